//! One AF_XDP socket with its own UMEM, bound to one queue of one interface.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;

use xroce_core::transport::qp_state::PathMtu;

use super::eviction::{LineEviction, TakenFrames};
use super::ring::Ring;
use super::umem::Umem;

/// Size of a UMEM frame. Outside hugetlbfs (which xroce does not use: transparent huge pages do
/// not count) a frame cannot span more than a page, so frames larger
/// than this (a 4096 path MTU gives 4154-byte frames) travel as several descriptors
/// (`XDP_USE_SG`).
pub const FRAME_SIZE: u32 = 4096;
/// Kicks one `flush` makes at most (each sends up to 32 frames in copy mode).
const MAX_KICKS_PER_FLUSH: usize = 8;
/// Descriptors a kick sends at most in copy mode (the kernel's `MAX_PER_SOCKET_BUDGET`).
const COPY_MODE_KICK_BUDGET: u32 = 32;
/// A transmit slot: two adjacent UMEM frames (see [`XskSocket::send_with`]).
const TX_SLOT: usize = 2 * FRAME_SIZE as usize;

/// Whether this kernel's AF_XDP sockets take multi-buffer frames (`XDP_USE_SG`, Linux 6.6+).
///
/// Probed once: a bind to interface index 0 with the flag fails with `EINVAL` where the flag is
/// unknown (the kernel checks flags first) and with `ENODEV` where it is known.
pub fn kernel_supports_multi_buffer() -> bool {
    static SUPPORTED: OnceLock<bool> = OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        // SAFETY: plain socket(2); closed below.
        let fd = unsafe { libc::socket(libc::AF_XDP, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            // No AF_XDP here, or no permission (a user's `ibv_devinfo`): the kernel's version
            // says it then, and opening a real socket will say why it cannot.
            return kernel_release_at_least(6, 6);
        }
        // SAFETY: `fd` is the socket just created and owned here.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let addr = libc::sockaddr_xdp {
            sxdp_family: libc::AF_XDP as u16,
            sxdp_flags: libc::XDP_COPY | libc::XDP_USE_SG,
            sxdp_ifindex: 0,
            sxdp_queue_id: 0,
            sxdp_shared_umem_fd: 0,
        };
        // SAFETY: `addr` is a valid sockaddr_xdp and its size is passed.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_xdp).cast(),
                std::mem::size_of::<libc::sockaddr_xdp>() as libc::socklen_t,
            )
        };
        !(rc != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL))
    })
}

/// Whether the running kernel's release is `major.minor` or later (from
/// `/proc/sys/kernel/osrelease`; true when that cannot be read).
fn kernel_release_at_least(major: u32, minor: u32) -> bool {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map_or(true, |release| release_at_least(&release, major, minor))
}

/// Whether kernel release text (`6.1.0-26-amd64`) names `major.minor` or later.
fn release_at_least(release: &str, major: u32, minor: u32) -> bool {
    let mut parts = release
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(|p| p.parse::<u32>().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0)) >= (major, minor)
}

/// The active path MTU of a port on a netdev with `netdev_mtu`: rdma_rxe's rule
/// ([`PathMtu::for_netdev_mtu`]), capped at 2048 where the sockets cannot carry frames larger
/// than one UMEM frame (no `multi_buffer`: a 4096-byte payload makes a 4154-byte frame).
pub fn port_path_mtu(netdev_mtu: u32, multi_buffer: bool) -> PathMtu {
    let mtu = PathMtu::for_netdev_mtu(netdev_mtu as usize);
    if mtu == PathMtu::Mtu4096 && !multi_buffer {
        PathMtu::Mtu2048
    } else {
        mtu
    }
}

/// One way of binding a socket: zero-copy or copy mode, with or without multi-buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BindAttempt {
    zero_copy: bool,
    multi_buffer: bool,
}

/// The binds [`XskSocket::open`] tries in `mode`, in order, going on to the next only when the
/// driver refuses zero-copy. Zero-copy comes first, with multi-buffer when it is asked for; then,
/// where the interface's frames fit one UMEM frame, zero-copy without it: many drivers'
/// zero-copy takes one buffer per frame (virtio-net's, for one) and refuses `XDP_USE_SG` with
/// `EOPNOTSUPP`, the answer of a driver without zero-copy too, and copy mode would cost such a
/// NIC a copy of every frame each way for a capability its MTU does not need. Copy mode last.
fn bind_attempts(mode: BindMode, multi_buffer: bool, fits_one_frame: bool) -> Vec<BindAttempt> {
    let mut attempts = Vec::with_capacity(3);
    if mode != BindMode::Copy {
        attempts.push(BindAttempt {
            zero_copy: true,
            multi_buffer,
        });
        if multi_buffer && fits_one_frame {
            attempts.push(BindAttempt {
                zero_copy: true,
                multi_buffer: false,
            });
        }
    }
    if mode != BindMode::ZeroCopy {
        attempts.push(BindAttempt {
            zero_copy: false,
            multi_buffer,
        });
    }
    attempts
}

/// How to bind the socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BindMode {
    /// Zero-copy when the driver supports it, copy mode otherwise (veth: copy).
    #[default]
    Auto,
    Copy,
    ZeroCopy,
}

/// The environment variable with which a program's engines bind their sockets in another
/// mode than `auto`: `copy` or `zero-copy` (as `xroce engine --mode`).
pub const BIND_MODE_ENV: &str = "XROCE_BIND_MODE";

impl BindMode {
    /// What `XROCE_BIND_MODE` names (unset or empty: auto).
    pub fn from_env() -> Result<BindMode, String> {
        crate::setting_from_env(BIND_MODE_ENV)
    }
}

