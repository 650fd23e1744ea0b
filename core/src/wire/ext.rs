//! The extension headers that follow the BTH (layouts from rdma_rxe's `rxe_hdr.h`; all
//! multi-byte fields big-endian).
//!
//! Each `Repr` parses from and emits into a slice of exactly its length; the slice comes from
//! [`TransportPacket`](super::transport::TransportPacket), which has already checked that the
//! bytes are there, so these functions only fail when called with a short slice.

use super::{be, check_len, Result, WireError};

/// Reliable Datagram ETH: resv(8) | EE-context(24).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RdethRepr {
    pub ee_context: u32,
}

impl RdethRepr {
    pub const LEN: usize = 4;
    pub fn parse(b: &[u8]) -> Result<Self> {
        check_len("RDETH", b, Self::LEN)?;
        Ok(RdethRepr {
            ee_context: be::u24_at(b, 1),
        })
    }
    pub fn emit(&self, b: &mut [u8]) -> Result<()> {
        check_len("RDETH", b, Self::LEN)?;
        if self.ee_context > 0x00ff_ffff {
            return Err(WireError::FieldRange("EE context above 24 bits"));
        }
        b[0] = 0;
        be::set_u24(b, 1, self.ee_context);
        Ok(())
    }
}

/// Datagram ETH: Q_Key(32) | resv(8) | SrcQP(24).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DethRepr {
    pub qkey: u32,
    pub src_qpn: u32,
}

impl DethRepr {
    pub const LEN: usize = 8;
    pub fn parse(b: &[u8]) -> Result<Self> {
        check_len("DETH", b, Self::LEN)?;
        Ok(DethRepr {
            qkey: be::u32_at(b, 0..4),
            src_qpn: be::u24_at(b, 5),
        })
    }
    pub fn emit(&self, b: &mut [u8]) -> Result<()> {
        check_len("DETH", b, Self::LEN)?;
        if self.src_qpn > 0x00ff_ffff {
            return Err(WireError::FieldRange("DETH source QPN above 24 bits"));
        }
        be::set_u32(b, 0..4, self.qkey);
        b[4] = 0;
        be::set_u24(b, 5, self.src_qpn);
        Ok(())
    }
}

/// FLUSH ETH (Linux 6.2+): resv(26) | SEL(2) | PLT(4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FethRepr {
    /// Selectivity level (2 bits): 0 = memory region range, 1 = whole memory region.
    pub selectivity: u8,
    /// Placement type (4 bits): bit 0 global visibility, bit 1 persistence.
    pub placement: u8,
}

impl FethRepr {
    pub const LEN: usize = 4;
    pub fn parse(b: &[u8]) -> Result<Self> {
        check_len("FETH", b, Self::LEN)?;
        let w = be::u32_at(b, 0..4);
        Ok(FethRepr {
            selectivity: ((w >> 4) & 3) as u8,
            placement: (w & 0xf) as u8,
        })
    }
    pub fn emit(&self, b: &mut [u8]) -> Result<()> {
        check_len("FETH", b, Self::LEN)?;
        if self.selectivity > 3 || self.placement > 0xf {
            return Err(WireError::FieldRange(
                "FETH selectivity or placement too large",
            ));
        }
        let w = (u32::from(self.selectivity) << 4) | u32::from(self.placement);
        be::set_u32(b, 0..4, w);
        Ok(())
    }
}

/// RDMA ETH: VA(64) | R_Key(32) | DMA length(32).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RethRepr {
    pub va: u64,
    pub rkey: u32,
    /// The whole message length on a WRITE FIRST/ONLY and on a READ request.
    pub dma_len: u32,
}

impl RethRepr {
    pub const LEN: usize = 16;
    pub fn parse(b: &[u8]) -> Result<Self> {
        check_len("RETH", b, Self::LEN)?;
        Ok(RethRepr {
            va: be::u64_at(b, 0..8),
            rkey: be::u32_at(b, 8..12),
            dma_len: be::u32_at(b, 12..16),
        })
    }
    pub fn emit(&self, b: &mut [u8]) -> Result<()> {
        check_len("RETH", b, Self::LEN)?;
        be::set_u64(b, 0..8, self.va);
        be::set_u32(b, 8..12, self.rkey);
        be::set_u32(b, 12..16, self.dma_len);
        Ok(())
    }
}

