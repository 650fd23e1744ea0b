//! Queue pairs: create, modify, query, destroy.

use std::net::Ipv6Addr;
use std::sync::Arc;

use libc::c_int;
use xroce_core::transport::{
    Access, AddressVector, AttrMask, PathMtu, QpAttr, QpCap, QpInit, QpState, QpType,
};
use xroce_core::wire::IpAddress;
use xroce_datapath::engine::VerbError;
use xroce_datapath::netlink::{core_address, std_address};

use super::cq::cq;
use super::pd_mr::pd;
use super::srq::srq;
use super::{errno, init_sync};
use crate::abi::verbs::{
    ibv_ah_attr, ibv_global_route, ibv_pd, ibv_qp, ibv_qp_attr, ibv_qp_cap, ibv_qp_init_attr,
    IBV_QPT_RC, IBV_QPT_UC, IBV_QPT_UD,
};
use crate::destroyed_events::forget_object_events;
use crate::engines::{inherited, EngineRef};
use crate::event_routes::{with_routes, ObjectRoute};
use crate::set_errno;

#[repr(C)]
pub struct XroceQp {
    pub qp: ibv_qp,
    pub engine: Arc<EngineRef>,
    pub sq_sig_all: bool,
}

/// # Safety
/// `qp` must be a live QP of this provider.
pub unsafe fn qp<'a>(qp: *mut ibv_qp) -> &'a XroceQp {
    // SAFETY: `ibv_qp` is the first field of `XroceQp`.
    unsafe { &*(qp as *mut XroceQp) }
}

fn qp_type(t: u32) -> Option<QpType> {
    match t {
        IBV_QPT_RC => Some(QpType::Rc),
        IBV_QPT_UC => Some(QpType::Uc),
        IBV_QPT_UD => Some(QpType::Ud),
        _ => None,
    }
}

fn cap_from(c: &ibv_qp_cap) -> QpCap {
    QpCap {
        max_send_wr: c.max_send_wr,
        max_recv_wr: c.max_recv_wr,
        max_send_sge: c.max_send_sge,
        max_recv_sge: c.max_recv_sge,
        max_inline_data: c.max_inline_data,
    }
}

fn cap_to(c: &QpCap) -> ibv_qp_cap {
    ibv_qp_cap {
        max_send_wr: c.max_send_wr,
        max_recv_wr: c.max_recv_wr,
        max_send_sge: c.max_send_sge,
        max_recv_sge: c.max_recv_sge,
        max_inline_data: c.max_inline_data,
    }
}

