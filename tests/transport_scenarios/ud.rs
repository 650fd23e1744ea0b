//! UD: datagrams, GRHs, Q_Keys and address handles.

use super::*;

/// A UD destination QPN must fit the BTH's 24 bits: refused at post, not failed when built
/// (which counted it as a frame too big for its buffer).
#[test]
fn ud_remote_qpn_above_24_bits_is_refused() {
    let mut sim = Sim::new(62, 2, LinkConfig::default());
    let (a, b, ah) = ud_pair(&mut sim);
    let src = sim.nodes[0].alloc(4096, RW);
    let wide = QpEnd {
        qpn: b.qpn | 0x100_0000,
        ..b
    };
    let r = sim.nodes[0].post_send(a.qpn, ud_send(1, ah, wide, QKEY, sge(&src, 0, 60)));
    assert!(matches!(r, Err(VerbsError::Invalid(_))), "{r:?}");
    sim.nodes[0]
        .post_send(a.qpn, ud_send(2, ah, b, QKEY, sge(&src, 0, 60)))
        .unwrap();
    settle(&mut sim);
    assert_eq!(
        ids_and_status(&sim.nodes[0].poll(a.send_cq)),
        [(2, WcStatus::Success)]
    );
    assert_eq!(counters(&sim, 0).tx_too_big_for_buffer, 0);
}

/// UD on IPv4: a datagram with the wrong Q_Key is dropped and counted, leaving the receive
/// WQE for the next one; the right Q_Key delivers it behind the 40-byte GRH area, which for
/// IPv4 is 20 zero bytes and the IPv4 header as received (digest §9.1).
#[test]
fn ud_qkey_check_and_ipv4_grh_area() {
    let mut sim = Sim::new(61, 2, LinkConfig::default());
    let (a, b, ah) = ud_pair(&mut sim);
    let src = sim.nodes[0].alloc(4096, RW);
    let dst = sim.nodes[1].alloc(8192, RW);
    let data = pattern(600, 61);
    sim.nodes[0].bytes_mut(&src)[..600].copy_from_slice(&data);
    // Not zero, so that the GRH's zero bytes are seen to be written.
    sim.nodes[1].bytes_mut(&dst).fill(0xee);
    sim.nodes[1]
        .post_recv(b.qpn, recv_wr(5, &dst, 0, 40 + 1024))
        .unwrap();

    sim.nodes[0]
        .post_send(a.qpn, ud_send(1, ah, b, 0x2222_2222, sge(&src, 0, 600)))
        .unwrap();
    settle(&mut sim);
    assert_eq!(
        ids_and_status(&sim.nodes[0].poll(a.send_cq)),
        [(1, WcStatus::Success)],
        "UD completes once sent, delivered or not"
    );
    assert_eq!(counters(&sim, 1).qkey_violations, 1);
    assert_eq!(cq_len(&sim, 1, b.recv_cq), 0);
    assert!(sim.nodes[1].bytes(&dst).iter().all(|&x| x == 0xee));

    sim.nodes[0]
        .post_send(a.qpn, ud_send(2, ah, b, QKEY, sge(&src, 0, 600)))
        .unwrap();
    settle(&mut sim);
    assert_eq!(
        ids_and_status(&sim.nodes[0].poll(a.send_cq)),
        [(2, WcStatus::Success)]
    );
    let rc = sim.nodes[1].poll(b.recv_cq);
    assert_eq!(ids_and_status(&rc), [(5, WcStatus::Success)]);
    let wc = rc[0];
    assert_eq!(wc.opcode, WcOpcode::Recv);
    assert_eq!(wc.byte_len, 600 + 40);
    assert!(wc.flags.contains(WcFlags::GRH));
    assert!(!wc.flags.contains(WcFlags::WITH_IMM));
    assert_eq!((wc.src_qp, wc.qp_num), (a.qpn, b.qpn));
    assert_eq!(counters(&sim, 1).qkey_violations, 1);

    let buf = sim.nodes[1].bytes(&dst);
    assert_eq!(&buf[..20], &[0u8; 20]);
    let ip = &buf[20..40];
    assert_eq!(ip[0], 0x45, "IPv4, 20-byte header");
    // Total length: IPv4 20 + UDP 8 + BTH 12 + DETH 8 + payload + ICRC 4.
    let total = u16::from_be_bytes([ip[2], ip[3]]);
    assert_eq!(usize::from(total), 20 + 8 + 12 + 8 + 600 + 4);
    assert_eq!(ip[8], 64, "TTL");
    assert_eq!(ip[9], 17, "UDP");
    assert_eq!(&ip[12..16], &[10, 0, 0, 1]);
    assert_eq!(&ip[16..20], &[10, 0, 0, 2]);
    // The header as received, checksum included: it sums to 0xFFFF.
    let mut sum: u32 = ip
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    assert_eq!(sum, 0xffff, "IPv4 header checksum");
    assert_eq!(&buf[40..640], &data[..]);
    assert!(
        buf[640..].iter().all(|&x| x == 0xee),
        "nothing past the data"
    );
}

