//! The responder: executes incoming requests and answers them (`rxe_resp.c`).
//!
//! Expected-PSN checks, one sequence-error NAK per gap, duplicates re-ACKed or replayed from the
//! responder-resource ring, opcode-sequence and access checks, RNR NAKs when no receive WQE is
//! posted, R_Key checks, atomics, immediate data, MSN, and ACKs on AckReq (coalesced while
//! unsent, never withheld). UC drops a message on any gap; UD checks the Q_Key and writes the
//! 40-byte GRH area.

use std::collections::VecDeque;

use super::device::{Shared, Transmit};
use super::host_memory::{payload_hash_start, read_maybe_hashing, HostMemory};
use super::memory::Access;
use super::qp::Qp;
use super::qp_state::{QpState, QpType};
use super::verbs::{RecvWr, WcFlags, WcOpcode, WcStatus, WorkCompletion};
use super::{psn, sgl, AsyncEvent, Event};
use crate::wire::{
    emit_ack_on_path, AethRepr, AethSyndrome, AtomicAckEthRepr, IpRepr, NakCode, Opcode,
    OpcodeInfo, Operation, Position, RoceFrame, TransportRepr,
};

/// Bytes at the head of a UD receive buffer that hold the GRH image.
pub const GRH_LEN: usize = 40;
/// Responses queued beyond this are dropped (a peer flooding duplicate READs cannot make the
/// responder queue grow without bound; the requester's retry recovers).
const MAX_QUEUED_RESPONSES: usize = 1024;
/// Largest RETH length accepted.
const MAX_DMA_LEN: u32 = 1 << 31;
/// How far behind the expected PSN a UC packet is taken for a repeat by the network (and
/// dropped) rather than a sender that started again at an earlier PSN (see `uc_request`).
/// Repeats arrive within the packets in flight; a new random PSN lands this close behind the
/// old one once in 16 384 times, and then loses at most this many packets.
const UC_REPEAT_WINDOW: i32 = 1024;

/// A remembered READ or atomic, for replaying duplicates (`struct resp_res`).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Resource {
    Read {
        first_psn: u32,
        last_psn: u32,
        va: u64,
        len: u32,
        rkey: u32,
    },
    Atomic {
        psn: u32,
        orig: u64,
    },
}

/// A READ response being generated, one packet per `poll_transmit`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReadReply {
    /// PSN of the original request: a reply starting there begins with FIRST/ONLY.
    first_psn: u32,
    psn: u32,
    va: u64,
    rkey: u32,
    remaining: u64,
    msn: u32,
    started: bool,
}

/// A packet the responder owes its peer.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Outbound {
    Ack {
        psn: u32,
        syndrome: AethSyndrome,
        msn: u32,
    },
    AtomicAck {
        psn: u32,
        orig: u64,
        msn: u32,
    },
    Read(ReadReply),
}

/// The WRITE in progress.
#[derive(Debug, Clone, Copy)]
struct WriteTarget {
    va: u64,
    rkey: u32,
    resid: u64,
    total: u32,
}

/// The message being received.
#[derive(Debug, Clone, Copy)]
pub(crate) struct InMessage {
    kind: Operation,
    write: Option<WriteTarget>,
}

/// The receive WQE a SEND (or WRITE with immediate) is landing in.
#[derive(Debug)]
pub(crate) struct InRecv {
    pub wqe: RecvWr,
    offset: u64,
}

/// Responder state (`qp->resp` in rxe).
#[derive(Debug, Default)]
pub(crate) struct Responder {
    /// Expected PSN.
    pub psn: u32,
    /// The PSN after the last SEND or WRITE packet executed (as rdma_rxe's `resp.ack_psn`,
    /// which moves on atomics too): a plain ACK that is not the answer to a request (a
    /// duplicate's, a departed QP's) names the PSN before it. Never a READ's or an atomic's
    /// PSN: rdma_rxe's completer takes a plain ACK at the last PSN of a READ or atomic it
    /// waits for as that operation's success, with no data.
    pub ack_psn: u32,
    pub msn: u32,
    sent_psn_nak: bool,
    cur: Option<InMessage>,
    pub recv: Option<InRecv>,
    resources: Vec<Option<Resource>>,
    res_next: usize,
    pub out: VecDeque<Outbound>,
    uc_dropping: bool,
}

impl Responder {
    /// A sequence-error NAK went out for the current gap (none is sent again until the
    /// expected PSN arrives).
    pub(crate) fn sent_psn_nak(&self) -> bool {
        self.sent_psn_nak
    }

    pub(crate) fn resize_resources(&mut self, n: usize) {
        self.resources = vec![None; n];
        self.res_next = 0;
    }

    fn remember(&mut self, r: Resource) {
        if self.resources.is_empty() {
            return;
        }
        let i = self.res_next;
        self.resources[i] = Some(r);
        self.res_next = (i + 1) % self.resources.len();
    }

    /// After an error only the NAK that reported it still goes out.
    pub(crate) fn drop_pending_except_nak(&mut self) {
        self.out.retain(|o| {
            matches!(
                o,
                Outbound::Ack {
                    syndrome: AethSyndrome::Nak(_),
                    ..
                }
            )
        });
    }

