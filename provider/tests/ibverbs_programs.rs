//! Unmodified rdma-core example programs and perftest over xroce, between two network
//! namespaces joined by a veth pair: `xroce link add` in each, programs started with
//! `xroce exec --`, exactly as the README tells users.
//!
//! Needs root, ibverbs-utils and perftest (`cargo xtask test` installs them). Without root
//! these tests fail unless `XROCE_SKIP_ROOT_TESTS=1` says to skip them.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use xroce_datapath::netns::{root_or_skip, run_bounded, run_bounded_dumping_state, NetnsPair};
use xroce_datapath::test_support::{self, built, read_stats};

mod debian13;

/// Longest one program may run.
const PROGRAM_TIMEOUT: Duration = Duration::from_secs(120);
/// The device name both sides use.
const DEV: &str = "xr0";
/// The bridge of [`Rig::on_bridges`].
const BRIDGE: &str = "xrbr";
/// rdma-core examples and perftest both listen on this TCP port by default.
const PORT: u16 = 18515;

/// The programs measure and compete for the 2 CPUs of a CI machine (perftest calibrates its
/// clock at start-up); one rig at a time keeps their runs independent of each other.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Two namespaces, each with an xroce device `xr0` on its end of the veth; or (see
/// [`Rig::one_namespace`]) both ends in namespace 0, with devices `xr0` and `xr1`.
struct Rig {
    pair: NetnsPair,
    /// Both veth ends, and both devices, are in namespace 0.
    one_namespace: bool,
    xroce: PathBuf,
    provider: PathBuf,
    /// `XROCE_BACKEND` for programs on each side ("": the default, AF_XDP).
    backends: [&'static str; 2],
    /// `XROCE_TRANSMIT` for programs on each side ("": the default, auto, which on the rig's
    /// veth pair batches runs of frames through a UDP socket).
    transmits: [&'static str; 2],
    /// `XROCE_BIND_MODE` for programs on each side ("": the default, auto).
    bind_modes: [&'static str; 2],
    /// `XROCE_LOG` for programs on each side ("": the default, warn).
    logs: [&'static str; 2],
    /// Released last, after the namespaces are gone (fields drop in order).
    _serial: std::sync::MutexGuard<'static, ()>,
}

impl Rig {
    fn new(prefix: &str, mtu: u32) -> Rig {
        Rig::create(prefix, mtu, false, false).0
    }

    /// Like [`Rig::new`], with a global (ULA) IPv6 address on each side as well.
    fn with_ipv6(prefix: &str, mtu: u32) -> Rig {
        Rig::create(prefix, mtu, true, false).0
    }

    /// Like [`Rig::new`], but each side's veth end is a port of a bridge (`xrbr`) that holds
    /// the address, and the devices are on the bridges: a driver without native XDP. Also
    /// returns what `xroce link add` printed on each side.
    fn on_bridges(prefix: &str, mtu: u32) -> (Rig, [String; 2]) {
        Rig::create(prefix, mtu, false, true)
    }

    /// Both ends of the veth pair in namespace 0, each with its address and an xroce device
    /// (`xr0` and `xr1`): two NICs of one host cabled together. Programs pick their device
    /// with `-d` ([`Rig::exec`] adds it).
    fn one_namespace(prefix: &str, mtu: u32) -> Rig {
        let serial = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
        let pair = NetnsPair::new(prefix, mtu).expect("create namespaces");
        let (end, ns0) = (pair.iface(1), pair.ns_name(0));
        let out = pair
            .exec(1, &format!("ip link set {end} netns {ns0}"))
            .expect("move the veth end");
        assert!(out.status.success(), "moving {end}: {out:?}");
        let out = pair
            .exec(
                0,
                &format!(
                    "ip addr add {}/24 dev {end} && ip link set {end} up",
                    pair.ipv4(1)
                ),
            )
            .expect("address the moved end");
        assert!(out.status.success(), "addressing {end}: {out:?}");
        let rig = Rig {
            pair,
            one_namespace: true,
            xroce: built("xroce"),
            provider: built("libxroce_provider.so"),
            backends: ["", ""],
            transmits: ["", ""],
            bind_modes: ["", ""],
            logs: ["", ""],
            _serial: serial,
        };
        for side in 0..2 {
            let mut cmd = rig.pair.command(0, &rig.xroce);
            cmd.args([
                "link",
                "add",
                rig.device(side),
                "netdev",
                rig.pair.iface(side),
            ]);
            let out = run_bounded(cmd, Duration::from_secs(60)).expect("run xroce link add");
            assert!(
                out.status.success(),
                "xroce link add failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        rig
    }

    /// The xroce device on `side`'s end of the veth.
    fn device(&self, side: usize) -> &'static str {
        if self.one_namespace && side == 1 {
            "xr1"
        } else {
            DEV
        }
    }

    /// The namespace `side`'s end of the veth is in.
    fn namespace(&self, side: usize) -> usize {
        if self.one_namespace {
            0
        } else {
            side
        }
    }

    fn create(prefix: &str, mtu: u32, ipv6: bool, bridges: bool) -> (Rig, [String; 2]) {
        let serial = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
        let pair = if ipv6 {
            NetnsPair::with_ipv6(prefix, mtu)
        } else {
            NetnsPair::new(prefix, mtu)
        }
        .expect("create namespaces");
        let rig = Rig {
            pair,
            one_namespace: false,
            xroce: built("xroce"),
            provider: built("libxroce_provider.so"),
            backends: ["", ""],
            transmits: ["", ""],
            bind_modes: ["", ""],
            logs: ["", ""],
            _serial: serial,
        };
        let mut printed: [String; 2] = Default::default();
        for (side, printed) in printed.iter_mut().enumerate() {
            let mut netdev = rig.pair.iface(side);
            if bridges {
                let veth = rig.pair.iface(side);
                let setup = format!(
                    "ip addr flush dev {veth} && ip link add {BRIDGE} type bridge && \
                     ip link set {veth} master {BRIDGE} && ip link set {BRIDGE} up && \
                     ip addr add {}/24 dev {BRIDGE}",
                    rig.pair.ipv4(side)
                );
                let out = rig.pair.exec(side, &setup).expect("run bridge set-up");
                assert!(out.status.success(), "bridge set-up: {out:?}");
                netdev = BRIDGE;
            }
            let mut cmd = rig.pair.command(side, &rig.xroce);
            cmd.args(["link", "add", DEV, "netdev", netdev]);
            let out = run_bounded(cmd, Duration::from_secs(60)).expect("run xroce link add");
            assert!(
                out.status.success(),
                "xroce link add failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            *printed = String::from_utf8_lossy(&out.stdout).into_owned();
        }
        (rig, printed)
    }

    /// `xroce exec -- args...` in `side`'s namespace (with `-d` naming `side`'s device when
    /// both are in one namespace).
    fn exec(&self, side: usize, args: &[&str]) -> Command {
        let mut cmd = self.pair.command(self.namespace(side), &self.xroce);
        cmd.arg("exec").arg("--");
        match args.split_first() {
            Some((program, rest)) if self.one_namespace => {
                cmd.arg(program).args(["-d", self.device(side)]).args(rest)
            }
            _ => cmd.args(args),
        };
        cmd.env("XROCE_PROVIDER", &self.provider);
        if !self.backends[side].is_empty() {
            cmd.env("XROCE_BACKEND", self.backends[side]);
        }
        if !self.transmits[side].is_empty() {
            cmd.env("XROCE_TRANSMIT", self.transmits[side]);
        }
        if !self.bind_modes[side].is_empty() {
            cmd.env("XROCE_BIND_MODE", self.bind_modes[side]);
        }
        if !self.logs[side].is_empty() {
            cmd.env("XROCE_LOG", self.logs[side]);
        }
        cmd
    }

    fn run(&self, side: usize, args: &[&str]) -> Output {
        run_bounded(self.exec(side, args), PROGRAM_TIMEOUT)
            .unwrap_or_else(|e| panic!("{args:?}: {e}"))
    }

    /// Waits until something in namespace 0 listens on the TCP port.
    fn wait_listening(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            let out = self
                .pair
                .exec(0, &format!("ss -Hltn 'sport = :{PORT}'"))
                .expect("run ss");
            if !String::from_utf8_lossy(&out.stdout).trim().is_empty() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("no server started listening on port {PORT} within 20 s");
    }

    /// [`Rig::try_server_client`], again when perftest could not calibrate its clock.
    ///
    /// perftest converts cycles to time with a CPU frequency it measures at start-up against
    /// gettimeofday; when the fit is poor ("Correlation coefficient r^2 < 0.9", common on a
    /// busy 2-core machine) it refuses to print a report. That is perftest and the machine, not
    /// xroce, so such a run is repeated (at most twice more).
    fn server_client(&self, args: &[&str]) -> (String, String) {
        self.server_client_counted(args, None, None)
    }

    /// [`Rig::server_client`], the client's engines adding their counters to `stats`
    /// (`XROCE_STATS_FILE`).
    fn server_client_with_stats(&self, args: &[&str], stats: &std::path::Path) -> (String, String) {
        self.server_client_counted(args, Some(stats), None)
    }

    /// [`Rig::server_client`], each side's engines adding their counters to its stats file, if
    /// it has one.
    fn server_client_counted(
        &self,
        args: &[&str],
        stats: Option<&std::path::Path>,
        server_stats: Option<&std::path::Path>,
    ) -> (String, String) {
        for attempt in 1.. {
            match self.try_server_client(args, stats, server_stats) {
                Ok(r) => return r,
                Err(msg) if attempt < 3 && msg.contains("Correlation coefficient r^2") => {
                    eprintln!("{args:?}: perftest could not calibrate its clock; running again");
                }
                Err(msg) => panic!("{msg}"),
            }
        }
        unreachable!()
    }

    /// Runs `args` as the server in namespace 0 and `args SERVER_IP` as the client in namespace
    /// 1; both must exit 0. Returns (server, client) output, or the failure with both outputs.
    /// The engines of each side add their counters to its stats file, if it has one.
    fn try_server_client(
        &self,
        args: &[&str],
        stats: Option<&std::path::Path>,
        server_stats: Option<&std::path::Path>,
    ) -> Result<(String, String), String> {
        let mut server_cmd = self.exec(0, args);
        if let Some(stats) = server_stats {
            server_cmd.env("XROCE_STATS_FILE", stats);
        }
        let server = std::thread::spawn(move || run_bounded(server_cmd, PROGRAM_TIMEOUT));
        self.wait_listening();
        let ip = self.pair.ipv4(0).to_string();
        let mut client_args = args.to_vec();
        client_args.push(&ip);
        let mut client_cmd = self.exec(1, &client_args);
        if let Some(stats) = stats {
            client_cmd.env("XROCE_STATS_FILE", stats);
        }
        let client = run_bounded(client_cmd, PROGRAM_TIMEOUT)
            .unwrap_or_else(|e| panic!("{client_args:?}: {e}"));
        let server = server
            .join()
            .expect("server thread")
            .unwrap_or_else(|e| panic!("server {args:?}: {e}"));
        let text = |o: &Output| {
            format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            )
        };
        let (s, c) = (text(&server), text(&client));
        if server.status.success() && client.status.success() {
            Ok((s, c))
        } else {
            Err(format!(
                "{args:?} failed\n--- server ({}):\n{s}\n--- client ({}):\n{c}",
                server.status, client.status
            ))
        }
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        for side in 0..2 {
            let mut cmd = self.pair.command(self.namespace(side), &self.xroce);
            cmd.args(["link", "del", self.device(side)]);
            let _ = run_bounded(cmd, Duration::from_secs(30));
        }
    }
}

#[test]
fn devices_and_attributes() {
    if !root_or_skip() {
        return;
    }
    let rig = Rig::new("xpa", 1500);
    let out = rig.run(0, &["ibv_devices"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains(DEV),
        "ibv_devices:\n{text}"
    );

    let out = rig.run(0, &["ibv_devinfo", "-v", "-d", DEV]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "ibv_devinfo failed: {text}");
    for want in [
        "PORT_ACTIVE",
        "active_mtu:\t\t1024 (3)",
        "max_mtu:\t\t4096 (5)",
        "link_layer:\t\tEthernet",
        "atomic_cap:\t\t\tATOMIC_HCA (1)",
        "max_qp_rd_atom:\t\t\t128",
        "phys_port_cnt:\t\t\t1",
    ] {
        assert!(
            text.contains(want),
            "ibv_devinfo -v lacks {want:?}:\n{text}"
        );
    }
    let ipv4 = rig.pair.ipv4(0).octets();
    let mapped = format!(
        "GID[  1]:\t\t::ffff:{}.{}.{}.{}, RoCE v2",
        ipv4[0], ipv4[1], ipv4[2], ipv4[3]
    );
    assert!(
        text.contains(&mapped),
        "GID table lacks {mapped:?}:\n{text}"
    );
    assert!(
        text.contains("GID[  0]:\t\tfe80::"),
        "GID 0 is not the link-local GID:\n{text}"
    );
}

/// On a kernel with RDMA, libibverbs lists devices over netlink and never reads the generated
/// sysfs tree; under `xroce exec` it must not ask netlink (then it reads the tree, which also
/// links the kernel's own devices). This kernel has no RDMA, so the proof is that the
/// `NETLINK_RDMA` socket never reaches the kernel under `xroce exec`, while it does without.
#[test]
fn device_listing_does_not_ask_the_kernel_under_xroce_exec() {
    if !root_or_skip() {
        return;
    }
    let rig = Rig::new("xpn", 1500);
    let trace = ["strace", "-f", "-e", "trace=socket", "ibv_devices"];
    let out = rig.run(0, &trace);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        stdout.contains(DEV),
        "ibv_devices under strace:\n{stdout}\n{stderr}"
    );
    assert!(
        !stderr.contains("NETLINK_RDMA"),
        "libibverbs asked the kernel under xroce exec:\n{stderr}"
    );
    // Without xroce exec the same program does ask (so the check above can see it).
    let plain = rig
        .pair
        .exec(0, &trace.join(" "))
        .expect("run strace ibv_devices");
    assert!(
        String::from_utf8_lossy(&plain.stderr).contains("NETLINK_RDMA"),
        "plain ibv_devices did not open a NETLINK_RDMA socket: {plain:?}"
    );
}

/// `XROCE_LOG=debug` is how a user sees what the transport did. With one RoCE frame in five
/// dropped on its way into the server, `ibv_rc_pingpong` still finishes, and its stderr carries
/// the recoveries (the client resending after sequence NAKs, probing for lost tails, the
/// server's NAKs), each line stamped with the time of day and the process. At the default
/// level the same lossy run says nothing of them.
#[test]
fn the_transport_logs_its_recoveries_at_debug_and_keeps_quiet_by_default() {
    if !root_or_skip() {
        return;
    }
    let mut rig = Rig::new("xpl", 1500);
    let iface = rig.pair.iface(0).to_string();
    rig.pair.run_in(0, move || {
        xroce_datapath::xdp::set_drop_one_in(&iface, 5).expect("set the drop knob");
    });
    let args = ["ibv_rc_pingpong", "-g", "1", "-s", "4096", "-n", "50"];
    let (s, c) = rig.server_client(&args);
    for text in [&s, &c] {
        assert!(text.contains("iters in"), "no result:\n{text}");
        assert!(
            !text.contains("xroce: debug"),
            "debug lines by default:\n{text}"
        );
    }
    rig.logs = ["debug", "debug"];
    let (s, c) = rig.server_client(&args);
    assert!(c.contains("iters in"), "no result:\n{c}");
    let debug_lines = |text: &str| -> Vec<String> {
        text.lines()
            .filter(|l| l.starts_with("xroce: debug "))
            .map(String::from)
            .collect()
    };
    let (server_lines, client_lines) = (debug_lines(&s), debug_lines(&c));
    // `info`'s line, which `debug` includes: the path the engine took.
    assert!(
        c.lines().any(|l| l.starts_with("xroce: ")
            && l.contains(": engine started: af_xdp, receiving on queue 0, ")),
        "the client's engine did not say how it started:\n{c}"
    );
    let resent = client_lines
        .iter()
        .find(|l| l.contains("resending from there"))
        .unwrap_or_else(|| panic!("the client logged no retransmission:\n{c}"));
    // "xroce: debug HH:MM:SS.uuuuuu pid N xroce_core::transport::completer: QP 0x...: ..."
    let words: Vec<&str> = resent.split(' ').collect();
    let clock: Vec<&str> = words[2].split([':', '.']).collect();
    assert!(
        clock.len() == 4 && clock.iter().all(|p| p.parse::<u32>().is_ok()) && clock[3].len() == 6,
        "no time of day in {resent:?}"
    );
    assert_eq!(words[3], "pid", "{resent:?}");
    assert!(words[4].parse::<u32>().is_ok(), "{resent:?}");
    assert_eq!(words[5], "xroce_core::transport::completer:", "{resent:?}");
    assert!(words[6] == "QP" && words[7].starts_with("0x"), "{resent:?}");
    assert!(
        server_lines.iter().any(|l| l.contains("NAK sent")),
        "the server, whose incoming frames were dropped, logged no NAK:\n{s}"
    );
    // A message's last packet lost draws no NAK (a ping-pong sends nothing behind it): the
    // client probes for it (ibv_rc_pingpong's `timeout` 14 allows probes).
    assert!(
        client_lines.iter().any(|l| l.contains("probing")),
        "the client logged no tail-loss probe:\n{c}"
    );
    assert_ne!(
        words[4],
        server_lines[0].split(' ').nth(4).unwrap_or_default(),
        "client and server lines carry the same pid"
    );
}

#[test]
fn rdma_core_pingpong_programs() {
    if !root_or_skip() {
        return;
    }
    let rig = Rig::new("xpp", 1500);
    let runs: &[&[&str]] = &[
        &["ibv_rc_pingpong", "-g", "1"],
        &["ibv_rc_pingpong", "-g", "1", "-s", "1"],
        &["ibv_rc_pingpong", "-g", "1", "-s", "64"],
        &["ibv_rc_pingpong", "-g", "1", "-s", "65536"],
        &["ibv_rc_pingpong", "-g", "1", "-n", "10000"],
        &["ibv_rc_pingpong", "-g", "1", "-e"],
        &["ibv_uc_pingpong", "-g", "1"],
        &["ibv_ud_pingpong", "-g", "1"],
        &["ibv_srq_pingpong", "-g", "1"],
    ];
    for args in runs {
        let (s, c) = rig.server_client(args);
        for text in [&s, &c] {
            assert!(
                text.contains("iters in"),
                "{args:?} printed no result:\n{text}"
            );
        }
        eprintln!("{args:?}: {}", c.lines().last().unwrap_or_default());
    }
    // Without `-g` the examples send no GID, which RoCE cannot route (rdma_rxe refuses it
    // too): the connection fails, and the user is told what to give.
    let failure = rig
        .try_server_client(&["ibv_rc_pingpong", "-n", "10"], None, None)
        .expect_err("ibv_rc_pingpong without a GID index connected");
    assert!(
        failure.contains("Failed to modify QP to RTR")
            && failure.contains("give the program a GID index (`-g 1`"),
        "{failure}"
    );
}

/// A bridge has no native XDP: `xroce link add` without `--mode` attaches the program in
/// generic mode there, says why, and RDMA works over it (it was refused, with a hint to give
/// `--mode generic`).
#[test]
fn a_device_on_a_bridge_runs_in_generic_xdp_mode() {
    if !root_or_skip() {
        return;
    }
    let (rig, printed) = Rig::on_bridges("xbr", 1500);
    for text in &printed {
        assert!(
            text.contains(&format!(
                "{DEV}: netdev {BRIDGE}, XDP program loaded (generic, plain build; the driver \
                 has no native XDP)"
            )),
            "{text}"
        );
    }
    let (s, c) = rig.server_client(&["ibv_rc_pingpong", "-g", "1", "-n", "200"]);
    for text in [&s, &c] {
        assert!(text.contains("200 iters in"), "{text}");
    }
    let (_, c) = rig.server_client(&["ib_write_bw", "-x", "1", "-n", "2000"]);
    assert!(
        c.lines().any(|l| l.trim_start().starts_with("65536")),
        "no result line:\n{c}"
    );
}

/// An AF_XDP queue takes one socket, so a device serves one RDMA process at a time: a second
/// program on a device in use fails at once, told which process has it, and once that one
/// is gone (killed, leaving its note behind) the device serves the next.
#[test]
fn a_second_program_on_a_device_is_told_which_process_has_it() {
    if !root_or_skip() {
        return;
    }
    let rig = Rig::new("xbusy", 1500);
    // A server holds the device (its engine starts with its protection domain) while it waits
    // for a client.
    let mut first = rig
        .exec(0, &["ibv_rc_pingpong", "-g", "1"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start the first server");
    rig.wait_listening();
    let second = rig.run(0, &["ibv_rc_pingpong", "-g", "1", "-p", "18600"]);
    // `xroce link show` names it too.
    let mut show = rig.pair.command(0, &rig.xroce);
    show.args(["link", "show", DEV]);
    let show = run_bounded(show, Duration::from_secs(30)).expect("run xroce link show");
    let shown = String::from_utf8_lossy(&show.stdout).into_owned();
    let _ = first.kill();
    let _ = first.wait();
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(
        !second.status.success(),
        "a second program started: {stderr}"
    );
    assert!(
        stderr.contains("in use by process ")
            && stderr.contains("(ibv_rc_pingpong)")
            && stderr.contains("one RDMA process at a time")
            && stderr.contains("need a device each"),
        "the error does not name the program in the way, or what to do: {stderr}"
    );
    assert!(
        shown.contains(&format!(
            "in use by process {} (ibv_rc_pingpong)",
            first.id()
        )),
        "xroce link show does not name the program holding the device: {shown}"
    );
    let (s, c) = rig.server_client(&["ibv_rc_pingpong", "-g", "1", "-n", "100"]);
    assert!(s.contains("iters in") && c.contains("iters in"), "{s}\n{c}");
}

/// After `IBV_EVENT_DEVICE_FATAL` (here: the steering program removed under a running
/// program) an application opens the device again while its failed context is still open, as
/// it would on an RDMA NIC. Once the steering is back, the new context gets a working device
/// (a SEND between two of its QPs arrives), not the failed engine.
#[test]
fn a_device_opened_again_after_it_failed_works_once_the_cause_is_gone() {
    if !root_or_skip() {
        return;
    }
    use std::io::{BufRead, Write};
    let program = compile_c("reopen_after_fatal");
    let rig = Rig::new("xpf", 1500);
    let mut child = rig
        .exec(0, &[&program.to_string_lossy(), "1"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start reopen_after_fatal");
    let pid = child.id();
    let (lines_tx, lines) = std::sync::mpsc::channel::<String>();
    let stdout = child.stdout.take().expect("its stdout");
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            let _ = lines_tx.send(line);
        }
    });
    let stderr = child.stderr.take().expect("its stderr");
    let stderr = std::thread::spawn(move || std::io::read_to_string(stderr).unwrap_or_default());
    let mut seen = Vec::new();
    let mut expect = |want: &str| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match lines.recv_timeout(left) {
                Ok(line) => {
                    let found = line == want;
                    seen.push(line);
                    if found {
                        return;
                    }
                }
                Err(_) => break,
            }
        }
        // SAFETY: signalling the child this test started.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        panic!("reopen_after_fatal never printed {want:?}; it printed {seen:?}");
    };
    expect("ready");
    let iface = rig.pair.iface(0).to_string();
    let unload_from = iface.clone();
    rig.pair
        .run_in(0, move || xroce_datapath::xdp::unload(&unload_from))
        .expect("unload the steering program");
    expect("fatal");
    rig.pair
        .run_in(0, move || {
            xroce_datapath::xdp::load(&xroce_datapath::xdp::LoadOptions::new(&iface))
        })
        .expect("load the steering program again");
    child
        .stdin
        .take()
        .expect("its stdin")
        .write_all(b"go\n")
        .expect("tell it to go on");
    expect("reopened ok");
    let status = child.wait().expect("wait for reopen_after_fatal");
    let stderr = stderr.join().unwrap_or_default();
    assert!(
        status.success(),
        "reopen_after_fatal {status}: {seen:?}\n{stderr}"
    );
    assert!(
        stderr.contains("the device has failed"),
        "the failure was not reported: {stderr}"
    );
}

/// librdmacm needs the kernel's `rdma_cm` device, which this kernel lacks and xroce does not
/// provide: perftest's `-R` (connect through RDMA CM) fails at its first librdmacm call, and
/// the user is told why and what to run instead, not only perftest's "rdma_create_event_channel
/// failed".
#[test]
fn programs_using_rdma_cm_are_told_why_it_cannot_work() {
    if !root_or_skip() {
        return;
    }
    let rig = Rig::new("xrcm", 1500);
    let out = rig.run(0, &["ib_send_bw", "-d", DEV, "-x", "1", "-R"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "ib_send_bw -R started: {stderr}");
    assert!(
        stderr.contains("librdmacm (RDMA CM) needs the kernel's rdma_cm device")
            && stderr.contains("without -R"),
        "no word on RDMA CM: {stderr}"
    );
    assert_eq!(
        stderr.matches("xroce: librdmacm").count(),
        1,
        "said more than once: {stderr}"
    );
}

/// Two xroce devices in one namespace, on the two ends of a veth pair (two NICs of one host
/// cabled together; a CI machine's root namespace): each reaches the other's addresses over
/// the link, though the kernel routes the host's own addresses through its loopback
/// interface and answers no ARP for them there. RC over IPv4 and over link-local IPv6 GIDs,
/// and perftest's WRITE and READ; every frame went over the veth (none looped back inside an
/// engine, none to the wrong interface).
#[test]
fn two_devices_in_one_namespace_reach_each_other_over_their_link() {
    if !root_or_skip() {
        return;
    }
    let rig = Rig::one_namespace("xr1ns", 1500);
    let stats = std::env::temp_dir().join(format!("xroce-one-ns-{}.stats", std::process::id()));
    let _ = std::fs::remove_file(&stats);
    let mut sent = 0;
    for args in [
        &["ibv_rc_pingpong", "-g", "1", "-n", "200"][..],
        &["ibv_rc_pingpong", "-g", "0", "-n", "200"],
        &["ib_write_bw", "-x", "1", "-n", "500"],
        &["ib_read_bw", "-x", "1", "-n", "500"],
    ] {
        if args[2] == "0" {
            rig.wait_ipv6_ready();
        }
        let (s, c) = rig.server_client_with_stats(args, &stats);
        let done = if args[0] == "ibv_rc_pingpong" {
            "200 iters"
        } else {
            "65536"
        };
        assert!(
            c.contains(done),
            "{args:?}: no result:\n{c}\n--- server:\n{s}"
        );
        let counters = read_stats(&stats);
        assert!(
            counters["tx_frames"] > sent,
            "{args:?}: the client sent nothing over the link: {counters:?}"
        );
        sent = counters["tx_frames"];
        for none in ["tx_loopback", "tx_wrong_interface", "retry_exceeded"] {
            assert_eq!(counters[none], 0, "{args:?}: {none}: {counters:?}");
        }
    }
    let _ = std::fs::remove_file(&stats);
}

#[test]
fn perftest_programs() {
    if !root_or_skip() {
        return;
    }
    // Every frame through AF_XDP, as on a NIC; `programs_send_through_udp_gso` runs perftest
    // through batches.
    let mut rig = Rig::new("xpf", 1500);
    rig.transmits = ["af-xdp", "af-xdp"];
    let mut runs: Vec<Vec<&str>> = Vec::new();
    for prog in [
        "ib_send_bw",
        "ib_write_bw",
        "ib_read_bw",
        "ib_atomic_bw",
        "ib_send_lat",
        "ib_write_lat",
        "ib_read_lat",
        "ib_atomic_lat",
    ] {
        runs.push(vec![prog]);
        // All sizes (atomics have one size); fewer iterations per size keep it bounded.
        if !prog.starts_with("ib_atomic") {
            runs.push(vec![prog, "-a", "-n", "100"]);
        }
    }
    runs.push(vec!["ib_write_bw", "-q", "8"]);
    for args in &runs {
        let (_, c) = rig.server_client(args);
        // perftest prints one result row per size, starting with the size in bytes.
        let rows = c
            .lines()
            .filter(|l| l.trim_start().starts_with(|ch: char| ch.is_ascii_digit()))
            .count();
        let want = if args.contains(&"-a") { 20 } else { 1 };
        assert!(
            rows >= want,
            "{args:?}: {rows} result rows, want {want}:\n{c}"
        );
        eprintln!("{args:?}: ok, {rows} rows");
    }
}

/// perftest beyond its defaults, as people run it: both directions at once (`-b`), completion
/// events instead of polling (`-e`), UC and UD, a timed run (`-D`), a memory region per QP and
/// lists of work requests per post. Each must finish and report.
///
/// `ib_send_lat -e` must take its frames in the thread that waits for its events (see
/// `ibv_get_cq_event` in `comp_channel.rs`).
///
/// `ib_send_lat -e` waits for one completion event after each send and then polls the send CQ
/// once, so it relies on the send's completion (its ACK) coming before the answer's, as an RDMA
/// NIC or rdma_rxe orders them. With the ACK held back for the answer it took the receive event
/// for the send's, its one-entry send CQ overran, and the run hung (most runs of 5 000
/// iterations); neither side's engine may see an overrun. (perftest's UC and UD bandwidth
/// servers count their receives, and a message that finds no receive posted is dropped, on
/// rdma_rxe too: those modes run as latency tests or as WRITEs here.)
#[test]
fn perftest_modes_beyond_the_defaults() {
    if !root_or_skip() {
        return;
    }
    let rig = Rig::new("xpm", 1500);
    let stats = |side: &str| {
        std::env::temp_dir().join(format!("xroce-modes-{}.{side}", std::process::id()))
    };
    let (client_stats, server_stats) = (stats("client"), stats("server"));
    for args in [
        &["ib_send_lat", "-e", "-n", "5000"][..],
        &["ib_send_bw", "-e", "-n", "1000"],
        &["ib_read_lat", "-e", "-n", "1000"],
        &["ib_send_lat", "-c", "UD", "-e", "-n", "1000"],
        &["ib_send_lat", "-c", "UC", "-e", "-n", "1000"],
        &["ib_send_bw", "-b", "-n", "1000"],
        &["ib_write_bw", "-b", "-n", "1000"],
        &["ib_read_bw", "-b", "-n", "1000"],
        &["ib_write_bw", "-c", "UC", "-n", "1000"],
        &["ib_send_bw", "-D", "1"],
        &["ib_write_bw", "--mr_per_qp", "-q", "4", "-n", "500"],
        &["ib_send_bw", "-l", "4", "-n", "1000"],
    ] {
        let _ = std::fs::remove_file(&client_stats);
        let _ = std::fs::remove_file(&server_stats);
        let (s, c) = rig.server_client_counted(args, Some(&client_stats), Some(&server_stats));
        // perftest prints one result row per size, starting with the size in bytes.
        let rows = c
            .lines()
            .filter(|l| l.trim_start().starts_with(|ch: char| ch.is_ascii_digit()))
            .count();
        assert!(rows >= 1, "{args:?}: no result row:\n{c}\n--- server:\n{s}");
        for (side, path) in [("client", &client_stats), ("server", &server_stats)] {
            let counters = read_stats(path);
            assert_eq!(
                counters.get("cq_overflows"),
                Some(&0),
                "{args:?}: the {side}'s engine: {counters:?}"
            );
            if args[..2] == ["ib_send_lat", "-e"] {
                // The application thread waiting in ibv_get_cq_event takes the frames its
                // event comes from itself. The progress thread, woken by the same frames at
                // real-time priority, takes some first: waiters took from a quarter to all of
                // them in runs beside other tests, so no share is required. None taken by a
                // waiter means that the wait does not watch the frames.
                let taken = |name| counters.get(name).copied().unwrap_or(0);
                let (all, by_waiters) = (taken("rx_frames"), taken("rx_frames_by_waiters"));
                eprintln!("{args:?}: the {side}'s waiters took {by_waiters} of {all} frames");
                assert!(
                    by_waiters > 0,
                    "{args:?}: the {side}'s waiters took none of {all} frames"
                );
            }
        }
        eprintln!("{args:?}: ok");
    }
    let _ = std::fs::remove_file(&client_stats);
    let _ = std::fs::remove_file(&server_stats);
}

/// Debian 13's libibverbs (rdma-core 56), its example programs and its perftest (25.01), as
/// its users run them, on the devices and provider built here (see [`debian13`]): the provider
/// registers with that libibverbs (its private symbols and struct layouts are 56's, not the
/// machine's 44), the device and its GIDs show, and the programs' own checks pass.
#[test]
fn debian_13_rdma_core_and_perftest_run_over_xroce() {
    if !root_or_skip() {
        return;
    }
    let userland = debian13::ensure();
    let release = userland.version("libibverbs1").unwrap_or_default();
    assert!(
        release.starts_with("56."),
        "Debian 13's libibverbs1 is {release:?}"
    );
    // The programs really load the unpacked libibverbs and glibc, not the machine's.
    let resolved = userland.resolved_libraries("ibv_devinfo");
    for library in ["libibverbs.so.1", "libc.so.6"] {
        let line = resolved
            .lines()
            .find(|l| l.trim_start().starts_with(library))
            .unwrap_or_else(|| panic!("ibv_devinfo loads no {library}:\n{resolved}"));
        assert!(
            line.contains(env!("CARGO_TARGET_TMPDIR")),
            "{library} comes from the machine, not Debian 13: {line}"
        );
    }
    let rig = Rig::new("xp13", 1500);
    let run = |program: &str, args: &[&str]| -> Vec<String> {
        let mut line = userland.command(program);
        line.extend(args.iter().map(|a| a.to_string()));
        line
    };
    let devinfo = run("ibv_devinfo", &["-v", "-d", DEV]);
    let out = rig.run(0, &devinfo.iter().map(String::as_str).collect::<Vec<_>>());
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let ipv4 = rig.pair.ipv4(0).octets();
    let gid = format!(
        "GID[  1]:\t\t::ffff:{}.{}.{}.{}, RoCE v2",
        ipv4[0], ipv4[1], ipv4[2], ipv4[3]
    );
    assert!(
        out.status.success()
            && text.contains("PORT_ACTIVE")
            && text.contains(&gid)
            && !text.contains("xroce:"),
        "Debian 13's ibv_devinfo -v:\n{text}"
    );
    let runs: &[(&str, &[&str])] = &[
        ("ibv_rc_pingpong", &["-g", "1"]),
        ("ibv_rc_pingpong", &["-g", "1", "-s", "65536"]),
        ("ibv_rc_pingpong", &["-g", "1", "-e"]),
        ("ibv_ud_pingpong", &["-g", "1"]),
        ("ibv_srq_pingpong", &["-g", "1"]),
        ("ib_send_bw", &["-x", "1", "-F"]),
        ("ib_write_bw", &["-x", "1", "-F", "-q", "4"]),
        ("ib_read_lat", &["-x", "1", "-F"]),
        ("ib_atomic_bw", &["-x", "1", "-F"]),
    ];
    for (program, args) in runs {
        let line = run(program, args);
        let (s, c) = rig.server_client(&line.iter().map(String::as_str).collect::<Vec<_>>());
        let done = if program.starts_with("ibv_") {
            // The examples print a result line on both sides once their checks passed.
            [&s, &c].iter().all(|t| t.contains("iters in"))
        } else {
            // perftest: a result row, starting with the size in bytes.
            c.lines()
                .any(|l| l.trim_start().starts_with(|ch: char| ch.is_ascii_digit()))
        };
        assert!(
            done,
            "Debian 13's {program} {args:?}:\n--- server:\n{s}\n--- client:\n{c}"
        );
        eprintln!("Debian 13's {program} {args:?}: ok");
    }
}

/// Unmodified programs whose client side runs on the DPDK port (`XROCE_BACKEND=dpdk`, a
/// provider built with the `dpdk` feature) against a server on AF_XDP, over IPv4 and IPv6
/// (GID 0, the link-local address): the examples' own checks and perftest's runs pass, and the
/// client's frames went past the steering program (no socket) to DPDK's driver. The runs with
/// `-e` wait in `ibv_get_cq_event`: the client's engine sleeps, and only its doorbell (the
/// port's kernel UDP socket) wakes it for each message, over both IP versions.
#[cfg(feature = "dpdk")]
#[test]
fn programs_run_over_the_dpdk_port() {
    if !root_or_skip() {
        return;
    }
    let mut rig = Rig::with_ipv6("xdk", 1500);
    rig.wait_ipv6_ready();
    rig.backends[1] = "dpdk";
    let runs: &[&[&str]] = &[
        &["ibv_rc_pingpong", "-g", "1", "-n", "10000"],
        &["ibv_rc_pingpong", "-g", "1", "-s", "65536", "-c"],
        &["ibv_rc_pingpong", "-g", "1", "-e", "-n", "2000"],
        &["ibv_rc_pingpong", "-g", "0", "-e", "-n", "2000"],
        &["ibv_rc_pingpong", "-g", "0", "-c", "-s", "4096"],
        &["ibv_ud_pingpong", "-g", "1"],
        &["ibv_ud_pingpong", "-g", "0"],
        &["ib_write_bw", "-x", "1"],
        &["ib_read_bw", "-x", "1"],
        &["ib_read_bw", "-x", "0"],
        &["ib_send_lat", "-x", "1"],
        &["ib_send_lat", "-x", "0"],
        &["ib_write_lat", "-x", "1"],
    ];
    for args in runs {
        let (s, c) = rig.server_client(args);
        for text in [&s, &c] {
            assert!(
                text.contains("iters in") || text.contains("#bytes"),
                "{args:?} printed no result:\n{text}"
            );
        }
        eprintln!("{args:?}: {}", c.lines().last().unwrap_or_default());
    }
    let counters = |side: usize| {
        let iface = rig.pair.iface(side).to_string();
        rig.pair.run_in(side, move || {
            xroce_datapath::xdp::read_counters(&iface).expect("steering counters")
        })
    };
    let (server, client) = (counters(0), counters(1));
    eprintln!("steering program, server (AF_XDP): {server:?}\nclient (DPDK): {client:?}");
    assert!(server.redirected > 10_000 && server.roce_no_socket == 0);
    assert!(client.redirected == 0 && client.roce_no_socket > 10_000);
}

/// Datagrams the kernel's UDP sockets in `side`'s namespace sent (`Udp: OutDatagrams`).
fn udp_datagrams_sent(rig: &Rig, side: usize) -> u64 {
    let out = rig
        .pair
        .exec(side, "cat /proc/net/snmp")
        .expect("read /proc/net/snmp");
    let text = String::from_utf8_lossy(&out.stdout);
    test_support::udp_out_datagrams(&text)
        .unwrap_or_else(|| panic!("no Udp OutDatagrams in:\n{text}"))
}

/// Both ends sending IPv4 frames through a kernel UDP socket in batches
/// (`XROCE_TRANSMIT=udp-gso`): RC with its contents checked, one-sided and UD, in both
/// directions, over a veth pair, where the kernel leaves the UDP checksum partial. The frames
/// must have gone through UDP sockets (the namespaces' UDP counters), every one accepted (no
/// bad ICRC or checksum, no retransmission); IPv6 still goes through AF_XDP beside it.
#[test]
fn programs_send_through_udp_gso() {
    if !root_or_skip() {
        return;
    }
    let mut rig = Rig::with_ipv6("xgs", 1500);
    rig.wait_ipv6_ready();
    rig.transmits = ["udp-gso", "udp-gso"];
    let stats = ["server", "client"].map(|side| {
        std::env::temp_dir().join(format!("xroce-udp-gso-{}.{side}", std::process::id()))
    });
    for path in &stats {
        let _ = std::fs::remove_file(path);
    }
    let sent_before = [udp_datagrams_sent(&rig, 0), udp_datagrams_sent(&rig, 1)];
    let runs: &[&[&str]] = &[
        &["ibv_rc_pingpong", "-g", "1", "-n", "2000"],
        &[
            "ibv_rc_pingpong",
            "-g",
            "1",
            "-s",
            "65536",
            "-n",
            "200",
            "-c",
        ],
        &[
            "ibv_rc_pingpong",
            "-g",
            "1",
            "-s",
            "3000",
            "-n",
            "500",
            "-c",
        ],
        &[
            "ibv_rc_pingpong",
            "-g",
            "0",
            "-s",
            "4096",
            "-n",
            "200",
            "-c",
        ],
        &["ibv_ud_pingpong", "-g", "1"],
        &["ib_write_bw", "-x", "1", "-s", "65536", "-n", "2000"],
        &["ib_read_bw", "-x", "1", "-n", "2000"],
        &["ib_send_bw", "-x", "1", "-s", "64", "-n", "20000"],
        &["ib_send_lat", "-x", "1", "-n", "2000"],
    ];
    for args in runs {
        let (s, c) = rig.server_client_counted(args, Some(&stats[1]), Some(&stats[0]));
        for text in [&s, &c] {
            assert!(
                text.contains("iters in") || text.contains("#bytes"),
                "{args:?} printed no result:\n{text}"
            );
        }
        eprintln!("{args:?}: {}", c.lines().last().unwrap_or_default());
    }
    for side in 0..2 {
        let sent = udp_datagrams_sent(&rig, side) - sent_before[side];
        let counters = read_stats(&stats[side]);
        let count = |name: &str| {
            *counters
                .get(name)
                .unwrap_or_else(|| panic!("side {side}: no {name} in {counters:?}"))
        };
        eprintln!("side {side}: {sent} UDP datagrams sent; {counters:?}");
        assert_eq!(count("udp_gso"), runs.len() as u64, "side {side}");
        // The kernel counts a batch as one datagram. Through AF_XDP none would count (the
        // programs exchange their QP numbers over TCP).
        assert!(sent > 1_000, "side {side}: {sent} UDP datagrams");
        for name in ["bad_icrc", "bad_checksum", "malformed", "timeouts"] {
            assert_eq!(count(name), 0, "side {side}: {name}");
        }
        // Frames out of order or lost would draw sequence NAKs. So does the protocol at work:
        // `ib_send_bw` can outrun its server's re-posting of receives (an ACK says a SEND
        // arrived, not that it was taken), and a SEND that finds no receive is answered with
        // an RNR NAK, the packets behind it with one sequence NAK. So every sequence NAK must
        // follow an RNR NAK (three of each came in one of this stop's two CI runs).
        assert!(
            count("seq_naks_sent") <= count("rnr_naks_sent"),
            "side {side}: sequence NAKs not explained by RNR NAKs: {counters:?}"
        );
    }
    // A ping-pong has no runs of frames to batch: it goes through AF_XDP, as without
    // batching, where a sendmsg per frame would cost more.
    let sent_before = [udp_datagrams_sent(&rig, 0), udp_datagrams_sent(&rig, 1)];
    rig.server_client(&["ib_send_lat", "-x", "1", "-n", "5000"]);
    for (side, before) in sent_before.into_iter().enumerate() {
        let sent = udp_datagrams_sent(&rig, side) - before;
        assert!(
            sent < 100,
            "side {side}: {sent} UDP datagrams in a ping-pong of 5000"
        );
    }
    for path in &stats {
        let _ = std::fs::remove_file(path);
    }
}

/// A program that stalls (here an `ibv_rc_pingpong` server no client ever connects to) and is
/// sent the signal `XROCE_DUMP_SIGNAL` names writes what its engine is doing to stderr: its QP
/// in INIT with the 500 receives the program posted, its empty CQ (501 entries asked for, 511
/// held, as rdma_rxe rounds them). (`run_bounded_dumping_state`
/// sends the signal when the program times out, as the interop tests do on a hang.)
#[test]
fn a_stalled_program_reports_its_state_on_the_dump_signal() {
    if !root_or_skip() {
        return;
    }
    let rig = Rig::new("xpd", 1500);
    let mut cmd = rig.exec(0, &["ibv_rc_pingpong", "-g", "1"]);
    cmd.env("XROCE_DUMP_SIGNAL", "USR1");
    // Generous: the server must have its QP, CQ and receives before the signal comes.
    let err = run_bounded_dumping_state(cmd, Duration::from_secs(10), libc::SIGUSR1)
        .expect_err("the server waits for a client forever");
    let text = err.to_string();
    for want in [
        "xroce: state of pid",
        "--- netdev ",
        "progress thread asleep",
        "Rc Init",
        "| rq 500 expect",
        "cq 1 0/511",
    ] {
        assert!(text.contains(want), "the report lacks {want:?}:\n{text}");
    }
}

/// `XROCE_EVICT_RECEIVED_LINES` with a word it does not know stops the device's start with an
/// error naming the variable and the words it takes, rather than running with a guess.
#[test]
fn an_eviction_setting_it_does_not_know_is_refused_naming_the_variable() {
    if !root_or_skip() {
        return;
    }
    let rig = Rig::new("xev", 1500);
    let mut cmd = rig.exec(1, &["ibv_rc_pingpong", "-g", "1", "-n", "10", "127.0.0.1"]);
    cmd.env("XROCE_EVICT_RECEIVED_LINES", "clflushopt");
    let out = run_bounded(cmd, PROGRAM_TIMEOUT).expect("run ibv_rc_pingpong");
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && text.contains("xroce: cannot start device")
            && text.contains("unknown eviction \"clflushopt\" in XROCE_EVICT_RECEIVED_LINES")
            && text.contains("clflush or off"),
        "{}\n{text}",
        out.status
    );
}

/// `XROCE_BIND_MODE` picks how a program's engines bind their AF_XDP sockets: `zero-copy` on a
/// veth, whose driver has none, fails with the kernel's refusal and how to do without it; a
/// name it does not know fails naming the ones it does; `copy` runs (on a veth auto mode binds
/// copy mode too: the interop tests run zero-copy where the driver has it).
#[test]
fn a_bind_mode_named_in_the_environment_is_used_or_refused_with_why() {
    if !root_or_skip() {
        return;
    }
    let mut rig = Rig::new("xpm", 1500);
    for (mode, want) in [
        (
            "zero-copy",
            "does not support zero-copy AF_XDP (auto mode, the default, binds in copy mode",
        ),
        ("native", "unknown bind mode \"native\" in XROCE_BIND_MODE"),
    ] {
        let mut cmd = rig.exec(1, &["ibv_rc_pingpong", "-g", "1", "-n", "10", "127.0.0.1"]);
        cmd.env("XROCE_BIND_MODE", mode);
        let out = run_bounded(cmd, PROGRAM_TIMEOUT).expect("run ibv_rc_pingpong");
        let text = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success()
                && text.contains("xroce: cannot start device")
                && text.contains(want),
            "XROCE_BIND_MODE={mode}: {}\n{text}",
            out.status
        );
    }
    rig.bind_modes = ["copy", "copy"];
    let stats = [0, 1].map(|side| {
        std::env::temp_dir().join(format!(
            "xroce-bind-mode-{}-{side}.stats",
            std::process::id()
        ))
    });
    for path in &stats {
        let _ = std::fs::remove_file(path);
    }
    let (s, c) = rig.server_client_counted(
        &["ibv_rc_pingpong", "-g", "1", "-n", "100"],
        Some(&stats[1]),
        Some(&stats[0]),
    );
    for text in [&s, &c] {
        assert!(text.contains("100 iters in"), "{text}");
    }
    for path in &stats {
        let line = std::fs::read_to_string(path).unwrap_or_default();
        let _ = std::fs::remove_file(path);
        assert!(
            line.contains(" zero_copy=0 ") && line.contains(" rx_frames="),
            "an engine in copy mode: {line}"
        );
    }
}

/// The port's events, and the device's end when its netdev is removed, reach an application
/// that only watches (it starts no engine). A link that goes down and up again at once is
/// reported as both, as rdma_rxe reports each netdev event.
#[test]
fn async_events_reach_ibv_asyncwatch() {
    if !root_or_skip() {
        return;
    }
    let rig = Rig::new("xpe", 1500);
    // ibv_asyncwatch never exits by itself; `timeout` ends it and its output is kept.
    let watch_cmd = rig.exec(0, &["timeout", "12", "ibv_asyncwatch", "-d", DEV]);
    let watch = std::thread::spawn(move || run_bounded(watch_cmd, Duration::from_secs(40)));
    // Give it time to open the device and block in ibv_get_async_event. The waits are
    // generous because the port's thread reads the link's state when a change wakes it: a
    // thread kept off its core past both the down and the up would see no change at all.
    std::thread::sleep(Duration::from_secs(3));
    let iface = rig.pair.iface(0).to_string();
    for step in [
        format!("ip link set {iface} down"),
        format!("ip link set {iface} up"),
        // Down and up from one process, quicker than the port's thread reads the link.
        format!("printf 'link set {iface} down\nlink set {iface} up\n' | ip -batch -"),
        format!("ip addr add 10.250.9.1/24 dev {iface}"),
        // The netdev gone: the device with it (the veth pair goes, both ends).
        format!("ip link del {iface}"),
    ] {
        let out = rig.pair.exec(0, &step).expect("run ip");
        assert!(out.status.success(), "{step}: {out:?}");
        std::thread::sleep(Duration::from_secs(1));
    }
    let out = watch.join().expect("watch thread").expect("ibv_asyncwatch");
    let text = String::from_utf8_lossy(&out.stdout);
    // In order: down, up, and the quick flap's down and up (the netdev's removal may add a
    // last PORT_ERR before DEVICE_FATAL).
    let (err, active) = (
        "IBV_EVENT_PORT_ERR (10), port 1",
        "IBV_EVENT_PORT_ACTIVE (9), port 1",
    );
    let port_events: Vec<&str> = text
        .lines()
        .filter_map(|l| [err, active].into_iter().find(|e| l.contains(e)))
        .collect();
    assert!(
        port_events.starts_with(&[err, active, err, active]),
        "ibv_asyncwatch's port events are not down, up, down, up:\n{text}"
    );
    for want in [
        "IBV_EVENT_GID_CHANGE (18), port 1",
        "IBV_EVENT_DEVICE_FATAL (8)",
    ] {
        assert!(
            text.contains(want),
            "ibv_asyncwatch lacks {want:?}:\n{text}"
        );
    }
}

/// libibverbs reads GIDs from the device's files in the generated sysfs tree on every query;
/// a running program's engine keeps them equal to its table. An address added while an
/// `ibv_rc_pingpong` server waits appears at the next index; the address the program started
/// with, once removed, leaves its slot empty instead of the later one moving up (a tree
/// written afresh would list it at index 1), as the kernel's table behaves for rdma_rxe.
#[test]
fn a_running_programs_gid_files_follow_its_engines_table() {
    if !root_or_skip() {
        return;
    }
    let rig = Rig::new("xpg", 1500);
    let server_cmd = rig.exec(0, &["timeout", "20", "ibv_rc_pingpong", "-g", "1"]);
    let server = std::thread::spawn(move || run_bounded(server_cmd, Duration::from_secs(40)));
    // Listening means its context, PD, CQ and QP exist: its engine runs.
    rig.wait_listening();
    let port = rig
        .pair
        .run_in(0, xroce_datapath::registry::sysfs_root)
        .expect("the namespace's tree")
        .join(format!("class/infiniband/{DEV}/ports/1"));
    let gid = |i: usize| {
        std::fs::read_to_string(port.join(format!("gids/{i}")))
            .expect("GID file")
            .trim()
            .to_string()
    };
    let wait_for = |i: usize, want: &str, what: &str| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while gid(i) != want {
            assert!(
                Instant::now() < deadline,
                "{what}: GID {i} is {}, not {want}",
                gid(i)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let as_gid = |ip: &str| {
        let ip: std::net::IpAddr = ip.parse().unwrap();
        xroce_datapath::registry::format_gid(xroce_datapath::registry::gid_ipv6(ip).octets())
    };
    let first = rig.pair.ipv4(0).to_string();
    assert_eq!(gid(1), as_gid(&first), "GID 1 at the start");
    let iface = rig.pair.iface(0).to_string();
    for step in [
        format!("ip addr add 10.250.9.1/24 dev {iface}"),
        format!("ip addr del {first}/24 dev {iface}"),
    ] {
        let out = rig.pair.exec(0, &step).expect("run ip");
        assert!(out.status.success(), "{step}: {out:?}");
        if step.contains(" add ") {
            wait_for(2, &as_gid("10.250.9.1"), "the added address");
        } else {
            wait_for(
                1,
                &xroce_datapath::registry::format_gid([0; 16]),
                "the removed one",
            );
            assert_eq!(gid(2), as_gid("10.250.9.1"), "the added address moved");
        }
    }
    // The server waits for a client that never comes: end it (and its `xroce exec` and
    // `timeout`), the processes of this test's namespace.
    let ns = rig.pair.ns_name(0).to_string();
    let _ = std::process::Command::new("sh")
        .args(["-c", &format!("ip netns pids {ns} | xargs -r kill")])
        .status();
    let _ = server.join();
}

#[test]
fn valgrind_finds_no_invalid_accesses() {
    if !root_or_skip() {
        return;
    }
    let rig = Rig::new("xpv", 1500);
    // The server runs under memcheck; the client runs natively.
    let server_cmd = rig.exec(
        0,
        &[
            "valgrind",
            "--error-exitcode=1",
            "ibv_rc_pingpong",
            "-g",
            "1",
            "-n",
            "200",
        ],
    );
    let server = std::thread::spawn(move || run_bounded(server_cmd, PROGRAM_TIMEOUT));
    rig.wait_listening();
    let ip = rig.pair.ipv4(0).to_string();
    let client = rig.run(1, &["ibv_rc_pingpong", "-g", "1", "-n", "200", &ip]);
    let server = server.join().expect("server thread").expect("valgrind run");
    let report = String::from_utf8_lossy(&server.stderr);
    assert!(
        client.status.success(),
        "client failed: {}",
        String::from_utf8_lossy(&client.stderr)
    );
    assert!(
        server.status.success()
            && report.contains("ERROR SUMMARY: 0 errors")
            && !report.contains("Invalid read")
            && !report.contains("Invalid write"),
        "valgrind reports errors ({}):\n{report}",
        server.status
    );
}

/// Compiles `provider/tests/c/NAME.c` against the system's libibverbs into the build
/// directory and returns the executable.
fn compile_c(name: &str) -> PathBuf {
    test_support::compile_c(
        &PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/c")
            .join(format!("{name}.c")),
    )
}

/// A program that does not link libibverbs but loads a plugin depending on it with `dlopen`
/// (UCX, libfabric and MPI plugins are loaded so) sees the xroce device and can use the calls
/// the provider interposes. They used to find no libibverbs behind them (`RTLD_NEXT` does not
/// search libraries loaded later) and failed with ENOSYS: no device at all.
#[test]
fn a_plugin_loaded_with_dlopen_sees_the_xroce_device() {
    if !root_or_skip() {
        return;
    }
    let sources = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/c/dlopen");
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dlopen");
    std::fs::create_dir_all(&dir).expect("a build directory");
    let (plugin, main) = (dir.join("plugin.so"), dir.join("main"));
    let cc = |args: &[&std::ffi::OsStr]| {
        let out = Command::new("cc")
            .args(["-O2", "-Wall", "-Wextra", "-Werror"])
            .args(args)
            .output()
            .expect("run cc");
        assert!(
            out.status.success(),
            "cc: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    cc(&[
        "-shared".as_ref(),
        "-fPIC".as_ref(),
        "-o".as_ref(),
        plugin.as_os_str(),
        sources.join("plugin.c").as_os_str(),
        "-libverbs".as_ref(),
    ]);
    cc(&[
        "-o".as_ref(),
        main.as_os_str(),
        sources.join("main.c").as_os_str(),
        "-ldl".as_ref(),
    ]);
    let rig = Rig::new("xpd", 1500);
    let out = rig.run(0, &[&main.to_string_lossy(), &plugin.to_string_lossy()]);
    let text = String::from_utf8_lossy(&out.stdout);
    let xroce_device = format!("device {} channel ok", rig.device(0));
    assert!(
        out.status.success() && text.lines().any(|l| l == xroce_device),
        "{}\n{text}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn application_errors_get_verbs_errors() {
    if !root_or_skip() {
        return;
    }
    let program = compile_c("verbs_errors");
    let rig = Rig::new("xpx", 1500);
    let exe = program.to_string_lossy();
    let out = rig.run(0, &[&exe, "1"]);
    let text = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && !text.contains("FAIL"),
        "verbs_errors ({}):\n{text}\n{stderr}",
        out.status
    );
    // Every check ran (a program that stopped early would also print no FAIL).
    for check in [
        "post_send_in_reset",
        "post_recv_in_reset",
        "post_send_in_init",
        "modify_qp_illegal_transition",
        "destroy_cq_in_use",
        "inline_above_limit",
        "inline_at_limit",
        "more_sges_than_max_send_sge",
        "unknown_opcode",
        "more_wrs_than_the_queue_holds",
        "queued_wrs_flush_in_order",
        "invalid_lkey",
        "sge_beyond_mr",
        "invalid_rkey",
        "remote_write_beyond_mr",
        "create_cq_rounds_up_as_rdma_rxe",
        "cq_overflow_raises_cq_err",
        "cq_overflow_qp_goes_on",
        "destroyed_cq_events_dropped",
        "create_ah_without_grh",
        "ud_ah_of_another_pd",
        "post_recv_in_error_notifies_the_channel",
        "cyclic_wr_chain_on_a_qp_in_error_ends",
        "destroy_cq_after_its_events_were_acknowledged",
        "destroyed_qp_async_events_dropped",
        "reg_mr_unmapped_memory",
        "reg_mr_read_only_for_writing",
        "reg_mr_read_only_for_reading",
        "reg_mr_hugetlb_hint",
        "deregistered_lkey",
        "create_cq_comp_vector_out_of_range",
        "modify_qp_reset_to_err",
        "modify_qp_av_port_out_of_range",
        "modify_qp_alt_path_refused",
        "modify_qp_path_mig_state_kept",
        "create_ah_port_out_of_range",
        "modify_qp_av_in_sqd_carries_its_port",
        "create_srq_with_no_sge_takes_one",
        "close_device_destroys_what_it_left",
        "forked_child_closes_the_inherited_context",
        "dealloc_pd_in_use",
        "reopen_after_leaked_objects",
        "closed_contexts_with_leaked_objects_leave_no_threads",
        "concurrent_first_verbs_share_one_engine",
        "a_context_opened_as_the_last_closes_works",
    ] {
        assert!(
            text.lines().any(|l| l == format!("ok {check}")),
            "verbs_errors did not pass {check}:\n{text}"
        );
    }
    // Again with its standard error a pipe whose reading end is already closed (the program
    // ignores SIGPIPE, as many servers do): xroce's messages there (such as the refused AH's)
    // fail with EPIPE, which must not abort it.
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let mut cmd = rig.exec(0, &[&exe, "1"]);
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(writer);
    let child = cmd.spawn().expect("run verbs_errors");
    // The command holds the writing end until it is dropped.
    drop(cmd);
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let out = match rx.recv_timeout(PROGRAM_TIMEOUT) {
        Ok(out) => out.expect("wait for verbs_errors"),
        Err(_) => {
            // SAFETY: signalling the child this test started.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            panic!("verbs_errors with an unread standard error did not finish");
        }
    };
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("ok create_ah_without_grh") && !text.contains("FAIL"),
        "verbs_errors with an unread standard error ({}):\n{text}",
        out.status
    );
}

#[test]
fn completion_channels_lose_no_wakeups() {
    if !root_or_skip() {
        return;
    }
    let program = compile_c("comp_channel_stress");
    let rig = Rig::new("xpc", 1500);
    let exe = program.to_string_lossy();
    // 4 threads per side, 125 000 event-driven ping-pong rounds each: 500 000 completion
    // events on each side, one million in all. A lost wake-up stops a thread after 10 s.
    let port = PORT.to_string();
    let (s, c) = rig.server_client(&[&exe, "-t", "4", "-n", "125000", "-p", &port]);
    for (side, text) in [("server", &s), ("client", &c)] {
        assert!(
            text.lines().any(|l| l == "events 500000"),
            "{side} did not receive all 500000 events:\n{text}"
        );
    }
}

/// `tcpdump` on the interface sees none of xroce's frames (AF_XDP bypasses its taps), so
/// `XROCE_PCAP` is how a user sees the wire: every frame the engine sent and received, whole,
/// with valid ICRCs, readable by `xroce pcap check`.
#[test]
fn xroce_pcap_captures_every_frame_sent_and_received() {
    if !root_or_skip() {
        return;
    }
    let rig = Rig::new("xcap", 1500);
    let dir = std::env::temp_dir().join(format!("xroce-capture-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temporary directory");
    let files = |side: usize| {
        (
            dir.join(format!("side{side}-{{netdev}}.pcap")),
            dir.join(format!("side{side}-{}.pcap", rig.pair.iface(side))),
            dir.join(format!("side{side}.stats")),
        )
    };
    let args = ["ibv_rc_pingpong", "-g", "1", "-n", "200"];
    let with_capture = |side: usize, args: &[&str]| {
        let (template, _, stats) = files(side);
        let mut cmd = rig.exec(side, args);
        cmd.env("XROCE_PCAP", template)
            .env("XROCE_STATS_FILE", stats);
        cmd
    };
    let server_cmd = with_capture(0, &args);
    let server = std::thread::spawn(move || run_bounded(server_cmd, PROGRAM_TIMEOUT));
    rig.wait_listening();
    let ip = rig.pair.ipv4(0).to_string();
    let mut client_args = args.to_vec();
    client_args.push(&ip);
    let client = run_bounded(with_capture(1, &client_args), PROGRAM_TIMEOUT).expect("client");
    let server = server.join().expect("server thread").expect("server");
    assert!(server.status.success() && client.status.success());

    for side in 0..2 {
        let (_, capture, stats) = files(side);
        let stats = read_stats(&stats);
        let stat = |name: &str| {
            *stats
                .get(name)
                .unwrap_or_else(|| panic!("side {side}: no {name} in {stats:?}"))
                as usize
        };
        let frames = xroce_cli::capture::read_file(&capture)
            .unwrap_or_else(|e| panic!("{}: {e}", capture.display()));
        for f in &frames {
            assert_eq!(f.data.len(), f.original_len, "frames are captured whole");
        }
        assert_eq!(
            frames.len(),
            stat("rx_frames") + stat("tx_frames"),
            "side {side}: {stats:?}"
        );
        let me = rig.pair.ipv4(side);
        let (mut sent, mut opcodes) = (0, std::collections::HashSet::new());
        for f in &frames {
            let frame =
                xroce_core::wire::RoceFrame::parse_ethernet(&f.data).expect("a RoCEv2 frame");
            frame.verify().expect("a valid ICRC and checksums");
            if frame.headers.ip.src_addr() == xroce_core::wire::IpAddress::V4(me.into()) {
                sent += 1;
            }
            opcodes.insert(frame.headers.transport.bth.opcode);
        }
        assert_eq!(sent, stat("tx_frames"), "side {side}");
        use xroce_core::wire::Opcode;
        for op in [
            Opcode::RC_SEND_FIRST,
            Opcode::RC_SEND_LAST,
            Opcode::RC_ACKNOWLEDGE,
        ] {
            assert!(
                opcodes.contains(&op),
                "side {side}: no {op:?} in the capture"
            );
        }
        // The user's own checker agrees.
        let mut check = Command::new(&rig.xroce);
        check.args(["pcap", "check", "-q"]).arg(&capture);
        let out = run_bounded(check, Duration::from_secs(60)).expect("xroce pcap check");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `XROCE_PCAP_MAX` bounds a capture for long runs: the file is rotated to `FILE.1` whenever
/// it fills, so the two files hold the run's last frames, none of them over the bound, with
/// nothing missing where one ends and the other begins. A size it cannot read fails the
/// device's start, saying what it takes.
#[test]
fn a_bounded_capture_keeps_the_last_frames_of_a_run() {
    if !root_or_skip() {
        return;
    }
    const MAX: u64 = 64 << 10;
    let rig = Rig::new("xcapm", 1500);
    let dir = std::env::temp_dir().join(format!("xroce-capture-max-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temporary directory");
    let (capture, stats) = (dir.join("server.pcap"), dir.join("server.stats"));
    let rotated = xroce_datapath::engine::rotated_capture_path(&capture);

    let mut bad = rig.exec(1, &["ibv_rc_pingpong", "-g", "1", "-n", "10", "127.0.0.1"]);
    bad.env("XROCE_PCAP", &capture)
        .env("XROCE_PCAP_MAX", "lots");
    let out = run_bounded(bad, PROGRAM_TIMEOUT).expect("run ibv_rc_pingpong");
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && text.contains("xroce: cannot start device")
            && text.contains("XROCE_PCAP_MAX: capture size \"lots\" not understood"),
        "{}\n{text}",
        out.status
    );

    // 4 KiB messages, 300 each way: about 2.5 MB of frames on each side.
    let args = ["ibv_rc_pingpong", "-g", "1", "-s", "4096", "-n", "300"];
    let mut server_cmd = rig.exec(0, &args);
    server_cmd
        .env("XROCE_PCAP", &capture)
        .env("XROCE_PCAP_MAX", "64K")
        .env("XROCE_STATS_FILE", &stats);
    let server = std::thread::spawn(move || run_bounded(server_cmd, PROGRAM_TIMEOUT));
    rig.wait_listening();
    let ip = rig.pair.ipv4(0).to_string();
    let mut client_args = args.to_vec();
    client_args.push(&ip);
    let client = run_bounded(rig.exec(1, &client_args), PROGRAM_TIMEOUT).expect("client");
    let server = server.join().expect("server thread").expect("server");
    assert!(server.status.success() && client.status.success());

    let stats = read_stats(&stats);
    let counted = stats["tx_frames"] + stats["rx_frames"];
    let mut kept = Vec::new();
    for file in [&rotated, &capture] {
        let len = std::fs::metadata(file)
            .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
            .len();
        assert!(len <= MAX, "{} holds {len} bytes", file.display());
        kept.extend(xroce_cli::capture::read_file(file).expect("a capture file"));
    }
    assert!(
        (kept.len() as u64) < counted / 4,
        "{} of {counted} frames kept",
        kept.len()
    );
    // The server's SENDs, across both files: consecutive PSNs up to its last one.
    let me = xroce_core::wire::IpAddress::V4(rig.pair.ipv4(0).into());
    let psns: Vec<u32> = kept
        .iter()
        .map(|f| xroce_core::wire::RoceFrame::parse_ethernet(&f.data).expect("RoCEv2"))
        .filter(|f| {
            f.headers.ip.src_addr() == me
                && f.headers
                    .transport
                    .bth
                    .opcode
                    .info()
                    .is_some_and(|i| i.is_request())
        })
        .map(|f| f.headers.transport.bth.psn)
        .collect();
    assert!(psns.len() > 8, "{} SEND packets kept", psns.len());
    for pair in psns.windows(2) {
        assert_eq!(pair[1], (pair[0] + 1) & 0xff_ffff, "a gap in {psns:x?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// RoCEv2 over IPv6: GID 0 (the link-local address, the default GID, as with rdma_rxe) and a
/// global address's GID carry RC and UD traffic and perftest, data checked, and the frames on
/// the wire really are IPv6 from the chosen address (the client's capture says so), with
/// valid ICRCs.
#[test]
fn ipv6_gids_carry_roce_over_ipv6() {
    if !root_or_skip() {
        return;
    }
    let rig = Rig::with_ipv6("xv6", 1500);
    rig.wait_ipv6_ready();
    let global = rig.pair.ipv6(1).expect("the client's global IPv6 address");
    let link_local = rig.link_local(1);
    let global_gid = rig.gid_index(1, global);
    assert_eq!(
        rig.gid_index(0, rig.pair.ipv6(0).expect("server's IPv6")),
        global_gid,
        "both sides list their global address at the same GID index"
    );
    let g = global_gid.to_string();
    let runs: &[(&[&str], std::net::Ipv6Addr)] = &[
        (
            &["ibv_rc_pingpong", "-g", "0", "-c", "-n", "200"],
            link_local,
        ),
        (
            &["ibv_ud_pingpong", "-g", "0", "-c", "-n", "200"],
            link_local,
        ),
        (&["ibv_rc_pingpong", "-g", &g, "-c", "-n", "200"], global),
        (&["ib_write_bw", "-x", &g, "-n", "200"], global),
        (&["ib_read_lat", "-x", "0", "-n", "200"], link_local),
    ];
    let dir = std::env::temp_dir().join(format!("xroce-ipv6-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temporary directory");
    let capture = dir.join("client.pcap");
    for (args, source) in runs {
        let server_cmd = rig.exec(0, args);
        let server = std::thread::spawn(move || run_bounded(server_cmd, PROGRAM_TIMEOUT));
        rig.wait_listening();
        let ip = rig.pair.ipv4(0).to_string();
        let mut client_args = args.to_vec();
        client_args.push(&ip);
        let mut client_cmd = rig.exec(1, &client_args);
        client_cmd.env("XROCE_PCAP", &capture);
        let client = run_bounded(client_cmd, PROGRAM_TIMEOUT).expect("client");
        let server = server.join().expect("server thread").expect("server");
        assert!(
            server.status.success() && client.status.success(),
            "{args:?}:\n--- server: {server:?}\n--- client: {client:?}"
        );
        let frames = xroce_cli::capture::read_file(&capture)
            .unwrap_or_else(|e| panic!("{}: {e}", capture.display()));
        let mut sent = 0;
        let mine = std::net::IpAddr::V6(*source);
        for f in &frames {
            let (src, dst) = test_support::verified_roce_ends(&f.data)
                .unwrap_or_else(|e| panic!("{args:?}: {e}"));
            assert!(
                src == mine || dst == mine,
                "{args:?}: a frame from {src} to {dst}, not over {source}"
            );
            sent += usize::from(src == mine);
        }
        assert!(
            sent >= 200 && frames.len() > sent,
            "{args:?}: {} frames captured, {sent} sent",
            frames.len()
        );
        eprintln!(
            "{args:?}: {} IPv6 frames from and to {source}",
            frames.len()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

impl Rig {
    /// Waits until both sides have a link-local address past duplicate address detection: a
    /// tentative address answers no neighbour solicitation, so GID 0 would not resolve yet.
    fn wait_ipv6_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(15);
        for side in 0..2 {
            loop {
                let out = self.link_local_addresses(side);
                if test_support::link_local_in(&out).is_some() && !out.contains("tentative") {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "no usable link-local address after 15 s: {out:?}"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }

    /// `ip -6 -o addr show dev IF scope link` on `side`'s interface.
    fn link_local_addresses(&self, side: usize) -> String {
        let out = self
            .pair
            .exec(
                self.namespace(side),
                &format!(
                    "ip -6 -o addr show dev {} scope link",
                    self.pair.iface(side)
                ),
            )
            .expect("ip -6 addr");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The link-local IPv6 address of `side`'s interface.
    fn link_local(&self, side: usize) -> std::net::Ipv6Addr {
        let text = self.link_local_addresses(side);
        test_support::link_local_in(&text)
            .unwrap_or_else(|| panic!("no link-local address in {text:?}"))
    }

    /// The index of `address` in `side`'s GID table, as `ibv_devinfo -v` lists it.
    fn gid_index(&self, side: usize, address: std::net::Ipv6Addr) -> usize {
        let out = self.run(side, &["ibv_devinfo", "-v", "-d", DEV]);
        let text = String::from_utf8_lossy(&out.stdout);
        text.lines()
            .find_map(|l| {
                let (index, gid) = l.trim().strip_prefix("GID[")?.split_once("]:")?;
                let gid = gid
                    .trim()
                    .split(',')
                    .next()?
                    .parse::<std::net::Ipv6Addr>()
                    .ok()?;
                (gid == address).then(|| index.trim().parse().ok())?
            })
            .unwrap_or_else(|| panic!("{address} is not in the GID table:\n{text}"))
    }
}
