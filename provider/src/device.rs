//! Devices and contexts: what `ibv_get_device_list` and `ibv_open_device` reach, and the device
//! and port queries (`ibv_devinfo`).

use std::mem::offset_of;
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use libc::{c_int, c_void};
use xroce_core::transport::device::limits;
use xroce_core::transport::PathMtu;
use xroce_datapath::registry;

use crate::abi::driver::{verbs_device, verbs_sysfs_dev};
use crate::abi::verbs::{
    ibv_context, ibv_device, ibv_device_attr, ibv_port_attr, verbs_context, IBV_ATOMIC_HCA,
    IBV_LINK_LAYER_ETHERNET, IBV_PORT_ACTIVE, IBV_PORT_DOWN,
};
use crate::engines::EngineRef;
use crate::set_errno;

/// Completion vectors of a context: one (every CQ's events come from the engine's thread).
pub const NUM_COMP_VECTORS: c_int = 1;

/// A device libibverbs found: `struct verbs_device` first, then which netdev it drives.
#[repr(C)]
pub struct XroceDevice {
    pub vdev: verbs_device,
    pub name: String,
    pub netdev: String,
    /// The device's directory in the generated sysfs tree (libibverbs' `ibdev_path`).
    pub ibdev_dir: PathBuf,
}

/// An open context: `struct verbs_context` (allocated by libibverbs, sized by us), then ours.
#[repr(C)]
pub struct XroceContext {
    pub vctx: verbs_context,
    pub state: *mut ContextState,
}

/// What one open context owns.
pub struct ContextState {
    pub name: String,
    pub netdev: String,
    /// See [`XroceDevice::ibdev_dir`]; its engine keeps the GID files there equal to its table.
    pub ibdev_dir: PathBuf,
    /// Started on first use (a PD, CQ, ...), so `ibv_devinfo` never binds the netdev's queue.
    pub engine: Mutex<Option<Arc<EngineRef>>>,
    /// Write end of the pipe behind `context->async_fd`.
    pub async_tx: Arc<OwnedFd>,
    /// The PDs allocated on this context and not freed: closing it frees them with what is
    /// in them (see `free_context`).
    pub pds: Mutex<Vec<xroce_core::transport::memory::PdId>>,
    /// `IBV_EVENT_DEVICE_FATAL` was posted to this context (by its port watcher, the netdev
    /// gone, or by its engine, the device failed): it is posted once.
    pub fatal_posted: Arc<std::sync::atomic::AtomicBool>,
    /// Reports the netdev's state and address changes (stopped when the context is freed).
    pub port_watch: Option<crate::port_events::PortWatch>,
    /// The process that opened the context. A forked child inherits the context, but not the
    /// threads behind it (the engine's, the port watcher's), which stay its parent's.
    pub pid: u32,
}

/// The context state behind an `ibv_context` this provider allocated.
///
/// # Safety
/// `ctx` must be a live context returned by `alloc_context`.
pub unsafe fn state<'a>(ctx: *mut ibv_context) -> &'a ContextState {
    let offset = offset_of!(XroceContext, vctx) + offset_of!(verbs_context, context);
    // SAFETY: per the contract, `ctx` lies at `offset` inside an `XroceContext`.
    unsafe {
        let xctx = (ctx as *mut u8).sub(offset) as *mut XroceContext;
        &*(*xctx).state
    }
}

/// True if `ctx` belongs to this provider (and not to a real RDMA device's provider).
///
/// # Safety
/// `ctx` must be a live `ibv_context` of any provider.
pub unsafe fn is_ours(ctx: *mut ibv_context) -> bool {
    // SAFETY: every provider's `ibv_device` sits first in a `verbs_device`.
    unsafe {
        let dev = (*ctx).device as *mut verbs_device;
        !dev.is_null() && (*dev).ops == crate::register::device_ops()
    }
}

