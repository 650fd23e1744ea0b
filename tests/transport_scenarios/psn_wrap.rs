//! PSNs that wrap past 2^24 - 1 mid-message and mid-window.

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Send,
    Write,
    Read,
}

/// A 5-packet SEND, WRITE or READ whose PSNs run 0xFFFFFE, 0xFFFFFF, 0, 1, 2; with `lose`, the
/// packets at 0xFFFFFF and 0 (requests, or READ responses) are lost the first time, so the
/// go-back-N restart point lies just before the wrap and the resent packets cross it.
fn wrap_case(kind: Kind, lose: bool) {
    let mut sim = Sim::new(51, 2, LinkConfig::default());
    let o = ConnectOptions {
        psn: (0xFF_FFFE, 0xFF_FFFD),
        ..ConnectOptions::default()
    };
    let (a, b) = connect(&mut sim, 0, 1, &o);
    let local = sim.nodes[0].alloc(8192, RW);
    let remote = sim.nodes[1].alloc(8192, RW);
    let data = pattern(5000, 51);
    let dropped = lose.then(|| {
        let from = if kind == Kind::Read { 1 } else { 0 };
        drop_matching(&mut sim, from, 2, |_, psn| psn == 0xFF_FFFF || psn == 0)
    });
    let what = format!("{kind:?}, lose {lose}");
    match kind {
        Kind::Send | Kind::Write => {
            sim.nodes[0].bytes_mut(&local)[..5000].copy_from_slice(&data);
            let op = if kind == Kind::Send {
                sim.nodes[1]
                    .post_recv(b.qpn, recv_wr(3, &remote, 0, 8192))
                    .unwrap();
                SendOp::SendWithImm { imm: 0x1234 }
            } else {
                write_op(&remote, 0)
            };
            sim.nodes[0]
                .post_send(a.qpn, SendWr::new(1, op, vec![sge(&local, 0, 5000)]))
                .unwrap();
        }
        Kind::Read => {
            sim.nodes[1].bytes_mut(&remote)[..5000].copy_from_slice(&data);
            sim.nodes[0]
                .post_send(
                    a.qpn,
                    SendWr::new(1, read_op(&remote, 0), vec![sge(&local, 0, 5000)]),
                )
                .unwrap();
        }
    }
    let sc = wait_cq(&mut sim, 0, a.send_cq, 1);
    settle(&mut sim);
    assert_eq!(ids_and_status(&sc), [(1, WcStatus::Success)], "{what}");
    let landed = match kind {
        Kind::Read => &sim.nodes[0].bytes(&local)[..5000],
        _ => &sim.nodes[1].bytes(&remote)[..5000],
    };
    assert!(landed == &data[..], "{what}: data differs");
    if kind == Kind::Send {
        let rc = sim.nodes[1].poll(b.recv_cq);
        assert_eq!(ids_and_status(&rc), [(3, WcStatus::Success)], "{what}");
        assert_eq!((rc[0].byte_len, rc[0].imm), (5000, 0x1234), "{what}");
    }
    // Five PSNs consumed across the wrap, on both ends.
    assert_eq!(
        sim.nodes[0].dev.query_qp(a.qpn).unwrap().sq_psn,
        3,
        "{what}"
    );
    assert_eq!(
        sim.nodes[1].dev.query_qp(b.qpn).unwrap().rq_psn,
        3,
        "{what}"
    );
    if let Some(d) = dropped {
        assert_eq!(d.get(), 2, "{what}");
        assert!(counters(&sim, 0).retransmissions >= 1, "{what}");
    }
}

#[test]
fn psn_wrap_in_the_middle_of_a_message() {
    for kind in [Kind::Send, Kind::Write, Kind::Read] {
        for lose in [false, true] {
            wrap_case(kind, lose);
        }
    }
}

/// Twenty mixed 3-packet operations starting 16 PSNs before the wrap, on a link that loses,
/// duplicates, reorders and corrupts: retries cross the wrap many times; every WQE completes in
/// order, every byte lands, every SEND is delivered exactly once.
#[test]
fn psn_wrap_with_retries_on_a_lossy_link() {
    for seed in [52, 53, 54] {
        let mut sim = Sim::new(seed, 2, LinkConfig::lossy(0.05, 0.02, 0.05, 0.01));
        let o = ConnectOptions {
            psn: (0xFF_FFF0, 0xFF_FFF8),
            ..ConnectOptions::default()
        };
        let (a, b) = connect(&mut sim, 0, 1, &o);
        const N: usize = 20;
        const LEN: usize = 3000;
        let local = sim.nodes[0].alloc(N * 4096, RW);
        let remote = sim.nodes[1].alloc(N * 4096, RW);
        let kinds = [Kind::Send, Kind::Write, Kind::Read];
        let mut expect_local = vec![0u8; N * 4096];
        let mut expect_remote = vec![0u8; N * 4096];
        for i in 0..N {
            let off = (i * 4096) as u64;
            let data = pattern(LEN, i as u8);
            let kind = kinds[i % 3];
            let op = match kind {
                Kind::Send => {
                    sim.nodes[1]
                        .post_recv(b.qpn, recv_wr(100 + i as u64, &remote, off, 4096))
                        .unwrap();
                    SendOp::Send
                }
                Kind::Write => write_op(&remote, off),
                Kind::Read => read_op(&remote, off),
            };
            let at = i * 4096..i * 4096 + LEN;
            if kind == Kind::Read {
                sim.nodes[1].bytes_mut(&remote)[at.clone()].copy_from_slice(&data);
                expect_remote[at.clone()].copy_from_slice(&data);
                expect_local[at].copy_from_slice(&data);
            } else {
                sim.nodes[0].bytes_mut(&local)[at.clone()].copy_from_slice(&data);
                expect_local[at.clone()].copy_from_slice(&data);
                expect_remote[at].copy_from_slice(&data);
            }
            sim.nodes[0]
                .post_send(
                    a.qpn,
                    SendWr::new(i as u64, op, vec![sge(&local, off, LEN as u32)]),
                )
                .unwrap();
        }
        let sc = wait_cq(&mut sim, 0, a.send_cq, N);
        settle(&mut sim);
        let want: Vec<_> = (0..N as u64).map(|i| (i, WcStatus::Success)).collect();
        assert_eq!(ids_and_status(&sc), want, "seed {seed}");
        let rc = sim.nodes[1].poll(b.recv_cq);
        let want: Vec<_> = (0..N as u64)
            .filter(|i| i % 3 == 0)
            .map(|i| (100 + i, WcStatus::Success))
            .collect();
        assert_eq!(ids_and_status(&rc), want, "seed {seed}");
        assert!(
            sim.nodes[0].bytes(&local) == &expect_local[..],
            "seed {seed}"
        );
        assert!(
            sim.nodes[1].bytes(&remote) == &expect_remote[..],
            "seed {seed}"
        );
        // 20 × 3 PSNs from 0xFFFFF0: 0xFFFFF0 + 60 = 0x2C after the wrap.
        assert_eq!(sim.nodes[0].dev.query_qp(a.qpn).unwrap().sq_psn, 0x2C);
        assert!(
            sim.stats.lost > 0 && counters(&sim, 0).retransmissions > 0,
            "seed {seed}: the link must actually have lost something"
        );
    }
}
