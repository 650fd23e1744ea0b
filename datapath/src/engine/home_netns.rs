//! The network namespace an engine started in, held open so that its look-ups (routes,
//! neighbours, the attached XDP program) ask that namespace's kernel tables whichever thread
//! makes them.
//!
//! A netlink socket answers for the namespace of the thread that opened it. The engine's own
//! sockets are opened when it starts, but some look-ups open theirs later, on whatever thread
//! calls the verb (`ibv_modify_qp`'s neighbour resolution) or runs a progress round: in a
//! program whose threads sit in different namespaces, such a thread would look up the wrong
//! tables (a route to a peer that is one of its own addresses, say).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;

/// The calling thread's network namespace, as the kernel names it to each thread.
const THREAD_NETNS: &str = "/proc/thread-self/ns/net";

/// A network namespace held open (see the module documentation).
#[derive(Debug)]
pub(crate) struct HomeNetns {
    file: File,
    /// The namespace's inode number: two threads in one namespace see the same.
    ino: u64,
}

impl HomeNetns {
    /// The calling thread's namespace, or `None` where it cannot be opened (no `/proc`): look-ups
    /// then run on the calling thread, in whatever namespace it is in.
    pub(crate) fn current() -> Option<HomeNetns> {
        let file = File::open(THREAD_NETNS).ok()?;
        let ino = file.metadata().ok()?.ino();
        Some(HomeNetns { file, ino })
    }

    /// Whether the calling thread is in this namespace (true when that cannot be told).
    fn is_current(&self) -> bool {
        std::fs::metadata(THREAD_NETNS).map_or(true, |m| m.ino() == self.ino)
    }

    /// Runs `f` in this namespace: on the calling thread when it is there already (the usual
    /// case, and the cost is one `stat`), else on a thread started in it for the purpose. A
    /// panic in `f` is passed on.
    pub(crate) fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> io::Result<R> {
        if self.is_current() {
            return Ok(f());
        }
        std::thread::scope(|s| {
            let handle = std::thread::Builder::new()
                .name("xroce-netns".into())
                .spawn_scoped(s, move || {
                    // SAFETY: `file` is an open nsfs file of a network namespace; setns with
                    // CLONE_NEWNET moves only this new thread, which ends after `f`.
                    if unsafe { libc::setns(self.file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                        return Err(io::Error::last_os_error());
                    }
                    Ok(f())
                })?;
            match handle.join() {
                Ok(r) => r,
                Err(panic) => std::panic::resume_unwind(panic),
            }
        })
    }
}

/// Runs `f` in `home` when there is one, else on the calling thread.
pub(crate) fn run_at_home<R: Send>(
    home: Option<&HomeNetns>,
    f: impl FnOnce() -> R + Send,
) -> io::Result<R> {
    match home {
        Some(home) => home.run(f),
        None => Ok(f()),
    }
}
