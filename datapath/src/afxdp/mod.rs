//! AF_XDP sockets, written directly on the kernel's socket interface (`libc`).
//!
//! Why not a crate: see `docs/decisions.md` ("AF_XDP rings"). In short, xsk-rs builds libxdp and
//! libbpf from C and does not expose multi-buffer descriptors, and xdpilone is EUPL-1.2; the
//! rings themselves are a few hundred lines.
//!
//! - [`ring`](self): the four shared rings (fill, completion, RX, TX);
//! - [`XskSocket`]: a socket with its own UMEM, bound to one queue, zero-copy
//!   when the driver supports it and copy mode otherwise, multi-buffer (`XDP_USE_SG`) whenever
//!   the kernel has it (6.6 and later; [`kernel_supports_multi_buffer`]);
//! - `umem`: a socket's UMEM, anonymous memory (no hugetlbfs), in transparent huge pages where
//!   the kernel gives them;
//! - [`QueueSet`]: an engine's sockets on every receive queue of an interface with several;
//! - `zero_copy`: drivers whose zero-copy is known to lose frames, which auto mode binds in
//!   copy mode;
//! - `eviction`: a copy-mode socket evicts the cache lines of the frames it received, so that
//!   the kernel's next copy into those UMEM frames (on another CPU) finds them free.

mod channels;
mod eviction;
mod queue_set;
mod ring;
mod socket;
mod umem;
mod zero_copy;

pub use channels::receive_queues_in_use;
pub use queue_set::{QueueSet, RECEIVE_ONLY};
pub use socket::{
    binds_multi_buffer, fits_one_frame, kernel_supports_multi_buffer, port_path_mtu, BindMode,
    XskConfig, XskError, XskSocket, XskStats, BIND_MODE_ENV, FRAME_SIZE,
};
pub use zero_copy::auto_mode_avoids_zero_copy;
