//! End-to-end over a real veth pair between two network namespaces: an XDP program and an
//! engine on each side, RC/UC/UD traffic through AF_XDP sockets, every byte checked.
//!
//! Needs root (creates namespaces, loads XDP). Without root these tests fail unless
//! `XROCE_SKIP_ROOT_TESTS=1` says to skip them.

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

/// Tests that count transmit batches per round run alone; the others of this file run in
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

    /// The same, with no other test of this file running meanwhile.
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

/// The RC workload: WRITE, READ, SEND and both atomics from side 0 to side 1; at least 100 MiB
/// in total, every byte compared.
fn rc_suite(mtu: u32, path_mtu: PathMtu, drop_one_in: u32, transmit: Transmit) {
    rc_suite_on(mtu, path_mtu, drop_one_in, [Backend::AfXdp; 2], transmit);
}

/// [`rc_suite`] with each side's engine on the backend given (client, server). With both ends'
/// XDP programs native, `Transmit::Auto` batches through a UDP socket on the veth pair
/// (checked), `Transmit::AfXdp` sends every frame through AF_XDP, as on a NIC.
fn rc_suite_on(
    mtu: u32,
    path_mtu: PathMtu,
    drop_one_in: u32,
    backends: [Backend; 2],
    transmit: Transmit,
) {
    let setup = Setup::new(mtu);
    if drop_one_in != 0 {
        for side in 0..2 {
            let iface = setup.pair.iface(side).to_string();
            setup.pair.run_in(side, move || {
                xdp::set_drop_one_in(&iface, drop_one_in).expect("drop knob");
            });
        }
    }
    const WRITE: usize = 40 * MIB;
    const READ: usize = 32 * MIB;
    const SEND: usize = 32 * MIB;
    const MSG: usize = 64 * 1024;
    const ATOMICS: usize = 500;

    let (to_server, from_client) = mpsc::channel::<Endpoint>();
    let (to_client, from_server) = mpsc::channel::<Endpoint>();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let (verified_tx, verified_rx) = mpsc::channel::<()>();

    let server_iface = setup.pair.iface(1).to_string();
    let server_ip = setup.pair.ipv4(1);
    let server = setup.pair.spawn_in(1, move || {
        let engine = Engine::start(EngineConfig {
            backend: backends[1],
            transmit,
            ..EngineConfig::new(&server_iface)
        })
        .expect("engine");
        assert_eq!(
            engine.sends_through_udp_gso(),
            backends[1] == Backend::AfXdp && transmit == Transmit::Auto,
            "the server's transmit path"
        );
        // What another process reads from the notes the engine leaves (on either backend).
        assert_eq!(
            xroce_datapath::engine::holder_multi_buffer(&server_iface),
            Some(engine.is_multi_buffer()),
            "the engine's note on {server_iface}"
        );
        let pd = engine.with_device(|d| d.alloc_pd());
        // [0, WRITE): WRITE target; [WRITE, +READ): READ source; then SEND target; then the
        // atomic counter.
        let mut buf = Buffer::new(&engine, pd, WRITE + READ + SEND + 64);
        buf.write(WRITE, &pattern(2, READ));
        let qp = create_qp(&engine, pd, QpType::Rc);
        to_init(&engine, &qp);
        for i in 0..SEND / MSG {
            engine
                .post_recv(
                    qp.qpn,
                    RecvWr {
                        wr_id: i as u64,
                        sg_list: vec![buf.sge(WRITE + READ + i * MSG, MSG)].into(),
                    },
                )
                .expect("post_recv");
        }
        let me = Endpoint {
            qpn: qp.qpn,
            psn: 0x10_0000,
            ip: IpAddress::V4(server_ip.into()),
            va: buf.addr(0),
            rkey: buf.mr.rkey,
        };
        to_client.send(me).expect("send endpoint");
        let client = from_client.recv_timeout(WAIT).expect("client endpoint");
        bring_up(&engine, &qp, me.ip, &client, me.psn, path_mtu);
        // The client's SENDs land in posted receives, in order.
        let recvs = expect_completions(&engine, qp.recv_cq, SEND / MSG, "SEND receives");
        for (i, wc) in recvs.iter().enumerate() {
            assert_eq!(wc.wr_id, i as u64);
            assert_eq!(wc.opcode, WcOpcode::Recv);
            assert_eq!(wc.byte_len as usize, MSG);
        }
        done_rx.recv_timeout(WAIT * 4).expect("client finished");
        assert!(
            buf.read(0, WRITE) == pattern(1, WRITE),
            "WRITE data differs"
        );
        assert!(
            buf.read(WRITE + READ, SEND) == pattern(3, SEND),
            "SEND data differs"
        );
        let counter = u64::from_le_bytes(buf.read(WRITE + READ + SEND, 8).try_into().unwrap());
        assert_eq!(counter, (ATOMICS as u64) * 3 + 1000, "atomic counter");
        verified_tx.send(()).expect("verified");
        let counters = engine.with_device(|d| d.counters());
        drop(buf);
        drop(engine);
        counters
    });

    let client_iface = setup.pair.iface(0).to_string();
    let client_ip = setup.pair.ipv4(0);
    let client = setup.pair.spawn_in(0, move || {
        let engine = Engine::start(EngineConfig {
            backend: backends[0],
            transmit,
            ..EngineConfig::new(&client_iface)
        })
        .expect("engine");
        assert_eq!(
            engine.sends_through_udp_gso(),
            backends[0] == Backend::AfXdp && transmit == Transmit::Auto,
            "the client's transmit path"
        );
        let pd = engine.with_device(|d| d.alloc_pd());
        // [0, WRITE): WRITE source (its first SEND bytes are the SEND source); [WRITE, +READ):
        // READ target; then SEND source; then atomic results.
        let mut buf = Buffer::new(&engine, pd, WRITE + READ + SEND + 8 * 2 * ATOMICS);
        buf.write(0, &pattern(1, WRITE));
        buf.write(WRITE + READ, &pattern(3, SEND));
        let qp = create_qp(&engine, pd, QpType::Rc);
        to_init(&engine, &qp);
        let me = Endpoint {
            qpn: qp.qpn,
            psn: 0xff_fff0, // wraps early: PSN arithmetic over the wire
            ip: IpAddress::V4(client_ip.into()),
            va: buf.addr(0),
            rkey: buf.mr.rkey,
        };
        to_server.send(me).expect("send endpoint");
        let server = from_server.recv_timeout(WAIT).expect("server endpoint");
        bring_up(&engine, &qp, me.ip, &server, me.psn, path_mtu);

        stream(&engine, &qp, WRITE / MSG, 32, "WRITE", |i| {
            SendWr::new(
                i as u64,
                SendOp::RdmaWrite {
                    remote_addr: server.va + (i * MSG) as u64,
                    rkey: server.rkey,
                },
                vec![buf.sge(i * MSG, MSG)],
            )
        });
        stream(&engine, &qp, READ / MSG, 16, "READ", |i| {
            SendWr::new(
                i as u64,
                SendOp::RdmaRead {
                    remote_addr: server.va + (WRITE + i * MSG) as u64,
                    rkey: server.rkey,
                },
                vec![buf.sge(WRITE + i * MSG, MSG)],
            )
        });
        assert!(
            buf.read(WRITE, READ) == pattern(2, READ),
            "READ data differs"
        );
        stream(&engine, &qp, SEND / MSG, 32, "SEND", |i| {
            SendWr::new(
                i as u64,
                SendOp::Send,
                vec![buf.sge(WRITE + READ + i * MSG, MSG)],
            )
        });
        // Atomics on the server's counter (starts at 0): CAS 0 -> 1000 first, then alternate
        // fetch-and-add of 1 and 2, each result landing in its own slot.
        let counter = server.va + (WRITE + READ + SEND) as u64;
        let results = WRITE + READ + SEND;
        stream(&engine, &qp, 1, 1, "CAS", |i| {
            SendWr::new(
                i as u64,
                SendOp::CompareSwap {
                    remote_addr: counter,
                    rkey: server.rkey,
                    compare: 0,
                    swap: 1000,
                },
                vec![buf.sge(results, 8)],
            )
        });
        stream(&engine, &qp, ATOMICS * 2, 8, "FETCH_ADD", |i| {
            SendWr::new(
                i as u64,
                SendOp::FetchAdd {
                    remote_addr: counter,
                    rkey: server.rkey,
                    add: 1 + (i as u64 % 2),
                },
                vec![buf.sge(results + 8 * i, 8)],
            )
        });
        // Original values: 1000, 1001, 1003, 1004, 1006, ... (CAS result slot 0 was overwritten
        // by the first FETCH_ADD, which also saw 1000).
        let mut expect = 1000u64;
        for i in 0..ATOMICS * 2 {
            let got = u64::from_le_bytes(buf.read(results + 8 * i, 8).try_into().unwrap());
            assert_eq!(got, expect, "fetch-add #{i} original value");
            expect += 1 + (i as u64 % 2);
        }
        done_tx.send(()).expect("done");
        verified_rx.recv_timeout(WAIT).expect("server verified");
        let counters = engine.with_device(|d| d.counters());
        drop(buf);
        drop(engine);
        counters
    });
    let client_counters = client.join().expect("client side");
    let server_counters = server.join().expect("server side");
    eprintln!("client counters: {client_counters:?}");
    eprintln!("server counters: {server_counters:?}");
    assert_eq!(client_counters.bad_icrc + server_counters.bad_icrc, 0);
    assert_eq!(
        client_counters.bad_checksum + server_counters.bad_checksum,
        0
    );
    // Nothing but RoCEv2 reached the transports (a DPDK port sees all of the interface's
    // frames; the others are the engine's to set aside).
    assert_eq!(client_counters.malformed + server_counters.malformed, 0);
    // Each side's frames came the way its backend takes them: through the steering program's
    // sockets, or past the program (no socket) to the DPDK driver.
    for (side, backend) in backends.into_iter().enumerate() {
        let iface = setup.pair.iface(side).to_string();
        let xdp = setup
            .pair
            .run_in(side, move || xdp::read_counters(&iface).expect("counters"));
        eprintln!("side {side} ({backend:?}) steering program: {xdp:?}");
        match backend {
            Backend::AfXdp => assert!(xdp.redirected > 1000 && xdp.roce_no_socket == 0),
            Backend::Dpdk => assert!(xdp.redirected == 0 && xdp.roce_no_socket > 1000),
        }
    }
    if drop_one_in != 0 {
        let dropped: u64 = (0..2)
            .map(|side| {
                let iface = setup.pair.iface(side).to_string();
                setup.pair.run_in(side, move || {
                    xdp::read_counters(&iface)
                        .expect("counters")
                        .dropped_by_knob
                })
            })
            .sum();
        eprintln!("frames dropped by the knob: {dropped}");
        assert!(dropped > 100, "the drop knob dropped only {dropped} frames");
        assert!(client_counters.retransmissions + server_counters.retransmissions > 0);
    }
}

/// The DPDK port (`net_af_packet`) against an AF_XDP engine: the same transfers, every byte
/// checked.
#[cfg(feature = "dpdk")]
#[test]
fn dpdk_port_against_af_xdp_moves_rc_traffic_mtu_1500() {
    if root_or_skip() {
        rc_suite_on(
            1500,
            PathMtu::Mtu1024,
            0,
            [Backend::Dpdk, Backend::AfXdp],
            Transmit::AfXdp,
        );
    }
}

/// Two DPDK ports at path MTU 4096 (netdev MTU 9000: one frame per packet, no multi-buffer).
#[cfg(feature = "dpdk")]
#[test]
fn dpdk_ports_move_rc_traffic_mtu_9000() {
    if root_or_skip() {
        rc_suite_on(
            9000,
            PathMtu::Mtu4096,
            0,
            [Backend::Dpdk, Backend::Dpdk],
            Transmit::Auto,
        );
    }
}

/// Every frame through AF_XDP, as on a NIC.
#[test]
fn rc_write_read_send_atomics_mtu_1500() {
    if root_or_skip() {
        rc_suite(1500, PathMtu::Mtu1024, 0, Transmit::AfXdp);
    }
}

/// Path MTU 4096 on a 9000-byte veth: frames of two UMEM frames each (multi-buffer), sent
/// through AF_XDP. A kernel without AF_XDP multi-buffer (before 6.6) carries at most 2048 (see
/// the README's known limits); there the same transfers run at that.
#[test]
fn rc_write_read_send_atomics_mtu_9000_multi_buffer() {
    if root_or_skip() {
        if xroce_datapath::afxdp::kernel_supports_multi_buffer() {
            rc_suite(9000, PathMtu::Mtu4096, 0, Transmit::AfXdp);
        } else {
            eprintln!("no AF_XDP multi-buffer in this kernel: path MTU 2048 instead of 4096");
            rc_suite(9000, PathMtu::Mtu2048, 0, Transmit::AfXdp);
        }
    }
}

/// The same at path MTU 4096 as the engine sends by default on a veth pair: runs of frames in
/// batches through a UDP socket.
#[test]
fn rc_write_read_send_atomics_mtu_9000_batched() {
    if root_or_skip() {
        let path_mtu = if xroce_datapath::afxdp::kernel_supports_multi_buffer() {
            PathMtu::Mtu4096
        } else {
            PathMtu::Mtu2048
        };
        rc_suite(9000, path_mtu, 0, Transmit::Auto);
    }
}

/// Batched, with 1 % of the RoCE frames dropped by the receivers' XDP programs.
#[test]
fn rc_transfers_survive_one_percent_loss() {
    if root_or_skip() {
        rc_suite(1500, PathMtu::Mtu1024, 100, Transmit::Auto);
    }
}

