//! Reading packet captures: classic pcap (micro- or nanosecond) and pcapng, any byte order.
//!
//! Parsing of the file formats is pcap-parser's; this module turns its blocks into a flat list
//! of packets with their link type and a timestamp in nanoseconds, and gets each packet down to
//! the bytes xroce's wire layer parses (an Ethernet frame or a bare IP packet).

use std::fs::File;
use std::path::Path;

use pcap_parser::pcapng::Block;
use pcap_parser::traits::PcapNGPacketBlock;
use pcap_parser::{Linktype, PcapBlockOwned, PcapError};

/// One captured packet.
#[derive(Debug, Clone)]
pub struct CapturedPacket {
    /// Time since the Unix epoch, in nanoseconds.
    pub timestamp_ns: u128,
    pub link: LinkLayer,
    /// The captured bytes (possibly fewer than `original_len` if the snap length cut them).
    pub data: Vec<u8>,
    pub original_len: usize,
}

/// How the bytes of a captured packet begin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLayer {
    Ethernet,
    /// A bare IPv4 or IPv6 packet (DLT_RAW, LINKTYPE_IPV4/IPV6).
    RawIp,
    /// Linux cooked capture v1 (`tcpdump -i any` on older libpcap): 16-byte header.
    LinuxSll,
    /// Linux cooked capture v2: 20-byte header.
    LinuxSll2,
    /// A link type xroce does not decode.
    Other(i32),
}

impl From<Linktype> for LinkLayer {
    fn from(l: Linktype) -> Self {
        match l {
            Linktype::ETHERNET => LinkLayer::Ethernet,
            Linktype::RAW | Linktype::IPV4 | Linktype::IPV6 => LinkLayer::RawIp,
            Linktype(12) | Linktype(14) => LinkLayer::RawIp, // DLT_RAW on some BSDs
            Linktype::LINUX_SLL => LinkLayer::LinuxSll,
            Linktype::LINUX_SLL2 => LinkLayer::LinuxSll2,
            Linktype(other) => LinkLayer::Other(other),
        }
    }
}

/// What went wrong reading a capture file.
#[derive(Debug)]
pub struct CaptureError {
    pub message: String,
    /// Packets read before the error (a truncated file still yields what it holds).
    pub packets: Vec<CapturedPacket>,
}

impl std::fmt::Display for CaptureError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// Per-interface facts of a pcapng section.
struct Interface {
    link: LinkLayer,
    /// Timestamp units per second.
    resolution: u64,
    offset_s: i64,
}

