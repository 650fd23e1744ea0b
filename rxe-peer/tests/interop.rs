//! Interoperability with Linux's rdma_rxe: xroce in a network namespace on the same bridge as
//! rdma_rxe guests, unmodified rdma-core examples and perftest on both sides, in both
//! directions (xroce as server and as client).
//!
//! Needs root and the workspace built (`cargo build --workspace`: the `xroce` binary and the
//! provider library); fails without root unless `XROCE_SKIP_ROOT_TESTS=1`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Output as ProcOutput};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use xroce_datapath::netns::{root_or_skip, run_bounded};
use xroce_rxe_peer::{default_cache_dir, ensure_image, find_agent, Guest, GuestConfig, Lab};

/// Longest one program may run (the rxe side is an emulated CPU).
const PROGRAM_TIMEOUT: Duration = Duration::from_secs(180);
/// rdma-core examples and perftest listen on this TCP port by default.
const PORT: u16 = 18515;

static NS: AtomicU32 = AtomicU32::new(0);

/// One rig at a time: the guests are emulated CPUs and the machine has two cores.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// `target/<profile>`, where cargo put the xroce binary and the provider library.
fn build_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent()
        .and_then(|deps| deps.parent())
        .expect("test executable lives in target/<profile>/deps")
        .to_path_buf()
}

fn built(name: &str) -> PathBuf {
    let p = build_dir().join(name);
    assert!(
        p.exists(),
        "{} is missing; build the workspace first (cargo build --workspace)",
        p.display()
    );
    p
}

/// An rdma_rxe guest and xroce (device `xr0` on veth `xr0`) on one bridge.
struct Rig {
    xroce_ns: String,
    xroce_ip: std::net::Ipv4Addr,
    xroce: PathBuf,
    provider: PathBuf,
    stats: PathBuf,
    guest: Guest,
    // Dropped last: kills the guest and deletes the bridge namespace.
    _lab: Lab,
    _serial: std::sync::MutexGuard<'static, ()>,
}

