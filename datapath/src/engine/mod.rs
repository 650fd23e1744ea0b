//! The engine: one transport [`Device`] on one interface queue, driven by a progress thread.
//!
//! The progress thread moves frames between the port (an AF_XDP socket) and the transport, runs
//! the transport's timers, and follows the kernel's addresses and neighbours. Applications call
//! the verbs through [`Engine`], which takes the device lock, and wake the thread when they gave
//! it work. The thread busy-polls while anything happened in the last
//! [`EngineConfig::spin`], and otherwise sleeps in `poll()` on the socket, a wake-up eventfd and
//! the address watcher, with the transport's next timer as the timeout: an idle engine costs
//! nothing (urdma's progress thread burned a core forever).

mod addressing;
mod capture;
pub mod hashing_copy;
mod home_netns;
mod keep_alive;
mod memory;
mod nap_alarm;
mod progress;
mod queue_claim;
mod report;

use std::net::IpAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use xroce_core::transport::memory::Access;
use xroce_core::transport::qp::QpAttr;
use xroce_core::transport::qp_state::AttrMask;
use xroce_core::transport::verbs::{RecvWr, SendWr, VerbsError, WorkCompletion};
use xroce_core::transport::{AddressVector, CqId, Device, DeviceConfig, Event};
use xroce_core::wire::IpAddress;

pub use addressing::{AddressingError, Applied, Neighbours};
pub use memory::ProcessMemory;
pub use queue_claim::{holder as queue_holder, holder_multi_buffer, interface_holder, QueueHolder};

use crate::afxdp::{BindMode, QueueSet, XskConfig, XskError, XskSocket, RECEIVE_ONLY};
use crate::netlink::core_address;
pub use crate::udp_gso::Transmit;
use crate::udp_gso::{AutoBatching, GsoSocket, UdpGsoPort, TRANSMIT_ENV};
pub use capture::{parse_capture_max, rotated_path as rotated_capture_path};

/// What to run an engine on.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The netdev (in the caller's network namespace).
    pub iface: String,
    /// The receive queue to bind (the XDP program redirects per queue).
    pub queue: u32,
    /// Auto binds zero-copy where the driver has it, unless its zero-copy is known to lose
    /// frames (see [`crate::afxdp::auto_mode_avoids_zero_copy`]); copy mode elsewhere.
    pub bind_mode: BindMode,
    /// How long the progress thread keeps busy-polling after the last bit of work before it
    /// sleeps in `poll()`.
    pub spin: Duration,
    /// Longest a verb call may wait for the kernel to resolve a neighbour (modify_qp to RTR,
    /// create_ah) before failing.
    pub resolve_timeout: Duration,
    /// Receives the transport's completion-channel and asynchronous events. It runs with the
    /// engine lock held (on the progress thread or an application thread), so it must not call
    /// back into the engine; the provider writes the event to a file descriptor and returns.
    pub on_event: Option<EventSink>,
    /// Write every frame the engine sends and receives to this pcap file (created, truncated
    /// or, when this process captured to it before, continued; see `capture`). The interface's own taps do not see xroce's frames.
    pub capture: Option<std::path::PathBuf>,
    /// Rotate the capture file once it holds this many bytes: it becomes `FILE.1` (replacing
    /// the older one) and a new `FILE` begins, so the last frames of a long run are kept with
    /// at most twice this on disk. `None`: one file, as long as the run.
    pub capture_max: Option<u64>,
    /// Notice at once when the XDP program is unloaded, from the removal of its pins (see
    /// [`crate::xdp::PinWatch`]). Without it (or when bpffs cannot be reached) an unload is
    /// noticed only when retransmissions time out; tests turn it off to exercise that path.
    pub watch_xdp_pins: bool,
    /// Also receive on the interface's other receive queues (see [`QueueSet`]): a NIC spreads
    /// flows over its queues, so a QP's frames may arrive on any. `queue` is the one the engine
    /// sends on.
    pub all_rx_queues: bool,
    /// Binds the sockets without multi-buffer even where the kernel has it, as on kernels
    /// before 6.6: the port's active MTU is then at most 2048, and a QP asking for 4096 makes
    /// packets no transmit frame holds (see `Counters::tx_too_big_for_buffer`). Tests use it
    /// to run that path on a newer kernel.
    pub single_buffer: bool,
    /// The device's directory in the generated sysfs tree (`.../class/infiniband/NAME`), whose
    /// GID files the engine rewrites with its own table when it starts and whenever the
    /// table changes (see [`crate::registry::write_port_gids`]): libibverbs reads GIDs from
    /// there, and the engine keeps a removed address's slot empty where a regenerated tree
    /// would list the addresses afresh. `None`: no tree (tests, `xroce engine`).
    pub gid_mirror: Option<std::path::PathBuf>,
    /// What moves the frames: an AF_XDP socket (the default) or a DPDK driver.
    pub backend: Backend,
    /// How an AF_XDP engine sends: runs of IPv4 RoCEv2 frames through a kernel UDP socket in
    /// batches, the rest through its AF_XDP socket (see [`crate::udp_gso`]); by default so on
    /// virtio-net in copy mode and on a veth while it segments in software, all through
    /// AF_XDP elsewhere.
    pub transmit: Transmit,
}

/// What moves an engine's frames (see [`EngineConfig::backend`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    /// AF_XDP sockets on the interface's queues, fed by the XDP steering program.
    #[default]
    AfXdp,
    /// DPDK's `net_af_packet` driver on the interface (cargo feature `dpdk`; see
    /// `crate::dpdk`). The XDP program is not needed, and queue and zero-copy settings do
    /// not apply.
    Dpdk,
}

/// The environment variable that picks the backend: `af_xdp` (the default) or `dpdk`.
pub const BACKEND_ENV: &str = "XROCE_BACKEND";

impl Backend {
    /// The backend `XROCE_BACKEND` names (unset or empty: AF_XDP).
    pub fn from_env() -> Result<Backend, EngineError> {
        crate::setting_from_env(BACKEND_ENV)
    }

    /// Whether this build has the backend (DPDK only with the cargo feature `dpdk`).
    pub fn built_in(self) -> bool {
        match self {
            Backend::AfXdp => true,
            Backend::Dpdk => cfg!(feature = "dpdk"),
        }
    }
}

impl std::fmt::Display for Backend {
    /// The name `XROCE_BACKEND` takes.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::AfXdp => "af_xdp",
            Backend::Dpdk => "dpdk",
        })
    }
}

impl std::str::FromStr for Backend {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Backend, EngineError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "af_xdp" | "afxdp" | "af-xdp" => Ok(Backend::AfXdp),
            "dpdk" => Ok(Backend::Dpdk),
            other => Err(EngineError::UnknownBackend(other.to_string())),
        }
    }
}

/// A callback for [`Event`]s (see [`EngineConfig::on_event`]).
#[derive(Clone)]
pub struct EventSink(pub Arc<dyn Fn(Event) + Send + Sync>);

impl std::fmt::Debug for EventSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EventSink")
    }
}

