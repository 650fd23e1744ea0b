//! Failures: a failed device, failed requests and the responses owed before them, requests
//! and READ responses too big for the transmit buffer, and error NAKs.

use super::*;

/// A failed device (its interface removed: `Device::fail`) flushes every QP: the SEND not yet
/// sent and the posted receive complete with WR_FLUSH_ERR, later posts too, nothing more goes
/// on the wire, and DEVICE_FATAL is raised once.
#[test]
fn a_failed_device_flushes_every_qp_and_raises_device_fatal_once() {
    let mut sim = Sim::new(9, 2, LinkConfig::default());
    let (a, _b) = connect(&mut sim, 0, 1, &ConnectOptions::default());
    let mr = sim.nodes[0].alloc(4096, Access::LOCAL_WRITE);
    let sge = Sge {
        addr: mr.va,
        length: 64,
        lkey: mr.lkey,
    };
    sim.nodes[0]
        .post_recv(
            a.qpn,
            RecvWr {
                wr_id: 5,
                sg_list: vec![sge].into(),
            },
        )
        .unwrap();
    sim.nodes[0]
        .post_send(a.qpn, SendWr::new(6, SendOp::Send, vec![sge]))
        .unwrap();
    let dev = &mut sim.nodes[0].dev;
    while dev.poll_event().is_some() {}
    dev.fail();
    dev.fail();
    let mut events = Vec::new();
    while let Some(e) = dev.poll_event() {
        events.push(e);
    }
    assert_eq!(
        events
            .iter()
            .filter(|e| **e == Event::Async(AsyncEvent::DeviceFatal))
            .count(),
        1,
        "{events:?}"
    );
    assert!(dev.failed());
    assert!(!dev.has_work(0), "a failed device has nothing to send");
    sim.nodes[0]
        .post_send(a.qpn, SendWr::new(7, SendOp::Send, vec![sge]))
        .unwrap();
    let sends: Vec<_> = sim.nodes[0]
        .poll(a.send_cq)
        .iter()
        .map(|wc| (wc.wr_id, wc.status))
        .collect();
    assert_eq!(
        sends,
        [(6, WcStatus::WrFlushErr), (7, WcStatus::WrFlushErr)]
    );
    let recvs: Vec<_> = sim.nodes[0]
        .poll(a.recv_cq)
        .iter()
        .map(|wc| (wc.wr_id, wc.status))
        .collect();
    assert_eq!(recvs, [(5, WcStatus::WrFlushErr)]);
    assert!(sim.run_idle(1_000_000_000));
    assert_eq!(
        sim.nodes[0].dev.counters().tx_requests,
        0,
        "the failed device sent its SEND after all"
    );
    // No QP comes back to post work that would never complete; receives of an SRQ (which
    // belong to no QP, so nothing would flush them) are refused too.
    let dev = &mut sim.nodes[0].dev;
    let to = |state| QpAttr {
        state,
        ..QpAttr::default()
    };
    dev.modify_qp(a.qpn, &to(QpState::Reset), AttrMask::STATE)
        .expect("a failed device's QP can be reset, to be destroyed");
    assert!(matches!(
        dev.modify_qp(a.qpn, &to(QpState::Init), AttrMask::STATE),
        Err(VerbsError::DeviceFailed)
    ));
    let pd = sim.nodes[0].pd;
    let dev = &mut sim.nodes[0].dev;
    let srq = dev.create_srq(pd, 16, 1).expect("create_srq");
    let refused = dev.post_srq_recv(
        srq,
        RecvWr {
            wr_id: 8,
            sg_list: vec![sge].into(),
        },
    );
    assert!(
        matches!(refused, Err(VerbsError::DeviceFailed)),
        "{refused:?}"
    );
    assert_eq!(VerbsError::DeviceFailed.errno(), 5, "EIO");
}

