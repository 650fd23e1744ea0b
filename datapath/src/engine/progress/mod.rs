//! The progress thread: frames in, transport, frames out, timers, sleep when idle.

mod route;
mod sleep;

use std::os::fd::RawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use xroce_core::transport::{Event, PathMtu, Transmit, TX_TURN_PACKETS};
use xroce_core::wire;

use super::ack_holds::{Deferred, LEFT_HOLD_LATE_NS};
use super::addressing::{AddressWatcher, Applied};
use super::capture::Capture;
use super::home_netns::{run_at_home, HomeNetns};
use super::{Shared, State};
use crate::netlink::Change;
use crate::port::{Port, RxDrops};
use crate::xdp::{PinWatch, XsksMap};
use route::{ethernet_header, next_hop_mac, Route, RouteMemo};
use sleep::{app_busy, frames_waiting, sleep, FrameWatch, Wait, WakePriority};

/// Frames taken from the port per lock hold.
const RX_BATCH: usize = 64;
/// Packets built per lock hold: as many as a UDP GSO batch takes, so that a round of small
/// frames leaves in one batch, not one and a frame too few for a batch of its own (which
/// went through AF_XDP with a kick of its own: a second system call per round).
const TX_BATCH: usize = crate::udp_gso::MAX_SEGMENTS;
/// A round that has built at least this many frames when it builds the last packet of a
/// signalled WR with unsignalled ones behind it (`Transmit::completes_signaled`, the first in
/// the round) kicks them all at once, that packet included: its ACK, and the application's
/// completion with it, then come back while the rest of the round is built and sent.
/// `ib_send_bw`'s sender (128 in flight, every 100th signalled) waits for that completion
/// before it posts the next hundred, and its message was the ninth of a round of 37: sent
/// with the whole round, its ACK came 8-10 µs after the round, which the sender spent idle.
/// (Not in the first few frames of a round: a ping-pong's answer is its round's first packet,
/// and the ACK behind it must leave in the same kick.)
pub(crate) const KICK_SIGNALED_AFTER: usize = 4;
/// Frame bytes built per lock hold before the kernel is told to send them. Each frame is
/// copied three more times after the transport writes it (into an skb, by veth for XDP, into
/// the receiver's UMEM); a batch that still sits in the sender's L2 cache when those copies run
/// makes them cheap. With 64 frames of 4 KiB (256 KiB) and many QPs whose buffers come in cold,
/// the kernel's copies missed the cache. 68 KiB: a QP's turn at path MTU 4096 (sixteen 4 KiB
/// packets, a 64 KiB message, with their headers) and the ACK that goes with it. With 64 KiB
/// the ACK held for an answer of 64 KiB was left for a round of its own, and the progress
/// thread was woken for it: `ib_write_lat` at 64 KiB took 260-270 µs one-way, 175-200 after.
const TX_BATCH_BYTES: usize = 68 * 1024;
/// What every RoCEv2 frame over IPv6 carries besides its extension headers and payload.
const ROCE_IPV6_FRAME: usize = ETH_HEADER
    + wire::ipv6::HEADER_LEN
    + wire::udp::HEADER_LEN
    + wire::bth::HEADER_LEN
    + wire::ICRC_LEN;
/// The largest frame xroce sends at path MTU 4096: IPv6, and a RETH (WRITE FIRST or ONLY).
const MAX_FRAME_AT_MTU_4096: usize = ROCE_IPV6_FRAME + wire::RethRepr::LEN + 4096;
/// An ACK frame over IPv6.
const ACK_FRAME: usize = ROCE_IPV6_FRAME + wire::AethRepr::LEN;
const _: () = assert!(
    TX_TURN_PACKETS as usize * MAX_FRAME_AT_MTU_4096 + ACK_FRAME <= TX_BATCH_BYTES,
    "a QP's turn at path MTU 4096 and an ACK fit in one batch"
);
/// Ethernet header without VLAN tag (xroce sends untagged).
const ETH_HEADER: usize = 14;
/// An application thread that left a verb (`poll_cq`, `post_send`) less than this long ago is
/// still in its verbs loop (a polling loop comes back within a microsecond or so) and moves
/// frames itself. Short, because an application may stop polling and spin on memory instead
/// (`ib_write_lat` waits for the peer's WRITE to land): the progress thread must take over at
/// once. (It was 1 ms, then 100 µs, measured from the last entry: `ib_write_lat` measured
/// 1.3 ms, then 138 µs.)
pub(crate) const APP_ACTIVE_NS: u64 = 3_000;
/// First check interval while the application is in its verbs loop (doubling up to
/// `MAX_NAP_NS` while it stays there).
const NAP_NS: u64 = 10_000;
/// An application that polled a CQ within this long is a poller (see `run`).
pub(crate) const APP_POLLER_NS: u64 = 10_000_000;
/// A nap that runs out less than this long after the application's last poll found it
/// polling (see `EngineCounters::naps_out_while_polled`): well above a wake-up's delay here
/// (up to some tens of µs), well below the alarm's margin (`nap_alarm`: 750 µs). Also what
/// makes an application a ping-pong partner whose answer an ACK may wait for (`thread_round`).
const POLLED_LATELY_NS: u64 = 100_000;
/// How long this thread holds ACKs for the application's answer (see `thread_round`). Longer
/// than `poll_cq`'s hold (`ACK_HOLD_NS`): the application is outside its verbs when this
/// thread takes its frames, and this thread's own wake-up may have taken its core, so coming
/// back to answer costs it a scheduling delay, on this VM's busy cores up to some tens of µs.
/// In a `ib_write_lat`-style ping-pong between two engines (`engine_netns.rs`), 5 µs holds ran
/// out before the answer in up to all of a run's holds, 20 µs in up to three quarters, 50 µs
/// in a handful; a run out hold costs the next turn a progress-thread wake-up on the peer. A
/// peer whose application waits for an ACK that no answer will carry is late by this much.
const THREAD_ACK_HOLD_NS: u64 = 50_000;
/// Longest check interval while an application keeps polling.
const MAX_NAP_NS: u64 = 1_000_000;
/// The longest this thread sleeps when the application polled a moment before (see `run`).
const AFTER_POLL_SLEEP_NS: u64 = 1_000_000;
/// The progress thread's timer slack (the kernel's default, 50 µs, would stretch its short
/// sleeps several times over).
const TIMER_SLACK_NS: libc::c_ulong = 1_000;
/// After taking a packet that is not the last of its message (`Device::mid_message`), this
/// thread waits this long for the next one awake instead of sleeping. Asleep, it was woken
/// for each packet; on this VM each such wake-up costs the sending side an interprocessor
/// interrupt inside its `sendto`, about 25 µs, so that a 64 KiB message (16 packets) took
/// 450-590 µs to leave instead of about 80 (`ib_write_lat` 64 KiB: a few per cent of turns
/// over 400 µs, and the p99). Packets of a message follow each other within a few µs here.
/// Only on the CPU its application last polled from: the thread then takes the core from
/// its own application, which waits for this message outside its verbs (else it would take
/// the packets itself). On another CPU it may be the sender's, whose next packets cannot
/// come while this thread spins there; wake-ups there cost no interrupt either.
const MID_MESSAGE_WAIT_NS: u64 = 20_000;
/// The longest this thread waits awake for the rest of messages per wake-up: it does so at
/// real-time priority (dropping it while it spins would leave it runnable behind a spinning
/// application until the scheduler's next tick, see `WakePriority`).
const MID_MESSAGE_WAIT_MAX_NS: u64 = 1_000_000;
/// How often a busy progress thread reads the address watcher.
const WATCH_EVERY_NS: u64 = 1_000_000;
/// Naps that a frame cut short while the application was in its verbs loop (it takes such
/// frames itself) before naps stop watching for frames (see `FrameWatch`).
const WASTED_FRAME_WAKES: u32 = 4;

