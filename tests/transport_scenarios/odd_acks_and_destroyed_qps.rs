//! ACKs for nothing sent, bad checksums, QPs destroyed while their peers still talk to them,
//! and a receive WQE taken by a message still arriving.

use super::*;

/// One 1 KiB WRITE from node 0's QP `a` (wr_id 1, from the start of `src` to the start of
/// `dst`), completed: the simulator's trace of it (node, packet), its ACK last.
fn traced_write(
    sim: &mut Sim,
    a: &QpEnd,
    src: &MemoryRegion,
    dst: &MemoryRegion,
) -> Vec<(usize, Vec<u8>)> {
    sim.trace = Some(Vec::new());
    sim.nodes[0]
        .post_send(
            a.qpn,
            SendWr::new(1, write_op(dst, 0), vec![sge(src, 0, 1024)]),
        )
        .unwrap();
    assert_eq!(wait_cq(sim, 0, a.send_cq, 1)[0].status, WcStatus::Success);
    sim.trace.take().unwrap()
}

/// A frame whose IPv4 header checksum or (non-zero) UDP checksum is wrong is dropped and
/// counted apart from one whose ICRC is wrong: a path that rewrites headers is not a RoCE
/// stack's fault, and the counters should not send its user looking at the ICRC.
#[test]
fn bad_checksums_are_counted_apart_from_bad_icrcs() {
    let mut sim = Sim::new(44, 2, LinkConfig::default());
    let (a, _b) = connect(&mut sim, 0, 1, &ConnectOptions::default());
    let src = sim.nodes[0].alloc(4096, RW);
    let dst = sim.nodes[1].alloc(4096, RW);
    let trace = traced_write(&mut sim, &a, &src, &dst);
    let ack = &trace.iter().rev().find(|(from, _)| *from == 1).unwrap().1;
    assert_eq!(&ack[26..28], &[0, 0], "xroce sends no UDP checksum");
    let mut bad_ip = ack.clone();
    bad_ip[10] ^= 0xff; // the IPv4 header checksum (the ICRC leaves it out)
    let mut bad_udp = ack.clone();
    bad_udp[26..28].copy_from_slice(&[0x12, 0x34]); // the ICRC leaves it out too
    let mut bad_icrc = ack.clone();
    *bad_icrc.last_mut().unwrap() ^= 1;
    let before = counters(&sim, 0);
    let now = sim.now;
    let node = &mut sim.nodes[0];
    for p in [&bad_ip, &bad_udp, &bad_icrc] {
        node.dev.handle_packet(now, p, &mut node.mem);
    }
    let after = counters(&sim, 0);
    assert_eq!(after.rx_packets - before.rx_packets, 3);
    assert_eq!(after.bad_checksum - before.bad_checksum, 2);
    assert_eq!(after.bad_icrc - before.bad_icrc, 1);
    assert_eq!(after.duplicates, before.duplicates, "a bad frame was taken");
}

/// An ACK for a PSN the requester never sent (a late packet of an earlier connection with the
/// same QP number: every xroce process numbers its QPs from the same start) is ignored and
/// counted. Taken as an implicit acknowledgement it completed the WRITE in flight as a
/// success although the peer never received it; each end then waited for the other forever.
/// The WRITE's real transmission is lost here, so only the retransmission delivers it.
#[test]
fn an_ack_for_a_psn_never_sent_completes_nothing() {
    let mut sim = Sim::new(43, 2, LinkConfig::default());
    let (a, _b) = connect(&mut sim, 0, 1, &ConnectOptions::default());
    let src = sim.nodes[0].alloc(4096, RW);
    let dst = sim.nodes[1].alloc(4096, RW);
    let data = pattern(2048, 43);
    sim.nodes[0].bytes_mut(&src)[..2048].copy_from_slice(&data);

    // A first WRITE goes through, and its ACK is kept as the model of a stray one.
    let trace = traced_write(&mut sim, &a, &src, &dst);
    let (first_psn, ack) = {
        let request = trace.iter().find(|(from, _)| *from == 0).unwrap();
        let ack = trace.iter().rev().find(|(from, _)| *from == 1).unwrap();
        (bth_of(&request.1).1, ack.1.clone())
    };
    assert_eq!(bth_of(&ack).0, Opcode::RC_ACKNOWLEDGE);

    // The second WRITE's only transmission is lost; meanwhile an ACK arrives for a PSN far
    // beyond anything sent.
    let lost = drop_matching(&mut sim, 0, 1, |op, _| op == Opcode::RC_RDMA_WRITE_ONLY);
    sim.nodes[0]
        .post_send(
            a.qpn,
            SendWr::new(2, write_op(&dst, 1024), vec![sge(&src, 1024, 1024)]),
        )
        .unwrap();
    sim.run_until(SEC, |_| lost.get() == 1);
    assert_eq!(lost.get(), 1);
    let stray = ack_rewritten(&ack, first_psn + 1000, ack[40]);
    let now = sim.now;
    let node = &mut sim.nodes[0];
    node.dev.handle_packet(now, &stray, &mut node.mem);
    assert_eq!(
        cq_len(&sim, 0, a.send_cq),
        0,
        "the stray ACK completed the lost WRITE"
    );
    assert_eq!(counters(&sim, 0).ghost_responses, 1);

    // The retransmission delivers it, and only then does it complete.
    let wc = wait_cq(&mut sim, 0, a.send_cq, 1);
    assert_eq!((wc[0].wr_id, wc[0].status), (2, WcStatus::Success));
    assert!(counters(&sim, 0).timeouts >= 1);
    assert_eq!(&sim.nodes[1].bytes(&dst)[..2048], &data[..]);
}