/// UC WRITEs and SENDs, and UD datagrams, in both directions at MTU 1500.
#[test]
fn uc_and_ud_exchanges() {
    if !root_or_skip() {
        return;
    }
    let setup = Setup::new(1500);
    const MSG: usize = 16 * 1024;
    const COUNT: usize = 64;
    const UD_MSG: usize = 1000; // fits the 1024-byte port MTU
    const UD_COUNT: usize = 200;
    setup.on_both_sides(|me: Side<(Endpoint, Endpoint)>| {
        let (side, ip, pd, engine) = (me.index, me.ip, me.pd, &me.engine);
        // Layout: [0, COUNT*MSG) UC source; then UC WRITE target; then UC SEND target;
        // then UD source; then UD receive area (GRH + payload per slot).
        let uc_src = 0;
        let uc_write = COUNT * MSG;
        let uc_recv = 2 * COUNT * MSG;
        let ud_src = 3 * COUNT * MSG;
        let ud_recv = ud_src + UD_COUNT * UD_MSG;
        let slot = 40 + UD_MSG;
        let mut buf = Buffer::new(engine, pd, ud_recv + UD_COUNT * slot);
        buf.write(uc_src, &pattern(10 + side as u64, COUNT * MSG));
        buf.write(ud_src, &pattern(20 + side as u64, UD_COUNT * UD_MSG));
        let uc = create_qp(engine, pd, QpType::Uc);
        let ud = create_qp(engine, pd, QpType::Ud);
        to_init(engine, &uc);
        to_init(engine, &ud);
        for i in 0..COUNT {
            engine
                .post_recv(
                    uc.qpn,
                    RecvWr {
                        wr_id: i as u64,
                        sg_list: vec![buf.sge(uc_recv + i * MSG, MSG)].into(),
                    },
                )
                .expect("post_recv uc");
        }
        for i in 0..UD_COUNT {
            engine
                .post_recv(
                    ud.qpn,
                    RecvWr {
                        wr_id: i as u64,
                        sg_list: vec![buf.sge(ud_recv + i * slot, slot)].into(),
                    },
                )
                .expect("post_recv ud");
        }
        let me_uc = Endpoint {
            qpn: uc.qpn,
            psn: 0x500 + side as u32,
            ip,
            va: buf.addr(uc_write),
            rkey: buf.mr.rkey,
        };
        let me_ud = Endpoint {
            qpn: ud.qpn,
            psn: 0,
            ip,
            va: 0,
            rkey: 0,
        };
        let (peer_uc, peer_ud) = me.swap((me_uc, me_ud));
        bring_up(engine, &uc, ip, &peer_uc, me_uc.psn, PathMtu::Mtu1024);
        bring_up(engine, &ud, ip, &peer_ud, 0x77, PathMtu::Mtu1024);
        me.connected.wait();
        // Receives are posted before the endpoints are exchanged,
        // so no message can arrive to an empty receive queue (UC and UD would drop it).
        stream(engine, &uc, COUNT, 16, "UC WRITE", |i| {
            SendWr::new(
                i as u64,
                SendOp::RdmaWrite {
                    remote_addr: peer_uc.va + (i * MSG) as u64,
                    rkey: peer_uc.rkey,
                },
                vec![buf.sge(uc_src + i * MSG, MSG)],
            )
        });
        stream(engine, &uc, COUNT, 16, "UC SEND", |i| {
            SendWr::new(
                i as u64,
                SendOp::SendWithImm { imm: i as u32 },
                vec![buf.sge(uc_src + i * MSG, MSG)],
            )
        });
        // What the peer sent us.
        let peer = 1 - side as u64;
        let uc_recvs = expect_completions(engine, uc.recv_cq, COUNT, "UC receives");
        for (i, wc) in uc_recvs.iter().enumerate() {
            assert_eq!(wc.wr_id, i as u64);
            assert_eq!(wc.imm, i as u32);
            assert_eq!(wc.byte_len as usize, MSG);
        }
        let peer_src = pattern(10 + peer, COUNT * MSG);
        assert!(
            buf.read(uc_write, COUNT * MSG) == peer_src,
            "UC WRITE data differs"
        );
        assert!(
            buf.read(uc_recv, COUNT * MSG) == peer_src,
            "UC SEND data differs"
        );
        // UC and UD are unreliable: a receiver short of buffers drops, as rdma_rxe and RDMA
        // NICs do. The engine's receive ring holds 2048 frames; the UC phase sends 2048 packets
        // each way, so it cannot overflow, but a UD burst on top of an undrained UC phase can
        // (on a loaded machine: 200 datagrams lost in a CI run, all the peer's UC had filled
        // the ring). So the UD phase starts when both sides have taken all the UC messages.
        me.connected.wait();
        let ah = address_handle(engine, pd, ip, peer_ud.ip);
        stream(engine, &ud, UD_COUNT, 16, "UD SEND", |i| {
            let mut wr = SendWr::new(
                i as u64,
                SendOp::Send,
                vec![buf.sge(ud_src + i * UD_MSG, UD_MSG)],
            );
            wr.ud = Some(UdDest {
                ah,
                remote_qpn: peer_ud.qpn,
                remote_qkey: 0x1111_1111,
            });
            wr
        });
        let ud_recvs = expect_completions(engine, ud.recv_cq, UD_COUNT, "UD receives");
        let peer_ud_src = pattern(20 + peer, UD_COUNT * UD_MSG);
        for (i, wc) in ud_recvs.iter().enumerate() {
            assert_eq!(wc.wr_id, i as u64, "veth does not reorder");
            assert_eq!(wc.byte_len as usize, 40 + UD_MSG);
            assert_eq!(wc.src_qp, peer_ud.qpn);
            let got = buf.read(ud_recv + i * slot + 40, UD_MSG);
            assert!(
                got == peer_ud_src[i * UD_MSG..(i + 1) * UD_MSG],
                "UD datagram {i} differs"
            );
        }
        // Let the peer finish reading before this engine (and its memory) goes away.
        me.connected.wait();
        drop(buf);
    });
}

/// An application that posts and never polls (unsignalled UD sends in a loop) still takes
/// the frames that come for its device: its posts look at the receive ring when nothing has
/// for `APP_ACTIVE_NS`. The peer's RC SEND to it is taken by those posts (not by its progress
/// thread, which keeps off while the application is in its verbs, and took it only after
/// about 100 ms of posting when posts never looked) and acknowledged while it goes on posting.
#[test]
fn an_application_that_only_posts_still_takes_its_frames() {
    if !root_or_skip() {
        return;
    }
    within_bounds_once_in_five(only_posting_run);
}

