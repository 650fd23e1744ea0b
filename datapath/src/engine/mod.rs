//! The engine: one transport [`Device`] on one interface queue, driven by a progress thread.
//!
//! The progress thread moves frames between the port (an AF_XDP socket) and the transport, runs
//! the transport's timers, and follows the kernel's addresses and neighbours. Applications call
//! the verbs through [`Engine`], which takes the device lock, and wake the thread when they gave
//! it work. The thread busy-polls while anything happened in the last
//! [`EngineConfig::spin`], and otherwise sleeps in `poll()` on the socket, a wake-up eventfd and
//! the address watcher, with the transport's next timer as the timeout: an idle engine costs
//! nothing (urdma's progress thread burned a core forever).
//!
//! Here: [`Engine`] (the verbs, with the lock and the hand-offs between the application and
//! the thread). Beside it: `config` (what to run on, and the start's errors), `open_port`
//! (the AF_XDP sockets or the DPDK port), `progress` (the thread and the rounds that move
//! frames), `ack_holds` (ACKs held for the application's answer), `nap_alarm` (the thread's
//! naps next to a polling application), `counters`, `addressing` (GIDs, routes, neighbours),
//! `keep_alive` (the next hops' neighbour entries kept fresh), `home_netns` (the namespace
//! the engine started in), `memory` (the application's memory as the transport reaches it),
//! `queue_claim` (which process holds a queue), `capture` (pcap), `hashing_copy` (the
//! payload's copy fused with its ICRC) and `report` (the state dump).

mod ack_holds;
mod addressing;
mod capture;
mod config;
mod counters;
pub mod hashing_copy;
mod home_netns;
mod keep_alive;
mod memory;
mod nap_alarm;
mod open_port;
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
use xroce_core::transport::{AddressVector, CqId, Device, DeviceConfig};
use xroce_core::wire::IpAddress;

use ack_holds::{Deferred, HoldsRunningOut, LeftHolds};
pub use addressing::{AddressingError, Applied, Neighbours};
pub use config::{Backend, EngineConfig, EngineError, EventSink, BACKEND_ENV};
pub use counters::EngineCounters;
pub use memory::ProcessMemory;
use open_port::{open_af_xdp, open_dpdk, OpenedPort};
pub use queue_claim::{holder as queue_holder, holder_multi_buffer, interface_holder, QueueHolder};

use crate::netlink::core_address;
pub use crate::udp_gso::Transmit;
pub use capture::{parse_capture_max, rotated_path as rotated_capture_path};

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
        fields.extend(c.fields());
        fields.extend([
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
    use super::{monotonic_ns, random_first_qpn};
    use std::time::{Duration, Instant};
    use xroce_core::transport::device::limits::FIRST_QPN;

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
