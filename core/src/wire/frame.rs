//! Whole RoCEv2 frames: parse an Ethernet frame (or a bare IP packet) down to the payload, and
//! build one from headers plus payload into a caller-provided buffer, ICRC included.

use super::bth::{self, BthRepr};
use super::ethernet::{EtherType, EthernetFrame, EthernetRepr};
use super::ext::AethRepr;
use super::ip::IpRepr;
use super::ipv4::{self, Ipv4Packet};
use super::opcode::Opcode;
use super::path::PathHeaders;
use super::transport::{pad_for, TransportPacket, TransportRepr};
use super::udp::{self, UdpPacket, UdpRepr};
use super::{Result, WireError, ICRC_LEN, ROCEV2_UDP_PORT};
use crate::icrc;

/// All headers of a RoCEv2 frame. When building, the length fields (`ip` payload length, `udp`
/// payload length) and the BTH pad count are computed by the writer; the values in here are
/// ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeaders {
    /// `None` for a bare IP packet (a pcap with a raw-IP link type).
    pub eth: Option<EthernetRepr>,
    pub ip: IpRepr,
    pub udp: UdpRepr,
    pub transport: TransportRepr,
}

/// A parsed RoCEv2 frame, borrowing its payload from the input bytes.
#[derive(Debug, Clone, Copy)]
pub struct RoceFrame<'a> {
    pub headers: FrameHeaders,
    /// The payload (pad excluded).
    pub payload: &'a [u8],
    /// The IP packet, header through ICRC, without trailing link-layer padding.
    pub ip_packet: &'a [u8],
}

impl<'a> RoceFrame<'a> {
    /// Parses an Ethernet frame (optionally 802.1Q-tagged). Returns `NotRoce` for anything that
    /// is not IPv4/IPv6 + UDP to port 4791, and another error for a RoCEv2 packet that is
    /// malformed. Checksums and the ICRC are not checked here: see [`Self::verify`].
    pub fn parse_ethernet(frame: &'a [u8]) -> Result<Self> {
        let eth_frame = EthernetFrame::new_checked(frame)?;
        let eth = EthernetRepr::parse(&eth_frame)?;
        if !matches!(eth.ethertype, EtherType::Ipv4 | EtherType::Ipv6) {
            return Err(WireError::NotRoce("EtherType is not IPv4 or IPv6"));
        }
        let payload = &frame[eth.header_len()..];
        let version = payload.first().map_or(0, |b| b >> 4);
        let expected = if eth.ethertype == EtherType::Ipv4 {
            4
        } else {
            6
        };
        if version != expected {
            return Err(WireError::IpVersion(version));
        }
        let mut f = Self::parse_ip(payload)?;
        f.headers.eth = Some(eth);
        Ok(f)
    }

    /// Parses a bare IP packet (no link-layer header).
    pub fn parse_ip(packet: &'a [u8]) -> Result<Self> {
        classify(packet)?;
        let (ip, ip_payload) = IpRepr::parse_bytes(packet)?;
        let ip_packet = &packet[..ip.header_len() + ip.payload_len()];
        if ip.protocol() != ipv4::PROTOCOL_UDP {
            return Err(WireError::NotRoce("IP protocol is not UDP"));
        }
        let udp_packet = UdpPacket::new_checked(ip_payload)?;
        let udp = UdpRepr::parse(&udp_packet)?;
        if udp.dst_port != ROCEV2_UDP_PORT {
            return Err(WireError::NotRoce("UDP destination port is not 4791"));
        }
        if udp::HEADER_LEN + udp.payload_len != ip_payload.len() {
            return Err(WireError::BadLength {
                layer: "UDP",
                detail: "UDP length disagrees with the IP length",
            });
        }
        let tp = TransportPacket::new_checked(udp_packet.payload())?;
        let transport = TransportRepr::parse(&tp)?;
        Ok(RoceFrame {
            headers: FrameHeaders {
                eth: None,
                ip,
                udp,
                transport,
            },
            payload: tp.payload(),
            ip_packet,
        })
    }

    /// The ICRC stored in the frame.
    pub fn stored_icrc(&self) -> Result<u32> {
        icrc::stored(self.ip_packet)
    }

    /// The ICRC computed over the frame.
    pub fn computed_icrc(&self) -> Result<u32> {
        icrc::compute(self.ip_packet)
    }

    pub fn icrc_ok(&self) -> bool {
        matches!(icrc::verify(self.ip_packet), Ok(true))
    }

