//! Ctrl-C during a benchmark: the benchmark removes its namespaces (and the XDP pins in them)
//! before it exits, and says so.

use std::os::unix::fs::MetadataExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use xroce_datapath::netns::root_or_skip;

fn signal_group(pgid: u32, signal: libc::c_int) {
    // SAFETY: kill has no memory effects; the group is the benchmark this test started.
    unsafe {
        libc::kill(-(pgid as libc::pid_t), signal);
    }
}

#[test]
fn an_interrupted_benchmark_removes_its_namespaces() {
    if !root_or_skip() {
        return;
    }
    let log_path = std::env::temp_dir().join(format!(
        "xroce-interrupted-bench-{}.log",
        std::process::id()
    ));
    let log = std::fs::File::create(&log_path).expect("log file");
    // Its own process group, which the test interrupts as a terminal's Ctrl-C would.
    let mut bench = Command::new(env!("CARGO_BIN_EXE_datapath"))
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log file"))
        .stderr(log)
        .process_group(0)
        .spawn()
        .expect("start the datapath benchmark");
    let pid = bench.id();
    let names = [0, 1].map(|side| format!("xrbench-{pid}-0-{side}"));
    let ns_path = |side: usize| format!("/run/netns/{}", names[side]);
    // Set up means: both namespaces exist and the XDP program is pinned in both.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut pins = Vec::new();
    while Instant::now() < deadline && pins.len() < 2 {
        pins = (0..2)
            .filter_map(|side| std::fs::metadata(ns_path(side)).ok())
            .map(|ns| format!("/sys/fs/bpf/xroce/{}", ns.ino()))
            .filter(|dir| Path::new(dir).exists())
            .collect();
        if bench.try_wait().ok().flatten().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let set_up = pins.len() == 2;
    if set_up {
        std::thread::sleep(Duration::from_millis(500));
        signal_group(pid, libc::SIGINT);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        match bench.try_wait() {
            Ok(Some(status)) => break Some(status),
            _ if Instant::now() >= deadline => break None,
            _ => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    if status.is_none() {
        signal_group(pid, libc::SIGKILL);
        let _ = bench.wait();
    }
    let left: Vec<String> = (0..2)
        .filter(|side| Path::new(&ns_path(*side)).exists())
        .map(|side| names[side].clone())
        .collect();
    let pins_left: Vec<&String> = pins.iter().filter(|dir| Path::new(dir).exists()).collect();
    for name in &left {
        let _ = Command::new("ip").args(["netns", "del", name]).status();
    }
    let printed = std::fs::read_to_string(&log_path).unwrap_or_default();
    let _ = std::fs::remove_file(&log_path);
    assert!(
        set_up,
        "the benchmark set up its namespaces and XDP; it printed:\n{printed}"
    );
    let status = status.unwrap_or_else(|| {
        panic!("the benchmark ended within 60 s of Ctrl-C; it printed:\n{printed}")
    });
    assert_eq!(
        (status.code(), status.signal()),
        (Some(128 + libc::SIGINT), None),
        "it exited 130 after cleaning up; it printed:\n{printed}"
    );
    assert!(
        left.is_empty(),
        "namespaces left: {left:?}; it printed:\n{printed}"
    );
    assert!(pins_left.is_empty(), "pins left: {pins_left:?}");
    assert!(
        printed.contains("interrupted") && printed.contains(&names[0]),
        "it said what it removed:\n{printed}"
    );
}
