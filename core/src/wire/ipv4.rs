//! IPv4 header without options (RoCEv2 and rdma_rxe's ICRC assume exactly 20 bytes).

use core::fmt;

use super::{be, check_len, ones_complement_sum, Field, Result, WireError};

/// A 32-bit IPv4 address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct Ipv4Address(pub [u8; 4]);

impl fmt::Display for Ipv4Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        core::net::Ipv4Addr::from(self.0).fmt(f)
    }
}

impl From<core::net::Ipv4Addr> for Ipv4Address {
    fn from(a: core::net::Ipv4Addr) -> Self {
        Ipv4Address(a.octets())
    }
}

pub(crate) mod field {
    use super::Field;
    pub const VER_IHL: usize = 0;
    pub const TOS: usize = 1;
    pub const LENGTH: Field = 2..4;
    pub const IDENT: Field = 4..6;
    pub const FLAGS_FRAG: Field = 6..8;
    pub const TTL: usize = 8;
    pub const PROTOCOL: usize = 9;
    pub const CHECKSUM: Field = 10..12;
    pub const SRC: Field = 12..16;
    pub const DST: Field = 16..20;
}

pub const HEADER_LEN: usize = 20;
pub const PROTOCOL_UDP: u8 = 17;
const FLAG_DF: u16 = 0x4000;
const FLAG_MF: u16 = 0x2000;
const FRAG_OFFSET_MASK: u16 = 0x1fff;

/// A checked view over an IPv4 packet.
#[derive(Debug, Clone, Copy)]
pub struct Ipv4Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Ipv4Packet<T> {
    pub const fn new_unchecked(buffer: T) -> Self {
        Ipv4Packet { buffer }
    }

    /// Wraps `buffer` after checking the version, that the header has no options, and that the
    /// total length fits in the buffer (trailing bytes, such as Ethernet padding, are allowed and
    /// ignored by [`payload`](Self::payload)).
    pub fn new_checked(buffer: T) -> Result<Self> {
        let p = Self::new_unchecked(buffer);
        p.check_len()?;
        Ok(p)
    }

    pub fn check_len(&self) -> Result<()> {
        let b = self.buffer.as_ref();
        check_len("IPv4 header", b, HEADER_LEN)?;
        if self.version() != 4 {
            return Err(WireError::IpVersion(self.version()));
        }
        if self.ihl() != 5 {
            return Err(WireError::Ipv4Options { ihl: self.ihl() });
        }
        let total = usize::from(self.total_len());
        if total < HEADER_LEN {
            return Err(WireError::BadLength {
                layer: "IPv4",
                detail: "total length below the header length",
            });
        }
        check_len("IPv4 packet (total length)", b, total)
    }

    pub fn into_inner(self) -> T {
        self.buffer
    }

    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[field::VER_IHL] >> 4
    }
    /// Header length in 32-bit words.
    pub fn ihl(&self) -> u8 {
        self.buffer.as_ref()[field::VER_IHL] & 0x0f
    }
    /// The whole TOS byte (DSCP << 2 | ECN).
    pub fn tos(&self) -> u8 {
        self.buffer.as_ref()[field::TOS]
    }
    pub fn total_len(&self) -> u16 {
        be::u16_at(self.buffer.as_ref(), field::LENGTH)
    }
    pub fn ident(&self) -> u16 {
        be::u16_at(self.buffer.as_ref(), field::IDENT)
    }
    pub fn dont_frag(&self) -> bool {
        be::u16_at(self.buffer.as_ref(), field::FLAGS_FRAG) & FLAG_DF != 0
    }
    /// True when the packet is a fragment (more-fragments flag or a non-zero offset).
    pub fn is_fragment(&self) -> bool {
        let ff = be::u16_at(self.buffer.as_ref(), field::FLAGS_FRAG);
        ff & FLAG_MF != 0 || ff & FRAG_OFFSET_MASK != 0
    }
    pub fn ttl(&self) -> u8 {
        self.buffer.as_ref()[field::TTL]
    }
    pub fn protocol(&self) -> u8 {
        self.buffer.as_ref()[field::PROTOCOL]
    }
    pub fn checksum(&self) -> u16 {
        be::u16_at(self.buffer.as_ref(), field::CHECKSUM)
    }
    pub fn src_addr(&self) -> Ipv4Address {
        let mut a = [0u8; 4];
        a.copy_from_slice(&self.buffer.as_ref()[field::SRC]);
        Ipv4Address(a)
    }
    pub fn dst_addr(&self) -> Ipv4Address {
        let mut a = [0u8; 4];
        a.copy_from_slice(&self.buffer.as_ref()[field::DST]);
        Ipv4Address(a)
    }

    /// True when the header checksum is correct.
    pub fn verify_checksum(&self) -> bool {
        ones_complement_sum(0, &self.buffer.as_ref()[..HEADER_LEN]) == 0xffff
    }
}