/// One run of [`an_application_that_only_posts_still_takes_its_frames`]: `Err` when the
/// poster's own verbs took none of the frames that came while it posted (its progress thread
/// did, which a host that preempts the poster can also cause).
fn only_posting_run() -> Result<(), String> {
    use std::sync::atomic::AtomicBool;
    // Set by side 0 once it is posting in its loop; side 1 sends only then.
    static POSTING: AtomicBool = AtomicBool::new(false);
    // Set by side 1 when its SEND's completion came; side 0 posts until then (or the limit).
    static ACKED: AtomicBool = AtomicBool::new(false);
    POSTING.store(false, Ordering::SeqCst);
    ACKED.store(false, Ordering::SeqCst);
    const POSTING_FOR: Duration = Duration::from_secs(3);
    let setup = Setup::new(1500);
    let [taken_by_posts, _] = setup.on_both_sides(|me: Side<(Endpoint, Endpoint)>| {
        let (side, ip, pd, engine) = (me.index, me.ip, me.pd, &me.engine);
        let mut buf = Buffer::new(engine, pd, 4096);
        buf.write(0, &pattern(30 + side as u64, 64));
        let rc = create_qp(engine, pd, QpType::Rc);
        let ud = create_qp(engine, pd, QpType::Ud);
        to_init(engine, &rc);
        to_init(engine, &ud);
        if side == 0 {
            engine
                .post_recv(
                    rc.qpn,
                    RecvWr {
                        wr_id: 1,
                        sg_list: vec![buf.sge(1024, 64)].into(),
                    },
                )
                .expect("post_recv");
        }
        let endpoint = |qpn, psn| Endpoint {
            qpn,
            psn,
            ip,
            va: 0,
            rkey: 0,
        };
        let (me_rc, me_ud) = (endpoint(rc.qpn, 0x900 + side as u32), endpoint(ud.qpn, 0));
        let (peer_rc, peer_ud) = me.swap((me_rc, me_ud));
        bring_up(engine, &rc, ip, &peer_rc, me_rc.psn, PathMtu::Mtu1024);
        bring_up(engine, &ud, ip, &peer_ud, 0x77, PathMtu::Mtu1024);
        me.connected.wait();
        let mut taken_by_posts = 0;
        if side == 1 {
            let t0 = Instant::now();
            while !POSTING.load(Ordering::SeqCst) {
                assert!(t0.elapsed() < WAIT, "side 0 never started posting");
                std::thread::sleep(Duration::from_millis(1));
            }
            engine
                .post_send(rc.qpn, SendWr::new(2, SendOp::Send, vec![buf.sge(0, 64)]))
                .expect("post_send");
            let wc = spin_for_one(
                engine,
                rc.send_cq,
                "the SEND's ACK from a peer that only posts",
            );
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
            ACKED.store(true, Ordering::SeqCst);
        } else {
            let ah = address_handle(engine, pd, ip, peer_ud.ip);
            let counters = engine.counters();
            // Frames taken other than by the progress thread: here, only by the posts.
            let by_verbs = || {
                counters.rx_frames.load(Ordering::SeqCst)
                    - counters.rx_frames_by_thread.load(Ordering::SeqCst)
            };
            let t0 = Instant::now();
            let mut posts = 0u64;
            let mut before = 0;
            while !ACKED.load(Ordering::SeqCst) && t0.elapsed() < POSTING_FOR {
                let mut wr = SendWr::new(posts, SendOp::Send, vec![buf.sge(0, 64)]);
                wr.ud = Some(UdDest {
                    ah,
                    remote_qpn: peer_ud.qpn,
                    remote_qkey: 0x1111_1111,
                });
                // Unsignalled: the send queue empties as each datagram goes, no CQ fills.
                wr.flags = SendFlags::NONE;
                engine.post_send(ud.qpn, wr).expect("post UD send");
                posts += 1;
                if posts == 1000 {
                    // Well inside its loop: from here on nothing but its posts looks for frames
                    // in its verbs.
                    before = by_verbs();
                    POSTING.store(true, Ordering::SeqCst);
                }
            }
            taken_by_posts = by_verbs() - before;
            eprintln!(
                "side 0: {posts} datagrams posted in {:?}, {taken_by_posts} frames taken by them",
                t0.elapsed()
            );
            assert!(posts > 1000, "side 0 stopped before side 1 sent");
            assert!(
                ACKED.load(Ordering::SeqCst),
                "the peer's SEND was not acknowledged in {POSTING_FOR:?} of posting without \
                 polling ({posts} posts)"
            );
            let wc = spin_for_one(engine, rc.recv_cq, "the peer's SEND");
            assert_eq!((wc.wr_id, wc.byte_len), (1, 64), "{wc:?}");
            assert!(
                buf.read(1024, 64) == pattern(31, 64),
                "the SEND's data differs"
            );
        }
        me.connected.wait();
        drop(buf);
        taken_by_posts
    });
    if taken_by_posts == 0 {
        return Err("the poster's progress thread, not its posts, took the peer's SEND".into());
    }
    Ok(())
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

/// Polls `cq` from this thread (the application's own progress, as a spinning verbs program
/// does) until one completion arrives.
fn spin_for_one(engine: &Engine, cq: CqId, what: &str) -> WorkCompletion {
    let deadline = Instant::now() + WAIT;
    let mut out = Vec::with_capacity(1);
    while out.is_empty() {
        engine.poll_cq(cq, 1, &mut out).expect("poll_cq");
        assert!(
            Instant::now() < deadline,
            "{what}: no completion after {WAIT:?}; counters {:?}",
            engine.with_device(|d| d.counters())
        );
    }
    assert_eq!(out[0].status, WcStatus::Success, "{what}: {:?}", out[0]);
    out[0]
}

/// A SEND ping-pong with both applications spinning on their CQs: each side's ACK for the
/// message it answers leaves in the same batch as the answer (one kick of the kernel), not in
/// a batch of its own ahead of it. Before, every round cost each side two transmit batches.
/// The last ACK still goes when the application destroys its QP right after its last poll.
#[test]
fn ping_pong_sends_each_ack_with_the_answer() {
    ping_pong_batching(SendCompletions::LastOnly);
}

/// The same ping-pong as `ib_send_lat` runs it: every send signalled, and each side spins on
/// its send CQ until the send is acknowledged before it looks for the answer. The question
/// arrives while the answering side still waits there; its ACK must wait for the answer all
/// the same (before, a poll of the send CQ sent it on its own: half the rounds cost an extra
/// batch, and a second system call on the latency path).
#[test]
fn ping_pong_waiting_on_each_send_sends_each_ack_with_the_answer() {
    ping_pong_batching(SendCompletions::EachWaited);
}

/// The same, with applications that take longer than the ACK hold between their send's
/// completion and their look for the answer, as under emulation (a QEMU guest without KVM runs
/// that stretch of perftest and the provider in tens of microseconds, not one). The question
/// is already waiting when the application looks: its ACK must still wait for the answer.
/// Before, the look that found the hold expired sent the ACK on its own first: 60 % of the
/// rounds in the benchmark's guests took two batches.
#[test]
fn ping_pong_with_slow_applications_sends_each_ack_with_the_answer() {
    ping_pong_batching(SendCompletions::EachWaitedThenThink);
}

#[derive(Clone, Copy, PartialEq)]
enum SendCompletions {
    /// Sends are unsignalled but for side 1's last.
    LastOnly,
    /// Every send is signalled and waited for right after it is posted.
    EachWaited,
    /// As `EachWaited`, and the application then spends `THINK` outside the verbs before it
    /// looks for the answer.
    EachWaitedThenThink,
}

/// Twice the ACK hold (5 µs).
const THINK: Duration = Duration::from_micros(10);

fn ping_pong_batching(mode: SendCompletions) {
    if !root_or_skip() {
        return;
    }
    within_bounds_once_in_five(|| ping_pong_batching_run(mode));
}

/// One run of [`ping_pong_batching`]: panics when messages or ACKs go missing; `Err` when
/// the transmit batches exceed their bound.
fn ping_pong_batching_run(mode: SendCompletions) -> Result<(), String> {
    let setup = Setup::alone(1500);
    const ROUNDS: usize = 2000;
    const MSG: usize = 64;
    let unanswered_acked = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let results = setup.on_both_sides(move |me: Side<Endpoint>| {
        let (side, pd, engine) = (me.index, me.pd, &me.engine);
        let buf = Buffer::new(engine, pd, 2 * ROUNDS * MSG + MSG);
        let qp = create_qp(engine, pd, QpType::Rc);
        to_init(engine, &qp);
        for i in 0..=ROUNDS {
            let wr = RecvWr {
                wr_id: i as u64,
                sg_list: vec![buf.sge(ROUNDS * MSG + i * MSG, MSG)].into(),
            };
            engine.post_recv(qp.qpn, wr).expect("post_recv");
        }
        connect_for_sends(&me, &qp, 0x900 + side as u32);
        let send = |i: usize| {
            let mut wr = SendWr::new(i as u64, SendOp::Send, vec![buf.sge(i * MSG, MSG)]);
            let signalled = match mode {
                SendCompletions::LastOnly => side == 1 && i + 1 == ROUNDS,
                SendCompletions::EachWaited | SendCompletions::EachWaitedThenThink => true,
            };
            if !signalled {
                wr.flags = xroce_core::transport::verbs::SendFlags::NONE;
            }
            engine.post_send(qp.qpn, wr).expect("post_send");
            if mode != SendCompletions::LastOnly {
                spin_for_one(engine, qp.send_cq, "the send's ACK");
            }
            if mode == SendCompletions::EachWaitedThenThink {
                let until = Instant::now() + THINK;
                while Instant::now() < until {
                    std::hint::spin_loop();
                }
            }
        };
        for i in 0..ROUNDS {
            if side == 0 {
                send(i);
                spin_for_one(engine, qp.recv_cq, "answer");
            } else {
                spin_for_one(engine, qp.recv_cq, "question");
                send(i);
            }
        }
        if mode != SendCompletions::LastOnly {
            // A message that gets no answer: side 1 takes it and keeps polling its empty
            // CQ, so the ACK held for an answer must go out on its own after a while.
            if side == 0 {
                send(ROUNDS);
                unanswered_acked.store(true, std::sync::atomic::Ordering::SeqCst);
            } else {
                spin_for_one(engine, qp.recv_cq, "the unanswered message");
                let deadline = Instant::now() + WAIT;
                let mut out = Vec::new();
                while !unanswered_acked.load(std::sync::atomic::Ordering::SeqCst) {
                    engine.poll_cq(qp.recv_cq, 1, &mut out).expect("poll_cq");
                    assert!(
                        Instant::now() < deadline,
                        "the ACK for an unanswered message was held for good"
                    );
                }
            }
        }
        if side == 0 {
            // Gone right after the last completion, as programs are: the ACK that
            // completion's poll left for later must still go out.
            engine
                .with_device(|d| d.destroy_qp(qp.qpn))
                .expect("destroy_qp");
        } else if mode == SendCompletions::LastOnly {
            expect_completions(engine, qp.send_cq, 1, "the last answer, acknowledged");
        }
        // Every verb above has returned, so none counts as inside (the progress thread keeps
        // off the engine while one is: for good, were the count wrong).
        let report = engine.state_report();
        assert!(
            report.contains("application threads in verbs 0,"),
            "side {side}: {report}"
        );
        let c = engine.counters();
        let frames = c.tx_frames.load(std::sync::atomic::Ordering::Relaxed) as usize;
        let batches = c.tx_batches.load(std::sync::atomic::Ordering::Relaxed) as usize;
        let acks = engine.with_device(|d| d.counters()).tx_responses as usize;
        (side, frames, batches, acks)
    });
    // What must hold in every run, on both sides, before the bounds that may be retried.
    for &(side, frames, _, acks) in &results {
        assert!(
            acks >= ROUNDS - 1,
            "side {side}: every message is acknowledged ({acks} ACKs for {ROUNDS})"
        );
        assert!(frames >= ROUNDS + acks, "side {side}: {frames} frames");
    }
    for (side, frames, batches, _) in results {
        // One batch per round, with some slack for rounds the progress thread took over. An
        // application that thinks outside the verbs looks gone to the progress thread, which
        // then sends what is held: in 1-25 % of the rounds here, and in CI runs on busy hosts
        // 51 % and once 79 % (3 014 and 3 571 batches). ACKs on their own cost every round
        // two batches, 4 000 in all, in every run.
        let slack = match mode {
            SendCompletions::EachWaitedThenThink => ROUNDS * 3 / 4,
            _ => ROUNDS / 4,
        };
        if batches > ROUNDS + slack {
            return Err(format!(
                "side {side}: {batches} transmit batches for {frames} frames in {ROUNDS} \
                 rounds: ACKs go out on their own"
            ));
        }
    }
    Ok(())
}

/// A WRITE ping-pong as `ib_write_lat` runs it: each side writes the round's tag into the
/// peer's buffer, spins on its send CQ until that WRITE is acknowledged, and otherwise spins
/// on its own memory, outside the verbs, until the peer's WRITE lands there. A WRITE stores
/// no completion at the responder, and one that lands while its application spins on memory
/// is taken by the progress thread; either way its ACK must wait for the answer and leave in
/// the same batch, so that the peer, polling for that ACK, also receives the answer and never
/// needs its progress thread. Before, those ACKs went out on their own: 1.5-1.8 batches per
/// round on each side, a progress thread woken for every turn, and `ib_write_lat` 40-50 µs
/// one-way on this VM's two busy cores (8-12 µs after).
#[test]
fn write_ping_pong_spinning_on_memory_sends_each_ack_with_the_answer() {
    // 0-159 frames taken by the progress threads in 2000 rounds here; 270-400 with the
    // ACK sent ahead of the answer when the wait for it ran out.
    write_ping_pong_spinning_on_memory(64, WRITE_ROUNDS / 6);
}

/// The same with WRITEs of four packets (path MTU 1024): the whole answer must go ahead of
/// the ACK, or the peer's application takes its completion and leaves for its memory before
/// the answer's last packets arrive, and its progress thread has to take them. (The wait for
/// the answer must also start when the message is whole, which
/// `ack_only_requests_count_messages_when_they_are_whole` checks; started at the first
/// packet, it made 1.2-1.35 batches per round here against 1.05-1.1.)
#[test]
fn multi_packet_write_ping_pong_sends_each_ack_with_the_answer() {
    // 12-134 frames in 2000 rounds here, and on busy CI hosts 402, 550 and once three runs
    // in a row of 510-782; 3800-4300 (two per round) with the answer's packets behind the
    // ACK. One frame per round tells the two apart. A wait for the answer that runs out too
    // early (500-1200) cannot be told from a busy host's noise by this count; the simulator's
    // `ack_only_requests_count_messages_when_they_are_whole` checks that wait without timing.
    write_ping_pong_spinning_on_memory(4096, WRITE_ROUNDS);
}

/// The rounds of one [`write_ping_pong_run`].
const WRITE_ROUNDS: usize = 2000;

/// Runs [`write_ping_pong_run`] (see [`within_bounds_once_in_five`]); `max_by_thread`
/// bounds the frames each side's progress thread may take in a run.
fn write_ping_pong_spinning_on_memory(msg: usize, max_by_thread: usize) {
    if !root_or_skip() {
        return;
    }
    within_bounds_once_in_five(|| write_ping_pong_run(msg, max_by_thread));
}

/// Runs `run` until one run keeps within its bounds (`Ok`), at most five times; panics with
/// every run's excess when none did.
///
/// For counts that follow the host's scheduling (transmit batches, frames the progress
/// threads took): on a busy host a run now and then exceeds its bound with nothing wrong,
/// while a regression shows in every run. Noise comes in bursts: this binary's other tests
/// run beside it on the host's two CPUs, and CI has had three runs in a row out of bounds
/// (once right after its build, and once in stop 80, whose trials of the multi-packet WRITE
/// ping-pong found a first run out of bounds about one time in five, with and without that
/// stop's change alike). So a run that failed is repeated after a pause that grows, for the
/// burst to pass.
fn within_bounds_once_in_five(mut run: impl FnMut() -> Result<(), String>) {
    const RUNS: u64 = 5;
    let mut failures = Vec::new();
    for attempt in 0..RUNS {
        if attempt > 0 {
            std::thread::sleep(Duration::from_secs(2 * attempt));
        }
        match run() {
            Ok(()) => return,
            Err(e) => {
                eprintln!("{e}; running again");
                failures.push(e);
            }
        }
    }
    panic!("{RUNS} runs out of bounds:\n{}", failures.join("\n"));
}

/// One run of [`write_ping_pong_spinning_on_memory`]: panics when data or ACKs go missing;
/// `Err` when the transmit batches or the frames the progress threads took exceed their
/// bounds.
fn write_ping_pong_run(msg: usize, max_by_thread: usize) -> Result<(), String> {
    let setup = Setup::alone(1500);
    const ROUNDS: usize = WRITE_ROUNDS;
    let results = setup.on_both_sides(move |me: Side<Endpoint>| {
        let (side, pd, engine) = (me.index, me.pd, &me.engine);
        // [0, msg): what this side writes; [msg, 2 msg): where the peer writes.
        let mut buf = Buffer::new(engine, pd, 2 * msg);
        let qp = create_qp(engine, pd, QpType::Rc);
        to_init(engine, &qp);
        let peer = connect_at(&me, &qp, &buf, msg, 0xa00 + side as u32, PathMtu::Mtu1024);
        // 1..=255, never the buffer's initial 0, and each round's differs from the last.
        let tag = |round: usize| (round % 255) as u8 + 1;
        let write = |buf: &mut Buffer, round: usize| {
            buf.write(0, &vec![tag(round); msg]);
            let wr = SendWr::new(
                round as u64,
                SendOp::RdmaWrite {
                    remote_addr: peer.va,
                    rkey: peer.rkey,
                },
                vec![buf.sge(0, msg)],
            );
            engine.post_send(qp.qpn, wr).expect("post_send");
            spin_for_one(engine, qp.send_cq, "the WRITE's ACK");
        };
        let wait_for_peer = |buf: &Buffer, round: usize| {
            let deadline = Instant::now() + WAIT;
            // The peer's WRITE lands in one piece; its last byte comes last, as perftest
            // assumes.
            while buf.read_volatile(2 * msg - 1) != tag(round) {
                assert!(
                    Instant::now() < deadline,
                    "side {side}: round {round}'s WRITE never landed"
                );
                std::hint::spin_loop();
            }
            for off in msg..2 * msg {
                assert_eq!(
                    buf.read_volatile(off),
                    tag(round),
                    "round {round}, byte {off}"
                );
            }
        };
        for round in 0..ROUNDS {
            if side == 0 {
                write(&mut buf, round);
                wait_for_peer(&buf, round);
            } else {
                wait_for_peer(&buf, round);
                write(&mut buf, round);
            }
        }
        // Side 1's last WRITE is acknowledged (held for an answer that never comes, its ACK
        // goes out after the hold) before side 1 gets here: after this, side 0 has sent every
        // ACK it will count.
        me.connected.wait();
        let c = engine.counters();
        let batches = c.tx_batches.load(std::sync::atomic::Ordering::Relaxed) as usize;
        let by_thread = c
            .rx_frames_by_thread
            .load(std::sync::atomic::Ordering::Relaxed) as usize;
        let acks = engine.with_device(|d| d.counters()).tx_responses as usize;
        (side, batches, by_thread, acks)
    });
    // What must hold in every run, on both sides, before the bounds that may be retried.
    for &(side, batches, by_thread, acks) in &results {
        eprintln!(
            "side {side}: {batches} transmit batches, {by_thread} frames taken by the progress \
             thread, {acks} ACKs in {ROUNDS} rounds"
        );
        assert!(
            acks >= ROUNDS,
            "side {side}: every WRITE is acknowledged ({acks} ACKs for {ROUNDS})"
        );
    }
    for (side, batches, by_thread, _) in results {
        // One batch per round (the WRITE with the ACK for the peer's), with slack for rounds
        // the progress threads took over: 2003-2149 batches in 2000 rounds here. ACKs on their
        // own cost most rounds two (1.65-2.0 per round); with the ACK's wait for the answer
        // running out before the ACK for this side's own WRITE came in (5 µs, stop 28),
        // 1.05-1.27.
        if batches > ROUNDS + ROUNDS / 5 {
            return Err(format!(
                "side {side}: {batches} transmit batches in {ROUNDS} rounds: ACKs go out on \
                 their own"
            ));
        }
        // The answer reaches the peer ahead of the ACK, so the peer's application, polling
        // for that ACK, takes the answer too: the progress threads took 0-159 frames in 2000
        // rounds at 64 B here and 12-134 at 4 KiB. 3800-4300 at 4 KiB when the answer's
        // packets came behind the ACK (the application left for its memory after the ACK, and
        // the thread took the rest); 270-400 at 64 B and 500-1200 at 4 KiB when a wait that
        // ran out sent the ACK ahead of the answer.
        if by_thread > max_by_thread {
            return Err(format!(
                "side {side}: the progress thread took {by_thread} frames in {ROUNDS} rounds: \
                 the answer arrives after the application left its verbs"
            ));
        }
    }
    Ok(())
}

/// A WRITE of 64 packets, arriving a few µs apart, for an application that waits on memory
/// outside its verbs: the progress thread takes every packet, and between two packets of the
/// message it waits awake instead of going to sleep and being woken by the next one. On this
/// VM every such wake-up cost the sender an interprocessor interrupt inside its `sendto`
/// (about 25 µs): a 64 KiB message then took 450-590 µs to leave instead of about 80, the
/// tail of `ib_write_lat` at 64 KiB. The packets come from a raw AF_XDP socket that spaces
/// them (an engine would send them back to back in one kick).
#[test]
fn the_progress_thread_takes_a_message_of_many_packets_awake() {
    if !root_or_skip() {
        return;
    }
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        eprintln!("skipped: needs two CPUs (the sender on one, the receiver on the other)");
        return;
    }
    let setup = Setup::alone(1500);
    const ROUNDS: usize = 100;
    const PACKETS: usize = 64;
    const PACKET: usize = 1024;
    const MSG: usize = PACKETS * PACKET;
    const GAP: Duration = Duration::from_micros(8);
    // The sender is not an engine: a QP number no engine uses.
    const SENDER_QPN: u32 = 0x5e0d;
    const FIRST_PSN: u32 = 0xd00;
    let tag = |round: usize| (round % 255) as u8 + 1;
    // Rounds the receiving application has checked (the sender waits for each: a spinning
    // rendezvous, so that the receiving application never enters its verbs).
    let checked = Arc::new(AtomicUsize::new(0));
    let (target_tx, target_rx) = mpsc::channel::<(u32, u64, u32)>();
    let sender_ip = setup.pair.ipv4(0);
    let receiver_ip = setup.pair.ipv4(1);
    let receiver = {
        let checked = checked.clone();
        let iface = setup.pair.iface(1).to_string();
        setup.pair.spawn_in(1, move || {
            // The receiving application on CPU 1 and the sender on CPU 0: the progress
            // thread, started from here, inherits CPU 1.
            pin_to_cpu(1);
            let engine = Engine::start(EngineConfig::new(&iface)).expect("engine");
            let pd = engine.with_device(|d| d.alloc_pd());
            let buf = Buffer::new(&engine, pd, MSG);
            let qp = create_qp(&engine, pd, QpType::Rc);
            to_init(&engine, &qp);
            let sender = Endpoint {
                qpn: SENDER_QPN,
                psn: FIRST_PSN,
                ip: IpAddress::V4(sender_ip.into()),
                va: 0,
                rkey: 0,
            };
            let own_ip = IpAddress::V4(receiver_ip.into());
            bring_up(&engine, &qp, own_ip, &sender, 0, PathMtu::Mtu1024);
            // An application that polls a CQ now and then (as `ib_write_lat` polls for its own
            // WRITE's completion) but waits for the WRITE on memory: next to a poller the
            // progress thread never spins for work in general. It polls before each message
            // is let go, never while one may be arriving: a poll after the sender was let go
            // took the first packet of the next message itself now and then (8 of 6400 in
            // one CI run).
            let mut none = Vec::with_capacity(1);
            engine.poll_cq(qp.send_cq, 1, &mut none).expect("poll_cq");
            target_tx
                .send((qp.qpn, buf.addr(0), buf.mr.rkey))
                .expect("tell the sender");
            for round in 0..ROUNDS {
                let deadline = Instant::now() + WAIT;
                while buf.read_volatile(MSG - 1) != tag(round) {
                    assert!(
                        Instant::now() < deadline,
                        "round {round}'s WRITE never landed; counters {:?}",
                        engine.with_device(|d| d.counters())
                    );
                    std::hint::spin_loop();
                }
                for off in 0..MSG {
                    assert_eq!(
                        buf.read_volatile(off),
                        tag(round),
                        "round {round}, byte {off}"
                    );
                }
                engine.poll_cq(qp.send_cq, 1, &mut none).expect("poll_cq");
                checked.store(round + 1, Ordering::SeqCst);
            }
            let c = engine.counters();
            (
                c.rx_frames_by_thread.load(Ordering::Relaxed) as usize,
                c.frame_wakeups.load(Ordering::Relaxed) as usize,
                c.mid_message_waits.load(Ordering::Relaxed) as usize,
            )
        })
    };
    let (qpn, va, rkey) = target_rx.recv_timeout(WAIT).expect("the receiving QP");
    let iface = setup.pair.iface(0).to_string();
    setup.pair.run_in(0, move || {
        pin_to_cpu(0);
        let own = xroce_datapath::netlink::interface_by_name(&iface).expect("interface");
        let peer_mac = xroce_datapath::netlink::resolve(
            own.index,
            receiver_ip.into(),
            None,
            Duration::from_secs(3),
        )
        .expect("the receiver's MAC");
        let mut sock =
            XskSocket::open_when_free(own.index, XskConfig::default(), Duration::from_secs(1))
                .expect("AF_XDP socket");
        let mut map = xdp::XsksMap::open(&iface).expect("the XDP program's socket map");
        map.set(0, sock.as_raw_fd()).expect("register the socket");
        let mut frame = vec![0u8; 2048];
        let mut psn = FIRST_PSN;
        for round in 0..ROUNDS {
            let deadline = Instant::now() + WAIT;
            while checked.load(Ordering::SeqCst) < round {
                // The receiver's ACKs arrive here; nothing waits for them.
                sock.recv(64, &mut |_| {});
                assert!(
                    Instant::now() < deadline,
                    "round {round}: the receiver left"
                );
                std::hint::spin_loop();
            }
            let payload = vec![tag(round); PACKET];
            for i in 0..PACKETS {
                let (opcode, reth) = match i {
                    0 => (
                        Opcode::RC_RDMA_WRITE_FIRST,
                        Some(RethRepr {
                            va,
                            rkey,
                            dma_len: MSG as u32,
                        }),
                    ),
                    i if i == PACKETS - 1 => (Opcode::RC_RDMA_WRITE_LAST, None),
                    _ => (Opcode::RC_RDMA_WRITE_MIDDLE, None),
                };
                let mut transport = TransportRepr::new(BthRepr {
                    ack_req: i == PACKETS - 1,
                    ..BthRepr::new(opcode, qpn, psn)
                });
                transport.reth = reth;
                let headers = FrameHeaders {
                    eth: Some(EthernetRepr {
                        src: EthernetAddress(own.mac),
                        dst: EthernetAddress(peer_mac),
                        vlan: None,
                        ethertype: EtherType::Ipv4,
                    }),
                    ip: IpRepr::V4(Ipv4Repr {
                        src: sender_ip.into(),
                        dst: receiver_ip.into(),
                        tos: 0,
                        ident: 0,
                        dont_frag: true,
                        ttl: 64,
                        protocol: 17,
                        payload_len: 0,
                    }),
                    udp: UdpRepr {
                        src_port: 0xc000,
                        dst_port: 4791,
                        payload_len: 0,
                    },
                    transport,
                };
                let len = emit_frame(&mut frame, &headers, &payload).expect("build a packet");
                while !sock.send(&frame[..len]) {
                    sock.flush().expect("kick");
                }
                sock.flush().expect("kick");
                psn = (psn + 1) & 0xff_ffff;
                let sent = Instant::now();
                while sent.elapsed() < GAP {
                    std::hint::spin_loop();
                }
            }
        }
    });
    let (by_thread, frame_wakeups, waits) = receiver.join().expect("receiving side");
    eprintln!(
        "the progress thread took {by_thread} packets, was woken by frames {frame_wakeups} \
         times and waited awake for the next packet of a message {waits} times, in {ROUNDS} \
         messages of {PACKETS} packets"
    );
    assert!(
        by_thread >= ROUNDS * PACKETS,
        "the receiving application stays out of its verbs, so its progress thread takes every \
         packet: {by_thread} of {}",
        ROUNDS * PACKETS
    );
    // About one wake-up per message: 130-139 for 100 messages here, the thread waiting awake
    // for the next packet 5900-6200 times. Asleep between packets: 5600-6200 wake-ups.
    assert!(
        frame_wakeups <= ROUNDS * PACKETS / 8,
        "the progress thread was woken {frame_wakeups} times by the packets of {ROUNDS} \
         messages: it sleeps between the packets of a message"
    );
}