impl Rig {
    fn new(prefix: &str, mtu: u32) -> Rig {
        let serial = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
        let image = ensure_image(&default_cache_dir(), &mut |m| eprintln!("{m}")).expect("image");
        let lab = Lab::new(prefix, mtu, image, find_agent().expect("agent")).expect("lab");
        let xroce_ns = format!(
            "{prefix}x-{}-{}",
            std::process::id(),
            NS.fetch_add(1, Ordering::Relaxed)
        );
        let st = Command::new("ip")
            .args(["netns", "add", &xroce_ns])
            .status()
            .expect("ip netns add");
        assert!(st.success());
        let xroce_ip = lab.attach_netns(&xroce_ns, "xr0", 100).expect("veth");
        let guest = lab
            .boot(GuestConfig::rxe("rxe", 10))
            .expect("boot rxe guest");
        let stats = std::env::temp_dir().join(format!("{xroce_ns}.stats"));
        let rig = Rig {
            xroce_ns,
            xroce_ip,
            xroce: built("xroce"),
            provider: built("libxroce_provider.so"),
            stats,
            guest,
            _lab: lab,
            _serial: serial,
        };
        let out = rig.xroce_cmd(&["link", "add", "xr0", "netdev", "xr0"]);
        assert!(
            out.status.success(),
            "xroce link add: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        rig
    }

    fn xroce_cmd(&self, args: &[&str]) -> ProcOutput {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.xroce_ns])
            .arg(&self.xroce)
            .args(args)
            .env("XROCE_PROVIDER", &self.provider);
        run_bounded(c, PROGRAM_TIMEOUT).expect("run xroce")
    }

    /// `xroce exec -- program...` in xroce's namespace.
    fn on_xroce(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.xroce_ns])
            .arg(&self.xroce)
            .arg("exec")
            .arg("--")
            .args(program.split_whitespace())
            .env("XROCE_PROVIDER", &self.provider)
            .env("XROCE_STATS_FILE", &self.stats);
        c
    }

    /// Runs `program` as the server on one side and `program <server ip>` as the client on
    /// the other; both must succeed. Returns (server output, client output).
    fn server_client(&self, program: &str, xroce_serves: bool) -> (String, String) {
        let text = |o: &ProcOutput| {
            format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            )
        };
        let (server, client) = if xroce_serves {
            let cmd = self.on_xroce(program);
            let server = std::thread::spawn(move || run_bounded(cmd, PROGRAM_TIMEOUT));
            self.wait_listening_xroce();
            let client = self
                .guest
                .run(&format!("{program} {}", self.xroce_ip), PROGRAM_TIMEOUT)
                .expect("guest client");
            let server = server.join().expect("server thread").expect("xroce server");
            (
                (server.status.success(), text(&server)),
                (client.success(), client.text()),
            )
        } else {
            let server = self.guest.spawn(program, PROGRAM_TIMEOUT);
            self.wait_listening_guest();
            let client = run_bounded(
                self.on_xroce(&format!("{program} {}", self.guest.ipv4())),
                PROGRAM_TIMEOUT,
            )
            .expect("xroce client");
            let server = server.wait().expect("guest server");
            (
                (server.success(), server.text()),
                (client.status.success(), text(&client)),
            )
        };
        assert!(
            server.0 && client.0,
            "{program} with xroce as {}:\n--- server:\n{}\n--- client:\n{}",
            if xroce_serves { "server" } else { "client" },
            server.1,
            client.1
        );
        (server.1, client.1)
    }

    fn wait_listening_xroce(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            let out = Command::new("ip")
                .args(["netns", "exec", &self.xroce_ns, "ss", "-Hltn"])
                .arg(format!("sport = :{PORT}"))
                .output()
                .expect("ss");
            if !String::from_utf8_lossy(&out.stdout).trim().is_empty() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the xroce side did not listen on {PORT} within 30 s");
    }

    fn wait_listening_guest(&self) {
        // /proc/net/tcp lists listening sockets (state 0A) with the port in hex.
        let probe = format!(
            "for i in $(seq 300); do grep -qi ':{PORT:04X} .* 0A ' /proc/net/tcp && exit 0; sleep 0.1; done; exit 1"
        );
        let out = self
            .guest
            .run(&probe, Duration::from_secs(40))
            .expect("probe");
        assert!(out.success(), "the guest did not listen on {PORT}");
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        let _ = self.xroce_cmd(&["link", "del", "xr0"]);
        let _ = Command::new("ip")
            .args(["netns", "del", &self.xroce_ns])
            .status();
        let _ = std::fs::remove_file(&self.stats);
    }
}

/// The engine counters the xroce side wrote (`XROCE_STATS_FILE`) since the file was last
/// removed, summed over the engines that wrote them.
fn read_stats(path: &std::path::Path) -> BTreeMap<String, u64> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut sum = BTreeMap::new();
    for line in text.lines() {
        for (k, v) in line.split_whitespace().filter_map(|f| f.split_once('=')) {
            if let Ok(v) = v.parse::<u64>() {
                *sum.entry(k.to_string()).or_insert(0) += v;
            }
        }
    }
    sum
}

fn delta(after: &BTreeMap<String, u64>, before: &BTreeMap<String, u64>, k: &str) -> u64 {
    after.get(k).copied().unwrap_or(0) - before.get(k).copied().unwrap_or(0)
}

