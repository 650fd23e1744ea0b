//! SRQs, fences, signalling and verbs errors.

use super::*;

/// Two QPs drawing from one SRQ: each message takes the oldest SRQ WQE whichever QP it arrives
/// on; the armed limit fires once when the count drops below it, then disarms. A QP on an SRQ
/// refuses post_recv, and going to ERROR raises LAST_WQE_REACHED without flushing the SRQ.
#[test]
fn srq_feeds_two_qps_and_raises_its_limit_event_once() {
    let mut sim = Sim::new(91, 2, LinkConfig::default());
    let o = ConnectOptions::default();
    let pd = sim.nodes[1].pd;
    let srq = sim.nodes[1].dev.create_srq(pd, 16, 2).unwrap();
    let a1 = create_qp_with(&mut sim, 0, &o, 64, 64, None);
    let a2 = create_qp_with(&mut sim, 0, &o, 64, 64, None);
    let b1 = create_qp_with(&mut sim, 1, &o, 64, 64, Some(srq));
    let b2 = create_qp_with(&mut sim, 1, &o, 64, 64, Some(srq));
    for (x, y) in [(a1, b1), (a2, b2)] {
        bring_up(&mut sim, x, y, &o, o.psn.0, o.psn.1);
        bring_up(&mut sim, y, x, &o, o.psn.1, o.psn.0);
    }
    let src = sim.nodes[0].alloc(4096, RW);
    let dst = sim.nodes[1].alloc(8192, RW);
    for i in 0..4u64 {
        sim.nodes[1]
            .dev
            .post_srq_recv(srq, recv_wr(100 + i, &dst, i * 1024, 1024))
            .unwrap();
    }
    sim.nodes[1].dev.modify_srq_limit(srq, 3).unwrap();
    assert!(matches!(
        sim.nodes[1].post_recv(b1.qpn, recv_wr(1, &dst, 0, 8)),
        Err(VerbsError::Invalid(_))
    ));
    assert!(matches!(
        sim.nodes[1].dev.destroy_srq(srq),
        Err(VerbsError::Busy(_))
    ));

    let msgs = [(a1, b1, 0u64), (a2, b2, 1), (a1, b1, 2)];
    for (i, &(from, to, n)) in msgs.iter().enumerate() {
        let data = pattern(200, n as u8);
        sim.nodes[0].bytes_mut(&src)[..200].copy_from_slice(&data);
        sim.nodes[0]
            .post_send(
                from.qpn,
                SendWr::new(n, SendOp::Send, vec![sge(&src, 0, 200)]),
            )
            .unwrap();
        settle(&mut sim);
        let rc = sim.nodes[1].poll(to.recv_cq);
        assert_eq!(
            ids_and_status(&rc),
            [(100 + n, WcStatus::Success)],
            "msg {i}"
        );
        assert_eq!(rc[0].qp_num, to.qpn);
        let off = (n * 1024) as usize;
        assert_eq!(&sim.nodes[1].bytes(&dst)[off..off + 200], &data[..]);
    }
    // 4 posted, 3 taken: the second take left 2 < 3.
    assert_eq!(
        events(&mut sim, 1),
        [Event::Async(AsyncEvent::SrqLimitReached(srq))]
    );
    let s = sim.nodes[1].dev.srq(srq).unwrap();
    assert_eq!(
        (s.len(), s.limit()),
        (1, 0),
        "the limit disarms after firing"
    );

    // b1 to ERROR: LAST_WQE_REACHED, and the SRQ's WQE stays for b2.
    let attr = QpAttr {
        state: QpState::Error,
        ..QpAttr::default()
    };
    sim.nodes[1]
        .dev
        .modify_qp(b1.qpn, &attr, AttrMask::STATE)
        .unwrap();
    assert_eq!(
        events(&mut sim, 1),
        [Event::Async(AsyncEvent::QpLastWqeReached(b1.qpn))]
    );
    assert_eq!(sim.nodes[1].dev.srq(srq).unwrap().len(), 1);
    assert_eq!(cq_len(&sim, 1, b1.recv_cq), 0, "SRQ WQEs are not flushed");
    sim.nodes[0]
        .post_send(a2.qpn, SendWr::new(3, SendOp::Send, vec![sge(&src, 0, 10)]))
        .unwrap();
    settle(&mut sim);
    assert_eq!(
        ids_and_status(&sim.nodes[1].poll(b2.recv_cq)),
        [(103, WcStatus::Success)]
    );
}