    /// False only for an IPv4 packet whose header checksum is wrong (or that is unreadable).
    pub fn ip_checksum_ok(&self) -> bool {
        match self.headers.ip {
            IpRepr::V4(_) => {
                Ipv4Packet::new_checked(self.ip_packet).is_ok_and(|p| p.verify_checksum())
            }
            IpRepr::V6(_) => true,
        }
    }

    /// True when the UDP checksum is zero (as rdma_rxe sends), correct, or the partial sum an
    /// offloading sender leaves (see `UdpPacket::verify_checksum`).
    pub fn udp_checksum_ok(&self) -> bool {
        let ip = &self.headers.ip;
        self.ip_packet
            .get(ip.header_len()..)
            .and_then(|b| UdpPacket::new_checked(b).ok())
            .is_some_and(|u| u.verify_checksum(ip))
    }

    /// Everything a receiver must check before trusting the packet: the ICRC, the IPv4 header
    /// checksum and a UDP checksum that is neither zero nor partial.
    pub fn verify(&self) -> Result<()> {
        if !self.ip_checksum_ok() {
            return Err(WireError::Ipv4Checksum);
        }
        if !self.udp_checksum_ok() {
            return Err(WireError::UdpChecksum);
        }
        let (computed, stored) = icrc::computed_and_stored(self.ip_packet)?;
        if computed != stored {
            return Err(WireError::Icrc { computed, stored });
        }
        Ok(())
    }
}

