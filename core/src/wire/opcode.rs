//! The one table of RoCE opcodes: which extension headers each carries, its transport, its
//! operation and its place in a message. Parser and builder both consult it.
//!
//! Content follows rdma_rxe's `rxe_opcode[]` (values from `include/rdma/ib_pack.h`) for RC, UC and
//! UD (FLUSH and ATOMIC_WRITE from Linux 6.2 included), plus the RD opcodes (decoded for display;
//! rdma_rxe has no RD QPs) and the RoCEv2 CNP (0x81, BTH followed by 16 reserved bytes). Opcodes
//! absent from the table (0x15 RESYNC, UC READ, ...) are unknown and rejected by the parser.

use core::fmt;

/// A BTH opcode.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Opcode(pub u8);

/// The set of extension headers that follow the BTH, in wire order.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct HeaderSet(u16);

/// One extension header kind. Declaration order is wire order.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum HeaderKind {
    Rdeth,
    Deth,
    /// FLUSH extended transport header (Linux 6.2+ rdma_rxe), before the RETH.
    Feth,
    Reth,
    AtomicEth,
    Aeth,
    AtomicAckEth,
    ImmDt,
    Ieth,
    /// The 16 reserved bytes after the BTH of a RoCEv2 CNP.
    CnpReserved,
}

impl HeaderKind {
    pub const ALL: [HeaderKind; 10] = [
        HeaderKind::Rdeth,
        HeaderKind::Deth,
        HeaderKind::Feth,
        HeaderKind::Reth,
        HeaderKind::AtomicEth,
        HeaderKind::Aeth,
        HeaderKind::AtomicAckEth,
        HeaderKind::ImmDt,
        HeaderKind::Ieth,
        HeaderKind::CnpReserved,
    ];

    /// Size on the wire in bytes.
    pub const fn wire_len(self) -> usize {
        match self {
            HeaderKind::Rdeth => 4,
            HeaderKind::Deth => 8,
            HeaderKind::Feth => 4,
            HeaderKind::Reth => 16,
            HeaderKind::AtomicEth => 28,
            HeaderKind::Aeth => 4,
            HeaderKind::AtomicAckEth => 8,
            HeaderKind::ImmDt => 4,
            HeaderKind::Ieth => 4,
            HeaderKind::CnpReserved => 16,
        }
    }

    const fn bit(self) -> u16 {
        1 << (self as u16)
    }
}

impl HeaderSet {
    pub const NONE: HeaderSet = HeaderSet(0);
    pub const RDETH: HeaderSet = HeaderSet(HeaderKind::Rdeth.bit());
    pub const DETH: HeaderSet = HeaderSet(HeaderKind::Deth.bit());
    pub const FETH: HeaderSet = HeaderSet(HeaderKind::Feth.bit());
    pub const RETH: HeaderSet = HeaderSet(HeaderKind::Reth.bit());
    pub const ATOMIC_ETH: HeaderSet = HeaderSet(HeaderKind::AtomicEth.bit());
    pub const AETH: HeaderSet = HeaderSet(HeaderKind::Aeth.bit());
    pub const ATOMIC_ACK_ETH: HeaderSet = HeaderSet(HeaderKind::AtomicAckEth.bit());
    pub const IMM_DT: HeaderSet = HeaderSet(HeaderKind::ImmDt.bit());
    pub const IETH: HeaderSet = HeaderSet(HeaderKind::Ieth.bit());
    pub const CNP_RESERVED: HeaderSet = HeaderSet(HeaderKind::CnpReserved.bit());

    pub const fn with(self, other: HeaderSet) -> HeaderSet {
        HeaderSet(self.0 | other.0)
    }

    /// The set holding only `kind`.
    pub const fn of(kind: HeaderKind) -> HeaderSet {
        HeaderSet(kind.bit())
    }

    pub const fn without(self, other: HeaderSet) -> HeaderSet {
        HeaderSet(self.0 & !other.0)
    }

