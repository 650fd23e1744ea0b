//! The device: every object of one RDMA device (PDs, MRs, CQs, SRQs, AHs, QPs) and the
//! sans-IO interface the engine drives.
//!
//! The device never reads a clock, sleeps or touches a socket. The caller passes `now` (any
//! monotonic nanosecond count) and:
//! * hands received IP packets to [`Device::handle_packet`];
//! * calls [`Device::poll_transmit`] until it returns `None`, sending each packet;
//! * calls [`Device::handle_timeout`] when [`Device::poll_timeout`] says a timer is due;
//! * drains [`Device::poll_event`] for completion-channel and asynchronous events.

use std::collections::VecDeque;

use rustc_hash::FxHashMap as HashMap;

use super::handle_ids;

use super::address::{AddressVector, AhId};
use super::cq::{CompletionQueue, CqId, Pushed};
use super::host_memory::HostMemory;
use super::memory::{Access, MemoryRegion, MemoryTable, MrId, PdId};
use super::qp::{InlineData, Qp, QpAttr, QpInit, SendWqe, WqeState};
use super::qp_state::{AttrMask, PathMtu, QpState, QpType};
use super::qp_timers::QpTimers;
use super::requester::MAX_MSG_SIZE;
use super::srq::{SharedReceiveQueue, SrqId};
use super::verbs::{
    AsyncEvent, Event, RecvWr, SendFlags, SendOp, SendWr, VerbsError, WcFlags, WcOpcode, WcStatus,
    WorkCompletion,
};
use super::Nanos;
use crate::wire::{
    IpAddress, IpRepr, Opcode, Operation, PathHeaders, RoceFrame, Transport, WireError,
};

/// Device limits, as rdma_rxe advertises them (digest §8) where they bind.
pub mod limits {
    pub const MAX_QP_WR: u32 = 1 << 20;
    pub const MAX_SGE: u32 = 32;
    pub const MAX_INLINE_DATA: u32 = 512;
    /// rdma_rxe stops at 32767 to bound kernel memory; a CQ here grows on demand, and
    /// perftest's `ib_write_bw -q 256` asks for 256 × 128 entries.
    pub const MAX_CQE: u32 = (1 << 20) - 1;
    pub const MAX_SRQ_WR: u32 = 1 << 20;
    pub const MAX_SRQ_SGE: u32 = 27;
    /// First QPN handed out (rdma_rxe's `RXE_MIN_QP_INDEX` + 1).
    pub const FIRST_QPN: u32 = 0x11;
}

/// How a device is set up.
#[derive(Debug, Clone)]
pub struct DeviceConfig {
    /// The GID table, as IP addresses (IPv4-mapped GIDs become IPv4). `None` marks an empty
    /// slot, so indices stay stable when an address goes away.
    pub gids: Vec<Option<IpAddress>>,
    /// The port's active MTU (from the netdev MTU, see [`PathMtu::for_netdev_mtu`]); UD uses it.
    pub port_mtu: PathMtu,
    /// Seeds the memory-key generator. The engine draws it from the OS; tests fix it.
    pub key_seed: [u8; 32],
    /// The first QPN handed out (then upwards, skipping the special QPs). rdma_rxe's QPNs keep
    /// counting across programs; an xroce device lives as long as its process, so the engine
    /// starts each one at a random QPN: a program run again does not reuse the QP numbers its
    /// previous run's peer may still have packets in flight for. Tests use
    /// [`limits::FIRST_QPN`]. Out-of-range values are taken as `FIRST_QPN`.
    pub first_qpn: u32,
}

/// Where a built packet goes. The packet in the caller's buffer starts with the IP header; the
/// caller adds the link layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transmit {
    pub len: usize,
    pub src: IpAddress,
    pub dst: IpAddress,
    /// The local QP that sent it.
    pub qpn: u32,
    /// The last packet of a signalled RC send WR with unsignalled WRs queued behind it: it
    /// asks for the ACK that brings the application's completion, which the application may
    /// wait for before it posts more.
    pub completes_signaled: bool,
}

/// What the device has seen and done, for `xroce` statistics and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub rx_packets: u64,
    pub tx_requests: u64,
    pub tx_responses: u64,
    pub malformed: u64,
    pub bad_icrc: u64,
    /// A bad IPv4 header checksum, or a bad UDP checksum (one that is not zero): a path that
    /// rewrites headers, not a RoCE stack's ICRC.
    pub bad_checksum: u64,
    pub not_local: u64,
    pub bad_pkey: u64,
    pub unknown_qp: u64,
    pub wrong_transport: u64,
    pub wrong_address: u64,
    pub cnp_received: u64,
    pub duplicates: u64,
    /// Responses (ACKs, NAKs, READ responses, atomic ACKs) for PSNs this QP never sent,
    /// ignored: left over from an earlier connection that used the same QP number.
    pub ghost_responses: u64,
    pub seq_naks_sent: u64,
    pub seq_naks_received: u64,
    pub rnr_naks_sent: u64,
    pub rnr_naks_received: u64,
    pub error_naks_sent: u64,
    /// NAKs for invalid requests, remote access and remote operational errors.
    pub error_naks_received: u64,
    pub retransmissions: u64,
    pub timeouts: u64,
    /// Tail-loss probes: the oldest and newest packets sent again after nothing was heard for
    /// the QP's probe delay (from its measured ACK time, at least 1 ms and at most a quarter
    /// of its retransmission timeout: see `round_trip`), or twice as long for each probe
    /// before it, up to that quarter (see `probe_delay_ns`).
    pub tail_probes: u64,
    /// Go-back-Ns that halved an RC QP's send window (see `send_window`).
    pub send_window_cuts: u64,
    pub retry_exceeded: u64,
    pub qkey_violations: u64,
    pub ud_no_receive: u64,
    pub ud_too_long: u64,
    /// Packets that did not fit the transmit buffer the port gave (a path MTU above what its
    /// frames carry: 4096 where AF_XDP has no multi-buffer). The request failed its work
    /// request with a local QP operation error; a READ response, the READ with a NAK.
    pub tx_too_big_for_buffer: u64,
    /// Requests whose QP's source GID (its AV's `sgid_index`) names no address of the
    /// interface any more (the address was removed), or one of the other IP family than the
    /// destination: the work request failed with a local QP operation error, as on rdma_rxe.
    pub tx_no_source_address: u64,
    pub uc_messages_dropped: u64,
    pub cq_overflows: u64,
    /// SENDs with invalidate, failed because nothing here can be invalidated (class J).
    pub invalidate_errors: u64,
    /// Work completions stored in CQs (the engine watches it to tell whether a batch of
    /// frames gave the application something to do).
    pub completions: u64,
}