/// Node 0 posts `first` (an operation and its length, from `src`), then a WRITE with a bad
/// R_Key into `dst`; both requests reach node 1 in one receive batch, as the engine hands
/// them over. Returns the requests.
fn then_a_failing_write(
    sim: &mut Sim,
    a: QpEnd,
    (first, len): (SendOp, u32),
    src: &MemoryRegion,
    dst: &MemoryRegion,
) -> Vec<Vec<u8>> {
    sim.nodes[0]
        .post_send(a.qpn, SendWr::new(1, first, vec![sge(src, 0, len)]))
        .unwrap();
    let bad = SendOp::RdmaWrite {
        remote_addr: dst.va,
        rkey: dst.rkey ^ 1,
    };
    sim.nodes[0]
        .post_send(a.qpn, SendWr::new(2, bad, vec![sge(src, 4096, 64)]))
        .unwrap();
    let now = sim.now;
    let requests = drain(sim, 0, now);
    for p in &requests {
        let node = &mut sim.nodes[1];
        node.dev.handle_packet(now, p, &mut node.mem);
    }
    requests
}

/// A READ or an atomic, then in the same receive batch (as the engine hands them over) a
/// WRITE with a bad R_Key: the responder owes the READ response (or the atomic ACK) for the
/// earlier PSN and must send it ahead of the NAK, as rdma_rxe sends a READ response whole
/// before it looks at the next request. With the response dropped, the requester retried a
/// READ that the responder, now in ERROR, never answered: forever with `retry_cnt` 7; and an
/// atomic the responder executed was reported failed.
#[test]
fn responses_owed_before_a_failed_request_still_go_out() {
    for (what, retry_cnt) in [("read", 7), ("read", 2), ("fetch_add", 7)] {
        let mut sim = Sim::new(61, 2, LinkConfig::default());
        let opts = ConnectOptions {
            retry_cnt,
            ..ConnectOptions::default()
        };
        let (a, _b) = connect(&mut sim, 0, 1, &opts);
        let src = sim.nodes[0].alloc(8192, RW);
        let dst = sim.nodes[1].alloc(8192, RW);
        sim.nodes[1].bytes_mut(&dst)[..8].copy_from_slice(&5u64.to_ne_bytes());
        sim.nodes[1].bytes_mut(&dst)[64..64 + 4096].copy_from_slice(&pattern(4096, 3));
        let (first, len) = if what == "read" {
            (read_op(&dst, 64), 4096)
        } else {
            (fetch_add_op(&dst, 0, 1), 8)
        };
        let requests = then_a_failing_write(&mut sim, a, (first, len), &src, &dst);
        assert_eq!(requests.len(), 2, "{what}");
        let now = sim.now;
        let responses = drain(&mut sim, 1, now);
        let opcodes: Vec<Opcode> = responses.iter().map(|p| bth_of(p).0).collect();
        let owed = if what == "read" {
            Opcode::RC_RDMA_READ_RESPONSE_FIRST
        } else {
            Opcode::RC_ATOMIC_ACKNOWLEDGE
        };
        assert_eq!(opcodes.first(), Some(&owed), "{what}: {opcodes:?}");
        assert_eq!(
            opcodes.last(),
            Some(&Opcode::RC_ACKNOWLEDGE),
            "{what}: the NAK last: {opcodes:?}"
        );
        for p in &responses {
            let node = &mut sim.nodes[0];
            node.dev.handle_packet(now, p, &mut node.mem);
        }
        let done = wait_cq(&mut sim, 0, a.send_cq, 2);
        assert_eq!(
            ids_and_status(&done),
            [(1, WcStatus::Success), (2, WcStatus::RemAccessErr)],
            "{what} (retry_cnt {retry_cnt})"
        );
        if what == "read" {
            assert_eq!(&sim.nodes[0].bytes(&src)[..4096], &pattern(4096, 3)[..]);
        } else {
            assert_eq!(u64_at(sim.nodes[1].bytes(&dst), 0), 6);
            assert_eq!(u64_at(sim.nodes[0].bytes(&src), 0), 5);
        }
    }
}

