//! The InfiniBand transport as a sans-IO state machine (issue 3, in progress).
//!
//! The finished transport will take `(now, frame)` and `(now, verb)` and yield frames,
//! completions, async events and its next deadline, never reading a clock or touching a socket.
//! What exists so far are the pieces every queue pair stands on:
//!
//! * [`qp_state`]: QP states, the attributes a modify carries, the IBTA transition table as
//!   Linux enforces it, and rdma_rxe's timer and MTU rules;
//! * [`memory`]: protection domains and memory regions with unpredictable keys, access rights
//!   and bounds checks.
//!
//! Not yet written: completion queues, SRQs, address handles, and the requester, responder and
//! completer themselves.

pub mod memory;
pub mod qp_state;