/// Before an RC QP is destroyed it sends one more ACK for the last request it executed: after
/// that nothing answers the peer's resends, and rdma_rxe can be left waiting for exactly that
/// ACK (see `Device::queue_farewell_ack`). The ACK carries the last PSN and MSN, and the
/// requester takes it as the duplicate it is: no completion, no error, no retransmission. A QP
/// that executed nothing, and a UD QP, have no such ACK.
#[test]
fn a_qp_about_to_be_destroyed_acknowledges_its_last_request_once_more() {
    let mut sim = Sim::new(41, 2, LinkConfig::default());
    let (a, b) = connect(&mut sim, 0, 1, &ConnectOptions::default());
    let src = sim.nodes[0].alloc(4096, RW);
    let dst = sim.nodes[1].alloc(4096, RW);
    for id in 1..=3u64 {
        post_send_and_its_recv(&mut sim, (a, &src), (b, &dst), id);
    }
    assert_eq!(wait_cq(&mut sim, 0, a.send_cq, 3).len(), 3);
    settle(&mut sim);
    assert_eq!(sim.nodes[1].poll(b.recv_cq).len(), 3);
    let last_send_psn = sim.nodes[0]
        .dev
        .query_qp(a.qpn)
        .unwrap()
        .sq_psn
        .wrapping_sub(1)
        & 0xff_ffff;
    let before = (counters(&sim, 0), counters(&sim, 1));

    // The requester's QP executed no request of the peer's: nothing to acknowledge.
    assert!(!sim.nodes[0].dev.queue_farewell_ack(a.qpn));
    sim.trace = Some(Vec::new());
    assert!(sim.nodes[1].dev.queue_farewell_ack(b.qpn));
    settle(&mut sim);
    let trace = sim.trace.take().unwrap();
    let sent: Vec<_> = trace
        .iter()
        .map(|(node, p)| {
            let f = RoceFrame::parse_ip(p).unwrap();
            let t = f.headers.transport;
            (
                *node,
                t.bth.opcode,
                t.bth.psn,
                t.aeth.map(|a| (a.syndrome, a.msn)),
            )
        })
        .collect();
    assert_eq!(
        sent,
        vec![(
            1,
            Opcode::RC_ACKNOWLEDGE,
            last_send_psn,
            Some((
                AethSyndrome::Ack {
                    credits: AethSyndrome::UNLIMITED_CREDITS
                },
                3
            ))
        )],
        "one ACK, for the last SEND (the third message)"
    );
    assert!(sim.nodes[0].poll(a.send_cq).is_empty());
    assert_eq!(state(&sim, a), QpState::Rts);
    let after = (counters(&sim, 0), counters(&sim, 1));
    assert_eq!(after.0.retransmissions, before.0.retransmissions);
    assert_eq!(after.0.rx_packets, before.0.rx_packets + 1);
    assert_eq!(after.1.tx_responses, before.1.tx_responses + 1);
    sim.nodes[1].dev.destroy_qp(b.qpn).unwrap();

    // UD has no ACKs.
    let (ua, _, _) = xroce_tests::sim::ud_pair(&mut sim, 0, 1);
    assert!(!sim.nodes[0].dev.queue_farewell_ack(ua.qpn));
}

