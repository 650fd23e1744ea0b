//! RNR NAKs (digest §4.7): a receiver with no receive posted, its retries, and recovery once one is.

use super::*;

/// Two connected RC QPs (nodes 0 and 1) whose RNR timer is 640 µs (code 12, digest §4.6 table:
/// far above the simulated RTT), and a 3000-byte SEND (WR 1) posted on node 0's while node 1's
/// has no receive: three packets at MTU 1024, the FIRST draws the RNR NAK.
struct UnreadyReceiver {
    sim: Sim,
    a: QpEnd,
    b: QpEnd,
    /// The receive buffer to post on node 1, and what must land in it.
    dst: MemoryRegion,
    data: Vec<u8>,
}

fn send_to_an_unready_receiver(seed: u64, retry_cnt: u8) -> UnreadyReceiver {
    let mut sim = Sim::new(seed, 2, LinkConfig::default());
    let o = ConnectOptions {
        min_rnr_timer: 12,
        retry_cnt,
        ..ConnectOptions::default()
    };
    let (a, b) = connect(&mut sim, 0, 1, &o);
    let src = sim.nodes[0].alloc(8192, RW);
    let dst = sim.nodes[1].alloc(8192, RW);
    let data = pattern(3000, seed as u8);
    sim.nodes[0].bytes_mut(&src)[..3000].copy_from_slice(&data);
    sim.nodes[0]
        .post_send(
            a.qpn,
            SendWr::new(1, SendOp::Send, vec![sge(&src, 0, 3000)]),
        )
        .unwrap();
    UnreadyReceiver {
        sim,
        a,
        b,
        dst,
        data,
    }
}

/// A SEND finding no receive is RNR-NAKed (class B: the responder stays in RTS) and retried
/// every RNR timer period; once a receive is posted the retry lands and the data arrives.
#[test]
fn rnr_nak_then_recovery_when_a_receive_is_posted() {
    let UnreadyReceiver {
        mut sim,
        a,
        b,
        dst,
        data,
    } = send_to_an_unready_receiver(11, 7);
    let window: Nanos = 3_000_000;
    assert!(!sim.run_until(window, |s| cq_len(s, 0, a.send_cq) > 0));

    let (c0, c1) = (counters(&sim, 0), counters(&sim, 1));
    assert!(c1.rnr_naks_sent >= 2, "{c1:?}");
    assert_eq!(c0.rnr_naks_received, c1.rnr_naks_sent);
    // The requester honours the 640 µs wait: at most one attempt per period in the window.
    assert!(
        c1.rnr_naks_sent <= window / 640_000 + 1,
        "{} RNR NAKs in {window} ns: the RNR timer was not honoured",
        c1.rnr_naks_sent
    );
    // Retries under RNR are neither timeouts nor retry-count failures.
    assert_eq!(c0.timeouts, 0);
    assert_eq!(state(&sim, a), QpState::Rts);
    assert_eq!(state(&sim, b), QpState::Rts, "RNR is class B: no error");
    assert_eq!(cq_len(&sim, 1, b.recv_cq), 0);

    sim.nodes[1]
        .post_recv(b.qpn, recv_wr(7, &dst, 0, 4096))
        .unwrap();
    let sc = wait_cq(&mut sim, 0, a.send_cq, 1);
    assert_eq!(ids_and_status(&sc), [(1, WcStatus::Success)]);
    settle(&mut sim);
    let rc = sim.nodes[1].poll(b.recv_cq);
    assert_eq!(ids_and_status(&rc), [(7, WcStatus::Success)]);
    assert_eq!(rc[0].byte_len, 3000);
    assert_eq!(&sim.nodes[1].bytes(&dst)[..3000], &data[..]);
    let (c0, c1) = (counters(&sim, 0), counters(&sim, 1));
    assert_eq!(c0.rnr_naks_received, c1.rnr_naks_sent);
    assert_eq!(c0.retry_exceeded, 0);
}

