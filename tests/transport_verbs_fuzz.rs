//! An application that calls anything. The provider hands the transport whatever a program
//! passes to libibverbs: QP attributes out of range, masks no transition allows, handles
//! already destroyed or never made, keys and addresses that name no memory, flags with bits
//! no verb defines, queues overfilled. Random sequences of such calls on two devices joined by
//! the simulated link, with packets flowing between them, must never panic (the engine runs
//! inside the application's process), must keep `poll_cq` within what it was asked for, and
//! must leave the devices able to connect two new QPs and move a message.

use rand_chacha::rand_core::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use xroce_core::transport::qp_state::transition_rule;
use xroce_core::transport::verbs::{SendFlags, UdDest};
use xroce_core::transport::{
    Access, AddressVector, AhId, AttrMask, CqId, MemoryRegion, MrId, PathMtu, PdId, QpAttr, QpCap,
    QpInit, QpState, QpType, RecvWr, SendOp, SendWr, Sge, SrqId, WcStatus,
};
use xroce_tests::sim::{
    below, chance, connect, seeds_from_env, ConnectOptions, LinkConfig, NameSeedOnPanic, Sim,
};

/// Calls per seed, and seeds (`XROCE_SIM_SEEDS` overrides, `XROCE_SIM_SEED` picks one).
const CALLS: usize = 3_000;
const SEEDS: u64 = 200;

/// How far the calls got, summed over seeds: a fuzzer whose calls all fail early would
/// prove little.
#[derive(Default, Debug)]
struct Reached {
    /// Modifies that took a QP to RTS.
    to_rts: u64,
    /// Send work requests the device took.
    sends: u64,
    /// Packets the link carried.
    packets: u64,
    /// Completions the devices made.
    completions: u64,
    /// Successful completions the calls polled: work that moved data.
    succeeded: u64,
    /// Seeds whose calls put packets on the link.
    seeds_with_packets: u64,
}

/// Handles one device's application holds (some destroyed since: the fuzzer keeps using them).
#[derive(Default)]
struct Handles {
    pds: Vec<PdId>,
    cqs: Vec<CqId>,
    qps: Vec<(u32, QpType)>,
    srqs: Vec<SrqId>,
    ahs: Vec<AhId>,
    mrs: Vec<(MrId, MemoryRegion)>,
}

/// One of `items`, or now and then a value no call returned.
fn pick<T: Copy>(rng: &mut ChaCha8Rng, items: &[T], invalid: impl FnOnce(u32) -> T) -> T {
    if items.is_empty() || chance(rng, 10) {
        invalid(rng.next_u32())
    } else {
        items[below(rng, items.len() as u64) as usize]
    }
}

/// Whether the application forgets a handle it destroyed; now and then it uses one again.
fn forget(rng: &mut ChaCha8Rng) -> bool {
    chance(rng, 95)
}

/// A small number, a number at a limit, or any.
fn count(rng: &mut ChaCha8Rng) -> u32 {
    match below(rng, 6) {
        0 => 0,
        1..=3 => below(rng, 20) as u32,
        4 => [64, 255, 256, 4096, 16_384, 65_536][below(rng, 6) as usize],
        _ => rng.next_u32(),
    }
}

fn state(rng: &mut ChaCha8Rng) -> QpState {
    QpState::ALL[below(rng, QpState::ALL.len() as u64) as usize]
}

fn attr(rng: &mut ChaCha8Rng, sim: &Sim, me: usize) -> (QpAttr, AttrMask) {
    let peer = sim.nodes[1 - me].ip;
    let a = QpAttr {
        state: state(rng),
        cur_state: state(rng),
        path_mtu: [
            PathMtu::Mtu256,
            PathMtu::Mtu512,
            PathMtu::Mtu1024,
            PathMtu::Mtu2048,
            PathMtu::Mtu4096,
        ][below(rng, 5) as usize],
        qkey: rng.next_u32(),
        rq_psn: if chance(rng, 80) {
            rng.next_u32() & 0xff_ffff
        } else {
            rng.next_u32()
        },
        sq_psn: if chance(rng, 80) {
            rng.next_u32() & 0xff_ffff
        } else {
            rng.next_u32()
        },
        dest_qpn: count(rng),
        access: Access(rng.next_u32() & if chance(rng, 80) { 0xf } else { u32::MAX }),
        pkey_index: below(rng, 3) as u16,
        port_num: below(rng, 3) as u8,
        av: Some(AddressVector {
            dgid: peer,
            sgid_index: below(rng, 4) as u8,
            traffic_class: rng.next_u32() as u8,
            hop_limit: rng.next_u32() as u8,
            flow_label: rng.next_u32(),
        }),
        timeout: rng.next_u32() as u8,
        retry_cnt: rng.next_u32() as u8,
        rnr_retry: rng.next_u32() as u8,
        min_rnr_timer: rng.next_u32() as u8,
        max_rd_atomic: rng.next_u32() as u8,
        max_dest_rd_atomic: rng.next_u32() as u8,
        en_sqd_async_notify: chance(rng, 50),
        path_mig_state: rng.next_u32() as u8,
        cap: QpCap {
            max_send_wr: count(rng),
            max_recv_wr: count(rng),
            max_send_sge: count(rng),
            max_recv_sge: count(rng),
            max_inline_data: count(rng),
        },
    };
    (
        a,
        AttrMask(rng.next_u32() & if chance(rng, 90) { 0x1f_ffff } else { u32::MAX }),
    )
}

