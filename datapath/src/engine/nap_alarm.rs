//! The alarm that ends the progress thread's naps next to a polling application, and that the
//! application postpones while it keeps polling.
//!
//! While an application polls its CQs it moves its own frames, and the progress thread naps;
//! it must wake now and then to see whether the application has left (then it takes over).
//! With a plain timeout those checks cost a wake-up each, about a thousand a second, and on
//! two cores each one takes the core of a spinning application for a few microseconds: that
//! was the p99 of every ping-pong (30-100 µs against raw AF_XDP's 8). Here the nap ends on a
//! timerfd instead. The thread's naps start short and double while the application stays in
//! its verbs loop; once they are as long as they get (the application has been polling for a
//! couple of milliseconds), the application pushes the alarm `POSTPONE_NS` ahead once every
//! `PUSH_EVERY_NS` from its own `poll_cq`: one system call per quarter millisecond on its own
//! time, and no wake-up at all. When it stops polling, the alarm fires at most `POSTPONE_NS`
//! later and the thread takes over, as soon as its longest nap allowed before. Where the
//! application, though still polling, is kept from its loop for longer than that (a one-vCPU
//! guest, whose kernel network work runs on the same CPU), every alarm that rings for nothing
//! doubles the postponement, up to `MAX_POSTPONE_NS`, until the thread next takes over.
//!
//! A push moves the alarm later. While it is the CPU's earliest timer, that leaves the CPU's
//! timer programmed for the old expiry, which then fires for nothing: a timer interrupt per
//! push, a trap to the hypervisor in a VM, which cost a ping-pong turn about 11 µs here (2-5 %
//! of 64 B turns, the whole p99). An application that keeps polling for `STEADY_PUSHES`
//! pushes is a steady poller (`ib_send_lat`, `ib_send_bw`, any CQ-polling loop), and its
//! postponement grows to `STEADY_POSTPONE_NS`: a 250 Hz kernel's tick period, so the
//! scheduler's tick comes first, a push costs no interrupt, and pushes come a quarter as
//! often. The thread taking over, or
//! the application coming back from elsewhere several times between two pushes, brings it
//! back to `POSTPONE_NS`: an application that works outside its verbs (`ib_write_lat` spins
//! on memory between its polls) keeps the 1 ms bound.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

/// How far ahead a push moves the alarm: the longest the thread waits to take over from an
/// application that stopped polling (its longest nap).
pub(crate) const POSTPONE_NS: u64 = 1_000_000;
/// How often a polling application pushes (a quarter of the postponement, which grows with
/// it: see `MAX_POSTPONE_NS`).
const PUSH_EVERY_NS: u64 = POSTPONE_NS / 4;
/// The longest postponement. An application that keeps polling can still be away from its
/// loop for longer than `POSTPONE_NS` when its CPU does other work: in a one-vCPU guest under
/// emulation, the kernel's own network work took that long every other turn of a ping-pong,
/// and each time the alarm woke the thread only to find the application back in its verbs
/// (about 0.6 wake-ups per turn, each preempting the application on its only CPU). Each such
/// wasted alarm doubles the postponement up to this; the thread taking over resets it.
const MAX_POSTPONE_NS: u64 = 8_000_000;
/// Pushes in a row (with no take-over between them) that make the application a steady
/// poller: 2 ms of polling at `PUSH_EVERY_NS`.
const STEADY_PUSHES: u32 = 8;
/// A steady poller's postponement: a 250 Hz kernel's tick period (4 ms), so the next tick
/// comes first, the alarm is not the CPU's earliest timer, and moving it costs no interrupt.
/// (Measured here: `timerfd_settime` 1.9 µs 1 ms ahead, 0.6 µs 4 ms ahead; 64 B ping-pong
/// turns over 12 µs 560-1100 in 20 000 with `POSTPONE_NS`, 80-170 with this.) An application
/// that stops polling after that is taken over up to this long after, unless a frame wakes
/// the thread first (see `FrameWatch` in `progress::sleep`).
const STEADY_POSTPONE_NS: u64 = 4_000_000;
/// Returns to the verbs from elsewhere between two pushes that mean the application is not a
/// steady poller (see `NapAlarm::app_left`).
const LEAVES_PER_PUSH: u32 = 4;