pub unsafe extern "C" fn create_qp(p: *mut ibv_pd, attr: *mut ibv_qp_init_attr) -> *mut ibv_qp {
    // SAFETY: libibverbs passes one of our PDs and the application's attributes.
    let (x, a) = unsafe { (pd(p), &mut *attr) };
    if inherited(&x.engine) {
        set_errno(libc::EIO);
        return std::ptr::null_mut();
    }
    let Some(ty) = qp_type(a.qp_type) else {
        set_errno(libc::EOPNOTSUPP); // XRC, raw packet, driver QPs
        return std::ptr::null_mut();
    };
    if a.send_cq.is_null() || a.recv_cq.is_null() {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    // A CQ or SRQ must belong to the PD's context, as the kernel requires (EINVAL otherwise):
    // objects are numbered per device, so one of another xroce device would silently stand
    // for this device's object of the same number, and one of another provider is no
    // `XroceCq` at all. libibverbs sets every object's context.
    // SAFETY: the application passes CQs and an SRQ (or NULL) it created; only the public
    // `context` field is read before the check.
    let same_context = unsafe {
        (*a.send_cq).context == x.pd.context
            && (*a.recv_cq).context == x.pd.context
            && (a.srq.is_null() || (*a.srq).context == x.pd.context)
    };
    if !same_context {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    // SAFETY: CQs and SRQ of this context, so ours.
    let (scq, rcq) = unsafe { (cq(a.send_cq), cq(a.recv_cq)) };
    // SAFETY: as above.
    let srq_of = (!a.srq.is_null()).then(|| unsafe { srq(a.srq) });
    let (send_cq, recv_cq) = (scq.id, rcq.id);
    let srq_id = srq_of.map(|s| s.id);
    let init = QpInit {
        ty,
        pd: x.id,
        send_cq,
        recv_cq,
        srq: srq_id,
        cap: cap_from(&a.cap),
        sq_sig_all: a.sq_sig_all != 0,
    };
    let created = x.engine.engine.with_device(|d| {
        let qpn = d.create_qp(init)?;
        let cap = d.query_qp(qpn)?.cap;
        Ok::<_, xroce_core::transport::verbs::VerbsError>((qpn, cap))
    });
    let (qpn, cap) = match created {
        Ok(v) => v,
        Err(e) => {
            set_errno(errno(&e));
            return std::ptr::null_mut();
        }
    };
    a.cap = cap_to(&cap);
    let boxed = Box::new(XroceQp {
        qp: ibv_qp {
            context: x.pd.context,
            qp_context: a.qp_context,
            pd: p,
            send_cq: a.send_cq,
            recv_cq: a.recv_cq,
            srq: a.srq,
            handle: qpn,
            qp_num: qpn,
            state: QpState::Reset as u32,
            qp_type: a.qp_type,
            // SAFETY: initialised right below, before anyone can use them.
            mutex: unsafe { std::mem::zeroed() },
            cond: unsafe { std::mem::zeroed() },
            events_completed: 0,
        },
        engine: x.engine.clone(),
        sq_sig_all: a.sq_sig_all != 0,
    });
    let ptr = Box::into_raw(boxed);
    // SAFETY: `ptr` is the fresh QP.
    unsafe { init_sync(&mut (*ptr).qp.mutex, &mut (*ptr).qp.cond) };
    // SAFETY: the context is ours.
    let async_tx = unsafe { crate::device::state(x.pd.context) }
        .async_tx
        .clone();
    with_routes(|r| {
        r.qps
            .insert((x.engine.id, qpn), ObjectRoute::new(ptr as usize, async_tx))
    });
    ptr as *mut ibv_qp
}

/// The address a GID stands for (IPv4-mapped GIDs are IPv4).
pub fn gid_address(gid: &[u8; 16]) -> IpAddress {
    let v6 = Ipv6Addr::from(*gid);
    match v6.to_ipv4_mapped() {
        Some(v4) => core_address(v4.into()),
        None => core_address(v6.into()),
    }
}

fn gid_bytes(ip: IpAddress) -> [u8; 16] {
    match std_address(ip) {
        std::net::IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        std::net::IpAddr::V6(v6) => v6.octets(),
    }
}

/// Why an address without a GRH is refused, for the application's user: the usual cause is
/// a program started without a GID index, which then sends an all-zero GID.
pub const NO_GRH: &str = "the address has no GRH (is_global = 0), and RoCE addresses are GIDs: \
     give the program a GID index (`-g 1` for the ibv_*_pingpong examples, `-x 1` for perftest; \
     `ibv_devinfo -v` lists the GIDs)";

/// The kernel's check of an address's port (`rdma_is_port_valid`, made by uverbs before
/// the driver sees `ibv_create_ah` or `ibv_modify_qp` with `IBV_QP_AV`): the device has
/// port 1 alone. A zeroed `ibv_ah_attr` (port 0) is the usual cause.
pub fn check_av_port(ah: &ibv_ah_attr) -> Result<(), String> {
    if ah.port_num == 1 {
        Ok(())
    } else {
        Err(format!(
            "the address names port {}, and the device has port 1 alone (set ah_attr.port_num)",
            ah.port_num
        ))
    }
}

/// The transport's address vector for a verbs one. RoCE needs the GRH (`is_global`).
pub fn address_vector(ah: &ibv_ah_attr) -> Option<AddressVector> {
    if ah.is_global == 0 {
        return None;
    }
    Some(AddressVector {
        dgid: gid_address(&ah.grh.dgid),
        sgid_index: ah.grh.sgid_index,
        traffic_class: ah.grh.traffic_class,
        hop_limit: ah.grh.hop_limit,
        flow_label: ah.grh.flow_label,
    })
}

fn ah_attr(av: &AddressVector) -> ibv_ah_attr {
    ibv_ah_attr {
        grh: ibv_global_route {
            dgid: gid_bytes(av.dgid),
            flow_label: av.flow_label,
            sgid_index: av.sgid_index,
            hop_limit: av.hop_limit,
            traffic_class: av.traffic_class,
        },
        is_global: 1,
        port_num: 1,
        ..Default::default()
    }
}

/// The transport's attributes for the fields `mask` names.
fn qp_attr(a: &ibv_qp_attr, mask: AttrMask) -> Result<QpAttr, c_int> {
    let mut out = QpAttr::default();
    if mask.contains(AttrMask::STATE) {
        out.state = QpState::from_ibv(a.qp_state).ok_or(libc::EINVAL)?;
    }
    if mask.contains(AttrMask::CUR_STATE) {
        out.cur_state = QpState::from_ibv(a.cur_qp_state).ok_or(libc::EINVAL)?;
    }
    if mask.contains(AttrMask::PATH_MTU) {
        out.path_mtu = PathMtu::from_ibv(a.path_mtu).ok_or(libc::EINVAL)?;
    }
    if mask.contains(AttrMask::AV) {
        if let Err(e) = check_av_port(&a.ah_attr) {
            xroce_datapath::stderr_line!("xroce: QP attributes: {e}");
            return Err(libc::EINVAL);
        }
        out.av = Some(address_vector(&a.ah_attr).ok_or_else(|| {
            xroce_datapath::stderr_line!("xroce: QP attributes: {NO_GRH}");
            libc::EINVAL
        })?);
    }
    if mask.contains(AttrMask::ALT_PATH) {
        // Linux's core refuses alternate paths on RoCE ports before rdma_rxe sees them
        // ("Ban them in roce mode"), with EINVAL.
        xroce_datapath::stderr_line!(
            "xroce: QP attributes: alternate paths (IBV_QP_ALT_PATH) are InfiniBand only; \
             Linux refuses them on RoCE devices too"
        );
        return Err(libc::EINVAL);
    }
    if mask.contains(AttrMask::PATH_MIG_STATE) {
        // Kept and reported, as rdma_rxe does (the kernel passes it on as one byte).
        out.path_mig_state = a.path_mig_state as u8;
    }
    out.qkey = a.qkey;
    out.rq_psn = a.rq_psn;
    out.sq_psn = a.sq_psn;
    out.dest_qpn = a.dest_qp_num;
    out.access = Access(a.qp_access_flags & 0xf);
    out.pkey_index = a.pkey_index;
    out.port_num = a.port_num;
    out.timeout = a.timeout;
    out.retry_cnt = a.retry_cnt;
    out.rnr_retry = a.rnr_retry;
    out.min_rnr_timer = a.min_rnr_timer;
    out.max_rd_atomic = a.max_rd_atomic;
    out.max_dest_rd_atomic = a.max_dest_rd_atomic;
    out.en_sqd_async_notify = a.en_sqd_async_notify != 0;
    out.cap = cap_from(&a.cap);
    Ok(out)
}

pub unsafe extern "C" fn modify_qp(q: *mut ibv_qp, attr: *mut ibv_qp_attr, mask: c_int) -> c_int {
    // SAFETY: libibverbs passes one of our QPs and the application's attributes.
    let (x, a) = unsafe { (qp(q), &*attr) };
    if inherited(&x.engine) {
        return libc::EIO;
    }
    let mut mask = AttrMask(mask as u32);
    let mut core = match qp_attr(a, mask) {
        Ok(c) => c,
        Err(e) => return e,
    };
    // uverbs: an AV outside the move to RTR carries its port as IBV_QP_PORT too (added when
    // the caller left it out, EINVAL when the two differ), so the transition's mask rules
    // judge it with the port (UC's SQD->SQD takes an AV but no port: EINVAL on Linux).
    if mask.contains(AttrMask::AV)
        && !(mask.contains(AttrMask::STATE) && core.state == QpState::Rtr)
    {
        if mask.contains(AttrMask::PORT) && a.port_num != a.ah_attr.port_num {
            return libc::EINVAL;
        }
        mask = AttrMask(mask.0 | AttrMask::PORT.0);
        core.port_num = a.ah_attr.port_num;
    }
    match x.engine.engine.modify_qp(x.qp.qp_num, &core, mask) {
        Ok(()) => 0,
        Err(VerbError::Verbs(e)) => errno(&e),
        Err(VerbError::Addressing(e)) => {
            xroce_datapath::stderr_line!("xroce: QP {:#x}: {e}", x.qp.qp_num);
            libc::EHOSTUNREACH
        }
    }
}

pub unsafe extern "C" fn query_qp(
    q: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    _mask: c_int,
    init: *mut ibv_qp_init_attr,
) -> c_int {
    // SAFETY: libibverbs passes one of our QPs.
    let x = unsafe { qp(q) };
    if inherited(&x.engine) {
        return libc::EIO;
    }
    let a = match x.engine.engine.with_device(|d| d.query_qp(x.qp.qp_num)) {
        Ok(a) => a,
        Err(e) => return errno(&e),
    };
    let out = ibv_qp_attr {
        qp_state: a.state as u32,
        cur_qp_state: a.cur_state as u32,
        path_mtu: a.path_mtu as u32,
        path_mig_state: a.path_mig_state as u32,
        qkey: a.qkey,
        rq_psn: a.rq_psn,
        sq_psn: a.sq_psn,
        dest_qp_num: a.dest_qpn,
        qp_access_flags: a.access.0,
        cap: cap_to(&a.cap),
        ah_attr: a.av.as_ref().map(ah_attr).unwrap_or_default(),
        pkey_index: a.pkey_index,
        en_sqd_async_notify: a.en_sqd_async_notify as u8,
        sq_draining: (a.state == QpState::Sqd) as u8,
        max_rd_atomic: a.max_rd_atomic,
        max_dest_rd_atomic: a.max_dest_rd_atomic,
        min_rnr_timer: a.min_rnr_timer,
        port_num: a.port_num,
        timeout: a.timeout,
        retry_cnt: a.retry_cnt,
        rnr_retry: a.rnr_retry,
        ..Default::default()
    };
    // SAFETY: the caller provides both structs.
    unsafe {
        *attr = out;
        if !init.is_null() {
            *init = ibv_qp_init_attr {
                qp_context: x.qp.qp_context,
                send_cq: x.qp.send_cq,
                recv_cq: x.qp.recv_cq,
                srq: x.qp.srq,
                cap: cap_to(&a.cap),
                qp_type: x.qp.qp_type,
                sq_sig_all: x.sq_sig_all as c_int,
            };
        }
    }
    0
}

pub unsafe extern "C" fn destroy_qp(q: *mut ibv_qp) -> c_int {
    // SAFETY: libibverbs passes one of our QPs.
    let x = unsafe { qp(q) };
    if inherited(&x.engine) {
        return 0; // the parent's
    }
    let qpn = x.qp.qp_num;
    if let Err(e) = x.engine.engine.destroy_qp(qpn) {
        return errno(&e);
    }
    // SAFETY: the QP's context is ours and live; its mutex and condition variable
    // were initialised by `create_qp`.
    unsafe {
        forget_object_events(
            |r| r.qps.remove(&(x.engine.id, qpn)),
            (*(*q).context).async_fd,
            &mut (*q).mutex,
            &mut (*q).cond,
            &(*q).events_completed,
        )
    };
    // SAFETY: gone from the device and the routes; free what `create_qp` made.
    unsafe {
        libc::pthread_mutex_destroy(&mut (*q).mutex);
        libc::pthread_cond_destroy(&mut (*q).cond);
        drop(Box::from_raw(q as *mut XroceQp));
    }
    0
}
