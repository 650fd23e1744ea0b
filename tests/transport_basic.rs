//! Every operation once over a clean simulated link: the data lands, the completions say so.

use xroce_core::transport::memory::MemoryRegion;
use xroce_core::transport::{
    Access, QpType, RecvWr, SendFlags, SendOp, SendWr, Sge, WcFlags, WcOpcode, WcStatus,
};
use xroce_tests::sim::{connect, ConnectOptions, LinkConfig, Node, Sim};

const RW: Access = Access(
    Access::LOCAL_WRITE.0
        | Access::REMOTE_WRITE.0
        | Access::REMOTE_READ.0
        | Access::REMOTE_ATOMIC.0,
);

fn pattern(len: usize, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ salt)
        .collect()
}

#[test]
fn rc_send_write_read_atomics() {
    let mut sim = Sim::new(1, 2, LinkConfig::default());
    let o = ConnectOptions::default();
    let (a, b) = connect(&mut sim, 0, 1, &o);

    let src = sim.nodes[0].alloc(16384, RW);
    let dst = sim.nodes[1].alloc(16384, RW);
    let data = pattern(5000, 7);
    sim.nodes[0].bytes_mut(&src)[..5000].copy_from_slice(&data);

    // SEND 5000 bytes (5 packets at MTU 1024) into a posted receive.
    sim.nodes[1]
        .dev
        .post_recv(
            b.qpn,
            RecvWr {
                wr_id: 77,
                sg_list: vec![Sge {
                    addr: dst.va,
                    length: 8192,
                    lkey: dst.lkey,
                }]
                .into(),
            },
        )
        .unwrap();
    let mut wr = SendWr::new(
        1,
        SendOp::SendWithImm { imm: 0xdeadbeef },
        vec![Sge {
            addr: src.va,
            length: 5000,
            lkey: src.lkey,
        }],
    );
    wr.flags = SendFlags::SIGNALED | SendFlags::SOLICITED;
    sim.nodes[0].post_send(a.qpn, wr).unwrap();
    assert!(sim.run_until(1_000_000_000, |s| !s.nodes[0]
        .dev
        .cq(a.send_cq)
        .unwrap()
        .is_empty()));
    let sc = sim.nodes[0].poll(a.send_cq);
    assert_eq!(sc.len(), 1);
    assert_eq!(sc[0].status, WcStatus::Success);
    assert_eq!(sc[0].opcode, WcOpcode::Send);
    let rc = sim.nodes[1].poll(b.recv_cq);
    assert_eq!(rc.len(), 1, "{rc:?}");
    assert_eq!(rc[0].wr_id, 77);
    assert_eq!(rc[0].byte_len, 5000);
    assert_eq!(rc[0].imm, 0xdeadbeef);
    assert!(rc[0].flags.contains(WcFlags::WITH_IMM));
    assert!(rc[0].solicited);
    assert_eq!(rc[0].src_qp, a.qpn);
    assert_eq!(&sim.nodes[1].bytes(&dst)[..5000], &data[..]);

    // WRITE 3000 bytes at offset 8192 of the remote region.
    let wr = SendWr::new(
        2,
        SendOp::RdmaWrite {
            remote_addr: dst.va + 8192,
            rkey: dst.rkey,
        },
        vec![Sge {
            addr: src.va,
            length: 3000,
            lkey: src.lkey,
        }],
    );
    sim.nodes[0].post_send(a.qpn, wr).unwrap();
    assert!(sim.run_until(1_000_000_000, |s| !s.nodes[0]
        .dev
        .cq(a.send_cq)
        .unwrap()
        .is_empty()));
    let sc = sim.nodes[0].poll(a.send_cq);
    assert_eq!(
        (sc[0].status, sc[0].opcode),
        (WcStatus::Success, WcOpcode::RdmaWrite)
    );
    assert_eq!(&sim.nodes[1].bytes(&dst)[8192..11192], &data[..3000]);

    // READ 4500 bytes back from the remote region into offset 10000 locally.
    let remote = pattern(4500, 99);
    sim.nodes[1].bytes_mut(&dst)[100..4600].copy_from_slice(&remote);
    let wr = SendWr::new(
        3,
        SendOp::RdmaRead {
            remote_addr: dst.va + 100,
            rkey: dst.rkey,
        },
        vec![
            Sge {
                addr: src.va + 10000,
                length: 1000,
                lkey: src.lkey,
            },
            Sge {
                addr: src.va + 12000,
                length: 3500,
                lkey: src.lkey,
            },
        ],
    );
    sim.nodes[0].post_send(a.qpn, wr).unwrap();
    assert!(sim.run_until(1_000_000_000, |s| !s.nodes[0]
        .dev
        .cq(a.send_cq)
        .unwrap()
        .is_empty()));
    let sc = sim.nodes[0].poll(a.send_cq);
    assert_eq!(
        (sc[0].status, sc[0].opcode),
        (WcStatus::Success, WcOpcode::RdmaRead)
    );
    let local = sim.nodes[0].bytes(&src);
    assert_eq!(&local[10000..11000], &remote[..1000]);
    assert_eq!(&local[12000..15500], &remote[1000..]);

    // FETCH_ADD then CMP_SWAP on an 8-byte word.
    sim.nodes[1].bytes_mut(&dst)[16000..16008].copy_from_slice(&40u64.to_ne_bytes());
    let wr = SendWr::new(
        4,
        SendOp::FetchAdd {
            remote_addr: dst.va + 16000,
            rkey: dst.rkey,
            add: 2,
        },
        vec![Sge {
            addr: src.va + 16000,
            length: 8,
            lkey: src.lkey,
        }],
    );
    sim.nodes[0].post_send(a.qpn, wr).unwrap();
    let wr = SendWr::new(
        5,
        SendOp::CompareSwap {
            remote_addr: dst.va + 16000,
            rkey: dst.rkey,
            compare: 42,
            swap: 7,
        },
        vec![Sge {
            addr: src.va + 16008,
            length: 8,
            lkey: src.lkey,
        }],
    );
    sim.nodes[0].post_send(a.qpn, wr).unwrap();
    assert!(sim.run_until(1_000_000_000, |s| s.nodes[0]
        .dev
        .cq(a.send_cq)
        .unwrap()
        .len()
        == 2));
    let sc = sim.nodes[0].poll(a.send_cq);
    assert!(sc.iter().all(|c| c.status == WcStatus::Success), "{sc:?}");
    let local = sim.nodes[0].bytes(&src);
    assert_eq!(
        u64::from_ne_bytes(local[16000..16008].try_into().unwrap()),
        40
    );
    assert_eq!(
        u64::from_ne_bytes(local[16008..16016].try_into().unwrap()),
        42
    );
    let word = &sim.nodes[1].bytes(&dst)[16000..16008];
    assert_eq!(u64::from_ne_bytes(word.try_into().unwrap()), 7);

    assert!(
        sim.run_idle(1_000_000_000),
        "timers still armed when all is acknowledged"
    );
    let c = sim.nodes[0].dev.counters();
    assert_eq!(c.retransmissions, 0);
    assert_eq!(sim.nodes[1].dev.counters().seq_naks_sent, 0);
}