impl Counters {
    /// Every counter with its name, in declaration order (for reports and statistics files).
    pub fn fields(&self) -> [(&'static str, u64); 34] {
        [
            ("rx_packets", self.rx_packets),
            ("tx_requests", self.tx_requests),
            ("tx_responses", self.tx_responses),
            ("malformed", self.malformed),
            ("bad_icrc", self.bad_icrc),
            ("bad_checksum", self.bad_checksum),
            ("not_local", self.not_local),
            ("bad_pkey", self.bad_pkey),
            ("unknown_qp", self.unknown_qp),
            ("wrong_transport", self.wrong_transport),
            ("wrong_address", self.wrong_address),
            ("cnp_received", self.cnp_received),
            ("duplicates", self.duplicates),
            ("ghost_responses", self.ghost_responses),
            ("seq_naks_sent", self.seq_naks_sent),
            ("seq_naks_received", self.seq_naks_received),
            ("rnr_naks_sent", self.rnr_naks_sent),
            ("rnr_naks_received", self.rnr_naks_received),
            ("error_naks_sent", self.error_naks_sent),
            ("error_naks_received", self.error_naks_received),
            ("retransmissions", self.retransmissions),
            ("timeouts", self.timeouts),
            ("tail_probes", self.tail_probes),
            ("send_window_cuts", self.send_window_cuts),
            ("retry_exceeded", self.retry_exceeded),
            ("qkey_violations", self.qkey_violations),
            ("ud_no_receive", self.ud_no_receive),
            ("ud_too_long", self.ud_too_long),
            ("tx_too_big_for_buffer", self.tx_too_big_for_buffer),
            ("tx_no_source_address", self.tx_no_source_address),
            ("uc_messages_dropped", self.uc_messages_dropped),
            ("cq_overflows", self.cq_overflows),
            ("invalidate_errors", self.invalidate_errors),
            ("completions", self.completions),
        ]
    }
}

/// Everything a QP touches besides itself.
pub(crate) struct Shared {
    pub mem: MemoryTable,
    pub cqs: HashMap<CqId, CompletionQueue>,
    pub srqs: HashMap<SrqId, SharedReceiveQueue>,
    pub ahs: HashMap<AhId, (PdId, AddressVector)>,
    pub events: VecDeque<Event>,
    pub gids: Vec<Option<IpAddress>>,
    pub port_mtu: PathMtu,
    pub counters: Counters,
    ip_ident: u16,
    /// CQs their application has armed at least once (see [`Device::completion_events_used`]).
    notifying_cqs: usize,
}

impl Shared {
    pub fn gid(&self, index: u8) -> Option<IpAddress> {
        self.gids.get(usize::from(index)).copied().flatten()
    }

    pub fn next_ip_ident(&mut self) -> u16 {
        self.ip_ident = self.ip_ident.wrapping_add(1);
        self.ip_ident
    }

    /// The IPv4 identification for the next packet on `path`: the device's next one for an
    /// IPv4 path, 0 (unused) for IPv6, which takes none from the sequence.
    pub(crate) fn next_ip_ident_for(&mut self, path: &PathHeaders) -> u16 {
        match path.ip() {
            IpRepr::V4(_) => self.next_ip_ident(),
            IpRepr::V6(_) => 0,
        }
    }

    /// Stores a completion; false when the CQ overflowed (the CQ-error event is raised for the
    /// first completion lost since one was last stored).
    pub fn complete(&mut self, cq: CqId, wc: WorkCompletion) -> bool {
        let Some(q) = self.cqs.get_mut(&cq) else {
            return false;
        };
        match q.push(wc) {
            Pushed::Stored { notify } => {
                self.counters.completions += 1;
                if notify {
                    self.events.push_back(Event::CqNotify(cq));
                }
                true
            }
            Pushed::Overflow { first } => {
                self.counters.cq_overflows += 1;
                if first {
                    self.events.push_back(Event::Async(AsyncEvent::CqError(cq)));
                }
                false
            }
        }
    }

    /// Like [`Self::complete`] where the QP is already going to ERROR anyway.
    pub fn complete_quiet(&mut self, cq: CqId, wc: WorkCompletion) {
        let _ = self.complete(cq, wc);
    }
}

/// Packets a QP sends in one turn of the round robin before the next ready QP goes.
///
/// One packet per turn interleaved every QP's messages: with many QPs the sender read each
/// application buffer one page at a time, a page from a different buffer every packet, and the
/// receiver wrote them the same way, so the caches and the hardware prefetcher never saw a
/// stream. Sixteen packets are a 64 KiB run of one buffer at path MTU 4096; a QP still waits at
/// most 16 packets of every other ready QP.
pub const TX_TURN_PACKETS: u32 = 16;

/// One RDMA device.
pub struct Device {
    qps: HashMap<u32, Qp>,
    /// QPs that may have something to send, in round-robin order.
    ready: VecDeque<u32>,
    /// Packets the QP at the head of `ready` has sent in its current turn (see
    /// [`TX_TURN_PACKETS`]).
    turn_sent: u32,
    /// The QPs' timers, earliest first (see `qp_timers`). Noted whenever a QP may have armed
    /// or moved a timer (everything that changes a QP marks it ready); a timer that moved
    /// later is found not due when its entry is reached.
    timers: QpTimers,
    sh: Shared,
    next_qpn: u32,
    next_cq: u32,
    next_srq: u32,
    next_ah: u32,
    /// RC SEND and WRITE messages whose last packet reached a responder: requests whose only
    /// answer is an ACK (see [`Self::ack_only_requests`]).
    ack_only_requests: u64,
    /// Those of them that reached a QP waiting for the ACK of its one message in flight (see
    /// [`Self::answers_awaiting_acks`]).
    answers_awaiting_acks: u64,
    /// See [`Self::mid_message`].
    mid_message: bool,
    /// See [`Self::fail`].
    failed: bool,
    /// Destroyed RC QPs that still answer their peers' resends, each until its deadline (see
    /// [`Self::destroy_qp_lingering`]). Out of `qps`, so no verb reaches them.
    departed: HashMap<u32, (Qp, Nanos)>,
    /// A departed QP has an ACK to send.
    departed_pending: bool,
    /// Counts [`Self::set_gids`] calls (see [`Self::gids_version`]).
    gids_version: u64,
}

impl Device {
    pub fn new(config: DeviceConfig) -> Self {
        Device {
            qps: HashMap::default(),
            ready: VecDeque::new(),
            turn_sent: 0,
            timers: QpTimers::default(),
            sh: Shared {
                mem: MemoryTable::new(config.key_seed),
                cqs: HashMap::default(),
                srqs: HashMap::default(),
                ahs: HashMap::default(),
                events: VecDeque::new(),
                gids: config.gids,
                port_mtu: config.port_mtu,
                counters: Counters::default(),
                ip_ident: 0,
                notifying_cqs: 0,
            },
            next_qpn: if (limits::FIRST_QPN..MAX_QPN).contains(&config.first_qpn) {
                config.first_qpn
            } else {
                limits::FIRST_QPN
            },
            next_cq: 1,
            next_srq: 1,
            next_ah: 1,
            ack_only_requests: 0,
            answers_awaiting_acks: 0,
            mid_message: false,
            failed: false,
            departed: HashMap::default(),
            departed_pending: false,
            gids_version: 0,
        }
    }