    pub const fn contains(self, kind: HeaderKind) -> bool {
        self.0 & kind.bit() != 0
    }

    /// Total size of the extension headers (BTH excluded).
    pub const fn len(self) -> usize {
        let mut total = 0;
        let mut i = 0;
        while i < HeaderKind::ALL.len() {
            if self.contains(HeaderKind::ALL[i]) {
                total += HeaderKind::ALL[i].wire_len();
            }
            i += 1;
        }
        total
    }

    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The headers of the set in wire order, each with its offset from the end of the BTH:
    /// one pass for a parser or writer that handles every header of a packet (asking
    /// [`offset_of`](Self::offset_of) per kind walks the set once per kind). Visits only the
    /// headers present, so a packet with none (a SEND) costs nothing here.
    pub fn in_wire_order(self) -> InWireOrder {
        InWireOrder {
            bits: self.0,
            offset: 0,
        }
    }

    /// Offset of `kind` from the end of the BTH, or `None` if the set does not contain it.
    pub const fn offset_of(self, kind: HeaderKind) -> Option<usize> {
        if !self.contains(kind) {
            return None;
        }
        let mut off = 0;
        let mut i = 0;
        while i < HeaderKind::ALL.len() {
            let k = HeaderKind::ALL[i];
            if k as u16 == kind as u16 {
                return Some(off);
            }
            if self.contains(k) {
                off += k.wire_len();
            }
            i += 1;
        }
        None
    }
}

/// See [`HeaderSet::in_wire_order`].
pub struct InWireOrder {
    /// Headers not visited yet; bit `k` stands for `HeaderKind::ALL[k]`.
    bits: u16,
    offset: usize,
}

impl Iterator for InWireOrder {
    type Item = (HeaderKind, usize);

    fn next(&mut self) -> Option<(HeaderKind, usize)> {
        if self.bits == 0 {
            return None;
        }
        let kind = *HeaderKind::ALL.get(self.bits.trailing_zeros() as usize)?;
        self.bits &= self.bits - 1;
        let at = self.offset;
        self.offset += kind.wire_len();
        Some((kind, at))
    }
}

impl fmt::Debug for HeaderSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set()
            .entries(HeaderKind::ALL.iter().filter(|k| self.contains(**k)))
            .finish()
    }
}

/// The transport service an opcode belongs to (its top three bits).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Transport {
    Rc,
    Uc,
    Rd,
    Ud,
    /// RoCEv2 congestion notification packet.
    Cnp,
}

/// What the packet does.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Operation {
    Send,
    RdmaWrite,
    RdmaReadRequest,
    RdmaReadResponse,
    Acknowledge,
    AtomicAcknowledge,
    CompareSwap,
    FetchAdd,
    /// RDMA FLUSH (Linux 6.2+): make a remote range persistent or globally visible.
    Flush,
    /// RDMA ATOMIC WRITE (Linux 6.2+): an 8-byte write performed atomically.
    AtomicWrite,
    CongestionNotification,
}

/// The packet's place in its message.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Position {
    First,
    Middle,
    Last,
    Only,
}

impl Position {
    /// FIRST or ONLY: the packet starts a message.
    pub const fn starts_message(self) -> bool {
        matches!(self, Position::First | Position::Only)
    }
    /// LAST or ONLY: the packet ends a message.
    pub const fn ends_message(self) -> bool {
        matches!(self, Position::Last | Position::Only)
    }
}

/// Everything the table knows about one opcode.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct OpcodeInfo {
    /// Name as in `ib_pack.h` without the `IB_OPCODE_` prefix.
    pub name: &'static str,
    pub transport: Transport,
    pub operation: Operation,
    pub position: Position,
    /// Extension headers after the BTH.
    pub headers: HeaderSet,
    /// BTH plus `headers`, in bytes: worked out once here, because every packet built or
    /// parsed asks (summing the set each time was 2 % of a 64 B SEND's instructions).
    header_len: u8,
}

