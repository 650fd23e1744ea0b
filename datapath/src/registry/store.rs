//! The registry's state on disk: the lock, the per-namespace link records, and the device nodes.
//!
//! ```text
//! /run/xroce/lock                         flock(2)ed by every command that changes something
//! /run/xroce/net-<N>/netns_cookie          SO_NETNS_COOKIE of namespace N when the dir was made
//! /run/xroce/net-<N>/links/<NAME>          "netdev=DEV\n"; its mtime is the link's creation time
//! /run/xroce/net-<N>/sysfs/                the generated tree (see `sysfs.rs`)
//! /dev/infiniband/xroce-<NAME>             char 1:7, shared by every namespace using NAME
//! ```
//!
//! Network namespace ids (nsfs inode numbers) are reused as soon as a namespace is freed, so a
//! directory left by a deleted namespace would otherwise be inherited by the next namespace
//! that gets the same number, links and all. The kernel's network namespace cookie is never
//! reused: a directory whose recorded cookie differs from the caller's namespace belongs to a
//! dead namespace and is discarded.

use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use super::{
    cdev_path, run_dir_of, Link, RegistryError, CDEV_DIR, CDEV_MAJOR, CDEV_MINOR, RUN_ROOT,
};

/// Longest wait for another xroce command holding the lock.
const LOCK_TIMEOUT: Duration = Duration::from_secs(10);
const LOCK_FILE: &str = "lock";
const COOKIE_FILE: &str = "netns_cookie";
const LINKS_DIR: &str = "links";
/// `SO_NETNS_COOKIE` (asm-generic value, used by x86 and arm; Linux 5.14+). Not exported by
/// the libc crate for every target.
const SO_NETNS_COOKIE: libc::c_int = 71;

/// The registry of the calling thread's network namespace, locked.
#[derive(Debug)]
pub(crate) struct Store {
    netns: u64,
    dir: PathBuf,
    exclusive: bool,
    /// Set when the namespace directory was found to belong to a dead namespace and could not
    /// be discarded (shared lock): it is then treated as empty.
    stale: bool,
    _lock: File,
}

impl Store {
    /// Locks the registry for changes (creating `/run/xroce` if needed). Needs root.
    pub(crate) fn open_exclusive() -> Result<Store, RegistryError> {
        let root = Path::new(RUN_ROOT);
        mkdir(root)?;
        let path = root.join(LOCK_FILE);
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .open(&path)
            .map_err(|e| RegistryError::io("opening", &path, e))?;
        flock(&lock, &path, libc::LOCK_EX)?;
        let netns = super::netns_id()?;
        let mut store = Store {
            netns,
            dir: run_dir_of(netns),
            exclusive: true,
            stale: false,
            _lock: lock,
        };
        store.check_owner()?;
        Ok(store)
    }

    /// Locks the registry for reading; `None` when nothing was ever registered on this
    /// machine. Works without root.
    pub(crate) fn open_shared() -> Result<Option<Store>, RegistryError> {
        let Some(lock) = shared_lock()? else {
            return Ok(None);
        };
        let netns = super::netns_id()?;
        let mut store = Store {
            netns,
            dir: run_dir_of(netns),
            exclusive: false,
            stale: false,
            _lock: lock,
        };
        store.check_owner()?;
        Ok(Some(store))
    }

    /// The namespace id (`net-<N>`).
    pub(crate) fn netns(&self) -> u64 {
        self.netns
    }

