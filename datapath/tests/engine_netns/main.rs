//! End-to-end over a real veth pair between two network namespaces: an XDP program and an
//! engine on each side, RC/UC/UD traffic through AF_XDP sockets, every byte checked.
//!
//! Needs root (creates namespaces, loads XDP). Without root these tests fail unless
//! `XROCE_SKIP_ROOT_TESTS=1` says to skip them.
//!
//! One file per kind of situation; the helpers that more than one of them uses are here.

mod interfaces_and_addresses;
mod ports;
mod progress_and_holds;
mod traffic;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Barrier, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};
use xroce_datapath::netns::root_or_skip;

use std::os::fd::AsRawFd;
use xroce_core::transport::memory::{Access, MemoryRegion, PdId};
use xroce_core::transport::qp::{QpAttr, QpCap, QpInit};
use xroce_core::transport::qp_state::{AttrMask, PathMtu, QpState};
use xroce_core::transport::verbs::{
    RecvWr, SendFlags, SendOp, SendWr, Sge, UdDest, WcOpcode, WcStatus, WorkCompletion,
};
use xroce_core::transport::QpType;
use xroce_core::transport::{AddressVector, AhId, CqId};
use xroce_core::wire::{
    emit_frame, BthRepr, EtherType, EthernetAddress, EthernetRepr, FrameHeaders, IpAddress, IpRepr,
    Ipv4Repr, Opcode, RethRepr, TransportRepr, UdpRepr,
};
use xroce_datapath::afxdp::{XskConfig, XskSocket};
use xroce_datapath::engine::{Backend, Engine, EngineConfig, Transmit, VerbError};
use xroce_datapath::netlink::std_address;
use xroce_datapath::netns::NetnsPair;
use xroce_datapath::{registry, xdp};

const MIB: usize = 1 << 20;
/// Longest any single wait for a completion may take before the test fails.
const WAIT: Duration = Duration::from_secs(30);

/// Deterministic contents: byte `i` of stream `seed`.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Page-aligned memory registered with an engine.
struct Buffer {
    bytes: Vec<u8>,
    mr: MemoryRegion,
}

impl Buffer {
    fn new(engine: &Engine, pd: PdId, len: usize) -> Buffer {
        let mut bytes = vec![0u8; len];
        let access = Access::LOCAL_WRITE
            | Access::REMOTE_WRITE
            | Access::REMOTE_READ
            | Access::REMOTE_ATOMIC;
        // SAFETY: `bytes` is never reallocated and outlives the registration: `Buffer` derefs
        // the region before dropping the vector (see Drop ordering in the tests: engines are
        // dropped after buffers are no longer used by remote peers).
        let (_, mr) =
            unsafe { engine.reg_mr(pd, bytes.as_mut_ptr(), len, access) }.expect("reg_mr");
        Buffer { bytes, mr }
    }

    fn addr(&self, off: usize) -> u64 {
        self.mr.va + off as u64
    }

    fn sge(&self, off: usize, len: usize) -> Sge {
        Sge {
            addr: self.addr(off),
            length: len as u32,
            lkey: self.mr.lkey,
        }
    }

    /// Reads the bytes (the engine may write them concurrently; callers only read what is done).
    fn read(&self, off: usize, len: usize) -> Vec<u8> {
        // Volatile-free copy is fine: completions (taken under the engine lock) order the writes.
        self.bytes[off..off + len].to_vec()
    }

    /// One byte as it is now, for a thread that spins until a peer's WRITE lands.
    fn read_volatile(&self, off: usize) -> u8 {
        assert!(off < self.bytes.len());
        // SAFETY: in bounds (checked above) of a live allocation; a volatile read of a byte
        // the engine may be writing at the same time sees either the old or the new value.
        unsafe { std::ptr::read_volatile(self.bytes.as_ptr().add(off)) }
    }

    fn write(&mut self, off: usize, data: &[u8]) {
        self.bytes[off..off + data.len()].copy_from_slice(data);
    }
}