/// A READ response owed before a failed request fails itself (the responder's region is
/// deregistered before it goes): its NAK is what the requester sees, not the later request's,
/// so the READ ends in REM_ACCESS_ERR rather than waiting to be resent.
#[test]
fn an_owed_read_response_that_fails_is_nacked_in_psn_order() {
    let mut sim = Sim::new(62, 2, LinkConfig::default());
    let (a, _b) = connect(&mut sim, 0, 1, &ConnectOptions::default());
    let src = sim.nodes[0].alloc(8192, RW);
    let dst = sim.nodes[1].alloc(8192, RW);
    let pd = sim.nodes[1].pd;
    let (doomed_id, doomed) = sim.nodes[1].dev.reg_mr(pd, dst.va, dst.len, RW).unwrap();
    let requests = then_a_failing_write(&mut sim, a, (read_op(&doomed, 0), 4096), &src, &dst);
    let read_psn = bth_of(&requests[0]).1;
    let write_psn = bth_of(&requests[1]).1;
    let now = sim.now;
    sim.nodes[1].dev.dereg_mr(doomed_id).unwrap();
    let responses = drain(&mut sim, 1, now);
    let naks: Vec<u32> = responses.iter().map(|p| bth_of(p).1).collect();
    assert_eq!(
        naks,
        [read_psn],
        "only the READ's NAK (not the WRITE's at {write_psn})"
    );
    for p in &responses {
        let node = &mut sim.nodes[0];
        node.dev.handle_packet(now, p, &mut node.mem);
    }
    let done = wait_cq(&mut sim, 0, a.send_cq, 2);
    assert_eq!(
        ids_and_status(&done),
        [(1, WcStatus::RemAccessErr), (2, WcStatus::WrFlushErr)]
    );
}

/// A request packet that cannot fit the requester's transmit buffer (a path MTU above what the
/// port's frames carry: 4096 on a kernel without AF_XDP multi-buffer) fails its work request
/// at once with a local QP operation error and is counted, instead of being left unsent; a
/// message that fits one buffer went out before it, and the device says how many did not fit.
#[test]
fn a_request_too_big_for_the_transmit_buffer_fails_its_work_request_and_is_counted() {
    let mut sim = Sim::new(72, 2, LinkConfig::default());
    let o = ConnectOptions {
        path_mtu: PathMtu::Mtu4096,
        ..ConnectOptions::default()
    };
    let (a, _b) = connect(&mut sim, 0, 1, &o);
    let a_buf = sim.nodes[0].alloc(8192, RW);
    let b_buf = sim.nodes[1].alloc(8192, RW);
    let write = |offset| SendOp::RdmaWrite {
        remote_addr: b_buf.va + offset,
        rkey: b_buf.rkey,
    };
    let wr = SendWr::new(1, write(0), vec![sge(&a_buf, 0, 1500)]);
    sim.nodes[0].post_send(a.qpn, wr).unwrap();
    let wr = SendWr::new(2, write(0), vec![sge(&a_buf, 0, 4096)]);
    sim.nodes[0].post_send(a.qpn, wr).unwrap();

    // Room for the headers and 2048 bytes of payload, not 4096.
    let now = sim.now;
    let mut small = vec![0u8; 2200];
    let node = &mut sim.nodes[0];
    let t = node
        .dev
        .poll_transmit(now, &node.mem, &mut small)
        .expect("the 1500-byte WRITE fits");
    assert_eq!(t.len, 1500 + 20 + 8 + 12 + 16 + 4);
    let first = small[..t.len].to_vec();
    assert!(node.dev.poll_transmit(now, &node.mem, &mut small).is_none());
    assert_eq!(node.dev.counters().tx_too_big_for_buffer, 1);

    // The first WRITE is acknowledged, and completes; the second fails after it.
    let node = &mut sim.nodes[1];
    node.dev.handle_packet(now, &first, &mut node.mem);
    assert!(sim.run_idle(1_000_000_000));
    let wc = sim.nodes[0].poll(a.send_cq);
    let got: Vec<_> = wc.iter().map(|c| (c.wr_id, c.status)).collect();
    assert_eq!(got, [(1, WcStatus::Success), (2, WcStatus::LocQpOpErr)]);
    assert_eq!(
        sim.nodes[0].dev.query_qp(a.qpn).unwrap().state,
        QpState::Error
    );
}

