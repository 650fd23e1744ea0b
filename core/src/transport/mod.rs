//! The InfiniBand transport as a sans-IO state machine: RC, UC and UD queue pairs as rdma_rxe
//! implements them, rebuilt so that a test can drive them deterministically.
//!
//! Nothing here reads a clock, sleeps, spawns or touches a socket. [`Device`] takes
//! `(now, packet)` and `(now, verb)` and yields packets, completions, events and its next
//! deadline (the shape of quinn-proto's `Connection`).
//!
//! * [`device`]: the objects of one device and the sans-IO interface;
//! * [`qp`]: a queue pair's attributes and queues; [`requester`], [`completer`] and
//!   [`responder`] are its three protocol engines (`rxe_req.c`, `rxe_comp.c`, `rxe_resp.c`);
//! * [`send_window`]: how far an RC requester runs ahead of its acknowledgements;
//! * [`round_trip`]: how long its ACKs take, and so when it probes for a lost tail;
//! * [`qp_state`]: states, the transition table, MTU and timer rules;
//! * [`memory`]: protection domains and memory regions with unpredictable keys;
//! * [`cq`], [`srq`], [`address`]: completion queues, shared receive queues, address vectors;
//! * [`verbs`]: work requests, completions, events and errors;
//! * [`host_memory`]: the bytes behind the regions.

pub mod address;
pub mod completer;
pub mod cq;
pub mod device;
mod handle_ids;
pub mod host_memory;
pub mod memory;
pub mod psn;
pub mod qp;
pub mod qp_state;
mod qp_timers;
mod report;
pub mod requester;
pub mod responder;
pub mod round_trip;
pub mod send_window;
mod sgl;
pub mod srq;
pub mod verbs;

pub use address::{AddressVector, AhId};
pub use cq::{CompletionQueue, CqId};
pub use device::{Counters, Device, DeviceConfig, Transmit, TX_TURN_PACKETS};
pub use host_memory::{HostMemory, MemFault, VecMemory};
pub use memory::{Access, MemoryRegion, MrId, PdId};
pub use qp::{QpAttr, QpCap, QpInit};
pub use qp_state::{AttrMask, PathMtu, QpState, QpType};
pub use srq::SrqId;
pub use verbs::{
    AsyncEvent, Event, RecvWr, SendFlags, SendOp, SendWr, Sge, UdDest, VerbsError, WcFlags,
    WcOpcode, WcStatus, WorkCompletion,
};

/// Time in nanoseconds, from any fixed origin the caller chooses.
pub type Nanos = u64;
