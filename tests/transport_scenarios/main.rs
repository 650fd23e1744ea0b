//! Scenario tests for the transport, on the deterministic simulator: each one sets up one
//! situation the digest (§4-§9) describes, often by losing exactly one chosen packet, and checks
//! what rdma_rxe would do: which completions arrive with which status, which counters move,
//! which state the QPs end in, and that the bytes in memory are right.
//!
//! One file per kind of situation; the helpers that more than one of them uses are here.

mod access;
mod ack_requests;
mod cq_overflow;
mod duplicates;
mod failures;
mod loss_and_retry;
mod odd_acks_and_destroyed_qps;
mod psn_wrap;
mod rnr;
mod srq_fence_and_verbs;
mod transmit_rounds;
mod uc;
mod ud;

use std::cell::Cell;
use std::collections::HashSet;
use std::rc::Rc;

use xroce_core::transport::qp_state::TAIL_PROBE_NS;
use xroce_core::transport::requester::MAX_UNACKED_PSNS;
use xroce_core::transport::round_trip::MIN_PROBE_NS;
use xroce_core::transport::{
    Access, AddressVector, AhId, AsyncEvent, AttrMask, Counters, CqId, Event, MemoryRegion, Nanos,
    PathMtu, QpAttr, QpState, QpType, RecvWr, SendFlags, SendOp, SendWr, Sge, UdDest, VerbsError,
    WcFlags, WcOpcode, WcStatus, WorkCompletion, TX_TURN_PACKETS,
};
use xroce_core::wire::{AethSyndrome, NakCode, Opcode, RoceFrame};
use xroce_tests::sim::{
    bring_up, connect, create_qp, create_qp_with, node_ipv6, ConnectOptions, LinkConfig, QpEnd, Sim,
};

const RW: Access = Access(
    Access::LOCAL_WRITE.0
        | Access::REMOTE_WRITE.0
        | Access::REMOTE_READ.0
        | Access::REMOTE_ATOMIC.0,
);

/// One second of virtual time: far more than any scenario here needs.
const SEC: Nanos = 1_000_000_000;

fn pattern(len: usize, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ salt ^ (i >> 8) as u8)
        .collect()
}

fn sge(mr: &MemoryRegion, offset: u64, length: u32) -> Sge {
    Sge {
        addr: mr.va + offset,
        length,
        lkey: mr.lkey,
    }
}

fn recv_wr(wr_id: u64, mr: &MemoryRegion, offset: u64, length: u32) -> RecvWr {
    RecvWr {
        wr_id,
        sg_list: vec![sge(mr, offset, length)].into(),
    }
}

/// Posts receive `10 + id` on `b` (1 KiB at `id` KiB into `dst`) and SEND `id` of 100 bytes
/// from `src` on `a`.
fn post_send_and_its_recv(
    sim: &mut Sim,
    (a, src): (QpEnd, &MemoryRegion),
    (b, dst): (QpEnd, &MemoryRegion),
    id: u64,
) {
    sim.nodes[b.node]
        .post_recv(b.qpn, recv_wr(10 + id, dst, id * 1024, 1024))
        .unwrap();
    sim.nodes[a.node]
        .post_send(a.qpn, SendWr::new(id, SendOp::Send, vec![sge(src, 0, 100)]))
        .unwrap();
}

fn cq_len(sim: &Sim, node: usize, cq: CqId) -> usize {
    sim.nodes[node].dev.cq(cq).map_or(0, |q| q.len())
}

/// Runs until `cq` holds at least `n` completions, then drains it.
fn wait_cq(sim: &mut Sim, node: usize, cq: CqId, n: usize) -> Vec<WorkCompletion> {
    let reached = sim.run_until(SEC, |s| cq_len(s, node, cq) >= n);
    assert!(
        reached,
        "node {node} {cq:?}: {} of {n} completions",
        cq_len(sim, node, cq)
    );
    sim.nodes[node].poll(cq)
}

/// Runs until nothing is in flight and no timer is armed.
fn settle(sim: &mut Sim) {
    assert!(
        sim.run_idle(SEC),
        "still busy after a second of virtual time"
    );
}

fn ids_and_status(wcs: &[WorkCompletion]) -> Vec<(u64, WcStatus)> {
    wcs.iter().map(|w| (w.wr_id, w.status)).collect()
}

fn state(sim: &Sim, end: QpEnd) -> QpState {
    sim.nodes[end.node].dev.query_qp(end.qpn).unwrap().state
}

fn counters(sim: &Sim, node: usize) -> Counters {
    sim.nodes[node].dev.counters()
}

fn events(sim: &mut Sim, node: usize) -> Vec<Event> {
    std::iter::from_fn(|| sim.nodes[node].dev.poll_event()).collect()
}

/// Opcode and PSN of a packet on the link.
fn bth_of(packet: &[u8]) -> (Opcode, u32) {
    let f = RoceFrame::parse_ip(packet).expect("the simulator carries RoCEv2 packets only");
    (f.headers.transport.bth.opcode, f.headers.transport.bth.psn)
}