pub(crate) struct NapAlarm {
    fd: OwnedFd,
    /// The thread's naps are at their longest: the application has been in its verbs loop at
    /// every check for a while, and polls push the alarm. (During a short burst of polls, an
    /// event-driven application between two sleeps, the thread's short naps stay in charge
    /// and take over soon after the burst.)
    long_naps: AtomicBool,
    /// Engine time of the last push (0: none yet).
    pushed_at: AtomicU64,
    /// How far ahead a push moves the alarm now (`POSTPONE_NS` to `MAX_POSTPONE_NS`).
    postpone_ns: AtomicU64,
    /// Pushes since the thread last took over or the application last left its verbs (see
    /// `STEADY_PUSHES`).
    pushes: AtomicU32,
    /// The application is a steady poller: pushes postpone by at least `STEADY_POSTPONE_NS`.
    steady: AtomicBool,
    /// Engine time by which the alarm rings for ACKs a poll holds (0: none; see
    /// `ring_for_hold`). Pushes do not move the alarm past it.
    hold_due_at: AtomicU64,
    /// Times the application came back to its verbs from elsewhere since the last push.
    leaves: AtomicU32,
}

impl NapAlarm {
    pub(crate) fn new() -> io::Result<NapAlarm> {
        // SAFETY: timerfd_create takes plain flags; the result is checked below.
        let fd = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(NapAlarm {
            // SAFETY: `fd` is a fresh descriptor nobody else owns.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            long_naps: AtomicBool::new(false),
            pushed_at: AtomicU64::new(0),
            postpone_ns: AtomicU64::new(POSTPONE_NS),
            pushes: AtomicU32::new(0),
            steady: AtomicBool::new(false),
            hold_due_at: AtomicU64::new(0),
            leaves: AtomicU32::new(0),
        })
    }

    /// The thread naps `ns` (see `set`); `long`: its naps are at their longest, and polls
    /// may postpone this one.
    pub(crate) fn nap(&self, ns: u64, long: bool, now: u64) {
        self.long_naps.store(long, Ordering::Relaxed);
        self.set(self.until_hold(ns, now));
    }

    /// `ns` from `now`, or less to ring by the held ACKs' time (see `ring_for_hold`).
    fn until_hold(&self, ns: u64, now: u64) -> u64 {
        let hold_due_at = self.hold_due_at.load(Ordering::Relaxed);
        if hold_due_at > now {
            ns.min(hold_due_at - now)
        } else {
            ns
        }
    }

    /// The thread took over (or has nothing to nap for): polls stop pushing, and the next
    /// pushes postpone by `POSTPONE_NS` again.
    pub(crate) fn short_naps(&self) {
        self.long_naps.store(false, Ordering::Relaxed);
        self.postpone_ns.store(POSTPONE_NS, Ordering::Relaxed);
        self.pushes.store(0, Ordering::Relaxed);
        self.steady.store(false, Ordering::Relaxed);
    }

    /// The application comes back to its verbs after `APP_ACTIVE_NS` or more away. Once in
    /// a while that is an interrupt or a preemption (every millisecond or so in a ping-pong
    /// here); `LEAVES_PER_PUSH` times between two pushes, it is an application that works
    /// outside its verbs (`ib_write_lat` spins on memory for the peer's WRITE on every turn),
    /// and not a steady poller, whatever it pushed so far.
    pub(crate) fn app_left(&self) {
        if self.leaves.fetch_add(1, Ordering::Relaxed) + 1 >= LEAVES_PER_PUSH
            && (self.pushes.load(Ordering::Relaxed) != 0 || self.steady.load(Ordering::Relaxed))
        {
            self.pushes.store(0, Ordering::Relaxed);
            self.steady.store(false, Ordering::Relaxed);
        }
    }

    /// The application arms a CQ (`ibv_req_notify_cq`): it is about to wait for an event
    /// outside its verbs, and the frames that bring it may need the thread. A steady poller's
    /// alarm, pushed up to `STEADY_POSTPONE_NS` out, is brought back within `POSTPONE_NS`.
    pub(crate) fn app_waits(&self) {
        if self.steady.swap(false, Ordering::Relaxed) {
            self.pushes.store(0, Ordering::Relaxed);
            if self.long_naps.load(Ordering::Relaxed) {
                self.set(self.postpone_ns.load(Ordering::Relaxed));
            }
        }
    }

    /// How far ahead a push moves the alarm now.
    fn postponement(&self) -> u64 {
        let p = self.postpone_ns.load(Ordering::Relaxed);
        if self.steady.load(Ordering::Relaxed) {
            p.max(STEADY_POSTPONE_NS)
        } else {
            p
        }
    }

