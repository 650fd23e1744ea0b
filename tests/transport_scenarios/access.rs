//! Remote access violations, and messages longer than the receive buffer: both sides fail and flush.

use super::*;

/// What the responder is asked to do wrong, and the status the requester must see.
struct AccessCase {
    name: &'static str,
    /// Access flags of both QPs.
    qp_access: Access,
    op: fn(&Regions) -> SendOp,
    /// Bytes of the local buffer named by the WR.
    len: u32,
    expect: WcStatus,
}

/// Remote regions on the responder: one with every right, one per missing right.
struct Regions {
    all: MemoryRegion,
    no_write: MemoryRegion,
    no_read: MemoryRegion,
    no_atomic: MemoryRegion,
}

const NO_READ_QP: Access = Access(Access::LOCAL_WRITE.0 | Access::REMOTE_WRITE.0);
const NO_WRITE_QP: Access = Access(Access::LOCAL_WRITE.0 | Access::REMOTE_READ.0);
const NO_ATOMIC_QP: Access =
    Access(Access::LOCAL_WRITE.0 | Access::REMOTE_WRITE.0 | Access::REMOTE_READ.0);

fn access_cases() -> Vec<AccessCase> {
    vec![
        AccessCase {
            name: "WRITE with an unknown rkey",
            qp_access: RW,
            op: |r| SendOp::RdmaWrite {
                remote_addr: r.all.va,
                rkey: r.all.rkey ^ 0x5a5a_5a5a,
            },
            len: 100,
            expect: WcStatus::RemAccessErr,
        },
        AccessCase {
            name: "WRITE running past the end of the region",
            qp_access: RW,
            op: |r| write_op(&r.all, r.all.len - 100),
            len: 200,
            expect: WcStatus::RemAccessErr,
        },
        AccessCase {
            name: "WRITE to a region without REMOTE_WRITE",
            qp_access: RW,
            op: |r| write_op(&r.no_write, 0),
            len: 100,
            expect: WcStatus::RemAccessErr,
        },
        AccessCase {
            name: "READ with an unknown rkey",
            qp_access: RW,
            op: |r| SendOp::RdmaRead {
                remote_addr: r.all.va,
                rkey: r.all.rkey.wrapping_add(1),
            },
            len: 100,
            expect: WcStatus::RemAccessErr,
        },
        AccessCase {
            name: "READ running past the end of the region",
            qp_access: RW,
            op: |r| read_op(&r.all, r.all.len - 10),
            len: 100,
            expect: WcStatus::RemAccessErr,
        },
        AccessCase {
            name: "READ from a region without REMOTE_READ",
            qp_access: RW,
            op: |r| read_op(&r.no_read, 0),
            len: 100,
            expect: WcStatus::RemAccessErr,
        },
        AccessCase {
            name: "FETCH_ADD on a region without REMOTE_ATOMIC",
            qp_access: RW,
            op: |r| SendOp::FetchAdd {
                remote_addr: r.no_atomic.va,
                rkey: r.no_atomic.rkey,
                add: 1,
            },
            len: 8,
            expect: WcStatus::RemAccessErr,
        },
        // rdma_rxe NAKs a request the QP's access flags forbid with *invalid request* (digest
        // §5.4), not remote access error.
        AccessCase {
            name: "READ on a QP without REMOTE_READ",
            qp_access: NO_READ_QP,
            op: |r| read_op(&r.all, 0),
            len: 100,
            expect: WcStatus::RemInvReqErr,
        },
        AccessCase {
            name: "WRITE on a QP without REMOTE_WRITE",
            qp_access: NO_WRITE_QP,
            op: |r| write_op(&r.all, 0),
            len: 100,
            expect: WcStatus::RemInvReqErr,
        },
        AccessCase {
            name: "CMP_SWAP on a QP without REMOTE_ATOMIC",
            qp_access: NO_ATOMIC_QP,
            op: |r| SendOp::CompareSwap {
                remote_addr: r.all.va,
                rkey: r.all.rkey,
                compare: 0,
                swap: 1,
            },
            len: 8,
            expect: WcStatus::RemInvReqErr,
        },
    ]
}