impl<'a, T: AsRef<[u8]> + ?Sized> Ipv4Packet<&'a T> {
    /// The bytes after the header, up to the total length.
    pub fn payload(&self) -> &'a [u8] {
        &self.buffer.as_ref()[HEADER_LEN..usize::from(self.total_len())]
    }
}

/// The meaning of an IPv4 header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv4Repr {
    pub src: Ipv4Address,
    pub dst: Ipv4Address,
    /// The TOS byte (DSCP << 2 | ECN); rdma_rxe copies the AH traffic class here.
    pub tos: u8,
    pub ident: u16,
    pub dont_frag: bool,
    pub ttl: u8,
    pub protocol: u8,
    /// Bytes after the 20-byte header.
    pub payload_len: usize,
}

impl Ipv4Repr {
    /// Parses the header. Fragments are rejected; the header checksum is *not* checked here
    /// (see [`Ipv4Packet::verify_checksum`]) so that a capture with a bad checksum can still be
    /// decoded and reported.
    pub fn parse<T: AsRef<[u8]>>(p: &Ipv4Packet<T>) -> Result<Self> {
        p.check_len()?;
        if p.is_fragment() {
            return Err(WireError::Fragmented);
        }
        Ok(Ipv4Repr {
            src: p.src_addr(),
            dst: p.dst_addr(),
            tos: p.tos(),
            ident: p.ident(),
            dont_frag: p.dont_frag(),
            ttl: p.ttl(),
            protocol: p.protocol(),
            payload_len: usize::from(p.total_len()) - HEADER_LEN,
        })
    }

    pub const fn header_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the header, checksum included, at the start of `buf`.
    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        check_len("IPv4 header", buf, HEADER_LEN)?;
        let total = u16::try_from(HEADER_LEN + self.payload_len)
            .map_err(|_| WireError::FieldRange("IPv4 total length above 65535"))?;
        let flags = if self.dont_frag { FLAG_DF } else { 0 };
        buf[field::VER_IHL] = 0x45;
        buf[field::TOS] = self.tos;
        be::set_u16(buf, field::LENGTH, total);
        be::set_u16(buf, field::IDENT, self.ident);
        be::set_u16(buf, field::FLAGS_FRAG, flags);
        buf[field::TTL] = self.ttl;
        buf[field::PROTOCOL] = self.protocol;
        buf[field::SRC].copy_from_slice(&self.src.0);
        buf[field::DST].copy_from_slice(&self.dst.0);
        // The checksum is summed from the values, not read back from `buf`: reading bytes just
        // stored in pieces stalls store forwarding, and this runs for every packet sent.
        let checksum = header_checksum(self.fixed_words_sum(), total, self.ident);
        be::set_u16(buf, field::CHECKSUM, checksum);
        Ok(())
    }

    /// The unfolded ones'-complement sum of the header words that stay the same for every
    /// packet of a path: all but the total length, the identification and the checksum.
    pub(crate) fn fixed_words_sum(&self) -> u32 {
        let flags = if self.dont_frag { FLAG_DF } else { 0 };
        [
            u16::from_be_bytes([0x45, self.tos]),
            flags,
            u16::from_be_bytes([self.ttl, self.protocol]),
            u16::from_be_bytes([self.src.0[0], self.src.0[1]]),
            u16::from_be_bytes([self.src.0[2], self.src.0[3]]),
            u16::from_be_bytes([self.dst.0[0], self.dst.0[1]]),
            u16::from_be_bytes([self.dst.0[2], self.dst.0[3]]),
        ]
        .iter()
        .map(|&w| u32::from(w))
        .sum()
    }
}