impl OpcodeInfo {
    pub(super) const fn new(
        name: &'static str,
        transport: Transport,
        operation: Operation,
        position: Position,
        headers: HeaderSet,
    ) -> OpcodeInfo {
        OpcodeInfo {
            name,
            transport,
            operation,
            position,
            headers,
            header_len: (super::bth::HEADER_LEN + headers.len()) as u8,
        }
    }

    /// BTH plus extension headers, in bytes.
    pub const fn header_len(&self) -> usize {
        self.header_len as usize
    }

    /// True for packets that go to a responder (requests); false for ACKs, read responses and
    /// atomic ACKs, which go to the requester's completer.
    pub const fn is_request(&self) -> bool {
        !matches!(
            self.operation,
            Operation::RdmaReadResponse
                | Operation::Acknowledge
                | Operation::AtomicAcknowledge
                | Operation::CongestionNotification
        )
    }

    /// True when the packet may carry payload bytes.
    pub const fn has_payload(&self) -> bool {
        matches!(
            self.operation,
            Operation::Send
                | Operation::RdmaWrite
                | Operation::RdmaReadResponse
                | Operation::AtomicWrite
        )
    }

    pub const fn with_immediate(&self) -> bool {
        self.headers.contains(HeaderKind::ImmDt)
    }

    pub const fn with_invalidate(&self) -> bool {
        self.headers.contains(HeaderKind::Ieth)
    }
}

use HeaderSet as H;
use Operation::*;
use Position::*;
use Transport::*;

const fn e(
    name: &'static str,
    transport: Transport,
    operation: Operation,
    position: Position,
    headers: HeaderSet,
) -> Option<OpcodeInfo> {
    Some(OpcodeInfo::new(
        name, transport, operation, position, headers,
    ))
}