/// The modify an application connecting `qpn` would make next from its current state, with
/// values in range, a peer QP of the other device, and now and then one bit of the mask
/// flipped or one value out of range.
fn plausible_modify(
    rng: &mut ChaCha8Rng,
    sim: &Sim,
    me: usize,
    qpn: u32,
    ty: QpType,
    peer_qpns: &[u32],
) -> (QpAttr, AttrMask) {
    let (mut a, _) = attr(rng, sim, me);
    a.port_num = 1;
    a.pkey_index = 0;
    a.qkey = 0x1111_1111;
    a.access = Access(rng.next_u32() & 0xf);
    a.dest_qpn = pick(rng, peer_qpns, |v| v & 0xff_ffff);
    a.rq_psn &= 0xff_ffff;
    a.sq_psn &= 0xff_ffff;
    a.timeout = below(rng, 20) as u8;
    a.retry_cnt = below(rng, 7) as u8;
    a.rnr_retry = below(rng, 7) as u8;
    a.min_rnr_timer = below(rng, 32) as u8;
    a.max_rd_atomic = below(rng, 17) as u8;
    a.max_dest_rd_atomic = below(rng, 17) as u8;
    if let Some(av) = &mut a.av {
        av.sgid_index = 0;
    }
    let cur = sim.nodes[me]
        .dev
        .query_qp(qpn)
        .map_or(QpState::Reset, |q| q.cur_state);
    let state = match cur {
        QpState::Reset => QpState::Init,
        QpState::Init => QpState::Rtr,
        QpState::Rtr | QpState::Sqd | QpState::Sqe => QpState::Rts,
        QpState::Rts => [QpState::Sqd, QpState::Error, QpState::Rts][below(rng, 3) as usize],
        QpState::Error => QpState::Reset,
    };
    // What the transition requires, and some of what it allows.
    let mut mask = transition_rule(cur, state, ty).map_or(AttrMask::STATE, |r| {
        AttrMask::STATE | r.required | AttrMask(r.optional.0 & rng.next_u32())
    });
    a.state = state;
    if chance(rng, 15) {
        mask = AttrMask(mask.0 ^ (1 << below(rng, 21)));
    }
    if chance(rng, 10) {
        match below(rng, 5) {
            0 => a.timeout = 32 + below(rng, 200) as u8,
            1 => a.retry_cnt = 8 + below(rng, 200) as u8,
            2 => a.min_rnr_timer = 32 + below(rng, 200) as u8,
            3 => a.rq_psn |= 0x100_0000,
            _ => a.port_num = 2,
        }
    }
    (a, mask)
}

/// Scatter/gather entries over registered memory, around it, or anywhere.
fn sges(rng: &mut ChaCha8Rng, h: &Handles) -> Vec<Sge> {
    if chance(rng, 60) {
        // What a working application passes: one entry inside one of its regions.
        if let Some((_, mr)) = h.mrs.get(below(rng, h.mrs.len() as u64) as usize) {
            let at = below(rng, mr.len);
            return vec![Sge {
                addr: mr.va + at,
                length: below(rng, (mr.len - at).min(2048) + 1) as u32,
                lkey: mr.lkey,
            }];
        }
    }
    (0..below(rng, 5))
        .map(|_| {
            let (lkey, va, len) = match h.mrs.get(below(rng, h.mrs.len() as u64 + 1) as usize) {
                Some((_, mr)) if chance(rng, 85) => (mr.lkey, mr.va, mr.len),
                _ => (rng.next_u32(), rng.next_u64(), rng.next_u64()),
            };
            Sge {
                addr: va.wrapping_add(below(rng, len.saturating_add(64))),
                length: if chance(rng, 80) {
                    below(rng, 4200) as u32
                } else {
                    rng.next_u32()
                },
                lkey,
            }
        })
        .collect()
}

