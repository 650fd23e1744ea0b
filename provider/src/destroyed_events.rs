//! What happens to the events of a CQ, QP or SRQ when it is destroyed.
//!
//! The kernel's uverbs drops a destroyed object's events that the application has not read
//! yet, and `ibv_destroy_*` then waits until every event it did read is acknowledged
//! (`ibv_ack_cq_events`, `ibv_ack_async_event`). Both matter: `ibv_get_cq_event` and
//! `ibv_get_async_event` turn a record into a pointer to the object and read through it, and
//! the acknowledgement locks the object's mutex. xroce's events are records in pipes (the
//! completion channel's and the context's async pipe), so a destroy takes the object's unread
//! records out of them and waits for the rest to be acknowledged, as libibverbs'
//! `ibv_cmd_destroy_*` do for a kernel device.

use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd};

use libc::{c_int, pthread_cond_t, pthread_mutex_t};

use crate::abi::verbs::async_event_desc;
use crate::event_routes::{with_routes, ObjectRoute, Routes};

/// Takes out of the pipe whose read end is `read_fd` (and write end `write_end`) every
/// record of `record_len` bytes for which `dead` holds; the others are written back in their
/// order. Returns how many were taken out, or `None` when the pipe could not be read.
///
/// Call it with the routes lock held, so that no event is written meanwhile. The pipe is read
/// through a second, non-blocking opening of it (`/proc/self/fd/N`): the application's own
/// descriptor stays blocking, and a thread of the application reading events at the same time
/// cannot leave this one waiting. Where that opening fails (no `/proc`, no descriptor left, a
/// sandbox), nothing is taken out.
pub(crate) fn purge_pipe(
    read_fd: c_int,
    write_end: &OwnedFd,
    record_len: usize,
    dead: impl Fn(&[u8]) -> bool,
) -> Option<u32> {
    let mut record = [0u8; 32];
    if record_len == 0 || record_len > record.len() {
        return None;
    }
    let path = CString::new(format!("/proc/self/fd/{read_fd}")).ok()?;
    // SAFETY: opening a NUL-terminated path; the descriptor is closed below.
    let fd = unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_RDONLY | libc::O_NONBLOCK | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return None;
    }
    let mut kept = Vec::new();
    let mut purged = 0;
    loop {
        // SAFETY: reading at most `record.len()` bytes into `record`.
        let n = unsafe { libc::read(fd, record.as_mut_ptr().cast(), record_len) };
        if n <= 0 {
            break;
        }
        let got = &record[..n as usize];
        if n as usize == record_len && dead(got) {
            purged += 1;
        } else {
            kept.extend_from_slice(got);
        }
    }
    // SAFETY: closing the descriptor opened above.
    unsafe { libc::close(fd) };
    for r in kept.chunks(record_len) {
        // SAFETY: writing from a valid buffer to the pipe's write end. The records were in
        // the pipe a moment ago, so there is room for them again.
        unsafe { libc::write(write_end.as_raw_fd(), r.as_ptr().cast(), r.len()) };
    }
    Some(purged)
}

/// Waits until `acknowledged()` holds, reading it under `mutex` and sleeping on `cond`,
/// which `ibv_ack_cq_events` and `ibv_ack_async_event` signal (libibverbs' own wait in
/// `ibv_cmd_destroy_cq`, `_qp` and `_srq`). An application that never acknowledges an event
/// it took waits here, as it would on any RDMA device.
///
/// # Safety
/// `mutex` and `cond` must be the initialised mutex and condition variable of a live object,
/// and `acknowledged` may only read that object.
pub(crate) unsafe fn wait_acknowledged(
    mutex: *mut pthread_mutex_t,
    cond: *mut pthread_cond_t,
    acknowledged: impl Fn() -> bool,
) {
    // SAFETY: per the contract; the counters are written by the application under `mutex`.
    unsafe {
        libc::pthread_mutex_lock(mutex);
        while !acknowledged() {
            libc::pthread_cond_wait(cond, mutex);
        }
        libc::pthread_mutex_unlock(mutex);
    }
}

/// For a destroyed QP or SRQ whose route `remove` takes out of the routing table: its unread
/// async events are dropped, and this waits until the ones the application took are
/// acknowledged (`events_completed`, under `mutex`, signalled on `cond`).
///
/// # Safety
/// `async_fd` must be the read end of the object's context's async pipe; `mutex`, `cond` and
/// `events_completed` the object's own, initialised.
pub(crate) unsafe fn forget_object_events(
    remove: impl FnOnce(&mut Routes) -> Option<ObjectRoute>,
    async_fd: c_int,
    mutex: *mut pthread_mutex_t,
    cond: *mut pthread_cond_t,
    events_completed: *const u32,
) {
    let taken = with_routes(|r| {
        let route = remove(r)?;
        events_taken(
            async_fd,
            &route.async_tx,
            ASYNC_RECORD,
            route.object,
            route.async_posted,
        )
    });
    if let Some(taken) = taken {
        // SAFETY: per the contract.
        unsafe {
            wait_acknowledged(mutex, cond, || {
                covers(std::ptr::read_volatile(events_completed), taken)
            })
        };
    }
}

