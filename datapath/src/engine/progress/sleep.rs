//! How the progress thread sleeps and what wakes it: its naps next to an application in its
//! verbs loop (ended by the nap alarm, and by frames while watching for them pays), its
//! real-time priority while asleep, and its other sleeps (until an event, or at most so long).

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::Ordering;

use super::{earliest, Watchers, APP_ACTIVE_NS, MAX_NAP_NS, WASTED_FRAME_WAKES};
use crate::engine::ack_holds::Deferred;
use crate::engine::Shared;

/// Whether the progress thread's naps (taken while the application is in its verbs loop) also
/// end when a frame arrives.
///
/// An application that polls its CQs takes its frames itself, and a nap woken by each of them
/// takes the core that application needs (two cores, two spinning peers): naps then end only
/// on their timer. But an application may leave its verbs loop right after a completion and
/// spin on memory (`ib_write_lat` waits for the peer's WRITE to land in its buffer). Nobody
/// takes the WRITE then until this thread's nap ends, which made `ib_write_lat` 40-55 µs
/// one-way against 5-8 µs for `ib_send_lat`. So naps watch for frames as long as watching
/// pays: it stops after `WASTED_FRAME_WAKES` naps in a row were cut short by frames the
/// application was there to take, and starts again when this thread, taking over from a
/// quiet application, finds work that had waited for it.
#[derive(Debug)]
pub(super) struct FrameWatch {
    watching: bool,
    /// Naps in a row cut short by frames the application then took.
    wasted: u32,
    /// Frames are known to wait in the socket for an application that is still in a verb:
    /// watching them would end every nap at once.
    waiting: bool,
}

impl Default for FrameWatch {
    fn default() -> Self {
        FrameWatch {
            watching: true,
            wasted: 0,
            waiting: false,
        }
    }
}

impl FrameWatch {
    /// The next nap ends when a frame arrives.
    pub(super) fn watching(&self) -> bool {
        self.watching && !self.waiting
    }

    /// A frame ended a nap while the application was in its verbs loop, and a moment later
    /// frames are (`waiting`) or are not in the socket: not, and the application took them.
    pub(super) fn after_grace(&mut self, waiting: bool) {
        self.waiting = waiting;
        if waiting {
            return;
        }
        self.wasted += 1;
        if self.wasted >= WASTED_FRAME_WAKES {
            self.watching = false;
        }
    }

    /// This thread ran a round of progress (the application was quiet); `work`: it found
    /// something to do, which had waited for it.
    pub(super) fn took_a_round(&mut self, work: bool) {
        self.waiting = false;
        if work {
            self.watching = true;
            self.wasted = 0;
        }
    }
}

/// The application is in its verbs loop: a thread is inside a verb, or one left less than
/// `APP_ACTIVE_NS` ago.
pub(super) fn app_busy(shared: &Shared, now: u64) -> bool {
    let active_ns = shared.app_active_at.load(Ordering::Relaxed);
    shared.app_in_verbs.load(Ordering::SeqCst) > 0
        || (active_ns != 0 && now.saturating_sub(active_ns) < APP_ACTIVE_NS)
}

/// The progress thread sleeps with real-time priority (`SCHED_FIFO` 1) and works with normal
/// priority. An application that spins on memory (ib_write_lat waits for the peer's WRITE to
/// land in its buffer) holds its core without a break, and on two cores both do: a woken
/// thread of normal priority then waits for the scheduler's tick (milliseconds) before it
/// can receive the frame the application waits for. Woken at real-time priority it runs at
/// once, and it keeps that priority for the round of progress it was woken for (a round is
/// bounded: one receive batch, one transmit batch); dropping to normal priority before that
/// round let the spinning application take the core back in the middle of it.
///
/// It also keeps it through the next round if that one finds nothing to do, and into the
/// sleep after: dropping priority between the two left the thread runnable at normal priority
/// behind the spinning application, which then held the core until the scheduler's next
/// tick, with the thread neither asleep (frames did not wake it) nor running: waits of 1-2 ms
/// in `ib_write_lat`, and two `sched_setscheduler` calls per wake-up. A second round that
/// finds work, or a spin, drops to normal priority (`settle`), so the thread never holds a
/// core at real-time priority for longer than a wake-up and two rounds, and a bug cannot turn
/// it into a spinning real-time thread. Without the privilege (CAP_SYS_NICE) or with
/// `XROCE_PROGRESS_RT=0` it sleeps at normal priority.
pub(super) struct WakePriority {
    enabled: bool,
    /// The thread runs at real-time priority now.
    raised: bool,
    /// A round since the wake-up found work.
    worked: bool,
}

impl WakePriority {
    pub(super) fn new() -> Self {
        let wanted = std::env::var_os("XROCE_PROGRESS_RT").is_none_or(|v| v != "0");
        let mut p = WakePriority {
            enabled: wanted,
            raised: false,
            worked: false,
        };
        // Find out now whether the switch is allowed, so that it is not tried per sleep.
        if p.enabled && !p.set(libc::SCHED_FIFO) {
            p.enabled = false;
        }
        p.set(libc::SCHED_OTHER);
        p
    }