/// Decides early whether an IP packet is meant to be RoCEv2, so that a non-RoCE packet is
/// reported as `NotRoce` rather than as malformed (for example an IPv4 packet with options
/// carrying TCP).
fn classify(packet: &[u8]) -> Result<()> {
    match packet.first().map(|b| b >> 4) {
        Some(4) if packet.len() >= ipv4::HEADER_LEN => {
            let p = Ipv4Packet::new_unchecked(packet);
            if p.protocol() != ipv4::PROTOCOL_UDP {
                return Err(WireError::NotRoce("IP protocol is not UDP"));
            }
            let l4 = usize::from(p.ihl()) * 4;
            if let Some(port) = packet.get(l4 + 2..l4 + 4) {
                if u16::from_be_bytes([port[0], port[1]]) != ROCEV2_UDP_PORT {
                    return Err(WireError::NotRoce("UDP destination port is not 4791"));
                }
            }
            Ok(())
        }
        Some(6) if packet.len() >= 40 => {
            if packet[6] != ipv4::PROTOCOL_UDP {
                return Err(WireError::NotRoce(
                    "IPv6 next header is not UDP (extension headers are not RoCEv2)",
                ));
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Builds a RoCEv2 frame in place in a caller-provided buffer.
///
/// ```
/// # use xroce_core::wire::*;
/// # fn demo(headers: &FrameHeaders, buf: &mut [u8]) -> Result<usize> {
/// let mut w = FrameWriter::new(buf, headers, 5)?;
/// w.payload_mut().copy_from_slice(b"hello");
/// w.finish()
/// # }
/// ```
///
/// [`new`](Self::new) writes every header with its final lengths; the caller then fills
/// [`payload_mut`](Self::payload_mut) (for example by gathering straight from registered memory)
/// and [`finish`](Self::finish) writes the pad and the ICRC. Nothing is allocated.
pub struct FrameWriter<'b> {
    buf: &'b mut [u8],
    ip_start: usize,
    payload_start: usize,
    payload_len: usize,
}

impl<'b> FrameWriter<'b> {
    pub fn new(buf: &'b mut [u8], headers: &FrameHeaders, payload_len: usize) -> Result<Self> {
        let ip_start = headers.eth.map_or(0, |e| e.header_len());
        let path = PathHeaders::new(&headers.ip, &headers.udp)?;
        let ident = match &headers.ip {
            IpRepr::V4(r) => r.ident,
            IpRepr::V6(_) => 0,
        };
        let w = Self::at(buf, ip_start, &path, ident, &headers.transport, payload_len)?;
        if let Some(eth) = &headers.eth {
            eth.emit(w.buf)?;
        }
        Ok(w)
    }

    /// Starts a bare IP packet (no link-layer header) on a path whose IP and UDP headers were
    /// built beforehand; `ident` is the IPv4 identification.
    pub fn on_path(
        buf: &'b mut [u8],
        path: &PathHeaders,
        ident: u16,
        transport: &TransportRepr,
        payload_len: usize,
    ) -> Result<Self> {
        Self::at(buf, 0, path, ident, transport, payload_len)
    }

    fn at(
        buf: &'b mut [u8],
        ip_start: usize,
        path: &PathHeaders,
        ident: u16,
        transport: &TransportRepr,
        payload_len: usize,
    ) -> Result<Self> {
        let transport_len = transport.packet_len(payload_len)?;
        let bth_start = ip_start + path.header_len();
        let total = bth_start + transport_len;
        if buf.len() < total {
            return Err(WireError::BufferTooSmall {
                need: total,
                have: buf.len(),
            });
        }
        path.emit(&mut buf[ip_start..], ident, transport_len)?;
        let hlen = transport.emit_headers(&mut buf[bth_start..], payload_len)?;
        Ok(FrameWriter {
            buf,
            ip_start,
            payload_start: bth_start + hlen,
            payload_len,
        })
    }

    /// The payload's length.
    pub fn payload_len(&self) -> usize {
        self.payload_len
    }

    /// The payload area, exactly `payload_len` bytes.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.payload_start..self.payload_start + self.payload_len]
    }

    /// The ICRC's CRC-32 over the headers, for a payload hashed as it is written
    /// ([`icrc::crc_before_payload`]); then [`finish_hashed`](Self::finish_hashed).
    pub fn crc_before_payload(&self) -> Option<u32> {
        icrc::crc_before_payload(&self.buf[self.ip_start..self.payload_start])
    }

    /// [`finish`](Self::finish), for a payload that may have been hashed as it was written:
    /// with `hashed`, the CRC its bytes and the headers before them came to
    /// ([`crc_before_payload`](Self::crc_before_payload) and on), the ICRC is completed over
    /// the pad instead of computed over the whole packet.
    pub fn finish_hashed(self, hashed: Option<u32>) -> Result<usize> {
        let pad_start = self.payload_start + self.payload_len;
        let pad = pad_for(self.payload_len);
        let end = pad_start + pad + ICRC_LEN;
        self.buf[pad_start..end - ICRC_LEN].fill(0);
        match hashed {
            Some(crc) => {
                let icrc = icrc::finish_after_payload(crc, pad);
                self.buf[end - ICRC_LEN..end].copy_from_slice(&icrc.to_le_bytes());
            }
            None => {
                icrc::fill(&mut self.buf[self.ip_start..end])?;
            }
        }
        Ok(end)
    }

    /// Zeroes the pad, writes the ICRC and returns the frame length.
    pub fn finish(self) -> Result<usize> {
        self.finish_hashed(None)
    }
}

/// Builds an RC ACKNOWLEDGE packet (BTH and AETH, no payload) on `path` into `buf`, starting
/// at the IP header; returns its length. The same bytes as [`FrameWriter::on_path`] with a
/// [`TransportRepr`] holding `bth` (whose opcode must be `RC_ACKNOWLEDGE`; its pad count is
/// ignored) and `aeth`, without the walk over the opcode's headers: a responder builds one
/// for nearly every message it takes, on a ping-pong turn's path before the answer's kick.
pub fn emit_ack_on_path(
    buf: &mut [u8],
    path: &PathHeaders,
    ident: u16,
    bth: &BthRepr,
    aeth: &AethRepr,
) -> Result<usize> {
    if bth.opcode != Opcode::RC_ACKNOWLEDGE {
        return Err(WireError::HeaderMismatch {
            opcode: bth.opcode.0,
            detail: "not an ACKNOWLEDGE",
        });
    }
    const TRANSPORT_LEN: usize = bth::HEADER_LEN + AethRepr::LEN + ICRC_LEN;
    let start = path.header_len();
    let end = start + TRANSPORT_LEN;
    let Some(packet) = buf.get_mut(..end) else {
        return Err(WireError::BufferTooSmall {
            need: end,
            have: buf.len(),
        });
    };
    path.emit(packet, ident, TRANSPORT_LEN)?;
    let aeth_at = start + bth::HEADER_LEN;
    BthRepr {
        pad_count: 0,
        ..*bth
    }
    .emit(&mut packet[start..aeth_at])?;
    aeth.emit(&mut packet[aeth_at..aeth_at + AethRepr::LEN])?;
    icrc::fill(packet)?;
    Ok(end)
}

/// Builds a complete frame carrying `payload` into `buf`; returns its length.
pub fn emit_frame(buf: &mut [u8], headers: &FrameHeaders, payload: &[u8]) -> Result<usize> {
    let mut w = FrameWriter::new(buf, headers, payload.len())?;
    w.payload_mut().copy_from_slice(payload);
    w.finish()
}