impl Rig {
    /// Runs `program` both ways round and checks both sides' counters after each run: rdma_rxe
    /// saw no out-of-sequence request from xroce and NAKed none of its packets as out of
    /// sequence, xroce saw nothing malformed and no bad ICRC, and what each side counts as
    /// sent the other counts as received (within a few packets: a last ACK may reach a QP the
    /// other side has already destroyed).
    fn both_ways(&self, program: &str) {
        for xroce_serves in [true, false] {
            let _ = std::fs::remove_file(&self.stats);
            let before = self.guest.rxe_counters().expect("rxe counters");
            let (_, client) = self.server_client(program, xroce_serves);
            let after = self.guest.rxe_counters().expect("rxe counters");
            let x = read_stats(&self.stats);
            let d = |k: &str| delta(&after, &before, k);
            let xs = |k: &str| x.get(k).copied().unwrap_or(0);
            let what = format!(
                "{program} (xroce {}): rxe {:?} xroce {:?}",
                if xroce_serves { "server" } else { "client" },
                after
                    .keys()
                    .map(|k| (k.as_str(), d(k)))
                    .filter(|(_, v)| *v != 0)
                    .collect::<Vec<_>>(),
                x.iter().filter(|(_, v)| **v != 0).collect::<Vec<_>>()
            );
            assert!(xs("tx_frames") > 0, "no xroce counters: {what}");
            assert_eq!(d("out_of_seq_request"), 0, "{what}");
            assert_eq!(d("rcvd_seq_err"), 0, "{what}");
            assert_eq!(xs("bad_icrc") + xs("malformed"), 0, "{what}");
            assert_eq!(xs("seq_naks_received") + xs("seq_naks_sent"), 0, "{what}");
            // What one side sent, the other received: exactly, but for a few packets at the
            // end (a last ACK reaching a QP already destroyed) and for retransmissions a
            // sender's timer made after the receiving program had exited (the emulated rxe
            // guest is slow enough for its timer to fire spuriously, which the acceptance
            // allows). Never more received than sent.
            let agrees = |sent: u64, received: u64, sender_retries: u64| {
                received <= sent + 2 && sent - received.min(sent) <= 4 + 64 * sender_retries
            };
            assert!(
                agrees(xs("tx_frames"), d("rcvd_pkts"), xs("timeouts")),
                "rxe received {} of the {} frames xroce sent: {what}",
                d("rcvd_pkts"),
                xs("tx_frames")
            );
            assert!(
                agrees(d("sent_pkts"), xs("rx_frames"), d("completer_retry_err")),
                "xroce received {} of the {} packets rxe sent: {what}",
                xs("rx_frames"),
                d("sent_pkts")
            );
            eprintln!(
                "ok: {program} (xroce {}): {} out, {} in; retries: xroce {}, rxe {}; duplicates: xroce {}, rxe {}; {}",
                if xroce_serves { "serves" } else { "connects" },
                xs("tx_frames"),
                xs("rx_frames"),
                xs("timeouts"),
                d("completer_retry_err"),
                xs("duplicates"),
                d("duplicate_request"),
                client.lines().rev().find(|l| !l.trim().is_empty() && !l.starts_with('-')).unwrap_or("").trim()
            );
        }
    }

    /// rdma_rxe logged no bad ICRC (it drops such packets silently, with a rate-limited
    /// kernel message).
    fn assert_no_icrc_errors(&self) {
        let out = self
            .guest
            .run("dmesg", Duration::from_secs(30))
            .expect("dmesg");
        assert!(
            !out.stdout.to_lowercase().contains("icrc"),
            "rdma_rxe reported ICRC errors:\n{}",
            out.stdout
        );
    }
}

/// Every program of the acceptance list, both ways, at one netdev MTU.
fn programs_at(mtu: u32) {
    if !root_or_skip() {
        return;
    }
    let rig = Rig::new(&format!("xri{mtu}"), mtu);
    for program in [
        "ibv_rc_pingpong -g 1 -s 1 -n 1000",
        "ibv_rc_pingpong -g 1 -s 64 -n 1000",
        "ibv_rc_pingpong -g 1 -s 4096 -n 1000",
        "ibv_rc_pingpong -g 1 -s 65536 -n 1000",
        "ibv_rc_pingpong -g 1 -e -n 1000",
        "ibv_uc_pingpong -g 1",
        "ibv_ud_pingpong -g 1",
        "ibv_srq_pingpong -g 1",
        "ib_send_bw",
        "ib_write_bw",
        "ib_read_bw",
        "ib_atomic_bw",
        "ib_send_lat",
        "ib_write_lat",
        "ib_read_lat",
        "ib_atomic_lat",
    ] {
        rig.both_ways(program);
    }
    rig.assert_no_icrc_errors();
}

#[test]
fn programs_interoperate_at_mtu_1500() {
    programs_at(1500);
}

#[test]
fn programs_interoperate_at_mtu_9000() {
    programs_at(9000);
}
