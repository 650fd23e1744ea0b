//! `cargo xtask demo`: unmodified RDMA programs over xroce between two network namespaces.
//!
//! Installs what is missing, builds `xroce` and the provider, creates two namespaces joined by
//! a veth pair, an xroce device in each (`xroce link add`), runs `ibv_rc_pingpong` and
//! `ib_write_bw` between them (`xroce exec --`), prints their results, traces a short run with
//! `XROCE_PCAP` (and `XROCE_LOG=info`) and checks the capture with `xroce pcap check`, and
//! removes everything again, also after a failure or Ctrl-C.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::interrupt::{interrupted, was_interrupted};

const NS: [&str; 2] = ["xroce-demo-a", "xroce-demo-b"];
const IFACE: [&str; 2] = ["xdemo-a", "xdemo-b"];
const ADDR: [&str; 2] = ["10.77.7.1", "10.77.7.2"];
const DEV: &str = "xroce0";
const PORT: u16 = 18515;
/// Longest one demo program may run.
const PROGRAM_TIMEOUT: Duration = Duration::from_secs(120);

/// Set while cleaning up: the removal commands then run to their end (bounded) even after
/// Ctrl-C, which is when they matter most.
static CLEANING_UP: AtomicBool = AtomicBool::new(false);
/// How long the server may go on once its client has failed: it may wait in `accept()` or
/// for completions that will never come.
const AFTER_CLIENT_FAILED: Duration = Duration::from_secs(5);

pub fn run(root: &Path) -> Result<(), String> {
    if !crate::packages::is_root() {
        return Err(
            "the demo creates network namespaces and loads an XDP program: run it as root".into(),
        );
    }
    crate::interrupt::catch_signals();
    crate::packages::ensure_demo_packages()?;
    let cargo = crate::cargo();
    crate::step(
        root,
        "build xroce and the provider",
        &cargo,
        &["build", "-p", "xroce-cli", "-p", "xroce-provider"],
    )?;
    let bin = root.join("target/debug");
    let mut demo = Demo {
        xroce: bin.join("xroce"),
        provider: bin.join("libxroce_provider.so"),
        capture: root.join("target/xroce-demo.pcap"),
        client_capture: false,
        namespaces: 0,
        links: [false; 2],
    };
    let result = demo.run_steps();
    demo.cleanup();
    match &result {
        Ok(()) => println!("==> demo finished: RDMA traffic between two namespaces over xroce"),
        Err(e) => println!("==> demo FAILED: {e}"),
    }
    result
}

struct Demo {
    xroce: PathBuf,
    provider: PathBuf,
    /// Where the traced run's client writes its frames (`XROCE_PCAP`); kept after the demo.
    capture: PathBuf,
    /// The client runs with `XROCE_PCAP` set to `capture`.
    client_capture: bool,
    /// How many of the namespaces exist (created in order).
    namespaces: usize,
    /// Which sides have an xroce device.
    links: [bool; 2],
}