/// Position in the trace of the first packet from `from` with opcode `op`.
fn first_index(trace: &[(usize, Vec<u8>)], from: usize, op: Opcode) -> usize {
    trace
        .iter()
        .position(|(n, p)| *n == from && bth_of(p).0 == op)
        .unwrap_or_else(|| panic!("no {op:?} from node {from} in the trace"))
}

/// A fenced WR waits until every earlier READ has completed: its packet goes out only after the
/// READ's last response. Without the fence it goes out right behind the READ request.
#[test]
fn fence_holds_a_wr_until_earlier_reads_complete() {
    for fence in [false, true] {
        let mut sim = Sim::new(92, 2, LinkConfig::default());
        let (a, _b) = connect(&mut sim, 0, 1, &ConnectOptions::default());
        let local = sim.nodes[0].alloc(8192, RW);
        let remote = sim.nodes[1].alloc(8192, RW);
        sim.trace = Some(Vec::new());
        sim.nodes[0]
            .post_send(
                a.qpn,
                SendWr::new(1, read_op(&remote, 0), vec![sge(&local, 0, 4000)]),
            )
            .unwrap();
        let mut wr = SendWr::new(2, write_op(&remote, 4096), vec![sge(&local, 4096, 100)]);
        if fence {
            wr.flags = SendFlags::SIGNALED | SendFlags::FENCE;
        }
        sim.nodes[0].post_send(a.qpn, wr).unwrap();
        let sc = wait_cq(&mut sim, 0, a.send_cq, 2);
        settle(&mut sim);
        assert_eq!(
            ids_and_status(&sc),
            [(1, WcStatus::Success), (2, WcStatus::Success)]
        );
        let trace = sim.trace.take().unwrap();
        let write = first_index(&trace, 0, Opcode::RC_RDMA_WRITE_ONLY);
        let first_resp = first_index(&trace, 1, Opcode::RC_RDMA_READ_RESPONSE_FIRST);
        let last_resp = first_index(&trace, 1, Opcode::RC_RDMA_READ_RESPONSE_LAST);
        if fence {
            assert!(
                write > last_resp,
                "fenced WRITE went out before the READ completed"
            );
        } else {
            assert!(write < first_resp, "an unfenced WRITE need not wait");
        }
    }
}

/// Unsignalled WRs complete silently when they succeed, but an error always produces a
/// completion; `sq_sig_all` signals everything.
#[test]
fn unsignalled_wrs_complete_silently_but_errors_always_report() {
    for sig_all in [false, true] {
        let mut sim = Sim::new(93, 2, LinkConfig::default());
        let o = ConnectOptions {
            sq_sig_all: sig_all,
            ..ConnectOptions::default()
        };
        let (a, _b) = connect(&mut sim, 0, 1, &o);
        let src = sim.nodes[0].alloc(4096, RW);
        let dst = sim.nodes[1].alloc(4096, RW);
        let mut quiet = SendWr::new(1, write_op(&dst, 0), vec![sge(&src, 0, 100)]);
        quiet.flags = SendFlags::NONE;
        sim.nodes[0].post_send(a.qpn, quiet.clone()).unwrap();
        sim.nodes[0]
            .post_send(
                a.qpn,
                SendWr::new(2, write_op(&dst, 200), vec![sge(&src, 0, 100)]),
            )
            .unwrap();
        let mut bad = quiet;
        bad.wr_id = 3;
        bad.op = SendOp::RdmaWrite {
            remote_addr: dst.va,
            rkey: dst.rkey ^ 1,
        };
        sim.nodes[0].post_send(a.qpn, bad).unwrap();
        settle(&mut sim);
        let sc = sim.nodes[0].poll(a.send_cq);
        let want: &[(u64, WcStatus)] = if sig_all {
            &[
                (1, WcStatus::Success),
                (2, WcStatus::Success),
                (3, WcStatus::RemAccessErr),
            ]
        } else {
            &[(2, WcStatus::Success), (3, WcStatus::RemAccessErr)]
        };
        assert_eq!(ids_and_status(&sc), want, "sq_sig_all {sig_all}");
    }
}

