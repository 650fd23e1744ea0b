//! Registration with libibverbs when the library is loaded.
//!
//! The provider does not link against libibverbs: it finds the copy already in the process
//! (`RTLD_NOLOAD`), checks its release ([`crate::abi::version`]) and resolves the private
//! symbols by version. A process without libibverbs (a shell that `xroce exec` preloads this
//! library into on its way to the real program) is left alone.

use std::ffi::{CStr, CString};
use std::sync::OnceLock;

use libc::{c_char, c_int, c_void};

use crate::abi::driver::{
    verbs_context_ops, verbs_device_ops, verbs_match_ent, VERBS_MATCH_MODALIAS,
    VERBS_MATCH_SENTINEL,
};
use crate::abi::verbs::{ibv_device, verbs_context};
use crate::abi::version;

/// libibverbs' private entry points this provider calls.
pub struct Private {
    pub init_and_alloc_context: InitAndAllocFn,
    pub set_ops: SetOpsFn,
    pub uninit_context: UninitFn,
}

type InitAndAllocFn =
    unsafe extern "C" fn(*mut ibv_device, c_int, usize, *mut verbs_context, u32) -> *mut c_void;
type SetOpsFn = unsafe extern "C" fn(*mut verbs_context, *const verbs_context_ops);
type UninitFn = unsafe extern "C" fn(*mut verbs_context);
type RegisterFn = unsafe extern "C" fn(*const verbs_device_ops);

static PRIVATE: OnceLock<Private> = OnceLock::new();

/// The private entry points, once registration succeeded.
pub fn private() -> Option<&'static Private> {
    PRIVATE.get()
}

struct SyncTable([verbs_match_ent; 2]);
// SAFETY: the table is immutable and its pointers point at 'static C strings.
unsafe impl Sync for SyncTable {}

struct SyncDeviceOps(verbs_device_ops);
// SAFETY: immutable, and every pointer in it points at 'static data.
unsafe impl Sync for SyncDeviceOps {}

/// Devices whose `device/modalias` is `xroce:NAME` (written by `xroce link add`).
static MATCH_TABLE: SyncTable = SyncTable([
    verbs_match_ent {
        driver_data: std::ptr::null_mut(),
        modalias: c"xroce:*".as_ptr(),
        vendor: 0,
        device: 0,
        kind: VERBS_MATCH_MODALIAS,
    },
    verbs_match_ent {
        driver_data: std::ptr::null_mut(),
        modalias: std::ptr::null(),
        vendor: 0,
        device: 0,
        kind: VERBS_MATCH_SENTINEL,
    },
]);

static DEVICE_OPS: SyncDeviceOps = SyncDeviceOps(verbs_device_ops {
    name: c"xroce".as_ptr(),
    match_min_abi_version: 0,
    match_max_abi_version: u32::MAX,
    match_table: std::ptr::addr_of!(MATCH_TABLE.0).cast(),
    static_providers: std::ptr::null(),
    match_device: None,
    alloc_context: Some(crate::device::alloc_context),
    import_context: None,
    alloc_device: Some(crate::device::alloc_device),
    uninit_device: Some(crate::device::uninit_device),
});

/// This provider's `verbs_device_ops` (devices whose `ops` point here are xroce's).
pub fn device_ops() -> *const verbs_device_ops {
    &DEVICE_OPS.0
}

#[used]
#[link_section = ".init_array"]
static ON_LOAD: extern "C" fn() = on_load;

extern "C" fn on_load() {
    xroce_datapath::stderr_log::install();
    if let Err(Some(why)) = register() {
        REFUSED.store(true, std::sync::atomic::Ordering::Relaxed);
        xroce_datapath::stderr_line!("{why}");
    }
}

