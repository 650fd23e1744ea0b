//! Where the pins live, and getting to a bpffs that outlives this process.
//!
//! Layout: `/sys/fs/bpf/xroce/<netns-id>/<ifname>/{link,prog,xsks_map,counters,drop_config,local_addrs,steer_config,local_list}`.
//! `<netns-id>` is the inode number of the calling thread's network namespace: interface names
//! repeat across namespaces while bpffs is shared by all of them.
//!
//! # `ip netns exec` and the mount namespace
//!
//! `ip netns exec NS cmd` runs `cmd` in a private mount namespace in which `/sys` is a fresh
//! sysfs (so that `/sys/class/net` shows NS). `/sys/fs/bpf` there is an empty sysfs directory,
//! not the host's bpffs. Mounting a bpffs on it would create a new, private bpffs instance that
//! disappears with the command's mount namespace, taking the pinned link with it: the program
//! would be detached the moment the command exits.
//!
//! So when `/sys/fs/bpf` is not a bpffs and this thread's mount namespace is not the one it
//! came from, the pin work runs in the original mount namespace (PID 1's, or failing access to
//! it, that of the nearest ancestor process in another mount namespace, which for `ip netns
//! exec` is the process that ran `ip`). Only the mount namespace changes; the network
//! namespace (which decides which interfaces we see) stays the caller's.
//!
//! `setns(CLONE_NEWNS)` is refused (`EINVAL`) to a thread that shares its filesystem context
//! (root, cwd) with other threads, which every thread of a multi-threaded process does. Rather
//! than require the whole process to be single-threaded at that point, the work runs on a
//! short-lived helper thread that first `unshare(CLONE_FS)`s, so only that thread moves; the
//! caller's threads keep their mount namespace. The helper inherits the caller's network
//! namespace (threads start in their creator's namespaces). The file descriptors it obtains are
//! process-wide and stay valid after it exits.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::sys;
use super::XdpError;

/// Where bpffs is expected.
pub(crate) const BPFFS: &str = "/sys/fs/bpf";
/// xroce's directory on it.
pub(crate) const ROOT: &str = "/sys/fs/bpf/xroce";
/// `BPF_FS_MAGIC`.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
/// File names of the pins in an interface's directory (besides the maps, pinned under their
/// own names): the link, and the program (so its name, hence the build, can be read without
/// CAP_SYS_ADMIN, which `BPF_PROG_GET_FD_BY_ID` needs).
pub(crate) const LINK_PIN: &str = "link";
pub(crate) const PROG_PIN: &str = "prog";

/// Longest wait for another loader holding the lock.
const LOCK_TIMEOUT: Duration = Duration::from_secs(10);

/// Identifies the calling thread's network namespace: the inode of its nsfs file.
pub(crate) fn netns_id() -> io::Result<u64> {
    // thread-self, not self: /proc/self/ns/net is the main thread's namespace, and tests and
    // engines call this from threads that did setns(CLONE_NEWNET).
    Ok(std::fs::metadata("/proc/thread-self/ns/net")?.ino())
}

/// The pin directory of `iface` in network namespace `netns`.
pub(crate) fn iface_dir(netns: u64, iface: &str) -> PathBuf {
    Path::new(ROOT).join(netns.to_string()).join(iface)
}

/// The directory of all pins of network namespace `netns`.
pub(crate) fn netns_dir(netns: u64) -> PathBuf {
    Path::new(ROOT).join(netns.to_string())
}

fn is_bpffs(path: &str) -> bool {
    sys::fs_magic(Path::new(path)).is_ok_and(|m| m == BPF_FS_MAGIC)
}

/// Runs `f` where `/sys/fs/bpf` is the persistent bpffs, mounting it if needed.
pub(crate) fn with_bpffs_create<R: Send>(
    f: impl FnOnce() -> Result<R, XdpError> + Send,
) -> Result<R, XdpError> {
    match with_bpffs(true, f)? {
        Some(r) => r,
        None => Err(XdpError::Bpffs {
            detail: "no bpffs is mounted and mounting one failed".to_string(),
        }),
    }
}

/// Runs `f` where `/sys/fs/bpf` is the persistent bpffs; `None` when no bpffs is mounted there
/// (then nothing can be pinned, so nothing is loaded).
pub(crate) fn with_bpffs_existing<R: Send>(
    f: impl FnOnce() -> Result<R, XdpError> + Send,
) -> Result<Option<R>, XdpError> {
    match with_bpffs(false, f)? {
        Some(r) => r.map(Some),
        None => Ok(None),
    }
}

fn with_bpffs<R: Send>(create: bool, f: impl FnOnce() -> R + Send) -> Result<Option<R>, XdpError> {
    if is_bpffs(BPFFS) {
        return Ok(Some(f()));
    }
    match origin_mount_ns() {
        Some(ns) => std::thread::scope(|s| {
            let helper = s.spawn(move || -> Result<Option<R>, XdpError> {
                enter_mount_ns(&ns)?;
                if !is_bpffs(BPFFS) {
                    if !create {
                        return Ok(None);
                    }
                    mount_bpffs()?;
                }
                Ok(Some(f()))
            });
            match helper.join() {
                Ok(r) => r,
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }),
        None => {
            if !create {
                return Ok(None);
            }
            mount_bpffs()?;
            Ok(Some(f()))
        }
    }
}

/// The mount namespace to pin in when ours is a private one (see the module comment), or
/// `None` when ours is the original (or no other can be opened).
fn origin_mount_ns() -> Option<File> {
    let own = std::fs::metadata("/proc/thread-self/ns/mnt").ok()?.ino();
    let open = |pid: u32| -> Option<(File, u64)> {
        let file = File::open(format!("/proc/{pid}/ns/mnt")).ok()?;
        let ino = file.metadata().ok()?.ino();
        Some((file, ino))
    };
    if let Some((file, ino)) = open(1) {
        return (ino != own).then_some(file);
    }
    // PID 1's namespace links cannot be read here (some sandboxes forbid it even to root):
    // walk up the ancestors to the first one in another mount namespace.
    let mut pid = std::process::id();
    for _ in 0..64 {
        pid = parent_pid(pid)?;
        if pid <= 1 {
            return None;
        }
        if let Some((file, ino)) = open(pid) {
            if ino != own {
                return Some(file);
            }
        }
    }
    None
}

fn parent_pid(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("PPid:"))
        .and_then(|v| v.trim().parse().ok())
}