/// The header checksum field for a header whose other words sum to `fixed_sum` (see
/// [`Ipv4Repr::fixed_words_sum`]), with this total length and identification.
pub(crate) fn header_checksum(fixed_sum: u32, total_len: u16, ident: u16) -> u16 {
    let sum = fixed_sum + u32::from(total_len) + u32::from(ident);
    let folded = (sum & 0xffff) + (sum >> 16);
    let folded = (folded & 0xffff) + (folded >> 16);
    !(folded as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    // The worked IPv4 header from the digest's RC SEND_ONLY example (checksum a5 31).
    const HDR: [u8; 20] = [
        0x45, 0x00, 0x00, 0x34, 0x12, 0x34, 0x40, 0x00, 0x40, 0x11, 0xa5, 0x31, 192, 168, 1, 1,
        192, 168, 1, 2,
    ];

    #[test]
    fn parses_and_reemits_with_the_same_checksum() {
        let mut buf = [0u8; 0x34];
        buf[..20].copy_from_slice(&HDR);
        let p = Ipv4Packet::new_checked(&buf[..]).unwrap();
        assert!(p.verify_checksum());
        let r = Ipv4Repr::parse(&p).unwrap();
        assert_eq!(r.payload_len, 0x34 - 20);
        assert!(r.dont_frag);
        let mut out = [0u8; 20];
        r.emit(&mut out).unwrap();
        assert_eq!(out, HDR);
    }

    /// The checksum summed from the field values must match the header's bytes, including
    /// a sum whose first fold carries.
    #[test]
    fn emitted_headers_carry_a_checksum_that_verifies() {
        let addrs = [
            [0, 0, 0, 0],
            [255, 255, 255, 255],
            [10, 251, 0, 1],
            [192, 168, 1, 2],
        ];
        for src in addrs {
            for dst in addrs {
                for (tos, ttl, ident, dont_frag) in [
                    (0, 64, 0, true),
                    (0xff, 0xff, 0xffff, false),
                    (0x02, 1, 0x1234, true),
                    // With all-ones addresses the first fold of this one carries again.
                    (0xff, 0xff, 0xb513, false),
                ] {
                    let r = Ipv4Repr {
                        src: Ipv4Address(src),
                        dst: Ipv4Address(dst),
                        tos,
                        ident,
                        dont_frag,
                        ttl,
                        protocol: PROTOCOL_UDP,
                        payload_len: 1500 - HEADER_LEN,
                    };
                    let mut out = [0u8; 1500];
                    r.emit(&mut out).unwrap();
                    let p = Ipv4Packet::new_checked(&out[..]).unwrap();
                    assert!(p.verify_checksum(), "{r:?}");
                    assert_eq!(Ipv4Repr::parse(&p).unwrap(), r);
                }
            }
        }
    }

    #[test]
    fn options_are_rejected() {
        let mut buf = [0u8; 0x34];
        buf[..20].copy_from_slice(&HDR);
        buf[0] = 0x46;
        assert_eq!(
            Ipv4Packet::new_checked(&buf[..]).unwrap_err(),
            WireError::Ipv4Options { ihl: 6 }
        );
    }

    #[test]
    fn fragments_are_rejected() {
        let mut buf = [0u8; 0x34];
        buf[..20].copy_from_slice(&HDR);
        buf[6] = 0x20; // MF
        let p = Ipv4Packet::new_checked(&buf[..]).unwrap();
        assert_eq!(Ipv4Repr::parse(&p).unwrap_err(), WireError::Fragmented);
    }
}