    pub fn counters(&self) -> Counters {
        self.sh.counters
    }

    /// [`Counters::tx_too_big_for_buffer`], without copying the rest (the engine checks it
    /// every round).
    pub fn tx_too_big_for_buffer(&self) -> u64 {
        self.sh.counters.tx_too_big_for_buffer
    }

    /// [`Counters::tx_no_source_address`], without copying the rest.
    pub fn tx_no_source_address(&self) -> u64 {
        self.sh.counters.tx_no_source_address
    }

    /// What every QP and CQ is doing at `now`, a line each (see `Qp::report_line`), with the
    /// device's next timer and round-robin list: for a person finding out why a program stalled.
    pub fn state_report(&self, now: Nanos) -> String {
        let mut qpns: Vec<&u32> = self.qps.keys().collect();
        qpns.sort();
        let mut out = format!(
            "earliest timer entry {:?} (now {now}, {} entries), ready {:?}\n",
            self.timers.earliest(),
            self.timers.len(),
            self.ready
        );
        for qpn in qpns {
            out.push_str(&self.qps[qpn].report_line(now));
            out.push('\n');
        }
        let mut cqs: Vec<_> = self.sh.cqs.iter().collect();
        cqs.sort_by_key(|(id, _)| id.0);
        for (id, cq) in cqs {
            out.push_str(&format!(
                "cq {} {}/{}{}\n",
                id.0,
                cq.len(),
                cq.capacity(),
                if cq.overflowed() { " overflowed" } else { "" }
            ));
        }
        out
    }

    /// `counters().completions` without copying every counter (read per poll by the engine).
    pub fn completions_stored(&self) -> u64 {
        self.sh.counters.completions
    }

    /// How many RC SEND and WRITE messages have had their last packet (new or duplicate) reach a
    /// responder so far: requests that call for nothing but an ACK, which may wait a moment for
    /// the answer the application is about to send (READ and atomic responses carry what the
    /// peer waits for, and go at once). A first or middle packet does not count: the
    /// application cannot answer before the message is whole, and a wait that started at the
    /// first packet ran out while the rest arrived (a 16 KiB WRITE is four packets at path
    /// MTU 4096), so the ACK left alone after all.
    pub fn ack_only_requests(&self) -> u64 {
        self.ack_only_requests
    }

    /// How many of [`Self::ack_only_requests`] reached a QP that had sent one message and was
    /// waiting for its ACK: the shape of a ping-pong turn, where the peer's message comes
    /// ahead of the peer's ACK for this side's (both in one kick, see
    /// [`Self::poll_transmit`]). The application takes its completion when that ACK arrives
    /// and answers then, so the ACK for the peer's message may wait for the answer a little
    /// longer than usual. A QP with several messages in flight (a stream) does not count.
    pub fn answers_awaiting_acks(&self) -> u64 {
        self.answers_awaiting_acks
    }

    /// The newest packet that reached a QP was the first or a middle packet of a message
    /// (a SEND, a WRITE or a READ response): the rest of that message is on its way. A
    /// progress thread that went to sleep now would be woken again for each of those packets.
    pub fn mid_message(&self) -> bool {
        self.mid_message
    }

    pub fn gids(&self) -> &[Option<IpAddress>] {
        &self.sh.gids
    }

    /// Replaces the GID table (the netdev's addresses changed).
    pub fn set_gids(&mut self, gids: Vec<Option<IpAddress>>) {
        self.sh.gids = gids;
        self.gids_version += 1;
    }

    /// Changes whenever [`Self::set_gids`] replaced the GID table: what a sender learned
    /// from the table (that a destination is one of this device's own addresses, say) holds
    /// while this stays the same.
    pub fn gids_version(&self) -> u64 {
        self.gids_version
    }

    pub fn port_mtu(&self) -> PathMtu {
        self.sh.port_mtu
    }

    pub fn set_port_mtu(&mut self, mtu: PathMtu) {
        self.sh.port_mtu = mtu;
    }

    // ----- protection domains and memory regions -----

    pub fn alloc_pd(&mut self) -> PdId {
        self.sh.mem.alloc_pd()
    }

    pub fn dealloc_pd(&mut self, pd: PdId) -> Result<(), VerbsError> {
        let used = self.qps.values().any(|q| q.pd == pd)
            || self.sh.ahs.values().any(|(p, _)| *p == pd)
            || self.sh.srqs.values().any(|s| s.pd == pd);
        if used || !self.sh.mem.dealloc_pd(pd) {
            return Err(VerbsError::Busy("protection domain"));
        }
        Ok(())
    }

    /// Frees `pd` with the memory regions and address handles still in it, as closing a
    /// context frees what its application left (the kernel destroys a closed file's objects);
    /// returns the regions, whose memory is no longer registered. The regions go in any case
    /// (no peer may reach memory the application may free now); the PD and its address
    /// handles stay while a QP or SRQ still uses the PD.
    pub fn dealloc_pd_with_contents(&mut self, pd: PdId) -> Vec<MemoryRegion> {
        let regions: Vec<MemoryRegion> = self
            .sh
            .mem
            .regions_of(pd)
            .into_iter()
            .filter_map(|mr| self.sh.mem.deregister(mr))
            .collect();
        if !self.qps.values().any(|q| q.pd == pd) && !self.sh.srqs.values().any(|s| s.pd == pd) {
            self.sh.ahs.retain(|_, (p, _)| *p != pd);
            let _ = self.dealloc_pd(pd);
        }
        regions
    }

    pub fn reg_mr(
        &mut self,
        pd: PdId,
        va: u64,
        len: u64,
        access: Access,
    ) -> Result<(MrId, MemoryRegion), VerbsError> {
        Ok(self.sh.mem.register(pd, va, len, access)?)
    }

    pub fn dereg_mr(&mut self, mr: MrId) -> Result<MemoryRegion, VerbsError> {
        self.sh
            .mem
            .deregister(mr)
            .ok_or(VerbsError::NoSuchObject("memory region"))
    }

