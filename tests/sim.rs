//! A deterministic network simulator for the transport: devices joined by a simulated link
//! with virtual time, and knobs for loss, reordering, duplication, corruption and delay, all
//! drawn from one seed. The same seed replays the same run exactly.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use rand_chacha::rand_core::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use xroce_core::transport::qp_state::transition_rule;
use xroce_core::transport::{
    Access, AddressVector, AhId, AttrMask, CqId, Device, DeviceConfig, MemoryRegion, Nanos,
    PathMtu, PdId, QpAttr, QpCap, QpInit, QpState, QpType, RecvWr, SendWr, SrqId, VecMemory,
    VerbsError, WorkCompletion,
};
use xroce_core::wire::{IpAddress, Ipv4Address, Ipv6Address};

/// Faults and timing of the simulated link, applied independently to every packet.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkConfig {
    /// Probability that a packet is lost.
    pub loss: f64,
    /// Probability that a packet is delivered twice.
    pub duplicate: f64,
    /// Probability that a packet is held back by up to `reorder_window_ns`.
    pub reorder: f64,
    pub reorder_window_ns: u64,
    /// Probability that one bit of the packet flips (the receiver's ICRC check drops it).
    pub corrupt: f64,
    /// One-way propagation delay.
    pub delay_ns: u64,
    /// Uniform extra delay in `[0, jitter_ns]`.
    pub jitter_ns: u64,
    /// Serialisation time per byte at the sender (0.8 ≈ 10 Gbit/s); 0 for an infinitely fast
    /// link.
    pub ns_per_byte: f64,
    /// At most this many packets a node hands to the link at a time, the next burst once the
    /// last has left the node (like the engine, which sends in rounds and reads what arrived
    /// in between); `None`: everything the node has, at once.
    pub tx_burst: Option<usize>,
}

impl Default for LinkConfig {
    fn default() -> Self {
        LinkConfig {
            loss: 0.0,
            duplicate: 0.0,
            reorder: 0.0,
            reorder_window_ns: 0,
            corrupt: 0.0,
            delay_ns: 5_000,
            jitter_ns: 0,
            ns_per_byte: 0.8,
            tx_burst: None,
        }
    }
}

impl LinkConfig {
    /// A link that loses, duplicates, reorders and corrupts at the given rates.
    pub fn lossy(loss: f64, duplicate: f64, reorder: f64, corrupt: f64) -> Self {
        LinkConfig {
            loss,
            duplicate,
            reorder,
            reorder_window_ns: 50_000,
            corrupt,
            jitter_ns: 2_000,
            ..LinkConfig::default()
        }
    }
}

/// One simulated host: a device, its memory, and its address.
pub struct Node {
    pub dev: Device,
    pub mem: VecMemory,
    pub ip: IpAddress,
    pub pd: PdId,
    next_base: u64,
    busy_until: Nanos,
    /// With `LinkConfig::tx_burst`: when the node may send its next burst.
    tx_resume_at: Option<Nanos>,
}

impl Node {
    /// Adds `len` bytes of host memory and registers them; returns the region.
    pub fn alloc(&mut self, len: usize, access: Access) -> MemoryRegion {
        let base = self.next_base;
        // Leave a gap so that an access past the end hits no memory at all.
        self.next_base += (len as u64).div_ceil(4096) * 4096 + 0x10_000;
        self.mem.add(base, len.max(1));
        let (_, mr) = self
            .dev
            .reg_mr(self.pd, base, len as u64, access)
            .expect("registering simulator memory");
        mr
    }

    pub fn bytes(&self, mr: &MemoryRegion) -> &[u8] {
        self.mem.area(mr.va).expect("region memory")
    }

    pub fn bytes_mut(&mut self, mr: &MemoryRegion) -> &mut [u8] {
        self.mem.area_mut(mr.va).expect("region memory")
    }

    /// `post_send` with this node's memory (for inline data).
    pub fn post_send(&mut self, qpn: u32, wr: SendWr) -> Result<(), VerbsError> {
        self.dev.post_send(qpn, wr, &self.mem)
    }

