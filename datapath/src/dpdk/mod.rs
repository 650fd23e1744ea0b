//! The DPDK port (cargo feature `dpdk`): frames through a DPDK poll-mode driver instead of an
//! AF_XDP socket, behind the same [`Port`] trait, so the engine does not know which it drives.
//!
//! The driver is DPDK's `net_af_packet` on the engine's interface: it needs neither hugepages
//! (the environment starts with `--no-huge`) nor a device taken from the kernel, which keeps
//! the interface's addresses, ARP/ND and routes, as with AF_XDP. It sees every frame of the
//! interface (the engine sets aside what is not RoCEv2), and the kernel sees RoCEv2 frames
//! too: the port binds UDP port 4791 on the interface in the kernel, as rdma_rxe does, so that
//! the kernel does not answer each of them with an ICMP error.
//!
//! DPDK's drivers are polled: they have no descriptor to sleep on. That kernel socket is one:
//! every RoCEv2 frame the driver receives reaches it too (IPv6 ones with their zero UDP
//! checksum included: see `bind_roce_udp_port`), so it becomes readable when frames arrive, a
//! doorbell the progress thread sleeps on and silences before it takes frames
//! ([`Port::wait_fd_is_doorbell`]). An idle engine on this port thus sleeps as one on AF_XDP
//! does. A firewall that drops UDP 4791 in the kernel would silence it (AF_XDP takes frames
//! before the kernel's firewall). The DPDK calls themselves are static inline functions in
//! DPDK's headers; `dpdk/shim.c` wraps them.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::port::{Port, RxDrops};

/// Opaque DPDK types (`struct rte_mbuf`, `struct rte_mempool`).
type Mbuf = c_void;
type Mempool = c_void;

extern "C" {
    fn xroce_dpdk_eal_init(argc: c_int, argv: *mut *mut c_char) -> c_int;
    fn xroce_dpdk_strerror(err: c_int) -> *const c_char;
    fn xroce_dpdk_open(
        name: *const c_char,
        args: *const c_char,
        pool_name: *const c_char,
        mbufs: u32,
        data_room: u16,
        port: *mut u16,
        pool: *mut *mut Mempool,
        what: *mut *const c_char,
    ) -> c_int;
    fn xroce_dpdk_close(name: *const c_char, port: u16, pool: *mut Mempool);
    fn xroce_dpdk_rx(port: u16, bufs: *mut *mut Mbuf, n: u16) -> u16;
    fn xroce_dpdk_tx(port: u16, bufs: *mut *mut Mbuf, n: u16) -> u16;
    fn xroce_dpdk_data(m: *const Mbuf, len: *mut u32, pkt_len: *mut u32) -> *const u8;
    fn xroce_dpdk_read(m: *const Mbuf, len: u32, out: *mut u8) -> c_int;
    fn xroce_dpdk_alloc(pool: *mut Mempool, data: *mut *mut u8, room: *mut u32) -> *mut Mbuf;
    fn xroce_dpdk_set_len(m: *mut Mbuf, len: u32);
    fn xroce_dpdk_free(m: *mut Mbuf);
    fn xroce_dpdk_rx_drops(
        port: u16,
        missed: *mut u64,
        no_mbuf: *mut u64,
        errors: *mut u64,
    ) -> c_int;
}

/// Bytes of one frame slot in the driver's packet rings (`framesz`) and of one buffer. The
/// largest RoCEv2 frame is a 4096-byte payload with its headers (under 4 200 bytes over IPv6
/// with two VLAN tags), whatever the interface's MTU: path MTUs stop at 4096. Longer frames
/// (the kernel's own, on a jumbo link) reach the port cut to a slot, and are not RoCEv2.
const FRAME_SLOT: u32 = 4_608;
/// The largest frame the port sends: a slot less the ring's per-frame header (`tpacket2_hdr`
/// and the link-layer address, aligned), with margin.
pub const MAX_FRAME: usize = FRAME_SLOT as usize - 128;
/// Slots per ring block (`blocksz` = 8 slots, 9 pages of 4 KiB), and slots per ring.
const RING_BLOCK: u32 = 8 * FRAME_SLOT;
const RING_SLOTS: u32 = 512;
/// Buffers in the port's pool: a receive burst, the frames queued for a flush, and what the
/// driver holds in between.
const POOL_BUFFERS: u32 = 1024;
/// Frames taken from the driver per call.
const RX_BURST: usize = 64;
/// Frames queued before [`Port::send`] asks for a flush.
const TX_QUEUE: usize = 256;
/// Memory DPDK reserves at start for its pools (MiB): a port's pool is about 5 MiB, and a
/// process may run several engines (one per device).
const EAL_MEMORY_MB: &str = "128";
/// Extra arguments for DPDK's environment (whitespace-separated), e.g. `--log-level=7`.
pub const EAL_ARGS_ENV: &str = "XROCE_DPDK_EAL_ARGS";

