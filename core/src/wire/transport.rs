//! The InfiniBand transport part of a RoCEv2 packet: BTH, the extension headers its opcode
//! prescribes, payload, pad and ICRC (everything inside the UDP datagram).

use super::bth::{self, BthPacket, BthRepr};
use super::ext::{
    emit_u32, parse_u32, AethRepr, AtomicAckEthRepr, AtomicEthRepr, DethRepr, FethRepr, RdethRepr,
    RethRepr,
};
use super::opcode::{HeaderKind, HeaderSet, OpcodeInfo};
use super::{check_len, Result, WireError, ICRC_LEN};

/// A checked view over a UDP payload holding BTH .. ICRC.
///
/// After [`new_checked`](Self::new_checked) the opcode is known, every extension header it
/// names is present, and the pad count fits, so no accessor can panic.
#[derive(Debug, Clone, Copy)]
pub struct TransportPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> TransportPacket<T> {
    pub const fn new_unchecked(buffer: T) -> Self {
        TransportPacket { buffer }
    }

    pub fn new_checked(buffer: T) -> Result<Self> {
        let p = Self::new_unchecked(buffer);
        p.check_len()?;
        Ok(p)
    }

    /// Validates what the accessors rely on, in the order rdma_rxe's receive path does: BTH
    /// present and of version 0, opcode known, headers plus ICRC present, pad within bounds.
    pub fn check_len(&self) -> Result<()> {
        let b = self.buffer.as_ref();
        let bth = BthPacket::new_checked(b)?;
        if bth.transport_version() != 0 {
            return Err(WireError::TransportVersion(bth.transport_version()));
        }
        let info = bth
            .opcode()
            .info()
            .ok_or(WireError::UnknownOpcode(bth.opcode().0))?;
        check_len(info.name, b, info.header_len() + ICRC_LEN)?;
        let available = b.len() - info.header_len() - ICRC_LEN;
        let pad = bth.pad_count();
        if usize::from(pad) > available {
            return Err(WireError::BadPadCount { pad, available });
        }
        if !info.has_payload() && available != usize::from(pad) {
            return Err(WireError::BadLength {
                layer: info.name,
                detail: "payload on an opcode that carries none",
            });
        }
        Ok(())
    }

    pub fn into_inner(self) -> T {
        self.buffer
    }

    pub fn bth(&self) -> BthPacket<&[u8]> {
        BthPacket::new_unchecked(self.buffer.as_ref())
    }

    /// The opcode's table entry (known to exist after `new_checked`).
    pub fn info(&self) -> &'static OpcodeInfo {
        let op = self.bth().opcode();
        match op.info() {
            Some(i) => i,
            // new_checked rejected unknown opcodes; an unchecked view may still get here.
            None => &UNKNOWN,
        }
    }

    pub fn header_len(&self) -> usize {
        self.info().header_len()
    }

    fn payload_end(&self) -> usize {
        self.buffer.as_ref().len() - ICRC_LEN - usize::from(self.bth().pad_count())
    }

    /// The ICRC as a number: the four trailing bytes read least-significant byte first.
    pub fn icrc(&self) -> u32 {
        let b = self.buffer.as_ref();
        let mut a = [0u8; 4];
        a.copy_from_slice(&b[b.len() - ICRC_LEN..]);
        u32::from_le_bytes(a)
    }
}

impl<'a, T: AsRef<[u8]> + ?Sized> TransportPacket<&'a T> {
    /// The payload, pad excluded.
    pub fn payload(&self) -> &'a [u8] {
        &self.buffer.as_ref()[self.header_len()..self.payload_end()]
    }
    /// The pad bytes (rdma_rxe writes zeros; they are covered by the ICRC).
    pub fn pad(&self) -> &'a [u8] {
        let b = self.buffer.as_ref();
        &b[self.payload_end()..b.len() - ICRC_LEN]
    }
}

/// Stands in for `info()` on an unchecked view of an unknown opcode: no headers, no payload.
static UNKNOWN: OpcodeInfo = OpcodeInfo::new(
    "UNKNOWN",
    super::opcode::Transport::Rc,
    super::opcode::Operation::Acknowledge,
    super::opcode::Position::Only,
    HeaderSet::NONE,
);

