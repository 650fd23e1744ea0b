//! On request, every engine of the process writes what it is doing to standard error: the
//! counters, the progress thread's view, and a line per QP and CQ (PSNs, queues, timers; see
//! `Engine::state_report`). For a program that stopped making progress, it tells which side
//! waits for what without a debugger.
//!
//! Opt-in, because it takes a signal the application might use itself:
//! `XROCE_DUMP_SIGNAL=USR1` (or `USR2`, or a number) makes that signal trigger the dump, e.g.
//! `kill -USR1 PID`. The handler only writes a byte to a pipe (all a signal handler may do); a
//! thread started with the first engine reads it and writes the report.

use std::io::Write;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicI32, Ordering};

/// Environment variable naming the signal that triggers the dump.
pub const DUMP_SIGNAL_ENV: &str = "XROCE_DUMP_SIGNAL";

/// Write end of the pipe the handler signals on (-1 until installed).
static PIPE_TX: AtomicI32 = AtomicI32::new(-1);

/// The signal `XROCE_DUMP_SIGNAL` names: `USR1`, `SIGUSR1`, `USR2`, `SIGUSR2` or a number.
pub fn parse_signal(name: &str) -> Option<libc::c_int> {
    let name = name.trim();
    let bare = name.strip_prefix("SIG").unwrap_or(name);
    match bare {
        "USR1" => Some(libc::SIGUSR1),
        "USR2" => Some(libc::SIGUSR2),
        _ => name
            .parse::<libc::c_int>()
            .ok()
            .filter(|n| (1..=libc::SIGRTMAX()).contains(n)),
    }
}

extern "C" fn on_signal(_: libc::c_int) {
    let fd = PIPE_TX.load(Ordering::Relaxed);
    if fd >= 0 {
        let b = 1u8;
        // SAFETY: write(2) is async-signal-safe; one byte from a valid local. A full pipe
        // (dumps already pending) drops the byte, which is fine.
        unsafe { libc::write(fd, (&b as *const u8).cast(), 1) };
    }
}

/// Installs the handler and starts the dump thread, once per process, if
/// `XROCE_DUMP_SIGNAL` asks for it. `report` writes every engine's state.
pub fn install_if_asked(report: fn(&mut dyn Write)) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    let Some(value) = std::env::var_os(DUMP_SIGNAL_ENV) else {
        return;
    };
    ONCE.call_once(|| {
        let Some(sig) = value.to_str().and_then(parse_signal) else {
            xroce_datapath::stderr_line!(
                "xroce: {DUMP_SIGNAL_ENV}={} is not a signal (USR1, USR2 or a number); no state \
                 dumps",
                value.to_string_lossy()
            );
            return;
        };
        if let Err(e) = install(sig, report) {
            xroce_datapath::stderr_line!("xroce: cannot set up state dumps on signal {sig}: {e}");
        }
    });
}

fn install(sig: libc::c_int, report: fn(&mut dyn Write)) -> std::io::Result<()> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: pipe2 writes two descriptors into the array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors are fresh and owned here from now on.
    let (rx, tx) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    std::thread::Builder::new()
        .name("xroce-dump".into())
        .spawn(move || dump_loop(rx, report))?;
    // The write end lives as long as the process (the handler may run at any time).
    PIPE_TX.store(std::os::fd::IntoRawFd::into_raw_fd(tx), Ordering::Relaxed);
    // SAFETY: a zeroed sigaction is valid; the handler only calls write(2).
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        sa.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut sa.sa_mask);
        if libc::sigaction(sig, &sa, std::ptr::null_mut()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Waits for the handler's bytes and writes a report for each.
fn dump_loop(rx: OwnedFd, report: fn(&mut dyn Write)) {
    use std::os::fd::AsRawFd;
    loop {
        let mut p = libc::pollfd {
            fd: rx.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, no timeout.
        if unsafe { libc::poll(&mut p, 1, -1) } < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return;
        }
        let mut buf = [0u8; 64];
        // SAFETY: reads into a local buffer of that size (non-blocking).
        unsafe { libc::read(rx.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        // Made first, then written a line at a time as xroce's other lines are (one
        // `write(2)` each, no lock: see `stderr_line!`), so that lines from other threads
        // fall between its lines, not inside them.
        let mut text = Vec::new();
        report(&mut text);
        for line in text.split_inclusive(|&b| b == b'\n') {
            xroce_datapath::write_stderr(line);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signal_names_and_numbers() {
        assert_eq!(parse_signal("USR1"), Some(libc::SIGUSR1));
        assert_eq!(parse_signal("SIGUSR2"), Some(libc::SIGUSR2));
        assert_eq!(parse_signal("10"), Some(10));
        assert_eq!(parse_signal("0"), None);
        assert_eq!(parse_signal("HUP?"), None);
    }
}