    /// After a request at `failed` failed (class A/C), what was owed for the requests before
    /// it still goes out ahead of the NAK: READ responses, atomic ACKs and ACKs, in PSN order,
    /// as rdma_rxe sends a READ response whole before it looks at the next request. Dropping
    /// them would leave the requester retrying a READ that nobody answers any more (forever
    /// with `retry_cnt` 7), or failing an atomic the responder did execute.
    /// The NAK for `failed` itself stays, and NAKs before it; anything after it is moot.
    pub(crate) fn keep_owed_before(&mut self, failed: u32) {
        self.out.retain(|o| match o {
            Outbound::Ack {
                syndrome: AethSyndrome::Nak(_),
                psn,
                ..
            } => psn::diff(*psn, failed) <= 0,
            Outbound::Ack { psn, .. } | Outbound::AtomicAck { psn, .. } => {
                psn::diff(*psn, failed) < 0
            }
            Outbound::Read(r) => psn::diff(r.psn, failed) < 0,
        });
    }

    fn push(&mut self, o: Outbound) {
        if self.out.len() < MAX_QUEUED_RESPONSES {
            self.out.push_back(o);
        }
    }

    /// Queues an ACK for `psn`, merging it into an unsent ACK at the tail (ACKs are
    /// cumulative, so the later one says everything the earlier did).
    fn ack(&mut self, psn: u32) {
        let msn = self.msn;
        if let Some(Outbound::Ack {
            psn: p,
            syndrome: AethSyndrome::Ack { .. },
            msn: m,
        }) = self.out.back_mut()
        {
            *p = psn;
            *m = msn;
            return;
        }
        self.push_ack(psn);
    }

    /// Queues an ACK for `psn` as a frame of its own.
    fn push_ack(&mut self, psn: u32) {
        let msn = self.msn;
        self.push(Outbound::Ack {
            psn,
            syndrome: AethSyndrome::Ack {
                credits: AethSyndrome::UNLIMITED_CREDITS,
            },
            msn,
        });
    }

    fn nak(&mut self, psn: u32, syndrome: AethSyndrome) {
        let msn = self.msn;
        self.push(Outbound::Ack { psn, syndrome, msn });
    }
}

/// What executing a SEND/WRITE packet came to, when nothing was wrong with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Executed {
    Done,
    /// The last packet of a SEND with invalidate: placed, but the R_Key cannot be
    /// invalidated here (see `Qp::class_j`).
    InvalidateFailed,
}

/// Why a SEND/WRITE packet could not be executed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// Bad length, opcode sequence or operation: NAK invalid request.
    Invalid,
    /// R_Key, bounds or rights: NAK remote access error.
    Access,
    /// The receive WQE names memory that cannot be written: NAK remote operational error.
    Malformed,
}

impl Fault {
    fn nak(self) -> NakCode {
        match self {
            Fault::Invalid => NakCode::InvalidRequest,
            Fault::Access => NakCode::RemoteAccessError,
            Fault::Malformed => NakCode::RemoteOperationalError,
        }
    }
    fn status(self) -> WcStatus {
        match self {
            Fault::Invalid => WcStatus::RemInvReqErr,
            Fault::Access => WcStatus::RemAccessErr,
            Fault::Malformed => WcStatus::LocQpOpErr,
        }
    }
}

impl Qp {
    /// Handles a request packet addressed to this QP.
    pub(crate) fn handle_request(
        &mut self,
        sh: &mut Shared,
        host: &mut dyn HostMemory,
        frame: &RoceFrame<'_>,
    ) {
        if !matches!(
            self.attr.state,
            QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
        ) {
            return;
        }
        let Some(info) = frame.headers.transport.bth.opcode.info() else {
            return;
        };
        match self.ty {
            QpType::Rc => self.rc_request(sh, host, frame, info),
            QpType::Uc => self.uc_request(sh, host, frame, info),
            QpType::Ud => self.ud_request(sh, host, frame),
        }
    }

