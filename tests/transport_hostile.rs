//! A peer that sends anything. Anyone on the link can send RoCEv2 frames to a device, with
//! correct checksums and ICRC, from a connected peer's address and aimed at live QPs: random
//! opcodes, PSNs near and far from the expected ones, extension headers pointing inside,
//! across and outside registered memory with right and wrong keys, lengths that disagree,
//! unknown opcodes, bad pad counts and garbage after the BTH. Mixed with legitimate traffic
//! both ways, none of it may panic either device (the engine runs inside the application's
//! process), write memory that has no remote write access and is no receive or READ target,
//! or leave the device unable to serve a new connection. `HOSTILE_DEBUG=1` (with
//! `--nocapture`) prints what the forged frames did to the victim's counters.

use rand_chacha::rand_core::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;
use xroce_core::icrc;
use xroce_core::transport::verbs::{SendFlags, UdDest};

use xroce_core::transport::{Access, MemoryRegion, QpType, RecvWr, SendOp, SendWr, Sge, SrqId};
use xroce_core::wire::opcode::{HeaderKind, OPCODE_TABLE};
use xroce_core::wire::{
    emit_frame, AethRepr, AethSyndrome, AtomicAckEthRepr, AtomicEthRepr, BthRepr, DethRepr,
    FethRepr, FrameHeaders, IpAddress, IpRepr, Ipv4Repr, Ipv6Repr, Opcode, RdethRepr, RethRepr,
    TransportRepr, UdpRepr, WireError, ROCEV2_UDP_PORT,
};
use xroce_tests::sim::{
    below, bring_up, chance, connect, create_qp, create_qp_with, node_ipv6, seeds_from_env,
    ud_pair, ConnectOptions, LinkConfig, NameSeedOnPanic, QpEnd, Sim,
};

/// The victim's node and its legitimate peer's.
const VICTIM: usize = 0;
const PEER: usize = 1;
/// Forged frames per episode, episodes per seed, and seeds (`XROCE_SIM_SEEDS` overrides).
const FORGED: usize = 120;
const EPISODES: usize = 16;
const SEEDS: u64 = 48;
/// What every byte of the memory no one may write holds.
const UNTOUCHED: u8 = 0x5a;

/// The victim's memory and keys an attacker aims at.
struct Targets {
    /// Remote write, read and atomic access: the legitimate peer's target too.
    open: MemoryRegion,
    /// Remote read only.
    read_only: MemoryRegion,
    /// Local access only, never named by a posted work request.
    local_only: MemoryRegion,
    /// Receives and READ sinks of the victim's own requests.
    sink: MemoryRegion,
}

impl Targets {
    fn regions(&self) -> [&MemoryRegion; 4] {
        [&self.open, &self.read_only, &self.local_only, &self.sink]
    }
}

/// The IP header of a frame from `src` to `dst` (both IPv4 or both IPv6).
fn ip_header(rng: &mut ChaCha8Rng, src: IpAddress, dst: IpAddress) -> IpRepr {
    match (src, dst) {
        (IpAddress::V4(src), IpAddress::V4(dst)) => IpRepr::V4(Ipv4Repr {
            src,
            dst,
            tos: 0,
            ident: rng.next_u32() as u16,
            dont_frag: true,
            ttl: 64,
            protocol: 17,
            payload_len: 0,
        }),
        (IpAddress::V6(src), IpAddress::V6(dst)) => IpRepr::V6(Ipv6Repr {
            src,
            dst,
            traffic_class: 0,
            flow_label: rng.next_u32() & 0xf_ffff,
            next_header: 17,
            hop_limit: 64,
            payload_len: 0,
        }),
        _ => panic!("the nodes' addresses are of one family"),
    }
}

/// An address an attacker would try: inside a region, just around its ends, or anywhere.
fn aim(rng: &mut ChaCha8Rng, t: &Targets) -> (u64, u32) {
    let regions = t.regions();
    let r = regions[below(rng, 4) as usize];
    let va = match below(rng, 6) {
        0 => r.va,
        1 => r.va + below(rng, r.len),
        2 => r.va + r.len - below(rng, 16).min(r.len),
        3 => r.va.wrapping_sub(below(rng, 64) + 1),
        4 => r.va + r.len + below(rng, 64),
        _ => rng.next_u64(),
    };
    let key = match below(rng, 5) {
        0..=2 => r.rkey,
        3 => regions[below(rng, 4) as usize].lkey,
        _ => rng.next_u32(),
    };
    (va, key)
}

