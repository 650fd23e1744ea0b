//! Which packets ask for ACKs, and when ACKs go: AckReq spacing, ACKs behind answers, busy QPs taking turns.

use super::*;

/// AckReq: on the last packet of a message, and on a middle packet whenever more than 64
/// packets went without it (digest §4.4): packets 65, 131 and 197 of a 200-packet WRITE, and
/// its last one, 199.
#[test]
fn ack_req_every_66th_packet_and_on_the_last() {
    let mut sim = Sim::new(27, 2, LinkConfig::default());
    let (a, _b) = connect(&mut sim, 0, 1, &ConnectOptions::default());
    let src = sim.nodes[0].alloc(200 * 1024, RW);
    let dst = sim.nodes[1].alloc(200 * 1024, RW);
    sim.trace = Some(Vec::new());
    sim.nodes[0]
        .post_send(
            a.qpn,
            SendWr::new(1, write_op(&dst, 0), vec![sge(&src, 0, 200 * 1024)]),
        )
        .unwrap();
    let sc = wait_cq(&mut sim, 0, a.send_cq, 1);
    settle(&mut sim);
    assert_eq!(ids_and_status(&sc), [(1, WcStatus::Success)]);
    assert_eq!(counters(&sim, 0).retransmissions, 0);
    let asked: Vec<usize> = ack_req_flags(&sim.trace.take().unwrap(), 0)
        .iter()
        .enumerate()
        .filter(|(_, ask)| **ask)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(asked, [65, 131, 197, 199]);
}

/// The AckReq bit of every packet node `from` sent, in order.
fn ack_req_flags(trace: &[(usize, Vec<u8>)], from: usize) -> Vec<bool> {
    trace
        .iter()
        .filter(|(node, _)| *node == from)
        .map(|(_, pkt)| bth_ack_req(pkt))
        .collect()
}

/// A burst of messages queued together asks for one ACK, on its last message (ACKs are
/// cumulative). (A message followed by one that fails its local checks still asks for its own:
/// `local_protection_errors_send_nothing` would see a retransmission otherwise.)
#[test]
fn ack_req_once_per_burst() {
    let mut sim = Sim::new(28, 2, LinkConfig::default());
    let (a, _b) = connect(&mut sim, 0, 1, &ConnectOptions::default());
    let src = sim.nodes[0].alloc(64 * 1024, RW);
    let dst = sim.nodes[1].alloc(64 * 1024, RW);
    sim.trace = Some(Vec::new());
    for i in 0..10u64 {
        let off = i * 1024;
        sim.nodes[0]
            .post_send(
                a.qpn,
                SendWr::new(i, write_op(&dst, off), vec![sge(&src, off, 1024)]),
            )
            .unwrap();
    }
    let sc = wait_cq(&mut sim, 0, a.send_cq, 10);
    settle(&mut sim);
    assert_eq!(sc.len(), 10);
    assert!(sc.iter().all(|w| w.status == WcStatus::Success));
    let trace = sim.trace.take().unwrap();
    let ack_req = ack_req_flags(&trace, 0);
    assert_eq!(ack_req.len(), 10);
    assert_eq!(ack_req.iter().filter(|r| **r).count(), 1, "{ack_req:?}");
    assert!(ack_req[9], "the last WRITE asks");
    let acks = trace.iter().filter(|(from, _)| *from == 1).count();
    assert_eq!(acks, 1, "one ACK for the burst");
    let c = counters(&sim, 0);
    assert_eq!((c.timeouts, c.retransmissions), (0, 0));
}

