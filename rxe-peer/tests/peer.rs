//! The harness end to end: the image builds, two rdma_rxe guests boot in parallel, real
//! `ibv_rc_pingpong` runs between them, rxe's counters read back, and a killed guest is gone.
//!
//! Needs root; fails without it unless `XROCE_SKIP_ROOT_TESTS=1`.

use std::time::{Duration, Instant};

use xroce_datapath::netns::root_or_skip;
use xroce_rxe_peer::{default_cache_dir, ensure_image, find_agent, GuestConfig, Lab};

#[test]
fn two_rxe_guests_ping_pong() {
    if !root_or_skip() {
        return;
    }
    let image = ensure_image(&default_cache_dir(), &mut |m| eprintln!("{m}")).expect("image");
    let agent = find_agent().expect("agent");
    let lab = Lab::new("xrpeer", 1500, image, agent).expect("lab");
    let t = Instant::now();
    let mut guests = lab
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

    let server = guests[0].spawn(
        "ibv_rc_pingpong -d rxe0 -g 1 -n 100",
        Duration::from_secs(120),
    );
    std::thread::sleep(Duration::from_secs(1));
    let client = guests[1]
        .run(
            &format!("ibv_rc_pingpong -d rxe0 -g 1 -n 100 {}", guests[0].ipv4()),
            Duration::from_secs(120),
        )
        .expect("client");
    let server = server.wait().expect("server");
    assert!(client.success(), "client: {}", client.text());
    assert!(server.success(), "server: {}", server.text());
    assert!(client.text().contains("100 iters"), "{}", client.text());

    let counters = guests[0].rxe_counters().expect("counters");
    assert!(
        counters.get("sent_pkts").copied().unwrap_or(0) >= 100
            && counters.get("rcvd_pkts").copied().unwrap_or(0) >= 100,
        "{counters:?}"
    );

    // Timeouts are real: a command running past its bound is stopped.
    let slow = guests[1]
        .run("sleep 30", Duration::from_secs(1))
        .expect("slow");
    assert_eq!(slow.status, xroce_rxe_peer::protocol::TIMED_OUT);

    guests[1].kill();
    assert!(!guests[1].is_running());
    assert!(
        guests[1].run("true", Duration::from_secs(2)).is_err(),
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