/// What one side tells the other to connect.
#[derive(Debug, Clone, Copy)]
struct Endpoint {
    qpn: u32,
    psn: u32,
    ip: IpAddress,
    va: u64,
    rkey: u32,
}

struct Qp {
    qpn: u32,
    send_cq: CqId,
    recv_cq: CqId,
    ty: QpType,
}

fn create_qp(engine: &Engine, pd: PdId, ty: QpType) -> Qp {
    engine.with_device(|d| {
        let send_cq = d.create_cq(8192).expect("create_cq");
        let recv_cq = d.create_cq(8192).expect("create_cq");
        let qpn = d
            .create_qp(QpInit {
                ty,
                pd,
                send_cq,
                recv_cq,
                srq: None,
                cap: QpCap {
                    max_send_wr: 1024,
                    max_recv_wr: 4096,
                    max_send_sge: 4,
                    max_recv_sge: 4,
                    max_inline_data: 128,
                },
                sq_sig_all: false,
            })
            .expect("create_qp");
        Qp {
            qpn,
            send_cq,
            recv_cq,
            ty,
        }
    })
}

fn qp_access() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC
}

/// RESET → INIT (receives may be posted from here on).
fn to_init(engine: &Engine, qp: &Qp) {
    let a = QpAttr {
        state: QpState::Init,
        port_num: 1,
        access: qp_access(),
        qkey: 0x1111_1111,
        ..QpAttr::default()
    };
    let m = AttrMask::STATE | AttrMask::PKEY_INDEX | AttrMask::PORT;
    let mask = match qp.ty {
        QpType::Ud => m | AttrMask::QKEY,
        _ => m | AttrMask::ACCESS_FLAGS,
    };
    engine.modify_qp(qp.qpn, &a, mask).expect("to INIT");
}

/// 4.096 µs × 2^12 ≈ 17 ms: well above a veth round trip, short enough to recover drops fast.
const DEFAULT_TIMEOUT: u8 = 12;

/// INIT → RTR → RTS, connected to `remote`.
fn bring_up(
    engine: &Engine,
    qp: &Qp,
    local_ip: IpAddress,
    remote: &Endpoint,
    sq_psn: u32,
    mtu: PathMtu,
) {
    bring_up_timed(engine, qp, local_ip, remote, sq_psn, mtu, DEFAULT_TIMEOUT);
}

/// [`bring_up`] with the local ACK timeout `timeout`.
fn bring_up_timed(
    engine: &Engine,
    qp: &Qp,
    local_ip: IpAddress,
    remote: &Endpoint,
    sq_psn: u32,
    mtu: PathMtu,
    timeout: u8,
) {
    let sgid_index = engine
        .gids()
        .iter()
        .position(|g| *g == Some(local_ip))
        .expect("local address in GID table") as u8;
    let m = AttrMask::STATE;
    let mut a = QpAttr {
        access: qp_access(),
        qkey: 0x1111_1111,
        ..QpAttr::default()
    };
    a.state = QpState::Rtr;
    a.path_mtu = mtu;
    a.dest_qpn = remote.qpn;
    a.rq_psn = remote.psn;
    a.max_dest_rd_atomic = 16;
    a.min_rnr_timer = 1;
    a.av = Some(AddressVector {
        dgid: remote.ip,
        sgid_index,
        traffic_class: 0,
        hop_limit: 64,
        flow_label: 0,
    });
    let rtr = match qp.ty {
        QpType::Rc => {
            m | AttrMask::AV
                | AttrMask::PATH_MTU
                | AttrMask::DEST_QPN
                | AttrMask::RQ_PSN
                | AttrMask::MAX_DEST_RD_ATOMIC
                | AttrMask::MIN_RNR_TIMER
        }
        QpType::Uc => m | AttrMask::AV | AttrMask::PATH_MTU | AttrMask::DEST_QPN | AttrMask::RQ_PSN,
        QpType::Ud => m,
    };
    engine.modify_qp(qp.qpn, &a, rtr).expect("to RTR");
    a.state = QpState::Rts;
    a.sq_psn = sq_psn;
    a.timeout = timeout;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.max_rd_atomic = 16;
    let rts = match qp.ty {
        QpType::Rc => {
            m | AttrMask::SQ_PSN
                | AttrMask::TIMEOUT
                | AttrMask::RETRY_CNT
                | AttrMask::RNR_RETRY
                | AttrMask::MAX_QP_RD_ATOMIC
        }
        _ => m | AttrMask::SQ_PSN,
    };
    engine.modify_qp(qp.qpn, &a, rts).expect("to RTS");
}