    /// A long nap ended on the alarm and the thread found the application still in its verbs
    /// loop: the pushes came too far apart. Doubles the postponement (see `MAX_POSTPONE_NS`).
    pub(crate) fn rang_for_nothing(&self) {
        self.postpone_ns.store(
            (self.postponement() * 2).min(MAX_POSTPONE_NS),
            Ordering::Relaxed,
        );
    }

    /// A poll at `now` holds ACKs that the progress thread must send by `at` if the
    /// application leaves them (see `LeftHolds` in the engine): while the thread's naps are
    /// long, the alarm rings by then, and pushes do not move it later. (Short naps end within
    /// a millisecond anyway.) A system call: only for holds of an application that left one
    /// before.
    pub(crate) fn ring_for_hold(&self, now: u64, at: u64) {
        if self.long_naps.load(Ordering::Relaxed) {
            self.hold_due_at.store(at, Ordering::Relaxed);
            self.set(at.saturating_sub(now));
        }
    }

    /// The alarm rang at `now`: whether it rang for held ACKs (see `ring_for_hold`), which is
    /// no sign of pushes coming too far apart. Forgets that hold.
    pub(crate) fn rang_for_hold(&self, now: u64) -> bool {
        let at = self.hold_due_at.load(Ordering::Relaxed);
        if at == 0 || now < at {
            return false;
        }
        self.hold_due_at.store(0, Ordering::Relaxed);
        true
    }

    /// Sets the alarm `ns` from now (at least 1 ns: zero would disarm it). Setting it also
    /// forgets an expiry nobody has read yet.
    fn set(&self, ns: u64) {
        let ns = ns.max(1);
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: (ns / 1_000_000_000) as libc::time_t,
                tv_nsec: (ns % 1_000_000_000) as libc::c_long,
            },
        };
        // SAFETY: a valid timerfd and itimerspec; the old value is not asked for. It cannot
        // fail with these arguments; if it did, the nap would end on its other events.
        unsafe { libc::timerfd_settime(self.fd.as_raw_fd(), 0, &spec, std::ptr::null_mut()) };
    }

    /// Reads an expiry, so that the descriptor stops polling readable.
    pub(crate) fn clear(&self) {
        super::read_counter(self.fd.as_raw_fd());
    }

    /// An application polled a CQ at `now` (engine time): postpones the alarm if the thread's
    /// naps are long and nobody pushed for `PUSH_EVERY_NS`.
    pub(crate) fn app_polled(&self, now: u64) {
        if let Some(at) = self.push_due(now) {
            // One thread pushes per interval, even when several poll.
            if self
                .pushed_at
                .compare_exchange(at, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
            {
                let ns = self.pushed();
                self.set(self.until_hold(ns, now));
            }
        }
    }

    /// Counts a push and returns how far ahead it moves the alarm (see `STEADY_PUSHES`).
    fn pushed(&self) -> u64 {
        self.leaves.store(0, Ordering::Relaxed);
        if self.pushes.fetch_add(1, Ordering::Relaxed) + 1 >= STEADY_PUSHES {
            self.steady.store(true, Ordering::Relaxed);
        }
        self.postponement()
    }

    /// `Some(last push time)` when a poll at `now` should push (see `app_polled`).
    fn push_due(&self, now: u64) -> Option<u64> {
        if !self.long_naps.load(Ordering::Relaxed) {
            return None;
        }
        let pushed = self.pushed_at.load(Ordering::Relaxed);
        let every = self.postponement() / (POSTPONE_NS / PUSH_EVERY_NS);
        (now.saturating_sub(pushed) >= every).then_some(pushed)
    }
}

impl AsRawFd for NapAlarm {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: u64 = 1_000;

    /// Polls `every` apart from `from` to `to`; returns the times they pushed.
    fn poll_run(alarm: &NapAlarm, from: u64, to: u64, every: u64) -> Vec<u64> {
        let mut pushes = Vec::new();
        let mut now = from;
        while now < to {
            if alarm.push_due(now).is_some() {
                alarm.pushed_at.store(now, Ordering::Relaxed);
                alarm.pushed();
                pushes.push(now);
            }
            now += every;
        }
        pushes
    }

