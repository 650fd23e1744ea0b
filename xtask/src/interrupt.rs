//! Ctrl-C and SIGTERM for the commands that set things up (network namespaces, guests, XDP
//! programs) and must take them down again when interrupted.
//!
//! The signal only sets a flag. The programs these commands run are in the same foreground
//! process group, so a Ctrl-C stops them too, and the command's waits end; the command then
//! sees the flag, removes what it made and exits with an error.

use std::sync::atomic::{AtomicI32, Ordering};

/// The signal that came, 0 before one did.
static SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(signal: libc::c_int) {
    SIGNAL.store(signal, Ordering::SeqCst);
}

/// From now on SIGINT and SIGTERM set the flag instead of ending the process.
pub fn catch_signals() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: installs an async-signal-safe handler (one atomic store).
        unsafe {
            libc::signal(
                sig,
                on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
            );
        }
    }
}

/// Whether a signal came.
pub fn was_interrupted() -> bool {
    signal().is_some()
}

/// The signal that came, if one did.
pub fn signal() -> Option<libc::c_int> {
    Some(SIGNAL.load(Ordering::SeqCst)).filter(|&s| s != 0)
}

/// `Err("interrupted")` once a signal came.
pub fn interrupted() -> Result<(), String> {
    if was_interrupted() {
        Err("interrupted".into())
    } else {
        Ok(())
    }
}
