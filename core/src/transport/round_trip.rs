//! How long an RC requester's packets take to be acknowledged, and from that how long it waits
//! in silence before its tail-loss probe.
//!
//! A tail-loss probe (see [`tail_probe_ns`](super::qp_state::tail_probe_ns)) waited 4 ms
//! whatever the path: far above the 10-30 µs a packet takes to be acknowledged between two
//! namespaces, so on a lossy path of that kind a lost last packet of a ping-pong's turn cost
//! 4 ms, and those stalls made up most of the average latency (`ib_send_lat` 64 B with 1 % of
//! the frames dropped each way: 89 µs on average, typical 6 µs). Between TCG guests, where a
//! guest goes quiet for milliseconds now and then, 4 ms is about right.
//!
//! So the delay follows the measured time to an ACK, as TCP's retransmission timer follows the
//! round trip (RFC 6298): a smoothed time and its mean deviation, updated from one packet that
//! asks for an ACK at a time (never a resent one, whose ACK could answer either copy), and
//! the probe waits twice the smoothed time and four deviations, at least [`MIN_PROBE_NS`] and
//! at most a quarter of the retransmission timeout (the longest a probe may wait, see
//! `probe_ceiling_ns`). A probe ends the measurement under way (the packet may go again), and
//! each further probe waits twice as long, up to that bound; that doubling is kept across
//! stalls until a packet is timed again, as TCP keeps a backed-off timer (RFC 6298, 5.7), so
//! a path that slowed down past the probe's delay is learnt instead of probed for on every
//! turn. The ACKs measured include what the responder held them for (its application's
//! answer, up to 50 µs), so a peer that holds its ACKs is not probed for that.
//!
//! The delay used to stop at [`TAIL_PROBE_NS`] (4 ms). On a path whose ACKs take longer than
//! that (TCG guests now and then, a tunnel between two sites) every other packet asking for an
//! ACK was probed for, for good: the ACK came after the probe, which ended the measurement and
//! doubled the delay; the next packet, timed under the doubled delay, ended the doubling and
//! brought the delay back under the path's time. Now a steady path whose ACKs come within a
//! quarter of the timer (16.8 ms at `timeout` 14) is learnt and left alone, with twice its
//! time to spare up to an eighth (8.4 ms), and only a stall longer than that is probed for.

use super::qp_state::TAIL_PROBE_NS;
use super::Nanos;

/// The shortest probe delay: the progress thread's longest nap (1 ms), so that a probe
/// deadline which every packet asking for an ACK restarts never shortens its naps, and far
/// above what a responder holds its ACKs for.
pub const MIN_PROBE_NS: u64 = 1_000_000;

/// The smoothed time from a packet asking for an ACK to that ACK, and its mean deviation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RoundTrip {
    smoothed: Option<Nanos>,
    deviation: Nanos,
}

impl RoundTrip {
    /// One measurement (RFC 6298's gains: an eighth for the time, a quarter for the
    /// deviation).
    pub fn sample(&mut self, rtt: Nanos) {
        match self.smoothed {
            None => {
                self.smoothed = Some(rtt);
                self.deviation = rtt / 2;
            }
            Some(s) => {
                self.deviation = (3 * self.deviation + s.abs_diff(rtt)) / 4;
                self.smoothed = Some((7 * s + rtt) / 8);
            }
        }
    }

    /// The smoothed time, once anything was measured.
    pub fn smoothed(&self) -> Option<Nanos> {
        self.smoothed
    }

    /// How long the requester goes without hearing anything before its first probe:
    /// [`TAIL_PROBE_NS`] until a packet was measured, then twice the smoothed time and four
    /// deviations, at least [`MIN_PROBE_NS`] and at most `ceiling` (the QP's longest probe
    /// delay, a quarter of its retransmission timeout; taken as [`TAIL_PROBE_NS`] where it is
    /// shorter, as when the QP does not probe at all).
    pub fn probe_delay(&self, ceiling: Nanos) -> Nanos {
        let ceiling = ceiling.max(TAIL_PROBE_NS);
        self.smoothed.map_or(TAIL_PROBE_NS, |s| {
            s.saturating_mul(2)
                .saturating_add(self.deviation.saturating_mul(4))
                .clamp(MIN_PROBE_NS, ceiling)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ceiling at `timeout` 14: a quarter of 67.1 ms.
    const AT_14: Nanos = 16_777_216;

    #[test]
    fn the_ceiling_at_timeout_14_is_a_quarter_of_its_timer() {
        assert_eq!(super::super::qp_state::probe_ceiling_ns(14), AT_14);
    }

    #[test]
    fn the_probe_waits_4_ms_until_a_round_trip_was_measured() {
        assert_eq!(RoundTrip::default().probe_delay(AT_14), TAIL_PROBE_NS);
    }

    /// Namespaces on one host: ACKs in 10-30 µs, the probe at its floor.
    #[test]
    fn a_fast_path_is_probed_after_the_shortest_delay() {
        let mut rt = RoundTrip::default();
        for rtt in [12_000, 30_000, 9_000, 15_000] {
            rt.sample(rtt);
        }
        assert!(rt.smoothed().is_some_and(|s| (9_000..30_000).contains(&s)));
        assert_eq!(rt.probe_delay(AT_14), MIN_PROBE_NS);
    }

    /// TCG guests: ACKs in about half a millisecond, now and then several: the probe waits
    /// for their deviation (beyond the 4 ms it started from), and comes down again when the
    /// path steadies (at 0.7 ms, to about twice that).
    #[test]
    fn a_slow_jittery_path_is_probed_later() {
        let mut rt = RoundTrip::default();
        for rtt in [400_000, 3_000_000, 500_000, 2_500_000, 450_000] {
            rt.sample(rtt);
        }
        let d = rt.probe_delay(AT_14);
        assert!((TAIL_PROBE_NS + 1..AT_14).contains(&d), "{d}");
        for _ in 0..40 {
            rt.sample(700_000);
        }
        let d = rt.probe_delay(AT_14);
        assert!((2 * 700_000..2 * 700_000 + 100_000).contains(&d), "{d}");
    }

    /// A steady 10 ms path (a tunnel between two sites): the probe waits past the ACKs, up to
    /// its ceiling; with a ceiling under 4 ms (a QP that does not probe) it says 4 ms.
    #[test]
    fn a_path_slower_than_4_ms_is_probed_after_its_own_time() {
        let mut rt = RoundTrip::default();
        for _ in 0..20 {
            rt.sample(10_000_000);
        }
        assert_eq!(rt.probe_delay(AT_14), AT_14);
        let d = rt.probe_delay(100 * AT_14);
        assert!((20_000_000..20_100_000).contains(&d), "{d}");
        assert_eq!(rt.probe_delay(1_000), TAIL_PROBE_NS);
    }

    #[test]
    fn smoothing_follows_rfc_6298() {
        let mut rt = RoundTrip::default();
        rt.sample(800);
        assert_eq!((rt.smoothed(), rt.deviation), (Some(800), 400));
        rt.sample(1600);
        // deviation 3/4 · 400 + 1/4 · 800; time 7/8 · 800 + 1/8 · 1600.
        assert_eq!((rt.smoothed(), rt.deviation), (Some(900), 500));
    }
}