    /// `/run/xroce/net-<N>`.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    fn links_dir(&self) -> PathBuf {
        self.dir.join(LINKS_DIR)
    }

    /// Discards the namespace directory if it was made for another (dead) namespace with the
    /// same id; records the cookie of ours when the directory exists without one.
    fn check_owner(&mut self) -> Result<(), RegistryError> {
        if !self.dir.exists() {
            return Ok(());
        }
        let Some(ours) = netns_cookie() else {
            // Kernel without SO_NETNS_COOKIE: cannot tell, trust the directory.
            return Ok(());
        };
        let path = self.dir.join(COOKIE_FILE);
        let recorded = match fs::read_to_string(&path) {
            Ok(text) => text.trim().parse::<u64>().ok(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(RegistryError::io("reading", &path, e)),
        };
        match recorded {
            Some(cookie) if cookie == ours => Ok(()),
            None if self.exclusive => write_file(&path, &format!("{ours}\n")),
            None => Ok(()),
            Some(_) if !self.exclusive => {
                self.stale = true;
                Ok(())
            }
            Some(_) => {
                log::info!(
                    "{} belongs to a network namespace that no longer exists; removing it",
                    self.dir.display()
                );
                let names: Vec<String> = self.links()?.into_iter().map(|l| l.name).collect();
                remove_tree(&self.dir)?;
                for name in names {
                    remove_dev_node_if_unused(&name)?;
                }
                Ok(())
            }
        }
    }

    /// Creates the namespace directory (with its cookie) if needed.
    fn ensure_dir(&self) -> Result<(), RegistryError> {
        if !self.dir.exists() {
            mkdir(&self.dir)?;
            if let Some(cookie) = netns_cookie() {
                write_file(&self.dir.join(COOKIE_FILE), &format!("{cookie}\n"))?;
            }
        }
        mkdir(&self.links_dir())
    }

    /// Every link of this namespace, by name.
    pub(crate) fn links(&self) -> Result<Vec<Link>, RegistryError> {
        if self.stale {
            return Ok(Vec::new());
        }
        let dir = self.links_dir();
        let entries = match fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(RegistryError::io("reading", &dir, e)),
        };
        let mut links = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| RegistryError::io("reading", &dir, e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            // Temporary files of an interrupted write start with '.', which names cannot.
            if name.starts_with('.') || super::check_name(&name).is_err() {
                continue;
            }
            if let Some(link) = self.link(&name)? {
                links.push(link);
            }
        }
        links.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(links)
    }

    /// The link called `name`, if any.
    pub(crate) fn link(&self, name: &str) -> Result<Option<Link>, RegistryError> {
        if self.stale {
            return Ok(None);
        }
        let path = self.links_dir().join(name);
        let text = match fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(RegistryError::io("reading", &path, e)),
        };
        let created = fs::metadata(&path)
            .and_then(|m| m.modified())
            .unwrap_or(SystemTime::UNIX_EPOCH);
        let Some(netdev) = text.lines().find_map(|l| l.strip_prefix("netdev=")) else {
            log::warn!("ignoring {}: no netdev= line", path.display());
            return Ok(None);
        };
        Ok(Some(Link {
            name: name.to_string(),
            netdev: netdev.trim().to_string(),
            created,
        }))
    }

    /// Records a new link.
    pub(crate) fn write_link(&self, name: &str, netdev: &str) -> Result<(), RegistryError> {
        debug_assert!(self.exclusive);
        self.ensure_dir()?;
        write_file(&self.links_dir().join(name), &format!("netdev={netdev}\n"))
    }

    /// Removes a link's record (missing is fine).
    pub(crate) fn remove_link(&self, name: &str) -> Result<(), RegistryError> {
        debug_assert!(self.exclusive);
        let path = self.links_dir().join(name);
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(RegistryError::io("removing", &path, e)),
        }
    }

    /// Removes the namespace directory (the last link is gone).
    pub(crate) fn remove_dir(&self) -> Result<(), RegistryError> {
        debug_assert!(self.exclusive);
        remove_tree(&self.dir)
    }
}

/// The cookie of the calling thread's network namespace, or `None` when the kernel has none
/// (before 5.14).
fn netns_cookie() -> Option<u64> {
    // SAFETY: socket(2) with constant arguments; the result is checked below.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` is a socket we just opened and own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut cookie: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: `cookie` is a u64 and `len` its size; the kernel writes at most `len` bytes.
    let ret = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            (&mut cookie as *mut u64).cast(),
            &mut len,
        )
    };
    (ret == 0 && len as usize == std::mem::size_of::<u64>()).then_some(cookie)
}

