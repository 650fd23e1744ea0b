//! The RoCEv2 wire layer: zero-copy checked views over bytes, and plain `Repr` structs.
//!
//! Every header follows the same shape (borrowed from smoltcp's `wire` module):
//!
//! * `XxxPacket<T: AsRef<[u8]>>` wraps a buffer. `new_checked` validates the length once, after
//!   which no accessor can panic. Setters exist when `T: AsMut<[u8]>`.
//! * `XxxRepr` is a plain struct holding the header's meaning, with `parse(&XxxPacket) -> Result`
//!   and `emit(&self, &mut XxxPacket)`.
//!
//! Layering, outermost first: [`ethernet`] (optional 802.1Q tag) → [`ipv4`] / [`ipv6`] → [`udp`] →
//! [`bth`] → extension headers ([`ext`]) → payload → pad → ICRC. [`transport`] puts BTH, the
//! extension headers the [`opcode`] table prescribes, the payload and the pad together; [`frame`]
//! parses and builds whole Ethernet frames, ICRC included; [`path`] keeps the IP and UDP headers
//! of one path prebuilt for the frames sent on it.

pub mod bth;
mod describe;
pub mod ethernet;
pub mod ext;
pub mod frame;
pub mod ip;
pub mod ipv4;
pub mod ipv6;
pub mod opcode;
pub mod path;
pub mod transport;
pub mod udp;

pub use bth::{BthPacket, BthRepr};
pub use ethernet::{EtherType, EthernetAddress, EthernetFrame, EthernetRepr, VlanTag};
pub use ext::{
    AethRepr, AethSyndrome, AtomicAckEthRepr, AtomicEthRepr, DethRepr, FethRepr, NakCode,
    RdethRepr, RethRepr,
};
pub use frame::{emit_ack_on_path, emit_frame, FrameHeaders, FrameWriter, RoceFrame};
pub use ip::{IpAddress, IpRepr};
pub use ipv4::{Ipv4Address, Ipv4Packet, Ipv4Repr};
pub use ipv6::{Ipv6Address, Ipv6Packet, Ipv6Repr};
pub use opcode::{HeaderKind, HeaderSet, Opcode, OpcodeInfo, Operation, Position, Transport};
pub use path::PathHeaders;
pub use transport::{TransportPacket, TransportRepr};
pub use udp::{UdpPacket, UdpRepr};

/// The UDP destination port IANA assigned to RoCEv2.
pub const ROCEV2_UDP_PORT: u16 = 4791;

/// Size of the invariant CRC that ends every RoCEv2 packet.
pub const ICRC_LEN: usize = 4;

/// A byte range inside a header, as in smoltcp's `field` modules.
pub(crate) type Field = core::ops::Range<usize>;

