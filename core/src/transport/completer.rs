//! The completer: acknowledgements, READ responses and atomic ACKs retire send WQEs in order
//! (`rxe_comp.c`); the retransmission and RNR timers drive retries.

use super::device::Shared;
use super::host_memory::HostMemory;
use super::qp::{Qp, WqeState};
use super::qp_state::{
    probe_ceiling_ns, probe_delay_ns, retransmit_timeout_ns, QpState, QpType, RNR_TIMER_US,
};
use super::verbs::{SendOp, WcStatus};
use super::{psn, sgl, Nanos};
use crate::wire::{AethSyndrome, NakCode, Operation, Position, RoceFrame};

/// rdma_rxe treats a retry count of 7 as infinite, for `retry_cnt` as for `rnr_retry`.
pub const INFINITE_RETRY: u8 = 7;

/// Why a QP goes back N.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Retry {
    /// The retransmission timer ran out.
    Timeout,
    /// The responder NAKed a PSN it did not expect.
    SequenceNak,
    /// A response beyond a READ or atomic's PSNs came: its own response was lost.
    LostResponse,
}

impl std::fmt::Display for Retry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Retry::Timeout => "no response in time",
            Retry::SequenceNak => "sequence NAK",
            Retry::LostResponse => "a READ or atomic response lost",
        })
    }
}

/// How many retries a QP has left, as a log line says it.
fn retries_left(count: u8) -> String {
    if count == INFINITE_RETRY {
        "retrying forever".into()
    } else {
        format!("{count} retries left")
    }
}

/// The completion status for the head WQE that an error NAK fails.
fn nak_status(code: NakCode) -> WcStatus {
    match code {
        NakCode::InvalidRequest => WcStatus::RemInvReqErr,
        NakCode::RemoteAccessError => WcStatus::RemAccessErr,
        _ => WcStatus::RemOpErr,
    }
}

impl Qp {
    /// Handles an ACK, NAK, READ response or atomic ACK addressed to this QP.
    pub(crate) fn handle_response(
        &mut self,
        now: Nanos,
        sh: &mut Shared,
        host: &mut dyn HostMemory,
        frame: &RoceFrame<'_>,
    ) {
        if !matches!(self.attr.state, QpState::Rts | QpState::Sqd) {
            return;
        }
        let oldest = self.comp.psn;
        self.process_response(now, sh, host, frame);
        // ACKs and responses grow the send window back after a loss.
        let answered = psn::diff(self.comp.psn, oldest);
        if let Some((timed, sent)) = self.req.rtt_sample {
            if psn::diff(self.comp.psn, timed) > 0 {
                self.req.rtt_sample = None;
                self.comp.rtt.sample(now.saturating_sub(sent));
                // The path's time is known again: the next stall probes from the first
                // delay. Only a measurement ends the doubling, not progress alone, as TCP keeps
                // a backed-off retransmission timer until a segment is timed (RFC 6298, 5.7):
                // an ACK slower than the probe's delay is never timed (the probe ends the
                // measurement), and a path that slowed down past it would otherwise be probed
                // for on every turn, for good.
                self.comp.probes = 0;
            }
        }
        if answered > 0 {
            self.req.window.on_acked(answered as u32);
        }
        self.retire_local(sh);
        self.rearm_retransmit(now);
        self.check_drained(sh);
    }

