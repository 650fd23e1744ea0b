//! UDP header. RoCEv2 uses destination port 4791 and, like rdma_rxe, checksum 0.

use super::ip::IpRepr;
use super::{be, check_len, ones_complement_sum, Field, Result, WireError};

pub(crate) mod field {
    use super::Field;
    pub const SRC_PORT: Field = 0..2;
    pub const DST_PORT: Field = 2..4;
    pub const LENGTH: Field = 4..6;
    pub const CHECKSUM: Field = 6..8;
}

pub const HEADER_LEN: usize = 8;

/// A checked view over a UDP datagram.
#[derive(Debug, Clone, Copy)]
pub struct UdpPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> UdpPacket<T> {
    pub const fn new_unchecked(buffer: T) -> Self {
        UdpPacket { buffer }
    }

    /// Wraps `buffer` after checking that the UDP length is at least the header and fits.
    pub fn new_checked(buffer: T) -> Result<Self> {
        let p = Self::new_unchecked(buffer);
        p.check_len()?;
        Ok(p)
    }

    pub fn check_len(&self) -> Result<()> {
        let b = self.buffer.as_ref();
        check_len("UDP header", b, HEADER_LEN)?;
        let len = usize::from(self.len());
        if len < HEADER_LEN {
            return Err(WireError::BadLength {
                layer: "UDP",
                detail: "length below the header length",
            });
        }
        check_len("UDP datagram (length field)", b, len)
    }

    pub fn into_inner(self) -> T {
        self.buffer
    }

    pub fn src_port(&self) -> u16 {
        be::u16_at(self.buffer.as_ref(), field::SRC_PORT)
    }
    pub fn dst_port(&self) -> u16 {
        be::u16_at(self.buffer.as_ref(), field::DST_PORT)
    }
    pub fn len(&self) -> u16 {
        be::u16_at(self.buffer.as_ref(), field::LENGTH)
    }
    pub fn is_empty(&self) -> bool {
        usize::from(self.len()) == HEADER_LEN
    }
    pub fn checksum(&self) -> u16 {
        be::u16_at(self.buffer.as_ref(), field::CHECKSUM)
    }

    /// True when the checksum is zero ("not computed", what rdma_rxe sends), correct for the
    /// pseudo-header of `ip`, or left partial for a device to complete.
    ///
    /// A sending kernel that offloads the UDP checksum writes only the pseudo-header's sum
    /// there, and on a virtual link (veth) no device ever completes it: the receiving kernel
    /// trusts such a packet (`CHECKSUM_PARTIAL`), but an AF_XDP receiver gets the bytes alone.
    /// xroce's own batched sending (the datapath's `udp_gso`) leaves it so. Accepting that one
    /// value gives nothing away: the ICRC covers every byte the checksum does.
    pub fn verify_checksum(&self, ip: &IpRepr) -> bool {
        if self.checksum() == 0 {
            // What rdma_rxe and xroce send: no pseudo-header sum needed.
            return true;
        }
        let len = usize::from(self.len());
        let pseudo = ip.pseudo_header_sum(len);
        if u32::from(self.checksum()) == ones_complement_sum(pseudo, &[]) {
            return true;
        }
        let sum = ones_complement_sum(pseudo, &self.buffer.as_ref()[..len]);
        sum == 0xffff
    }
}

impl<'a, T: AsRef<[u8]> + ?Sized> UdpPacket<&'a T> {
    /// The bytes after the header, up to the UDP length.
    pub fn payload(&self) -> &'a [u8] {
        &self.buffer.as_ref()[HEADER_LEN..usize::from(self.len())]
    }
}

/// The meaning of a UDP header. The checksum is not part of it: xroce always sends 0, as
/// rdma_rxe does, and checks a non-zero one on receive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdpRepr {
    pub src_port: u16,
    pub dst_port: u16,
    /// Bytes after the 8-byte header.
    pub payload_len: usize,
}

impl UdpRepr {
    pub fn parse<T: AsRef<[u8]>>(p: &UdpPacket<T>) -> Result<Self> {
        p.check_len()?;
        Ok(UdpRepr {
            src_port: p.src_port(),
            dst_port: p.dst_port(),
            payload_len: usize::from(p.len()) - HEADER_LEN,
        })
    }

    pub const fn header_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the header with checksum 0.
    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        check_len("UDP header", buf, HEADER_LEN)?;
        let len = u16::try_from(HEADER_LEN + self.payload_len)
            .map_err(|_| WireError::FieldRange("UDP length above 65535"))?;
        be::set_u16(buf, field::SRC_PORT, self.src_port);
        be::set_u16(buf, field::DST_PORT, self.dst_port);
        be::set_u16(buf, field::LENGTH, len);
        be::set_u16(buf, field::CHECKSUM, 0);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::ipv4::{Ipv4Address, Ipv4Repr};

    #[test]
    fn nonzero_checksum_is_verified() {
        let ip = IpRepr::V4(Ipv4Repr {
            src: Ipv4Address([10, 0, 0, 1]),
            dst: Ipv4Address([10, 0, 0, 2]),
            tos: 0,
            ident: 0,
            dont_frag: true,
            ttl: 64,
            protocol: 17,
            payload_len: 12,
        });
        let mut d = [0x12, 0x34, 0x12, 0xb7, 0x00, 0x0c, 0x00, 0x00, 1, 2, 3, 4];
        assert!(UdpPacket::new_checked(&d[..]).unwrap().verify_checksum(&ip));
        let sum = !ones_complement_sum(ip.pseudo_header_sum(12), &d) as u16;
        d[6..8].copy_from_slice(&sum.to_be_bytes());
        assert!(UdpPacket::new_checked(&d[..]).unwrap().verify_checksum(&ip));
        d[11] ^= 1;
        assert!(!UdpPacket::new_checked(&d[..]).unwrap().verify_checksum(&ip));
        // Partial, as an offloading sender leaves it: the pseudo-header's sum alone.
        let partial = ones_complement_sum(ip.pseudo_header_sum(12), &[]) as u16;
        // 0x0a00 + 0x0001 + 0x0a00 + 0x0002 + 17 + 12, as Linux leaves it.
        assert_eq!(partial, 0x1420);
        d[6..8].copy_from_slice(&partial.to_be_bytes());
        assert!(UdpPacket::new_checked(&d[..]).unwrap().verify_checksum(&ip));
        d[6..8].copy_from_slice(&(partial ^ 1).to_be_bytes());
        assert!(!UdpPacket::new_checked(&d[..]).unwrap().verify_checksum(&ip));
    }
}
