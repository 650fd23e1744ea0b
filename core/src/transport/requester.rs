//! The requester: turns send WQEs into request packets (`rxe_req.c`).
//!
//! Segmentation by path MTU, PSN assignment with 24-bit wrap, the AckReq policy (rdma_rxe's,
//! with one ACK per burst of queued messages), the send window (`MAX_UNACKED_PSNS`, shrunk
//! after losses: `send_window`), the initiator-depth limit on READs and atomics, fences, and
//! the go-back-N restart point after a retry.

use super::device::{Shared, Transmit};
use super::host_memory::{payload_hash_start, HostMemory};
use super::memory::Access;
use super::qp::{Qp, WqeState};
use super::qp_state::{retransmit_timeout_ns, QpState, QpType};
use super::verbs::{SendFlags, SendOp, WcStatus};
use super::{psn, sgl, Nanos};
use crate::wire::{AtomicEthRepr, DethRepr, Opcode, RethRepr, TransportRepr};

/// An RC requester never runs more than this many PSNs ahead of the oldest unacknowledged one,
/// and fewer after a loss (the [`SendWindow`](super::send_window::SendWindow) starts here).
///
/// rdma_rxe stops at 128 (`RXE_MAX_UNACKED_PSNS`); the window is the requester's own choice
/// (a responder takes any in-order PSN), and 128 was too small. An ACK is asked for on every
/// 66th packet of a long message, so with 128 a requester may send only about 63 packets more
/// while an ACK makes its way back. Between two TCG guests (path MTU 1024, packets 60-100 µs
/// apart at the sender) the ACK often took longer, the window stood full in a third of the
/// samples, and `ib_write_bw` reached 15.6-17.0 MB/s against 18-26 MB/s with 512 (stop 57,
/// alternating runs). rdma_rxe as the responder keeps up with more: receiving from xroce it
/// took 21-23 MB/s with a window of 1024 against 16-17 with 128, and asked for no
/// retransmission. The price: a loss makes go-back-N resend what went out after it, up to a
/// window (512 KiB at path MTU 1024, 2 MiB at 4096) where 128 cost a quarter of that; so a
/// loss halves the window, and acknowledgements grow it back.
pub const MAX_UNACKED_PSNS: u32 = 512;
/// AckReq is forced on a middle packet after this many packets without it
/// (`RXE_MAX_PKT_PER_ACK`).
pub const MAX_PKT_PER_ACK: u32 = 64;
/// In a burst of queued messages, the last packet of every this-many-th message still asks
/// for an ACK, so that acknowledgements (and completions) keep flowing while the burst goes out
/// instead of arriving all at its end.
pub const MAX_MSGS_PER_ACK: u32 = 16;
/// Longest time without AckReq when the QP has no retransmission timer.
pub const MAX_NOACK_NS: u64 = 1_000_000;
/// Largest message a WR may carry (rdma_rxe's `max_msg_sz`).
pub const MAX_MSG_SIZE: u64 = 1 << 31;

/// Opcode offsets inside the SEND and WRITE families (IBTA table 38); RC starts at 0x00, UC
/// at 0x20.
mod op {
    pub const SEND_FIRST: u8 = 0x00;
    pub const SEND_MIDDLE: u8 = 0x01;
    pub const SEND_LAST: u8 = 0x02;
    pub const SEND_LAST_IMM: u8 = 0x03;
    pub const SEND_ONLY: u8 = 0x04;
    pub const SEND_ONLY_IMM: u8 = 0x05;
    pub const WRITE_FIRST: u8 = 0x06;
    pub const WRITE_MIDDLE: u8 = 0x07;
    pub const WRITE_LAST: u8 = 0x08;
    pub const WRITE_LAST_IMM: u8 = 0x09;
    pub const WRITE_ONLY: u8 = 0x0a;
    pub const WRITE_ONLY_IMM: u8 = 0x0b;
}