fn length(rng: &mut ChaCha8Rng) -> u32 {
    match below(rng, 5) {
        0 => 0,
        1 => below(rng, 64) as u32,
        2 => below(rng, 4096) as u32,
        3 => u32::MAX - below(rng, 8) as u32,
        _ => rng.next_u32(),
    }
}

/// RC's response opcodes: READ responses, ACKnowledge, atomic ACKnowledge.
const RC_RESPONSES: std::ops::RangeInclusive<u8> = 0x0d..=0x12;

/// The opcode of a forged frame: mostly one of the target QP's transport (only RC responses
/// in an episode that attacks requesters), sometimes any known opcode, sometimes a byte no
/// opcode has.
fn opcode(rng: &mut ChaCha8Rng, ty: QpType, responses_only: bool) -> u8 {
    if responses_only && ty == QpType::Rc && chance(rng, 90) {
        return RC_RESPONSES.start() + below(rng, RC_RESPONSES.count() as u64) as u8;
    }
    let base = match ty {
        QpType::Rc => 0x00,
        QpType::Uc => 0x20,
        _ => 0x60,
    };
    let known: Vec<u8> = (0..=255u8)
        .filter(|&o| OPCODE_TABLE[usize::from(o)].is_some())
        .collect();
    match below(rng, 10) {
        0..=6 => {
            let own: Vec<u8> = known.iter().copied().filter(|o| o & 0xe0 == base).collect();
            own[below(rng, own.len() as u64) as usize]
        }
        7 | 8 => known[below(rng, known.len() as u64) as usize],
        _ => rng.next_u32() as u8,
    }
}