impl EngineConfig {
    pub fn new(iface: impl Into<String>) -> Self {
        Self {
            iface: iface.into(),
            queue: 0,
            bind_mode: BindMode::Auto,
            spin: Duration::from_micros(200),
            resolve_timeout: Duration::from_secs(3),
            on_event: None,
            capture: None,
            capture_max: None,
            watch_xdp_pins: true,
            all_rx_queues: true,
            single_buffer: false,
            gid_mirror: None,
            backend: Backend::AfXdp,
            transmit: Transmit::Auto,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Addressing(#[from] AddressingError),
    #[error(transparent)]
    Xdp(#[from] crate::xdp::XdpError),
    #[error(transparent)]
    Socket(#[from] XskError),
    /// Another AF_XDP socket is bound to the queue: an xroce device serves one RDMA process
    /// at a time.
    #[error(
        "queue {queue} of {iface} is in use by {}: an AF_XDP queue takes one socket, so an \
         xroce device serves one RDMA process at a time (a server and a client on one machine \
         need a device each, e.g. on the two ends of a veth pair: see the README, \"Both ends \
         on one machine\")",
        holder.as_ref().map_or_else(|| "another AF_XDP socket (another xroce engine?)".to_string(), |h| h.to_string())
    )]
    QueueInUse {
        iface: String,
        queue: u32,
        /// The engine's process holding it, when its note names one that still runs.
        holder: Option<QueueHolder>,
    },
    /// Another engine's DPDK port has the interface (its kernel UDP socket is bound there).
    #[error(
        "{iface} is in use by {}: xroce's DPDK port takes the whole interface, so an xroce \
         device serves one RDMA process at a time (a server and a client on one machine need a \
         device each, e.g. on the two ends of a veth pair: see the README, \"Both ends on one \
         machine\")",
        holder.as_ref().map_or_else(|| "another program (another xroce engine, or rdma_rxe?)".to_string(), |h| h.to_string())
    )]
    InterfaceInUse {
        iface: String,
        holder: Option<QueueHolder>,
    },
    /// A receive-only socket on another queue of the interface could not be set up.
    #[error("cannot receive on queue {queue} of {iface} as well: {source}")]
    ReceiveQueue {
        iface: String,
        queue: u32,
        #[source]
        source: XskError,
    },
    #[error("unknown backend {0:?} in {BACKEND_ENV}: use af_xdp (the default) or dpdk")]
    UnknownBackend(String),
    /// `XROCE_TRANSMIT` named no transmit path (the message says what it takes).
    #[error("{0}")]
    UnknownTransmit(String),
    /// `XROCE_BIND_MODE` named no bind mode (the message says what it takes).
    #[error("{0}")]
    UnknownBindMode(String),
    /// `XROCE_PCAP_MAX` gave no size (the message says what it takes).
    #[error("{0}")]
    BadCaptureMax(String),
    #[error(
        "cannot open the UDP socket that sends batches of IPv4 frames on {iface} \
         ({TRANSMIT_ENV}=udp-gso; auto or af-xdp send through AF_XDP without it): {source}"
    )]
    UdpGsoSocket {
        iface: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "this xroce was built without the DPDK backend ({BACKEND_ENV}=dpdk): build it with \
         `--features dpdk` (needs libdpdk-dev)"
    )]
    DpdkNotBuilt,
    #[cfg(feature = "dpdk")]
    #[error(transparent)]
    Dpdk(#[from] crate::dpdk::DpdkError),
    #[error("cannot create the engine's wake-up eventfd: {0}")]
    EventFd(std::io::Error),
    #[error("cannot create the progress thread's nap timerfd: {0}")]
    TimerFd(std::io::Error),
    #[error("cannot start the progress thread: {0}")]
    Thread(std::io::Error),
    #[error("cannot capture to {}: {source}", path.display())]
    Capture {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

/// What [`Engine::take_frames`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TakeFrames {
    /// It ran a round: the frames that waited were taken.
    Taken,
    /// Another thread is in the engine, and takes the frames.
    OtherThread,
    /// The engine has stopped or failed: nothing takes frames any more.
    Stopped,
}

/// Engine-level counters (the transport's own are in [`Device::counters`]).
#[derive(Debug, Default)]
pub struct EngineCounters {
    pub rx_frames: AtomicU64,
    /// Of `rx_frames`, those the progress thread took (the application's verbs took the
    /// rest). Next to an application that polls, the thread should take next to none: each
    /// one it takes cost a wake-up, and the application, which would have taken it, waited.
    pub rx_frames_by_thread: AtomicU64,
    /// Of `rx_frames`, those an application thread took while it waited for a completion
    /// event (see [`Engine::take_frames`]).
    pub rx_frames_by_waiters: AtomicU64,
    /// Of `rx_frames`, those a poll took on its way out with completions, for a receiver
    /// that does not answer (its ACKs go at once): see [`Engine::poll_cq`].
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

/// State shared by the application side and the progress thread.
pub(crate) struct Shared {
    pub(crate) state: Mutex<State>,
    /// Written by the application after it queued work, when the thread may be asleep.
    pub(crate) wake: OwnedFd,
    pub(crate) kick: AtomicBool,
    pub(crate) sleeping: AtomicBool,
    /// Changes the progress thread handed to a polling application (see `poll_cq`).
    pub(crate) handed_changes: progress::HandedChanges,
    /// When the progress thread's sleep ends by itself if nothing wakes it (engine
    /// nanoseconds; `u64::MAX`: only an event ends it; 0: awake, or napping next to an
    /// application that runs the timers itself). Stored under the state lock, so that an
    /// application thread that arms an earlier timer afterwards sees it and wakes the thread
    /// (see `Engine::wake_for_sooner_deadline`).
    pub(crate) sleep_until: AtomicU64,
    pub(crate) stop: AtomicBool,
    /// Signalled after progress made completions (for `wait_cq`).
    pub(crate) progressed: Condvar,
    /// Threads waiting on `progressed`: the progress thread signals only when there are any
    /// (a condition variable's notify is a system call even with nobody waiting).
    pub(crate) progress_waiters: AtomicUsize,
    pub(crate) counters: EngineCounters,
    /// Application threads inside a verb that moves frames itself (`poll_cq`, `post_send`):
    /// while there are any, the progress thread keeps off the lock.
    pub(crate) app_in_verbs: AtomicU32,
    /// When the last application thread left such a verb (engine nanoseconds; 0 = never).
    pub(crate) app_active_at: AtomicU64,
    /// When an application last polled a CQ (0 = never). Only an application that polls is
    /// counted on to come back and drive progress (see `progress::run`).
    pub(crate) app_polled_at: AtomicU64,
    /// The CPU the application last polled a CQ on (-1 = none yet).
    pub(crate) app_cpu: AtomicI32,
    /// Ends the progress thread's naps; a polling application postpones it.
    pub(crate) nap_alarm: nap_alarm::NapAlarm,
    /// Kernel thread id of the progress thread (0 until it runs), for CPU accounting.
    pub(crate) progress_tid: AtomicI32,
    /// CLOCK_MONOTONIC when the engine started: engine time counts from here.
    pub(crate) epoch_ns: u64,
    pub(crate) config: EngineConfig,
    /// The network namespace the engine started in, where its look-ups are made.
    pub(crate) home: Option<home_netns::HomeNetns>,
    /// The receive queues the interface used when the engine started (AF_XDP, where the
    /// driver reports channels): it has a socket on each.
    pub(crate) rx_queues_at_start: Option<u32>,
    /// Retransmissions timed out and the progress thread should compare the interface's
    /// receive queues with [`Self::rx_queues_at_start`] (see `progress::report_more_queues`).
    pub(crate) queues_check_due: AtomicBool,
}

/// What the lock protects.
pub(crate) struct State {
    pub(crate) dev: Device,
    pub(crate) mem: ProcessMemory,
    pub(crate) neighbours: Neighbours,
    pub(crate) io: progress::PortState,
    /// Set by the thread when it exits with an error, reported to the application.
    pub(crate) failed: Option<String>,
    /// The notes naming this process as the holder of its queues, removed with the sockets.
    pub(crate) queue_claims: Vec<queue_claim::QueueClaim>,
    /// What waits for the next progress round; that round sets it back to `Nothing`.
    pub(crate) deferred: Deferred,
    /// Holds for a ping-pong answer (`ANSWER_HOLD_NS`) that ran out with no ACK for this
    /// side: after a few in a row, holds are never lengthened for an answer for a while (see
    /// `ANSWER_HOLDS_OFF_NS`).
    pub(crate) answer_holds: HoldsRunningOut,
    /// Holds for the polling application's answer (`ACK_HOLD_NS`) that ran out with no post
    /// from it: after a few in a row, `poll_cq` sends ACKs as soon as it receives their
    /// requests, for a while (see `ACK_HOLDS_OFF_NS`).
    pub(crate) ack_holds: HoldsRunningOut,
    /// Holds `poll_cq` made that the application left to the progress thread (see
    /// [`LeftHolds`]).
    pub(crate) left_holds: LeftHolds,
}

/// Holds of ACKs that `poll_cq` made for the application's answer and the application left:
/// it went away from its verbs without answering, and the ACKs waited for the progress
/// thread's next round, `LEFT_HOLD_LATE_NS` or more after the hold ran out. Next to a steady
/// poller that thread naps on an alarm the polls keep pushing, up to
/// `nap_alarm::MAX_POSTPONE_NS` out, so the peer, whose send queue may wait for those ACKs,
/// stalled for milliseconds. Two applications that both send, take their
/// completions and then wait for each other outside their verbs, did so every few rounds:
/// 30 stalls of 1-17 ms in 1 000 rounds, half the run. Each left hold turns `poll_cq`'s holds
/// off for a spell, `LEFT_HOLDS_OFF_NS` doubled for every spell since the application last
/// answered a hold, so such an application is tried a few times in all, not once per spell;
/// a hold it answers brings the spells back to the shortest.
#[derive(Debug, Default)]
pub(crate) struct LeftHolds {
    /// Spells since a hold was last answered.
    spells: u32,
    /// Engine time before which `poll_cq` holds nothing.
    off_until: u64,
}

impl LeftHolds {
    /// A hold was left at `now`: holds are off for the next spell.
    pub(crate) fn left(&mut self, now: u64) {
        let doublings = self.spells.min(LEFT_HOLDS_MAX_DOUBLINGS);
        self.off_until = now.saturating_add(LEFT_HOLDS_OFF_NS << doublings);
        self.spells = self.spells.saturating_add(1);
    }

    /// The application answered a hold: the next spell, if any, is the shortest.
    fn answered(&mut self) {
        self.spells = 0;
    }

    /// The application has left a hold since it last answered one: its next holds are on
    /// trial, and the thread wakes for them.
    fn on_trial(&self) -> bool {
        self.spells > 0
    }

    fn off_at(&self, now: u64) -> bool {
        now < self.off_until
    }
}

/// Holds of one kind that ran out in a row, and until when such holds are off.
#[derive(Debug, Default)]
pub(crate) struct HoldsRunningOut {
    /// Holds that ran out since one last served its purpose.
    pub(crate) in_a_row: u32,
    /// Engine time before which such holds are not made.
    off_until: u64,
}

impl HoldsRunningOut {
    /// A hold ran out: after `limit` in a row, holds are off for `off_ns` from `now`.
    fn ran_out(&mut self, now: u64, limit: u32, off_ns: u64) {
        self.in_a_row += 1;
        if self.in_a_row >= limit {
            self.in_a_row = 0;
            self.off_until = now + off_ns;
        }
    }

    fn off_at(&self, now: u64) -> bool {
        now < self.off_until
    }
}

/// Packets the transport has ready that a round left for later.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Deferred {
    Nothing,
    /// WRs posted to a streaming QP (see `Engine::after_post`): the next poll sends them.
    Requests,
    /// ACKs held for the application's answer (see `Engine::poll_cq`), until engine time
    /// `until` at the latest. `answer_from`: the hold waits for a ping-pong answer (see
    /// `ANSWER_HOLD_NS`), and the device had stored this many completions when it started.
    /// `by_poll`: a `poll_cq` started it (else the progress thread, see
    /// `progress::thread_round`).
    AcksUntil {
        until: u64,
        answer_from: Option<u64>,
        by_poll: bool,
    },
}

impl Shared {
    /// Engine time, in nanoseconds. Read on every post and poll, so it reads the clock
    /// directly: through `Instant` (the same clock) its checked arithmetic and 128-bit
    /// conversion cost about 50 instructions per read, a tenth of a small message's posting.
    pub(crate) fn now(&self) -> u64 {
        monotonic_ns().saturating_sub(self.epoch_ns)
    }

    /// The state if no other thread holds it (a poisoned lock is taken as it is).
    pub(crate) fn try_state(&self) -> Option<MutexGuard<'_, State>> {
        match self.state.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// Marks the calling application thread as inside a verb that moves frames itself, until
    /// the returned guard is dropped.
    pub(crate) fn enter_verbs(&self) -> InVerbs<'_> {
        self.enter(true)
    }

    /// [`Self::enter_verbs`] for a verb that moves no frames (posting a receive): the
    /// progress thread keeps off the lock meanwhile, but leaving it is no sign of an
    /// application that drives progress, so it does not stamp `app_active_at` (which spares
    /// a clock read on a ping-pong's turn).
    pub(crate) fn enter_quiet_verb(&self) -> InVerbs<'_> {
        self.enter(false)
    }

    fn enter(&self, stamps: bool) -> InVerbs<'_> {
        self.app_in_verbs.fetch_add(1, Ordering::SeqCst);
        InVerbs {
            shared: self,
            left_at: None,
            stamps,
        }
    }

    /// Makes sure the progress thread looks at new work soon.
    pub(crate) fn wake(&self) {
        self.kick.store(true, Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst) {
            self.counters.wakeups.fetch_add(1, Ordering::Relaxed);
            let one: u64 = 1;
            // SAFETY: writing 8 bytes from a valid u64 to our eventfd.
            unsafe {
                libc::write(
                    self.wake.as_raw_fd(),
                    (&one as *const u64).cast(),
                    std::mem::size_of::<u64>(),
                )
            };
        }
    }
}

/// Reads the 8-byte counter of a non-blocking eventfd or timerfd, so that it stops polling
/// readable (nothing to read is fine).
pub(crate) fn read_counter(fd: std::os::fd::RawFd) {
    let mut v: u64 = 0;
    // SAFETY: reading 8 bytes into a valid u64; a bad or empty descriptor only fails the read.
    unsafe { libc::read(fd, (&mut v as *mut u64).cast(), std::mem::size_of::<u64>()) };
}

/// An application thread inside a verb (see [`Shared::enter_verbs`]).
pub(crate) struct InVerbs<'a> {
    shared: &'a Shared,
    /// Engine time the verb is done at, when the verb read the clock on its way out anyway.
    left_at: Option<u64>,
    /// Leaving stamps `app_active_at` (see [`Shared::enter_quiet_verb`]).
    stamps: bool,
}

impl InVerbs<'_> {
    /// The verb has nothing left to do after `now` (a clock reading it just took): the guard
    /// stamps that instead of reading the clock again. A streaming post reads the clock once
    /// instead of twice, which was 1 % of a 64 B `ib_send_bw` sender's time.
    pub(crate) fn leaving_at(&mut self, now: u64) {
        self.left_at = Some(now);
    }
}