/// Waits for exactly `n` completions on `cq`, all successful, and returns them.
fn expect_completions(engine: &Engine, cq: CqId, n: usize, what: &str) -> Vec<WorkCompletion> {
    let mut out = Vec::with_capacity(n);
    let deadline = Instant::now() + WAIT;
    while out.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "{what}: {} of {n} completions after {WAIT:?}; engine counters {}, failure {:?}",
            out.len(),
            engine.stats_line(),
            engine.failure()
        );
        engine
            .wait_cq(
                cq,
                n - out.len(),
                &mut out,
                left.min(Duration::from_millis(500)),
            )
            .expect("poll_cq");
    }
    for wc in &out {
        assert_eq!(wc.status, WcStatus::Success, "{what}: {wc:?}");
    }
    out
}

/// What a panic said (its message, when it was a string).
fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(a panic without a message)".into())
}

/// Posts `count` send WRs built by `make`, keeping at most `window` outstanding, each signalled.
fn stream(
    engine: &Engine,
    qp: &Qp,
    count: usize,
    window: usize,
    what: &str,
    make: impl Fn(usize) -> SendWr,
) {
    let mut posted = 0;
    let mut done = 0;
    let mut wcs = Vec::new();
    let deadline = Instant::now() + WAIT * 2;
    while done < count {
        while posted < count && posted - done < window {
            engine.post_send(qp.qpn, make(posted)).expect("post_send");
            posted += 1;
        }
        wcs.clear();
        engine
            .wait_cq(qp.send_cq, 64, &mut wcs, Duration::from_millis(200))
            .expect("poll_cq");
        for wc in &wcs {
            assert_eq!(
                wc.status,
                WcStatus::Success,
                "{what}: {wc:?}; counters {:?}",
                engine.with_device(|d| d.counters())
            );
            assert_eq!(wc.wr_id as usize, done, "{what}: completions in order");
            done += 1;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {done} of {count} done after {:?}; counters {:?}",
            WAIT * 2,
            engine.with_device(|d| d.counters())
        );
    }
}

struct Setup {
    pair: NetnsPair,
    // Dropped after `pair` (fields drop in order): the namespaces are gone before the next
    // test that runs alone starts.
    _turn: Turn,
}

/// Tests that count transmit batches per round run alone; the others of this binary run in
/// parallel with each other. On two cores the parallel ones take the cores a ping-pong's
/// applications spin on, and an application kept off its core lets the ACKs held for its
/// answer go out on their own: `write_ping_pong_...` counted 2200-2900 batches for 2000 rounds
/// next to them, 2000-2500 alone (the code before holding ACKs for WRITEs: 3300-4000).
static TURNS: RwLock<()> = RwLock::new(());

