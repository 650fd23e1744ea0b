//! How far an RC requester may run ahead of its oldest unacknowledged PSN: a window that a
//! loss halves and acknowledged packets grow back.
//!
//! RC recovers a loss by going back N: the responder drops every PSN after a gap, so the
//! requester resends everything it sent after the lost packet. What a loss costs is therefore
//! what was in flight behind it, up to the whole window. A fixed window of 512 PSNs (what a
//! clean path wants, [`MAX_UNACKED_PSNS`]) made that ruinous where frames are lost: with 1 % of
//! the frames dropped, five of a window's packets are lost on average, the go-back-N that
//! resends it loses some again, and xroce sent rdma_rxe 5.7 times the frames its `ib_write_bw`
//! needed. RDMA NICs shrink their send window after a retransmission for the same reason
//! (NVIDIA's "slow restart"); rdma_rxe has a fixed 128.
//!
//! The rule is TCP's congestion avoidance, counted in PSNs: a go-back-N halves the window (no
//! further than [`MIN_SEND_WINDOW`]), and every window's worth of PSNs acknowledged grows it by
//! [`SEND_WINDOW_GROWTH`], up to [`MAX_UNACKED_PSNS`]. A path that loses nothing keeps the
//! whole window; the requester asks for ACKs often enough that a small window keeps moving
//! ([`SendWindow::ack_every`]).

use super::requester::{MAX_PKT_PER_ACK, MAX_UNACKED_PSNS};

/// The smallest window a loss leaves: a few ACK round trips' worth of packets, so that a QP
/// on a lossy path still streams.
pub const MIN_SEND_WINDOW: u32 = 16;

/// PSNs the window grows by for every window's worth acknowledged (about one round trip when
/// the window is what holds the requester back).
pub const SEND_WINDOW_GROWTH: u32 = 4;

/// An RC requester's send window, in PSNs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendWindow {
    size: u32,
    /// PSNs acknowledged since the window last grew.
    acked: u32,
}

impl Default for SendWindow {
    fn default() -> Self {
        SendWindow {
            size: MAX_UNACKED_PSNS,
            acked: 0,
        }
    }
}

impl SendWindow {
    /// PSNs the requester may have outstanding.
    pub fn size(&self) -> u32 {
        self.size
    }

    /// A go-back-N started (a sequence NAK, a lost READ response, a timeout): the window
    /// halves. Returns whether it changed.
    pub fn on_loss(&mut self) -> bool {
        let before = self.size;
        self.size = (self.size / 2).max(MIN_SEND_WINDOW);
        self.acked = 0;
        self.size != before
    }

    /// `n` more PSNs were acknowledged (or answered).
    pub fn on_acked(&mut self, n: u32) {
        if self.size >= MAX_UNACKED_PSNS {
            return;
        }
        self.acked = self.acked.saturating_add(n);
        while self.acked >= self.size && self.size < MAX_UNACKED_PSNS {
            self.acked -= self.size;
            self.size = (self.size + SEND_WINDOW_GROWTH).min(MAX_UNACKED_PSNS);
        }
        if self.size >= MAX_UNACKED_PSNS {
            self.acked = 0;
        }
    }

    /// Packets a requester sends without asking for an ACK, at most: four ACKs a window, so
    /// that one comes back while the rest of the window is still going out, and rdma_rxe's
    /// 64 when the window is whole.
    pub fn ack_every(&self) -> u32 {
        (self.size / 4).clamp(1, MAX_PKT_PER_ACK)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loss_halves_the_window_down_to_its_floor() {
        let mut w = SendWindow::default();
        assert_eq!(w.size(), MAX_UNACKED_PSNS);
        assert!(w.on_loss());
        assert_eq!(w.size(), MAX_UNACKED_PSNS / 2);
        let mut cuts = 1;
        while w.on_loss() {
            cuts += 1;
        }
        assert_eq!(w.size(), MIN_SEND_WINDOW);
        // 512 → 256 → 128 → 64 → 32 → 16.
        assert_eq!(cuts, 5);
        assert!(!w.on_loss(), "the floor holds");
    }

    #[test]
    fn a_window_of_acknowledgements_grows_it_by_the_growth_step() {
        let mut w = SendWindow::default();
        w.on_loss();
        w.on_loss();
        assert_eq!(w.size(), 128);
        w.on_acked(127);
        assert_eq!(w.size(), 128, "one short of a window");
        w.on_acked(1);
        assert_eq!(w.size(), 128 + SEND_WINDOW_GROWTH);
        // A large cumulative ACK grows it once per window it covers.
        w.on_acked(132 + 136 + 10);
        assert_eq!(w.size(), 128 + 3 * SEND_WINDOW_GROWTH);
    }

    #[test]
    fn the_window_grows_back_to_whole_and_no_further() {
        let mut w = SendWindow::default();
        while w.on_loss() {}
        let mut acked = 0u64;
        while w.size() < MAX_UNACKED_PSNS {
            w.on_acked(1);
            acked += 1;
            assert!(acked < 1_000_000, "never grew back: {w:?}");
        }
        // From 16 to 512 in steps of 4, each after a window's worth: about 31 000 PSNs.
        let steps = (MAX_UNACKED_PSNS - MIN_SEND_WINDOW) / SEND_WINDOW_GROWTH;
        let expected: u64 = (0..u64::from(steps))
            .map(|i| u64::from(MIN_SEND_WINDOW) + i * u64::from(SEND_WINDOW_GROWTH))
            .sum();
        assert_eq!(acked, expected);
        w.on_acked(1_000_000);
        assert_eq!(w.size(), MAX_UNACKED_PSNS);
    }

    #[test]
    fn a_small_window_asks_for_acks_more_often() {
        let mut w = SendWindow::default();
        assert_eq!(w.ack_every(), MAX_PKT_PER_ACK);
        while w.on_loss() {}
        assert_eq!(w.ack_every(), MIN_SEND_WINDOW / 4);
    }
}
