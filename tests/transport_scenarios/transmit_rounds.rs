//! How the transmit round takes QPs: mid-message holds, `has_work`, and QPs joining and
//! leaving the transmit list.

use super::*;

/// `mid_message` tells whether the newest packet to reach a QP leaves its message unfinished
/// (the engine's progress thread then waits awake for the rest): true after the first and
/// middle packets of a WRITE and of a READ response, false after their last packets, after an
/// ACK, and after a READ request.
#[test]
fn mid_message_holds_between_the_first_and_the_last_packet_of_a_message() {
    let mut sim = Sim::new(34, 2, LinkConfig::default());
    let (a, _b) = connect(&mut sim, 0, 1, &ConnectOptions::default());
    let a_buf = sim.nodes[0].alloc(4096, RW);
    let b_buf = sim.nodes[1].alloc(4096, RW);
    let now = sim.now;
    let mut seen = Vec::new();
    let mut exchange = |sim: &mut Sim, from: usize| {
        let to = 1 - from;
        for p in drain(sim, from, now) {
            let node = &mut sim.nodes[to];
            node.dev.handle_packet(now, &p, &mut node.mem);
            seen.push((bth_of(&p).0, node.dev.mid_message()));
        }
    };
    // A WRITE of three packets (path MTU 1024) from A, and B's ACK.
    sim.nodes[0]
        .post_send(
            a.qpn,
            SendWr::new(1, write_op(&b_buf, 0), vec![sge(&a_buf, 0, 3000)]),
        )
        .unwrap();
    exchange(&mut sim, 0);
    exchange(&mut sim, 1);
    // A READ of three packets: the request to B, the response to A.
    sim.nodes[0]
        .post_send(
            a.qpn,
            SendWr::new(2, read_op(&b_buf, 0), vec![sge(&a_buf, 0, 3000)]),
        )
        .unwrap();
    exchange(&mut sim, 0);
    exchange(&mut sim, 1);
    assert_eq!(
        seen,
        [
            (Opcode::RC_RDMA_WRITE_FIRST, true),
            (Opcode::RC_RDMA_WRITE_MIDDLE, true),
            (Opcode::RC_RDMA_WRITE_LAST, false),
            (Opcode::RC_ACKNOWLEDGE, false),
            (Opcode::RC_RDMA_READ_REQUEST, false),
            (Opcode::RC_RDMA_READ_RESPONSE_FIRST, true),
            (Opcode::RC_RDMA_READ_RESPONSE_MIDDLE, true),
            (Opcode::RC_RDMA_READ_RESPONSE_LAST, false),
        ],
        "(packet delivered, then the receiver's mid_message)"
    );
}

/// Node 0 of a two-node simulation with an RC QP connected to node 1 and 4 KiB of memory,
/// after the transmit round that bringing the QP up queued (it finds nothing to send).
fn idle_connected_sender(seed: u64) -> (Sim, QpEnd, MemoryRegion) {
    let mut sim = Sim::new(seed, 2, LinkConfig::default());
    let (a, _b) = connect(&mut sim, 0, 1, &ConnectOptions::default());
    let src = sim.nodes[0].alloc(4096, RW);
    let now = sim.now;
    let node = &mut sim.nodes[0];
    assert!(node
        .dev
        .poll_transmit(now, &node.mem, &mut [0u8; 16384])
        .is_none());
    (sim, a, src)
}

/// `Device::has_work` is what lets a polling application skip the transmit round: it must be
/// true whenever a round would do something (a packet to send, a timer due), and false once a
/// round found nothing to do and nothing came since.
#[test]
fn has_work_is_true_whenever_a_round_would_do_something() {
    let (mut sim, a, src) = idle_connected_sender(65);
    let now = sim.now;
    let node = &mut sim.nodes[0];
    let mut buf = vec![0u8; 16384];
    assert!(!node.dev.has_work(now), "a connected, idle device");
    node.post_send(a.qpn, SendWr::new(1, SendOp::Send, vec![sge(&src, 0, 64)]))
        .unwrap();
    assert!(node.dev.has_work(now), "a posted SEND waits to go");
    assert!(node.dev.poll_transmit(now, &node.mem, &mut buf).is_some());
    assert!(node.dev.poll_transmit(now, &node.mem, &mut buf).is_none());
    // Sent and unacknowledged: only the retransmission timer is left.
    assert!(!node.dev.has_work(now), "nothing to send, no timer due");
    let due = node
        .dev
        .poll_timeout()
        .expect("the retransmission timer runs");
    assert!(!node.dev.has_work(due - 1));
    assert!(node.dev.has_work(due), "the timer is due");
    assert!(node.dev.handle_timeout(due));
    assert!(node.dev.has_work(due), "the retransmission waits to go");
    assert!(node.dev.poll_transmit(due, &node.mem, &mut buf).is_some());
}