enum Turn {
    Shared(#[allow(dead_code)] RwLockReadGuard<'static, ()>),
    Alone(#[allow(dead_code)] RwLockWriteGuard<'static, ()>),
}

impl Setup {
    /// Namespaces at `mtu`, the test running next to the other shared ones.
    fn new(mtu: u32) -> Setup {
        let turn = Turn::Shared(TURNS.read().unwrap_or_else(|p| p.into_inner()));
        Setup::with_turn(mtu, turn)
    }

    /// The same, with no other test of this binary running meanwhile.
    fn alone(mtu: u32) -> Setup {
        let turn = Turn::Alone(TURNS.write().unwrap_or_else(|p| p.into_inner()));
        Setup::with_turn(mtu, turn)
    }

    fn with_turn(mtu: u32, turn: Turn) -> Setup {
        Setup::with_queues(mtu, 1, turn)
    }

    /// Namespaces at `mtu` whose veth ends have `queues` queues each.
    fn with_queues(mtu: u32, queues: u32, turn: Turn) -> Setup {
        let pair = NetnsPair::with_queues("xreng", mtu, queues).expect("namespaces");
        for side in 0..2 {
            let iface = pair.iface(side).to_string();
            pair.run_in(side, move || {
                xdp::load(&xdp::LoadOptions::new(&iface)).expect("load XDP program");
            });
        }
        Setup { pair, _turn: turn }
    }

    /// Runs `body` on both sides at once, each in its namespace with an engine of its own;
    /// returns what each side returned, side 0 first. `T` is what the sides tell each other
    /// to connect (see [`Side::swap`]).
    fn on_both_sides<T, R>(&self, body: impl Fn(Side<T>) -> R + Send + Sync + 'static) -> [R; 2]
    where
        T: Send + 'static,
        R: Send + 'static,
    {
        self.on_both_sides_configured(|_, _| {}, body)
    }

    /// [`Setup::on_both_sides`] with engines configured by `configure` (given the side).
    fn on_both_sides_configured<T, R>(
        &self,
        configure: fn(usize, &mut EngineConfig),
        body: impl Fn(Side<T>) -> R + Send + Sync + 'static,
    ) -> [R; 2]
    where
        T: Send + 'static,
        R: Send + 'static,
    {
        let body = Arc::new(body);
        let (tx0, rx1) = mpsc::channel::<T>();
        let (tx1, rx0) = mpsc::channel::<T>();
        let connected = Arc::new(Barrier::new(2));
        let handles = [(0usize, tx0, rx0), (1, tx1, rx1)].map(|(index, to_peer, from_peer)| {
            let body = body.clone();
            let connected = connected.clone();
            let iface = self.pair.iface(index).to_string();
            let ip = IpAddress::V4(self.pair.ipv4(index).into());
            self.pair.spawn_in(index, move || {
                let mut config = EngineConfig::new(&iface);
                configure(index, &mut config);
                let engine = Engine::start(config).expect("engine");
                let pd = engine.with_device(|d| d.alloc_pd());
                body(Side {
                    index,
                    ip,
                    engine,
                    pd,
                    to_peer,
                    from_peer,
                    connected,
                })
            })
        });
        // When a side fails, the other is given a while to end too before the failure is
        // reported: the side that failed second (each waits at most `WAIT` for anything) often
        // says why the first did. (It may also wait for ever, at the barrier, for a side that
        // died before it: hence the bound.)
        let mut said = Vec::new();
        let mut results = Vec::new();
        for (i, handle) in handles.into_iter().enumerate() {
            let deadline = Instant::now() + WAIT + Duration::from_secs(5);
            while !said.is_empty() && !handle.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            if !said.is_empty() && !handle.is_finished() {
                said.push(format!("side {i}: still running"));
                continue;
            }
            match handle.join() {
                Ok(r) => results.push(r),
                Err(panic) => said.push(format!("side {i}: {}", panic_text(panic.as_ref()))),
            }
        }
        if !said.is_empty() {
            panic!("{}", said.join("\n"));
        }
        match <[R; 2]>::try_from(results) {
            Ok(both) => both,
            Err(_) => unreachable!("both sides returned"),
        }
    }
}

/// One side of a two-engine test (see [`Setup::on_both_sides`]).
struct Side<T> {
    index: usize,
    ip: IpAddress,
    engine: Engine,
    pd: PdId,
    to_peer: mpsc::Sender<T>,
    from_peer: mpsc::Receiver<T>,
    /// Both sides wait here once connected: UC and UD drop what arrives before the receiving
    /// QP is in RTR.
    connected: Arc<Barrier>,
}

impl<T> Side<T> {
    /// Tells the other side `mine` and returns what it told this one.
    fn swap(&self, mine: T) -> T {
        self.to_peer.send(mine).expect("send endpoint");
        self.from_peer.recv_timeout(WAIT).expect("peer endpoint")
    }
}

/// Connects `qp` with the peer's at path MTU `mtu`, telling the peer to use `buf` from
/// `offset` on; returns the peer's endpoint once both sides are connected.
fn connect_at(
    me: &Side<Endpoint>,
    qp: &Qp,
    buf: &Buffer,
    offset: usize,
    psn: u32,
    mtu: PathMtu,
) -> Endpoint {
    connect_timed_at(me, qp, buf, offset, psn, mtu, DEFAULT_TIMEOUT)
}

fn connect_timed_at(
    me: &Side<Endpoint>,
    qp: &Qp,
    buf: &Buffer,
    offset: usize,
    psn: u32,
    mtu: PathMtu,
    timeout: u8,
) -> Endpoint {
    let peer = me.swap(Endpoint {
        qpn: qp.qpn,
        psn,
        ip: me.ip,
        va: buf.addr(offset),
        rkey: buf.mr.rkey,
    });
    bring_up_timed(&me.engine, qp, me.ip, &peer, psn, mtu, timeout);
    me.connected.wait();
    peer
}

/// Posts signalled WRITEs of `msg` bytes each, message `i` of `messages` from `buf` at
/// `i * msg` to the peer's buffer at the same offset, with work request id `i`.
fn post_writes(
    engine: &Engine,
    qp: &Qp,
    buf: &Buffer,
    peer: &Endpoint,
    messages: std::ops::Range<usize>,
    msg: usize,
) {
    for i in messages {
        let wr = SendWr::new(
            i as u64,
            SendOp::RdmaWrite {
                remote_addr: peer.va + (i * msg) as u64,
                rkey: peer.rkey,
            },
            vec![buf.sge(i * msg, msg)],
        );
        engine.post_send(qp.qpn, wr).expect("post_send");
    }
}

/// Polls `cq` until `n` completions are in or `WAIT` passes (no status check).
fn poll_completions(engine: &Engine, cq: CqId, n: usize, what: &str) -> Vec<WorkCompletion> {
    let mut out = Vec::new();
    let deadline = Instant::now() + WAIT;
    while out.len() < n {
        assert!(
            Instant::now() < deadline,
            "{what}: {} of {n} completions after {WAIT:?} ({:?}); {}",
            out.len(),
            engine.failure(),
            engine.stats_line()
        );
        engine
            .poll_cq(cq, n - out.len(), &mut out)
            .expect("poll_cq");
        std::thread::sleep(Duration::from_millis(1));
    }
    out
}

/// An address handle on `engine` for `peer`, from this side's GID for `own`.
fn address_handle(engine: &Engine, pd: PdId, own: IpAddress, peer: IpAddress) -> AhId {
    let sgid_index = engine.gid_index(std_address(own)).expect("own GID");
    engine
        .create_ah(
            pd,
            AddressVector {
                dgid: peer,
                sgid_index,
                traffic_class: 0,
                hop_limit: 64,
                flow_label: 0,
            },
        )
        .expect("create_ah")
}

/// The engine's progress thread's kernel id, once it runs.
fn progress_thread_id(engine: &Engine) -> i32 {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(t) = engine.progress_thread_id() {
            return t;
        }
        assert!(Instant::now() < deadline, "no progress thread");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A 4 KiB buffer and an RC QP connected to a QP number nobody has at `peer`: what it sends
/// is never acknowledged, so its retransmissions time out.
fn connected_to_nobody(engine: &Engine, local: IpAddress, peer: IpAddress) -> (Buffer, Qp) {
    let pd = engine.with_device(|d| d.alloc_pd());
    let buf = Buffer::new(engine, pd, 4096);
    let qp = create_qp(engine, pd, QpType::Rc);
    to_init(engine, &qp);
    let nobody = Endpoint {
        qpn: 0x12345,
        psn: 0,
        ip: peer,
        va: 0,
        rkey: 0,
    };
    bring_up(engine, &qp, local, &nobody, 0, PathMtu::Mtu1024);
    (buf, qp)
}