/// With `rnr_retry = n` the requester accepts n + 1 RNR NAKs, then completes the WQE with
/// RNR_RETRY_EXC_ERR; its QP goes to ERROR, the WQEs behind it and any posted later flush.
#[test]
fn rnr_retry_exhausted_fails_the_wqe_and_flushes_the_rest() {
    for rnr_retry in [0u8, 2] {
        let mut sim = Sim::new(12, 2, LinkConfig::default());
        let o = ConnectOptions {
            rnr_retry,
            ..ConnectOptions::default()
        };
        let (a, b) = connect(&mut sim, 0, 1, &o);
        let src = sim.nodes[0].alloc(4096, RW);
        let dst = sim.nodes[1].alloc(4096, RW);
        sim.nodes[0]
            .post_recv(a.qpn, recv_wr(50, &src, 2048, 1024))
            .unwrap();
        sim.nodes[0]
            .post_send(a.qpn, SendWr::new(1, SendOp::Send, vec![sge(&src, 0, 100)]))
            .unwrap();
        sim.nodes[0]
            .post_send(a.qpn, SendWr::new(2, SendOp::Send, vec![sge(&src, 0, 100)]))
            .unwrap();
        sim.nodes[0]
            .post_send(
                a.qpn,
                SendWr::new(3, write_op(&dst, 0), vec![sge(&src, 0, 100)]),
            )
            .unwrap();
        let sc = wait_cq(&mut sim, 0, a.send_cq, 3);
        assert_eq!(
            ids_and_status(&sc),
            [
                (1, WcStatus::RnrRetryExcErr),
                (2, WcStatus::WrFlushErr),
                (3, WcStatus::WrFlushErr)
            ],
            "rnr_retry {rnr_retry}"
        );
        settle(&mut sim);
        let (c0, c1) = (counters(&sim, 0), counters(&sim, 1));
        assert_eq!(c0.rnr_naks_received, u64::from(rnr_retry) + 1);
        assert_eq!(c1.rnr_naks_sent, u64::from(rnr_retry) + 1);
        assert_eq!(state(&sim, a), QpState::Error);
        assert_eq!(
            state(&sim, b),
            QpState::Rts,
            "the responder is not at fault"
        );
        // The requester's receive queue flushes too.
        let rc = sim.nodes[0].poll(a.recv_cq);
        assert_eq!(ids_and_status(&rc), [(50, WcStatus::WrFlushErr)]);
        // Work posted to a QP in ERROR completes at once with a flush error.
        sim.nodes[0]
            .post_send(a.qpn, SendWr::new(4, SendOp::Send, vec![sge(&src, 0, 8)]))
            .unwrap();
        sim.nodes[0]
            .post_recv(a.qpn, recv_wr(51, &src, 0, 8))
            .unwrap();
        assert_eq!(
            ids_and_status(&sim.nodes[0].poll(a.send_cq)),
            [(4, WcStatus::WrFlushErr)]
        );
        assert_eq!(
            ids_and_status(&sim.nodes[0].poll(a.recv_cq)),
            [(51, WcStatus::WrFlushErr)]
        );
        // Nothing reached the responder's memory or CQs.
        assert_eq!(cq_len(&sim, 1, b.recv_cq), 0);
        assert!(sim.nodes[1].bytes(&dst).iter().all(|&x| x == 0));
    }
}