/// Atomic ETH: VA(64) | R_Key(32) | Swap-or-Add(64) | Compare(64), 28 bytes packed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AtomicEthRepr {
    pub va: u64,
    pub rkey: u32,
    /// Swap value (CmpSwap) or addend (FetchAdd).
    pub swap_add: u64,
    /// Compare value (CmpSwap); uninitialised garbage in rdma_rxe's FetchAdd requests.
    pub compare: u64,
}

impl AtomicEthRepr {
    pub const LEN: usize = 28;
    pub fn parse(b: &[u8]) -> Result<Self> {
        check_len("AtomicETH", b, Self::LEN)?;
        Ok(AtomicEthRepr {
            va: be::u64_at(b, 0..8),
            rkey: be::u32_at(b, 8..12),
            swap_add: be::u64_at(b, 12..20),
            compare: be::u64_at(b, 20..28),
        })
    }
    pub fn emit(&self, b: &mut [u8]) -> Result<()> {
        check_len("AtomicETH", b, Self::LEN)?;
        be::set_u64(b, 0..8, self.va);
        be::set_u32(b, 8..12, self.rkey);
        be::set_u64(b, 12..20, self.swap_add);
        be::set_u64(b, 20..28, self.compare);
        Ok(())
    }
}

/// NAK codes (AETH syndrome type 011).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NakCode {
    PsnSequenceError,
    InvalidRequest,
    RemoteAccessError,
    RemoteOperationalError,
    InvalidRdRequest,
    /// A reserved NAK value, kept so that it re-emits unchanged.
    Reserved(u8),
}

/// The AETH syndrome, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AethSyndrome {
    /// ACK with a credit count (rdma_rxe always sends 0x1F, "invalid/unlimited").
    Ack {
        credits: u8,
    },
    /// Receiver not ready; `timer` is the 5-bit RNR timer code.
    RnrNak {
        timer: u8,
    },
    Nak(NakCode),
    /// Syndrome types 010 and 1xx are reserved; the raw byte is kept.
    Reserved(u8),
}

impl AethSyndrome {
    /// The credit value rdma_rxe puts in every ACK: "no credit information".
    pub const UNLIMITED_CREDITS: u8 = 0x1f;
}

impl From<u8> for AethSyndrome {
    fn from(s: u8) -> Self {
        let value = s & 0x1f;
        match s >> 5 {
            0b000 => AethSyndrome::Ack { credits: value },
            0b001 => AethSyndrome::RnrNak { timer: value },
            0b011 => AethSyndrome::Nak(match value {
                0 => NakCode::PsnSequenceError,
                1 => NakCode::InvalidRequest,
                2 => NakCode::RemoteAccessError,
                3 => NakCode::RemoteOperationalError,
                4 => NakCode::InvalidRdRequest,
                v => NakCode::Reserved(v),
            }),
            _ => AethSyndrome::Reserved(s),
        }
    }
}

impl From<AethSyndrome> for u8 {
    fn from(s: AethSyndrome) -> u8 {
        match s {
            AethSyndrome::Ack { credits } => credits & 0x1f,
            AethSyndrome::RnrNak { timer } => 0x20 | (timer & 0x1f),
            AethSyndrome::Nak(code) => {
                0x60 | match code {
                    NakCode::PsnSequenceError => 0,
                    NakCode::InvalidRequest => 1,
                    NakCode::RemoteAccessError => 2,
                    NakCode::RemoteOperationalError => 3,
                    NakCode::InvalidRdRequest => 4,
                    NakCode::Reserved(v) => v & 0x1f,
                }
            }
            AethSyndrome::Reserved(raw) => raw,
        }
    }
}

/// ACK Extended Transport Header: Syndrome(8) | MSN(24).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AethRepr {
    pub syndrome: AethSyndrome,
    pub msn: u32,
}