/// The meaning of BTH plus extension headers. Which `Option`s are `Some` must agree with the
/// opcode table entry for `bth.opcode`; [`emit_headers`](Self::emit_headers) checks it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransportRepr {
    pub bth: BthRepr,
    pub rdeth: Option<RdethRepr>,
    pub deth: Option<DethRepr>,
    pub feth: Option<FethRepr>,
    pub reth: Option<RethRepr>,
    pub atomic_eth: Option<AtomicEthRepr>,
    pub aeth: Option<AethRepr>,
    pub atomic_ack_eth: Option<AtomicAckEthRepr>,
    /// ImmDt, as the 32-bit big-endian value on the wire (opaque to the transport).
    pub immediate: Option<u32>,
    /// IETH: the R_Key to invalidate.
    pub invalidate_rkey: Option<u32>,
}

impl TransportRepr {
    /// A repr with only a BTH; fill in the extension headers the opcode needs.
    pub fn new(bth: BthRepr) -> Self {
        TransportRepr {
            bth,
            rdeth: None,
            deth: None,
            feth: None,
            reth: None,
            atomic_eth: None,
            aeth: None,
            atomic_ack_eth: None,
            immediate: None,
            invalidate_rkey: None,
        }
    }

    pub fn parse<T: AsRef<[u8]>>(p: &TransportPacket<T>) -> Result<Self> {
        p.check_len()?;
        let bth = BthRepr::parse(&p.bth())?;
        let mut r = TransportRepr::new(bth);
        // One walk over the opcode's headers (every packet received comes here).
        let b = p.buffer.as_ref();
        for (kind, off) in p.info().headers.in_wire_order() {
            let at = bth::HEADER_LEN + off;
            // `check_len` above guarantees every header is there.
            let Some(h) = b.get(at..at + kind.wire_len()) else {
                return Err(WireError::Truncated {
                    layer: "extension headers",
                    need: at + kind.wire_len(),
                    have: b.len(),
                });
            };
            match kind {
                HeaderKind::Rdeth => r.rdeth = Some(RdethRepr::parse(h)?),
                HeaderKind::Deth => r.deth = Some(DethRepr::parse(h)?),
                HeaderKind::Feth => r.feth = Some(FethRepr::parse(h)?),
                HeaderKind::Reth => r.reth = Some(RethRepr::parse(h)?),
                HeaderKind::AtomicEth => r.atomic_eth = Some(AtomicEthRepr::parse(h)?),
                HeaderKind::Aeth => r.aeth = Some(AethRepr::parse(h)?),
                HeaderKind::AtomicAckEth => r.atomic_ack_eth = Some(AtomicAckEthRepr::parse(h)?),
                HeaderKind::ImmDt => r.immediate = Some(parse_u32("ImmDt", h)?),
                HeaderKind::Ieth => r.invalidate_rkey = Some(parse_u32("IETH", h)?),
                // Reserved bytes, no field.
                HeaderKind::CnpReserved => {}
            }
        }
        Ok(r)
    }