/// An RNR NAK can hit the last packet of a multi-packet WRITE with immediate (the packet that
/// consumes the receive WQE). The NAK acknowledges the packets before it, so the requester
/// resumes at the NAKed packet; the data written before the NAK is kept, and the completion
/// reports the whole RDMA length.
#[test]
fn rnr_nak_on_the_last_packet_of_a_write_with_immediate() {
    let mut sim = Sim::new(13, 2, LinkConfig::default());
    let o = ConnectOptions::default();
    let (a, b) = connect(&mut sim, 0, 1, &o);
    let src = sim.nodes[0].alloc(8192, RW);
    let dst = sim.nodes[1].alloc(8192, RW);
    let data = pattern(3000, 13);
    sim.nodes[0].bytes_mut(&src)[..3000].copy_from_slice(&data);
    sim.trace = Some(Vec::new());
    let op = SendOp::RdmaWriteWithImm {
        remote_addr: dst.va,
        rkey: dst.rkey,
        imm: 0xabc,
    };
    sim.nodes[0]
        .post_send(a.qpn, SendWr::new(1, op, vec![sge(&src, 0, 3000)]))
        .unwrap();
    assert!(!sim.run_until(200_000, |s| cq_len(s, 0, a.send_cq) > 0));
    assert!(counters(&sim, 1).rnr_naks_sent >= 2);
    sim.nodes[1]
        .post_recv(b.qpn, recv_wr(4, &dst, 4096, 16))
        .unwrap();
    let sc = wait_cq(&mut sim, 0, a.send_cq, 1);
    settle(&mut sim);
    assert_eq!(ids_and_status(&sc), [(1, WcStatus::Success)]);
    let rc = sim.nodes[1].poll(b.recv_cq);
    assert_eq!(ids_and_status(&rc), [(4, WcStatus::Success)]);
    let wc = rc[0];
    assert_eq!(wc.opcode, WcOpcode::RecvRdmaWithImm);
    assert_eq!((wc.byte_len, wc.imm), (3000, 0xabc));
    assert!(wc.flags.contains(WcFlags::WITH_IMM));
    assert_eq!(&sim.nodes[1].bytes(&dst)[..3000], &data[..]);

    let p = o.psn.0;
    let sent: Vec<_> = sim
        .trace
        .take()
        .unwrap()
        .iter()
        .filter(|(from, _)| *from == 0)
        .map(|(_, pkt)| bth_of(pkt))
        .collect();
    let last = (Opcode::RC_RDMA_WRITE_LAST_WITH_IMMEDIATE, p + 2);
    assert_eq!(
        sent[..3],
        [
            (Opcode::RC_RDMA_WRITE_FIRST, p),
            (Opcode::RC_RDMA_WRITE_MIDDLE, p + 1),
            last
        ]
    );
    assert!(
        sent.len() > 3 && sent[3..].iter().all(|&x| x == last),
        "{sent:?}"
    );
}

/// A receiver out of receive buffers costs only RNR retries. After its RNR NAK the responder
/// also answers the packets behind the NAKed one with a sequence NAK for the same PSN (as
/// rdma_rxe does); the requester, already waiting to resend from there, does not count it as a
/// retry. Before, the first such NAK was counted: with `retry_cnt` 0 a SEND to a receiver not
/// ready failed with RETRY_EXC_ERR on the first round although `rnr_retry` 7 asks for retrying
/// forever (rdma_rxe's requester does the same).
#[test]
fn rnr_rounds_do_not_use_up_the_retry_count() {
    for retry_cnt in [0, 1] {
        let UnreadyReceiver {
            mut sim,
            a,
            b,
            dst,
            data,
        } = send_to_an_unready_receiver(97, retry_cnt);
        // The two packets behind the RNR-NAKed FIRST draw a sequence NAK.
        assert!(!sim.run_until(5_000_000, |s| cq_len(s, 0, a.send_cq) > 0));
        let (c0, c1) = (counters(&sim, 0), counters(&sim, 1));
        assert!(c1.rnr_naks_sent >= 4, "{c1:?}");
        assert!(
            c0.seq_naks_received >= 4,
            "no sequence NAKs behind the RNR NAKs: {c0:?}"
        );
        assert_eq!(state(&sim, a), QpState::Rts);

        sim.nodes[1]
            .post_recv(b.qpn, recv_wr(7, &dst, 0, 4096))
            .unwrap();
        let sc = wait_cq(&mut sim, 0, a.send_cq, 1);
        assert_eq!(ids_and_status(&sc), [(1, WcStatus::Success)]);
        settle(&mut sim);
        assert_eq!(&sim.nodes[1].bytes(&dst)[..3000], &data[..]);
        assert_eq!(counters(&sim, 0).retry_exceeded, 0);
    }
}

