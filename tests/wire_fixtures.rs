//! The wire layer against real rdma_rxe captures: every packet parses, re-emits byte-identical
//! and verifies; truncations, bit flips and malformed variants are rejected without panics.

use std::collections::BTreeSet;

use xroce_core::icrc;
use xroce_core::wire::{
    emit_frame, EtherType, IpRepr, Ipv6Address, Ipv6Repr, Opcode, RoceFrame, VlanTag, WireError,
};
use xroce_tests::{fixture_frames, RXE_CAPTURES};

/// Re-emits a parsed frame into a fresh buffer.
fn reemit(f: &RoceFrame) -> Vec<u8> {
    let mut buf = vec![0u8; 10_000];
    let n = emit_frame(&mut buf, &f.headers, f.payload).expect("emit");
    buf.truncate(n);
    buf
}

/// Offset of the IP header in an Ethernet frame.
fn ip_offset(frame: &[u8]) -> usize {
    if frame[12..14] == [0x81, 0x00] {
        18
    } else {
        14
    }
}

#[test]
fn rxe_captures_roundtrip_byte_identical_and_verify() {
    for name in RXE_CAPTURES {
        let mut opcodes = BTreeSet::new();
        for (i, frame) in fixture_frames(name).iter().enumerate() {
            let f = RoceFrame::parse_ethernet(frame)
                .unwrap_or_else(|e| panic!("{name} #{}: {e}", i + 1));
            f.verify()
                .unwrap_or_else(|e| panic!("{name} #{}: {e}", i + 1));
            let out = reemit(&f);
            // Anything after the IP packet is Ethernet padding of a minimum-size frame.
            assert!(out.len() <= frame.len(), "{name} #{}", i + 1);
            assert_eq!(
                &out[..],
                &frame[..out.len()],
                "{name} #{}: re-emitted frame differs",
                i + 1
            );
            if out.len() < frame.len() {
                assert_eq!(frame.len(), 60, "{name} #{}: unexpected trailer", i + 1);
            }
            opcodes.insert(f.headers.transport.bth.opcode);
        }
        // The captures hold what their names promise.
        let expect: &[Opcode] = match name {
            "rc_pingpong.pcap" => &[
                Opcode::RC_SEND_FIRST,
                Opcode::RC_SEND_LAST,
                Opcode::RC_ACKNOWLEDGE,
            ],
            "ud_pingpong.pcap" => &[Opcode::UD_SEND_ONLY],
            "ib_write_bw.pcap" => &[Opcode::RC_RDMA_WRITE_FIRST, Opcode::RC_RDMA_WRITE_LAST],
            "ib_read_bw.pcap" => &[
                Opcode::RC_RDMA_READ_REQUEST,
                Opcode::RC_RDMA_READ_RESPONSE_FIRST,
                Opcode::RC_RDMA_READ_RESPONSE_LAST,
            ],
            _ => unreachable!(),
        };
        for op in expect {
            assert!(opcodes.contains(op), "{name}: no {op:?} in {opcodes:?}");
        }
    }
}

#[test]
fn every_truncation_of_every_fixture_is_rejected_without_panic() {
    for name in RXE_CAPTURES {
        for frame in fixture_frames(name) {
            let full = RoceFrame::parse_ethernet(&frame).expect("fixture parses");
            let real_len = ip_offset(&frame) + full.ip_packet.len();
            for cut in 0..real_len {
                let r = RoceFrame::parse_ethernet(&frame[..cut]);
                assert!(r.is_err(), "{name}: truncated to {cut} bytes still parsed");
                let ip = &frame[ip_offset(&frame).min(cut)..cut];
                assert!(!matches!(icrc::verify(ip), Ok(true)));
            }
        }
    }
}

/// Byte offsets (from the IP header) of the fields the ICRC masks out.
fn masked_bytes(ip: &IpRepr) -> Vec<usize> {
    match ip {
        // TOS, TTL, header checksum; UDP checksum; BTH byte 4.
        IpRepr::V4(_) => vec![1, 8, 10, 11, 26, 27, 32],
        // Traffic class + flow label (bits 4..32), hop limit; UDP checksum; BTH byte 4.
        IpRepr::V6(_) => vec![1, 2, 3, 7, 46, 47, 52],
    }
}