    /// Polls push only while the thread's naps are long, then once per `PUSH_EVERY_NS`, each
    /// push well inside the alarm it replaces; they stop when the thread takes over.
    #[test]
    fn polls_push_at_a_steady_pace_only_while_naps_are_long() {
        let alarm = NapAlarm::new().expect("timerfd");
        let start = 10 * US;
        assert!(poll_run(&alarm, start, start + 2_000 * US, 5 * US).is_empty());
        alarm.nap(POSTPONE_NS, true, 0);
        let pushes = poll_run(&alarm, start + 2_000 * US, start + 4_000 * US, 5 * US);
        assert_eq!(pushes.len(), 8, "{pushes:?}");
        for pair in pushes.windows(2) {
            assert_eq!(pair[1] - pair[0], PUSH_EVERY_NS);
            assert!(pair[1] - pair[0] < POSTPONE_NS, "the alarm never runs out");
        }
        alarm.short_naps();
        assert!(poll_run(&alarm, start + 4_000 * US, start + 6_000 * US, 5 * US).is_empty());
        alarm.nap(10 * US, false, 0);
        assert!(poll_run(&alarm, start + 6_000 * US, start + 8_000 * US, 5 * US).is_empty());
    }

    /// Gaps between the pushes of polls every 5 µs over `[from, from + span)`.
    fn push_gaps(alarm: &NapAlarm, from: u64, span: u64) -> Vec<u64> {
        let pushes = poll_run(alarm, from, from + span, 5 * US);
        pushes.windows(2).map(|p| p[1] - p[0]).collect()
    }

    /// Alarms that ring for nothing stretch the postponement, and the pushes with it, up to
    /// the limit; the thread taking over brings both back.
    #[test]
    fn wasted_alarms_stretch_the_postponement_until_the_thread_takes_over() {
        let alarm = NapAlarm::new().expect("timerfd");
        alarm.nap(POSTPONE_NS, true, 0);
        alarm.rang_for_nothing();
        assert_eq!(alarm.postpone_ns.load(Ordering::Relaxed), 2 * POSTPONE_NS);
        // Three pushes: too few to make the application a steady poller.
        assert_eq!(
            push_gaps(&alarm, 10 * US, 1_600 * US),
            [2 * PUSH_EVERY_NS, 2 * PUSH_EVERY_NS]
        );
        for _ in 0..10 {
            alarm.rang_for_nothing();
        }
        assert_eq!(alarm.postpone_ns.load(Ordering::Relaxed), MAX_POSTPONE_NS);
        let every = MAX_POSTPONE_NS / 4;
        let gaps = push_gaps(&alarm, 10_000 * US, 40_000 * US);
        assert!(
            !gaps.is_empty() && gaps.iter().all(|g| *g == every),
            "{gaps:?}"
        );
        assert!(
            every < MAX_POSTPONE_NS,
            "each push lands well inside the alarm it replaces"
        );
        alarm.short_naps();
        assert_eq!(alarm.postpone_ns.load(Ordering::Relaxed), POSTPONE_NS);
    }