/// In a burst that signals only some of its WRs (perftest signals every 100th), a signalled WR
/// with unsignalled ones queued behind it asks for its ACK, and says so to the engine
/// (`completes_signaled`): its sender likely waits for that completion before it posts more,
/// so the ACK must not wait for the end of the burst. Where every WR is signalled the burst
/// still asks once (`ack_req_once_per_burst`).
#[test]
fn a_signalled_wr_among_unsignalled_ones_asks_for_its_ack() {
    let mut sim = Sim::new(29, 2, LinkConfig::default());
    let (a, _b) = connect(&mut sim, 0, 1, &ConnectOptions::default());
    let src = sim.nodes[0].alloc(64 * 1024, RW);
    let dst = sim.nodes[1].alloc(64 * 1024, RW);
    // WRs 4 and 9 signalled; 9 is the burst's last (it asks anyway).
    for i in 0..10u64 {
        let off = i * 1024;
        let mut wr = SendWr::new(i, write_op(&dst, off), vec![sge(&src, off, 1024)]);
        if i != 4 && i != 9 {
            wr.flags = SendFlags::NONE;
        }
        sim.nodes[0].post_send(a.qpn, wr).unwrap();
    }
    // Take the packets straight from the device, with what it says of each.
    let mut frame = vec![0u8; 9000];
    let mut sent = Vec::new();
    let node = &mut sim.nodes[0];
    while let Some(tx) = node.dev.poll_transmit(sim.now, &node.mem, &mut frame) {
        sent.push((bth_ack_req(&frame[..tx.len]), tx.completes_signaled));
    }
    assert_eq!(sent.len(), 10);
    let asked: Vec<usize> = (0..10).filter(|&i| sent[i].0).collect();
    assert_eq!(asked, [4, 9], "{sent:?}");
    let told: Vec<usize> = (0..10).filter(|&i| sent[i].1).collect();
    assert_eq!(told, [4], "the last has no WR behind it: {sent:?}");
}

/// A reply leaves ahead of the ACK for the message it answers, all of it: the peer is waiting
/// for the reply, and the ACK only frees a send-queue slot. The engine lets the application
/// see its receive completion before the ACK is sent, so in a ping-pong the two go out
/// together, and this order puts the whole reply first. (With the kinds taking turns packet
/// by packet, the ACK went out behind the reply's first packet; the peer, polling for that
/// ACK, took its completion and left its verbs before the rest arrived, and `ib_write_lat`
/// spinning on memory waited for its progress thread: 100-130 µs one-way at 8 KiB.) When a
/// QP has both kinds queued the kinds take turns of `TX_TURN_PACKETS`, so a stream of
/// requests does not hold its ACKs back for longer than a turn either.
#[test]
fn a_reply_goes_out_ahead_of_the_ack_for_the_message_it_answers() {
    let mut sim = Sim::new(31, 2, LinkConfig::default());
    let (a, b) = connect(&mut sim, 0, 1, &ConnectOptions::default());
    let a_buf = sim.nodes[0].alloc(4096, RW);
    let b_buf = sim.nodes[1].alloc(4096, RW);
    sim.nodes[0]
        .post_recv(a.qpn, recv_wr(1, &a_buf, 2048, 64))
        .unwrap();
    sim.nodes[1]
        .post_recv(b.qpn, recv_wr(1, &b_buf, 2048, 64))
        .unwrap();
    let mut buf = vec![0u8; 8192];

    // A's SEND reaches B; B has not transmitted since.
    sim.nodes[0]
        .post_send(
            a.qpn,
            SendWr::new(1, SendOp::Send, vec![sge(&a_buf, 0, 64)]),
        )
        .unwrap();
    let now = sim.now;
    let node = &mut sim.nodes[0];
    let t = node.dev.poll_transmit(now, &node.mem, &mut buf).unwrap();
    let send = buf[..t.len].to_vec();
    assert_eq!(bth_of(&send).0, Opcode::RC_SEND_ONLY);
    let node = &mut sim.nodes[1];
    node.dev.handle_packet(now, &send, &mut node.mem);
    assert_eq!(sim.nodes[1].poll(b.recv_cq).len(), 1);

    // B answers with a WRITE of three packets (path MTU 1024), and more requests than a turn
    // holds queue behind the answer.
    sim.nodes[1]
        .post_send(
            b.qpn,
            SendWr::new(10, write_op(&a_buf, 1024), vec![sge(&b_buf, 0, 3072)]),
        )
        .unwrap();
    let turn = TX_TURN_PACKETS as usize;
    let behind = turn;
    for i in 0..behind {
        sim.nodes[1]
            .post_send(
                b.qpn,
                SendWr::new(11 + i as u64, write_op(&a_buf, 0), vec![sge(&b_buf, 0, 64)]),
            )
            .unwrap();
    }
    let node = &mut sim.nodes[1];
    let mut order = Vec::new();
    while let Some(t) = node.dev.poll_transmit(now, &node.mem, &mut buf) {
        order.push(bth_of(&buf[..t.len]).0);
    }
    let mut expected = vec![
        Opcode::RC_RDMA_WRITE_FIRST,
        Opcode::RC_RDMA_WRITE_MIDDLE,
        Opcode::RC_RDMA_WRITE_LAST,
    ];
    // The turn goes on with the queue, the ACK starts the next one, the queue ends it.
    expected.extend(std::iter::repeat_n(Opcode::RC_RDMA_WRITE_ONLY, turn - 3));
    expected.push(Opcode::RC_ACKNOWLEDGE);
    expected.extend(std::iter::repeat_n(
        Opcode::RC_RDMA_WRITE_ONLY,
        behind - (turn - 3),
    ));
    assert_eq!(
        order, expected,
        "the whole answer first, then the rest of the turn, then the ACK, then the rest of the queue"
    );
}

