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
    /// The CQ was full: the completion could not be stored and the CQ is now in error.
    Overflow,
}

/// A completion queue. Completions are stored up to the capacity given at creation; one more is
/// an overrun, which puts the CQ in error (reported once as `IBV_EVENT_CQ_ERR`) rather than
/// overwriting or silently dropping entries.
#[derive(Debug)]
pub struct CompletionQueue {
    capacity: usize,
    entries: VecDeque<WorkCompletion>,
    armed: Armed,
    overflowed: bool,
}

impl CompletionQueue {
    pub fn new(capacity: usize) -> Self {
        CompletionQueue {
            capacity,
            entries: VecDeque::with_capacity(capacity.min(4096)),
            armed: Armed::No,
            overflowed: false,
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
            return Pushed::Overflow;
        }
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
        out.extend(self.entries.drain(..n));
        n
    }

    /// Arms the CQ: the next completion (only a solicited one when `solicited_only`) raises a
    /// notification.
    pub fn req_notify(&mut self, solicited_only: bool) {
        self.armed = if solicited_only {
            Armed::SolicitedOnly
        } else {
            Armed::Any
        };
    }
}