#[test]
fn uc_send_and_write() {
    let mut sim = Sim::new(2, 2, LinkConfig::default());
    let o = ConnectOptions {
        ty: QpType::Uc,
        ..ConnectOptions::default()
    };
    let (a, b) = connect(&mut sim, 0, 1, &o);
    let src = sim.nodes[0].alloc(8192, RW);
    let dst = sim.nodes[1].alloc(8192, RW);
    let data = pattern(3000, 3);
    sim.nodes[0].bytes_mut(&src)[..3000].copy_from_slice(&data);
    sim.nodes[1]
        .dev
        .post_recv(
            b.qpn,
            RecvWr {
                wr_id: 9,
                sg_list: vec![Sge {
                    addr: dst.va,
                    length: 4096,
                    lkey: dst.lkey,
                }]
                .into(),
            },
        )
        .unwrap();
    let sge = vec![Sge {
        addr: src.va,
        length: 3000,
        lkey: src.lkey,
    }];
    let mem = sim.nodes[0].mem.clone();
    sim.nodes[0]
        .dev
        .post_send(a.qpn, SendWr::new(1, SendOp::Send, sge.clone()), &mem)
        .unwrap();
    sim.nodes[0]
        .dev
        .post_send(
            a.qpn,
            SendWr::new(
                2,
                SendOp::RdmaWrite {
                    remote_addr: dst.va + 4096,
                    rkey: dst.rkey,
                },
                sge,
            ),
            &mem,
        )
        .unwrap();
    assert!(sim.run_idle(1_000_000_000));
    assert_eq!(sim.nodes[0].poll(a.send_cq).len(), 2);
    let rc = sim.nodes[1].poll(b.recv_cq);
    assert_eq!(rc.len(), 1);
    assert_eq!(rc[0].byte_len, 3000);
    assert_eq!(&sim.nodes[1].bytes(&dst)[..3000], &data[..]);
    assert_eq!(&sim.nodes[1].bytes(&dst)[4096..7096], &data[..]);
}