    fn rc_request(
        &mut self,
        sh: &mut Shared,
        host: &mut dyn HostMemory,
        frame: &RoceFrame<'_>,
        info: &OpcodeInfo,
    ) {
        let t = &frame.headers.transport;
        let p = t.bth.psn;
        let d = psn::diff(p, self.resp.psn);
        if d > 0 {
            // A gap: one NAK carrying the expected PSN, then silence until it arrives.
            if !self.resp.sent_psn_nak {
                self.resp.sent_psn_nak = true;
                let expected = self.resp.psn;
                self.resp
                    .nak(expected, AethSyndrome::Nak(NakCode::PsnSequenceError));
                sh.counters.seq_naks_sent += 1;
                log::debug!(
                    "QP {:#x}: PSN {p:#x} came while {expected:#x} was expected; sequence NAK sent",
                    self.qpn
                );
            }
            return;
        }
        if d < 0 {
            sh.counters.duplicates += 1;
            self.rc_duplicate(frame, info);
            return;
        }
        self.resp.sent_psn_nak = false;

        let op = info.operation;
        let pos = info.position;
        let in_sequence = match self.resp.cur {
            Some(m) => m.kind == op && matches!(pos, Position::Middle | Position::Last),
            None => pos.starts_message(),
        };
        if !in_sequence {
            return self.class_c(sh, p, Fault::Invalid);
        }
        let allowed = match op {
            Operation::Send => true,
            Operation::RdmaWrite => self.attr.access.contains(Access::REMOTE_WRITE),
            Operation::RdmaReadRequest => self.attr.access.contains(Access::REMOTE_READ),
            Operation::CompareSwap | Operation::FetchAdd => {
                self.attr.access.contains(Access::REMOTE_ATOMIC)
            }
            // FLUSH and ATOMIC_WRITE are not offered by this device.
            _ => false,
        };
        if !allowed {
            return self.class_c(sh, p, Fault::Invalid);
        }
        let read_or_atomic = matches!(
            op,
            Operation::RdmaReadRequest | Operation::CompareSwap | Operation::FetchAdd
        );
        if read_or_atomic && self.attr.max_dest_rd_atomic == 0 {
            return self.class_c(sh, p, Fault::Invalid);
        }
        if self.needs_recv(info) && self.resp.recv.is_none() {
            match self.take_recv_wqe(sh) {
                Some(wqe) => self.resp.recv = Some(InRecv { wqe, offset: 0 }),
                None => {
                    let timer = self.attr.min_rnr_timer;
                    self.resp.nak(p, AethSyndrome::RnrNak { timer });
                    sh.counters.rnr_naks_sent += 1;
                    log::debug!(
                        "QP {:#x}: no receive posted for PSN {p:#x}; RNR NAK sent",
                        self.qpn
                    );
                    return;
                }
            }
        }
        match op {
            Operation::Send | Operation::RdmaWrite => {
                match self.exec_send_write(sh, host, frame, info) {
                    Ok(Executed::Done) => {}
                    Ok(Executed::InvalidateFailed) => return self.class_j(sh, p, t.bth.ack_req),
                    Err(f) => return self.class_c(sh, p, f),
                }
                if self.attr.state == QpState::Error {
                    // The receive completion overran the CQ and the QP went to ERROR: like
                    // rdma_rxe (RESPST_ERR_CQ_OVERFLOW), do not acknowledge a message whose
                    // completion was lost, or the sender would count it as delivered.
                    return;
                }
                self.resp.psn = psn::add(p, 1);
                self.resp.ack_psn = self.resp.psn;
                if t.bth.ack_req {
                    self.resp.ack(p);
                }
            }
            Operation::RdmaReadRequest => {
                let Some(reth) = t.reth else {
                    return self.class_c(sh, p, Fault::Invalid);
                };
                if reth.dma_len > MAX_DMA_LEN {
                    return self.class_c(sh, p, Fault::Invalid);
                }
                if reth.dma_len > 0
                    && sh
                        .mem
                        .check_remote(
                            reth.rkey,
                            self.pd,
                            reth.va,
                            u64::from(reth.dma_len),
                            Access::REMOTE_READ,
                        )
                        .is_err()
                {
                    return self.class_c(sh, p, Fault::Access);
                }
                let mtu = self.mtu(sh) as u64;
                let npkts = u64::from(reth.dma_len).div_ceil(mtu).max(1) as u32;
                let last_psn = psn::add(p, npkts - 1);
                self.resp.remember(Resource::Read {
                    first_psn: p,
                    last_psn,
                    va: reth.va,
                    len: reth.dma_len,
                    rkey: reth.rkey,
                });
                // C9-148: the MSN counts a READ when it is accepted.
                self.resp.msn = psn::add(self.resp.msn, 1);
                let msn = self.resp.msn;
                self.resp.push(Outbound::Read(ReadReply {
                    first_psn: p,
                    psn: p,
                    va: reth.va,
                    rkey: reth.rkey,
                    remaining: u64::from(reth.dma_len),
                    msn,
                    started: false,
                }));
                self.resp.psn = psn::add(last_psn, 1);
            }
            Operation::CompareSwap | Operation::FetchAdd => {
                let Some(a) = t.atomic_eth else {
                    return self.class_c(sh, p, Fault::Invalid);
                };
                if a.va % 8 != 0 {
                    return self.class_c(sh, p, Fault::Invalid);
                }
                if sh
                    .mem
                    .check_remote(a.rkey, self.pd, a.va, 8, Access::REMOTE_ATOMIC)
                    .is_err()
                {
                    return self.class_c(sh, p, Fault::Access);
                }
                let mut cur = [0u8; 8];
                if host.read(a.va, &mut cur).is_err() {
                    return self.class_c(sh, p, Fault::Access);
                }
                // Memory holds host byte order; the wire carries big-endian operands.
                let orig = u64::from_ne_bytes(cur);
                let new = if op == Operation::CompareSwap {
                    if orig == a.compare {
                        a.swap_add
                    } else {
                        orig
                    }
                } else {
                    orig.wrapping_add(a.swap_add)
                };
                if new != orig && host.write(a.va, &new.to_ne_bytes()).is_err() {
                    return self.class_c(sh, p, Fault::Access);
                }
                self.resp.remember(Resource::Atomic { psn: p, orig });
                self.resp.msn = psn::add(self.resp.msn, 1);
                let msn = self.resp.msn;
                self.resp.push(Outbound::AtomicAck { psn: p, orig, msn });
                self.resp.psn = psn::add(p, 1);
            }
            _ => {}
        }
    }