fn flock(file: &File, path: &Path, op: libc::c_int) -> Result<(), RegistryError> {
    let start = Instant::now();
    loop {
        // SAFETY: flock on a descriptor we own; no memory is involved.
        if unsafe { libc::flock(file.as_raw_fd(), op | libc::LOCK_NB) } == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EWOULDBLOCK) && err.raw_os_error() != Some(libc::EINTR)
        {
            return Err(RegistryError::io("locking", path, err));
        }
        if start.elapsed() > LOCK_TIMEOUT {
            return Err(RegistryError::LockTimeout {
                path: path.to_path_buf(),
                seconds: LOCK_TIMEOUT.as_secs(),
            });
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Creates a directory (and its parents) readable by everyone: programs run by other users
/// read the generated tree.
pub(crate) fn mkdir(path: &Path) -> Result<(), RegistryError> {
    if path.is_dir() {
        return Ok(());
    }
    if let Some(parent) = path.parent() {
        if !parent.as_os_str().is_empty() {
            mkdir(parent)?;
        }
    }
    match fs::create_dir(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(()),
        Err(e) => return Err(RegistryError::io("creating", path, e)),
    }
    // The umask may have removed bits.
    fs::set_permissions(path, fs::Permissions::from_mode(0o755))
        .map_err(|e| RegistryError::io("setting the mode of", path, e))
}

/// The registry's lock taken shared, for a writer of files in a tree that a regeneration
/// (which takes it exclusive) must not replace meanwhile. `None` when there is no registry.
pub(crate) fn shared_lock() -> Result<Option<File>, RegistryError> {
    let path = Path::new(RUN_ROOT).join(LOCK_FILE);
    let lock = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(RegistryError::io("opening", &path, e)),
    };
    flock(&lock, &path, libc::LOCK_SH)?;
    Ok(Some(lock))
}

/// Writes a whole file atomically (temporary file, then rename), mode 0644.
pub(crate) fn write_file(path: &Path, content: &str) -> Result<(), RegistryError> {
    let Some(name) = path.file_name() else {
        return Err(RegistryError::io(
            "writing",
            path,
            io::Error::from(io::ErrorKind::InvalidInput),
        ));
    };
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".{}", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o644)
            .open(&tmp)?;
        f.write_all(content.as_bytes())?;
        f.set_permissions(fs::Permissions::from_mode(0o644))?;
        fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        return Err(RegistryError::io("writing", path, e));
    }
    Ok(())
}

/// `rm -rf path` (missing is fine).
pub(crate) fn remove_tree(path: &Path) -> Result<(), RegistryError> {
    match fs::remove_dir_all(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(RegistryError::io("removing", path, e)),
    }
}

fn node_rdev() -> libc::dev_t {
    libc::makedev(CDEV_MAJOR, CDEV_MINOR)
}

/// What sits at a device node path, for messages.
fn describe(meta: &fs::Metadata) -> String {
    let t = meta.file_type();
    if t.is_char_device() || t.is_block_device() {
        let rdev = meta.rdev();
        format!(
            "a {} device {}:{}",
            if t.is_char_device() {
                "character"
            } else {
                "block"
            },
            libc::major(rdev),
            libc::minor(rdev)
        )
    } else if t.is_dir() {
        "a directory".to_string()
    } else if t.is_symlink() {
        "a symbolic link".to_string()
    } else if t.is_file() {
        "a regular file".to_string()
    } else {
        "a FIFO or socket".to_string()
    }
}