    pub fn post_recv(&mut self, qpn: u32, wr: RecvWr) -> Result<(), VerbsError> {
        self.dev.post_recv(qpn, wr)
    }

    /// Drains a CQ.
    pub fn poll(&mut self, cq: CqId) -> Vec<WorkCompletion> {
        let mut out = Vec::new();
        self.dev.poll_cq(cq, usize::MAX, &mut out).expect("poll_cq");
        out
    }
}

/// Packets sent, lost, duplicated, corrupted and delivered by the link.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkStats {
    pub sent: u64,
    pub lost: u64,
    pub duplicated: u64,
    pub reordered: u64,
    pub corrupted: u64,
    pub delivered: u64,
}

struct InFlight {
    at: Nanos,
    seq: u64,
    to: usize,
    packet: Vec<u8>,
}

impl PartialEq for InFlight {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for InFlight {}
impl PartialOrd for InFlight {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for InFlight {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}

/// Devices on one simulated link.
pub struct Sim {
    pub now: Nanos,
    pub nodes: Vec<Node>,
    pub link: LinkConfig,
    pub stats: LinkStats,
    rng: ChaCha8Rng,
    queue: BinaryHeap<Reverse<InFlight>>,
    seq: u64,
    buf: Vec<u8>,
    /// When set, every packet put on the link is also recorded here (IP header onwards).
    pub trace: Option<Vec<(usize, Vec<u8>)>>,
    /// When set, called for every packet put on the link with the sending node's index and the
    /// packet (IP header onwards); `true` loses it (counted in `stats.lost`). Random loss cannot
    /// hit one chosen packet, so scenario tests use this to drop exactly the one they mean to.
    /// Runs after `trace` records the packet, and before any random fault.
    pub drop_filter: Option<DropFilter>,
}

/// Decides, per packet, whether the link loses it: `(sending node, packet) -> lose`.
pub type DropFilter = Box<dyn FnMut(usize, &[u8]) -> bool>;

/// IPv4 address of node `i`: 10.0.0.(i+1).
pub fn node_ipv4(i: usize) -> IpAddress {
    IpAddress::V4(Ipv4Address([10, 0, 0, i as u8 + 1]))
}

/// IPv6 address of node `i`: fd00::(i+1).
pub fn node_ipv6(i: usize) -> IpAddress {
    let mut a = [0u8; 16];
    a[0] = 0xfd;
    a[15] = i as u8 + 1;
    IpAddress::V6(Ipv6Address(a))
}

impl Sim {
    /// `n` nodes on IPv4 with port MTU 4096, faults from `link`, randomness from `seed`.
    pub fn new(seed: u64, n: usize, link: LinkConfig) -> Self {
        Self::with_addresses(seed, (0..n).map(node_ipv4).collect(), link)
    }

