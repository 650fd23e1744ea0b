//! CQ overflow: the asynchronous error and what it does to the QPs.

use super::*;

/// Posts signalled 100-byte WRITEs with ids `ids` from node 0 (`a`) into `dst`, then lets the
/// link settle.
fn write_all(sim: &mut Sim, a: QpEnd, src: &MemoryRegion, dst: &MemoryRegion, ids: &[u64]) {
    for &id in ids {
        sim.nodes[0]
            .post_send(
                a.qpn,
                SendWr::new(id, write_op(dst, id * 100), vec![sge(src, 0, 100)]),
            )
            .unwrap();
    }
    settle(sim);
}

/// A send CQ of three entries given five completions, as rdma_rxe treats it: the two that do
/// not fit are lost (rdma_rxe's completer ignores the failed post), the overrun is reported as
/// one CQ_ERR, the completions stored are intact and the QP goes on. Completions fit again once
/// the application takes some, and a later overrun is reported again. (Moving the QP to ERROR
/// instead hung perftest's `ib_send_lat -e`, which overruns its one-entry send CQ now and then.)
#[test]
fn a_send_cq_overrun_loses_the_completion_and_the_qp_goes_on() {
    let mut sim = Sim::new(81, 2, LinkConfig::default());
    let o = ConnectOptions {
        cqe: 3,
        ..ConnectOptions::default()
    };
    let (a, b) = connect(&mut sim, 0, 1, &o);
    let src = sim.nodes[0].alloc(4096, RW);
    let dst = sim.nodes[1].alloc(4096, RW);
    for (i, byte) in sim.nodes[0].bytes_mut(&src)[..100].iter_mut().enumerate() {
        *byte = i as u8 + 1;
    }
    write_all(&mut sim, a, &src, &dst, &[1, 2, 3, 4, 5]);
    assert_eq!(
        events(&mut sim, 0),
        [Event::Async(AsyncEvent::CqError(a.send_cq))]
    );
    assert_eq!(events(&mut sim, 1), []);
    let cq = sim.nodes[0].dev.cq(a.send_cq).unwrap();
    assert!(cq.overflowed());
    assert_eq!(cq.len(), 3);
    assert_eq!(counters(&sim, 0).cq_overflows, 2);
    let sc = sim.nodes[0].poll(a.send_cq);
    assert_eq!(
        ids_and_status(&sc),
        [
            (1, WcStatus::Success),
            (2, WcStatus::Success),
            (3, WcStatus::Success)
        ]
    );
    assert!(sc
        .iter()
        .all(|w| w.opcode == WcOpcode::RdmaWrite && w.byte_len == 100 && w.qp_num == a.qpn));
    assert_eq!(state(&sim, a), QpState::Rts);
    assert_eq!(state(&sim, b), QpState::Rts);

    // The QP still works, and its completions are stored again.
    write_all(&mut sim, a, &src, &dst, &[6]);
    assert_eq!(
        ids_and_status(&sim.nodes[0].poll(a.send_cq)),
        [(6, WcStatus::Success)]
    );
    assert_eq!(events(&mut sim, 0), []);
    // A second overrun is a second report.
    write_all(&mut sim, a, &src, &dst, &[7, 8, 9, 10]);
    assert_eq!(
        events(&mut sim, 0),
        [Event::Async(AsyncEvent::CqError(a.send_cq))]
    );
    assert_eq!(
        ids_and_status(&sim.nodes[0].poll(a.send_cq)),
        [
            (7, WcStatus::Success),
            (8, WcStatus::Success),
            (9, WcStatus::Success)
        ]
    );
    assert_eq!(counters(&sim, 0).cq_overflows, 3);
    assert_eq!(state(&sim, a), QpState::Rts);
    // Every WRITE landed, the lost completions' included.
    for id in 1..=10u64 {
        let at = (id * 100) as usize;
        assert_eq!(
            &sim.nodes[1].bytes(&dst)[at..at + 100],
            &sim.nodes[0].bytes(&src)[..100],
            "WRITE {id}"
        );
    }
}

/// An RC pair (`retry_cnt` 2) whose responder (node 1) has a receive CQ of one entry, and 4 KiB
/// of memory on each node.
fn responder_with_a_one_entry_recv_cq(
    seed: u64,
) -> (Sim, QpEnd, QpEnd, MemoryRegion, MemoryRegion) {
    let mut sim = Sim::new(seed, 2, LinkConfig::default());
    let o = ConnectOptions {
        retry_cnt: 2,
        ..ConnectOptions::default()
    };
    let a = create_qp_with(&mut sim, 0, &o, 64, 64, None);
    let b = create_qp_with(&mut sim, 1, &o, 64, 1, None);
    bring_up(&mut sim, a, b, &o, o.psn.0, o.psn.1);
    bring_up(&mut sim, b, a, &o, o.psn.1, o.psn.0);
    let src = sim.nodes[0].alloc(4096, RW);
    let dst = sim.nodes[1].alloc(4096, RW);
    (sim, a, b, src, dst)
}