/// Whether `/dev/infiniband/xroce-NAME` exists as our node (`Ok(true)`), is absent
/// (`Ok(false)`), or is something else (an error).
pub(crate) fn check_dev_node(name: &str) -> Result<bool, RegistryError> {
    let path = cdev_path(name);
    match fs::symlink_metadata(&path) {
        Ok(meta) if meta.file_type().is_char_device() && meta.rdev() == node_rdev() => Ok(true),
        Ok(meta) => Err(RegistryError::DevNodeConflict {
            found: describe(&meta),
            path,
        }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(RegistryError::io("inspecting", path, e)),
    }
}

/// Creates `/dev/infiniband/xroce-NAME` (char 1:7, mode 0666) unless it is there already;
/// `Ok(true)` when it was created now.
///
/// libibverbs lists a sysfs device only if its node exists (`try_access_device`) and opens it
/// in `ibv_open_device` (`open_cdev`: `O_RDWR`, a character device whose number equals sysfs
/// `dev`). With the numbers of /dev/full, any command libibverbs still writes to the kernel
/// fails cleanly with `ENOSPC`.
pub(crate) fn ensure_dev_node(name: &str) -> Result<bool, RegistryError> {
    if check_dev_node(name)? {
        return Ok(false);
    }
    mkdir(Path::new(CDEV_DIR))?;
    let path = cdev_path(name);
    let c_path = CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        RegistryError::io(
            "creating",
            &path,
            io::Error::from(io::ErrorKind::InvalidInput),
        )
    })?;
    // SAFETY: `c_path` is NUL-terminated and lives across the call; mknod touches no memory of
    // ours.
    if unsafe { libc::mknod(c_path.as_ptr(), libc::S_IFCHR | 0o666, node_rdev()) } != 0 {
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EEXIST) {
            // Created by a concurrent command of another namespace (the lock is global, so
            // only by something else): accept it if it is right.
            return check_dev_node(name).map(|_| false);
        }
        return Err(RegistryError::io("creating the device node", &path, err));
    }
    // The umask applies to mknod; programs of any user open the node read-write.
    fs::set_permissions(&path, fs::Permissions::from_mode(0o666))
        .map_err(|e| RegistryError::io("setting the mode of", &path, e))?;
    Ok(true)
}

/// The cookie recorded in namespace directory `dir`, if it has one.
fn recorded_cookie(dir: &Path) -> Option<u64> {
    fs::read_to_string(dir.join(COOKIE_FILE))
        .ok()
        .and_then(|text| text.trim().parse().ok())
}

