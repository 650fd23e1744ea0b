//! A queue pair: its attributes, queues and the state its requester, completer and responder
//! share. The three protocol engines are in `requester.rs`, `completer.rs` and `responder.rs`.

use std::collections::VecDeque;

use super::address::{udp_sport_for_flow, udp_sport_for_qpn, AddressVector};
use super::cq::CqId;
use super::device::Shared;
use super::memory::{Access, PdId};
use super::qp_state::{
    check_transition, rd_atomic_slots, AttrMask, ModifyError, PathMtu, QpState, QpType,
    MAX_QP_RD_ATOM, MAX_TIMEOUT,
};
use super::responder::Responder;
use super::round_trip::RoundTrip;
use super::send_window::SendWindow;
use super::srq::SrqId;
use super::verbs::{
    AsyncEvent, RecvWr, SendWr, VerbsError, WcFlags, WcOpcode, WcStatus, WorkCompletion,
};
use super::{psn, Nanos};
use crate::wire::{
    ipv4, BthRepr, FrameWriter, IpAddress, IpRepr, Ipv4Repr, Ipv6Repr, Opcode, PathHeaders,
    TransportRepr, UdpRepr, ROCEV2_UDP_PORT,
};

/// Queue sizes asked for at creation (`struct ibv_qp_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

impl Default for QpCap {
    fn default() -> Self {
        QpCap {
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 64,
        }
    }
}

/// What `create_qp` needs (`struct ibv_qp_init_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpInit {
    pub ty: QpType,
    pub pd: PdId,
    pub send_cq: CqId,
    pub recv_cq: CqId,
    pub srq: Option<SrqId>,
    pub cap: QpCap,
    /// Every send WR completes with a work completion, whatever its SIGNALED flag.
    pub sq_sig_all: bool,
}

/// QP attributes (`struct ibv_qp_attr`, the fields RoCE uses). `modify_qp` reads the fields its
/// mask names; `query_qp` fills all of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpAttr {
    pub state: QpState,
    pub cur_state: QpState,
    pub path_mtu: PathMtu,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qpn: u32,
    pub access: Access,
    pub pkey_index: u16,
    pub port_num: u8,
    pub av: Option<AddressVector>,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub min_rnr_timer: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub en_sqd_async_notify: bool,
    /// `ibv_mig_state`, kept and reported as rdma_rxe keeps it: RoCE has no alternate path
    /// to migrate to, so it changes nothing else.
    pub path_mig_state: u8,
    pub cap: QpCap,
}

