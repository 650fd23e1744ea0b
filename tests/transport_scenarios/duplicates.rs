//! Duplicates replayed from the responder-resource cache: READ and atomic replies resent, not re-executed.

use super::*;

/// Losing the FIRST response of a 4-packet READ: the completer drops the out-of-order rest, the
/// timer fires, the READ is re-requested with its original PSN, and the responder replays it
/// from memory (a duplicate found in its resource ring).
#[test]
fn lost_read_response_first_is_replayed() {
    let mut sim = Sim::new(41, 2, LinkConfig::default());
    let o = ConnectOptions::default();
    let (a, _b) = connect(&mut sim, 0, 1, &o);
    let local = sim.nodes[0].alloc(8192, RW);
    let remote = sim.nodes[1].alloc(8192, RW);
    let data = pattern(4000, 41);
    sim.nodes[1].bytes_mut(&remote)[100..4100].copy_from_slice(&data);
    let dropped = drop_matching(&mut sim, 1, 1, |op, _| {
        op == Opcode::RC_RDMA_READ_RESPONSE_FIRST
    });
    sim.nodes[0]
        .post_send(
            a.qpn,
            SendWr::new(1, read_op(&remote, 100), vec![sge(&local, 0, 4000)]),
        )
        .unwrap();
    let sc = wait_cq(&mut sim, 0, a.send_cq, 1);
    settle(&mut sim);
    assert_eq!(ids_and_status(&sc), [(1, WcStatus::Success)]);
    assert_eq!(sc[0].opcode, WcOpcode::RdmaRead);
    assert_eq!(&sim.nodes[0].bytes(&local)[..4000], &data[..]);
    assert_eq!(dropped.get(), 1);
    let (c0, c1) = (counters(&sim, 0), counters(&sim, 1));
    assert_eq!(c0.timeouts, 1);
    assert_eq!(c0.retransmissions, 1);
    assert_eq!(c1.duplicates, 1);
    // Four responses, then all four again.
    assert_eq!(c1.tx_responses, 8);
}

/// Losing a MIDDLE response: the retried READ asks only for the rest (PSN, VA and length moved
/// past what arrived) and the replay continues with MIDDLE…LAST, not FIRST (digest §4.6, §5.3).
#[test]
fn lost_read_response_middle_resumes_where_the_data_stopped() {
    let mut sim = Sim::new(42, 2, LinkConfig::default());
    let o = ConnectOptions::default();
    let (a, _b) = connect(&mut sim, 0, 1, &o);
    let local = sim.nodes[0].alloc(8192, RW);
    let remote = sim.nodes[1].alloc(8192, RW);
    let data = pattern(4000, 42);
    sim.nodes[1].bytes_mut(&remote)[..4000].copy_from_slice(&data);
    let p = o.psn.0;
    let dropped = drop_matching(&mut sim, 1, 1, move |op, psn| {
        op == Opcode::RC_RDMA_READ_RESPONSE_MIDDLE && psn == p + 1
    });
    sim.trace = Some(Vec::new());
    sim.nodes[0]
        .post_send(
            a.qpn,
            SendWr::new(1, read_op(&remote, 0), vec![sge(&local, 0, 4000)]),
        )
        .unwrap();
    let sc = wait_cq(&mut sim, 0, a.send_cq, 1);
    settle(&mut sim);
    assert_eq!(ids_and_status(&sc), [(1, WcStatus::Success)]);
    assert_eq!(&sim.nodes[0].bytes(&local)[..4000], &data[..]);
    assert_eq!(dropped.get(), 1);
    assert_eq!(counters(&sim, 1).duplicates, 1);

    let trace = sim.trace.take().unwrap();
    let requests: Vec<_> = frames_sent_by(&trace, 0)
        .iter()
        .map(|f| f.headers.transport)
        .collect();
    assert_eq!(requests.len(), 2, "the READ and one retry");
    let retry = &requests[1];
    assert_eq!(retry.bth.opcode, Opcode::RC_RDMA_READ_REQUEST);
    assert_eq!(retry.bth.psn, p + 1);
    let reth = retry.reth.unwrap();
    assert_eq!((reth.va, reth.dma_len), (remote.va + 1024, 4000 - 1024));
    let replay: Vec<_> = trace
        .iter()
        .filter(|(from, _)| *from == 1)
        .map(|(_, pkt)| bth_of(pkt))
        .skip(4)
        .collect();
    assert_eq!(
        replay,
        [
            (Opcode::RC_RDMA_READ_RESPONSE_MIDDLE, p + 1),
            (Opcode::RC_RDMA_READ_RESPONSE_MIDDLE, p + 2),
            (Opcode::RC_RDMA_READ_RESPONSE_LAST, p + 3),
        ]
    );
}