/// The opcode table, indexed by opcode value.
pub static OPCODE_TABLE: [Option<OpcodeInfo>; 256] = {
    let mut t: [Option<OpcodeInfo>; 256] = [None; 256];
    let imm = H::IMM_DT;
    let reth = H::RETH;
    // Reliable Connected.
    t[0x00] = e("RC_SEND_FIRST", Rc, Send, First, H::NONE);
    t[0x01] = e("RC_SEND_MIDDLE", Rc, Send, Middle, H::NONE);
    t[0x02] = e("RC_SEND_LAST", Rc, Send, Last, H::NONE);
    t[0x03] = e("RC_SEND_LAST_WITH_IMMEDIATE", Rc, Send, Last, imm);
    t[0x04] = e("RC_SEND_ONLY", Rc, Send, Only, H::NONE);
    t[0x05] = e("RC_SEND_ONLY_WITH_IMMEDIATE", Rc, Send, Only, imm);
    t[0x06] = e("RC_RDMA_WRITE_FIRST", Rc, RdmaWrite, First, reth);
    t[0x07] = e("RC_RDMA_WRITE_MIDDLE", Rc, RdmaWrite, Middle, H::NONE);
    t[0x08] = e("RC_RDMA_WRITE_LAST", Rc, RdmaWrite, Last, H::NONE);
    t[0x09] = e(
        "RC_RDMA_WRITE_LAST_WITH_IMMEDIATE",
        Rc,
        RdmaWrite,
        Last,
        imm,
    );
    t[0x0a] = e("RC_RDMA_WRITE_ONLY", Rc, RdmaWrite, Only, reth);
    t[0x0b] = e(
        "RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE",
        Rc,
        RdmaWrite,
        Only,
        reth.with(imm),
    );
    t[0x0c] = e("RC_RDMA_READ_REQUEST", Rc, RdmaReadRequest, Only, reth);
    t[0x0d] = e(
        "RC_RDMA_READ_RESPONSE_FIRST",
        Rc,
        RdmaReadResponse,
        First,
        H::AETH,
    );
    t[0x0e] = e(
        "RC_RDMA_READ_RESPONSE_MIDDLE",
        Rc,
        RdmaReadResponse,
        Middle,
        H::NONE,
    );
    t[0x0f] = e(
        "RC_RDMA_READ_RESPONSE_LAST",
        Rc,
        RdmaReadResponse,
        Last,
        H::AETH,
    );
    t[0x10] = e(
        "RC_RDMA_READ_RESPONSE_ONLY",
        Rc,
        RdmaReadResponse,
        Only,
        H::AETH,
    );
    t[0x11] = e("RC_ACKNOWLEDGE", Rc, Acknowledge, Only, H::AETH);
    t[0x12] = e(
        "RC_ATOMIC_ACKNOWLEDGE",
        Rc,
        AtomicAcknowledge,
        Only,
        H::AETH.with(H::ATOMIC_ACK_ETH),
    );
    t[0x13] = e("RC_COMPARE_SWAP", Rc, CompareSwap, Only, H::ATOMIC_ETH);
    t[0x14] = e("RC_FETCH_ADD", Rc, FetchAdd, Only, H::ATOMIC_ETH);
    t[0x16] = e("RC_SEND_LAST_WITH_INVALIDATE", Rc, Send, Last, H::IETH);
    t[0x17] = e("RC_SEND_ONLY_WITH_INVALIDATE", Rc, Send, Only, H::IETH);
    t[0x1c] = e("RC_FLUSH", Rc, Flush, Only, H::FETH.with(reth));
    t[0x1d] = e("RC_ATOMIC_WRITE", Rc, AtomicWrite, Only, reth);
    // Unreliable Connected.
    t[0x20] = e("UC_SEND_FIRST", Uc, Send, First, H::NONE);
    t[0x21] = e("UC_SEND_MIDDLE", Uc, Send, Middle, H::NONE);
    t[0x22] = e("UC_SEND_LAST", Uc, Send, Last, H::NONE);
    t[0x23] = e("UC_SEND_LAST_WITH_IMMEDIATE", Uc, Send, Last, imm);
    t[0x24] = e("UC_SEND_ONLY", Uc, Send, Only, H::NONE);
    t[0x25] = e("UC_SEND_ONLY_WITH_IMMEDIATE", Uc, Send, Only, imm);
    t[0x26] = e("UC_RDMA_WRITE_FIRST", Uc, RdmaWrite, First, reth);
    t[0x27] = e("UC_RDMA_WRITE_MIDDLE", Uc, RdmaWrite, Middle, H::NONE);
    t[0x28] = e("UC_RDMA_WRITE_LAST", Uc, RdmaWrite, Last, H::NONE);
    t[0x29] = e(
        "UC_RDMA_WRITE_LAST_WITH_IMMEDIATE",
        Uc,
        RdmaWrite,
        Last,
        imm,
    );
    t[0x2a] = e("UC_RDMA_WRITE_ONLY", Uc, RdmaWrite, Only, reth);
    t[0x2b] = e(
        "UC_RDMA_WRITE_ONLY_WITH_IMMEDIATE",
        Uc,
        RdmaWrite,
        Only,
        reth.with(imm),
    );
    // Reliable Datagram: decoded, never used (rdma_rxe has no RD QPs either).
    let rd = H::RDETH.with(H::DETH);
    t[0x40] = e("RD_SEND_FIRST", Rd, Send, First, rd);
    t[0x41] = e("RD_SEND_MIDDLE", Rd, Send, Middle, rd);
    t[0x42] = e("RD_SEND_LAST", Rd, Send, Last, rd);
    t[0x43] = e("RD_SEND_LAST_WITH_IMMEDIATE", Rd, Send, Last, rd.with(imm));
    t[0x44] = e("RD_SEND_ONLY", Rd, Send, Only, rd);
    t[0x45] = e("RD_SEND_ONLY_WITH_IMMEDIATE", Rd, Send, Only, rd.with(imm));
    t[0x46] = e("RD_RDMA_WRITE_FIRST", Rd, RdmaWrite, First, rd.with(reth));
    t[0x47] = e("RD_RDMA_WRITE_MIDDLE", Rd, RdmaWrite, Middle, rd);
    t[0x48] = e("RD_RDMA_WRITE_LAST", Rd, RdmaWrite, Last, rd);
    t[0x49] = e(
        "RD_RDMA_WRITE_LAST_WITH_IMMEDIATE",
        Rd,
        RdmaWrite,
        Last,
        rd.with(imm),
    );
    t[0x4a] = e("RD_RDMA_WRITE_ONLY", Rd, RdmaWrite, Only, rd.with(reth));
    t[0x4b] = e(
        "RD_RDMA_WRITE_ONLY_WITH_IMMEDIATE",
        Rd,
        RdmaWrite,
        Only,
        rd.with(reth).with(imm),
    );
    t[0x4c] = e(
        "RD_RDMA_READ_REQUEST",
        Rd,
        RdmaReadRequest,
        Only,
        rd.with(reth),
    );
    let rd_aeth = H::RDETH.with(H::AETH);
    t[0x4d] = e(
        "RD_RDMA_READ_RESPONSE_FIRST",
        Rd,
        RdmaReadResponse,
        First,
        rd_aeth,
    );
    t[0x4e] = e(
        "RD_RDMA_READ_RESPONSE_MIDDLE",
        Rd,
        RdmaReadResponse,
        Middle,
        H::RDETH,
    );
    t[0x4f] = e(
        "RD_RDMA_READ_RESPONSE_LAST",
        Rd,
        RdmaReadResponse,
        Last,
        rd_aeth,
    );
    t[0x50] = e(
        "RD_RDMA_READ_RESPONSE_ONLY",
        Rd,
        RdmaReadResponse,
        Only,
        rd_aeth,
    );
    t[0x51] = e("RD_ACKNOWLEDGE", Rd, Acknowledge, Only, rd_aeth);
    t[0x52] = e(
        "RD_ATOMIC_ACKNOWLEDGE",
        Rd,
        AtomicAcknowledge,
        Only,
        rd_aeth.with(H::ATOMIC_ACK_ETH),
    );
    t[0x53] = e(
        "RD_COMPARE_SWAP",
        Rd,
        CompareSwap,
        Only,
        rd.with(H::ATOMIC_ETH),
    );
    t[0x54] = e("RD_FETCH_ADD", Rd, FetchAdd, Only, rd.with(H::ATOMIC_ETH));
    // Unreliable Datagram.
    t[0x64] = e("UD_SEND_ONLY", Ud, Send, Only, H::DETH);
    t[0x65] = e(
        "UD_SEND_ONLY_WITH_IMMEDIATE",
        Ud,
        Send,
        Only,
        H::DETH.with(imm),
    );
    // RoCEv2 congestion notification.
    t[0x81] = e("CNP", Cnp, CongestionNotification, Only, H::CNP_RESERVED);
    t
};