/// The initiator depth (`max_rd_atomic`) bounds READs in flight: with 1, the second READ's
/// request waits for the first READ's last response; with 2 both go out at once.
#[test]
fn initiator_depth_limits_reads_in_flight() {
    for depth in [1u8, 2] {
        let mut sim = Sim::new(96, 2, LinkConfig::default());
        let o = ConnectOptions {
            max_rd_atomic: depth,
            ..ConnectOptions::default()
        };
        let (a, _b) = connect(&mut sim, 0, 1, &o);
        let local = sim.nodes[0].alloc(8192, RW);
        let remote = sim.nodes[1].alloc(8192, RW);
        let data = pattern(4000, 96);
        sim.nodes[1].bytes_mut(&remote)[..4000].copy_from_slice(&data);
        sim.trace = Some(Vec::new());
        for id in 0..2u64 {
            sim.nodes[0]
                .post_send(
                    a.qpn,
                    SendWr::new(
                        id,
                        read_op(&remote, id * 2000),
                        vec![sge(&local, id * 2000, 2000)],
                    ),
                )
                .unwrap();
        }
        let sc = wait_cq(&mut sim, 0, a.send_cq, 2);
        settle(&mut sim);
        assert_eq!(
            ids_and_status(&sc),
            [(0, WcStatus::Success), (1, WcStatus::Success)]
        );
        assert_eq!(&sim.nodes[0].bytes(&local)[..4000], &data[..]);
        let trace = sim.trace.take().unwrap();
        let reads: Vec<usize> = trace
            .iter()
            .enumerate()
            .filter(|(_, (n, p))| *n == 0 && bth_of(p).0 == Opcode::RC_RDMA_READ_REQUEST)
            .map(|(i, _)| i)
            .collect();
        assert_eq!(reads.len(), 2);
        let first_last = first_index(&trace, 1, Opcode::RC_RDMA_READ_RESPONSE_LAST);
        if depth == 1 {
            assert!(reads[1] > first_last, "depth 1: the second READ waited");
        } else {
            assert!(reads[1] < first_last, "depth 2: no wait");
        }
    }
}

/// SQD: WQEs already started complete, new ones are held, SQ_DRAINED is raised once the
/// started ones are done, leaving SQD is refused while draining, and back in RTS the held WQEs
/// go.
#[test]
fn sqd_drains_started_work_and_holds_the_rest() {
    let mut sim = Sim::new(97, 2, LinkConfig::default());
    let (a, _b) = connect(&mut sim, 0, 1, &ConnectOptions::default());
    let src = sim.nodes[0].alloc(4096, RW);
    let dst = sim.nodes[1].alloc(8192, RW);
    sim.nodes[0]
        .post_send(
            a.qpn,
            SendWr::new(1, write_op(&dst, 0), vec![sge(&src, 0, 3000)]),
        )
        .unwrap();
    sim.transmit_all(); // WQE 1 is on the wire
    sim.nodes[0]
        .post_send(
            a.qpn,
            SendWr::new(2, write_op(&dst, 4096), vec![sge(&src, 0, 100)]),
        )
        .unwrap();
    let sqd = QpAttr {
        state: QpState::Sqd,
        en_sqd_async_notify: true,
        ..QpAttr::default()
    };
    let dev = &mut sim.nodes[0].dev;
    dev.modify_qp(a.qpn, &sqd, AttrMask::STATE | AttrMask::EN_SQD_ASYNC_NOTIFY)
        .unwrap();
    let rts = QpAttr {
        state: QpState::Rts,
        ..QpAttr::default()
    };
    assert!(
        dev.modify_qp(a.qpn, &rts, AttrMask::STATE).is_err(),
        "SQD → RTS while draining"
    );
    assert!(
        dev.modify_qp(a.qpn, &sqd, AttrMask::STATE).is_err(),
        "SQD → SQD while draining"
    );
    assert_eq!(events(&mut sim, 0), []);
    settle(&mut sim);
    assert_eq!(
        ids_and_status(&sim.nodes[0].poll(a.send_cq)),
        [(1, WcStatus::Success)]
    );
    assert_eq!(
        events(&mut sim, 0),
        [Event::Async(AsyncEvent::SqDrained(a.qpn))]
    );
    assert_eq!(counters(&sim, 0).tx_requests, 3, "WQE 2 held back");
    assert_eq!(state(&sim, a), QpState::Sqd);
    back_to_rts_sends_the_held_wqe(&mut sim, a, 2);
}