    fn set(&self, policy: libc::c_int) -> bool {
        let param = libc::sched_param {
            sched_priority: if policy == libc::SCHED_FIFO { 1 } else { 0 },
        };
        // SAFETY: sched_setscheduler on the calling thread (pid 0) with a valid parameter.
        unsafe { libc::sched_setscheduler(0, policy, &param) == 0 }
    }

    /// Sleeps at real-time priority and stays there for the round after (see `round_done`).
    pub(super) fn sleep<R>(&mut self, sleep: impl FnOnce() -> R) -> R {
        if self.enabled && !self.raised {
            self.set(libc::SCHED_FIFO);
            self.raised = true;
        }
        self.worked = false;
        sleep()
    }

    /// A round of progress is done; `work`: it found something to do. The second round
    /// with work since the wake-up drops to normal priority, unless the thread is waiting
    /// for the rest of a message (`waiting_for_message`, itself bounded in time).
    pub(super) fn round_done(&mut self, work: bool, waiting_for_message: bool) {
        if work && !waiting_for_message {
            if self.worked {
                self.settle();
            }
            self.worked = true;
        }
    }

    /// Back to normal priority.
    pub(super) fn settle(&mut self) {
        if self.raised {
            self.set(libc::SCHED_OTHER);
            self.raised = false;
        }
    }
}

/// What ended a [`sleep`] (besides a kick or a timeout).
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Woke {
    /// The address watcher has something to read.
    pub(super) addresses: bool,
    /// Frames are waiting in the socket (only when `sleep` watched it).
    pub(super) frames: bool,
    /// The nap alarm rang.
    pub(super) alarm: bool,
}

/// How long a [`sleep`] may last besides its events (a kick, an address change, a frame when
/// watched, the next transport timer).
#[derive(Debug, Clone, Copy)]
pub(super) enum Wait {
    /// At most this long.
    AtMost(u64),
    /// A nap next to an application in its verbs loop: this long on the nap alarm, which the
    /// application postpones while it keeps polling (see `nap_alarm`).
    Nap(u64),
    /// Until an event.
    Events,
}

/// How long a [`sleep`] may last for the transport's timers and the ACKs held for an answer,
/// `due_in` from now (0: already due).
///
/// A nap is taken while the application is in its verbs, and what is due then is the
/// application's to run: its polls run the timers and send held ACKs. Ending the nap at once
/// for it made this thread loop, at real-time priority, on the core the application needed to
/// get back to its verbs: an application blocked for the engine lock meanwhile, or preempted
/// inside a verb, stayed off its core for 50-500 ms, until the kernel's throttling of
/// real-time threads let it run (64 KiB `ib_write_lat`: retransmission timeouts with nothing
/// lost). So what is due does not shorten a nap, which runs its course; other sleeps end at
/// once, and the round after them runs it.
fn timer_wait(wait: Wait, due_in: Option<u64>) -> Option<u64> {
    due_in.filter(|&ns| ns > 0 || !matches!(wait, Wait::Nap(_)))
}