/// Registration was refused (and said why) when the library was loaded.
static REFUSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Registers the provider now if libibverbs was not in the process when this library was
/// loaded: a plugin that depends on it was loaded later with `dlopen` (UCX, libfabric and MPI
/// plugins are), and calls `ibv_get_device_list`, interposed here, before anything else. Tried
/// once.
pub fn register_late() {
    use std::sync::atomic::Ordering::Relaxed;
    if PRIVATE.get().is_some() || REFUSED.load(Relaxed) {
        return;
    }
    // Tried again on each call until libibverbs is there (`Err(None)`); a refusal is said
    // once and final. Concurrent first calls may both try: `register` keeps the first.
    if let Err(Some(why)) = register() {
        if !REFUSED.swap(true, Relaxed) {
            xroce_datapath::stderr_line!("{why}");
        }
    }
}

/// Registers the provider. `Err(None)`: nothing to do (no libibverbs in this process);
/// `Err(Some(reason))`: refused, with the reason to print once.
fn register() -> Result<(), Option<String>> {
    // SAFETY: dlopen with RTLD_NOLOAD only looks up an already loaded object.
    let handle = unsafe {
        libc::dlopen(
            c"libibverbs.so.1".as_ptr(),
            libc::RTLD_NOW | libc::RTLD_NOLOAD | libc::RTLD_GLOBAL,
        )
    };
    if handle.is_null() {
        return Err(None);
    }
    let file = library_file(handle).ok_or_else(|| {
        Some("xroce: cannot locate the libibverbs file; the xroce device is not registered".into())
    })?;
    if let Some(why) = version::refusal(&file) {
        return Err(Some(why));
    }
    // Accepted, so the release is known.
    let abi = version::private_abi(version::release_from_file_name(&file).unwrap_or(0));
    let symbol_version = format!("IBVERBS_PRIVATE_{abi}");
    let find = |name: &str| -> Result<*mut c_void, Option<String>> {
        lookup(handle, name, &symbol_version)
            .ok_or_else(|| Some(format!("xroce: {file} lacks {name}@{symbol_version}")))
    };
    let register = find(&format!("verbs_register_driver_{abi}"))?;
    let init = find("_verbs_init_and_alloc_context")?;
    let set_ops = find("verbs_set_ops")?;
    let uninit = find("verbs_uninit_context")?;
    // SAFETY: the symbols come from a libibverbs whose release uses exactly these signatures
    // (checked above); function pointers and data pointers have the same size here.
    let private = unsafe {
        Private {
            init_and_alloc_context: std::mem::transmute::<*mut c_void, InitAndAllocFn>(init),
            set_ops: std::mem::transmute::<*mut c_void, SetOpsFn>(set_ops),
            uninit_context: std::mem::transmute::<*mut c_void, UninitFn>(uninit),
        }
    };
    if PRIVATE.set(private).is_err() {
        return Ok(()); // already registered (loaded twice under different names)
    }
    // SAFETY: as above; DEVICE_OPS is 'static as libibverbs requires.
    unsafe {
        let register = std::mem::transmute::<*mut c_void, RegisterFn>(register);
        register(&DEVICE_OPS.0);
    }
    Ok(())
}

/// `name@version` in the library `handle`.
fn lookup(handle: *mut c_void, name: &str, version: &str) -> Option<*mut c_void> {
    let name = CString::new(name).ok()?;
    let version = CString::new(version).ok()?;
    // SAFETY: valid handle and NUL-terminated strings.
    let p = unsafe { libc::dlvsym(handle, name.as_ptr(), version.as_ptr()) };
    (!p.is_null()).then_some(p)
}

/// The real file behind the loaded libibverbs (its name carries the rdma-core release).
fn library_file(handle: *mut c_void) -> Option<String> {
    // SAFETY: valid handle, NUL-terminated name.
    let sym = unsafe { libc::dlsym(handle, c"ibv_get_device_list".as_ptr()) };
    if sym.is_null() {
        return None;
    }
    // SAFETY: dladdr fills `info` for an address inside a loaded object.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    if unsafe { libc::dladdr(sym, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr returned a NUL-terminated file name owned by the loader.
    let name = unsafe { CStr::from_ptr(info.dli_fname as *const c_char) };
    let path = std::path::Path::new(name.to_str().ok()?);
    let real = std::fs::canonicalize(path).ok()?;
    Some(real.to_string_lossy().into_owned())
}