    // ----- completion queues -----

    /// A CQ for at least `cqe` completions: it holds [`cq::rounded_capacity`]`(cqe)`, as
    /// rdma_rxe's would (`cq(id).capacity()` tells).
    ///
    /// [`cq::rounded_capacity`]: super::cq::rounded_capacity
    pub fn create_cq(&mut self, cqe: u32) -> Result<CqId, VerbsError> {
        if cqe == 0 || cqe > limits::MAX_CQE {
            return Err(VerbsError::Invalid(
                "cqe must be between 1 and the device's max_cqe",
            ));
        }
        let id = handle_ids::next_free(&mut self.next_cq, &self.sh.cqs, CqId);
        let capacity = super::cq::rounded_capacity(cqe);
        self.sh
            .cqs
            .insert(id, CompletionQueue::new(capacity as usize));
        Ok(id)
    }

    pub fn destroy_cq(&mut self, cq: CqId) -> Result<(), VerbsError> {
        if self
            .qps
            .values()
            .any(|q| q.send_cq == cq || q.recv_cq == cq)
        {
            return Err(VerbsError::Busy("completion queue"));
        }
        let q = self
            .sh
            .cqs
            .remove(&cq)
            .ok_or(VerbsError::NoSuchObject("completion queue"))?;
        if q.notifies() {
            self.sh.notifying_cqs -= 1;
        }
        Ok(())
    }

    pub fn cq(&self, cq: CqId) -> Option<&CompletionQueue> {
        self.sh.cqs.get(&cq)
    }

    /// Moves up to `max` completions into `out`; returns how many.
    pub fn poll_cq(
        &mut self,
        cq: CqId,
        max: usize,
        out: &mut Vec<WorkCompletion>,
    ) -> Result<usize, VerbsError> {
        let q = self
            .sh
            .cqs
            .get_mut(&cq)
            .ok_or(VerbsError::NoSuchObject("completion queue"))?;
        Ok(q.poll(max, out))
    }

    pub fn req_notify_cq(&mut self, cq: CqId, solicited_only: bool) -> Result<(), VerbsError> {
        let q = self
            .sh
            .cqs
            .get_mut(&cq)
            .ok_or(VerbsError::NoSuchObject("completion queue"))?;
        if q.req_notify(solicited_only) {
            self.sh.notifying_cqs += 1;
        }
        Ok(())
    }

    /// Some CQ has been armed (`ibv_req_notify_cq`): the application learns of (some of) its
    /// completions from its completion channel rather than by polling for them. Sticky: between
    /// a notification and the application arming the CQ again, no CQ may be armed. Per device,
    /// so per engine: one armed CQ in any context of the process turns the engine's ACK holds
    /// off for all its QPs (they then get their ACKs as from a NIC, only less batched).
    pub fn completion_events_used(&self) -> bool {
        self.sh.notifying_cqs > 0
    }

    // ----- shared receive queues -----

    pub fn create_srq(&mut self, pd: PdId, max_wr: u32, max_sge: u32) -> Result<SrqId, VerbsError> {
        if max_wr == 0 || max_wr > limits::MAX_SRQ_WR || max_sge > limits::MAX_SRQ_SGE {
            return Err(VerbsError::Invalid("SRQ size out of range"));
        }
        let id = handle_ids::next_free(&mut self.next_srq, &self.sh.srqs, SrqId);
        self.sh.srqs.insert(
            id,
            SharedReceiveQueue::new(pd, max_wr as usize, max_sge as usize),
        );
        Ok(id)
    }

    pub fn destroy_srq(&mut self, srq: SrqId) -> Result<(), VerbsError> {
        if self.qps.values().any(|q| q.srq == Some(srq)) {
            return Err(VerbsError::Busy("shared receive queue"));
        }
        self.sh
            .srqs
            .remove(&srq)
            .map(|_| ())
            .ok_or(VerbsError::NoSuchObject("shared receive queue"))
    }

    /// Arms (non-zero) or disarms the SRQ limit event.
    pub fn modify_srq_limit(&mut self, srq: SrqId, limit: u32) -> Result<(), VerbsError> {
        let s = self
            .sh
            .srqs
            .get_mut(&srq)
            .ok_or(VerbsError::NoSuchObject("shared receive queue"))?;
        if limit as usize > s.max_wr {
            return Err(VerbsError::Invalid("SRQ limit above its size"));
        }
        s.set_limit(limit);
        Ok(())
    }

    pub fn srq(&self, srq: SrqId) -> Option<&SharedReceiveQueue> {
        self.sh.srqs.get(&srq)
    }

    pub fn post_srq_recv(&mut self, srq: SrqId, wr: RecvWr) -> Result<(), VerbsError> {
        if self.failed {
            // No QP will ever take it (an SRQ's receives are not flushed: they belong to no
            // QP, as on an RDMA NIC).
            return Err(VerbsError::DeviceFailed);
        }
        let s = self
            .sh
            .srqs
            .get_mut(&srq)
            .ok_or(VerbsError::NoSuchObject("shared receive queue"))?;
        if wr.sg_list.len() > s.max_sge {
            return Err(VerbsError::Invalid("more SGEs than the SRQ's max_sge"));
        }
        if !s.push(wr) {
            return Err(VerbsError::QueueFull("shared receive queue"));
        }
        Ok(())
    }

    // ----- address handles -----

    pub fn create_ah(&mut self, pd: PdId, av: AddressVector) -> Result<AhId, VerbsError> {
        self.check_ah(&av)?;
        let id = handle_ids::next_free(&mut self.next_ah, &self.sh.ahs, AhId);
        self.sh.ahs.insert(id, (pd, av));
        Ok(id)
    }

    /// The error [`Self::create_ah`] would return for `av` (the engine checks before it waits
    /// for the address to be resolved).
    pub fn check_ah(&self, av: &AddressVector) -> Result<(), VerbsError> {
        let Some(sgid) = self.sh.gid(av.sgid_index) else {
            return Err(VerbsError::Invalid("sgid_index names no GID"));
        };
        if matches!(sgid, IpAddress::V4(_)) != matches!(av.dgid, IpAddress::V4(_)) {
            return Err(VerbsError::Invalid(
                "source and destination GIDs are of different IP versions",
            ));
        }
        Ok(())
    }

    pub fn destroy_ah(&mut self, ah: AhId) -> Result<(), VerbsError> {
        self.sh
            .ahs
            .remove(&ah)
            .map(|_| ())
            .ok_or(VerbsError::NoSuchObject("address handle"))
    }

    // ----- queue pairs -----