/// A receive CQ overrun on the responder: the responder QP goes to ERROR (digest §5.12) and,
/// as in rdma_rxe, does not acknowledge the SEND whose completion was lost, so the sender never
/// believes it was received; it fails that SEND after its retries instead.
#[test]
fn recv_cq_overflow_moves_the_responder_to_error_without_acking() {
    let (mut sim, a, b, src, dst) = responder_with_a_one_entry_recv_cq(82);
    for id in [10, 11, 12] {
        sim.nodes[1]
            .post_recv(b.qpn, recv_wr(id, &dst, (id - 10) * 1024, 1024))
            .unwrap();
    }
    for id in 1..=3u64 {
        sim.nodes[0]
            .post_send(a.qpn, SendWr::new(id, SendOp::Send, vec![sge(&src, 0, 64)]))
            .unwrap();
        // One at a time, so each SEND asks for its own ACK (see ack_req_once_per_burst).
        sim.transmit_all();
    }
    let sc = wait_cq(&mut sim, 0, a.send_cq, 3);
    settle(&mut sim);
    assert_eq!(
        ids_and_status(&sc),
        [
            (1, WcStatus::Success),
            (2, WcStatus::RetryExcErr),
            (3, WcStatus::WrFlushErr)
        ]
    );
    assert_eq!(
        events(&mut sim, 1),
        [
            Event::Async(AsyncEvent::CqError(b.recv_cq)),
            Event::Async(AsyncEvent::QpFatal(b.qpn))
        ]
    );
    assert_eq!(
        ids_and_status(&sim.nodes[1].poll(b.recv_cq)),
        [(10, WcStatus::Success)]
    );
    assert_eq!(state(&sim, b), QpState::Error);
    assert_eq!(state(&sim, a), QpState::Error);
}

/// A receive CQ overrun by a SEND that arrives in the same receive batch as earlier requests:
/// the SEND before it and the atomic between them were answered by rdma_rxe before it took the
/// overrunning one, so their ACK and atomic ACK still go out; only the SEND whose completion
/// was lost is not acknowledged. With them dropped, the requester failed an atomic the
/// responder had executed (or retried it for ever with `retry_cnt` 7).
#[test]
fn a_recv_cq_overrun_still_answers_the_requests_before_it() {
    let (mut sim, a, b, src, dst) = responder_with_a_one_entry_recv_cq(83);
    sim.nodes[1].bytes_mut(&dst)[..8].copy_from_slice(&40u64.to_ne_bytes());
    for id in [10, 11] {
        sim.nodes[1]
            .post_recv(b.qpn, recv_wr(id, &dst, 1024 * (id - 9), 1024))
            .unwrap();
    }
    let add = fetch_add_op(&dst, 0, 2);
    for (id, op, at) in [(1, SendOp::Send, 64), (2, add, 0), (3, SendOp::Send, 64)] {
        let len = if id == 2 { 8 } else { 64 };
        sim.nodes[0]
            .post_send(a.qpn, SendWr::new(id, op, vec![sge(&src, at, len)]))
            .unwrap();
    }
    // All three reach the responder before it sends anything.
    let now = sim.now;
    for p in &drain(&mut sim, 0, now) {
        let node = &mut sim.nodes[1];
        node.dev.handle_packet(now, p, &mut node.mem);
    }
    assert_eq!(state(&sim, b), QpState::Error);
    let sc = wait_cq(&mut sim, 0, a.send_cq, 3);
    settle(&mut sim);
    assert_eq!(
        ids_and_status(&sc),
        [
            (1, WcStatus::Success),
            (2, WcStatus::Success),
            (3, WcStatus::RetryExcErr)
        ]
    );
    assert_eq!(
        u64_at(sim.nodes[0].bytes(&src), 0),
        40,
        "the atomic's result"
    );
    assert_eq!(u64_at(sim.nodes[1].bytes(&dst), 0), 42, "added once");
    assert_eq!(
        ids_and_status(&sim.nodes[1].poll(b.recv_cq)),
        [(10, WcStatus::Success)]
    );
}

/// A QP whose own SEND fails (RNR retries exhausted) right after it took the peer's SEND, in
/// the same receive batch: it still acknowledges the peer's SEND, as rdma_rxe had before it
/// saw the RNR NAK. With the ACK dropped, the peer's SEND, delivered and completed, failed
/// after its retries.
#[test]
fn a_qp_whose_send_fails_still_acknowledges_what_it_received() {
    let mut sim = Sim::new(84, 2, LinkConfig::default());
    let o = ConnectOptions {
        retry_cnt: 2,
        rnr_retry: 0,
        ..ConnectOptions::default()
    };
    let (a, b) = connect(&mut sim, 0, 1, &o);
    let a_buf = sim.nodes[0].alloc(4096, RW);
    let b_buf = sim.nodes[1].alloc(4096, RW);
    sim.nodes[1]
        .post_recv(b.qpn, recv_wr(10, &b_buf, 0, 1024))
        .unwrap();
    for (node, qpn, mr) in [(0, a.qpn, &a_buf), (1, b.qpn, &b_buf)] {
        sim.nodes[node]
            .post_send(qpn, SendWr::new(1, SendOp::Send, vec![sge(mr, 2048, 64)]))
            .unwrap();
    }
    let now = sim.now;
    let deliver = |sim: &mut Sim, to: usize, packets: &[Vec<u8>]| {
        let node = &mut sim.nodes[to];
        for p in packets {
            node.dev.handle_packet(now, p, &mut node.mem);
        }
    };
    let a_send = drain(&mut sim, 0, now);
    let b_send = drain(&mut sim, 1, now);
    // A has no receive posted: it answers B's SEND with an RNR NAK.
    deliver(&mut sim, 0, &b_send);
    let rnr_nak = drain(&mut sim, 0, now);
    // B takes A's SEND and the NAK that fails its own in one batch.
    deliver(&mut sim, 1, &[a_send, rnr_nak].concat());
    assert_eq!(state(&sim, b), QpState::Error);
    assert_eq!(
        ids_and_status(&sim.nodes[1].poll(b.send_cq)),
        [(1, WcStatus::RnrRetryExcErr)]
    );
    let sc = wait_cq(&mut sim, 0, a.send_cq, 1);
    assert_eq!(ids_and_status(&sc), [(1, WcStatus::Success)]);
    assert_eq!(
        ids_and_status(&sim.nodes[1].poll(b.recv_cq)),
        [(10, WcStatus::Success)]
    );
}