    /// Queues one more ACK for the last request this RC QP executed, for just before it is
    /// destroyed; false when there is none to send (another transport, a state that sends
    /// nothing, or nothing executed yet).
    ///
    /// rdma_rxe can be left waiting for exactly that ACK: its retransmission timer fires on an
    /// old deadline while the last message is in flight and resends it, and an ACK arriving
    /// during the resend moves its `comp.psn` without completing the WQE (see
    /// docs/decisions.md, "Why rdma_rxe retransmits on a clean path"). Only another ACK for
    /// that PSN gets it out, and while the QP lives the resent duplicate brings one. After
    /// the QP is gone nothing answers, and with `retry_cnt` 7 (infinite in rdma_rxe, and what
    /// the rdma-core examples set) it resends forever. A duplicate ACK costs a peer nothing.
    /// It is a frame of its own even when an ACK is still queued (the one an application
    /// that ends on a receive leaves held): that one may be the ACK arriving during a resend.
    pub(crate) fn queue_farewell_ack(&mut self) -> bool {
        if !self.executed_requests() || self.resp.ack_psn == self.attr.rq_psn {
            return false;
        }
        self.resp.push_ack(psn::add(self.resp.ack_psn, psn::MASK));
        true
    }

    /// Whether this RC QP executed a request of a connected peer: what it takes to answer
    /// that peer's resends after it is destroyed (see `Device::destroy_qp_lingering`). Also
    /// in ERROR: applications often move a QP there to flush it before destroying it, and
    /// what it executed before was executed all the same.
    pub(crate) fn executed_requests(&self) -> bool {
        self.ty == QpType::Rc
            && matches!(
                self.attr.state,
                QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe | QpState::Error
            )
            && self.resp.psn != self.attr.rq_psn
    }

    /// Leaves only what answering resends needs: the expected PSN and MSN, the path, and
    /// queued ACKs. Work queues, the message being received, READ responses and the
    /// responder's READ/atomic resources go, so nothing can reach memory, a receive WQE or
    /// a CQ any more (see `Device::destroy_qp_lingering`). True when an ACK is still queued.
    pub(crate) fn strip_for_departure(&mut self) -> bool {
        self.sq.clear();
        self.rq.clear();
        self.resp.recv = None;
        self.resp.cur = None;
        self.resp.resources.clear();
        self.resp.res_next = 0;
        self.resp.out.retain(|o| matches!(o, Outbound::Ack { .. }));
        // A live QP in ERROR ignores requests, as rdma_rxe's does; a departed one answers
        // resends whatever state it left in (the queues are gone, so nothing else can run).
        if self.attr.state == QpState::Error {
            self.attr.state = QpState::Rtr;
        }
        !self.resp.out.is_empty()
    }

    /// Whether `frame` is a resent SEND or WRITE packet of a request this QP executed, the
    /// one kind of packet a destroyed QP still answers: with the ACK for the last request,
    /// which touches no memory and completes nothing here.
    pub(crate) fn is_resent_send_or_write(&self, frame: &RoceFrame<'_>, info: &OpcodeInfo) -> bool {
        info.is_request()
            && matches!(info.operation, Operation::Send | Operation::RdmaWrite)
            && psn::diff(frame.headers.transport.bth.psn, self.resp.psn) < 0
    }

    /// A request whose PSN is behind the expected one.
    fn rc_duplicate(&mut self, frame: &RoceFrame<'_>, info: &OpcodeInfo) {
        let t = &frame.headers.transport;
        let p = t.bth.psn;
        match info.operation {
            Operation::Send | Operation::RdmaWrite => {
                // Re-ACK with the last SEND/WRITE PSN executed, even without AckReq (C9-105):
                // this is how a lost ACK is recovered (see `Responder::ack_psn`).
                let last = psn::add(self.resp.ack_psn, psn::MASK);
                self.resp.ack(last);
            }
            Operation::RdmaReadRequest => {
                let Some(reth) = t.reth else { return };
                let found = self.resp.resources.iter().flatten().find_map(|r| match *r {
                    Resource::Read {
                        first_psn,
                        last_psn,
                        va,
                        len,
                        rkey,
                    } if psn::diff(p, first_psn) >= 0 && psn::diff(p, last_psn) <= 0 => {
                        Some((first_psn, va, len, rkey))
                    }
                    _ => None,
                });
                let Some((first_psn, va, len, rkey)) = found else {
                    return;
                };
                let end = reth.va.saturating_add(u64::from(reth.dma_len));
                let subset = reth.rkey == rkey
                    && reth.va >= va
                    && reth.va.checked_add(u64::from(reth.dma_len)).is_some()
                    && end <= va.saturating_add(u64::from(len));
                if !subset {
                    return;
                }
                let msn = self.resp.msn;
                self.resp.push(Outbound::Read(ReadReply {
                    first_psn,
                    psn: p,
                    va: reth.va,
                    rkey,
                    remaining: u64::from(reth.dma_len),
                    msn,
                    started: false,
                }));
            }
            Operation::CompareSwap | Operation::FetchAdd => {
                let orig = self.resp.resources.iter().flatten().find_map(|r| match *r {
                    Resource::Atomic { psn, orig } if psn == p => Some(orig),
                    _ => None,
                });
                if let Some(orig) = orig {
                    let msn = self.resp.msn;
                    self.resp.push(Outbound::AtomicAck { psn: p, orig, msn });
                }
            }
            _ => {}
        }
    }

