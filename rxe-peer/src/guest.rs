//! A guest: qemu-system-x86_64 in the lab namespace, booting the cached kernel and initramfs
//! plus a per-boot archive (the agent and any extra files), and the connection to its agent.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::lab::Lab;
use crate::protocol::{Reply, Request, AGENT_PORT};
use crate::{PeerError, Result};

/// The name of qemu's QMP socket in a guest's directory.
const QMP_SOCKET: &str = "qmp.sock";
/// How long a guest may take to boot under TCG (measured: 9-13 s; more on a loaded machine).
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a guest whose transmit queue was stuck may take to answer once its link is back.
/// (A guest whose link came back answers within a second or two.)
const STALL_RECOVERY: Duration = Duration::from_secs(30);
/// qemu's path of the guest's virtio-net device (its `-device ...,id=nic0`).
const NIC_PATH: &str = "/machine/peripheral/nic0/virtio-backend";
/// How long a KVM boot may take before KVM is declared unusable here.
const KVM_PROBE_TIMEOUT: Duration = Duration::from_secs(25);

/// What to boot.
#[derive(Debug, Clone)]
pub struct GuestConfig {
    /// Short name (also the guest's hostname).
    pub name: String,
    /// Host number of its address on the lab subnet (`10.A.B.host`).
    pub host: u8,
    /// Create `rxe0` over `eth0` once up.
    pub rxe: bool,
    pub memory_mib: u32,
    /// Host files to copy into the guest: (host path, guest path).
    pub extra_files: Vec<(PathBuf, String)>,
    /// A NIC whose buffers the guest maps through its DMA API (virtio's
    /// `VIRTIO_F_ACCESS_PLATFORM`), which virtio-net's AF_XDP zero-copy needs (Linux 6.13 and
    /// later, e.g. [`crate::GuestKernel::Debian13Backports`]). Off by default: every frame's
    /// mapping then costs more, rdma_rxe's too, so comparisons leave it off.
    pub dma_api_nic: bool,
}

impl GuestConfig {
    /// An rdma_rxe peer with 1 GiB.
    pub fn rxe(name: &str, host: u8) -> Self {
        GuestConfig {
            name: name.to_string(),
            host,
            rxe: true,
            memory_mib: 1024,
            extra_files: Vec::new(),
            dma_api_nic: false,
        }
    }
}

/// How [`Guest::recover`] got a guest answering again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recovery {
    /// Taking its link down and up was enough.
    LinkBounced,
    /// It had to be booted again; what the link bounce's failure said.
    Restarted(String),
}

/// A command's result.
#[derive(Debug, Clone)]
pub struct Output {
    pub status: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    pub fn success(&self) -> bool {
        self.status == 0
    }

    /// Standard output then standard error.
    pub fn text(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }
}

/// A running guest. Dropped, its qemu is killed.
pub struct Guest {
    name: String,
    ip: Ipv4Addr,
    ns: String,
    /// qemu; replaced by [`Guest::restart`], hence behind a lock.
    child: Mutex<Option<Child>>,
    console: PathBuf,
    /// The guest's files (console, initrd, qemu's monitor socket).
    dir: PathBuf,
    accel: &'static str,
    /// What it was booted from and on, for [`Guest::restart`] (none for an attached guest).
    booted: Option<(GuestConfig, String)>,
    /// Times [`Guest::restart`] booted it again (numbers the logs it keeps).
    restarts: std::sync::atomic::AtomicU32,
}

/// A command running in the background ([`Guest::spawn`]).
pub struct Background {
    handle: std::thread::JoinHandle<Result<Output>>,
}

impl Background {
    /// Whether the command has ended (its output waits for [`wait`](Self::wait)).
    pub fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }

    /// Waits for the command to end (it is bounded by the timeout it was started with).
    pub fn wait(self) -> Result<Output> {
        self.handle
            .join()
            .unwrap_or_else(|_| Err(PeerError::Agent("command thread panicked".into())))
    }
}

impl Guest {
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn ipv4(&self) -> Ipv4Addr {
        self.ip
    }