/// QPNs count up from the device's configured first QPN (the engine draws it at random, so a
/// program run again gets numbers its previous run did not use); a first QPN outside the
/// usable range (the special QPs 0 and 1, the multicast QPN) falls back to 0x11, and the count
/// wraps from just below the multicast QPN back to 0x11.
#[test]
fn qp_numbers_start_at_the_configured_first_qpn() {
    use xroce_core::transport::device::limits::FIRST_QPN;
    use xroce_core::transport::{Device, DeviceConfig, PathMtu, QpCap, QpInit};
    let numbers = |first_qpn: u32, n: usize| {
        let mut dev = Device::new(DeviceConfig {
            gids: vec![],
            port_mtu: PathMtu::Mtu1024,
            key_seed: [7; 32],
            first_qpn,
        });
        let pd = dev.alloc_pd();
        let cq = dev.create_cq(16).unwrap();
        (0..n)
            .map(|_| {
                dev.create_qp(QpInit {
                    ty: QpType::Rc,
                    pd,
                    send_cq: cq,
                    recv_cq: cq,
                    srq: None,
                    cap: QpCap::default(),
                    sq_sig_all: false,
                })
                .unwrap()
            })
            .collect::<Vec<u32>>()
    };
    assert_eq!(numbers(0x12_3456, 2), [0x12_3456, 0x12_3457]);
    assert_eq!(numbers(0, 1), [FIRST_QPN]);
    assert_eq!(numbers(1, 1), [FIRST_QPN]);
    assert_eq!(numbers(0xff_ffff, 1), [FIRST_QPN]);
    assert_eq!(numbers(0xff_fffe, 2), [0xff_fffe, FIRST_QPN]);
}

/// Posts a SEND of `len` bytes from `buf` and returns whether the send queue was busy.
fn post_was_busy(node: &mut Node, qpn: u32, buf: &MemoryRegion, len: u32) -> bool {
    let sge = Sge {
        addr: buf.va,
        length: len,
        lkey: buf.lkey,
    };
    let wr = SendWr::new(0, SendOp::Send, vec![sge]);
    node.dev
        .post_send_was_busy(qpn, wr, &node.mem)
        .expect("post_send")
}

/// Builds `n` packets of `node` and drops them (no ACK ever comes back).
fn send_packets(node: &mut Node, n: usize) {
    let mut frame = vec![0u8; 9000];
    for _ in 0..n {
        assert!(node.dev.poll_transmit(0, &node.mem, &mut frame).is_some());
    }
}