    /// SEND FIRST/ONLY and WRITE-with-immediate LAST/ONLY consume a receive WQE.
    fn needs_recv(&self, info: &OpcodeInfo) -> bool {
        match info.operation {
            Operation::Send => info.position.starts_message(),
            Operation::RdmaWrite => info.with_immediate() && info.position.ends_message(),
            _ => false,
        }
    }

    fn take_recv_wqe(&mut self, sh: &mut Shared) -> Option<RecvWr> {
        match self.srq {
            Some(id) => {
                let (wqe, crossed) = sh.srqs.get_mut(&id)?.take()?;
                if crossed {
                    sh.events
                        .push_back(Event::Async(AsyncEvent::SrqLimitReached(id)));
                }
                Some(wqe)
            }
            None => self.rq.pop_front(),
        }
    }

    /// Places one SEND or WRITE packet (shared by RC and UC).
    fn exec_send_write(
        &mut self,
        sh: &mut Shared,
        host: &mut dyn HostMemory,
        frame: &RoceFrame<'_>,
        info: &OpcodeInfo,
    ) -> Result<Executed, Fault> {
        let t = &frame.headers.transport;
        let pos = info.position;
        let n = frame.payload.len();
        let mtu = self.mtu(sh);
        let len_ok = match pos {
            Position::Only => n <= mtu,
            Position::First | Position::Middle => n == mtu,
            Position::Last => (1..=mtu).contains(&n),
        };
        if !len_ok {
            return Err(Fault::Invalid);
        }
        match info.operation {
            Operation::Send => {
                let r = self.resp.recv.as_mut().ok_or(Fault::Invalid)?;
                if r.offset + n as u64 > r.wqe.length() {
                    return Err(Fault::Invalid);
                }
                sgl::scatter(
                    &sh.mem,
                    host,
                    self.pd,
                    &r.wqe.sg_list,
                    r.offset,
                    frame.payload,
                )
                .map_err(|_| Fault::Malformed)?;
                r.offset += n as u64;
                if pos.ends_message() {
                    self.resp.cur = None;
                    if info.with_invalidate() {
                        // Placed and checked like any SEND (a length or placement fault is
                        // class C, as in rdma_rxe); only then the invalidation fails.
                        return Ok(Executed::InvalidateFailed);
                    }
                    self.resp.msn = psn::add(self.resp.msn, 1);
                    let byte_len = r.offset as u32;
                    self.complete_recv(sh, WcOpcode::Recv, byte_len, frame);
                } else {
                    self.resp.cur = Some(InMessage {
                        kind: Operation::Send,
                        write: None,
                    });
                }
            }
            Operation::RdmaWrite => {
                let mut target = if pos.starts_message() {
                    let reth = t.reth.ok_or(Fault::Invalid)?;
                    if reth.dma_len > MAX_DMA_LEN {
                        return Err(Fault::Invalid);
                    }
                    if reth.dma_len > 0 {
                        sh.mem
                            .check_remote(
                                reth.rkey,
                                self.pd,
                                reth.va,
                                u64::from(reth.dma_len),
                                Access::REMOTE_WRITE,
                            )
                            .map_err(|_| Fault::Access)?;
                    }
                    WriteTarget {
                        va: reth.va,
                        rkey: reth.rkey,
                        resid: u64::from(reth.dma_len),
                        total: reth.dma_len,
                    }
                } else {
                    self.resp.cur.and_then(|m| m.write).ok_or(Fault::Invalid)?
                };
                // Every packet but the last carries exactly one MTU; the last, exactly the rest.
                let exact = if target.resid > mtu as u64 {
                    n == mtu && !pos.ends_message()
                } else {
                    n as u64 == target.resid && pos.ends_message()
                };
                if !exact {
                    return Err(Fault::Invalid);
                }
                if n > 0 {
                    // Re-checked per packet: the region may have been deregistered meanwhile,
                    // and the engine must never write memory that is no longer registered.
                    sh.mem
                        .check_remote(
                            target.rkey,
                            self.pd,
                            target.va,
                            n as u64,
                            Access::REMOTE_WRITE,
                        )
                        .map_err(|_| Fault::Access)?;
                    host.write(target.va, frame.payload)
                        .map_err(|_| Fault::Access)?;
                }
                target.va += n as u64;
                target.resid -= n as u64;
                if pos.ends_message() {
                    self.resp.cur = None;
                    self.resp.msn = psn::add(self.resp.msn, 1);
                    if info.with_immediate() {
                        self.complete_recv(sh, WcOpcode::RecvRdmaWithImm, target.total, frame);
                    }
                } else {
                    self.resp.cur = Some(InMessage {
                        kind: Operation::RdmaWrite,
                        write: Some(target),
                    });
                }
            }
            _ => return Err(Fault::Invalid),
        }
        Ok(Executed::Done)
    }

