//! One-line, grep-friendly descriptions of RoCEv2 headers, for `xroce pcap check` and traces.

use core::fmt;

use super::ext::{AethSyndrome, NakCode};
use super::frame::RoceFrame;
use super::ip::IpRepr;
use super::transport::TransportRepr;

impl fmt::Display for AethSyndrome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AethSyndrome::Ack { credits } => write!(f, "ACK credits={credits}"),
            AethSyndrome::RnrNak { timer } => write!(f, "RNR_NAK timer={timer}"),
            AethSyndrome::Nak(code) => match code {
                NakCode::PsnSequenceError => f.write_str("NAK PSN_SEQUENCE_ERROR"),
                NakCode::InvalidRequest => f.write_str("NAK INVALID_REQUEST"),
                NakCode::RemoteAccessError => f.write_str("NAK REMOTE_ACCESS_ERROR"),
                NakCode::RemoteOperationalError => f.write_str("NAK REMOTE_OPERATIONAL_ERROR"),
                NakCode::InvalidRdRequest => f.write_str("NAK INVALID_RD_REQUEST"),
                NakCode::Reserved(v) => write!(f, "NAK reserved={v:#04x}"),
            },
            AethSyndrome::Reserved(raw) => write!(f, "reserved-syndrome={raw:#04x}"),
        }
    }
}

/// `OPCODE qpn=… psn=… [ackreq] [se] [fecn] [becn] [pkey=…] ext-headers…`
impl fmt::Display for TransportRepr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = &self.bth;
        write!(f, "{} qpn={:#08x} psn={:#08x}", b.opcode, b.dest_qpn, b.psn)?;
        for (set, name) in [
            (b.ack_req, "ackreq"),
            (b.solicited, "se"),
            (b.mig_req, "mig"),
            (b.fecn, "fecn"),
            (b.becn, "becn"),
        ] {
            if set {
                write!(f, " {name}")?;
            }
        }
        if b.pkey != super::bth::DEFAULT_PKEY {
            write!(f, " pkey={:#06x}", b.pkey)?;
        }
        if let Some(h) = &self.rdeth {
            write!(f, " rdeth(eec={:#08x})", h.ee_context)?;
        }
        if let Some(h) = &self.deth {
            write!(f, " deth(qkey={:#010x} src_qp={:#08x})", h.qkey, h.src_qpn)?;
        }
        if let Some(h) = &self.feth {
            write!(f, " feth(sel={} plt={:#x})", h.selectivity, h.placement)?;
        }
        if let Some(h) = &self.reth {
            write!(
                f,
                " reth(va={:#x} rkey={:#010x} len={})",
                h.va, h.rkey, h.dma_len
            )?;
        }
        if let Some(h) = &self.atomic_eth {
            write!(
                f,
                " atomic(va={:#x} rkey={:#010x} swap_add={:#x} compare={:#x})",
                h.va, h.rkey, h.swap_add, h.compare
            )?;
        }
        if let Some(h) = &self.aeth {
            write!(f, " aeth({} msn={})", h.syndrome, h.msn)?;
        }
        if let Some(h) = &self.atomic_ack_eth {
            write!(f, " atomic_ack(orig={:#x})", h.orig)?;
        }
        if let Some(v) = self.immediate {
            write!(f, " imm={v:#010x}")?;
        }
        if let Some(v) = self.invalidate_rkey {
            write!(f, " ieth(rkey={v:#010x})")?;
        }
        Ok(())
    }
}

/// `SRC:PORT > DST:PORT <transport> payload=N`
impl fmt::Display for RoceFrame<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let h = &self.headers;
        let (src, dst) = (h.ip.src_addr(), h.ip.dst_addr());
        match h.ip {
            IpRepr::V4(_) => write!(f, "{src}:{} > {dst}:{}", h.udp.src_port, h.udp.dst_port)?,
            IpRepr::V6(_) => write!(f, "[{src}]:{} > [{dst}]:{}", h.udp.src_port, h.udp.dst_port)?,
        }
        if let Some(tag) = h.eth.and_then(|e| e.vlan) {
            write!(f, " vlan={}", tag.vid)?;
        }
        write!(f, " {} payload={}", h.transport, self.payload.len())
    }
}