/// The port and its buffers, kept under the engine lock so that whichever thread holds the
/// lock (the progress thread, or an application polling its CQ) can move frames.
pub(crate) struct PortState {
    pub(crate) port: Box<dyn Port>,
    /// The port had no room for the last packet: more are waiting in the transport.
    tx_full: bool,
    /// The interface is down: the kernel refused the last flush with `ENETDOWN`, and the
    /// frames queued for it wait (see [`send`]).
    pub(crate) link_down: bool,
    pub(crate) failed: bool,
    /// The transport has met a packet too big for a transmit frame, and stderr was told.
    too_big_reported: bool,
    /// [`Device::tx_no_source_address`] was reported on stderr.
    no_source_reported: bool,
    /// Where every frame sent and received is written, when asked for.
    pub(crate) capture: Option<Capture>,
    pub(crate) steering: SteeringWatch,
    /// The last destination's route, for the next frame to it.
    route: RouteMemo,
    /// Engine time of the last look at the receive ring ([`receive`]).
    pub(crate) received_at: u64,
    /// What the port had dropped when it was closed ([`Self::close`]): the counters of a
    /// stopped engine, written to `XROCE_STATS_FILE` after the stop, are the closed port's.
    drops_at_close: RxDrops,
}

/// How often at most [`SteeringWatch`] asks the kernel.
const STEERING_CHECK_NS: u64 = 1_000_000_000;

/// Whether the XDP program that steers this engine's frames to its socket is still on the
/// interface. Without it no RoCEv2 frame reaches the engine (`xroce link del`, or `ip link set
/// IF xdp off`, while a program runs): the kernel answers them with ICMP errors and the QPs
/// retransmit in vain, where rdma_rxe's device would be gone and its applications told. The
/// kernel reports no detachment (no link notification), so the engine looks when its
/// retransmission timers run out, at most once a second: one rtnetlink request.
pub(crate) struct SteeringWatch {
    iface: String,
    /// The program attached when the engine started; 0: unknown, never checked.
    program: u32,
    checked_at: u64,
    timeouts: u64,
    /// A look was taken since [`Self::take_looked`] last said so.
    looked: bool,
}

impl SteeringWatch {
    pub(crate) fn new(iface: &str) -> SteeringWatch {
        SteeringWatch {
            program: crate::xdp::attached_program_id(iface).unwrap_or(0),
            ..SteeringWatch::none(iface)
        }
    }

    /// A watch that never looks: for a port whose frames do not go through the program.
    pub(crate) fn none(iface: &str) -> SteeringWatch {
        SteeringWatch {
            iface: iface.to_string(),
            program: 0,
            checked_at: 0,
            timeouts: 0,
            looked: false,
        }
    }

    /// Whether retransmissions timed out and the watch looked since the last call: a moment
    /// to check the interface's receive queues too (see [`report_more_queues`]).
    fn take_looked(&mut self) -> bool {
        std::mem::take(&mut self.looked)
    }

    /// True when retransmissions timed out since the last look and the program attached is
    /// no longer the one this engine's socket was registered with (none, or another load with
    /// its own socket map). `home`: the engine's namespace, where to look whichever thread runs
    /// the round.
    fn program_gone(&mut self, now: u64, timeouts: u64, home: Option<&HomeNetns>) -> bool {
        if self.program == 0
            || timeouts == self.timeouts
            || now.saturating_sub(self.checked_at) < STEERING_CHECK_NS
        {
            return false;
        }
        self.timeouts = timeouts;
        self.checked_at = now;
        self.looked = true;
        self.program_changed(home)
    }

    /// The program attached now is not the one this engine's socket was registered with.
    /// Unreadable (the interface gone, say): not this watch's to say.
    fn program_changed(&self, home: Option<&HomeNetns>) -> bool {
        if self.program == 0 {
            return false;
        }
        let iface = &self.iface;
        let attached = run_at_home(home, || crate::xdp::attached_program_id(iface));
        matches!(attached, Ok(Ok(id)) if id != self.program)
    }
}

/// Says on stderr, once, when the interface now uses more receive queues than it did when
/// the engine started and took a socket on each (`ethtool -L` since, as a cloud guest agent
/// may do): the steering program passes what arrives on the new ones to the kernel, and the
/// QPs whose flows land there stall, which is why retransmissions time out. Called by the
/// progress thread, which runs in the engine's namespace, without the engine lock.
fn report_more_queues(shared: &Shared) {
    let Some(bound) = shared.rx_queues_at_start else {
        return;
    };
    if shared.counters.rx_queues_grown.load(Ordering::Relaxed) != 0 {
        return;
    }
    let iface = &shared.config.iface;
    if let Some(n) = crate::afxdp::receive_queues_in_use(iface).filter(|&n| n > bound) {
        shared.counters.rx_queues_grown.store(1, Ordering::Relaxed);
        crate::stderr_line!(
            "xroce: netdev {iface} now has {n} receive queues, more than the {bound} it had \
             when this engine started and took a socket on each: RoCEv2 frames on the others \
             go to the kernel, and the QPs whose flows land there stall. Restart the program, \
             or set the queues back (`ethtool -L {iface} combined {bound}`, or `rx {bound}` \
             where the driver counts receive channels apart)."
        );
    }
}

/// Why the device failed when its steering program went away.
fn steering_gone() -> String {
    "the XDP program that steers RoCEv2 frames to xroce is no longer attached \
     (`xroce link del` while the device was in use?)"
        .to_string()
}

impl PortState {
    /// The port had no room for the last packet the transport built.
    pub(crate) fn tx_full(&self) -> bool {
        self.tx_full
    }

    pub(crate) fn new(
        port: Box<dyn Port>,
        capture: Option<Capture>,
        steering: SteeringWatch,
    ) -> Self {
        Self {
            port,
            tx_full: false,
            link_down: false,
            failed: false,
            too_big_reported: false,
            no_source_reported: false,
            capture,
            steering,
            route: RouteMemo::default(),
            received_at: 0,
            drops_at_close: RxDrops::default(),
        }
    }

