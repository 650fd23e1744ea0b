//! ACKs held for the application's answer.
//!
//! A poll that receives a SEND or WRITE holds the ACKs it calls for while the application
//! takes its completions and answers, so that a ping-pong's answer leaves first with the ACK
//! behind it in one kick (see [`Engine::poll_cq`]). This module has how long such holds last,
//! when they are given up on for a while (holds that keep running out, holds the application
//! leaves to the progress thread), and the poll round that makes and ends them.

use std::sync::atomic::Ordering;

use xroce_core::transport::verbs::{VerbsError, WorkCompletion};
use xroce_core::transport::CqId;

use super::{progress, Engine, State};

/// Holds of ACKs that `poll_cq` made for the application's answer and the application left:
/// it went away from its verbs without answering, and the ACKs waited for the progress
/// thread's next round, `LEFT_HOLD_LATE_NS` or more after the hold ran out. Next to a steady
/// poller that thread naps on an alarm the polls keep pushing, up to
/// `nap_alarm::MAX_POSTPONE_NS` out, so the peer, whose send queue may wait for those ACKs,
/// stalled for milliseconds. Two applications that both send, take their
/// completions and then wait for each other outside their verbs, did so every few rounds:
/// 30 stalls of 1-17 ms in 1 000 rounds, half the run. Each left hold turns `poll_cq`'s holds
/// off for a spell, `LEFT_HOLDS_OFF_NS` doubled for every spell since the application last
/// answered a hold, so such an application is tried a few times in all, not once per spell;
/// a hold it answers brings the spells back to the shortest.
#[derive(Debug, Default)]
pub(crate) struct LeftHolds {
    /// Spells since a hold was last answered.
    spells: u32,
    /// Engine time before which `poll_cq` holds nothing.
    off_until: u64,
}

impl LeftHolds {
    /// A hold was left at `now`: holds are off for the next spell.
    pub(crate) fn left(&mut self, now: u64) {
        let doublings = self.spells.min(LEFT_HOLDS_MAX_DOUBLINGS);
        self.off_until = now.saturating_add(LEFT_HOLDS_OFF_NS << doublings);
        self.spells = self.spells.saturating_add(1);
    }

    /// The application answered a hold: the next spell, if any, is the shortest.
    pub(super) fn answered(&mut self) {
        self.spells = 0;
    }

    /// The application has left a hold since it last answered one: its next holds are on
    /// trial, and the thread wakes for them.
    pub(super) fn on_trial(&self) -> bool {
        self.spells > 0
    }

    pub(super) fn off_at(&self, now: u64) -> bool {
        now < self.off_until
    }
}

/// Holds of one kind that ran out in a row, and until when such holds are off.
#[derive(Debug, Default)]
pub(crate) struct HoldsRunningOut {
    /// Holds that ran out since one last served its purpose.
    pub(crate) in_a_row: u32,
    /// Engine time before which such holds are not made.
    off_until: u64,
}

impl HoldsRunningOut {
    /// A hold ran out: after `limit` in a row, holds are off for `off_ns` from `now`.
    pub(super) fn ran_out(&mut self, now: u64, limit: u32, off_ns: u64) {
        self.in_a_row += 1;
        if self.in_a_row >= limit {
            self.in_a_row = 0;
            self.off_until = now + off_ns;
        }
    }

    pub(super) fn off_at(&self, now: u64) -> bool {
        now < self.off_until
    }
}

/// Packets the transport has ready that a round left for later.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Deferred {
    Nothing,
    /// WRs posted to a streaming QP (see `Engine::after_post`): the next poll sends them.
    Requests,
    /// ACKs held for the application's answer (see `Engine::poll_cq`), until engine time
    /// `until` at the latest. `answer_from`: the hold waits for a ping-pong answer (see
    /// `ANSWER_HOLD_NS`), and the device had stored this many completions when it started.
    /// `by_poll`: a `poll_cq` started it (else the progress thread, see
    /// `progress::thread_round`).
    AcksUntil {
        until: u64,
        answer_from: Option<u64>,
        by_poll: bool,
    },
}