/// post_send before RTS is refused, and nothing refused is sent later.
#[test]
fn post_send_before_rts_is_refused() {
    let mut sim = Sim::new(94, 2, LinkConfig::default());
    let o = ConnectOptions::default();
    let a = create_qp(&mut sim, 0, &o);
    let b = create_qp(&mut sim, 1, &o);
    let src = sim.nodes[0].alloc(4096, RW);
    let wr = || SendWr::new(1, SendOp::Send, vec![sge(&src, 0, 10)]);
    let refused = |r: Result<(), VerbsError>| matches!(r, Err(VerbsError::Invalid(_)));
    assert!(refused(sim.nodes[0].post_send(a.qpn, wr())), "RESET");
    assert!(
        refused(sim.nodes[0].post_recv(a.qpn, recv_wr(1, &src, 0, 10))),
        "post_recv in RESET"
    );
    let init = QpAttr {
        state: QpState::Init,
        port_num: 1,
        access: RW,
        ..QpAttr::default()
    };
    let init_mask =
        AttrMask::STATE | AttrMask::PKEY_INDEX | AttrMask::PORT | AttrMask::ACCESS_FLAGS;
    sim.nodes[0].dev.modify_qp(a.qpn, &init, init_mask).unwrap();
    assert!(refused(sim.nodes[0].post_send(a.qpn, wr())), "INIT");
    // Receives may be posted from INIT on.
    sim.nodes[0]
        .post_recv(a.qpn, recv_wr(1, &src, 0, 10))
        .unwrap();
    // bring_up goes INIT again: from RESET only, so reset first.
    let reset = QpAttr::default();
    sim.nodes[0]
        .dev
        .modify_qp(a.qpn, &reset, AttrMask::STATE)
        .unwrap();
    bring_up(&mut sim, a, b, &o, o.psn.0, o.psn.1);
    settle(&mut sim);
    assert_eq!(counters(&sim, 0).tx_requests, 0, "refused WRs stay refused");
    assert_eq!(cq_len(&sim, 0, a.send_cq), 0);
}