/// UD on IPv6: the GRH area is the IPv6 header as received.
#[test]
fn ud_ipv6_grh_area_is_the_ipv6_header() {
    let mut sim = Sim::with_addresses(62, vec![node_ipv6(0), node_ipv6(1)], LinkConfig::default());
    let (a, b, ah) = ud_pair(&mut sim);
    let src = sim.nodes[0].alloc(4096, RW);
    let dst = sim.nodes[1].alloc(4096, RW);
    let data = pattern(1000, 62);
    sim.nodes[0].bytes_mut(&src)[..1000].copy_from_slice(&data);
    sim.nodes[1].bytes_mut(&dst).fill(0xee);
    sim.nodes[1]
        .post_recv(b.qpn, recv_wr(6, &dst, 0, 2048))
        .unwrap();
    let mut wr = ud_send(1, ah, b, QKEY, sge(&src, 0, 1000));
    wr.op = SendOp::SendWithImm { imm: 0xfeed };
    sim.nodes[0].post_send(a.qpn, wr).unwrap();
    settle(&mut sim);
    assert_eq!(
        ids_and_status(&sim.nodes[0].poll(a.send_cq)),
        [(1, WcStatus::Success)]
    );
    let rc = sim.nodes[1].poll(b.recv_cq);
    assert_eq!(ids_and_status(&rc), [(6, WcStatus::Success)]);
    let wc = rc[0];
    assert_eq!(wc.byte_len, 1000 + 40);
    assert!(wc.flags.contains(WcFlags::GRH) && wc.flags.contains(WcFlags::WITH_IMM));
    assert_eq!((wc.imm, wc.src_qp), (0xfeed, a.qpn));
    let buf = sim.nodes[1].bytes(&dst);
    let ip = &buf[..40];
    assert_eq!(ip[0] >> 4, 6, "IPv6");
    // Payload length: UDP 8 + BTH 12 + DETH 8 + ImmDt 4 + payload + ICRC 4.
    let payload_len = u16::from_be_bytes([ip[4], ip[5]]);
    assert_eq!(usize::from(payload_len), 8 + 12 + 8 + 4 + 1000 + 4);
    assert_eq!(ip[6], 17, "next header UDP");
    assert_eq!(ip[7], 64, "hop limit");
    let (xroce_core::wire::IpAddress::V6(s), xroce_core::wire::IpAddress::V6(d)) =
        (sim.nodes[0].ip, sim.nodes[1].ip)
    else {
        panic!("IPv6 nodes expected");
    };
    assert_eq!(&ip[8..24], &s.0);
    assert_eq!(&ip[24..40], &d.0);
    assert_eq!(&buf[40..1040], &data[..]);
}