/// Keeps the calling thread (and threads it starts later) on `cpu`.
fn pin_to_cpu(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes within it, and
    // sched_setaffinity reads `size_of` bytes of it for the calling thread (pid 0).
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    assert_eq!(
        rc,
        0,
        "pinning to CPU {cpu}: {}",
        std::io::Error::last_os_error()
    );
}

/// Two applications that each send a message at the same moment and wait for its ACK before
/// they look for the peer's: each receives the peer's message while it waits for its own ACK,
/// the shape of a ping-pong turn, so each holds its ACK for an answer (`Engine::poll_cq`), and
/// each holds the ACK the other waits for: only the holds' end lets them go on. After a few
/// such holds ran out in a row, holds stay short for a while; without that, every round
/// stalled for a whole answer hold (50 µs).
///
/// Each application then leaves its verbs to wait for the other outside them, with ACKs
/// still held for an answer it never posts: those waited for its progress thread, which
/// naps next to a steady poller until an alarm milliseconds out (16-30 stalls of 1-17 ms in
/// 1 000 rounds, half the run). The thread counts each such hold it finds (`held_acks_left`),
/// and each turns the polls' holds off for a spell that doubles while the application keeps
/// leaving them (`LeftHolds`).
#[test]
fn simultaneous_sends_do_not_stall_on_each_others_held_acks() {
    if !root_or_skip() {
        return;
    }
    within_bounds_once_in_five(simultaneous_sends_run);
}

/// One run of [`simultaneous_sends_do_not_stall_on_each_others_held_acks`]: panics when a
/// message or an ACK goes missing; `Err` when too many holds ran out.
fn simultaneous_sends_run() -> Result<(), String> {
    let setup = Setup::alone(1500);
    const ROUNDS: usize = 1000;
    const MSG: usize = 64;
    // Rounds each side has started: both start round i once both finished round i - 1 (a
    // spinning rendezvous; a blocking one costs a wake-up per round).
    let started = Arc::new([AtomicUsize::new(0), AtomicUsize::new(0)]);
    let results = setup.on_both_sides(move |me: Side<Endpoint>| {
        let (side, pd, engine) = (me.index, me.pd, &me.engine);
        let buf = Buffer::new(engine, pd, 2 * MSG);
        let qp = create_qp(engine, pd, QpType::Rc);
        to_init(engine, &qp);
        let recv = || {
            let wr = RecvWr {
                wr_id: 0,
                sg_list: vec![buf.sge(MSG, MSG)].into(),
            };
            engine.post_recv(qp.qpn, wr).expect("post_recv");
        };
        recv();
        connect_for_sends(&me, &qp, 0xb00 + side as u32);
        let t0 = Instant::now();
        for i in 0..ROUNDS {
            started[side].store(i + 1, Ordering::SeqCst);
            let deadline = Instant::now() + WAIT;
            while started[1 - side].load(Ordering::SeqCst) < i + 1 {
                assert!(
                    Instant::now() < deadline,
                    "side {side}: the peer left in round {i}"
                );
                std::hint::spin_loop();
            }
            let wr = SendWr::new(i as u64, SendOp::Send, vec![buf.sge(0, MSG)]);
            engine.post_send(qp.qpn, wr).expect("post_send");
            spin_for_one(engine, qp.send_cq, "the send's ACK");
            spin_for_one(engine, qp.recv_cq, "the peer's message");
            recv();
        }
        let elapsed = t0.elapsed();
        let c = engine.counters();
        let holds = c.answer_holds.load(Ordering::Relaxed) as usize;
        let ran_out = c.answer_holds_ran_out.load(Ordering::Relaxed) as usize;
        let left = c.held_acks_left.load(Ordering::Relaxed) as usize;
        (side, holds, ran_out, left, elapsed)
    });
    for (side, holds, ran_out, left, elapsed) in results {
        eprintln!(
            "side {side}: {holds} answer holds, {ran_out} ran out with no ACK, {left} left to \
             the progress thread, {ROUNDS} rounds in {elapsed:?}"
        );
        // Spells of 10 ms and more, a few in all: one such hold here in most runs, two in
        // some. (Counted the same way but not acted on, 276-804 here.) A hold
        // the application answers makes the next spell the shortest again.
        let spells = elapsed.as_millis() as usize / 10 + 1;
        if left > spells.max(4) {
            return Err(format!(
                "side {side}: {left} held ACKs left to the progress thread in {ROUNDS} rounds \
                 ({elapsed:?}): the polls kept holding ACKs for an application that leaves them"
            ));
        }
        // Three in a row, then none for 10 ms: 63-157 in 1000 rounds here, about two per
        // 10 ms, before left holds turned the holds off (a hold that gets its ACK in between
        // starts the count again); 0-3 since. Holds that never stopped ran out in 385-406 of
        // them. A slower host fits more 10 ms spells into the run.
        if ran_out > (ROUNDS / 4).max(5 * spells) {
            return Err(format!(
                "side {side}: {ran_out} answer holds ran out in {ROUNDS} rounds ({elapsed:?}): \
                 the two sides keep holding each other's ACKs"
            ));
        }
    }
    Ok(())
}

/// A one-way stream of `MESSAGES` SENDs of `SEND_MSG` bytes into an application that takes
/// each completion with a poll of its own and never answers (`ib_send_bw`'s receiver), which
/// checks that every message arrives, in order, intact, through `SEND_SLOTS` receives it posts
/// again. The sender, side 0, is `send(engine, qp, post)`, where `post(i, signalled)` writes
/// message `i` into its slot and posts it. Returns each side's engine counters at the end.
fn one_way_sends(
    psn_base: u32,
    send: fn(&Engine, &Qp, &mut dyn FnMut(usize, bool)),
) -> [[u64; 3]; 2] {
    const SEND_SLOTS: usize = 512;
    const SEND_MSG: usize = 64;
    let setup = Setup::alone(1500);
    setup.on_both_sides(move |me: Side<Endpoint>| {
        let (side, pd, engine) = (me.index, me.pd, &me.engine);
        let mut buf = Buffer::new(engine, pd, SEND_SLOTS * SEND_MSG);
        let qp = create_qp(engine, pd, QpType::Rc);
        to_init(engine, &qp);
        let post_recv = |buf: &Buffer, slot: usize| {
            let wr = RecvWr {
                wr_id: slot as u64,
                sg_list: vec![buf.sge(slot * SEND_MSG, SEND_MSG)].into(),
            };
            engine.post_recv(qp.qpn, wr).expect("post_recv");
        };
        if side == 1 {
            (0..SEND_SLOTS).for_each(|slot| post_recv(&buf, slot));
        }
        connect_for_sends(&me, &qp, psn_base + side as u32);
        if side == 0 {
            send(engine, &qp, &mut |i, signalled| {
                let slot = i % SEND_SLOTS;
                buf.write(slot * SEND_MSG, &pattern(i as u64, SEND_MSG));
                let sge = buf.sge(slot * SEND_MSG, SEND_MSG);
                let mut wr = SendWr::new(i as u64, SendOp::Send, vec![sge]);
                if !signalled {
                    wr.flags = xroce_core::transport::verbs::SendFlags::NONE;
                }
                engine.post_send(qp.qpn, wr).expect("post_send");
            });
        } else {
            for i in 0..MESSAGES {
                let wc = spin_for_one(engine, qp.recv_cq, "the next message");
                let slot = wc.wr_id as usize;
                assert_eq!(
                    slot,
                    i % SEND_SLOTS,
                    "message {i} landed in the wrong receive"
                );
                assert_eq!(wc.byte_len as usize, SEND_MSG, "message {i}: {wc:?}");
                assert!(
                    buf.read(slot * SEND_MSG, SEND_MSG) == pattern(i as u64, SEND_MSG),
                    "message {i} arrived changed"
                );
                if i + SEND_SLOTS < MESSAGES {
                    post_recv(&buf, slot);
                }
            }
        }
        let c = engine.counters();
        [
            c.ack_holds_ran_out.load(Ordering::Relaxed),
            c.tx_kicks_for_completions.load(Ordering::Relaxed),
            c.rx_frames_while_draining.load(Ordering::Relaxed),
        ]
    })
}

/// Messages of [`one_way_sends`].
const MESSAGES: usize = 20_000;

/// A stream of SENDs into an application that takes each completion and never answers
/// (`ib_send_bw`'s receiver): a hold of the ACKs for an answer runs out every time, and its
/// sender, whose send queue refills only with those ACKs, waits meanwhile. After a few holds
/// in a row ran out, the receiver sends its ACKs as soon as it receives their requests, for a
/// while. Before, every receive round held its ACK until the application had taken every
/// completion and the hold had run out: 12 897 such holds in one run of this stream. Every
/// message arrives, in order, intact.
#[test]
fn a_receiver_that_never_answers_sends_its_acks_without_holding_them() {
    if !root_or_skip() {
        return;
    }
    within_bounds_once_in_five(receiver_that_never_answers_run);
}

/// One run of [`a_receiver_that_never_answers_sends_its_acks_without_holding_them`]: panics
/// when a message goes missing or arrives changed; `Err` when too many holds ran out.
fn receiver_that_never_answers_run() -> Result<(), String> {
    let t0 = Instant::now();
    // Sends in flight at most, each signalled: a short queue makes many receive rounds, each
    // a hold before.
    let counters = one_way_sends(0xc00, |engine, qp, post| {
        const WINDOW: usize = 4;
        let mut in_flight = 0;
        for i in 0..MESSAGES {
            if in_flight == WINDOW {
                spin_for_one(engine, qp.send_cq, "a send's ACK");
                in_flight -= 1;
            }
            post(i, true);
            in_flight += 1;
        }
        for _ in 0..in_flight {
            spin_for_one(engine, qp.send_cq, "a send's ACK");
        }
    });
    let elapsed = t0.elapsed();
    let ran_out = counters[1][0] as usize;
    eprintln!("receiver: {ran_out} ACK holds ran out in {MESSAGES} messages ({elapsed:?})");
    // Three in a row, then none for 10 ms. A slower host fits more 10 ms spells into the
    // stream.
    let spells = elapsed.as_millis() as usize / 10 + 2;
    if ran_out > (MESSAGES / 40).max(3 * spells) {
        return Err(format!(
            "{ran_out} ACK holds ran out in a stream of {MESSAGES} messages ({elapsed:?}): the \
             receiver keeps holding ACKs for answers it never sends"
        ));
    }
    Ok(())
}

/// `ib_send_bw`'s pattern: a sender that signals one SEND in 100 and refills its 128-deep
/// window only with those completions, into a receiver that never answers and takes its
/// completions one poll at a time. The sender's engine kicks the frames up to each signalled
/// SEND early (its packet asks for the ACK), and the receiver's polls take the frames that
/// came while they return completions and send their ACKs (its ACKs go at once once its holds
/// have run out). Before, the signalled SEND went with the rest of its round and its ACK
/// waited until the receiver had taken every completion before it: the sender sat idle.
/// Every message arrives, in order, intact.
#[test]
fn a_sender_waiting_for_one_completion_in_many_gets_its_ack_early() {
    if !root_or_skip() {
        return;
    }
    let counters = one_way_sends(0xd00, |engine, qp, post| {
        const WINDOW: usize = 128;
        const SIGNAL_EVERY: usize = 100;
        let mut completed = 0;
        for i in 0..MESSAGES {
            if i - completed == WINDOW {
                spin_for_one(engine, qp.send_cq, "a signalled send's ACK");
                completed += SIGNAL_EVERY;
            }
            post(i, (i + 1) % SIGNAL_EVERY == 0);
        }
        while completed < MESSAGES {
            spin_for_one(engine, qp.send_cq, "a signalled send's ACK");
            completed += SIGNAL_EVERY;
        }
    });
    let (kicks, drained) = (counters[0][1], counters[1][2]);
    eprintln!(
        "sender: {kicks} early kicks; receiver: {drained} frames taken by polls that returned \
         completions ({MESSAGES} messages)"
    );
    assert!(kicks > 0, "the sender never kicked a signalled SEND early");
    assert!(
        drained > 0,
        "the receiver took no frames while it took its completions"
    );
}

/// A path MTU above the port's active MTU, as `ibv_rc_pingpong -m 4096` asks for on a
/// 1500-byte veth: a message that fits the link in one packet still arrives (1200 bytes, more
/// than the port's 1024), as with rdma_rxe; a longer one makes a packet the veth drops, which
/// the engine counts (and reports once on stderr) so that the hang that follows has a reason.
/// (3000 bytes: one packet that fits a UMEM frame, so the test holds on kernels without
/// multi-buffer too.)
#[test]
fn packets_longer_than_the_interfaces_mtu_are_counted() {
    if !root_or_skip() {
        return;
    }
    const FITS: usize = 1200;
    const TOO_LONG: usize = 3000;
    let setup = Setup::new(1500);
    let results = setup.on_both_sides(move |me: Side<Endpoint>| {
        let (side, pd, engine) = (me.index, me.pd, &me.engine);
        let mut buf = Buffer::new(engine, pd, 2 * TOO_LONG);
        let qp = create_qp(engine, pd, QpType::Rc);
        to_init(engine, &qp);
        let psn = 0xb00 + side as u32;
        let peer = connect_at(&me, &qp, &buf, TOO_LONG, psn, PathMtu::Mtu4096);
        let too_long = || engine.counters().tx_too_long.load(Ordering::Relaxed);
        let mut outcome = (0, 0, Vec::new());
        if side == 0 {
            buf.write(0, &pattern(7, TOO_LONG));
            let write = |id: u64, len: usize| {
                let op = SendOp::RdmaWrite {
                    remote_addr: peer.va,
                    rkey: peer.rkey,
                };
                engine
                    .post_send(qp.qpn, SendWr::new(id, op, vec![buf.sge(0, len)]))
                    .expect("post_send");
            };
            write(1, FITS);
            expect_completions(engine, qp.send_cq, 1, "the WRITE that fits one packet");
            let before = too_long();
            write(2, TOO_LONG);
            let deadline = Instant::now() + WAIT;
            while too_long() == before && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            outcome = (before, too_long(), Vec::new());
        }
        // Side 1 looks at its memory once side 0 has seen what it waited for.
        me.connected.wait();
        if side == 1 {
            outcome.2 = buf.read(TOO_LONG, TOO_LONG);
        }
        outcome
    });
    let [(before, after, _), (_, _, landed)] = results;
    assert_eq!(
        before, 0,
        "a packet that fits the link was counted as too long"
    );
    assert!(after > 0, "the {TOO_LONG}-byte packet was not counted");
    let sent = pattern(7, TOO_LONG);
    assert_eq!(&landed[..FITS], &sent[..FITS], "the WRITE that fits");
    assert!(
        landed[FITS..].iter().all(|&b| b == 0),
        "the packet too long for the veth arrived"
    );
}