/// How long `poll_cq` holds ACKs for the application's answer while the application finds
/// nothing to take. An answer comes within a microsecond or two of the completion it answers
/// (`ib_send_lat` posts its reply right after its poll); a peer whose application waits for
/// the ACK itself (a send completion) is late by about this much when no answer comes.
const ACK_HOLD_NS: u64 = 5_000;

/// How long `poll_cq` holds ACKs for a message that arrived while the application waited for
/// the ACK of its own one message in flight (`Device::answers_awaiting_acks`): until that ACK
/// arrives (then `ACK_HOLD_NS` more at most) or this long. As long as the progress thread's
/// hold (`THREAD_ACK_HOLD_NS`): the ACK comes a kernel pass behind the message, or later when
/// the peer's core was taken meanwhile.
const ANSWER_HOLD_NS: u64 = 50_000;

/// Two applications that each send one message and wait for its ACK before the next, at the
/// same time, hold each other's ACKs until their answer holds run out, on every turn. After
/// this many in a row ran out with no ACK for this side (one now and then is a late peer),
/// holds stay short for `ANSWER_HOLDS_OFF_NS`: such a pair then stalls a few times in that
/// long.
const ANSWER_HOLDS_RUN_OUT_IN_A_ROW: u32 = 3;
const ANSWER_HOLDS_OFF_NS: u64 = 10_000_000;

/// A hold for the application's answer (`ACK_HOLD_NS`) that runs out with no post from it
/// delays its peer's send completions, and with them the peer's sending: `ib_send_bw`'s
/// receiver never answers, and its sender, whose 128-deep send queue refills only when the
/// ACK for every 100th message comes, sat idle until the receiving application had taken all
/// the round's completions and the hold had run out. After this many such holds in a row,
/// ACKs go as soon as their requests are received, for `ACK_HOLDS_OFF_NS`; a post that answers
/// a hold starts the count again.
const ACK_HOLDS_RUN_OUT_IN_A_ROW: u32 = 3;
const ACK_HOLDS_OFF_NS: u64 = 10_000_000;

/// The shortest spell without `poll_cq` holds after the application left one (see
/// [`LeftHolds`]), and how many times it doubles at most while the application keeps leaving
/// them: up to 1.28 s.
const LEFT_HOLDS_OFF_NS: u64 = 10_000_000;
const LEFT_HOLDS_MAX_DOUBLINGS: u32 = 7;
/// How late the progress thread must find a poll's hold for it to count as left. An
/// application that spins on memory between its verbs (`ib_write_lat`) answers a few
/// microseconds after the hold ran out, often after this thread found it; under emulation (a
/// guest without KVM) an application takes tens of microseconds to answer. Neither is a reason
/// to stop holding. A hold left to the thread's alarm is a millisecond late or more.
pub(crate) const LEFT_HOLD_LATE_NS: u64 = 200_000;
/// How much later than `LEFT_HOLD_LATE_NS` past a hold on trial the thread wakes for it, so
/// that it finds the hold that late and counts it as left.
const LEFT_HOLD_RING_MARGIN_NS: u64 = 20_000;

