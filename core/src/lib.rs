//! xroce core: RoCEv2 in userspace.
//!
//! * [`wire`]: the RoCEv2 wire format (Ethernet, IPv4/IPv6, UDP, BTH and extension headers),
//!   zero-copy views plus plain `Repr` structs, and the frame builder.
//! * [`icrc`]: the invariant CRC, bit-exact with Linux rdma_rxe.
//!
//! The transport (queue pairs, completion queues, retransmission) will live beside these as a
//! sans-IO state machine.

#![forbid(unsafe_code)]

pub mod icrc;
pub mod transport;
pub mod wire;