/// An operation aimed at one of the peer's regions (now and then past its end), or anywhere.
fn send_op(rng: &mut ChaCha8Rng, peer_mrs: &[MemoryRegion]) -> SendOp {
    let (remote_addr, rkey) = match peer_mrs.get(below(rng, peer_mrs.len() as u64) as usize) {
        Some(mr) if chance(rng, 80) => (mr.va + below(rng, mr.len + 16), mr.rkey),
        _ => (rng.next_u64(), rng.next_u32()),
    };
    match below(rng, 7) {
        0 => SendOp::Send,
        1 => SendOp::SendWithImm {
            imm: rng.next_u32(),
        },
        2 => SendOp::RdmaWrite { remote_addr, rkey },
        3 => SendOp::RdmaWriteWithImm {
            remote_addr,
            rkey,
            imm: rng.next_u32(),
        },
        4 => SendOp::RdmaRead { remote_addr, rkey },
        5 => SendOp::CompareSwap {
            remote_addr,
            rkey,
            compare: rng.next_u64(),
            swap: rng.next_u64(),
        },
        _ => SendOp::FetchAdd {
            remote_addr,
            rkey,
            add: rng.next_u64(),
        },
    }
}

/// What device `me`'s application knows of the other's: its QPs and its regions.
struct Peer {
    qpns: Vec<u32>,
    mrs: Vec<MemoryRegion>,
}

