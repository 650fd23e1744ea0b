//! Test fixture: two network namespaces joined by a veth pair.
//!
//! ```no_run
//! use xroce_datapath::netns::NetnsPair;
//!
//! let pair = NetnsPair::new("mytest", 1500)?;          // needs root
//! let peer = pair.ipv4(1);
//! // Code on a thread inside namespace 0:
//! let sent = pair.run_in(0, move || {
//!     let socket = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
//!     socket.send_to(b"hello", (peer, 4791)).unwrap()
//! });
//! // A command inside namespace 1 (bounded in time):
//! let out = pair.exec(1, "ip -d link show")?;
//! # Ok::<(), std::io::Error>(())
//! ```
//!
//! - Namespaces get unique names `<prefix>-<pid>-<n>-0` and `...-1`, so tests may run in
//!   parallel threads and processes. The veth ends are `xr0` (in namespace 0) and `xr1` (in
//!   namespace 1), with `10.X.Y.1/24` and `10.X.Y.2/24` (X from the process id, Y from a
//!   counter; the namespaces are isolated, so the addresses cannot clash with the host's), and
//!   optionally `fd00:7872:X:Y::1/64` and `::2/64` (without duplicate address detection, so
//!   they work at once). Both ends and `lo` are up, with the requested MTU. Each end has one
//!   receive and one transmit queue, so every frame arrives on queue 0 (veth would otherwise
//!   spread flows over one queue per CPU).
//! - [`NetnsPair::run_in`] runs a closure on a fresh thread that has entered a namespace with
//!   `setns(CLONE_NEWNET)`; sockets it opens and [`crate::xdp`] calls it makes act in that
//!   namespace. [`NetnsPair::exec`] runs a shell command there with `ip netns exec`.
//! - Every command is bounded in time ([`COMMAND_TIMEOUT`] unless given). Dropping the pair
//!   kills (by process group id) the background commands it started, unloads xroce's XDP
//!   program from both ends if it is loaded (so no pins are left in bpffs), and deletes both
//!   namespaces, which deletes the veth pair.
//!
//! - A program that is interrupted (a benchmark's Ctrl-C), where no `Drop` will run, calls
//!   [`refuse_new_namespaces`] and [`remove_own_namespaces`] from its signal thread: its
//!   namespaces go with everything in them.
//!
//! Uses `ip` from iproute2 and needs root.

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Default bound on each command the fixture runs.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(20);

static PAIRS: AtomicU32 = AtomicU32::new(0);

/// Two network namespaces joined by a veth pair (see the module documentation). Sides are
/// `0` and `1`.
#[derive(Debug)]
pub struct NetnsPair {
    ns: [String; 2],
    ifaces: [String; 2],
    ipv4: [Ipv4Addr; 2],
    ipv6: Option<[Ipv6Addr; 2]>,
    mtu: u32,
    created: [bool; 2],
    children: Mutex<Vec<Child>>,
}

impl NetnsPair {
    /// Creates the namespaces, the veth pair with `mtu`, and IPv4 addresses.
    pub fn new(prefix: &str, mtu: u32) -> io::Result<NetnsPair> {
        NetnsPair::create(prefix, mtu, false, 1)
    }

    /// Like [`NetnsPair::new`], with IPv6 addresses as well.
    pub fn with_ipv6(prefix: &str, mtu: u32) -> io::Result<NetnsPair> {
        NetnsPair::create(prefix, mtu, true, 1)
    }

    /// Like [`NetnsPair::new`], with `queues` transmit and receive queues on each end (a
    /// frame sent on queue `q` of one end arrives on queue `q` of the other).
    pub fn with_queues(prefix: &str, mtu: u32, queues: u32) -> io::Result<NetnsPair> {
        NetnsPair::create(prefix, mtu, false, queues)
    }