/// What starting a WQE led to.
enum Start {
    /// PSNs assigned; packets can go.
    Ready,
    /// Not yet: a fence, the initiator depth or SQD holds it back.
    Wait,
    /// Finished or failed without a packet (see its state).
    NoPacket,
}

impl Qp {
    /// Builds the next request packet into `buf`, if one may be sent now.
    pub(crate) fn next_request(
        &mut self,
        now: Nanos,
        sh: &mut Shared,
        host: &dyn HostMemory,
        buf: &mut [u8],
    ) -> Option<Transmit> {
        loop {
            if !matches!(self.attr.state, QpState::Rts | QpState::Sqd) {
                return None;
            }
            self.retire_local(sh);
            if self.attr.state == QpState::Error || self.comp.rnr_deadline.is_some() {
                return None;
            }
            if self.req.need_retry {
                self.go_back_n(sh);
            }
            if self.req.probe || self.req.probe_newest {
                if let Some(t) = self.start_probe(now, sh, host, buf) {
                    return Some(t);
                }
            }
            let idx = self.req.wqe_index;
            let state = self.sq.get(idx)?.state;
            match state {
                WqeState::Posted => match self.start_wqe(idx, sh) {
                    Start::Ready => {}
                    Start::Wait => return None,
                    Start::NoPacket => continue,
                },
                WqeState::Pending => {}
                // Waits for the completer to reach it.
                WqeState::Done | WqeState::Error(_) => return None,
            }
            if self.ty == QpType::Rc
                && psn::diff(
                    self.req.psn,
                    psn::add(self.comp.psn, self.req.window.size()),
                ) > 0
            {
                return None;
            }
            match self.build_request(now, sh, host, idx, buf) {
                Some(t) => return Some(t),
                None => continue,
            }
        }
    }

    /// Whether the WQE at `idx` is posted and `start_wqe` would start it now, behind a
    /// message that is not a READ or atomic (so no initiator-depth slot is taken between):
    /// not held by a fence or for a READ/atomic slot, and passing its local checks.
    fn starts_at_once(&mut self, idx: usize, sh: &mut Shared) -> bool {
        let Some(w) = self.sq.get(idx) else {
            return false;
        };
        let fenced = w.wr.flags.contains(SendFlags::FENCE)
            && self.req.rd_atomic_avail < self.req.rd_atomic_max;
        let no_slot = w.wr.op.is_read_or_atomic() && self.req.rd_atomic_avail == 0;
        w.state == WqeState::Posted && !fenced && !no_slot && self.passes_local_checks(idx, sh)
    }

    /// First look at a WQE: limits, local checks, PSN assignment.
    fn start_wqe(&mut self, idx: usize, sh: &mut Shared) -> Start {
        let mtu = self.mtu(sh) as u64;
        let (op, flags, length) = {
            let w = &self.sq[idx];
            (w.wr.op, w.wr.flags, w.length)
        };
        if self.attr.state == QpState::Sqd {
            return Start::Wait;
        }
        if flags.contains(SendFlags::FENCE) && self.req.rd_atomic_avail < self.req.rd_atomic_max {
            return Start::Wait;
        }
        let needs_slot = op.is_read_or_atomic();
        if needs_slot && self.req.rd_atomic_avail == 0 {
            return Start::Wait;
        }
        if self.ty == QpType::Ud && length > mtu {
            // rdma_rxe completes an oversized UD send successfully without sending it.
            self.sq[idx].state = WqeState::Done;
            return Start::NoPacket;
        }
        if !self.passes_local_checks(idx, sh) {
            self.sq[idx].state = WqeState::Error(WcStatus::LocProtErr);
            return Start::NoPacket;
        }
        let npkts = if op.is_atomic() {
            1
        } else {
            length.div_ceil(mtu).max(1) as u32
        };
        if needs_slot {
            self.req.rd_atomic_avail -= 1;
        }
        let first = self.req.psn;
        let w = &mut self.sq[idx];
        w.has_rd_atomic = needs_slot;
        w.first_psn = first;
        w.last_psn = psn::add(first, npkts - 1);
        w.state = WqeState::Pending;
        self.req.psn_end = psn::add(first, npkts);
        self.req.offset = 0;
        Start::Ready
    }