/// The first eight bytes of a record, as the pointer or element they hold.
fn record_word(record: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    if let Some(b) = record.get(..8) {
        w.copy_from_slice(b);
    }
    u64::from_ne_bytes(w)
}

/// Bytes of a completion channel's record (a `struct ibv_cq *`).
pub(crate) const COMP_RECORD: usize = 8;
/// Bytes of an async event record (`struct ib_uverbs_async_event_desc`).
pub(crate) const ASYNC_RECORD: usize = std::mem::size_of::<async_event_desc>();

/// Takes `object`'s unread records (`record_len` bytes each: [`COMP_RECORD`] or
/// [`ASYNC_RECORD`]) out of the pipe whose read end is `read_fd` and returns how many of the
/// `posted` ones the application has taken, which it must acknowledge; `None` when the pipe
/// could not be read, so that nothing is known to wait for (waiting for records still unread
/// would never end in a program that reads them in the thread now destroying). Records name
/// their object by its address, unique among live objects.
pub(crate) fn events_taken(
    read_fd: c_int,
    write_end: &OwnedFd,
    record_len: usize,
    object: usize,
    posted: u32,
) -> Option<u32> {
    if posted == 0 {
        return Some(0);
    }
    let purged = purge_pipe(read_fd, write_end, record_len, |r| {
        record_word(r) == object as u64
    })?;
    Some(posted.wrapping_sub(purged))
}

/// Whether `completed` acknowledgements cover `taken` events: libibverbs' counters are
/// 32-bit and wrap, so they are compared as a wrapping difference.
pub(crate) fn covers(completed: u32, taken: u32) -> bool {
    (completed.wrapping_sub(taken) as i32) >= 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    fn pipe() -> (c_int, OwnedFd) {
        let mut fds = [0 as c_int; 2];
        // SAFETY: pipe2 writes two descriptors into `fds`.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: fds[1] is ours from here.
        (fds[0], unsafe { OwnedFd::from_raw_fd(fds[1]) })
    }

    fn write_word(fd: &OwnedFd, w: u64) {
        let b = w.to_ne_bytes();
        // SAFETY: writing 8 bytes from a valid buffer.
        assert_eq!(
            unsafe { libc::write(fd.as_raw_fd(), b.as_ptr().cast(), 8) },
            8
        );
    }

    fn read_all(fd: c_int) -> Vec<u64> {
        let mut out = Vec::new();
        loop {
            let mut pfd = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: polling one valid descriptor without waiting.
            if unsafe { libc::poll(&mut pfd, 1, 0) } != 1 {
                return out;
            }
            let mut b = [0u8; 8];
            // SAFETY: reading 8 bytes into a valid buffer.
            assert_eq!(unsafe { libc::read(fd, b.as_mut_ptr().cast(), 8) }, 8);
            out.push(u64::from_ne_bytes(b));
        }
    }

    #[test]
    fn takes_out_only_the_dead_records_and_keeps_the_order_of_the_rest() {
        let (rd, wr) = pipe();
        for w in [1, 7, 2, 7, 3] {
            write_word(&wr, w);
        }
        let purged = purge_pipe(rd, &wr, 8, |r| record_word(r) == 7);
        assert_eq!(purged, Some(2));
        assert_eq!(read_all(rd), [1, 2, 3]);
        // The application's descriptor is still blocking.
        // SAFETY: reading the flags of a valid descriptor.
        let flags = unsafe { libc::fcntl(rd, libc::F_GETFL) };
        assert_eq!(flags & libc::O_NONBLOCK, 0);
        // An empty pipe: nothing to take out, and no wait.
        assert_eq!(purge_pipe(rd, &wr, 8, |_| true), Some(0));
        // A descriptor that is no pipe of ours cannot be read: nothing is known.
        assert_eq!(purge_pipe(-1, &wr, 8, |_| true), None);
        // SAFETY: closing the read end made above.
        unsafe { libc::close(rd) };
    }

    #[test]
    fn counts_what_the_application_took() {
        let (rd, wr) = pipe();
        write_word(&wr, 9);
        write_word(&wr, 4);
        // Three posted for CQ 9, one of them still unread: two were taken.
        assert_eq!(events_taken(rd, &wr, COMP_RECORD, 9, 3), Some(2));
        assert_eq!(read_all(rd), [4]);
        // Nothing posted: the pipe is not even looked at.
        write_word(&wr, 9);
        assert_eq!(events_taken(rd, &wr, COMP_RECORD, 9, 0), Some(0));
        assert_eq!(read_all(rd), [9]);
        // SAFETY: closing the read end made above.
        unsafe { libc::close(rd) };
    }

    #[test]
    fn acknowledgements_are_counted_across_the_wrap() {
        assert!(covers(5, 5));
        assert!(covers(6, 5));
        assert!(!covers(4, 5));
        assert!(covers(2, u32::MAX - 1), "completed wrapped past taken");
        assert!(!covers(u32::MAX, 1), "taken wrapped, completed not yet");
    }
}