/// `ack_only_requests` counts RC SEND and WRITE messages as their last packet arrives: the
/// engine holds the ACK for the application's answer from then on, and the application
/// cannot answer a message that is not whole. (Counting every packet started the wait at a
/// message's first packet; it ran out while the rest arrived, and the ACK left alone.) READ
/// requests, answered with data at once, do not count.
#[test]
fn ack_only_requests_count_messages_when_they_are_whole() {
    let mut sim = Sim::new(32, 2, LinkConfig::default());
    let (a, b) = connect(&mut sim, 0, 1, &ConnectOptions::default());
    let a_buf = sim.nodes[0].alloc(4096, RW);
    let b_buf = sim.nodes[1].alloc(4096, RW);
    sim.nodes[1]
        .post_recv(b.qpn, recv_wr(1, &b_buf, 0, 4096))
        .unwrap();
    // Three packets at path MTU 1024 each, then a READ.
    for (id, op) in [
        (1, write_op(&b_buf, 0)),
        (2, SendOp::Send),
        (3, read_op(&b_buf, 0)),
    ] {
        sim.nodes[0]
            .post_send(a.qpn, SendWr::new(id, op, vec![sge(&a_buf, 0, 3072)]))
            .unwrap();
    }
    let now = sim.now;
    let mut buf = vec![0u8; 8192];
    let mut seen = Vec::new();
    loop {
        let node = &mut sim.nodes[0];
        let Some(t) = node.dev.poll_transmit(now, &node.mem, &mut buf) else {
            break;
        };
        let node = &mut sim.nodes[1];
        node.dev.handle_packet(now, &buf[..t.len], &mut node.mem);
        seen.push((bth_of(&buf[..t.len]).0, node.dev.ack_only_requests()));
    }
    assert_eq!(
        seen,
        [
            (Opcode::RC_RDMA_WRITE_FIRST, 0),
            (Opcode::RC_RDMA_WRITE_MIDDLE, 0),
            (Opcode::RC_RDMA_WRITE_LAST, 1),
            (Opcode::RC_SEND_FIRST, 1),
            (Opcode::RC_SEND_MIDDLE, 1),
            (Opcode::RC_SEND_LAST, 2),
            (Opcode::RC_RDMA_READ_REQUEST, 2),
        ],
        "(packet, messages counted after it)"
    );
}

