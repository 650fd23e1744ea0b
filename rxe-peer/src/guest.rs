//! A guest: qemu-system-x86_64 in the lab namespace, booting the cached kernel and initramfs
//! plus a per-boot archive (the agent and any extra files), and the connection to its agent.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::lab::Lab;
use crate::protocol::{Reply, Request, AGENT_PORT};
use crate::{PeerError, Result};

/// The name of qemu's QMP socket in a guest's directory.
const QMP_SOCKET: &str = "qmp.sock";
/// How long a guest may take to boot under TCG (measured: 9-13 s; more on a loaded machine).
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a guest whose transmit queue was stuck may take to answer once its link is back.
const STALL_RECOVERY: Duration = Duration::from_secs(60);
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
        }
    }
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
    child: Option<Child>,
    console: PathBuf,
    /// The guest's files (console, initrd, qemu's monitor socket).
    dir: PathBuf,
    accel: &'static str,
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
        run_on(&self.ns, self.ip, command, timeout)
    }

    /// Starts `command` in the guest and returns at once; [`Background::wait`] collects it.
    pub fn spawn(&self, command: &str, timeout: Duration) -> Background {
        let (ns, ip, command) = (self.ns.clone(), self.ip, command.to_string());
        Background {
            handle: std::thread::spawn(move || run_on(&ns, ip, &command, timeout)),
        }
    }

    /// Kills qemu at once (the guest disappears mid-whatever, like a crashed host).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Whether qemu still runs.
    pub fn is_running(&mut self) -> bool {
        self.child
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

    /// Takes the guest's link down and up again through qemu's monitor (QMP), after which
    /// qemu's virtio-net has dropped what the stuck transmit queue held and listens to the
    /// guest's notifications again; see [`Guest::transmit_stalls`].
    pub fn bounce_link(&self) -> Result<()> {
        let path = self.dir.join(QMP_SOCKET);
        let stream = std::os::unix::net::UnixStream::connect(&path).map_err(|e| {
            PeerError::io(
                format!(
                    "connecting to qemu's monitor at {} (none when the path is longer than \
                     107 bytes)",
                    path.display()
                ),
                e,
            )
        })?;
        let qmp_error = |e: std::io::Error| PeerError::io(format!("QMP at {}", path.display()), e);
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(qmp_error)?;
        let mut writer = stream.try_clone().map_err(qmp_error)?;
        let mut reader = std::io::BufReader::new(stream);
        // One reply per command; events ({"event": ...}) may come in between.
        let mut reply = |command: &str| -> Result<()> {
            if !command.is_empty() {
                writer
                    .write_all(format!("{command}\n").as_bytes())
                    .map_err(qmp_error)?;
            }
            loop {
                let mut line = String::new();
                if std::io::BufRead::read_line(&mut reader, &mut line).map_err(qmp_error)? == 0 {
                    return Err(PeerError::Agent("QMP: qemu closed the monitor".into()));
                }
                if line.contains("\"error\"") {
                    return Err(PeerError::Agent(format!("QMP {command}: {}", line.trim())));
                }
                if line.contains("\"return\"") || line.contains("\"QMP\"") {
                    return Ok(());
                }
            }
        };
        reply("")?; // the greeting
        reply(r#"{"execute":"qmp_capabilities"}"#)?;
        reply(r#"{"execute":"set_link","arguments":{"name":"n0","up":false}}"#)?;
        std::thread::sleep(Duration::from_millis(200));
        reply(r#"{"execute":"set_link","arguments":{"name":"n0","up":true}}"#)
    }

    /// Gets the guest talking again after its transmit queue got stuck in qemu (see
    /// [`Guest::transmit_stalls`]): bounces its link and waits (at most 60 s) until its agent
    /// answers. What was running there when it stalled still runs; see
    /// [`Guest::kill_programs`].
    pub fn recover_from_transmit_stall(&self) -> Result<()> {
        self.bounce_link()?;
        let deadline = Instant::now() + STALL_RECOVERY;
        while self.run("true", Duration::from_secs(5)).is_err() {
            if Instant::now() >= deadline {
                return Err(PeerError::Agent(format!(
                    "the guest did not answer within {} s of its link coming back{}",
                    STALL_RECOVERY.as_secs(),
                    self.report()
                )));
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        Ok(())
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
        let console = self.console_log();
        let lines: Vec<&str> = console.lines().collect();
        let tail = lines[lines.len().saturating_sub(40)..].join("\n");
        format!(
            "\n--- guest {}: {qemu}; console's last lines:\n{tail}",
            self.name
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

    /// qemu's PID, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether this guest's qemu still runs (an exited, unreaped qemu does not).
    pub fn qemu_alive(&self) -> bool {
        self.pid().is_some_and(|pid| is_our_qemu(pid, &self.name))
    }

    /// Detaches from qemu: it keeps running after this `Guest` is dropped.
    pub fn detach(&mut self) -> Option<u32> {
        self.child.take().map(|c| c.id())
    }

    /// A handle on a guest some other process booted (`cargo xtask rxe-peer run`).
    pub fn attach(name: &str, ns: &str, ip: Ipv4Addr) -> Guest {
        Guest {
            name: name.to_string(),
            ip,
            ns: ns.to_string(),
            child: None,
            console: PathBuf::new(),
            dir: crate::lab::work_dir_for(ns).join(name),
            accel: "unknown",
        }
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        self.kill();
    }
}

fn run_on(ns: &str, ip: Ipv4Addr, command: &str, timeout: Duration) -> Result<Output> {
    let addr = SocketAddr::from((ip, AGENT_PORT));
    let mut stream = crate::lab::connect_in(ns, addr, Duration::from_secs(10))
        .map_err(|e| PeerError::Agent(format!("connecting to {addr}: {e}")))?;
    // The agent answers when the command ends; give it the command's time plus a margin.
    let _ = stream.set_read_timeout(Some(timeout + Duration::from_secs(15)));
    let req = Request {
        timeout_ms: timeout.as_millis() as u64,
        command: command.to_string(),
    };
    req.write(&mut stream)
        .map_err(|e| PeerError::Agent(format!("sending to {addr}: {e}")))?;
    let reply = Reply::read(&mut stream)
        .map_err(|e| PeerError::Agent(format!("waiting for {addr} ({command}): {e}")))?;
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
        .arg("-device")
        .arg(format!("virtio-net-pci,netdev=n0,mac={mac}"))
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
        .push(child.id());
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
        child: Some(child),
        console,
        dir: dir.to_path_buf(),
        accel,
    })
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

/// SIGKILLs the qemu processes with these PIDs and waits (briefly) for them to go.
pub(crate) fn kill_all(pids: &[u32]) {
    for &pid in pids {
        // SAFETY: kill(2) on a PID this harness started (qemu, via `ip netns exec`, which
        // execs it).
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    for &pid in pids {
        while Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < deadline {
            // Reap it if it is our child; otherwise just wait for it to go.
            // SAFETY: waitpid with WNOHANG on a PID; harmless if it is not our child.
            unsafe { libc::waitpid(pid as i32, std::ptr::null_mut(), libc::WNOHANG) };
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::name_option_is;

    #[test]
    fn a_guest_is_known_by_its_name_with_or_without_options() {
        assert!(name_option_is(b"xrbench0", "xrbench0"));
        assert!(name_option_is(b"xrbench0,debug-threads=on", "xrbench0"));
        assert!(!name_option_is(b"xrbench01,debug-threads=on", "xrbench0"));
        assert!(!name_option_is(b"xrbench", "xrbench0"));
    }
}
