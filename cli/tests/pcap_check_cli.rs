//! `xroce pcap check` as a user runs it: the real binary on real captures.

use std::process::{Command, Output};

use xroce_tests::{fixture_frames, fixture_path, pcap_bytes, pcapng_bytes, RXE_CAPTURES};

fn xroce(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_xroce"))
        .args(args)
        .output()
        .expect("run xroce")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn summary_line(o: &Output) -> String {
    stdout(o)
        .lines()
        .rfind(|l| l.contains(" packets, "))
        .unwrap_or_default()
        .to_string()
}

fn tmp(name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("xroce-pcap-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn every_rxe_capture_verifies_with_the_right_counts() {
    for name in RXE_CAPTURES {
        let path = fixture_path(name);
        let n = fixture_frames(name).len();
        let o = xroce(&["pcap", "check", path.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(0), "{name}: {}", stdout(&o));
        assert_eq!(
            summary_line(&o),
            format!("{n} packets, {n} ICRC ok, 0 bad, 0 not RoCEv2"),
            "{name}"
        );
        // One decoded line per packet.
        assert_eq!(stdout(&o).lines().filter(|l| l.starts_with('#')).count(), n);
    }
}

#[test]
fn decoded_lines_show_the_extension_headers() {
    let out = |name: &str| {
        stdout(&xroce(&[
            "pcap",
            "check",
            fixture_path(name).to_str().unwrap(),
        ]))
    };
    let write = out("ib_write_bw.pcap");
    assert!(write.contains("RC_RDMA_WRITE_FIRST qpn="), "{write}");
    assert!(write.contains(" reth(va=0x"), "{write}");
    assert!(write.contains(" psn=0x"));
    let ud = out("ud_pingpong.pcap");
    assert!(ud.contains("UD_SEND_ONLY"));
    assert!(ud.contains("deth(qkey=0x11111111 src_qp="), "{ud}");
    let rc = out("rc_pingpong.pcap");
    assert!(rc.contains("RC_ACKNOWLEDGE"));
    assert!(rc.contains("aeth(ACK credits=31 msn="), "{rc}");
    assert!(rc.contains(" ackreq"));
    assert!(rc.contains(":4791 "));
}

#[test]
fn a_corrupted_packet_is_named_and_exits_1() {
    let mut frames = fixture_frames("rc_pingpong.pcap");
    frames.truncate(5);
    let last = frames[2].len() - 5;
    frames[2][last] ^= 0x40; // a payload/pad byte before the ICRC
    let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
    let p = tmp("corrupt.pcap", &pcap_bytes(&refs));
    let o = xroce(&["pcap", "check", p.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        summary_line(&o),
        "5 packets, 4 ICRC ok, 1 bad, 0 not RoCEv2"
    );
    let s = stdout(&o);
    assert!(s.contains("ICRC BAD"), "{s}");
    assert!(s.contains("1 bad RoCEv2 packet(s): #3"), "{s}");
    // --quiet prints only the bad packet and the summary.
    let q = xroce(&["pcap", "check", "--quiet", p.to_str().unwrap()]);
    assert_eq!(stdout(&q).lines().filter(|l| l.starts_with('#')).count(), 1);
}

#[test]
fn non_roce_packets_are_counted_not_errors() {
    let mut frames = fixture_frames("ud_pingpong.pcap");
    frames.truncate(3);
    let mut arp = vec![0xffu8; 6];
    arp.extend([2, 0, 0, 0, 0, 1, 0x08, 0x06]);
    arp.extend([0u8; 46]);
    let mut other_udp = frames[0].clone();
    other_udp[36..38].copy_from_slice(&53u16.to_be_bytes());
    let mut refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
    refs.push(&arp);
    refs.push(&other_udp);
    let p = tmp("mixed.pcap", &pcap_bytes(&refs));
    let o = xroce(&["pcap", "check", p.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
    assert_eq!(
        summary_line(&o),
        "5 packets, 3 ICRC ok, 0 bad, 2 not RoCEv2"
    );
}

/// A capture without RoCEv2 (tcpdump on the interface xroce runs on sees none of its frames)
/// verifies nothing, and says so with its own exit status instead of passing.
#[test]
fn a_capture_without_roce_packets_is_not_a_pass() {
    let frames = fixture_frames("ud_pingpong.pcap");
    let mut arp = vec![0xffu8; 6];
    arp.extend([2, 0, 0, 0, 0, 1, 0x08, 0x06]);
    arp.extend([0u8; 46]);
    let mut other_udp = frames[0].clone();
    other_udp[36..38].copy_from_slice(&53u16.to_be_bytes());
    let p = tmp("no-roce.pcap", &pcap_bytes(&[&arp, &other_udp]));
    let o = xroce(&["pcap", "check", p.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(3), "{}", stdout(&o));
    assert_eq!(
        summary_line(&o),
        "2 packets, 0 ICRC ok, 0 bad, 2 not RoCEv2"
    );
    let why = String::from_utf8_lossy(&o.stderr);
    assert!(
        why.contains("nothing was verified") && why.contains("XROCE_PCAP"),
        "{why}"
    );
    let empty = tmp("empty.pcap", &pcap_bytes(&[]));
    let o = xroce(&["pcap", "check", empty.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(3), "{}", stdout(&o));
}

#[test]
fn pcapng_files_are_read_with_their_timestamp_resolution() {
    let frames = fixture_frames("rc_pingpong.pcap");
    // Default resolution (microseconds): 1.5 s after the first packet.
    let p = tmp(
        "us.pcapng",
        &pcapng_bytes(&[(1_000_000, &frames[0]), (2_500_000, &frames[1])], None),
    );
    let o = xroce(&["pcap", "check", p.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
    assert_eq!(
        summary_line(&o),
        "2 packets, 2 ICRC ok, 0 bad, 0 not RoCEv2"
    );
    assert!(stdout(&o).contains(" 1.500000 "), "{}", stdout(&o));
    // Nanosecond resolution (if_tsresol 9): 0.25 s.
    let p = tmp(
        "ns.pcapng",
        &pcapng_bytes(&[(0, &frames[0]), (250_000_000, &frames[1])], Some(9)),
    );
    let o = xroce(&["pcap", "check", p.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
    assert!(stdout(&o).contains(" 0.250000 "), "{}", stdout(&o));
    // Power-of-two resolution (if_tsresol 0x80 | 20: 2^20 units per second): 0.5 s.
    let p = tmp(
        "pow2.pcapng",
        &pcapng_bytes(&[(0, &frames[0]), (1 << 19, &frames[1])], Some(0x80 | 20)),
    );
    let o = xroce(&["pcap", "check", p.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
    assert!(stdout(&o).contains(" 0.500000 "), "{}", stdout(&o));
}

#[test]
fn unreadable_input_exits_2() {
    let garbage = tmp(
        "garbage.pcap",
        b"this is not a capture file at all, not even close",
    );
    let o = xroce(&["pcap", "check", garbage.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not a pcap or pcapng file"));

    // Nothing was read from it, so no count line claims "0 packets" for it.
    assert!(!stdout(&o).contains("packets"), "{}", stdout(&o));

    let o = xroce(&["pcap", "check", "/nonexistent/capture.pcap"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("cannot open"));

    let dir = std::env::temp_dir();
    let o = xroce(&["pcap", "check", dir.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("is a directory"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );

    // A file cut in the middle of a record: packets before the cut are still reported.
    let frames = fixture_frames("rc_pingpong.pcap");
    let refs: Vec<&[u8]> = frames.iter().take(3).map(Vec::as_slice).collect();
    let bytes = pcap_bytes(&refs);
    let cut = tmp("cut.pcap", &bytes[..bytes.len() - 10]);
    let o = xroce(&["pcap", "check", cut.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        summary_line(&o),
        "2 packets, 2 ICRC ok, 0 bad, 0 not RoCEv2"
    );
    assert!(String::from_utf8_lossy(&o.stderr).contains("truncated"));
}

#[test]
fn several_files_get_a_total_and_the_worst_status() {
    let a = fixture_path("ud_pingpong.pcap");
    let b = fixture_path("rc_pingpong.pcap");
    let n = fixture_frames("ud_pingpong.pcap").len() + fixture_frames("rc_pingpong.pcap").len();
    let o = xroce(&["pcap", "check", a.to_str().unwrap(), b.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0));
    assert!(stdout(&o).contains(&format!(
        "total: {n} packets, {n} ICRC ok, 0 bad, 0 not RoCEv2"
    )));
    let o = xroce(&["pcap", "check", a.to_str().unwrap(), "/nonexistent.pcap"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn help_explains_the_command() {
    let o = xroce(&["pcap", "check", "--help"]);
    assert_eq!(o.status.code(), Some(0));
    let s = stdout(&o);
    assert!(s.contains("Exit status"), "{s}");
    assert!(s.contains("not RoCEv2"));
    // No file is a usage error, not a silent success.
    let o = xroce(&["pcap", "check"]);
    assert_eq!(
        o.status.code(),
        Some(2),
        "clap reports usage errors with status 2"
    );
    assert!(String::from_utf8_lossy(&o.stderr).contains("<FILE>"));
}

/// `xroce pcap check FILE | head`: the pipe closes under the checker.
fn check_with_the_reader_gone(file: &std::path::Path) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_xroce"))
        .args(["pcap", "check"])
        .arg(file)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run xroce");
    drop(child.stdout.take());
    child.wait_with_output().expect("wait")
}

#[test]
fn a_reader_that_stops_reading_ends_the_check_quietly() {
    let out = check_with_the_reader_gone(&fixture_path("ib_write_bw.pcap"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.is_empty(), "{stderr}");
    assert_eq!(out.status.code(), Some(0));

    // The status still counts what was not printed: a bad last packet makes it 1 (the pipe
    // closes before the checker reaches it).
    let mut frames = fixture_frames("ib_write_bw.pcap");
    let bad = frames.len() - 1;
    let at = frames[bad].len() - 5;
    frames[bad][at] ^= 0x40;
    let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
    let p = tmp("bad-late.pcap", &pcap_bytes(&refs));
    let out = check_with_the_reader_gone(&p);
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(1));
}