/// Moves the calling (helper) thread, and only it, into the mount namespace `ns`.
fn enter_mount_ns(ns: &File) -> Result<(), XdpError> {
    // SAFETY: unshare with CLONE_FS only gives this thread its own copy of root/cwd/umask; it
    // touches no memory.
    if unsafe { libc::unshare(libc::CLONE_FS) } != 0 {
        return Err(bpffs_error(
            "cannot give the helper thread its own filesystem context (unshare(CLONE_FS))",
        ));
    }
    // SAFETY: `ns` is an open nsfs file of a mount namespace; setns changes only this thread's
    // mount namespace (and its root/cwd, now private to it).
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNS) } != 0 {
        return Err(bpffs_error(
            "cannot enter the original mount namespace to reach its bpffs (setns)",
        ));
    }
    Ok(())
}

fn bpffs_error(what: &str) -> XdpError {
    let err = io::Error::last_os_error();
    XdpError::Bpffs {
        detail: format!("{what}: {err}"),
    }
}

fn mount_bpffs() -> Result<(), XdpError> {
    let source = c"bpf";
    let target = CString::new(BPFFS).map_err(|_| XdpError::Bpffs {
        detail: "bad path".to_string(),
    })?;
    let options = c"mode=0700";
    // SAFETY: all strings are NUL-terminated and live across the call.
    let ret = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            source.as_ptr(),
            0,
            options.as_ptr().cast(),
        )
    };
    if ret != 0 {
        let err = io::Error::last_os_error();
        let hint = match err.raw_os_error() {
            Some(libc::EPERM) | Some(libc::EACCES) => " (mounting needs CAP_SYS_ADMIN)",
            Some(libc::ENOENT) => " (/sys/fs/bpf does not exist: is sysfs mounted on /sys?)",
            _ => "",
        };
        return Err(XdpError::Bpffs {
            detail: format!("mounting bpffs on {BPFFS} failed: {err}{hint}"),
        });
    }
    log::info!("mounted bpffs on {BPFFS}");
    Ok(())
}

/// An exclusive lock on xroce's pin tree, held while pins are created or removed, so that two
/// loaders (threads or processes) do not interleave. Released on drop.
pub(crate) struct PinLock {
    _dir: File,
}

/// Creates `ROOT` if needed and locks it.
pub(crate) fn lock(create: bool) -> Result<Option<PinLock>, XdpError> {
    if create {
        std::fs::create_dir_all(ROOT).map_err(|e| pin_io_error("creating", Path::new(ROOT), e))?;
    }
    let dir = match File::open(ROOT) {
        Ok(dir) => dir,
        Err(e) if e.kind() == io::ErrorKind::NotFound && !create => return Ok(None),
        Err(e) => return Err(pin_io_error("opening", Path::new(ROOT), e)),
    };
    let start = Instant::now();
    loop {
        // SAFETY: flock on a descriptor we own; no memory is involved.
        if unsafe { libc::flock(dir.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(Some(PinLock { _dir: dir }));
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EWOULDBLOCK) && err.raw_os_error() != Some(libc::EINTR)
        {
            return Err(pin_io_error("locking", Path::new(ROOT), err));
        }
        if start.elapsed() > LOCK_TIMEOUT {
            return Err(XdpError::Bpffs {
                detail: format!(
                    "another xroce loader has held the lock on {ROOT} for more than {} s",
                    LOCK_TIMEOUT.as_secs()
                ),
            });
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// An I/O error on the pin tree, with permission problems reported as such.
pub(crate) fn pin_io_error(what: &str, path: &Path, err: io::Error) -> XdpError {
    match err.raw_os_error() {
        Some(libc::EPERM) | Some(libc::EACCES) => XdpError::PermissionDenied {
            iface: None,
            action: format!("{what} {}", path.display()),
            source: err,
        },
        _ => XdpError::Bpffs {
            detail: format!("{what} {} failed: {err}", path.display()),
        },
    }
}

/// Removes the pins of one interface directory and the directory, then the namespace directory
/// if it became empty. Missing files are fine.
pub(crate) fn remove_iface_dir(dir: &Path) -> Result<(), XdpError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(pin_io_error("reading", dir, e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| pin_io_error("reading", dir, e))?;
        let path = entry.path();
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(pin_io_error("removing", &path, e)),
        }
    }
    match std::fs::remove_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(pin_io_error("removing", dir, e)),
    }
    if let Some(parent) = dir.parent() {
        // Fails while other interfaces of the namespace still have pins: that is fine.
        let _ = std::fs::remove_dir(parent);
    }
    Ok(())
}