/// Flips every bit of the ICRC-covered region (and of the ICRC itself) one at a time.
fn check_bit_flips(ip_packet: &[u8], ip: &IpRepr, what: &str) {
    assert!(icrc::verify(ip_packet).unwrap(), "{what}: baseline");
    let masked = masked_bytes(ip);
    let mut pkt = ip_packet.to_vec();
    for byte in 0..pkt.len() {
        for bit in 0..8 {
            // IPv6 byte 0 holds the version (covered) and the top of the traffic class (masked).
            let is_masked =
                masked.contains(&byte) || (matches!(ip, IpRepr::V6(_)) && byte == 0 && bit < 4);
            pkt[byte] ^= 1 << bit;
            let ok = matches!(icrc::verify(&pkt), Ok(true));
            pkt[byte] ^= 1 << bit;
            if is_masked {
                assert!(
                    ok,
                    "{what}: flip in masked byte {byte} bit {bit} broke the ICRC"
                );
            } else {
                assert!(!ok, "{what}: flip at byte {byte} bit {bit} went unnoticed");
            }
        }
    }
}

#[test]
fn single_bit_flips_fail_verification_except_in_masked_fields() {
    for name in RXE_CAPTURES {
        let mut seen = BTreeSet::new();
        for frame in fixture_frames(name) {
            let f = RoceFrame::parse_ethernet(&frame).unwrap();
            // One frame per opcode keeps the debug-build run short.
            if seen.insert(f.headers.transport.bth.opcode) {
                check_bit_flips(f.ip_packet, &f.headers.ip, name);
            }
        }
    }
    // The same over IPv6: rebuild an rxe frame with an IPv6 header.
    let frame = &fixture_frames("rc_pingpong.pcap")[0];
    let f = RoceFrame::parse_ethernet(frame).unwrap();
    let mut h = f.headers;
    let mut eth = h.eth.unwrap();
    eth.ethertype = EtherType::Ipv6;
    h.eth = Some(eth);
    h.ip = IpRepr::V6(Ipv6Repr {
        src: Ipv6Address([0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]),
        dst: Ipv6Address([0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]),
        traffic_class: 0x0a,
        flow_label: 0x12345,
        next_header: 17,
        hop_limit: 64,
        payload_len: 0,
    });
    let mut buf = vec![0u8; 10_000];
    let n = emit_frame(&mut buf, &h, f.payload).unwrap();
    let v6 = RoceFrame::parse_ethernet(&buf[..n]).unwrap();
    v6.verify().unwrap();
    check_bit_flips(v6.ip_packet, &v6.headers.ip, "IPv6 rebuild");
}

/// The first frame of the RC ping-pong capture, for mutation.
fn sample() -> Vec<u8> {
    fixture_frames("rc_pingpong.pcap").swap_remove(0)
}

#[test]
fn malformed_variants_are_errors() {
    let base = sample();
    let ip = 14;
    let udp = ip + 20;
    let bth = udp + 8;

    // IP total length beyond the frame.
    let mut f = base.clone();
    f[ip + 2..ip + 4].copy_from_slice(&0xffffu16.to_be_bytes());
    assert!(matches!(
        RoceFrame::parse_ethernet(&f),
        Err(WireError::Truncated { .. })
    ));
    // IP total length below the header length.
    let mut f = base.clone();
    f[ip + 2..ip + 4].copy_from_slice(&10u16.to_be_bytes());
    assert!(matches!(
        RoceFrame::parse_ethernet(&f),
        Err(WireError::BadLength { .. })
    ));
    // UDP length disagreeing with the IP length.
    let mut f = base.clone();
    let udp_len = u16::from_be_bytes([f[udp + 4], f[udp + 5]]);
    f[udp + 4..udp + 6].copy_from_slice(&(udp_len - 4).to_be_bytes());
    assert!(matches!(
        RoceFrame::parse_ethernet(&f),
        Err(WireError::BadLength { .. })
    ));
    // UDP length below its header.
    let mut f = base.clone();
    f[udp + 4..udp + 6].copy_from_slice(&4u16.to_be_bytes());
    assert!(RoceFrame::parse_ethernet(&f).is_err());

    // Unknown opcodes.
    for op in [0x15u8, 0x18, 0x1e, 0x30, 0x66, 0x80, 0xff] {
        let mut f = base.clone();
        f[bth] = op;
        assert_eq!(
            RoceFrame::parse_ethernet(&f).unwrap_err(),
            WireError::UnknownOpcode(op)
        );
    }
    // Transport version 1.
    let mut f = base.clone();
    f[bth + 1] |= 1;
    assert_eq!(
        RoceFrame::parse_ethernet(&f).unwrap_err(),
        WireError::TransportVersion(1)
    );
    // A pad count larger than what follows the headers: an ACK (no payload) claiming pad 3.
    let ack = fixture_frames("rc_pingpong.pcap")
        .into_iter()
        .find(|fr| fr[bth] == Opcode::RC_ACKNOWLEDGE.0)
        .expect("an ACK in the capture");
    let mut f = ack.clone();
    f[bth + 1] |= 0x30;
    assert!(matches!(
        RoceFrame::parse_ethernet(&f),
        Err(WireError::BadPadCount { pad: 3, .. })
    ));
    // Payload bytes on an opcode that carries none: relabel a SEND_FIRST as an ACK.
    let mut f = base.clone();
    assert_eq!(f[bth], Opcode::RC_SEND_FIRST.0);
    f[bth] = Opcode::RC_ACKNOWLEDGE.0;
    assert!(matches!(
        RoceFrame::parse_ethernet(&f),
        Err(WireError::BadLength { .. })
    ));
    // An opcode whose headers do not fit: a 12-byte BTH-only SEND relabelled as a
    // 40-byte-header atomic on a packet with too few bytes.
    let send_only_small = {
        let mut h = RoceFrame::parse_ethernet(&ack).unwrap().headers;
        h.transport.aeth = None;
        h.transport.bth.opcode = Opcode::RC_SEND_ONLY;
        let mut buf = vec![0u8; 200];
        let n = emit_frame(&mut buf, &h, b"").unwrap();
        buf.truncate(n);
        buf
    };
    let mut f = send_only_small.clone();
    f[bth] = Opcode::RC_COMPARE_SWAP.0;
    assert!(matches!(
        RoceFrame::parse_ethernet(&f),
        Err(WireError::Truncated { .. })
    ));
}

