//! UC: a lost packet drops its message and the next message is taken.

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
