//! Helpers for the end-to-end tests of several crates: where cargo put the binaries they run,
//! compiling the small C verbs programs some of them use, reading the counters programs
//! leave in `XROCE_STATS_FILE`, and checking the frames of their captures.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::netlink::std_address;

/// `target/<profile>`, where cargo put the `xroce` binary, the provider library and the guest
/// agent (found from the running test executable, `target/<profile>/deps/NAME-HASH`).
pub fn build_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent()
        .and_then(|deps| deps.parent())
        .expect("test executable lives in target/<profile>/deps")
        .to_path_buf()
}

/// A workspace artifact in [`build_dir`]; fails the test, saying what to run, when it is not
/// built.
pub fn built(name: &str) -> PathBuf {
    let p = build_dir().join(name);
    assert!(
        p.exists(),
        "{} is missing; build the workspace first (cargo build --workspace)",
        p.display()
    );
    p
}

/// Compiles C program `source` against libibverbs (warnings are errors) into
/// `target/<profile>/c-tests/` and returns the executable.
pub fn compile_c(source: &Path) -> PathBuf {
    let name = source.file_stem().expect("a C source file name").to_owned();
    let dir = build_dir().join("c-tests");
    std::fs::create_dir_all(&dir).expect("create target/<profile>/c-tests");
    let exe = dir.join(name);
    let out = Command::new("cc")
        .args(["-O2", "-Wall", "-Wextra", "-Werror", "-pthread", "-o"])
        .arg(&exe)
        .arg(source)
        .arg("-libverbs")
        .output()
        .expect("run cc (install gcc and libibverbs-dev)");
    assert!(
        out.status.success(),
        "compiling {}:\n{}",
        source.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

/// The engine counters written to an `XROCE_STATS_FILE` (one line per engine:
/// `netdev=NAME pid=PID name=value ...`), summed over the engines that wrote them. An absent
/// file reads as no counters.
pub fn read_stats(path: &Path) -> BTreeMap<String, u64> {
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

/// `Udp: OutDatagrams` from the text of `/proc/net/snmp`: datagrams the kernel's UDP sockets
/// sent (a UDP GSO batch counts once).
pub fn udp_out_datagrams(snmp: &str) -> Option<u64> {
    let mut udp = snmp.lines().filter(|l| l.starts_with("Udp:"));
    let (names, values) = (udp.next()?, udp.next()?);
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .find(|(n, _)| *n == "OutDatagrams")
        .and_then(|(_, v)| v.parse().ok())
}

/// The IP source and destination of a captured RoCEv2 frame, once its ICRC and checksums
/// are checked; or why it is not a valid one.
pub fn verified_roce_ends(frame: &[u8]) -> Result<(IpAddr, IpAddr), String> {
    let frame = xroce_core::wire::RoceFrame::parse_ethernet(frame)
        .map_err(|e| format!("not a RoCEv2 frame: {e}"))?;
    frame
        .verify()
        .map_err(|e| format!("a RoCEv2 frame that does not verify: {e}"))?;
    let ip = &frame.headers.ip;
    Ok((std_address(ip.src_addr()), std_address(ip.dst_addr())))
}

/// The address in the output of `ip -6 -o addr show dev IF scope link`.
pub fn link_local_in(ip_output: &str) -> Option<Ipv6Addr> {
    ip_output
        .split_whitespace()
        .skip_while(|w| *w != "inet6")
        .nth(1)?
        .split('/')
        .next()?
        .parse()
        .ok()
}
