//! Device discovery on kernels that have RDMA (distribution kernels, where `ib_core` is a
//! module).
//!
//! libibverbs lists devices by asking the kernel over netlink (`NETLINK_RDMA`) and reads the
//! sysfs tree (`$SYSFS_PATH/class/infiniband_verbs`) only when that socket cannot be opened.
//! On a kernel without RDMA it cannot, and the tree `xroce exec` points `SYSFS_PATH` at is read;
//! on a kernel with RDMA (or with `ib_core` loadable: opening the socket loads it) netlink
//! answers, the tree is never read, and xroce devices stay invisible.
//!
//! Under `xroce exec` this library is preloaded and takes the place of `ibv_get_device_list`:
//! while libibverbs builds its list on this thread, opening a `NETLINK_RDMA` socket fails with
//! `EPROTONOSUPPORT`, as on a kernel without RDMA, so libibverbs reads the tree. The tree also
//! links the kernel's own devices (see the registry's `link_real_devices`), so real RDMA
//! devices stay visible. Every other socket, and `NETLINK_RDMA` at any other time, goes to the C
//! library unchanged.

use std::cell::Cell;
use std::ffi::CStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use libc::{c_int, c_void};

/// `NETLINK_RDMA` (linux/netlink.h); not in the libc crate.
const NETLINK_RDMA: c_int = 20;

thread_local! {
    /// This thread is inside libibverbs' `ibv_get_device_list`.
    static LISTING: Cell<bool> = const { Cell::new(false) };
}

/// Whether the program runs under `xroce exec` (which sets `XROCE_EXEC=1`).
pub(crate) fn under_xroce_exec() -> bool {
    static EXEC: OnceLock<bool> = OnceLock::new();
    *EXEC.get_or_init(|| std::env::var_os("XROCE_EXEC").is_some_and(|v| v == "1"))
}

/// The next definition of `name` after this library's (libibverbs', the C library's).
pub(crate) fn next_symbol(name: &CStr, version: Option<&CStr>) -> usize {
    // SAFETY: RTLD_NEXT lookups of NUL-terminated names.
    unsafe {
        match version {
            Some(v) => libc::dlvsym(libc::RTLD_NEXT, name.as_ptr(), v.as_ptr()) as usize,
            None => libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) as usize,
        }
    }
}

/// The definition of an interposed function that calls are forwarded to, remembered once
/// found.
///
/// `RTLD_NEXT` searches only what was loaded at start. A program that loads libibverbs (or
/// librdmacm) with `dlopen`, as a plugin's dependency (UCX, libfabric and MPI plugins do),
/// still calls this library's definitions, which come first in the global scope; the real
/// ones are then found by the library's soname among the loaded objects. Nothing found is not
/// remembered: the library may be loaded later.
pub(crate) struct Forward {
    found: AtomicUsize,
}

impl Forward {
    pub(crate) const fn new() -> Forward {
        Forward {
            found: AtomicUsize::new(0),
        }
    }

    /// `name` (at `version`) in `soname`, or 0 when no loaded object defines it.
    pub(crate) fn get(&self, soname: &CStr, name: &CStr, version: Option<&CStr>) -> usize {
        let known = self.found.load(Ordering::Relaxed);
        if known != 0 {
            return known;
        }
        let mut p = next_symbol(name, version);
        if p == 0 {
            p = loaded_symbol(soname, name, version);
        }
        if p != 0 {
            self.found.store(p, Ordering::Relaxed);
        }
        p
    }
}

/// `name` (at `version`) in the already loaded object `soname`, or 0. The object is made to
/// stay loaded (`RTLD_NODELETE`), and this handle is kept: a plugin that brought it in may be
/// closed and loaded again, and the address [`Forward`] remembers must stay valid.
fn loaded_symbol(soname: &CStr, name: &CStr, version: Option<&CStr>) -> usize {
    // SAFETY: dlopen with RTLD_NOLOAD only looks up an already loaded object.
    let handle = unsafe {
        libc::dlopen(
            soname.as_ptr(),
            libc::RTLD_NOW | libc::RTLD_NOLOAD | libc::RTLD_NODELETE,
        )
    };
    if handle.is_null() {
        return 0;
    }
    // SAFETY: lookups of NUL-terminated names in a live handle, never closed.
    unsafe {
        match version {
            Some(v) => libc::dlvsym(handle, name.as_ptr(), v.as_ptr()) as usize,
            None => libc::dlsym(handle, name.as_ptr()) as usize,
        }
    }
}

/// libibverbs' soname.
pub(crate) const LIBIBVERBS: &CStr = c"libibverbs.so.1";

type GetDeviceListFn = unsafe extern "C" fn(*mut c_int) -> *mut *mut c_void;
type SocketFn = unsafe extern "C" fn(c_int, c_int, c_int) -> c_int;

/// Clears the listing flag when the real call returns (or unwinds).
struct Listing;

impl Drop for Listing {
    fn drop(&mut self) {
        LISTING.with(|l| l.set(false));
    }
}

/// `ibv_get_device_list` (IBVERBS_1.1): libibverbs' own, with `NETLINK_RDMA` unavailable for
/// its duration under `xroce exec`.
///
/// # Safety
/// As `ibv_get_device_list`: `num_devices` is NULL or points at a writable int.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_list(num_devices: *mut c_int) -> *mut *mut c_void {
    static REAL: Forward = Forward::new();
    let real = REAL.get(LIBIBVERBS, c"ibv_get_device_list", Some(c"IBVERBS_1.1"));
    // A libibverbs loaded after this library (with dlopen) has not had the provider yet.
    crate::register::register_late();
    if real == 0 {
        crate::set_errno(libc::ENOSYS);
        return std::ptr::null_mut();
    }
    // SAFETY: the address of libibverbs' `ibv_get_device_list@IBVERBS_1.1`.
    let real: GetDeviceListFn = unsafe { std::mem::transmute::<usize, GetDeviceListFn>(real) };
    let _listing = under_xroce_exec().then(|| {
        LISTING.with(|l| l.set(true));
        Listing
    });
    // SAFETY: forwarding the caller's argument.
    unsafe { real(num_devices) }
}

/// `socket(2)`, refusing `NETLINK_RDMA` while libibverbs lists devices under `xroce exec`.
///
/// # Safety
/// As `socket(2)`.
#[no_mangle]
pub unsafe extern "C" fn socket(domain: c_int, ty: c_int, protocol: c_int) -> c_int {
    if domain == libc::AF_NETLINK && protocol == NETLINK_RDMA && LISTING.with(|l| l.get()) {
        crate::set_errno(libc::EPROTONOSUPPORT);
        return -1;
    }
    // Not a OnceLock: its first caller looks the symbol up holding the C library's loader
    // lock, and a library constructor calling `socket` under that lock (in a `dlopen` on
    // another thread) would then wait on the OnceLock for good. Two threads looking it up
    // at once both find the same address.
    static REAL: AtomicUsize = AtomicUsize::new(0);
    let mut real = REAL.load(Ordering::Relaxed);
    if real == 0 {
        real = next_symbol(c"socket", None);
        REAL.store(real, Ordering::Relaxed);
    }
    if real != 0 {
        // SAFETY: the C library's `socket`.
        let real: SocketFn = unsafe { std::mem::transmute::<usize, SocketFn>(real) };
        // SAFETY: forwarding the caller's arguments.
        return unsafe { real(domain, ty, protocol) };
    }
    // No next definition (not possible in a dynamically linked process): the system call.
    // SAFETY: socket(2) takes three integers.
    unsafe { libc::syscall(libc::SYS_socket, domain, ty, protocol) as c_int }
}
