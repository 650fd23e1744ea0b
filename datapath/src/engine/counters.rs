//! The engine's own counters, named as the stats line (`XROCE_STATS_FILE`) names them.

use std::sync::atomic::{AtomicU64, Ordering};

/// Engine-level counters (the transport's own are in
/// [`Device::counters`](xroce_core::transport::Device::counters)).
#[derive(Debug, Default)]
pub struct EngineCounters {
    pub rx_frames: AtomicU64,
    /// Of `rx_frames`, those the progress thread took (the application's verbs took the
    /// rest). Next to an application that polls, the thread should take next to none: each
    /// one it takes cost a wake-up, and the application, which would have taken it, waited.
    pub rx_frames_by_thread: AtomicU64,
    /// Of `rx_frames`, those an application thread took while it waited for a completion
    /// event (see [`super::Engine::take_frames`]).
    pub rx_frames_by_waiters: AtomicU64,
    /// Of `rx_frames`, those a poll took on its way out with completions, for a receiver
    /// that does not answer (its ACKs go at once): see [`super::Engine::poll_cq`].
    pub rx_frames_while_draining: AtomicU64,
    pub rx_not_roce: AtomicU64,
    /// RoCEv2 frames addressed to another MAC than the interface's, dropped as the kernel
    /// drops such frames (`PACKET_OTHERHOST`): a peer still using an old MAC of ours, or a
    /// promiscuous interface (a bridge port) seeing frames for another host.
    pub rx_other_host: AtomicU64,
    pub tx_frames: AtomicU64,
    /// Rounds that handed frames to the port (one kick of the kernel each in copy mode, two
    /// for a round kicked early: `tx_kicks_for_completions`): `tx_frames / tx_batches` is
    /// about the batching the transmit path achieves.
    pub tx_batches: AtomicU64,
    /// Rounds that kicked their frames early, at a packet asking for the ACK of a signalled
    /// WR with unsignalled ones behind it (see `progress::KICK_SIGNALED_AFTER`).
    pub tx_kicks_for_completions: AtomicU64,
    pub tx_loopback: AtomicU64,
    /// Packets dropped because the destination's MAC was not known yet (resolution started;
    /// the transport's retransmission recovers).
    pub tx_no_neighbour: AtomicU64,
    /// Packets dropped because the route to the destination leaves by another interface.
    pub tx_wrong_interface: AtomicU64,
    /// Packets longer than the interface's MTU: a QP's path MTU is above the port's active
    /// MTU. They are sent, as rdma_rxe sends them, and the kernel or the link drops them;
    /// the first is reported on stderr (see `progress::report_too_long`).
    pub tx_too_long: AtomicU64,
    /// Times the kernel refused frames because the interface was down (each spell counted
    /// once; the frames wait for it to come back).
    pub link_downs: AtomicU64,
    /// Kicks that woke the sleeping progress thread.
    pub wakeups: AtomicU64,
    /// Sleeps of the progress thread that a frame ended (it watched for frames).
    pub frame_wakeups: AtomicU64,
    /// Times the progress thread, having taken a packet that is not the last of its message,
    /// waited awake for the next one instead of sleeping (see `MID_MESSAGE_WAIT_NS`).
    pub mid_message_waits: AtomicU64,
    /// Naps of the progress thread that ran out although the application had just polled a
    /// CQ: wake-ups that only checked on it (see `nap_alarm`).
    pub naps_out_while_polled: AtomicU64,
    /// Holds of ACKs that waited for a ping-pong answer (see `ANSWER_HOLD_NS`).
    pub answer_holds: AtomicU64,
    /// Of those, holds that ran out before any ACK came for this side (each turns them off
    /// for `ANSWER_HOLDS_OFF_NS`).
    pub answer_holds_ran_out: AtomicU64,
    /// Holds of ACKs for the application's answer (whoever started them: a poll, or the
    /// progress thread for an application that polled lately) that a poll found run out
    /// with no post from the application (see `ACK_HOLDS_OFF_NS`).
    pub ack_holds_ran_out: AtomicU64,
    /// Holds a poll made for the application's answer that the progress thread found run out
    /// with the application away from its verbs, and sent (see `LeftHolds`).
    pub held_acks_left: AtomicU64,
    /// The receive queues the interface uses, looked at when retransmissions time out, were
    /// more than the engine took sockets on at its start (said on stderr; 1 once seen).
    pub rx_queues_grown: AtomicU64,
}

impl EngineCounters {
    /// Each counter by the name it has in the stats line.
    pub(crate) fn fields(&self) -> [(&'static str, u64); 23] {
        [
            ("rx_frames", self.rx_frames.load(Ordering::Relaxed)),
            (
                "rx_frames_by_thread",
                self.rx_frames_by_thread.load(Ordering::Relaxed),
            ),
            (
                "rx_frames_by_waiters",
                self.rx_frames_by_waiters.load(Ordering::Relaxed),
            ),
            (
                "rx_frames_while_draining",
                self.rx_frames_while_draining.load(Ordering::Relaxed),
            ),
            ("rx_not_roce", self.rx_not_roce.load(Ordering::Relaxed)),
            ("rx_other_host", self.rx_other_host.load(Ordering::Relaxed)),
            ("tx_frames", self.tx_frames.load(Ordering::Relaxed)),
            ("tx_batches", self.tx_batches.load(Ordering::Relaxed)),
            (
                "tx_kicks_for_completions",
                self.tx_kicks_for_completions.load(Ordering::Relaxed),
            ),
            ("tx_loopback", self.tx_loopback.load(Ordering::Relaxed)),
            (
                "tx_no_neighbour",
                self.tx_no_neighbour.load(Ordering::Relaxed),
            ),
            (
                "tx_wrong_interface",
                self.tx_wrong_interface.load(Ordering::Relaxed),
            ),
            ("tx_too_long", self.tx_too_long.load(Ordering::Relaxed)),
            ("link_downs", self.link_downs.load(Ordering::Relaxed)),
            ("wakeups", self.wakeups.load(Ordering::Relaxed)),
            ("frame_wakeups", self.frame_wakeups.load(Ordering::Relaxed)),
            (
                "mid_message_waits",
                self.mid_message_waits.load(Ordering::Relaxed),
            ),
            (
                "naps_out_while_polled",
                self.naps_out_while_polled.load(Ordering::Relaxed),
            ),
            ("answer_holds", self.answer_holds.load(Ordering::Relaxed)),
            (
                "answer_holds_ran_out",
                self.answer_holds_ran_out.load(Ordering::Relaxed),
            ),
            (
                "ack_holds_ran_out",
                self.ack_holds_ran_out.load(Ordering::Relaxed),
            ),
            (
                "held_acks_left",
                self.held_acks_left.load(Ordering::Relaxed),
            ),
            (
                "rx_queues_grown",
                self.rx_queues_grown.load(Ordering::Relaxed),
            ),
        ]
    }
}