impl Drop for InVerbs<'_> {
    fn drop(&mut self) {
        if self.stamps {
            let now = self.left_at.unwrap_or_else(|| self.shared.now());
            self.shared.app_active_at.store(now, Ordering::Relaxed);
        }
        self.shared.app_in_verbs.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A running engine. Dropping it stops the progress thread and unbinds the socket (RoCE frames
/// then go to the kernel again).
pub struct Engine {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    ifindex: u32,
    /// Every queue it receives on, the one it sends on first.
    queues: Vec<u32>,
    zero_copy: bool,
    /// Why auto mode bound copy mode (see [`Engine::zero_copy_avoided`]).
    zero_copy_avoided: Option<&'static str>,
    /// Every socket carries frames longer than one UMEM frame (see [`Engine::is_multi_buffer`]).
    multi_buffer: bool,
    /// IPv4 frames in runs may leave through a UDP socket (see
    /// [`Engine::sends_through_udp_gso`]): the frames that did so far.
    udp_gso: Option<Arc<AtomicU64>>,
    /// Readable while received frames wait (see [`Engine::frames_fd`]).
    frames_fd: Option<RawFd>,
}

impl Engine {
    /// Binds an AF_XDP socket to `config.iface` queue `config.queue`, enters it into the XDP
    /// program's socket map, builds the GID table from the interface's addresses, and starts the
    /// progress thread. The XDP program must be loaded (`cargo xtask xdp load --iface IF`).
    pub fn start(config: EngineConfig) -> Result<Engine, EngineError> {
        if !config.backend.built_in() {
            return Err(EngineError::DpdkNotBuilt);
        }
        let mut neighbours = Neighbours::open(&config.iface)?;
        let ifindex = neighbours.ifindex();
        // Watching before reading: an address that appears in between (IPv6 duplicate address
        // detection ending as the application starts) is a change the thread applies.
        let address_watch = neighbours.watch()?;
        let gids = neighbours.gid_table()?;
        let mtu = neighbours.mtu();
        let OpenedPort {
            port,
            wait_fd,
            xsks,
            local_addrs,
            queues,
            queue_claims,
            zero_copy,
            zero_copy_avoided,
            multi_buffer,
            udp_gso,
        } = {
            // Each kind checks for the other's note and leaves its own under this lock.
            let _start = queue_claim::start_lock(&config.iface);
            match config.backend {
                Backend::AfXdp => open_af_xdp(&config, ifindex, &neighbours, &gids)?,
                Backend::Dpdk => open_dpdk(&config)?,
            }
        };
        // Once the port is this engine's: a second program on a busy device, refused above,
        // must not touch the capture file of the one that has it (and is told why it was
        // refused, not about the file). A capture that cannot be made stops the start; the
        // port and its notes go with this function's locals.
        let capture = match &config.capture {
            Some(path) => Some(capture::Capture::create(path, config.capture_max).map_err(
                |source| EngineError::Capture {
                    path: path.clone(),
                    source,
                },
            )?),
            None => None,
        };
        // Which CRC-32 code hashes ICRCs is measured once per process (up to a tenth of a
        // millisecond under an emulated CPU): here rather than on the first frame.
        let icrc_code = xroce_core::icrc::code_in_use();
        log::debug!("ICRCs hashed with the {} code", icrc_code.name());
        // The port MTU follows later MTU changes by what the sockets carry.
        neighbours.set_multi_buffer(multi_buffer);
        if let Some(map) = local_addrs {
            neighbours.steer_only_to(map, gids.clone());
        }
        let doorbell = port.wait_fd_is_doorbell();
        let watchers = progress::Watchers {
            addresses: address_watch,
            // Without it (no pins, or bpffs out of reach) an unload is noticed only when
            // retransmissions time out.
            pins: if config.watch_xdp_pins && xsks.is_some() {
                crate::xdp::PinWatch::open(&config.iface).unwrap_or_else(|e| {
                    log::debug!("not watching the XDP program's pins: {e}");
                    None
                })
            } else {
                None
            },
        };

        let mut key_seed = [0u8; 32];
        getrandom(&mut key_seed);
        let mut qpn_seed = [0u8; 4];
        getrandom(&mut qpn_seed);
        // The table starts as the device's tree has it, when there is one (the indices a
        // program read there are the ones it will use), with the addresses of now merged in.
        let tree = config.gid_mirror.as_deref().and_then(|dir| {
            crate::registry::read_port_gids(dir, &config.iface)
                .map(|old| crate::registry::merge_gid_table(&old, &gids))
        });
        let gids = tree.unwrap_or_else(|| gids.into_iter().map(Some).collect());
        let port_mtu = crate::afxdp::port_path_mtu(mtu, multi_buffer);
        let dev = Device::new(DeviceConfig {
            gids: gids.into_iter().map(|g| g.map(core_address)).collect(),
            port_mtu,
            key_seed,
            first_qpn: random_first_qpn(u32::from_le_bytes(qpn_seed)),
        });
        if let Some(dir) = &config.gid_mirror {
            // The tree was written before this start; the addresses may have moved since.
            neighbours.mirror_gids_to(dir.clone(), dev.gids());
        }
        // SAFETY: a fresh eventfd, owned at once.
        let efd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if efd < 0 {
            return Err(EngineError::EventFd(std::io::Error::last_os_error()));
        }
        // SAFETY: `efd` is a valid descriptor nobody else owns.
        let wake = unsafe { OwnedFd::from_raw_fd(efd) };
        let nap_alarm = nap_alarm::NapAlarm::new().map_err(EngineError::TimerFd)?;
        let queue = config.queue;
        // Read again here rather than passed from where the sockets were opened: a DPDK port
        // takes the whole interface, and a driver without channels reports none.
        let rx_queues_at_start = xsks
            .as_ref()
            .and_then(|_| crate::afxdp::receive_queues_in_use(&config.iface));
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                dev,
                mem: ProcessMemory::new(),
                neighbours,
                io: progress::PortState::new(
                    port,
                    capture,
                    if xsks.is_some() {
                        progress::SteeringWatch::new(&config.iface)
                    } else {
                        // Frames reach a DPDK port without the steering program.
                        progress::SteeringWatch::none(&config.iface)
                    },
                ),
                failed: None,
                queue_claims,
                deferred: Deferred::Nothing,
                answer_holds: HoldsRunningOut::default(),
                ack_holds: HoldsRunningOut::default(),
                left_holds: LeftHolds::default(),
            }),
            wake,
            kick: AtomicBool::new(false),
            sleeping: AtomicBool::new(false),
            sleep_until: AtomicU64::new(0),
            handed_changes: progress::HandedChanges::default(),
            stop: AtomicBool::new(false),
            progressed: Condvar::new(),
            progress_waiters: AtomicUsize::new(0),
            counters: EngineCounters::default(),
            app_in_verbs: AtomicU32::new(0),
            app_active_at: AtomicU64::new(0),
            app_polled_at: AtomicU64::new(0),
            app_cpu: AtomicI32::new(-1),
            nap_alarm,
            progress_tid: AtomicI32::new(0),
            epoch_ns: monotonic_ns(),
            home: home_netns::HomeNetns::current(),
            rx_queues_at_start,
            queues_check_due: AtomicBool::new(false),
            config,
        });
        let xsks_bound = xsks.is_some();
        let thread_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("xroce-progress-{ifindex}-{queue}"))
            .spawn({
                let queues = queues.clone();
                move || progress::run(thread_shared, watchers, xsks, queues, wait_fd, doorbell)
            })
            .map_err(EngineError::Thread)?;
        log::info!(
            "{}: engine started: {}, receiving on queue{} {}, {}, transmitting {}; path MTU up \
             to {}",
            shared.config.iface,
            shared.config.backend,
            if queues.len() == 1 { "" } else { "s" },
            queues
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            match (xsks_bound, zero_copy, zero_copy_avoided) {
                (false, ..) => "no AF_XDP sockets".to_string(),
                (true, true, _) => "zero-copy sockets".to_string(),
                (true, false, Some(why)) => format!("copy-mode sockets ({why})"),
                (true, false, None) => "copy-mode sockets".to_string(),
            },
            if udp_gso.is_some() {
                "runs of IPv4 frames through a UDP socket (UDP GSO), the rest through the port"
            } else {
                "through the port"
            },
            port_mtu.bytes()
        );
        Ok(Engine {
            shared,
            thread: Mutex::new(Some(thread)),
            ifindex,
            queues,
            zero_copy,
            zero_copy_avoided,
            multi_buffer,
            udp_gso,
            frames_fd: (!doorbell).then_some(wait_fd),
        })
    }

    pub fn ifindex(&self) -> u32 {
        self.ifindex
    }

    /// The queues the engine receives on, the one it sends on first (see
    /// [`EngineConfig::all_rx_queues`]).
    pub fn queues(&self) -> &[u32] {
        &self.queues
    }

    /// The queue the engine sends on.
    pub fn queue(&self) -> u32 {
        self.queues[0]
    }

    /// Whether IPv4 frames in runs may leave through a kernel UDP socket in batches (see
    /// [`EngineConfig::transmit`]; an AF_XDP engine only). On a veth they do only while the
    /// veth segments batches in software; [`Engine::frames_sent_in_batches`] counts those that
    /// did.
    pub fn sends_through_udp_gso(&self) -> bool {
        self.udp_gso.is_some()
    }

    /// The frames that left through the UDP socket, in batches, so far.
    pub fn frames_sent_in_batches(&self) -> u64 {
        self.udp_gso
            .as_ref()
            .map_or(0, |n| n.load(Ordering::Relaxed))
    }

    pub fn is_zero_copy(&self) -> bool {
        self.zero_copy
    }

    /// Why the engine's sockets are in copy mode although auto mode would bind zero-copy on
    /// the driver, when its zero-copy is known to lose frames (see
    /// [`crate::afxdp::auto_mode_avoids_zero_copy`]).
    pub fn zero_copy_avoided(&self) -> Option<&'static str> {
        self.zero_copy_avoided
    }

    /// Whether the port carries frames longer than one UMEM frame (every socket bound with
    /// multi-buffer, or the DPDK backend): without it the port's path MTU stops at 2048, and
    /// stays there if the interface's MTU is raised later (see [`crate::afxdp::port_path_mtu`]).
    pub fn is_multi_buffer(&self) -> bool {
        self.multi_buffer
    }

    /// What moves this engine's frames.
    pub fn backend(&self) -> Backend {
        self.shared.config.backend
    }

    pub fn counters(&self) -> &EngineCounters {
        &self.shared.counters
    }

    /// The progress thread's kernel thread id (for `perf -t`, `/proc/self/task/TID`); `None`
    /// until it runs.
    pub fn progress_thread_id(&self) -> Option<i32> {
        Some(self.shared.progress_tid.load(Ordering::Relaxed)).filter(|t| *t != 0)
    }

    /// CPU time (user + system) the progress thread has used so far, from
    /// `/proc/self/task/TID/stat`; `None` if it cannot be read.
    pub fn progress_cpu_time(&self) -> Option<Duration> {
        let tid = self.progress_thread_id()?;
        crate::cpu_time::from_stat_file(std::path::Path::new(&format!(
            "/proc/self/task/{tid}/stat"
        )))
    }

    /// The transport's and the engine's counters as `name=value` pairs separated by spaces.
    pub fn stats_line(&self) -> String {
        let st = self.lock();
        let transport = (st.dev.counters().fields().to_vec(), st.io.rx_drops());
        drop(st);
        self.format_stats(Some(transport))
    }

    /// [`Self::stats_line`] waiting at most `patience` for the engine lock: at exit, a thread
    /// stopped inside a verb may hold it for ever (a signal handler that calls `exit()` while
    /// the program polls); the progress thread holds it only for a round at a time. When it
    /// stays taken, the transport's counters are left out (`transport_busy=1`).
    pub fn stats_line_waiting_at_most(&self, patience: Duration) -> String {
        let deadline = Instant::now() + patience;
        let transport = loop {
            if let Some(st) = self.shared.try_state() {
                break Some((st.dev.counters().fields().to_vec(), st.io.rx_drops()));
            }
            if Instant::now() >= deadline {
                break None;
            }
            std::thread::sleep(Duration::from_micros(200));
        };
        self.format_stats(transport)
    }

    fn format_stats(
        &self,
        transport: Option<(Vec<(&'static str, u64)>, crate::port::RxDrops)>,
    ) -> String {
        let c = &self.shared.counters;
        let (mut fields, drops) = match transport {
            Some((fields, drops)) => (fields, Some(drops)),
            None => (vec![("transport_busy", 1)], None),
        };
        // Known only with the lock.
        if let Some(drops) = drops {
            fields.extend([
                ("rx_dropped_ring_full", drops.ring_full),
                ("rx_dropped_other", drops.other),
            ]);
        }
        fields.extend([
            ("rx_frames", c.rx_frames.load(Ordering::Relaxed)),
            (
                "rx_frames_by_thread",
                c.rx_frames_by_thread.load(Ordering::Relaxed),
            ),
            (
                "rx_frames_by_waiters",
                c.rx_frames_by_waiters.load(Ordering::Relaxed),
            ),
            (
                "rx_frames_while_draining",
                c.rx_frames_while_draining.load(Ordering::Relaxed),
            ),
            ("rx_not_roce", c.rx_not_roce.load(Ordering::Relaxed)),
            ("rx_other_host", c.rx_other_host.load(Ordering::Relaxed)),
            ("tx_frames", c.tx_frames.load(Ordering::Relaxed)),
            ("tx_batches", c.tx_batches.load(Ordering::Relaxed)),
            (
                "tx_kicks_for_completions",
                c.tx_kicks_for_completions.load(Ordering::Relaxed),
            ),
            ("tx_loopback", c.tx_loopback.load(Ordering::Relaxed)),
            ("tx_no_neighbour", c.tx_no_neighbour.load(Ordering::Relaxed)),
            (
                "tx_wrong_interface",
                c.tx_wrong_interface.load(Ordering::Relaxed),
            ),
            ("tx_too_long", c.tx_too_long.load(Ordering::Relaxed)),
            ("link_downs", c.link_downs.load(Ordering::Relaxed)),
            ("wakeups", c.wakeups.load(Ordering::Relaxed)),
            ("frame_wakeups", c.frame_wakeups.load(Ordering::Relaxed)),
            (
                "mid_message_waits",
                c.mid_message_waits.load(Ordering::Relaxed),
            ),
            (
                "naps_out_while_polled",
                c.naps_out_while_polled.load(Ordering::Relaxed),
            ),
            ("answer_holds", c.answer_holds.load(Ordering::Relaxed)),
            (
                "answer_holds_ran_out",
                c.answer_holds_ran_out.load(Ordering::Relaxed),
            ),
            (
                "ack_holds_ran_out",
                c.ack_holds_ran_out.load(Ordering::Relaxed),
            ),
            ("held_acks_left", c.held_acks_left.load(Ordering::Relaxed)),
            ("rx_queues_grown", c.rx_queues_grown.load(Ordering::Relaxed)),
            // Not a counter: 1 when the socket the engine sends on bound in zero-copy mode.
            ("zero_copy", u64::from(self.zero_copy)),
            // Nor this: 1 when every socket carries frames longer than one UMEM frame.
            ("multi_buffer", u64::from(self.multi_buffer)),
            // Nor this: 1 when runs of IPv4 frames may leave through a UDP socket in batches
            // (`XROCE_TRANSMIT`: by default on virtio-net in copy mode, and on a veth while it
            // segments in software; see `crate::udp_gso`). The next counts those that did.
            ("udp_gso", u64::from(self.sends_through_udp_gso())),
            ("tx_frames_batched", self.frames_sent_in_batches()),
            // Nor this: 1 when ICRCs are hashed with tables rather than carry-less multiplies
            // (the faster here; see `xroce_core::icrc::code_in_use`).
            (
                "icrc_table",
                u64::from(xroce_core::icrc::code_in_use() == xroce_core::icrc::Crc32Code::Table),
            ),
        ]);
        fields
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Why the progress thread stopped, if it did.
    pub fn failure(&self) -> Option<String> {
        self.lock().failed.clone()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic on the progress thread poisons the lock; the state is still consistent
        // enough to report and tear down, so keep going.
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on the device (any verb), then wakes the progress thread. What an earlier
    /// `poll_cq` left to send (ACKs, see there) goes first: the verb may be destroying the QP
    /// or closing the device, as an application does right after its last completion.
    pub fn with_device<R>(&self, f: impl FnOnce(&mut Device) -> R) -> R {
        let mut guard = self.lock();
        self.send_deferred(&mut guard);
        let r = f(&mut guard.dev);
        Self::dispatch_if_failed(&self.shared, &mut guard);
        drop(guard);
        self.shared.wake();
        r
    }

    /// On a failed device nobody else hands out the events a verb caused (the progress thread
    /// has stopped): a receive posted to a QP in error completes at once, and an application
    /// waiting on its completion channel must hear of it.
    fn dispatch_if_failed(shared: &Shared, st: &mut State) {
        if st.io.failed {
            progress::dispatch_events(shared, &mut st.dev);
        }
    }

    /// Sends what an earlier `poll_cq` or post left for later (ACKs above all) now. For a
    /// process about to exit without closing its device. Does nothing if another thread holds
    /// the engine (it may be the caller, interrupted inside a verb; a holder moves frames
    /// itself anyway).
    pub fn flush(&self) {
        if let Some(mut guard) = self.shared.try_state() {
            self.send_deferred(&mut guard);
            let _ = guard.io.port.send_kept();
            guard.io.flush_capture();
        }
    }

    /// Transmits what a round left for later (see `poll_cq` and `after_post`), if anything.
    fn send_deferred(&self, st: &mut State) {
        if st.deferred != Deferred::Nothing && !st.io.failed {
            progress::send(&self.shared, st, self.shared.now());
        }
    }

    /// `ibv_destroy_qp`. What the QP still has to send goes first, with one more ACK for
    /// the last request it executed (see `Device::queue_farewell_ack`): after this nothing
    /// answers the peer's resends.
    pub fn destroy_qp(&self, qpn: u32) -> Result<(), VerbsError> {
        let mut guard = self.lock();
        let st = &mut *guard;
        if (st.dev.queue_farewell_ack(qpn) || st.deferred != Deferred::Nothing) && !st.io.failed {
            progress::send(&self.shared, st, self.shared.now());
        }
        // Lingering needs the progress thread to answer; a stopped or failed engine has none.
        let r = if st.io.failed || self.shared.stop.load(Ordering::SeqCst) {
            st.dev.destroy_qp(qpn)
        } else {
            st.dev
                .destroy_qp_lingering(qpn, self.shared.now(), LINGER_NS)
        };
        drop(guard);
        self.shared.wake();
        r
    }

    /// Runs a data-path verb that gives the progress thread nothing to send (posting a
    /// receive, arming a CQ) on the device, without waking it: a wake-up per `post_recv`
    /// would take the core of an application that polls (one per iteration of
    /// `ib_send_lat`). The events the verb caused go out from this thread: a receive posted
    /// to a QP in error completes at once, and with the progress thread asleep (an error QP
    /// has no timers) an application waiting on its completion channel would not hear of it
    /// until something else woke the thread.
    pub fn with_device_quiet<R>(&self, f: impl FnOnce(&mut Device) -> R) -> R {
        let _in_verbs = self.shared.enter_quiet_verb();
        let mut guard = self.lock();
        let r = f(&mut guard.dev);
        progress::dispatch_events(&self.shared, &mut guard.dev);
        r
    }

    /// `ibv_req_notify_cq`: arms `cq` for its next completion (or next solicited one). The
    /// application will wait for the event outside its verbs; see `NapAlarm::app_waits`.
    pub fn req_notify_cq(&self, cq: CqId, solicited_only: bool) -> Result<(), VerbsError> {
        {
            let _in_verbs = self.shared.enter_verbs();
            let mut guard = self.lock();
            let st = &mut *guard;
            let armed = st.dev.req_notify_cq(cq, solicited_only);
            progress::dispatch_events(&self.shared, &mut st.dev);
            armed?;
            // The application is about to block: what its polls would have sent (ACKs held
            // for its answer, requests left for its next poll) and the timers its own verbs
            // started are the thread's now.
            if st.deferred == Deferred::Requests {
                self.shared.wake();
            } else {
                self.wake_for_sooner_deadline(st, true);
            }
        }
        self.shared.nap_alarm.app_waits();
        Ok(())
    }

    /// The interface's MAC as the engine last read it: the source of its frames, and the
    /// destination it takes frames for. The progress thread follows a change of it, about a
    /// millisecond after the kernel's notification (later on a loaded machine).
    pub fn mac(&self) -> [u8; 6] {
        self.lock().neighbours.mac()
    }

    /// The GID table (index = GID index; IPv4 addresses stand for IPv4-mapped GIDs).
    pub fn gids(&self) -> Vec<Option<IpAddress>> {
        self.lock().dev.gids().to_vec()
    }

    /// Index of `ip` in the GID table.
    pub fn gid_index(&self, ip: IpAddr) -> Option<u8> {
        let want = core_address(ip);
        self.gids()
            .iter()
            .position(|g| *g == Some(want))
            .and_then(|i| u8::try_from(i).ok())
    }

    /// Registers `[addr, addr + len)` of this process with the device.
    ///
    /// # Safety
    /// The memory must stay valid (readable, and writable if remote or local write access is
    /// granted) until `dereg_mr`; the engine may read and write it at any time until then.
    pub unsafe fn reg_mr(
        &self,
        pd: xroce_core::transport::memory::PdId,
        addr: *mut u8,
        len: usize,
        access: xroce_core::transport::memory::Access,
    ) -> Result<
        (
            xroce_core::transport::memory::MrId,
            xroce_core::transport::memory::MemoryRegion,
        ),
        VerbsError,
    > {
        let mut st = self.lock();
        let r = st.dev.reg_mr(pd, addr as u64, len as u64, access)?;
        let writable = access.contains(Access::LOCAL_WRITE);
        // SAFETY: forwarded from this function's contract.
        unsafe { st.mem.add(addr as u64, len as u64, writable) };
        Ok(r)
    }

    /// Destroys what an application left on a context it closed while other contexts keep
    /// the engine running: its QPs (so no peer reaches them), SRQs and CQs, then its PDs with
    /// their address handles and memory regions (so no R_Key of memory the application may
    /// now free still works). Objects already gone are skipped.
    pub fn release_objects(
        &self,
        qps: &[u32],
        srqs: &[xroce_core::transport::SrqId],
        cqs: &[CqId],
        pds: &[xroce_core::transport::memory::PdId],
    ) {
        // As `ibv_destroy_qp` does: what was owed goes out, a farewell ACK, and the QP lingers
        // to answer resends (a peer's last message must not go unacknowledged).
        for &qpn in qps {
            let _ = self.destroy_qp(qpn);
        }
        let mut st = self.lock();
        for &srq in srqs {
            let _ = st.dev.destroy_srq(srq);
        }
        for &cq in cqs {
            let _ = st.dev.destroy_cq(cq);
        }
        for &pd in pds {
            for r in st.dev.dealloc_pd_with_contents(pd) {
                st.mem
                    .remove(r.va, r.len, r.access.contains(Access::LOCAL_WRITE));
            }
        }
    }

    pub fn dereg_mr(&self, mr: xroce_core::transport::memory::MrId) -> Result<(), VerbsError> {
        let mut st = self.lock();
        let region = st.dev.dereg_mr(mr)?;
        st.mem.remove(
            region.va,
            region.len,
            region.access.contains(Access::LOCAL_WRITE),
        );
        Ok(())
    }

    /// `ibv_modify_qp`. A transition that sets an address vector first makes sure the kernel
    /// has resolved the next hop's MAC (waiting up to `resolve_timeout`), so the first packets
    /// are not dropped for want of it.
    pub fn modify_qp(&self, qpn: u32, attr: &QpAttr, mask: AttrMask) -> Result<(), VerbError> {
        if mask.contains(AttrMask::AV) {
            if let Some(av) = &attr.av {
                // A request that will be refused is refused now, not after a wait for an
                // address that may never answer.
                self.with_device(|d| d.check_modify_qp(qpn, attr, mask))
                    .map_err(VerbError::Verbs)?;
                self.resolve(av)?;
            }
        }
        self.with_device(|d| d.modify_qp(qpn, attr, mask))
            .map_err(VerbError::Verbs)
    }

    /// Resolves the MAC for an address vector's destination (blocking, bounded).
    pub fn resolve(&self, av: &AddressVector) -> Result<(), VerbError> {
        let timeout = self.shared.config.resolve_timeout;
        if self.lock().dev.gids().contains(&Some(av.dgid)) {
            return Ok(()); // loopback: no wire, no neighbour
        }
        let probe = self.lock().neighbours.prepare(av.dgid);
        let found = home_netns::run_at_home(self.shared.home.as_ref(), || probe.wait(timeout))
            .map_err(|source| {
                VerbError::Addressing(AddressingError::HomeNamespace {
                    dst: crate::netlink::std_address(av.dgid),
                    source,
                })
            })?
            .map_err(VerbError::Addressing)?;
        self.lock().neighbours.learn(av.dgid, found);
        Ok(())
    }

    /// `ibv_create_ah`, resolving the destination's next hop first (bounded by
    /// `resolve_timeout`).
    pub fn create_ah(
        &self,
        pd: xroce_core::transport::memory::PdId,
        av: AddressVector,
    ) -> Result<xroce_core::transport::AhId, VerbError> {
        self.with_device(|d| d.check_ah(&av))
            .map_err(VerbError::Verbs)?;
        self.resolve(&av)?;
        self.with_device(|d| d.create_ah(pd, av))
            .map_err(VerbError::Verbs)
    }

    pub fn post_send(&self, qpn: u32, wr: SendWr) -> Result<(), VerbsError> {
        let mut in_verbs = self.shared.enter_verbs();
        let mut guard = self.lock();
        let st = &mut *guard;
        let busy = st.dev.post_send_was_busy(qpn, wr, &st.mem)?;
        self.after_post(guard, busy, &mut in_verbs);
        Ok(())
    }

    /// `ibv_post_send` for a work request whose inline data (`IBV_SEND_INLINE`) may lie
    /// outside registered memory, as verbs allows: it is copied from the caller's pointers
    /// during this call.
    ///
    /// # Safety
    /// If `wr` asks for inline data, every SGE of it must name memory readable for its length
    /// for the duration of the call.
    pub unsafe fn post_send_caller_inline(&self, qpn: u32, wr: SendWr) -> Result<(), VerbsError> {
        let mut in_verbs = self.shared.enter_verbs();
        let mut guard = self.lock();
        let busy = if wr
            .flags
            .contains(xroce_core::transport::verbs::SendFlags::INLINE)
        {
            guard
                .dev
                .post_send_was_busy(qpn, wr, &memory::CallerMemory)?
        } else {
            let st = &mut *guard;
            st.dev.post_send_was_busy(qpn, wr, &st.mem)?
        };
        self.after_post(guard, busy, &mut in_verbs);
        Ok(())
    }

    /// After a WR was queued on a QP whose send queue was idle (`busy` false: empty, or
    /// holding only its previous message, sent and awaiting its ACK), its packets go
    /// out at once from this thread: no hand-off, no wake-up on the latency path. On a QP that
    /// is already streaming they wait for the next progress round (the application's next
    /// `poll_cq`, or the progress thread), which sends everything queued together: one system
    /// call and one ACK for the batch instead of one each.
    fn after_post(&self, mut guard: MutexGuard<'_, State>, busy: bool, in_verbs: &mut InVerbs) {
        if let Deferred::AcksUntil { by_poll, .. } = guard.deferred {
            // A hold answered: the ACKs ride with this post.
            guard.ack_holds.in_a_row = 0;
            if by_poll {
                // (The thread's holds are for an application away from its verbs: one that
                // leaves its polls' holds answers those as well, the peer's next message
                // being at hand when it comes back.)
                guard.left_holds.answered();
            }
        }
        if !busy {
            self.send_now(guard);
            return;
        }
        // Requests do not wait for an answer (held ACKs go with them).
        guard.deferred = Deferred::Requests;
        drop(guard);
        let now = self.shared.now();
        in_verbs.leaving_at(now);
        let polled_ns = self.shared.app_polled_at.load(Ordering::Relaxed);
        if polled_ns == 0 || now.saturating_sub(polled_ns) >= progress::APP_POLLER_NS {
            // Nobody is polling: the progress thread sends.
            self.shared.wake();
        }
    }

    fn send_now(&self, mut guard: MutexGuard<'_, State>) {
        let st = &mut *guard;
        // Send at once from this thread: no hand-off, no wake-up on the latency path. The
        // progress thread is woken only for what this round left over (a long message), or
        // for the retransmission timer the send started, when it sleeps past it.
        //
        // The frames that came since the application's last poll wait for its next one when
        // that poll was a moment ago (`APP_ACTIVE_NS`): taking them here put their
        // processing, a peer's trailing ACK say, between the post and the kick of the answer,
        // and cost every ping-pong turn a look at the receive ring on its path. An
        // application that posts and does not poll (unsignalled UD sends in a loop) still has
        // its frames taken by its posts: the progress thread keeps off while it is in its
        // verbs.
        let now = self.shared.now();
        if now.saturating_sub(st.io.received_at) >= progress::APP_ACTIVE_NS {
            progress::receive(&self.shared, st, now);
        }
        if progress::send(&self.shared, st, now).more {
            drop(guard);
            self.shared.wake();
        } else {
            self.wake_for_sooner_deadline(st, false);
        }
    }

    /// Wakes the progress thread when the transport has a timer due (with `held_acks`, or
    /// ACKs held for an answer to send) before the thread's sleep ends by itself. The
    /// application armed it from its own thread and may block on its completion channel
    /// next: a lost packet would then never be resent, and its application would wait for
    /// ever. Costs a load per verb; the thread wakes only for a deadline earlier than every
    /// one it knew (not for each send of a ping-pong, whose timers restart later each turn).
    fn wake_for_sooner_deadline(&self, st: &State, held_acks: bool) {
        let until = self.shared.sleep_until.load(Ordering::SeqCst);
        if until == 0 {
            return;
        }
        let held = match st.deferred {
            Deferred::AcksUntil { until, .. } if held_acks => Some(until),
            _ => None,
        };
        let due = progress::earliest(st.dev.poll_timeout(), held);
        if due.is_some_and(|t| t < until) {
            self.shared.wake();
        }
    }

    pub fn post_recv(&self, qpn: u32, wr: RecvWr) -> Result<(), VerbsError> {
        self.with_device_quiet(|d| d.post_recv(qpn, wr))
    }

    /// `ibv_poll_cq`. When the CQ is empty the calling thread runs one round of progress
    /// itself (receive, timers, transmit) and looks again: an application spinning on its CQ
    /// then moves its own packets, with no hand-off to the progress thread, which stays out of
    /// the way while the application polls.
    ///
    /// Frames that gave the application completions (on any CQ), or executed SENDs or WRITEs
    /// (a WRITE completes nothing at the responder, yet `ib_write_lat` answers it), make the
    /// round stop before it transmits: the ACKs they call for are held while the application
    /// takes its completions and answers. A ping-pong's answer then leaves first with the ACK
    /// behind it in one batch (see `Device::poll_transmit`), instead of the ACK costing a
    /// system call of its own on the latency path. Held ACKs go out with the next post, with
    /// any verb that changes the device, from the progress thread once the application leaves
    /// its verbs loop, and at the latest with the first poll after `ACK_HOLD_NS` that finds no
    /// completion waiting on its CQ. A message that arrived while the application waits for the
    /// ACK of its own one message in flight, a ping-pong's turn, is held until that ACK is in
    /// (and `ACK_HOLD_NS` from then) or for `ANSWER_HOLD_NS`. An application whose holds keep
    /// running out with no post (a receiver that never answers) has its ACKs sent as soon as
    /// they are received, for a while (`ACK_HOLDS_OFF_NS`).
    pub fn poll_cq(
        &self,
        cq: CqId,
        max: usize,
        out: &mut Vec<WorkCompletion>,
    ) -> Result<usize, VerbsError> {
        // When the application last left a verb (before this poll enters).
        let left_at = self.shared.app_active_at.load(Ordering::Relaxed);
        // Any poll, productive or not, says the application is driving progress: the progress
        // thread then keeps off the lock.
        let _in_verbs = self.shared.enter_verbs();
        // One clock read per poll (a few tens of ns here): the round below uses it too.
        let now = self.shared.now();
        if left_at != 0 && now.saturating_sub(left_at) >= progress::APP_ACTIVE_NS {
            // It was away from its verbs (on memory, say): not a steady poller.
            self.shared.nap_alarm.app_left();
        }
        self.shared.app_polled_at.store(now, Ordering::Relaxed);
        self.shared.app_cpu.store(current_cpu(), Ordering::Relaxed);
        // A steady poller keeps the progress thread asleep (see `nap_alarm`).
        self.shared.nap_alarm.app_polled(now);
        let mut guard = self.lock();
        let st = &mut *guard;
        if !st.io.failed && self.shared.handed_changes.waiting.load(Ordering::Relaxed) {
            // Address or neighbour changes the progress thread could not apply while this
            // application kept the lock (see `progress::run`).
            let changes = self.shared.handed_changes.take();
            progress::apply_changes(&self.shared, st, changes);
        }
        if st.io.failed {
            Self::dispatch_if_failed(&self.shared, st);
            return st.dev.poll_cq(cq, max, out);
        }
        let mut trial = false;
        let polled = self.poll_cq_round(st, now, cq, max, out, &mut trial);
        // ACKs held here wait for this application's next verb; a timer this round armed
        // (an RNR NAK taken, say) must not wait for an application that leaves to block.
        // Nor must a hold on trial (see `LeftHolds`): a thread asleep until a later timer
        // wakes, and naps next to this application.
        self.wake_for_sooner_deadline(st, trial);
        polled
    }

    /// `poll_cq` on a working device, at `now` (see there).
    fn poll_cq_round(
        &self,
        st: &mut State,
        now: u64,
        cq: CqId,
        max: usize,
        out: &mut Vec<WorkCompletion>,
        trial: &mut bool,
    ) -> Result<usize, VerbsError> {
        let holding = matches!(st.deferred, Deferred::AcksUntil { until, .. } if now < until);
        match st.deferred {
            Deferred::Requests => {
                progress::progress_once(&self.shared, st);
            }
            Deferred::AcksUntil { answer_from, .. } if !holding => {
                // The hold ran out, but completions the application has yet to take come
                // first: its answer to them can still carry the ACKs. Under emulation (a
                // guest without KVM) the application takes tens of microseconds between the
                // poll that received a message and the post that answers it. Each such poll
                // takes completions stored earlier, so a poll that finds none, and sends,
                // comes soon. That poll sends only what was held: what it receives next
                // below is held afresh, for the answer to it.
                let n = st.dev.poll_cq(cq, max, out)?;
                if n > 0 {
                    return Ok(n);
                }
                if answer_from == Some(st.dev.completions_stored()) {
                    // An answer's hold ran out and this side's ACK never came. Now and then
                    // the peer was only late; but when it holds that ACK for the same reason
                    // (both sides sent a message at once, and each waits for its ACK before
                    // it sends again), both stall this long on every turn: after a few in a
                    // row, holds stay short for a while.
                    self.shared
                        .counters
                        .answer_holds_ran_out
                        .fetch_add(1, Ordering::Relaxed);
                    st.answer_holds.ran_out(
                        now,
                        ANSWER_HOLDS_RUN_OUT_IN_A_ROW,
                        ANSWER_HOLDS_OFF_NS,
                    );
                } else if answer_from.is_none() {
                    // The application took every completion of the CQ it polls and posted
                    // nothing: a receiver that does not answer (a stream of SENDs into it).
                    // (A post to any QP counts as an answer, so a ping-pong on one QP keeps a
                    // stream into another under holds.)
                    self.shared
                        .counters
                        .ack_holds_ran_out
                        .fetch_add(1, Ordering::Relaxed);
                    st.ack_holds
                        .ran_out(now, ACK_HOLDS_RUN_OUT_IN_A_ROW, ACK_HOLDS_OFF_NS);
                }
                progress::send(&self.shared, st, now);
            }
            _ => {}
        }
        let n = st.dev.poll_cq(cq, max, out)?;
        if n > 0 {
            if st.ack_holds.off_at(now) && st.deferred == Deferred::Nothing {
                // A receiver that does not answer, taking a round's completions a few at a
                // time: the frames that came meanwhile are taken now and their ACKs go,
                // instead of after the last of those completions. Its peer may wait for one
                // of them before it posts more (`ib_send_bw`'s sender, every 100th message,
                // whose packet its engine kicked early for this: see
                // `progress::KICK_SIGNALED_AFTER`). Not while ACKs are held for an answer,
                // nor when a message came that this side answers once its own ACK is in (a
                // ping-pong on another QP): the next empty poll treats those as it does.
                let answers = st.dev.answers_awaiting_acks();
                let received = progress::receive(&self.shared, st, now);
                if received > 0 {
                    self.shared
                        .counters
                        .rx_frames_while_draining
                        .fetch_add(received as u64, Ordering::Relaxed);
                    if st.dev.answers_awaiting_acks() == answers {
                        progress::send(&self.shared, st, now);
                    }
                }
            }
            return Ok(n);
        }
        let completions = st.dev.completions_stored();
        let requests = st.dev.ack_only_requests();
        let answers = st.dev.answers_awaiting_acks();
        progress::receive(&self.shared, st, now);
        if st.dev.completions_stored() != completions || st.dev.ack_only_requests() != requests {
            if st.dev.completion_events_used() {
                // An application that learns of completions from its completion channel: a
                // held ACK would reach the peer behind the answer, and the peer's events would
                // come in an order no RDMA NIC gives (see `progress::thread_round`). The ACKs
                // go now.
                progress::send(&self.shared, st, now);
                return st.dev.poll_cq(cq, max, out);
            }
            match st.deferred {
                Deferred::Nothing
                    if (st.ack_holds.off_at(now) && st.dev.answers_awaiting_acks() == answers)
                        || st.left_holds.off_at(now) =>
                {
                    // A receiver that has not been answering (see `ACK_HOLDS_OFF_NS`), or
                    // that leaves its verbs without answering (see `LeftHolds`): its peer's
                    // send queue waits for these ACKs, which go now, before the application
                    // takes its completions.
                    progress::send(&self.shared, st, now);
                }
                // Only an ACK for this side came (a send completion): nothing to hold. (Held,
                // the application's next post took it for an answer to a hold, see
                // `LeftHolds`.)
                Deferred::Nothing if !st.dev.transmit_queued() => {}
                Deferred::Nothing => {
                    // A message that came while this side waits for the ACK of its own (a
                    // ping-pong turn) is ahead of that ACK in the peer's kick, and the
                    // application answers once the ACK is in. On veth the ACK arrives a
                    // kernel pass (2-4 µs here) behind the message, often more than
                    // `ACK_HOLD_NS` on a busy host; the hold then sent this side's ACK
                    // alone, and a peer spinning on memory took its completion, left its
                    // verbs, and needed its progress thread for the answer behind it.
                    let answer =
                        st.dev.answers_awaiting_acks() != answers && !st.answer_holds.off_at(now);
                    let hold = if answer { ANSWER_HOLD_NS } else { ACK_HOLD_NS };
                    st.deferred = Deferred::AcksUntil {
                        until: now + hold,
                        answer_from: answer.then(|| st.dev.completions_stored()),
                        by_poll: true,
                    };
                    if st.left_holds.on_trial() {
                        // This application left a hold before: should it leave this one too,
                        // the thread sends it about `LEFT_HOLD_LATE_NS` late, not after its
                        // sleep (naps of up to `nap_alarm::MAX_POSTPONE_NS` next to a steady
                        // poller, or a transport timer's wait tens of milliseconds long).
                        let at = now + hold + LEFT_HOLD_LATE_NS + LEFT_HOLD_RING_MARGIN_NS;
                        self.shared.nap_alarm.ring_for_hold(now, at);
                        *trial = true;
                    }
                    if answer {
                        self.shared
                            .counters
                            .answer_holds
                            .fetch_add(1, Ordering::Relaxed);
                    }
                }
                Deferred::AcksUntil {
                    until,
                    answer_from: Some(c),
                    by_poll,
                } if c != st.dev.completions_stored() => {
                    // The ACK the answer waited for (or another completion) is in: from here
                    // the application answers at once or not at all.
                    st.deferred = Deferred::AcksUntil {
                        until: until.min(now + ACK_HOLD_NS),
                        answer_from: None,
                        by_poll,
                    };
                    st.answer_holds.in_a_row = 0;
                }
                _ => {}
            }
            // What a hold leaves unsent must not include frames built already.
            let _ = st.io.port.send_kept();
            return st.dev.poll_cq(cq, max, out);
        }
        if holding {
            // Nothing new: the application is between taking a completion and answering
            // (or waits on another CQ); the held ACKs may still ride with the answer. Frames
            // built already do not wait for them (an error is the next flush's).
            let _ = st.io.port.send_kept();
            return Ok(0);
        }
        // Frames held while the interface is down wait for it (the progress thread kicks them
        // when it comes back): a poll asks the kernel again only when the transport has work.
        if !st.dev.has_work(now) && (!st.io.port.tx_pending() || st.io.link_down) {
            // Nothing to send, no timer due: an application waiting for its peer. Skipping
            // the transmit round halves an empty poll, and a frame that lands meanwhile is
            // noticed that much sooner.
            st.deferred = Deferred::Nothing;
            return Ok(0);
        }
        progress::send(&self.shared, st, now);
        st.dev.poll_cq(cq, max, out)
    }

    /// A descriptor that polls readable while received frames wait for the engine, for an
    /// application thread about to block until a completion event (`ibv_get_cq_event`). That
    /// thread can then take the frames itself ([`Engine::take_frames`]) rather than wait for
    /// the progress thread to take them and wake it. `None` when the port has no such
    /// descriptor (a doorbell, which stays readable after its frames were taken) or the engine
    /// has stopped. The descriptor is the engine's: it is closed when the engine stops. Takes
    /// no lock.
    pub fn frames_fd(&self) -> Option<RawFd> {
        if self.shared.stop.load(Ordering::SeqCst) {
            return None;
        }
        self.frames_fd
    }

    /// Runs a round of progress (receive, timers, events, transmit) from the calling thread
    /// when no other thread is in the engine, as the progress thread would: the events the
    /// frames raise go to their completion channels. Never waits for the engine's lock.
    pub fn take_frames(&self) -> TakeFrames {
        if self.shared.stop.load(Ordering::SeqCst) {
            return TakeFrames::Stopped;
        }
        let Some(mut guard) = self.shared.try_state() else {
            return TakeFrames::OtherThread;
        };
        let st = &mut *guard;
        if st.io.failed {
            return TakeFrames::Stopped;
        }
        // As `progress_once`, which holds no ACK: nothing is held for an application that
        // learns of its completions from events (see `progress::thread_round`).
        let now = self.shared.now();
        let received = progress::receive(&self.shared, st, now);
        let round = progress::send(&self.shared, st, now);
        self.shared
            .counters
            .rx_frames_by_waiters
            .fetch_add(received as u64, Ordering::Relaxed);
        if round.more {
            // A long message's rest, or frames the ring had no room for: the thread's.
            drop(guard);
            self.shared.wake();
        } else {
            self.wake_for_sooner_deadline(st, false);
        }
        TakeFrames::Taken
    }

    /// Polls `cq` until at least one completion arrives or `timeout` passes; returns how many
    /// were appended to `out`.
    pub fn wait_cq(
        &self,
        cq: CqId,
        max: usize,
        out: &mut Vec<WorkCompletion>,
        timeout: Duration,
    ) -> Result<usize, VerbsError> {
        let deadline = Instant::now() + timeout;
        let mut st = self.lock();
        loop {
            let n = st.dev.poll_cq(cq, max, out)?;
            if n > 0 {
                return Ok(n);
            }
            let now = Instant::now();
            if now >= deadline || st.failed.is_some() {
                return Ok(0);
            }
            let wait = (deadline - now).min(Duration::from_millis(10));
            self.shared.progress_waiters.fetch_add(1, Ordering::SeqCst);
            st = self
                .shared
                .progressed
                .wait_timeout(st, wait)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            self.shared.progress_waiters.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// How long a destroyed RC QP answers its peer's resends of the requests it executed (see
/// `Device::destroy_qp_lingering`), and so how long closing a device can wait for that. A
/// peer resends when its retransmission timer fires: rdma_rxe with `timeout` 14, which the
/// rdma-core examples and perftest set, fires 67 ms after it armed the timer, at the latest
/// 67 ms after the message the destroyed QP last executed.
const LINGER_NS: u64 = 100_000_000;

/// How long `poll_cq` holds ACKs for the application's answer while the application finds
/// nothing to take. An answer comes within a microsecond or two of the completion it answers
/// (`ib_send_lat` posts its reply right after its poll); a peer whose application waits for
/// the ACK itself (a send completion) is late by about this much when no answer comes.
const ACK_HOLD_NS: u64 = 5_000;

/// How long `poll_cq` holds ACKs for a message that arrived while the application waited for
/// the ACK of its own one message in flight (`Device::answers_awaiting_acks`): until that ACK
/// arrives (then `ACK_HOLD_NS` more at most) or this long. As long as the progress thread's
/// hold (`THREAD_ACK_HOLD_NS`): the ACK comes a kernel pass behind the message, or later when
/// the peer's core was taken meanwhile.
const ANSWER_HOLD_NS: u64 = 50_000;

/// Two applications that each send one message and wait for its ACK before the next, at the
/// same time, hold each other's ACKs until their answer holds run out, on every turn. After
/// this many in a row ran out with no ACK for this side (one now and then is a late peer),
/// holds stay short for `ANSWER_HOLDS_OFF_NS`: such a pair then stalls a few times in that
/// long.
const ANSWER_HOLDS_RUN_OUT_IN_A_ROW: u32 = 3;
const ANSWER_HOLDS_OFF_NS: u64 = 10_000_000;

/// A hold for the application's answer (`ACK_HOLD_NS`) that runs out with no post from it
/// delays its peer's send completions, and with them the peer's sending: `ib_send_bw`'s
/// receiver never answers, and its sender, whose 128-deep send queue refills only when the
/// ACK for every 100th message comes, sat idle until the receiving application had taken all
/// the round's completions and the hold had run out. After this many such holds in a row,
/// ACKs go as soon as their requests are received, for `ACK_HOLDS_OFF_NS`; a post that answers
/// a hold starts the count again.
const ACK_HOLDS_RUN_OUT_IN_A_ROW: u32 = 3;
const ACK_HOLDS_OFF_NS: u64 = 10_000_000;

/// The shortest spell without `poll_cq` holds after the application left one (see
/// [`LeftHolds`]), and how many times it doubles at most while the application keeps leaving
/// them: up to 1.28 s.
const LEFT_HOLDS_OFF_NS: u64 = 10_000_000;
const LEFT_HOLDS_MAX_DOUBLINGS: u32 = 7;
/// How late the progress thread must find a poll's hold for it to count as left. An
/// application that spins on memory between its verbs (`ib_write_lat`) answers a few
/// microseconds after the hold ran out, often after this thread found it; under emulation (a
/// guest without KVM) an application takes tens of microseconds to answer. Neither is a reason
/// to stop holding. A hold left to the thread's alarm is a millisecond late or more.
pub(crate) const LEFT_HOLD_LATE_NS: u64 = 200_000;
/// How much later than `LEFT_HOLD_LATE_NS` past a hold on trial the thread wakes for it, so
/// that it finds the hold that late and counts it as left.
const LEFT_HOLD_RING_MARGIN_NS: u64 = 20_000;

/// The CPU the calling thread runs on (glibc reads it from the thread's rseq area: no system
/// call), or -1.
pub(crate) fn current_cpu() -> i32 {
    // SAFETY: sched_getcpu takes no arguments and has no preconditions.
    unsafe { libc::sched_getcpu() }
}

/// CLOCK_MONOTONIC in nanoseconds (what `Instant` reads).
fn monotonic_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into `t`, which lives across the call.
    // CLOCK_MONOTONIC always exists, so it cannot fail.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    (t.tv_sec as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(t.tv_nsec as u64)
}

/// The port an engine drives, and what goes with it.
struct OpenedPort {
    port: Box<dyn crate::port::Port>,
    /// What the progress thread sleeps on for frames.
    wait_fd: RawFd,
    /// The steering program's socket map the port's sockets are entered in (AF_XDP).
    xsks: Option<crate::xdp::XsksMap>,
    /// The steering program's copy of the device's addresses (AF_XDP, a program that has it).
    local_addrs: Option<crate::xdp::LocalAddrs>,
    /// The queues received on, the one sent on first.
    queues: Vec<u32>,
    queue_claims: Vec<queue_claim::QueueClaim>,
    zero_copy: bool,
    /// Why auto mode bound copy mode although the driver may have zero-copy.
    zero_copy_avoided: Option<&'static str>,
    /// Whether the port carries frames larger than one UMEM frame (DPDK's does); the
    /// configuration asked for it, but zero-copy may have done without (see
    /// [`XskSocket::open`]).
    multi_buffer: bool,
    /// IPv4 frames in runs may leave through a UDP socket ([`crate::udp_gso`]): the frames
    /// that did so far.
    udp_gso: Option<Arc<AtomicU64>>,
}

/// AF_XDP sockets on the interface's queues, entered into the steering program's map.
fn open_af_xdp(
    config: &EngineConfig,
    ifindex: u32,
    neighbours: &Neighbours,
    gids: &[IpAddr],
) -> Result<OpenedPort, EngineError> {
    // A DPDK engine's driver would see none of the frames this one's sockets take.
    if let Some(holder) = queue_claim::interface_holder(&config.iface) {
        return Err(EngineError::InterfaceInUse {
            iface: config.iface.clone(),
            holder: Some(holder),
        });
    }
    let mut xsks = crate::xdp::XsksMap::open(&config.iface)?;
    let mut local_addrs = crate::xdp::LocalAddrs::open(&config.iface)?;
    // The test-only knob outlives the test that set it: said here, since it would otherwise
    // show only as retransmissions.
    if let Ok(one_in @ 1..) = crate::xdp::drop_one_in(&config.iface) {
        crate::stderr_line!(
            "xroce: netdev {}: the XDP program's test-only drop knob is on: 1 RoCEv2 frame in \
             {one_in} is dropped (`cargo xtask xdp set-drop --iface {} --one-in 0` turns it off; so does \
             `xroce link del`, which unloads the program)",
            config.iface,
            config.iface
        );
    }
    let rx_queues = crate::afxdp::receive_queues_in_use(&config.iface)
        .unwrap_or_else(|| neighbours.rx_queues());
    let known_flaw = crate::afxdp::auto_mode_avoids_zero_copy(&config.iface);
    let (socket, others) = open_sockets(ifindex, config, known_flaw, rx_queues, neighbours.mtu())?;
    let zero_copy = socket.is_zero_copy();
    // Each socket chose its own way; frames too large for one that went without multi-buffer
    // would be lost on its queue, so the port carries them only if every socket does.
    let multi_buffer = std::iter::once(&socket)
        .chain(&others)
        .all(XskSocket::is_multi_buffer);
    let bound: Vec<(u32, RawFd)> = std::iter::once(&socket)
        .chain(&others)
        .map(|s| (s.queue(), s.as_raw_fd()))
        .collect();
    let queue_claims: Vec<_> = bound
        .iter()
        .filter_map(|&(queue, _)| queue_claim::claim(&config.iface, queue, multi_buffer))
        .collect();
    let max_frame = socket.max_tx_frame();
    // Zero-copy sockets hand the driver frames without a copy; batching through the kernel's
    // UDP stack pays where copy mode hands the driver one frame at a time (see `udp_gso`).
    let batching = match config.transmit {
        Transmit::Auto if zero_copy => AutoBatching::Off,
        Transmit::Auto => crate::udp_gso::auto_batching(&config.iface),
        Transmit::AfXdp => AutoBatching::Off,
        Transmit::UdpGso => AutoBatching::On,
    };
    let ((port, udp_gso), wait_fd) = if others.is_empty() {
        let fd = socket.as_raw_fd();
        (
            with_transmit(config, ifindex, max_frame, batching, socket)?,
            fd,
        )
    } else {
        let set = QueueSet::new(socket, others)?;
        let fd = set.wait_fd_raw();
        (
            with_transmit(config, ifindex, max_frame, batching, set)?,
            fd,
        )
    };
    // Before the sockets: from their first frame on, the program steers only what is the
    // device's (a previous engine's addresses are replaced).
    if let Some(map) = &mut local_addrs {
        map.set(gids)?;
    }
    // Entered once all are bound: a start that failed above left the map as it was.
    for &(queue, fd) in &bound {
        xsks.set(queue, fd)?;
    }
    Ok(OpenedPort {
        port,
        wait_fd,
        xsks: Some(xsks),
        local_addrs,
        queues: bound.iter().map(|&(q, _)| q).collect(),
        queue_claims,
        zero_copy,
        zero_copy_avoided: known_flaw.filter(|_| config.bind_mode == BindMode::Auto),
        multi_buffer,
        udp_gso,
    })
}

/// A port, and the count of frames it sent in batches when it may batch.
type PortAndBatched = (Box<dyn crate::port::Port>, Option<Arc<AtomicU64>>);

/// The AF_XDP port, wrapped to send runs of IPv4 frames through a UDP socket as `batching`
/// says. Left to choose (auto), a UDP socket that cannot be opened leaves everything to AF_XDP,
/// said on stderr; asked for, it is an error. Returns, when the port may batch, the count of
/// frames it sent in batches.
fn with_transmit<P: crate::port::Port + 'static>(
    config: &EngineConfig,
    ifindex: u32,
    max_frame: usize,
    batching: AutoBatching,
    port: P,
) -> Result<PortAndBatched, EngineError> {
    if batching == AutoBatching::Off {
        return Ok((Box::new(port), None));
    }
    match GsoSocket::open(&config.iface) {
        Ok(socket) => {
            let port = UdpGsoPort::new(
                port,
                socket,
                &config.iface,
                ifindex,
                max_frame,
                batching == AutoBatching::WhileSegmentedInSoftware,
                local_check(),
            );
            let batched = port.frames_batched();
            Ok((Box::new(port), Some(batched)))
        }
        Err(source) if config.transmit == Transmit::Auto => {
            crate::stderr_line!(
                "xroce: netdev {}: cannot open a UDP socket to send batches through ({source}); \
                 every frame goes through AF_XDP",
                config.iface
            );
            Ok((Box::new(port), None))
        }
        Err(source) => Err(EngineError::UdpGsoSocket {
            iface: config.iface.clone(),
            source,
        }),
    }
}

/// Tells whether an address is one of the namespace's own, asked in the namespace the calling
/// thread is in now (the engine's, while it starts) whichever thread asks later.
fn local_check() -> crate::udp_gso::LocalCheck {
    let home = home_netns::HomeNetns::current();
    Box::new(move |dst| {
        home_netns::run_at_home(home.as_ref(), || crate::udp_gso::is_local_ipv4(dst))
            .unwrap_or(true)
    })
}

/// A DPDK `net_af_packet` device on the interface. One engine per interface: the port's
/// kernel UDP socket is bound to the interface, and a second one is refused; an AF_XDP
/// engine's sockets would take the RoCEv2 frames before the driver sees them.
#[cfg(feature = "dpdk")]
fn open_dpdk(config: &EngineConfig) -> Result<OpenedPort, EngineError> {
    let in_use = |holder| EngineError::InterfaceInUse {
        iface: config.iface.clone(),
        holder,
    };
    if let Some(holder) = queue_claim::any_queue_holder(&config.iface) {
        return Err(in_use(Some(holder)));
    }
    let port = match crate::dpdk::DpdkPort::open(&config.iface) {
        Ok(port) => port,
        Err(crate::dpdk::DpdkError::RoceUdpPort { source, .. })
            if source.kind() == std::io::ErrorKind::AddrInUse =>
        {
            return Err(in_use(queue_claim::interface_holder(&config.iface)));
        }
        Err(e) => return Err(e.into()),
    };
    // The DPDK port carries frames of any size the interface takes.
    let multi_buffer = true;
    Ok(OpenedPort {
        wait_fd: port.doorbell_fd(),
        port: Box::new(port),
        xsks: None,
        local_addrs: None,
        queues: vec![0],
        queue_claims: queue_claim::claim_interface(&config.iface, multi_buffer)
            .into_iter()
            .collect(),
        zero_copy: false,
        zero_copy_avoided: None,
        multi_buffer,
        udp_gso: None,
    })
}

#[cfg(not(feature = "dpdk"))]
fn open_dpdk(_config: &EngineConfig) -> Result<OpenedPort, EngineError> {
    Err(EngineError::DpdkNotBuilt)
}

/// Binds the engine's socket on `config.queue` and, unless `config.all_rx_queues` is off, a
/// receive-only socket on each other receive queue of the interface (see [`QueueSet`]), in
/// ascending order of queue, so that of two engines starting together on one interface one
/// gets every queue instead of each waiting for the other's. `rx_queues` are the queues in use
/// (ethtool's channels), or those the driver allocated when it does not report channels: then
/// the first queue that cannot be bound ends the list. A queue another process holds fails the
/// start, naming the holder; so does any other failure to bind the engine's own queue.
/// `known_flaw` (the driver's zero-copy loses frames) turns auto mode into copy mode, and is
/// said on stderr when a forced zero-copy bind succeeds.
fn open_sockets(
    ifindex: u32,
    config: &EngineConfig,
    known_flaw: Option<&'static str>,
    rx_queues: u32,
    netdev_mtu: u32,
) -> Result<(XskSocket, Vec<XskSocket>), EngineError> {
    let fits_one_frame = crate::afxdp::fits_one_frame(netdev_mtu);
    let mode = match (config.bind_mode, known_flaw) {
        (BindMode::Auto, Some(_)) => BindMode::Copy,
        (mode, _) => mode,
    };
    let busy = |queue| EngineError::QueueInUse {
        iface: config.iface.clone(),
        queue,
        holder: queue_claim::holder(&config.iface, queue),
    };
    let steerable = crate::xdp::abi::XSKS_MAP_ENTRIES;
    let others_up_to = if config.all_rx_queues {
        if rx_queues > steerable {
            crate::stderr_line!(
                "xroce: {} uses {rx_queues} receive queues; xroce's XDP program steers RoCEv2 \
                 frames from the first {steerable} only (frames on the others go to the kernel)",
                config.iface
            );
        }
        rx_queues.min(steerable)
    } else {
        0
    };
    let mut main = None;
    let mut others = Vec::new();
    // Lowered when a queue turns out not to be in use: none past it is.
    let mut in_use = others_up_to;
    for queue in 0..others_up_to.max(config.queue + 1) {
        if queue == config.queue {
            let xsk = XskConfig {
                queue,
                mode,
                single_buffer: config.single_buffer,
                fits_one_frame,
                ..XskConfig::default()
            };
            let sock = XskSocket::open_when_free(ifindex, xsk, Duration::from_secs(1)).map_err(
                |e| match e {
                    XskError::QueueBusy { queue, .. } => busy(queue),
                    e => e.into(),
                },
            )?;
            if let (true, Some(flaw)) = (sock.is_zero_copy(), known_flaw) {
                crate::stderr_line!(
                    "xroce: {}: bound zero-copy, as asked, although {flaw}",
                    config.iface
                );
            }
            main = Some(sock);
        } else if queue < in_use {
            let xsk = XskConfig {
                queue,
                mode,
                single_buffer: config.single_buffer,
                fits_one_frame,
                ..RECEIVE_ONLY
            };
            match XskSocket::open_when_free(ifindex, xsk, Duration::from_secs(1)) {
                Ok(sock) => others.push(sock),
                Err(XskError::QueueBusy { queue, .. }) => return Err(busy(queue)),
                // A queue the driver allocated but does not use (the count came from
                // rtnetlink); forcing zero-copy reports such a queue as unsupported.
                Err(XskError::NoSuchQueue { .. } | XskError::ZeroCopyUnsupported { .. }) => {
                    in_use = queue;
                }
                Err(source) => {
                    return Err(EngineError::ReceiveQueue {
                        iface: config.iface.clone(),
                        queue,
                        source,
                    })
                }
            }
        }
    }
    // The loop's range includes `config.queue`, whose failure returned above.
    let main = main.ok_or(EngineError::Socket(XskError::NoSuchQueue {
        ifindex,
        queue: config.queue,
    }))?;
    Ok((main, others))
}

/// Errors of verbs that also touch the kernel's addressing.
#[derive(Debug, thiserror::Error)]
pub enum VerbError {
    #[error(transparent)]
    Verbs(VerbsError),
    #[error(transparent)]
    Addressing(AddressingError),
}

impl Engine {
    /// Stops the progress thread and hands the queue back to the kernel (RoCEv2 frames go to
    /// the kernel's stack again). Verbs still reach the device afterwards, but nothing moves
    /// frames for it. Stopping twice is harmless; dropping the engine stops it.
    pub fn stop(&self) {
        // ACKs an application's last poll left for later still go.
        self.send_deferred(&mut self.lock());
        // QPs destroyed a moment ago answer their peers' resends for a while (see
        // `Device::destroy_qp_lingering`); the progress thread does that, so it stays. (Not
        // after a first stop: there is no progress thread then.)
        if !self.shared.stop.load(Ordering::SeqCst) {
            while self.lock().dev.lingering(self.shared.now()) {
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
        }
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.sleeping.store(true, Ordering::SeqCst);
        self.shared.wake();
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = thread {
            let _ = t.join();
        }
        // Close the socket now (not when the last reference goes): the queue is free for the
        // next engine, in this process or another. The capture file is complete from here.
        let mut st = self.lock();
        // Frames built go, as a round's flush would have sent them.
        let _ = st.io.port.send_kept();
        st.io.close();
        st.queue_claims.clear();
        st.io.capture = None;
        st.neighbours.stop_keep_alive();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A device's first QPN from a random number: anywhere in the lower half of the QPN space
/// (from `FIRST_QPN`), so that a process's QPs rarely meet the numbers of a previous process on
/// the same device, and a long-lived one has 8 million numbers before it wraps.
fn random_first_qpn(random: u32) -> u32 {
    use xroce_core::transport::device::limits::FIRST_QPN;
    FIRST_QPN + random % (0x80_0000 - FIRST_QPN)
}

/// Fills `out` from the kernel's random source (memory keys must not be guessable).
fn getrandom(out: &mut [u8]) {
    let mut filled = 0;
    while filled < out.len() {
        let rest = &mut out[filled..];
        // SAFETY: the kernel writes at most `rest.len()` bytes into `rest`.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n > 0 {
            filled += n as usize;
        } else if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            // getrandom(2) without flags only fails on ancient kernels; keys then come from
            // the clock, which is still distinct per process.
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default()
                ^ u128::from(std::process::id());
            for (i, b) in rest.iter_mut().enumerate() {
                *b = (t >> (i % 16 * 8)) as u8 ^ i as u8;
            }
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{
        monotonic_ns, random_first_qpn, Backend, EngineError, LeftHolds, LEFT_HOLDS_MAX_DOUBLINGS,
        LEFT_HOLDS_OFF_NS,
    };
    use std::time::{Duration, Instant};
    use xroce_core::transport::device::limits::FIRST_QPN;

    /// Each hold left turns holds off for a spell twice as long as the last, up to the
    /// limit; a hold answered makes the next spell the shortest again.
    #[test]
    fn left_holds_turn_holds_off_for_spells_that_double_until_one_is_answered() {
        let mut holds = LeftHolds::default();
        assert!(!holds.off_at(0));
        let mut now = 1_000;
        for spell in 0..LEFT_HOLDS_MAX_DOUBLINGS + 3 {
            holds.left(now);
            let off = LEFT_HOLDS_OFF_NS << spell.min(LEFT_HOLDS_MAX_DOUBLINGS);
            assert!(holds.off_at(now + off - 1), "spell {spell}");
            assert!(!holds.off_at(now + off), "spell {spell}");
            now += off;
        }
        holds.answered();
        holds.left(now);
        assert!(holds.off_at(now + LEFT_HOLDS_OFF_NS - 1));
        assert!(!holds.off_at(now + LEFT_HOLDS_OFF_NS));
    }

    #[test]
    fn backends_are_named_as_users_write_them() {
        for (text, backend) in [
            ("", Backend::AfXdp),
            ("af_xdp", Backend::AfXdp),
            ("AF_XDP", Backend::AfXdp),
            ("afxdp", Backend::AfXdp),
            ("dpdk", Backend::Dpdk),
            (" DPDK\n", Backend::Dpdk),
        ] {
            assert_eq!(text.parse::<Backend>().ok(), Some(backend), "{text:?}");
        }
        for backend in [Backend::AfXdp, Backend::Dpdk] {
            assert_eq!(backend.to_string().parse::<Backend>().ok(), Some(backend));
        }
        let err = "rdma".parse::<Backend>().expect_err("unknown backend");
        assert!(matches!(err, EngineError::UnknownBackend(ref b) if b == "rdma"));
        assert!(
            err.to_string().contains("af_xdp (the default) or dpdk"),
            "{err}"
        );
    }

    /// Without the `dpdk` feature, asking for DPDK fails at once with what to do, before the
    /// interface is looked at.
    #[cfg(not(feature = "dpdk"))]
    #[test]
    fn a_build_without_dpdk_says_how_to_get_it() {
        use super::{Engine, EngineConfig};
        let err = Engine::start(EngineConfig {
            backend: Backend::Dpdk,
            ..EngineConfig::new("no-such-interface")
        })
        .err()
        .expect("DPDK without the feature");
        assert!(matches!(err, EngineError::DpdkNotBuilt), "{err}");
        assert!(err.to_string().contains("--features dpdk"), "{err}");
    }

    #[test]
    fn engine_time_is_the_monotonic_clock_in_nanoseconds() {
        let before = monotonic_ns();
        let started = Instant::now();
        std::thread::sleep(Duration::from_millis(3));
        let slept = started.elapsed();
        let after = monotonic_ns();
        // The same clock as `Instant`, read before and after it: it spans at least as much
        // (in the wrong unit, µs or ticks, it would span a thousandth of it or less).
        assert!(
            after - before >= slept.as_nanos() as u64,
            "{before} {after} {slept:?}"
        );
        assert!(after - before >= 3_000_000);
    }

    #[test]
    fn first_qpns_stay_in_the_lower_half_above_the_special_qps() {
        for r in [0, 1, 0x7f_ffee, 0x7f_ffef, 0x1234_5678, u32::MAX] {
            let q = random_first_qpn(r);
            assert!((FIRST_QPN..0x80_0000).contains(&q), "{r:#x} -> {q:#x}");
        }
        assert_eq!(random_first_qpn(0), FIRST_QPN);
        assert_ne!(random_first_qpn(1), random_first_qpn(2));
    }
}