    /// Completes the receive WQE in progress successfully.
    fn complete_recv(
        &mut self,
        sh: &mut Shared,
        opcode: WcOpcode,
        byte_len: u32,
        frame: &RoceFrame<'_>,
    ) {
        let Some(r) = self.resp.recv.take() else {
            return;
        };
        let t = &frame.headers.transport;
        let mut flags = WcFlags::GRH; // rdma_rxe sets it on every receive completion
        if t.immediate.is_some() {
            flags = WcFlags(flags.0 | WcFlags::WITH_IMM.0);
        }
        let wc = WorkCompletion {
            wr_id: r.wqe.wr_id,
            status: WcStatus::Success,
            opcode,
            byte_len,
            imm: t.immediate.unwrap_or(0),
            qp_num: self.qpn,
            src_qp: t.deth.map_or(self.attr.dest_qpn, |d| d.src_qpn),
            flags,
            solicited: t.bth.solicited,
        };
        self.post_recv_completion(sh, wc, t.bth.psn);
    }

    /// Posts a receive completion for the request at PSN `p`. A CQ without room moves the QP
    /// to ERROR without answering `p`; what was owed for the requests before it still goes
    /// out, as rdma_rxe had answered each of those before it took the next.
    fn post_recv_completion(&mut self, sh: &mut Shared, wc: WorkCompletion, p: u32) {
        if !sh.complete(self.recv_cq, wc) {
            sh.events
                .push_back(Event::Async(AsyncEvent::QpFatal(self.qpn)));
            self.enter_error_owing(sh, Some(p));
        }
    }

    /// A class A/C error: NAK the PSN, fail the receive in progress, and move to ERROR.
    fn class_c(&mut self, sh: &mut Shared, p: u32, f: Fault) {
        self.resp.nak(p, AethSyndrome::Nak(f.nak()));
        sh.counters.error_naks_sent += 1;
        log::debug!(
            "QP {:#x}: request at PSN {p:#x} refused; NAK {:?} sent",
            self.qpn,
            f.nak()
        );
        self.fail_recv_in_progress(sh, f.status());
        self.resp.cur = None;
        self.enter_error_owing(sh, Some(p));
    }

    /// The last packet of a SEND with invalidate, placed. Its R_Key would name a memory
    /// window or a fast-registered region, neither of which this device offers, so the
    /// invalidation always fails. rdma_rxe fails such a SEND as class J
    /// (`RESPST_ERR_INVALIDATE_RKEY`): the receive completes with REM_INV_REQ_ERR and the QP
    /// moves to ERROR without a NAK. Executing it as a plain SEND would tell the application
    /// nothing while its peer counts on the R_Key no longer working. As rdma_rxe, it still
    /// ACKs the packet when asked to (its MSN not counted), so the requester completes the
    /// SEND; and as after any receive completion the CQ has no room for, a full CQ means
    /// ERROR with no ACK.
    fn class_j(&mut self, sh: &mut Shared, p: u32, ack_req: bool) {
        sh.counters.invalidate_errors += 1;
        self.resp.cur = None;
        if let Some(r) = self.resp.recv.take() {
            let wc = self.failed_recv_wc(r.wqe.wr_id, WcStatus::RemInvReqErr);
            self.post_recv_completion(sh, wc, p);
            if self.attr.state == QpState::Error {
                return; // the CQ had no room: no ACK, as for a SEND
            }
        }
        // Taken, as far as the peer is told: a destroyed QP that lingers answers its resend.
        self.resp.psn = psn::add(p, 1);
        self.resp.ack_psn = self.resp.psn;
        if ack_req {
            self.resp.ack(p);
        }
        // Owed up to and including `p`: that ACK, and what came before it.
        self.enter_error_owing(sh, Some(psn::add(p, 1)));
    }

    fn fail_recv_in_progress(&mut self, sh: &mut Shared, status: WcStatus) {
        if let Some(r) = self.resp.recv.take() {
            let wc = self.failed_recv_wc(r.wqe.wr_id, status);
            sh.complete_quiet(self.recv_cq, wc);
        }
    }

    fn failed_recv_wc(&self, wr_id: u64, status: WcStatus) -> WorkCompletion {
        WorkCompletion {
            wr_id,
            status,
            opcode: WcOpcode::Recv,
            byte_len: 0,
            imm: 0,
            qp_num: self.qpn,
            src_qp: self.attr.dest_qpn,
            flags: WcFlags::default(),
            solicited: false,
        }
    }