/// A frame from the peer's address to one of the victim's QPs (or a QPN near them), ICRC
/// correct: forged headers, and now and then bytes after the BTH or the pad count garbled.
fn forge(
    rng: &mut ChaCha8Rng,
    sim: &Sim,
    qps: &[(QpEnd, QpType, u32)],
    t: &Targets,
    responses_only: bool,
) -> Vec<u8> {
    let (qp, ty, psn0) = qps[below(rng, qps.len() as u64) as usize];
    let op = opcode(rng, ty, responses_only);
    let dest_qpn = if chance(rng, 90) {
        qp.qpn
    } else {
        qp.qpn.wrapping_add(below(rng, 5) as u32).wrapping_sub(2) & 0xff_ffff
    };
    // Requests aim at the PSN the victim's responder expects next, responses at the last PSN
    // its requester sent (`sq_psn` is the next one it will send): where the attack gets
    // furthest.
    let live = sim.nodes[VICTIM].dev.query_qp(qp.qpn).ok();
    let is_response = RC_RESPONSES.contains(&(op & 0x1f));
    let expected = live.map_or(psn0, |a| {
        if is_response {
            a.sq_psn.wrapping_sub(1) & 0xff_ffff
        } else {
            a.rq_psn
        }
    });
    let psn = match below(rng, 10) {
        0..=4 => expected,
        5 | 6 => expected.wrapping_sub(below(rng, 8) as u32 + 1) & 0xff_ffff,
        7 | 8 => psn0.wrapping_add(below(rng, 96) as u32).wrapping_sub(16) & 0xff_ffff,
        _ => rng.next_u32() & 0xff_ffff,
    };
    let bth = BthRepr {
        solicited: chance(rng, 20),
        mig_req: chance(rng, 50),
        ack_req: chance(rng, 50),
        ..BthRepr::new(Opcode(op), dest_qpn, psn)
    };
    let mut tr = TransportRepr::new(bth);
    let info = Opcode(op).info();
    let has = |k| info.is_some_and(|i| i.headers.contains(k));
    if has(HeaderKind::Rdeth) {
        tr.rdeth = Some(RdethRepr {
            ee_context: rng.next_u32() & 0xff_ffff,
        });
    }
    if has(HeaderKind::Deth) {
        tr.deth = Some(DethRepr {
            qkey: if chance(rng, 70) {
                0x1111_1111
            } else {
                rng.next_u32()
            },
            src_qpn: rng.next_u32() & 0xff_ffff,
        });
    }
    if has(HeaderKind::Feth) {
        tr.feth = Some(FethRepr {
            selectivity: 0,
            placement: 0,
        });
    }
    if has(HeaderKind::Reth) {
        let (va, rkey) = aim(rng, t);
        tr.reth = Some(RethRepr {
            va,
            rkey,
            dma_len: length(rng),
        });
    }
    if has(HeaderKind::AtomicEth) {
        let (va, rkey) = aim(rng, t);
        tr.atomic_eth = Some(AtomicEthRepr {
            va: if chance(rng, 70) { va & !7 } else { va },
            rkey,
            swap_add: rng.next_u64(),
            compare: rng.next_u64(),
        });
    }
    if has(HeaderKind::Aeth) {
        tr.aeth = Some(AethRepr {
            syndrome: AethSyndrome::from(rng.next_u32() as u8),
            msn: rng.next_u32() & 0xff_ffff,
        });
    }
    if has(HeaderKind::AtomicAckEth) {
        tr.atomic_ack_eth = Some(AtomicAckEthRepr {
            orig: rng.next_u64(),
        });
    }
    if has(HeaderKind::ImmDt) {
        tr.immediate = Some(rng.next_u32());
    }
    if has(HeaderKind::Ieth) {
        tr.invalidate_rkey = Some(aim(rng, t).1);
    }
    let carries = info.is_none_or(|i| i.has_payload());
    let payload: Vec<u8> = if carries {
        let n = match below(rng, 4) {
            0 => 0,
            1 => below(rng, 64),
            2 => 1024 - below(rng, 4),
            _ => below(rng, 1100),
        };
        (0..n).map(|_| rng.next_u32() as u8).collect()
    } else {
        Vec::new()
    };
    let headers = FrameHeaders {
        eth: None,
        ip: ip_header(rng, sim.nodes[PEER].ip, sim.nodes[VICTIM].ip),
        udp: UdpRepr {
            src_port: 0xc000 | rng.next_u32() as u16,
            dst_port: ROCEV2_UDP_PORT,
            payload_len: 0,
        },
        transport: tr,
    };
    // Where the BTH starts: after the IP and UDP headers.
    let bth_at = headers.ip.header_len() + 8;
    let mut buf = vec![0u8; 2048];
    let n = match emit_frame(&mut buf, &headers, &payload) {
        Ok(n) => n,
        // An opcode no table entry has: write a SEND's frame and put the byte in its place.
        Err(WireError::UnknownOpcode(_)) => {
            let mut h = headers;
            h.transport = TransportRepr::new(BthRepr::new(Opcode::RC_SEND_ONLY, dest_qpn, psn));
            let n = emit_frame(&mut buf, &h, &payload).expect("a SEND frame");
            buf[bth_at] = op;
            n
        }
        Err(e) => panic!("a forged frame could not be built: {e} ({headers:?})"),
    };
    let mut frame = buf[..n].to_vec();
    // The BTH (12 bytes), then extension headers and payload, then the ICRC (4).
    let ext_at = bth_at + 12;
    if chance(rng, 10) && frame.len() > ext_at + 4 {
        let at = ext_at + below(rng, (frame.len() - ext_at - 4) as u64) as usize;
        frame[at] = rng.next_u32() as u8;
    }
    if chance(rng, 5) {
        let flags = bth_at + 1;
        frame[flags] = (frame[flags] & !0x30) | ((rng.next_u32() as u8 & 3) << 4);
    }
    icrc::fill(&mut frame).expect("the ICRC of a frame just built");
    frame
}

/// A receive of `len` bytes at offset `at` of `mr`.
fn recv_wr(mr: &MemoryRegion, at: u64, len: u32) -> RecvWr {
    RecvWr {
        wr_id: at,
        sg_list: std::iter::once(Sge {
            addr: mr.va + at,
            length: len,
            lkey: mr.lkey,
        })
        .collect(),
    }
}

fn post_recv(sim: &mut Sim, node: usize, qpn: u32, mr: &MemoryRegion, at: u64, len: u32) {
    // A QP the attack moved to ERROR takes it and flushes it.
    let _ = sim.nodes[node].post_recv(qpn, recv_wr(mr, at, len));
}

fn post_srq_recv(sim: &mut Sim, srq: SrqId, mr: &MemoryRegion, at: u64, len: u32) {
    let wr = recv_wr(mr, at, len);
    sim.nodes[VICTIM]
        .dev
        .post_srq_recv(srq, wr)
        .expect("post_srq_recv");
}