    /// The WQE's scatter/gather list names memory it may use (checked again when it starts,
    /// unless no region was deregistered since it last passed).
    fn passes_local_checks(&mut self, idx: usize, sh: &Shared) -> bool {
        let generation = sh.mem.generation();
        let pd = self.pd;
        let Some(w) = self.sq.get_mut(idx) else {
            return false;
        };
        if w.checked_in == generation {
            return true;
        }
        let passed = match w.wr.op {
            SendOp::RdmaRead { .. } | SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. } => {
                sgl::check(&sh.mem, pd, &w.wr.sg_list, Access::LOCAL_WRITE).is_ok()
            }
            _ if w.inline.is_some() => true,
            _ => sgl::check(&sh.mem, pd, &w.wr.sg_list, Access::NONE).is_ok(),
        };
        if passed {
            w.checked_in = generation;
        }
        passed
    }

    /// Builds one packet of the WQE at `idx` from `req.offset`. `None` when the WQE failed
    /// locally instead (its state says how).
    fn build_request(
        &mut self,
        now: Nanos,
        sh: &mut Shared,
        host: &dyn HostMemory,
        idx: usize,
        buf: &mut [u8],
    ) -> Option<Transmit> {
        let mtu = self.mtu(sh) as u64;
        let offset = self.req.offset;
        let psn = self.req.psn;
        let w = &self.sq[idx];
        let dest = match (self.ty, w.ud_av, w.wr.ud) {
            (QpType::Ud, Some(av), Some(ud)) => Some((av, ud.remote_qpn)),
            (QpType::Ud, _, _) => None,
            _ => self.attr.av.map(|av| (av, self.attr.dest_qpn)),
        };
        let Some((av, dest_qpn)) = dest else {
            self.sq[idx].state = WqeState::Error(WcStatus::LocQpOpErr);
            return None;
        };
        let base = if self.ty == QpType::Uc { 0x20 } else { 0x00 };
        let remaining = w.length - offset;
        let start = offset == 0;
        let mut payload_len = 0u64;
        let mut psn_advance = 1u32;
        let mut ends = true;
        let mut t = TransportRepr::new(self.bth(Opcode(0), dest_qpn, psn));
        match w.wr.op {
            SendOp::Send | SendOp::SendWithImm { .. } => {
                payload_len = remaining.min(mtu);
                ends = remaining <= mtu;
                let imm = w.wr.op.immediate();
                t.bth.opcode = Opcode(if self.ty == QpType::Ud {
                    if imm.is_some() {
                        Opcode::UD_SEND_ONLY_WITH_IMMEDIATE.0
                    } else {
                        Opcode::UD_SEND_ONLY.0
                    }
                } else {
                    base + match (start, ends, imm.is_some()) {
                        (true, true, false) => op::SEND_ONLY,
                        (true, true, true) => op::SEND_ONLY_IMM,
                        (true, false, _) => op::SEND_FIRST,
                        (false, false, _) => op::SEND_MIDDLE,
                        (false, true, false) => op::SEND_LAST,
                        (false, true, true) => op::SEND_LAST_IMM,
                    }
                });
                if ends {
                    t.immediate = imm;
                    t.bth.solicited = w.wr.flags.contains(SendFlags::SOLICITED);
                }
                if let (QpType::Ud, Some(ud)) = (self.ty, w.wr.ud) {
                    t.deth = Some(DethRepr {
                        qkey: ud.remote_qkey,
                        src_qpn: self.qpn,
                    });
                }
            }
            SendOp::RdmaWrite { remote_addr, rkey }
            | SendOp::RdmaWriteWithImm {
                remote_addr, rkey, ..
            } => {
                payload_len = remaining.min(mtu);
                ends = remaining <= mtu;
                let imm = w.wr.op.immediate();
                t.bth.opcode = Opcode(
                    base + match (start, ends, imm.is_some()) {
                        (true, true, false) => op::WRITE_ONLY,
                        (true, true, true) => op::WRITE_ONLY_IMM,
                        (true, false, _) => op::WRITE_FIRST,
                        (false, false, _) => op::WRITE_MIDDLE,
                        (false, true, false) => op::WRITE_LAST,
                        (false, true, true) => op::WRITE_LAST_IMM,
                    },
                );
                if start {
                    t.reth = Some(RethRepr {
                        va: remote_addr,
                        rkey,
                        dma_len: w.length as u32,
                    });
                }
                if ends {
                    t.immediate = imm;
                    t.bth.solicited = imm.is_some() && w.wr.flags.contains(SendFlags::SOLICITED);
                }
            }
            SendOp::RdmaRead { remote_addr, rkey } => {
                // A retried READ resumes after the bytes already received.
                t.bth.opcode = Opcode::RC_RDMA_READ_REQUEST;
                t.reth = Some(RethRepr {
                    va: remote_addr.wrapping_add(offset),
                    rkey,
                    dma_len: remaining as u32,
                });
                psn_advance = remaining.div_ceil(mtu).max(1) as u32;
            }
            SendOp::CompareSwap {
                remote_addr,
                rkey,
                compare,
                swap,
            } => {
                t.bth.opcode = Opcode::RC_COMPARE_SWAP;
                t.atomic_eth = Some(AtomicEthRepr {
                    va: remote_addr,
                    rkey,
                    swap_add: swap,
                    compare,
                });
            }
            SendOp::FetchAdd {
                remote_addr,
                rkey,
                add,
            } => {
                t.bth.opcode = Opcode::RC_FETCH_ADD;
                t.atomic_eth = Some(AtomicEthRepr {
                    va: remote_addr,
                    rkey,
                    swap_add: add,
                    compare: 0,
                });
            }
        }
        // The last packet of a signalled WR with unsignalled ones queued behind it (perftest
        // signals every 100th) asks for its ACK, whatever follows: its sender likely waits
        // for this completion before it posts more, and the engine kicks such a packet early
        // (`completes_signaled`). Where every WR is signalled, the ACKs stay coalesced.
        let completes_signaled = ends
            && self.ty == QpType::Rc
            && !self.sq_sig_all
            && self.sq[idx].wr.flags.contains(SendFlags::SIGNALED)
            && self
                .sq
                .get(idx + 1)
                .is_some_and(|next| !next.wr.flags.contains(SendFlags::SIGNALED));
        let probing = std::mem::take(&mut self.req.force_ack_req);
        if self.ty == QpType::Rc {
            // Packets since the last AckReq (rdma_rxe forces one after 64 without; a send
            // window that a loss shrank asks more often, to keep moving).
            // Also by time: next to many busy QPs a QP gets one packet per round of the
            // device's round robin, so 64 packets can take longer than the retransmission
            // timeout, which would then fire although nothing was lost (256 QPs of
            // ib_write_bw 64 KiB: 8 000 such timeouts in 3 s, half the throughput).
            let periodic = {
                let n = self.req.noack_pkts;
                self.req.noack_pkts += 1;
                let since = *self.req.noack_since.get_or_insert(now);
                n > self.req.window.ack_every()
                    || now.saturating_sub(since) >= self.ack_interval_ns()
            };
            // The last packet of a message asks for an ACK, unless another message is already
            // queued right behind it and will go out next: the ACK that one asks for covers
            // both (ACKs are cumulative), so a burst of small messages costs one ACK instead of
            // one each. rdma_rxe asks on every last packet; its responder answers any AckReq,
            // and an ACK is still asked for at least every 66th packet, well inside the send
            // window. Only in RTS (in SQD the next message will not start), and only when the
            // next one will send a packet (a local error would leave this one unacknowledged
            // until the retransmission timer). READ and atomic requests are answered anyway and
            // keep the bit, as rdma_rxe sets it.
            let more_behind = ends
                && !completes_signaled
                && self.req.noack_msgs + 1 < MAX_MSGS_PER_ACK
                && !self.sq[idx].wr.op.is_read_or_atomic()
                && self.attr.state == QpState::Rts
                && self.starts_at_once(idx + 1, sh);
            if (ends && !more_behind) || periodic || probing {
                t.bth.ack_req = true;
                self.req.noack_pkts = 0;
                self.req.noack_msgs = 0;
                self.req.noack_since = None;
            } else if ends {
                self.req.noack_msgs += 1;
            }
        }
        let Some((mut writer, src, dst)) =
            self.start_packet(sh, &av, buf, &t, payload_len as usize)
        else {
            // No path: the source GID names no address of the interface any more (removed
            // under the QP; rdma_rxe fails the request the same way). Or the path is there and
            // the packet does not fit the transmit buffer: a path MTU above what the port's
            // frames carry, which will not change while the QP lives.
            if self.path_headers(sh, &av).is_some() {
                sh.counters.tx_too_big_for_buffer += 1;
            } else {
                sh.counters.tx_no_source_address += 1;
            }
            self.sq[idx].state = WqeState::Error(WcStatus::LocQpOpErr);
            return None;
        };
        let w = &self.sq[idx];
        // The list passed its region checks when the WQE started (or was looked ahead at);
        // while no region has been deregistered since, they still hold for every piece of it,
        // and the per-packet lookups are skipped.
        let table = (w.checked_in != sh.mem.generation()).then_some(&sh.mem);
        // A long payload is hashed for the ICRC as it is copied in, in one pass over it
        // (`HostMemory::read_hashing`); a short one costs less copied and hashed whole.
        let hashed_from = w
            .inline
            .is_none()
            .then(|| payload_hash_start(host, &writer))
            .flatten();
        let gathered = match &w.inline {
            Some(data) => {
                let s = offset as usize;
                writer
                    .payload_mut()
                    .copy_from_slice(&data[s..s + payload_len as usize]);
                Ok(None)
            }
            None => sgl::gather(
                table,
                host,
                self.pd,
                &w.wr.sg_list,
                offset,
                writer.payload_mut(),
                hashed_from,
            ),
        };
        let len = match gathered {
            Ok(hashed) => writer.finish_hashed(hashed).ok()?,
            Err(_) => {
                self.sq[idx].state = WqeState::Error(WcStatus::LocProtErr);
                return None;
            }
        };

        self.req.psn = psn::add(psn, psn_advance);
        let finished = match w.wr.op {
            SendOp::Send
            | SendOp::SendWithImm { .. }
            | SendOp::RdmaWrite { .. }
            | SendOp::RdmaWriteWithImm { .. } => {
                self.req.offset += payload_len;
                ends
            }
            _ => true,
        };
        if finished {
            self.req.wqe_index += 1;
            self.req.offset = 0;
            if self.ty != QpType::Rc {
                self.sq[idx].state = WqeState::Done;
            }
        }
        if self.ty == QpType::Rc {
            if self.comp.retrans_deadline.is_none() {
                if let Some(t) = retransmit_timeout_ns(self.attr.timeout) {
                    self.comp.retrans_deadline = Some(now + t);
                }
            }
            // Only a packet that asks for an ACK sets the probe's delay going: a QP between
            // two turns of the round robin, its packets so far not asking (ACKs coalesce over
            // up to 64), is not waiting for anything.
            let first_time = self.req.newest_built.is_none_or(|n| psn::diff(psn, n) > 0);
            if first_time {
                self.req.newest_built = Some(psn);
            }
            if t.bth.ack_req {
                self.req.asked_ack_psn = Some(psn);
                if first_time && !probing && self.req.rtt_sample.is_none() {
                    // Going for the first time: time it to its ACK.
                    self.req.rtt_sample = Some((psn, now));
                }
                self.rearm_probe(now, true);
            }
        }
        if finished && self.ty != QpType::Rc {
            self.retire_local(sh);
        }
        sh.counters.tx_requests += 1;
        Some(Transmit {
            len,
            src,
            dst,
            qpn: self.qpn,
            completes_signaled,
        })
    }

    /// Longest time packets go out without one asking for an ACK: an eighth of the
    /// retransmission timeout, and 1 ms when that timer is off.
    fn ack_interval_ns(&self) -> u64 {
        retransmit_timeout_ns(self.attr.timeout).map_or(MAX_NOACK_NS, |t| t / 8)
    }

    /// Go-back-N: resend from the oldest unacknowledged PSN. The head WQE resumes where the
    /// acknowledgements (or, for a READ, the responses received) left it; everything after it
    /// is resent whole, with the PSNs it had.
    pub(crate) fn go_back_n(&mut self, sh: &mut Shared) {
        self.req.need_retry = false;
        self.resume_from_comp_psn(sh);
        sh.counters.retransmissions += 1;
    }

    /// A tail-loss probe that is due: its first packet, the oldest unacknowledged one, built
    /// here; or, for its newest packet, the requester pointed back at it, for the caller to
    /// build as the next request (`None` then, as when nothing is outstanding any more).
    fn start_probe(
        &mut self,
        now: Nanos,
        sh: &mut Shared,
        host: &dyn HostMemory,
        buf: &mut [u8],
    ) -> Option<Transmit> {
        let outstanding = psn::diff(self.req.psn, self.comp.psn);
        let newest = psn::add(self.req.psn, psn::MASK);
        // The newest alone: the oldest is a READ or atomic request.
        let mut newest_alone = false;
        if std::mem::take(&mut self.req.probe) && outstanding > 0 {
            if let Some(t) = self.build_probe(now, sh, host, buf) {
                // The newest goes next, unless it is this one.
                self.req.probe_newest = outstanding > 1;
                let which = if outstanding > 1 {
                    "the oldest and the newest"
                } else {
                    "it"
                };
                self.note_probe(sh, which, newest);
                return Some(t);
            }
            self.req.probe_newest = true;
            newest_alone = true;
        }
        if std::mem::take(&mut self.req.probe_newest)
            && outstanding > 0
            && self.point_at_newest_sent(sh)
        {
            self.req.force_ack_req = true;
            if newest_alone {
                self.note_probe(sh, "the newest", newest);
            }
        }
        None
    }

    /// The tail-loss probe (see [`tail_probe_ns`](super::qp_state::tail_probe_ns)), first
    /// packet: the oldest unacknowledged one once more, asking for an ACK, with the requester
    /// left where it was; the newest goes next (`Qp::point_at_newest_sent`). Between them they
    /// draw an answer whatever was lost. The responder holds the oldest or expects it next, so
    /// it ACKs or takes it, even when it has sent its one sequence NAK for a gap and drops any
    /// later PSN unanswered (that NAK lost, or ignored by a requester already going back N).
    /// The newest, behind it, is then ACKed if everything arrived, taken if it alone was lost,
    /// or draws the sequence NAK that starts go-back-N where the loss began. No inference is
    /// drawn from the answers: a responder that was only slow ACKs the lot. `None` where the
    /// oldest packet is a READ or atomic request, whose resending is left to the
    /// retransmission timer (a READ asked again is answered again, whole).
    fn build_probe(
        &mut self,
        now: Nanos,
        sh: &mut Shared,
        host: &dyn HostMemory,
        buf: &mut [u8],
    ) -> Option<Transmit> {
        let head = self.sq.front()?;
        if head.state != WqeState::Pending || head.wr.op.is_read_or_atomic() {
            return None;
        }
        let r = &self.req;
        let resume = (
            r.psn,
            r.wqe_index,
            r.offset,
            r.noack_pkts,
            r.noack_msgs,
            r.noack_since,
        );
        self.resume_from_comp_psn(sh);
        self.req.force_ack_req = true;
        let probe = self.build_request(now, sh, host, 0, buf);
        self.req.force_ack_req = false;
        let r = &mut self.req;
        (
            r.psn,
            r.wqe_index,
            r.offset,
            r.noack_pkts,
            r.noack_msgs,
            r.noack_since,
        ) = resume;
        probe
    }

    /// Counts a tail-loss probe as its first packet goes, and says at `debug` which packets
    /// of those outstanding (up to `newest`) go again.
    fn note_probe(&self, sh: &mut Shared, which: &str, newest: u32) {
        sh.counters.tail_probes += 1;
        log::debug!(
            "QP {:#x}: nothing heard for {} µs with PSNs {:#x}..{:#x} outstanding; probing \
             (probe {} of this stall): {which} again, asking for ACKs",
            self.qpn,
            self.probe_delay_after(self.comp.probes.saturating_sub(1))
                .unwrap_or(0)
                / 1000,
            self.comp.psn,
            newest,
            self.comp.probes
        );
    }

    /// Points the requester back at the newest packet it sent, a SEND or WRITE packet not yet
    /// acknowledged, for the tail-loss probe's second packet; once that packet has gone again
    /// the requester carries on where it was. False, with nothing moved, where that packet is
    /// a READ or atomic request.
    pub(crate) fn point_at_newest_sent(&mut self, sh: &Shared) -> bool {
        if self.req.offset == 0 {
            // Between messages: the newest packet ended the WQE before this one.
            return self.resend_last_packet(sh);
        }
        // Part-way through a SEND or WRITE (the window or the round robin paused it).
        let Some(w) = self.sq.get(self.req.wqe_index) else {
            return false;
        };
        if w.state != WqeState::Pending || w.wr.op.is_read_or_atomic() {
            return false;
        }
        let newest = psn::add(self.req.psn, psn::MASK);
        let into = psn::diff(newest, w.first_psn).max(0) as u64;
        self.req.offset = into * self.mtu(sh) as u64;
        self.req.psn = newest;
        true
    }

    /// Points the requester back at the last packet of the last message it sent, a SEND or
    /// WRITE not yet acknowledged, to send it once more; it then carries on where it was.
    /// False, with nothing moved, when there is no such message.
    pub(crate) fn resend_last_packet(&mut self, sh: &Shared) -> bool {
        let Some(idx) = self.req.wqe_index.checked_sub(1) else {
            return false;
        };
        let mtu = self.mtu(sh) as u64;
        let Some(w) = self.sq.get(idx) else {
            return false;
        };
        if w.state != WqeState::Pending || w.wr.op.is_read_or_atomic() {
            return false;
        }
        let into = psn::diff(w.last_psn, w.first_psn).max(0) as u64;
        self.req.offset = (into * mtu).min(w.length);
        self.req.psn = w.last_psn;
        self.req.wqe_index = idx;
        true
    }

    /// Points the requester at the oldest unacknowledged PSN, in the head WQE at the offset
    /// that PSN stands for.
    pub(crate) fn resume_from_comp_psn(&mut self, sh: &Shared) {
        self.req.psn = self.comp.psn;
        self.req.wqe_index = 0;
        self.req.noack_pkts = 0;
        self.req.noack_msgs = 0;
        self.req.noack_since = None;
        let mtu = self.mtu(sh) as u64;
        self.req.offset = match self.sq.front() {
            Some(w) if w.state == WqeState::Pending => match w.wr.op {
                SendOp::RdmaRead { .. } => w.read_received,
                op if op.is_atomic() => 0,
                _ => {
                    let acked = psn::diff(self.comp.psn, w.first_psn).max(0) as u64;
                    (acked * mtu).min(w.length)
                }
            },
            _ => 0,
        };
    }
}