    pub fn with_addresses(seed: u64, ips: Vec<IpAddress>, link: LinkConfig) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let nodes = ips
            .into_iter()
            .map(|ip| {
                let mut key_seed = [0u8; 32];
                rng.fill_bytes(&mut key_seed);
                let mut dev = Device::new(DeviceConfig {
                    gids: vec![Some(ip)],
                    port_mtu: PathMtu::Mtu4096,
                    key_seed,
                    first_qpn: xroce_core::transport::device::limits::FIRST_QPN,
                });
                let pd = dev.alloc_pd();
                Node {
                    dev,
                    mem: VecMemory::new(),
                    ip,
                    pd,
                    next_base: 0x10_0000,
                    busy_until: 0,
                    tx_resume_at: None,
                }
            })
            .collect();
        Sim {
            now: 0,
            nodes,
            link,
            stats: LinkStats::default(),
            rng,
            queue: BinaryHeap::new(),
            seq: 0,
            buf: vec![0u8; 16384],
            trace: None,
            drop_filter: None,
        }
    }

    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && (self.rng.next_u64() as f64 / u64::MAX as f64) < p
    }

    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.rng.next_u64() % (n + 1)
        }
    }

    /// Moves every packet the devices want to send onto the link.
    pub fn transmit_all(&mut self) {
        for i in 0..self.nodes.len() {
            if self.nodes[i].tx_resume_at.is_some_and(|t| t > self.now) {
                continue;
            }
            self.nodes[i].tx_resume_at = None;
            let mut sent = 0;
            loop {
                if self.link.tx_burst.is_some_and(|b| sent >= b) {
                    // The rest waits until this burst has left the node.
                    self.nodes[i].tx_resume_at = Some(self.nodes[i].busy_until.max(self.now + 1));
                    break;
                }
                sent += 1;
                let now = self.now;
                let node = &mut self.nodes[i];
                let Some(t) = node.dev.poll_transmit(now, &node.mem, &mut self.buf) else {
                    break;
                };
                let packet = self.buf[..t.len].to_vec();
                let depart = self.nodes[i].busy_until.max(now)
                    + (t.len as f64 * self.link.ns_per_byte) as u64;
                self.nodes[i].busy_until = depart;
                if let Some(tr) = self.trace.as_mut() {
                    tr.push((i, packet.clone()));
                }
                self.stats.sent += 1;
                if let Some(drop) = self.drop_filter.as_mut() {
                    if drop(i, &packet) {
                        self.stats.lost += 1;
                        continue;
                    }
                }
                let Some(to) = self.nodes.iter().position(|n| n.ip == t.dst) else {
                    self.stats.lost += 1;
                    continue;
                };
                self.launch(depart, to, packet, true);
            }
        }
    }

    fn launch(&mut self, depart: Nanos, to: usize, mut packet: Vec<u8>, may_duplicate: bool) {
        if self.chance(self.link.loss) {
            self.stats.lost += 1;
            return;
        }
        if may_duplicate && self.chance(self.link.duplicate) {
            self.stats.duplicated += 1;
            self.launch(depart, to, packet.clone(), false);
        }
        if self.chance(self.link.corrupt) {
            self.stats.corrupted += 1;
            let bit = self.below(packet.len() as u64 * 8 - 1) as usize;
            packet[bit / 8] ^= 1 << (bit % 8);
        }
        let mut at = depart + self.link.delay_ns + self.below(self.link.jitter_ns);
        if self.chance(self.link.reorder) {
            self.stats.reordered += 1;
            at += self.below(self.link.reorder_window_ns);
        }
        self.seq += 1;
        self.queue.push(Reverse(InFlight {
            at,
            seq: self.seq,
            to,
            packet,
        }));
    }

    /// The next time anything happens: a delivery or a device timer.
    fn next_event(&self) -> Option<Nanos> {
        let d = self.queue.peek().map(|Reverse(f)| f.at);
        let t = self
            .nodes
            .iter()
            .flat_map(|n| [n.dev.poll_timeout(), n.tx_resume_at])
            .flatten()
            .min();
        match (d, t) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Advances to the next event and handles it. False when nothing is left to happen.
    pub fn step(&mut self) -> bool {
        self.transmit_all();
        let Some(t) = self.next_event() else {
            return false;
        };
        self.now = self.now.max(t);
        while self.queue.peek().is_some_and(|Reverse(f)| f.at <= self.now) {
            let Some(Reverse(f)) = self.queue.pop() else {
                break;
            };
            self.stats.delivered += 1;
            let now = self.now;
            let node = &mut self.nodes[f.to];
            node.dev.handle_packet(now, &f.packet, &mut node.mem);
        }
        for node in &mut self.nodes {
            if node.dev.poll_timeout().is_some_and(|t| t <= self.now) {
                node.dev.handle_timeout(self.now);
            }
        }
        self.transmit_all();
        true
    }

    /// Runs until `done` holds (true) or `limit_ns` of virtual time pass or nothing is left to
    /// happen (false).
    pub fn run_until(&mut self, limit_ns: Nanos, mut done: impl FnMut(&mut Sim) -> bool) -> bool {
        let end = self.now + limit_ns;
        loop {
            self.transmit_all();
            if done(self) {
                return true;
            }
            if self.next_event().is_none_or(|t| t > end) {
                return done(self);
            }
            self.step();
        }
    }

    /// Runs until no packet is in flight and no timer is armed, or `limit_ns` passes.
    pub fn run_idle(&mut self, limit_ns: Nanos) -> bool {
        let end = self.now + limit_ns;
        loop {
            self.transmit_all();
            match self.next_event() {
                None => return true,
                Some(t) if t > end => return false,
                Some(_) => {
                    self.step();
                }
            }
        }
    }
}