    /// Frames the kernel dropped on the way into this engine's port: the open port's count,
    /// or, once the port is closed, its count at the close.
    pub(crate) fn rx_drops(&self) -> RxDrops {
        let open = self.port.rx_drops();
        RxDrops {
            ring_full: self.drops_at_close.ring_full + open.ring_full,
            other: self.drops_at_close.other + open.other,
        }
    }

    /// Closes the port (the engine stops: its queue is free for the next engine), keeping
    /// what it dropped for the counters reported after the stop.
    pub(crate) fn close(&mut self) {
        self.drops_at_close = self.rx_drops();
        self.port = Box::new(crate::port::ClosedPort);
    }

    /// Hands buffered captured frames to the file.
    pub(crate) fn flush_capture(&mut self) {
        if let Some(c) = &mut self.capture {
            c.flush();
        }
    }
}

/// What a round of progress did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Round {
    /// Anything happened (frames in or out, timers, events): poll again soon.
    pub(crate) work: bool,
    /// Something is left that needs another round without new input: the transmit batch was
    /// cut short, or frames wait in the port.
    pub(crate) more: bool,
}

/// One round of work: receive a batch, run due timers, transmit a batch, flush.
pub(crate) fn progress_once(shared: &Shared, st: &mut State) -> Round {
    let now = shared.now();
    let received = receive(shared, st, now);
    let mut round = send(shared, st, now);
    round.work |= received > 0;
    round
}

/// A round of the progress thread: [`progress_once`], except that ACKs may wait for the
/// application's answer, as [`super::Engine::poll_cq`] lets them wait.
///
/// An application that spins on memory between its verbs (`ib_write_lat` waits for the
/// peer's WRITE to land in its buffer, then posts its own and polls for that one's
/// completion) leaves the peer's WRITE to this thread. Sent at once, the ACK for it reached
/// the peer alone; the peer took its completion and went back to spinning on memory, so this
/// side's answer, a moment later, found nobody in the verbs there either, and every turn on
/// both sides waited for a progress thread to be woken (on this VM's two busy cores a wake-up
/// from the other core took about 30 µs: `ib_write_lat` 40-60 µs one-way against 8 µs for
/// `ib_send_lat`). Held until the application answers, the ACK leaves in one kick with the
/// answer, and the peer, polling for its completion, receives both: neither side needs its
/// progress thread again.
///
/// So when the frames received executed SENDs or WRITEs (whose only answer is an ACK) for an
/// application that polled lately, the ACKs wait until the application's next post (which
/// sends them) or `THREAD_ACK_HOLD_NS` (this thread's round then, see [`sleep`]). READ and
/// atomic requests never start a hold, nor do frames for an application that does not poll
/// (`ib_write_bw`'s receiver) or polled long ago; a hold that ran out is sent before the
/// round receives, so that what comes in is held afresh for its own answer.
///
/// Nor is anything held for an application that has armed a CQ (`ibv_req_notify_cq`): it
/// learns of its completions from its completion channel. Held, the ACK for its peer's message
/// left behind its answer, so the peer's receive completion came before its send completion, which
/// an RDMA NIC never does (its ACK leaves at once, long before any answer). perftest's
/// `ib_send_lat -e` waits for one event after each send and then polls the send CQ once: given
/// the receive event there, it took it for the send's, and then waited for ever for the receive
/// event it had already taken. (Whether a CQ is armed at the moment says little: each
/// notification disarms its CQ until the application arms it again.) The ACK then leaves in
/// the round that received its request; only a request already queued in that same round
/// (never the answer to that request, which the application posts after the event) goes
/// ahead of it.
pub(crate) fn thread_round(shared: &Shared, st: &mut State) -> Round {
    let now = shared.now();
    let mut round = Round {
        work: false,
        more: false,
    };
    // A hold that ran out goes first: what comes in below may be held afresh, for its own
    // answer (a stale hold must not send the new ACKs at once).
    if let Deferred::AcksUntil { until, by_poll, .. } = st.deferred {
        if until <= now {
            if by_poll && now - until >= LEFT_HOLD_LATE_NS {
                // The application took its completions and left its verbs without answering.
                shared
                    .counters
                    .held_acks_left
                    .fetch_add(1, Ordering::Relaxed);
                st.left_holds.left(now);
            }
            round = send(shared, st, now);
        }
    }
    let requests = st.dev.ack_only_requests();
    let received = receive(shared, st, now);
    if received > 0 {
        shared
            .counters
            .rx_frames_by_thread
            .fetch_add(received as u64, Ordering::Relaxed);
    }
    let hold = match st.deferred {
        _ if st.dev.completion_events_used() => false,
        Deferred::AcksUntil { .. } => true,
        Deferred::Nothing => {
            let polled_ns = shared.app_polled_at.load(Ordering::Relaxed);
            let polled_lately = polled_ns != 0 && now.saturating_sub(polled_ns) < POLLED_LATELY_NS;
            // Not for an application whose holds keep running out (see `ACK_HOLDS_OFF_NS`).
            let hold = polled_lately
                && st.dev.ack_only_requests() != requests
                && !st.ack_holds.off_at(now);
            if hold {
                st.deferred = Deferred::AcksUntil {
                    until: now + THREAD_ACK_HOLD_NS,
                    answer_from: None,
                    by_poll: false,
                };
            }
            hold
        }
        Deferred::Requests => false,
    };
    if hold {
        // The frames built already do not wait for the hold (an error is the next flush's).
        let _ = st.io.port.send_kept();
    } else {
        let sent = send(shared, st, now);
        round.work |= sent.work;
        round.more |= sent.more;
    }
    round.work |= received > 0;
    round
}

/// What the progress thread watches besides its frames and the application's kicks: the
/// kernel's address, neighbour and link changes, and the pins of the XDP program (see
/// [`PinWatch`]), which tell when the program was unloaded.
pub(crate) struct Watchers {
    pub(crate) addresses: AddressWatcher,
    pub(crate) pins: Option<PinWatch>,
}

/// Something a [`Watchers`] reported.
pub(crate) enum Noticed {
    Kernel(Change),
    /// Pins of the XDP program were removed: perhaps it is no longer attached.
    PinsRemoved,
}

impl Watchers {
    /// Everything reported since the last look. Never blocks.
    fn drain(&mut self) -> Vec<Noticed> {
        let mut out: Vec<Noticed> = self
            .addresses
            .drain()
            .into_iter()
            .map(Noticed::Kernel)
            .collect();
        if self.pins.as_ref().is_some_and(|p| p.drain()) {
            out.push(Noticed::PinsRemoved);
        }
        out
    }
}

