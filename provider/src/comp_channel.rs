//! Completion channels for xroce contexts.
//!
//! `ibv_create_comp_channel` is not a provider op: libibverbs always asks the kernel for the
//! channel's file descriptor, and there is no kernel device behind xroce. `xroce exec` preloads
//! this library, so these two definitions take the place of libibverbs' own (symbol
//! interposition): for an xroce context the channel is a pipe whose write end the engine feeds
//! with `struct ibv_cq *` values, exactly the 8-byte records `ibv_get_cq_event` reads; for any
//! other context (a real RDMA device in the same program) the call goes on to libibverbs.
//! `ibv_get_cq_event` is defined here too, so that a thread waiting for an event on such a
//! channel takes the engine's frames meanwhile (see there).
//! See `docs/decisions.md` ("Completion channels").

use std::collections::HashMap;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};

use libc::{c_int, c_void};

use crate::abi::verbs::{ibv_comp_channel, ibv_context, ibv_cq};
use crate::device::is_ours;
use crate::discovery::{Forward, LIBIBVERBS};
use crate::set_errno;
use xroce_datapath::engine::TakeFrames;

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
    next_at(name, c"IBVERBS_1.0", cache)
}

/// libibverbs' own definition of `name` at `version`.
fn next_at<T: Copy>(
    name: &'static std::ffi::CStr,
    version: &'static std::ffi::CStr,
    cache: &Forward,
) -> Option<T> {
    let p = cache.get(LIBIBVERBS, name, Some(version));
    // SAFETY: `T` is the function pointer type of `name` at `version`.
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

type GetEventFn =
    unsafe extern "C" fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int;

extern "C" {
    /// glibc's (the `libc` crate does not declare it).
    fn pthread_setcancelstate(state: c_int, oldstate: *mut c_int) -> c_int;
}

/// `PTHREAD_CANCEL_DISABLE` (pthread.h).
const PTHREAD_CANCEL_DISABLE: c_int = 1;

/// How long a waiter that found the engine busy (another thread taking the frames, which
/// raises the events) waits on its channel alone before it looks at the frames again.
const BUSY_ENGINE_WAIT_MS: c_int = 1;

/// `ibv_get_cq_event`. For an xroce channel the wait takes the frames the event may come from
/// itself: a blocking channel is watched together with the engine's frames, and frames that
/// arrive are taken in this thread (`Engine::take_frames`), which writes the event into the
/// channel and then reads it. libibverbs' own definition reads the channel alone, and then
/// every message cost two wake-ups in a row, the progress thread's for the frame and this
/// thread's for the event it wrote (`docs/decisions.md`, "Events without the progress thread
/// in between"). A channel the application made non-blocking (it waits with its own `poll`
/// or `epoll`) is read as libibverbs reads it. Other channels go to libibverbs.
///
/// Its `poll` and `read` are cancellation points, as libibverbs' `read` is: a thread
/// cancelled there (`pthread_cancel`; rping cancels its CQ thread so) unwinds through this
/// function, which is defined behaviour only with the "C-unwind" ABI and with no value that
/// has a destructor alive at those calls (the engine is looked up afresh around each wait).
///
/// # Safety
/// `channel` must be a live completion channel; `cq` and `cq_context` must be writable.
#[no_mangle]
pub unsafe extern "C-unwind" fn ibv_get_cq_event(
    channel: *mut ibv_comp_channel,
    cq: *mut *mut ibv_cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    // SAFETY: per the contract.
    let fd = unsafe { (*channel).fd };
    if !channels(|c| c.contains_key(&fd)) {
        static REAL: Forward = Forward::new();
        return match next_at::<GetEventFn>(c"ibv_get_cq_event", c"IBVERBS_1.1", &REAL) {
            // SAFETY: libibverbs' function, called with the caller's arguments.
            Some(real) => unsafe { real(channel, cq, cq_context) },
            None => {
                set_errno(libc::ENOSYS);
                -1
            }
        };
    }
    // SAFETY: an xroce channel's context is an xroce context, alive while the channel is.
    if let Err(e) = unsafe { wait_taking_frames(fd, (*channel).context) } {
        set_errno(e);
        return -1;
    }
    // The record libibverbs' definition reads: the CQ's address, 8 bytes.
    let mut record: u64 = 0;
    // SAFETY: reading 8 bytes into a u64.
    let n = unsafe { libc::read(fd, (&mut record as *mut u64).cast(), 8) };
    if n != 8 {
        return -1;
    }
    let the_cq = record as usize as *mut ibv_cq;
    // SAFETY: the engine wrote the address of a live CQ of this channel; the caller's
    // pointers are writable. (xroce's `cq_event` op does nothing, so it is not called.)
    unsafe {
        *cq = the_cq;
        *cq_context = (*the_cq).cq_context;
    }
    0
}

/// `f` on the running engine of an xroce context, when it has one this process may use; the
/// reference to the engine is let go before this returns.
///
/// # Safety
/// `context` must be a live xroce context.
unsafe fn with_engine<R>(
    context: *mut ibv_context,
    f: impl FnOnce(&xroce_datapath::engine::Engine) -> R,
) -> Option<R> {
    // SAFETY: per the contract.
    let state = unsafe { crate::device::state(context) };
    let engine = state
        .engine
        .try_lock()
        .ok()
        .and_then(|g| g.as_ref().cloned())?;
    // A forked child's read takes its parent's events, as before; it does not take frames
    // from its parent's rings.
    engine.started_by_this_process().then(|| f(&engine.engine))
}

/// Waits until the blocking channel `fd` of `context` has a record, taking the engine's
/// frames meanwhile. Returns at once for a non-blocking channel, or when the engine offers no
/// frames to watch (or stops doing so); the caller's read then waits as libibverbs' would.
/// `Err(errno)` when a signal ended the wait (see [`interrupted`]) or `poll` failed.
///
/// Nothing with a destructor is alive while it blocks (see `ibv_get_cq_event`).
///
/// # Safety
/// `context` must be a live xroce context.
unsafe fn wait_taking_frames(fd: c_int, context: *mut ibv_context) -> Result<(), c_int> {
    if !several_cpus() {
        return Ok(());
    }
    // SAFETY: F_GETFL on a descriptor the channel owns.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 || flags & libc::O_NONBLOCK != 0 {
        return Ok(());
    }
    loop {
        // SAFETY: per the contract.
        let Some(frames) = (unsafe { with_engine(context, |e| e.frames_fd()) }).flatten() else {
            return Ok(());
        };
        let mut fds = [
            libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: frames,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` holds two pollfds for the duration of the call.
        if unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) } < 0 {
            interrupted()?;
            continue;
        }
        if fds[0].revents != 0 {
            // A record, or the channel's end: the read says which.
            return Ok(());
        }
        if fds[1].revents & libc::POLLIN == 0 {
            // The engine's socket reports an error or hang-up: leave the frames to the
            // engine, and wait on the channel alone.
            return Ok(());
        }
        // The round may make system calls that are cancellation points (the transmit's
        // `sendto`) while locks and buffers are held: no cancellation in it.
        let mut cancel_state: c_int = 0;
        // SAFETY: glibc's pthread_setcancelstate, writing the old state into a local.
        unsafe { pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &mut cancel_state) };
        // SAFETY: per the contract.
        let took = unsafe { with_engine(context, |e| e.take_frames()) };
        // SAFETY: as above; the state before is restored.
        unsafe { pthread_setcancelstate(cancel_state, &mut cancel_state) };
        match took {
            Some(TakeFrames::Taken) => {}
            Some(TakeFrames::OtherThread) => {
                // It takes the frames; they stay readable until it has, so look at the
                // channel alone for a moment.
                fds[0].revents = 0;
                // SAFETY: one pollfd for the duration of the call.
                if unsafe { libc::poll(fds.as_mut_ptr(), 1, BUSY_ENGINE_WAIT_MS) } < 0 {
                    interrupted()?;
                }
            }
            Some(TakeFrames::Stopped) | None => return Ok(()),
        }
    }
}

/// Whether this process may run on more than one CPU. On one, the progress thread (raised to
/// real-time priority while it sleeps) always runs first when a frame wakes both threads,
/// takes the frame and writes the event, and the wait on two descriptors only adds system
/// calls: in guests of one vCPU, `ib_send_lat -e` took 680-780 µs one-way with it against
/// 590-670 µs without. Asked once per process.
fn several_cpus() -> bool {
    static SEVERAL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SEVERAL.get_or_init(|| std::thread::available_parallelism().is_ok_and(|n| n.get() > 1))
}

/// After a `poll` that failed: `Ok` to wait again, `Err(errno)` to return it. A signal
/// interrupts a `read` of the channel only when a handler without `SA_RESTART` ran (otherwise
/// the kernel restarts the read), but it always interrupts `poll`: the wait goes on, as the
/// read would, unless some handler of the process lacks `SA_RESTART`.
fn interrupted() -> Result<(), c_int> {
    let e = std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO);
    if e == libc::EINTR && every_handler_restarts() {
        Ok(())
    } else {
        Err(e)
    }
}

/// Whether every signal handler the process installed restarts interrupted system calls.
fn every_handler_restarts() -> bool {
    (1..=libc::SIGRTMAX()).all(|sig| {
        // SAFETY: an all-zero sigaction is a valid value to be overwritten.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: reads the disposition of `sig` into `old`; changes nothing.
        let rc = unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) };
        rc != 0
            || old.sa_sigaction == libc::SIG_DFL
            || old.sa_sigaction == libc::SIG_IGN
            || old.sa_flags & libc::SA_RESTART != 0
    })
}
