//! Which QPs have a timer due, among any number of QPs, without looking at each of them.
//!
//! A QP's timers (retransmission, tail-loss probe, RNR wait) move on almost every packet: the
//! retransmission timer restarts on each ACK, the probe is re-armed behind each packet that
//! asks for one. The device keeps a min-heap of entries, one live entry per QP with a timer,
//! at a time no later than that QP's earliest timer ([`Qp::timer_entry`] says which entry is
//! live). The heap is touched only when a QP's earliest timer moves before its entry (a new
//! entry; the old one goes stale), and when an entry is reached: the QP's timers are read
//! again, and it is due, or it gets an entry at its new time. A timer that moves later, the
//! common case, costs nothing, and finding the due QPs costs a heap operation for each entry
//! reached. Before, the device kept only the earliest time and, whenever that was reached,
//! read every QP's timers twice: with `ib_write_bw` streaming between two namespaces, 1.5 % of
//! the sending process's samples with 256 QPs, 7 % with 1 024.
//!
//! Stale entries are skipped when they are reached, and taken off the top of the heap after
//! each call, so that the earliest entry left belongs to a running timer (an engine's progress
//! thread sleeps until it). So that a QP whose timer keeps jumping back and forth cannot fill
//! the heap with far-off stale entries, the heap is rebuilt from the live ones when it holds
//! more than twice as many entries as there are QPs, plus [`SLACK`].

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use rustc_hash::FxHashMap as HashMap;

use super::qp::Qp;
use super::Nanos;

/// Entries kept beyond twice the QPs before the heap is rebuilt (so that a device with few
/// QPs does not rebuild it over and over). Small in the unit tests, so that they rebuild it.
const SLACK: usize = if cfg!(test) { 4 } else { 64 };

/// The QPs' timer entries, earliest first.
#[derive(Debug, Default)]
pub(crate) struct QpTimers {
    heap: BinaryHeap<Reverse<(Nanos, u32)>>,
    /// Times the heap was rebuilt (for the unit tests).
    #[cfg(test)]
    rebuilds: u32,
}

impl QpTimers {
    /// No QP's timer is due before this; `None` when no QP has one. A lower bound: a QP whose
    /// timer moved later since is found not due when its entry is reached.
    pub(crate) fn earliest(&self) -> Option<Nanos> {
        self.heap.peek().map(|Reverse((t, _))| *t)
    }

    /// Entries in the heap, live and stale (for the state dump and the tests).
    pub(crate) fn len(&self) -> usize {
        self.heap.len()
    }

    /// Takes note of `qp`'s earliest timer after something may have armed or moved it: a new
    /// entry when the timer is now earlier than the QP's entry, or the QP has none.
    pub(crate) fn note(&mut self, qp: &mut Qp) {
        if let Some(t) = qp.next_deadline() {
            if qp.timer_entry.is_none_or(|e| t < e) {
                qp.timer_entry = Some(t);
                self.heap.push(Reverse((t, qp.qpn)));
            }
        }
    }

    /// The QPs with a timer due at `now`, in QPN order (the QP table is a hash map; the
    /// order keeps runs repeatable). Their entries are taken: each is to run its timers and
    /// be noted again ([`Self::note`]). QPs reached whose timers moved later get an entry at
    /// their new time.
    pub(crate) fn take_due(&mut self, now: Nanos, qps: &mut HashMap<u32, Qp>) -> Vec<u32> {
        let mut due = Vec::new();
        while let Some(&Reverse((t, qpn))) = self.heap.peek() {
            if t > now {
                break;
            }
            self.heap.pop();
            let Some(qp) = live_entry_qp(qps, t, qpn) else {
                continue;
            };
            qp.timer_entry = None;
            match qp.next_deadline() {
                Some(d) if d <= now => due.push(qpn),
                Some(_) => self.note(qp),
                None => {}
            }
        }
        due.sort_unstable();
        self.drop_stale_top(qps);
        self.compact_if_stale(qps);
        due
    }

    /// Takes the entries off the top of the heap that stand for no running timer (their QP is
    /// gone, has a newer entry, or has no timer left), so that [`Self::earliest`] is a running
    /// timer's entry, or a time before which a timer moved later: after a stream over many QPs
    /// stops, each stopped QP's entry would otherwise wake the engine once. Entries of QPs
    /// whose timers moved later stay: pushing those again would cost a heap operation for
    /// nearly every streaming QP on every call.
    fn drop_stale_top(&mut self, qps: &mut HashMap<u32, Qp>) {
        while let Some(&Reverse((t, qpn))) = self.heap.peek() {
            if let Some(qp) = live_entry_qp(qps, t, qpn) {
                if qp.next_deadline().is_some() {
                    return;
                }
                qp.timer_entry = None;
            }
            self.heap.pop();
        }
    }

    /// Forgets every entry; the caller has cleared every QP's timers (the device failed).
    pub(crate) fn clear(&mut self, qps: &mut HashMap<u32, Qp>) {
        self.heap.clear();
        for qp in qps.values_mut() {
            qp.timer_entry = None;
        }
    }