/// modify_qp with a bad value or mask is refused as a whole: the QP keeps its state and every
/// attribute, including the valid ones the same call carried.
#[test]
fn modify_qp_with_bad_attributes_leaves_the_qp_unchanged() {
    let mut sim = Sim::new(95, 2, LinkConfig::default());
    let o = ConnectOptions::default();
    let a = create_qp(&mut sim, 0, &o);
    let peer_ip = sim.nodes[1].ip;
    let dev = &mut sim.nodes[0].dev;
    let check_refused =
        |dev: &mut xroce_core::transport::Device, attr: &QpAttr, mask: AttrMask, what: &str| {
            let before = dev.query_qp(a.qpn).unwrap();
            let r = dev.modify_qp(a.qpn, attr, mask);
            assert!(r.is_err(), "{what}: accepted");
            assert_eq!(r.unwrap_err().errno(), 22, "{what}: EINVAL");
            assert_eq!(dev.query_qp(a.qpn).unwrap(), before, "{what}: QP changed");
        };
    let init_mask =
        AttrMask::STATE | AttrMask::PKEY_INDEX | AttrMask::PORT | AttrMask::ACCESS_FLAGS;
    let mut attr = QpAttr {
        state: QpState::Init,
        port_num: 2,
        access: RW,
        ..QpAttr::default()
    };
    check_refused(dev, &attr, init_mask, "port 2");
    attr.port_num = 1;
    dev.modify_qp(a.qpn, &attr, init_mask).unwrap();

    attr.state = QpState::Rtr;
    attr.path_mtu = PathMtu::Mtu1024;
    attr.dest_qpn = 0x42;
    attr.rq_psn = 0x77;
    attr.max_dest_rd_atomic = 4;
    attr.min_rnr_timer = 12;
    attr.av = Some(AddressVector {
        dgid: peer_ip,
        sgid_index: 0,
        traffic_class: 0,
        hop_limit: 64,
        flow_label: 0,
    });
    let rtr_mask = AttrMask::STATE
        | AttrMask::AV
        | AttrMask::PATH_MTU
        | AttrMask::DEST_QPN
        | AttrMask::RQ_PSN
        | AttrMask::MAX_DEST_RD_ATOMIC
        | AttrMask::MIN_RNR_TIMER;
    check_refused(dev, &attr, rtr_mask.without(AttrMask::AV), "RTR without AV");
    let mut bad_av = attr;
    bad_av.av = bad_av.av.map(|av| AddressVector {
        sgid_index: 3,
        ..av
    });
    check_refused(dev, &bad_av, rtr_mask, "sgid_index naming no GID");
    dev.modify_qp(a.qpn, &attr, rtr_mask).unwrap();

    attr.state = QpState::Rts;
    attr.sq_psn = 0x1234;
    attr.timeout = 32;
    attr.retry_cnt = 7;
    attr.rnr_retry = 7;
    attr.max_rd_atomic = 4;
    attr.min_rnr_timer = 20; // valid, but part of a refused call
    let rts_mask = AttrMask::STATE
        | AttrMask::SQ_PSN
        | AttrMask::TIMEOUT
        | AttrMask::RETRY_CNT
        | AttrMask::RNR_RETRY
        | AttrMask::MAX_QP_RD_ATOMIC
        | AttrMask::MIN_RNR_TIMER;
    check_refused(dev, &attr, rts_mask, "timeout 32");
    attr.timeout = 14;
    attr.retry_cnt = 8;
    check_refused(dev, &attr, rts_mask, "retry_cnt 8");
    attr.retry_cnt = 7;
    attr.max_rd_atomic = 129;
    check_refused(dev, &attr, rts_mask, "max_rd_atomic 129");
    attr.max_rd_atomic = 4;
    dev.modify_qp(a.qpn, &attr, rts_mask).unwrap();
    let now = dev.query_qp(a.qpn).unwrap();
    assert_eq!(
        (now.state, now.timeout, now.min_rnr_timer, now.sq_psn),
        (QpState::Rts, 14, 20, 0x1234)
    );

    // RTS → RTS may not carry TIMEOUT; a wrong CUR_STATE is refused too.
    check_refused(
        dev,
        &attr,
        AttrMask::STATE | AttrMask::TIMEOUT,
        "TIMEOUT in RTS → RTS",
    );
    let mut cur = attr;
    cur.cur_state = QpState::Rtr;
    check_refused(
        dev,
        &cur,
        AttrMask::STATE | AttrMask::CUR_STATE,
        "wrong cur_state",
    );
    // Out of ERROR only RESET is legal.
    let err = QpAttr {
        state: QpState::Error,
        ..attr
    };
    dev.modify_qp(a.qpn, &err, AttrMask::STATE).unwrap();
    check_refused(dev, &attr, AttrMask::STATE, "ERROR → RTS");
}

/// A message whose last packet left the AckReq to the next one, which SQD then holds back:
/// entering SQD sends that last packet once more, asking for the ACK, so the message
/// completes and the drain ends. Before, only the retransmission timer recovered it (a retry used:
/// RETRY_EXC_ERR at `retry_cnt` 0), and with `timeout` 0 the QP waited in SQD for ever.
#[test]
fn sqd_asks_for_the_ack_the_held_back_message_would_have_asked_for() {
    for (timeout, retry_cnt) in [(0, 7), (8, 0)] {
        let mut sim = Sim::new(5, 2, LinkConfig::default());
        let o = ConnectOptions {
            timeout,
            retry_cnt,
            ..ConnectOptions::default()
        };
        let (a, _b) = connect(&mut sim, 0, 1, &o);
        let src = sim.nodes[0].alloc(4096, RW);
        let dst = sim.nodes[1].alloc(8192, RW);
        for i in 0..2u64 {
            sim.nodes[0]
                .post_send(
                    a.qpn,
                    SendWr::new(i + 1, write_op(&dst, i * 1024), vec![sge(&src, 0, 100)]),
                )
                .unwrap();
        }
        first_request_then_sqd(&mut sim, a);
        assert!(sim.run_idle(10 * SEC));
        assert_eq!(
            ids_and_status(&sim.nodes[0].poll(a.send_cq)),
            [(1, WcStatus::Success)],
            "timeout {timeout}, retry_cnt {retry_cnt}"
        );
        assert_eq!(
            events(&mut sim, 0),
            [Event::Async(AsyncEvent::SqDrained(a.qpn))]
        );
        let c = counters(&sim, 0);
        assert_eq!(
            (c.timeouts, c.retransmissions, c.tx_requests),
            (0, 0, 2),
            "WRITE 1's one packet went twice, and nothing else"
        );
        back_to_rts_sends_the_held_wqe(&mut sim, a, 2);
    }
}