    fn process_response(
        &mut self,
        now: Nanos,
        sh: &mut Shared,
        host: &mut dyn HostMemory,
        frame: &RoceFrame<'_>,
    ) {
        let t = &frame.headers.transport;
        let p = t.bth.psn;
        let Some(info) = t.bth.opcode.info() else {
            return;
        };
        let syndrome = t.aeth.map(|a| a.syndrome);
        if psn::diff(p, self.req.psn_end) >= 0 {
            // A response to nothing this QP sent: a late packet of an earlier connection that
            // had this QP number (every process numbers its QPs from the same start). Taken as
            // an implicit acknowledgement it would complete WQEs the peer never received, and
            // both ends would then wait for each other forever.
            sh.counters.ghost_responses += 1;
            return;
        }

        // Implicit acknowledgement: a response beyond a SEND/WRITE's last PSN completes it.
        loop {
            let Some(w) = self.sq.front() else {
                return;
            };
            if w.state != WqeState::Pending {
                return;
            }
            if psn::diff(p, w.last_psn) <= 0 {
                break;
            }
            if w.wr.op.is_read_or_atomic() {
                // The READ/atomic response was lost: retry it.
                self.start_retry(sh, Retry::LostResponse);
                return;
            }
            // A NAK or RNR NAK beyond this WQE acknowledges it too; so does an ACK.
            let next = psn::add(w.last_psn, 1);
            self.reset_retry_counters();
            if psn::diff(next, self.comp.psn) > 0 {
                self.comp.psn = next;
                self.comp.opcode = None;
            }
            self.retire_head(sh, WcStatus::Success);
            if self.attr.state == QpState::Error {
                return;
            }
        }
        let Some(w) = self.sq.front() else {
            return;
        };
        let op = w.wr.op;
        let (first_psn, last_psn) = (w.first_psn, w.last_psn);
        let d = psn::diff(p, self.comp.psn);
        if let (SendOp::RdmaRead { .. }, Some(AethSyndrome::Nak(code))) = (op, syndrome) {
            // An error NAK for the READ at the head may lie anywhere in its PSNs: rdma_rxe
            // NAKs a failure in the midst of its reply (the region deregistered, say) at the
            // READ request's PSN, behind where the responses already moved `comp.psn`, and a
            // responder NAKing at a response's PSN may be ahead of one that was lost. Either way
            // the responder has given up: taken as a stale duplicate, the NAK was dropped and
            // the READ retried against a QP in error until the retries ran out, forever with
            // `retry_cnt` 7.
            let in_read = psn::diff(p, first_psn) >= 0 && psn::diff(p, last_psn) <= 0;
            if in_read && code != NakCode::PsnSequenceError && d != 0 {
                sh.counters.error_naks_received += 1;
                log::debug!(
                    "QP {:#x}: NAK {code:?} for PSN {p:#x} of a READ: the work request fails \
                     with {:?}",
                    self.qpn,
                    nak_status(code)
                );
                self.fail_head(sh, nak_status(code));
                return;
            }
        }
        if d < 0 {
            // A duplicate (retried) response: only the one ending the head SEND/WRITE counts.
            if p == last_psn && !op.is_read_or_atomic() && info.operation == Operation::Acknowledge
            {
                if let Some(AethSyndrome::Ack { .. }) = syndrome {
                    self.reset_retry_counters();
                    self.retire_head(sh, WcStatus::Success);
                }
            }
            return;
        }
        if d > 0 && op.is_read_or_atomic() {
            // Out-of-order READ response or atomic ACK: not buffered; the timer recovers.
            return;
        }

        match info.operation {
            Operation::Acknowledge => match syndrome {
                Some(AethSyndrome::Ack { .. }) => {
                    if op.is_read_or_atomic() {
                        // An ACK cannot complete a READ or atomic: it carries no data.
                        return;
                    }
                    self.reset_retry_counters();
                    self.comp.psn = psn::add(p, 1);
                    self.comp.opcode = None;
                    if p == last_psn {
                        self.retire_head(sh, WcStatus::Success);
                    }
                }
                Some(AethSyndrome::RnrNak { timer }) => {
                    sh.counters.rnr_naks_received += 1;
                    if d == 0 && self.comp.rnr_deadline.is_some() {
                        // The same PSN again while this side already waits to resend it: a
                        // packet sent twice before the first RNR NAK came (the last packet
                        // resent on entering SQD) drew two. One wait, one retry.
                        return;
                    }
                    self.comp.psn = p;
                    // Packets behind the NAKed one draw one sequence NAK, now or later.
                    self.comp.rnr_echo_due = psn::diff(self.req.psn, psn::add(p, 1)) > 0;
                    if self.comp.rnr_retry > 0 {
                        if self.comp.rnr_retry != INFINITE_RETRY {
                            self.comp.rnr_retry -= 1;
                        }
                        let us = u64::from(RNR_TIMER_US[usize::from(timer & 0x1f)]);
                        self.comp.rnr_deadline = Some(now + us * 1000);
                        // The packet being timed is resent after the wait: its ACK would time
                        // the wait, not the path.
                        self.req.rtt_sample = None;
                        self.comp.retrans_deadline = None;
                        self.req.need_retry = true;
                        log::debug!(
                            "QP {:#x}: RNR NAK for PSN {p:#x} (no receive ready at the peer); \
                             resending in {us} µs ({})",
                            self.qpn,
                            retries_left(self.comp.rnr_retry)
                        );
                    } else {
                        log::debug!(
                            "QP {:#x}: RNR NAK for PSN {p:#x} with no RNR retries left \
                             (rnr_retry {}): the work request fails with RNR_RETRY_EXC_ERR",
                            self.qpn,
                            self.attr.rnr_retry
                        );
                        self.fail_head(sh, WcStatus::RnrRetryExcErr);
                    }
                }
                Some(AethSyndrome::Nak(NakCode::PsnSequenceError)) => {
                    sh.counters.seq_naks_received += 1;
                    if d == 0 && (self.comp.rnr_deadline.is_some() || self.comp.rnr_echo == Some(p))
                    {
                        // The packets behind an RNR-NAKed one draw a sequence NAK for its PSN
                        // (rdma_rxe's responder does this, once): this side already waits to
                        // resend from there, or has just resent (the NAK came late: a long
                        // message on a slow link, a short RNR timer). Counted as a retry, each
                        // RNR round would use up `retry_cnt` (at 0, the first round failed the
                        // WQE with RETRY_EXC_ERR although `rnr_retry` 7 asks to retry
                        // forever). Only that one: a NAK for a later PSN is a new loss.
                        self.comp.rnr_echo = None;
                        self.comp.rnr_echo_due = false;
                        return;
                    }
                    if d > 0 {
                        self.comp.psn = p;
                    }
                    self.start_retry(sh, Retry::SequenceNak);
                }
                Some(AethSyndrome::Nak(code)) => {
                    sh.counters.error_naks_received += 1;
                    log::debug!(
                        "QP {:#x}: NAK {code:?} for PSN {p:#x}: the work request fails with {:?}",
                        self.qpn,
                        nak_status(code)
                    );
                    self.fail_head(sh, nak_status(code));
                }
                Some(AethSyndrome::Reserved(_)) | None => self.fail_head(sh, WcStatus::BadRespErr),
            },
            Operation::RdmaReadResponse => {
                if !matches!(op, SendOp::RdmaRead { .. }) {
                    self.fail_head(sh, WcStatus::FatalErr);
                    return;
                }
                let pos = info.position;
                let in_sequence = match self.comp.opcode {
                    None => pos.starts_message(),
                    Some(_) => {
                        matches!(pos, Position::Middle | Position::Last)
                            || (pos.starts_message() && p == self.sq[0].first_psn)
                    }
                };
                if !in_sequence {
                    self.fail_head(sh, WcStatus::BadRespErr);
                    return;
                }
                // Each response packet sits at the PSN its bytes have in the READ, as this
                // side's path MTU cut it: FIRST and MIDDLE full packets before the last PSN,
                // LAST or ONLY at it. A peer segmenting by another path MTU (the two ends set
                // up differently) breaks this; unchecked, a smaller MTU's MIDDLE packets fell
                // beyond the READ's PSNs and were dropped as strays, with nothing left
                // outstanding to time out, and the READ waited forever.
                let at_last = p == last_psn;
                let full = frame.payload.len() == self.mtu(sh);
                if pos.ends_message() != at_last || (!pos.ends_message() && !full) {
                    self.fail_head(sh, WcStatus::BadRespErr);
                    return;
                }
                if pos != Position::Middle && !matches!(syndrome, Some(AethSyndrome::Ack { .. })) {
                    self.fail_head(sh, WcStatus::BadRespErr);
                    return;
                }
                self.reset_retry_counters();
                let w = &self.sq[0];
                if pos.starts_message() && p == w.first_psn {
                    self.sq[0].read_received = 0;
                }
                let w = &self.sq[0];
                let received = w.read_received;
                let n = frame.payload.len() as u64;
                if received + n > w.length {
                    self.fail_head(sh, WcStatus::LocLenErr);
                    return;
                }
                if sgl::scatter(
                    &sh.mem,
                    host,
                    self.pd,
                    &w.wr.sg_list,
                    received,
                    frame.payload,
                )
                .is_err()
                {
                    self.fail_head(sh, WcStatus::LocProtErr);
                    return;
                }
                self.sq[0].read_received = received + n;
                self.comp.psn = psn::add(p, 1);
                if pos.ends_message() {
                    self.comp.opcode = None;
                    if received + n == self.sq[0].length {
                        self.retire_head(sh, WcStatus::Success);
                    } else {
                        self.fail_head(sh, WcStatus::LocLenErr);
                    }
                } else {
                    self.comp.opcode = Some(t.bth.opcode);
                }
            }
            Operation::AtomicAcknowledge => {
                if !op.is_atomic() || !matches!(syndrome, Some(AethSyndrome::Ack { .. })) {
                    self.fail_head(sh, WcStatus::BadRespErr);
                    return;
                }
                let Some(ack) = t.atomic_ack_eth else {
                    return;
                };
                self.reset_retry_counters();
                // The original value lands in host byte order, as rdma_rxe writes it.
                let bytes = ack.orig.to_ne_bytes();
                let w = &self.sq[0];
                if sgl::scatter(&sh.mem, host, self.pd, &w.wr.sg_list, 0, &bytes).is_err() {
                    self.fail_head(sh, WcStatus::LocProtErr);
                    return;
                }
                self.comp.psn = psn::add(p, 1);
                self.comp.opcode = None;
                self.retire_head(sh, WcStatus::Success);
            }
            _ => {}
        }
    }

