//! The verbs: libibverbs calls these through the ops table below; each turns the C arguments
//! into the transport's types and calls the engine.
//!
//! Every object the provider hands out is a `#[repr(C)]` struct whose first field is the public
//! libibverbs struct (`ibv_pd`, `ibv_cq`, ...), so the pointer the application holds is also a
//! pointer to the provider's object.

mod ah;
mod cq;
mod pd_mr;
mod post;
mod qp;
mod srq;

use libc::c_int;
use xroce_core::transport::verbs::VerbsError;

use crate::abi::driver::verbs_context_ops;

pub use ah::XroceAh;
pub use cq::XroceCq;
pub use pd_mr::{XroceMr, XrocePd};
pub use qp::XroceQp;
pub use srq::XroceSrq;

struct SyncOps(verbs_context_ops);
// SAFETY: an immutable table of function pointers.
unsafe impl Sync for SyncOps {}

static CONTEXT_OPS: SyncOps = SyncOps(verbs_context_ops {
    advise_mr: None,
    alloc_dm: None,
    alloc_mw: None,
    alloc_null_mr: None,
    alloc_parent_domain: None,
    alloc_pd: Some(pd_mr::alloc_pd),
    alloc_td: None,
    async_event: Some(crate::device::async_event),
    attach_counters_point_flow: None,
    attach_mcast: None,
    bind_mw: None,
    close_xrcd: None,
    cq_event: Some(cq::cq_event),
    create_ah: Some(ah::create_ah),
    create_counters: None,
    create_cq: Some(cq::create_cq),
    create_cq_ex: None,
    create_flow: None,
    create_flow_action_esp: None,
    create_qp: Some(qp::create_qp),
    create_qp_ex: None,
    create_rwq_ind_table: None,
    create_srq: Some(srq::create_srq),
    create_srq_ex: None,
    create_wq: None,
    dealloc_mw: None,
    dealloc_pd: Some(pd_mr::dealloc_pd),
    dealloc_td: None,
    dereg_mr: Some(pd_mr::dereg_mr),
    destroy_ah: Some(ah::destroy_ah),
    destroy_counters: None,
    destroy_cq: Some(cq::destroy_cq),
    destroy_flow: None,
    destroy_flow_action: None,
    destroy_qp: Some(qp::destroy_qp),
    destroy_rwq_ind_table: None,
    destroy_srq: Some(srq::destroy_srq),
    destroy_wq: None,
    detach_mcast: None,
    free_context: Some(crate::device::free_context),
    free_dm: None,
    get_srq_num: None,
    import_dm: None,
    import_mr: None,
    import_pd: None,
    modify_cq: None,
    modify_flow_action_esp: None,
    modify_qp: Some(qp::modify_qp),
    modify_qp_rate_limit: None,
    modify_srq: Some(srq::modify_srq),
    modify_wq: None,
    open_qp: None,
    open_xrcd: None,
    poll_cq: Some(cq::poll_cq),
    post_recv: Some(post::post_recv),
    post_send: Some(post::post_send),
    post_srq_ops: None,
    post_srq_recv: Some(post::post_srq_recv),
    query_device_ex: Some(crate::device::query_device_ex),
    query_ece: None,
    query_port: Some(crate::device::query_port),
    query_qp: Some(qp::query_qp),
    query_qp_data_in_order: None,
    query_rt_values: None,
    query_srq: Some(srq::query_srq),
    read_counters: None,
    reg_dm_mr: None,
    reg_dmabuf_mr: None,
    reg_mr: Some(pd_mr::reg_mr),
    req_notify_cq: Some(cq::req_notify_cq),
    rereg_mr: None,
    resize_cq: None,
    set_ece: None,
    unimport_dm: None,
    unimport_mr: None,
    unimport_pd: None,
});

/// The ops table `verbs_set_ops` copies into every xroce context.
pub fn context_ops() -> *const verbs_context_ops {
    &CONTEXT_OPS.0
}

/// The errno a verb returns for a transport error.
fn errno(e: &VerbsError) -> c_int {
    e.errno()
}

/// Initialises a pthread mutex and condition variable embedded in a libibverbs struct (the
/// QP's and SRQ's, which libibverbs leaves to the provider for `ibv_create_qp`).
///
/// # Safety
/// Both must point at writable, otherwise unused storage of their types.
unsafe fn init_sync(mutex: *mut libc::pthread_mutex_t, cond: *mut libc::pthread_cond_t) {
    // SAFETY: per the contract.
    unsafe {
        libc::pthread_mutex_init(mutex, std::ptr::null());
        libc::pthread_cond_init(cond, std::ptr::null());
    }
}
