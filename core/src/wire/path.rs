//! The IP and UDP headers of one path, built once and stamped into every packet sent on it.
//!
//! Every packet a QP sends to its peer carries the same addresses, traffic class, TTL and UDP
//! ports; only the lengths, the IPv4 identification and the IPv4 header checksum change. Copying
//! a prebuilt pair and patching those fields saves about 100 of the 2 900 user-space
//! instructions a 64-byte SEND cost the sender when they were built field by field for each
//! packet (`docs/decisions.md`, "Headers built once per path").

use super::ip::{IpAddress, IpRepr};
use super::ipv4;
use super::ipv6;
use super::udp::{self, UdpRepr};
use super::{be, Result, WireError};

const MAX_LEN: usize = ipv6::HEADER_LEN + udp::HEADER_LEN;

/// The IP header and UDP header of one path, with every field that does not change from one
/// packet to the next already in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathHeaders {
    /// IP header then UDP header; lengths, IPv4 identification and both checksums zero.
    bytes: [u8; MAX_LEN],
    /// IPv4: the unfolded ones'-complement sum of the header words that do not change (the
    /// total length and identification are added per packet). Unused for IPv6.
    fixed_sum: u32,
    ip: IpRepr,
}

impl PathHeaders {
    /// The headers of `ip` and `udp`, whose lengths (and IPv4 identification) are ignored:
    /// [`emit`](Self::emit) writes them per packet.
    pub fn new(ip: &IpRepr, udp: &UdpRepr) -> Result<Self> {
        let mut bytes = [0u8; MAX_LEN];
        let mut ip = *ip;
        ip.set_payload_len(0);
        if let IpRepr::V4(r) = &mut ip {
            r.ident = 0;
        }
        ip.emit(&mut bytes)?;
        let ip_len = ip.header_len();
        UdpRepr {
            payload_len: 0,
            ..*udp
        }
        .emit(&mut bytes[ip_len..])?;
        // The UDP length and both checksums are written per packet (the UDP checksum as 0).
        be::set_u16(&mut bytes[ip_len..], udp::field::LENGTH, 0);
        let fixed_sum = match &ip {
            IpRepr::V4(r) => {
                be::set_u16(&mut bytes, ipv4::field::LENGTH, 0);
                be::set_u16(&mut bytes, ipv4::field::CHECKSUM, 0);
                r.fixed_words_sum()
            }
            IpRepr::V6(_) => 0,
        };
        Ok(PathHeaders {
            bytes,
            fixed_sum,
            ip,
        })
    }

    /// IP plus UDP header length.
    pub fn header_len(&self) -> usize {
        self.ip.header_len() + udp::HEADER_LEN
    }

    /// The IP header these were built from (payload length and identification zero).
    pub fn ip(&self) -> &IpRepr {
        &self.ip
    }

    pub fn src_addr(&self) -> IpAddress {
        self.ip.src_addr()
    }

    pub fn dst_addr(&self) -> IpAddress {
        self.ip.dst_addr()
    }

    pub fn udp_src_port(&self) -> u16 {
        be::u16_at(&self.bytes[self.ip.header_len()..], udp::field::SRC_PORT)
    }