impl AethRepr {
    pub const LEN: usize = 4;
    pub fn parse(b: &[u8]) -> Result<Self> {
        check_len("AETH", b, Self::LEN)?;
        Ok(AethRepr {
            syndrome: AethSyndrome::from(b[0]),
            msn: be::u24_at(b, 1),
        })
    }
    pub fn emit(&self, b: &mut [u8]) -> Result<()> {
        check_len("AETH", b, Self::LEN)?;
        if self.msn > 0x00ff_ffff {
            return Err(WireError::FieldRange("MSN above 24 bits"));
        }
        b[0] = self.syndrome.into();
        be::set_u24(b, 1, self.msn);
        Ok(())
    }
}

/// Atomic ACK ETH: the original remote value (64 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AtomicAckEthRepr {
    pub orig: u64,
}

impl AtomicAckEthRepr {
    pub const LEN: usize = 8;
    pub fn parse(b: &[u8]) -> Result<Self> {
        check_len("AtomicAckETH", b, Self::LEN)?;
        Ok(AtomicAckEthRepr {
            orig: be::u64_at(b, 0..8),
        })
    }
    pub fn emit(&self, b: &mut [u8]) -> Result<()> {
        check_len("AtomicAckETH", b, Self::LEN)?;
        be::set_u64(b, 0..8, self.orig);
        Ok(())
    }
}

/// A 4-byte header holding one 32-bit value: ImmDt (immediate data) and IETH (R_Key to
/// invalidate) both have this shape.
pub(crate) fn parse_u32(layer: &'static str, b: &[u8]) -> Result<u32> {
    check_len(layer, b, 4)?;
    Ok(be::u32_at(b, 0..4))
}

pub(crate) fn emit_u32(layer: &'static str, v: u32, b: &mut [u8]) -> Result<()> {
    check_len(layer, b, 4)?;
    be::set_u32(b, 0..4, v);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aeth_syndromes_roundtrip_every_byte() {
        for s in 0..=255u8 {
            assert_eq!(u8::from(AethSyndrome::from(s)), s);
        }
        assert_eq!(
            AethSyndrome::from(0x61),
            AethSyndrome::Nak(NakCode::InvalidRequest)
        );
        assert_eq!(AethSyndrome::from(0x2c), AethSyndrome::RnrNak { timer: 12 });
        assert_eq!(AethSyndrome::from(0x1f), AethSyndrome::Ack { credits: 31 });
    }

    #[test]
    fn atomic_eth_layout_is_packed() {
        let r = AtomicEthRepr {
            va: 0x0102030405060708,
            rkey: 0x0a0b0c0d,
            swap_add: 0x1112131415161718,
            compare: 0x2122232425262728,
        };
        let mut b = [0u8; 28];
        r.emit(&mut b).unwrap();
        assert_eq!(b[8..12], [0x0a, 0x0b, 0x0c, 0x0d]);
        assert_eq!(b[12], 0x11);
        assert_eq!(b[20], 0x21);
        assert_eq!(AtomicEthRepr::parse(&b).unwrap(), r);
    }

    #[test]
    fn feth_bits_sit_where_rxe_puts_them() {
        let r = FethRepr {
            selectivity: 1,
            placement: 2,
        };
        let mut b = [0u8; 4];
        r.emit(&mut b).unwrap();
        assert_eq!(b, [0, 0, 0, 0x12]); // SEL in bits 5-4, PLT in bits 3-0
        assert_eq!(FethRepr::parse(&b).unwrap(), r);
    }

    #[test]
    fn deth_roundtrip() {
        let r = DethRepr {
            qkey: 0x11111111,
            src_qpn: 0xabcdef,
        };
        let mut b = [0u8; 8];
        r.emit(&mut b).unwrap();
        assert_eq!(b, [0x11, 0x11, 0x11, 0x11, 0, 0xab, 0xcd, 0xef]);
        assert_eq!(DethRepr::parse(&b).unwrap(), r);
    }
}