/// Applies address, neighbour, route and link changes (and a removal of the steering
/// program's pins) to the engine, under its lock, in the order they were read.
pub(crate) fn apply_changes(
    shared: &Shared,
    st: &mut State,
    changes: impl IntoIterator<Item = Noticed>,
) {
    let mut link_changed = false;
    for noticed in changes {
        link_changed |= is_link_change(&noticed);
        tell_port(&mut *st.io.port, &noticed);
        match noticed {
            Noticed::Kernel(change) => {
                if st.neighbours.apply(&mut st.dev, change) == Applied::InterfaceGone {
                    fail_port(shared, st, "the interface was removed".to_string());
                    break;
                }
            }
            Noticed::PinsRemoved => {
                if st.io.steering.program_changed(shared.home.as_ref()) {
                    fail_port(shared, st, steering_gone());
                    break;
                }
            }
        }
    }
    if link_changed && st.io.link_down && !st.io.failed && st.neighbours.link_may_take_frames() {
        // Up again (or unknown): kick the frames held meanwhile. Not on a change that leaves
        // it down: the notification of the very change that took the link down may come
        // after the refused kick, and a kick then would only be refused again (and counted
        // as a second outage).
        st.io.link_down = false;
        send(shared, st, shared.now());
    }
}

/// Passes on to the port the changes that make what it asked the kernel stale (see
/// `UdpGsoPort`): a link's (its offloads), addresses' and routes' (which destinations are
/// local), all of them when notifications were lost.
fn tell_port(port: &mut dyn Port, noticed: &Noticed) {
    match noticed {
        Noticed::Kernel(Change::Link(ifindex)) => port.link_changed(Some(*ifindex)),
        Noticed::Kernel(Change::Resync) => {
            port.link_changed(None);
            port.addresses_changed();
        }
        Noticed::Kernel(Change::Addresses(_) | Change::Routes) => port.addresses_changed(),
        Noticed::Kernel(Change::Neighbour(..)) | Noticed::PinsRemoved => {}
    }
}

/// Changes the progress thread read but could not apply for want of the lock, which an
/// application polling in a tight loop keeps: its next poll applies them (see
/// `Engine::poll_cq`).
#[derive(Default)]
pub(crate) struct HandedChanges {
    pub(crate) waiting: std::sync::atomic::AtomicBool,
    changes: std::sync::Mutex<Vec<Noticed>>,
}

impl HandedChanges {
    fn hand(&self, changes: &mut Vec<Noticed>) {
        let mut handed = self.changes.lock().unwrap_or_else(|p| p.into_inner());
        handed.append(changes);
        self.waiting.store(true, Ordering::Release);
    }