/// A QP destroyed right after it executed its peer's last SEND, whose ACKs never arrived:
/// destroyed plainly, nothing answers the peer's resends and its WQE ends in
/// `RetryExcErr`; destroyed lingering, it answers the first resend with the ACK for the
/// last request and the peer's WQE completes. Verbs see it gone at once, it executes
/// nothing new, and once its time is up it answers nothing.
#[test]
fn a_destroyed_qp_lingers_to_answer_its_peers_resends() {
    const LINGER: Nanos = 50_000_000;
    // The third case: the application moves the QP to ERROR (to flush it) before destroying
    // it, which must not keep it from answering.
    for (lingering, errored_first) in [(false, false), (true, false), (true, true)] {
        let mut sim = Sim::new(43, 2, LinkConfig::default());
        let opts = ConnectOptions {
            retry_cnt: 3,
            ..ConnectOptions::default()
        };
        let (a, b) = connect(&mut sim, 0, 1, &opts);
        let src = sim.nodes[0].alloc(4096, RW);
        let dst = sim.nodes[1].alloc(4096, RW);
        // The responder's ACKs are lost; it executes the SEND all the same.
        sim.drop_filter = Some(Box::new(|from, _| from == 1));
        post_send_and_its_recv(&mut sim, (a, &src), (b, &dst), 1);
        assert_eq!(wait_cq(&mut sim, 1, b.recv_cq, 1).len(), 1);
        if errored_first {
            let to_error = QpAttr {
                state: QpState::Error,
                ..QpAttr::default()
            };
            sim.nodes[1]
                .dev
                .modify_qp(b.qpn, &to_error, AttrMask::STATE)
                .unwrap();
        }
        let r = if lingering {
            sim.nodes[1]
                .dev
                .destroy_qp_lingering(b.qpn, sim.now, LINGER)
        } else {
            sim.nodes[1].dev.destroy_qp(b.qpn)
        };
        r.unwrap();
        sim.drop_filter = None;
        assert!(matches!(
            sim.nodes[1].dev.query_qp(b.qpn),
            Err(VerbsError::NoSuchObject(_))
        ));
        assert_eq!(sim.nodes[1].dev.lingering(sim.now), lingering);
        let before = counters(&sim, 1);
        let done = wait_cq(&mut sim, 0, a.send_cq, 1);
        let after = counters(&sim, 1);
        if lingering {
            assert_eq!(
                done[0].status,
                WcStatus::Success,
                "{errored_first} {done:?}"
            );
            assert!(after.tx_responses > before.tx_responses, "{after:?}");
            assert_eq!(after.unknown_qp, before.unknown_qp);
        } else {
            assert_eq!(done[0].status, WcStatus::RetryExcErr, "{done:?}");
            assert!(after.unknown_qp > before.unknown_qp, "{after:?}");
        }
    }

    // A new message to a lingering QP is not executed (nor answered), and the QP is forgotten
    // once its time is up.
    let mut sim = Sim::new(44, 2, LinkConfig::default());
    let (a, b) = connect(
        &mut sim,
        0,
        1,
        &ConnectOptions {
            retry_cnt: 1,
            ..ConnectOptions::default()
        },
    );
    let src = sim.nodes[0].alloc(4096, RW);
    let dst = sim.nodes[1].alloc(4096, RW);
    post_send_and_its_recv(&mut sim, (a, &src), (b, &dst), 1);
    assert_eq!(
        wait_cq(&mut sim, 0, a.send_cq, 1)[0].status,
        WcStatus::Success
    );
    sim.nodes[1]
        .dev
        .destroy_qp_lingering(b.qpn, sim.now, LINGER)
        .unwrap();
    sim.nodes[0]
        .post_send(a.qpn, SendWr::new(2, SendOp::Send, vec![sge(&src, 0, 100)]))
        .unwrap();
    let before = counters(&sim, 1);
    let done = wait_cq(&mut sim, 0, a.send_cq, 1);
    assert_eq!(done[0].status, WcStatus::RetryExcErr, "{done:?}");
    assert_eq!(counters(&sim, 1).tx_responses, before.tx_responses);
    sim.now += 2 * LINGER;
    assert!(!sim.nodes[1].dev.lingering(sim.now));
}