    pub fn create_qp(&mut self, init: QpInit) -> Result<u32, VerbsError> {
        if self.failed {
            return Err(VerbsError::DeviceFailed);
        }
        if !self.sh.cqs.contains_key(&init.send_cq) || !self.sh.cqs.contains_key(&init.recv_cq) {
            return Err(VerbsError::NoSuchObject("completion queue"));
        }
        if let Some(srq) = init.srq {
            if !self.sh.srqs.contains_key(&srq) {
                return Err(VerbsError::NoSuchObject("shared receive queue"));
            }
        }
        let c = init.cap;
        if c.max_send_wr > limits::MAX_QP_WR || c.max_recv_wr > limits::MAX_QP_WR {
            return Err(VerbsError::Invalid(
                "max_send_wr/max_recv_wr above the device limit",
            ));
        }
        if c.max_send_sge > limits::MAX_SGE || c.max_recv_sge > limits::MAX_SGE {
            return Err(VerbsError::Invalid("max_send_sge/max_recv_sge above 32"));
        }
        if c.max_inline_data > limits::MAX_INLINE_DATA {
            return Err(VerbsError::Invalid("max_inline_data above 512"));
        }
        let mut init = init;
        // Sized as rdma_rxe sizes a send WQE: room for max_send_sge SGEs (16 bytes each) or
        // max_inline_data bytes, whichever is more, and both limits then fill that room
        // (reported back through the QP's capabilities). A program that asks for 2 SGEs and no
        // inline data may post 32 inline bytes on rdma_rxe, and rc_pingpong-like programs
        // choose inline from what is reported. Within the limits above: 32 SGEs are 512 bytes.
        let wqe = (c.max_send_sge * 16).max(c.max_inline_data);
        init.cap.max_send_sge = wqe / 16;
        init.cap.max_inline_data = wqe;
        let mut qpn = self.next_qpn;
        while self.qps.contains_key(&qpn) || self.departed.contains_key(&qpn) {
            qpn = next_qpn(qpn);
        }
        self.next_qpn = next_qpn(qpn);
        self.qps.insert(qpn, Qp::new(qpn, &init));
        Ok(qpn)
    }

    /// Queues one more ACK for the last request `qpn` executed, to be transmitted before
    /// the QP is destroyed. True when there is one (only an RC QP that executed requests
    /// and is still connected has, also one moved to ERROR). Why: see `Qp::queue_farewell_ack`.
    pub fn queue_farewell_ack(&mut self, qpn: u32) -> bool {
        let Some(qp) = self.qps.get_mut(&qpn) else {
            return false;
        };
        let queued = qp.queue_farewell_ack();
        if queued {
            queue_ready(&mut self.ready, &mut self.timers, qp);
        }
        queued
    }

    pub fn destroy_qp(&mut self, qpn: u32) -> Result<(), VerbsError> {
        self.remove_qp(qpn).map(drop)
    }

    /// [`Self::destroy_qp`], except that an RC QP that executed requests of a connected peer
    /// goes on answering that peer's resends of them (SEND and WRITE packets behind the PSN
    /// it expects) with the ACK for the last one, until `until`; nothing else reaches it and
    /// it completes nothing. Verbs see it gone at once.
    ///
    /// rdma_rxe can be left resending its last message after its peer got it: its
    /// retransmission timer fires on an old deadline while the message is in flight, and an
    /// ACK arriving during the resend moves its `comp.psn` without completing the WQE (see
    /// docs/decisions.md, "Why rdma_rxe retransmits on a clean path"). Only another ACK for
    /// that PSN gets it out. The farewell ACK ([`Self::queue_farewell_ack`]) can arrive during
    /// the same resend; an answer to the next resend cannot. With `retry_cnt` 7 (infinite in
    /// rdma_rxe, and what the rdma-core examples set) a peer left unanswered resends forever.
    ///
    /// Only the QP's expected PSN, MSN, path and queued ACKs are kept (its queues are
    /// dropped): nothing it does can reach memory, a receive WQE or a CQ. QPs whose time is
    /// up are forgotten here and whenever a packet comes for one, so the aside holds only
    /// those destroyed within the last `linger`.
    pub fn destroy_qp_lingering(
        &mut self,
        qpn: u32,
        now: Nanos,
        linger: Nanos,
    ) -> Result<(), VerbsError> {
        let mut qp = self.remove_qp(qpn)?;
        self.departed.retain(|_, (_, until)| *until > now);
        if qp.executed_requests() && !self.failed {
            // A farewell ACK the transmit ring had no room for still goes.
            self.departed_pending |= qp.strip_for_departure();
            self.departed.insert(qpn, (qp, now + linger));
        }
        Ok(())
    }

    /// Whether a destroyed QP still answers resends at `now` (see
    /// [`Self::destroy_qp_lingering`]); forgets those whose time is up.
    pub fn lingering(&mut self, now: Nanos) -> bool {
        self.departed.retain(|_, (_, until)| *until > now);
        !self.departed.is_empty()
    }

    fn remove_qp(&mut self, qpn: u32) -> Result<Qp, VerbsError> {
        let qp = self
            .qps
            .remove(&qpn)
            .ok_or(VerbsError::NoSuchObject("queue pair"))?;
        // A destroyed QP leaves the ready list at once: QP numbers wrap, and a new QP given
        // this number while the old one was still listed could be listed twice.
        if self.ready.front() == Some(&qpn) {
            self.turn_sent = 0;
        }
        self.ready.retain(|&q| q != qpn);
        Ok(qp)
    }

    pub fn qp(&self, qpn: u32) -> Option<&Qp> {
        self.qps.get(&qpn)
    }

    pub fn query_qp(&self, qpn: u32) -> Result<QpAttr, VerbsError> {
        self.qps
            .get(&qpn)
            .map(Qp::attr)
            .ok_or(VerbsError::NoSuchObject("queue pair"))
    }

    pub fn modify_qp(&mut self, qpn: u32, attr: &QpAttr, mask: AttrMask) -> Result<(), VerbsError> {
        let on_failed_device = self.refuse_on_failed_device(attr, mask);
        let qp = self
            .qps
            .get_mut(&qpn)
            .ok_or(VerbsError::NoSuchObject("queue pair"))?;
        on_failed_device?;
        // `modify` checks the rest before it changes anything.
        qp.modify(&mut self.sh, attr, mask)?;
        self.mark_ready(qpn);
        Ok(())
    }

