//! `cargo xtask rxe-peer up | run | status | down` as a user drives it: a lab with one rdma_rxe
//! guest and an attached namespace comes up, a command runs in the guest, and `down` leaves
//! no namespace and no qemu behind.
//!
//! Needs root; fails without it unless `XROCE_SKIP_ROOT_TESTS=1`. Uses the guest agent that
//! `cargo build --workspace` put in target/debug.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Duration;

use xroce_datapath::netns::{root_or_skip, run_bounded};

fn xtask(state: &std::path::Path, args: &[&str]) -> Output {
    let target = PathBuf::from(env!("CARGO_BIN_EXE_xtask"))
        .parent()
        .expect("target/<profile>")
        .to_path_buf();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_xtask"));
    cmd.args(args)
        .env("XROCE_RXE_PEER_STATE", state)
        .env("XROCE_GUEST_AGENT", target.join("xroce-guest-agent"));
    run_bounded(cmd, Duration::from_secs(300)).expect("run xtask")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn netns_exists(name: &str) -> bool {
    std::path::Path::new("/run/netns").join(name).exists()
}

#[test]
fn up_run_status_down() {
    if !root_or_skip() {
        return;
    }
    let state = std::env::temp_dir().join(format!("xroce-rxe-peer-state-{}", std::process::id()));
    let attach = format!("xrpc-{}", std::process::id());
    assert!(!netns_exists(&attach));

    let out = xtask(&state, &["rxe-peer", "run", "rxe1", "--", "true"]);
    assert!(
        !out.status.success() && text(&out).contains("no rxe-peer lab is running"),
        "{}",
        text(&out)
    );

    let status = xtask(&state, &["rxe-peer", "status"]);
    assert!(
        status.status.success() && text(&status).contains("no rxe-peer lab is running"),
        "{}",
        text(&status)
    );

    let up = xtask(
        &state,
        &["rxe-peer", "up", "--guests", "1", "--attach", &attach],
    );
    assert!(up.status.success(), "up: {}", text(&up));
    let record = std::fs::read_to_string(&state).expect("lab record");
    let lab_ns = record
        .lines()
        .find_map(|l| l.strip_prefix("ns "))
        .expect("namespace in the record")
        .to_string();
    let guard = Down(&state);
    assert!(netns_exists(&lab_ns) && netns_exists(&attach), "{record}");

    // A second lab is refused while one runs.
    let again = xtask(&state, &["rxe-peer", "up", "--guests", "1"]);
    assert!(
        !again.status.success() && text(&again).contains("already running"),
        "{}",
        text(&again)
    );

    let run = xtask(&state, &["rxe-peer", "run", "rxe1", "--", "ibv_devices"]);
    assert!(
        run.status.success() && String::from_utf8_lossy(&run.stdout).contains("rxe0"),
        "run: {}",
        text(&run)
    );
    // The command's status comes back as the exit status; a timeout is 124.
    let status = xtask(&state, &["rxe-peer", "run", "rxe1", "--", "exit", "3"]);
    assert_eq!(status.status.code(), Some(3), "{}", text(&status));
    let slow = xtask(
        &state,
        &[
            "rxe-peer",
            "run",
            "rxe1",
            "--timeout",
            "1",
            "--",
            "sleep",
            "30",
        ],
    );
    assert_eq!(slow.status.code(), Some(124), "{}", text(&slow));

    // The attached namespace reaches the guest over the bridge.
    let guest_ip = record
        .lines()
        .find_map(|l| l.strip_prefix("guest rxe1 "))
        .and_then(|l| l.split_whitespace().next())
        .expect("guest address")
        .to_string();
    let mut ping = Command::new("ip");
    ping.args([
        "netns", "exec", &attach, "ping", "-c", "1", "-W", "5", &guest_ip,
    ]);
    let ping = run_bounded(ping, Duration::from_secs(20)).expect("ping");
    assert!(ping.status.success(), "ping: {}", text(&ping));

    let status = xtask(&state, &["rxe-peer", "status"]);
    assert!(
        status.status.success()
            && text(&status).contains("guest rxe1")
            && !text(&status).contains("NOT RUNNING"),
        "{}",
        text(&status)
    );

    let pid: u32 = record
        .lines()
        .find_map(|l| l.strip_prefix("guest rxe1 "))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|p| p.parse().ok())
        .expect("qemu pid");
    drop(guard);
    assert!(!netns_exists(&lab_ns), "lab namespace left behind");
    assert!(!netns_exists(&attach), "created namespace left behind");
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "qemu {pid} still runs"
    );
    assert!(!state.exists(), "lab record left behind");
}

/// Runs `rxe-peer down` when dropped (also when an assertion failed).
struct Down<'a>(&'a std::path::Path);

impl Drop for Down<'_> {
    fn drop(&mut self) {
        let out = xtask(self.0, &["rxe-peer", "down"]);
        assert!(
            out.status.success() || std::thread::panicking(),
            "down: {}",
            text(&out)
        );
    }
}