    /// `kvm` or `tcg`.
    pub fn accelerator(&self) -> &'static str {
        self.accel
    }

    /// Runs `command` through bash in the guest, for at most `timeout`.
    pub fn run(&self, command: &str, timeout: Duration) -> Result<Output> {
        run_on(&self.ns, self.ip, command, timeout, self.watched_qemu())
    }

    /// Waits, for at most 30 s, until a program in the guest listens on TCP `port` (as
    /// `ibv_rc_pingpong`'s and perftest's servers do once their QP is ready); says why not
    /// when nothing did (the server gave up, or the guest stopped answering: its network
    /// stalled in qemu). A fixed sleep instead loses the race to a slow emulated guest.
    pub fn wait_listening(&self, port: u16) -> std::result::Result<(), String> {
        // /proc/net/tcp lists listening sockets (state 0A) with the port in hex.
        let probe = format!(
            "for i in $(seq 300); do grep -qi ':{port:04X} .* 0A ' /proc/net/tcp && exit 0; sleep 0.1; done; exit 1"
        );
        match self.run(&probe, Duration::from_secs(40)) {
            Ok(out) if out.success() => Ok(()),
            Ok(_) => Err(format!(
                "nothing listened on {port} in guest {} within 30 s",
                self.name
            )),
            Err(e) => Err(format!(
                "guest {} did not answer while a program was to listen on {port}: {e}",
                self.name
            )),
        }
    }

    /// Starts `command` in the guest and returns at once; [`Background::wait`] collects it.
    pub fn spawn(&self, command: &str, timeout: Duration) -> Background {
        let (ns, ip, command) = (self.ns.clone(), self.ip, command.to_string());
        let qemu = self.watched_qemu();
        Background {
            handle: std::thread::spawn(move || run_on(&ns, ip, &command, timeout, qemu)),
        }
    }

    /// The qemu a command in the guest waits on: its PID and the guest's name, while it runs
    /// (none for an attached guest, whose qemu another process owns).
    fn watched_qemu(&self) -> Option<(u32, String)> {
        self.pid().map(|pid| (pid, self.name.clone()))
    }

    fn child(&self) -> MutexGuard<'_, Option<Child>> {
        self.child.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Kills qemu at once (the guest disappears mid-whatever, like a crashed host).
    pub fn kill(&self) {
        if let Some(mut c) = self.child().take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Whether qemu still runs.
    pub fn is_running(&self) -> bool {
        self.child()
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// The serial console so far.
    pub fn console_log(&self) -> String {
        fs::read_to_string(&self.console).unwrap_or_default()
    }

    /// How many times the guest kernel has reported its network device's transmit queue
    /// stuck (`NETDEV WATCHDOG: ... transmit queue 0 timed out`, every 5 s while it lasts).
    ///
    /// QEMU 7.2's virtio-net under TCG was seen to stop taking the guest's frames for good
    /// (twice in about 345 `ib_read_bw` runs in which the guest sent at full speed), while
    /// frames to the guest kept arriving: a fault of the emulator, whoever the peer is.
    pub fn transmit_stalls(&self) -> usize {
        self.console_log()
            .matches("transmit queue 0 timed out")
            .count()
    }

    /// Whether the guest's agent runs a trivial command within `timeout` (after a connection
    /// that may take up to 10 s more). A guest whose
    /// network stopped in qemu without its kernel saying so (seen once in a CI run: the rdma_rxe
    /// client stopped sending mid-transfer, the agent's port stopped answering, and the console
    /// had no watchdog line) answers nothing; [`Guest::recover_from_transmit_stall`] is then
    /// worth a try too.
    pub fn answers(&self, timeout: Duration) -> bool {
        self.run("true", timeout).is_ok()
    }

    /// A session with this guest's qemu monitor (QMP).
    fn monitor(&self) -> Result<Qmp> {
        Qmp::connect(&self.dir.join(QMP_SOCKET))
    }

    /// Takes the guest's link down and up again through qemu's monitor (QMP), after which
    /// qemu's virtio-net has dropped what the stuck transmit queue held and listens to the
    /// guest's notifications again; see [`Guest::transmit_stalls`].
    pub fn bounce_link(&self) -> Result<()> {
        let mut qmp = self.monitor()?;
        qmp.execute(r#"{"execute":"set_link","arguments":{"name":"n0","up":false}}"#)?;
        std::thread::sleep(Duration::from_millis(200));
        qmp.execute(r#"{"execute":"set_link","arguments":{"name":"n0","up":true}}"#)?;
        Ok(())
    }

    /// `len` bytes of the guest's physical memory from `addr`, as its devices read them (qemu's
    /// `xp`): for seeing what a device was handed.
    pub fn read_physical(&self, addr: u64, len: usize) -> Result<Vec<u8>> {
        let reply = self.monitor()?.human(&format!("xp /{len}bx {addr:#x}"))?;
        let bytes = xp_bytes(&reply);
        if bytes.len() != len {
            return Err(PeerError::Agent(format!(
                "qemu's xp of {len} bytes at {addr:#x} gave {} of them: {reply}",
                bytes.len()
            )));
        }
        Ok(bytes)
    }

    /// Stops the guest's vCPU through qemu's monitor, as if its kernel had hung: it answers
    /// nothing until [`Guest::restart`]ed (a harness's test of its own recovery).
    pub fn pause(&self) -> Result<()> {
        self.monitor()?.execute(r#"{"execute":"stop"}"#).map(drop)
    }

    /// What qemu says of the guest, for a report on a guest that stopped answering: whether
    /// its vCPU runs (and how much of one second it used: a spinning guest kernel uses it
    /// all, an idle one almost none), where it is, and the virtio-net queues' indices, qemu's
    /// and the guest's own (a transmit queue whose guest index ran ahead of qemu's
    /// `last_avail_idx`, nothing in use, is one whose notification qemu never got: seen here,
    /// and a link bounce does not get qemu to look again; a receive queue with no buffers is
    /// one the guest stopped filling).
    pub fn vm_state(&self) -> String {
        let Some(pid) = self.pid() else {
            return "qemu not tracked".into();
        };
        let before = vcpu_time(pid);
        std::thread::sleep(Duration::from_secs(1));
        let vcpu = match (before, vcpu_time(pid)) {
            (Some(a), Some(b)) => format!("{:.0} %", b.saturating_sub(a).as_secs_f64() * 100.0),
            _ => "unknown".into(),
        };
        let mut qmp = match self.monitor() {
            Ok(q) => q,
            Err(e) => return format!("vCPU busy over 1 s: {vcpu}; monitor: {e}"),
        };
        // After a command fails (a read timing out, most likely) its reply may still come,
        // and would be read as the next command's: the rest are not asked on this session.
        let mut failed = false;
        let mut hmp = |command: &str| {
            if failed {
                return format!("({command}: not asked, an earlier monitor command failed)");
            }
            qmp.human(command).unwrap_or_else(|e| {
                failed = true;
                e.to_string()
            })
        };
        let status = hmp("info status");
        let registers = hmp("info registers");
        let rip = registers
            .lines()
            .find(|l| l.contains("RIP="))
            .unwrap_or("RIP unknown")
            .to_string();
        let queues: Vec<String> = (0..2)
            .map(|q| {
                let status = hmp(&format!("info virtio-queue-status {NIC_PATH} {q}"));
                // The guest's own index of what it has published sits in its memory, at the
                // avail ring's second 16-bit word: ahead of qemu's `last_avail_idx` with
                // nothing `inuse`, it is frames (or buffers) qemu never looked at, i.e. a
                // notification lost between them.
                let published = ring_address(&status, "avail:")
                    .map(|avail| hmp(&format!("xp /2hx {:#x}", avail)))
                    .and_then(|words| {
                        let idx = words.split_whitespace().nth(2)?.strip_prefix("0x")?;
                        u16::from_str_radix(idx, 16).ok()
                    })
                    .map_or_else(|| "unknown".into(), |i| i.to_string());
                // The indices tell whether qemu or the guest stopped; the ring's addresses
                // tell nothing.
                let indices: Vec<&str> = status
                    .lines()
                    .filter(|l| l.contains("idx") || l.contains("inuse"))
                    .collect();
                format!(
                    "{}\n  guest's avail idx:    {published}",
                    indices.join("\n")
                )
            })
            .collect();
        format!(
            "vCPU busy over 1 s: {vcpu}; {}; {}\nreceive queue:\n{}\ntransmit queue:\n{}",
            status.trim(),
            rip.trim(),
            queues[0],
            queues[1]
        )
    }

    /// Gets the guest talking again after its transmit queue got stuck in qemu (see
    /// [`Guest::transmit_stalls`]): bounces its link and waits until its agent answers (30 s
    /// after the bounce, plus what a last probe and the report take: about a minute at most). What was running there when it stalled still runs; see
    /// [`Guest::kill_programs`].
    pub fn recover_from_transmit_stall(&self) -> Result<()> {
        self.bounce_link()?;
        let deadline = Instant::now() + STALL_RECOVERY;
        while self.run("true", Duration::from_secs(5)).is_err() {
            if Instant::now() >= deadline {
                return Err(PeerError::Agent(format!(
                    "the guest did not answer within {} s of its link coming back; {}{}",
                    STALL_RECOVERY.as_secs(),
                    self.vm_state(),
                    self.report()
                )));
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        Ok(())
    }

    /// Boots the guest again, as it was booted (same tap, address and files), after killing
    /// its qemu: for a guest that a link bounce did not revive. The console so far is kept
    /// beside the new one (`.before-restart`).
    pub fn restart(&self, lab: &Lab) -> Result<()> {
        let Some((config, tap)) = &self.booted else {
            return Err(PeerError::Agent(format!(
                "guest {} was not booted by this process; it cannot be restarted here",
                self.name
            )));
        };
        if lab.netns() != self.ns {
            return Err(PeerError::Agent(format!(
                "guest {} runs in namespace {}, not in the lab given ({}); it cannot be \
                 restarted there",
                self.name,
                self.ns,
                lab.netns()
            )));
        }
        let old_pid = self.pid();
        self.kill();
        // Its PID is not the lab's to kill any more: once reused, it may be another lab's
        // guest of the same name.
        lab.qemus
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(pid, _)| Some(*pid) != old_pid);
        // The old console and qemu's own messages are kept for a look at what went wrong,
        // numbered so that a second restart does not overwrite the first's.
        let restarts = self
            .restarts
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        for log in [
            self.console.clone(),
            self.dir.join(format!("qemu-{}.log", self.accel)),
        ] {
            let _ = fs::rename(
                &log,
                log.with_extension(format!("log.before-restart-{restarts}")),
            );
        }
        let initrd = self.dir.join("initrd.img");
        let fresh = start(
            lab,
            config,
            tap,
            &self.dir,
            &initrd,
            self.accel,
            BOOT_TIMEOUT,
        )?;
        // A qemu that another thread's restart started meanwhile is not left running.
        let replaced = std::mem::replace(&mut *self.child(), fresh.child().take());
        if let Some(mut old) = replaced {
            let pid = old.id();
            lab.qemus
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .retain(|(p, _)| *p != pid);
            let _ = old.kill();
            let _ = old.wait();
        }
        Ok(())
    }

    /// [`Guest::recover_from_transmit_stall`], then, if the guest still does not answer,
    /// [`Guest::restart`]. Says which it took.
    pub fn recover(&self, lab: &Lab) -> Result<Recovery> {
        match self.recover_from_transmit_stall() {
            Ok(()) => Ok(Recovery::LinkBounced),
            Err(bounce) => {
                self.restart(lab).map_err(|e| {
                    PeerError::Agent(format!("{bounce}\nthen restarting the guest: {e}"))
                })?;
                Ok(Recovery::Restarted(bounce.to_string()))
            }
        }
    }

    /// Kills (SIGKILL) every process in the guest whose executable is named one of
    /// `programs` (the guest has no `pkill`).
    pub fn kill_programs(&self, programs: &[&str]) -> Result<()> {
        for program in programs {
            // The kernel's name for a process is at most 15 bytes of its executable's.
            let comm: String = program.chars().take(15).collect();
            self.run(
                &format!(
                    "for p in /proc/[0-9]*; do [ \"$(cat $p/comm 2>/dev/null)\" = '{comm}' ] && \
                     kill -9 ${{p#/proc/}}; done; true"
                ),
                Duration::from_secs(10),
            )?;
        }
        Ok(())
    }

    /// Whether the guest's qemu still runs, and the end of its serial console: for a failure
    /// report in which the guest stopped answering (a guest kernel that panics ends qemu, as
    /// it boots with `panic=-1` and `-no-reboot`).
    pub fn report(&self) -> String {
        let qemu = match self.pid() {
            Some(pid) if self.qemu_alive() => format!("qemu (pid {pid}) runs"),
            Some(pid) => format!("qemu (pid {pid}) has ended"),
            None => "qemu not tracked".to_string(),
        };
        format!(
            "\n--- guest {}: {qemu}; {}",
            self.name,
            console_excerpt(&self.console_log())
        )
    }

    /// rdma_rxe's counters (`/sys/class/infiniband/rxe0/ports/1/hw_counters/*`).
    pub fn rxe_counters(&self) -> Result<BTreeMap<String, u64>> {
        let out = self.run(
            "cd /sys/class/infiniband/rxe0/ports/1/hw_counters && for f in *; do echo \"$f $(cat $f)\"; done",
            Duration::from_secs(20),
        )?;
        if !out.success() {
            return Err(PeerError::Agent(format!(
                "reading rxe counters: {}",
                out.text()
            )));
        }
        Ok(out
            .stdout
            .lines()
            .filter_map(|l| {
                let (k, v) = l.split_once(' ')?;
                Some((k.to_string(), v.trim().parse().ok()?))
            })
            .collect())
    }

    /// The CPU time its vCPU has used so far (none when qemu is not tracked or gone).
    pub fn vcpu_time(&self) -> Option<Duration> {
        let pid = self.pid()?;
        // An exited qemu's PID may have been reused by another process.
        is_our_qemu(pid, &self.name)
            .then(|| vcpu_time(pid))
            .flatten()
    }

    /// qemu's PID, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child().as_ref().map(Child::id)
    }

    /// Whether this guest's qemu still runs (an exited, unreaped qemu does not).
    pub fn qemu_alive(&self) -> bool {
        self.pid().is_some_and(|pid| is_our_qemu(pid, &self.name))
    }

    /// Whether the guest's kernel panicked: its qemu has ended (the guest boots with
    /// `panic=-1` and `-no-reboot`) and its console says so.
    pub fn kernel_panicked(&self) -> bool {
        !self.qemu_alive() && self.console_log().contains("Kernel panic")
    }

    /// Detaches from qemu: it keeps running after this `Guest` is dropped.
    pub fn detach(&mut self) -> Option<u32> {
        self.child().take().map(|c| c.id())
    }

    /// A handle on a guest some other process booted (`cargo xtask rxe-peer run`).
    pub fn attach(name: &str, ns: &str, ip: Ipv4Addr) -> Guest {
        Guest {
            name: name.to_string(),
            ip,
            ns: ns.to_string(),
            child: Mutex::new(None),
            console: PathBuf::new(),
            dir: crate::lab::work_dir_for(ns).join(name),
            accel: "unknown",
            booted: None,
            restarts: Default::default(),
        }
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        self.kill();
    }
}

/// How often a command's wait looks whether the guest's qemu still runs.
const QEMU_LOOK_EVERY: Duration = Duration::from_secs(1);

/// Runs `command` through the agent of the guest at `ip`; while it waits for the answer it
/// looks every [`QEMU_LOOK_EVERY`] whether the guest's qemu (`qemu`: its PID and the guest's
/// name) still runs. A guest whose kernel panicked ends its qemu (`-no-reboot`) without
/// closing the connection, which would otherwise be waited on for the command's whole time.
fn run_on(
    ns: &str,
    ip: Ipv4Addr,
    command: &str,
    timeout: Duration,
    qemu: Option<(u32, String)>,
) -> Result<Output> {
    let addr = SocketAddr::from((ip, AGENT_PORT));
    let mut stream = crate::lab::connect_in(ns, addr, Duration::from_secs(10))
        .map_err(|e| PeerError::Agent(format!("connecting to {addr}: {e}")))?;
    let req = Request {
        timeout_ms: timeout.as_millis() as u64,
        command: command.to_string(),
    };
    req.write(&mut stream)
        .map_err(|e| PeerError::Agent(format!("sending to {addr}: {e}")))?;
    let waiting = |e: &dyn std::fmt::Display| {
        PeerError::Agent(format!("waiting for {addr} ({command}): {e}"))
    };
    // The agent answers when the command ends; give it the command's time plus a margin.
    let deadline = Instant::now() + timeout + Duration::from_secs(15);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(waiting(&"no answer in the command's time"));
        }
        let _ = stream.set_read_timeout(Some(left.min(QEMU_LOOK_EVERY)));
        match stream.peek(&mut [0u8; 1]) {
            // The answer has begun (or the agent closed): read it whole below.
            Ok(_) => break,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(waiting(&e)),
        }
        if let Some((pid, name)) = &qemu {
            if !is_our_qemu(*pid, name) {
                return Err(waiting(&format_args!(
                    "guest {name}'s qemu ended while the command ran (its console says why)"
                )));
            }
        }
    }
    let left = deadline.saturating_duration_since(Instant::now());
    let _ = stream.set_read_timeout(Some(left.max(QEMU_LOOK_EVERY)));
    let reply = Reply::read(&mut stream).map_err(|e| waiting(&e))?;
    Ok(Output {
        status: reply.status,
        stdout: String::from_utf8_lossy(&reply.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&reply.stderr).into_owned(),
    })
}

/// The accelerator to try: `XROCE_RXE_PEER_ACCEL` (kvm or tcg), else what an earlier boot on
/// this machine found, else KVM when /dev/kvm opens (probed with a boot, TCG if it fails).
fn accelerator_choice(cache: &Path) -> &'static str {
    match std::env::var("XROCE_RXE_PEER_ACCEL").as_deref() {
        Ok("kvm") => return "kvm",
        Ok("tcg") => return "tcg",
        _ => {}
    }
    match fs::read_to_string(cache.join("accelerator")).as_deref() {
        Ok("kvm") => "kvm",
        Ok("tcg") => "tcg",
        _ if fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/kvm")
            .is_ok() =>
        {
            "kvm-probe"
        }
        _ => "tcg",
    }
}

pub(crate) fn boot(lab: &Lab, config: GuestConfig, tap: &str, dir: &Path) -> Result<Guest> {
    fs::create_dir_all(dir).map_err(|e| PeerError::io(format!("{}", dir.display()), e))?;
    // The initrd: the cached base, then this boot's archive.
    let initrd = dir.join("initrd.img");
    fs::copy(&lab.image().initrd, &initrd).map_err(|e| PeerError::io("copying the initrd", e))?;
    {
        let mut f = fs::OpenOptions::new()
            .append(true)
            .open(&initrd)
            .map_err(|e| PeerError::io("opening the initrd", e))?;
        let mut buf = Vec::new();
        crate::image::write_boot_cpio(&mut buf, lab.agent(), &config.extra_files)?;
        f.write_all(&buf)
            .map_err(|e| PeerError::io("appending to the initrd", e))?;
    }
    let cache = lab
        .image()
        .kernel
        .parent()
        .and_then(Path::parent)
        .unwrap_or(Path::new("/tmp"))
        .to_path_buf();
    let choice = accelerator_choice(&cache);
    if choice == "kvm-probe" {
        match start(lab, &config, tap, dir, &initrd, "kvm", KVM_PROBE_TIMEOUT) {
            Ok(g) => {
                let _ = fs::write(cache.join("accelerator"), "kvm");
                return Ok(g);
            }
            Err(_) => {
                // Recorded so that later boots go straight to TCG.
                let _ = fs::write(cache.join("accelerator"), "tcg");
            }
        }
    }
    let accel = if choice == "kvm" { "kvm" } else { "tcg" };
    start(lab, &config, tap, dir, &initrd, accel, BOOT_TIMEOUT)
}

fn start(
    lab: &Lab,
    config: &GuestConfig,
    tap: &str,
    dir: &Path,
    initrd: &Path,
    accel: &'static str,
    timeout: Duration,
) -> Result<Guest> {
    let ip = lab.address(config.host);
    let console = dir.join(format!("console-{accel}.log"));
    let _ = fs::remove_file(&console);
    let mac = format!(
        "52:54:00:{:02x}:{:02x}:{:02x}",
        ip.octets()[1],
        ip.octets()[2],
        config.host
    );
    let append = format!(
        "console=ttyS0 panic=-1 quiet loglevel=4 xroce.ip={ip}/24 xroce.mtu={} xroce.rxe={} \
         xroce.name={}",
        lab.mtu(),
        u8::from(config.rxe),
        config.name
    );
    let (accel_arg, cpu) = if accel == "kvm" {
        ("kvm", "host")
    } else {
        ("tcg,thread=multi", "max")
    };
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", lab.netns(), "qemu-system-x86_64"])
        // debug-threads names qemu's threads (the vCPU's is "CPU 0/TCG"), so that the
        // benchmark can tell the vCPU's CPU time from the I/O threads'.
        .args(["-name", &format!("{},debug-threads=on", config.name)])
        .args(["-accel", accel_arg, "-cpu", cpu, "-smp", "1"])
        .args(["-m", &config.memory_mib.to_string()])
        .args([
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
        ])
        .arg("-serial")
        .arg(format!("file:{}", console.display()))
        .arg("-kernel")
        .arg(&lab.image().kernel)
        .arg("-initrd")
        .arg(initrd)
        .args(["-append", &append])
        .arg("-netdev")
        .arg(format!("tap,id=n0,ifname={tap},script=no,downscript=no"))
        // event_idx=off: with it on, the guest notifies qemu of new frames only when its index
        // crosses the one qemu asked for, and once that notification was lost (the guest had
        // published 238 frames past qemu's index, qemu idled waiting; see `vm_state`) nothing
        // ever made either side look again. Without it the guest notifies on every frame it
        // adds while qemu listens, so the next frame (a retransmission, an ARP reply) repairs
        // a lost notification. Bandwidth between guests was the same either way here.
        .arg("-device")
        .arg(format!(
            "virtio-net-pci,netdev=n0,id=nic0,event_idx=off{},mac={mac}",
            // A modern-only device: a legacy one cannot offer VIRTIO_F_ACCESS_PLATFORM.
            if config.dma_api_nic {
                ",disable-legacy=on,iommu_platform=on"
            } else {
                ""
            }
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    // The QMP socket lets the harness reach qemu itself, e.g. to take the guest's link down
    // and up again (`Guest::bounce_link`). A socket's path has room for 107 bytes; under a
    // temporary directory too long for that the guest goes without one (qemu would refuse
    // to start).
    let qmp = dir.join(QMP_SOCKET);
    if qmp.as_os_str().len() < 108 {
        cmd.arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", qmp.display()));
    }
    // qemu's own messages go to a file, not a pipe: a guest left running (`cargo xtask
    // rxe-peer up`) outlives this process, and a write to a closed pipe would kill it.
    let qemu_log = dir.join(format!("qemu-{accel}.log"));
    let log = fs::File::create(&qemu_log)
        .map_err(|e| PeerError::io(format!("creating {}", qemu_log.display()), e))?;
    cmd.stderr(log);
    let mut child = cmd
        .spawn()
        .map_err(|e| PeerError::io("starting qemu-system-x86_64 (package qemu-system-x86)", e))?;
    lab.qemus
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push((child.id(), config.name.clone()));
    let tail = |console: &Path| {
        let text = fs::read_to_string(console).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(25)..].join("\n")
    };
    let deadline = Instant::now() + timeout;
    let addr = SocketAddr::from((ip, AGENT_PORT));
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            let err = fs::read_to_string(&qemu_log).unwrap_or_default();
            return Err(PeerError::QemuExited {
                name: config.name.clone(),
                status: format!("{status}: {}", err.trim()),
                console: tail(&console),
            });
        }
        if fs::read_to_string(&console).is_ok_and(|c| c.contains("XROCE-READY"))
            && lab.connect(addr, Duration::from_millis(500)).is_ok()
        {
            break;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(PeerError::BootTimeout {
                name: config.name.clone(),
                secs: timeout.as_secs(),
                console: tail(&console),
            });
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    if fs::read_to_string(&console).is_ok_and(|c| c.contains("XROCE-RXE-FAILED")) {
        let _ = child.kill();
        let _ = child.wait();
        return Err(PeerError::Agent(format!(
            "guest {}: creating rxe0 failed; console:\n{}",
            config.name,
            tail(&console)
        )));
    }
    Ok(Guest {
        name: config.name.clone(),
        ip,
        ns: lab.netns().to_string(),
        child: Mutex::new(Some(child)),
        console,
        dir: dir.to_path_buf(),
        accel,
        booted: Some((config.clone(), tap.to_string())),
        restarts: Default::default(),
    })
}

/// A QMP session: qemu's greeting read and capabilities negotiated.
struct Qmp {
    writer: std::os::unix::net::UnixStream,
    reader: std::io::BufReader<std::os::unix::net::UnixStream>,
    path: PathBuf,
}

impl Qmp {
    fn connect(path: &Path) -> Result<Qmp> {
        let stream = std::os::unix::net::UnixStream::connect(path).map_err(|e| {
            PeerError::io(
                format!(
                    "connecting to qemu's monitor at {} (none when the path is longer than \
                     107 bytes)",
                    path.display()
                ),
                e,
            )
        })?;
        let error = |e| PeerError::io(format!("QMP at {}", path.display()), e);
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(error)?;
        let writer = stream.try_clone().map_err(error)?;
        let mut qmp = Qmp {
            writer,
            reader: std::io::BufReader::new(stream),
            path: path.to_path_buf(),
        };
        qmp.reply("")?; // the greeting
        qmp.execute(r#"{"execute":"qmp_capabilities"}"#)?;
        Ok(qmp)
    }

    /// Runs one human monitor command (`info status`, `xp ...`) and returns its text.
    fn human(&mut self, command: &str) -> Result<String> {
        self.execute(&format!(
            r#"{{"execute":"human-monitor-command","arguments":{{"command-line":"{command}"}}}}"#
        ))
        .map(|reply| hmp_text(&reply))
    }

    /// Sends one command and returns its reply's line.
    fn execute(&mut self, command: &str) -> Result<String> {
        self.writer
            .write_all(format!("{command}\n").as_bytes())
            .map_err(|e| PeerError::io(format!("QMP at {}", self.path.display()), e))?;
        self.reply(command)
    }

    /// The next reply (events, `{"event": ...}`, may come before it).
    fn reply(&mut self, command: &str) -> Result<String> {
        loop {
            let mut line = String::new();
            let read = std::io::BufRead::read_line(&mut self.reader, &mut line)
                .map_err(|e| PeerError::io(format!("QMP at {}", self.path.display()), e))?;
            if read == 0 {
                return Err(PeerError::Agent("QMP: qemu closed the monitor".into()));
            }
            if line.contains("\"error\"") {
                return Err(PeerError::Agent(format!("QMP {command}: {}", line.trim())));
            }
            if line.contains("\"return\"") || line.contains("\"QMP\"") {
                return Ok(line.trim().to_string());
            }
        }
    }
}

/// The guest-physical address on the line `label 0x...` of `info virtio-queue-status`.
fn ring_address(status: &str, label: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.trim_start().starts_with(label))?;
    let hex = line.split_whitespace().nth(1)?.strip_prefix("0x")?;
    u64::from_str_radix(hex, 16).ok()
}

/// The text of a `human-monitor-command` reply (`{"return": "..."}`), unescaped.
fn hmp_text(reply: &str) -> String {
    let Some(text) = reply
        .split_once(r#""return": ""#)
        .and_then(|(_, rest)| rest.rsplit_once('"'))
        .map(|(text, _)| text)
    else {
        return reply.to_string();
    };
    // One pass, left to right: `\\n` is a backslash and an `n`, not a newline.
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('r') => {}
            Some('t') => out.push('\t'),
            Some('u') => {
                let hex: String = chars.by_ref().take(4).collect();
                out.push(
                    u32::from_str_radix(&hex, 16)
                        .ok()
                        .and_then(char::from_u32)
                        .unwrap_or('\u{fffd}'),
                );
            }
            Some(other) => out.push(other),
            None => out.push('\\'),
        }
    }
    out
}

/// The CPU time qemu `pid`'s vCPU threads have used, which qemu names "CPU N/TCG" (or "/KVM")
/// when started with `-name ...,debug-threads=on`: the first field (ns) of each one's
/// `schedstat`.
fn vcpu_time(pid: u32) -> Option<Duration> {
    let mut total = None;
    for task in fs::read_dir(format!("/proc/{pid}/task")).ok()?.flatten() {
        let dir = task.path();
        if fs::read_to_string(dir.join("comm")).is_ok_and(|c| c.starts_with("CPU ")) {
            let stat = fs::read_to_string(dir.join("schedstat")).ok()?;
            let ns: u64 = stat.split_whitespace().next()?.parse().ok()?;
            total = Some(total.unwrap_or(0) + ns);
        }
    }
    total.map(Duration::from_nanos)
}

/// Whether `pid` is a running qemu of guest `name` (checked on its command line, so that a
/// reused PID is never taken for a guest).
pub(crate) fn is_our_qemu(pid: u32, name: &str) -> bool {
    let Ok(cmdline) = fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
    args.first()
        .is_some_and(|a| a.ends_with(b"qemu-system-x86_64"))
        && args
            .windows(2)
            .any(|w| w[0] == b"-name" && name_option_is(w[1], name))
}

/// Whether qemu's `-name` option `value` names guest `name` (`NAME` or `NAME,options`).
fn name_option_is(value: &[u8], name: &str) -> bool {
    value
        .strip_prefix(name.as_bytes())
        .is_some_and(|rest| rest.is_empty() || rest.starts_with(b","))
}

/// SIGKILLs the qemu processes of these (PID, guest name) pairs that still run as that guest
/// (a PID may have been reused since), and waits (briefly) for them to go.
pub(crate) fn kill_all<'a>(guests: impl IntoIterator<Item = (u32, &'a str)>) {
    let pids: Vec<u32> = guests
        .into_iter()
        .filter(|&(pid, name)| is_our_qemu(pid, name))
        .map(|(pid, _)| pid)
        .collect();
    for &pid in &pids {
        // SAFETY: kill(2) on a PID this harness started (qemu, via `ip netns exec`, which
        // execs it).
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    for &pid in &pids {
        while Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < deadline {
            // Reap it if it is our child; otherwise just wait for it to go.
            // SAFETY: waitpid with WNOHANG on a PID; harmless if it is not our child.
            unsafe { libc::waitpid(pid as i32, std::ptr::null_mut(), libc::WNOHANG) };
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The bytes in qemu's `xp /Nbx` output: lines of `address: 0xNN 0xNN ...`.
fn xp_bytes(text: &str) -> Vec<u8> {
    text.lines()
        .filter_map(|line| line.split_once(": "))
        .flat_map(|(_, bytes)| bytes.split_whitespace())
        .filter_map(|b| u8::from_str_radix(b.strip_prefix("0x")?, 16).ok())
        .collect()
}

/// How the kernel's report of its own failure (an oops, a BUG, a warning with a stack, a
/// panic with no oops before it, as sysrq's) begins, right after a console line's timestamp
/// (`[   58.096429] `): what a failed run needs most, and the first thing a console's tail cuts
/// off (a panic's stack and registers alone fill 40 lines).
const KERNEL_REPORT_STARTS: [&str; 7] = [
    "] Kernel panic - not syncing",
    "] BUG:",
    "] Oops:",
    "] general protection fault",
    "] kernel BUG at",
    "] WARNING:",
    "] Unable to handle",
];

/// The part of a guest's console a failure report shows: its last 40 lines, and before them,
/// when the kernel reported a failure of its own, up to 40 lines from that report's first
/// line (its cause: the faulting function, the slab or the list that was corrupt).
fn console_excerpt(console: &str) -> String {
    const SHOWN: usize = 40;
    let lines: Vec<&str> = console.lines().collect();
    let tail_from = lines.len().saturating_sub(SHOWN);
    let tail = lines[tail_from..].join("\n");
    let report_from = lines.iter().position(|line| {
        KERNEL_REPORT_STARTS
            .iter()
            .any(|start| line.contains(start))
    });
    match report_from {
        Some(first) if first < tail_from => {
            let head_to = (first + SHOWN).min(tail_from);
            let skipped = tail_from - head_to;
            let gap = if skipped > 0 {
                format!("[… {skipped} lines …]\n")
            } else {
                String::new()
            };
            format!(
                "the kernel's report, from its first line:\n{}\n{gap}{tail}",
                lines[first..head_to].join("\n")
            )
        }
        _ => format!("console's last lines:\n{tail}"),
    }
}

#[cfg(test)]
mod tests {
    use super::{console_excerpt, hmp_text, name_option_is, ring_address, xp_bytes};

    #[test]
    fn physical_memory_is_read_from_qemus_xp() {
        let text = "000000003ee10690: 0xcc 0xcc 0x00 0x01 0xff 0x10 0x20 0x30\n\
                    000000003ee10698: 0x0a 0x0b 0x0c 0x0d\n";
        assert_eq!(
            xp_bytes(text),
            [0xcc, 0xcc, 0, 1, 0xff, 0x10, 0x20, 0x30, 0x0a, 0x0b, 0x0c, 0x0d]
        );
        assert!(xp_bytes("Cannot access memory\n").is_empty());
    }

    #[test]
    fn a_rings_address_is_read_from_the_queue_status() {
        let status = "  last_avail_idx:       43727\n  VRing:\n    desc:         \
                      0x00000000026a4000\n    avail:        0x00000000026a5000\n";
        assert_eq!(ring_address(status, "avail:"), Some(0x26a5000));
        assert_eq!(ring_address(status, "used:"), None);
    }

    #[test]
    fn a_monitor_commands_text_is_unescaped() {
        assert_eq!(
            hmp_text(r#"{"return": "VM status: running\r\nRIP=\"x\" a\\b\r\n"}"#),
            "VM status: running\nRIP=\"x\" a\\b\n"
        );
        assert_eq!(hmp_text(r#"{"return": {}}"#), r#"{"return": {}}"#);
        // An escaped backslash before an `n` is a backslash and an `n`, not a newline.
        assert_eq!(
            hmp_text(r#"{"return": "C:\\new\tx\u00e9 end\\"}"#),
            "C:\\new\tx\u{e9} end\\"
        );
    }

    #[test]
    fn a_guest_is_known_by_its_name_with_or_without_options() {
        assert!(name_option_is(b"xrbench0", "xrbench0"));
        assert!(name_option_is(b"xrbench0,debug-threads=on", "xrbench0"));
        assert!(!name_option_is(b"xrbench01,debug-threads=on", "xrbench0"));
        assert!(!name_option_is(b"xrbench", "xrbench0"));
    }

    #[test]
    fn a_consoles_excerpt_keeps_the_start_of_the_kernels_report() {
        let mut console: Vec<String> = (0..30).map(|i| format!("boot {i}")).collect();
        console.push("[   57.9] DEBUG: a program's line, not the kernel's report".into());
        console
            .push("[   58.0] general protection fault, probably for non-canonical address".into());
        console.push("[   58.0] RIP: 0010:kmalloc_reserve+0x64/0x100".into());
        console.extend((0..100).map(|i| format!("trace {i}")));
        let excerpt = console_excerpt(&console.join("\n"));
        assert!(excerpt.starts_with("the kernel's report, from its first line:\n[   58.0] general"));
        assert!(excerpt.contains("RIP: 0010:kmalloc_reserve"));
        assert!(excerpt.contains("[… 22 lines …]"), "{excerpt}");
        assert!(excerpt.ends_with("trace 99"));
        assert!(!excerpt.contains("boot 29"));

        // A report inside the last 40 lines, or none, leaves only the tail.
        let short = "boot\n[    9.1] BUG: soft lockup\nend";
        assert_eq!(
            console_excerpt(short),
            format!("console's last lines:\n{short}")
        );
        // A panic with no oops before it (sysrq's) starts its own report.
        let mut panic: Vec<String> = vec!["[    4.2] sysrq: Trigger a crash".into()];
        panic.push("[    4.2] Kernel panic - not syncing: sysrq triggered crash".into());
        panic.extend((0..45).map(|i| format!("[    4.2] stack {i}")));
        let excerpt = console_excerpt(&panic.join("\n"));
        assert!(
            excerpt.starts_with(
                "the kernel's report, from its first line:\n[    4.2] Kernel panic - not syncing"
            ),
            "{excerpt}"
        );
        let quiet: Vec<String> = (0..50).map(|i| format!("line {i}")).collect();
        let excerpt = console_excerpt(&quiet.join("\n"));
        assert!(excerpt.starts_with("console's last lines:\nline 10\n"));
    }
}