fn c_str(chars: &[libc::c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .take_while(|c| **c != 0)
        .map(|c| *c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

pub(crate) unsafe extern "C" fn alloc_device(sysfs: *mut verbs_sysfs_dev) -> *mut verbs_device {
    // SAFETY: libibverbs passes a valid sysfs device.
    let sysfs = unsafe { &*sysfs };
    let name = c_str(&sysfs.ibdev_name);
    let ibdev_dir = PathBuf::from(c_str(&sysfs.ibdev_path));
    let path = ibdev_dir.join(registry::NETDEV_FILE);
    let netdev = match std::fs::read_to_string(&path) {
        Ok(s) if !s.trim().is_empty() => s.trim().to_string(),
        _ => {
            xroce_datapath::stderr_line!(
                "xroce: {} does not name the netdev of {name}; recreate it with xroce link add",
                path.display()
            );
            return std::ptr::null_mut();
        }
    };
    let dev = Box::new(XroceDevice {
        // SAFETY: all-zero is a valid `verbs_device` (null pointers, zero counters); libibverbs
        // fills it in after this returns.
        vdev: unsafe { std::mem::zeroed() },
        name,
        netdev,
        ibdev_dir,
    });
    Box::into_raw(dev) as *mut verbs_device
}

pub(crate) unsafe extern "C" fn uninit_device(vdev: *mut verbs_device) {
    // SAFETY: `vdev` came from `alloc_device`, where it is the first field of a boxed device.
    drop(unsafe { Box::from_raw(vdev as *mut XroceDevice) });
}

pub(crate) unsafe extern "C" fn alloc_context(
    ibdev: *mut ibv_device,
    cmd_fd: c_int,
    _private_data: *mut c_void,
) -> *mut verbs_context {
    let Some(private) = crate::register::private() else {
        set_errno(libc::ENOSYS);
        return std::ptr::null_mut();
    };
    crate::engines::guard_tables_across_fork();
    // SAFETY: `ibdev` is one of ours (libibverbs matched it to this provider).
    let dev = unsafe { &*(ibdev as *mut XroceDevice) };
    let mut fds = [0 as c_int; 2];
    // SAFETY: pipe2 writes two descriptors into `fds`.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return std::ptr::null_mut();
    }
    // SAFETY: fresh descriptors, owned from here.
    let (async_rx, async_tx) =
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // The engine never blocks on a full pipe (an application not reading its events).
    // SAFETY: fcntl on a descriptor we own.
    unsafe { libc::fcntl(fds[1], libc::F_SETFL, libc::O_NONBLOCK) };

    // SAFETY: libibverbs allocates `size_of::<XroceContext>()` zeroed bytes and initialises the
    // `verbs_context` at the given offset (rdma-core's verbs_init_and_alloc_context macro).
    let xctx = unsafe {
        (private.init_and_alloc_context)(
            ibdev,
            cmd_fd,
            std::mem::size_of::<XroceContext>(),
            offset_of!(XroceContext, vctx) as *mut verbs_context,
            0,
        )
    } as *mut XroceContext;
    if xctx.is_null() {
        return std::ptr::null_mut();
    }
    let async_tx = Arc::new(async_tx);
    let fatal_posted = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let state = Box::new(ContextState {
        name: dev.name.clone(),
        netdev: dev.netdev.clone(),
        ibdev_dir: dev.ibdev_dir.clone(),
        engine: Mutex::new(None),
        pds: Mutex::new(Vec::new()),
        pid: std::process::id(),
        port_watch: crate::port_events::PortWatch::start(
            dev.netdev.clone(),
            async_tx.clone(),
            fatal_posted.clone(),
        ),
        async_tx,
        fatal_posted,
    });
    // SAFETY: `xctx` is the fresh allocation; the ops table is 'static.
    unsafe {
        (private.set_ops)(&mut (*xctx).vctx, crate::verbs::context_ops());
        (*xctx).vctx.context.async_fd = async_rx.into_raw_fd();
        (*xctx).vctx.context.num_comp_vectors = NUM_COMP_VECTORS;
        (*xctx).state = Box::into_raw(state);
        &mut (*xctx).vctx
    }
}

pub(crate) unsafe extern "C" fn free_context(ctx: *mut ibv_context) {
    let Some(private) = crate::register::private() else {
        return;
    };
    let offset = offset_of!(XroceContext, vctx) + offset_of!(verbs_context, context);
    // SAFETY: `ctx` is ours (see `state`); libibverbs closes cmd_fd and async_fd in
    // verbs_uninit_context, then the allocation it made is freed with free(3).
    unsafe {
        let xctx = (ctx as *mut u8).sub(offset) as *mut XroceContext;
        let state = Box::from_raw((*xctx).state);
        if state.pid != std::process::id() {
            // A forked child closing what it inherited (its exit handlers may): the engine and
            // the port watcher are its parent's, their threads are not here, and stopping them
            // would join threads this process does not have, write to the parent's eventfd
            // and rings, or wait for a lock a parent's thread held at the fork. Nothing of the
            // state is dropped (its few bytes stay); libibverbs' part goes.
            std::mem::forget(state);
            (private.uninit_context)(&mut (*xctx).vctx);
            libc::free(xctx as *mut c_void);
            return;
        }
        let engine = state
            .engine
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        // Objects the application did not destroy: their events must not reach this
        // context's pipe once libibverbs has closed it.
        let (qps, srqs, cqs) =
            crate::event_routes::with_routes(|r| r.forget_context_objects(&state.async_tx));
        if let Some(e) = engine {
            // As closing a kernel device's file destroys its objects: another context may keep
            // the engine running, and a peer must not reach this one's QPs or memory (which
            // the application may free now) through it.
            let pds = std::mem::take(&mut *state.pds.lock().unwrap_or_else(|p| p.into_inner()));
            e.engine.release_objects(&qps, &srqs, &cqs, &pds);
            crate::event_routes::detach_context(&e, &state);
            e.release_context();
        }
        drop(state);
        (private.uninit_context)(&mut (*xctx).vctx);
        libc::free(xctx as *mut c_void);
    }
}

/// The netdev as the kernel sees it now (MTU, MAC, link state).
fn netdev(ctx: &ContextState) -> Option<xroce_datapath::netlink::Interface> {
    xroce_datapath::netlink::interface_by_name(&ctx.netdev).ok()
}

/// The attributes this device reports, rdma_rxe's where xroce has the same limits.
pub fn device_attr(mac: [u8; 6]) -> ibv_device_attr {
    // SAFETY: all-zero is a valid `ibv_device_attr` (plain integers and chars).
    let mut a: ibv_device_attr = unsafe { std::mem::zeroed() };
    for (d, s) in a.fw_ver.iter_mut().zip(env!("CARGO_PKG_VERSION").bytes()) {
        *d = s as libc::c_char;
    }
    let guid = registry::node_guid(mac).to_be();
    a.node_guid = guid;
    a.sys_image_guid = guid;
    a.max_mr_size = u64::MAX;
    a.page_size_cap = 0xffff_f000;
    a.vendor_id = 0x00ff_ffff; // like rxe: no IEEE OUI
    a.max_qp = 0x10000;
    a.max_qp_wr = limits::MAX_QP_WR as c_int;
    // BAD_PKEY_CNTR | BAD_QKEY_CNTR | PORT_ACTIVE_EVENT | SYS_IMAGE_GUID | RC_RNR_NAK_GEN
    a.device_cap_flags = (1 << 1) | (1 << 2) | (1 << 10) | (1 << 11) | (1 << 12);
    a.max_sge = limits::MAX_SGE as c_int;
    a.max_sge_rd = limits::MAX_SGE as c_int;
    a.max_cq = 0x4000;
    a.max_cqe = limits::MAX_CQE as c_int;
    a.max_mr = 0x4000;
    a.max_pd = 0x7ffc;
    a.max_qp_rd_atom = 128;
    a.max_res_rd_atom = 0x3f000;
    a.max_qp_init_rd_atom = 128;
    a.atomic_cap = IBV_ATOMIC_HCA;
    a.max_ah = 0x7fff;
    a.max_srq = 0x3ff;
    a.max_srq_wr = limits::MAX_SRQ_WR as c_int;
    a.max_srq_sge = limits::MAX_SRQ_SGE as c_int;
    a.max_pkeys = 1;
    a.local_ca_ack_delay = 15;
    a.phys_port_cnt = 1;
    a
}

pub(crate) unsafe extern "C" fn query_device_ex(
    ctx: *mut ibv_context,
    _input: *const c_void,
    attr: *mut ibv_device_attr,
    attr_size: usize,
) -> c_int {
    // SAFETY: `ctx` is ours.
    let st = unsafe { state(ctx) };
    let Some(nd) = netdev(st) else {
        return libc::ENODEV;
    };
    let a = device_attr(nd.mac);
    let n = attr_size.min(std::mem::size_of::<ibv_device_attr>());
    // SAFETY: the caller provides `attr_size` writable bytes; the extended part beyond the
    // classic attributes (ODP, TSO, RSS, ... capabilities xroce does not have) is zeroed.
    unsafe {
        std::ptr::write_bytes(attr as *mut u8, 0, attr_size);
        std::ptr::copy_nonoverlapping(&a as *const _ as *const u8, attr as *mut u8, n);
    }
    0
}

/// Port 1's attributes, computed from the netdev as rdma_rxe computes them. `multi_buffer`:
/// whether the port carries frames longer than one UMEM frame (else its active MTU stops at
/// 2048; see [`xroce_datapath::afxdp::port_path_mtu`]).
pub fn port_attr(nd: &xroce_datapath::netlink::Interface, multi_buffer: bool) -> ibv_port_attr {
    ibv_port_attr {
        state: if nd.up {
            IBV_PORT_ACTIVE
        } else {
            IBV_PORT_DOWN
        },
        max_mtu: PathMtu::Mtu4096 as u32,
        active_mtu: xroce_datapath::afxdp::port_path_mtu(nd.mtu, multi_buffer) as u32,
        gid_tbl_len: registry::GID_TABLE_LEN as c_int,
        port_cap_flags: 1 << 16, // IBV_PORT_CM_SUP, as rxe
        max_msg_sz: 1 << 31,
        pkey_tbl_len: 1,
        max_vl_num: 1,
        active_width: 1,                       // 1X
        active_speed: 8,                       // 10 Gb/s per lane (FDR10), what a veth reports
        phys_state: if nd.up { 5 } else { 3 }, // LinkUp / Disabled
        link_layer: IBV_LINK_LAYER_ETHERNET,
        ..Default::default()
    }
}

pub(crate) unsafe extern "C" fn query_port(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
) -> c_int {
    if port != 1 {
        return libc::EINVAL;
    }
    // SAFETY: `ctx` is ours.
    let st = unsafe { state(ctx) };
    let Some(nd) = netdev(st) else {
        return libc::ENODEV;
    };
    // What the running engine's sockets got, which is what its QPs are held to: a zero-copy
    // socket on a driver whose zero-copy takes one buffer per frame has no multi-buffer even
    // where the kernel has it. That engine is this process's, or another process's that holds
    // the interface (`ibv_devinfo` run beside the program: this process could not start one).
    // With neither, the kernel's capability is the guess (the sockets do without multi-buffer
    // only where the path MTU is 2048 or less anyway).
    let multi_buffer = crate::engines::running_multi_buffer(st)
        .or_else(|| xroce_datapath::engine::holder_multi_buffer(&nd.name))
        .unwrap_or_else(xroce_datapath::afxdp::kernel_supports_multi_buffer);
    // SAFETY: libibverbs passes a full `struct ibv_port_attr`.
    unsafe { *attr = port_attr(&nd, multi_buffer) };
    0
}

/// `ops->async_event`: nothing to do after `ibv_get_async_event` (no hardware to re-arm).
pub(crate) unsafe extern "C" fn async_event(_ctx: *mut ibv_context, _event: *mut c_void) {}
