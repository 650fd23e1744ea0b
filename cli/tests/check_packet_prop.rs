//! `check_packet` on arbitrary captured bytes, for every link type: never a panic, and a RoCEv2
//! frame behind any supported link header is recognised.

use proptest::prelude::*;
use xroce_cli::capture::{CapturedPacket, LinkLayer};
use xroce_cli::pcap_check::{check_packet, Verdict};
use xroce_tests::fixture_frames;

fn links() -> impl Strategy<Value = LinkLayer> {
    prop::sample::select(vec![
        LinkLayer::Ethernet,
        LinkLayer::RawIp,
        LinkLayer::LinuxSll,
        LinkLayer::LinuxSll2,
        LinkLayer::Other(147),
    ])
}

fn packet(link: LinkLayer, data: Vec<u8>) -> CapturedPacket {
    let original_len = data.len();
    CapturedPacket {
        timestamp_ns: 0,
        link,
        data,
        original_len,
    }
}

/// Wraps the IP packet of an Ethernet fixture frame in another link header.
fn rewrap(link: LinkLayer, eth_frame: &[u8]) -> Vec<u8> {
    let ip = &eth_frame[14..];
    let mut out = match link {
        LinkLayer::Ethernet => eth_frame[..14].to_vec(),
        LinkLayer::RawIp => Vec::new(),
        LinkLayer::LinuxSll => {
            let mut h = vec![0u8; 14];
            h.extend([0x08, 0x00]);
            h
        }
        LinkLayer::LinuxSll2 => {
            let mut h = vec![0x08, 0x00];
            h.extend([0u8; 18]);
            h
        }
        LinkLayer::Other(_) => Vec::new(),
    };
    out.extend(ip);
    out
}

proptest! {
    #[test]
    fn short_and_random_captures_never_panic(
        link in links(),
        lead in prop::sample::select(vec![vec![], vec![0x08, 0x00], vec![0x86, 0xdd]]),
        rest in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        let mut data = lead;
        data.extend(rest);
        let _ = check_packet(&packet(link, data));
    }

    #[test]
    fn truncated_rewrapped_frames_never_panic(
        link in links(),
        which in 0usize..100,
        cut in any::<prop::sample::Index>(),
    ) {
        let frames = fixture_frames("rc_pingpong.pcap");
        let data = rewrap(link, &frames[which % frames.len()]);
        let cut = cut.index(data.len() + 1);
        let _ = check_packet(&packet(link, data[..cut].to_vec()));
    }
}

#[test]
fn every_supported_link_type_finds_the_rocev2_frame() {
    let frame = &fixture_frames("rc_pingpong.pcap")[0];
    for link in [
        LinkLayer::Ethernet,
        LinkLayer::RawIp,
        LinkLayer::LinuxSll,
        LinkLayer::LinuxSll2,
    ] {
        let v = check_packet(&packet(link, rewrap(link, frame)));
        assert!(matches!(v, Verdict::Ok(_)), "{link:?}: {v:?}");
    }
    assert_eq!(
        check_packet(&packet(
            LinkLayer::Other(147),
            rewrap(LinkLayer::Other(147), frame)
        )),
        Verdict::NotRoce
    );
}