    /// Completes the head WQE with an error; the QP goes to ERROR and the rest flushes.
    fn fail_head(&mut self, sh: &mut Shared, status: WcStatus) {
        self.retire_head(sh, status);
    }

    fn reset_retry_counters(&mut self) {
        self.comp.retry_cnt = self.attr.retry_cnt;
        self.comp.rnr_retry = self.attr.rnr_retry;
        self.comp.started_retry = false;
        self.comp.rnr_echo = None;
    }

    /// A sequence NAK, a lost response or a timeout: count a retry and go back N, or give up
    /// with RETRY_EXC_ERR. A NAK during a retry already under way is ignored; a timeout is not.
    fn start_retry(&mut self, sh: &mut Shared, cause: Retry) {
        let Some(w) = self.sq.front() else {
            return;
        };
        if w.state == WqeState::Posted {
            return;
        }
        if self.comp.started_retry && cause != Retry::Timeout {
            return;
        }
        if self.comp.retry_cnt > 0 {
            if self.comp.retry_cnt != INFINITE_RETRY {
                self.comp.retry_cnt -= 1;
            }
            if psn::diff(self.req.psn, self.comp.psn) > 0 {
                self.req.need_retry = true;
                self.comp.started_retry = true;
                self.comp.retrans_deadline = None;
                // Its ACK could answer the copy resent now (Karn's rule).
                self.req.rtt_sample = None;
                // What the go-back-N resends was in flight behind the loss: fewer in flight
                // next time (see `send_window`).
                let before = self.req.window.size();
                if self.ty == QpType::Rc && self.req.window.on_loss() {
                    sh.counters.send_window_cuts += 1;
                }
                log::debug!(
                    "QP {:#x}: {cause} at PSN {:#x}; resending from there ({}); send window \
                     {before} -> {} PSNs",
                    self.qpn,
                    self.comp.psn,
                    retries_left(self.comp.retry_cnt),
                    self.req.window.size()
                );
            }
        } else {
            sh.counters.retry_exceeded += 1;
            log::debug!(
                "QP {:#x}: {cause} at PSN {:#x} with no retries left (retry_cnt {}): the work \
                 request fails with RETRY_EXC_ERR",
                self.qpn,
                self.comp.psn,
                self.attr.retry_cnt
            );
            self.fail_head(sh, WcStatus::RetryExcErr);
        }
    }