/// A WRITE followed by a READ that cannot start (no initiator depth: `max_rd_atomic` 0)
/// asks for its own ACK: it completes, and only the READ waits, as with rdma_rxe. Before, the
/// WRITE left the AckReq to the READ and was recovered only by a timeout (at `retry_cnt` 0 it
/// failed with RETRY_EXC_ERR).
#[test]
fn a_write_before_a_read_without_initiator_depth_asks_for_its_ack() {
    let mut sim = Sim::new(9, 2, LinkConfig::default());
    let o = ConnectOptions {
        max_rd_atomic: 0,
        retry_cnt: 0,
        ..ConnectOptions::default()
    };
    let (a, _b) = connect(&mut sim, 0, 1, &o);
    let src = sim.nodes[0].alloc(4096, RW);
    let dst = sim.nodes[1].alloc(8192, RW);
    sim.nodes[0]
        .post_send(
            a.qpn,
            SendWr::new(1, write_op(&dst, 0), vec![sge(&src, 0, 100)]),
        )
        .unwrap();
    sim.nodes[0]
        .post_send(
            a.qpn,
            SendWr::new(2, read_op(&dst, 0), vec![sge(&src, 1024, 100)]),
        )
        .unwrap();
    sim.run_idle(10 * SEC);
    assert_eq!(
        ids_and_status(&sim.nodes[0].poll(a.send_cq)),
        [(1, WcStatus::Success)]
    );
    assert_eq!(counters(&sim, 0).timeouts, 0);
    assert_eq!(state(&sim, a), QpState::Rts);
}

/// The same with a READ in flight ahead of that message: only the message's last packet goes
/// again (one duplicate at the responder), not the READ, whose reply would come twice.
#[test]
fn sqd_behind_a_read_in_flight_resends_only_the_last_packet() {
    let mut sim = Sim::new(6, 2, LinkConfig::default());
    let (a, _b) = connect(&mut sim, 0, 1, &ConnectOptions::default());
    let local = sim.nodes[0].alloc(16384, RW);
    let remote = sim.nodes[1].alloc(16384, RW);
    let posts = [
        SendWr::new(1, read_op(&remote, 0), vec![sge(&local, 0, 8192)]),
        SendWr::new(2, write_op(&remote, 8192), vec![sge(&local, 8192, 100)]),
        SendWr::new(3, write_op(&remote, 9216), vec![sge(&local, 8192, 100)]),
    ];
    for wr in posts {
        sim.nodes[0].post_send(a.qpn, wr).unwrap();
    }
    let now = sim.now;
    let mut buf = vec![0u8; 9000];
    let mut sent = Vec::new();
    let node = &mut sim.nodes[0];
    for _ in 0..2 {
        let t = node.dev.poll_transmit(now, &node.mem, &mut buf).unwrap();
        sent.push(buf[..t.len].to_vec());
    }
    assert!(!bth_ack_req(&sent[1]), "WRITE 2 left the AckReq to WRITE 3");
    let sqd = QpAttr {
        state: QpState::Sqd,
        ..QpAttr::default()
    };
    node.dev.modify_qp(a.qpn, &sqd, AttrMask::STATE).unwrap();
    let peer = &mut sim.nodes[1];
    for frame in &sent {
        peer.dev.handle_packet(now, frame, &mut peer.mem);
    }
    assert!(sim.run_idle(10 * SEC));
    assert_eq!(
        ids_and_status(&sim.nodes[0].poll(a.send_cq)),
        [(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    assert_eq!(counters(&sim, 1).duplicates, 1, "{:?}", counters(&sim, 1));
    assert_eq!(counters(&sim, 0).timeouts, 0);
    back_to_rts_sends_the_held_wqe(&mut sim, a, 3);
}
