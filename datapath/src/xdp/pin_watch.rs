//! Noticing, without polling, that xroce's program was unloaded from an interface.
//!
//! The kernel says nothing when a BPF link detaches an XDP program: `ip monitor link` stays
//! silent. But [`super::unload`] (`xroce link del`, `cargo xtask xdp unload`) detaches the link
//! and then removes the interface's pins, and bpffs reports removals through inotify like any
//! other file system. An engine watches its interface's pin directory, and when something
//! there goes away it looks whether its program is still attached (one rtnetlink request).
//! An engine whose frames are all received, or that is idle, learns at once that its RoCE
//! frames now go to the kernel; the retransmission-timeout check only helps a sender.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use super::{netns_id, pins, XdpError};

/// An inotify descriptor watching the pin directory of one interface for removals.
#[derive(Debug)]
pub struct PinWatch {
    fd: OwnedFd,
}

/// What in the directory counts: an entry removed or moved away, or the directory itself.
const REMOVALS: u32 =
    libc::IN_DELETE | libc::IN_MOVED_FROM | libc::IN_DELETE_SELF | libc::IN_MOVE_SELF;

impl PinWatch {
    /// Watches the pins of xroce's program on `iface` (in the calling thread's network
    /// namespace). `None` when there is nothing to watch: no pins (the program not loaded
    /// through them), or bpffs out of reach from this mount namespace.
    pub fn open(iface: &str) -> Result<Option<PinWatch>, XdpError> {
        let netns = netns_id(iface)?;
        // The pins may live in another mount namespace (see `pins`): the watch is placed from
        // there, and then works from any thread.
        let watch = pins::with_bpffs_existing(|| {
            let dir = pins::iface_dir(netns, iface);
            Ok(watch_dir(&dir)
                .map_err(|e| log::debug!("cannot watch {}: {e}", dir.display()))
                .ok())
        })?;
        Ok(watch.flatten())
    }

    /// Reads what has been reported; true when anything was removed. Never blocks.
    pub fn drain(&self) -> bool {
        // Room for many events: names in bpffs are short.
        let mut buf = [0u8; 4096];
        let mut removed = false;
        loop {
            // SAFETY: `buf` is valid for writes of its length for the duration of the call.
            let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                // EAGAIN: all read. Any other error leaves nothing more to learn here.
                return removed;
            }
            // Any event on this watch is a removal (the mask asks for nothing else), or
            // IN_IGNORED once the directory is gone, which follows one.
            removed = true;
        }
    }
}

impl AsRawFd for PinWatch {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

fn watch_dir(dir: &Path) -> io::Result<PinWatch> {
    let path = CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: inotify_init1 takes only flags.
    let raw = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a new descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: `fd` is a valid inotify descriptor and `path` a NUL-terminated string that
    // outlives the call.
    if unsafe { libc::inotify_add_watch(fd.as_raw_fd(), path.as_ptr(), REMOVALS) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(PinWatch { fd })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_removal_in_the_directory_is_reported_once_and_other_changes_are_not() {
        let dir = std::env::temp_dir().join(format!("xroce-pin-watch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("directory");
        std::fs::write(dir.join("link"), b"").expect("file");
        let watch = watch_dir(&dir).expect("watch");
        assert!(!watch.drain(), "nothing happened yet");
        // A new file, and a write to one, are not removals.
        std::fs::write(dir.join("counters"), b"x").expect("file");
        std::fs::write(dir.join("link"), b"y").expect("write");
        assert!(!watch.drain());
        std::fs::remove_file(dir.join("link")).expect("remove");
        assert!(watch.drain(), "the removal is reported");
        assert!(!watch.drain(), "and only once");
        std::fs::remove_file(dir.join("counters")).expect("remove");
        std::fs::remove_dir(&dir).expect("remove dir");
        assert!(watch.drain(), "the directory's removal is reported");
    }

    #[test]
    fn a_missing_directory_cannot_be_watched() {
        assert!(watch_dir(Path::new("/nonexistent/xroce/pins")).is_err());
    }
}
