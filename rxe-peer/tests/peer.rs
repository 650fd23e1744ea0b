//! The harness end to end: the image builds, two rdma_rxe guests boot in parallel, real
//! `ibv_rc_pingpong` runs between them, rxe's counters read back, the remedies for a guest
//! whose network stopped (a link bounce, a new boot) leave it working, a guest whose kernel
//! panics is told and booted again (and its peer's program stopped), and a killed guest is
//! gone.
//!
//! Needs root; fails without it unless `XROCE_SKIP_ROOT_TESTS=1`.

use std::time::{Duration, Instant};

use xroce_datapath::netns::{remove_orphaned_namespaces, root_or_skip};
use xroce_rxe_peer::{
    default_cache_dir, ensure_image, find_agent, run_pair, Guest, GuestConfig, Lab, Output,
    Recovery,
};

/// `ibv_rc_pingpong` with `iterations` between the first guest (server) and the second;
/// returns the client's output and the server's.
fn ping_pong(guests: &[Guest], iterations: u32) -> (Output, Output) {
    let command = format!("ibv_rc_pingpong -d rxe0 -g 1 -n {iterations}");
    let server = guests[0].spawn(&command, Duration::from_secs(120));
    // ibv_rc_pingpong's default port.
    if let Err(why) = guests[0].wait_listening(18515) {
        panic!("{why}; server: {:?}", server.wait());
    }
    let client = guests[1]
        .run(
            &format!("{command} {}", guests[0].ipv4()),
            Duration::from_secs(120),
        )
        .expect("client");
    (client, server.wait().expect("server"))
}

/// Waits, for at most 30 s (a guest under emulation on a busy host is slow), until `file`
/// exists in the guest.
fn file_appears(guest: &Guest, file: &str) -> Result<(), String> {
    let out = guest
        .run(
            &format!("for i in $(seq 300); do test -e {file} && exit 0; sleep 0.1; done; exit 1"),
            Duration::from_secs(40),
        )
        .map_err(|e| e.to_string())?;
    if out.success() {
        Ok(())
    } else {
        Err(format!("{file} did not appear in guest {}", guest.name()))
    }
}

/// Ten turns of [`ping_pong`] succeed on both sides.
fn ping_pong_works(guests: &[Guest], when: &str) {
    let (client, server) = ping_pong(guests, 10);
    assert!(
        client.success() && server.success(),
        "{when}: client: {}\nserver: {}",
        client.text(),
        server.text()
    );
}