    /// After `STEADY_PUSHES` pushes in a row the postponement is `STEADY_POSTPONE_NS` and
    /// the pushes a quarter of it apart; the thread taking over ends that, and alarms that
    /// ring for nothing still stretch it.
    #[test]
    fn a_steady_poller_pushes_the_alarm_past_the_tick_and_less_often() {
        let alarm = NapAlarm::new().expect("timerfd");
        alarm.nap(POSTPONE_NS, true, 0);
        let gaps = push_gaps(&alarm, 10 * US, 20_000 * US);
        let steady = STEADY_PUSHES as usize;
        assert!(gaps.len() > steady, "{gaps:?}");
        assert!(
            gaps[..steady - 1].iter().all(|g| *g == PUSH_EVERY_NS),
            "{gaps:?}"
        );
        assert!(
            gaps[steady - 1..]
                .iter()
                .all(|g| *g == STEADY_POSTPONE_NS / 4),
            "{gaps:?}"
        );
        assert_eq!(alarm.postponement(), STEADY_POSTPONE_NS);
        const {
            assert!(
                STEADY_POSTPONE_NS >= 1_000_000_000 / 250,
                "at least a 250 Hz kernel's tick period"
            )
        };

        // The thread took over: the application must prove itself a steady poller again.
        alarm.short_naps();
        alarm.nap(POSTPONE_NS, true, 0);
        let gaps = push_gaps(&alarm, 30_000 * US, 1_900 * US);
        assert!(gaps.iter().all(|g| *g == PUSH_EVERY_NS), "{gaps:?}");

        // So must one that arms a CQ to wait for its event.
        push_gaps(&alarm, 35_000 * US, 4_000 * US);
        assert_eq!(alarm.postponement(), STEADY_POSTPONE_NS);
        alarm.app_waits();
        assert_eq!(alarm.postponement(), POSTPONE_NS);

        // An application that comes back from elsewhere must too.
        push_gaps(&alarm, 40_000 * US, 20_000 * US);
        assert_eq!(alarm.postponement(), STEADY_POSTPONE_NS);
        for _ in 1..LEAVES_PER_PUSH {
            alarm.app_left();
        }
        assert_eq!(
            alarm.postponement(),
            STEADY_POSTPONE_NS,
            "an interrupt now and then is not leaving"
        );
        alarm.app_left();
        assert_eq!(alarm.postponement(), POSTPONE_NS);
        let gaps = push_gaps(&alarm, 60_000 * US, 1_900 * US);
        assert!(gaps.iter().all(|g| *g == PUSH_EVERY_NS), "{gaps:?}");

        push_gaps(&alarm, 70_000 * US, 20_000 * US);
        alarm.rang_for_nothing();
        assert_eq!(
            alarm.postponement(),
            MAX_POSTPONE_NS.min(2 * STEADY_POSTPONE_NS)
        );
        // Leaving resets the steadiness, not the stretch the wasted alarm asked for.
        for _ in 0..LEAVES_PER_PUSH {
            alarm.app_left();
        }
        assert_eq!(
            alarm.postponement(),
            MAX_POSTPONE_NS.min(2 * STEADY_POSTPONE_NS)
        );
    }

    /// Whether the alarm polls readable within `timeout_ms`.
    fn readable(alarm: &NapAlarm, timeout_ms: i32) -> bool {
        let mut p = libc::pollfd {
            fd: alarm.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut p, 1, timeout_ms) == 1 }
    }

    /// The alarm polls readable once it expires, setting it forgets an unread expiry, and
    /// `clear` reads one.
    #[test]
    fn the_alarm_fires_and_setting_it_forgets_an_unread_expiry() {
        let alarm = NapAlarm::new().expect("timerfd");
        let readable = |timeout_ms| readable(&alarm, timeout_ms);
        assert!(!readable(0), "not armed yet");
        alarm.nap(1_000, false, 0);
        assert!(readable(1_000), "fires");
        alarm.nap(10_000_000_000, true, 0);
        assert!(!readable(0), "setting it again forgot the expiry");
        alarm.nap(1_000, false, 0);
        assert!(readable(1_000));
        alarm.clear();
        assert!(!readable(0), "read");
    }

    /// A hold on trial makes a long nap's alarm ring by its time: pushes and later naps do
    /// not move it past that, the ring is told apart from one that came for nothing, and
    /// once it rang the alarm is the thread's own again.
    #[test]
    fn an_alarm_for_held_acks_is_not_postponed_past_them() {
        let alarm = NapAlarm::new().expect("timerfd");
        let readable = |timeout_ms| readable(&alarm, timeout_ms);
        let now = 1_000 * US;
        alarm.nap(10_000_000_000, false, now);
        alarm.ring_for_hold(now, now + 300 * US);
        assert_eq!(
            alarm.hold_due_at.load(Ordering::Relaxed),
            0,
            "short naps end soon anyway"
        );
        alarm.nap(10_000_000_000, true, now);
        alarm.ring_for_hold(now, now + 300 * US);
        assert_eq!(
            alarm.until_hold(STEADY_POSTPONE_NS, now + 100 * US),
            200 * US
        );
        assert_eq!(alarm.until_hold(50 * US, now + 100 * US), 50 * US);
        // A nap the thread starts meanwhile (10 s here) still rings for the hold.
        alarm.nap(10_000_000_000, true, now);
        assert!(readable(1_000), "rang for the hold");
        assert!(
            !alarm.rang_for_hold(now + 299 * US),
            "not due yet at that time"
        );
        assert!(alarm.rang_for_hold(now + 300 * US));
        assert!(!alarm.rang_for_hold(now + 400 * US), "told once");
        assert_eq!(
            alarm.until_hold(STEADY_POSTPONE_NS, now + 400 * US),
            STEADY_POSTPONE_NS
        );
    }
}
