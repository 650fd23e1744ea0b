//! rdma-core's private provider interface (`libibverbs/driver.h`, `IBVERBS_PRIVATE_34` and
//! `_57`), as rdma-core 36..=58 lay it out (unchanged over those releases). No package ships this header, so the layouts are written here
//! from the rdma-core sources of those releases; `tests/abi_layout.rs` checks the sizes and
//! offsets libibverbs depends on (the `verbs_context_ops` slot count, the `verbs_device` and
//! `verbs_sysfs_dev` fields), and the end-to-end tests exercise every op through the real
//! libibverbs. [`super::version`] refuses any other libibverbs.

#![allow(non_camel_case_types)]

use libc::{c_char, c_int, c_void, timespec};

use super::verbs::{
    ibv_ah, ibv_ah_attr, ibv_comp_channel, ibv_context, ibv_cq, ibv_device, ibv_device_attr,
    ibv_mr, ibv_pd, ibv_port_attr, ibv_qp, ibv_qp_attr, ibv_qp_init_attr, ibv_recv_wr, ibv_send_wr,
    ibv_sge, ibv_srq, ibv_srq_attr, ibv_srq_init_attr, ibv_wc, verbs_context, IBV_SYSFS_NAME_MAX,
    IBV_SYSFS_PATH_MAX,
};

/// `struct list_node` (ccan): two pointers.
#[repr(C)]
pub struct list_node {
    pub next: *mut list_node,
    pub prev: *mut list_node,
}

/// `VERBS_MATCH_SENTINEL` / `VERBS_MATCH_MODALIAS`.
pub const VERBS_MATCH_SENTINEL: u8 = 0;
pub const VERBS_MATCH_MODALIAS: u8 = 2;

/// `struct verbs_match_ent`.
#[repr(C)]
pub struct verbs_match_ent {
    pub driver_data: *mut c_void,
    /// `u.modalias` (a C string) or `u.driver_id`.
    pub modalias: *const c_char,
    pub vendor: u16,
    pub device: u16,
    pub kind: u8,
}

/// `struct verbs_sysfs_dev`: a device libibverbs found in sysfs.
#[repr(C)]
pub struct verbs_sysfs_dev {
    pub entry: list_node,
    pub provider_data: *mut c_void,
    pub match_: *const verbs_match_ent,
    pub flags: u32,
    pub sysfs_name: [c_char; IBV_SYSFS_NAME_MAX],
    pub sysfs_cdev: libc::dev_t,
    pub ibdev_name: [c_char; IBV_SYSFS_NAME_MAX],
    pub ibdev_path: [c_char; IBV_SYSFS_PATH_MAX],
    pub modalias: [c_char; 512],
    pub node_guid: u64,
    pub driver_id: u32,
    pub node_type: c_int,
    pub ibdev_idx: c_int,
    pub num_ports: u32,
    pub abi_ver: u32,
    pub time_created: timespec,
}

/// `struct verbs_device_ops`.
#[repr(C)]
pub struct verbs_device_ops {
    pub name: *const c_char,
    pub match_min_abi_version: u32,
    pub match_max_abi_version: u32,
    pub match_table: *const verbs_match_ent,
    pub static_providers: *const *const verbs_device_ops,
    pub match_device: Option<unsafe extern "C" fn(*mut verbs_sysfs_dev) -> bool>,
    pub alloc_context:
        Option<unsafe extern "C" fn(*mut ibv_device, c_int, *mut c_void) -> *mut verbs_context>,
    pub import_context: Option<unsafe extern "C" fn(*mut ibv_device, c_int) -> *mut verbs_context>,
    pub alloc_device: Option<unsafe extern "C" fn(*mut verbs_sysfs_dev) -> *mut verbs_device>,
    pub uninit_device: Option<unsafe extern "C" fn(*mut verbs_device)>,
}

/// `struct verbs_device`: `struct ibv_device` first, then libibverbs' bookkeeping.
#[repr(C)]
pub struct verbs_device {
    pub device: ibv_device,
    pub ops: *const verbs_device_ops,
    pub refcount: c_int,
    pub entry: list_node,
    pub sysfs: *mut verbs_sysfs_dev,
    pub core_support: u64,
}

/// `struct verbs_mr`: what `dereg_mr` receives.
#[repr(C)]
pub struct verbs_mr {
    pub ibv_mr: ibv_mr,
    pub mr_type: c_int,
    pub access: c_int,
}

/// An op slot the provider does not implement (left NULL; `verbs_set_ops` keeps libibverbs'
/// dummy, which fails with `EOPNOTSUPP`).
pub type NoOp = Option<unsafe extern "C" fn()>;

