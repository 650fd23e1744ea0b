//! Property tests: random header `Repr`s round-trip through emit/parse, and random or mutated
//! bytes never make the parser panic.

use proptest::prelude::*;
use xroce_core::icrc;
use xroce_core::wire::opcode::{HeaderKind, OPCODE_TABLE};
use xroce_core::wire::transport::pad_for;
use xroce_core::wire::{
    emit_ack_on_path, emit_frame, AethRepr, AethSyndrome, AtomicAckEthRepr, AtomicEthRepr, BthRepr,
    DethRepr, EtherType, EthernetAddress, EthernetRepr, FethRepr, FrameHeaders, FrameWriter,
    IpRepr, Ipv4Address, Ipv4Repr, Ipv6Address, Ipv6Repr, Opcode, PathHeaders, RdethRepr, RethRepr,
    RoceFrame, TransportRepr, UdpRepr, VlanTag, ROCEV2_UDP_PORT,
};

fn known_opcodes() -> Vec<u8> {
    (0..=255u8)
        .filter(|&o| OPCODE_TABLE[usize::from(o)].is_some())
        .collect()
}

prop_compose! {
    fn arb_bth(opcode: u8)(
        solicited in any::<bool>(), mig_req in any::<bool>(), pkey in any::<u16>(), fecn in any::<bool>(), becn in any::<bool>(),
        dest_qpn in 0u32..0x100_0000, ack_req in any::<bool>(), psn in 0u32..0x100_0000,
    ) -> BthRepr {
        BthRepr { opcode: Opcode(opcode), solicited, mig_req, pad_count: 0, pkey, fecn, becn,
                  dest_qpn, ack_req, psn }
    }
}

prop_compose! {
    /// A transport repr whose headers are exactly those its (random, known) opcode needs.
    fn arb_transport()(op in prop::sample::select(known_opcodes()))(
        bth in arb_bth(op),
        ee in 0u32..0x100_0000, qkey in any::<u32>(), src_qpn in 0u32..0x100_0000,
        va in any::<u64>(), rkey in any::<u32>(), len in any::<u32>(), swap in any::<u64>(), cmp in any::<u64>(),
        syn in any::<u8>(), msn in 0u32..0x100_0000, orig in any::<u64>(), imm in any::<u32>(), inv in any::<u32>(),
    ) -> TransportRepr {
        let h = bth.opcode.info().unwrap().headers;
        let mut t = TransportRepr::new(bth);
        let has = |k| h.contains(k);
        t.rdeth = has(HeaderKind::Rdeth).then_some(RdethRepr { ee_context: ee });
        t.deth = has(HeaderKind::Deth).then_some(DethRepr { qkey, src_qpn });
        t.feth = has(HeaderKind::Feth)
            .then_some(FethRepr { selectivity: syn & 3, placement: (syn >> 2) & 0xf });
        t.reth = has(HeaderKind::Reth).then_some(RethRepr { va, rkey, dma_len: len });
        t.atomic_eth = has(HeaderKind::AtomicEth)
            .then_some(AtomicEthRepr { va, rkey, swap_add: swap, compare: cmp });
        t.aeth = has(HeaderKind::Aeth)
            .then_some(AethRepr { syndrome: AethSyndrome::from(syn), msn });
        t.atomic_ack_eth = has(HeaderKind::AtomicAckEth).then_some(AtomicAckEthRepr { orig });
        t.immediate = has(HeaderKind::ImmDt).then_some(imm);
        t.invalidate_rkey = has(HeaderKind::Ieth).then_some(inv);
        t
    }
}

fn arb_ip() -> impl Strategy<Value = IpRepr> {
    prop_oneof![
        (
            any::<[u8; 4]>(),
            any::<[u8; 4]>(),
            any::<u8>(),
            any::<u16>(),
            any::<bool>(),
            any::<u8>()
        )
            .prop_map(|(s, d, tos, ident, df, ttl)| IpRepr::V4(Ipv4Repr {
                src: Ipv4Address(s),
                dst: Ipv4Address(d),
                tos,
                ident,
                dont_frag: df,
                ttl,
                protocol: 17,
                payload_len: 0,
            })),
        (
            any::<[u8; 16]>(),
            any::<[u8; 16]>(),
            any::<u8>(),
            0u32..0x10_0000,
            any::<u8>()
        )
            .prop_map(|(s, d, tc, fl, hl)| IpRepr::V6(Ipv6Repr {
                src: Ipv6Address(s),
                dst: Ipv6Address(d),
                traffic_class: tc,
                flow_label: fl,
                next_header: 17,
                hop_limit: hl,
                payload_len: 0,
            })),
    ]
}