/// A QP's send limits are sized as rdma_rxe sizes a send WQE: the room for `max_send_sge`
/// SGEs (16 bytes each) or `max_inline_data` bytes, whichever is more, and both limits fill it.
/// Asked for 2 SGEs and no inline data, a QP takes 32 inline bytes; asked for 1 SGE and 64
/// inline bytes, it takes 4 SGEs.
#[test]
fn send_limits_fill_the_send_wqe_as_rdma_rxe_sizes_it() {
    for (asked_sge, asked_inline, sge_limit, inline_limit) in [(2, 0, 2, 32), (1, 64, 4, 64)] {
        let mut sim = Sim::new(46, 2, LinkConfig::default());
        let mut o = ConnectOptions::default();
        o.cap.max_send_sge = asked_sge;
        o.cap.max_inline_data = asked_inline;
        let (a, b) = connect(&mut sim, 0, 1, &o);
        let cap = sim.nodes[0].dev.query_qp(a.qpn).unwrap().cap;
        assert_eq!(
            (cap.max_send_sge, cap.max_inline_data),
            (sge_limit, inline_limit),
            "asked for {asked_sge} SGEs and {asked_inline} inline bytes"
        );
        let src = sim.nodes[0].alloc(4096, RW);
        let dst = sim.nodes[1].alloc(4096, RW);
        for (i, b) in sim.nodes[0].bytes_mut(&src).iter_mut().enumerate() {
            *b = i as u8;
        }
        sim.nodes[1]
            .post_recv(b.qpn, recv_wr(1, &dst, 0, 1024))
            .unwrap();
        sim.nodes[1]
            .post_recv(b.qpn, recv_wr(2, &dst, 1024, 1024))
            .unwrap();
        // At the inline limit, and with as many SGEs as the limit allows.
        let mut inline = SendWr::new(1, SendOp::Send, vec![sge(&src, 0, inline_limit)]);
        inline.flags = SendFlags::INLINE | SendFlags::SIGNALED;
        sim.nodes[0].post_send(a.qpn, inline).unwrap();
        let sges: Vec<Sge> = (0..sge_limit)
            .map(|i| sge(&src, u64::from(i) * 8, 8))
            .collect();
        sim.nodes[0]
            .post_send(a.qpn, SendWr::new(2, SendOp::Send, sges))
            .unwrap();
        let rc = wait_cq(&mut sim, 1, b.recv_cq, 2);
        assert_eq!(
            ids_and_status(&rc),
            [(1, WcStatus::Success), (2, WcStatus::Success)]
        );
        let (got, want) = (sim.nodes[1].bytes(&dst), sim.nodes[0].bytes(&src));
        assert_eq!(
            &got[..inline_limit as usize],
            &want[..inline_limit as usize]
        );
        let n = sge_limit as usize * 8;
        assert_eq!(&got[1024..1024 + n], &want[..n]);
        // One byte more inline, or one SGE more, is refused.
        let mut over = SendWr::new(3, SendOp::Send, vec![sge(&src, 0, inline_limit + 1)]);
        over.flags = SendFlags::INLINE;
        assert!(matches!(
            sim.nodes[0].post_send(a.qpn, over),
            Err(VerbsError::Invalid(_))
        ));
        let sges: Vec<Sge> = (0..=sge_limit)
            .map(|i| sge(&src, u64::from(i) * 8, 8))
            .collect();
        assert!(matches!(
            sim.nodes[0].post_send(a.qpn, SendWr::new(4, SendOp::Send, sges)),
            Err(VerbsError::Invalid(_))
        ));
    }
}