/// `struct verbs_context_ops`: 76 slots, sorted by name as in the header.
#[repr(C)]
pub struct verbs_context_ops {
    pub advise_mr: NoOp,
    pub alloc_dm: NoOp,
    pub alloc_mw: NoOp,
    pub alloc_null_mr: NoOp,
    pub alloc_parent_domain: NoOp,
    pub alloc_pd: Option<unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd>,
    pub alloc_td: NoOp,
    pub async_event: Option<unsafe extern "C" fn(*mut ibv_context, *mut c_void)>,
    pub attach_counters_point_flow: NoOp,
    pub attach_mcast: NoOp,
    pub bind_mw: NoOp,
    pub close_xrcd: NoOp,
    pub cq_event: Option<unsafe extern "C" fn(*mut ibv_cq)>,
    pub create_ah: Option<unsafe extern "C" fn(*mut ibv_pd, *mut ibv_ah_attr) -> *mut ibv_ah>,
    pub create_counters: NoOp,
    pub create_cq: Option<
        unsafe extern "C" fn(*mut ibv_context, c_int, *mut ibv_comp_channel, c_int) -> *mut ibv_cq,
    >,
    pub create_cq_ex: NoOp,
    pub create_flow: NoOp,
    pub create_flow_action_esp: NoOp,
    pub create_qp: Option<unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp>,
    pub create_qp_ex: NoOp,
    pub create_rwq_ind_table: NoOp,
    pub create_srq:
        Option<unsafe extern "C" fn(*mut ibv_pd, *mut ibv_srq_init_attr) -> *mut ibv_srq>,
    pub create_srq_ex: NoOp,
    pub create_wq: NoOp,
    pub dealloc_mw: NoOp,
    pub dealloc_pd: Option<unsafe extern "C" fn(*mut ibv_pd) -> c_int>,
    pub dealloc_td: NoOp,
    pub dereg_mr: Option<unsafe extern "C" fn(*mut verbs_mr) -> c_int>,
    pub destroy_ah: Option<unsafe extern "C" fn(*mut ibv_ah) -> c_int>,
    pub destroy_counters: NoOp,
    pub destroy_cq: Option<unsafe extern "C" fn(*mut ibv_cq) -> c_int>,
    pub destroy_flow: NoOp,
    pub destroy_flow_action: NoOp,
    pub destroy_qp: Option<unsafe extern "C" fn(*mut ibv_qp) -> c_int>,
    pub destroy_rwq_ind_table: NoOp,
    pub destroy_srq: Option<unsafe extern "C" fn(*mut ibv_srq) -> c_int>,
    pub destroy_wq: NoOp,
    pub detach_mcast: NoOp,
    pub free_context: Option<unsafe extern "C" fn(*mut ibv_context)>,
    pub free_dm: NoOp,
    pub get_srq_num: NoOp,
    pub import_dm: NoOp,
    pub import_mr: NoOp,
    pub import_pd: NoOp,
    pub modify_cq: NoOp,
    pub modify_flow_action_esp: NoOp,
    pub modify_qp: Option<unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int>,
    pub modify_qp_rate_limit: NoOp,
    pub modify_srq: Option<unsafe extern "C" fn(*mut ibv_srq, *mut ibv_srq_attr, c_int) -> c_int>,
    pub modify_wq: NoOp,
    pub open_qp: NoOp,
    pub open_xrcd: NoOp,
    pub poll_cq: Option<unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int>,
    pub post_recv:
        Option<unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int>,
    pub post_send:
        Option<unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int>,
    pub post_srq_ops: NoOp,
    pub post_srq_recv: Option<
        unsafe extern "C" fn(*mut ibv_srq, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int,
    >,
    pub query_device_ex: Option<
        unsafe extern "C" fn(*mut ibv_context, *const c_void, *mut ibv_device_attr, usize) -> c_int,
    >,
    pub query_ece: NoOp,
    pub query_port: Option<unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int>,
    pub query_qp: Option<
        unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int, *mut ibv_qp_init_attr) -> c_int,
    >,
    pub query_qp_data_in_order: NoOp,
    pub query_rt_values: NoOp,
    pub query_srq: Option<unsafe extern "C" fn(*mut ibv_srq, *mut ibv_srq_attr) -> c_int>,
    pub read_counters: NoOp,
    pub reg_dm_mr: NoOp,
    pub reg_dmabuf_mr: NoOp,
    pub reg_mr:
        Option<unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, u64, c_int) -> *mut ibv_mr>,
    pub req_notify_cq: Option<unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int>,
    pub rereg_mr: NoOp,
    pub resize_cq: NoOp,
    pub set_ece: NoOp,
    pub unimport_dm: NoOp,
    pub unimport_mr: NoOp,
    pub unimport_pd: NoOp,
}

/// The number of op slots in [`verbs_context_ops`] for rdma-core 36..=58.
pub const VERBS_CONTEXT_OPS_SLOTS: usize = 76;

// The sge type is part of the op signatures above through the WRs; keep it referenced so the
// import list stays the one place naming every shared struct.
#[allow(dead_code)]
type _Sge = ibv_sge;