#[allow(missing_docs)]
impl Opcode {
    pub const RC_SEND_FIRST: Opcode = Opcode(0x00);
    pub const RC_SEND_MIDDLE: Opcode = Opcode(0x01);
    pub const RC_SEND_LAST: Opcode = Opcode(0x02);
    pub const RC_SEND_LAST_WITH_IMMEDIATE: Opcode = Opcode(0x03);
    pub const RC_SEND_ONLY: Opcode = Opcode(0x04);
    pub const RC_SEND_ONLY_WITH_IMMEDIATE: Opcode = Opcode(0x05);
    pub const RC_RDMA_WRITE_FIRST: Opcode = Opcode(0x06);
    pub const RC_RDMA_WRITE_MIDDLE: Opcode = Opcode(0x07);
    pub const RC_RDMA_WRITE_LAST: Opcode = Opcode(0x08);
    pub const RC_RDMA_WRITE_LAST_WITH_IMMEDIATE: Opcode = Opcode(0x09);
    pub const RC_RDMA_WRITE_ONLY: Opcode = Opcode(0x0a);
    pub const RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE: Opcode = Opcode(0x0b);
    pub const RC_RDMA_READ_REQUEST: Opcode = Opcode(0x0c);
    pub const RC_RDMA_READ_RESPONSE_FIRST: Opcode = Opcode(0x0d);
    pub const RC_RDMA_READ_RESPONSE_MIDDLE: Opcode = Opcode(0x0e);
    pub const RC_RDMA_READ_RESPONSE_LAST: Opcode = Opcode(0x0f);
    pub const RC_RDMA_READ_RESPONSE_ONLY: Opcode = Opcode(0x10);
    pub const RC_ACKNOWLEDGE: Opcode = Opcode(0x11);
    pub const RC_ATOMIC_ACKNOWLEDGE: Opcode = Opcode(0x12);
    pub const RC_COMPARE_SWAP: Opcode = Opcode(0x13);
    pub const RC_FETCH_ADD: Opcode = Opcode(0x14);
    pub const RC_SEND_LAST_WITH_INVALIDATE: Opcode = Opcode(0x16);
    pub const RC_SEND_ONLY_WITH_INVALIDATE: Opcode = Opcode(0x17);
    pub const RC_FLUSH: Opcode = Opcode(0x1c);
    pub const RC_ATOMIC_WRITE: Opcode = Opcode(0x1d);
    pub const UC_SEND_FIRST: Opcode = Opcode(0x20);
    pub const UC_SEND_MIDDLE: Opcode = Opcode(0x21);
    pub const UC_SEND_LAST: Opcode = Opcode(0x22);
    pub const UC_SEND_LAST_WITH_IMMEDIATE: Opcode = Opcode(0x23);
    pub const UC_SEND_ONLY: Opcode = Opcode(0x24);
    pub const UC_SEND_ONLY_WITH_IMMEDIATE: Opcode = Opcode(0x25);
    pub const UC_RDMA_WRITE_FIRST: Opcode = Opcode(0x26);
    pub const UC_RDMA_WRITE_MIDDLE: Opcode = Opcode(0x27);
    pub const UC_RDMA_WRITE_LAST: Opcode = Opcode(0x28);
    pub const UC_RDMA_WRITE_LAST_WITH_IMMEDIATE: Opcode = Opcode(0x29);
    pub const UC_RDMA_WRITE_ONLY: Opcode = Opcode(0x2a);
    pub const UC_RDMA_WRITE_ONLY_WITH_IMMEDIATE: Opcode = Opcode(0x2b);
    pub const UD_SEND_ONLY: Opcode = Opcode(0x64);
    pub const UD_SEND_ONLY_WITH_IMMEDIATE: Opcode = Opcode(0x65);
    pub const CNP: Opcode = Opcode(0x81);

