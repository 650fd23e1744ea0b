//! Shared receive queues.

use std::collections::VecDeque;

use super::memory::PdId;
use super::verbs::RecvWr;

/// A shared receive queue handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SrqId(pub u32);

/// A receive queue that several QPs draw from. When the number of posted WQEs falls below an
/// armed limit, one SRQ-limit event is raised and the limit disarms (`ibv_modify_srq`).
#[derive(Debug)]
pub struct SharedReceiveQueue {
    pub pd: PdId,
    pub max_wr: usize,
    pub max_sge: usize,
    queue: VecDeque<RecvWr>,
    limit: u32,
}

impl SharedReceiveQueue {
    pub fn new(pd: PdId, max_wr: usize, max_sge: usize) -> Self {
        SharedReceiveQueue {
            pd,
            max_wr,
            max_sge,
            queue: VecDeque::new(),
            limit: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.queue.len()
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// Arms (non-zero) or disarms (zero) the limit event.
    pub fn set_limit(&mut self, limit: u32) {
        self.limit = limit;
    }

    pub(crate) fn push(&mut self, wr: RecvWr) -> bool {
        if self.queue.len() >= self.max_wr {
            return false;
        }
        self.queue.push_back(wr);
        true
    }

    /// Takes the oldest WQE. The flag is true when this take crossed the armed limit (the
    /// caller raises the event; the limit is now disarmed).
    pub(crate) fn take(&mut self) -> Option<(RecvWr, bool)> {
        let wr = self.queue.pop_front()?;
        let crossed = self.limit != 0 && (self.queue.len() as u64) < u64::from(self.limit);
        if crossed {
            self.limit = 0;
        }
        Some((wr, crossed))
    }
}
