//! Address handles (UD destinations).

use std::sync::Arc;

use libc::c_int;
use xroce_core::transport::AhId;
use xroce_datapath::engine::VerbError;

use super::errno;
use super::pd_mr::pd;
use super::qp::{address_vector, check_av_port, NO_GRH};
use crate::abi::verbs::{ibv_ah, ibv_ah_attr, ibv_pd};
use crate::engines::{inherited, EngineRef};
use crate::set_errno;

#[repr(C)]
pub struct XroceAh {
    pub ah: ibv_ah,
    pub engine: Arc<EngineRef>,
    pub id: AhId,
}

/// # Safety
/// `ah` must be a live AH of this provider.
pub unsafe fn ah<'a>(ah: *mut ibv_ah) -> &'a XroceAh {
    // SAFETY: `ibv_ah` is the first field of `XroceAh`.
    unsafe { &*(ah as *mut XroceAh) }
}

pub unsafe extern "C" fn create_ah(p: *mut ibv_pd, attr: *mut ibv_ah_attr) -> *mut ibv_ah {
    // SAFETY: libibverbs passes one of our PDs and the application's attributes.
    let (x, a) = unsafe { (pd(p), &*attr) };
    if inherited(&x.engine) {
        set_errno(libc::EIO);
        return std::ptr::null_mut();
    }
    if let Err(e) = check_av_port(a) {
        xroce_datapath::stderr_line!("xroce: address handle: {e}");
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    let Some(av) = address_vector(a) else {
        xroce_datapath::stderr_line!("xroce: address handle: {NO_GRH}");
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    };
    match x.engine.engine.create_ah(x.id, av) {
        Ok(id) => Box::into_raw(Box::new(XroceAh {
            ah: ibv_ah {
                context: x.pd.context,
                pd: p,
                handle: id.0,
            },
            engine: x.engine.clone(),
            id,
        })) as *mut ibv_ah,
        Err(VerbError::Verbs(e)) => {
            set_errno(errno(&e));
            std::ptr::null_mut()
        }
        Err(VerbError::Addressing(e)) => {
            xroce_datapath::stderr_line!("xroce: address handle: {e}");
            set_errno(libc::EHOSTUNREACH);
            std::ptr::null_mut()
        }
    }
}

pub unsafe extern "C" fn destroy_ah(h: *mut ibv_ah) -> c_int {
    // SAFETY: libibverbs passes one of our AHs.
    let x = unsafe { ah(h) };
    if inherited(&x.engine) {
        return 0; // the parent's
    }
    match x.engine.engine.with_device(|d| d.destroy_ah(x.id)) {
        Ok(()) => {
            // SAFETY: gone from the device; free what `create_ah` made.
            drop(unsafe { Box::from_raw(h as *mut XroceAh) });
            0
        }
        Err(e) => errno(&e),
    }
}
