//! UC: a lost packet drops its message and the next message is taken; a receiver that drops
//! messages and a sender that starts again behind stay in step.

use super::*;

/// UC: losing one packet of a multi-packet SEND (its FIRST, a MIDDLE or its LAST) loses that
/// message, counted once (no receive completion); the receive WQE it was landing in takes the
/// next message intact, and the sender, which gets no acknowledgements on UC, completes both.
#[test]
fn uc_gap_loses_one_message_and_the_next_arrives_intact() {
    // FIRST: four packets of the message follow the gap; MIDDLE (the first one): three do;
    // LAST: the gap is only seen when the next message starts.
    for lose in [
        Opcode::UC_SEND_FIRST,
        Opcode::UC_SEND_MIDDLE,
        Opcode::UC_SEND_LAST,
    ] {
        let mut sim = Sim::new(71, 2, LinkConfig::default());
        let o = ConnectOptions {
            ty: QpType::Uc,
            ..ConnectOptions::default()
        };
        let (a, b) = connect(&mut sim, 0, 1, &o);
        let src = sim.nodes[0].alloc(16384, RW);
        let dst = sim.nodes[1].alloc(16384, RW);
        let lost = pattern(5000, 1);
        let next = pattern(2000, 2);
        let third = pattern(300, 3);
        sim.nodes[0].bytes_mut(&src)[..5000].copy_from_slice(&lost);
        sim.nodes[0].bytes_mut(&src)[8192..10192].copy_from_slice(&next);
        sim.nodes[0].bytes_mut(&src)[12288..12588].copy_from_slice(&third);
        sim.nodes[1]
            .post_recv(b.qpn, recv_wr(10, &dst, 0, 8192))
            .unwrap();
        sim.nodes[1]
            .post_recv(b.qpn, recv_wr(11, &dst, 8192, 8192))
            .unwrap();
        // The first packet with that opcode belongs to the 5-packet message.
        let dropped = drop_matching(&mut sim, 0, 1, move |op, _| op == lose);
        sim.nodes[0]
            .post_send(
                a.qpn,
                SendWr::new(1, SendOp::Send, vec![sge(&src, 0, 5000)]),
            )
            .unwrap();
        sim.nodes[0]
            .post_send(
                a.qpn,
                SendWr::new(2, SendOp::Send, vec![sge(&src, 8192, 2000)]),
            )
            .unwrap();
        settle(&mut sim);
        let what = format!("losing {lose:?}");
        assert_eq!(dropped.get(), 1, "{what}");
        assert_eq!(
            ids_and_status(&sim.nodes[0].poll(a.send_cq)),
            [(1, WcStatus::Success), (2, WcStatus::Success)],
            "{what}"
        );
        let rc = sim.nodes[1].poll(b.recv_cq);
        assert_eq!(ids_and_status(&rc), [(10, WcStatus::Success)], "{what}");
        assert_eq!(rc[0].byte_len, 2000, "{what}");
        assert_eq!(&sim.nodes[1].bytes(&dst)[..2000], &next[..], "{what}");
        assert_eq!(
            counters(&sim, 1).uc_messages_dropped,
            1,
            "{what}: one message lost"
        );
        assert_eq!(state(&sim, b), QpState::Rts, "{what}: a UC gap is no error");

        // The second WQE is untouched and takes the following message.
        sim.nodes[0]
            .post_send(
                a.qpn,
                SendWr::new(3, SendOp::Send, vec![sge(&src, 12288, 300)]),
            )
            .unwrap();
        settle(&mut sim);
        let rc = sim.nodes[1].poll(b.recv_cq);
        assert_eq!(ids_and_status(&rc), [(11, WcStatus::Success)], "{what}");
        assert_eq!(rc[0].byte_len, 300, "{what}");
        assert_eq!(&sim.nodes[1].bytes(&dst)[8192..8492], &third[..], "{what}");
        assert_eq!(counters(&sim, 1).uc_messages_dropped, 1, "{what}");
    }
}

