//! Helpers shared by xroce's integration tests.

pub mod sim;

use std::path::PathBuf;

use xroce_cli::capture::{self, CapturedPacket, LinkLayer};

/// The real rdma_rxe captures copied from `shared/pcap/` (see `fixtures/README.md`).
pub const RXE_CAPTURES: [&str; 4] = [
    "rc_pingpong.pcap",
    "ud_pingpong.pcap",
    "ib_write_bw.pcap",
    "ib_read_bw.pcap",
];

pub fn fixture_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/pcap")
        .join(name)
}

/// Every packet of a fixture capture; all rxe fixtures are Ethernet captures.
pub fn fixture_frames(name: &str) -> Vec<Vec<u8>> {
    let packets: Vec<CapturedPacket> = capture::read_file(&fixture_path(name))
        .unwrap_or_else(|e| panic!("reading fixture {name}: {e}"));
    assert!(!packets.is_empty(), "fixture {name} is empty");
    packets
        .into_iter()
        .map(|p| {
            assert_eq!(p.link, LinkLayer::Ethernet, "{name}");
            assert_eq!(
                p.data.len(),
                p.original_len,
                "{name}: snap length cut a packet"
            );
            p.data
        })
        .collect()
}

/// Builds a minimal little-endian pcapng file (SHB, one Ethernet IDB with the given timestamp
/// resolution option, one EPB per frame), to test the pcapng path without external tools.
pub fn pcapng_bytes(frames: &[(u64, &[u8])], tsresol: Option<u8>) -> Vec<u8> {
    fn block(out: &mut Vec<u8>, kind: u32, body: &[u8]) {
        let pad = body.len().wrapping_neg() & 3;
        let len = (12 + body.len() + pad) as u32;
        out.extend(kind.to_le_bytes());
        out.extend(len.to_le_bytes());
        out.extend(body);
        out.extend(std::iter::repeat_n(0u8, pad));
        out.extend(len.to_le_bytes());
    }
    let mut out = Vec::new();
    let mut shb = Vec::new();
    shb.extend(0x1a2b_3c4du32.to_le_bytes());
    shb.extend(1u16.to_le_bytes());
    shb.extend(0u16.to_le_bytes());
    shb.extend((-1i64).to_le_bytes());
    block(&mut out, 0x0a0d_0d0a, &shb);
    let mut idb = Vec::new();
    idb.extend(1u16.to_le_bytes()); // LINKTYPE_ETHERNET
    idb.extend(0u16.to_le_bytes());
    idb.extend(0u32.to_le_bytes()); // snaplen: unlimited
    if let Some(r) = tsresol {
        idb.extend(9u16.to_le_bytes()); // if_tsresol
        idb.extend(1u16.to_le_bytes());
        idb.extend([r, 0, 0, 0]);
        idb.extend([0u8; 4]); // opt_endofopt
    }
    block(&mut out, 1, &idb);
    for (ts, data) in frames {
        let mut epb = Vec::new();
        epb.extend(0u32.to_le_bytes());
        epb.extend(((ts >> 32) as u32).to_le_bytes());
        epb.extend((*ts as u32).to_le_bytes());
        epb.extend((data.len() as u32).to_le_bytes());
        epb.extend((data.len() as u32).to_le_bytes());
        epb.extend(*data);
        epb.extend(std::iter::repeat_n(0u8, data.len().wrapping_neg() & 3));
        block(&mut out, 6, &epb);
    }
    out
}

/// Builds a classic little-endian microsecond pcap file with Ethernet link type.
pub fn pcap_bytes(frames: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend(0xa1b2_c3d4u32.to_le_bytes());
    out.extend(2u16.to_le_bytes());
    out.extend(4u16.to_le_bytes());
    out.extend(0u32.to_le_bytes());
    out.extend(0u32.to_le_bytes());
    out.extend(65535u32.to_le_bytes());
    out.extend(1u32.to_le_bytes());
    for (i, f) in frames.iter().enumerate() {
        out.extend((i as u32).to_le_bytes());
        out.extend(0u32.to_le_bytes());
        out.extend((f.len() as u32).to_le_bytes());
        out.extend((f.len() as u32).to_le_bytes());
        out.extend(*f);
    }
    out
}