    /// The error [`Self::modify_qp`] would return for these attributes, without changing
    /// anything: the engine checks before it waits for an address to be resolved.
    pub fn check_modify_qp(
        &self,
        qpn: u32,
        attr: &QpAttr,
        mask: AttrMask,
    ) -> Result<(), VerbsError> {
        let qp = self
            .qps
            .get(&qpn)
            .ok_or(VerbsError::NoSuchObject("queue pair"))?;
        self.refuse_on_failed_device(attr, mask)?;
        qp.check_modify(&self.sh, attr, mask)
    }

    /// A failed device's QPs stay in error (or are reset, to be destroyed): none is brought up
    /// again to post work that would never complete.
    fn refuse_on_failed_device(&self, attr: &QpAttr, mask: AttrMask) -> Result<(), VerbsError> {
        if self.failed
            && mask.contains(AttrMask::STATE)
            && !matches!(attr.state, QpState::Error | QpState::Reset)
        {
            return Err(VerbsError::DeviceFailed);
        }
        Ok(())
    }

    /// `ibv_post_send`. Errors are the ones verbs reports at post time; anything found later
    /// (bad lkey, remote errors) arrives as a work completion.
    pub fn post_send(
        &mut self,
        qpn: u32,
        wr: SendWr,
        host: &dyn HostMemory,
    ) -> Result<(), VerbsError> {
        self.post_send_was_busy(qpn, wr, host).map(|_| ())
    }

    /// [`post_send`](Self::post_send), telling also whether the send queue was busy before this
    /// WR: it held WQEs waiting to go or partly sent, or more than one message sent and
    /// unacknowledged (a stream), so that this WR may wait to go out with the rest. One
    /// message sent whole and waiting for its ACK is not busy: that is a request/response
    /// application's previous turn, whose ACK comes behind the peer's answer, and the answer
    /// to that answer should not wait. One lookup of the QP serves the check, the post and
    /// the ready list: this runs for every WR.
    pub fn post_send_was_busy(
        &mut self,
        qpn: u32,
        wr: SendWr,
        host: &dyn HostMemory,
    ) -> Result<bool, VerbsError> {
        let qp = self
            .qps
            .get_mut(&qpn)
            .ok_or(VerbsError::NoSuchObject("queue pair"))?;
        let was_busy = !qp.sq.is_empty() && !qp.awaits_ack_of_its_only_message();
        let cap = qp.attr.cap;
        if matches!(qp.attr.state, QpState::Reset | QpState::Init | QpState::Rtr) {
            return Err(VerbsError::Invalid("QP is not ready to send (needs RTS)"));
        }
        if qp.sq.len() >= cap.max_send_wr as usize {
            return Err(VerbsError::QueueFull("send queue"));
        }
        if wr.sg_list.len() > cap.max_send_sge as usize {
            return Err(VerbsError::Invalid("more SGEs than the QP's max_send_sge"));
        }
        let op_ok = match qp.ty {
            QpType::Rc => true,
            QpType::Uc => !wr.op.is_read_or_atomic(),
            QpType::Ud => wr.op.is_send(),
        };
        if !op_ok {
            return Err(VerbsError::Invalid(
                "operation not supported on this QP type",
            ));
        }
        let length = wr.length();
        if length > MAX_MSG_SIZE {
            return Err(VerbsError::Invalid("message larger than 2 GiB"));
        }
        if matches!(wr.op, SendOp::RdmaRead { .. })
            && length.div_ceil(qp.attr.path_mtu.bytes() as u64) >= 1 << 23
        {
            // Half the PSN space: PSN comparisons (modulo 2^24) could no longer tell the
            // READ's later responses from earlier ones (2 GiB at path MTU 256).
            return Err(VerbsError::Invalid(
                "READ of 2^23 or more packets at this path MTU",
            ));
        }
        if let SendOp::CompareSwap { remote_addr, .. } | SendOp::FetchAdd { remote_addr, .. } =
            wr.op
        {
            // A longer local buffer takes the original value in its first 8 bytes, as
            // rdma-core's rxe provider accepts it (it refuses only fewer than 8).
            if length < 8 || remote_addr % 8 != 0 {
                return Err(VerbsError::Invalid(
                    "atomics need a local buffer of at least 8 bytes and an 8-byte aligned \
                     remote address",
                ));
            }
        }
        let ud_av = if qp.ty == QpType::Ud {
            let ud = wr
                .ud
                .ok_or(VerbsError::Invalid("UD send without a destination"))?;
            if ud.remote_qpn > 0xff_ffff {
                // A BTH holds 24 bits: the send would fail when built, reported as a frame
                // too big for its buffer.
                return Err(VerbsError::Invalid("UD remote QPN above 24 bits"));
            }
            let (_, av) = self
                .sh
                .ahs
                .get(&ud.ah)
                .ok_or(VerbsError::NoSuchObject("address handle"))?;
            Some(*av)
        } else {
            None
        };
        let inline = if wr.flags.contains(SendFlags::INLINE) && !wr.op.is_read_or_atomic() {
            if length > u64::from(cap.max_inline_data) {
                return Err(VerbsError::Invalid("inline data above max_inline_data"));
            }
            let mut data = InlineData::from_elem(0, length as usize);
            let mut at = 0usize;
            for sge in &wr.sg_list {
                let n = sge.length as usize;
                host.read(sge.addr, &mut data[at..at + n])
                    .map_err(|_| VerbsError::Invalid("inline data address not readable"))?;
                at += n;
            }
            Some(data)
        } else {
            None
        };
        let wqe = SendWqe {
            wr,
            inline,
            length,
            state: WqeState::Posted,
            first_psn: 0,
            last_psn: 0,
            has_rd_atomic: false,
            read_received: 0,
            ud_av,
            checked_in: 0,
        };
        if qp.attr.state == QpState::Error {
            // Posting to a QP in error completes at once with a flush error.
            let wc = qp.send_wc(&wqe, WcStatus::WrFlushErr);
            self.sh.complete_quiet(qp.send_cq, wc);
            return Ok(was_busy);
        }
        qp.sq.push_back(wqe);
        queue_ready(&mut self.ready, &mut self.timers, qp);
        Ok(was_busy)
    }