prop_compose! {
    fn arb_frame()(
        transport in arb_transport(), ip in arb_ip(),
        src in any::<[u8; 6]>(), dst in any::<[u8; 6]>(), vlan in prop::option::of((0u8..8, any::<bool>(), 0u16..4096)),
        sport in any::<u16>(), payload_len in 0usize..4200, fill in any::<u8>(),
    ) -> (FrameHeaders, Vec<u8>) {
        let eth = EthernetRepr {
            src: EthernetAddress(src),
            dst: EthernetAddress(dst),
            vlan: vlan.map(|(pcp, dei, vid)| VlanTag { pcp, dei, vid }),
            ethertype: match ip { IpRepr::V4(_) => EtherType::Ipv4, IpRepr::V6(_) => EtherType::Ipv6 },
        };
        let carries = transport.info().unwrap().has_payload();
        let payload: Vec<u8> = if carries {
            (0..payload_len).map(|i| (i as u8).wrapping_mul(31) ^ fill).collect()
        } else {
            Vec::new()
        };
        let udp = UdpRepr { src_port: sport, dst_port: ROCEV2_UDP_PORT, payload_len: 0 };
        (FrameHeaders { eth: Some(eth), ip, udp, transport }, payload)
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, .. ProptestConfig::default() })]

    #[test]
    fn random_frames_roundtrip((headers, payload) in arb_frame()) {
        let mut buf = vec![0u8; 9000];
        let n = emit_frame(&mut buf, &headers, &payload).unwrap();
        let f = RoceFrame::parse_ethernet(&buf[..n]).unwrap();
        prop_assert!(f.verify().is_ok());
        prop_assert_eq!(f.payload, &payload[..]);

        let t_len = headers.transport.packet_len(payload.len()).unwrap();
        prop_assert_eq!(f.headers.udp.payload_len, t_len);
        prop_assert_eq!(f.headers.ip.payload_len(), 8 + t_len);
        prop_assert_eq!(usize::from(f.headers.transport.bth.pad_count), pad_for(payload.len()));

        let mut expect = headers;
        expect.ip.set_payload_len(8 + t_len);
        expect.udp.payload_len = t_len;
        expect.transport.bth.pad_count = pad_for(payload.len()) as u8;
        prop_assert_eq!(f.headers, expect);

        // Emitting the parsed headers again gives the same bytes.
        let mut again = vec![0u8; 9000];
        let m = emit_frame(&mut again, &f.headers, f.payload).unwrap();
        prop_assert_eq!(&again[..m], &buf[..n]);
    }

    /// The ACK builder that skips the generic header walk writes the bytes the generic
    /// writer does, on any path; and it builds nothing but ACKs.
    #[test]
    fn acks_built_directly_match_the_generic_writer(
        bth in arb_bth(Opcode::RC_ACKNOWLEDGE.0), pad in 0u8..4, ip in arb_ip(), sport in any::<u16>(),
        ident in any::<u16>(), syn in any::<u8>(), msn in 0u32..0x100_0000, other in any::<u8>(),
    ) {
        let udp = UdpRepr { src_port: sport, dst_port: ROCEV2_UDP_PORT, payload_len: 0 };
        let path = PathHeaders::new(&ip, &udp).unwrap();
        let aeth = AethRepr { syndrome: AethSyndrome::from(syn), msn };
        let bth = BthRepr { pad_count: pad, ..bth };
        let mut t = TransportRepr::new(bth);
        t.aeth = Some(aeth);
        let mut generic = vec![0xa5u8; 256];
        let n = FrameWriter::on_path(&mut generic, &path, ident, &t, 0).unwrap().finish().unwrap();
        let mut direct = vec![0x5au8; 256];
        let m = emit_ack_on_path(&mut direct, &path, ident, &bth, &aeth).unwrap();
        prop_assert_eq!(&direct[..m], &generic[..n]);
        prop_assert!(RoceFrame::parse_ip(&direct[..m]).unwrap().verify().is_ok());
        // Too small a buffer, or another opcode: refused.
        prop_assert!(emit_ack_on_path(&mut direct[..m - 1], &path, ident, &bth, &aeth).is_err());
        if other != Opcode::RC_ACKNOWLEDGE.0 {
            let wrong = BthRepr { opcode: Opcode(other), ..bth };
            prop_assert!(emit_ack_on_path(&mut direct, &path, ident, &wrong, &aeth).is_err());
        }
    }

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        let _ = RoceFrame::parse_ethernet(&bytes);
        let _ = RoceFrame::parse_ip(&bytes);
        let _ = icrc::verify(&bytes);
    }

    #[test]
    fn mutated_frames_never_panic(
        (headers, payload) in arb_frame(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut buf = vec![0u8; 9000];
        let n = emit_frame(&mut buf, &headers, &payload).unwrap();
        let frame = &mut buf[..n];
        for (at, v) in edits {
            let i = at.index(frame.len());
            frame[i] = v;
        }
        let cut = cut.index(frame.len() + 1);
        if let Ok(f) = RoceFrame::parse_ethernet(&frame[..cut]) {
            let _ = f.verify();
            let _ = f.to_string();
        }
    }
}