    fn create(prefix: &str, mtu: u32, ipv6: bool, queues: u32) -> io::Result<NetnsPair> {
        remove_orphaned_namespaces(prefix);
        let pid = std::process::id();
        let n = PAIRS.fetch_add(1, Ordering::Relaxed);
        let x = 100 + (pid % 100) as u8;
        let y = (n % 256) as u8;
        let mut pair = NetnsPair {
            ns: [0, 1].map(|side| format!("{prefix}-{pid}-{n}-{side}")),
            ifaces: ["xr0".to_string(), "xr1".to_string()],
            ipv4: [Ipv4Addr::new(10, x, y, 1), Ipv4Addr::new(10, x, y, 2)],
            ipv6: ipv6.then(|| {
                [1, 2].map(|h| Ipv6Addr::new(0xfd00, 0x7872, x.into(), y.into(), 0, 0, 0, h))
            }),
            mtu,
            created: [false; 2],
            children: Mutex::new(Vec::new()),
        };
        // On any error below, dropping `pair` deletes what was created.
        for side in 0..2 {
            add_namespace(&pair.ns[side])?;
            pair.created[side] = true;
        }
        let mtu_text = mtu.to_string();
        let queues = queues.to_string();
        ip(&[
            "-n",
            &pair.ns[0],
            "link",
            "add",
            &pair.ifaces[0],
            "mtu",
            &mtu_text,
            "numtxqueues",
            &queues,
            "numrxqueues",
            &queues,
            "type",
            "veth",
            "peer",
            "name",
            &pair.ifaces[1],
            "mtu",
            &mtu_text,
            "numtxqueues",
            &queues,
            "numrxqueues",
            &queues,
            "netns",
            &pair.ns[1],
        ])?;
        for side in 0..2 {
            let ns = pair.ns[side].as_str();
            let dev = pair.ifaces[side].as_str();
            let v4 = format!("{}/24", pair.ipv4[side]);
            ip(&["-n", ns, "addr", "add", &v4, "dev", dev])?;
            if let Some(v6) = pair.ipv6 {
                let v6 = format!("{}/64", v6[side]);
                ip(&["-n", ns, "-6", "addr", "add", &v6, "dev", dev, "nodad"])?;
            }
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
        }
        Ok(pair)
    }

    /// The name of namespace `side` (for `ip netns exec`, `ip -n`).
    pub fn ns_name(&self, side: usize) -> &str {
        &self.ns[side]
    }

    /// The veth end in namespace `side` (`xr0` or `xr1`).
    pub fn iface(&self, side: usize) -> &str {
        &self.ifaces[side]
    }

    /// The IPv4 address of side `side`'s veth end.
    pub fn ipv4(&self, side: usize) -> Ipv4Addr {
        self.ipv4[side]
    }

    /// The IPv6 address of side `side`'s veth end, if the pair has IPv6.
    pub fn ipv6(&self, side: usize) -> Option<Ipv6Addr> {
        self.ipv6.map(|a| a[side])
    }

    /// The MTU of both veth ends.
    pub fn mtu(&self) -> u32 {
        self.mtu
    }

    /// Runs `f` on a new thread inside namespace `side` and returns its result. A panic in `f`
    /// is passed on to the caller. Panics if the namespace cannot be entered.
    pub fn run_in<R: Send, F: FnOnce() -> R + Send>(&self, side: usize, f: F) -> R {
        let ns = self.ns[side].as_str();
        std::thread::scope(|s| {
            let handle = std::thread::Builder::new()
                .name(format!("in-{ns}"))
                .spawn_scoped(s, move || {
                    if let Err(e) = enter(ns) {
                        panic!("cannot enter network namespace {ns}: {e}");
                    }
                    f()
                })
                .unwrap_or_else(|e| panic!("cannot start a thread for namespace {ns}: {e}"));
            match handle.join() {
                Ok(r) => r,
                Err(panic) => std::panic::resume_unwind(panic),
            }
        })
    }

    /// Starts `f` on a new thread inside namespace `side`; join the handle for its result (an
    /// `Err` if it panicked, including when the namespace could not be entered).
    pub fn spawn_in<R, F>(&self, side: usize, f: F) -> JoinHandle<R>
    where
        R: Send + 'static,
        F: FnOnce() -> R + Send + 'static,
    {
        let ns = self.ns[side].clone();
        std::thread::Builder::new()
            .name(format!("in-{ns}"))
            .spawn(move || {
                if let Err(e) = enter(&ns) {
                    panic!("cannot enter network namespace {ns}: {e}");
                }
                f()
            })
            .unwrap_or_else(|e| {
                panic!("cannot start a thread for namespace {}: {e}", self.ns[side])
            })
    }

    /// Runs `sh -c command` inside namespace `side` (`ip netns exec`), bounded by
    /// [`COMMAND_TIMEOUT`]. The exit status is in the output; only failing to run it, or
    /// the timeout, is an error.
    pub fn exec(&self, side: usize, command: &str) -> io::Result<Output> {
        self.exec_with_timeout(side, command, COMMAND_TIMEOUT)
    }