/// A message counts in `answers_awaiting_acks` when it reaches a QP that sent one message and
/// waits for its ACK (a ping-pong turn: the engine then holds the ACK for the answer longer);
/// not when the QP has nothing in flight, nor when it has several (a stream).
#[test]
fn answers_awaiting_acks_count_messages_that_reach_a_qp_waiting_for_its_one_ack() {
    let mut sim = Sim::new(33, 2, LinkConfig::default());
    let (a, b) = connect(&mut sim, 0, 1, &ConnectOptions::default());
    let a_buf = sim.nodes[0].alloc(4096, RW);
    let b_buf = sim.nodes[1].alloc(4096, RW);
    for (node, qpn, mr) in [(0, a.qpn, &a_buf), (1, b.qpn, &b_buf)] {
        for id in 0..4 {
            sim.nodes[node]
                .post_recv(qpn, recv_wr(id, mr, 64 * id, 64))
                .unwrap();
        }
    }
    let now = sim.now;
    let deliver = |sim: &mut Sim, to: usize, packet: &[u8]| {
        let node = &mut sim.nodes[to];
        node.dev.handle_packet(now, packet, &mut node.mem);
        (
            bth_of(packet).0,
            sim.nodes[0].dev.answers_awaiting_acks(),
            sim.nodes[1].dev.answers_awaiting_acks(),
        )
    };
    let send = |sim: &mut Sim, node: usize, qpn: u32, mr: &MemoryRegion, id: u64| {
        sim.nodes[node]
            .post_send(qpn, SendWr::new(id, SendOp::Send, vec![sge(mr, 0, 64)]))
            .unwrap();
    };
    let mut seen = Vec::new();
    // A's question reaches B, which has nothing in flight.
    send(&mut sim, 0, a.qpn, &a_buf, 1);
    for p in drain(&mut sim, 0, now) {
        seen.push(deliver(&mut sim, 1, &p));
    }
    // B's answer goes ahead of B's ACK, and reaches A waiting for that ACK.
    send(&mut sim, 1, b.qpn, &b_buf, 1);
    for p in drain(&mut sim, 1, now) {
        seen.push(deliver(&mut sim, 0, &p));
    }
    // A sends two messages (ahead of its ACK for B's): both reach B waiting for its one ACK.
    send(&mut sim, 0, a.qpn, &a_buf, 2);
    send(&mut sim, 0, a.qpn, &a_buf, 3);
    for p in drain(&mut sim, 0, now) {
        seen.push(deliver(&mut sim, 1, &p));
    }
    // B's two messages reach A, which has two in flight: a stream, not a turn.
    send(&mut sim, 1, b.qpn, &b_buf, 2);
    send(&mut sim, 1, b.qpn, &b_buf, 3);
    for p in drain(&mut sim, 1, now) {
        seen.push(deliver(&mut sim, 0, &p));
    }
    assert_eq!(
        seen,
        [
            (Opcode::RC_SEND_ONLY, 0, 0),
            (Opcode::RC_SEND_ONLY, 1, 0),
            (Opcode::RC_ACKNOWLEDGE, 1, 0),
            (Opcode::RC_SEND_ONLY, 1, 1),
            (Opcode::RC_SEND_ONLY, 1, 2),
            (Opcode::RC_ACKNOWLEDGE, 1, 2),
            (Opcode::RC_SEND_ONLY, 1, 2),
            (Opcode::RC_SEND_ONLY, 1, 2),
            (Opcode::RC_ACKNOWLEDGE, 1, 2),
        ],
        "(packet delivered, then A's and B's counts)"
    );
}