impl Demo {
    fn run_steps(&mut self) -> Result<(), String> {
        println!(
            "==> network: namespaces {} and {}, veth {} <-> {}",
            NS[0], NS[1], IFACE[0], IFACE[1]
        );
        for ns in NS {
            // Left over from an interrupted earlier run.
            let _ = quiet("ip", &["netns", "del", ns]);
        }
        for ns in NS {
            must("ip", &["netns", "add", ns])?;
            self.namespaces += 1;
        }
        must(
            "ip",
            &[
                "link", "add", IFACE[0], "netns", NS[0], "type", "veth", "peer", "name", IFACE[1],
                "netns", NS[1],
            ],
        )?;
        for side in 0..2 {
            let ns = NS[side];
            must(
                "ip",
                &[
                    "-n",
                    ns,
                    "addr",
                    "add",
                    &format!("{}/24", ADDR[side]),
                    "dev",
                    IFACE[side],
                ],
            )?;
            must("ip", &["-n", ns, "link", "set", IFACE[side], "up"])?;
            must("ip", &["-n", ns, "link", "set", "lo", "up"])?;
        }
        interrupted()?;
        for side in 0..2 {
            println!(
                "==> [{}] xroce link add {DEV} netdev {}",
                NS[side], IFACE[side]
            );
            let out = self.xroce_in(side, &["link", "add", DEV, "netdev", IFACE[side]])?;
            print_indented(&out);
            if !out.status.success() {
                return Err(format!("xroce link add failed in {}", NS[side]));
            }
            self.links[side] = true;
            interrupted()?;
        }
        println!("==> [{}] xroce exec -- ibv_devices", NS[0]);
        let out = self.exec_in(0, &["ibv_devices"])?;
        print_indented(&out);

        println!("\n==> ibv_rc_pingpong -g 1 (rdma-core's example, unmodified): server in {}, client in {}", NS[0], NS[1]);
        self.server_client(&["ibv_rc_pingpong", "-g", "1", "-n", "10000"])?;
        println!(
            "\n==> ib_write_bw (perftest, unmodified): server in {}, client in {}",
            NS[0], NS[1]
        );
        self.server_client(&["ib_write_bw", "-s", "65536", "-n", "2000"])?;

        println!(
            "\n==> the wire, traced: ibv_rc_pingpong -s 64 -n 20 again, the client with XROCE_PCAP={} \
             and XROCE_LOG=info",
            self.capture.display()
        );
        println!("    (tcpdump on the veth sees none of xroce's frames: AF_XDP bypasses its taps;");
        println!("    XROCE_LOG=info has each engine say the path its frames take, debug adds the");
        println!("    transport's retransmissions and NAKs)");
        self.client_capture = true;
        let traced = self.server_client(&["ibv_rc_pingpong", "-g", "1", "-s", "64", "-n", "20"]);
        self.client_capture = false;
        traced?;
        println!(
            "==> xroce pcap check {} (first lines and the summary)",
            self.capture.display()
        );
        let mut check = Command::new(&self.xroce);
        check.args(["pcap", "check"]).arg(&self.capture);
        let out = bounded(check, Duration::from_secs(60))?;
        let text = String::from_utf8_lossy(&out.stdout);
        let lines: Vec<&str> = text.lines().collect();
        for line in lines.iter().take(4) {
            println!("  {line}");
        }
        if lines.len() > 5 {
            println!("  ...");
        }
        if let Some(last) = lines.last().filter(|_| lines.len() > 4) {
            println!("  {last}");
        }
        if !out.status.success() {
            return Err(format!(
                "xroce pcap check found bad frames in {}",
                self.capture.display()
            ));
        }
        println!("    (open it in Wireshark, or run `xroce pcap check` on it yourself)");
        Ok(())
    }

    fn xroce_in(&self, side: usize, args: &[&str]) -> Result<Output, String> {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", NS[side]])
            .arg(&self.xroce)
            .args(args);
        bounded(cmd, Duration::from_secs(60))
    }

