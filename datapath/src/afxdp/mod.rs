//! AF_XDP sockets, written directly on the kernel's socket interface (`libc`).
//!
//! Why not a crate: see `docs/decisions.md` ("AF_XDP rings"). In short, xsk-rs builds libxdp and
//! libbpf from C and does not expose multi-buffer descriptors, and xdpilone is EUPL-1.2; the
//! rings themselves are a few hundred lines.
//!
//! - [`ring`](self): the four shared rings (fill, completion, RX, TX);
//! - [`XskSocket`]: a socket with its own UMEM in ordinary pages, bound to one queue, zero-copy
//!   when the driver supports it and copy mode otherwise, multi-buffer (`XDP_USE_SG`) always on.

mod ring;
mod socket;

pub use socket::{BindMode, XskConfig, XskError, XskSocket, XskStats, FRAME_SIZE};