/// Two ends set up with different path MTUs (perftest takes each side's port MTU, so two
/// netdevs of different MTUs do this): the responder cuts a READ's response by its own MTU, so
/// the packets do not sit at the PSNs the requester gave the READ. The READ fails with
/// BAD_RESP_ERR at once. Before, a smaller responder MTU's MIDDLE packets fell beyond the
/// READ's PSNs and were dropped as strays, nothing was left outstanding for the retransmission
/// timer, and the READ waited forever; a larger one's ONLY packet completed it with the next
/// WQE's PSNs out of step.
#[test]
fn a_read_answered_at_another_path_mtu_fails_instead_of_waiting() {
    for (requester, responder) in [
        (PathMtu::Mtu4096, PathMtu::Mtu1024),
        (PathMtu::Mtu1024, PathMtu::Mtu4096),
    ] {
        let mut sim = Sim::new(83, 2, LinkConfig::default());
        let ro = ConnectOptions {
            path_mtu: requester,
            ..ConnectOptions::default()
        };
        let so = ConnectOptions {
            path_mtu: responder,
            ..ConnectOptions::default()
        };
        let a = create_qp(&mut sim, 0, &ro);
        let b = create_qp(&mut sim, 1, &so);
        bring_up(&mut sim, a, b, &ro, ro.psn.0, ro.psn.1);
        bring_up(&mut sim, b, a, &so, ro.psn.1, ro.psn.0);
        let local = sim.nodes[0].alloc(16384, RW);
        let remote = sim.nodes[1].alloc(16384, RW);
        sim.nodes[0]
            .post_send(
                a.qpn,
                SendWr::new(1, read_op(&remote, 0), vec![sge(&local, 0, 16384)]),
            )
            .unwrap();
        let sc = wait_cq(&mut sim, 0, a.send_cq, 1);
        assert_eq!(
            ids_and_status(&sc),
            [(1, WcStatus::BadRespErr)],
            "requester {requester:?}, responder {responder:?}"
        );
    }
}

/// rdma_rxe NAKs a failure in the midst of a READ's reply (its region deregistered after the
/// first packets went) at the READ request's PSN, behind where the responses that arrived moved
/// the requester. The NAK fails the READ at once with the NAK's status. Before, it was taken
/// as a stale duplicate and dropped, and the READ was retried against a QP in error until the
/// retries ran out (forever with `retry_cnt` 7).
#[test]
fn an_error_nak_behind_a_reads_arrived_responses_fails_it() {
    let mut sim = Sim::new(89, 2, LinkConfig::default());
    let (a, _b) = connect(&mut sim, 0, 1, &ConnectOptions::default());
    let src = sim.nodes[0].alloc(16384, RW);
    let dst = sim.nodes[1].alloc(16384, RW);

    // A WRITE's ACK, kept as the model of the NAK.
    sim.trace = Some(Vec::new());
    sim.nodes[0]
        .post_send(
            a.qpn,
            SendWr::new(1, write_op(&dst, 0), vec![sge(&src, 0, 64)]),
        )
        .unwrap();
    assert_eq!(
        wait_cq(&mut sim, 0, a.send_cq, 1)[0].status,
        WcStatus::Success
    );

    // A READ of eight packets whose reply stops after its FIRST packet.
    let lost = drop_matching(&mut sim, 1, 100, |op, _| {
        op == Opcode::RC_RDMA_READ_RESPONSE_MIDDLE || op == Opcode::RC_RDMA_READ_RESPONSE_LAST
    });
    sim.nodes[0]
        .post_send(
            a.qpn,
            SendWr::new(2, read_op(&dst, 0), vec![sge(&src, 0, 8192)]),
        )
        .unwrap();
    let data = pattern(1024, 89);
    sim.nodes[1].bytes_mut(&dst)[..1024].copy_from_slice(&data);
    // Until the FIRST packet's bytes have landed: the requester has moved past the READ
    // request's PSN.
    let landed = |sim: &mut Sim| sim.nodes[0].bytes(&src)[..1024] == data[..];
    sim.run_until(SEC, |sim| lost.get() == 7 && landed(sim));
    assert!(
        lost.get() == 7 && landed(&mut sim),
        "the reply was not cut after its FIRST packet"
    );
    let trace = sim.trace.take().unwrap();
    let ack = trace
        .iter()
        .find(|(from, p)| *from == 1 && bth_of(p).0 == Opcode::RC_ACKNOWLEDGE)
        .expect("the WRITE's ACK")
        .1
        .clone();
    let read_psn = trace
        .iter()
        .find(|(from, p)| *from == 0 && bth_of(p).0 == Opcode::RC_RDMA_READ_REQUEST)
        .map(|(_, p)| bth_of(p).1)
        .expect("the READ request");
    assert_eq!(counters(&sim, 0).timeouts, 0);

    // Syndrome 0x62: a remote access error NAK.
    let nak = ack_rewritten(&ack, read_psn, 0x62);
    let now = sim.now;
    let node = &mut sim.nodes[0];
    node.dev.handle_packet(now, &nak, &mut node.mem);
    let sc = wait_cq(&mut sim, 0, a.send_cq, 1);
    assert_eq!(ids_and_status(&sc), [(2, WcStatus::RemAccessErr)]);
    let c = counters(&sim, 0);
    assert_eq!((c.error_naks_received, c.timeouts), (1, 0));
}