#[derive(Debug, thiserror::Error)]
pub enum DpdkError {
    #[error(
        "DPDK's environment did not start ({0}); extra arguments can be given in {EAL_ARGS_ENV}"
    )]
    Eal(String),
    #[error("DPDK cannot {what} for {iface}: {reason}")]
    Open {
        iface: String,
        what: String,
        reason: String,
    },
    #[error(
        "cannot bind UDP port 4791 on {iface} in the kernel (is rdma_rxe using it?): {source}"
    )]
    RoceUdpPort { iface: String, source: io::Error },
}

fn strerror(err: c_int) -> String {
    // SAFETY: rte_strerror returns a pointer to a static or thread-local string.
    unsafe { CStr::from_ptr(xroce_dpdk_strerror(err)) }
        .to_string_lossy()
        .into_owned()
}

/// Starts DPDK's environment once per process (DPDK allows no second start); later ports add
/// their devices to it.
fn eal() -> Result<(), DpdkError> {
    static EAL: OnceLock<Result<(), String>> = OnceLock::new();
    EAL.get_or_init(|| {
        let mut args: Vec<String> = [
            "xroce",
            "--no-huge",
            "-m",
            EAL_MEMORY_MB,
            "--no-pci",
            // No files under /var/run/dpdk: each process has its own environment.
            "--no-shconf",
            "--no-telemetry",
            "--iova-mode=va",
            // Errors only (4 is ERR): DPDK's start-up notices and warnings would go to the
            // application's standard error.
            "--log-level=4",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        // One lcore, on a CPU this thread may run on (the shim gives the thread its affinity
        // back afterwards).
        args.push("-l".into());
        args.push(allowed_cpu().to_string());
        if let Ok(extra) = std::env::var(EAL_ARGS_ENV) {
            args.extend(extra.split_whitespace().map(str::to_string));
        }
        let owned: Vec<CString> = args
            .iter()
            .map(|a| CString::new(a.as_str()).map_err(|_| format!("argument {a:?} holds a NUL")))
            .collect::<Result<_, _>>()?;
        // rte_eal_init may reorder argv, and keeps pointers into it: both live for the process.
        let owned: &'static [CString] = Box::leak(owned.into_boxed_slice());
        let argv: &'static mut [*mut c_char] = Box::leak(
            owned
                .iter()
                .map(|a| a.as_ptr() as *mut c_char)
                .chain(std::iter::once(std::ptr::null_mut()))
                .collect::<Vec<_>>()
                .into_boxed_slice(),
        );
        // SAFETY: argv holds `owned.len()` valid NUL-terminated strings and a final null, all
        // leaked (they outlive the process's use of DPDK).
        let ret = unsafe { xroce_dpdk_eal_init(owned.len() as c_int, argv.as_mut_ptr()) };
        if ret < 0 {
            return Err(strerror(ret));
        }
        Ok(())
    })
    .clone()
    .map_err(DpdkError::Eal)
}

/// The lowest CPU the calling thread may run on (0 when that cannot be read).
fn allowed_cpu() -> usize {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity fills it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid cpu_set_t of the size given.
    let ok =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) }
            == 0;
    if !ok {
        return 0;
    }
    // SAFETY: CPU_ISSET reads the set within its size (CPU_SETSIZE).
    (0..libc::CPU_SETSIZE as usize)
        .find(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .unwrap_or(0)
}

