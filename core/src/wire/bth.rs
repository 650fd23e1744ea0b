//! The InfiniBand Base Transport Header (12 bytes), as rdma_rxe lays it out (`struct rxe_bth`).
//!
//! ```text
//! byte 0   : OpCode
//! byte 1   : SE(1) | M(1) | PadCnt(2) | TVer(4)
//! byte 2-3 : P_Key
//! byte 4   : FECN(1) | BECN(1) | resv6a(6)
//! byte 5-7 : DestQP
//! byte 8   : AckReq(1) | resv7(7)
//! byte 9-11: PSN
//! ```

use super::opcode::Opcode;
use super::{be, check_len, Field, Result, WireError};

mod field {
    use super::Field;
    pub const OPCODE: usize = 0;
    pub const FLAGS: usize = 1;
    pub const PKEY: Field = 2..4;
    pub const BECN_FECN: usize = 4;
    pub const DEST_QP: usize = 5;
    pub const ACK_REQ: usize = 8;
    pub const PSN: usize = 9;
}

pub const HEADER_LEN: usize = 12;

const SE: u8 = 0x80;
const MIG_REQ: u8 = 0x40;
const PAD_SHIFT: u8 = 4;
const TVER_MASK: u8 = 0x0f;
const FECN: u8 = 0x80;
const BECN: u8 = 0x40;
const ACK_REQ: u8 = 0x80;

/// Packet sequence numbers and queue pair numbers are 24-bit.
pub const PSN_MASK: u32 = 0x00ff_ffff;
pub const QPN_MASK: u32 = 0x00ff_ffff;

/// The default full-membership partition key rdma_rxe puts in every packet.
pub const DEFAULT_PKEY: u16 = 0xffff;

/// A checked view over a BTH.
#[derive(Debug, Clone, Copy)]
pub struct BthPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> BthPacket<T> {
    pub const fn new_unchecked(buffer: T) -> Self {
        BthPacket { buffer }
    }

    pub fn new_checked(buffer: T) -> Result<Self> {
        check_len("BTH", buffer.as_ref(), HEADER_LEN)?;
        Ok(Self::new_unchecked(buffer))
    }

    pub fn into_inner(self) -> T {
        self.buffer
    }

    fn b(&self) -> &[u8] {
        self.buffer.as_ref()
    }
    pub fn opcode(&self) -> Opcode {
        Opcode(self.b()[field::OPCODE])
    }
    pub fn solicited(&self) -> bool {
        self.b()[field::FLAGS] & SE != 0
    }
    pub fn mig_req(&self) -> bool {
        self.b()[field::FLAGS] & MIG_REQ != 0
    }
    pub fn pad_count(&self) -> u8 {
        (self.b()[field::FLAGS] >> PAD_SHIFT) & 3
    }
    pub fn transport_version(&self) -> u8 {
        self.b()[field::FLAGS] & TVER_MASK
    }
    pub fn pkey(&self) -> u16 {
        be::u16_at(self.b(), field::PKEY)
    }
    pub fn fecn(&self) -> bool {
        self.b()[field::BECN_FECN] & FECN != 0
    }
    pub fn becn(&self) -> bool {
        self.b()[field::BECN_FECN] & BECN != 0
    }
    pub fn dest_qpn(&self) -> u32 {
        be::u24_at(self.b(), field::DEST_QP)
    }
    pub fn ack_req(&self) -> bool {
        self.b()[field::ACK_REQ] & ACK_REQ != 0
    }
    pub fn psn(&self) -> u32 {
        be::u24_at(self.b(), field::PSN)
    }
}