/// A lost READ response noticed through the ACK of a later SEND (an ACK beyond a pending READ's
/// last PSN, digest §4.8): the retry starts at once, without waiting for the timer. The SEND is
/// resent too and must be re-ACKed, not delivered twice.
#[test]
fn lost_read_response_detected_by_a_later_ack() {
    let mut sim = Sim::new(43, 2, LinkConfig::default());
    let o = ConnectOptions::default();
    let (a, b) = connect(&mut sim, 0, 1, &o);
    let local = sim.nodes[0].alloc(8192, RW);
    let remote = sim.nodes[1].alloc(8192, RW);
    let data = pattern(500, 43);
    sim.nodes[1].bytes_mut(&remote)[..500].copy_from_slice(&data);
    sim.nodes[0].bytes_mut(&local)[4096..4196].copy_from_slice(&pattern(100, 1));
    sim.nodes[1]
        .post_recv(b.qpn, recv_wr(9, &remote, 4096, 1024))
        .unwrap();
    let dropped = drop_matching(&mut sim, 1, 1, |op, _| {
        op == Opcode::RC_RDMA_READ_RESPONSE_ONLY
    });
    sim.nodes[0]
        .post_send(
            a.qpn,
            SendWr::new(1, read_op(&remote, 0), vec![sge(&local, 0, 500)]),
        )
        .unwrap();
    sim.nodes[0]
        .post_send(
            a.qpn,
            SendWr::new(2, SendOp::Send, vec![sge(&local, 4096, 100)]),
        )
        .unwrap();
    let sc = wait_cq(&mut sim, 0, a.send_cq, 2);
    settle(&mut sim);
    assert_eq!(dropped.get(), 1);
    assert_eq!(
        ids_and_status(&sc),
        [(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    assert_eq!(&sim.nodes[0].bytes(&local)[..500], &data[..]);
    let rc = sim.nodes[1].poll(b.recv_cq);
    assert_eq!(
        ids_and_status(&rc),
        [(9, WcStatus::Success)],
        "delivered once"
    );
    let (c0, c1) = (counters(&sim, 0), counters(&sim, 1));
    assert_eq!(c0.timeouts, 0, "the ACK, not the timer, started the retry");
    assert_eq!(c0.retransmissions, 1);
    assert_eq!(c1.duplicates, 2, "the READ and the SEND came twice");
}

/// A lost atomic ACK: the atomic is resent with its PSN and the responder replays the stored
/// original value instead of executing it again, so it takes effect exactly once. With
/// CMP_SWAP a re-execution would be visible: the compare would now fail and return the new
/// value.
#[test]
fn lost_atomic_ack_is_replayed_not_reexecuted() {
    let mut sim = Sim::new(44, 2, LinkConfig::default());
    let o = ConnectOptions::default();
    let (a, _b) = connect(&mut sim, 0, 1, &o);
    let local = sim.nodes[0].alloc(4096, RW);
    let remote = sim.nodes[1].alloc(4096, RW);
    sim.nodes[1].bytes_mut(&remote)[64..72].copy_from_slice(&40u64.to_ne_bytes());
    // The first ACK of each atomic is lost; the replay gets through.
    let mut seen = HashSet::new();
    let dropped = drop_matching(&mut sim, 1, 2, move |op, psn| {
        op == Opcode::RC_ATOMIC_ACKNOWLEDGE && seen.insert(psn)
    });

    sim.nodes[0]
        .post_send(
            a.qpn,
            SendWr::new(1, fetch_add_op(&remote, 64, 2), vec![sge(&local, 0, 8)]),
        )
        .unwrap();
    let sc = wait_cq(&mut sim, 0, a.send_cq, 1);
    assert_eq!(ids_and_status(&sc), [(1, WcStatus::Success)]);
    assert_eq!(u64_at(sim.nodes[0].bytes(&local), 0), 40);
    assert_eq!(u64_at(sim.nodes[1].bytes(&remote), 64), 42, "added once");
    assert_eq!(counters(&sim, 1).duplicates, 1);

    sim.nodes[0]
        .post_send(
            a.qpn,
            SendWr::new(
                2,
                SendOp::CompareSwap {
                    remote_addr: remote.va + 64,
                    rkey: remote.rkey,
                    compare: 42,
                    swap: 7,
                },
                vec![sge(&local, 8, 8)],
            ),
        )
        .unwrap();
    let sc = wait_cq(&mut sim, 0, a.send_cq, 1);
    settle(&mut sim);
    assert_eq!(ids_and_status(&sc), [(2, WcStatus::Success)]);
    assert_eq!(dropped.get(), 2);
    assert_eq!(
        u64_at(sim.nodes[0].bytes(&local), 8),
        42,
        "the stored original"
    );
    assert_eq!(u64_at(sim.nodes[1].bytes(&remote), 64), 7);
    let (c0, c1) = (counters(&sim, 0), counters(&sim, 1));
    assert_eq!(c1.duplicates, 2);
    assert_eq!(c0.timeouts, 2);
}

/// An atomic's local buffer may be longer than 8 bytes, as rdma-core's rxe provider takes it:
/// the original value lands in its first 8 bytes and the rest is left as it was. Shorter than
/// 8 bytes is refused.
#[test]
fn an_atomic_with_a_longer_local_buffer_gets_the_original_in_its_first_8_bytes() {
    let mut sim = Sim::new(45, 2, LinkConfig::default());
    let (a, _b) = connect(&mut sim, 0, 1, &ConnectOptions::default());
    let local = sim.nodes[0].alloc(4096, RW);
    let remote = sim.nodes[1].alloc(4096, RW);
    sim.nodes[1].bytes_mut(&remote)[64..72].copy_from_slice(&40u64.to_ne_bytes());
    sim.nodes[0].bytes_mut(&local)[..24].fill(0xee);
    // Two SGEs, 4 + 12 bytes: the value is split across them.
    let wr = SendWr::new(
        1,
        fetch_add_op(&remote, 64, 2),
        vec![sge(&local, 0, 4), sge(&local, 4, 12)],
    );
    sim.nodes[0].post_send(a.qpn, wr).unwrap();
    let sc = wait_cq(&mut sim, 0, a.send_cq, 1);
    assert_eq!(ids_and_status(&sc), [(1, WcStatus::Success)]);
    let bytes = sim.nodes[0].bytes(&local);
    assert_eq!(u64_at(bytes, 0), 40, "the original value");
    assert_eq!(
        &bytes[8..24],
        &[0xee; 16],
        "the rest of the buffer is untouched"
    );
    assert_eq!(u64_at(sim.nodes[1].bytes(&remote), 64), 42);

    let short = SendWr::new(2, fetch_add_op(&remote, 64, 2), vec![sge(&local, 0, 4)]);
    assert!(
        matches!(
            sim.nodes[0].post_send(a.qpn, short),
            Err(VerbsError::Invalid(_))
        ),
        "a 4-byte buffer cannot take the original value"
    );
}
