//! IPv4 or IPv6: the network layer of a RoCEv2 packet.

use core::fmt;

use super::ipv4::{self, Ipv4Address, Ipv4Packet, Ipv4Repr};
use super::ipv6::{self, Ipv6Address, Ipv6Packet, Ipv6Repr};
use super::{ones_complement_sum, Result, WireError};

/// Either IP header of a RoCEv2 packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IpRepr {
    V4(Ipv4Repr),
    V6(Ipv6Repr),
}

/// An IP address of either family, for display and for GIDs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IpAddress {
    V4(Ipv4Address),
    V6(Ipv6Address),
}

impl fmt::Display for IpAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IpAddress::V4(a) => a.fmt(f),
            IpAddress::V6(a) => a.fmt(f),
        }
    }
}

impl IpRepr {
    /// Parses the IP header at the start of `bytes`, choosing the family from the version nibble.
    /// Returns the header and the IP payload (without trailing link-layer padding).
    pub fn parse_bytes(bytes: &[u8]) -> Result<(IpRepr, &[u8])> {
        match bytes.first().map(|b| b >> 4) {
            Some(4) => {
                let p = Ipv4Packet::new_checked(bytes)?;
                Ok((IpRepr::V4(Ipv4Repr::parse(&p)?), p.payload()))
            }
            Some(6) => {
                let p = Ipv6Packet::new_checked(bytes)?;
                Ok((IpRepr::V6(Ipv6Repr::parse(&p)?), p.payload()))
            }
            Some(v) => Err(WireError::IpVersion(v)),
            None => Err(WireError::Truncated {
                layer: "IP header",
                need: 1,
                have: 0,
            }),
        }
    }

    pub fn header_len(&self) -> usize {
        match self {
            IpRepr::V4(_) => ipv4::HEADER_LEN,
            IpRepr::V6(_) => ipv6::HEADER_LEN,
        }
    }

    pub fn payload_len(&self) -> usize {
        match self {
            IpRepr::V4(r) => r.payload_len,
            IpRepr::V6(r) => r.payload_len,
        }
    }

    pub fn set_payload_len(&mut self, len: usize) {
        match self {
            IpRepr::V4(r) => r.payload_len = len,
            IpRepr::V6(r) => r.payload_len = len,
        }
    }

    /// The IPv4 TOS byte or the IPv6 traffic class.
    pub fn traffic_class(&self) -> u8 {
        match self {
            IpRepr::V4(r) => r.tos,
            IpRepr::V6(r) => r.traffic_class,
        }
    }

    /// The upper-layer protocol number (IPv4 protocol / IPv6 next header).
    pub fn protocol(&self) -> u8 {
        match self {
            IpRepr::V4(r) => r.protocol,
            IpRepr::V6(r) => r.next_header,
        }
    }

    pub fn src_addr(&self) -> IpAddress {
        match self {
            IpRepr::V4(r) => IpAddress::V4(r.src),
            IpRepr::V6(r) => IpAddress::V6(r.src),
        }
    }

    pub fn dst_addr(&self) -> IpAddress {
        match self {
            IpRepr::V4(r) => IpAddress::V4(r.dst),
            IpRepr::V6(r) => IpAddress::V6(r.dst),
        }
    }

    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        match self {
            IpRepr::V4(r) => r.emit(buf),
            IpRepr::V6(r) => r.emit(buf),
        }
    }

    /// The unfolded ones'-complement sum of the UDP pseudo-header for `udp_len` bytes of UDP.
    pub(crate) fn pseudo_header_sum(&self, udp_len: usize) -> u32 {
        let (src, dst): (&[u8], &[u8]) = match self {
            IpRepr::V4(r) => (&r.src.0, &r.dst.0),
            IpRepr::V6(r) => (&r.src.0, &r.dst.0),
        };
        let sum = ones_complement_sum(ones_complement_sum(0, src), dst);
        let len_words = udp_len as u32;
        sum + (len_words >> 16) + (len_words & 0xffff) + u32::from(ipv4::PROTOCOL_UDP)
    }
}
