//! Shared receive queues.

use std::sync::Arc;

use libc::c_int;
use xroce_core::transport::SrqId;

use super::pd_mr::pd;
use super::{errno, init_sync};
use crate::abi::verbs::{
    ibv_pd, ibv_srq, ibv_srq_attr, ibv_srq_init_attr, IBV_SRQ_LIMIT, IBV_SRQ_MAX_WR,
};
use crate::destroyed_events::forget_object_events;
use crate::engines::{inherited, EngineRef};
use crate::event_routes::{with_routes, ObjectRoute};
use crate::set_errno;

#[repr(C)]
pub struct XroceSrq {
    pub srq: ibv_srq,
    pub engine: Arc<EngineRef>,
    pub id: SrqId,
    pub max_wr: u32,
    pub max_sge: u32,
}

/// # Safety
/// `srq` must be a live SRQ of this provider.
pub unsafe fn srq<'a>(srq: *mut ibv_srq) -> &'a XroceSrq {
    // SAFETY: `ibv_srq` is the first field of `XroceSrq`.
    unsafe { &*(srq as *mut XroceSrq) }
}

pub unsafe extern "C" fn create_srq(p: *mut ibv_pd, init: *mut ibv_srq_init_attr) -> *mut ibv_srq {
    // SAFETY: libibverbs passes one of our PDs and the application's attributes.
    let (x, a) = unsafe { (pd(p), &mut *init) };
    if inherited(&x.engine) {
        set_errno(libc::EIO);
        return std::ptr::null_mut();
    }
    // rdma_rxe raises `max_sge` to at least one (RXE_MIN_SRQ_SGE), so an SRQ made with 0
    // still takes receives of one SGE; the values in effect go back to the application below.
    let (max_wr, max_sge, limit) = (a.attr.max_wr, a.attr.max_sge.max(1), a.attr.srq_limit);
    let made = x.engine.engine.with_device(|d| {
        let id = d.create_srq(x.id, max_wr, max_sge)?;
        if limit > 0 {
            if let Err(e) = d.modify_srq_limit(id, limit) {
                let _ = d.destroy_srq(id);
                return Err(e);
            }
        }
        Ok(id)
    });
    let id = match made {
        Ok(id) => id,
        Err(e) => {
            set_errno(errno(&e));
            return std::ptr::null_mut();
        }
    };
    a.attr.max_wr = max_wr;
    a.attr.max_sge = max_sge;
    let boxed = Box::new(XroceSrq {
        // SAFETY: all-zero is a valid `ibv_srq`; libibverbs fills context, user context and
        // PD, and the mutex and condition variable are initialised below.
        srq: ibv_srq {
            handle: id.0,
            ..unsafe { std::mem::zeroed() }
        },
        engine: x.engine.clone(),
        id,
        max_wr,
        max_sge,
    });
    let ptr = Box::into_raw(boxed);
    // SAFETY: `ptr` is the fresh SRQ; the context is ours.
    let async_tx = unsafe {
        init_sync(&mut (*ptr).srq.mutex, &mut (*ptr).srq.cond);
        crate::device::state(x.pd.context).async_tx.clone()
    };
    with_routes(|r| {
        r.srqs
            .insert((x.engine.id, id), ObjectRoute::new(ptr as usize, async_tx))
    });
    ptr as *mut ibv_srq
}

pub unsafe extern "C" fn modify_srq(
    s: *mut ibv_srq,
    attr: *mut ibv_srq_attr,
    mask: c_int,
) -> c_int {
    // SAFETY: libibverbs passes one of our SRQs and the application's attributes.
    let (x, a) = unsafe { (srq(s), &*attr) };
    if inherited(&x.engine) {
        return libc::EIO;
    }
    if mask & IBV_SRQ_MAX_WR != 0 {
        return libc::EOPNOTSUPP; // resizing is not supported
    }
    if mask & IBV_SRQ_LIMIT != 0 {
        if let Err(e) = x
            .engine
            .engine
            .with_device(|d| d.modify_srq_limit(x.id, a.srq_limit))
        {
            return errno(&e);
        }
    }
    0
}

pub unsafe extern "C" fn query_srq(s: *mut ibv_srq, attr: *mut ibv_srq_attr) -> c_int {
    // SAFETY: libibverbs passes one of our SRQs.
    let x = unsafe { srq(s) };
    if inherited(&x.engine) {
        return libc::EIO;
    }
    let Some(limit) = x
        .engine
        .engine
        .with_device(|d| d.srq(x.id).map(|q| q.limit()))
    else {
        return libc::EINVAL;
    };
    // SAFETY: the caller provides the struct.
    unsafe {
        *attr = ibv_srq_attr {
            max_wr: x.max_wr,
            max_sge: x.max_sge,
            srq_limit: limit,
        }
    };
    0
}

pub unsafe extern "C" fn destroy_srq(s: *mut ibv_srq) -> c_int {
    // SAFETY: libibverbs passes one of our SRQs.
    let x = unsafe { srq(s) };
    if inherited(&x.engine) {
        return 0; // the parent's
    }
    if let Err(e) = x.engine.engine.with_device(|d| d.destroy_srq(x.id)) {
        return errno(&e);
    }
    // SAFETY: the SRQ's context is ours and live; its mutex and condition variable
    // were initialised by `create_srq`.
    unsafe {
        forget_object_events(
            |r| r.srqs.remove(&(x.engine.id, x.id)),
            (*(*s).context).async_fd,
            &mut (*s).mutex,
            &mut (*s).cond,
            &(*s).events_completed,
        )
    };
    // SAFETY: gone from the device and the routes; free what `create_srq` made.
    unsafe {
        libc::pthread_mutex_destroy(&mut (*s).mutex);
        libc::pthread_cond_destroy(&mut (*s).cond);
        drop(Box::from_raw(s as *mut XroceSrq));
    }
    0
}