    /// [`NetnsPair::exec`] with another bound.
    pub fn exec_with_timeout(
        &self,
        side: usize,
        command: &str,
        timeout: Duration,
    ) -> io::Result<Output> {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns[side], "sh", "-c", command]);
        run_bounded(cmd, timeout)
    }

    /// A `Command` that runs `program` inside namespace `side` (`ip netns exec NS program`);
    /// add arguments and environment, then run it with [`run_bounded`].
    pub fn command(&self, side: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns[side]]).arg(program);
        cmd
    }

    /// Starts `sh -c command` inside namespace `side` in the background (output discarded)
    /// and returns its process id. It is killed when the pair is dropped.
    pub fn spawn(&self, side: usize, command: &str) -> io::Result<u32> {
        let child = Command::new("ip")
            .args(["netns", "exec", &self.ns[side], "sh", "-c", command])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()?;
        let pid = child.id();
        self.children
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(child);
        Ok(pid)
    }

    /// Runs `f` inside namespace `side` without panicking if it cannot be entered.
    fn try_run_in<R: Send, F: FnOnce() -> R + Send>(&self, side: usize, f: F) -> io::Result<R> {
        let ns = self.ns[side].as_str();
        std::thread::scope(|s| {
            let handle = s.spawn(move || enter(ns).map(|()| f()));
            handle
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("panicked")))
        })
    }
}

impl Drop for NetnsPair {
    fn drop(&mut self) {
        let children = std::mem::take(
            &mut *self
                .children
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        );
        for mut child in children {
            signal_group(child.id(), libc::SIGKILL);
            let _ = child.wait();
        }
        if self.created == [true; 2] {
            for side in 0..2 {
                let iface = self.ifaces[side].clone();
                let _ = self.try_run_in(side, move || crate::xdp::unload(&iface));
            }
        }
        for side in 0..2 {
            if self.created[side] {
                if let Err(e) = ip(&["netns", "del", &self.ns[side]]) {
                    eprintln!("netns fixture: deleting namespace {}: {e}", self.ns[side]);
                }
            }
        }
    }
}

/// Whether new namespaces are refused ([`refuse_new_namespaces`]). Held across `ip netns
/// add`, so that the refusal waits for a namespace being made to exist.
static REFUSING: Mutex<bool> = Mutex::new(false);

/// `ip netns add NAME`, unless an interrupted program refuses new namespaces.
fn add_namespace(name: &str) -> io::Result<()> {
    let refusing = REFUSING.lock().unwrap_or_else(|p| p.into_inner());
    if *refusing {
        return Err(io::Error::other(format!(
            "not creating namespace {name}: the program was interrupted"
        )));
    }
    ip(&["netns", "add", name])
}

/// For a program that was interrupted: waits until a namespace being made (by a pair, or
/// inside [`unless_refused`]) exists, then refuses to make more, so that
/// [`remove_own_namespaces`] finds all of them.
pub fn refuse_new_namespaces() {
    *REFUSING.lock().unwrap_or_else(|p| p.into_inner()) = true;
}

/// Runs `make` (which creates a namespace some other way, such as the guests' lab) unless
/// new namespaces are refused, and keeps [`refuse_new_namespaces`] waiting meanwhile.
pub fn unless_refused<T>(make: impl FnOnce() -> T) -> io::Result<T> {
    let refusing = REFUSING.lock().unwrap_or_else(|p| p.into_inner());
    if *refusing {
        return Err(io::Error::other(
            "not creating a namespace: the program was interrupted",
        ));
    }
    Ok(make())
}

/// For a program that was interrupted, when no `Drop` will run: removes every namespace
/// named `<prefix>-<this process's id>-...` for one of `prefixes` (pairs', and others named
/// the same way, such as the guests' lab), with what is in them: the processes (a benchmark's
/// perftest programs, which run in process groups of their own, and guests) are SIGKILLed,
/// the xroce devices made there (`xroce link add`) deleted with their device nodes, and
/// xroce's XDP programs unloaded (so no pins stay in bpffs). Returns each name found, with
/// whether deleting it failed.
///
/// A namespace of a process that had this id before is removed too: its process is gone
/// (unless it ran in another PID namespace that shares /run/netns, as `remove_orphaned_namespaces`
/// assumes too).
pub fn remove_own_namespaces(prefixes: &[&str]) -> Vec<(String, Result<(), String>)> {
    let own = format!("{}-", std::process::id());
    let Ok(entries) = std::fs::read_dir("/run/netns") else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| {
            prefixes.iter().any(|prefix| {
                name.strip_prefix(prefix)
                    .and_then(|rest| rest.strip_prefix('-'))
                    .is_some_and(|rest| rest.starts_with(&own))
            })
        })
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|name| {
            let outcome = remove_namespace(&name);
            (name, outcome)
        })
        .collect()
}