impl Default for QpAttr {
    fn default() -> Self {
        QpAttr {
            state: QpState::Reset,
            cur_state: QpState::Reset,
            // rdma_rxe's value before IBV_QP_PATH_MTU is set.
            path_mtu: PathMtu::Mtu256,
            qkey: 0,
            rq_psn: 0,
            sq_psn: 0,
            dest_qpn: 0,
            access: Access::NONE,
            pkey_index: 0,
            port_num: 1,
            av: None,
            timeout: 0,
            retry_cnt: 0,
            rnr_retry: 0,
            min_rnr_timer: 0,
            max_rd_atomic: 0,
            max_dest_rd_atomic: 0,
            en_sqd_async_notify: false,
            path_mig_state: 0, // IBV_MIG_MIGRATED
            cap: QpCap::default(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WqeState {
    /// Not started by the requester.
    Posted,
    /// Started: PSNs assigned, packets (partly) sent, waiting for the completer.
    Pending,
    /// Finished locally (UC/UD after transmission, oversized UD): complete when at the head.
    Done,
    /// Failed locally; completes with this status and moves the QP to error.
    Error(WcStatus),
}

/// Inline payload of a send WQE: up to 64 bytes (the default `max_inline_data`, and what a
/// latency test sends) are held in the WQE; a heap allocation and free per post cost a 64 B
/// `ib_send_lat` turn about 160 instructions.
pub(crate) type InlineData = smallvec::SmallVec<[u8; 64]>;

/// A send work queue element.
#[derive(Debug)]
pub(crate) struct SendWqe {
    pub wr: SendWr,
    /// Inline payload, copied from the application at post time.
    pub inline: Option<InlineData>,
    pub length: u64,
    pub state: WqeState,
    pub first_psn: u32,
    pub last_psn: u32,
    /// Holds one of the requester's READ/atomic slots.
    pub has_rd_atomic: bool,
    /// READ: bytes of response placed so far (the completer's cursor).
    pub read_received: u64,
    /// UD: the destination, resolved from the AH at post time.
    pub ud_av: Option<AddressVector>,
    /// The memory table's generation when the scatter/gather list last passed its local
    /// checks (0: never). The requester checks a WQE when it looks ahead at it from the end of
    /// the message before and again when it starts it; while no region went away in between,
    /// the second check is this comparison, and so are the region checks of every packet's
    /// gather.
    pub checked_in: u64,
}

/// Requester state (`qp->req` in rxe).
#[derive(Debug, Default)]
pub(crate) struct Requester {
    /// Next PSN to send.
    pub psn: u32,
    /// Index in the SQ (from the head) of the WQE being sent.
    pub wqe_index: usize,
    /// Bytes of that WQE already sent in this pass.
    pub offset: u64,
    pub noack_pkts: u32,
    /// Messages ended without AckReq since the last packet that asked for an ACK.
    pub noack_msgs: u32,
    /// When the first packet without AckReq since the last one that asked went out.
    pub noack_since: Option<Nanos>,
    pub rd_atomic_avail: u32,
    pub rd_atomic_max: u32,
    /// The completer asked for a go-back-N from `comp.psn`.
    pub need_retry: bool,
    /// The completer's tail-loss probe is due: the next packets built are the oldest
    /// unacknowledged one and the newest one sent, again (see `Qp::build_probe`).
    pub probe: bool,
    /// The probe's second packet, the newest one sent, is still to go.
    pub probe_newest: bool,
    /// The PSN of the packet built last that asked for an ACK (a probe's packets included):
    /// while it is unacknowledged, the QP waits for an answer, and the probe's delay runs.
    pub asked_ack_psn: Option<u32>,
    /// The packet being built asks for an ACK whatever the AckReq policy says: it is a probe.
    pub force_ack_req: bool,
    /// The PSN after the last one any started WQE was given (where the next WQE starts; a
    /// go-back-N moves `psn` back, not this): a response for this PSN or a later one answers
    /// nothing this QP sent.
    pub psn_end: u32,
    /// How many PSNs may be outstanding (RC): halved by a go-back-N, grown back by ACKs.
    pub window: SendWindow,
    /// The packet being timed to its ACK (its PSN, and when it went), for `Completer::rtt`:
    /// one at a time, and none resent.
    pub rtt_sample: Option<(u32, Nanos)>,
    /// The newest PSN built so far: a packet beyond it goes for the first time, and only
    /// such a packet is timed (Karn's rule: a resent one's ACK could answer either copy).
    pub newest_built: Option<u32>,
}

/// Completer state (`qp->comp` in rxe).
#[derive(Debug, Default)]
pub(crate) struct Completer {
    /// Oldest PSN not yet acknowledged.
    pub psn: u32,
    /// Opcode of the last READ response in a multi-packet response, `None` between messages.
    pub opcode: Option<Opcode>,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub started_retry: bool,
    pub retrans_deadline: Option<Nanos>,
    /// When a tail-loss probe goes unless something is sent or heard first
    /// ([`tail_probe_ns`](super::qp_state::tail_probe_ns)).
    pub probe_deadline: Option<Nanos>,
    /// Probes sent since a packet was last timed to its ACK: each waits twice as long as the
    /// one before, up to a quarter of the retransmission timeout (see
    /// [`probe_delay_ns`](super::qp_state::probe_delay_ns)).
    pub probes: u32,
    /// How long ACKs take (RC), which sets the probe's delay.
    pub rtt: RoundTrip,
    pub rnr_deadline: Option<Nanos>,
    /// The PSN an RNR wait that ended resent from: the sequence NAK the packets behind the
    /// RNR-NAKed one drew may still arrive, carrying it, and is no new loss.
    pub rnr_echo: Option<u32>,
    /// During an RNR wait: packets behind the RNR-NAKed one were sent, and the sequence NAK
    /// they draw has not arrived yet (so it may arrive after the wait: see `rnr_echo`).
    pub rnr_echo_due: bool,
}

/// A queue pair.
#[derive(Debug)]
pub struct Qp {
    pub(crate) qpn: u32,
    pub(crate) ty: QpType,
    pub(crate) pd: PdId,
    pub(crate) send_cq: CqId,
    pub(crate) recv_cq: CqId,
    pub(crate) srq: Option<SrqId>,
    pub(crate) sq_sig_all: bool,
    pub(crate) attr: QpAttr,
    pub(crate) udp_sport: u16,
    pub(crate) sq: VecDeque<SendWqe>,
    pub(crate) rq: VecDeque<RecvWr>,
    pub(crate) req: Requester,
    pub(crate) comp: Completer,
    pub(crate) resp: Responder,
    /// SQD: the SQ-drained event is still to be raised.
    pub(crate) drain_notify: bool,
    /// On the device's ready list.
    pub(crate) queued: bool,
    /// The time of this QP's live entry in the device's timers (see `qp_timers`): no later
    /// than its earliest timer while it has one.
    pub(crate) timer_entry: Option<Nanos>,
    /// A request goes ahead of a response when the QP has both: at the start of a turn, and
    /// after a request until the turn ends (see `Device::poll_transmit`).
    pub(crate) request_turn: bool,
    /// The IP and UDP headers of the last packet's path (see [`Qp::path_headers`]).
    pub(crate) path: Option<PathHeaders>,
}

/// The TTL/hop limit xroce sends: rdma_rxe sends the route's default (64) whatever the AV asks.
pub const DEFAULT_TTL: u8 = 64;

impl Qp {
    /// Whether a packet from `src` to `dst` comes from this connected QP's peer, to the local
    /// address its path was given (`gids` is the device's GID table).
    pub(crate) fn hears_from(
        &self,
        gids: &[Option<IpAddress>],
        src: IpAddress,
        dst: IpAddress,
    ) -> bool {
        self.attr.av.is_some_and(|av| {
            av.dgid == src && gids.get(usize::from(av.sgid_index)).copied().flatten() == Some(dst)
        })
    }

    pub(crate) fn new(qpn: u32, init: &QpInit) -> Self {
        Qp {
            qpn,
            ty: init.ty,
            pd: init.pd,
            send_cq: init.send_cq,
            recv_cq: init.recv_cq,
            srq: init.srq,
            sq_sig_all: init.sq_sig_all,
            attr: QpAttr {
                cap: init.cap,
                ..QpAttr::default()
            },
            udp_sport: udp_sport_for_qpn(qpn),
            sq: VecDeque::new(),
            rq: VecDeque::new(),
            req: Requester::default(),
            comp: Completer::default(),
            resp: Responder::default(),
            drain_notify: false,
            path: None,
            queued: false,
            timer_entry: None,
            request_turn: true,
        }
    }

    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    pub fn qp_type(&self) -> QpType {
        self.ty
    }

    pub fn state(&self) -> QpState {
        self.attr.state
    }

    /// The attributes as `ibv_query_qp` reports them.
    pub fn attr(&self) -> QpAttr {
        QpAttr {
            cur_state: self.attr.state,
            sq_psn: self.req.psn,
            rq_psn: self.resp.psn,
            ..self.attr
        }
    }

    /// Path MTU in bytes for segmentation and length checks: the QP's for RC/UC, the port's
    /// for UD.
    pub(crate) fn mtu(&self, sh: &Shared) -> usize {
        match self.ty {
            QpType::Ud => sh.port_mtu.bytes(),
            _ => self.attr.path_mtu.bytes(),
        }
    }

    /// Whether `ibv_modify_qp` with these attributes would be accepted (what [`Self::modify`]
    /// checks before it changes anything).
    pub(crate) fn check_modify(
        &self,
        sh: &Shared,
        attr: &QpAttr,
        mask: AttrMask,
    ) -> Result<(), VerbsError> {
        let cur = self.attr.state;
        let next = if mask.contains(AttrMask::STATE) {
            attr.state
        } else {
            cur
        };
        if mask.contains(AttrMask::CUR_STATE) && attr.cur_state != cur {
            return Err(ModifyError::CurrentStateMismatch {
                given: attr.cur_state,
                actual: cur,
            }
            .into());
        }
        check_transition(cur, next, self.ty, mask)?;
        self.check_attr_values(sh, attr, mask)?;
        // While draining, no transition but to ERROR (rdma_rxe's rule), and no new initiator
        // depth: the READs and atomics in flight were counted against the old one, and a lower
        // `max_rd_atomic` then let more start than it allows. Other attributes may change.
        let transition_or_depth =
            mask.contains(AttrMask::STATE) || mask.contains(AttrMask::MAX_QP_RD_ATOMIC);
        if cur == QpState::Sqd && next != QpState::Error && self.draining() && transition_or_depth {
            return Err(ModifyError::InvalidAttribute("the send queue is still draining").into());
        }
        Ok(())
    }

    /// Applies `ibv_modify_qp`. Validation happens before anything changes, so a refused
    /// modify leaves the QP as it was.
    pub(crate) fn modify(
        &mut self,
        sh: &mut Shared,
        attr: &QpAttr,
        mask: AttrMask,
    ) -> Result<(), VerbsError> {
        self.check_modify(sh, attr, mask)?;
        let cur = self.attr.state;
        let next = if mask.contains(AttrMask::STATE) {
            attr.state
        } else {
            cur
        };

        let m = |b: AttrMask| mask.contains(b);
        if m(AttrMask::PATH_MTU) {
            self.attr.path_mtu = attr.path_mtu;
        }
        if m(AttrMask::QKEY) {
            self.attr.qkey = attr.qkey;
        }
        if m(AttrMask::ACCESS_FLAGS) {
            self.attr.access = attr.access;
        }
        if m(AttrMask::PKEY_INDEX) {
            self.attr.pkey_index = attr.pkey_index;
        }
        if m(AttrMask::PORT) {
            self.attr.port_num = attr.port_num;
        }
        if m(AttrMask::DEST_QPN) {
            self.attr.dest_qpn = attr.dest_qpn;
        }
        if m(AttrMask::AV) {
            self.attr.av = attr.av;
        }
        if m(AttrMask::AV) || m(AttrMask::DEST_QPN) {
            if let Some(av) = self.attr.av {
                self.udp_sport = udp_sport_for_flow(av.flow_label, self.qpn, self.attr.dest_qpn);
            }
        }
        if m(AttrMask::TIMEOUT) {
            self.attr.timeout = attr.timeout;
        }
        if m(AttrMask::RETRY_CNT) {
            self.attr.retry_cnt = attr.retry_cnt;
            self.comp.retry_cnt = attr.retry_cnt;
        }
        if m(AttrMask::RNR_RETRY) {
            self.attr.rnr_retry = attr.rnr_retry;
            self.comp.rnr_retry = attr.rnr_retry;
        }
        if m(AttrMask::MIN_RNR_TIMER) {
            self.attr.min_rnr_timer = attr.min_rnr_timer;
        }
        if m(AttrMask::MAX_QP_RD_ATOMIC) {
            self.attr.max_rd_atomic = attr.max_rd_atomic;
            let slots = rd_atomic_slots(attr.max_rd_atomic);
            let in_use = self.req.rd_atomic_max - self.req.rd_atomic_avail;
            self.req.rd_atomic_max = slots;
            self.req.rd_atomic_avail = slots.saturating_sub(in_use);
        }
        if m(AttrMask::MAX_DEST_RD_ATOMIC) {
            self.attr.max_dest_rd_atomic = attr.max_dest_rd_atomic;
            self.resp
                .resize_resources(rd_atomic_slots(attr.max_dest_rd_atomic) as usize);
        }
        if m(AttrMask::RQ_PSN) {
            self.attr.rq_psn = attr.rq_psn & psn::MASK;
            self.resp.psn = self.attr.rq_psn;
            self.resp.ack_psn = self.attr.rq_psn;
        }
        if m(AttrMask::SQ_PSN) {
            self.attr.sq_psn = attr.sq_psn & psn::MASK;
            self.req.psn = self.attr.sq_psn;
            self.req.psn_end = self.attr.sq_psn;
            self.comp.psn = self.attr.sq_psn;
        }
        if m(AttrMask::EN_SQD_ASYNC_NOTIFY) {
            self.attr.en_sqd_async_notify = attr.en_sqd_async_notify;
        }
        if m(AttrMask::PATH_MIG_STATE) {
            self.attr.path_mig_state = attr.path_mig_state;
        }

        if m(AttrMask::STATE) && next != cur {
            match next {
                QpState::Reset => self.reset(),
                QpState::Error => {
                    self.attr.state = QpState::Error;
                    self.flush(sh, None);
                }
                QpState::Sqd => {
                    self.attr.state = QpState::Sqd;
                    let between_messages = self
                        .sq
                        .get(self.req.wqe_index)
                        .is_none_or(|w| w.state == WqeState::Posted);
                    if cur == QpState::Rts && self.req.noack_msgs > 0 && between_messages {
                        // The last message sent left the AckReq to the next one, which SQD
                        // now holds back: nothing would acknowledge it but the retransmission
                        // timer (never, at `timeout` 0), and the drain would wait for it. Its
                        // last packet goes again, asking (a duplicate, which the responder
                        // acknowledges with everything before it; no retry is used).
                        self.resend_last_packet(sh);
                    }
                    self.drain_notify = true;
                    self.check_drained(sh);
                }
                s => self.attr.state = s,
            }
        }
        Ok(())
    }

    /// The value checks rdma_rxe adds to the core's mask checks (`rxe_qp_chk_attr()`).
    fn check_attr_values(
        &self,
        sh: &Shared,
        attr: &QpAttr,
        mask: AttrMask,
    ) -> Result<(), ModifyError> {
        let m = |b: AttrMask| mask.contains(b);
        let bad = ModifyError::InvalidAttribute;
        if m(AttrMask::PORT) && attr.port_num != 1 {
            return Err(bad("port_num must be 1"));
        }
        if m(AttrMask::ACCESS_FLAGS) && attr.access.0 & !Access::SUPPORTED.0 != 0 {
            return Err(bad("unsupported access flags"));
        }
        if m(AttrMask::PKEY_INDEX) && attr.pkey_index != 0 {
            return Err(bad("pkey_index must be 0 (one P_Key, 0xFFFF)"));
        }
        if m(AttrMask::AV) {
            let Some(av) = attr.av else {
                return Err(bad("AV mask set without an address vector"));
            };
            let Some(sgid) = sh.gid(av.sgid_index) else {
                return Err(bad("sgid_index names no GID"));
            };
            if matches!(sgid, IpAddress::V4(_)) != matches!(av.dgid, IpAddress::V4(_)) {
                return Err(bad(
                    "source and destination GIDs are of different IP versions",
                ));
            }
        }
        if m(AttrMask::DEST_QPN) && attr.dest_qpn > psn::MASK {
            return Err(bad("dest_qp_num above 24 bits"));
        }
        if m(AttrMask::TIMEOUT) && attr.timeout > MAX_TIMEOUT {
            return Err(bad("timeout above 31"));
        }
        if m(AttrMask::RETRY_CNT) && attr.retry_cnt > 7 {
            return Err(bad("retry_cnt above 7"));
        }
        if m(AttrMask::RNR_RETRY) && attr.rnr_retry > 7 {
            return Err(bad("rnr_retry above 7"));
        }
        if m(AttrMask::MIN_RNR_TIMER) && attr.min_rnr_timer > 31 {
            return Err(bad("min_rnr_timer above 31"));
        }
        if m(AttrMask::MAX_QP_RD_ATOMIC) && attr.max_rd_atomic > MAX_QP_RD_ATOM {
            return Err(bad("max_rd_atomic above 128"));
        }
        if m(AttrMask::MAX_DEST_RD_ATOMIC) && attr.max_dest_rd_atomic > MAX_QP_RD_ATOM {
            return Err(bad("max_dest_rd_atomic above 128"));
        }
        Ok(())
    }

    /// Entering RESET: queues emptied without completions, every counter back to its initial
    /// value (`rxe_qp_reset()`).
    fn reset(&mut self) {
        let keep = QpAttr {
            cap: self.attr.cap,
            ..QpAttr::default()
        };
        self.attr = keep;
        self.sq.clear();
        self.rq.clear();
        self.req = Requester::default();
        self.comp = Completer::default();
        self.resp = Responder::default();
        self.udp_sport = udp_sport_for_qpn(self.qpn);
        self.drain_notify = false;
    }

    /// True while SQD still has WQEs in flight.
    fn draining(&self) -> bool {
        self.attr.state == QpState::Sqd
            && self.sq.iter().any(|w| !matches!(w.state, WqeState::Posted))
    }

    /// Raises SQ-drained once everything started before SQD has completed.
    pub(crate) fn check_drained(&mut self, sh: &mut Shared) {
        if self.drain_notify && !self.draining() {
            self.drain_notify = false;
            if self.attr.en_sqd_async_notify {
                sh.events
                    .push_back(super::Event::Async(AsyncEvent::SqDrained(self.qpn)));
            }
        }
    }

    /// Moves the QP to ERROR after a failure and flushes its queues.
    pub(crate) fn enter_error(&mut self, sh: &mut Shared) {
        self.enter_error_owing(sh, None);
    }

    /// As [`Self::enter_error`]; after a request at PSN `failed` failed, the responses owed
    /// for the requests before it stay queued (see `Responder::keep_owed_before`).
    pub(crate) fn enter_error_owing(&mut self, sh: &mut Shared, failed: Option<u32>) {
        if self.attr.state == QpState::Error {
            // A response owed before an earlier failure failed itself (its region went away
            // while it was being sent): its NAK is the one the requester must see next; the
            // earlier failure's NAK and whatever else came after it in PSN order are moot.
            if let Some(p) = failed {
                self.resp.keep_owed_before(p);
            }
            return;
        }
        self.attr.state = QpState::Error;
        log::debug!(
            "QP {:#x}: in the error state; its work requests are flushed",
            self.qpn
        );
        self.flush(sh, failed);
    }

    /// Completes every queued WQE with WR_FLUSH_ERR (send completions regardless of
    /// signalling) and stops the timers. A responder's final NAK stays queued so that it still
    /// reaches the peer, behind what was owed before the request it reports (`failed`).
    fn flush(&mut self, sh: &mut Shared, failed: Option<u32>) {
        while let Some(wqe) = self.sq.pop_front() {
            let wc = self.send_wc(&wqe, WcStatus::WrFlushErr);
            sh.complete_quiet(self.send_cq, wc);
        }
        self.req.wqe_index = 0;
        self.req.offset = 0;
        self.req.need_retry = false;
        self.req.probe = false;
        self.req.probe_newest = false;
        self.req.rd_atomic_avail = self.req.rd_atomic_max;
        self.comp.retrans_deadline = None;
        self.comp.probe_deadline = None;
        self.comp.rnr_deadline = None;
        if let Some(inb) = self.resp.recv.take() {
            let wc = self.recv_flush_wc(inb.wqe.wr_id);
            sh.complete_quiet(self.recv_cq, wc);
        }
        while let Some(wr) = self.rq.pop_front() {
            let wc = self.recv_flush_wc(wr.wr_id);
            sh.complete_quiet(self.recv_cq, wc);
        }
        match failed {
            Some(p) => self.resp.keep_owed_before(p),
            None => self.resp.drop_pending_except_nak(),
        }
        if self.srq.is_some() {
            sh.events
                .push_back(super::Event::Async(AsyncEvent::QpLastWqeReached(self.qpn)));
        }
    }

    fn recv_flush_wc(&self, wr_id: u64) -> WorkCompletion {
        WorkCompletion {
            wr_id,
            status: WcStatus::WrFlushErr,
            opcode: WcOpcode::Recv,
            byte_len: 0,
            imm: 0,
            qp_num: self.qpn,
            src_qp: 0,
            flags: WcFlags::default(),
            solicited: false,
        }
    }

    pub(crate) fn send_wc(&self, wqe: &SendWqe, status: WcStatus) -> WorkCompletion {
        WorkCompletion {
            wr_id: wqe.wr.wr_id,
            status,
            opcode: wqe.wr.op.wc_opcode(),
            byte_len: wqe.length as u32,
            imm: 0,
            qp_num: self.qpn,
            src_qp: 0,
            flags: if wqe.wr.op.immediate().is_some() {
                WcFlags::WITH_IMM
            } else {
                WcFlags::default()
            },
            solicited: false,
        }
    }

    /// Retires the SQ head with `status`: a completion if signalled or failed, the READ/atomic
    /// slot returned, and on failure the QP to ERROR. A successful completion the send CQ has
    /// no room for is lost and the QP goes on, as in rdma_rxe, whose completer ignores the
    /// failed post (the CQ reports the overrun as `IBV_EVENT_CQ_ERR`): a program that lets a
    /// small send CQ fill up runs on there, and must here too.
    pub(crate) fn retire_head(&mut self, sh: &mut Shared, status: WcStatus) {
        // What is needed of the WQE is read where it lies; moving the whole of it out of the
        // queue (256 bytes) was a tenth of this function's cost, once per message.
        let Some(wqe) = self.sq.front() else {
            return;
        };
        let has_rd_atomic = wqe.has_rd_atomic;
        let signalled = self.sq_sig_all
            || wqe.wr.flags.contains(super::SendFlags::SIGNALED)
            || status != WcStatus::Success;
        let wc = signalled.then(|| self.send_wc(wqe, status));
        self.sq.pop_front();
        if self.req.wqe_index > 0 {
            self.req.wqe_index -= 1;
        } else {
            // The WQE the requester was still (re)sending is acknowledged whole: an ACK that
            // was late arrived during a go-back-N resend. Carry on where the acknowledgements
            // left off; staying at the old PSN would start the next message at a PSN inside
            // this one, which the responder rejects as out of sequence.
            self.resume_from_comp_psn(sh);
        }
        if has_rd_atomic {
            self.req.rd_atomic_avail = (self.req.rd_atomic_avail + 1).min(self.req.rd_atomic_max);
        }
        if let Some(wc) = wc {
            sh.complete(self.send_cq, wc);
        }
        if status != WcStatus::Success {
            // The send side failed, not the receive side: what the responder owes for the
            // requests it took still goes out (rdma_rxe had sent it already).
            let taken = self.resp.psn;
            self.enter_error_owing(sh, Some(taken));
        } else {
            self.check_drained(sh);
        }
    }

    /// Completes head WQEs that finished locally (UC/UD sends, local errors).
    pub(crate) fn retire_local(&mut self, sh: &mut Shared) {
        while let Some(w) = self.sq.front() {
            match w.state {
                WqeState::Done => self.retire_head(sh, WcStatus::Success),
                WqeState::Error(s) => self.retire_head(sh, s),
                _ => break,
            }
        }
    }

    /// Whether the next `next_request` and `next_response` surely both return `None`: no
    /// response queued, no WQE at or after the one being sent, no go-back-N asked for, and no
    /// finished WQE at the head for `next_request` to retire. Conservative: `false` only
    /// says they may have something.
    pub(crate) fn has_nothing_to_send(&self) -> bool {
        self.resp.out.is_empty()
            && self.sq.len() <= self.req.wqe_index
            && !self.req.need_retry
            && !self.req.probe
            && !self.req.probe_newest
            && self
                .sq
                .front()
                .is_none_or(|w| !matches!(w.state, WqeState::Done | WqeState::Error(_)))
    }

    /// One message in the send queue, sent whole and not yet acknowledged: the application
    /// waits for that ACK (or goes on without it).
    pub(crate) fn awaits_ack_of_its_only_message(&self) -> bool {
        self.ty == QpType::Rc
            && self.sq.len() == 1
            && self.req.wqe_index == 1
            && self.req.psn != self.comp.psn
    }

    /// The IP and UDP headers for a packet to `av`, built when the path differs from the last
    /// packet's (the first packet, a new address vector, a UD destination that changed, or a
    /// source GID whose address changed) and reused otherwise. `None` when the source GID is
    /// gone or its family differs from the destination's.
    pub(crate) fn path_headers(&mut self, sh: &Shared, av: &AddressVector) -> Option<&PathHeaders> {
        let src = sh.gid(av.sgid_index)?;
        let fresh = self.path.as_ref().is_some_and(|p| {
            p.src_addr() == src
                && p.dst_addr() == av.dgid
                && p.udp_src_port() == self.udp_sport
                && p.ip().traffic_class() == av.traffic_class
        });
        if !fresh {
            let ip = match (src, av.dgid) {
                (IpAddress::V4(s), IpAddress::V4(d)) => IpRepr::V4(Ipv4Repr {
                    src: s,
                    dst: d,
                    tos: av.traffic_class,
                    ident: 0,
                    dont_frag: true,
                    ttl: DEFAULT_TTL,
                    protocol: ipv4::PROTOCOL_UDP,
                    payload_len: 0,
                }),
                (IpAddress::V6(s), IpAddress::V6(d)) => IpRepr::V6(Ipv6Repr {
                    src: s,
                    dst: d,
                    traffic_class: av.traffic_class,
                    flow_label: 0,
                    next_header: ipv4::PROTOCOL_UDP,
                    hop_limit: DEFAULT_TTL,
                    payload_len: 0,
                }),
                _ => return None,
            };
            let udp = UdpRepr {
                src_port: self.udp_sport,
                dst_port: ROCEV2_UDP_PORT,
                payload_len: 0,
            };
            self.path = Some(PathHeaders::new(&ip, &udp).ok()?);
        }
        self.path.as_ref()
    }

    /// Starts a packet to `av` in `buf`: the path's IP and UDP headers, with the device's next
    /// IPv4 identification, then `t`'s transport headers. Also gives the packet's source and
    /// destination addresses. `None` when there is no path (see [`Self::path_headers`]) or the
    /// packet does not fit. Always inlined into its two callers: `#[inline]` alone left it
    /// out of line, where returning the writer and both addresses cost 38 instructions per
    /// packet sent (callgrind, `ib_send_bw -s 64` sender).
    #[inline(always)]
    pub(crate) fn start_packet<'b>(
        &mut self,
        sh: &mut Shared,
        av: &AddressVector,
        buf: &'b mut [u8],
        t: &TransportRepr,
        payload_len: usize,
    ) -> Option<(FrameWriter<'b>, IpAddress, IpAddress)> {
        let path = self.path_headers(sh, av)?;
        let ident = sh.next_ip_ident_for(path);
        let writer = FrameWriter::on_path(buf, path, ident, t, payload_len).ok()?;
        Some((writer, path.src_addr(), path.dst_addr()))
    }

    pub(crate) fn bth(&self, opcode: Opcode, dest_qpn: u32, psn: u32) -> BthRepr {
        BthRepr::new(opcode, dest_qpn, psn)
    }
}
