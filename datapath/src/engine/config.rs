//! What an engine runs on ([`EngineConfig`], [`Backend`]), and how starting one fails
//! ([`EngineError`]).

use std::sync::Arc;
use std::time::Duration;

use xroce_core::transport::Event;

use super::{AddressingError, QueueHolder, Transmit};
use crate::afxdp::{BindMode, XskError};
use crate::udp_gso::TRANSMIT_ENV;

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
    /// Also receive on the interface's other receive queues (see
    /// [`crate::afxdp::QueueSet`]): a NIC spreads flows over its queues, so a QP's frames may
    /// arrive on any. `queue` is the one the engine sends on.
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

#[cfg(test)]
mod tests {
    use super::{Backend, EngineError};

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
        use super::EngineConfig;
        use crate::engine::Engine;
        let err = Engine::start(EngineConfig {
            backend: Backend::Dpdk,
            ..EngineConfig::new("no-such-interface")
        })
        .err()
        .expect("DPDK without the feature");
        assert!(matches!(err, EngineError::DpdkNotBuilt), "{err}");
        assert!(err.to_string().contains("--features dpdk"), "{err}");
    }
}