/// [`remove_own_namespaces`]'s work for one namespace: `Err` says why it was not deleted.
fn remove_namespace(ns: &str) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let ns_file = std::fs::File::open(format!("/run/netns/{ns}")).map_err(|e| e.to_string())?;
    let id = ns_file.metadata().map_err(|e| e.to_string())?;
    // The name goes first: nothing can enter by it any more (`ip netns exec` opens it), so
    // what the kill below misses can only be a process entering at this very moment. The
    // namespace itself lives on while `ns_file` is open.
    let deleted = ip(&["netns", "del", ns]).map_err(|e| e.to_string());
    kill_processes_in(id.ino());
    let (tx, rx) = mpsc::channel();
    // Its own thread, because it enters the namespace; bounded, because deleting devices and
    // unloading take locks (the registry's, bpffs's) that the interrupted main thread may
    // hold for a moment.
    std::thread::spawn(move || {
        // SAFETY: `ns_file` is an open nsfs file of a network namespace; setns with
        // CLONE_NEWNET changes only this thread's network namespace.
        if unsafe { libc::setns(ns_file.as_raw_fd(), libc::CLONE_NEWNET) } == 0 {
            if let Ok(links) = crate::registry::links() {
                for link in links {
                    let _ = crate::registry::delete(&link.name);
                }
            }
            // The interfaces that still carry xroce's program are those with pins.
            let pinned = std::fs::read_dir(crate::xdp::pins::netns_dir(id.ino()));
            for iface in pinned.into_iter().flatten().flatten() {
                let _ = crate::xdp::unload(&iface.file_name().to_string_lossy());
            }
        }
        let _ = tx.send(());
    });
    let _ = rx.recv_timeout(Duration::from_secs(5));
    deleted
}

/// Whether process `pid` is in the network namespace with nsfs inode `ino`.
pub(crate) fn in_netns(pid: u32, ino: u64) -> bool {
    std::fs::read_link(format!("/proc/{pid}/ns/net"))
        .is_ok_and(|link| link.as_os_str().to_str() == Some(&format!("net:[{ino}]")))
}

/// The processes in the network namespace with nsfs inode `ino`; `None` when /proc cannot be
/// read.
pub(crate) fn processes_in_netns(ino: u64) -> Option<Vec<u32>> {
    let entries = std::fs::read_dir("/proc").ok()?;
    Some(
        entries
            .flatten()
            .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()))
            .filter(|&pid| in_netns(pid, ino))
            .collect(),
    )
}

/// SIGKILLs every process other than this one in the network namespace with nsfs inode `ino`,
/// scanning again until a scan finds none left running (at most 3 s): a program may have been
/// entering it during the first scan.
fn kill_processes_in(ino: u64) {
    let own = std::process::id();
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    loop {
        let Some(mut inside) = processes_in_netns(ino) else {
            return;
        };
        inside.retain(|&pid| pid != own && is_running(pid));
        if inside.is_empty() || std::time::Instant::now() >= deadline {
            return;
        }
        for pid in inside {
            kill_if_inside(pid, ino);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SIGKILLs `pid` through a pidfd, after checking again that the process the pidfd names is
/// in the namespace: the process found by the scan may have exited and its id been reused.
/// Kernels without pidfds (before 5.3) get a plain kill.
fn kill_if_inside(pid: u32, ino: u64) {
    let Ok(id) = libc::pid_t::try_from(pid) else {
        return;
    };
    // SAFETY: pidfd_open takes a process id and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, id, 0) };
    if fd < 0 {
        if io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS) && in_netns(pid, ino) {
            // SAFETY: kill has no memory effects; the target was just seen in a namespace
            // this process made.
            unsafe {
                libc::kill(id, libc::SIGKILL);
            }
        }
        return;
    }
    let Ok(fd) = i32::try_from(fd) else {
        return;
    };
    // SAFETY: `fd` is the fresh pidfd just returned, owned here.
    let pidfd = unsafe { OwnedFd::from_raw_fd(fd) };
    if in_netns(pid, ino) {
        // SAFETY: pidfd_send_signal with a valid pidfd, a signal number, no siginfo and no
        // flags; it touches no memory of ours.
        unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                pidfd.as_raw_fd(),
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            );
        }
    }
}

