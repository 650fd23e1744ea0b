//! Ethernet II header, with an optional 802.1Q VLAN tag.

use core::fmt;

use super::{be, check_len, Field, Result};

/// A 48-bit MAC address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct EthernetAddress(pub [u8; 6]);

impl EthernetAddress {
    pub const BROADCAST: EthernetAddress = EthernetAddress([0xff; 6]);
}

impl fmt::Display for EthernetAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            b[0], b[1], b[2], b[3], b[4], b[5]
        )
    }
}

/// The EtherTypes this stack cares about; anything else is kept as a raw value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EtherType {
    Ipv4,
    Ipv6,
    Arp,
    Vlan,
    Other(u16),
}

impl From<u16> for EtherType {
    fn from(v: u16) -> Self {
        match v {
            0x0800 => EtherType::Ipv4,
            0x86dd => EtherType::Ipv6,
            0x0806 => EtherType::Arp,
            0x8100 => EtherType::Vlan,
            o => EtherType::Other(o),
        }
    }
}

impl From<EtherType> for u16 {
    fn from(v: EtherType) -> u16 {
        match v {
            EtherType::Ipv4 => 0x0800,
            EtherType::Ipv6 => 0x86dd,
            EtherType::Arp => 0x0806,
            EtherType::Vlan => 0x8100,
            EtherType::Other(o) => o,
        }
    }
}

mod field {
    use super::Field;
    pub const DST: Field = 0..6;
    pub const SRC: Field = 6..12;
    pub const TYPE: Field = 12..14;
    /// With a VLAN tag: the TCI follows the 0x8100 TPID, then the inner EtherType.
    pub const TCI: Field = 14..16;
    pub const INNER_TYPE: Field = 16..18;
}

/// Length of an untagged Ethernet header.
pub const HEADER_LEN: usize = 14;
/// Length of an Ethernet header carrying one 802.1Q tag.
pub const VLAN_HEADER_LEN: usize = 18;

/// A checked view over an Ethernet frame (header and what follows).
#[derive(Debug, Clone, Copy)]
pub struct EthernetFrame<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> EthernetFrame<T> {
    pub const fn new_unchecked(buffer: T) -> Self {
        EthernetFrame { buffer }
    }

    /// Wraps `buffer` after checking that the whole header (including a VLAN tag, if the TPID
    /// announces one) is present.
    pub fn new_checked(buffer: T) -> Result<Self> {
        let f = Self::new_unchecked(buffer);
        f.check_len()?;
        Ok(f)
    }

    pub fn check_len(&self) -> Result<()> {
        let b = self.buffer.as_ref();
        check_len("Ethernet header", b, HEADER_LEN)?;
        if self.is_vlan_tagged() {
            check_len("802.1Q tag", b, VLAN_HEADER_LEN)?;
        }
        Ok(())
    }

    pub fn into_inner(self) -> T {
        self.buffer
    }

    pub fn dst_addr(&self) -> EthernetAddress {
        let mut a = [0u8; 6];
        a.copy_from_slice(&self.buffer.as_ref()[field::DST]);
        EthernetAddress(a)
    }

    pub fn src_addr(&self) -> EthernetAddress {
        let mut a = [0u8; 6];
        a.copy_from_slice(&self.buffer.as_ref()[field::SRC]);
        EthernetAddress(a)
    }

    fn outer_type(&self) -> u16 {
        be::u16_at(self.buffer.as_ref(), field::TYPE)
    }

    pub fn is_vlan_tagged(&self) -> bool {
        self.outer_type() == u16::from(EtherType::Vlan)
    }

    /// The VLAN tag, if the frame carries one.
    pub fn vlan(&self) -> Option<VlanTag> {
        self.is_vlan_tagged()
            .then(|| VlanTag::from_tci(be::u16_at(self.buffer.as_ref(), field::TCI)))
    }