/// An IPv4 ACK packet (as the simulator carries it) rewritten to acknowledge `psn` with AETH
/// syndrome `syndrome`, its ICRC made good again.
fn ack_rewritten(ack: &[u8], psn: u32, syndrome: u8) -> Vec<u8> {
    let mut p = ack.to_vec();
    // BTH PSN: bytes 9..12 of the BTH, after 20 bytes of IPv4 and 8 of UDP; the AETH's
    // syndrome follows the BTH.
    p[37..40].copy_from_slice(&(psn & 0x00ff_ffff).to_be_bytes()[1..]);
    p[40] = syndrome;
    xroce_core::icrc::fill(&mut p).unwrap();
    p
}

/// The frames node `from` sent, in the order they left, from a simulator trace.
fn frames_sent_by(trace: &[(usize, Vec<u8>)], from: usize) -> Vec<RoceFrame<'_>> {
    trace
        .iter()
        .filter(|(node, _)| *node == from)
        .map(|(_, pkt)| {
            RoceFrame::parse_ip(pkt).expect("the simulator carries RoCEv2 packets only")
        })
        .collect()
}

/// Loses the first `max` packets node `from` sends that `pick` chooses (by opcode and PSN).
/// Returns how many were lost so far, so a test can check that the loss it depends on happened.
fn drop_matching(
    sim: &mut Sim,
    from: usize,
    max: u32,
    mut pick: impl FnMut(Opcode, u32) -> bool + 'static,
) -> Rc<Cell<u32>> {
    let dropped = Rc::new(Cell::new(0));
    let count = dropped.clone();
    sim.drop_filter = Some(Box::new(move |node, packet| {
        if node != from || count.get() >= max {
            return false;
        }
        let (op, psn) = bth_of(packet);
        let hit = pick(op, psn);
        if hit {
            count.set(count.get() + 1);
        }
        hit
    }));
    dropped
}

fn write_op(mr: &MemoryRegion, offset: u64) -> SendOp {
    SendOp::RdmaWrite {
        remote_addr: mr.va + offset,
        rkey: mr.rkey,
    }
}

fn read_op(mr: &MemoryRegion, offset: u64) -> SendOp {
    SendOp::RdmaRead {
        remote_addr: mr.va + offset,
        rkey: mr.rkey,
    }
}

fn fetch_add_op(mr: &MemoryRegion, offset: u64, add: u64) -> SendOp {
    SendOp::FetchAdd {
        remote_addr: mr.va + offset,
        rkey: mr.rkey,
        add,
    }
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_ne_bytes(bytes[at..at + 8].try_into().unwrap())
}

/// Everything node `from` has to send at `now`, in order, without delivering it.
fn drain(sim: &mut Sim, from: usize, now: Nanos) -> Vec<Vec<u8>> {
    let mut packets = Vec::new();
    let node = &mut sim.nodes[from];
    let mut buf = vec![0u8; 8192];
    while let Some(t) = node.dev.poll_transmit(now, &node.mem, &mut buf) {
        packets.push(buf[..t.len].to_vec());
    }
    packets
}

fn bth_ack_req(packet: &[u8]) -> bool {
    RoceFrame::parse_ip(packet)
        .expect("the simulator carries RoCEv2 packets only")
        .headers
        .transport
        .bth
        .ack_req
}

/// SQD → RTS on `a`, after which the held WQE `wr_id` is sent and completes.
fn back_to_rts_sends_the_held_wqe(sim: &mut Sim, a: QpEnd, wr_id: u64) {
    let rts = QpAttr {
        state: QpState::Rts,
        ..QpAttr::default()
    };
    sim.nodes[0]
        .dev
        .modify_qp(a.qpn, &rts, AttrMask::STATE)
        .unwrap();
    let sc = wait_cq(sim, 0, a.send_cq, 1);
    assert_eq!(ids_and_status(&sc), [(wr_id, WcStatus::Success)]);
}

/// Node 0 sends the first request packet of `a`, which must leave its AckReq to the message
/// queued behind it; `a` then enters SQD (raising SQ_DRAINED when drained), and the packet
/// reaches node 1.
fn first_request_then_sqd(sim: &mut Sim, a: QpEnd) {
    let now = sim.now;
    let mut buf = vec![0u8; 9000];
    let node = &mut sim.nodes[0];
    let t = node.dev.poll_transmit(now, &node.mem, &mut buf).unwrap();
    let first = buf[..t.len].to_vec();
    assert!(
        !bth_ack_req(&first),
        "the first message left the AckReq to the next"
    );
    let sqd = QpAttr {
        state: QpState::Sqd,
        en_sqd_async_notify: true,
        ..QpAttr::default()
    };
    node.dev
        .modify_qp(a.qpn, &sqd, AttrMask::STATE | AttrMask::EN_SQD_ASYNC_NOTIFY)
        .unwrap();
    let peer = &mut sim.nodes[1];
    peer.dev.handle_packet(now, &first, &mut peer.mem);
}

/// Two UD QPs (node 0 → node 1) and an address handle on node 0 for node 1.
fn ud_pair(sim: &mut Sim) -> (QpEnd, QpEnd, AhId) {
    xroce_tests::sim::ud_pair(sim, 0, 1)
}

fn ud_send(wr_id: u64, ah: AhId, to: QpEnd, qkey: u32, sg: Sge) -> SendWr {
    let mut wr = SendWr::new(wr_id, SendOp::Send, vec![sg]);
    wr.ud = Some(UdDest {
        ah,
        remote_qpn: to.qpn,
        remote_qkey: qkey,
    });
    wr
}

const QKEY: u32 = 0x1111_1111; // what `bring_up` gives UD QPs