#[test]
fn ipv4_options_are_rejected_only_for_rocev2() {
    let base = sample();
    // Insert 4 bytes of options (NOPs) after the 20-byte header and fix the lengths.
    let mut f = base[..34].to_vec();
    f.extend([1, 1, 1, 1]);
    f.extend(&base[34..]);
    f[14] = 0x46;
    let total = u16::from_be_bytes([f[16], f[17]]) + 4;
    f[16..18].copy_from_slice(&total.to_be_bytes());
    assert_eq!(
        RoceFrame::parse_ethernet(&f).unwrap_err(),
        WireError::Ipv4Options { ihl: 6 }
    );
    // The same packet as TCP is simply not RoCEv2.
    f[14 + 9] = 6;
    assert!(matches!(
        RoceFrame::parse_ethernet(&f),
        Err(WireError::NotRoce(_))
    ));
}

#[test]
fn non_roce_traffic_is_classified_as_such() {
    let base = sample();
    // ARP.
    let mut f = base.clone();
    f[12..14].copy_from_slice(&[0x08, 0x06]);
    assert!(matches!(
        RoceFrame::parse_ethernet(&f),
        Err(WireError::NotRoce(_))
    ));
    // Another UDP port.
    let mut f = base.clone();
    f[36..38].copy_from_slice(&53u16.to_be_bytes());
    assert!(matches!(
        RoceFrame::parse_ethernet(&f),
        Err(WireError::NotRoce(_))
    ));
}

#[test]
fn vlan_tagged_frame_parses_verifies_and_roundtrips() {
    let base = sample();
    let mut f = base[..12].to_vec();
    f.extend([0x81, 0x00, 0x20, 0x2a]); // PCP 1, VID 42
    f.extend(&base[12..]);
    let parsed = RoceFrame::parse_ethernet(&f).unwrap();
    parsed.verify().unwrap(); // the tag is outside the ICRC
    let eth = parsed.headers.eth.unwrap();
    assert_eq!(
        eth.vlan,
        Some(VlanTag {
            pcp: 1,
            dei: false,
            vid: 42
        })
    );
    assert_eq!(reemit(&parsed), f);
    assert_eq!(
        parsed.headers.transport,
        RoceFrame::parse_ethernet(&base).unwrap().headers.transport
    );
}

#[test]
fn ipv4_header_checksum_and_udp_checksum_are_checked_separately_from_the_icrc() {
    let base = sample();
    // TTL is masked out of the ICRC but covered by the IPv4 header checksum.
    let mut f = base.clone();
    f[14 + 8] ^= 0x01;
    let p = RoceFrame::parse_ethernet(&f).unwrap();
    assert!(p.icrc_ok());
    assert_eq!(p.verify().unwrap_err(), WireError::Ipv4Checksum);
    // A wrong non-zero UDP checksum.
    let mut f = base.clone();
    f[40..42].copy_from_slice(&[0x12, 0x34]);
    let p = RoceFrame::parse_ethernet(&f).unwrap();
    assert!(p.icrc_ok());
    assert_eq!(p.verify().unwrap_err(), WireError::UdpChecksum);
}