/// Everything that can be wrong with bytes handed to the wire layer.
///
/// Input from the network is untrusted: every malformed packet maps to one of these values, never
/// to a panic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The buffer ends before the named header or field does.
    #[error("truncated {layer}: need {need} bytes, have {have}")]
    Truncated {
        layer: &'static str,
        need: usize,
        have: usize,
    },
    /// A length field disagrees with the bytes present or with the layers it encloses.
    #[error("bad {layer} length: {detail}")]
    BadLength {
        layer: &'static str,
        detail: &'static str,
    },
    /// The IPv4 header carries options; RoCEv2 (and rdma_rxe's ICRC) assumes a 20-byte header.
    #[error("IPv4 header with options (IHL {ihl}); RoCEv2 requires a 20-byte header")]
    Ipv4Options { ihl: u8 },
    /// The IP version nibble is neither 4 nor 6, or does not match the EtherType.
    #[error("unexpected IP version {0}")]
    IpVersion(u8),
    /// The IPv4 packet is a fragment; RoCEv2 is sent with DF and never fragmented.
    #[error("IPv4 fragment (RoCEv2 packets are never fragmented)")]
    Fragmented,
    /// The IPv4 header checksum does not match.
    #[error("bad IPv4 header checksum")]
    Ipv4Checksum,
    /// A non-zero UDP checksum does not match (zero means "not computed", as rdma_rxe sends).
    #[error("bad UDP checksum")]
    UdpChecksum,
    /// Not a RoCEv2 packet at all: another EtherType, IP protocol or UDP port.
    #[error("not RoCEv2: {0}")]
    NotRoce(&'static str),
    /// The BTH transport version is not 0.
    #[error("unsupported BTH transport version {0}")]
    TransportVersion(u8),
    /// The opcode has no entry in the opcode table.
    #[error("unknown opcode {0:#04x}")]
    UnknownOpcode(u8),
    /// The BTH pad count does not fit the packet (more pad than bytes after the headers).
    #[error("bad pad count {pad} for {available} bytes after the headers")]
    BadPadCount { pad: u8, available: usize },
    /// A `Repr` handed to `emit` carries headers that its opcode does not (or lacks one it needs).
    #[error("headers do not match opcode {opcode:#04x}: {detail}")]
    HeaderMismatch { opcode: u8, detail: &'static str },
    /// A field value cannot be represented on the wire (for example a PSN above 2^24).
    #[error("field out of range: {0}")]
    FieldRange(&'static str),
    /// The ICRC stored in the packet differs from the one computed over it.
    #[error("bad ICRC: computed {computed:#010x}, packet has {stored:#010x}")]
    Icrc { computed: u32, stored: u32 },
    /// The caller's output buffer is too small for the frame.
    #[error("output buffer too small: need {need} bytes, have {have}")]
    BufferTooSmall { need: usize, have: usize },
}

pub type Result<T> = core::result::Result<T, WireError>;

/// Returns `Err(Truncated)` unless `buf` holds at least `need` bytes.
#[inline]
pub(crate) fn check_len(layer: &'static str, buf: &[u8], need: usize) -> Result<()> {
    if buf.len() < need {
        Err(WireError::Truncated {
            layer,
            need,
            have: buf.len(),
        })
    } else {
        Ok(())
    }
}

/// Big-endian field helpers over byte slices. Callers have checked lengths already.
pub(crate) mod be {
    use super::Field;

    #[inline]
    pub fn u16_at(b: &[u8], f: Field) -> u16 {
        let s = &b[f];
        u16::from_be_bytes([s[0], s[1]])
    }
    #[inline]
    pub fn u24_at(b: &[u8], at: usize) -> u32 {
        u32::from_be_bytes([0, b[at], b[at + 1], b[at + 2]])
    }
    #[inline]
    pub fn u32_at(b: &[u8], f: Field) -> u32 {
        let s = &b[f];
        u32::from_be_bytes([s[0], s[1], s[2], s[3]])
    }
    #[inline]
    pub fn u64_at(b: &[u8], f: Field) -> u64 {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[f]);
        u64::from_be_bytes(a)
    }
    #[inline]
    pub fn set_u16(b: &mut [u8], f: Field, v: u16) {
        b[f].copy_from_slice(&v.to_be_bytes());
    }
    #[inline]
    pub fn set_u24(b: &mut [u8], at: usize, v: u32) {
        b[at..at + 3].copy_from_slice(&v.to_be_bytes()[1..]);
    }
    #[inline]
    pub fn set_u32(b: &mut [u8], f: Field, v: u32) {
        b[f].copy_from_slice(&v.to_be_bytes());
    }
    #[inline]
    pub fn set_u64(b: &mut [u8], f: Field, v: u64) {
        b[f].copy_from_slice(&v.to_be_bytes());
    }
}

/// The Internet checksum (RFC 1071) of `data`, folded, not complemented, seeded with `initial`.
///
/// Added eight bytes at a time, as two 32-bit words into a 64-bit sum (2^16 is 1 modulo
/// 2^16 - 1, so a word and its two 16-bit halves fold to the same value: RFC 1071's deferred
/// carries), and in the machine's byte order, swapped once at the end (RFC 1071's byte order
/// independence: a byte swap is a multiplication by 2^8 modulo 2^16 - 1). Swapping each word
/// instead made the compiler shuffle bytes in vector registers, which QEMU's emulation (the
/// guests, where a batching peer's datagrams arrive with full checksums) runs slowly.
pub(crate) fn ones_complement_sum(initial: u32, data: &[u8]) -> u32 {
    fn fold(mut sum: u64) -> u64 {
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        sum
    }
    let swap = |s: u64| ((s & 0xff) << 8) | (s >> 8);
    // At most 2^13 words of 2^32 each for a 64 KiB packet: the sum cannot overflow.
    let mut sum = swap(fold(u64::from(initial)));
    let mut words = data.chunks_exact(8);
    for w in &mut words {
        let w = u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
        sum += (w >> 32) + (w & 0xffff_ffff);
    }
    let mut halves = words.remainder().chunks_exact(2);
    for c in &mut halves {
        sum += u64::from(u16::from_le_bytes([c[0], c[1]]));
    }
    if let [last] = halves.remainder() {
        // The high byte of a big-endian word padded with zero: the low byte of a little-endian one.
        sum += u64::from(*last);
    }
    swap(fold(sum)) as u32
}

#[cfg(test)]
mod tests {
    use super::ones_complement_sum;
    use proptest::prelude::*;

    /// RFC 1071 as written: 16-bit big-endian words, an odd last byte padded with zero.
    fn by_halves(initial: u32, data: &[u8]) -> u32 {
        let mut sum = u64::from(initial);
        for c in data.chunks(2) {
            sum += u64::from(u16::from_be_bytes([c[0], c.get(1).copied().unwrap_or(0)]));
        }
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        sum as u32
    }

    /// Every length's tail (0 to 7 bytes after the 8-byte words), all-ones data (the most
    /// carries), zeros (the sum that stays 0) and seeds up to `u32::MAX`.
    #[test]
    fn word_sums_fold_as_the_definition_does() {
        for len in 0..=80 {
            for fill in [0x00u8, 0xff, 0x5a] {
                let data = vec![fill; len];
                for initial in [0, 1, 0xffff, 0x1_0000, u32::MAX] {
                    assert_eq!(
                        ones_complement_sum(initial, &data),
                        by_halves(initial, &data),
                        "{len} bytes of {fill:#x}, seed {initial:#x}"
                    );
                }
            }
        }
        let jumbo = vec![0xffu8; 65_535];
        assert_eq!(ones_complement_sum(0, &jumbo), by_halves(0, &jumbo));
    }

    proptest! {
        #[test]
        fn word_sums_match_the_definition_on_any_bytes(
            data in proptest::collection::vec(any::<u8>(), 0..2000),
            initial in any::<u32>(),
        ) {
            prop_assert_eq!(ones_complement_sum(initial, &data), by_halves(initial, &data));
        }
    }
}