#[test]
fn two_rxe_guests_ping_pong() {
    if !root_or_skip() {
        return;
    }
    let image = ensure_image(&default_cache_dir(), &mut |m| eprintln!("{m}")).expect("image");
    let agent = find_agent().expect("agent");
    remove_orphaned_namespaces("xrpeer");
    let lab = Lab::new("xrpeer", 1500, image, agent).expect("lab");
    let t = Instant::now();
    let guests = lab
        .boot_all(vec![
            GuestConfig::rxe("rxe-a", 10),
            GuestConfig::rxe("rxe-b", 11),
        ])
        .expect("boot");
    eprintln!(
        "booted 2 guests in {:.1} s ({})",
        t.elapsed().as_secs_f64(),
        guests[0].accelerator()
    );

    let dev = guests[0]
        .run("ibv_devices; rdma link", Duration::from_secs(20))
        .expect("ibv_devices");
    assert!(
        dev.success() && dev.stdout.contains("rxe0"),
        "{}",
        dev.text()
    );

    let (client, server) = ping_pong(&guests, 100);
    assert!(client.success(), "client: {}", client.text());
    assert!(server.success(), "server: {}", server.text());
    assert!(client.text().contains("100 iters"), "{}", client.text());

    let counters = guests[0].rxe_counters().expect("counters");
    assert!(
        counters.get("sent_pkts").copied().unwrap_or(0) >= 100
            && counters.get("rcvd_pkts").copied().unwrap_or(0) >= 100,
        "{counters:?}"
    );

    // The harness's remedy for a guest whose network device got stuck in qemu: the link
    // goes down and up through qemu's monitor (the guest sees its carrier change twice), and
    // afterwards the guests exchange RDMA traffic again.
    let carrier_changes = |g: &Guest| {
        g.run(
            "cat /sys/class/net/eth0/carrier_changes",
            Duration::from_secs(20),
        )
        .expect("carrier changes")
        .stdout
        .trim()
        .parse::<u64>()
        .expect("a count")
    };
    let changes_before = carrier_changes(&guests[0]);
    guests[0]
        .recover_from_transmit_stall()
        .expect("bounce the link and wait for the agent");
    assert!(
        carrier_changes(&guests[0]) >= changes_before + 2,
        "the guest saw its link go down and up"
    );
    ping_pong_works(&guests, "after the bounce");

    // What a stalled run leaves behind is killed by its executable's name: a server that
    // waits for a client that never comes ends at once.
    let waiting = guests[0].spawn(
        "ibv_rc_pingpong -d rxe0 -g 1 -n 10",
        Duration::from_secs(60),
    );
    std::thread::sleep(Duration::from_secs(2));
    assert!(!waiting.is_finished(), "the server waits for its client");
    guests[0]
        .kill_programs(&["ib_write_bw", "ibv_rc_pingpong"])
        .expect("kill the server");
    let waited = waiting.wait().expect("the killed server's result");
    assert!(
        !waited.success() && waited.status != xroce_rxe_peer::protocol::TIMED_OUT,
        "the server was killed, not timed out: {}",
        waited.text()
    );
    let report = guests[0].report();
    assert!(
        report.contains(") runs; ") && report.lines().count() > 3,
        "the report says qemu runs and shows the console: {report}"
    );

    // What qemu says of a running guest, for the report on one that stopped answering.
    let state = guests[0].vm_state();
    assert!(
        state.contains("VM status: running")
            && state.contains("RIP=")
            && state.contains("transmit queue:\n")
            && state.matches("last_avail_idx").count() == 2
            && state.matches("guest's avail idx:").count() == 2
            && !state.contains("unknown"),
        "qemu's view of the guest: {state}"
    );

    // The last resort for a guest a link bounce does not revive (here one whose vCPU was
    // stopped, as if its kernel had hung): it boots again as it was, with rdma_rxe, and the
    // pair exchanges RDMA traffic again.
    guests[0].pause().expect("pause");
    assert!(
        !guests[0].answers(Duration::from_secs(2)),
        "a paused guest answers"
    );
    assert!(
        guests[0].vm_state().contains("VM status: paused"),
        "qemu's view of a paused guest: {}",
        guests[0].vm_state()
    );
    let old_qemu = guests[0].pid();
    let how = guests[0].recover(&lab).expect("recover by restarting");
    assert!(
        matches!(&how, Recovery::Restarted(why) if why.contains("VM status: paused")),
        "the link bounce was not enough, and the report says why: {how:?}"
    );
    assert_ne!(guests[0].pid(), old_qemu, "a new qemu");
    assert!(guests[0].is_running());
    ping_pong_works(&guests, "after the restart");

    // A guest whose kernel panics (here on purpose, through sysrq) ends its qemu; the harness
    // tells that from a guest that stopped answering, shows the kernel's last words, and boots
    // it again.
    assert!(!guests[0].kernel_panicked(), "a running guest panicked");
    // A command under way when the kernel panics is not waited on for its whole time: its
    // wait sees the qemu end. Its peer in the other guest, which would wait for it, is killed
    // rather than waited on (`run_pair`, as the benchmark runs perftest between guests).
    let pair = std::thread::scope(|s| {
        let pair = s.spawn(|| {
            run_pair(
                [&guests[0], &guests[1]],
                [
                    ": > /tmp/under-way && sleep 120",
                    ": > /tmp/peer-under-way && sleep 119",
                ],
                Duration::from_secs(120),
                || file_appears(&guests[0], "/tmp/under-way"),
                &["sleep"],
            )
        });
        file_appears(&guests[1], "/tmp/peer-under-way").expect("the peer's command started");
        let _crash = guests[0].spawn("echo c > /proc/sysrq-trigger", Duration::from_secs(5));
        let deadline = Instant::now() + Duration::from_secs(60);
        while !guests[0].kernel_panicked() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(200));
        }
        pair.join().expect("run_pair panicked")
    })
    .expect("the command under way started");
    let report = guests[0].report();
    assert!(
        guests[0].kernel_panicked()
            && report.contains(") has ended;")
            && report.contains("Kernel panic - not syncing"),
        "the crashed guest's report: {report}"
    );
    match pair.first {
        Err(e) if e.to_string().contains("qemu ended while the command ran") => {}
        Err(e) => panic!("the command under way ended otherwise: {e}"),
        Ok(out) => panic!("the command under way finished: {}", out.text()),
    }
    let peer = pair.second.expect("the peer's result");
    assert!(
        !peer.success() && peer.status != xroce_rxe_peer::protocol::TIMED_OUT,
        "the peer of the crashed guest was killed, not waited on: status {}, {}",
        peer.status,
        peer.text()
    );
    guests[0]
        .restart(&lab)
        .expect("boot the crashed guest again");
    assert!(!guests[0].kernel_panicked(), "the guest booted again");
    ping_pong_works(&guests, "after the panic and the restart");

    // Timeouts are real: a command running past its bound is stopped.
    let slow = guests[1]
        .run("sleep 30", Duration::from_secs(1))
        .expect("slow");
    assert_eq!(slow.status, xroce_rxe_peer::protocol::TIMED_OUT);

    assert!(
        guests[1].answers(Duration::from_secs(15)),
        "a running guest answers"
    );
    guests[1].kill();
    assert!(!guests[1].is_running());
    assert!(
        !guests[1].answers(Duration::from_secs(2)),
        "a killed guest still answers"
    );
}

#[test]
#[ignore]
fn explore_rxe_rxe_retries() {
    let image = ensure_image(&default_cache_dir(), &mut |m| eprintln!("{m}")).expect("image");
    let lab = Lab::new("xrpx", 1500, image, find_agent().unwrap()).unwrap();
    let g = lab
        .boot_all(vec![
            GuestConfig::rxe("rxe-a", 10),
            GuestConfig::rxe("rxe-b", 11),
        ])
        .unwrap();
    for size in [4096, 65536] {
        let b0 = g[0].rxe_counters().unwrap();
        let b1 = g[1].rxe_counters().unwrap();
        let s = g[0].spawn(
            &format!("ibv_rc_pingpong -g 1 -s {size} -n 300"),
            Duration::from_secs(300),
        );
        std::thread::sleep(Duration::from_secs(2));
        let c = g[1]
            .run(
                &format!("ibv_rc_pingpong -g 1 -s {size} -n 300 {}", g[0].ipv4()),
                Duration::from_secs(300),
            )
            .unwrap();
        let _ = s.wait();
        let a0 = g[0].rxe_counters().unwrap();
        let a1 = g[1].rxe_counters().unwrap();
        eprintln!(
            "size {size}: {} | retries a {} b {} dup a {} b {}",
            c.stdout.lines().last().unwrap_or(""),
            a0["completer_retry_err"] - b0["completer_retry_err"],
            a1["completer_retry_err"] - b1["completer_retry_err"],
            a0["duplicate_request"] - b0["duplicate_request"],
            a1["duplicate_request"] - b1["duplicate_request"]
        );
    }
}
