//! How long `poll_cq` holds the ACK for a ping-pong's message while this side waits for the
//! ACK of its own (see `Engine::poll_cq` and `ANSWER_HOLD_NS`).
//!
//! The peer's kick carries its message and, behind it, the ACK this side waits for. On a veth
//! pair the ACK lands a kernel pass (a few µs) behind the message, and `ANSWER_HOLD_NS` covers
//! that many times over. Under emulation (QEMU's TCG) each frame of a kick is a notification
//! of the emulated device of its own, and the ACK comes 30-200 µs behind: a fixed 50 µs hold ran
//! out on about one turn in twenty, three of those in a row switched answer holds off for
//! 10 ms, and meanwhile every turn sent its ACK alone, a second kick on each side. So the hold
//! follows what it sees, as a retransmission timer follows round trips: a hold that ran out is
//! doubled for the next one, up to `MAX_NS`; a hold whose ACK came moves an eighth of the way
//! down towards four times that ACK's lateness, never below `ANSWER_HOLD_NS`. Where ACKs come
//! within a few µs, as on the host, the hold stays at `ANSWER_HOLD_NS`.

/// The shortest answer hold, and the length a host whose ACKs come promptly keeps: until the
/// ACK this side waits for arrives (then `ACK_HOLD_NS` more at most) or this long. As long as
/// the progress thread's hold (`THREAD_ACK_HOLD_NS`): on a veth pair the ACK comes a kernel
/// pass behind the message, or later when the peer's core was taken meanwhile.
pub(crate) const ANSWER_HOLD_NS: u64 = 50_000;

/// The longest: a peer that does not answer (two sides that sent at the same moment, each
/// waiting for its ACK) stalls this long at most per hold, until holds are switched off.
pub(crate) const MAX_NS: u64 = 500_000;

/// The length of the next answer hold, and when the current one started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AnswerHold {
    length: u64,
    started: u64,
}

impl Default for AnswerHold {
    fn default() -> Self {
        AnswerHold {
            length: ANSWER_HOLD_NS,
            started: 0,
        }
    }
}

impl AnswerHold {
    /// A hold starts at `now`: until when it lasts.
    pub(crate) fn start(&mut self, now: u64) -> u64 {
        self.started = now;
        now.saturating_add(self.length)
    }

    /// The ACK the hold waited for came at `now`.
    pub(crate) fn served(&mut self, now: u64) {
        let late = now.saturating_sub(self.started);
        let want = late.saturating_mul(4).clamp(ANSWER_HOLD_NS, MAX_NS);
        if want > self.length {
            self.length = want;
        } else {
            self.length -= (self.length - want) / 8;
        }
    }

    /// The hold ran out with no ACK for this side.
    pub(crate) fn ran_out(&mut self) {
        self.length = self.length.saturating_mul(2).min(MAX_NS);
    }

    /// Answer holds were switched off (several ran out in a row: a peer that is not coming):
    /// when they are made again, they start short.
    pub(crate) fn reset(&mut self) {
        self.length = ANSWER_HOLD_NS;
    }

    /// The length the next hold will have.
    #[cfg(test)]
    fn length(&self) -> u64 {
        self.length
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: u64 = 1_000;

    #[test]
    fn acks_that_come_promptly_keep_the_shortest_hold() {
        let mut h = AnswerHold::default();
        let mut now = 1_000 * US;
        for _ in 0..100 {
            let until = h.start(now);
            assert_eq!(until, now + ANSWER_HOLD_NS);
            // The host's case: the ACK a few µs behind the message.
            h.served(now + 4 * US);
            now += 10 * US;
        }
        assert_eq!(h.length(), ANSWER_HOLD_NS);
    }

    #[test]
    fn a_hold_that_ran_out_doubles_up_to_the_longest() {
        let mut h = AnswerHold::default();
        let mut lengths = Vec::new();
        for turn in 0..6 {
            h.start(turn * MAX_NS);
            h.ran_out();
            lengths.push(h.length() / US);
        }
        assert_eq!(lengths, [100, 200, 400, 500, 500, 500]);
        h.reset();
        assert_eq!(h.length(), ANSWER_HOLD_NS);
    }

    #[test]
    fn a_late_ack_lengthens_the_hold_at_once_and_prompt_ones_shorten_it_slowly() {
        let mut h = AnswerHold::default();
        // An emulated guest's ACK, 40 µs behind the message, inside the 50 µs hold.
        h.start(0);
        h.served(40 * US);
        assert_eq!(h.length(), 160 * US);
        // Lateness beyond the longest hold is capped.
        h.start(1_000 * US);
        h.served(1_000 * US + 300 * US);
        assert_eq!(h.length(), MAX_NS);
        // Prompt ACKs from then on: an eighth of the way down each time, never below the floor.
        let mut now = 10_000 * US;
        let mut previous = h.length();
        for _ in 0..200 {
            h.start(now);
            h.served(now + 2 * US);
            assert!(h.length() <= previous);
            assert!(h.length() >= ANSWER_HOLD_NS);
            previous = h.length();
            now += 100 * US;
        }
        assert!(h.length() < ANSWER_HOLD_NS + 10 * US, "{}", h.length());
        // One step down from the longest: 500 - (500 - 50) / 8.
        let mut h = AnswerHold {
            length: MAX_NS,
            started: 0,
        };
        h.start(0);
        h.served(2 * US);
        assert_eq!(h.length(), MAX_NS - (MAX_NS - ANSWER_HOLD_NS) / 8);
    }
}
