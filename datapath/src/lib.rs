//! xroce on a real network.
//!
//! - [`xdp`]: builds in the XDP steering program, loads and pins it on an interface, and gives
//!   access to its maps (the XSKMAP engines bind into, the counters, the test-only drop knob).
//! - [`netlink`]: what the kernel knows about addressing: interfaces, their addresses (the GID
//!   table), routes and neighbours.
//! - [`afxdp`]: AF_XDP sockets over a UMEM in anonymous memory (transparent huge pages where
//!   the kernel gives them).
//! - [`port`]: the small frame I/O trait the engine drives (AF_XDP, DPDK; the simulator
//!   elsewhere).
//! - `dpdk` (cargo feature `dpdk`): the DPDK port, through DPDK's `net_af_packet` driver.
//! - [`engine`]: the progress loop joining a port, the kernel's addressing and the transport.
//! - [`cpu_time`]: CPU time of threads and processes from `/proc`.
//! - [`registry`]: xroce RDMA devices (`xroce link`) and the sysfs tree libibverbs finds them by.
//! - [`stderr_log`]: the logger that writes xroce's `log` records to standard error
//!   (`XROCE_LOG`).
//! - [`netns`], [`test_support`]: fixtures for the end-to-end tests of this and other crates.

pub mod afxdp;
pub mod cpu_time;
#[cfg(feature = "dpdk")]
pub mod dpdk;
pub mod engine;
pub mod ethtool;
pub mod netlink;
pub mod netns;
pub mod port;
pub mod registry;
pub mod stderr_log;
pub mod test_support;
pub mod udp_gso;
pub mod xdp;

/// The setting environment variable `name` holds, parsed (unset, or not Unicode: the
/// default).
pub fn setting_from_env<T: std::str::FromStr + Default>(name: &str) -> Result<T, T::Err> {
    match std::env::var(name) {
        Ok(v) => v.parse(),
        Err(_) => Ok(T::default()),
    }
}

/// `eprintln!` for code that runs inside applications (the engine, the provider): a standard
/// error that cannot be written (a pipe whose reader has gone, in a program that ignores
/// SIGPIPE) is ignored, where `eprintln!` would panic, and a panic inside a verb aborts the
/// application. The line is made first and written with one `write(2)`, without std's lock
/// on standard error: a child forked while another thread held that lock would wait for it
/// for good, and a thread holding it while it waits for one of xroce's locks would stall
/// every thread that has something to say. One write also keeps a line whole between
/// processes sharing the pipe (up to `PIPE_BUF`), which the lock's piecewise writes did not.
#[macro_export]
macro_rules! stderr_line {
    ($($arg:tt)*) => {{
        $crate::write_stderr_line(::std::format_args!($($arg)*))
    }};
}

/// What [`stderr_line!`] writes with.
#[doc(hidden)]
pub fn write_stderr_line(args: std::fmt::Arguments<'_>) {
    use std::fmt::Write as _;
    let mut line = String::new();
    // A `Display` that fails leaves its part out (`to_string` would panic, inside a verb).
    let _ = line.write_fmt(args);
    line.push('\n');
    write_stderr(line.as_bytes());
}

/// Writes `bytes` to standard error with `write(2)`, taking no lock (see [`stderr_line!`]);
/// an error ends it.
pub fn write_stderr(bytes: &[u8]) {
    let mut rest = bytes;
    while !rest.is_empty() {
        // SAFETY: writes from a live buffer of that length to descriptor 2.
        let n = unsafe { libc::write(libc::STDERR_FILENO, rest.as_ptr().cast(), rest.len()) };
        if n > 0 {
            rest = &rest[n as usize..];
        } else if n == 0
            || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted
        {
            return;
        }
    }
}