/// How to set up a connected QP pair.
#[derive(Debug, Clone, Copy)]
pub struct ConnectOptions {
    pub ty: QpType,
    pub path_mtu: PathMtu,
    pub access: Access,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub min_rnr_timer: u8,
    pub max_rd_atomic: u8,
    pub cap: QpCap,
    pub cqe: u32,
    /// Initial PSNs of the QP on the first node and on the second.
    pub psn: (u32, u32),
    pub sq_sig_all: bool,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            ty: QpType::Rc,
            path_mtu: PathMtu::Mtu1024,
            access: Access::LOCAL_WRITE
                | Access::REMOTE_WRITE
                | Access::REMOTE_READ
                | Access::REMOTE_ATOMIC,
            // 4.096 µs << 8 ≈ 1 ms: short enough for quick tests, far above the simulated RTT.
            timeout: 8,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 1,
            max_rd_atomic: 16,
            cap: QpCap {
                max_send_wr: 4096,
                max_recv_wr: 4096,
                max_send_sge: 8,
                max_recv_sge: 8,
                max_inline_data: 256,
            },
            cqe: 32767,
            psn: (0x100, 0x200),
            sq_sig_all: false,
        }
    }
}

/// One end of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpEnd {
    pub node: usize,
    pub qpn: u32,
    pub send_cq: CqId,
    pub recv_cq: CqId,
}

/// Creates a QP on node `i` in RESET, with CQs of at least `o.cqe` entries (see
/// `cq::rounded_capacity`) and no SRQ.
pub fn create_qp(sim: &mut Sim, i: usize, o: &ConnectOptions) -> QpEnd {
    create_qp_with(sim, i, o, o.cqe, o.cqe, None)
}

/// Creates a QP on node `i` in RESET, with its own CQs of the given sizes and an optional SRQ.
pub fn create_qp_with(
    sim: &mut Sim,
    i: usize,
    o: &ConnectOptions,
    send_cqe: u32,
    recv_cqe: u32,
    srq: Option<SrqId>,
) -> QpEnd {
    let node = &mut sim.nodes[i];
    let send_cq = node.dev.create_cq(send_cqe).expect("create_cq");
    let recv_cq = node.dev.create_cq(recv_cqe).expect("create_cq");
    let qpn = node
        .dev
        .create_qp(QpInit {
            ty: o.ty,
            pd: node.pd,
            send_cq,
            recv_cq,
            srq,
            cap: o.cap,
            sq_sig_all: o.sq_sig_all,
        })
        .expect("create_qp");
    QpEnd {
        node: i,
        qpn,
        send_cq,
        recv_cq,
    }
}

/// The attributes a QP of type `ty` must be given on its way up to `to` (RESET to INIT, INIT
/// to RTR, RTR to RTS), from the transport's transition table, `STATE` included.
pub fn required_mask(ty: QpType, to: QpState) -> AttrMask {
    let from = match to {
        QpState::Init => QpState::Reset,
        QpState::Rtr => QpState::Init,
        QpState::Rts => QpState::Rtr,
        other => panic!("{other:?} is not a state on the way up"),
    };
    AttrMask::STATE | transition_rule(from, to, ty).map_or(AttrMask::NONE, |r| r.required)
}