/// Whether a WR finds its send queue busy decides whether the engine sends it at once or lets
/// it wait for the next round, with the rest of a stream. Busy: a message waiting to go or
/// partly sent, or two sent and unacknowledged. Not busy: an empty queue, or one message sent
/// whole and awaiting its ACK (a ping-pong's previous turn, whose ACK comes behind the peer's
/// answer: the answer to that must not wait for a round).
#[test]
fn a_send_queue_is_busy_unless_empty_or_holding_one_message_sent_whole() {
    let mut sim = Sim::new(3, 2, LinkConfig::default());
    let o = ConnectOptions::default();
    let qpns: Vec<u32> = (0..3).map(|_| connect(&mut sim, 0, 1, &o).0.qpn).collect();
    let node = &mut sim.nodes[0];
    let buf = node.alloc(8192, RW);

    // One message sent whole, then the answer to the peer's answer.
    assert!(!post_was_busy(node, qpns[0], &buf, 64), "empty");
    send_packets(node, 1);
    assert!(
        !post_was_busy(node, qpns[0], &buf, 64),
        "one message sent whole, awaiting its ACK"
    );

    // A message not yet sent, then two sent and unacknowledged.
    assert!(!post_was_busy(node, qpns[1], &buf, 64));
    assert!(
        post_was_busy(node, qpns[1], &buf, 64),
        "a message waits to go"
    );
    send_packets(node, 3);
    assert!(
        post_was_busy(node, qpns[1], &buf, 64),
        "two messages sent: a stream"
    );

    // A message of four packets (path MTU 1024), one of them sent.
    send_packets(node, 1);
    assert!(!post_was_busy(node, qpns[2], &buf, 4096));
    send_packets(node, 1);
    assert!(
        post_was_busy(node, qpns[2], &buf, 64),
        "a message partly sent"
    );
    let mut frame = vec![0u8; 9000];
    let mut left = 0;
    while node.dev.poll_transmit(0, &node.mem, &mut frame).is_some() {
        left += 1;
    }
    assert_eq!(left, 4, "the rest of the long message and the short one");
}

/// What a sender learned from the GID table holds while `gids_version` stays: it moves with
/// every replacement of the table, the same table too.
#[test]
fn the_gid_tables_version_moves_with_each_replacement() {
    let mut sim = Sim::new(5, 1, LinkConfig::default());
    let dev = &mut sim.nodes[0].dev;
    let before = dev.gids_version();
    let gids = dev.gids().to_vec();
    dev.set_gids(gids.clone());
    assert_ne!(dev.gids_version(), before);
    let once = dev.gids_version();
    dev.set_gids(gids);
    assert_ne!(dev.gids_version(), once);
}

/// A long payload is hashed for the ICRC as it is copied out of the sender's memory, a short
/// one after (`HostMemory::read_hashing`), in SENDs, WRITEs with immediate data gathered from
/// several pieces, and READ responses. Either way each packet carries the ICRC of its whole IP
/// packet, pad included (lengths that leave 1-3 pad bytes in the last packet), and the same
/// bytes as the frame built in one piece from its headers and payload.
#[test]
fn a_payload_hashed_as_it_is_copied_carries_the_icrc_of_the_whole_packet() {
    use xroce_tests::sim::{node_ipv4, node_ipv6};
    for ips in [
        vec![node_ipv4(0), node_ipv4(1)],
        vec![node_ipv6(0), node_ipv6(1)],
    ] {
        payloads_hashed_as_copied(Sim::with_addresses(3, ips, LinkConfig::default()));
    }
}