    /// The EtherType of the payload (the inner one for a tagged frame).
    pub fn ethertype(&self) -> EtherType {
        if self.is_vlan_tagged() {
            EtherType::from(be::u16_at(self.buffer.as_ref(), field::INNER_TYPE))
        } else {
            EtherType::from(self.outer_type())
        }
    }

    pub fn header_len(&self) -> usize {
        if self.is_vlan_tagged() {
            VLAN_HEADER_LEN
        } else {
            HEADER_LEN
        }
    }
}

impl<'a, T: AsRef<[u8]> + ?Sized> EthernetFrame<&'a T> {
    pub fn payload(&self) -> &'a [u8] {
        &self.buffer.as_ref()[self.header_len()..]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> EthernetFrame<T> {
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let at = self.header_len();
        &mut self.buffer.as_mut()[at..]
    }
}

/// An 802.1Q tag control field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct VlanTag {
    /// Priority code point, 0..=7.
    pub pcp: u8,
    /// Drop eligible indicator.
    pub dei: bool,
    /// VLAN identifier, 0..=4095.
    pub vid: u16,
}

impl VlanTag {
    pub fn from_tci(tci: u16) -> Self {
        VlanTag {
            pcp: (tci >> 13) as u8,
            dei: tci & 0x1000 != 0,
            vid: tci & 0x0fff,
        }
    }

    pub fn tci(&self) -> u16 {
        (u16::from(self.pcp & 7) << 13) | (u16::from(self.dei) << 12) | (self.vid & 0x0fff)
    }
}

/// The meaning of an Ethernet header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EthernetRepr {
    pub src: EthernetAddress,
    pub dst: EthernetAddress,
    pub vlan: Option<VlanTag>,
    /// The EtherType of the payload (inner type when tagged).
    pub ethertype: EtherType,
}

impl EthernetRepr {
    pub fn parse<T: AsRef<[u8]>>(frame: &EthernetFrame<T>) -> Result<Self> {
        frame.check_len()?;
        Ok(EthernetRepr {
            src: frame.src_addr(),
            dst: frame.dst_addr(),
            vlan: frame.vlan(),
            ethertype: frame.ethertype(),
        })
    }

    pub fn header_len(&self) -> usize {
        if self.vlan.is_some() {
            VLAN_HEADER_LEN
        } else {
            HEADER_LEN
        }
    }

    /// Writes the header at the start of `buf`, which must hold `header_len()` bytes.
    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        check_len("Ethernet header", buf, self.header_len())?;
        buf[field::DST].copy_from_slice(&self.dst.0);
        buf[field::SRC].copy_from_slice(&self.src.0);
        match self.vlan {
            Some(tag) => {
                be::set_u16(buf, field::TYPE, EtherType::Vlan.into());
                be::set_u16(buf, field::TCI, tag.tci());
                be::set_u16(buf, field::INNER_TYPE, self.ethertype.into());
            }
            None => be::set_u16(buf, field::TYPE, self.ethertype.into()),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vlan_tagged_frame_parses_and_reemits() {
        let bytes: [u8; 20] = [
            1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0x81, 0x00, 0xa0, 0x64, 0x08, 0x00, 0x45, 0,
        ];
        let f = EthernetFrame::new_checked(&bytes[..]).unwrap();
        let r = EthernetRepr::parse(&f).unwrap();
        assert_eq!(
            r.vlan,
            Some(VlanTag {
                pcp: 5,
                dei: false,
                vid: 100
            })
        );
        assert_eq!(r.ethertype, EtherType::Ipv4);
        assert_eq!(f.payload(), &[0x45, 0]);
        let mut out = [0u8; 18];
        r.emit(&mut out).unwrap();
        assert_eq!(&out[..], &bytes[..18]);
    }

    #[test]
    fn truncated_vlan_tag_is_an_error() {
        let bytes = [0u8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x81, 0x00, 0, 1];
        assert!(EthernetFrame::new_checked(&bytes[..]).is_err());
    }
}