/// Reads every packet of a pcap or pcapng file.
pub fn read_file(path: &Path) -> Result<Vec<CapturedPacket>, CaptureError> {
    let fail = |message: String, packets| CaptureError { message, packets };
    let file = File::open(path).map_err(|e| fail(format!("cannot open: {e}"), Vec::new()))?;
    // Opening a directory succeeds; reading it would fail with a parser error that names no cause.
    if file.metadata().is_ok_and(|m| m.is_dir()) {
        return Err(fail("is a directory".to_string(), Vec::new()));
    }
    let mut reader = pcap_parser::create_reader(1 << 20, file).map_err(|e| {
        fail(
            match e {
                PcapError::Eof => "empty file".to_string(),
                PcapError::HeaderNotRecognized => "not a pcap or pcapng file".to_string(),
                e => format!("not a pcap or pcapng file ({e:?})"),
            },
            Vec::new(),
        )
    })?;

    let mut packets = Vec::new();
    let mut legacy_link = LinkLayer::Other(-1);
    let mut legacy_nanos = false;
    let mut interfaces: Vec<Interface> = Vec::new();
    loop {
        match reader.next() {
            Ok((offset, block)) => {
                match block {
                    PcapBlockOwned::LegacyHeader(h) => {
                        legacy_link = h.network.into();
                        legacy_nanos = h.is_nanosecond_precision();
                    }
                    PcapBlockOwned::Legacy(b) => {
                        let frac = u128::from(b.ts_usec) * if legacy_nanos { 1 } else { 1000 };
                        packets.push(CapturedPacket {
                            timestamp_ns: u128::from(b.ts_sec) * 1_000_000_000 + frac,
                            link: legacy_link,
                            data: b.data.to_vec(),
                            original_len: b.origlen as usize,
                        });
                    }
                    PcapBlockOwned::NG(Block::SectionHeader(_)) => interfaces.clear(),
                    PcapBlockOwned::NG(Block::InterfaceDescription(idb)) => {
                        interfaces.push(Interface {
                            link: idb.linktype.into(),
                            resolution: ts_resolution(idb.if_tsresol),
                            offset_s: idb.ts_offset(),
                        });
                    }
                    PcapBlockOwned::NG(Block::EnhancedPacket(epb)) => {
                        let iface = interfaces.get(epb.if_id as usize);
                        let (link, resolution, offset_s) = iface
                            .map_or((LinkLayer::Other(-1), 1_000_000, 0), |i| {
                                (i.link, i.resolution.max(1), i.offset_s)
                            });
                        let raw = (u128::from(epb.ts_high) << 32) | u128::from(epb.ts_low);
                        let ns = raw * 1_000_000_000 / u128::from(resolution);
                        let ns = ns.saturating_add_signed(i128::from(offset_s) * 1_000_000_000);
                        packets.push(CapturedPacket {
                            timestamp_ns: ns,
                            link,
                            data: epb.packet_data().to_vec(),
                            original_len: epb.origlen as usize,
                        });
                    }
                    PcapBlockOwned::NG(Block::SimplePacket(spb)) => {
                        let link = interfaces.first().map_or(LinkLayer::Other(-1), |i| i.link);
                        packets.push(CapturedPacket {
                            timestamp_ns: 0,
                            link,
                            data: spb.packet_data().to_vec(),
                            original_len: spb.origlen as usize,
                        });
                    }
                    PcapBlockOwned::NG(_) => {}
                }
                reader.consume(offset);
            }
            Err(PcapError::Eof) => return Ok(packets),
            Err(PcapError::UnexpectedEof) => {
                return Err(fail(
                    "file ends in the middle of a record (truncated capture)".into(),
                    packets,
                ))
            }
            Err(PcapError::Incomplete(_)) => {
                if reader.reader_exhausted() {
                    return Err(fail(
                        "file ends in the middle of a record (truncated capture)".into(),
                        packets,
                    ));
                }
                if let Err(e) = reader.refill() {
                    return Err(fail(format!("read error: {e:?}"), packets));
                }
            }
            Err(e) => {
                return Err(fail(
                    format!("malformed capture after {} packets: {e:?}", packets.len()),
                    packets,
                ))
            }
        }
    }
}

/// Timestamp units per second from a pcapng `if_tsresol` byte: 10^n, or 2^n when the top bit
/// is set. Values that do not fit in 64 bits fall back to the pcapng default, microseconds.
fn ts_resolution(tsresol: u8) -> u64 {
    let n = u32::from(tsresol & 0x7f);
    let units = if tsresol & 0x80 == 0 {
        10u64.checked_pow(n)
    } else {
        1u64.checked_shl(n)
    };
    units.unwrap_or(1_000_000)
}

/// Where the network-layer packet starts in a captured frame, for link types without Ethernet:
/// `Some(offset)` for an IP packet, `None` when the frame is not IP.
pub fn ip_offset(link: LinkLayer, data: &[u8]) -> Option<usize> {
    let proto_at = |at: usize| {
        data.get(at..at + 2)
            .map(|p| u16::from_be_bytes([p[0], p[1]]))
    };
    let is_ip = |p: Option<u16>| matches!(p, Some(0x0800 | 0x86dd));
    match link {
        LinkLayer::RawIp => Some(0),
        LinkLayer::LinuxSll if data.len() >= 16 && is_ip(proto_at(14)) => Some(16),
        LinkLayer::LinuxSll2 if data.len() >= 20 && is_ip(proto_at(0)) => Some(20),
        _ => None,
    }
}