/// One random call on device `me`; its result is whatever the device says.
fn call(
    rng: &mut ChaCha8Rng,
    sim: &mut Sim,
    me: usize,
    h: &mut Handles,
    peer: &Peer,
    reached: &mut Reached,
) {
    let pd = pick(rng, &h.pds, PdId);
    let cq = pick(rng, &h.cqs, CqId);
    let (qpn, ty) = pick(rng, &h.qps, |v| (v & 0xff_ffff, QpType::Rc));
    let srq = pick(rng, &h.srqs, SrqId);
    match below(rng, 24) {
        0 => h.pds.push(sim.nodes[me].dev.alloc_pd()),
        1 => {
            let _ = sim.nodes[me].dev.dealloc_pd(pd);
        }
        2 => {
            let cqe = if chance(rng, 70) {
                1 + below(rng, 256) as u32
            } else {
                count(rng)
            };
            if let Ok(c) = sim.nodes[me].dev.create_cq(cqe) {
                h.cqs.push(c);
            }
        }
        3 => {
            if sim.nodes[me].dev.destroy_cq(cq).is_ok() && forget(rng) {
                h.cqs.retain(|&c| c != cq);
            }
        }
        4 | 5 => {
            let init = QpInit {
                ty: [QpType::Rc, QpType::Uc, QpType::Ud][below(rng, 3) as usize],
                pd,
                send_cq: cq,
                recv_cq: pick(rng, &h.cqs, CqId),
                srq: chance(rng, 20).then_some(srq),
                cap: if chance(rng, 70) {
                    QpCap {
                        max_send_wr: 1 + below(rng, 64) as u32,
                        max_recv_wr: 1 + below(rng, 64) as u32,
                        max_send_sge: 1 + below(rng, 4) as u32,
                        max_recv_sge: 1 + below(rng, 4) as u32,
                        max_inline_data: below(rng, 256) as u32,
                    }
                } else {
                    QpCap {
                        max_send_wr: count(rng),
                        max_recv_wr: count(rng),
                        max_send_sge: count(rng),
                        max_recv_sge: count(rng),
                        max_inline_data: count(rng),
                    }
                },
                sq_sig_all: chance(rng, 50),
            };
            let ty = init.ty;
            if let Ok(q) = sim.nodes[me].dev.create_qp(init) {
                h.qps.push((q, ty));
            }
        }
        6 => {
            if sim.nodes[me].dev.destroy_qp(qpn).is_ok() && forget(rng) {
                h.qps.retain(|q| q.0 != qpn);
            }
        }
        7..=9 => {
            let (a, mask) = if chance(rng, 75) {
                plausible_modify(rng, sim, me, qpn, ty, &peer.qpns)
            } else {
                attr(rng, sim, me)
            };
            let state = |sim: &Sim| sim.nodes[me].dev.query_qp(qpn).map(|q| q.cur_state);
            let was = state(sim);
            let _ = sim.nodes[me].dev.modify_qp(qpn, &a, mask);
            if was.is_ok_and(|s| s != QpState::Rts) && state(sim) == Ok(QpState::Rts) {
                reached.to_rts += 1;
            }
        }
        10..=13 => {
            let mut wr = SendWr::new(rng.next_u64(), send_op(rng, &peer.mrs), sges(rng, h));
            if chance(rng, 40) {
                wr.flags = SendFlags(rng.next_u32() & if chance(rng, 80) { 0xf } else { u32::MAX });
            }
            if chance(rng, 50) {
                wr.ud = Some(UdDest {
                    ah: pick(rng, &h.ahs, AhId),
                    remote_qpn: count(rng),
                    // The simulator's Q_Key (what `plausible_modify` sets), or any.
                    remote_qkey: if chance(rng, 70) {
                        0x1111_1111
                    } else {
                        rng.next_u32()
                    },
                });
            }
            let node = &mut sim.nodes[me];
            if node.dev.post_send(qpn, wr, &node.mem).is_ok() {
                reached.sends += 1;
            }
        }
        14..=16 => {
            let wr = RecvWr {
                wr_id: rng.next_u64(),
                sg_list: sges(rng, h).into_iter().collect(),
            };
            if chance(rng, 70) {
                let _ = sim.nodes[me].dev.post_recv(qpn, wr);
            } else {
                let _ = sim.nodes[me].dev.post_srq_recv(srq, wr);
            }
        }
        17 => {
            let max = [0, 1, 16, usize::MAX][below(rng, 4) as usize];
            let mut out = Vec::new();
            if let Ok(n) = sim.nodes[me].dev.poll_cq(cq, max, &mut out) {
                assert!(n <= max && n == out.len(), "poll_cq gave {n} for {max}");
                reached.succeeded += out
                    .iter()
                    .filter(|wc| wc.status == WcStatus::Success)
                    .count() as u64;
            }
            let _ = sim.nodes[me].dev.req_notify_cq(cq, chance(rng, 50));
        }
        18 => {
            if let Ok(s) = sim.nodes[me].dev.create_srq(pd, count(rng), count(rng)) {
                h.srqs.push(s);
            }
            let _ = sim.nodes[me].dev.modify_srq_limit(srq, count(rng));
        }
        19 => {
            if sim.nodes[me].dev.destroy_srq(srq).is_ok() && forget(rng) {
                h.srqs.retain(|&s| s != srq);
            }
        }
        20 => {
            let av = AddressVector {
                dgid: sim.nodes[1 - me].ip,
                sgid_index: if chance(rng, 70) {
                    0
                } else {
                    below(rng, 4) as u8
                },
                traffic_class: rng.next_u32() as u8,
                hop_limit: rng.next_u32() as u8,
                flow_label: rng.next_u32(),
            };
            match sim.nodes[me].dev.create_ah(pd, av) {
                Ok(a) => h.ahs.push(a),
                Err(_) => {
                    let ah = pick(rng, &h.ahs, AhId);
                    if sim.nodes[me].dev.destroy_ah(ah).is_ok() && forget(rng) {
                        h.ahs.retain(|&a| a != ah);
                    }
                }
            }
        }
        21 | 22 => {
            // Memory the simulator has (a region it allocated) or none.
            let mr = sim.nodes[me].alloc(1 + below(rng, 8192) as usize, Access::NONE);
            let access = Access(rng.next_u32() & if chance(rng, 80) { 0xf } else { u32::MAX });
            let (va, len) = if chance(rng, 80) {
                (mr.va, mr.len)
            } else {
                (rng.next_u64(), rng.next_u64())
            };
            if let Ok(r) = sim.nodes[me].dev.reg_mr(pd, va, len, access) {
                h.mrs.push(r);
            }
        }
        _ => {
            if let Some(i) = (!h.mrs.is_empty()).then(|| below(rng, h.mrs.len() as u64)) {
                let (id, _) = h.mrs[i as usize];
                if sim.nodes[me].dev.dereg_mr(id).is_ok() && forget(rng) {
                    h.mrs.remove(i as usize);
                }
            }
        }
    }
}

