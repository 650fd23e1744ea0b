//! `xroce engine` as a process: one engine per queue (a second gets a clear error), and
//! killing an engine hands RoCEv2 traffic back to the kernel, after which a new engine binds.
//!
//! Needs root (namespaces, XDP); fails without it unless `XROCE_SKIP_ROOT_TESTS=1`.

use std::io::{BufRead, BufReader};
use std::net::UdpSocket;
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use xroce_datapath::netns::root_or_skip;

use xroce_datapath::netns::{run_bounded, NetnsPair};
use xroce_datapath::xdp;

const XROCE: &str = env!("CARGO_BIN_EXE_xroce");

/// An engine process, killed (SIGKILL) if still running when dropped.
struct EngineProcess {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl EngineProcess {
    fn start(pair: &NetnsPair, side: usize) -> EngineProcess {
        Self::start_with(pair, side, &[])
    }

    /// [`EngineProcess::start`] with more arguments for `xroce engine`.
    fn start_with(pair: &NetnsPair, side: usize, extra: &[&str]) -> EngineProcess {
        let mut child = pair
            .command(side, XROCE)
            .args(["engine", "--iface", pair.iface(side)])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start xroce engine");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let p = EngineProcess { child, lines };
        let line = p
            .lines
            .recv_timeout(Duration::from_secs(15))
            .expect("engine printed nothing within 15 s");
        assert!(line.contains("ready"), "unexpected first line: {line}");
        p
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` and waits (bounded) for the process to exit; returns its status.
    fn stop(mut self, signal: libc::c_int) -> std::process::ExitStatus {
        // `ip netns exec` execs the program, so the child's PID is the engine's.
        // SAFETY: kill(2) on our own child's PID.
        unsafe { libc::kill(self.pid() as i32, signal) };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "engine did not exit within 10 s of signal {signal}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for EngineProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends `n` UDP datagrams to port 4791 of side 0 from side 1 (kernel sockets).
fn send_roce_port_datagrams(pair: &NetnsPair, n: usize) {
    let seen_before = counters(pair).roce_seen();
    let dst = (pair.ipv4(0), 4791);
    let src = pair.ipv4(1);
    pair.run_in(1, move || {
        let s = UdpSocket::bind((src, 0)).expect("bind");
        for _ in 0..n {
            s.send_to(b"not really RoCE", dst).expect("send_to");
        }
    });
    // Until the steering program has run on all of them (it counts each RoCEv2-port frame
    // once, whatever it does with it): a loaded machine may leave them in softirq for long.
    let deadline = Instant::now() + Duration::from_secs(10);
    while counters(pair).roce_seen() < seen_before + n as u64 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whole frames in a capture file (what a truncated file holds so far, while it is written).
fn captured_frames(path: &std::path::Path) -> usize {
    xroce_cli::capture::read_file(path).map_or_else(|e| e.packets.len(), |p| p.len())
}

fn counters(pair: &NetnsPair) -> xdp::XdpCounters {
    let iface = pair.iface(0).to_string();
    pair.run_in(0, move || xdp::read_counters(&iface).expect("counters"))
}

fn ping(pair: &NetnsPair) -> bool {
    let out = pair
        .exec(1, &format!("ping -c 2 -i 0.2 -W 1 {}", pair.ipv4(0)))
        .expect("ping");
    out.status.success()
}

#[test]
fn one_engine_per_queue_and_the_kernel_takes_over_when_it_dies() {
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::new("xrproc", 1500).expect("namespaces");
    let iface = pair.iface(0).to_string();
    pair.run_in(0, move || {
        xdp::load(&xdp::LoadOptions::new(&iface)).expect("load");
    });

    let capture = std::env::temp_dir().join(format!("xrproc-{}.pcap", std::process::id()));
    let capture_arg = capture.to_string_lossy().into_owned();
    let first = EngineProcess::start_with(&pair, 0, &["--pcap", &capture_arg]);
    // RoCE-port frames now go to the engine's socket.
    let before = counters(&pair);
    send_roce_port_datagrams(&pair, 5);
    let during = counters(&pair);
    assert_eq!(
        during.redirected - before.redirected,
        5,
        "{before:?} -> {during:?}"
    );

    // The XDP program counted the five frames; the engine may still be writing them. Once
    // all five are in the file it has nothing more to write.
    let deadline = Instant::now() + Duration::from_secs(10);
    while captured_frames(&capture) < 5 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }

    // A second engine on the same queue: a clear error, promptly, naming the process in
    // its way.
    // Started with the same capture file, as a user repeating a command line does: the
    // refusal is about the queue, and the first engine's file is left as it is.
    let captured = std::fs::read(&capture).expect("the first engine's capture");
    assert_eq!(captured_frames(&capture), 5, "the first engine's capture");
    let stderr = failing_engine_with(&pair, pair.iface(0), &["--pcap", &capture_arg]);
    assert_eq!(
        std::fs::read(&capture).expect("the capture after the refused start"),
        captured,
        "the refused engine changed the first engine's capture"
    );
    let _ = std::fs::remove_file(&capture);
    let holder = format!("in use by process {} (xroce)", first.child.id());
    assert!(
        stderr.contains(&format!("queue 0 of {}", pair.iface(0)))
            && stderr.contains(&holder)
            && stderr.contains("one RDMA process at a time"),
        "unclear error (expected {holder:?}): {stderr}"
    );

    // Kill -9: the socket goes away with the process; RoCE-port frames reach the kernel again
    // (counted as "no socket"), and other traffic was never affected.
    let status = first.stop(libc::SIGKILL);
    assert!(!status.success());
    let before = counters(&pair);
    send_roce_port_datagrams(&pair, 5);
    let after = counters(&pair);
    assert_eq!(
        after.redirected, before.redirected,
        "frames still redirected after the engine died"
    );
    assert_eq!(after.roce_no_socket - before.roce_no_socket, 5);
    assert!(ping(&pair), "ping failed after the engine was killed");

    // A new engine binds the same queue, and a clean stop exits 0.
    let second = EngineProcess::start(&pair, 0);
    let before = counters(&pair);
    send_roce_port_datagrams(&pair, 3);
    assert_eq!(counters(&pair).redirected - before.redirected, 3);
    assert!(ping(&pair), "ping failed while an engine runs");
    let status = second.stop(libc::SIGTERM);
    assert!(status.success(), "engine exit after SIGTERM: {status:?}");
}

/// An engine whose interface is removed says so and exits with a failure, instead of
/// waiting for a signal with a device that cannot work; it prints its counters first, as it
/// does when stopped.
#[test]
fn an_engine_whose_interface_is_removed_exits_with_the_reason() {
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::new("xrgone", 1500).expect("namespaces");
    let iface = pair.iface(0).to_string();
    pair.run_in(0, {
        let iface = iface.clone();
        move || xdp::load(&xdp::LoadOptions::new(&iface)).expect("load")
    });
    let mut engine = spawn_piped_engine(&pair, &iface);
    // The engine is up once its socket takes the RoCE port's frames.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let before = counters(&pair);
        send_roce_port_datagrams(&pair, 1);
        if counters(&pair).redirected > before.redirected {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the engine did not bind within 15 s"
        );
    }
    let out = pair
        .exec(0, &format!("ip link del {iface}"))
        .expect("ip link del");
    assert!(out.status.success(), "{out:?}");
    let status = wait_at_most_10_s(&mut engine)
        .expect("the engine still runs 10 s after its interface was removed");
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut engine.stderr.take().expect("stderr"), &mut stderr)
        .expect("read stderr");
    let mut stdout = String::new();
    std::io::Read::read_to_string(&mut engine.stdout.take().expect("stdout"), &mut stdout)
        .expect("read stdout");
    assert!(!status.success(), "{status:?}");
    assert!(stderr.contains("interface was removed"), "{stderr}");
    assert!(
        stdout.contains("stopping (the device failed)") && stdout.contains("frames in"),
        "{stdout}"
    );
}

/// Runs `xroce engine --iface IFACE` in namespace 0 to completion (bounded) and returns its
/// stderr, checking it failed.
fn failing_engine(pair: &NetnsPair, iface: &str) -> String {
    failing_engine_with(pair, iface, &[])
}

/// [`failing_engine`] with more arguments for `xroce engine`.
fn failing_engine_with(pair: &NetnsPair, iface: &str, extra: &[&str]) -> String {
    let mut c = pair.command(0, XROCE);
    c.args(["engine", "--iface", iface]).args(extra);
    let out = run_bounded(c, Duration::from_secs(15)).expect("engine ran");
    assert!(!out.status.success(), "engine started: {out:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn engine_without_the_xdp_program_says_what_to_do() {
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::new("xrnoprog", 1500).expect("namespaces");
    let stderr = failing_engine(&pair, pair.iface(0));
    assert!(
        stderr.contains("xdp load"),
        "no hint to load the program: {stderr}"
    );
    let stderr = failing_engine(&pair, "nosuch0");
    assert!(
        stderr.contains("nosuch0"),
        "error does not name the interface: {stderr}"
    );
}

/// An engine whose parent exited (a daemonised program) inside `ip netns exec`'s private mount
/// namespace still finds the XDP program's socket map: when the host's bpffs cannot be reached
/// (PID 1's namespace may be unreadable, and there is no parent to follow), the attached
/// program leads to its maps.
#[test]
fn orphaned_engine_in_a_private_mount_namespace_binds() {
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::new("xrorph", 1500).expect("namespaces");
    let iface = pair.iface(0).to_string();
    pair.run_in(0, {
        let iface = iface.clone();
        move || xdp::load(&xdp::LoadOptions::new(&iface)).expect("load")
    });
    let dir = std::env::temp_dir().join(format!("xroce-orphan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let log = dir.join("engine.log");
    let pidfile = dir.join("engine.pid");
    // The subshell exits at once, so the engine is reparented away from its ancestors.
    let script = format!(
        "(sh -c 'echo $$ > {pid}; exec {xroce} engine --iface {iface}' > {log} 2>&1 &); exit 0",
        pid = pidfile.display(),
        xroce = XROCE,
        log = log.display(),
    );
    let out = pair.exec(0, &script).expect("start the orphan");
    assert!(out.status.success(), "{out:?}");
    let deadline = Instant::now() + Duration::from_secs(15);
    let text = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("ready") || text.contains("error") || Instant::now() > deadline {
            break text;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let pid: i32 = std::fs::read_to_string(&pidfile)
        .ok()
        .and_then(|p| p.trim().parse().ok())
        .expect("engine pid");
    let before = counters(&pair);
    send_roce_port_datagrams(&pair, 4);
    let after = counters(&pair);
    // SAFETY: kill(2) on the engine this test started (its PID from the pid file).
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        text.contains("ready"),
        "orphaned engine did not start:\n{text}"
    );
    assert_eq!(
        after.redirected - before.redirected,
        4,
        "{before:?} -> {after:?}"
    );
}

/// An engine started over a program whose test-only drop knob was left on says so: the
/// frames it loses would otherwise show only as retransmissions.
#[test]
fn an_engine_warns_about_a_drop_knob_left_on() {
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::new("xrknob", 1500).expect("namespaces");
    let iface = pair.iface(0).to_string();
    pair.run_in(0, {
        let iface = iface.clone();
        move || {
            xdp::load(&xdp::LoadOptions::new(&iface)).expect("load");
            xdp::set_drop_one_in(&iface, 50).expect("drop knob");
        }
    });
    let mut engine = spawn_piped_engine(&pair, &iface);
    let stdout = engine.stdout.take().expect("stdout");
    let (tx, ready) = mpsc::channel();
    std::thread::spawn(move || {
        let first = BufReader::new(stdout).lines().next();
        let _ = tx.send(first);
    });
    let first = ready.recv_timeout(Duration::from_secs(15));
    // SAFETY: kill(2) on our own child's PID (`ip netns exec` execs the engine).
    unsafe { libc::kill(engine.id() as i32, libc::SIGTERM) };
    let status = wait_at_most_10_s(&mut engine);
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut engine.stderr.take().expect("stderr"), &mut stderr)
        .expect("read stderr");
    assert!(
        matches!(&first, Ok(Some(Ok(line))) if line.contains("ready")),
        "{first:?} {status:?} {stderr}"
    );
    assert!(
        stderr.contains("test-only drop knob is on: 1 RoCEv2 frame in 50 is dropped"),
        "{stderr}"
    );
}

/// `xroce engine` on `iface` in namespace 0, its output piped.
fn spawn_piped_engine(pair: &NetnsPair, iface: &str) -> Child {
    pair.command(0, XROCE)
        .args(["engine", "--iface", iface])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start xroce engine")
}

/// Waits up to 10 s for `child` to exit; `None` (the child killed) when it did not.
fn wait_at_most_10_s(child: &mut Child) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