/// Serialises device creation and removal: DPDK's device lists are not safe against
/// concurrent changes.
static DEVICES: Mutex<()> = Mutex::new(());

/// A DPDK `net_af_packet` device on one interface, with its buffer pool.
pub struct DpdkPort {
    name: CString,
    port: u16,
    pool: *mut Mempool,
    /// The interface's name (in the engine's network namespace).
    iface: String,
    /// Frames queued for the next flush.
    tx: Vec<*mut Mbuf>,
    rx: [*mut Mbuf; RX_BURST],
    /// Where a frame chained over several buffers is joined (not with `net_af_packet`, which
    /// receives each frame into one buffer).
    joined: Vec<u8>,
    /// The kernel socket on UDP port 4791: it keeps the kernel from answering RoCEv2 frames
    /// with ICMP errors, and is the port's doorbell (its buffer is the smallest there is: it
    /// holds a frame or two, and drops the rest).
    doorbell: OwnedFd,
}

// SAFETY: the buffers and the device queues are used by one thread at a time (the engine keeps
// its port under its lock); DPDK's receive and transmit calls may come from any thread, one at
// a time per queue, and its pool is thread-safe.
unsafe impl Send for DpdkPort {}

impl DpdkPort {
    /// Creates a `net_af_packet` device on `iface` (in the caller's network namespace) and
    /// starts it.
    pub fn open(iface: &str) -> Result<DpdkPort, DpdkError> {
        let roce_port = bind_roce_udp_port(iface).map_err(|source| DpdkError::RoceUdpPort {
            iface: iface.to_string(),
            source,
        })?;
        eal()?;
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let open_error = |what: &str, reason: String| DpdkError::Open {
            iface: iface.to_string(),
            what: what.to_string(),
            reason,
        };
        let name = CString::new(format!("net_af_packet_xroce{n}"))
            .map_err(|_| open_error("name the device", "NUL in name".into()))?;
        let pool_name = CString::new(format!("xroce_pool{n}"))
            .map_err(|_| open_error("name the pool", "NUL in name".into()))?;
        let args = CString::new(format!(
            "iface={iface},framesz={FRAME_SLOT},blocksz={RING_BLOCK},framecnt={RING_SLOTS},qdisc_bypass=1"
        ))
        .map_err(|_| open_error("name the interface", "NUL in the interface's name".into()))?;
        let mut port = 0u16;
        let mut pool = std::ptr::null_mut();
        let mut what: *const c_char = std::ptr::null();
        let ret = {
            let _devices = DEVICES.lock().unwrap_or_else(|p| p.into_inner());
            // SAFETY: all strings are NUL-terminated and live across the call; the out
            // pointers point at locals.
            unsafe {
                xroce_dpdk_open(
                    name.as_ptr(),
                    args.as_ptr(),
                    pool_name.as_ptr(),
                    POOL_BUFFERS,
                    FRAME_SLOT as u16,
                    &mut port,
                    &mut pool,
                    &mut what,
                )
            }
        };
        if ret < 0 {
            let what = if what.is_null() {
                "open the device".to_string()
            } else {
                // SAFETY: the shim sets `what` to a static string.
                unsafe { CStr::from_ptr(what) }
                    .to_string_lossy()
                    .into_owned()
            };
            // The driver's probe says only -1 (EPERM) whatever went wrong; DPDK logged why.
            let reason = if what == "create the virtual device" {
                format!(
                    "the net_af_packet driver refused it (DPDK's messages above say why; more \
                     with {EAL_ARGS_ENV}=--log-level=8)"
                )
            } else {
                strerror(ret)
            };
            return Err(open_error(&what, reason));
        }
        Ok(DpdkPort {
            name,
            port,
            pool,
            iface: iface.to_string(),
            tx: Vec::with_capacity(TX_QUEUE),
            rx: [std::ptr::null_mut(); RX_BURST],
            joined: Vec::new(),
            doorbell: roce_port,
        })
    }

    /// The descriptor that becomes readable when RoCEv2 frames arrive (see the module's text).
    pub fn doorbell_fd(&self) -> RawFd {
        self.doorbell.as_raw_fd()
    }