/// Legitimate work in both directions on the connections under attack.
fn legit_work(
    rng: &mut ChaCha8Rng,
    sim: &mut Sim,
    qps: &[(QpEnd, QpType, u32)],
    peers: &[QpEnd],
    t: &Targets,
    peer_mr: &MemoryRegion,
    ud_ah: xroce_core::transport::AhId,
) {
    let i = below(rng, qps.len() as u64) as usize;
    let (victim, ty, _) = qps[i];
    let peer = peers[i];
    let len = below(rng, 2048) as u32;
    let sge = |mr: &MemoryRegion, len: u32| Sge {
        addr: mr.va,
        length: len,
        lkey: mr.lkey,
    };
    let (node, qpn, wr) = if chance(rng, 50) {
        // The victim asks: a SEND, or on RC a READ into its sink or a WRITE to the peer.
        let op = match (ty, below(rng, 3)) {
            (QpType::Rc, 1) => SendOp::RdmaRead {
                remote_addr: peer_mr.va,
                rkey: peer_mr.rkey,
            },
            (QpType::Rc | QpType::Uc, 2) => SendOp::RdmaWrite {
                remote_addr: peer_mr.va,
                rkey: peer_mr.rkey,
            },
            _ => SendOp::Send,
        };
        let mut wr = SendWr::new(0, op, vec![sge(&t.sink, len.min(1024))]);
        if ty == QpType::Ud {
            wr.ud = Some(UdDest {
                ah: ud_ah,
                remote_qpn: peer.qpn,
                remote_qkey: 0x1111_1111,
            });
        }
        (VICTIM, victim.qpn, wr)
    } else {
        // The peer asks: a SEND, or a WRITE into the open region.
        let op = if ty != QpType::Ud && chance(rng, 50) {
            SendOp::RdmaWrite {
                remote_addr: t.open.va,
                rkey: t.open.rkey,
            }
        } else {
            SendOp::Send
        };
        let mut wr = SendWr::new(0, op, vec![sge(peer_mr, len.min(1024))]);
        wr.flags = SendFlags::SIGNALED;
        if ty == QpType::Ud {
            return; // the peer's UD QP has no address handle for the victim here
        }
        (PEER, peer.qpn, wr)
    };
    // Refused (a QP in ERROR, a full queue) is fine: the attack may have caused it.
    let _ = sim.nodes[node].post_send(qpn, wr);
    if node == VICTIM {
        // On the link but not yet delivered: the victim waits for its responses, which the
        // forged ones now race.
        sim.transmit_all();
    }
}