    /// `ibv_post_recv`.
    pub fn post_recv(&mut self, qpn: u32, wr: RecvWr) -> Result<(), VerbsError> {
        let qp = self
            .qps
            .get_mut(&qpn)
            .ok_or(VerbsError::NoSuchObject("queue pair"))?;
        if qp.srq.is_some() {
            return Err(VerbsError::Invalid("the QP receives from an SRQ"));
        }
        if qp.attr.state == QpState::Reset {
            return Err(VerbsError::Invalid("QP is in RESET"));
        }
        // The WQE a message is being received into still holds its slot, as in rdma_rxe's
        // ring (it completes with the message): else a flush could complete one receive more
        // than `max_recv_wr`, overrunning a CQ sized to it.
        let in_use = qp.rq.len() + usize::from(qp.resp.recv.is_some());
        if in_use >= qp.attr.cap.max_recv_wr as usize {
            return Err(VerbsError::QueueFull("receive queue"));
        }
        if wr.sg_list.len() > qp.attr.cap.max_recv_sge as usize {
            return Err(VerbsError::Invalid("more SGEs than the QP's max_recv_sge"));
        }
        if qp.attr.state == QpState::Error {
            let wc = WorkCompletion {
                wr_id: wr.wr_id,
                status: WcStatus::WrFlushErr,
                opcode: WcOpcode::Recv,
                byte_len: 0,
                imm: 0,
                qp_num: qpn,
                src_qp: 0,
                flags: WcFlags::default(),
                solicited: false,
            };
            self.sh.complete_quiet(qp.recv_cq, wc);
            return Ok(());
        }
        qp.rq.push_back(wr);
        Ok(())
    }

    // ----- the sans-IO interface -----

    /// Handles one received packet (starting at the IP header). Anything invalid is dropped
    /// and counted, as rdma_rxe does: nothing a peer sends can make this panic.
    pub fn handle_packet(&mut self, now: Nanos, packet: &[u8], host: &mut dyn HostMemory) {
        let c = &mut self.sh.counters;
        c.rx_packets += 1;
        // Bound by reference: moving the parsed frame (280 bytes) out of the `Result` was a
        // copy per packet received.
        let parsed = RoceFrame::parse_ip(packet);
        let Ok(frame) = &parsed else {
            c.malformed += 1;
            return;
        };
        match frame.verify() {
            Ok(()) => {}
            Err(WireError::Ipv4Checksum | WireError::UdpChecksum) => {
                c.bad_checksum += 1;
                return;
            }
            Err(_) => {
                c.bad_icrc += 1;
                return;
            }
        }
        let h = &frame.headers;
        let dst = h.ip.dst_addr();
        if !self.sh.gids.iter().flatten().any(|g| *g == dst) {
            c.not_local += 1;
            return;
        }
        let bth = &h.transport.bth;
        if bth.pkey & 0x7fff != 0x7fff {
            c.bad_pkey += 1;
            return;
        }
        let Some(info) = bth.opcode.info() else {
            c.malformed += 1;
            return;
        };
        if bth.opcode == Opcode::CNP {
            // No congestion control, as rdma_rxe.
            c.cnp_received += 1;
            return;
        }
        let qpn = bth.dest_qpn;
        let Some(qp) = self.qps.get_mut(&qpn) else {
            if let Some((qp, until)) = self.departed.get_mut(&qpn) {
                if *until <= now {
                    self.departed.remove(&qpn);
                } else if info.transport == Transport::Rc
                    && qp.hears_from(&self.sh.gids, h.ip.src_addr(), dst)
                    && qp.is_resent_send_or_write(frame, info)
                {
                    qp.handle_request(&mut self.sh, host, frame);
                    self.departed_pending = true;
                    return;
                }
            }
            c.unknown_qp += 1;
            return;
        };
        let matches = matches!(
            (info.transport, qp.ty),
            (Transport::Rc, QpType::Rc) | (Transport::Uc, QpType::Uc) | (Transport::Ud, QpType::Ud)
        );
        if !matches {
            c.wrong_transport += 1;
            return;
        }
        if qp.ty != QpType::Ud {
            // A connected QP only hears from its peer, at the address it was given.
            if !qp.hears_from(&self.sh.gids, h.ip.src_addr(), dst) {
                c.wrong_address += 1;
                return;
            }
        }
        self.mid_message = !info.position.ends_message();
        if info.is_request() {
            if qp.ty == QpType::Rc
                && matches!(info.operation, Operation::Send | Operation::RdmaWrite)
                && info.position.ends_message()
            {
                self.ack_only_requests += 1;
                if qp.awaits_ack_of_its_only_message() {
                    self.answers_awaiting_acks += 1;
                }
            }
            qp.handle_request(&mut self.sh, host, frame);
        } else {
            qp.handle_response(now, &mut self.sh, host, frame);
        }
        self.mark_ready(qpn);
    }

    /// Builds the next packet to send into `buf` (starting at the IP header, so leave room in
    /// front for the link layer). Ready QPs take turns of up to [`TX_TURN_PACKETS`] packets.
    pub fn poll_transmit(
        &mut self,
        now: Nanos,
        host: &dyn HostMemory,
        buf: &mut [u8],
    ) -> Option<Transmit> {
        // The QP whose turn it is stays at the head of the list while its turn goes on (the
        // builders below cannot queue QPs, so it cannot be queued twice meanwhile); it leaves
        // the head when the turn ends or it has nothing left.
        while let Some(&qpn) = self.ready.front() {
            let Some(qp) = self.qps.get_mut(&qpn) else {
                self.ready.pop_front();
                self.turn_sent = 0;
                continue;
            };
            // A request goes first, and the kind a turn started with keeps going until it runs
            // out or the turn ends: when an application answers a message, the whole answer
            // leaves ahead of the ACK for the message (both in one batch when the engine defers
            // the ACK until the application has had its turn). The peer waits for both; an ACK
            // ahead of the answer's last packets let it take its completion and leave its
            // verbs (`ib_write_lat` then spins on memory) before they arrived, and they waited
            // for its progress thread: at 8 KiB, two packets, `ib_write_lat` took 100-130 µs
            // one-way against 15 µs for `ib_send_lat`, when the kinds alternated packet by
            // packet. A turn that ends with both kinds queued hands the next one to the other
            // kind, so that neither starves the other.
            let sent = if qp.request_turn {
                match qp.next_request(now, &mut self.sh, host, buf) {
                    Some(t) => Some((t, false)),
                    None => qp.next_response(&mut self.sh, host, buf).map(|t| (t, true)),
                }
            } else {
                match qp.next_response(&mut self.sh, host, buf) {
                    Some(t) => Some((t, true)),
                    None => qp
                        .next_request(now, &mut self.sh, host, buf)
                        .map(|t| (t, false)),
                }
            };
            // A QP with nothing left starts its next turn with a request.
            let turn_ends = self.turn_sent + 1 >= TX_TURN_PACKETS;
            qp.request_turn = match &sent {
                None => true,
                Some((_, response)) => *response == turn_ends,
            };
            // Sending (or a WQE that failed on the way) may have armed or moved a timer.
            self.timers.note(qp);
            if let Some((t, _)) = sent {
                self.turn_sent += 1;
                if qp.has_nothing_to_send() {
                    // Its last packet for now: it leaves the list at once, as the call that
                    // found nothing would take it off, so that the caller can tell from
                    // `transmit_queued` that the round is over without that call (on the
                    // datapath, a transmit slot taken and given back on each turn's path).
                    qp.request_turn = true;
                    qp.queued = false;
                    self.ready.pop_front();
                    self.turn_sent = 0;
                } else if self.turn_sent >= TX_TURN_PACKETS {
                    // While the turn goes on, the QP stays first and is asked again next time.
                    self.turn_sent = 0;
                    self.ready.pop_front();
                    self.ready.push_back(qpn);
                }
                return Some(t);
            }
            qp.queued = false;
            self.ready.pop_front();
            self.turn_sent = 0;
        }
        if self.departed_pending {
            for (qp, _) in self.departed.values_mut() {
                if let Some(t) = qp.next_response(&mut self.sh, host, buf) {
                    return Some(t);
                }
            }
            self.departed_pending = false;
        }
        None
    }