/// A UC receiver that drops messages (no receive posted) keeps its expected PSN level with the
/// sender's: otherwise, after 2^23 dropped packets, every new message would look older than
/// the expected PSN and be dropped as a duplicate even once receives are posted. A repeated
/// packet is still delivered at most once.
#[test]
fn a_uc_receiver_that_drops_messages_keeps_up_with_the_senders_psn() {
    let mut sim = Sim::new(72, 2, LinkConfig::default());
    let o = ConnectOptions {
        ty: QpType::Uc,
        ..ConnectOptions::default()
    };
    let (a, b) = connect(&mut sim, 0, 1, &o);
    let src = sim.nodes[0].alloc(4096, RW);
    let dst = sim.nodes[1].alloc(4096, RW);
    for i in 0..20 {
        sim.nodes[0]
            .post_send(a.qpn, SendWr::new(i, SendOp::Send, vec![sge(&src, 0, 64)]))
            .unwrap();
    }
    settle(&mut sim);
    assert_eq!(counters(&sim, 1).uc_messages_dropped, 20);
    let sq_psn = sim.nodes[0].dev.query_qp(a.qpn).unwrap().sq_psn;
    assert_eq!(sim.nodes[1].dev.query_qp(b.qpn).unwrap().rq_psn, sq_psn);

    // Receives posted: the next message arrives; a copy of it is not delivered again.
    sim.nodes[1]
        .post_recv(b.qpn, recv_wr(7, &dst, 0, 1024))
        .unwrap();
    sim.nodes[1]
        .post_recv(b.qpn, recv_wr(8, &dst, 1024, 1024))
        .unwrap();
    sim.nodes[0]
        .post_send(a.qpn, SendWr::new(99, SendOp::Send, vec![sge(&src, 0, 64)]))
        .unwrap();
    let now = sim.now;
    let packets = drain(&mut sim, 0, now);
    assert_eq!(packets.len(), 1);
    for _ in 0..2 {
        let node = &mut sim.nodes[1];
        node.dev.handle_packet(now, &packets[0], &mut node.mem);
    }
    assert_eq!(
        ids_and_status(&sim.nodes[1].poll(b.recv_cq)),
        [(7, WcStatus::Success)]
    );
    assert_eq!(counters(&sim, 1).duplicates, 1);
}

/// A UC sender that starts again at a PSN well behind the one its receiver expects (its QP
/// reset and reconnected with a new random PSN while the receiver kept its QP) is taken from
/// its first message on, as rdma_rxe restarts on any FIRST/ONLY. Dropped as old duplicates,
/// its messages were lost until it caught up, up to 2^23 packets later. A FIRST/ONLY just
/// behind, a repeat by the network, is still dropped.
#[test]
fn a_uc_sender_that_starts_again_further_behind_is_taken() {
    let mut sim = Sim::new(73, 2, LinkConfig::default());
    let o = ConnectOptions {
        ty: QpType::Uc,
        ..ConnectOptions::default()
    };
    let a = create_qp_with(&mut sim, 0, &o, 64, 64, None);
    let b = create_qp_with(&mut sim, 1, &o, 64, 64, None);
    let sender_psn = 0x40_0000;
    // The receiver expects 2^22 packets more than the sender will send from.
    bring_up(&mut sim, a, b, &o, sender_psn, 0);
    bring_up(&mut sim, b, a, &o, 0, sender_psn + 0x40_0000);
    let src = sim.nodes[0].alloc(4096, RW);
    let dst = sim.nodes[1].alloc(4096, RW);
    for id in 0..3 {
        sim.nodes[1]
            .post_recv(b.qpn, recv_wr(id, &dst, 1024 * id, 1024))
            .unwrap();
    }
    for id in 0..3 {
        sim.nodes[0]
            .post_send(a.qpn, SendWr::new(id, SendOp::Send, vec![sge(&src, 0, 64)]))
            .unwrap();
    }
    settle(&mut sim);
    assert_eq!(
        ids_and_status(&sim.nodes[1].poll(b.recv_cq)),
        [
            (0, WcStatus::Success),
            (1, WcStatus::Success),
            (2, WcStatus::Success)
        ]
    );
    assert_eq!(
        sim.nodes[1].dev.query_qp(b.qpn).unwrap().rq_psn,
        sender_psn + 3
    );
    assert_eq!(counters(&sim, 1).duplicates, 0);
}