    fn uc_request(
        &mut self,
        sh: &mut Shared,
        host: &mut dyn HostMemory,
        frame: &RoceFrame<'_>,
        info: &OpcodeInfo,
    ) {
        let p = frame.headers.transport.bth.psn;
        let pos = info.position;
        let d = psn::diff(p, self.resp.psn);
        if d < 0 && (d >= -UC_REPEAT_WINDOW || !pos.starts_message()) {
            // An old duplicate (the network repeated it). rdma_rxe would restart a message on
            // a duplicated FIRST/ONLY and deliver it twice; xroce drops it, so a UC message is
            // delivered at most once. Senders only move forward, so nothing valid is lost.
            sh.counters.duplicates += 1;
            return;
        }
        // A FIRST/ONLY further behind is no repeat but a sender that started again at another
        // PSN (its QP reset and connected anew, perftest's random PSNs, a program that never
        // exchanged PSNs): like rdma_rxe, which restarts on any FIRST/ONLY, take it. Dropped
        // as a duplicate, every message would be lost until the sender caught up (up to 2^23
        // packets).
        let in_order = d == 0 && !self.resp.uc_dropping;
        // The expected PSN follows every packet at or past it, also those of messages dropped
        // (no receive posted, a gap): otherwise a receiver that drops for long enough (2^23
        // packets) would see every later message as behind it, an old duplicate.
        self.resp.psn = psn::add(p, 1);
        if !in_order || (pos.starts_message() && self.resp.cur.is_some()) {
            // A gap loses the message in progress; a FIRST/ONLY always starts a new one.
            // Each lost message counts once: when its reception is abandoned, or when the first
            // packet after its lost start shows up; not again for every packet dropped after.
            let losing =
                self.resp.cur.is_some() || (!self.resp.uc_dropping && !pos.starts_message());
            self.uc_abandon();
            if losing {
                sh.counters.uc_messages_dropped += 1;
            }
            if !pos.starts_message() {
                self.resp.uc_dropping = true;
                return;
            }
        }
        let in_sequence = match self.resp.cur {
            Some(m) => m.kind == info.operation,
            None => pos.starts_message(),
        };
        let allowed = match info.operation {
            Operation::Send => true,
            Operation::RdmaWrite => self.attr.access.contains(Access::REMOTE_WRITE),
            _ => false,
        };
        if !in_sequence || !allowed {
            return self.uc_drop(sh);
        }
        if self.needs_recv(info) && self.resp.recv.is_none() {
            match self.take_recv_wqe(sh) {
                Some(wqe) => self.resp.recv = Some(InRecv { wqe, offset: 0 }),
                None => return self.uc_drop(sh),
            }
        }
        match self.exec_send_write(sh, host, frame, info) {
            // The expected PSN moved on above. UC has no SEND with invalidate (the opcodes
            // are RC's).
            Ok(_) => {}
            Err(Fault::Malformed) => {
                self.fail_recv_in_progress(sh, WcStatus::LocQpOpErr);
                self.enter_error(sh);
            }
            Err(f) => {
                if self.srq.is_some() {
                    // With an SRQ the WQE was already taken: it completes with the error.
                    self.fail_recv_in_progress(sh, f.status());
                }
                self.uc_drop(sh);
            }
        }
    }

    /// UC: drop the rest of this message (class D).
    fn uc_drop(&mut self, sh: &mut Shared) {
        self.uc_abandon();
        self.resp.uc_dropping = true;
        sh.counters.uc_messages_dropped += 1;
    }

    /// UC: forget the message in progress; its receive WQE is kept for the next message.
    fn uc_abandon(&mut self) {
        self.resp.cur = None;
        self.resp.uc_dropping = false;
        if let Some(r) = self.resp.recv.as_mut() {
            r.offset = 0;
        }
    }

    fn ud_request(&mut self, sh: &mut Shared, host: &mut dyn HostMemory, frame: &RoceFrame<'_>) {
        let t = &frame.headers.transport;
        let Some(deth) = t.deth else { return };
        if deth.qkey != self.attr.qkey {
            sh.counters.qkey_violations += 1;
            return;
        }
        let Some(wqe) = self.take_recv_wqe(sh) else {
            sh.counters.ud_no_receive += 1;
            return;
        };
        let n = frame.payload.len();
        if (GRH_LEN + n) as u64 > wqe.length() {
            if self.srq.is_some() {
                self.resp.recv = Some(InRecv { wqe, offset: 0 });
                self.fail_recv_in_progress(sh, WcStatus::RemInvReqErr);
            } else {
                // Not consumed: rdma_rxe only peeks at the RQ before dropping.
                self.rq.push_front(wqe);
            }
            sh.counters.ud_too_long += 1;
            return;
        }
        let mut grh = [0u8; GRH_LEN];
        match frame.headers.ip {
            // IPv4: 20 zero bytes, then the IPv4 header as received.
            IpRepr::V4(_) => grh[20..].copy_from_slice(&frame.ip_packet[..20]),
            IpRepr::V6(_) => grh.copy_from_slice(&frame.ip_packet[..GRH_LEN]),
        }
        let placed = sgl::scatter(&sh.mem, host, self.pd, &wqe.sg_list, 0, &grh).and_then(|_| {
            sgl::scatter(
                &sh.mem,
                host,
                self.pd,
                &wqe.sg_list,
                GRH_LEN as u64,
                frame.payload,
            )
        });
        self.resp.recv = Some(InRecv { wqe, offset: 0 });
        if placed.is_err() {
            self.fail_recv_in_progress(sh, WcStatus::LocQpOpErr);
            self.enter_error(sh);
            return;
        }
        self.complete_recv(sh, WcOpcode::Recv, (GRH_LEN + n) as u32, frame);
    }