/// The plain ACKs a QP sends for no request of its own (its farewell when destroyed, the
/// answer to a duplicate) name the last SEND or WRITE it executed, never a READ's or an
/// atomic's PSN: rdma_rxe's completer takes a plain ACK at the PSN of the atomic it waits for
/// as that atomic's success, with no result. Here the atomic ACK is lost and the responder is
/// destroyed; its farewell ACK named the atomic's PSN.
#[test]
fn acks_for_no_request_never_name_an_atomic() {
    const LINGER: Nanos = 50_000_000;
    let mut sim = Sim::new(45, 2, LinkConfig::default());
    let o = ConnectOptions {
        retry_cnt: 1,
        ..ConnectOptions::default()
    };
    let (a, b) = connect(&mut sim, 0, 1, &o);
    let src = sim.nodes[0].alloc(4096, RW);
    let dst = sim.nodes[1].alloc(4096, RW);
    post_send_and_its_recv(&mut sim, (a, &src), (b, &dst), 1);
    assert_eq!(
        wait_cq(&mut sim, 0, a.send_cq, 1)[0].status,
        WcStatus::Success
    );
    let send_psn = o.psn.0;
    let atomic_psn = (o.psn.0 + 1) & 0xff_ffff;
    drop_matching(&mut sim, 1, u32::MAX, |op, _| {
        op == Opcode::RC_ATOMIC_ACKNOWLEDGE
    });
    sim.trace = Some(Vec::new());
    sim.nodes[0]
        .post_send(
            a.qpn,
            SendWr::new(2, fetch_add_op(&dst, 64, 1), vec![sge(&src, 0, 8)]),
        )
        .unwrap();
    // The atomic is executed, its ACK lost; then the responder goes, and so do its resends.
    assert!(sim.run_until(1_000_000, |s| counters(s, 1).tx_responses > 1));
    // As the engine destroys a QP: the farewell ACK first, then the QP lingers.
    assert!(sim.nodes[1].dev.queue_farewell_ack(b.qpn));
    sim.transmit_all();
    sim.nodes[1]
        .dev
        .destroy_qp_lingering(b.qpn, sim.now, LINGER)
        .unwrap();
    let done = wait_cq(&mut sim, 0, a.send_cq, 1);
    assert_eq!(done[0].status, WcStatus::RetryExcErr, "{done:?}");
    let acks: Vec<u32> = sim
        .trace
        .take()
        .unwrap_or_default()
        .iter()
        .filter(|(node, _)| *node == 1)
        .map(|(_, p)| bth_of(p))
        .filter(|(op, _)| *op == Opcode::RC_ACKNOWLEDGE)
        .map(|(_, psn)| psn)
        .collect();
    assert!(!acks.is_empty(), "no farewell ACK at all");
    assert!(
        acks.iter().all(|&psn| psn == send_psn),
        "ACKs at {acks:x?}: the SEND was {send_psn:#x}, the atomic {atomic_psn:#x}"
    );
}

/// A receive WQE a message is being received into still counts against `max_recv_wr` until
/// the message completes, as in rdma_rxe's ring: otherwise one receive more than the queue
/// holds could be posted, and a flush complete more receives than a CQ sized to it holds.
#[test]
fn a_receive_in_progress_still_takes_its_slot() {
    let mut sim = Sim::new(46, 2, LinkConfig::default());
    let o = ConnectOptions::default();
    let a = create_qp_with(&mut sim, 0, &o, 64, 64, None);
    let b = create_qp_with(&mut sim, 1, &o, 64, 64, None);
    bring_up(&mut sim, a, b, &o, o.psn.0, o.psn.1);
    bring_up(&mut sim, b, a, &o, o.psn.1, o.psn.0);
    let max_recv_wr = sim.nodes[1].dev.query_qp(b.qpn).unwrap().cap.max_recv_wr as u64;
    let src = sim.nodes[0].alloc(4096, RW);
    let dst = sim.nodes[1].alloc(4096 * 2, RW);
    for id in 0..max_recv_wr {
        sim.nodes[1]
            .post_recv(b.qpn, recv_wr(id, &dst, 0, 4096))
            .unwrap();
    }
    // A SEND of four packets whose last is lost: its receive is in progress.
    drop_matching(&mut sim, 0, u32::MAX, |op, _| op == Opcode::RC_SEND_LAST);
    sim.nodes[0]
        .post_send(
            a.qpn,
            SendWr::new(1, SendOp::Send, vec![sge(&src, 0, 4096)]),
        )
        .unwrap();
    assert!(sim.run_until(1_000_000, |s| s.nodes[1].dev.mid_message()));
    let refused = sim.nodes[1].post_recv(b.qpn, recv_wr(99, &dst, 4096, 4096));
    assert!(
        matches!(refused, Err(VerbsError::QueueFull(_))),
        "{refused:?}"
    );
}