    /// Writes both headers at the start of `buf` for a UDP datagram carrying
    /// `udp_payload_len` bytes; `ident` is the IPv4 identification (IPv6 has none).
    pub fn emit(&self, buf: &mut [u8], ident: u16, udp_payload_len: usize) -> Result<()> {
        let hlen = self.header_len();
        let Some(out) = buf.get_mut(..hlen) else {
            return Err(WireError::BufferTooSmall {
                need: hlen,
                have: buf.len(),
            });
        };
        let udp_len = udp::HEADER_LEN + udp_payload_len;
        let udp_len16 =
            u16::try_from(udp_len).map_err(|_| WireError::FieldRange("UDP length above 65535"))?;
        out.copy_from_slice(&self.bytes[..hlen]);
        let ip_len = self.ip.header_len();
        be::set_u16(&mut out[ip_len..], udp::field::LENGTH, udp_len16);
        match self.ip {
            IpRepr::V4(_) => {
                let total = u16::try_from(ipv4::HEADER_LEN + udp_len)
                    .map_err(|_| WireError::FieldRange("IPv4 total length above 65535"))?;
                be::set_u16(out, ipv4::field::LENGTH, total);
                be::set_u16(out, ipv4::field::IDENT, ident);
                // From the values, not read back from `out` (see `Ipv4Repr::emit`).
                let checksum = ipv4::header_checksum(self.fixed_sum, total, ident);
                be::set_u16(out, ipv4::field::CHECKSUM, checksum);
            }
            // The IPv6 payload is the UDP datagram.
            IpRepr::V6(_) => be::set_u16(out, ipv6::field::PAYLOAD_LEN, udp_len16),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::ipv4::{Ipv4Address, Ipv4Packet, Ipv4Repr};
    use crate::wire::ipv6::{Ipv6Address, Ipv6Repr};
    use crate::wire::ROCEV2_UDP_PORT;

    fn v4(tos: u8, ttl: u8, dont_frag: bool) -> IpRepr {
        IpRepr::V4(Ipv4Repr {
            src: Ipv4Address([192, 168, 255, 1]),
            dst: Ipv4Address([10, 255, 0, 254]),
            tos,
            ident: 0xbeef,
            dont_frag,
            ttl,
            protocol: ipv4::PROTOCOL_UDP,
            payload_len: 999,
        })
    }

    fn udp(src_port: u16) -> UdpRepr {
        UdpRepr {
            src_port,
            dst_port: ROCEV2_UDP_PORT,
            payload_len: 77,
        }
    }

    /// What the headers' own emitters write for the same packet.
    fn field_by_field(ip: &IpRepr, udp: &UdpRepr, ident: u16, payload: usize) -> Vec<u8> {
        let mut ip = *ip;
        ip.set_payload_len(udp::HEADER_LEN + payload);
        if let IpRepr::V4(r) = &mut ip {
            r.ident = ident;
        }
        let mut out = vec![0u8; ip.header_len() + udp::HEADER_LEN];
        ip.emit(&mut out).unwrap();
        UdpRepr {
            payload_len: payload,
            ..*udp
        }
        .emit(&mut out[ip.header_len()..])
        .unwrap();
        out
    }

    #[test]
    fn stamps_the_same_bytes_as_the_field_by_field_emitters() {
        let v6 = IpRepr::V6(Ipv6Repr {
            src: Ipv6Address([0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8]),
            dst: Ipv6Address([0x20, 0x01, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 1]),
            traffic_class: 0x2e,
            flow_label: 0x54321,
            next_header: ipv4::PROTOCOL_UDP,
            hop_limit: 7,
            payload_len: 5,
        });
        let ips = [v4(0, 64, true), v4(0xb8, 1, false), v4(0xff, 255, true), v6];
        for ip in ips {
            for sport in [0xc000, 0xffff, 1] {
                let path = PathHeaders::new(&ip, &udp(sport)).unwrap();
                // Lengths and idents whose checksum sums carry on the first and second fold.
                for (ident, payload) in [(0, 0), (0xffff, 1480), (0x8001, 4124), (7, 65_507)] {
                    let mut out = vec![0u8; path.header_len()];
                    path.emit(&mut out, ident, payload).unwrap();
                    assert_eq!(
                        out,
                        field_by_field(&ip, &udp(sport), ident, payload),
                        "{ip:?} sport {sport:#x} ident {ident:#x} payload {payload}"
                    );
                    if let IpRepr::V4(_) = ip {
                        assert!(Ipv4Packet::new_unchecked(&out[..]).verify_checksum());
                    }
                }
            }
        }
    }

    #[test]
    fn keeps_what_it_was_built_for() {
        let path = PathHeaders::new(&v4(4, 64, true), &udp(0xc132)).unwrap();
        assert_eq!(path.udp_src_port(), 0xc132);
        assert_eq!(
            path.src_addr(),
            IpAddress::V4(Ipv4Address([192, 168, 255, 1]))
        );
        assert_eq!(
            path.dst_addr(),
            IpAddress::V4(Ipv4Address([10, 255, 0, 254]))
        );
        assert_eq!(path.ip().payload_len(), 0);
        assert_eq!(path.header_len(), 28);
    }

    #[test]
    fn refuses_what_does_not_fit() {
        let path = PathHeaders::new(&v4(0, 64, true), &udp(1)).unwrap();
        let mut short = [0u8; 27];
        assert!(matches!(
            path.emit(&mut short, 0, 10),
            Err(WireError::BufferTooSmall { need: 28, have: 27 })
        ));
        let mut out = [0u8; 28];
        assert!(matches!(
            path.emit(&mut out, 0, 65_535 - 8 - 20 + 1),
            Err(WireError::FieldRange(_))
        ));
    }
}