    /// Rebuilds the heap from the live entries when it holds more than twice as many entries
    /// as there are QPs, plus [`SLACK`].
    fn compact_if_stale(&mut self, qps: &HashMap<u32, Qp>) {
        if self.heap.len() <= 2 * qps.len() + SLACK {
            return;
        }
        self.heap = qps
            .values()
            .filter_map(|qp| qp.timer_entry.map(|t| Reverse((t, qp.qpn))))
            .collect();
        #[cfg(test)]
        {
            self.rebuilds += 1;
        }
    }

    /// Whether every QP with a timer has a live entry no later than it, and the earliest
    /// entry is no later than any timer (checked by test builds, where a path that armed a
    /// timer without noting it would make it fire late).
    pub(crate) fn covers(&self, qps: &HashMap<u32, Qp>) -> bool {
        qps.values().all(|qp| {
            qp.next_deadline().is_none_or(|d| {
                qp.timer_entry.is_some_and(|e| e <= d) && self.earliest().is_some_and(|e| e <= d)
            })
        })
    }

    /// Whether the heap holds an entry `(t, qpn)` (the unit tests check that live entries are
    /// in it).
    #[cfg(test)]
    fn holds(&self, t: Nanos, qpn: u32) -> bool {
        self.heap.iter().any(|Reverse(e)| *e == (t, qpn))
    }

    /// The earliest entry (for the unit tests).
    #[cfg(test)]
    fn top(&self) -> Option<(Nanos, u32)> {
        self.heap.peek().map(|Reverse(e)| *e)
    }
}