    /// What was handed over (nothing when nothing waits).
    pub(crate) fn take(&self) -> Vec<Noticed> {
        if !self.waiting.load(Ordering::Relaxed) || !self.waiting.swap(false, Ordering::Acquire) {
            return Vec::new();
        }
        std::mem::take(&mut *self.changes.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// An interface may have come up, gone down or gone away (notifications lost count too), or
/// the program steering its frames may have been unloaded: applied at once.
fn is_link_change(noticed: &Noticed) -> bool {
    matches!(
        noticed,
        Noticed::Kernel(Change::Link(_) | Change::Resync) | Noticed::PinsRemoved
    )
}

/// Counts a packet longer than the interface's MTU and, for the engine's first, says on
/// stderr why it will not arrive and what to change. Such packets come from a QP whose path
/// MTU is above the port's active MTU (`ibv_rc_pingpong -m 4096` on a 1500-byte netdev). They
/// still go out, as rdma_rxe sends them: the path MTU the two ends agreed on decides how
/// messages are cut, and a message short enough for one packet that fits still arrives (a
/// lower MTU here would split it where the peer expects one packet). A longer one is resent
/// until its retries run out, forever with `retry_cnt` 7.
fn report_too_long(shared: &Shared, tx: &Transmit, mtu: u32, port_mtu: PathMtu) {
    if shared.counters.tx_too_long.fetch_add(1, Ordering::Relaxed) == 0 {
        let (iface, qpn, len, active) = (&shared.config.iface, tx.qpn, tx.len, port_mtu.bytes());
        crate::stderr_line!(
            "xroce: netdev {iface}: QP {qpn:#x} sends a {len}-byte packet, longer than the \
             interface's MTU ({mtu}); the link will drop it and the QP resend it. Its path MTU \
             is above the port's active MTU ({active}): ask for a path MTU of at most {active} \
             (e.g. `-m {active}`), or raise the interface's MTU (`xroce link del`, then the \
             new MTU, then `xroce link add`: the XDP program loaded for a small MTU can keep \
             the interface from taking a large one). (Said once; the state dump counts such \
             packets.)"
        );
    }
}

/// Says on stderr, once, why a work request failed with a local QP operation error (or a
/// READ was NAKed): its packet did not fit a transmit frame. Only a QP whose path MTU is 4096
/// on sockets without multi-buffer (kernels before 6.6, or zero-copy on a driver whose
/// zero-copy takes one buffer per frame) makes such packets; the port's active MTU there is
/// 2048.
fn report_too_big(shared: &Shared, port_mtu: PathMtu) {
    let (iface, active) = (&shared.config.iface, port_mtu.bytes());
    crate::stderr_line!(
        "xroce: netdev {iface}: a packet did not fit a transmit frame, so its work request \
         failed (local QP operation error) or, for a READ response, the READ was refused: a \
         QP's path MTU is above what the engine's AF_XDP sockets carry (frames of more than \
         one page need sockets bound with multi-buffer, which Linux has from 6.6 and which \
         zero-copy on some drivers does without). Ask for a path MTU of at most {active} \
         (e.g. `-m {active}`). (Said once; the state dump counts such packets: \
         tx_too_big_for_buffer.)"
    );
}

/// The port cannot work any more (its interface was removed, or the kernel refuses its frames
/// for good): says so on stderr, fails the device (every QP to the error state, its work
/// flushed, `IBV_EVENT_DEVICE_FATAL`: see `Device::fail`), so that applications waiting for
/// completions get flush errors instead of waiting forever, and marks the port failed (the
/// progress thread then stops).
pub(crate) fn fail_port(shared: &Shared, st: &mut State, why: String) {
    if st.io.failed {
        return;
    }
    crate::stderr_line!(
        "xroce: netdev {}: {why}; the device has failed, and its QPs are in the error state",
        shared.config.iface
    );
    st.io.failed = true;
    st.failed = Some(why);
    st.dev.fail();
    dispatch_events(shared, &mut st.dev);
    if shared.progress_waiters.load(Ordering::SeqCst) > 0 {
        shared.progressed.notify_all();
    }
}

/// The first half of a round: takes a batch of frames from the port into the transport and
/// hands out the events that caused. Whatever the frames call for (ACKs, READ responses)
/// waits in the transport for [`send`]. Returns how many frames came in.
pub(crate) fn receive(shared: &Shared, st: &mut State, now: u64) -> usize {
    let State {
        dev,
        mem,
        io,
        neighbours,
        ..
    } = st;
    io.received_at = now;
    let capture = &mut io.capture;
    let own_mac = neighbours.mac();
    let n = io.port.recv(RX_BATCH, &mut |frame| {
        shared.counters.rx_frames.fetch_add(1, Ordering::Relaxed);
        if let Some(c) = capture {
            c.record(frame);
        }
        match ip_payload(frame).filter(|ip| carries_rocev2(ip)) {
            // The kernel's IP stack takes only frames for the interface's MAC; rdma_rxe's
            // peers rely on that to move away from a MAC (see `Neighbours::keep_alive`).
            Some(ip) if frame.get(..6) == Some(&own_mac[..]) => dev.handle_packet(now, ip, mem),
            Some(_) => {
                shared
                    .counters
                    .rx_other_host
                    .fetch_add(1, Ordering::Relaxed);
            }
            None => {
                shared.counters.rx_not_roce.fetch_add(1, Ordering::Relaxed);
            }
        }
    });
    dispatch_events(shared, dev);
    n
}

/// Completion-channel and asynchronous events go to whoever asked for them (the provider
/// writes them to the application's event file descriptors). True if a CQ was notified.
pub(crate) fn dispatch_events(shared: &Shared, dev: &mut xroce_core::transport::Device) -> bool {
    let mut notified = false;
    while let Some(ev) = dev.poll_event() {
        notified |= matches!(ev, Event::CqNotify(_));
        if let Some(sink) = &shared.config.on_event {
            (sink.0)(ev);
        }
    }
    notified
}

/// The second half of a round: runs due timers, transmits a batch and flushes it.
pub(crate) fn send(shared: &Shared, st: &mut State, now: u64) -> Round {
    st.deferred = Deferred::Nothing;
    let State {
        dev,
        mem,
        neighbours,
        io,
        ..
    } = st;
    let mut work = false;

    // Timers.
    if dev.poll_timeout().is_some_and(|t| t <= now) {
        work |= dev.handle_timeout(now);
        let gone = io
            .steering
            .program_gone(now, dev.timeouts(), shared.home.as_ref());
        if io.steering.take_looked() {
            // Looked at by the progress thread, outside the engine lock (an ethtool request
            // waits for RTNL, which must not hold up an application's verbs).
            shared.queues_check_due.store(true, Ordering::Relaxed);
        }
        if gone {
            fail_port(shared, st, steering_gone());
            return Round {
                work: false,
                more: false,
            };
        }
    }

    // Transmit: the transport writes each packet straight into the port's buffer, behind room
    // for the Ethernet header, and is asked only when there is room.
    let mut built = 0;
    // Frames handed to the port this round (loopback packets are not).
    let mut wired = 0u64;
    let mut built_bytes = 0;
    let routes = &mut io.route;
    // Both counters only grow, so their sum changes whenever either does.
    let routes_version = neighbours.routes_version().wrapping_add(dev.gids_version());
    // The round's first packet to bring a signalled completion, when it has frames before it.
    let mut signaled_seen = false;
    let capture = &mut io.capture;
    while built < TX_BATCH && built_bytes < TX_BATCH_BYTES {
        if !dev.transmit_queued() {
            // Nothing left (the transport drops a QP from its list with its last packet): no
            // transmit slot is taken only to be given back.
            io.tx_full = false;
            break;
        }
        let mut produced = false;
        let mut kick_now = false;
        let room = io.port.send_with(&mut |buf| {
            let tx = dev.poll_transmit(now, mem, buf.get_mut(ETH_HEADER..)?)?;
            produced = true;
            if tx.completes_signaled && !signaled_seen {
                signaled_seen = true;
                kick_now = built >= KICK_SIGNALED_AFTER;
            }
            if tx.len > neighbours.mtu() as usize {
                report_too_long(shared, &tx, neighbours.mtu(), dev.port_mtu());
            }
            let frame_len = ETH_HEADER + tx.len;
            built_bytes += frame_len;
            let route = routes.route(tx.dst, routes_version, |dst| {
                if dev.gids().contains(&Some(dst)) {
                    Some(Route::Loopback)
                } else {
                    let src = neighbours.mac();
                    let mac = next_hop_mac(shared, neighbours, dst)?;
                    Some(Route::Wire(ethernet_header(src, mac, dst)?))
                }
            });
            match route? {
                Route::Wire(header) => buf[..ETH_HEADER].copy_from_slice(&header),
                Route::Loopback => {
                    // A QP talking to a QP of this device never touches the wire.
                    shared.counters.tx_loopback.fetch_add(1, Ordering::Relaxed);
                    if let Some(c) = capture.as_mut() {
                        let mac = neighbours.mac();
                        if let Some(header) = ethernet_header(mac, mac, tx.dst) {
                            buf[..ETH_HEADER].copy_from_slice(&header);
                            c.record(&buf[..frame_len]);
                        }
                    }
                    dev.handle_packet(now, &buf[ETH_HEADER..frame_len], mem);
                    return None;
                }
            }
            if let Some(c) = capture.as_mut() {
                c.record(&buf[..frame_len]);
            }
            wired += 1;
            Some(frame_len)
        });
        if !room {
            // The transport keeps its packets until the kernel frees transmit slots.
            io.tx_full = true;
            break;
        }
        if !produced {
            io.tx_full = false;
            break;
        }
        built += 1;
        work = true;
        if kick_now {
            shared
                .counters
                .tx_kicks_for_completions
                .fetch_add(1, Ordering::Relaxed);
            if io.port.kick().is_err() {
                // The round's flush below says why.
                break;
            }
        }
    }

    if !io.too_big_reported && dev.tx_too_big_for_buffer() > 0 {
        io.too_big_reported = true;
        report_too_big(shared, dev.port_mtu());
    }
    if !io.no_source_reported && dev.tx_no_source_address() > 0 {
        io.no_source_reported = true;
        crate::stderr_line!(
            "xroce: netdev {}: a QP's source GID (the sgid_index of its address vector) no \
             longer names an address of the interface (was the address removed?), so its work \
             request failed with a local QP operation error; such a QP must be connected again \
             with a current GID (`ibv_devinfo -v` lists them). (Said once; the state dump \
             counts such requests: tx_no_source_address.)",
            shared.config.iface
        );
    }

    // Events from timers (and from loopback packets).
    work |= dispatch_events(shared, dev);
    if wired > 0 {
        neighbours.keep_alive(now);
        shared
            .counters
            .tx_frames
            .fetch_add(wired, Ordering::Relaxed);
        shared.counters.tx_batches.fetch_add(1, Ordering::Relaxed);
    }
    // Cut short by its limits, with packets left: the next round builds them (a caller that
    // holds ACKs instead sends what the port kept with `Port::send_kept`).
    let cut = built == TX_BATCH || built_bytes >= TX_BATCH_BYTES;
    let flushed = if cut && dev.transmit_queued() {
        io.port.flush_before_more()
    } else {
        io.port.flush()
    };
    match flushed {
        // A flush that may not have asked the kernel at all (nothing to kick, or no wake-up
        // needed) says nothing about the link; one that emptied the queue does.
        Ok(()) => io.link_down &= io.port.tx_pending(),
        // The interface is down (`ip link set IF down`): the kernel takes no frames until it
        // is up again, and those queued wait in the ring, like frames on a NIC whose link is
        // down. What is lost meanwhile is the transport's to retransmit; nothing fails. This
        // thread does not spin on the queue meanwhile: the interface coming back wakes it
        // (the address watcher reports link changes), and so do the transport's timers.
        // Any other error ends the device only when the interface is gone (the socket is
        // unbound then: ENXIO) or its steering program is: a driver may refuse a kick while
        // it rebuilds its rings. Otherwise the frames wait, as for a link that is down.
        Err(e) => {
            let down = e.raw_os_error() == Some(libc::ENETDOWN);
            if !down
                && (neighbours.interface_gone()
                    || io.steering.program_changed(shared.home.as_ref()))
            {
                fail_port(
                    shared,
                    st,
                    format!("the interface stopped accepting frames ({e})"),
                );
                return Round {
                    work: false,
                    more: false,
                };
            }
            if !io.link_down {
                if !down {
                    crate::stderr_line!(
                        "xroce: netdev {}: the kernel refused frames ({e}); they wait, and \
                         the QPs retransmit, until it takes them again",
                        shared.config.iface
                    );
                }
                shared.counters.link_downs.fetch_add(1, Ordering::Relaxed);
            }
            io.link_down = true;
        }
    }
    let more = cut || (!io.link_down && (io.tx_full || io.port.tx_pending()));
    Round {
        work: work || more,
        more,
    }
}

pub(crate) fn run(
    shared: Arc<Shared>,
    mut watchers: Watchers,
    mut xsks: Option<XsksMap>,
    queues: Vec<u32>,
    wait_fd: RawFd,
    doorbell: bool,
) {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };
    shared.progress_tid.store(tid, Ordering::Relaxed);
    // Short sleeps must be short: the default timer slack adds up to 50 µs to each.
    // SAFETY: prctl(PR_SET_TIMERSLACK) takes a plain integer and affects only this thread.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, TIMER_SLACK_NS, 0, 0, 0) };
    let mut wake_priority = WakePriority::new();
    // Check interval while the application stays in its verbs loop (NAP_NS doubling up to
    // MAX_NAP_NS).
    let mut nap_ns = NAP_NS;
    // The application was busy at the last look (see below).
    let mut confirm_quiet = false;
    let spin_ns = shared.config.spin.as_nanos() as u64;
    let mut last_work = shared.now();
    // 0: read the address watcher on the next round.
    let mut last_watch = 0;
    // Address changes read while napping, applied when this thread next holds the lock. They
    // must be read at once: the watcher's socket stays readable until they are, and every
    // nap would return at once (this thread spun for as long as the application polled).
    let mut address_changes = Vec::new();
    // Since when changes other than the links' have waited for the lock.
    let mut changes_waiting_since: Option<u64> = None;
    let mut frame_watch = FrameWatch::default();
    // The last nap was a long one and ended on the alarm, which polls postpone.
    let mut long_nap_rang = false;
    // Since when this thread has been taking a message's packets without sleeping, and
    // whether it is waiting awake for the next one now (see `MID_MESSAGE_WAIT_NS`).
    let mut message_wait_since: Option<u64> = None;
    let mut waiting_for_rest = false;
    loop {
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        let now = shared.now();
        // While an application is inside its verbs (polling a CQ, posting) it moves frames
        // itself (see `Engine::poll_cq`); this thread keeps off the lock and looks again a
        // moment later. Kicks and address changes wake it meanwhile, and received frames only
        // while that has been worth it (see `FrameWatch`): for an application that polls,
        // every frame would wake it for nothing.
        let app_busy = app_busy(&shared, now)
            // Quiet now, but perhaps only because this thread's wake-up took its core:
            // step aside once and look again before taking over (an application spinning on
            // memory is still quiet then; one in a polling loop is back in its verbs).
            || (confirm_quiet && {
                let woke =
                    wake_priority.sleep(|| sleep(&shared, None, &watchers, Wait::AtMost(APP_ACTIVE_NS)));
                if woke.addresses {
                    address_changes.extend(watchers.drain());
                }
                app_busy(&shared, shared.now())
            });
        confirm_quiet = app_busy;
        if std::mem::take(&mut long_nap_rang)
            && app_busy
            && !shared.nap_alarm.rang_for_hold(shared.now())
        {
            // Polls came too far apart to hold the alarm off, yet the application is still
            // polling: the wake-up was for nothing.
            shared.nap_alarm.rang_for_nothing();
        }
        // A held lock means the application is at work too. But a change of the links (the
        // interface up again, or gone) is applied at once, waiting for the lock if need be:
        // an application polling for its peer sends nothing, and would neither resume the
        // frames held while the interface was down nor learn that it was removed.
        let link_changed = address_changes.iter().any(is_link_change);
        // Other changes (addresses, neighbours, routes) wait while the application is busy,
        // but not for as long as it polls: a new address would never enter the GID table,
        // nor a peer's new MAC the neighbour cache, and the list would keep growing. After a
        // while they are handed to the application, whose next poll applies them under the
        // lock it holds anyway (this thread never waits for the lock: see `sleep`).
        changes_waiting_since = if address_changes.is_empty() {
            None
        } else {
            Some(changes_waiting_since.unwrap_or(now))
        };
        let changes_overdue =
            changes_waiting_since.is_some_and(|t| now.saturating_sub(t) >= WATCH_EVERY_NS);
        let guard = if link_changed {
            Some(shared.state.lock().unwrap_or_else(|p| p.into_inner()))
        } else if app_busy {
            if changes_overdue {
                shared.handed_changes.hand(&mut address_changes);
            }
            None
        } else {
            shared.try_state()
        };
        let Some(mut guard) = guard else {
            let frames = frame_watch.watching().then_some(wait_fd);
            if doorbell && frames.is_some() {
                // It may still ring for frames the application has taken since (only this
                // thread silences it). Those not taken yet are the application's, in its
                // verbs, or this thread's after the nap.
                crate::port::silence_doorbell(wait_fd);
            }
            let woke = wake_priority.sleep(|| sleep(&shared, frames, &watchers, Wait::Nap(nap_ns)));
            long_nap_rang = woke.alarm && nap_ns >= MAX_NAP_NS;
            if woke.addresses {
                address_changes.extend(watchers.drain());
            }
            if woke.frames {
                // Give the application the time a polling loop takes to come back for the
                // frame; if it did not (it has left for good, to spin on memory), the next
                // round finds it quiet and takes the frame. A frame that waits for the lock
                // (held outside the verbs loop) stays unwatched until this thread has it.
                // A doorbell cannot say whether its frames are still waiting: an application
                // back in its verbs after the grace is taken to have taken them.
                if doorbell {
                    crate::port::silence_doorbell(wait_fd);
                }
                let waiting = !self::app_busy(&shared, shared.now()) || {
                    let _ = wake_priority
                        .sleep(|| sleep(&shared, None, &watchers, Wait::AtMost(APP_ACTIVE_NS)));
                    if doorbell {
                        !self::app_busy(&shared, shared.now())
                    } else {
                        frames_waiting(wait_fd)
                    }
                };
                frame_watch.after_grace(waiting);
            } else {
                nap_ns = (nap_ns * 2).min(MAX_NAP_NS);
                // Counted when the application polled lately (this thread's own wake-up may
                // have kept it off its core for some µs): one that the scheduler took off its
                // core for long did not push the alarm either, and this wake-up is due.
                let polled_ns = shared.app_polled_at.load(Ordering::Relaxed);
                if !woke.addresses && shared.now().saturating_sub(polled_ns) < POLLED_LATELY_NS {
                    shared
                        .counters
                        .naps_out_while_polled
                        .fetch_add(1, Ordering::Relaxed);
                }
            }
            continue;
        };
        nap_ns = NAP_NS;
        shared.nap_alarm.short_naps();
        let (work, mid_message) = {
            let st = &mut *guard;
            if st.io.failed {
                break;
            }
            if doorbell {
                // Before the round takes frames: a doorbell that rings after this is for
                // frames the round may not see, and the sleep after it must wake for them.
                crate::port::silence_doorbell(wait_fd);
            }
            let work = thread_round(&shared, st).work;
            if !work {
                // Nothing to do: a good moment to write out captured frames.
                st.io.flush_capture();
            }
            let mid_message = st.dev.mid_message();
            frame_watch.took_a_round(work);
            // Handed to an application that then stopped polling before it took them: older
            // than those read since, so they go first (a neighbour's MAC changed twice must
            // end with the second).
            let mut handed = shared.handed_changes.take();
            if !handed.is_empty() {
                handed.append(&mut address_changes);
                address_changes = handed;
            }
            // Address and neighbour changes are rare: while busy, look every millisecond
            // rather than paying a system call per round.
            if !address_changes.is_empty() || now.saturating_sub(last_watch) >= WATCH_EVERY_NS {
                last_watch = now;
                address_changes.extend(watchers.drain());
                apply_changes(&shared, st, address_changes.drain(..));
            }
            (work, mid_message)
        };
        drop(guard);
        if shared.queues_check_due.swap(false, Ordering::Relaxed) {
            report_more_queues(&shared);
        }
        // A message of several packets is coming in, and this thread runs on the CPU its
        // application polled from (which now waits for the message outside its verbs): wait
        // for the rest awake (see `MID_MESSAGE_WAIT_NS`), for at most
        // `MID_MESSAGE_WAIT_MAX_NS` per wake-up.
        if work
            && mid_message
            && message_wait_since.is_none()
            && super::current_cpu() == shared.app_cpu.load(Ordering::Relaxed)
        {
            message_wait_since = Some(now);
        }
        let waiting_for_message = mid_message
            && message_wait_since.is_some_and(|t| now.saturating_sub(t) < MID_MESSAGE_WAIT_MAX_NS);
        // Real-time priority lasts for the round a wake-up was for and the round that finds
        // nothing left (then the thread sleeps again, still raised: see `WakePriority`), and
        // while it waits for the rest of a message.
        wake_priority.round_done(work, waiting_for_message);
        if work {
            waiting_for_rest = false;
            if shared.progress_waiters.load(Ordering::SeqCst) > 0 {
                shared.progressed.notify_all();
            }
            last_work = now;
            continue;
        }
        if waiting_for_message && now.saturating_sub(last_work) < MID_MESSAGE_WAIT_NS {
            if !waiting_for_rest {
                waiting_for_rest = true;
                shared
                    .counters
                    .mid_message_waits
                    .fetch_add(1, Ordering::Relaxed);
            }
            std::hint::spin_loop();
            continue;
        }
        message_wait_since = None;
        waiting_for_rest = false;
        // Nothing to do. Next to an application that polls its CQs (a poller: it polled in
        // the last few ms) this thread never busy-waits: on two cores a third spinning thread
        // takes the CPU the application and its peer need. It blocks until the next frame,
        // timer or kick instead; a woken thread that has slept preempts a spinning
        // application at once (ib_write_lat spins on memory between its polls). Otherwise
        // (an application sleeping in ibv_get_cq_event, say) it spins a little longer first.
        let polled_ns = shared.app_polled_at.load(Ordering::Relaxed);
        let poller = polled_ns != 0 && now.saturating_sub(polled_ns) < APP_POLLER_NS;
        if !poller && now.saturating_sub(last_work) < spin_ns {
            wake_priority.settle();
            std::hint::spin_loop();
            continue;
        }
        // An application that polled a moment ago may be back in its verbs before this sleep
        // ends, hold ACKs there for its answer and leave them (see `LeftHolds`): the sleep
        // then ends by `AFTER_POLL_SLEEP_NS`, not at the next transport timer, tens of
        // milliseconds out. That costs one wake-up after an application goes quiet.
        let wait = if polled_ns != 0 && now.saturating_sub(polled_ns) < POLLED_LATELY_NS {
            Wait::AtMost(AFTER_POLL_SLEEP_NS)
        } else {
            Wait::Events
        };
        let woke = wake_priority.sleep(|| sleep(&shared, Some(wait_fd), &watchers, wait));
        if woke.addresses {
            address_changes.extend(watchers.drain());
        }
        last_work = shared.now().saturating_sub(spin_ns);
    }
    // Leave the queues to the kernel: with their slots empty the XDP program passes RoCE
    // frames on.
    if let Some(xsks) = &mut xsks {
        for queue in queues {
            let _ = xsks.clear(queue);
        }
        // Best effort: an application inside a verb now may hold the lock; a later engine
        // sets the filter afresh anyway.
        if let Some(mut st) = shared.try_state() {
            st.neighbours.stop_steering();
        }
    }
    shared.progressed.notify_all();
}

/// The smaller of two optional times; `None` only when both are.
pub(crate) fn earliest(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The IP packet inside an Ethernet frame (after up to two VLAN tags, 802.1Q or 802.1ad, in
/// any order: what the steering program lets through), for IPv4 and IPv6.
fn ip_payload(frame: &[u8]) -> Option<&[u8]> {
    const IPV4: u16 = 0x0800;
    const IPV6: u16 = 0x86dd;
    const TAG_8021Q: u16 = 0x8100;
    const TAG_8021AD: u16 = 0x88a8;
    // The EtherType after the two MACs, then after each tag (2 bytes of TCI, 2 of type).
    let mut at = 12;
    for _ in 0..=crate::xdp::abi::MAX_VLAN_TAGS {
        let t = frame.get(at..at + 2)?;
        match u16::from_be_bytes([t[0], t[1]]) {
            IPV4 | IPV6 => return frame.get(at + 2..),
            TAG_8021Q | TAG_8021AD => at += 4,
            _ => return None,
        }
    }
    None
}

/// Whether an IP packet is UDP to port 4791. The steering program lets only those through to
/// an AF_XDP socket, but a DPDK port receives all of the interface's frames (neighbour
/// discovery, the kernel's own traffic): those are not the transport's to count as malformed.
/// Lengths are the transport's to check.
fn carries_rocev2(ip: &[u8]) -> bool {
    const UDP: u8 = 17;
    // More fragments, or a fragment offset: not a whole datagram (as the steering program).
    const FRAGMENT: u16 = 0x3fff;
    let udp_at = match ip.first().map(|b| b >> 4) {
        Some(4) => {
            let ihl = usize::from(ip[0] & 0x0f);
            let fragment = ip
                .get(6..8)
                .is_none_or(|f| u16::from_be_bytes([f[0], f[1]]) & FRAGMENT != 0);
            if ihl < 5 || fragment || ip.get(9) != Some(&UDP) {
                return false;
            }
            ihl * 4
        }
        Some(6) if ip.get(6) == Some(&UDP) => 40,
        _ => return false,
    };
    ip.get(udp_at + 2..udp_at + 4)
        .is_some_and(|p| u16::from_be_bytes([p[0], p[1]]) == wire::ROCEV2_UDP_PORT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_udp_to_port_4791_is_rocev2() {
        let mut v4 = vec![0u8; 28];
        v4[0] = 0x45;
        v4[9] = 17;
        v4[22..24].copy_from_slice(&4791u16.to_be_bytes());
        assert!(carries_rocev2(&v4));
        // IPv4 options move the UDP header.
        let mut opts = vec![0u8; 32];
        opts[0] = 0x46;
        opts[9] = 17;
        opts[26..28].copy_from_slice(&4791u16.to_be_bytes());
        assert!(carries_rocev2(&opts));
        let mut other_port = v4.clone();
        other_port[22..24].copy_from_slice(&53u16.to_be_bytes());
        assert!(!carries_rocev2(&other_port));
        let mut tcp = v4.clone();
        tcp[9] = 6;
        assert!(!carries_rocev2(&tcp));
        // A header length under 5 words, a first fragment, a later fragment.
        let mut short_header = v4.clone();
        short_header[0] = 0x44;
        assert!(!carries_rocev2(&short_header));
        let mut first_fragment = v4.clone();
        first_fragment[6] = 0x20;
        assert!(!carries_rocev2(&first_fragment));
        let mut later_fragment = v4.clone();
        later_fragment[7] = 0x10;
        assert!(!carries_rocev2(&later_fragment));
        // Don't-fragment is not a fragment.
        let mut dont_fragment = v4.clone();
        dont_fragment[6] = 0x40;
        assert!(carries_rocev2(&dont_fragment));
        let mut v6 = vec![0u8; 48];
        v6[0] = 0x60;
        v6[6] = 17;
        v6[42..44].copy_from_slice(&4791u16.to_be_bytes());
        assert!(carries_rocev2(&v6));
        let mut icmp6 = v6.clone();
        icmp6[6] = 58;
        assert!(!carries_rocev2(&icmp6));
        // Cut short before the port, or empty.
        assert!(!carries_rocev2(&v4[..23]));
        assert!(!carries_rocev2(&[]));
    }

    /// A port that moves no frames and records what it is told.
    #[derive(Default)]
    struct RecordingPort {
        drops: RxDrops,
        links: Vec<Option<u32>>,
        addresses: usize,
    }
    impl Port for RecordingPort {
        fn recv(&mut self, _: usize, _: &mut dyn FnMut(&[u8])) -> usize {
            0
        }
        fn send(&mut self, _: &[u8]) -> bool {
            false
        }
        fn send_with(&mut self, _: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> bool {
            false
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
        fn tx_pending(&self) -> bool {
            false
        }
        fn wait_fd(&self) -> Option<RawFd> {
            None
        }
        fn link_changed(&mut self, ifindex: Option<u32>) {
            self.links.push(ifindex);
        }
        fn addresses_changed(&mut self) {
            self.addresses += 1;
        }
        fn rx_drops(&self) -> RxDrops {
            self.drops
        }
    }

    /// The port's side of every kind of notification: a link's with its interface, addresses'
    /// and routes' as such, both when notifications were lost, nothing for a neighbour or the
    /// program's pins.
    #[test]
    fn the_port_hears_of_the_changes_that_make_its_answers_stale() {
        let heard = |noticed: Noticed| {
            let mut port = RecordingPort::default();
            tell_port(&mut port, &noticed);
            (port.links, port.addresses)
        };
        let ip = std::net::IpAddr::from([10, 0, 0, 1]);
        assert_eq!(heard(Noticed::Kernel(Change::Link(7))), (vec![Some(7)], 0));
        assert_eq!(heard(Noticed::Kernel(Change::Addresses(7))), (vec![], 1));
        assert_eq!(heard(Noticed::Kernel(Change::Routes)), (vec![], 1));
        assert_eq!(heard(Noticed::Kernel(Change::Resync)), (vec![None], 1));
        assert_eq!(
            heard(Noticed::Kernel(Change::Neighbour(7, ip, None))),
            (vec![], 0)
        );
        assert_eq!(heard(Noticed::PinsRemoved), (vec![], 0));
    }

    /// The kernel's receive drops outlive the port: a stopped engine closes its socket before
    /// `XROCE_STATS_FILE` is written, and the line then reported the closed port's zeros.
    #[test]
    fn receive_drops_are_kept_when_the_port_closes() {
        let drops = RxDrops {
            ring_full: 3,
            other: 76_785,
        };
        let mut io = PortState::new(
            Box::new(RecordingPort {
                drops,
                ..RecordingPort::default()
            }),
            None,
            SteeringWatch::none("veth-test"),
        );
        assert_eq!(io.rx_drops(), drops);
        io.close();
        assert_eq!(io.rx_drops(), drops, "the count at the close is kept");
        assert_eq!(io.port.rx_drops(), RxDrops::default(), "the port is closed");
    }

    /// Untagged, one tag, two tags (802.1Q and 802.1ad, as the steering program accepts them);
    /// a third tag, another EtherType or a cut frame is not an IP packet.
    #[test]
    fn the_ip_packet_is_found_behind_up_to_two_vlan_tags() {
        let ip = [0x45u8, 0, 0, 20];
        let frame = |types: &[u16]| {
            let mut f = vec![0u8; 12];
            for (k, t) in types.iter().enumerate() {
                f.extend_from_slice(&t.to_be_bytes());
                if k + 1 < types.len() {
                    f.extend_from_slice(&[0x00, 0x64]); // TCI: VLAN 100
                }
            }
            f.extend_from_slice(&ip);
            f
        };
        for types in [
            &[0x0800][..],
            &[0x86dd],
            &[0x8100, 0x0800],
            &[0x88a8, 0x0800],
            &[0x88a8, 0x8100, 0x0800],
            &[0x8100, 0x8100, 0x86dd],
        ] {
            assert_eq!(ip_payload(&frame(types)), Some(&ip[..]), "{types:x?}");
        }
        for types in [
            &[0x8100, 0x8100, 0x8100, 0x0800][..],
            &[0x0806],
            &[0x8100, 0x0806],
        ] {
            assert_eq!(ip_payload(&frame(types)), None, "{types:x?}");
        }
        assert_eq!(ip_payload(&frame(&[0x8100, 0x0800])[..15]), None);
    }
}