/// A READ response that cannot fit the responder's transmit buffer (a path MTU above what the
/// port's frames carry: 4096 on a kernel without AF_XDP multi-buffer) is a remote operational
/// error, NAKed at once, not a response left at the head of the queue, where it held up
/// every later response of the QP for good.
#[test]
fn a_read_response_too_big_for_the_transmit_buffer_is_naked_not_stuck() {
    let mut sim = Sim::new(71, 2, LinkConfig::default());
    let o = ConnectOptions {
        path_mtu: PathMtu::Mtu4096,
        ..ConnectOptions::default()
    };
    let (a, b) = connect(&mut sim, 0, 1, &o);
    let a_buf = sim.nodes[0].alloc(4096, RW);
    let b_buf = sim.nodes[1].alloc(4096, RW);
    sim.nodes[0]
        .post_send(
            a.qpn,
            SendWr::new(7, read_op(&b_buf, 0), vec![sge(&a_buf, 0, 4096)]),
        )
        .unwrap();
    let now = sim.now;
    let mut big = vec![0u8; 8192];
    let node = &mut sim.nodes[0];
    let t = node.dev.poll_transmit(now, &node.mem, &mut big).unwrap();
    let request = big[..t.len].to_vec();
    let node = &mut sim.nodes[1];
    node.dev.handle_packet(now, &request, &mut node.mem);

    // Room for the headers and 2048 bytes of payload, not 4096.
    let mut small = vec![0u8; 2200];
    let node = &mut sim.nodes[1];
    let t = node
        .dev
        .poll_transmit(now, &node.mem, &mut small)
        .expect("the NAK goes instead of the response");
    let nak = small[..t.len].to_vec();
    let f = RoceFrame::parse_ip(&nak).unwrap();
    assert_eq!(f.headers.transport.bth.opcode, Opcode::RC_ACKNOWLEDGE);
    assert_eq!(
        f.headers.transport.aeth.map(|a| a.syndrome),
        Some(AethSyndrome::Nak(NakCode::RemoteOperationalError))
    );
    assert!(node.dev.poll_transmit(now, &node.mem, &mut small).is_none());
    assert_eq!(node.dev.query_qp(b.qpn).unwrap().state, QpState::Error);
    assert_eq!(node.dev.counters().tx_too_big_for_buffer, 1);

    // The requester learns it as a remote operational error.
    let node = &mut sim.nodes[0];
    node.dev.handle_packet(now, &nak, &mut node.mem);
    let wc = sim.nodes[0].poll(a.send_cq);
    assert_eq!(wc.len(), 1);
    assert_eq!((wc[0].wr_id, wc[0].status), (7, WcStatus::RemOpErr));
}
