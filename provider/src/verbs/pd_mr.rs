//! Protection domains and memory regions.

use std::sync::Arc;

use libc::{c_int, c_void};
use xroce_core::transport::{Access, MrId, PdId};

use super::errno;
use crate::abi::driver::verbs_mr;
use crate::abi::verbs::{
    ibv_context, ibv_mr, ibv_pd, IBV_ACCESS_HUGETLB, IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_MW_BIND,
    IBV_ACCESS_OPTIONAL_RANGE, IBV_ACCESS_REMOTE_ATOMIC, IBV_ACCESS_REMOTE_READ,
    IBV_ACCESS_REMOTE_WRITE,
};
use crate::device::state;
use crate::engines::{engine_for, inherited, EngineRef};
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
    st.pds.lock().unwrap_or_else(|p| p.into_inner()).push(id);
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
    if inherited(&x.engine) {
        return 0; // the parent's
    }
    match x.engine.engine.with_device(|d| d.dealloc_pd(x.id)) {
        Ok(()) => {
            // SAFETY: libibverbs keeps the PD's context open while the PD exists.
            let st = unsafe { state(x.pd.context) };
            st.pds
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .retain(|&id| id != x.id);
            // SAFETY: the PD is gone from the device; free the box `alloc_pd` made.
            drop(unsafe { Box::from_raw(p as *mut XrocePd) });
            0
        }
        Err(e) => errno(&e),
    }
}

/// The transport's access rights for verbs access flags, or `None` for flags xroce cannot honour.
fn access(flags: c_int) -> Option<Access> {
    // Huge pages need nothing different here (rdma_rxe ignores the flag too).
    let flags = flags & !(IBV_ACCESS_OPTIONAL_RANGE | IBV_ACCESS_HUGETLB);
    let known = IBV_ACCESS_LOCAL_WRITE
        | IBV_ACCESS_REMOTE_WRITE
        | IBV_ACCESS_REMOTE_READ
        | IBV_ACCESS_REMOTE_ATOMIC
        | IBV_ACCESS_MW_BIND;
    if flags & !known != 0 {
        return None; // zero-based, on-demand paging: not supported
    }
    Some(Access((flags & 0xf) as u32))
}

/// Whether `[addr, addr + len)` is mapped memory of this process, and writable where the
/// access asks for writes: rdma_rxe pins a registration's pages (`ib_umem_get`, for writing
/// when the access allows any write) and fails with EFAULT otherwise. Without this check a
/// bad registration would succeed, and a peer's WRITE or a receive into it would crash the
/// whole process in the engine. The pages are faulted in (`MADV_POPULATE_READ`/`_WRITE`, as
/// pinning them would); on kernels before 5.14 the range is taken on trust.
fn check_mapped(addr: *mut c_void, len: usize, access: Access) -> Result<(), c_int> {
    if len == 0 {
        return Ok(());
    }
    // SAFETY: sysconf has no preconditions.
    let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        p if p > 0 => p as usize,
        _ => 4096,
    };
    let start = addr as usize & !(page - 1);
    let Some(end) = (addr as usize)
        .checked_add(len)
        .and_then(|e| e.checked_next_multiple_of(page))
    else {
        return Err(libc::EINVAL);
    };
    let writes = Access::LOCAL_WRITE.0 | Access::REMOTE_WRITE.0 | Access::REMOTE_ATOMIC.0;
    let advice = if access.0 & writes != 0 {
        libc::MADV_POPULATE_WRITE
    } else {
        libc::MADV_POPULATE_READ
    };
    loop {
        // SAFETY: madvise only inspects and faults in the range; it changes no contents.
        let r = unsafe { libc::madvise(start as *mut c_void, end - start, advice) };
        if r == 0 {
            return Ok(());
        }
        match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::EINTR) | Some(libc::EAGAIN) => continue,
            // Not mapped (ENOMEM), not accessible as asked (EINVAL: insufficient
            // permissions, or device memory, which rdma_rxe cannot pin either; EFAULT).
            Some(libc::ENOMEM) | Some(libc::EFAULT) => return Err(libc::EFAULT),
            Some(libc::EINVAL) if populate_supported() => return Err(libc::EFAULT),
            // An older kernel.
            _ => return Ok(()),
        }
    }
}

/// Whether this kernel knows `MADV_POPULATE_READ` (Linux 5.14), asked once on a page of its
/// own: older kernels answer EINVAL for the advice itself.
fn populate_supported() -> bool {
    static SUPPORTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        // SAFETY: a fresh anonymous page, advised and unmapped again.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if p == libc::MAP_FAILED {
                return false;
            }
            let ok = libc::madvise(p, 4096, libc::MADV_POPULATE_READ) == 0;
            libc::munmap(p, 4096);
            ok
        }
    })
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
    if inherited(&x.engine) {
        set_errno(libc::EIO);
        return std::ptr::null_mut();
    }
    let Some(acc) = access(flags) else {
        set_errno(libc::EOPNOTSUPP);
        return std::ptr::null_mut();
    };
    if iova != addr as u64 {
        // Memory is addressed by its virtual address (as rxe before IOVA support).
        set_errno(libc::EOPNOTSUPP);
        return std::ptr::null_mut();
    }
    if let Err(e) = check_mapped(addr, length, acc) {
        set_errno(e);
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
    if inherited(&x.engine) {
        return 0; // the parent's
    }
    match x.engine.engine.dereg_mr(x.id) {
        Ok(()) => {
            // SAFETY: deregistered; free the box `reg_mr` made.
            drop(unsafe { Box::from_raw(vmr as *mut XroceMr) });
            0
        }
        Err(e) => errno(&e),
    }
}