    /// Keeps the retransmission timer and the tail-loss probe running while PSNs are
    /// outstanding, restarting them after every response, and stops them when everything is
    /// acknowledged.
    fn rearm_retransmit(&mut self, now: Nanos) {
        if self.attr.state == QpState::Error {
            self.comp.retrans_deadline = None;
            self.comp.probe_deadline = None;
            return;
        }
        let waiting = self.awaits_response();
        self.comp.retrans_deadline = retransmit_timeout_ns(self.attr.timeout)
            .filter(|_| waiting)
            .map(|t| now + t);
        let asked = self
            .req
            .asked_ack_psn
            .is_some_and(|a| psn::diff(a, self.comp.psn) >= 0);
        self.rearm_probe(now, waiting && asked);
    }

    /// Restarts the tail-loss probe's delay (`waiting`: a packet that asked for an ACK is not
    /// acknowledged yet), after such a packet went or a response came. Each probe of this
    /// stall (and of those before it, until a packet is timed again: see `handle_response`)
    /// doubles the delay, up to a quarter of the retransmission timeout (see
    /// `probe_delay_ns`); the timer, which probes do not restart, ends a stall that no probe
    /// ends.
    pub(crate) fn rearm_probe(&mut self, now: Nanos, waiting: bool) {
        self.comp.probe_deadline = self
            .probe_delay_after(self.comp.probes)
            .filter(|_| waiting && self.ty == QpType::Rc)
            .map(|t| now + t);
    }