/// A QP whose source address was removed from the interface (its GID slot now empty) cannot
/// send: the work request fails with a local QP operation error, as on rdma_rxe, and is
/// counted, so that the engine can say why (nothing else would).
#[test]
fn a_send_after_the_source_address_went_fails_and_is_counted() {
    let mut sim = Sim::new(65, 2, LinkConfig::default());
    let (a, b) = connect(&mut sim, 0, 1, &ConnectOptions::default());
    let src = sim.nodes[0].alloc(4096, RW);
    let dst = sim.nodes[1].alloc(4096, RW);
    sim.nodes[1]
        .post_recv(b.qpn, recv_wr(1, &dst, 0, 64))
        .unwrap();
    sim.nodes[0]
        .post_send(a.qpn, SendWr::new(1, SendOp::Send, vec![sge(&src, 0, 64)]))
        .unwrap();
    let sc = wait_cq(&mut sim, 0, a.send_cq, 1);
    assert_eq!(ids_and_status(&sc), [(1, WcStatus::Success)]);
    assert_eq!(counters(&sim, 0).tx_no_source_address, 0);

    sim.nodes[0].dev.set_gids(vec![None]);
    sim.nodes[0]
        .post_send(a.qpn, SendWr::new(2, SendOp::Send, vec![sge(&src, 0, 64)]))
        .unwrap();
    let sc = wait_cq(&mut sim, 0, a.send_cq, 1);
    assert_eq!(ids_and_status(&sc), [(2, WcStatus::LocQpOpErr)]);
    let c = counters(&sim, 0);
    assert_eq!(c.tx_no_source_address, 1);
    assert_eq!(c.tx_too_big_for_buffer, 0, "not taken for a packet too big");
}

/// A QP reuses the IP and UDP headers of its last packet while the path stays the same: a UD
/// QP sending to two peers in turn, before and after its source address changes, must still
/// send each packet with the addresses of its own path (and a valid IPv4 checksum, which
/// covers them).
#[test]
fn each_packet_carries_its_own_paths_addresses() {
    let mut sim = Sim::new(64, 3, LinkConfig::default());
    let (a, b, ah_b) = xroce_tests::sim::ud_pair(&mut sim, 0, 1);
    let (_, c, ah_c) = xroce_tests::sim::ud_pair(&mut sim, 0, 2);
    let src = sim.nodes[0].alloc(4096, RW);
    let dst_b = sim.nodes[1].alloc(8192, RW);
    let dst_c = sim.nodes[2].alloc(8192, RW);
    sim.trace = Some(Vec::new());
    // Two rounds: the second after node 0's address changed (its GID table follows the
    // interface, as the engine's address watcher makes it).
    let moved = xroce_core::wire::IpAddress::V4(xroce_core::wire::Ipv4Address([10, 0, 0, 99]));
    for round in 0..2u64 {
        if round == 1 {
            sim.nodes[0].dev.set_gids(vec![Some(moved)]);
            sim.nodes[0].ip = moved;
        }
        for i in 0..4u64 {
            // The second round starts with the peer the first ended with: only the source
            // address differs from the last packet's path.
            let (node, to, ah, mr) = if (i + round) % 2 == 0 {
                (1, b, ah_b, &dst_b)
            } else {
                (2, c, ah_c, &dst_c)
            };
            let wr_id = round * 10 + i;
            sim.nodes[node]
                .post_recv(to.qpn, recv_wr(wr_id, mr, 1024 * i, 1024))
                .unwrap();
            sim.nodes[0]
                .post_send(a.qpn, ud_send(wr_id, ah, to, QKEY, sge(&src, 0, 64)))
                .unwrap();
        }
        settle(&mut sim);
        let got_b = ids_and_status(&sim.nodes[1].poll(b.recv_cq));
        let got_c = ids_and_status(&sim.nodes[2].poll(c.recv_cq));
        let ok = WcStatus::Success;
        let (even, odd) = (
            [(round * 10, ok), (round * 10 + 2, ok)],
            [(round * 10 + 1, ok), (round * 10 + 3, ok)],
        );
        let (to_b, to_c) = if round == 0 { (even, odd) } else { (odd, even) };
        assert_eq!(got_b, to_b);
        assert_eq!(got_c, to_c);
    }
    let sent_by_0 = frames_sent_by(sim.trace.as_ref().unwrap(), 0);
    let nodes: Vec<_> = sim.nodes.iter().map(|n| n.ip).collect();
    let mut to_c = 0;
    for f in &sent_by_0 {
        f.verify().expect("checksums and ICRC");
        let ip = f.headers.ip;
        let (src, dst) = (ip.src_addr(), ip.dst_addr());
        assert!(src == xroce_tests::sim::node_ipv4(0) || src == moved);
        assert!(dst == nodes[1] || dst == nodes[2], "{dst}");
        to_c += usize::from(dst == nodes[2]);
    }
    assert_eq!(to_c, 4, "two datagrams per round to node 2");
    let from_moved = sent_by_0
        .iter()
        .filter(|f| f.headers.ip.src_addr() == moved)
        .count();
    // The second round's four datagrams, none of the first's.
    assert_eq!(from_moved, 4);
}

