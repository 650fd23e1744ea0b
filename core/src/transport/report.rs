//! A readable account of what every QP and CQ is doing right now, for a person looking at a
//! program that stopped making progress: which side waits for what (an unacknowledged PSN, a
//! receive WQE, a timer that never comes) is what tells a stall apart from a lost packet.

use std::fmt::Write;

use super::qp::Qp;
use super::verbs::SendOp;
use super::Nanos;

/// How a deadline relates to `now`, in milliseconds (negative: overdue).
fn deadline(d: Option<Nanos>, now: Nanos) -> String {
    match d {
        None => "-".into(),
        Some(t) if t >= now => format!("+{:.1}ms", (t - now) as f64 / 1e6),
        Some(t) => format!("-{:.1}ms", (now - t) as f64 / 1e6),
    }
}

fn op_name(op: &SendOp) -> &'static str {
    match op {
        SendOp::Send => "SEND",
        SendOp::SendWithImm { .. } => "SEND_IMM",
        SendOp::RdmaWrite { .. } => "WRITE",
        SendOp::RdmaWriteWithImm { .. } => "WRITE_IMM",
        SendOp::RdmaRead { .. } => "READ",
        SendOp::CompareSwap { .. } => "CMP_SWAP",
        SendOp::FetchAdd { .. } => "FETCH_ADD",
    }
}

impl Qp {
    /// One line about this QP: state, the send side (queued WQEs, next PSN, oldest unacked PSN,
    /// retries left, timers), the receive side (posted WQEs, expected PSN, MSN, a sequence NAK
    /// outstanding, responses queued).
    pub(crate) fn report_line(&self, now: Nanos) -> String {
        let mut s = String::new();
        let _ = write!(
            s,
            "qp {:#x} {:?} {:?} -> {:#x} mtu {} | sq {} (sending #{} +{}B) psn {:#08x} unacked {:#08x} \
             window {} retry {}/{} rnr {}/{}{} retrans {} probe {} ack_time {} rnr_wait {}",
            self.qpn,
            self.ty,
            self.attr.state,
            self.attr.dest_qpn,
            self.attr.path_mtu.bytes(),
            self.sq.len(),
            self.req.wqe_index,
            self.req.offset,
            self.req.psn,
            self.comp.psn,
            self.req.window.size(),
            self.comp.retry_cnt,
            self.attr.retry_cnt,
            self.comp.rnr_retry,
            self.attr.rnr_retry,
            if self.req.need_retry { " go-back-N" } else { "" },
            deadline(self.comp.retrans_deadline, now),
            deadline(self.comp.probe_deadline, now),
            self.comp
                .rtt
                .smoothed()
                .map_or_else(|| "-".into(), |t| format!("{:.1}ms", t as f64 / 1e6)),
            deadline(self.comp.rnr_deadline, now),
        );
        if let Some(w) = self.sq.front() {
            let _ = write!(
                s,
                " head {} {}B psn {:#08x}..{:#08x} {:?}",
                op_name(&w.wr.op),
                w.length,
                w.first_psn,
                w.last_psn,
                w.state
            );
        }
        let _ = write!(
            s,
            " | rq {}{} expect {:#08x} msn {}{}{} out {}",
            self.rq.len(),
            if self.srq.is_some() { " (srq)" } else { "" },
            self.resp.psn,
            self.resp.msn,
            if self.resp.recv.is_some() {
                " mid-message"
            } else {
                ""
            },
            if self.resp.sent_psn_nak() {
                " seq-NAK sent"
            } else {
                ""
            },
            self.resp.out.len(),
        );
        s
    }
}