fn payloads_hashed_as_copied(mut sim: Sim) {
    use xroce_core::icrc;
    use xroce_core::wire::{emit_frame, RoceFrame};

    // The hashed path needs the carry-less code, which a native CPU picks (`XROCE_ICRC=table`
    // would leave this test nothing to check).
    assert_eq!(icrc::code_in_use(), icrc::Crc32Code::CarryLess);
    sim.trace = Some(Vec::new());
    let o = ConnectOptions::default();
    let (a, b) = connect(&mut sim, 0, 1, &o);
    let src = sim.nodes[0].alloc(16384, RW);
    let dst = sim.nodes[1].alloc(16384, RW);
    let lengths = [100u32, 511, 512, 1001, 2050, 4095];
    for (i, len) in lengths.into_iter().enumerate() {
        let data = pattern(len as usize, i as u8);
        sim.nodes[0].bytes_mut(&src)[..data.len()].copy_from_slice(&data);
        sim.nodes[1]
            .dev
            .post_recv(
                b.qpn,
                RecvWr {
                    wr_id: i as u64,
                    sg_list: vec![Sge {
                        addr: dst.va,
                        length: 16384,
                        lkey: dst.lkey,
                    }]
                    .into(),
                },
            )
            .unwrap();
        sim.nodes[0]
            .post_send(a.qpn, signalled(i as u64, SendOp::Send, &src, len))
            .unwrap();
        assert!(
            sim.run_until(1_000_000_000, |s| !s.nodes[1].poll(b.recv_cq).is_empty()),
            "SEND of {len} bytes not received"
        );
        assert_eq!(
            sim.nodes[1].bytes(&dst)[..data.len()],
            data[..],
            "{len} bytes"
        );
    }
    // WRITEs with immediate data (RETH and ImmDt before the payload) gathered from three
    // pieces of odd lengths: the CRC goes on from piece to piece.
    for (i, len) in [777u32, 3001].into_iter().enumerate() {
        let data = pattern(len as usize, 0x20 + i as u8);
        sim.nodes[0].bytes_mut(&src)[..data.len()].copy_from_slice(&data);
        let pieces = [101u32, 333, len - 434];
        let mut at = 0;
        let sg_list: Vec<Sge> = pieces
            .iter()
            .map(|&n| {
                let sge = Sge {
                    addr: src.va + at,
                    length: n,
                    lkey: src.lkey,
                };
                at += u64::from(n);
                sge
            })
            .collect();
        let write = SendOp::RdmaWriteWithImm {
            remote_addr: dst.va,
            rkey: dst.rkey,
            imm: 0x1234 + i as u32,
        };
        let mut wr = SendWr::new(50 + i as u64, write, sg_list);
        wr.flags = SendFlags::SIGNALED;
        sim.nodes[1]
            .dev
            .post_recv(
                b.qpn,
                RecvWr {
                    wr_id: 50 + i as u64,
                    sg_list: Vec::new().into(),
                },
            )
            .unwrap();
        sim.nodes[0].post_send(a.qpn, wr).unwrap();
        assert!(
            sim.run_until(1_000_000_000, |s| !s.nodes[1].poll(b.recv_cq).is_empty()),
            "WRITE of {len} bytes not received"
        );
        assert_eq!(
            sim.nodes[1].bytes(&dst)[..data.len()],
            data[..],
            "{len} bytes written"
        );
    }
    // READ responses carry payloads the responder copies out of its memory the same way.
    for (i, len) in [600u32, 2050, 4095].into_iter().enumerate() {
        let data = pattern(len as usize, 0x40 + i as u8);
        sim.nodes[1].bytes_mut(&dst)[..data.len()].copy_from_slice(&data);
        let read = SendOp::RdmaRead {
            remote_addr: dst.va,
            rkey: dst.rkey,
        };
        sim.nodes[0]
            .post_send(a.qpn, signalled(100 + i as u64, read, &src, len))
            .unwrap();
        assert!(
            sim.run_until(1_000_000_000, |s| s.nodes[0]
                .poll(a.send_cq)
                .iter()
                .any(|c| c.opcode == WcOpcode::RdmaRead)),
            "READ of {len} bytes not completed"
        );
        assert_eq!(
            sim.nodes[0].bytes(&src)[..data.len()],
            data[..],
            "{len} bytes read"
        );
    }
    // Both nodes' packets: the SENDs, the READ responses, the ACKs and READ requests.
    let sent: Vec<Vec<u8>> = sim
        .trace
        .take()
        .expect("traced")
        .into_iter()
        .map(|(_, p)| p)
        .collect();
    let mut long = 0;
    for packet in &sent {
        let frame = RoceFrame::parse_ip(packet).expect("a RoCEv2 packet");
        assert!(icrc::verify(packet).unwrap(), "ICRC of {frame}");
        let mut rebuilt = vec![0u8; packet.len() + 64];
        let n = emit_frame(&mut rebuilt, &frame.headers, frame.payload).expect("rebuilt");
        assert_eq!(rebuilt[..n], packet[..], "{frame}");
        long += usize::from(frame.payload.len() >= 512);
    }
    // SENDs: 512, 1001, 2050 (two of 1024), 4095 (three of 1024, one of 1023); WRITEs: 777,
    // 3001 (two of 1024, one of 953); READ responses: 600, 2050 (two), 4095 (four): the
    // packets whose payloads were hashed as they were copied.
    assert!(long >= 19, "{long} long packets");
}

/// A signalled work request on the first `len` bytes of `mr`.
fn signalled(wr_id: u64, op: SendOp, mr: &MemoryRegion, len: u32) -> SendWr {
    let mut wr = SendWr::new(
        wr_id,
        op,
        vec![Sge {
            addr: mr.va,
            length: len,
            lkey: mr.lkey,
        }],
    );
    wr.flags = SendFlags::SIGNALED;
    wr
}
