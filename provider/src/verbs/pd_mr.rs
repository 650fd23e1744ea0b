//! Protection domains and memory regions.

use std::sync::Arc;

use libc::{c_int, c_void};
use xroce_core::transport::{Access, MrId, PdId};

use super::errno;
use crate::abi::driver::verbs_mr;
use crate::abi::verbs::{
    ibv_context, ibv_mr, ibv_pd, IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_MW_BIND,
    IBV_ACCESS_OPTIONAL_RANGE, IBV_ACCESS_REMOTE_ATOMIC, IBV_ACCESS_REMOTE_READ,
    IBV_ACCESS_REMOTE_WRITE,
};
use crate::device::state;
use crate::engines::{engine_for, EngineRef};
use crate::set_errno;

#[repr(C)]
pub struct XrocePd {
    pub pd: ibv_pd,
    pub engine: Arc<EngineRef>,
    pub id: PdId,
}

#[repr(C)]
pub struct XroceMr {
    pub vmr: verbs_mr,
    pub engine: Arc<EngineRef>,
    pub id: MrId,
}

/// The provider object behind an application's PD.
///
/// # Safety
/// `pd` must be a live PD of this provider.
pub unsafe fn pd<'a>(pd: *mut ibv_pd) -> &'a XrocePd {
    // SAFETY: `ibv_pd` is the first field of `XrocePd`.
    unsafe { &*(pd as *mut XrocePd) }
}

pub unsafe extern "C" fn alloc_pd(ctx: *mut ibv_context) -> *mut ibv_pd {
    // SAFETY: libibverbs passes one of our contexts.
    let st = unsafe { state(ctx) };
    let engine = match engine_for(st) {
        Ok(e) => e,
        Err(e) => {
            set_errno(e);
            return std::ptr::null_mut();
        }
    };
    let id = engine.engine.with_device(|d| d.alloc_pd());
    let pd = Box::new(XrocePd {
        pd: ibv_pd {
            context: ctx,
            handle: id.0,
        },
        engine,
        id,
    });
    Box::into_raw(pd) as *mut ibv_pd
}

pub unsafe extern "C" fn dealloc_pd(p: *mut ibv_pd) -> c_int {
    // SAFETY: libibverbs passes one of our PDs.
    let x = unsafe { pd(p) };
    match x.engine.engine.with_device(|d| d.dealloc_pd(x.id)) {
        Ok(()) => {
            // SAFETY: the PD is gone from the device; free the box `alloc_pd` made.
            drop(unsafe { Box::from_raw(p as *mut XrocePd) });
            0
        }
        Err(e) => errno(&e),
    }
}

/// The transport's access rights for verbs access flags, or `None` for flags xroce cannot honour.
fn access(flags: c_int) -> Option<Access> {
    let flags = flags & !IBV_ACCESS_OPTIONAL_RANGE;
    let known = IBV_ACCESS_LOCAL_WRITE
        | IBV_ACCESS_REMOTE_WRITE
        | IBV_ACCESS_REMOTE_READ
        | IBV_ACCESS_REMOTE_ATOMIC
        | IBV_ACCESS_MW_BIND;
    if flags & !known != 0 {
        return None; // zero-based, on-demand paging, huge pages: not supported
    }
    Some(Access((flags & 0xf) as u32))
}

pub unsafe extern "C" fn reg_mr(
    p: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    flags: c_int,
) -> *mut ibv_mr {
    // SAFETY: libibverbs passes one of our PDs.
    let x = unsafe { pd(p) };
    let Some(acc) = access(flags) else {
        set_errno(libc::EOPNOTSUPP);
        return std::ptr::null_mut();
    };
    if iova != addr as u64 {
        // Memory is addressed by its virtual address (as rxe before IOVA support).
        set_errno(libc::EOPNOTSUPP);
        return std::ptr::null_mut();
    }
    // SAFETY: verbs' contract: the application keeps the memory mapped until ibv_dereg_mr.
    let r = unsafe { x.engine.engine.reg_mr(x.id, addr as *mut u8, length, acc) };
    match r {
        Ok((id, region)) => {
            let mr = Box::new(XroceMr {
                vmr: verbs_mr {
                    ibv_mr: ibv_mr {
                        context: x.pd.context,
                        pd: p,
                        addr,
                        length,
                        handle: id.0,
                        lkey: region.lkey,
                        rkey: region.rkey,
                    },
                    mr_type: 0, // IBV_MR_TYPE_MR
                    access: flags,
                },
                engine: x.engine.clone(),
                id,
            });
            Box::into_raw(mr) as *mut ibv_mr
        }
        Err(e) => {
            set_errno(errno(&e));
            std::ptr::null_mut()
        }
    }
}

pub unsafe extern "C" fn dereg_mr(vmr: *mut verbs_mr) -> c_int {
    // SAFETY: libibverbs passes one of our MRs; `verbs_mr` is the first field of `XroceMr`.
    let x = unsafe { &*(vmr as *mut XroceMr) };
    match x.engine.engine.dereg_mr(x.id) {
        Ok(()) => {
            // SAFETY: deregistered; free the box `reg_mr` made.
            drop(unsafe { Box::from_raw(vmr as *mut XroceMr) });
            0
        }
        Err(e) => errno(&e),
    }
}