/// Sleeps until the application kicks, an address changes, a frame arrives (when `frames`
/// names the socket), the next transport timer is due, or `wait` says.
pub(super) fn sleep(
    shared: &Shared,
    frames: Option<RawFd>,
    watchers: &Watchers,
    wait: Wait,
) -> Woke {
    shared.sleeping.store(true, Ordering::SeqCst);
    // Work queued between our last look and `sleeping` being visible must not be slept through.
    if shared.kick.swap(false, Ordering::SeqCst) || shared.stop.load(Ordering::SeqCst) {
        shared.sleeping.store(false, Ordering::SeqCst);
        return Woke::default();
    }
    // Never wait for the lock here: its holder is an application inside a verb, which would
    // then pay a futex wake-up (a system call, and an interrupt of the other core) on its way
    // out, once per nap of this thread; in a stream that was 4 % of the sender's core. The
    // holder runs the timers itself meanwhile, so a nap bounded by `MAX_NAP_NS` misses none
    // by more than that.
    // ACKs held for the application's answer (see `super::thread_round`) count as a timer.
    let timer_ns = match shared.try_state() {
        Some(st) => {
            let held = match st.deferred {
                Deferred::AcksUntil { until, .. } => Some(until),
                _ => None,
            };
            let due = earliest(st.dev.poll_timeout(), held);
            let now = shared.now();
            let timer_ns = timer_wait(wait, due.map(|t| t.saturating_sub(now)));
            // Noted under the lock: a timer an application thread arms after this (a send
            // from its own thread, then a wait on its completion channel) is earlier than
            // this sleep's end, and the application wakes the thread for it. A nap ends soon
            // anyway, and the application next to it runs the timers in its polls.
            let until = match wait {
                Wait::Nap(_) => 0,
                Wait::AtMost(ns) => now.saturating_add(earliest(timer_ns, Some(ns)).unwrap_or(ns)),
                Wait::Events => timer_ns.map_or(u64::MAX, |ns| now.saturating_add(ns)),
            };
            shared.sleep_until.store(until, Ordering::SeqCst);
            timer_ns
        }
        None => Some(MAX_NAP_NS),
    };
    let at_most_ns = match wait {
        Wait::AtMost(ns) | Wait::Nap(ns) => Some(ns),
        Wait::Events => None,
    };
    let mut timeout_ns = earliest(timer_ns, at_most_ns);
    // A nap ends on the alarm instead, which a polling application postpones once the naps
    // are as long as they get.
    let mut alarm_fd = -1;
    if matches!(wait, Wait::Nap(_)) {
        if let Some(ns) = timeout_ns.take() {
            shared.nap_alarm.nap(ns, ns >= MAX_NAP_NS, shared.now());
            alarm_fd = shared.nap_alarm.as_raw_fd();
        }
    }
    // (A negative descriptor is skipped by ppoll.)
    let mut fds = [
        pollfd(shared.wake.as_raw_fd()),
        pollfd(watchers.addresses.as_raw_fd()),
        pollfd(frames.unwrap_or(-1)),
        pollfd(alarm_fd),
        pollfd(watchers.pins.as_ref().map_or(-1, |p| p.as_raw_fd())),
    ];
    let nfds = fds.len() as libc::nfds_t;
    let ts = timeout_ns.map(|ns| libc::timespec {
        tv_sec: (ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (ns % 1_000_000_000) as libc::c_long,
    });
    let ts_ptr = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: `fds` holds at least `nfds` valid pollfds and `ts_ptr` is null or points at a
    // timespec that lives across the call; no signal mask is changed.
    unsafe { libc::ppoll(fds.as_mut_ptr(), nfds, ts_ptr, std::ptr::null()) };
    shared.sleep_until.store(0, Ordering::SeqCst);
    shared.sleeping.store(false, Ordering::SeqCst);
    shared.kick.store(false, Ordering::SeqCst);
    if fds[3].revents != 0 {
        shared.nap_alarm.clear();
    }
    if fds[0].revents != 0 {
        crate::engine::read_counter(shared.wake.as_raw_fd());
    }
    let woke_by_frames = frames.is_some() && fds[2].revents != 0;
    if woke_by_frames {
        shared
            .counters
            .frame_wakeups
            .fetch_add(1, Ordering::Relaxed);
    }
    Woke {
        addresses: fds[1].revents != 0 || fds[4].revents != 0,
        frames: woke_by_frames,
        alarm: fds[3].revents != 0,
    }
}

/// Frames are waiting in the socket's receive ring (it polls readable).
pub(super) fn frames_waiting(fd: RawFd) -> bool {
    let mut p = pollfd(fd);
    // SAFETY: one valid pollfd, no timeout.
    unsafe { libc::poll(&mut p, 1, 0) > 0 && p.revents & libc::POLLIN != 0 }
}

fn pollfd(fd: RawFd) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nap_is_not_cut_short_by_what_is_already_due() {
        assert_eq!(timer_wait(Wait::Nap(1_000_000), Some(0)), None);
        assert_eq!(timer_wait(Wait::Nap(1_000_000), Some(5_000)), Some(5_000));
        assert_eq!(timer_wait(Wait::Nap(1_000_000), None), None);
        // Other sleeps are followed by a round that runs what is due.
        assert_eq!(timer_wait(Wait::AtMost(3_000), Some(0)), Some(0));
        assert_eq!(timer_wait(Wait::Events, Some(0)), Some(0));
        assert_eq!(timer_wait(Wait::Events, Some(7)), Some(7));
    }

    /// An application that polls: frames that cut naps short are taken by it, and after
    /// `WASTED_FRAME_WAKES` such naps in a row the naps stop watching for frames.
    #[test]
    fn frame_watch_stops_next_to_a_polling_application() {
        let mut w = FrameWatch::default();
        for _ in 0..WASTED_FRAME_WAKES - 1 {
            assert!(w.watching());
            w.after_grace(false);
        }
        assert!(w.watching());
        w.after_grace(false);
        assert!(!w.watching());
        // Rounds with nothing to do (the application took everything) change nothing.
        w.took_a_round(false);
        assert!(!w.watching());
    }

    /// An application that left for memory: the frames waited for this thread, which
    /// watches again (and counts the wasted wake-ups from zero).
    #[test]
    fn frame_watch_resumes_when_frames_waited_for_the_thread() {
        let mut w = FrameWatch::default();
        for _ in 0..WASTED_FRAME_WAKES {
            w.after_grace(false);
        }
        assert!(!w.watching());
        w.took_a_round(true);
        assert!(w.watching());
        for _ in 0..WASTED_FRAME_WAKES - 1 {
            w.after_grace(false);
        }
        assert!(w.watching(), "the count starts again after work");
    }

    /// Frames still waiting after the grace (the application is inside some other verb):
    /// naps stop watching them until this thread runs a round, or every nap would end at
    /// once; that is not a wasted wake-up.
    #[test]
    fn frame_watch_ignores_frames_known_to_wait() {
        let mut w = FrameWatch::default();
        w.after_grace(true);
        assert!(!w.watching());
        assert_eq!(w.wasted, 0);
        w.took_a_round(false);
        assert!(w.watching());
    }
}