/// Next to many busy QPs a QP gets one packet per round of the device's round robin, so its
/// packets are spread out in time: it must still ask for ACKs often enough that its
/// retransmission timer never fires when nothing was lost. (64 packets between AckReqs took
/// longer than the timeout here: perftest `ib_write_bw -q 256` saw 8 000 such timeouts.)
#[test]
fn many_busy_qps_ask_for_acks_before_their_timers_fire() {
    const QPS: usize = 48;
    const WRITES: u64 = 8;
    const LEN: u32 = 16 * 1024;
    let link = LinkConfig {
        tx_burst: Some(64),
        ..LinkConfig::default()
    };
    let mut sim = Sim::new(29, 2, link);
    // timeout 8: 1 ms, while one round of all QPs' packets takes 48 × 1 KiB at 10 Gbit/s
    // = 42 µs, and 65 rounds take 2.7 ms.
    let o = ConnectOptions::default();
    let qps: Vec<QpEnd> = (0..QPS).map(|_| connect(&mut sim, 0, 1, &o).0).collect();
    let size = WRITES * u64::from(LEN);
    let src = sim.nodes[0].alloc(size as usize, RW);
    let dst = sim.nodes[1].alloc(size as usize, RW);
    for q in &qps {
        for i in 0..WRITES {
            let off = i * u64::from(LEN);
            sim.nodes[0]
                .post_send(
                    q.qpn,
                    SendWr::new(i, write_op(&dst, off), vec![sge(&src, off, LEN)]),
                )
                .unwrap();
        }
    }
    for q in &qps {
        let wcs = wait_cq(&mut sim, 0, q.send_cq, WRITES as usize);
        assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    }
    settle(&mut sim);
    let c = counters(&sim, 0);
    assert_eq!(c.tx_requests, QPS as u64 * WRITES * 16);
    assert_eq!((c.timeouts, c.retransmissions), (0, 0));
}

/// Busy QPs share the link in turns of `TX_TURN_PACKETS` packets: long enough that each turn
/// reads one stretch of one application buffer (with a packet per turn, 256 busy QPs made the
/// sender read and the receiver write a different buffer every packet, and bandwidth fell by a
/// quarter), short enough that every ready QP gets the link again soon.
#[test]
fn busy_qps_send_in_turns_of_several_packets() {
    const QPS: usize = 3;
    // 64 packets of 1 KiB per WRITE: four turns each.
    const LEN: u32 = 64 * 1024;
    let mut sim = Sim::new(30, 2, LinkConfig::default());
    let o = ConnectOptions::default();
    let pairs: Vec<(QpEnd, QpEnd)> = (0..QPS).map(|_| connect(&mut sim, 0, 1, &o)).collect();
    let src = sim.nodes[0].alloc(LEN as usize, RW);
    let dst = sim.nodes[1].alloc(QPS * LEN as usize, RW);
    sim.trace = Some(Vec::new());
    for (i, (a, _)) in pairs.iter().enumerate() {
        let off = i as u64 * u64::from(LEN);
        sim.nodes[0]
            .post_send(
                a.qpn,
                SendWr::new(i as u64, write_op(&dst, off), vec![sge(&src, 0, LEN)]),
            )
            .unwrap();
    }
    for (a, _) in &pairs {
        let wcs = wait_cq(&mut sim, 0, a.send_cq, 1);
        assert_eq!(ids_and_status(&wcs)[0].1, WcStatus::Success);
    }
    let trace = sim.trace.take().unwrap();
    // Runs of consecutive requests to the same destination QP, in the order they left.
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for (_, packet) in trace.iter().filter(|(from, _)| *from == 0) {
        let f = RoceFrame::parse_ip(packet).expect("a RoCEv2 packet");
        let qpn = f.headers.transport.bth.dest_qpn;
        match runs.last_mut() {
            Some((q, n)) if *q == qpn => *n += 1,
            _ => runs.push((qpn, 1)),
        }
    }
    let turn = TX_TURN_PACKETS;
    let expected: Vec<(u32, u32)> = (0..(64 / turn) as usize)
        .flat_map(|_| pairs.iter().map(move |(_, b)| (b.qpn, turn)))
        .collect();
    assert_eq!(
        runs, expected,
        "requests by destination QP (qpn, packets in a row)"
    );
    for (i, _) in pairs.iter().enumerate() {
        let at = i * LEN as usize;
        assert_eq!(
            &sim.nodes[1].bytes(&dst)[at..at + LEN as usize],
            sim.nodes[0].bytes(&src)
        );
    }
}
