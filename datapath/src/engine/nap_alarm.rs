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
//! later and the thread takes over, as soon as its longest nap allowed before.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// How far ahead a push moves the alarm: the longest the thread waits to take over from an
/// application that stopped polling (its longest nap).
pub(crate) const POSTPONE_NS: u64 = 1_000_000;
/// How often a polling application pushes.
const PUSH_EVERY_NS: u64 = 250_000;

pub(crate) struct NapAlarm {
    fd: OwnedFd,
    /// The thread's naps are at their longest: the application has been in its verbs loop at
    /// every check for a while, and polls push the alarm. (During a short burst of polls, an
    /// event-driven application between two sleeps, the thread's short naps stay in charge
    /// and take over soon after the burst.)
    long_naps: AtomicBool,
    /// Engine time of the last push (0: none yet).
    pushed_at: AtomicU64,
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
        })
    }

    /// The thread naps `ns` (see `set`); `long`: its naps are at their longest, and polls
    /// may postpone this one.
    pub(crate) fn nap(&self, ns: u64, long: bool) {
        self.long_naps.store(long, Ordering::Relaxed);
        self.set(ns);
    }

    /// The thread took over (or has nothing to nap for): polls stop pushing.
    pub(crate) fn short_naps(&self) {
        self.long_naps.store(false, Ordering::Relaxed);
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
                self.set(POSTPONE_NS);
            }
        }
    }

    /// `Some(last push time)` when a poll at `now` should push (see `app_polled`).
    fn push_due(&self, now: u64) -> Option<u64> {
        if !self.long_naps.load(Ordering::Relaxed) {
            return None;
        }
        let pushed = self.pushed_at.load(Ordering::Relaxed);
        (now.saturating_sub(pushed) >= PUSH_EVERY_NS).then_some(pushed)
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