/// A forbidden remote access fails the WQE with the status rdma_rxe gives, moves both QPs to
/// ERROR (the responder's is a class C error), and flushes everything still posted on both
/// sides, receives included. The remote memory is untouched.
#[test]
fn remote_access_violations_fail_and_flush_both_sides() {
    for case in access_cases() {
        let mut sim = Sim::new(31, 2, LinkConfig::default());
        let o = ConnectOptions {
            access: case.qp_access,
            ..ConnectOptions::default()
        };
        let (a, b) = connect(&mut sim, 0, 1, &o);
        let src = sim.nodes[0].alloc(4096, RW);
        let r = Regions {
            all: sim.nodes[1].alloc(4096, RW),
            no_write: sim.nodes[1].alloc(4096, Access::LOCAL_WRITE | Access::REMOTE_READ),
            no_read: sim.nodes[1].alloc(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE),
            no_atomic: sim.nodes[1].alloc(
                4096,
                Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
            ),
        };
        let recv_buf = sim.nodes[1].alloc(4096, RW);
        sim.nodes[1].bytes_mut(&r.all).fill(0xab);
        sim.nodes[0].bytes_mut(&src).fill(0x11);
        for id in [10, 11] {
            sim.nodes[1]
                .post_recv(b.qpn, recv_wr(id, &recv_buf, 0, 1024))
                .unwrap();
        }
        sim.nodes[0]
            .post_recv(a.qpn, recv_wr(20, &src, 2048, 1024))
            .unwrap();
        let bad = SendWr::new(1, (case.op)(&r), vec![sge(&src, 0, case.len)]);
        sim.nodes[0].post_send(a.qpn, bad).unwrap();
        sim.nodes[0]
            .post_send(a.qpn, SendWr::new(2, SendOp::Send, vec![sge(&src, 0, 10)]))
            .unwrap();
        sim.nodes[0]
            .post_send(
                a.qpn,
                SendWr::new(3, write_op(&r.all, 0), vec![sge(&src, 0, 10)]),
            )
            .unwrap();

        let sc = wait_cq(&mut sim, 0, a.send_cq, 3);
        settle(&mut sim);
        let name = case.name;
        assert_eq!(
            ids_and_status(&sc),
            [
                (1, case.expect),
                (2, WcStatus::WrFlushErr),
                (3, WcStatus::WrFlushErr)
            ],
            "{name}"
        );
        assert_eq!(state(&sim, a), QpState::Error, "{name}");
        assert_eq!(state(&sim, b), QpState::Error, "{name}");
        assert_eq!(
            ids_and_status(&sim.nodes[0].poll(a.recv_cq)),
            [(20, WcStatus::WrFlushErr)],
            "{name}"
        );
        assert_eq!(
            ids_and_status(&sim.nodes[1].poll(b.recv_cq)),
            [(10, WcStatus::WrFlushErr), (11, WcStatus::WrFlushErr)],
            "{name}: the responder's receives flush"
        );
        assert_eq!(counters(&sim, 1).error_naks_sent, 1, "{name}");
        assert_eq!(counters(&sim, 0).error_naks_received, 1, "{name}");
        // Nothing was written anywhere on the responder, and no READ data came back.
        assert!(
            sim.nodes[1].bytes(&r.all).iter().all(|&x| x == 0xab),
            "{name}"
        );
        for mr in [&r.no_write, &r.no_read, &r.no_atomic, &recv_buf] {
            assert!(sim.nodes[1].bytes(mr).iter().all(|&x| x == 0), "{name}");
        }
        assert!(
            sim.nodes[0].bytes(&src).iter().all(|&x| x == 0x11),
            "{name}"
        );
    }
}

/// A SEND longer than the receive buffer: rdma_rxe NAKs it as an invalid request and completes
/// the receive with REM_INV_REQ_ERR (not LOC_LEN_ERR, digest §5.7); both QPs go to ERROR.
#[test]
fn send_longer_than_the_receive_buffer() {
    let mut sim = Sim::new(32, 2, LinkConfig::default());
    let (a, b) = connect(&mut sim, 0, 1, &ConnectOptions::default());
    let src = sim.nodes[0].alloc(4096, RW);
    let dst = sim.nodes[1].alloc(4096, RW);
    for id in [10, 11] {
        sim.nodes[1]
            .post_recv(b.qpn, recv_wr(id, &dst, (id - 10) * 2048, 1000))
            .unwrap();
    }
    sim.nodes[0]
        .post_send(
            a.qpn,
            SendWr::new(1, SendOp::Send, vec![sge(&src, 0, 1500)]),
        )
        .unwrap();
    let sc = wait_cq(&mut sim, 0, a.send_cq, 1);
    settle(&mut sim);
    assert_eq!(ids_and_status(&sc), [(1, WcStatus::RemInvReqErr)]);
    assert_eq!(
        ids_and_status(&sim.nodes[1].poll(b.recv_cq)),
        [(10, WcStatus::RemInvReqErr), (11, WcStatus::WrFlushErr)]
    );
    assert_eq!(state(&sim, a), QpState::Error);
    assert_eq!(state(&sim, b), QpState::Error);
}