    /// The table entry, or `None` for an opcode xroce does not know.
    pub fn info(self) -> Option<&'static OpcodeInfo> {
        OPCODE_TABLE[usize::from(self.0)].as_ref()
    }

    /// Table name, or `"UNKNOWN"`.
    pub fn name(self) -> &'static str {
        self.info().map_or("UNKNOWN", |i| i.name)
    }

    /// Looks an opcode up by transport, operation, position and whether it carries immediate
    /// data or an invalidate key: how the requester chooses what to send.
    pub fn find(
        transport: Transport,
        operation: Operation,
        position: Position,
        headers_extra: HeaderSet,
    ) -> Option<Opcode> {
        (0..=255u8).map(Opcode).find(|op| {
            op.info().is_some_and(|i| {
                i.transport == transport
                    && i.operation == operation
                    && i.position == position
                    && (i.headers.contains(HeaderKind::ImmDt)
                        == headers_extra.contains(HeaderKind::ImmDt))
                    && (i.headers.contains(HeaderKind::Ieth)
                        == headers_extra.contains(HeaderKind::Ieth))
            })
        })
    }
}

impl fmt::Debug for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}({:#04x})", self.name(), self.0)
    }
}

impl fmt::Display for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Header lengths (BTH included) listed in the digest, §1.8.
    #[test]
    fn header_lengths_match_rxe() {
        let cases: &[(u8, usize)] = &[
            (0x04, 12), // SEND
            (0x05, 16), // SEND + Imm
            (0x64, 20), // UD SEND
            (0x65, 24), // UD SEND + Imm
            (0x06, 28), // WRITE FIRST
            (0x0a, 28), // WRITE ONLY
            (0x0b, 32), // WRITE ONLY + Imm
            (0x0c, 28), // READ REQ
            (0x0d, 16), // READ RESP FIRST
            (0x0f, 16),
            (0x10, 16),
            (0x0e, 12), // READ RESP MIDDLE
            (0x11, 16), // ACK
            (0x12, 24), // ATOMIC ACK
            (0x13, 40), // CMP_SWAP
            (0x14, 40), // FETCH_ADD
            (0x17, 16), // SEND + Inv
            (0x1c, 32), // FLUSH
            (0x1d, 28), // ATOMIC_WRITE
            (0x81, 28), // CNP
        ];
        for &(op, len) in cases {
            let info = Opcode(op).info().unwrap();
            assert_eq!(info.header_len(), len, "{}", info.name);
        }
    }

    #[test]
    fn transport_prefix_matches_top_bits() {
        for (i, e) in OPCODE_TABLE.iter().enumerate() {
            let Some(info) = e else { continue };
            let expect = match i >> 5 {
                0 => Transport::Rc,
                1 => Transport::Uc,
                2 => Transport::Rd,
                3 => Transport::Ud,
                4 => Transport::Cnp,
                _ => panic!("opcode {i:#x} outside the known transports"),
            };
            assert_eq!(info.transport, expect, "{}", info.name);
            assert!(info.name.starts_with(match expect {
                Transport::Rc => "RC_",
                Transport::Uc => "UC_",
                Transport::Rd => "RD_",
                Transport::Ud => "UD_",
                Transport::Cnp => "CNP",
            }));
        }
    }

    #[test]
    fn header_offsets_follow_wire_order() {
        let h = HeaderSet::RETH.with(HeaderSet::IMM_DT);
        assert_eq!(h.offset_of(HeaderKind::Reth), Some(0));
        assert_eq!(h.offset_of(HeaderKind::ImmDt), Some(16));
        assert_eq!(h.offset_of(HeaderKind::Aeth), None);
        let a = HeaderSet::AETH.with(HeaderSet::ATOMIC_ACK_ETH);
        assert_eq!(a.offset_of(HeaderKind::AtomicAckEth), Some(4));
        let ud = HeaderSet::DETH.with(HeaderSet::IMM_DT);
        assert_eq!(ud.offset_of(HeaderKind::ImmDt), Some(8));
    }

    #[test]
    fn one_pass_in_wire_order_agrees_with_offset_of_for_every_opcode() {
        for op in (0..=255u8).map(Opcode) {
            let Some(info) = op.info() else { continue };
            let walked: Vec<_> = info.headers.in_wire_order().collect();
            let asked: Vec<_> = HeaderKind::ALL
                .into_iter()
                .filter_map(|k| info.headers.offset_of(k).map(|off| (k, off)))
                .collect();
            assert_eq!(walked, asked, "{}", info.name);
            let end = walked.last().map_or(0, |&(k, off)| off + k.wire_len());
            assert_eq!(end, info.headers.len(), "{}", info.name);
        }
    }

    #[test]
    fn find_picks_the_right_variant() {
        use Operation::*;
        use Position::*;
        use Transport::*;
        assert_eq!(
            Opcode::find(Rc, Send, Last, HeaderSet::IMM_DT),
            Some(Opcode::RC_SEND_LAST_WITH_IMMEDIATE)
        );
        assert_eq!(
            Opcode::find(Uc, RdmaWrite, Only, HeaderSet::NONE),
            Some(Opcode::UC_RDMA_WRITE_ONLY)
        );
        assert_eq!(
            Opcode::find(Uc, RdmaReadRequest, Only, HeaderSet::NONE),
            None
        );
        assert_eq!(Opcode(0x15).info(), None);
    }
}
