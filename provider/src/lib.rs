//! `libxroce_provider.so`: the libibverbs provider that makes xroce an RDMA device.
//!
//! libibverbs (rdma-core 36 to 58: see [`abi::version`]) finds the device
//! through the sysfs tree `xroce link add` generates, matches this provider by the device's
//! modalias (`xroce:NAME`), and calls the ops in [`verbs`]. Everything rdma_rxe's provider would
//! send to a kernel is done here, in the application's process, by an
//! [`xroce_datapath::engine::Engine`] bound to the device's netdev.
//!
//! - [`abi`]: every C layout shared with libibverbs, and the release check.
//! - [`register`]: the load-time constructor that registers the provider.
//! - [`device`]: device and context allocation, device and port queries.
//! - [`engines`]: one engine per netdev per process, started on first use.
//! - [`event_routes`]: where each engine's events go (completion channels, async events).
//! - [`verbs`]: PD, MR, CQ, QP, SRQ, AH and the data path ops.
//! - [`port_events`]: port up/down and GID changes as asynchronous events.
//! - `destroyed_events`: a destroyed object's unread events dropped, the others waited for.
//! - [`comp_channel`]: `ibv_create_comp_channel` for xroce contexts (an interposer, because it
//!   is not a provider op), and `ibv_get_cq_event`, whose wait takes the engine's frames.
//! - [`discovery`]: keeps libibverbs on the generated sysfs tree on kernels that have RDMA
//!   (interposes `ibv_get_device_list` and `socket` under `xroce exec`).

pub mod abi;
pub mod comp_channel;
mod destroyed_events;
pub mod device;
pub mod discovery;
pub mod engines;
pub mod event_routes;
pub mod port_events;
pub mod rdma_cm;
pub mod register;
pub mod state_dump;
pub mod verbs;

/// Sets the calling thread's `errno` (ops that return pointers report errors this way).
pub(crate) fn set_errno(e: libc::c_int) {
    // SAFETY: `__errno_location` returns the calling thread's errno slot.
    unsafe { *libc::__errno_location() = e };
}