/// A program whose threads sit in different network namespaces: the QPs are connected (the
/// transition to RTR resolves the peer's MAC) by threads that have moved into the *other*
/// side's namespace, where the peer's address is one of their own. The engine still looks the
/// peer up in its own namespace, where it started, and the WRITEs that follow arrive whole.
#[test]
fn a_thread_in_another_namespace_connects_through_the_engines_namespace() {
    if !root_or_skip() {
        return;
    }
    const MSG: usize = 8192;
    let setup = Setup::new(1500);
    let names = [0, 1].map(|side| setup.pair.ns_name(side).to_string());
    let results = setup.on_both_sides(move |me: Side<Endpoint>| {
        let (side, pd, engine) = (me.index, me.pd, &me.engine);
        let mut buf = Buffer::new(engine, pd, 2 * MSG);
        let qp = create_qp(engine, pd, QpType::Rc);
        to_init(engine, &qp);
        let psn = 0xd00 + side as u32;
        let peer = me.swap(Endpoint {
            qpn: qp.qpn,
            psn,
            ip: me.ip,
            va: buf.addr(MSG),
            rkey: buf.mr.rkey,
        });
        let elsewhere = &names[1 - side];
        std::thread::scope(|s| {
            s.spawn(|| {
                xroce_datapath::netns::enter(elsewhere).expect("enter the other namespace");
                bring_up(engine, &qp, me.ip, &peer, psn, PathMtu::Mtu1024);
            })
            .join()
            .expect("connected from the other namespace");
        });
        me.connected.wait();
        buf.write(0, &pattern(20 + side as u64, MSG));
        post_writes(engine, &qp, &buf, &peer, 0..1, MSG);
        expect_completions(engine, qp.send_cq, 1, "the WRITE");
        // Both WRITEs are done once both sides pass here.
        me.connected.wait();
        buf.read(MSG, MSG)
    });
    assert!(results[1] == pattern(20, MSG), "side 0's WRITE");
    assert!(results[0] == pattern(21, MSG), "side 1's WRITE");
}

/// Sockets without multi-buffer, as on kernels before 6.6 (Debian 12's own 6.1), forced here
/// on a 9000-byte veth: the port's active MTU is 2048, and a QP at that path MTU moves a
/// 64 KiB WRITE and READ intact. A QP asking for 4096 still sends a message that fits one
/// frame; one that makes a packet larger than a frame fails its work request at once with a
/// local QP operation error, counted, where it used to be left unsent.
#[test]
fn sockets_without_multi_buffer_cap_the_port_and_fail_what_no_frame_holds() {
    if !root_or_skip() {
        return;
    }
    const LONG: usize = 64 * 1024;
    const FITS: usize = 3000;
    let setup = Setup::new(9000);
    let ifaces = [0, 1].map(|side| setup.pair.iface(side).to_string());
    let results = setup.on_both_sides_configured(
        |_, config| config.single_buffer = true,
        move |me: Side<Endpoint>| {
            let (side, pd, engine) = (me.index, me.pd, &me.engine);
            // Another process (`xroce link show`, `ibv_devinfo`) learns it from the queue's
            // note, and reports the same active MTU.
            let holder = xroce_datapath::engine::queue_holder(&ifaces[side], 0);
            assert_eq!(
                holder.map(|h| h.multi_buffer),
                Some(Some(false)),
                "the queue's note"
            );
            assert_eq!(
                xroce_datapath::engine::holder_multi_buffer(&ifaces[side]),
                Some(false)
            );
            let port_mtu = (
                engine.with_device(|d| d.port_mtu()),
                engine.is_multi_buffer(),
            );
            // [0, LONG): side 0's WRITE lands here on side 1, and side 1's memory that side 0
            // READs back; [LONG, 2 LONG): what the QP at 4096 writes.
            let mut buf = Buffer::new(engine, pd, 3 * LONG);
            let small = create_qp(engine, pd, QpType::Rc);
            let big = create_qp(engine, pd, QpType::Rc);
            to_init(engine, &small);
            to_init(engine, &big);
            let psn = 0xc00 + side as u32;
            let peer_small = connect_at(&me, &small, &buf, 0, psn, PathMtu::Mtu2048);
            let peer_big = connect_at(&me, &big, &buf, LONG, psn, PathMtu::Mtu4096);
            let mut outcome = (port_mtu, Vec::new(), Vec::new(), 0, Vec::new());
            if side == 0 {
                buf.write(0, &pattern(11, LONG));
                buf.write(LONG, &pattern(12, FITS));
                let op = SendOp::RdmaWrite {
                    remote_addr: peer_small.va,
                    rkey: peer_small.rkey,
                };
                let wr = SendWr::new(1, op, vec![buf.sge(0, LONG)]);
                engine.post_send(small.qpn, wr).expect("post_send");
                expect_completions(engine, small.send_cq, 1, "the 64 KiB WRITE at 2048");
                let op = SendOp::RdmaRead {
                    remote_addr: peer_small.va,
                    rkey: peer_small.rkey,
                };
                let wr = SendWr::new(2, op, vec![buf.sge(2 * LONG, LONG)]);
                engine.post_send(small.qpn, wr).expect("post_send");
                expect_completions(engine, small.send_cq, 1, "the 64 KiB READ at 2048");
                outcome.1 = buf.read(2 * LONG, LONG);

                let write = |id: u64, len: usize| {
                    let op = SendOp::RdmaWrite {
                        remote_addr: peer_big.va,
                        rkey: peer_big.rkey,
                    };
                    let wr = SendWr::new(id, op, vec![buf.sge(LONG, len)]);
                    engine.post_send(big.qpn, wr).expect("post_send");
                };
                write(3, FITS);
                write(4, 2 * FITS);
                let wcs = poll_completions(engine, big.send_cq, 2, "the WRITEs at 4096");
                outcome.2 = wcs.iter().map(|wc| (wc.wr_id, wc.status)).collect();
                outcome.3 = engine.with_device(|d| d.counters().tx_too_big_for_buffer);
            }
            // Side 1 looks at its memory once side 0 has its completions.
            me.connected.wait();
            if side == 1 {
                outcome.4 = buf.read(LONG, FITS);
            }
            outcome
        },
    );
    let [(mtu0, read_back, statuses, too_big, _), (mtu1, _, _, _, landed)] = results;
    assert_eq!(
        (mtu0, mtu1),
        ((PathMtu::Mtu2048, false), (PathMtu::Mtu2048, false)),
        "both ports at 2048, neither taking frames longer than one UMEM frame"
    );
    assert!(
        read_back == pattern(11, LONG),
        "the 64 KiB WRITE and READ at path MTU 2048 came back changed"
    );
    assert_eq!(
        statuses,
        [(3, WcStatus::Success), (4, WcStatus::LocQpOpErr)],
        "at 4096: the WRITE that fits a frame, then the one that does not"
    );
    assert_eq!(too_big, 1, "the packet no frame holds was not counted");
    assert!(landed == pattern(12, FITS), "the WRITE that fits a frame");
}

/// A QP talking to a QP of the same engine never touches the wire; and an idle engine with
/// connected QPs sleeps.
#[test]
fn loopback_and_idle_cost() {
    if root_or_skip() {
        loopback_and_idle_cost_on(Backend::AfXdp);
    }
}

/// The same on the DPDK port, whose driver has no descriptor to sleep on: its idle engine
/// sleeps on the port's kernel UDP socket (the doorbell) instead.
#[cfg(feature = "dpdk")]
#[test]
fn dpdk_port_loopback_and_idle_cost() {
    if root_or_skip() {
        loopback_and_idle_cost_on(Backend::Dpdk);
    }
}

/// A second engine on an interface a DPDK engine has is refused with a clear error naming the
/// process, whether on DPDK (its kernel UDP socket on the interface is taken) or on AF_XDP
/// (whose sockets would take the frames before DPDK's driver saw them), and a DPDK engine is
/// refused where an AF_XDP engine runs; each starts once the other is gone. An engine on the
/// other end of the veth, in another namespace, is not in the way.
#[cfg(feature = "dpdk")]
#[test]
fn a_second_engine_on_a_dpdk_engines_interface_is_refused() {
    if !root_or_skip() {
        return;
    }
    let setup = Setup::new(1500);
    let dpdk = |iface: &str| {
        Engine::start(EngineConfig {
            backend: Backend::Dpdk,
            ..EngineConfig::new(iface)
        })
    };
    let iface = setup.pair.iface(0).to_string();
    let other = setup.pair.iface(1).to_string();
    let _peer = setup
        .pair
        .run_in(1, move || dpdk(&other).expect("engine on the other end"));
    setup.pair.run_in(0, move || {
        let refused = |started: Result<Engine, xroce_datapath::engine::EngineError>| {
            let err = started
                .err()
                .expect("a second engine on the interface started");
            let text = err.to_string();
            assert!(
                matches!(
                    err,
                    xroce_datapath::engine::EngineError::InterfaceInUse { .. }
                ) && text.contains(&format!("process {}", std::process::id()))
                    && text.contains("one RDMA process at a time"),
                "{text}"
            );
        };
        let first = dpdk(&iface).expect("first engine");
        assert_eq!(first.backend(), Backend::Dpdk);
        refused(dpdk(&iface));
        refused(Engine::start(EngineConfig::new(&iface)));
        drop(first);
        let af_xdp = Engine::start(EngineConfig::new(&iface)).expect("AF_XDP after DPDK");
        refused(dpdk(&iface));
        drop(af_xdp);
        dpdk(&iface).expect("DPDK after AF_XDP");
    });
}

fn loopback_and_idle_cost_on(backend: Backend) {
    let setup = Setup::new(1500);
    let iface = setup.pair.iface(0).to_string();
    let ip = IpAddress::V4(setup.pair.ipv4(0).into());
    let (cpu_used, idle_for) = setup.pair.run_in(0, move || {
        let engine = Engine::start(EngineConfig {
            backend,
            ..EngineConfig::new(&iface)
        })
        .expect("engine");
        let pd = engine.with_device(|d| d.alloc_pd());
        const LEN: usize = 4 * MIB;
        let mut buf = Buffer::new(&engine, pd, 2 * LEN);
        buf.write(0, &pattern(7, LEN));
        let a = create_qp(&engine, pd, QpType::Rc);
        let b = create_qp(&engine, pd, QpType::Rc);
        to_init(&engine, &a);
        to_init(&engine, &b);
        let ea = Endpoint {
            qpn: a.qpn,
            psn: 1,
            ip,
            va: buf.addr(0),
            rkey: buf.mr.rkey,
        };
        let eb = Endpoint {
            qpn: b.qpn,
            psn: 2,
            ip,
            va: buf.addr(LEN),
            rkey: buf.mr.rkey,
        };
        bring_up(&engine, &a, ip, &eb, ea.psn, PathMtu::Mtu1024);
        bring_up(&engine, &b, ip, &ea, eb.psn, PathMtu::Mtu1024);
        let redirected_before = xdp::read_counters(&iface).expect("counters").redirected;
        stream(&engine, &a, LEN / (64 * 1024), 16, "loopback WRITE", |i| {
            SendWr::new(
                i as u64,
                SendOp::RdmaWrite {
                    remote_addr: eb.va + (i * 64 * 1024) as u64,
                    rkey: eb.rkey,
                },
                vec![buf.sge(i * 64 * 1024, 64 * 1024)],
            )
        });
        assert!(
            buf.read(LEN, LEN) == pattern(7, LEN),
            "loopback WRITE data differs"
        );
        let loopback = engine
            .counters()
            .tx_loopback
            .load(std::sync::atomic::Ordering::Relaxed);
        assert!(
            loopback >= (LEN / 1024) as u64,
            "only {loopback} packets looped back"
        );
        assert_eq!(
            engine
                .counters()
                .tx_frames
                .load(std::sync::atomic::Ordering::Relaxed),
            0
        );
        assert_eq!(
            xdp::read_counters(&iface).expect("counters").redirected,
            redirected_before,
            "loopback traffic reached the wire"
        );
        // Idle: QPs connected, nothing to do. Measure the progress thread's CPU over 10 s (the
        // test binary runs other tests' engines in parallel, so not the whole process's).
        std::thread::sleep(Duration::from_millis(300));
        let (cpu0, t0) = (
            engine.progress_cpu_time().expect("thread CPU"),
            Instant::now(),
        );
        std::thread::sleep(Duration::from_secs(10));
        let used = engine.progress_cpu_time().expect("thread CPU") - cpu0;
        let wall = t0.elapsed();
        drop(buf);
        drop(engine);
        (used, wall)
    });
    let share = cpu_used.as_secs_f64() / idle_for.as_secs_f64() * 100.0;
    eprintln!(
        "idle engine ({backend:?}): {cpu_used:?} CPU over {idle_for:?} = {share:.3} % of a core"
    );
    // Reported, not a timing assertion: a progress thread that never sleeps uses ~100 %, so
    // this bound only catches that, whatever the machine's noise.
    assert!(share < 5.0, "an idle engine used {share:.2} % of a core");
}

/// Left to choose, batching through a UDP socket happens on a veth only while the veth does
/// not offload UDP segmentation, which it takes off when its peer runs native XDP: every veth
/// gets the port (`xroce_datapath::udp_gso::auto_batching`), which reads the offload in the
/// engine's namespace (`segmented_in_software`). Generic XDP on the peer leaves
/// the offload on: a batch would cross whole and the peer's program would lose it.
#[test]
fn batching_is_chosen_by_the_interfaces_driver_and_offloads() {
    use xroce_datapath::udp_gso::{auto_batching, segmented_in_software, AutoBatching};
    use xroce_datapath::xdp::XdpMode;
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::new("xrdrv", 1500).expect("namespaces");
    let (iface0, iface1) = (pair.iface(0).to_string(), pair.iface(1).to_string());
    let choice = || {
        let iface = iface0.clone();
        pair.run_in(0, move || {
            (
                xroce_datapath::ethtool::driver_name(&iface),
                auto_batching(&iface),
                segmented_in_software(&iface),
            )
        })
    };
    let while_in_software = AutoBatching::WhileSegmentedInSoftware;
    assert_eq!(
        choice(),
        (Some("veth".to_string()), while_in_software, false)
    );
    for (mode, expected) in [(XdpMode::Generic, false), (XdpMode::Native, true)] {
        let iface = iface1.clone();
        pair.run_in(1, move || {
            let mut options = xdp::LoadOptions::new(&iface);
            options.mode = Some(mode);
            xdp::load(&options).expect("load XDP program");
        });
        assert_eq!(
            choice().1,
            while_in_software,
            "peer in {mode:?} mode: decided as it goes"
        );
        assert_eq!(choice().2, expected, "peer in {mode:?} mode");
        let iface = iface1.clone();
        pair.run_in(1, move || xdp::unload(&iface).expect("unload"));
    }
    assert!(!choice().2, "peer without XDP again");
}