    /// The delay before the next probe once `probes` went since a packet was last timed: the
    /// measured first delay (see `round_trip`), doubled per probe up to the ceiling.
    pub(crate) fn probe_delay_after(&self, probes: u32) -> Option<Nanos> {
        let first = self
            .comp
            .rtt
            .probe_delay(probe_ceiling_ns(self.attr.timeout));
        probe_delay_ns(self.attr.timeout, probes, first)
    }

    /// PSNs are outstanding and nothing but a response will resend them: in RTS or SQD, and
    /// not waiting out an RNR NAK.
    fn awaits_response(&self) -> bool {
        psn::diff(self.req.psn, self.comp.psn) > 0
            && self.comp.rnr_deadline.is_none()
            && matches!(self.attr.state, QpState::Rts | QpState::Sqd)
    }

    /// The earliest timer of this QP.
    pub(crate) fn next_deadline(&self) -> Option<Nanos> {
        [
            self.comp.retrans_deadline,
            self.comp.probe_deadline,
            self.comp.rnr_deadline,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Runs the timers that are due at `now`.
    pub(crate) fn handle_timeout(&mut self, now: Nanos, sh: &mut Shared) {
        if let Some(t) = self.comp.rnr_deadline {
            if t <= now {
                // The RNR wait is over: go back N from the NAKed PSN. The sequence NAK the
                // packets behind the RNR-NAKed one drew may arrive only now (a long message on
                // a slow link, a short RNR timer), and must not count as another retry (at
                // `retry_cnt` 0 it failed the WQE); a NAK for any later PSN still does.
                self.comp.rnr_deadline = None;
                self.req.need_retry = true;
                // Only while that NAK is still due: else a NAK at this PSN is a new loss.
                self.comp.rnr_echo =
                    std::mem::take(&mut self.comp.rnr_echo_due).then_some(self.comp.psn);
            }
        }
        if let Some(t) = self.comp.retrans_deadline {
            if t <= now {
                self.comp.retrans_deadline = None;
                if self.awaits_response() {
                    sh.counters.timeouts += 1;
                    self.start_retry(sh, Retry::Timeout);
                }
            }
        }
        if let Some(t) = self.comp.probe_deadline {
            if t <= now {
                self.comp.probe_deadline = None;
                // Not while a go-back-N or an RNR wait is under way: those resend anyway.
                if !self.req.need_retry && self.awaits_response() {
                    // The requester sends it (and counts it) with its next packets. The
                    // packet being timed may go again, so its ACK would not time it: the
                    // doubled delay stays until a packet is timed (see `probes`).
                    self.comp.probes = self.comp.probes.saturating_add(1);
                    self.req.rtt_sample = None;
                    self.req.probe = true;
                }
            }
        }
    }
}