impl std::str::FromStr for BindMode {
    type Err = String;

    fn from_str(s: &str) -> Result<BindMode, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(BindMode::Auto),
            "copy" => Ok(BindMode::Copy),
            "zero-copy" | "zero_copy" | "zerocopy" => Ok(BindMode::ZeroCopy),
            other => Err(format!(
                "unknown bind mode {other:?} in {BIND_MODE_ENV}: use auto (the default: \
                 zero-copy where the driver has it, copy mode elsewhere), copy or zero-copy"
            )),
        }
    }
}

/// Socket geometry and options.
#[derive(Debug, Clone, Copy)]
pub struct XskConfig {
    pub queue: u32,
    /// UMEM frames; half back the fill ring (receive), half are for transmit.
    pub frames: u32,
    /// Entries in each of the four rings (a power of two).
    pub ring_size: u32,
    pub mode: BindMode,
    /// Every frame backs the fill ring (up to its size) and none transmits: for a socket that
    /// only receives.
    pub receive_only: bool,
    /// Binds without multi-buffer even where the kernel has it, as on kernels before 6.6:
    /// frames then fit one UMEM frame. Tests use it to run that path on a newer kernel.
    pub single_buffer: bool,
    /// The interface's frames fit one UMEM frame at its MTU (see [`fits_one_frame`]): where
    /// the driver's zero-copy takes one buffer per frame and so refuses multi-buffer, zero-copy
    /// then binds without it rather than falling back to copy mode.
    pub fits_one_frame: bool,
    /// Leaves the cache lines of received frames where they are (no eviction, see
    /// `eviction`): for a receiver that never reads its frames (the benchmark's counting
    /// one), which eviction could only slow.
    pub leave_received_lines: bool,
}

/// Headroom the kernel leaves in front of a received frame in a UMEM frame
/// (`XDP_PACKET_HEADROOM`; the UMEM's own headroom is 0).
const XDP_HEADROOM: u32 = 256;

/// Whether every frame of an interface with `netdev_mtu` fits one UMEM frame behind the
/// kernel's headroom, so that sockets need no multi-buffer to carry it. Counted as newer
/// kernels count when they check a zero-copy bind without multi-buffer: the Ethernet header,
/// two VLAN tags and the frame check sequence, against the frame's room rounded down to 128
/// bytes (older kernels allow a few bytes more).
pub fn fits_one_frame(netdev_mtu: u32) -> bool {
    let room = (FRAME_SIZE - XDP_HEADROOM) / 128 * 128;
    netdev_mtu.saturating_add(14 + 2 * 4 + 4) <= room
}

impl XskConfig {
    /// Whether the socket is to carry frames larger than one UMEM frame (`XDP_USE_SG`).
    pub fn multi_buffer(&self) -> bool {
        binds_multi_buffer(self.single_buffer)
    }
}

/// Whether sockets asked for `single_buffer` (or not) bind with `XDP_USE_SG`: when the kernel
/// has it and they were not asked to do without.
pub fn binds_multi_buffer(single_buffer: bool) -> bool {
    !single_buffer && kernel_supports_multi_buffer()
}

impl Default for XskConfig {
    fn default() -> Self {
        Self {
            queue: 0,
            frames: 4096,
            ring_size: 2048,
            mode: BindMode::Auto,
            receive_only: false,
            single_buffer: false,
            fits_one_frame: false,
            leave_received_lines: false,
        }
    }
}

/// An interface as messages name it: its name when the displaying thread's namespace has it
/// (errors are shown where the engine starts, in the interface's namespace).
fn iface_label(ifindex: u32) -> String {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: `buf` has the IF_NAMESIZE bytes if_indextoname may write.
    let name = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
    if name.is_null() {
        return format!("interface index {ifindex}");
    }
    // SAFETY: on success the kernel wrote a NUL-terminated name into `buf`.
    let name = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
    name.to_string_lossy().into_owned()
}

/// Why a socket could not be opened, in words a user can act on.
#[derive(Debug, thiserror::Error)]
pub enum XskError {
    #[error("cannot create an AF_XDP socket: {0} (needs root or CAP_NET_RAW, and a kernel with CONFIG_XDP_SOCKETS)")]
    Create(io::Error),
    #[error("cannot allocate {bytes} bytes of UMEM: {source}")]
    Umem { bytes: usize, source: io::Error },
    #[error("AF_XDP setup ({step}) failed: {source}")]
    Setup {
        step: &'static str,
        source: io::Error,
    },
    #[error("queue {queue} of {} already has an AF_XDP socket bound (is another xroce engine running on it?)", iface_label(*ifindex))]
    QueueBusy { ifindex: u32, queue: u32 },
    #[error("{} has no queue {queue}", iface_label(*ifindex))]
    NoSuchQueue { ifindex: u32, queue: u32 },
    /// The queue receives, but the interface transmits on fewer queues: the kernel would take
    /// every frame sent there and send none (`__xsk_generic_xmit` skips such a queue).
    #[error(
        "{} transmits on {tx_queues} queue(s), so queue {queue} can receive but not send; use a queue below {tx_queues}",
        iface_label(*ifindex)
    )]
    NoTransmitQueue {
        ifindex: u32,
        queue: u32,
        tx_queues: u32,
    },
    #[error(
        "the driver of {} does not support zero-copy AF_XDP (auto mode, the default, binds in \
         copy mode there)",
        iface_label(*ifindex)
    )]
    ZeroCopyUnsupported { ifindex: u32 },
    #[error("{0}")]
    UnknownEviction(String),
    #[error(
        "cannot bind the AF_XDP socket to queue {queue} of {}: {source}",
        iface_label(*ifindex)
    )]
    Bind {
        ifindex: u32,
        queue: u32,
        source: io::Error,
    },
}