impl Engine {
    /// [`Engine::poll_cq`] on a working device, at `now`.
    pub(super) fn poll_cq_round(
        &self,
        st: &mut State,
        now: u64,
        cq: CqId,
        max: usize,
        out: &mut Vec<WorkCompletion>,
        trial: &mut bool,
    ) -> Result<usize, VerbsError> {
        let holding = matches!(st.deferred, Deferred::AcksUntil { until, .. } if now < until);
        match st.deferred {
            Deferred::Requests => {
                progress::progress_once(&self.shared, st);
            }
            Deferred::AcksUntil { answer_from, .. } if !holding => {
                // The hold ran out, but completions the application has yet to take come
                // first: its answer to them can still carry the ACKs. Under emulation (a
                // guest without KVM) the application takes tens of microseconds between the
                // poll that received a message and the post that answers it. Each such poll
                // takes completions stored earlier, so a poll that finds none, and sends,
                // comes soon. That poll sends only what was held: what it receives next
                // below is held afresh, for the answer to it.
                let n = st.dev.poll_cq(cq, max, out)?;
                if n > 0 {
                    return Ok(n);
                }
                if answer_from == Some(st.dev.completions_stored()) {
                    // An answer's hold ran out and this side's ACK never came. Now and then
                    // the peer was only late; but when it holds that ACK for the same reason
                    // (both sides sent a message at once, and each waits for its ACK before
                    // it sends again), both stall this long on every turn: after a few in a
                    // row, holds stay short for a while.
                    self.shared
                        .counters
                        .answer_holds_ran_out
                        .fetch_add(1, Ordering::Relaxed);
                    st.answer_holds.ran_out(
                        now,
                        ANSWER_HOLDS_RUN_OUT_IN_A_ROW,
                        ANSWER_HOLDS_OFF_NS,
                    );
                } else if answer_from.is_none() {
                    // The application took every completion of the CQ it polls and posted
                    // nothing: a receiver that does not answer (a stream of SENDs into it).
                    // (A post to any QP counts as an answer, so a ping-pong on one QP keeps a
                    // stream into another under holds.)
                    self.shared
                        .counters
                        .ack_holds_ran_out
                        .fetch_add(1, Ordering::Relaxed);
                    st.ack_holds
                        .ran_out(now, ACK_HOLDS_RUN_OUT_IN_A_ROW, ACK_HOLDS_OFF_NS);
                }
                progress::send(&self.shared, st, now);
            }
            _ => {}
        }
        let n = st.dev.poll_cq(cq, max, out)?;
        if n > 0 {
            if st.ack_holds.off_at(now) && st.deferred == Deferred::Nothing {
                // A receiver that does not answer, taking a round's completions a few at a
                // time: the frames that came meanwhile are taken now and their ACKs go,
                // instead of after the last of those completions. Its peer may wait for one
                // of them before it posts more (`ib_send_bw`'s sender, every 100th message,
                // whose packet its engine kicked early for this: see
                // `progress::KICK_SIGNALED_AFTER`). Not while ACKs are held for an answer,
                // nor when a message came that this side answers once its own ACK is in (a
                // ping-pong on another QP): the next empty poll treats those as it does.
                let answers = st.dev.answers_awaiting_acks();
                let received = progress::receive(&self.shared, st, now);
                if received > 0 {
                    self.shared
                        .counters
                        .rx_frames_while_draining
                        .fetch_add(received as u64, Ordering::Relaxed);
                    if st.dev.answers_awaiting_acks() == answers {
                        progress::send(&self.shared, st, now);
                    }
                }
            }
            return Ok(n);
        }
        let completions = st.dev.completions_stored();
        let requests = st.dev.ack_only_requests();
        let answers = st.dev.answers_awaiting_acks();
        progress::receive(&self.shared, st, now);
        if st.dev.completions_stored() != completions || st.dev.ack_only_requests() != requests {
            if st.dev.completion_events_used() {
                // An application that learns of completions from its completion channel: a
                // held ACK would reach the peer behind the answer, and the peer's events would
                // come in an order no RDMA NIC gives (see `progress::thread_round`). The ACKs
                // go now.
                progress::send(&self.shared, st, now);
                return st.dev.poll_cq(cq, max, out);
            }
            match st.deferred {
                Deferred::Nothing
                    if (st.ack_holds.off_at(now) && st.dev.answers_awaiting_acks() == answers)
                        || st.left_holds.off_at(now) =>
                {
                    // A receiver that has not been answering (see `ACK_HOLDS_OFF_NS`), or
                    // that leaves its verbs without answering (see `LeftHolds`): its peer's
                    // send queue waits for these ACKs, which go now, before the application
                    // takes its completions.
                    progress::send(&self.shared, st, now);
                }
                // Only an ACK for this side came (a send completion): nothing to hold. (Held,
                // the application's next post took it for an answer to a hold, see
                // `LeftHolds`.)
                Deferred::Nothing if !st.dev.transmit_queued() => {}
                Deferred::Nothing => {
                    // A message that came while this side waits for the ACK of its own (a
                    // ping-pong turn) is ahead of that ACK in the peer's kick, and the
                    // application answers once the ACK is in. On veth the ACK arrives a
                    // kernel pass (2-4 µs here) behind the message, often more than
                    // `ACK_HOLD_NS` on a busy host; the hold then sent this side's ACK
                    // alone, and a peer spinning on memory took its completion, left its
                    // verbs, and needed its progress thread for the answer behind it.
                    let answer =
                        st.dev.answers_awaiting_acks() != answers && !st.answer_holds.off_at(now);
                    let hold = if answer { ANSWER_HOLD_NS } else { ACK_HOLD_NS };
                    st.deferred = Deferred::AcksUntil {
                        until: now + hold,
                        answer_from: answer.then(|| st.dev.completions_stored()),
                        by_poll: true,
                    };
                    if st.left_holds.on_trial() {
                        // This application left a hold before: should it leave this one too,
                        // the thread sends it about `LEFT_HOLD_LATE_NS` late, not after its
                        // sleep (naps of up to `nap_alarm::MAX_POSTPONE_NS` next to a steady
                        // poller, or a transport timer's wait tens of milliseconds long).
                        let at = now + hold + LEFT_HOLD_LATE_NS + LEFT_HOLD_RING_MARGIN_NS;
                        self.shared.nap_alarm.ring_for_hold(now, at);
                        *trial = true;
                    }
                    if answer {
                        self.shared
                            .counters
                            .answer_holds
                            .fetch_add(1, Ordering::Relaxed);
                    }
                }
                Deferred::AcksUntil {
                    until,
                    answer_from: Some(c),
                    by_poll,
                } if c != st.dev.completions_stored() => {
                    // The ACK the answer waited for (or another completion) is in: from here
                    // the application answers at once or not at all.
                    st.deferred = Deferred::AcksUntil {
                        until: until.min(now + ACK_HOLD_NS),
                        answer_from: None,
                        by_poll,
                    };
                    st.answer_holds.in_a_row = 0;
                }
                _ => {}
            }
            // What a hold leaves unsent must not include frames built already.
            let _ = st.io.port.send_kept();
            return st.dev.poll_cq(cq, max, out);
        }
        if holding {
            // Nothing new: the application is between taking a completion and answering
            // (or waits on another CQ); the held ACKs may still ride with the answer. Frames
            // built already do not wait for them (an error is the next flush's).
            let _ = st.io.port.send_kept();
            return Ok(0);
        }
        // Frames held while the interface is down wait for it (the progress thread kicks them
        // when it comes back): a poll asks the kernel again only when the transport has work.
        if !st.dev.has_work(now) && (!st.io.port.tx_pending() || st.io.link_down) {
            // Nothing to send, no timer due: an application waiting for its peer. Skipping
            // the transmit round halves an empty poll, and a frame that lands meanwhile is
            // noticed that much sooner.
            st.deferred = Deferred::Nothing;
            return Ok(0);
        }
        progress::send(&self.shared, st, now);
        st.dev.poll_cq(cq, max, out)
    }
}

#[cfg(test)]
mod tests {
    use super::{LeftHolds, LEFT_HOLDS_MAX_DOUBLINGS, LEFT_HOLDS_OFF_NS};

    /// Each hold left turns holds off for a spell twice as long as the last, up to the
    /// limit; a hold answered makes the next spell the shortest again.
    #[test]
    fn left_holds_turn_holds_off_for_spells_that_double_until_one_is_answered() {
        let mut holds = LeftHolds::default();
        assert!(!holds.off_at(0));
        let mut now = 1_000;
        for spell in 0..LEFT_HOLDS_MAX_DOUBLINGS + 3 {
            holds.left(now);
            let off = LEFT_HOLDS_OFF_NS << spell.min(LEFT_HOLDS_MAX_DOUBLINGS);
            assert!(holds.off_at(now + off - 1), "spell {spell}");
            assert!(!holds.off_at(now + off), "spell {spell}");
            now += off;
        }
        holds.answered();
        holds.left(now);
        assert!(holds.off_at(now + LEFT_HOLDS_OFF_NS - 1));
        assert!(!holds.off_at(now + LEFT_HOLDS_OFF_NS));
    }
}