    /// When to call [`Self::handle_timeout`]: no timer is due before this time (it may find
    /// none due then, when the timer it stood for was restarted meanwhile). `None` when no QP
    /// has a timer running. Costs nothing, however many QPs there are.
    pub fn poll_timeout(&self) -> Option<Nanos> {
        // Every test build checks that each running timer has its entry (a path that arms a
        // timer without noting it would make timers fire late, or never).
        debug_assert!(
            self.timers.covers(&self.qps),
            "a running timer has no entry at or before it (earliest entry {:?})",
            self.timers.earliest()
        );
        self.timers.earliest()
    }

    /// Runs every timer due at `now`; true if there was one. Costs a heap operation for each
    /// QP entry reached (see `qp_timers`), nothing before [`Self::poll_timeout`].
    pub fn handle_timeout(&mut self, now: Nanos) -> bool {
        if self.timers.earliest().is_none_or(|t| t > now) {
            return false;
        }
        let due = self.timers.take_due(now, &mut self.qps);
        for &qpn in &due {
            if let Some(qp) = self.qps.get_mut(&qpn) {
                qp.handle_timeout(now, &mut self.sh);
            }
            self.mark_ready(qpn);
        }
        !due.is_empty()
    }

    /// Packets wait to be built: [`Self::poll_transmit`] has more to give (unless a window or
    /// a fence holds them).
    pub fn transmit_queued(&self) -> bool {
        !self.ready.is_empty() || self.departed_pending
    }

    /// Whether [`Self::poll_transmit`], [`Self::handle_timeout`] or [`Self::poll_event`]
    /// have anything for a round at `now`: a QP is ready to send, a timer is due, or an event
    /// waits. A polling application that finds none of these waiting skips the transmit
    /// round.
    pub fn has_work(&self, now: Nanos) -> bool {
        self.transmit_queued()
            || self.timers.earliest().is_some_and(|t| t <= now)
            || !self.sh.events.is_empty()
    }

    /// The device is gone for good (its interface was removed, or the kernel stopped taking
    /// its frames): every QP goes to the error state with its outstanding work flushed
    /// (`IBV_WC_WR_FLUSH_ERR`), as an RDMA NIC in its fatal state does, and
    /// [`AsyncEvent::DeviceFatal`] is raised, once. An application waiting for a completion
    /// gets these instead of waiting forever. Work posted later completes with flush errors
    /// too (the QPs stay in error); nothing is sent any more.
    pub fn fail(&mut self) {
        if self.failed {
            return;
        }
        self.failed = true;
        self.departed.clear();
        self.sh
            .events
            .push_back(Event::Async(AsyncEvent::DeviceFatal));
        for qp in self.qps.values_mut() {
            qp.enter_error(&mut self.sh);
        }
        self.ready.clear();
        self.turn_sent = 0;
        self.timers.clear(&mut self.qps);
    }

    /// Retransmission timeouts so far (the `timeouts` counter), without copying every counter.
    pub fn timeouts(&self) -> u64 {
        self.sh.counters.timeouts
    }

    /// Whether [`Self::fail`] was called.
    pub fn failed(&self) -> bool {
        self.failed
    }

    /// The next completion-channel or asynchronous event.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.sh.events.pop_front()
    }

    /// Queues the QP for [`Self::poll_transmit`], and takes note of any timer it armed.
    fn mark_ready(&mut self, qpn: u32) {
        // One lookup for both (this runs for every post and every packet received).
        if let Some(qp) = self.qps.get_mut(&qpn) {
            queue_ready(&mut self.ready, &mut self.timers, qp);
        }
    }
}

/// Puts `qp` on the round robin of QPs that may have something to send, once, and takes
/// note of any timer it may have armed or moved.
fn queue_ready(ready: &mut VecDeque<u32>, timers: &mut QpTimers, qp: &mut Qp) {
    timers.note(qp);
    if !qp.queued {
        qp.queued = true;
        ready.push_back(qp.qpn);
    }
}

/// QPNs stay below this: 0xFFFFFF is the multicast QPN.
const MAX_QPN: u32 = 0xff_ffff;

fn next_qpn(q: u32) -> u32 {
    // QPN 0 and 1 are the special QPs; 0xFFFFFF is the multicast QPN.
    if q + 1 >= MAX_QPN {
        limits::FIRST_QPN
    } else {
        q + 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_and_address_handles_still_in_use_are_not_given_again_after_the_wrap() {
        let mut dev = Device::new(DeviceConfig {
            gids: Vec::new(),
            port_mtu: PathMtu::Mtu1024,
            key_seed: [3; 32],
            first_qpn: limits::FIRST_QPN,
        });
        let live_cq = dev.create_cq(8).unwrap();
        let pd = dev.alloc_pd();
        let live_srq = dev.create_srq(pd, 8, 1).unwrap();
        // As after 2^32 creations of each: the counters come round to the live handles.
        dev.next_cq = u32::MAX;
        dev.next_srq = u32::MAX;
        assert_eq!(dev.create_cq(8).unwrap(), CqId(u32::MAX));
        let cq = dev.create_cq(8).unwrap();
        assert_ne!(cq, live_cq);
        assert_eq!(dev.create_srq(pd, 8, 1).unwrap(), SrqId(u32::MAX));
        let srq = dev.create_srq(pd, 8, 1).unwrap();
        assert_ne!(srq, live_srq);
        // Destroying the new ones leaves the live ones in place.
        dev.destroy_cq(cq).unwrap();
        dev.destroy_srq(srq).unwrap();
        let mut out = Vec::new();
        assert_eq!(dev.poll_cq(live_cq, 1, &mut out), Ok(0));
        assert!(dev.destroy_srq(live_srq).is_ok());
    }
}