/// Whether a namespace other than the caller's has a link called `name`.
fn used_elsewhere(name: &str) -> Result<bool, RegistryError> {
    let own = run_dir_of(super::netns_id()?);
    let root = Path::new(RUN_ROOT);
    let entries = match fs::read_dir(root) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(RegistryError::io("reading", root, e)),
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let file_name = entry.file_name();
        let Some(id) = file_name
            .to_string_lossy()
            .strip_prefix("net-")
            .and_then(|id| id.parse::<u64>().ok())
        else {
            continue;
        };
        // The directory of a namespace deleted without `xroce link del` stays behind; its
        // links hold nothing (nobody can run a program there any more).
        if path != own
            && path.join(LINKS_DIR).join(name).exists()
            && netns_in_use(id, recorded_cookie(&path))
        {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Whether the namespace that made the directory of network namespace `id` can still be
/// used: a bind mount keeps a namespace with that inode (`ip netns add` makes one under
/// /run/netns), or a process is in one, and (when the directory recorded a cookie) that
/// namespace's cookie is the recorded one. Inode numbers are reused as soon as a namespace is
/// freed, so a live namespace with the same number can be a newer one.
fn netns_in_use(id: u64, recorded_cookie: Option<u64>) -> bool {
    let Some(handle) = live_netns_handle(id) else {
        return false;
    };
    let Some(recorded) = recorded_cookie else {
        return true;
    };
    // Cannot enter it (no CAP_SYS_ADMIN, or it went in between): count it as used.
    cookie_of_netns(&handle, id).is_none_or(|live| live == recorded)
}

/// A path through which network namespace `id` can be opened: its bind mount or a process
/// in it. `Some` without a path (`None` inside) when it cannot be told whether one exists.
fn live_netns_handle(id: u64) -> Option<Option<PathBuf>> {
    let tag = format!("net:[{id}]");
    match fs::read_to_string("/proc/self/mountinfo") {
        // Fields: id, parent, major:minor, root, mount point, ...; an nsfs bind mount's root
        // is `net:[N]`.
        Ok(mounts) => {
            let mount = mounts.lines().find_map(|line| {
                let mut fields = line.split(' ').skip(3);
                (fields.next() == Some(tag.as_str()))
                    .then(|| fields.next().map(unescape_mount_path))
                    .flatten()
            });
            if let Some(path) = mount {
                return Some(Some(path));
            }
        }
        // Cannot tell: count it as used (the device node stays, as before).
        Err(_) => return Some(None),
    }
    match crate::netns::processes_in_netns(id) {
        // Cannot tell without /proc: count it as used.
        None => Some(None),
        Some(inside) => inside
            .first()
            .map(|pid| Some(PathBuf::from(format!("/proc/{pid}/ns/net")))),
    }
}

/// A mount point as mountinfo writes it, with its octal escapes (`\040` for a space) undone.
fn unescape_mount_path(field: &str) -> PathBuf {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).and_then(|d| {
            std::str::from_utf8(d)
                .ok()
                .and_then(|d| u8::from_str_radix(d, 8).ok())
        });
        match (bytes[i], octal) {
            (b'\\', Some(byte)) => {
                out.push(byte);
                i += 4;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    PathBuf::from(std::ffi::OsString::from_vec(out))
}

/// The cookie of network namespace `id`, opened through `handle` (`None`: unknown) and read on
/// a thread of its own that enters it; `None` when that cannot be done.
fn cookie_of_netns(handle: &Option<PathBuf>, id: u64) -> Option<u64> {
    let file = File::open(handle.as_ref()?).ok()?;
    // The path may name another namespace by now (a process gone and its pid reused, a bind
    // mount replaced): only the namespace `id` itself is asked.
    if file.metadata().ok()?.ino() != id {
        return None;
    }
    std::thread::scope(|scope| {
        std::thread::Builder::new()
            .spawn_scoped(scope, || {
                // SAFETY: `file` is an open file that lives across the call; setns checks that
                // it is a network namespace and moves only this thread, which ends here.
                if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    return None;
                }
                netns_cookie()
            })
            .ok()?
            .join()
            .ok()
            .flatten()
    })
}

/// Removes `/dev/infiniband/xroce-NAME` unless another namespace still has a link of that
/// name, and `/dev/infiniband` if that leaves it empty. `Ok(true)` when the node was removed.
pub(crate) fn remove_dev_node_if_unused(name: &str) -> Result<bool, RegistryError> {
    if used_elsewhere(name)? {
        return Ok(false);
    }
    // Only remove what is ours.
    match check_dev_node(name) {
        Ok(true) => {}
        Ok(false) | Err(RegistryError::DevNodeConflict { .. }) => return Ok(false),
        Err(e) => return Err(e),
    }
    let path = cdev_path(name);
    match fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(RegistryError::io("removing", &path, e)),
    }
    // Fails while other nodes remain there, which is fine: a kernel without RDMA has no
    // /dev/infiniband of its own, so an empty one is ours.
    let _ = fs::remove_dir(CDEV_DIR);
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_is_in_use_while_a_process_is_in_it() {
        let own = crate::registry::netns_id().expect("own namespace");
        assert!(netns_in_use(own, None));
        // No namespace has inode 1.
        assert!(!netns_in_use(1, None));
    }

    /// A directory left by a deleted namespace whose inode number a live namespace now has
    /// belongs to nobody: the recorded cookie tells the two apart.
    #[test]
    fn a_namespace_with_a_reused_inode_is_not_the_one_that_made_the_directory() {
        let own = crate::registry::netns_id().expect("own namespace");
        let Some(cookie) = netns_cookie() else {
            eprintln!("skipped: the kernel has no SO_NETNS_COOKIE");
            return;
        };
        if cookie_of_netns(&live_netns_handle(own).flatten(), own).is_none() {
            eprintln!("skipped: cannot enter a network namespace (not root)");
            return;
        }
        assert!(netns_in_use(own, Some(cookie)));
        assert!(!netns_in_use(own, Some(cookie.wrapping_add(1))));
    }

    #[test]
    fn mount_points_lose_their_octal_escapes() {
        assert_eq!(
            unescape_mount_path(r"/run/netns/a\040b\134c"),
            PathBuf::from(r"/run/netns/a b\c")
        );
        assert_eq!(unescape_mount_path(r"/x\04"), PathBuf::from(r"/x\04"));
    }
}