    /// Whether the interface is up and has a carrier (`IFF_UP` and `IFF_RUNNING`). Asked
    /// through the doorbell socket, which lives in the interface's network namespace. No such
    /// interface (gone, or renamed: the engine learns which from its address watcher) counts
    /// as down; another failure as running, so that frames are tried again.
    fn interface_running(&self) -> bool {
        // SAFETY: an all-zero ifreq is valid; the name is copied in below.
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        let name = self.iface.as_bytes();
        if name.len() >= req.ifr_name.len() {
            return true;
        }
        for (dst, &src) in req.ifr_name.iter_mut().zip(name) {
            *dst = src as c_char;
        }
        // SAFETY: SIOCGIFFLAGS reads the name and writes the flags within `req`.
        if unsafe { libc::ioctl(self.doorbell.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) } < 0 {
            return io::Error::last_os_error().raw_os_error() != Some(libc::ENODEV);
        }
        // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
        let flags = c_int::from(unsafe { req.ifr_ifru.ifru_flags });
        let wanted = libc::IFF_UP | libc::IFF_RUNNING;
        flags & wanted == wanted
    }

    /// A fresh buffer and its writable bytes, or `None` when the pool is empty.
    fn alloc(&mut self) -> Option<(*mut Mbuf, &mut [u8])> {
        let mut data = std::ptr::null_mut();
        let mut room = 0u32;
        // SAFETY: `pool` is this port's live pool; the out pointers point at locals.
        let m = unsafe { xroce_dpdk_alloc(self.pool, &mut data, &mut room) };
        if m.is_null() {
            return None;
        }
        let len = (room as usize).min(MAX_FRAME);
        // SAFETY: the buffer's `room` bytes from `data` are writable and belong to `m`, which
        // nobody else holds until it is queued or freed; `&mut self` keeps it borrowed.
        Some((m, unsafe { std::slice::from_raw_parts_mut(data, len) }))
    }
}