/// Local protection errors (an unknown lkey for a SEND, a READ into a region without
/// LOCAL_WRITE) complete the WQE with LOC_PROT_ERR without sending it, after the WQEs ahead of
/// it complete; the QP goes to ERROR and the peer is unaffected.
#[test]
fn local_protection_errors_send_nothing() {
    for read in [false, true] {
        let mut sim = Sim::new(33, 2, LinkConfig::default());
        let (a, b) = connect(&mut sim, 0, 1, &ConnectOptions::default());
        let src = sim.nodes[0].alloc(4096, RW);
        let read_only = sim.nodes[0].alloc(4096, Access::REMOTE_READ);
        let dst = sim.nodes[1].alloc(4096, RW);
        sim.nodes[1]
            .post_recv(b.qpn, recv_wr(10, &dst, 0, 1024))
            .unwrap();
        sim.nodes[0]
            .post_send(
                a.qpn,
                SendWr::new(1, write_op(&dst, 2048), vec![sge(&src, 0, 100)]),
            )
            .unwrap();
        let bad = if read {
            SendWr::new(2, read_op(&dst, 0), vec![sge(&read_only, 0, 100)])
        } else {
            let mut bad_sge = sge(&src, 0, 100);
            bad_sge.lkey ^= 0x100;
            SendWr::new(2, SendOp::Send, vec![bad_sge])
        };
        sim.nodes[0].post_send(a.qpn, bad).unwrap();
        sim.nodes[0]
            .post_send(a.qpn, SendWr::new(3, SendOp::Send, vec![sge(&src, 0, 10)]))
            .unwrap();
        let sc = wait_cq(&mut sim, 0, a.send_cq, 3);
        settle(&mut sim);
        assert_eq!(
            ids_and_status(&sc),
            [
                (1, WcStatus::Success),
                (2, WcStatus::LocProtErr),
                (3, WcStatus::WrFlushErr)
            ],
            "read {read}"
        );
        assert_eq!(
            counters(&sim, 0).tx_requests,
            1,
            "only the good WRITE went out"
        );
        assert_eq!(state(&sim, a), QpState::Error);
        assert_eq!(state(&sim, b), QpState::Rts);
        assert_eq!(cq_len(&sim, 1, b.recv_cq), 0);
    }
}

/// Zero-length WRITE and READ do not look at the R_Key or the address (C9-88, digest §5.8);
/// a zero-length SEND still consumes a receive.
#[test]
fn zero_length_operations_ignore_the_rkey() {
    let mut sim = Sim::new(34, 2, LinkConfig::default());
    let (a, b) = connect(&mut sim, 0, 1, &ConnectOptions::default());
    let dst = sim.nodes[1].alloc(4096, RW);
    sim.nodes[1]
        .post_recv(b.qpn, recv_wr(10, &dst, 0, 64))
        .unwrap();
    let nowhere = |id, op: fn(u64, u32) -> SendOp| SendWr::new(id, op(0xdead_0000, 0x1234), vec![]);
    sim.nodes[0]
        .post_send(
            a.qpn,
            nowhere(1, |remote_addr, rkey| SendOp::RdmaWrite {
                remote_addr,
                rkey,
            }),
        )
        .unwrap();
    sim.nodes[0]
        .post_send(
            a.qpn,
            nowhere(2, |remote_addr, rkey| SendOp::RdmaRead {
                remote_addr,
                rkey,
            }),
        )
        .unwrap();
    sim.nodes[0]
        .post_send(a.qpn, SendWr::new(3, SendOp::Send, vec![]))
        .unwrap();
    let sc = wait_cq(&mut sim, 0, a.send_cq, 3);
    settle(&mut sim);
    assert_eq!(
        ids_and_status(&sc),
        [
            (1, WcStatus::Success),
            (2, WcStatus::Success),
            (3, WcStatus::Success)
        ]
    );
    assert!(sc.iter().all(|w| w.byte_len == 0));
    let rc = sim.nodes[1].poll(b.recv_cq);
    assert_eq!(ids_and_status(&rc), [(10, WcStatus::Success)]);
    assert_eq!(rc[0].byte_len, 0);
    assert_eq!(state(&sim, b), QpState::Rts);
}