    /// Builds the next response packet (ACK, NAK, READ response, atomic ACK), if one is owed.
    pub(crate) fn next_response(
        &mut self,
        sh: &mut Shared,
        host: &dyn HostMemory,
        buf: &mut [u8],
    ) -> Option<Transmit> {
        let av = self.attr.av?;
        let dest = self.attr.dest_qpn;
        let front = *self.resp.out.front()?;
        let ack_aeth = |msn: u32| AethRepr {
            syndrome: AethSyndrome::Ack {
                credits: AethSyndrome::UNLIMITED_CREDITS,
            },
            msn,
        };
        let (t, payload_len, read) = match front {
            Outbound::Ack { psn, syndrome, msn } => {
                self.resp.out.pop_front();
                // As `start_packet` and a `FrameWriter` would build it, but without walking
                // the opcode's headers: most packets a responder sends are these.
                let bth = self.bth(Opcode::RC_ACKNOWLEDGE, dest, psn);
                let path = self.path_headers(sh, &av)?;
                let ident = sh.next_ip_ident_for(path);
                let len =
                    emit_ack_on_path(buf, path, ident, &bth, &AethRepr { syndrome, msn }).ok()?;
                let (src, dst) = (path.src_addr(), path.dst_addr());
                sh.counters.tx_responses += 1;
                return Some(Transmit {
                    len,
                    src,
                    dst,
                    qpn: self.qpn,
                    completes_signaled: false,
                });
            }
            Outbound::AtomicAck { psn, orig, msn } => {
                self.resp.out.pop_front();
                let mut t = TransportRepr::new(self.bth(Opcode::RC_ATOMIC_ACKNOWLEDGE, dest, psn));
                t.aeth = Some(ack_aeth(msn));
                t.atomic_ack_eth = Some(AtomicAckEthRepr { orig });
                (t, 0, None)
            }
            // In ERROR only what was owed before a failed request is left (see
            // `Responder::keep_owed_before`); it goes out.
            Outbound::Read(r) => {
                let mtu = self.mtu(sh) as u64;
                let n = r.remaining.min(mtu);
                let last = r.remaining <= mtu;
                let opcode = if !r.started && r.psn == r.first_psn {
                    if last {
                        Opcode::RC_RDMA_READ_RESPONSE_ONLY
                    } else {
                        Opcode::RC_RDMA_READ_RESPONSE_FIRST
                    }
                } else if last {
                    Opcode::RC_RDMA_READ_RESPONSE_LAST
                } else {
                    Opcode::RC_RDMA_READ_RESPONSE_MIDDLE
                };
                if n > 0
                    && sh
                        .mem
                        .check_remote(r.rkey, self.pd, r.va, n, Access::REMOTE_READ)
                        .is_err()
                {
                    // Deregistered under a READ: remote access error, QP to ERROR.
                    self.resp.out.pop_front();
                    self.class_c(sh, r.psn, Fault::Access);
                    return self.next_response(sh, host, buf);
                }
                let mut t = TransportRepr::new(self.bth(opcode, dest, r.psn));
                if opcode != Opcode::RC_RDMA_READ_RESPONSE_MIDDLE {
                    t.aeth = Some(ack_aeth(r.msn));
                }
                (t, n as usize, Some(r))
            }
        };
        let Some((mut w, src, dst)) = self.start_packet(sh, &av, buf, &t, payload_len) else {
            if let Some(r) = read.filter(|_| self.path_headers(sh, &av).is_some()) {
                // The path is there, so the response does not fit the transmit buffer (a path
                // MTU above what the port's frames carry) and never will: left at the head of
                // the queue it would hold up every later response of this QP.
                sh.counters.tx_too_big_for_buffer += 1;
                self.resp.out.pop_front();
                self.class_c(sh, r.psn, Fault::Malformed);
                return self.next_response(sh, host, buf);
            }
            // No source address (it may come back): a READ response waits at the head of
            // the queue for it. An atomic's ACK, already taken off the queue, is lost like
            // a dropped packet; the requester's resend of the atomic brings it again.
            return None;
        };
        // The ICRC's CRC-32 over the headers and the payload, when a long payload was hashed
        // as it was copied in (`HostMemory::read_hashing`).
        let mut hashed = None;
        if let Some(r) = read {
            if payload_len > 0 {
                let from = payload_hash_start(host, &w);
                match read_maybe_hashing(host, r.va, w.payload_mut(), from) {
                    Ok(crc) => hashed = crc,
                    Err(_) => {
                        self.resp.out.pop_front();
                        self.class_c(sh, r.psn, Fault::Access);
                        return self.next_response(sh, host, buf);
                    }
                }
            }
            let n = payload_len as u64;
            match self.resp.out.front_mut() {
                Some(Outbound::Read(cur)) if cur.remaining > n => {
                    cur.psn = psn::add(cur.psn, 1);
                    cur.va += n;
                    cur.remaining -= n;
                    cur.started = true;
                }
                _ => {
                    self.resp.out.pop_front();
                }
            }
        }
        let len = w.finish_hashed(hashed).ok()?;
        sh.counters.tx_responses += 1;
        Some(Transmit {
            len,
            src,
            dst,
            qpn: self.qpn,
            completes_signaled: false,
        })
    }
}