/// The sequence NAK behind an RNR NAK can arrive after the RNR timer ran out: a message of
/// several 4 KiB packets on a 1 Gbit/s link, with an RNR timer of 10 µs. It is part of the
/// RNR round's go-back-N, not a retry of its own: at `retry_cnt` 0 it failed the SEND with
/// RETRY_EXC_ERR after one round.
#[test]
fn a_sequence_nak_after_the_rnr_timer_ran_out_is_no_retry() {
    let link = LinkConfig {
        ns_per_byte: 8.0,
        ..LinkConfig::default()
    };
    let mut sim = Sim::new(11, 2, link);
    let o = ConnectOptions {
        min_rnr_timer: 1,
        retry_cnt: 0,
        path_mtu: PathMtu::Mtu4096,
        ..ConnectOptions::default()
    };
    let (a, b) = connect(&mut sim, 0, 1, &o);
    let src = sim.nodes[0].alloc(16384, RW);
    let dst = sim.nodes[1].alloc(16384, RW);
    let data = pattern(12000, 11);
    sim.nodes[0].bytes_mut(&src)[..12000].copy_from_slice(&data);
    sim.nodes[0]
        .post_send(
            a.qpn,
            SendWr::new(1, SendOp::Send, vec![sge(&src, 0, 12000)]),
        )
        .unwrap();
    assert!(!sim.run_until(2_000_000, |s| cq_len(s, 0, a.send_cq) > 0));
    let c0 = counters(&sim, 0);
    assert!(
        c0.rnr_naks_received >= 2 && c0.seq_naks_received >= 2,
        "{c0:?}"
    );
    sim.nodes[1]
        .post_recv(b.qpn, recv_wr(7, &dst, 0, 16384))
        .unwrap();
    let sc = wait_cq(&mut sim, 0, a.send_cq, 1);
    assert_eq!(ids_and_status(&sc), [(1, WcStatus::Success)]);
    settle(&mut sim);
    assert_eq!(&sim.nodes[1].bytes(&dst)[..12000], &data[..]);
}

/// An RC pair with `timeout` 0 (no retransmission timer: only NAKs recover a loss) and the
/// shortest RNR timer; the first PSN node 0 sends, and 4 KiB of memory on each node.
fn rc_without_a_retransmission_timer(
    seed: u64,
) -> (Sim, QpEnd, QpEnd, u32, MemoryRegion, MemoryRegion) {
    let mut sim = Sim::new(seed, 2, LinkConfig::default());
    let o = ConnectOptions {
        min_rnr_timer: 1,
        timeout: 0,
        ..ConnectOptions::default()
    };
    let (a, b) = connect(&mut sim, 0, 1, &o);
    let src = sim.nodes[0].alloc(4096, RW);
    let dst = sim.nodes[1].alloc(4096, RW);
    (sim, a, b, o.psn.0, src, dst)
}

/// After an RNR wait, the resend loses a packet other than the first: the responder's sequence
/// NAK for it is a new loss and starts a retry at once. Only the NAK that echoes the RNR-NAKed
/// PSN is ignored; ignoring every NAK after an RNR wait left a QP with `timeout` 0 (no
/// retransmission timer) waiting for ever, and cost others a whole timeout.
#[test]
fn a_loss_in_the_resend_after_an_rnr_wait_is_retried_at_once() {
    let (mut sim, a, b, first, src, dst) = rc_without_a_retransmission_timer(12);
    let data = pattern(4096, 5);
    sim.nodes[0].bytes_mut(&src).copy_from_slice(&data);
    // The second packet is dropped the second time it goes: in the resend after the RNR wait.
    let mut sent_second = 0;
    drop_matching(&mut sim, 0, 1, move |_, psn| {
        sent_second += u32::from(psn == (first + 1) & 0xff_ffff);
        sent_second == 2 && psn == (first + 1) & 0xff_ffff
    });
    sim.nodes[0]
        .post_send(
            a.qpn,
            SendWr::new(1, SendOp::Send, vec![sge(&src, 0, 4096)]),
        )
        .unwrap();
    // The four packets meet no receive: an RNR NAK; the receive is there for the resend.
    assert!(sim.run_until(1_000_000, |s| counters(s, 0).rnr_naks_received > 0));
    sim.nodes[1]
        .post_recv(b.qpn, recv_wr(7, &dst, 0, 4096))
        .unwrap();
    let sc = wait_cq(&mut sim, 0, a.send_cq, 1);
    assert_eq!(ids_and_status(&sc), [(1, WcStatus::Success)]);
    settle(&mut sim);
    assert_eq!(sim.nodes[1].bytes(&dst), &data[..]);
    assert_eq!(counters(&sim, 0).timeouts, 0);
}