/// A QP leaves the transmit list with its last packet, so that the engine can tell the round
/// is over (`transmit_queued`) without a call that finds nothing. Only when nothing is left:
/// a message's later packets and a second message keep it listed, an ACK owed lists the
/// responder, and a UD send still completes as its packet goes.
#[test]
fn a_qp_leaves_the_transmit_list_with_its_last_packet_and_not_before() {
    let (mut sim, a, src) = idle_connected_sender(67);
    let now = sim.now;
    let mut buf = vec![0u8; 16384];
    {
        let node = &mut sim.nodes[0];
        // One packet: listed until it is built, not after.
        node.post_send(a.qpn, SendWr::new(1, SendOp::Send, vec![sge(&src, 0, 64)]))
            .unwrap();
        assert!(node.dev.transmit_queued());
        assert!(node.dev.poll_transmit(now, &node.mem, &mut buf).is_some());
        assert!(!node.dev.transmit_queued(), "its only packet went");
        // Two packets of one message (path MTU 1024), then a second message.
        node.post_send(
            a.qpn,
            SendWr::new(2, SendOp::Send, vec![sge(&src, 0, 2000)]),
        )
        .unwrap();
        node.post_send(a.qpn, SendWr::new(3, SendOp::Send, vec![sge(&src, 0, 64)]))
            .unwrap();
        for left in ["the message's second packet", "the second message"] {
            assert!(node.dev.poll_transmit(now, &node.mem, &mut buf).is_some());
            assert!(node.dev.transmit_queued(), "{left} is still to go");
        }
        assert!(node.dev.poll_transmit(now, &node.mem, &mut buf).is_some());
        assert!(!node.dev.transmit_queued());
        assert!(node.dev.poll_transmit(now, &node.mem, &mut buf).is_none());
    }
    // The responder: listed for the ACK it owes until that is built.
    let mut sim = Sim::new(69, 2, LinkConfig::default());
    let (a, b) = connect(&mut sim, 0, 1, &ConnectOptions::default());
    let src = sim.nodes[0].alloc(4096, RW);
    let dst = sim.nodes[1].alloc(4096, RW);
    let now = sim.now;
    for node in &mut sim.nodes {
        // Connecting listed both QPs; nothing is left to send.
        assert!(node.dev.poll_transmit(now, &node.mem, &mut buf).is_none());
        assert!(!node.dev.transmit_queued());
    }
    sim.nodes[1]
        .post_recv(b.qpn, recv_wr(5, &dst, 0, 64))
        .unwrap();
    let carry = |sim: &mut Sim, from: usize, buf: &mut [u8]| {
        let node = &mut sim.nodes[from];
        let len = node
            .dev
            .poll_transmit(now, &node.mem, buf)
            .expect("a packet")
            .len;
        let peer = &mut sim.nodes[1 - from];
        peer.dev.handle_packet(now, &buf[..len], &mut peer.mem);
    };
    sim.nodes[0]
        .post_send(a.qpn, SendWr::new(6, SendOp::Send, vec![sge(&src, 0, 64)]))
        .unwrap();
    carry(&mut sim, 0, &mut buf);
    let peer = &mut sim.nodes[1];
    assert!(peer.dev.transmit_queued(), "an ACK is owed");
    assert!(peer.dev.poll_transmit(now, &peer.mem, &mut buf).is_some());
    assert!(!peer.dev.transmit_queued(), "the ACK went");
    // A READ of two packets' worth: the responder stays listed between its responses.
    sim.nodes[0]
        .post_send(
            a.qpn,
            SendWr::new(
                7,
                SendOp::RdmaRead {
                    remote_addr: dst.va,
                    rkey: dst.rkey,
                },
                vec![sge(&src, 0, 2000)],
            ),
        )
        .unwrap();
    carry(&mut sim, 0, &mut buf);
    let peer = &mut sim.nodes[1];
    assert!(peer.dev.poll_transmit(now, &peer.mem, &mut buf).is_some());
    assert!(
        peer.dev.transmit_queued(),
        "the second response is still to go"
    );
    assert!(peer.dev.poll_transmit(now, &peer.mem, &mut buf).is_some());
    assert!(!peer.dev.transmit_queued(), "both responses went");

    // UD: a send completes as its packet is built, and no call after it is needed for that.
    let mut sim = Sim::new(68, 2, LinkConfig::default());
    let (u, v, ah) = ud_pair(&mut sim);
    let src = sim.nodes[0].alloc(4096, RW);
    let now = sim.now;
    let node = &mut sim.nodes[0];
    node.post_send(u.qpn, ud_send(4, ah, v, QKEY, sge(&src, 0, 64)))
        .unwrap();
    assert!(node.dev.poll_transmit(now, &node.mem, &mut buf).is_some());
    assert!(!node.dev.transmit_queued());
    assert_eq!(
        ids_and_status(&node.poll(u.send_cq)),
        [(4, WcStatus::Success)]
    );
}

/// A QP destroyed while it waits to send leaves nothing behind for the transmit round.
#[test]
fn a_destroyed_qp_leaves_the_transmit_round_at_once() {
    let (mut sim, a, src) = idle_connected_sender(66);
    let now = sim.now;
    let node = &mut sim.nodes[0];
    let mut buf = vec![0u8; 16384];
    node.post_send(a.qpn, SendWr::new(1, SendOp::Send, vec![sge(&src, 0, 64)]))
        .unwrap();
    assert!(node.dev.has_work(now), "a posted SEND waits to go");
    node.dev.destroy_qp(a.qpn).unwrap();
    assert!(
        !node.dev.has_work(now),
        "the destroyed QP is no longer listed"
    );
    assert!(node.dev.poll_transmit(now, &node.mem, &mut buf).is_none());
}