/// An engine batches through a UDP socket while its veth segments batches in software, which
/// the veth does while its peer runs native XDP, and it reads that again after each
/// notification of a change of its link (the kernel sends one when the feature changes):
/// - started before the peer's program was attached, it batches once the program is there in
///   native mode (it used to decide once, at its start, and never batched);
/// - once the peer's program is attached in generic mode instead, a batch would cross whole
///   and that program would lose it, so the engine drops what waits in batches and sends
///   through AF_XDP again. An engine that kept batching resent its WRITEs for ever, and this
///   test ran into its bound.
///
/// The WRITEs to the engine behind each program complete, every byte intact.
#[test]
fn batching_follows_the_peers_program() {
    use xroce_datapath::xdp::XdpMode;
    if !root_or_skip() {
        return;
    }
    let setup = Setup::new(1500);
    // The writer starts with no program on the other end.
    let iface = setup.pair.iface(1).to_string();
    setup
        .pair
        .run_in(1, move || xdp::unload(&iface).expect("unload"));
    let (started_tx, started_rx) = mpsc::channel::<()>();
    const MSG: usize = 64 * 1024;
    const MESSAGES: usize = 64;
    const PHASES: usize = 2;
    let (to_writer, from_reader) = mpsc::channel::<Endpoint>();
    let (to_reader, from_writer) = mpsc::channel::<Endpoint>();
    let (written_tx, written_rx) = mpsc::channel::<u64>();

    let writer_iface = setup.pair.iface(0).to_string();
    let writer_ip = IpAddress::V4(setup.pair.ipv4(0).into());
    let writer = setup.pair.spawn_in(0, move || {
        let engine = Engine::start(EngineConfig {
            transmit: Transmit::Auto,
            ..EngineConfig::new(&writer_iface)
        })
        .expect("engine");
        assert!(
            engine.sends_through_udp_gso(),
            "a veth: batches while it segments in software"
        );
        started_tx.send(()).expect("started");
        let pd = engine.with_device(|d| d.alloc_pd());
        let mut buf = Buffer::new(&engine, pd, MESSAGES * MSG);
        for phase in 0..PHASES {
            buf.write(0, &pattern(10 + phase as u64, MESSAGES * MSG));
            let qp = create_qp(&engine, pd, QpType::Rc);
            to_init(&engine, &qp);
            let reader = from_reader.recv_timeout(WAIT).expect("reader's endpoint");
            let me = Endpoint {
                qpn: qp.qpn,
                psn: 0x200 + phase as u32,
                ip: writer_ip,
                va: buf.addr(0),
                rkey: buf.mr.rkey,
            };
            to_reader.send(me).expect("send endpoint");
            bring_up(&engine, &qp, writer_ip, &reader, me.psn, PathMtu::Mtu1024);
            // The offload is read again after a link notification: after the native program
            // came, the writes go on until they go in batches (or for a bounded while).
            let until = Instant::now() + Duration::from_secs(10);
            loop {
                post_writes(&engine, &qp, &buf, &reader, 0..MESSAGES, MSG);
                expect_completions(&engine, qp.send_cq, MESSAGES, "the WRITEs");
                if phase == 1 || engine.frames_sent_in_batches() > 0 || Instant::now() > until {
                    break;
                }
            }
            written_tx
                .send(engine.frames_sent_in_batches())
                .expect("written");
        }
    });
    started_rx
        .recv_timeout(WAIT)
        .expect("the writer's engine started");

    let reader_iface = setup.pair.iface(1).to_string();
    // Each phase's reader thread takes these in turn.
    let from_writer = std::sync::Mutex::new(from_writer);
    let written_rx = std::sync::Mutex::new(written_rx);
    for phase in 0..PHASES {
        // Native, then generic: the writer's veth segments in software, then offloads UDP
        // segmentation again.
        let mode = [XdpMode::Native, XdpMode::Generic][phase];
        let iface = reader_iface.clone();
        setup.pair.run_in(1, move || {
            if mode == XdpMode::Generic {
                xdp::unload(&iface).expect("unload");
            }
            let mut options = xdp::LoadOptions::new(&iface);
            options.mode = Some(mode);
            xdp::load(&options).expect("load XDP program");
        });
        let iface = reader_iface.clone();
        let ip = IpAddress::V4(setup.pair.ipv4(1).into());
        let (to_writer, from_writer, written_rx) = (to_writer.clone(), &from_writer, &written_rx);
        let reader = setup.pair.run_in(1, move || {
            let (from_writer, written_rx) = (
                from_writer.lock().expect("channel"),
                written_rx.lock().expect("channel"),
            );
            let engine = Engine::start(EngineConfig::new(&iface)).expect("engine");
            let pd = engine.with_device(|d| d.alloc_pd());
            let buf = Buffer::new(&engine, pd, MESSAGES * MSG);
            let qp = create_qp(&engine, pd, QpType::Rc);
            to_init(&engine, &qp);
            let me = Endpoint {
                qpn: qp.qpn,
                psn: 0x300 + phase as u32,
                ip,
                va: buf.addr(0),
                rkey: buf.mr.rkey,
            };
            to_writer.send(me).expect("send endpoint");
            let writer = from_writer.recv_timeout(WAIT).expect("writer's endpoint");
            bring_up(&engine, &qp, ip, &writer, me.psn, PathMtu::Mtu1024);
            let batched = written_rx
                .recv_timeout(WAIT * 2)
                .unwrap_or_else(|_| panic!("phase {phase}: the WRITEs did not complete"));
            (
                buf.read(0, MESSAGES * MSG) == pattern(10 + phase as u64, MESSAGES * MSG),
                batched,
            )
        });
        assert!(reader.0, "phase {phase}: the WRITEs' bytes differ");
        if mode == XdpMode::Native {
            assert!(
                reader.1 > 0,
                "no frame went in batches to a peer in native mode"
            );
        }
    }
    writer.join().expect("writer");
}

/// With its interface down (the kernel then removes the interface's routes), connecting a QP
/// fails with an error that says the interface is down and how to bring it up, not that
/// there is no route to the peer or that it is reached through another interface.
#[test]
fn connecting_through_a_downed_interface_says_it_is_down() {
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::new("xrdown", 1500).expect("namespaces");
    let iface = pair.iface(0).to_string();
    let (me, peer) = (pair.ipv4(0), pair.ipv4(1));
    let message = pair.run_in(0, move || {
        xdp::load(&xdp::LoadOptions::new(&iface)).expect("load");
        let engine = Engine::start(EngineConfig::new(&iface)).expect("engine");
        let sgid_index = engine
            .gids()
            .iter()
            .position(|g| *g == Some(IpAddress::V4(me.into())))
            .expect("own GID") as u8;
        let av = AddressVector {
            dgid: IpAddress::V4(peer.into()),
            sgid_index,
            traffic_class: 0,
            hop_limit: 64,
            flow_label: 0,
        };
        let ip = |state: &str| {
            // This thread is in the namespace; `ip` starts in it.
            let out = std::process::Command::new("ip")
                .args(["link", "set", &iface, state])
                .output()
                .expect("run ip");
            assert!(out.status.success(), "ip link set {state}: {out:?}");
        };
        ip("down");
        let refused = engine.resolve(&av).map_err(|e| e.to_string());
        ip("up");
        refused.expect_err("a peer reached through a downed interface")
    });
    assert!(
        message.contains("is down") && message.contains("ip link set") && message.contains("up"),
        "the error does not say the interface is down: {message}"
    );
}