    fn exec_cmd(&self, side: usize, args: &[&str]) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", NS[side]])
            .arg(&self.xroce)
            .arg("exec")
            .arg("--")
            .args(args)
            .env("XROCE_PROVIDER", &self.provider);
        if side == 1 && self.client_capture {
            cmd.env("XROCE_PCAP", &self.capture)
                .env("XROCE_LOG", "info");
        }
        cmd
    }

    fn exec_in(&self, side: usize, args: &[&str]) -> Result<Output, String> {
        bounded(self.exec_cmd(side, args), PROGRAM_TIMEOUT)
    }

    /// Server in namespace 0, client (with the server's address) in namespace 1; prints both.
    fn server_client(&self, args: &[&str]) -> Result<(), String> {
        let mut server = self
            .exec_cmd(0, args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", args[0]))?;
        let listening = wait_listening();
        if let Err(e) = listening {
            let _ = server.kill();
            let out = server.wait_with_output().map_err(|e| e.to_string())?;
            print_indented(&out);
            return Err(e);
        }
        let mut client_args = args.to_vec();
        client_args.push(ADDR[0]);
        let client = self.exec_in(1, &client_args);
        let client_ok = matches!(&client, Ok(c) if c.status.success());
        let server = wait_child(
            server,
            if client_ok {
                PROGRAM_TIMEOUT
            } else {
                AFTER_CLIENT_FAILED
            },
        );
        // Both sides' output first, whatever happened: a failure's reason is in it.
        for (name, ns, out) in [("server", NS[0], &server), ("client", NS[1], &client)] {
            match out {
                Ok(o) => {
                    println!("  --- {name} ({ns}):");
                    print_indented(o);
                }
                Err(e) => println!("  --- {name} ({ns}): {e}"),
            }
        }
        let client = client?;
        let server = server?;
        interrupted()?;
        if server.status.success() && client.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{} failed (server {}, client {})",
                args[0], server.status, client.status
            ))
        }
    }

    fn cleanup(&mut self) {
        println!("==> cleaning up");
        CLEANING_UP.store(true, Ordering::SeqCst);
        for (side, ns) in NS.iter().enumerate() {
            if self.links[side] {
                match self.xroce_in(side, &["link", "del", DEV]) {
                    Ok(o) if o.status.success() => {}
                    Ok(o) => print_indented(&o),
                    Err(e) => println!("  xroce link del in {ns}: {e}"),
                }
                self.links[side] = false;
            }
        }
        for ns in NS.iter().take(self.namespaces) {
            if let Err(e) = must("ip", &["netns", "del", ns]) {
                println!("  {e}");
            }
        }
        self.namespaces = 0;
    }
}

/// Waits until the server in namespace 0 listens on the examples' TCP port.
fn wait_listening() -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        interrupted()?;
        let out = quiet(
            "ip",
            &[
                "netns",
                "exec",
                NS[0],
                "ss",
                "-Hltn",
                &format!("sport = :{PORT}"),
            ],
        )?;
        if !String::from_utf8_lossy(&out.stdout).trim().is_empty() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(format!(
        "the server did not listen on port {PORT} within 20 s"
    ))
}

fn print_indented(out: &Output) {
    for line in String::from_utf8_lossy(&out.stdout)
        .lines()
        .chain(String::from_utf8_lossy(&out.stderr).lines())
    {
        println!("  {line}");
    }
}

fn quiet(program: &str, args: &[&str]) -> Result<Output, String> {
    let mut cmd = Command::new(program);
    cmd.args(args);
    bounded(cmd, Duration::from_secs(30))
}

fn must(program: &str, args: &[&str]) -> Result<(), String> {
    let out = quiet(program, args)?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`{program} {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Runs a command to completion, killing it after `timeout`.
fn bounded(mut cmd: Command, timeout: Duration) -> Result<Output, String> {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {:?}: {e}", cmd.get_program()))?;
    wait_child(child, timeout)
}

/// Waits for `child`, killing it after `timeout` or on Ctrl-C (not while cleaning up). A
/// child that had to be killed is an error that carries what it had printed.
fn wait_child(mut child: Child, timeout: Duration) -> Result<Output, String> {
    let deadline = Instant::now() + timeout;
    let stop_asked = || was_interrupted() && !CLEANING_UP.load(Ordering::SeqCst);
    loop {
        match child.try_wait() {
            Ok(Some(_)) => return child.wait_with_output().map_err(|e| e.to_string()),
            Ok(None) if Instant::now() < deadline && !stop_asked() => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(None) => {
                let why = if stop_asked() {
                    "interrupted".to_string()
                } else {
                    format!("did not finish within {} s", timeout.as_secs())
                };
                let _ = child.kill();
                let said = match child.wait_with_output() {
                    Ok(out) => String::from_utf8_lossy(&out.stdout)
                        .lines()
                        .chain(String::from_utf8_lossy(&out.stderr).lines())
                        .map(|l| format!("\n    {l}"))
                        .collect::<String>(),
                    Err(_) => String::new(),
                };
                return Err(format!("{why}{said}"));
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}
