//! Programs that connect through librdmacm, told why that cannot work here.
//!
//! librdmacm (the RDMA connection manager: `rping`, perftest's `-R`, libraries that resolve
//! addresses and connect QPs for their users) talks to the kernel's `rdma_cm` device, which a
//! kernel without RDMA does not have and xroce does not provide. Such a program fails in its
//! first librdmacm call with a message of its own ("rdma_create_event_channel failed"), which
//! does not say why. Under `xroce exec` this library is preloaded and sits in front of
//! librdmacm's entry points: each calls librdmacm's own, and when that fails, the program is
//! also told what to do instead (once). On a machine whose kernel has `rdma_cm` nothing
//! changes.

use std::sync::atomic::{AtomicBool, Ordering};

use libc::{c_int, c_void};

use crate::discovery::{under_xroce_exec, Forward};

/// librdmacm's soname.
const LIBRDMACM: &std::ffi::CStr = c"librdmacm.so.1";

/// What the program is told when librdmacm cannot work.
pub const RDMA_CM_HINT: &str = "xroce: librdmacm (RDMA CM) needs the kernel's rdma_cm device, \
    which this kernel does not have, and xroce does not provide it; run the program without \
    RDMA CM (perftest without -R: QPs are connected over its own TCP exchange), or use the \
    rdma-core examples (ibv_rc_pingpong and the others)";

/// Says [`RDMA_CM_HINT`] once per process, under `xroce exec` only.
fn hint() {
    static SAID: AtomicBool = AtomicBool::new(false);
    if under_xroce_exec() && !SAID.swap(true, Ordering::Relaxed) {
        xroce_datapath::stderr_line!("{RDMA_CM_HINT}");
    }
}

type CreateEventChannelFn = unsafe extern "C" fn() -> *mut c_void;
type CreateIdFn = unsafe extern "C" fn(*mut c_void, *mut *mut c_void, *mut c_void, c_int) -> c_int;

/// `rdma_create_event_channel` (RDMACM_1.0): librdmacm's own, with the hint when it fails.
///
/// # Safety
/// As librdmacm's `rdma_create_event_channel`.
#[no_mangle]
pub unsafe extern "C" fn rdma_create_event_channel() -> *mut c_void {
    static REAL: Forward = Forward::new();
    let real = REAL.get(LIBRDMACM, c"rdma_create_event_channel", Some(c"RDMACM_1.0"));
    if real == 0 {
        // Not linked with librdmacm, yet calling it: nothing to forward to.
        hint();
        crate::set_errno(libc::ENOSYS);
        return std::ptr::null_mut();
    }
    // SAFETY: the address of librdmacm's `rdma_create_event_channel@RDMACM_1.0`.
    let real: CreateEventChannelFn =
        unsafe { std::mem::transmute::<usize, CreateEventChannelFn>(real) };
    // SAFETY: it takes no arguments.
    let channel = unsafe { real() };
    if channel.is_null() {
        let errno = std::io::Error::last_os_error();
        hint();
        crate::set_errno(errno.raw_os_error().unwrap_or(libc::ENODEV));
    }
    channel
}

/// `rdma_create_id` (RDMACM_1.0): librdmacm's own, with the hint when it fails (programs
/// that pass no event channel reach the kernel here first).
///
/// # Safety
/// As librdmacm's `rdma_create_id`.
#[no_mangle]
pub unsafe extern "C" fn rdma_create_id(
    channel: *mut c_void,
    id: *mut *mut c_void,
    context: *mut c_void,
    port_space: c_int,
) -> c_int {
    static REAL: Forward = Forward::new();
    let real = REAL.get(LIBRDMACM, c"rdma_create_id", Some(c"RDMACM_1.0"));
    if real == 0 {
        hint();
        crate::set_errno(libc::ENOSYS);
        return -1;
    }
    // SAFETY: the address of librdmacm's `rdma_create_id@RDMACM_1.0`.
    let real: CreateIdFn = unsafe { std::mem::transmute::<usize, CreateIdFn>(real) };
    // SAFETY: forwarding the caller's arguments.
    let rc = unsafe { real(channel, id, context, port_space) };
    if rc != 0 {
        let errno = std::io::Error::last_os_error();
        hint();
        crate::set_errno(errno.raw_os_error().unwrap_or(libc::ENODEV));
    }
    rc
}