/// Whether `pid` exists and is not a zombie (a killed child of ours stays one until reaped).
fn is_running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // The state follows the command name's closing parenthesis.
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|state| state != 'Z')
    })
}

/// Removes the namespaces named `<prefix>-<pid>-...` whose process is gone, with what is in
/// them (as [`remove_own_namespaces`] does for a program's own): a run killed outright
/// (SIGKILL, a timeout) reached neither its `Drop`s nor its signal handler, and may have left
/// guests or xroce programs running inside, xroce devices and XDP pins. Namespaces of living
/// processes, and names of any other shape, are left alone. Returns the names removed.
///
/// [`NetnsPair`] calls this for its prefix; harnesses that name other namespaces the same way
/// (the guests' labs, the interop tests' xroce side) call it for theirs.
pub fn remove_orphaned_namespaces(prefix: &str) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir("/run/netns") else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = orphan_pid(prefix, &name) else {
            continue;
        };
        if is_running(pid) {
            continue;
        }
        match remove_namespace(&name) {
            Ok(()) => {
                eprintln!("netns: removed {name}, left by process {pid} (gone)");
                removed.push(name);
            }
            // Another process cleaning up at the same moment may have removed it first.
            Err(_) if !entry.path().exists() => {}
            Err(e) => eprintln!("netns: removing {name} (left by process {pid}): {e}"),
        }
    }
    removed
}

/// The process id in a name `<prefix>-<pid>-<rest>` (`rest` not empty), if it has that shape.
fn orphan_pid(prefix: &str, name: &str) -> Option<u32> {
    let rest = name.strip_prefix(prefix)?.strip_prefix('-')?;
    let (pid, tail) = rest.split_once('-')?;
    if tail.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    pid.parse::<u32>().ok()
}

/// Moves the calling thread into the named network namespace (`/run/netns/NAME`).
pub fn enter(ns_name: &str) -> io::Result<()> {
    let file = std::fs::File::open(format!("/run/netns/{ns_name}"))?;
    // SAFETY: `file` is an open nsfs file of a network namespace; setns with CLONE_NEWNET
    // changes only the calling thread's network namespace.
    if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Runs `ip ARGS`, bounded by [`COMMAND_TIMEOUT`]; a non-zero exit is an error with its stderr.
fn ip(args: &[&str]) -> io::Result<()> {
    let mut cmd = Command::new("ip");
    cmd.args(args);
    let out = run_bounded(cmd, COMMAND_TIMEOUT)?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "`ip {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// For tests that need root (namespaces, XDP): `true` when running as root. Otherwise skips
/// (returns `false`) only when `XROCE_SKIP_ROOT_TESTS=1` asks for it, and fails the test
/// otherwise, so CI can never pass them vacuously.
pub fn root_or_skip() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    if std::env::var("XROCE_SKIP_ROOT_TESTS").as_deref() == Ok("1") {
        eprintln!("skipped: not root and XROCE_SKIP_ROOT_TESTS=1");
        return false;
    }
    panic!(
        "these tests need root (they create network namespaces and load XDP programs); run \
         them as root, or set XROCE_SKIP_ROOT_TESTS=1 to skip them"
    );
}

/// Runs a command in its own process group, collecting its output; after `timeout` the group is
/// killed and the result is a `TimedOut` error. (stdin is /dev/null.)
pub fn run_bounded(cmd: Command, timeout: Duration) -> io::Result<Output> {
    run_bounded_with(cmd, timeout, None)
}

/// [`run_bounded`] for an xroce program started with `XROCE_DUMP_SIGNAL` set to `signal`: when
/// it times out, the group first gets `signal`, and what the program then reports about its
/// engine (QP states, PSNs, timers) is in the error along with the rest of its output.
pub fn run_bounded_dumping_state(
    cmd: Command,
    timeout: Duration,
    signal: libc::c_int,
) -> io::Result<Output> {
    run_bounded_with(cmd, timeout, Some(signal))
}

/// How long a timed-out program gets to write its state report before it is killed.
const DUMP_GRACE: Duration = Duration::from_secs(5);

fn run_bounded_with(
    mut cmd: Command,
    timeout: Duration,
    dump_signal: Option<libc::c_int>,
) -> io::Result<Output> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let child = cmd.spawn().map_err(|e| {
        io::Error::new(e.kind(), format!("cannot run {:?}: {e}", cmd.get_program()))
    })?;
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(timeout) {
        Ok(result) => result,
        Err(_) => {
            if let Some(sig) = dump_signal {
                signal_group(pid, sig);
                std::thread::sleep(DUMP_GRACE);
            }
            signal_group(pid, libc::SIGKILL);
            // What it printed before it was killed is what says why it hung.
            let printed = match rx.recv_timeout(Duration::from_secs(5)) {
                Ok(Ok(o)) => format!(
                    "; it printed:\n{}{}",
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                ),
                _ => String::new(),
            };
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "{cmd:?} did not finish within {} s{printed}",
                    timeout.as_secs_f64()
                ),
            ))
        }
    }
}

