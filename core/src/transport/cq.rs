//! Completion queues with a fixed capacity.

use std::collections::VecDeque;

use super::verbs::WorkCompletion;

/// A completion queue handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CqId(pub u32);

/// How a CQ is armed for its next completion event (`ibv_req_notify_cq`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Armed {
    No,
    Any,
    SolicitedOnly,
}

/// What happened when a completion was pushed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pushed {
    Stored {
        notify: bool,
    },
    /// The CQ was full: the completion was not stored. `first` when it is the first one lost
    /// since a completion was last stored (the overrun to report as `IBV_EVENT_CQ_ERR`).
    Overflow {
        first: bool,
    },
}

/// A completion queue. Completions are stored up to its capacity; one more is an overrun: it is
/// not stored (nothing stored is overwritten), and the first of a run of them is reported as
/// `IBV_EVENT_CQ_ERR`. What the overrun does to the QP is the transport's to decide.
#[derive(Debug)]
pub struct CompletionQueue {
    capacity: usize,
    entries: VecDeque<WorkCompletion>,
    armed: Armed,
    overflowed: bool,
    /// Completions were lost and none has been stored since.
    overrunning: bool,
    /// Armed at least once (see [`CompletionQueue::notifies`]).
    notifies: bool,
}

/// The capacity rdma_rxe gives a CQ asked for `cqe` entries: its queue has a power-of-two
/// number of slots, one more than the entries it must hold, and every slot but one is usable
/// (`rxe_queue_init`), so 1 stays 1, 4 becomes 7 and 512 becomes 1023. Verbs reports it as the
/// CQ's `cqe`, and programs tried on rdma_rxe (or on a NIC, which rounds up too) may rely on it.
/// Asked for more than 2^31 - 1 (far above any device's `max_cqe`), it gives `u32::MAX`.
pub fn rounded_capacity(cqe: u32) -> u32 {
    cqe.checked_add(1)
        .and_then(u32::checked_next_power_of_two)
        .map_or(u32::MAX, |slots| slots - 1)
}

impl CompletionQueue {
    pub fn new(capacity: usize) -> Self {
        CompletionQueue {
            capacity,
            entries: VecDeque::with_capacity(capacity.min(4096)),
            armed: Armed::No,
            overflowed: false,
            overrunning: false,
            notifies: false,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// True once a completion was lost to an overrun.
    pub fn overflowed(&self) -> bool {
        self.overflowed
    }

    pub(crate) fn push(&mut self, wc: WorkCompletion) -> Pushed {
        if self.entries.len() >= self.capacity {
            self.overflowed = true;
            let first = !self.overrunning;
            self.overrunning = true;
            return Pushed::Overflow { first };
        }
        self.overrunning = false;
        self.entries.push_back(wc);
        let notify = match self.armed {
            Armed::No => false,
            Armed::Any => true,
            // A completion with an error status also fires a solicited-only arm (IBTA o11-4.2.1).
            Armed::SolicitedOnly => wc.solicited || wc.status != super::WcStatus::Success,
        };
        if notify {
            self.armed = Armed::No;
        }
        Pushed::Stored { notify }
    }

    /// Moves up to `max` completions, oldest first, into `out`; returns how many.
    pub fn poll(&mut self, max: usize, out: &mut Vec<WorkCompletion>) -> usize {
        let n = max.min(self.entries.len());
        if n == 0 {
            // An application spinning on an empty CQ comes here in every poll: no drain set up.
            return 0;
        }
        out.extend(self.entries.drain(..n));
        n
    }

    /// Arms the CQ: the next completion (only a solicited one when `solicited_only`) raises a
    /// notification. True the first time the CQ is armed.
    pub fn req_notify(&mut self, solicited_only: bool) -> bool {
        self.armed = if solicited_only {
            Armed::SolicitedOnly
        } else {
            Armed::Any
        };
        !std::mem::replace(&mut self.notifies, true)
    }

    /// Its application has armed it (`ibv_req_notify_cq`) at least once: it learns of this
    /// CQ's completions from its completion channel.
    pub fn notifies(&self) -> bool {
        self.notifies
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::device::limits::MAX_CQE;

    /// rdma_rxe's sizes (`rxe_queue_init`): one slot is kept free in a power-of-two queue.
    #[test]
    fn a_cq_holds_what_rdma_rxe_rounds_its_size_up_to() {
        for (asked, holds) in [
            (1, 1),
            (2, 3),
            (3, 3),
            (4, 7),
            (100, 127),
            (512, 1023),
            (1023, 1023),
            (1024, 2047),
            (MAX_CQE, MAX_CQE),
            (u32::MAX, u32::MAX),
        ] {
            assert_eq!(rounded_capacity(asked), holds, "asked for {asked}");
        }
    }
}