/// The traffic class is part of a path: datagrams to one peer through address handles that
/// differ only in it carry each its own (a reused header would keep the first one's).
#[test]
fn a_traffic_class_of_its_own_makes_a_path_of_its_own() {
    let mut sim = Sim::new(66, 2, LinkConfig::default());
    let (a, b, ah_plain) = ud_pair(&mut sim);
    let ah_marked = xroce_tests::sim::address_handle(&mut sim, 0, 1, 0x68);
    let src = sim.nodes[0].alloc(4096, RW);
    let dst = sim.nodes[1].alloc(8192, RW);
    sim.trace = Some(Vec::new());
    let ahs = [ah_plain, ah_marked, ah_marked, ah_plain];
    for (i, ah) in ahs.iter().enumerate() {
        let i = i as u64;
        sim.nodes[1]
            .post_recv(b.qpn, recv_wr(i, &dst, 1024 * i, 1024))
            .unwrap();
        sim.nodes[0]
            .post_send(a.qpn, ud_send(i, *ah, b, QKEY, sge(&src, 0, 64)))
            .unwrap();
        settle(&mut sim);
    }
    assert_eq!(sim.nodes[1].poll(b.recv_cq).len(), 4);
    let tos: Vec<u8> = frames_sent_by(sim.trace.as_ref().unwrap(), 0)
        .iter()
        .map(|f| {
            f.verify().expect("checksums and ICRC");
            f.headers.ip.traffic_class()
        })
        .collect();
    assert_eq!(tos, [0, 0x68, 0x68, 0]);
}

/// UD limits: a datagram larger than the receive buffer (with its 40 GRH bytes) is dropped and
/// the WQE kept; a send larger than the port MTU completes successfully without a packet.
#[test]
fn ud_too_long_for_the_buffer_or_the_mtu() {
    let mut sim = Sim::new(63, 2, LinkConfig::default());
    let (a, b, ah) = ud_pair(&mut sim);
    let src = sim.nodes[0].alloc(8192, RW);
    let dst = sim.nodes[1].alloc(4096, RW);
    // 100 + 40 > 120: too long.
    sim.nodes[1]
        .post_recv(b.qpn, recv_wr(7, &dst, 0, 120))
        .unwrap();
    sim.nodes[0]
        .post_send(a.qpn, ud_send(1, ah, b, QKEY, sge(&src, 0, 100)))
        .unwrap();
    settle(&mut sim);
    assert_eq!(counters(&sim, 1).ud_too_long, 1);
    assert_eq!(cq_len(&sim, 1, b.recv_cq), 0);
    // The WQE is still there for a datagram that fits.
    sim.nodes[0]
        .post_send(a.qpn, ud_send(2, ah, b, QKEY, sge(&src, 0, 80)))
        .unwrap();
    settle(&mut sim);
    let rc = sim.nodes[1].poll(b.recv_cq);
    assert_eq!(ids_and_status(&rc), [(7, WcStatus::Success)]);
    assert_eq!(rc[0].byte_len, 120);

    // Port MTU 4096 in the simulator: 4097 bytes are never sent (digest §9.1).
    let sent = counters(&sim, 0).tx_requests;
    sim.nodes[0]
        .post_send(a.qpn, ud_send(3, ah, b, QKEY, sge(&src, 0, 4097)))
        .unwrap();
    settle(&mut sim);
    let sc = sim.nodes[0].poll(a.send_cq);
    assert_eq!(
        ids_and_status(&sc),
        [
            (1, WcStatus::Success),
            (2, WcStatus::Success),
            (3, WcStatus::Success)
        ]
    );
    assert_eq!(counters(&sim, 0).tx_requests, sent);
}