/// `sig` to the process group led by `pid` (our child, started with `process_group(0)` and
/// not yet reaped, so the id is still its own).
fn signal_group(pid: u32, sig: libc::c_int) {
    if let Ok(pid) = libc::pid_t::try_from(pid) {
        // SAFETY: kill has no memory effects; the target is a process group we created.
        unsafe {
            libc::kill(-pid, sig);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_names_of_the_prefixs_shape_give_a_process_id() {
        assert_eq!(orphan_pid("xrbench", "xrbench-4242-0-1"), Some(4242));
        assert_eq!(orphan_pid("xrbench", "xrbench-4242-17-0"), Some(4242));
        assert_eq!(orphan_pid("xrbench", "xrbench-4242-0"), Some(4242));
        assert_eq!(orphan_pid("xri1500", "xri1500-4242-x3"), Some(4242));
        for other in [
            "xrbench-4242",
            "xrbench-4242-",
            "xrbenchx-4242-0-1",
            "other-4242-0-1",
            "xrbench-abc-0-1",
            "xrbench-+42-0",
            "xrbench--0-1",
            "xrbench",
        ] {
            assert_eq!(orphan_pid("xrbench", other), None, "{other}");
        }
    }

    /// What an interrupted benchmark does to its namespaces: those named with its prefix and
    /// process id go, with a program running inside in a process group of its own (killed),
    /// the xroce device made there and its device node, and the XDP programs' pins (one
    /// loaded by the device, one by itself). Another process's namespace stays.
    #[test]
    fn an_interrupted_programs_namespaces_go_with_their_programs_devices_and_pins() {
        if !root_or_skip() {
            return;
        }
        use std::os::unix::fs::MetadataExt;
        use std::os::unix::process::ExitStatusExt;
        let prefix = "xrremove";
        let mut pair = NetnsPair::new(prefix, 1500).expect("pair");
        let someone_elses = format!("{prefix}-1-{}-0", std::process::id());
        ip(&["netns", "add", &someone_elses]).expect("another process's namespace");
        let iface = pair.iface(0).to_string();
        pair.run_in(0, move || crate::registry::add("xrremove", &iface, None))
            .expect("xroce link add");
        let iface = pair.iface(1).to_string();
        pair.run_in(1, move || {
            crate::xdp::load(&crate::xdp::LoadOptions::new(&iface))
        })
        .expect("load XDP");
        let ino = |name: &str| {
            std::fs::metadata(format!("/run/netns/{name}"))
                .expect("namespace file")
                .ino()
        };
        let (ino0, ino1) = (ino(pair.ns_name(0)), ino(pair.ns_name(1)));
        let state = [
            (Some(ino0), crate::xdp::pins::netns_dir(ino0)),
            (Some(ino1), crate::xdp::pins::netns_dir(ino1)),
            (Some(ino0), crate::registry::run_dir_of(ino0)),
            (None, crate::registry::cdev_path("xrremove")),
        ];
        let state_before: Vec<bool> = state.iter().map(|(_, p)| p.exists()).collect();
        let mut sleep = pair.command(0, "sleep");
        let mut program = sleep
            .arg("60")
            .process_group(0)
            .spawn()
            .expect("sleep in the namespace");
        // `ip netns exec` enters the namespace, then becomes `sleep`.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while std::fs::read_to_string(format!("/proc/{}/comm", program.id()))
            .is_ok_and(|c| c.trim() != "sleep")
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(10));
        }
        let names = [pair.ns_name(0).to_string(), pair.ns_name(1).to_string()];
        let removed = remove_own_namespaces(&[prefix]);
        let status = program.try_wait().expect("wait for sleep");
        let _ = program.kill();
        let _ = program.wait();
        let exists = |n: &str| std::path::Path::new(&format!("/run/netns/{n}")).exists();
        let namespaces_left: Vec<_> = names.iter().filter(|n| exists(n)).collect();
        let someone_elses_left = exists(&someone_elses);
        let _ = ip(&["netns", "del", &someone_elses]);
        // Keyed by a namespace's inode, which the kernel reuses: a path that exists again
        // because another test's new namespace got the same inode is not a leftover.
        let live_inodes: Vec<u64> = std::fs::read_dir("/run/netns")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| std::fs::metadata(e.path()).ok().map(|m| m.ino()))
            .collect();
        let state_left: Vec<_> = state
            .iter()
            .filter(|(ino, p)| p.exists() && !ino.is_some_and(|i| live_inodes.contains(&i)))
            .map(|(_, p)| p)
            .collect();
        // Deleted already: the pair's own drop has nothing left to do.
        pair.created = [false; 2];
        drop(pair);
        assert_eq!(state_before, [true; 4], "{state:?} existed");
        assert_eq!(
            removed,
            names.clone().map(|n| (n, Ok(()))),
            "the pair's namespaces were removed"
        );
        assert_eq!(
            status.and_then(|s| s.signal()),
            Some(libc::SIGKILL),
            "the program inside was killed"
        );
        assert!(namespaces_left.is_empty(), "left: {namespaces_left:?}");
        assert!(
            someone_elses_left,
            "{someone_elses} is another process's and stays"
        );
        assert!(state_left.is_empty(), "left: {state_left:?}");
    }

    /// Namespaces left by a killed run (its process gone) are removed by the next pair made
    /// with the same prefix, a pair's and a lab's alike, and a program still running inside
    /// one is killed; a living process's namespace is not touched.
    #[test]
    fn a_killed_runs_namespaces_are_removed_by_the_next_pair() {
        if !root_or_skip() {
            return;
        }
        let prefix = "xrorphan";
        let dead = (1_000_000..4_000_000u32)
            .find(|p| !std::path::Path::new(&format!("/proc/{p}")).exists())
            .expect("an unused process id");
        let orphan_pair = format!("{prefix}-{dead}-0-0");
        let orphan_lab = format!("{prefix}-{dead}-7");
        let alive = format!("{prefix}-{}-999-0", std::process::id());
        for ns in [&orphan_pair, &orphan_lab, &alive] {
            ip(&["netns", "add", ns]).expect("namespace");
        }
        // What a killed run's guest would be: a process left running in the lab's namespace.
        let mut left_running = Command::new("ip")
            .args(["netns", "exec", &orphan_lab, "sleep", "60"])
            .spawn()
            .expect("sleep in the orphan namespace");
        let in_it = |pid: u32| {
            std::fs::metadata(format!("/run/netns/{orphan_lab}"))
                .is_ok_and(|m| in_netns(pid, std::os::unix::fs::MetadataExt::ino(&m)))
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !in_it(left_running.id()) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let pair = NetnsPair::new(prefix, 1500).expect("pair");
        let exists = |n: &str| std::path::Path::new(&format!("/run/netns/{n}")).exists();
        let left = [&orphan_pair, &orphan_lab, &alive].map(|ns| exists(ns));
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let killed = loop {
            match left_running.try_wait() {
                Ok(Some(status)) => {
                    break std::os::unix::process::ExitStatusExt::signal(&status)
                        == Some(libc::SIGKILL)
                }
                _ if std::time::Instant::now() >= deadline => break false,
                _ => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        let _ = left_running.kill();
        let _ = left_running.wait();
        drop(pair);
        for ns in [&alive, &orphan_pair, &orphan_lab] {
            let _ = ip(&["netns", "del", ns]);
        }
        assert_eq!(
            left,
            [false, false, true],
            "orphans removed, the living one kept"
        );
        assert!(killed, "the program left in the lab's namespace was killed");
    }
}