/// The GID table follows the interface's addresses.
#[test]
fn gid_table_follows_address_changes() {
    if !root_or_skip() {
        return;
    }
    let setup = Setup::new(1500);
    let iface = setup.pair.iface(0).to_string();
    let ns = setup.pair.ns_name(0).to_string();
    // A device's directory as the generated sysfs tree has it, for the engine's GID files.
    let ibdev = std::env::temp_dir().join(format!("xroce-gids-{}", std::process::id()));
    let port = ibdev.join("ports/1");
    for dir in ["gids", "gid_attrs/types", "gid_attrs/ndevs"] {
        std::fs::create_dir_all(port.join(dir)).expect("mkdir");
    }
    std::fs::write(ibdev.join(registry::NETDEV_FILE), format!("{iface}\n")).expect("netdev file");
    // What libibverbs reads for index `i`: the GID, its type, its netdev.
    let files = move |i: usize| {
        let read = |rel: String| std::fs::read_to_string(port.join(rel)).expect("GID file");
        (
            read(format!("gids/{i}")),
            read(format!("gid_attrs/types/{i}")),
            read(format!("gid_attrs/ndevs/{i}")),
        )
    };
    let expected = |gid: Option<IpAddress>, iface: &str| match gid {
        Some(g) => (
            format!(
                "{}\n",
                registry::format_gid(registry::gid_ipv6(std_address(g)).octets())
            ),
            "RoCE v2\n".to_string(),
            format!("{iface}\n"),
        ),
        None => (
            format!("{}\n", registry::format_gid([0; 16])),
            "IB/RoCE v1\n".to_string(),
            "\n".to_string(),
        ),
    };
    let mirror = ibdev.clone();
    setup.pair.run_in(0, move || {
        // The tree has the interface's two addresses with an empty slot between them (an
        // address removed earlier): the engine starts with the same indices.
        let kernel = xroce_datapath::netlink::interface_by_name(&iface)
            .and_then(|i| xroce_datapath::netlink::gid_table(&i))
            .expect("the interface's addresses");
        assert_eq!(kernel.len(), 2, "{kernel:?}");
        let holey = [Some(kernel[0]), None, Some(kernel[1])];
        registry::write_port_gids(&mirror, &iface, &holey).expect("write the tree's table");
        let config = EngineConfig {
            gid_mirror: Some(mirror),
            ..EngineConfig::new(&iface)
        };
        let engine = Engine::start(config).expect("engine");
        let before = engine.gids();
        let expected_start: Vec<Option<IpAddress>> = holey
            .iter()
            .map(|g| g.map(xroce_datapath::netlink::core_address))
            .collect();
        assert_eq!(before, expected_start, "the engine's table at the start");
        for (i, gid) in before.iter().enumerate() {
            assert_eq!(
                files(i),
                expected(*gid, &iface),
                "GID file {i} at the start"
            );
        }
        assert!(
            matches!(before[0], Some(IpAddress::V6(a)) if a.0[0] == 0xfe && a.0[1] == 0x80),
            "GID 0 is the link-local default: {before:?}"
        );
        let extra = add_extra_v6(&ns, &iface);
        let deadline = Instant::now() + WAIT;
        let index = loop {
            if let Some(i) = engine.gid_index(extra.into()) {
                break i;
            }
            assert!(
                Instant::now() < deadline,
                "new address not in the GID table: {:?}",
                engine.gids()
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        // Addresses already there keep their index.
        let after = engine.gids();
        for (i, g) in before.iter().enumerate() {
            if g.is_some() {
                assert_eq!(after[i], *g, "GID {i} moved");
            }
        }
        // The device's GID files say what the engine's table says.
        for (i, gid) in after.iter().enumerate() {
            assert_eq!(
                files(i),
                expected(*gid, &iface),
                "GID file {i} after the add"
            );
        }
        let out = std::process::Command::new("ip")
            .args(["-n", &ns, "addr", "del", "fd00:4:4::9/64", "dev", &iface])
            .output()
            .expect("ip addr del");
        assert!(out.status.success(), "{out:?}");
        let deadline = Instant::now() + WAIT;
        while engine.gids()[index as usize].is_some() {
            assert!(
                Instant::now() < deadline,
                "removed address still in the GID table"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        // Its slot is empty in the files too, and the others stay where they were.
        for (i, gid) in engine.gids().iter().enumerate() {
            assert_eq!(
                files(i),
                expected(*gid, &iface),
                "GID file {i} after the delete"
            );
        }
        assert_eq!(files(index as usize), expected(None, &iface));
    });
    let _ = std::fs::remove_dir_all(&ibdev);
}

/// The progress thread never blocks on the engine lock: its holder is an application inside
/// a verb, which would pay a futex wake-up on its way out (a system call, and an interrupt of
/// the other core), once per nap of the thread. In an `ib_write_bw` stream that was 34 000
/// futex calls in 4 s on the sender. Here a RoCE frame wakes the thread while the lock is
/// held; it must nap in `ppoll`, never wait in `futex` (the system call it is blocked in is
/// read from `/proc/self/task/TID/syscall`). The frame also makes the kernel resolve the
/// sender's address, and the neighbour change it reports must not keep the thread awake:
/// unread, it made every nap return at once, and the thread spun for as long as the lock was
/// held or the application polled.
#[test]
fn the_progress_thread_never_waits_for_the_engine_lock() {
    if !root_or_skip() {
        return;
    }
    let setup = Setup::new(1500);
    let iface = setup.pair.iface(0).to_string();
    let target = std::net::SocketAddr::from((setup.pair.ipv4(0), 4791));
    let pair = &setup.pair;
    let calls = pair.run_in(0, move || {
        let engine = Engine::start(EngineConfig::new(&iface)).expect("engine");
        let tid = progress_thread_id(&engine);
        let syscall = format!("/proc/self/task/{tid}/syscall");
        engine.with_device(|_| {
            // A frame for the XDP program to hand to the engine's socket (not a valid RoCE
            // packet: the engine counts it and drops it).
            pair.spawn_in(1, move || {
                let s = std::net::UdpSocket::bind(("0.0.0.0", 0)).expect("udp");
                s.send_to(b"wake up", target).expect("send");
            })
            .join()
            .expect("sender");
            let mut calls = Vec::new();
            for _ in 0..40 {
                std::thread::sleep(Duration::from_millis(5));
                let text = std::fs::read_to_string(&syscall).unwrap_or_else(|e| e.to_string());
                // "NR args..." while blocked in a system call, "running" otherwise.
                calls.push(text.split(' ').next().and_then(|n| n.parse::<i64>().ok()));
            }
            calls
        })
    });
    assert!(
        !calls.contains(&Some(libc::SYS_futex)),
        "the progress thread waited for the lock: system calls seen {calls:?}"
    );
    assert!(
        calls.contains(&Some(libc::SYS_ppoll)),
        "the progress thread was not seen napping: system calls seen {calls:?}"
    );
}

/// Applications that keep polling keep their progress threads asleep: a SEND ping-pong run
/// as `ib_send_lat` runs it. Each progress thread naps next to its polling application, its
/// naps double up to their longest, and from then on the application's polls postpone the
/// nap alarm, so the thread does not wake to check on it. With a timed nap each thread woke
/// about a thousand times a second, once per 30-60 rounds here, and each wake-up took the
/// core of a spinning application: the p99 of every ping-pong. Counted per round (so the
/// machine's speed does not matter) as naps that ran out although the application had just
/// polled: an application the scheduler takes off its core for longer than the alarm's margin
/// (other tests running beside this one) is not polling then, and a wake-up then is the thread
/// doing its job.
#[test]
fn a_ping_pong_keeps_the_progress_threads_asleep() {
    if !root_or_skip() {
        return;
    }
    let setup = Setup::new(1500);
    const ROUNDS: usize = 20_000;
    /// Rounds before counting: the naps grow to their longest meanwhile.
    const WARM_UP: usize = 1_000;
    const MSG: usize = 64;
    const RECVS: usize = 64;
    let results = setup.on_both_sides(move |me: Side<Endpoint>| {
        let (side, pd, engine) = (me.index, me.pd, &me.engine);
        let buf = Buffer::new(engine, pd, (RECVS + 1) * MSG);
        let qp = create_qp(engine, pd, QpType::Rc);
        to_init(engine, &qp);
        let post_recv = |i: usize| {
            let wr = RecvWr {
                wr_id: i as u64,
                sg_list: vec![buf.sge((1 + i) * MSG, MSG)].into(),
            };
            engine.post_recv(qp.qpn, wr).expect("post_recv");
        };
        (0..RECVS).for_each(post_recv);
        connect_for_sends(&me, &qp, 0xa00 + side as u32);
        let checks = || {
            engine
                .counters()
                .naps_out_while_polled
                .load(std::sync::atomic::Ordering::Relaxed)
        };
        // Every send signalled and waited for, then the answer: ib_send_lat's loop.
        let send = |i: usize| {
            let wr = SendWr::new(i as u64, SendOp::Send, vec![buf.sge(0, MSG)]);
            engine.post_send(qp.qpn, wr).expect("post_send");
            spin_for_one(engine, qp.send_cq, "the send's ACK");
        };
        let receive = |what: &str| {
            let wc = spin_for_one(engine, qp.recv_cq, what);
            post_recv(wc.wr_id as usize);
        };
        let mut counted_from = 0;
        for i in 0..ROUNDS {
            if i == WARM_UP {
                counted_from = checks();
            }
            if side == 0 {
                send(i);
                receive("answer");
            } else {
                receive("question");
                send(i);
            }
        }
        (side, checks() - counted_from)
    });
    let counted = (ROUNDS - WARM_UP) as u64;
    for (side, wakes) in results {
        assert!(
            wakes * 100 < counted,
            "side {side}: the progress thread woke {wakes} times in {counted} rounds to find the \
             application still polling"
        );
    }
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

/// Swaps endpoints (for SENDs only: no memory) with the other side, brings `qp` up to RTS
/// towards it, and waits for the other side to be there too.
fn connect_for_sends(me: &Side<Endpoint>, qp: &Qp, psn: u32) {
    let peer = me.swap(Endpoint {
        qpn: qp.qpn,
        psn,
        ip: me.ip,
        va: 0,
        rkey: 0,
    });
    bring_up(&me.engine, qp, me.ip, &peer, psn, PathMtu::Mtu1024);
    me.connected.wait();
}

/// An interface taken down and brought up again (`ip link set IF down`, then `up`) under RC
/// WRITEs: while it is down the kernel refuses frames (`ENETDOWN`); the engine keeps them and
/// its QPs, retransmits on its timer, and does not spin; once the interface is up the WRITEs
/// complete, every byte intact. (It used to take `ENETDOWN` for an interface gone for good:
/// its progress thread stopped, and no QP of it ever sent again.)
#[test]
fn an_interface_down_for_a_while_delays_writes_but_loses_nothing() {
    if root_or_skip() {
        interface_down_for_a_while(Backend::AfXdp);
    }
}

/// The same with the writer on the DPDK port, whose driver takes frames into its ring whatever
/// the kernel does with them: the port reports the link down once that ring is full.
#[cfg(feature = "dpdk")]
#[test]
fn an_interface_down_under_a_dpdk_port_delays_writes_but_loses_nothing() {
    if root_or_skip() {
        interface_down_for_a_while(Backend::Dpdk);
    }
}

fn interface_down_for_a_while(backend: Backend) {
    const MSG: usize = 64 * 1024;
    const COUNT: usize = 16;
    const DOWN_FOR: Duration = Duration::from_millis(400);
    let setup = Setup::new(1500);
    let iface = setup.pair.iface(1).to_string();
    let peer_ip = setup.pair.ipv4(0).to_string();
    let peer_mac = setup
        .pair
        .exec(
            0,
            &format!("cat /sys/class/net/{}/address", setup.pair.iface(0)),
        )
        .expect("read side 0's MAC");
    let peer_mac = String::from_utf8_lossy(&peer_mac.stdout).trim().to_string();
    let configure: fn(usize, &mut EngineConfig) = match backend {
        Backend::AfXdp => |_, _| {},
        Backend::Dpdk => |side, config| {
            if side == 1 {
                config.backend = Backend::Dpdk;
            }
        },
    };
    setup.on_both_sides_configured(configure, move |me: Side<Endpoint>| {
        let engine = &me.engine;
        let qp = create_qp(engine, me.pd, QpType::Rc);
        to_init(engine, &qp);
        let mut buf = Buffer::new(engine, me.pd, MSG * COUNT);
        let data = pattern(11, MSG * COUNT);
        if me.index == 1 {
            buf.write(0, &data);
        }
        let peer = connect_with_memory(&me, &qp, &buf, 0x1000 + me.index as u32);
        if me.index == 0 {
            // The WRITEs' target: side 1 says when they are done (or is gone, having failed).
            me.from_peer
                .recv_timeout(WAIT * 2)
                .expect("side 1 completed its WRITEs");
            assert!(
                buf.read(0, MSG * COUNT) == data,
                "the WRITEs' data differs after the interface came back"
            );
            return;
        }
        // This thread runs in side 1's namespace, and so do the commands.
        let link = |state: &str| ip(&["link", "set", "dev", &iface, state]);
        let thread = progress_thread_id(engine);
        link("down");
        // Taking the interface down flushes its neighbours, and with no MAC for the peer the
        // engine drops its frames before the kernel sees them. A permanent entry keeps the
        // MAC, so that frames reach the kernel, which refuses them.
        ip(&[
            "neigh", "replace", &peer_ip, "lladdr", &peer_mac, "dev", &iface, "nud", "permanent",
        ]);
        post_writes(engine, &qp, &buf, &peer, 0..COUNT, MSG);
        let thread_cpu = |e: &Engine| {
            e.progress_cpu_time()
                .unwrap_or_else(|| panic!("the progress thread is gone: {:?}", e.failure()))
        };
        let cpu_before = thread_cpu(engine);
        let t0 = Instant::now();
        std::thread::sleep(DOWN_FOR);
        let cpu = thread_cpu(engine) - cpu_before;
        let share = cpu.as_secs_f64() / t0.elapsed().as_secs_f64() * 100.0;
        let mut wcs = Vec::new();
        engine
            .poll_cq(qp.send_cq, 64, &mut wcs)
            .expect("poll_cq while down");
        let counters = |e: &Engine| e.stats_line();
        assert!(
            wcs.is_empty(),
            "completions while the interface was down: {wcs:?}"
        );
        assert_eq!(engine.failure(), None, "{}", counters(engine));
        link("up");
        expect_completions(engine, qp.send_cq, COUNT, "WRITEs after the interface came back");
        let stats = counters(engine);
        eprintln!("interface down {DOWN_FOR:?}: progress thread (tid {thread}) used {share:.1} % of a core; {stats}");
        assert!(stats.contains(" link_downs=1 "), "ENETDOWN not seen: {stats}");
        assert!(!stats.contains(" timeouts=0 "), "nothing was retransmitted: {stats}");
        // Not a timing assertion: a thread spinning on the refused queue uses ~100 %.
        assert!(share < 50.0, "the progress thread spun while the interface was down: {share:.1} %");
        me.to_peer.send(peer).expect("tell side 0");
    });
}

/// An address handle or a modify that will be refused anyway (a GID index beyond the table,
/// an illegal transition) is refused at once with the verbs error, as rdma_rxe refuses it:
/// not after waiting for an address nobody answers, with an addressing error.
#[test]
fn requests_that_will_be_refused_do_not_wait_for_an_address() {
    if !root_or_skip() {
        return;
    }
    let setup = Setup::new(1500);
    let iface = setup.pair.iface(0).to_string();
    let own = setup.pair.ipv4(0);
    let [a, b, c, _] = own.octets();
    // On the namespace's subnet, and nobody's.
    let nobody = IpAddress::V4(std::net::Ipv4Addr::new(a, b, c, 250).into());
    setup.pair.run_in(0, move || {
        let engine = Engine::start(EngineConfig::new(&iface)).expect("engine");
        let pd = engine.with_device(|d| d.alloc_pd());
        let sgid_index = engine
            .gid_index(std::net::IpAddr::V4(own))
            .expect("own GID");
        let av = |sgid_index| AddressVector {
            dgid: nobody,
            sgid_index,
            traffic_class: 0,
            hop_limit: 64,
            flow_label: 0,
        };
        let refused = engine.create_ah(pd, av(200));
        assert!(
            matches!(refused, Err(VerbError::Verbs(_))),
            "create_ah with GID index 200: {refused:?}"
        );
        let qp = create_qp(&engine, pd, QpType::Rc); // in RESET
        let attr = QpAttr {
            state: QpState::Rtr,
            av: Some(av(sgid_index)),
            ..QpAttr::default()
        };
        let refused = engine.modify_qp(qp.qpn, &attr, AttrMask::STATE | AttrMask::AV);
        assert!(
            matches!(refused, Err(VerbError::Verbs(_))),
            "RESET -> RTR with an address vector: {refused:?}"
        );
    });
}

/// The counters the provider writes at exit never wait for the engine lock: a signal handler
/// may call `exit()` while the program's thread holds it inside a verb, and waiting then would
/// hang the process for ever. Taken, the transport's counters are left out and said to be.
#[test]
fn counters_at_exit_do_not_wait_for_a_verb_in_progress() {
    if !root_or_skip() {
        return;
    }
    let setup = Setup::new(1500);
    let iface = setup.pair.iface(0).to_string();
    setup.pair.run_in(0, move || {
        let engine = Engine::start(EngineConfig::new(&iface)).expect("engine");
        // The progress thread holds the lock for a round at a time: it is waited out.
        let free = engine.stats_line_waiting_at_most(Duration::from_secs(5));
        assert!(
            free.contains(" completions=0") && !free.contains("transport_busy"),
            "{free}"
        );
        // As a verb in progress: the engine lock held by this thread.
        let busy =
            engine.with_device(|_| engine.stats_line_waiting_at_most(Duration::from_millis(50)));
        assert!(
            busy.contains("transport_busy=1") && busy.contains(" rx_frames="),
            "{busy}"
        );
    });
}

/// A peer whose MAC changes without telling anyone (no gratuitous ARP: `arp_notify` is 0 by
/// default) is found again: the engine keeps the kernel's neighbour entry in use, so the kernel
/// probes the old MAC, finds nobody, resolves the address again, and the engine follows. The
/// peer's engine, meanwhile, drops frames still sent to its old MAC, as its kernel would. The
/// kernel's neighbour timers are shortened in the writer's namespace so that this takes a
/// couple of seconds, not a minute; the writer's QP retransmits about once a second meanwhile
/// (`retry_cnt` 7: for ever, within the test's wait). The target is told not to announce its
/// new MAC (`arp_notify` 0, which a namespace may otherwise inherit from the host as 1).
#[test]
fn a_peer_whose_mac_changes_is_found_again() {
    if !root_or_skip() {
        return;
    }
    const MSG: usize = 64 * 1024;
    const COUNT: usize = 8;
    let setup = Setup::new(1500);
    let writer_if = setup.pair.iface(0).to_string();
    for (knob, value) in [
        ("base_reachable_time_ms", "200"),
        ("delay_first_probe_time", "1"),
        ("retrans_time_ms", "100"),
        ("ucast_solicit", "1"),
    ] {
        sysctl(
            &setup.pair,
            0,
            &format!("net.ipv4.neigh.{writer_if}.{knob}={value}"),
        );
    }
    let target_if = setup.pair.iface(1).to_string();
    sysctl(
        &setup.pair,
        1,
        &format!("net.ipv4.conf.{target_if}.arp_notify=0"),
    );
    setup.on_both_sides(move |me: Side<Endpoint>| {
        let engine = &me.engine;
        let qp = create_qp(engine, me.pd, QpType::Rc);
        to_init(engine, &qp);
        let mut buf = Buffer::new(engine, me.pd, MSG * COUNT * 2);
        let data = pattern(23, MSG * COUNT * 2);
        // 4.096 µs × 2^18 ≈ 1.07 s per try, 7 retries: time for the kernel to notice.
        let peer = connect_timed(&me, &qp, &buf, 0x2000 + me.index as u32, 18);
        if me.index == 1 {
            // The target: changes its MAC when the first half is in, then checks all of it.
            me.from_peer.recv_timeout(WAIT).expect("first half written");
            const NEW_MAC: [u8; 6] = [0x02, 0, 0, 0x7a, 0x7a, 0x01];
            ip(&[
                "link",
                "set",
                "dev",
                &target_if,
                "address",
                "02:00:00:7a:7a:01",
            ]);
            // veth delivers frames whatever their destination MAC, so until this engine has
            // read its new MAC it would still take the writer's frames for the old one, and
            // the writer would lose nothing (seen on a loaded CI machine).
            let deadline = Instant::now() + WAIT;
            while engine.mac() != NEW_MAC {
                assert!(
                    Instant::now() < deadline,
                    "the engine did not follow its interface's new MAC: {:02x?}",
                    engine.mac()
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            me.to_peer.send(peer).expect("tell the writer");
            me.from_peer
                .recv_timeout(WAIT)
                .expect("second half written");
            assert!(
                buf.read(0, MSG * COUNT * 2) == data,
                "the WRITEs' data differs"
            );
            let stats = engine.stats_line();
            eprintln!("target: {stats}");
            assert!(
                !stats.contains(" rx_other_host=0 "),
                "no frame came to the old MAC, so the test tested nothing: {stats}"
            );
            return;
        }
        buf.write(0, &data);
        post_writes(engine, &qp, &buf, &peer, 0..COUNT, MSG);
        expect_completions(engine, qp.send_cq, COUNT, "WRITEs before the MAC change");
        me.to_peer.send(peer).expect("tell the target");
        me.from_peer
            .recv_timeout(WAIT)
            .expect("the target's MAC changed");
        post_writes(engine, &qp, &buf, &peer, COUNT..2 * COUNT, MSG);
        expect_completions(engine, qp.send_cq, COUNT, "WRITEs after the MAC change");
        // The target checks its side whatever this side finds, so that both are shown.
        me.to_peer.send(peer).expect("tell the target");
        let stats = engine.stats_line();
        eprintln!("writer: {stats}");
        assert!(!stats.contains(" timeouts=0 "), "nothing was lost: {stats}");
    });
}

/// Sets `setting` (`name=value`) in the namespace of `side`.
fn sysctl(pair: &NetnsPair, side: usize, setting: &str) {
    let o = pair
        .exec(side, &format!("sysctl -qw {setting}"))
        .expect("sysctl");
    assert!(o.status.success(), "sysctl {setting}: {o:?}");
}

/// Swaps endpoints (with `buf` open to the peer's WRITEs and READs) with the other side,
/// brings `qp` up to RTS towards it at path MTU 1024, and waits for the other side to be there
/// too. Returns the peer's endpoint.
fn connect_with_memory(me: &Side<Endpoint>, qp: &Qp, buf: &Buffer, psn: u32) -> Endpoint {
    connect_at(me, qp, buf, 0, psn, PathMtu::Mtu1024)
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

/// [`connect_with_memory`] with the local ACK timeout `timeout` (4.096 µs × 2^timeout).
fn connect_timed(me: &Side<Endpoint>, qp: &Qp, buf: &Buffer, psn: u32, timeout: u8) -> Endpoint {
    connect_timed_at(me, qp, buf, 0, psn, PathMtu::Mtu1024, timeout)
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

/// Adds fd00:4:4::9/64 (no duplicate address detection) to `iface` in namespace `ns`.
fn add_extra_v6(ns: &str, iface: &str) -> std::net::Ipv6Addr {
    ip(&[
        "-n",
        ns,
        "addr",
        "add",
        "fd00:4:4::9/64",
        "dev",
        iface,
        "nodad",
    ]);
    std::net::Ipv6Addr::new(0xfd00, 4, 4, 0, 0, 0, 0, 9)
}

/// Runs `ip ARGS` in the calling thread's network namespace; it must succeed.
fn ip(args: &[&str]) {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .expect("run ip");
    assert!(out.status.success(), "ip {args:?}: {out:?}");
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

/// The interface removed under two engines (`ip link del` takes both ends of the veth): each
/// device fails rather than leave its applications waiting forever. WRITEs in flight and
/// posted receives complete with flush errors, so does work posted afterwards, and the engine
/// says why. Side 1 is busy sending (the kernel refuses its next frames); side 0 has nothing
/// to send and spins on its CQ (its progress thread learns of the removal from the kernel's
/// link notification, and must take the engine from the polling application to act on it).
#[test]
fn a_removed_interface_fails_the_device_and_flushes_every_qp() {
    if !root_or_skip() {
        return;
    }
    const MSG: usize = 64 * 1024;
    let setup = Setup::new(1500);
    let (ns0, iface0, iface1) = (
        setup.pair.ns_name(0).to_string(),
        setup.pair.iface(0).to_string(),
        setup.pair.iface(1).to_string(),
    );
    setup.on_both_sides(move |me: Side<Endpoint>| {
        let engine = &me.engine;
        let qp = create_qp(engine, me.pd, QpType::Rc);
        to_init(engine, &qp);
        let buf = Buffer::new(engine, me.pd, 4 * MSG);
        if me.index == 0 {
            for i in 0..4 {
                let wr = RecvWr {
                    wr_id: 100 + i as u64,
                    sg_list: vec![buf.sge(i * 1024, 1024)].into(),
                };
                engine.post_recv(qp.qpn, wr).expect("post_recv");
            }
        }
        let peer = connect_with_memory(&me, &qp, &buf, 0x2000 + me.index as u32);
        if me.index == 0 {
            // Side 1 removes the interface; this side, with nothing to send, spins on its CQ
            // (so its progress thread keeps off the lock) until its receives are flushed.
            let mut wcs = Vec::new();
            let deadline = Instant::now() + WAIT;
            while wcs.len() < 4 {
                assert!(
                    Instant::now() < deadline,
                    "receives of the polling side: {} of 4 flushed after {WAIT:?} ({:?})",
                    wcs.len(),
                    engine.failure()
                );
                engine.poll_cq(qp.recv_cq, 4, &mut wcs).expect("poll_cq");
            }
            me.from_peer
                .recv_timeout(WAIT * 2)
                .expect("side 1 removed the interface");
            for (i, wc) in wcs.iter().enumerate() {
                assert_eq!(wc.status, WcStatus::WrFlushErr, "{wc:?}");
                assert_eq!(wc.wr_id, 100 + i as u64);
            }
            let why = engine.failure().expect("the idle side's engine failed");
            assert!(why.contains("removed"), "{why}");
            return;
        }
        // The peer's end down first: the WRITEs below stay in flight (unacknowledged).
        ip(&["-n", &ns0, "link", "set", "dev", &iface0, "down"]);
        post_writes(engine, &qp, &buf, &peer, 0..4, MSG);
        ip(&["link", "del", "dev", &iface1]);
        let wcs = poll_completions(engine, qp.send_cq, 4, "WRITEs in flight");
        for (i, wc) in wcs.iter().enumerate() {
            assert_eq!(wc.status, WcStatus::WrFlushErr, "{wc:?}");
            assert_eq!(wc.wr_id, i as u64);
        }
        assert!(engine.failure().is_some(), "{}", engine.stats_line());
        // Work posted now completes at once, flushed.
        let wr = SendWr::new(9, SendOp::Send, vec![buf.sge(0, 64)]);
        engine
            .post_send(qp.qpn, wr)
            .expect("post_send after the failure");
        let wcs = poll_completions(engine, qp.send_cq, 1, "a SEND posted after the failure");
        assert_eq!((wcs[0].wr_id, wcs[0].status), (9, WcStatus::WrFlushErr));
        me.to_peer.send(peer).expect("tell side 0");
    });
}

/// The XDP program removed from under a running engine (`xroce link del` while a program
/// uses the device): no RoCEv2 frame reaches the engine any more, and the kernel does not say
/// so. An engine with a WRITE waiting for its ACK finds out when its retransmissions time out
/// (here with the watch of the program's pins turned off, as for a process that cannot reach
/// bpffs), fails its device, and the WRITE completes with a flush error instead of being
/// retried forever.
#[test]
fn an_engine_whose_xdp_program_is_removed_fails_its_device() {
    xdp_program_unloaded_under_an_engine(Waiting::ForAnAck);
}

/// The same with an engine that has nothing to send: it only waits for a message, as a
/// server does. No retransmission times out there, so the engine learns of the unload from
/// the removal of the program's pins (`xdp::PinWatch`), without any verb called meanwhile,
/// fails its device, and the receive it waits on completes with a flush error.
#[test]
fn an_engine_waiting_to_receive_learns_at_once_that_its_xdp_program_was_unloaded() {
    xdp_program_unloaded_under_an_engine(Waiting::ForAMessage);
}

/// What side 1 waits for when its XDP program is unloaded.
#[derive(Clone, Copy, PartialEq)]
enum Waiting {
    ForAnAck,
    ForAMessage,
}

fn xdp_program_unloaded_under_an_engine(waiting: Waiting) {
    if !root_or_skip() {
        return;
    }
    let setup = Setup::new(1500);
    let iface1 = setup.pair.iface(1).to_string();
    let configure = match waiting {
        Waiting::ForAnAck => |_, c: &mut EngineConfig| c.watch_xdp_pins = false,
        Waiting::ForAMessage => |_, _: &mut EngineConfig| {},
    };
    setup.on_both_sides_configured(configure, move |me: Side<Endpoint>| {
        let engine = &me.engine;
        let qp = create_qp(engine, me.pd, QpType::Rc);
        to_init(engine, &qp);
        let buf = Buffer::new(engine, me.pd, 4096);
        if me.index == 1 && waiting == Waiting::ForAMessage {
            let wr = RecvWr {
                wr_id: 5,
                sg_list: vec![buf.sge(0, 1024)].into(),
            };
            engine.post_recv(qp.qpn, wr).expect("post_recv");
        }
        let peer = connect_with_memory(&me, &qp, &buf, 0x3000 + me.index as u32);
        if me.index == 0 {
            me.from_peer
                .recv_timeout(WAIT * 2)
                .expect("side 1 finished");
            assert_eq!(engine.failure(), None, "the side with its program failed");
            return;
        }
        xdp::unload(&iface1).expect("unload the XDP program");
        let (cq, wr_id) = match waiting {
            Waiting::ForAnAck => {
                post_writes(engine, &qp, &buf, &peer, 0..1, 1024);
                (qp.send_cq, 0)
            }
            Waiting::ForAMessage => {
                // No verb until the engine has failed: its progress thread must find out
                // alone.
                let deadline = Instant::now() + WAIT;
                while engine.failure().is_none() {
                    assert!(
                        Instant::now() < deadline,
                        "the engine did not notice the unload within {WAIT:?}; {}",
                        engine.stats_line()
                    );
                    std::thread::sleep(Duration::from_millis(10));
                }
                (qp.recv_cq, 5)
            }
        };
        let wcs = poll_completions(engine, cq, 1, "work the unload left waiting");
        assert_eq!((wcs[0].wr_id, wcs[0].status), (wr_id, WcStatus::WrFlushErr));
        let why = engine.failure().expect("the engine failed");
        assert!(why.contains("XDP program"), "{why}");
        me.to_peer.send(peer).expect("tell side 0");
    });
}

/// A NIC spreads flows over its receive queues, so a QP's frames may arrive on any queue, not
/// only the one its engine sends on. On a veth pair with four queues a frame sent on queue `q`
/// arrives on queue `q`: side 1's engine sends on queue 2, so its WRITEs (and its ACKs) arrive
/// on side 0's queue 2, and side 0's, sent on queue 0, on side 1's queue 0. Both transfers
/// arrive whole only if each engine receives on the queues besides its own (with
/// `all_rx_queues` off, both sides wait in vain).
#[test]
fn an_engine_receives_on_every_queue_of_its_interface() {
    if !root_or_skip() {
        return;
    }
    const MSG: usize = 64 * 1024;
    const COUNT: usize = 16;
    let turn = Turn::Shared(TURNS.read().unwrap_or_else(|p| p.into_inner()));
    let setup = Setup::with_queues(1500, 4, turn);
    setup.on_both_sides_configured(
        |side, c| c.queue = if side == 1 { 2 } else { 0 },
        move |me: Side<Endpoint>| {
            let engine = &me.engine;
            let own = if me.index == 1 { 2 } else { 0 };
            let mut queues = engine.queues().to_vec();
            assert_eq!(
                queues[0], own,
                "the queue it sends on comes first: {queues:?}"
            );
            queues.sort_unstable();
            assert_eq!(queues, [0, 1, 2, 3], "a socket on every queue in use");
            let qp = create_qp(engine, me.pd, QpType::Rc);
            to_init(engine, &qp);
            let mut buf = Buffer::new(engine, me.pd, 2 * MSG * COUNT);
            // Each side writes its pattern from the first half of its buffer into the second
            // half of the peer's.
            let mine = pattern(20 + me.index as u64, MSG * COUNT);
            buf.write(0, &mine);
            let mut peer = connect_with_memory(&me, &qp, &buf, 0x5000 + me.index as u32);
            peer.va += (MSG * COUNT) as u64;
            post_writes(engine, &qp, &buf, &peer, 0..COUNT, MSG);
            let wcs = poll_completions(engine, qp.send_cq, COUNT, "WRITEs to the peer");
            assert!(
                wcs.iter().all(|wc| wc.status == WcStatus::Success),
                "{wcs:?}"
            );
            me.to_peer.send(peer).expect("tell the peer");
            me.from_peer
                .recv_timeout(WAIT * 2)
                .expect("the peer's WRITEs completed");
            let theirs = pattern(20 + (1 - me.index) as u64, MSG * COUNT);
            assert!(
                buf.read(MSG * COUNT, MSG * COUNT) == theirs,
                "side {}: the peer's WRITEs differ",
                me.index
            );
            assert_eq!(engine.failure(), None);
        },
    );
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

/// An interface given more receive queues after its engine started (`ethtool -L`, as a cloud
/// agent may do) spreads frames over queues the engine has no socket on: the steering program
/// passes those to the kernel and their QPs stall. Nothing else would say why; when
/// retransmissions time out the engine looks, and says so (counted as `rx_queues_grown`).
#[test]
fn receive_queues_added_under_an_engine_are_reported() {
    if !root_or_skip() {
        return;
    }
    let turn = Turn::Shared(TURNS.read().unwrap_or_else(|p| p.into_inner()));
    let setup = Setup::with_queues(1500, 4, turn);
    let (iface, peer_iface) = (setup.pair.iface(0).to_string(), setup.pair.iface(1));
    // One receive queue at side 0 (veth with XDP wants the peer to send on no more).
    for (side, what) in [
        (1, format!("{peer_iface} tx 1")),
        (0, format!("{iface} rx 1")),
    ] {
        let out = setup
            .pair
            .exec(side, &format!("ethtool -L {what}"))
            .expect("run ethtool");
        assert!(out.status.success(), "ethtool -L {what}: {out:?}");
    }
    let local = IpAddress::V4(setup.pair.ipv4(0).into());
    let peer = IpAddress::V4(setup.pair.ipv4(1).into());
    setup.pair.run_in(0, move || {
        let engine = Engine::start(EngineConfig::new(&iface)).expect("engine");
        assert_eq!(engine.queues(), [0], "one queue at the start");
        // Nobody answers: the SEND's retransmissions time out.
        let (buf, qp) = connected_to_nobody(&engine, local, peer);
        let grown = || engine.counters().rx_queues_grown.load(Ordering::Relaxed);
        // Timeouts with the queues as they were: nothing to report.
        engine
            .post_send(qp.qpn, SendWr::new(1, SendOp::Send, vec![buf.sge(0, 64)]))
            .expect("post_send");
        let deadline = Instant::now() + WAIT;
        while engine.with_device(|d| d.counters().timeouts) == 0 {
            assert!(
                Instant::now() < deadline,
                "no timeout: {}",
                engine.stats_line()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(grown(), 0, "reported with the queues unchanged");
        // This thread is in the namespace; `ethtool` starts in it.
        let out = std::process::Command::new("ethtool")
            .args(["-L", &iface, "rx", "4"])
            .output()
            .expect("run ethtool");
        assert!(out.status.success(), "ethtool -L {iface} rx 4: {out:?}");
        let deadline = Instant::now() + WAIT;
        while grown() == 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(grown(), 1, "not reported: {}", engine.stats_line());
        drop(buf);
    });
}

/// A SEND posted from the application's thread to an idle RC QP starts its retransmission
/// timer there, while the progress thread sleeps with no timer to wait for. When the packet
/// is lost and the application then waits outside its verbs (blocked in
/// `ibv_get_cq_event`), only the progress thread can resend it: it must learn of the timer.
/// No engine answers at the peer's address, so every resend is lost too, and the QP (with
/// `retry_cnt` 7, which never runs out) must keep resending about every 16 ms without the
/// application having polled. (Before the fix: not one resend in the whole wait.)
#[test]
fn a_lost_send_is_resent_while_the_application_waits_outside_its_verbs() {
    if !root_or_skip() {
        return;
    }
    let setup = Setup::new(1500);
    let iface = setup.pair.iface(0).to_string();
    let local = IpAddress::V4(setup.pair.ipv4(0).into());
    let peer = IpAddress::V4(setup.pair.ipv4(1).into());
    setup.pair.run_in(0, move || {
        let engine = Engine::start(EngineConfig::new(&iface)).expect("engine");
        let (buf, qp) = connected_to_nobody(&engine, local, peer);
        // The progress thread spins a little after the set-up, then sleeps for events. Wait
        // past the new interfaces' IPv6 duplicate address detection (1 s): its end is an
        // address change, which wakes the thread and would let it see the timer anyway.
        std::thread::sleep(Duration::from_secs(3));
        engine
            .post_send(qp.qpn, SendWr::new(1, SendOp::Send, vec![buf.sge(0, 64)]))
            .expect("post_send");
        // Away from the verbs for about 120 retransmission timeouts.
        std::thread::sleep(Duration::from_secs(2));
        let c = engine.with_device(|d| d.counters());
        assert!(
            c.timeouts >= 2 && c.retransmissions >= 2,
            "timeouts and resends while the application waited: {}",
            engine.stats_line()
        );
        drop(buf);
    });
}

/// An address added while an application thread keeps polling a CQ enters the GID table
/// (the progress thread leaves such changes for a moment while the application is busy in
/// its verbs, but not for as long as it polls; before, they waited for the polls to stop).
#[test]
fn gid_table_follows_an_address_added_while_an_application_polls() {
    if !root_or_skip() {
        return;
    }
    let setup = Setup::new(1500);
    let iface = setup.pair.iface(0).to_string();
    let ns = setup.pair.ns_name(0).to_string();
    setup.pair.run_in(0, move || {
        let engine = Arc::new(Engine::start(EngineConfig::new(&iface)).expect("engine"));
        let cq = engine.with_device(|d| d.create_cq(16).expect("create_cq"));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let poller = {
            let (engine, stop) = (engine.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut out = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    engine.poll_cq(cq, 16, &mut out).expect("poll_cq");
                }
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        let added = add_extra_v6(&ns, &iface);
        let start = Instant::now();
        let mut seen = false;
        while !seen && start.elapsed() < WAIT {
            std::thread::sleep(Duration::from_millis(20));
            seen = engine.gid_index(added.into()).is_some();
        }
        let polling = !poller.is_finished();
        stop.store(true, Ordering::Relaxed);
        poller.join().expect("poller");
        assert!(polling, "the poller stopped early");
        assert!(
            seen,
            "{added} not in the GID table after {WAIT:?}: {:?}",
            engine.gids()
        );
    });
}

/// Sends `n` 64-byte UDP datagrams to `to` from namespace `side`, 5 ms apart.
fn send_udp_from(pair: &NetnsPair, side: usize, to: std::net::SocketAddr, n: u8) {
    pair.spawn_in(side, move || {
        let s = std::net::UdpSocket::bind(("0.0.0.0", 0)).expect("udp");
        for i in 0..n {
            s.send_to(&[i; 64], to).expect("send");
            std::thread::sleep(Duration::from_millis(5));
        }
    })
    .join()
    .expect("sender");
}

/// RoCEv2 for an address that is not the xroce device's stays with the kernel while an
/// engine runs: here a kernel UDP socket on port 4791 of an address on the namespace's
/// loopback, reached through the engine's interface (as a macvlan's or a VLAN device's
/// address would be, or a route through the host). The steering program takes only what is
/// addressed to the device's GIDs, and follows them: an address added to the interface is
/// steered. Before, every datagram went to the engine, which dropped it.
#[test]
fn roce_for_another_address_stays_with_the_kernel() {
    if !root_or_skip() {
        return;
    }
    let setup = Setup::new(1500);
    let iface = setup.pair.iface(0).to_string();
    let [a, b, c, _] = setup.pair.ipv4(0).octets();
    let other = std::net::Ipv4Addr::new(a, b, c, 50);
    let ns = setup.pair.ns_name(0);
    ip(&["-n", ns, "addr", "add", &format!("{other}/32"), "dev", "lo"]);
    let pair = &setup.pair;
    let (received, taken, to_engine) = pair.run_in(0, move || {
        let engine = Engine::start(EngineConfig::new(&iface)).expect("engine");
        let listener = std::net::UdpSocket::bind((other, 4791)).expect("bind 4791");
        listener
            // Generous: the loop ends at the tenth datagram.
            .set_read_timeout(Some(WAIT))
            .expect("timeout");
        send_udp_from(pair, 1, (other, 4791).into(), 10);
        let mut received = 0;
        let mut buf = [0u8; 128];
        while received < 10 && listener.recv_from(&mut buf).is_ok() {
            received += 1;
        }
        let taken = engine.with_device(|d| d.counters()).rx_packets;

        // An address added to the interface is the device's: the program follows the GID
        // table, and frames to it reach the engine.
        let added = std::net::Ipv4Addr::new(a, b, c, 51);
        ip(&["addr", "add", &format!("{added}/24"), "dev", &iface]);
        let start = Instant::now();
        while engine.gid_index(added.into()).is_none() && start.elapsed() < WAIT {
            std::thread::sleep(Duration::from_millis(10));
        }
        send_udp_from(pair, 1, (added, 4791).into(), 5);
        let start = Instant::now();
        let mut to_engine = 0;
        while to_engine < 5 && start.elapsed() < WAIT {
            std::thread::sleep(Duration::from_millis(10));
            to_engine = engine.with_device(|d| d.counters()).rx_packets - taken;
        }
        (received, taken, to_engine)
    });
    assert_eq!(
        (received, taken),
        (10, 0),
        "datagrams the kernel's socket received, frames the engine took"
    );
    assert_eq!(
        to_engine, 5,
        "frames to the added address that reached the engine"
    );
}
