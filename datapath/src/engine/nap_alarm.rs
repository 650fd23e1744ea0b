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

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

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
        })
    }

    /// The thread naps `ns` (see `set`); `long`: its naps are at their longest, and polls
    /// may postpone this one.
    pub(crate) fn nap(&self, ns: u64, long: bool) {
        self.long_naps.store(long, Ordering::Relaxed);
        self.set(ns);
    }

    /// The thread took over (or has nothing to nap for): polls stop pushing, and the next
    /// pushes postpone by `POSTPONE_NS` again.
    pub(crate) fn short_naps(&self) {
        self.long_naps.store(false, Ordering::Relaxed);
        self.postpone_ns.store(POSTPONE_NS, Ordering::Relaxed);
    }

    /// A long nap ended on the alarm and the thread found the application still in its verbs
    /// loop: the pushes came too far apart. Doubles the postponement (see `MAX_POSTPONE_NS`).
    pub(crate) fn rang_for_nothing(&self) {
        let p = self.postpone_ns.load(Ordering::Relaxed);
        self.postpone_ns
            .store((p * 2).min(MAX_POSTPONE_NS), Ordering::Relaxed);
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
                self.set(self.postpone_ns.load(Ordering::Relaxed));
            }
        }
    }

    /// `Some(last push time)` when a poll at `now` should push (see `app_polled`).
    fn push_due(&self, now: u64) -> Option<u64> {
        if !self.long_naps.load(Ordering::Relaxed) {
            return None;
        }
        let pushed = self.pushed_at.load(Ordering::Relaxed);
        let every = self.postpone_ns.load(Ordering::Relaxed) / (POSTPONE_NS / PUSH_EVERY_NS);
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
        alarm.nap(POSTPONE_NS, true);
        let pushes = poll_run(&alarm, start + 2_000 * US, start + 4_000 * US, 5 * US);
        assert_eq!(pushes.len(), 8, "{pushes:?}");
        for pair in pushes.windows(2) {
            assert_eq!(pair[1] - pair[0], PUSH_EVERY_NS);
            assert!(pair[1] - pair[0] < POSTPONE_NS, "the alarm never runs out");
        }
        alarm.short_naps();
        assert!(poll_run(&alarm, start + 4_000 * US, start + 6_000 * US, 5 * US).is_empty());
        alarm.nap(10 * US, false);
        assert!(poll_run(&alarm, start + 6_000 * US, start + 8_000 * US, 5 * US).is_empty());
    }

    /// Alarms that ring for nothing stretch the postponement, and the pushes with it, up to
    /// the limit; the thread taking over brings both back.
    #[test]
    fn wasted_alarms_stretch_the_postponement_until_the_thread_takes_over() {
        let alarm = NapAlarm::new().expect("timerfd");
        alarm.nap(POSTPONE_NS, true);
        let gaps = |alarm: &NapAlarm, from: u64| {
            let pushes = poll_run(alarm, from, from + 40_000 * US, 5 * US);
            pushes.windows(2).map(|p| p[1] - p[0]).max()
        };
        assert_eq!(gaps(&alarm, 10 * US), Some(PUSH_EVERY_NS));
        alarm.rang_for_nothing();
        assert_eq!(alarm.postpone_ns.load(Ordering::Relaxed), 2 * POSTPONE_NS);
        assert_eq!(gaps(&alarm, 50_000 * US), Some(2 * PUSH_EVERY_NS));
        for _ in 0..10 {
            alarm.rang_for_nothing();
        }
        assert_eq!(alarm.postpone_ns.load(Ordering::Relaxed), MAX_POSTPONE_NS);
        let every = MAX_POSTPONE_NS / 4;
        assert_eq!(gaps(&alarm, 100_000 * US), Some(every));
        assert!(
            every < MAX_POSTPONE_NS,
            "each push lands well inside the alarm it replaces"
        );
        alarm.short_naps();
        assert_eq!(alarm.postpone_ns.load(Ordering::Relaxed), POSTPONE_NS);
    }

    /// The alarm polls readable once it expires, setting it forgets an unread expiry, and
    /// `clear` reads one.
    #[test]
    fn the_alarm_fires_and_setting_it_forgets_an_unread_expiry() {
        let alarm = NapAlarm::new().expect("timerfd");
        let readable = |timeout_ms| {
            let mut p = libc::pollfd {
                fd: alarm.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut p, 1, timeout_ms) == 1 }
        };
        assert!(!readable(0), "not armed yet");
        alarm.nap(1_000, false);
        assert!(readable(1_000), "fires");
        alarm.nap(10_000_000_000, true);
        assert!(!readable(0), "setting it again forgot the expiry");
        alarm.nap(1_000, false);
        assert!(readable(1_000));
        alarm.clear();
        assert!(!readable(0), "read");
    }
}