/// Kernel-side statistics of a socket (`XDP_STATISTICS`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct XskStats {
    pub rx_dropped: u64,
    pub rx_invalid_descs: u64,
    pub tx_invalid_descs: u64,
    pub rx_ring_full: u64,
    pub rx_fill_ring_empty_descs: u64,
    pub tx_ring_empty_descs: u64,
}

/// Joins a frame of two descriptors where it lies, if it can: returns the UMEM address and
/// length of the whole frame, or `None` (then the caller copies the pieces together).
///
/// In copy mode the kernel fills the first fragment to the end of its UMEM frame and puts
/// the rest behind the next frame's headroom. The fill ring hands out the receive frames in
/// address order, one after the other, and they come back in the order they arrived, so the
/// second frame nearly always directly follows the first (not where the receive area wraps
/// around). Then moving the second fragment down over that headroom makes the frame one
/// piece: a copy of its tail (74 bytes of a full 4 KiB RoCE packet) instead of the whole
/// frame. The second UMEM frame is this socket's until it goes back to the fill ring.
fn join_in_place(
    umem: &mut Umem,
    first: &libc::xdp_desc,
    second: &libc::xdp_desc,
) -> Option<(u64, u32)> {
    let frame = u64::from(FRAME_SIZE);
    let end = first.addr.checked_add(u64::from(first.len))?;
    if end % frame != 0 || second.addr & !(frame - 1) != end {
        return None;
    }
    let headroom = usize::try_from(second.addr - end).ok()?;
    let span = u32::try_from(headroom).ok()?.checked_add(second.len)?;
    let area = umem.slice_mut(end, span)?;
    area.copy_within(headroom.., 0);
    Some((first.addr, first.len.checked_add(second.len)?))
}

/// The UMEM the receiver read of a frame delivered from `addr` (its one descriptor, or the
/// first of two joined in place) whose last descriptor is `last`: of a joined frame, up to the
/// end of the second fragment's old place, which was read when it was moved down.
fn read_span(addr: u64, last: &libc::xdp_desc) -> (u64, u32) {
    let read_to = last.addr.saturating_add(u64::from(last.len));
    let len = u32::try_from(read_to.saturating_sub(addr)).unwrap_or(0);
    (addr, len)
}

/// An AF_XDP socket bound to (interface, queue), with a private UMEM.
///
/// Receive: half the frames sit in the fill ring; each received frame is handed to the caller
/// and its frame goes straight back to the fill ring. Transmit: frames come from a free list and
/// return to it through the completion ring.
pub struct XskSocket {
    // Field order matters for Drop: rings are unmapped and the socket closed before the UMEM.
    rx: Ring<libc::xdp_desc>,
    tx: Ring<libc::xdp_desc>,
    fill: Ring<u64>,
    comp: Ring<u64>,
    fd: OwnedFd,
    umem: Umem,
    free_tx: Vec<u64>,
    /// Reassembly buffer for multi-descriptor frames.
    scratch: Vec<u8>,
    zero_copy: bool,
    /// Bound with `XDP_USE_SG` (see [`XskConfig::multi_buffer`]).
    multi_buffer: bool,
    /// The frames received whose cache lines this CPU has yet to give up (copy mode; see
    /// `eviction`).
    taken: TakenFrames,
    /// A kick that ended on its budget (EAGAIN) was seen to move the kernel's consumer index:
    /// this kernel (6.17 and later) shows partial kicks, and a kick that shows no progress
    /// sent nothing (see `flush`).
    kernel_shows_partial_kicks: bool,
    /// The last `flush` left descriptors in the TX ring.
    left_queued: bool,
    ifindex: u32,
    queue: u32,
}

fn setsockopt<T>(
    fd: RawFd,
    name: libc::c_int,
    value: &T,
    step: &'static str,
) -> Result<(), XskError> {
    // SAFETY: `value` is a valid T for the duration of the call and its size is passed.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_XDP,
            name,
            (value as *const T).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(XskError::Setup {
            step,
            source: io::Error::last_os_error(),
        })
    }
}

fn getsockopt<T: Default>(fd: RawFd, name: libc::c_int, step: &'static str) -> Result<T, XskError> {
    let mut value = T::default();
    let mut len = std::mem::size_of::<T>() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes into `value`.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_XDP,
            name,
            (&mut value as *mut T).cast(),
            &mut len,
        )
    };
    if rc == 0 {
        Ok(value)
    } else {
        Err(XskError::Setup {
            step,
            source: io::Error::last_os_error(),
        })
    }
}

impl XskSocket {
    /// [`open`](Self::open), retrying "queue busy" for up to `patience`: a socket closed a
    /// moment ago (a process or engine that just exited) keeps its queue until the kernel's
    /// deferred cleanup runs, so only a queue still busy after that is another holder.
    pub fn open_when_free(
        ifindex: u32,
        config: XskConfig,
        patience: std::time::Duration,
    ) -> Result<Self, XskError> {
        let deadline = std::time::Instant::now() + patience;
        loop {
            match Self::open(ifindex, config) {
                Err(XskError::QueueBusy { .. }) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                other => return other,
            }
        }
    }