/// The QP whose live entry `(t, qpn)` is; `None` for a stale entry (its QP was destroyed, or
/// a newer entry of its QP replaced it).
fn live_entry_qp(qps: &mut HashMap<u32, Qp>, t: Nanos, qpn: u32) -> Option<&mut Qp> {
    qps.get_mut(&qpn).filter(|qp| qp.timer_entry == Some(t))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::cq::CqId;
    use crate::transport::memory::PdId;
    use crate::transport::qp::{QpCap, QpInit};
    use crate::transport::qp_state::QpType;

    fn qp(qpn: u32) -> Qp {
        let init = QpInit {
            ty: QpType::Rc,
            pd: PdId(1),
            send_cq: CqId(1),
            recv_cq: CqId(1),
            srq: None,
            cap: QpCap::default(),
            sq_sig_all: false,
        };
        Qp::new(qpn, &init)
    }

    /// A deterministic stream of numbers (xorshift64).
    struct Numbers(u64);
    impl Numbers {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

    /// Random timers armed, moved and cleared on 50 QPs while time goes on: each call finds
    /// exactly the QPs a scan of every QP finds due, and those QPs only.
    #[test]
    fn finds_what_a_scan_of_every_qp_finds() {
        let mut rebuilds = 0;
        for seed in 1..=20u64 {
            let mut n = Numbers(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let mut qps: HashMap<u32, Qp> = HashMap::default();
            let mut timers = QpTimers::default();
            let mut now: Nanos = 1_000;
            let mut found = 0;
            for step in 0..4_000 {
                let qpn = 17 + n.below(50) as u32;
                match n.below(10) {
                    // A QP destroyed, or made anew under a QPN used before.
                    0 => {
                        if qps.remove(&qpn).is_none() {
                            qps.insert(qpn, qp(qpn));
                        }
                    }
                    // A timer armed or moved, earlier or later, or stopped.
                    1..=6 => {
                        if let Some(q) = qps.get_mut(&qpn) {
                            // Now and then a far timer, which keeps the stale entries
                            // behind it in the heap until a rebuild.
                            let at = if n.below(8) == 0 {
                                now + 1_000_000 + n.below(1_000)
                            } else {
                                now + n.below(5_000)
                            };
                            match n.below(4) {
                                0 => q.comp.retrans_deadline = Some(at),
                                1 => q.comp.probe_deadline = Some(at),
                                2 => q.comp.rnr_deadline = Some(at),
                                _ => q.comp.probe_deadline = None,
                            }
                            timers.note(q);
                        }
                    }
                    // Time goes on and the due QPs run their timers.
                    _ => {
                        now += n.below(2_000);
                        let mut expected: Vec<u32> = qps
                            .values()
                            .filter(|q| q.next_deadline().is_some_and(|d| d <= now))
                            .map(|q| q.qpn)
                            .collect();
                        expected.sort_unstable();
                        let due = timers.take_due(now, &mut qps);
                        assert_eq!(due, expected, "seed {seed}, step {step}, now {now}");
                        found += due.len();
                        assert!(timers.len() <= 2 * qps.len() + SLACK, "seed {seed}");
                        // What is left on top stands for a running timer, so an engine
                        // does not wake for a stopped one.
                        if let Some((t, qpn)) = timers.top() {
                            let q = &qps[&qpn];
                            assert_eq!(q.timer_entry, Some(t), "seed {seed}, step {step}");
                            assert!(q.next_deadline().is_some(), "seed {seed}, step {step}");
                        }
                        for qpn in due {
                            let q = qps.get_mut(&qpn).expect("due QPs exist");
                            for d in [
                                &mut q.comp.retrans_deadline,
                                &mut q.comp.probe_deadline,
                                &mut q.comp.rnr_deadline,
                            ] {
                                if d.is_some_and(|d| d <= now) {
                                    *d = None;
                                }
                            }
                            timers.note(q);
                        }
                    }
                }
                assert!(timers.covers(&qps), "seed {seed}, step {step}");
                for q in qps.values() {
                    if let Some(t) = q.timer_entry {
                        assert!(timers.holds(t, q.qpn), "seed {seed}, step {step}");
                    }
                }
                assert!(
                    timers
                        .earliest()
                        .is_none_or(|e| qps.values().filter_map(Qp::next_deadline).all(|d| e <= d)),
                    "the earliest entry is later than a timer (seed {seed}, step {step})"
                );
            }
            assert!(found > 100, "seed {seed}: only {found} timers came due");
            rebuilds += timers.rebuilds;
        }
        assert!(rebuilds > 0, "no seed rebuilt the heap");
    }

    /// A QP whose timer jumps between a far and a near time on every turn leaves a stale far
    /// entry each time: the heap is rebuilt before those pile up.
    #[test]
    fn stale_entries_do_not_pile_up() {
        let mut qps: HashMap<u32, Qp> = HashMap::default();
        let mut timers = QpTimers::default();
        for qpn in 100..104 {
            qps.insert(qpn, qp(qpn));
        }
        let far = 1 << 50;
        // A QP whose timer runs all along, between the near and the far times: the far
        // entries left stale behind it are never on top of the heap.
        let mut steady = qp(99);
        steady.comp.retrans_deadline = Some(far / 2);
        timers.note(&mut steady);
        qps.insert(99, steady);
        let mut now = 0;
        let mut largest = 0;
        for _ in 0..10_000 {
            for q in qps.values_mut().filter(|q| q.qpn != 99) {
                q.comp.retrans_deadline = Some(far);
                timers.note(q);
                q.comp.probe_deadline = Some(now + 10);
                timers.note(q);
            }
            largest = largest.max(timers.len());
            now += 10;
            let due = timers.take_due(now, &mut qps);
            assert_eq!(due, vec![100, 101, 102, 103]);
            for q in qps.values_mut().filter(|q| q.qpn != 99) {
                q.comp.probe_deadline = None;
                timers.note(q);
            }
        }
        // Each turn pushes two entries a QP on top of what the last rebuild left.
        assert!(
            largest <= 2 * qps.len() + SLACK + 2 * qps.len(),
            "{largest} entries"
        );
        assert!(timers.rebuilds > 0);
        assert!(timers.covers(&qps));
        assert_eq!(timers.earliest(), Some(far / 2));
        qps.remove(&99);

        // QPs destroyed with their entries: the entries go with the next call that reaches
        // them or rebuilds, and a QP made anew under one of their numbers starts without one.
        qps.remove(&101);
        qps.remove(&102);
        qps.insert(102, qp(102));
        assert_eq!(qps[&102].timer_entry, None);
        assert_eq!(timers.take_due(far, &mut qps), vec![100, 103]);
        assert_eq!(timers.len(), 0, "every entry was reached");

        // A device that failed: every timer stopped, every entry forgotten.
        for q in qps.values_mut() {
            q.comp.rnr_deadline = Some(far + 5);
            timers.note(q);
        }
        for q in qps.values_mut() {
            q.comp.rnr_deadline = None;
        }
        timers.clear(&mut qps);
        assert_eq!(timers.earliest(), None);
        assert!(qps.values().all(|q| q.timer_entry.is_none()));
    }

    /// After a stream stops, the entries of QPs whose timers stopped do not each wake the
    /// engine: the call that reaches the first takes the others off the top with it.
    #[test]
    fn stopped_timers_leave_no_entry_on_top() {
        let mut qps: HashMap<u32, Qp> = HashMap::default();
        let mut timers = QpTimers::default();
        for qpn in 200..210u32 {
            let mut q = qp(qpn);
            q.comp.retrans_deadline = Some(1_000 + u64::from(qpn));
            timers.note(&mut q);
            qps.insert(qpn, q);
        }
        // The ACKs came: every timer but the first stopped, the last one's moved later.
        for q in qps.values_mut().filter(|q| q.qpn != 200) {
            q.comp.retrans_deadline = None;
        }
        qps.get_mut(&209).expect("made above").comp.probe_deadline = Some(5_000);
        timers.note(qps.get_mut(&209).expect("made above"));
        assert_eq!(timers.take_due(1_200, &mut qps), vec![200]);
        let first = qps.get_mut(&200).expect("made above");
        first.comp.retrans_deadline = None;
        timers.note(first);
        // Not 1 201: the stopped timers' entries went with the call; the moved one's stays.
        assert_eq!(timers.earliest(), Some(1_209));
        assert_eq!(timers.take_due(1_209, &mut qps), Vec::<u32>::new());
        assert_eq!(timers.earliest(), Some(5_000));
        assert_eq!(timers.take_due(5_000, &mut qps), vec![209]);
    }
}