/// Binds UDP port 4791 (IPv6 and IPv4) on `iface` in the caller's network namespace, with the
/// smallest receive buffer: the kernel then queues the RoCEv2 frames it sees there, drops them
/// when full, and answers none with "port unreachable". Bound to the interface, it also makes
/// a second engine on the same interface fail (`EADDRINUSE`), as a second AF_XDP socket on a
/// queue does, while engines on other interfaces bind their own.
fn bind_roce_udp_port(iface: &str) -> io::Result<OwnedFd> {
    // SAFETY: socket(2) with constant arguments; the result is checked.
    let fd = unsafe { libc::socket(libc::AF_INET6, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let (zero, one): (c_int, c_int) = (0, 1);
    for (level, name, value) in [
        (libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, &zero),
        // The smallest the kernel allows.
        (libc::SOL_SOCKET, libc::SO_RCVBUF, &one),
        // RoCEv2 frames carry UDP checksum 0, which IPv6 forbids: the kernel drops them
        // before the socket unless told (rdma_rxe's socket says the same), and the doorbell
        // would not ring for IPv6.
        (libc::IPPROTO_UDP, libc::UDP_NO_CHECK6_RX, &one),
    ] {
        // SAFETY: `value` points at a c_int of the size given.
        let r = unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (value as *const c_int).cast(),
                std::mem::size_of::<c_int>() as libc::socklen_t,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    // SAFETY: the name's bytes and length are passed together.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_BINDTODEVICE,
            iface.as_ptr().cast(),
            iface.len() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: an all-zero sockaddr_in6 is the unspecified address, port 0; the port is set below.
    let mut addr: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
    addr.sin6_family = libc::AF_INET6 as libc::sa_family_t;
    addr.sin6_port = xroce_core::wire::ROCEV2_UDP_PORT.to_be();
    // SAFETY: `addr` is a valid sockaddr_in6 of the size given.
    let r = unsafe {
        libc::bind(
            fd,
            (&addr as *const libc::sockaddr_in6).cast(),
            std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(sock)
}

impl Port for DpdkPort {
    fn recv(&mut self, max: usize, deliver: &mut dyn FnMut(&[u8])) -> usize {
        let want = max.min(RX_BURST) as u16;
        // SAFETY: `rx` has room for `want` buffer pointers.
        let got = unsafe { xroce_dpdk_rx(self.port, self.rx.as_mut_ptr(), want) } as usize;
        for &m in &self.rx[..got] {
            let (mut len, mut pkt_len) = (0u32, 0u32);
            // SAFETY: `m` is a received buffer this port owns until it frees it below.
            let data = unsafe { xroce_dpdk_data(m, &mut len, &mut pkt_len) };
            if len == pkt_len {
                // SAFETY: the first segment holds `len` bytes at `data`, alive until freed.
                deliver(unsafe { std::slice::from_raw_parts(data, len as usize) });
            } else {
                self.joined.resize(pkt_len as usize, 0);
                // SAFETY: `joined` has `pkt_len` bytes of room.
                if unsafe { xroce_dpdk_read(m, pkt_len, self.joined.as_mut_ptr()) } == 0 {
                    deliver(&self.joined);
                }
            }
            // SAFETY: `m` is ours and no longer used.
            unsafe { xroce_dpdk_free(m) };
        }
        got
    }

    fn send(&mut self, frame: &[u8]) -> bool {
        let mut copy = |buf: &mut [u8]| {
            let dst = buf.get_mut(..frame.len())?;
            dst.copy_from_slice(frame);
            Some(frame.len())
        };
        // A frame larger than a buffer cannot be sent: dropped, as the AF_XDP port drops it.
        self.send_with(&mut copy)
    }

    fn send_with(&mut self, build: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> bool {
        if self.tx.len() >= TX_QUEUE {
            return false;
        }
        let Some((m, buf)) = self.alloc() else {
            return false;
        };
        let room = buf.len();
        match build(buf).filter(|&len| len > 0 && len <= room) {
            Some(len) => {
                // SAFETY: `m` is ours; `len` fits its room.
                unsafe { xroce_dpdk_set_len(m, len as u32) };
                self.tx.push(m);
            }
            // SAFETY: `m` is ours and unused.
            None => unsafe { xroce_dpdk_free(m) },
        }
        true
    }

    fn flush(&mut self) -> io::Result<()> {
        while !self.tx.is_empty() {
            let n = self.tx.len().min(u16::MAX as usize) as u16;
            // SAFETY: `tx` holds `n` buffers this port owns; the driver takes those it sends.
            let sent = unsafe { xroce_dpdk_tx(self.port, self.tx.as_mut_ptr(), n) } as usize;
            self.tx.drain(..sent);
            if sent == 0 {
                // The driver's ring is full, or the interface is down; then say so, as the
                // AF_XDP socket does, so that the engine waits for the link instead of
                // trying again at once. net_af_packet takes frames into its ring even when
                // the kernel refuses them, so this is seen only once the ring is full, and
                // DPDK 22.11's driver does not report the link: the kernel is asked.
                if !self.interface_running() {
                    return Err(io::Error::from_raw_os_error(libc::ENETDOWN));
                }
                break;
            }
        }
        Ok(())
    }

    fn tx_pending(&self) -> bool {
        !self.tx.is_empty()
    }

    fn wait_fd(&self) -> Option<RawFd> {
        Some(self.doorbell_fd())
    }

    fn wait_fd_is_doorbell(&self) -> bool {
        true
    }

    /// What the driver reports; `net_af_packet` reports none (its ring's drops are the
    /// kernel's, and it counts no buffer shortage), so on it these stay 0.
    fn rx_drops(&self) -> RxDrops {
        let (mut missed, mut no_mbuf, mut errors) = (0, 0, 0);
        // SAFETY: the out pointers point at locals.
        if unsafe { xroce_dpdk_rx_drops(self.port, &mut missed, &mut no_mbuf, &mut errors) } != 0 {
            return RxDrops::default();
        }
        RxDrops {
            ring_full: missed + no_mbuf,
            other: errors,
        }
    }
}

impl Drop for DpdkPort {
    fn drop(&mut self) {
        for m in self.tx.drain(..) {
            // SAFETY: queued buffers are ours.
            unsafe { xroce_dpdk_free(m) };
        }
        let _devices = DEVICES.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the device and pool were made by `open` and are used by nobody else now.
        unsafe { xroce_dpdk_close(self.name.as_ptr(), self.port, self.pool) };
    }
}