/// Runs one seed; returns what the forged frames did to the victim's counters.
fn run_seed(seed: u64) -> BTreeMap<&'static str, u64> {
    let _named = NameSeedOnPanic(seed);
    let mut by_forged = BTreeMap::new();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    // Odd seeds run over IPv6.
    let mut sim = if seed % 2 == 1 {
        Sim::with_addresses(
            seed,
            vec![node_ipv6(0), node_ipv6(1)],
            LinkConfig::default(),
        )
    } else {
        Sim::new(seed, 2, LinkConfig::default())
    };
    let all =
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let t = Targets {
        open: sim.nodes[VICTIM].alloc(8192, all),
        read_only: sim.nodes[VICTIM].alloc(4096, Access::REMOTE_READ),
        local_only: sim.nodes[VICTIM].alloc(4096, Access::LOCAL_WRITE),
        sink: sim.nodes[VICTIM].alloc(64 * 1024, Access::LOCAL_WRITE),
    };
    for mr in [&t.read_only, &t.local_only] {
        sim.nodes[VICTIM].bytes_mut(mr).fill(UNTOUCHED);
    }
    let peer_mr = sim.nodes[PEER].alloc(64 * 1024, all);
    // Finite retries (7 is infinite, as in rdma_rxe): a connection the attack broke at one end
    // gives up at the other, and the run below ends.
    let rc = ConnectOptions {
        retry_cnt: 6,
        rnr_retry: 6,
        ..ConnectOptions::default()
    };
    let pd = sim.nodes[VICTIM].pd;
    let srq = sim.nodes[VICTIM]
        .dev
        .create_srq(pd, 1024, 4)
        .expect("create_srq");
    // Short episodes on fresh connections: an attack soon moves a QP to ERROR, where it
    // drops everything, so each episode starts from QPs the attack has not reached yet.
    for episode in 0..EPISODES {
        // Every third episode attacks the requesters: forged frames to RC QPs are responses,
        // which leave the responder (and so the QP) alive longer.
        let responses_only = episode % 3 == 2;
        let (rc_a, rc_b) = connect(&mut sim, VICTIM, PEER, &rc);
        // A connection that grants the peer no remote access at all.
        let closed = ConnectOptions {
            access: Access::LOCAL_WRITE,
            // PSNs where the 24-bit distance changes sign, and about to wrap.
            psn: (0x7f_fff0, 0xff_fff8),
            ..rc
        };
        let (rc2_a, rc2_b) = connect(&mut sim, VICTIM, PEER, &closed);
        let uc = ConnectOptions {
            ty: QpType::Uc,
            ..rc
        };
        let (uc_a, uc_b) = connect(&mut sim, VICTIM, PEER, &uc);
        let (ud_a, ud_b, ud_ah) = ud_pair(&mut sim, VICTIM, PEER);
        // An RC QP whose receives come from a shared receive queue.
        let srq_a = create_qp_with(&mut sim, VICTIM, &rc, rc.cqe, rc.cqe, Some(srq));
        let srq_b = create_qp(&mut sim, PEER, &rc);
        bring_up(&mut sim, srq_a, srq_b, &rc, rc.psn.0, rc.psn.1);
        bring_up(&mut sim, srq_b, srq_a, &rc, rc.psn.1, rc.psn.0);
        let peers = [rc_b, rc2_b, uc_b, ud_b, srq_b];
        // (victim QP, its type, the PSN its peer starts sending from)
        let start = |sim: &Sim, peer: QpEnd| {
            sim.nodes[PEER]
                .dev
                .query_qp(peer.qpn)
                .expect("the peer's QP")
                .sq_psn
        };
        let qps = [
            (rc_a, QpType::Rc, start(&sim, rc_b)),
            (rc2_a, QpType::Rc, start(&sim, rc2_b)),
            (uc_a, QpType::Uc, start(&sim, uc_b)),
            (ud_a, QpType::Ud, start(&sim, ud_b)),
            (srq_a, QpType::Rc, start(&sim, srq_b)),
        ];
        for k in 0..16 {
            post_srq_recv(&mut sim, srq, &t.sink, k * 2048, 1024 + 40);
        }
        for (i, (qp, _, _)) in qps.iter().enumerate() {
            // The closed connection gets no receives: forged SENDs find none (RNR NAKs).
            let receives = if qp.qpn == rc2_a.qpn { 0 } else { 16 };
            for k in 0..16 {
                if k < receives {
                    let at = (i as u64 * 16 + k) * 1024 % 60_000;
                    post_recv(&mut sim, VICTIM, qp.qpn, &t.sink, at, 1024 + 40);
                }
                post_recv(&mut sim, PEER, peers[i].qpn, &peer_mr, k * 2048, 2048);
            }
        }

        // Requests of the victim's own on the link (sent, not yet delivered) when the attack
        // starts: forged responses then race the real ones.
        for (qp, ty, _) in &qps {
            if *ty != QpType::Rc {
                continue;
            }
            let sink = |len| {
                vec![Sge {
                    addr: t.sink.va,
                    length: len,
                    lkey: t.sink.lkey,
                }]
            };
            let read = SendOp::RdmaRead {
                remote_addr: peer_mr.va,
                rkey: peer_mr.rkey,
            };
            for wr in [
                SendWr::new(1, SendOp::Send, sink(64)),
                SendWr::new(2, read, sink(2048)),
                SendWr::new(3, SendOp::Send, sink(1500)),
            ] {
                sim.nodes[VICTIM]
                    .post_send(qp.qpn, wr)
                    .expect("post_send on a new QP");
            }
        }
        sim.transmit_all();

        for _ in 0..FORGED {
            let frame = forge(&mut rng, &sim, &qps, &t, responses_only);
            let now = sim.now;
            let node = &mut sim.nodes[VICTIM];
            let before = node.dev.counters().fields();
            node.dev.handle_packet(now, &frame, &mut node.mem);
            // What this frame did, apart from the legitimate traffic's doing.
            for ((name, after), (_, was)) in node.dev.counters().fields().into_iter().zip(before) {
                *by_forged.entry(name).or_insert(0) += after - was;
            }
            if chance(&mut rng, 10) {
                legit_work(&mut rng, &mut sim, &qps, &peers, &t, &peer_mr, ud_ah);
            }
            if chance(&mut rng, 15) {
                for _ in 0..4 {
                    sim.step();
                }
            }
            if chance(&mut rng, 5) {
                for (i, (qp, _, _)) in qps.iter().enumerate() {
                    for (node, end) in [(VICTIM, *qp), (PEER, peers[i])] {
                        let taken = sim.nodes[node].poll(end.recv_cq).len();
                        sim.nodes[node].poll(end.send_cq);
                        // The closed connection's victim stays without receives.
                        let replenish = if node == VICTIM && end.qpn == rc2_a.qpn {
                            0
                        } else {
                            taken
                        };
                        for k in 0..replenish as u64 {
                            let at = (k % 16) * 2048;
                            match node {
                                VICTIM if end.qpn == srq_a.qpn => {
                                    post_srq_recv(&mut sim, srq, &t.sink, at, 1024 + 40)
                                }
                                VICTIM => {
                                    post_recv(&mut sim, node, end.qpn, &t.sink, at, 1024 + 40)
                                }
                                _ => post_recv(&mut sim, node, end.qpn, &peer_mr, at, 1024 + 40),
                            }
                        }
                    }
                }
            }
        }
        // Every retry and timer runs out: nothing keeps the two devices busy for good.
        assert!(
            sim.run_idle(10_000_000_000),
            "seed {seed}: still sending after 10 s of simulated time"
        );
    }
    for mr in [&t.read_only, &t.local_only] {
        let bytes = sim.nodes[VICTIM].bytes(mr);
        let changed = bytes.iter().filter(|&&b| b != UNTOUCHED).count();
        assert_eq!(
            changed, 0,
            "seed {seed}: {changed} bytes of a region with access {:?} were written",
            mr.access
        );
    }

    // The device still serves: a new connection moves a SEND and a WRITE.
    let (a, b) = connect(&mut sim, VICTIM, PEER, &rc);
    post_recv(&mut sim, PEER, b.qpn, &peer_mr, 0, 64);
    sim.nodes[VICTIM].bytes_mut(&t.sink)[..64].fill(0xa7);
    let send = SendWr::new(
        1,
        SendOp::Send,
        vec![Sge {
            addr: t.sink.va,
            length: 64,
            lkey: t.sink.lkey,
        }],
    );
    sim.nodes[VICTIM]
        .post_send(a.qpn, send)
        .expect("post_send on a new QP");
    let write = SendWr::new(
        2,
        SendOp::RdmaWrite {
            remote_addr: peer_mr.va + 4096,
            rkey: peer_mr.rkey,
        },
        vec![Sge {
            addr: t.sink.va,
            length: 64,
            lkey: t.sink.lkey,
        }],
    );
    sim.nodes[VICTIM]
        .post_send(a.qpn, write)
        .expect("post_send on a new QP");
    let mut done = Vec::new();
    sim.run_until(100_000_000, |s| {
        done.extend(s.nodes[VICTIM].poll(a.send_cq));
        done.len() == 2
    });
    assert_eq!(
        done.len(),
        2,
        "seed {seed}: a new connection's work did not complete"
    );
    assert!(
        done.iter()
            .all(|wc| wc.status == xroce_core::transport::WcStatus::Success),
        "seed {seed}: {done:?}"
    );
    let got = sim.nodes[PEER].poll(b.recv_cq);
    assert_eq!(got.len(), 1, "seed {seed}: the new connection's SEND");
    assert_eq!(
        sim.nodes[PEER].bytes(&peer_mr)[..64],
        [0xa7; 64],
        "seed {seed}"
    );
    assert_eq!(
        sim.nodes[PEER].bytes(&peer_mr)[4096..4160],
        [0xa7; 64],
        "seed {seed}"
    );
    by_forged
}

#[test]
fn forged_frames_from_a_peer_break_nothing() {
    let seeds = seeds_from_env(SEEDS);
    let mut seen = BTreeMap::new();
    for &seed in &seeds {
        for (name, n) in run_seed(seed) {
            *seen.entry(name).or_insert(0) += n;
        }
    }
    // The forged frames themselves (counted around each one's arrival, not the legitimate
    // traffic's doing) reached the QPs' every way of answering a bad request or response, not
    // only the parser's refusals: else this test would prove little. (A run of a few seeds,
    // `XROCE_SIM_SEED` say, need not reach them all.)
    if seeds.len() >= 20 {
        for name in [
            "duplicates",
            "rnr_naks_sent",
            "seq_naks_sent",
            "error_naks_sent",
            "error_naks_received",
            "rnr_naks_received",
            "ghost_responses",
            "qkey_violations",
            "uc_messages_dropped",
            "wrong_transport",
            "unknown_qp",
            "malformed",
        ] {
            assert!(
                seen[name] > 0,
                "no forged frame counted as {name}: {seen:?}"
            );
        }
    }
    if std::env::var_os("HOSTILE_DEBUG").is_some() {
        eprintln!("{seen:?}");
    }
}
