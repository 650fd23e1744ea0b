//! Completion channels for xroce contexts.
//!
//! `ibv_create_comp_channel` is not a provider op: libibverbs always asks the kernel for the
//! channel's file descriptor, and there is no kernel device behind xroce. `xroce exec` preloads
//! this library, so these two definitions take the place of libibverbs' own (symbol
//! interposition): for an xroce context the channel is a pipe whose write end the engine feeds
//! with `struct ibv_cq *` values, exactly the 8-byte records `ibv_get_cq_event` reads; for any
//! other context (a real RDMA device in the same program) the call goes on to libibverbs.
//! See `docs/decisions.md` ("Completion channels").

use std::collections::HashMap;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};

use libc::{c_int, c_void};

use crate::abi::verbs::{ibv_comp_channel, ibv_context};
use crate::device::is_ours;
use crate::discovery::{Forward, LIBIBVERBS};
use crate::set_errno;

/// Read end (the channel's `fd`) → write end, for channels of xroce contexts.
static CHANNELS: Mutex<ChannelTable> = Mutex::new(None);

pub(crate) type ChannelTable = Option<HashMap<c_int, Arc<OwnedFd>>>;

/// The channel table itself, for [`crate::engines::guard_tables_across_fork`].
pub(crate) fn channel_table() -> &'static Mutex<ChannelTable> {
    &CHANNELS
}

fn channels<R>(f: impl FnOnce(&mut HashMap<c_int, Arc<OwnedFd>>) -> R) -> R {
    let mut g = CHANNELS.lock().unwrap_or_else(|p| p.into_inner());
    f(g.get_or_insert_with(HashMap::new))
}

/// The write end of an xroce completion channel, for a CQ created with it.
///
/// # Safety
/// `channel` must be NULL or a live completion channel.
pub(crate) unsafe fn writer(channel: *mut ibv_comp_channel) -> Option<Arc<OwnedFd>> {
    if channel.is_null() {
        return None;
    }
    // SAFETY: the application passes a channel it created.
    let fd = unsafe { (*channel).fd };
    channels(|c| c.get(&fd).cloned())
}

type CreateFn = unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_comp_channel;
type DestroyFn = unsafe extern "C" fn(*mut ibv_comp_channel) -> c_int;

/// libibverbs' own definition of `name` (see [`Forward`]).
fn next<T: Copy>(name: &'static std::ffi::CStr, cache: &Forward) -> Option<T> {
    let p = cache.get(LIBIBVERBS, name, Some(c"IBVERBS_1.0"));
    // SAFETY: `T` is the function pointer type of `name` at IBVERBS_1.0.
    (p != 0).then(|| unsafe { std::mem::transmute_copy::<usize, T>(&p) })
}

/// # Safety
/// `context` must be a live `ibv_context`.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_comp_channel(
    context: *mut ibv_context,
) -> *mut ibv_comp_channel {
    // SAFETY: per the contract.
    if context.is_null() || !unsafe { is_ours(context) } {
        static REAL: Forward = Forward::new();
        return match next::<CreateFn>(c"ibv_create_comp_channel", &REAL) {
            // SAFETY: libibverbs' function, called with the caller's argument.
            Some(real) => unsafe { real(context) },
            None => {
                set_errno(libc::ENOSYS);
                std::ptr::null_mut()
            }
        };
    }
    let mut fds = [0 as c_int; 2];
    // SAFETY: pipe2 writes two descriptors into `fds`.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return std::ptr::null_mut();
    }
    // The writer never blocks: at most one record per armed CQ is ever pending.
    // SAFETY: fcntl on a descriptor just created.
    unsafe { libc::fcntl(fds[1], libc::F_SETFL, libc::O_NONBLOCK) };
    // libibverbs frees the channel with free(3) (ibv_destroy_comp_channel), so allocate it with
    // malloc(3).
    // SAFETY: malloc of a plain struct; checked for NULL.
    let ch =
        unsafe { libc::malloc(std::mem::size_of::<ibv_comp_channel>()) } as *mut ibv_comp_channel;
    if ch.is_null() {
        // SAFETY: closing descriptors we own.
        unsafe {
            libc::close(fds[0]);
            libc::close(fds[1]);
        }
        set_errno(libc::ENOMEM);
        return std::ptr::null_mut();
    }
    // SAFETY: `ch` is a fresh allocation of the right size; fds[1] is ours.
    unsafe {
        ch.write(ibv_comp_channel {
            context,
            fd: fds[0],
            refcnt: 0,
        });
        let tx = Arc::new(OwnedFd::from_raw_fd(fds[1]));
        channels(|c| c.insert(fds[0], tx));
    }
    ch
}

/// # Safety
/// `channel` must be a live completion channel.
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_comp_channel(channel: *mut ibv_comp_channel) -> c_int {
    // SAFETY: per the contract.
    let fd = unsafe { (*channel).fd };
    let ours = channels(|c| c.contains_key(&fd));
    if !ours {
        static REAL: Forward = Forward::new();
        return match next::<DestroyFn>(c"ibv_destroy_comp_channel", &REAL) {
            // SAFETY: libibverbs' function, called with the caller's argument.
            Some(real) => unsafe { real(channel) },
            None => libc::ENOSYS,
        };
    }
    // SAFETY: as libibverbs does: refcnt is guarded by the context mutex (ibv_create_cq and
    // ibv_destroy_cq change it under that lock).
    unsafe {
        let ctx = (*channel).context;
        libc::pthread_mutex_lock(&mut (*ctx).mutex);
        if (*channel).refcnt != 0 {
            libc::pthread_mutex_unlock(&mut (*ctx).mutex);
            return libc::EBUSY;
        }
        channels(|c| c.remove(&fd));
        libc::close(fd);
        libc::free(channel as *mut c_void);
        libc::pthread_mutex_unlock(&mut (*ctx).mutex);
    }
    0
}