/// An RNR wait for a message of one packet, with nothing sent behind it (so no echoing
/// sequence NAK is due): when its resend is lost and a later message's packet draws a sequence
/// NAK for its PSN, that NAK is a new loss and starts a retry at once. Taken for the echo, it
/// left a QP with `timeout` 0 waiting for ever.
#[test]
fn a_sequence_nak_after_an_rnr_wait_with_nothing_behind_is_a_retry() {
    let (mut sim, a, b, first, src, dst) = rc_without_a_retransmission_timer(13);
    // The SEND's packet is dropped the second time it goes: its resend after the RNR wait.
    let mut sent_first = 0;
    drop_matching(&mut sim, 0, 1, move |_, psn| {
        sent_first += u32::from(psn == first);
        sent_first == 2 && psn == first
    });
    sim.nodes[0]
        .post_send(a.qpn, SendWr::new(1, SendOp::Send, vec![sge(&src, 0, 64)]))
        .unwrap();
    assert!(sim.run_until(1_000_000, |s| counters(s, 0).rnr_naks_received > 0));
    // During the wait: receives for both, and a second SEND behind the first.
    for id in [7, 8] {
        sim.nodes[1]
            .post_recv(b.qpn, recv_wr(id, &dst, 1024 * (id - 7), 1024))
            .unwrap();
    }
    sim.nodes[0]
        .post_send(a.qpn, SendWr::new(2, SendOp::Send, vec![sge(&src, 64, 64)]))
        .unwrap();
    let sc = wait_cq(&mut sim, 0, a.send_cq, 2);
    assert_eq!(
        ids_and_status(&sc),
        [(1, WcStatus::Success), (2, WcStatus::Success)]
    );
}

/// A SEND sent twice before its RNR NAK came back (its last packet resent on entering SQD)
/// draws two RNR NAKs for one PSN: one wait, one use of `rnr_retry`. With `rnr_retry` 1 the
/// second NAK failed the SEND with RNR_RETRY_EXC_ERR.
#[test]
fn two_rnr_naks_for_one_psn_are_one_rnr_retry() {
    let mut sim = Sim::new(8, 2, LinkConfig::default());
    let o = ConnectOptions {
        rnr_retry: 1,
        min_rnr_timer: 12,
        ..ConnectOptions::default()
    };
    let (a, b) = connect(&mut sim, 0, 1, &o);
    let src = sim.nodes[0].alloc(4096, RW);
    let dst = sim.nodes[1].alloc(4096, RW);
    for wr_id in 1..=2 {
        sim.nodes[0]
            .post_send(
                a.qpn,
                SendWr::new(wr_id, SendOp::Send, vec![sge(&src, 0, 64)]),
            )
            .unwrap();
    }
    first_request_then_sqd(&mut sim, a);
    // Both NAKs come back, long before the RNR timer (0.64 ms) runs out.
    sim.run_until(100_000, |_| false);
    assert_eq!(counters(&sim, 0).rnr_naks_received, 2);
    for wr_id in [7, 8] {
        sim.nodes[1]
            .post_recv(b.qpn, recv_wr(wr_id, &dst, 0, 4096))
            .unwrap();
    }
    assert!(sim.run_idle(10 * SEC));
    assert_eq!(
        ids_and_status(&sim.nodes[0].poll(a.send_cq)),
        [(1, WcStatus::Success)]
    );
    back_to_rts_sends_the_held_wqe(&mut sim, a, 2);
}