fn run_seed(seed: u64, reached: &mut Reached) {
    let _named = NameSeedOnPanic(seed);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut sim = Sim::new(seed, 2, LinkConfig::default());
    let mut handles = [Handles::default(), Handles::default()];
    // A PD of the fuzzer's own: the simulator's registers the memory the calls ask for.
    // And a start an application would make: CQs, QPs of each type, a region; the calls
    // then connect, use and break them.
    for (i, h) in handles.iter_mut().enumerate() {
        let dev = &mut sim.nodes[i].dev;
        let pd = dev.alloc_pd();
        h.pds.push(pd);
        h.cqs = (0..2)
            .map(|_| dev.create_cq(64).expect("create_cq"))
            .collect();
        for ty in [QpType::Rc, QpType::Rc, QpType::Uc, QpType::Ud] {
            let init = QpInit {
                ty,
                pd,
                send_cq: h.cqs[0],
                recv_cq: h.cqs[1],
                srq: None,
                cap: QpCap::default(),
                sq_sig_all: false,
            };
            h.qps.push((dev.create_qp(init).expect("create_qp"), ty));
        }
        let mr = sim.nodes[i].alloc(8192, Access::NONE);
        let all = Access(0xf);
        h.mrs.push(
            sim.nodes[i]
                .dev
                .reg_mr(pd, mr.va, mr.len, all)
                .expect("reg_mr"),
        );
    }
    for _ in 0..CALLS {
        let me = below(&mut rng, 2) as usize;
        let other = &handles[1 - me];
        let peer = Peer {
            qpns: other.qps.iter().map(|q| q.0).collect(),
            mrs: other.mrs.iter().map(|m| m.1).collect(),
        };
        call(&mut rng, &mut sim, me, &mut handles[me], &peer, reached);
        if chance(&mut rng, 20) {
            for _ in 0..3 {
                sim.step();
            }
        }
    }
    // Whatever the calls set up runs its course (7 retries are infinite, as in rdma_rxe: a
    // QP the fuzzer connected to nothing may retry for good, so this is bounded, not idle).
    sim.run_idle(1_000_000_000);
    reached.packets += sim.stats.delivered;
    reached.seeds_with_packets += u64::from(sim.stats.delivered > 0);
    reached.completions += sim
        .nodes
        .iter()
        .map(|n| n.dev.counters().completions)
        .sum::<u64>();

    // The devices still serve: two new QPs move a SEND.
    let o = ConnectOptions::default();
    let (a, b) = connect(&mut sim, 0, 1, &o);
    let src = sim.nodes[0].alloc(64, Access::LOCAL_WRITE);
    let dst = sim.nodes[1].alloc(64, Access::LOCAL_WRITE);
    sim.nodes[0].bytes_mut(&src).fill(0x3c);
    let recv = RecvWr {
        wr_id: 9,
        sg_list: std::iter::once(Sge {
            addr: dst.va,
            length: 64,
            lkey: dst.lkey,
        })
        .collect(),
    };
    sim.nodes[1]
        .post_recv(b.qpn, recv)
        .expect("post_recv on a new QP");
    let send = SendWr::new(
        8,
        SendOp::Send,
        vec![Sge {
            addr: src.va,
            length: 64,
            lkey: src.lkey,
        }],
    );
    sim.nodes[0]
        .post_send(a.qpn, send)
        .expect("post_send on a new QP");
    let mut got = Vec::new();
    sim.run_until(100_000_000, |s| {
        got.extend(s.nodes[1].poll(b.recv_cq));
        !got.is_empty()
    });
    assert!(
        got.len() == 1 && got[0].status == WcStatus::Success,
        "seed {seed}: a new connection's SEND: {got:?}"
    );
    assert_eq!(sim.nodes[1].bytes(&dst), [0x3c; 64], "seed {seed}");
}

#[test]
fn random_verb_calls_break_nothing() {
    let seeds = seeds_from_env(SEEDS);
    let mut reached = Reached::default();
    for &seed in &seeds {
        run_seed(seed, &mut reached);
    }
    let Reached {
        to_rts,
        sends,
        packets,
        completions,
        succeeded,
        seeds_with_packets,
    } = reached;
    assert!(
        to_rts > 0 && sends > 0 && packets > 0 && completions > 0 && succeeded > 0,
        "the calls never got far: {reached:?}"
    );
    // Most seeds connect something that talks; a default run of few seeds with none would
    // say the calls stopped reaching the link.
    assert!(
        seeds.len() < 20 || seeds_with_packets * 4 >= seeds.len() as u64,
        "packets in only {seeds_with_packets} of {} seeds: {reached:?}",
        seeds.len()
    );
}