    /// Opens a socket on queue `config.queue` of interface `ifindex`.
    ///
    /// In `Auto` mode zero-copy is tried first and copy mode used when the driver refuses it.
    /// Multi-buffer (`XDP_USE_SG`) is requested when the kernel has it, so frames larger than a
    /// UMEM frame work; without it such frames cannot be sent or received ([`port_path_mtu`]
    /// keeps the transport's packets below that size). A driver whose zero-copy refuses
    /// multi-buffer gets zero-copy without it when `config.fits_one_frame`
    /// ([`Self::is_multi_buffer`] says which it was).
    pub fn open(ifindex: u32, config: XskConfig) -> Result<Self, XskError> {
        assert!(
            config.ring_size.is_power_of_two()
                && (config.frames >= 2 * config.ring_size
                    || (config.receive_only && config.frames >= config.ring_size))
        );
        // Once, before any bind: a word it does not know is the caller's error, whichever
        // mode the socket ends in.
        let eviction = if config.leave_received_lines {
            LineEviction::Off
        } else {
            LineEviction::for_copy_mode().map_err(XskError::UnknownEviction)?
        };
        let attempts = bind_attempts(config.mode, config.multi_buffer(), config.fits_one_frame);
        let bind = |a: &BindAttempt| {
            let config = XskConfig {
                single_buffer: config.single_buffer || !a.multi_buffer,
                ..config
            };
            let flag = if a.zero_copy {
                libc::XDP_ZEROCOPY
            } else {
                libc::XDP_COPY
            };
            Self::open_with(ifindex, config, flag, eviction)
        };
        let Some((last, first)) = attempts.split_last() else {
            return Self::open_with(ifindex, config, libc::XDP_COPY, eviction);
        };
        for a in first {
            match bind(a) {
                Err(XskError::ZeroCopyUnsupported { .. }) => continue,
                // Left to choose, anything but a queue in use goes on to the next way: the
                // kernel refuses zero-copy with multi-buffer before the driver is asked, but
                // without it the driver answers, and not always with an errno that says "no
                // zero-copy" (virtio-net's ENOENT without mergeable receive buffers, ENOMEM),
                // where copy mode works.
                Err(e)
                    if config.mode == BindMode::Auto
                        && !matches!(e, XskError::QueueBusy { .. }) =>
                {
                    log::debug!("zero-copy bind refused ({e}); trying the next way");
                    continue;
                }
                other => return other,
            }
        }
        bind(last)
    }