/// Brings a RESET QP through INIT and RTR to RTS, connected to `remote`.
pub fn bring_up(
    sim: &mut Sim,
    end: QpEnd,
    remote: QpEnd,
    o: &ConnectOptions,
    sq_psn: u32,
    rq_psn: u32,
) {
    let remote_ip = sim.nodes[remote.node].ip;
    let dev = &mut sim.nodes[end.node].dev;
    let mut a = QpAttr {
        state: QpState::Init,
        port_num: 1,
        access: o.access,
        qkey: 0x1111_1111,
        ..QpAttr::default()
    };
    dev.modify_qp(end.qpn, &a, required_mask(o.ty, QpState::Init))
        .expect("to INIT");
    a.state = QpState::Rtr;
    a.path_mtu = o.path_mtu;
    a.dest_qpn = remote.qpn;
    a.rq_psn = rq_psn;
    a.max_dest_rd_atomic = o.max_rd_atomic;
    a.min_rnr_timer = o.min_rnr_timer;
    a.av = Some(AddressVector {
        dgid: remote_ip,
        sgid_index: 0,
        traffic_class: 0,
        hop_limit: 64,
        flow_label: 0,
    });
    dev.modify_qp(end.qpn, &a, required_mask(o.ty, QpState::Rtr))
        .expect("to RTR");
    a.state = QpState::Rts;
    a.sq_psn = sq_psn;
    a.timeout = o.timeout;
    a.retry_cnt = o.retry_cnt;
    a.rnr_retry = o.rnr_retry;
    a.max_rd_atomic = o.max_rd_atomic;
    dev.modify_qp(end.qpn, &a, required_mask(o.ty, QpState::Rts))
        .expect("to RTS");
}

/// A connected RC or UC pair between nodes `a` and `b`.
pub fn connect(sim: &mut Sim, a: usize, b: usize, o: &ConnectOptions) -> (QpEnd, QpEnd) {
    let ea = create_qp(sim, a, o);
    let eb = create_qp(sim, b, o);
    bring_up(sim, ea, eb, o, o.psn.0, o.psn.1);
    bring_up(sim, eb, ea, o, o.psn.1, o.psn.0);
    (ea, eb)
}

/// Two UD QPs in RTS, on nodes `a` and `b`, and an address handle on `a` for `b`.
pub fn ud_pair(sim: &mut Sim, a: usize, b: usize) -> (QpEnd, QpEnd, AhId) {
    let o = ConnectOptions {
        ty: QpType::Ud,
        ..ConnectOptions::default()
    };
    let qa = create_qp(sim, a, &o);
    let qb = create_qp(sim, b, &o);
    bring_up(sim, qa, qb, &o, 0x10, 0);
    bring_up(sim, qb, qa, &o, 0x20, 0);
    let ah = address_handle(sim, a, b, 0);
    (qa, qb, ah)
}

/// An address handle on node `a` for node `b`, with this traffic class.
pub fn address_handle(sim: &mut Sim, a: usize, b: usize, traffic_class: u8) -> AhId {
    let dgid = sim.nodes[b].ip;
    let pd = sim.nodes[a].pd;
    sim.nodes[a]
        .dev
        .create_ah(
            pd,
            AddressVector {
                dgid,
                sgid_index: 0,
                traffic_class,
                hop_limit: 64,
                flow_label: 0,
            },
        )
        .expect("create_ah")
}

/// A number below `n` (0 when `n` is 0), for the randomised tests' generators.
pub fn below(rng: &mut ChaCha8Rng, n: u64) -> u64 {
    rng.next_u64() % n.max(1)
}

/// True `percent` times in a hundred.
pub fn chance(rng: &mut ChaCha8Rng, percent: u32) -> bool {
    rng.next_u32() % 100 < percent
}

/// The seeds a randomised test runs: only `XROCE_SIM_SEED` when it is set, else the first
/// `XROCE_SIM_SEEDS` (default `default`).
pub fn seeds_from_env(default: u64) -> Vec<u64> {
    match std::env::var("XROCE_SIM_SEED") {
        Ok(s) => vec![s.parse().expect("XROCE_SIM_SEED must be a number")],
        Err(_) => (0..std::env::var("XROCE_SIM_SEEDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(default))
            .collect(),
    }
}

/// Held while a randomised test runs one seed: a panic, wherever it comes from (an assertion
/// or the code under test), then names the seed that replays it.
pub struct NameSeedOnPanic(pub u64);

impl Drop for NameSeedOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "failed at seed {0}: rerun it alone with XROCE_SIM_SEED={0}",
                self.0
            );
        }
    }
}
