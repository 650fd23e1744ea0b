//! IPv6 fixed header. RoCEv2 packets carry no extension headers (rdma_rxe neither sends nor
//! accepts them), so the next header must be UDP.

use core::fmt;

use super::{be, check_len, Field, Result, WireError};

/// A 128-bit IPv6 address (also the shape of a RoCE GID).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct Ipv6Address(pub [u8; 16]);

impl fmt::Display for Ipv6Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        core::net::Ipv6Addr::from(self.0).fmt(f)
    }
}

impl From<core::net::Ipv6Addr> for Ipv6Address {
    fn from(a: core::net::Ipv6Addr) -> Self {
        Ipv6Address(a.octets())
    }
}

pub(crate) mod field {
    use super::Field;
    /// Version (4 bits), traffic class (8), flow label (20).
    pub const VER_TC_FLOW: Field = 0..4;
    pub const PAYLOAD_LEN: Field = 4..6;
    pub const NEXT_HEADER: usize = 6;
    pub const HOP_LIMIT: usize = 7;
    pub const SRC: Field = 8..24;
    pub const DST: Field = 24..40;
}

pub const HEADER_LEN: usize = 40;

/// A checked view over an IPv6 packet.
#[derive(Debug, Clone, Copy)]
pub struct Ipv6Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Ipv6Packet<T> {
    pub const fn new_unchecked(buffer: T) -> Self {
        Ipv6Packet { buffer }
    }

    /// Wraps `buffer` after checking the version and that the payload length fits.
    pub fn new_checked(buffer: T) -> Result<Self> {
        let p = Self::new_unchecked(buffer);
        p.check_len()?;
        Ok(p)
    }

    pub fn check_len(&self) -> Result<()> {
        let b = self.buffer.as_ref();
        check_len("IPv6 header", b, HEADER_LEN)?;
        if self.version() != 6 {
            return Err(WireError::IpVersion(self.version()));
        }
        check_len(
            "IPv6 packet (payload length)",
            b,
            HEADER_LEN + usize::from(self.payload_len()),
        )
    }

    pub fn into_inner(self) -> T {
        self.buffer
    }

    fn word0(&self) -> u32 {
        be::u32_at(self.buffer.as_ref(), field::VER_TC_FLOW)
    }
    pub fn version(&self) -> u8 {
        (self.word0() >> 28) as u8
    }
    pub fn traffic_class(&self) -> u8 {
        (self.word0() >> 20) as u8
    }
    pub fn flow_label(&self) -> u32 {
        self.word0() & 0x000f_ffff
    }
    pub fn payload_len(&self) -> u16 {
        be::u16_at(self.buffer.as_ref(), field::PAYLOAD_LEN)
    }
    pub fn next_header(&self) -> u8 {
        self.buffer.as_ref()[field::NEXT_HEADER]
    }
    pub fn hop_limit(&self) -> u8 {
        self.buffer.as_ref()[field::HOP_LIMIT]
    }
    pub fn src_addr(&self) -> Ipv6Address {
        let mut a = [0u8; 16];
        a.copy_from_slice(&self.buffer.as_ref()[field::SRC]);
        Ipv6Address(a)
    }
    pub fn dst_addr(&self) -> Ipv6Address {
        let mut a = [0u8; 16];
        a.copy_from_slice(&self.buffer.as_ref()[field::DST]);
        Ipv6Address(a)
    }
}

impl<'a, T: AsRef<[u8]> + ?Sized> Ipv6Packet<&'a T> {
    /// The bytes after the header, up to the payload length.
    pub fn payload(&self) -> &'a [u8] {
        &self.buffer.as_ref()[HEADER_LEN..HEADER_LEN + usize::from(self.payload_len())]
    }
}

/// The meaning of an IPv6 header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv6Repr {
    pub src: Ipv6Address,
    pub dst: Ipv6Address,
    pub traffic_class: u8,
    /// rdma_rxe always sends 0 here; the AH flow label only seeds the UDP source port.
    pub flow_label: u32,
    pub next_header: u8,
    pub hop_limit: u8,
    pub payload_len: usize,
}

impl Ipv6Repr {
    pub fn parse<T: AsRef<[u8]>>(p: &Ipv6Packet<T>) -> Result<Self> {
        p.check_len()?;
        Ok(Ipv6Repr {
            src: p.src_addr(),
            dst: p.dst_addr(),
            traffic_class: p.traffic_class(),
            flow_label: p.flow_label(),
            next_header: p.next_header(),
            hop_limit: p.hop_limit(),
            payload_len: usize::from(p.payload_len()),
        })
    }

    pub const fn header_len(&self) -> usize {
        HEADER_LEN
    }

    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        check_len("IPv6 header", buf, HEADER_LEN)?;
        if self.flow_label > 0x000f_ffff {
            return Err(WireError::FieldRange("IPv6 flow label above 20 bits"));
        }
        let len = u16::try_from(self.payload_len)
            .map_err(|_| WireError::FieldRange("IPv6 payload length above 65535"))?;
        let w0 = (6u32 << 28) | (u32::from(self.traffic_class) << 20) | self.flow_label;
        be::set_u32(buf, field::VER_TC_FLOW, w0);
        be::set_u16(buf, field::PAYLOAD_LEN, len);
        buf[field::NEXT_HEADER] = self.next_header;
        buf[field::HOP_LIMIT] = self.hop_limit;
        buf[field::SRC].copy_from_slice(&self.src.0);
        buf[field::DST].copy_from_slice(&self.dst.0);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip() {
        let r = Ipv6Repr {
            src: Ipv6Address([0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]),
            dst: Ipv6Address([0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]),
            traffic_class: 0xa5,
            flow_label: 0x12345,
            next_header: 17,
            hop_limit: 64,
            payload_len: 4,
        };
        let mut buf = [0u8; 44];
        r.emit(&mut buf).unwrap();
        let p = Ipv6Packet::new_checked(&buf[..]).unwrap();
        assert_eq!(Ipv6Repr::parse(&p).unwrap(), r);
        assert_eq!(p.payload().len(), 4);
    }

    #[test]
    fn payload_length_beyond_buffer_is_an_error() {
        let mut buf = [0u8; 40];
        buf[0] = 0x60;
        buf[5] = 1;
        assert!(matches!(
            Ipv6Packet::new_checked(&buf[..]),
            Err(WireError::Truncated { .. })
        ));
    }
}