    /// One bind; a socket that ends in copy mode evicts its received lines as `eviction` says.
    fn open_with(
        ifindex: u32,
        config: XskConfig,
        copy_flag: u16,
        eviction: LineEviction,
    ) -> Result<Self, XskError> {
        // Copy mode only: its transmit path skips a queue past the interface's transmit queues
        // and reports success. (Zero-copy sends through the driver, and some drivers number
        // their zero-copy queues past the channel count.)
        if copy_flag == libc::XDP_COPY && !config.receive_only {
            let tx_queues = crate::afxdp::channels::transmit_queues_in_use(&iface_label(ifindex));
            if let Some(tx_queues) = tx_queues.filter(|&n| config.queue >= n) {
                return Err(XskError::NoTransmitQueue {
                    ifindex,
                    queue: config.queue,
                    tx_queues,
                });
            }
        }
        // Before the socket: on an error below, the socket (dropped first) is closed before
        // the area it registered is unmapped.
        let umem = Umem::new(config.frames)?;
        // SAFETY: plain socket(2); the fd is owned right away.
        let raw = unsafe { libc::socket(libc::AF_XDP, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if raw < 0 {
            return Err(XskError::Create(io::Error::last_os_error()));
        }
        // SAFETY: `raw` is a fresh fd nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let reg = libc::xdp_umem_reg {
            addr: umem.base() as u64,
            len: umem.len() as u64,
            chunk_size: FRAME_SIZE,
            headroom: 0,
            flags: 0,
            tx_metadata_len: 0,
        };
        let s = fd.as_raw_fd();
        setsockopt(s, libc::XDP_UMEM_REG, &reg, "register UMEM")?;
        let n = config.ring_size;
        setsockopt(s, libc::XDP_UMEM_FILL_RING, &(n * 2), "fill ring size")?;
        setsockopt(
            s,
            libc::XDP_UMEM_COMPLETION_RING,
            &n,
            "completion ring size",
        )?;
        setsockopt(s, libc::XDP_RX_RING, &n, "RX ring size")?;
        setsockopt(s, libc::XDP_TX_RING, &n, "TX ring size")?;
        let off: MmapOffsets = getsockopt(s, libc::XDP_MMAP_OFFSETS, "ring offsets")?;
        let off = off.0;
        let map_err = |step| move |source| XskError::Setup { step, source };
        let rx = Ring::map(s, n, libc::XDP_PGOFF_RX_RING as u64, &off.rx)
            .map_err(map_err("map RX ring"))?;
        let tx = Ring::map(s, n, libc::XDP_PGOFF_TX_RING as u64, &off.tx)
            .map_err(map_err("map TX ring"))?;
        let fill = Ring::map(s, n * 2, libc::XDP_UMEM_PGOFF_FILL_RING, &off.fr)
            .map_err(map_err("map fill ring"))?;
        let comp = Ring::map(s, n, libc::XDP_UMEM_PGOFF_COMPLETION_RING, &off.cr)
            .map_err(map_err("map completion ring"))?;

        let mut sock = Self {
            rx,
            tx,
            fill,
            comp,
            fd,
            umem,
            free_tx: Vec::new(),
            scratch: Vec::with_capacity(16 * 1024),
            zero_copy: false,
            multi_buffer: config.multi_buffer(),
            taken: TakenFrames::new(LineEviction::Off),
            kernel_shows_partial_kicks: false,
            left_queued: false,
            ifindex,
            queue: config.queue,
        };
        // First half of the UMEM receives, second half transmits (all of it receives for a
        // socket that only receives).
        let (rx_frames, free_tx) = split_umem(config.frames, config.receive_only);
        let fill_n = rx_frames.min(sock.fill.free());
        for i in 0..fill_n {
            sock.fill.push(u64::from(i) * u64::from(FRAME_SIZE));
        }
        sock.fill.submit();
        sock.free_tx = free_tx;

        let addr = libc::sockaddr_xdp {
            sxdp_family: libc::AF_XDP as u16,
            sxdp_flags: copy_flag
                | libc::XDP_USE_NEED_WAKEUP
                | if sock.multi_buffer {
                    libc::XDP_USE_SG
                } else {
                    0
                },
            sxdp_ifindex: ifindex,
            sxdp_queue_id: config.queue,
            sxdp_shared_umem_fd: 0,
        };
        // SAFETY: `addr` is a valid sockaddr_xdp and its size is passed.
        let rc = unsafe {
            libc::bind(
                s,
                (&addr as *const libc::sockaddr_xdp).cast(),
                std::mem::size_of::<libc::sockaddr_xdp>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            let e = io::Error::last_os_error();
            let queue = config.queue;
            return Err(match e.raw_os_error() {
                Some(libc::EBUSY) => XskError::QueueBusy { ifindex, queue },
                Some(libc::EOPNOTSUPP) if copy_flag == libc::XDP_ZEROCOPY => {
                    XskError::ZeroCopyUnsupported { ifindex }
                }
                Some(libc::EINVAL) if copy_flag == libc::XDP_ZEROCOPY => {
                    XskError::ZeroCopyUnsupported { ifindex }
                }
                Some(libc::EINVAL) => XskError::NoSuchQueue { ifindex, queue },
                _ => XskError::Bind {
                    ifindex,
                    queue,
                    source: e,
                },
            });
        }
        let opts: XdpOptions = getsockopt(s, libc::XDP_OPTIONS, "query options")?;
        sock.zero_copy = opts.0 & libc::XDP_OPTIONS_ZEROCOPY != 0;
        if !sock.zero_copy {
            sock.taken = TakenFrames::new(eviction);
        }
        Ok(sock)
    }

    pub fn is_zero_copy(&self) -> bool {
        self.zero_copy
    }

    /// Whether the socket is bound with multi-buffer (`XDP_USE_SG`): frames larger than a UMEM
    /// frame travel only then.
    pub fn is_multi_buffer(&self) -> bool {
        self.multi_buffer
    }

    pub fn queue(&self) -> u32 {
        self.queue
    }

    pub fn ifindex(&self) -> u32 {
        self.ifindex
    }

    /// Evicts the lines of the frames taken since the last eviction (see `TakenFrames`).
    pub(crate) fn evict_taken(&mut self) {
        let umem = &self.umem;
        self.taken.evict(|addr, len| umem.start_of(addr, len));
    }

    /// Receives up to `max` frames, calling `deliver` with each whole frame (descriptors of a
    /// multi-buffer frame are joined). Frames go back to the fill ring at once. Returns the
    /// number of frames delivered.
    pub fn recv(&mut self, max: usize, deliver: &mut dyn FnMut(&[u8])) -> usize {
        if self.taken.backlogged() {
            self.evict_taken();
        }
        let avail = self.rx.available();
        if avail == 0 {
            self.wake_fill_if_needed();
            return 0;
        }
        let mut used = 0u32;
        let mut frames = 0usize;
        while used < avail && frames < max {
            // Find the extent of the next frame: descriptors up to and including one without
            // XDP_PKT_CONTD. The kernel publishes whole frames, but stay safe if it did not.
            let mut end = used;
            loop {
                if end >= avail {
                    break;
                }
                let d = self.rx.peek(end);
                end += 1;
                if d.options & libc::XDP_PKT_CONTD == 0 {
                    break;
                }
            }
            let last = self.rx.peek(end - 1);
            if last.options & libc::XDP_PKT_CONTD != 0 {
                break; // incomplete frame: leave it for the next call
            }
            let joined = match end - used {
                1 => Some((last.addr, last.len)),
                2 => join_in_place(&mut self.umem, &self.rx.peek(used), &last),
                _ => None,
            };
            if let Some((addr, len)) = joined {
                if let Some(bytes) = self.umem.slice(addr, len) {
                    deliver(bytes);
                }
                let (at, read) = read_span(addr, &last);
                self.taken.note(len, at, read);
            } else {
                self.scratch.clear();
                let mut ok = true;
                for i in used..end {
                    let d = self.rx.peek(i);
                    match self.umem.slice(d.addr, d.len) {
                        Some(b) => self.scratch.extend_from_slice(b),
                        None => ok = false,
                    }
                }
                if ok {
                    deliver(&self.scratch);
                }
                let frame_len = u32::try_from(self.scratch.len()).unwrap_or(u32::MAX);
                for i in used..end {
                    let d = self.rx.peek(i);
                    self.taken.note(frame_len, d.addr, d.len);
                }
            }
            frames += 1;
            used = end;
        }
        // Hand the frames back: the fill ring has room for every RX frame, so this never fails.
        for i in 0..used {
            let d = self.rx.peek(i);
            self.fill.push(d.addr & !(u64::from(FRAME_SIZE) - 1));
        }
        self.fill.submit();
        self.rx.release(used);
        self.wake_fill_if_needed();
        frames
    }

    fn wake_fill_if_needed(&self) {
        if self.fill.needs_wakeup() {
            // SAFETY: a zero-length, non-blocking recvfrom only prods the driver.
            unsafe {
                libc::recvfrom(
                    self.fd.as_raw_fd(),
                    std::ptr::null_mut(),
                    0,
                    libc::MSG_DONTWAIT,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                );
            }
        }
    }

    /// Takes back transmit slots the kernel has finished with. A frame of two descriptors
    /// completes both; the slot is free again with its first.
    fn reap_completions(&mut self) {
        let n = self.comp.available();
        for i in 0..n {
            let addr = self.comp.peek(i);
            if addr.is_multiple_of(TX_SLOT as u64) {
                self.free_tx.push(addr);
            }
        }
        if n > 0 {
            self.comp.release(n);
        }
    }

    /// Largest frame one transmit slot holds: two UMEM frames with multi-buffer, one without.
    pub fn max_tx_frame(&self) -> usize {
        if self.multi_buffer {
            TX_SLOT
        } else {
            FRAME_SIZE as usize
        }
    }

    /// Lets `build` write one frame directly into a transmit slot of the UMEM and queues it
    /// (one descriptor, or two when it is larger than a UMEM frame). `build` returns the
    /// frame's length, or `None` to send nothing. Returns `false`, without calling `build`, when
    /// there is no room now (try again after `flush`). Call `flush` to make the kernel send.
    pub fn send_with(&mut self, build: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> bool {
        if self.free_tx.is_empty() {
            self.reap_completions();
        }
        if self.free_tx.is_empty() || self.tx.free() < 2 {
            return false;
        }
        let max = self.max_tx_frame();
        let Some(&addr) = self.free_tx.last() else {
            return false;
        };
        let Some(buf) = self.umem.slice_mut(addr, max as u32) else {
            return false;
        };
        let Some(len) = build(buf).filter(|&l| l > 0 && l <= max) else {
            return true; // nothing to send; the slot stays free
        };
        self.free_tx.pop();
        let first = len.min(FRAME_SIZE as usize) as u32;
        self.tx.push(libc::xdp_desc {
            addr,
            len: first,
            options: if len > FRAME_SIZE as usize {
                libc::XDP_PKT_CONTD
            } else {
                0
            },
        });
        if len > FRAME_SIZE as usize {
            self.tx.push(libc::xdp_desc {
                addr: addr + u64::from(FRAME_SIZE),
                len: len as u32 - first,
                options: 0,
            });
        }
        true
    }

    /// Queues one frame for transmission (copied into a transmit slot). Returns `false` when
    /// there is no room now (the caller retries after `flush`). A frame larger than a slot
    /// cannot be sent and is dropped. Call `flush` to make the kernel send.
    pub fn send(&mut self, frame: &[u8]) -> bool {
        if frame.len() > self.max_tx_frame() {
            return true;
        }
        self.send_with(&mut |buf| {
            buf[..frame.len()].copy_from_slice(frame);
            Some(frame.len())
        })
    }

    /// Publishes queued frames and kicks the kernel when it needs it (always in copy mode).
    ///
    /// In copy mode a kick sends at most 32 descriptors, so a batch larger than that takes
    /// several; the loop stops when the ring is empty or the kernel pushes back.
    pub fn flush(&mut self) -> io::Result<()> {
        let flushed = self.flush_kicking();
        self.left_queued = self.tx.outstanding() != 0;
        self.evict_taken();
        flushed
    }

    fn flush_kicking(&mut self) -> io::Result<()> {
        self.tx.submit();
        self.reap_completions();
        // Kicks that showed no progress although the kernel may have sent a budget's worth
        // (see below).
        let mut unseen_kicks = 0;
        for _ in 0..MAX_KICKS_PER_FLUSH {
            let before = self.tx.outstanding();
            if before == 0 || !self.tx.needs_wakeup() {
                return Ok(());
            }
            // SAFETY: a zero-length, non-blocking sendto only tells the kernel to walk the TX
            // ring.
            let rc = unsafe {
                libc::sendto(
                    self.fd.as_raw_fd(),
                    std::ptr::null(),
                    0,
                    libc::MSG_DONTWAIT,
                    std::ptr::null(),
                    0,
                )
            };
            let mut budget_used = false;
            if rc < 0 {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    // EAGAIN also ends a kick that used up its 32 descriptors with more
                    // queued: a 64 KiB message of sixteen two-descriptor frames fills a kick,
                    // and the ACK behind it waited for the next flush (a progress-thread
                    // wake-up, on every turn of `ib_write_lat` at 64 KiB). So a kick that
                    // moved frames is followed by another; one that moved none means the
                    // kernel is busy or out of buffers, and the frames stay queued for the
                    // next flush.
                    Some(libc::EAGAIN) => budget_used = true,
                    Some(libc::EBUSY) | Some(libc::ENOBUFS) => {}
                    _ => return Err(e),
                }
            }
            let after = self.tx.outstanding();
            if after < before {
                // A kernel that hides partial kicks still shows, on an EAGAIN kick, the rest
                // of a range it took in an earlier kick, so only a flush that began with the
                // ring empty can tell which kind of kernel this is.
                self.kernel_shows_partial_kicks |= budget_used && !self.left_queued;
                self.reap_completions();
                continue;
            }
            // Kernels before 6.17 publish their consumer index only once they emptied the
            // ring: a kick that ended on its budget sent 32 descriptors that do not show. Until
            // this kernel was seen to show them, an EAGAIN kick counts as having sent a
            // budget's worth while that many could have been queued (on a busy driver, which
            // also answers EAGAIN, that costs at most one extra kick per 32 queued).
            let unseen_budgets = (unseen_kicks + 1) * COPY_MODE_KICK_BUDGET;
            if budget_used && !self.kernel_shows_partial_kicks && before > unseen_budgets {
                unseen_kicks += 1;
                continue;
            }
            return Ok(()); // no progress: leave the rest for the next flush
        }
        Ok(())
    }

    /// Whether frames are still queued for the kernel to send (the engine keeps polling then).
    pub fn tx_pending(&self) -> bool {
        self.tx.outstanding() != 0
    }

    pub fn stats(&self) -> io::Result<XskStats> {
        let s: XdpStatistics = getsockopt(self.fd.as_raw_fd(), libc::XDP_STATISTICS, "statistics")
            .map_err(|e| match e {
                XskError::Setup { source, .. } => source,
                other => io::Error::other(other.to_string()),
            })?;
        let s = s.0;
        Ok(XskStats {
            rx_dropped: s.rx_dropped,
            rx_invalid_descs: s.rx_invalid_descs,
            tx_invalid_descs: s.tx_invalid_descs,
            rx_ring_full: s.rx_ring_full,
            rx_fill_ring_empty_descs: s.rx_fill_ring_empty_descs,
            tx_ring_empty_descs: s.tx_ring_empty_descs,
        })
    }
}

impl AsRawFd for XskSocket {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

// libc's XDP structs do not implement Default; these wrappers give zeroed values for getsockopt.

#[repr(transparent)]
struct MmapOffsets(libc::xdp_mmap_offsets);

impl Default for MmapOffsets {
    fn default() -> Self {
        // SAFETY: a plain-integer C struct; all zeros is a valid value.
        Self(unsafe { std::mem::zeroed() })
    }
}

#[repr(transparent)]
struct XdpStatistics(libc::xdp_statistics);

impl Default for XdpStatistics {
    fn default() -> Self {
        // SAFETY: a plain-integer C struct; all zeros is a valid value.
        Self(unsafe { std::mem::zeroed() })
    }
}

#[repr(transparent)]
#[derive(Default)]
struct XdpOptions(u32);

/// How `frames` UMEM frames are used: the number of receive frames (the first ones), and the
/// transmit slots' addresses (the rest, by two). Transmit slots are two adjacent frames, so
/// that a frame up to `TX_SLOT` bytes is built in one contiguous piece and goes out as one or
/// two descriptors; completions recognise a slot by its alignment to `TX_SLOT`, so the receive
/// part ends on an even frame and a last odd frame is left unused.
fn split_umem(frames: u32, receive_only: bool) -> (u32, Vec<u64>) {
    if receive_only {
        return (frames, Vec::new());
    }
    let rx_frames = (frames / 2) & !1;
    let free_tx = (rx_frames..frames.saturating_sub(1))
        .step_by(2)
        .rev()
        .map(|i| u64::from(i) * u64::from(FRAME_SIZE))
        .collect();
    (rx_frames, free_tx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bind_mode_is_read_by_its_name() {
        assert_eq!("".parse(), Ok(BindMode::Auto));
        assert_eq!("auto".parse(), Ok(BindMode::Auto));
        assert_eq!(" Copy ".parse(), Ok(BindMode::Copy));
        assert_eq!("zero-copy".parse(), Ok(BindMode::ZeroCopy));
        assert_eq!("zero_copy".parse(), Ok(BindMode::ZeroCopy));
        let err = "native".parse::<BindMode>().expect_err("not a bind mode");
        assert!(
            err.contains("\"native\"")
                && err.contains(BIND_MODE_ENV)
                && err.contains("copy or zero-copy"),
            "{err}"
        );
    }

    #[test]
    fn transmit_slots_are_whole_aligned_frame_pairs_inside_the_umem() {
        for frames in [4096u32, 4098, 4097, 4099, 7, 2, 1] {
            let (rx, tx) = split_umem(frames, false);
            assert!(rx <= frames / 2, "{frames}");
            for &a in &tx {
                assert_eq!(a % TX_SLOT as u64, 0, "{frames}: slot {a:#x} unaligned");
                assert!(
                    a / u64::from(FRAME_SIZE) + 2 <= u64::from(frames),
                    "{frames}: past the end"
                );
                assert!(
                    a / u64::from(FRAME_SIZE) >= u64::from(rx),
                    "{frames}: overlaps receive"
                );
            }
            assert_eq!(tx.len() as u32, (frames - rx) / 2, "{frames}");
        }
        assert_eq!(split_umem(4096, false).0, 2048);
        assert_eq!(split_umem(4096, true), (4096, Vec::new()));
    }

    #[test]
    fn kernel_releases_compare_by_major_then_minor() {
        assert!(!release_at_least("6.1.0-26-amd64\n", 6, 6));
        assert!(release_at_least("6.6.0", 6, 6));
        assert!(release_at_least("6.18.44-fc-v669", 6, 6));
        assert!(release_at_least("7.0-rc1", 6, 6));
        assert!(!release_at_least("5.19.17", 6, 6));
        assert!(!release_at_least("", 6, 6));
    }

    #[test]
    fn zero_copy_does_without_multi_buffer_before_copy_mode_where_frames_fit_one_umem_frame() {
        let zc = |multi_buffer| BindAttempt {
            zero_copy: true,
            multi_buffer,
        };
        let copy = |multi_buffer| BindAttempt {
            zero_copy: false,
            multi_buffer,
        };
        assert_eq!(
            bind_attempts(BindMode::Auto, true, true),
            [zc(true), zc(false), copy(true)]
        );
        // A 9000-byte MTU needs multi-buffer: copy mode keeps it rather than zero-copy drop it.
        assert_eq!(
            bind_attempts(BindMode::Auto, true, false),
            [zc(true), copy(true)]
        );
        // Without multi-buffer (kernels before 6.6, or not asked for) there is nothing to drop.
        assert_eq!(
            bind_attempts(BindMode::Auto, false, true),
            [zc(false), copy(false)]
        );
        assert_eq!(
            bind_attempts(BindMode::ZeroCopy, true, true),
            [zc(true), zc(false)]
        );
        assert_eq!(bind_attempts(BindMode::ZeroCopy, true, false), [zc(true)]);
        assert_eq!(bind_attempts(BindMode::Copy, true, true), [copy(true)]);
    }

    #[test]
    fn frames_fit_one_umem_frame_up_to_an_mtu_of_3814() {
        // 3814 + Ethernet header + two VLAN tags + FCS = 3840, a 4096-byte frame behind 256 of
        // headroom.
        assert!(fits_one_frame(1500));
        assert!(fits_one_frame(3814));
        assert!(!fits_one_frame(3815));
        assert!(!fits_one_frame(9000));
        assert!(!fits_one_frame(u32::MAX));
    }

    #[test]
    fn multi_buffer_probe_matches_the_kernel_version() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: creating an AF_XDP socket needs root");
            return;
        }
        // XDP_USE_SG for AF_XDP sockets arrived in Linux 6.6.
        assert_eq!(
            kernel_supports_multi_buffer(),
            kernel_release_at_least(6, 6)
        );
    }

    /// A frame the kernel split over two receive frames, as copy mode lays it out: the first
    /// fragment from behind the headroom to the end of its frame, the rest behind the next
    /// frame's headroom.
    fn split_frame(
        umem: &mut Umem,
        first_frame: u64,
        second_frame: u64,
        frame: &[u8],
    ) -> (libc::xdp_desc, libc::xdp_desc) {
        const HEADROOM: u64 = 256;
        let size = u64::from(FRAME_SIZE);
        let first_len = (size - HEADROOM) as usize;
        let first = libc::xdp_desc {
            addr: first_frame * size + HEADROOM,
            len: first_len as u32,
            options: libc::XDP_PKT_CONTD,
        };
        let second = libc::xdp_desc {
            addr: second_frame * size + HEADROOM,
            len: (frame.len() - first_len) as u32,
            options: 0,
        };
        for (d, bytes) in [
            (&first, &frame[..first_len]),
            (&second, &frame[first_len..]),
        ] {
            umem.slice_mut(d.addr, d.len)
                .expect("in the UMEM")
                .copy_from_slice(bytes);
        }
        (first, second)
    }

    #[test]
    fn a_frame_in_two_adjacent_receive_frames_is_joined_where_it_lies() {
        let mut umem = Umem::new(8).expect("UMEM");
        // A full 4 KiB RoCE packet: 4170 bytes, 74 of them in the second fragment.
        let frame: Vec<u8> = (0..4170u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let (first, second) = split_frame(&mut umem, 2, 3, &frame);
        let (addr, len) = join_in_place(&mut umem, &first, &second).expect("adjacent: joined");
        assert_eq!((addr, len), (first.addr, 4170));
        assert_eq!(umem.slice(addr, len).expect("in the UMEM"), &frame[..]);
        // What the receiver read, for eviction: the whole frame where it now lies, and the
        // second fragment's old place, which the join read.
        let (at, read) = read_span(addr, &second);
        let read = at..at + u64::from(read);
        assert!(read.contains(&first.addr) && read.contains(&(addr + u64::from(len) - 1)));
        assert!(read.contains(&second.addr) && read.end == second.addr + u64::from(second.len));
        assert_eq!(
            read_span(first.addr, &first),
            (first.addr, first.len),
            "one descriptor"
        );

        // Not adjacent (where the receive area wraps around): left to the caller's copy, and
        // nothing is moved.
        let (first, second) = split_frame(&mut umem, 5, 1, &frame);
        let before = umem.slice(0, 8 * FRAME_SIZE).expect("all").to_vec();
        assert_eq!(join_in_place(&mut umem, &first, &second), None);
        assert_eq!(umem.slice(0, 8 * FRAME_SIZE).expect("all"), &before[..]);

        // A first fragment that stops short of its frame's end is not followed directly by the
        // second either.
        let short = libc::xdp_desc {
            len: first.len - 1,
            ..first
        };
        let next = libc::xdp_desc {
            addr: 6 * u64::from(FRAME_SIZE) + 256,
            ..second
        };
        assert_eq!(join_in_place(&mut umem, &short, &next), None);
    }

    #[test]
    fn path_mtu_follows_rxe_and_fits_the_socket() {
        assert_eq!(port_path_mtu(1500, true), PathMtu::Mtu1024);
        assert_eq!(port_path_mtu(1500, false), PathMtu::Mtu1024);
        assert_eq!(port_path_mtu(9000, true), PathMtu::Mtu4096);
        let single = port_path_mtu(9000, false);
        assert_eq!(single, PathMtu::Mtu2048);
        // The largest frame then fits one UMEM frame.
        assert!(single.bytes() + 14 + 40 + 8 + 12 + 16 + 4 <= FRAME_SIZE as usize);
    }

    #[test]
    fn errors_name_the_interface() {
        // Index 1 is every network namespace's loopback.
        let e = XskError::NoSuchQueue {
            ifindex: 1,
            queue: 5,
        };
        assert_eq!(e.to_string(), "lo has no queue 5");
        let e = XskError::ZeroCopyUnsupported { ifindex: u32::MAX };
        assert!(e.to_string().contains("interface index 4294967295"), "{e}");
    }
}