/// The meaning of a BTH. Reserved bits are sent as zero and ignored on receive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BthRepr {
    pub opcode: Opcode,
    /// Solicited event.
    pub solicited: bool,
    /// MigReq; rdma_rxe sends 0 and ignores it, ConnectX sends 1.
    pub mig_req: bool,
    /// Pad bytes between payload and ICRC. [`TransportRepr`](super::TransportRepr) derives it
    /// from the payload length on emit.
    pub pad_count: u8,
    pub pkey: u16,
    pub fecn: bool,
    pub becn: bool,
    pub dest_qpn: u32,
    pub ack_req: bool,
    pub psn: u32,
}

impl BthRepr {
    /// A BTH as xroce sends one: the default partition key, no flags set (set `ack_req` and
    /// the others on the result where needed).
    pub fn new(opcode: Opcode, dest_qpn: u32, psn: u32) -> Self {
        BthRepr {
            opcode,
            solicited: false,
            mig_req: false,
            pad_count: 0,
            pkey: DEFAULT_PKEY,
            fecn: false,
            becn: false,
            dest_qpn,
            ack_req: false,
            psn,
        }
    }

    /// Parses a BTH. A transport version other than 0 is an error (rdma_rxe drops such packets).
    pub fn parse<T: AsRef<[u8]>>(p: &BthPacket<T>) -> Result<Self> {
        check_len("BTH", p.b(), HEADER_LEN)?;
        if p.transport_version() != 0 {
            return Err(WireError::TransportVersion(p.transport_version()));
        }
        Ok(BthRepr {
            opcode: p.opcode(),
            solicited: p.solicited(),
            mig_req: p.mig_req(),
            pad_count: p.pad_count(),
            pkey: p.pkey(),
            fecn: p.fecn(),
            becn: p.becn(),
            dest_qpn: p.dest_qpn(),
            ack_req: p.ack_req(),
            psn: p.psn(),
        })
    }

    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        check_len("BTH", buf, HEADER_LEN)?;
        if self.dest_qpn > QPN_MASK {
            return Err(WireError::FieldRange("destination QPN above 24 bits"));
        }
        if self.psn > PSN_MASK {
            return Err(WireError::FieldRange("PSN above 24 bits"));
        }
        if self.pad_count > 3 {
            return Err(WireError::FieldRange("pad count above 3"));
        }
        buf[field::OPCODE] = self.opcode.0;
        buf[field::FLAGS] = (if self.solicited { SE } else { 0 })
            | (if self.mig_req { MIG_REQ } else { 0 })
            | (self.pad_count << PAD_SHIFT);
        be::set_u16(buf, field::PKEY, self.pkey);
        buf[field::BECN_FECN] =
            (if self.fecn { FECN } else { 0 }) | (if self.becn { BECN } else { 0 });
        be::set_u24(buf, field::DEST_QP, self.dest_qpn);
        buf[field::ACK_REQ] = if self.ack_req { ACK_REQ } else { 0 };
        be::set_u24(buf, field::PSN, self.psn);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_worked_example_bth() {
        // RC SEND_ONLY, PadCnt 3, P_Key 0xFFFF, DestQP 0x11, AckReq, PSN 0x123456.
        let bytes = [
            0x04, 0x30, 0xff, 0xff, 0x00, 0x00, 0x00, 0x11, 0x80, 0x12, 0x34, 0x56,
        ];
        let r = BthRepr::parse(&BthPacket::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(r.opcode, Opcode::RC_SEND_ONLY);
        assert_eq!(r.pad_count, 3);
        assert_eq!(r.dest_qpn, 0x11);
        assert!(r.ack_req);
        assert_eq!(r.psn, 0x123456);
        let mut out = [0u8; 12];
        r.emit(&mut out).unwrap();
        assert_eq!(out, bytes);
    }

    #[test]
    fn nonzero_tver_is_rejected() {
        let bytes = [0x04, 0x01, 0xff, 0xff, 0, 0, 0, 0x11, 0, 0, 0, 1];
        let p = BthPacket::new_checked(&bytes[..]).unwrap();
        assert_eq!(
            BthRepr::parse(&p).unwrap_err(),
            WireError::TransportVersion(1)
        );
    }
}