    /// The opcode's table entry, or `UnknownOpcode`.
    pub fn info(&self) -> Result<&'static OpcodeInfo> {
        self.bth
            .opcode
            .info()
            .ok_or(WireError::UnknownOpcode(self.bth.opcode.0))
    }

    /// BTH plus extension headers, in bytes.
    pub fn header_len(&self) -> Result<usize> {
        Ok(self.info()?.header_len())
    }

    /// Bytes from BTH through ICRC for `payload_len` bytes of payload.
    pub fn packet_len(&self, payload_len: usize) -> Result<usize> {
        Ok(self.header_len()? + payload_len + pad_for(payload_len) + ICRC_LEN)
    }

    /// Checks that the present headers are exactly those the opcode prescribes.
    fn check_headers(&self, info: &OpcodeInfo) -> Result<()> {
        let present = [
            (HeaderKind::Rdeth, self.rdeth.is_some()),
            (HeaderKind::Deth, self.deth.is_some()),
            (HeaderKind::Feth, self.feth.is_some()),
            (HeaderKind::Reth, self.reth.is_some()),
            (HeaderKind::AtomicEth, self.atomic_eth.is_some()),
            (HeaderKind::Aeth, self.aeth.is_some()),
            (HeaderKind::AtomicAckEth, self.atomic_ack_eth.is_some()),
            (HeaderKind::ImmDt, self.immediate.is_some()),
            (HeaderKind::Ieth, self.invalidate_rkey.is_some()),
        ];
        // Every packet built comes here: compare the sets whole, and look for the culprit
        // only when they differ. (The CNP's reserved bytes are not a field.)
        let set = present
            .iter()
            .fold(HeaderSet::NONE, |set, &(kind, is_present)| {
                if is_present {
                    set.with(HeaderSet::of(kind))
                } else {
                    set
                }
            });
        if set == info.headers.without(HeaderSet::CNP_RESERVED) {
            return Ok(());
        }
        for (kind, is_present) in present {
            if info.headers.contains(kind) != is_present {
                return Err(WireError::HeaderMismatch {
                    opcode: self.bth.opcode.0,
                    detail: if is_present {
                        "carries a header its opcode does not have"
                    } else {
                        "lacks a header its opcode needs"
                    },
                });
            }
        }
        Ok(())
    }

    /// Writes BTH and extension headers at the start of `buf` for a packet carrying
    /// `payload_len` bytes; the BTH pad count is derived from `payload_len` (the `pad_count`
    /// field of `self.bth` is ignored). Returns the header length. Payload, pad and ICRC are the
    /// caller's (see [`FrameWriter`](super::frame::FrameWriter)).
    pub fn emit_headers(&self, buf: &mut [u8], payload_len: usize) -> Result<usize> {
        let info = self.info()?;
        self.check_headers(info)?;
        if !info.has_payload() && payload_len != 0 {
            return Err(WireError::BadLength {
                layer: info.name,
                detail: "payload on an opcode that carries none",
            });
        }
        let hlen = info.header_len();
        check_len("transport headers", buf, hlen)?;
        let mut bth = self.bth;
        bth.pad_count = pad_for(payload_len) as u8;
        bth.emit(&mut buf[..bth::HEADER_LEN])?;
        let ext = &mut buf[bth::HEADER_LEN..hlen];
        // One walk over the opcode's headers. `check_headers` made sure each is `Some` here.
        for (kind, off) in info.headers.in_wire_order() {
            let h = &mut ext[off..off + kind.wire_len()];
            match kind {
                HeaderKind::Rdeth => emit_some(&self.rdeth, |v| v.emit(h))?,
                HeaderKind::Deth => emit_some(&self.deth, |v| v.emit(h))?,
                HeaderKind::Feth => emit_some(&self.feth, |v| v.emit(h))?,
                HeaderKind::Reth => emit_some(&self.reth, |v| v.emit(h))?,
                HeaderKind::AtomicEth => emit_some(&self.atomic_eth, |v| v.emit(h))?,
                HeaderKind::Aeth => emit_some(&self.aeth, |v| v.emit(h))?,
                HeaderKind::AtomicAckEth => emit_some(&self.atomic_ack_eth, |v| v.emit(h))?,
                HeaderKind::ImmDt => emit_some(&self.immediate, |&v| emit_u32("ImmDt", v, h))?,
                HeaderKind::Ieth => emit_some(&self.invalidate_rkey, |&v| emit_u32("IETH", v, h))?,
                HeaderKind::CnpReserved => h.fill(0),
            }
        }
        Ok(hlen)
    }
}

/// Writes a header that is present; one that is not was already reported by `check_headers`.
fn emit_some<H>(header: &Option<H>, emit: impl FnOnce(&H) -> Result<()>) -> Result<()> {
    header.as_ref().map_or(Ok(()), emit)
}

/// Pad bytes that bring `payload_len` to a multiple of four.
pub const fn pad_for(payload_len: usize) -> usize {
    payload_len.wrapping_neg() & 3
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::opcode::Opcode;

    fn repr(opcode: u8) -> TransportRepr {
        TransportRepr::new(BthRepr {
            ack_req: true,
            ..BthRepr::new(Opcode(opcode), 0x11, 7)
        })
    }

    fn mismatch(t: &TransportRepr) -> Option<&'static str> {
        match t.emit_headers(&mut [0u8; 64], 0) {
            Err(WireError::HeaderMismatch { detail, .. }) => Some(detail),
            _ => None,
        }
    }

    #[test]
    fn headers_must_be_exactly_those_of_the_opcode() {
        let reth = RethRepr {
            va: 0x1000,
            rkey: 5,
            dma_len: 0,
        };
        // RC_SEND_ONLY carries no RETH.
        let mut send = repr(0x04);
        assert_eq!(mismatch(&send), None);
        send.reth = Some(reth);
        assert_eq!(
            mismatch(&send),
            Some("carries a header its opcode does not have")
        );
        // RC_RDMA_WRITE_ONLY needs one.
        let mut write = repr(0x0a);
        assert_eq!(mismatch(&write), Some("lacks a header its opcode needs"));
        write.reth = Some(reth);
        assert_eq!(mismatch(&write), None);
        // The CNP's reserved bytes are the opcode's own, not a field to fill.
        assert_eq!(mismatch(&repr(0x81)), None);
    }
}
