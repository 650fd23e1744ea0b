//! `cargo xtask bench`: the performance suite. perftest over xroce between two network
//! namespaces on a veth pair, next to raw AF_XDP, kernel UDP and kernel TCP doing the same
//! exchanges on the same pair in the same run, and rdma_rxe↔rdma_rxe next to xroce↔xroce in
//! identical QEMU guests. Writes a Markdown table and an SVG plot. The goals that compare
//! xroce with raw AF_XDP are measured in back-to-back rounds (`xroce_bench::paired`).
//!
//! Usage: suite [--quick] [--no-guests] [--out DIR]   (root; run by `cargo xtask bench`)
//!   --quick      fewer sizes, shorter runs, no guests: a quick look while optimising
//!   --no-guests  skip the QEMU comparison
//!   --out DIR    where perf.md and perf.svg go (default bench/results)
//! The `xroce` binary, the provider and the guest agent are taken from the directory of this
//! executable (target/release when run by `cargo xtask bench`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use xroce_bench::baseline::{self, RoundTrip, Sink};
use xroce_bench::paired::{self, Paired};
use xroce_bench::perftest::{parse_bw, parse_lat, BwLine, LatLine, Run, XrocePair, DEV};
use xroce_bench::report::{number, size_text, Goal, Kind, Report, Row};
use xroce_bench::{guests, plot};
use xroce_datapath::afxdp;
use xroce_rxe_peer::GuestKernel;

struct Options {
    quick: bool,
    guests: bool,
    out: PathBuf,
}

fn options() -> Options {
    let mut o = Options {
        quick: false,
        guests: true,
        out: PathBuf::from("bench/results"),
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--quick" => {
                o.quick = true;
                o.guests = false;
            }
            "--no-guests" => o.guests = false,
            "--out" => match args.next() {
                Some(d) => o.out = PathBuf::from(d),
                None => usage("--out needs a directory"),
            },
            "-h" | "--help" => {
                println!("usage: suite [--quick] [--no-guests] [--out DIR]");
                std::process::exit(0);
            }
            other => usage(&format!("unknown argument {other:?}")),
        }
    }
    o
}

fn usage(why: &str) -> ! {
    eprintln!("suite: {why}\nusage: suite [--quick] [--no-guests] [--out DIR]");
    std::process::exit(2);
}

/// Progress on stderr, with the time since the start.
struct Progress(Instant);

impl Progress {
    fn say(&self, what: &str) {
        eprintln!("[{:6.1} s] {what}", self.0.elapsed().as_secs_f64());
    }
}

const LAT: &str = "Latency, path MTU 4096 (netdev MTU 9000)";
const BW4096: &str = "Bandwidth, path MTU 4096 (netdev MTU 9000)";
const BW1024: &str = "Bandwidth, path MTU 1024 (netdev MTU 1500)";
const RATE: &str = "Message rate, 64 B messages";
const SCALE: &str = "Scale: ib_write_bw 64 KiB with many QPs, path MTU 4096";
const CPU: &str = "CPU cost of streaming";
const IDLE: &str = "Idle CPU with connected QPs";
const MEMORY: &str = "Resident memory of an xroce process";
const GUESTS: &str = "Identical QEMU guests (TCG, 1 vCPU each)";
/// The guests' kernels, each compared in guests of its own: Debian 13's (the rdma_rxe of the
/// current Debian release) and Debian 12's (an older rdma_rxe, this machine's release).
/// rdma_rxe is the kernel's own code, and it changed between the two (6.12's runs its packet work on a workqueue, 6.1's in tasklets), so one
/// kernel alone would not say how xroce compares with what users run.
const GUEST_KERNELS: [GuestKernel; 2] = [GuestKernel::Debian13, GuestKernel::Debian12];

fn main() {
    run();
    // Not `return`: a clean-up after Ctrl-C, under way on another thread, must end first.
    xroce_bench::interrupt::exit(0);
}

fn run() {
    // The loader's warnings (and `XROCE_LOG`'s more) reach stderr.
    xroce_datapath::stderr_log::install();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("suite: needs root (network namespaces, XDP)");
        std::process::exit(1);
    }
    xroce_bench::interrupt::remove_namespaces_when_interrupted("suite");
    let opts = options();
    let p = Progress(Instant::now());
    let bin_dir = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| PathBuf::from("target/release"));
    let mut r = Report {
        machine: machine(),
        commit: std::env::var("XROCE_COMMIT").unwrap_or_else(|_| "unknown".into()),
        date: capture("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
        ..Report::default()
    };
    let secs = if opts.quick { 1 } else { 3 };
    let stream_for = Duration::from_secs(secs);
    let pings = if opts.quick { 5_000 } else { 20_000 };

    // ---------------------------------------------------------------- netdev MTU 9000
    p.say("namespaces at MTU 9000 with an xroce device on each end");
    let x = XrocePair::new(xroce_bench::interrupt::NAMESPACE_PREFIX, 9000, &bin_dir)
        .unwrap_or_else(|e| fail("set-up", e));
    let _ = x
        .pair
        .exec(0, &format!("ping -c 1 -W 1 {}", x.pair.ipv4(1)));

    p.say("baselines: kernel UDP and TCP");
    let tcp_rt = baseline::tcp_pingpong(&x.pair, 64, pings);
    let udp_4k = baseline::udp_stream(&x.pair, 4096, stream_for);
    let tcp_64k = baseline::tcp_stream(&x.pair, 65536, stream_for);
    let udp_64 = baseline::udp_stream(&x.pair, 64, stream_for);

    let lat_iters = 10_000 / if opts.quick { 5 } else { 1 };
    let rounds = if opts.quick { QUICK_ROUNDS } else { ROUNDS };
    let b2b = back_to_back(&x, &mut r, rounds, pings, secs, lat_iters, &p);
    let median_rt = |rts: &[RoundTrip]| RoundTrip {
        p50: paired::median(rts.iter().map(|t| t.p50).collect()).unwrap_or(f64::NAN),
        p99: paired::median(rts.iter().map(|t| t.p99).collect()).unwrap_or(f64::NAN),
    };
    for (method, rt) in [
        (RAW_ONE_WAY, median_rt(&b2b.raw_one_frame)),
        (RAW_TWO_FRAMES, median_rt(&b2b.raw_two_frames)),
        (RAW_TWO_CHECKED, median_rt(&b2b.raw_two_checked)),
        ("kernel UDP", median_rt(&b2b.udp_64_rt)),
        ("kernel TCP", tcp_rt),
    ] {
        r.rows.push(one_way(LAT, 64, method, rt));
    }
    // A stream that carried nothing failed; it is not a zero in the median.
    let raw_median = |streams: &[baseline::Stream], of: fn(&baseline::Stream) -> f64| {
        paired::median(
            streams
                .iter()
                .filter(|s| s.delivered_gbit > 0.0)
                .map(of)
                .collect(),
        )
        .unwrap_or(f64::NAN)
    };
    for (test, size, method, mb) in [
        (
            "4 KiB frames",
            4096,
            "raw AF_XDP",
            raw_median(&b2b.raw_4k, |s| s.mb_per_s),
        ),
        (
            "4 KiB frames",
            4096,
            RAW_READING,
            raw_median(&b2b.raw_4k_reading, |s| s.mb_per_s),
        ),
        (
            "4 KiB datagrams",
            4096,
            "kernel UDP",
            raw_median(&b2b.udp_4k, |s| s.mb_per_s),
        ),
        (
            "64 KiB messages, 1 pair of buffers",
            65536,
            GSO_FLOOR,
            raw_median(&b2b.gso_floor, |s| s.mb_per_s),
        ),
        ("64 KiB writes", 65536, "kernel TCP", tcp_64k.mb_per_s),
    ] {
        r.rows.push(Row::new(
            BW4096,
            test,
            size,
            method,
            Kind::MegabytesPerSecond,
            mb,
        ));
    }
    for (test, method, mpps) in [
        (
            "64 B frames",
            "raw AF_XDP",
            raw_median(&b2b.raw_64, |s| s.mpps),
        ),
        ("64 B datagrams", "kernel UDP", udp_64.mpps),
    ] {
        r.rows
            .push(Row::new(RATE, test, 64, method, Kind::Mpps, mpps));
    }

    let lat_runs = if opts.quick { 1 } else { 3 };
    let lat_sizes: &[u64] = if opts.quick {
        &[64, 65536]
    } else {
        &[64, 4096, 65536]
    };
    // The larger messages' ping-pong over the baselines: raw AF_XDP in frames of up to 4096
    // bytes (16 for 64 KiB, in one kick), kernel UDP in datagrams of up to 4096 bytes, kernel
    // TCP in one write. Measured once each (no goal compares with them).
    let mut bigger_baselines = Vec::new();
    for &size in lat_sizes.iter().filter(|&&s| s > 64) {
        p.say(&format!(
            "baselines: {} ping-pong over raw AF_XDP, kernel UDP and kernel TCP",
            size_text(size)
        ));
        let turns = if size >= 65536 { pings / 10 } else { pings };
        // A 4096-byte piece's frame takes two UMEM descriptors: AF_XDP multi-buffer.
        let raw = afxdp::kernel_supports_multi_buffer()
            .then(|| baseline::xsk_pingpong(&x.pair, size as usize, turns));
        for (method, rt) in [
            (RAW_ONE_WAY, raw),
            (
                "kernel UDP",
                Some(baseline::udp_pingpong(&x.pair, size as usize, turns)),
            ),
            (
                "kernel TCP",
                Some(baseline::tcp_pingpong(&x.pair, size as usize, turns)),
            ),
        ] {
            if let Some(rt) = rt {
                r.rows.push(one_way(LAT, size, method, rt));
            }
        }
        match raw {
            Some(raw) => bigger_baselines.push((size, raw.p50 / 2.0)),
            None => r.notes.push(format!(
                "No raw AF_XDP ping-pong of {}: its 4096-byte frames need AF_XDP multi-buffer \
                 (Linux 6.6 or newer)",
                size_text(size)
            )),
        }
    }
    let mut send_lat_by_size = Vec::new();
    for program in ["ib_send_lat", "ib_write_lat", "ib_read_lat"] {
        for &size in lat_sizes {
            let measured = if program == "ib_send_lat" && size == 64 {
                paired::median_index(&b2b.send_lat, |l| l.typical).map(|i| b2b.send_lat[i])
            } else {
                p.say(&format!("{program} {} over xroce", size_text(size)));
                let iters =
                    if size >= 65536 { 2000 } else { 10_000 } / if opts.quick { 5 } else { 1 };
                let args = ["-s", &size.to_string(), "-n", &iters.to_string()].map(String::from);
                median_latency(&x, &mut r, program, &args, lat_runs)
            };
            if let Some(l) = measured {
                if program == "ib_send_lat" {
                    send_lat_by_size.push((size, l.typical));
                }
                r.rows.push(Row {
                    p99: Some(l.p99),
                    ..Row::new(LAT, program, size, "xroce", Kind::LatencyUs, l.typical)
                });
            }
        }
    }
    // The same ping-pong over UD, which has no ACKs: one frame per turn where RC has two (the
    // answer and the ACK for the question, which ib_send_lat waits for as its send
    // completion). What separates the two is the ACK's trip, not the stack around it.
    p.say("ib_send_lat 64 B over xroce, UD");
    let iters = (10_000 / if opts.quick { 5 } else { 1 }).to_string();
    let args = ["-c", "UD", "-s", "64", "-n", &iters].map(String::from);
    if let Some(l) = median_latency(&x, &mut r, "ib_send_lat", &args, lat_runs) {
        r.rows.push(Row {
            p99: Some(l.p99),
            ..Row::new(
                LAT,
                "ib_send_lat UD",
                64,
                "xroce",
                Kind::LatencyUs,
                l.typical,
            )
        });
    }
    // With completion events (`-e`): both applications sleep in ibv_get_cq_event for every
    // message, as kernel UDP's ping-pong sleeps in recv for every datagram.
    p.say("ib_send_lat 64 B over xroce, completion events");
    let args = ["-e", "-s", "64", "-n", &iters].map(String::from);
    if let Some(l) = median_latency(&x, &mut r, "ib_send_lat", &args, lat_runs) {
        r.rows.push(Row {
            p99: Some(l.p99),
            ..Row::new(LAT, EVENT_LATENCY, 64, "xroce", Kind::LatencyUs, l.typical)
        });
    }
    r.notes.push(format!(
        "xroce latencies: the run with the median p50 of {lat_runs} runs per size (64 B \
         ib_send_lat over RC: of the {rounds} back-to-back rounds)"
    ));
    let larger: Vec<String> = bigger_baselines
        .iter()
        .filter_map(|&(size, raw_one_way)| {
            let (_, xroce) = send_lat_by_size.iter().find(|(s, _)| *s == size)?;
            Some(format!(
                "{}: {:.2}× ({} / {} µs)",
                size_text(size),
                xroce / raw_one_way,
                number(*xroce),
                number(raw_one_way)
            ))
        })
        .collect();
    if !larger.is_empty() {
        r.notes.push(format!(
            "ib_send_lat over RC as a multiple of raw AF_XDP's one-way time for the same \
             message (in frames of up to 4096 bytes, sent together, and no ACK), measured \
             once each: {}",
            larger.join("; ")
        ));
    }

    let bw_sizes: &[u64] = if opts.quick {
        &[64, 65536]
    } else {
        &[64, 4096, 65536, 1 << 20]
    };
    let from_rounds = [
        paired::median_index(&b2b.send_bw_64, |l| l.mpps)
            .map(|i| ("ib_send_bw", b2b.send_bw_64[i])),
        paired::median_index(&b2b.write_bw_64k, |l| l.mb_per_s)
            .map(|i| ("ib_write_bw", b2b.write_bw_64k[i])),
    ];
    let from_rounds: Vec<(&str, BwLine)> = from_rounds.into_iter().flatten().collect();
    for (program, l) in bandwidth(&x, &mut r, BW4096, bw_sizes, secs, &from_rounds, &p) {
        if l.size == 64 && program != "ib_read_bw" {
            // 64 B message rates next to the 64 B packet baselines.
            r.rows
                .push(Row::new(RATE, program, 64, "xroce", Kind::Mpps, l.mpps));
        }
    }

    // Many QPs. The goal compares 256 QPs with 1 QP, so those two run back to back in rounds
    // like the goals against raw AF_XDP (measured once each, minutes apart, their ratio
    // carried the host's drift: 0.98 in one run, 0.75 in the next of the same build).
    // Each run's losses too: many QPs can overrun the receiving engine's socket (README,
    // "Known limits"), which its counters show.
    let losses: std::cell::RefCell<Vec<(u32, Loss)>> = Default::default();
    let write_qps = |q: u32| {
        perftest_run_line(
            &x,
            "ib_write_bw",
            &["-q", &q.to_string(), "-D", &secs.to_string()],
            parse_bw,
        )
        .map(|(l, run)| {
            losses.borrow_mut().push((q, Loss::of(&run)));
            l.mb_per_s
        })
        .map_err(|e| format!("ib_write_bw -q {q}: {e}"))
    };
    // In the same rounds, raw AF_XDP moves 64 KiB messages between 256 pairs of buffers and
    // between one pair, copying and checking each frame as a RoCE stack must: what the memory
    // of 256 QPs costs a stack that copies, with no protocol in it.
    let damaged = std::cell::Cell::new(0);
    let raw_messages = |messages: usize| {
        let s = baseline::xsk_message_stream(&x.pair, messages, stream_for);
        damaged.set(damaged.get() + s.damaged);
        s.mb_per_s
    };
    let mut scale = Paired::default();
    let mut scale_raw = Paired::default();
    let mut one_vs_raw = Paired::default();
    for round in 0..rounds {
        p.say(&format!(
            "ib_write_bw 64 KiB with 256 QPs and with 1 QP over xroce, and raw AF_XDP's messages \
             between 256 and 1 pairs of buffers, back to back, round {} of {rounds}",
            round + 1
        ));
        let first = paired::xroce_first(round);
        // 256 in the "xroce" place of each pairing, 1 in its baseline's.
        let (many, one) = paired::in_order(first, || write_qps(256), || write_qps(1));
        let many = many.map_err(|e| r.notes.push(e)).ok();
        let one = one.map_err(|e| r.notes.push(e)).ok();
        scale.push(many, one);
        let (raw_many, raw_one) = paired::in_order(first, || raw_messages(256), || raw_messages(1));
        scale_raw.push(Some(raw_many), Some(raw_one));
        one_vs_raw.push(one, Some(raw_one));
    }
    let mut scale_rows = vec![(1, scale.median_baseline()), (256, scale.median_xroce())];
    if !opts.quick {
        p.say("ib_write_bw 64 KiB with 16 QPs over xroce");
        scale_rows.insert(1, (16, write_qps(16).map_err(|e| r.notes.push(e)).ok()));
    }
    for (q, mb_per_s) in scale_rows {
        if let Some(v) = mb_per_s {
            r.rows.push(Row::new(
                SCALE,
                &format!("{q} QP{}", if q == 1 { "" } else { "s" }),
                65536,
                "xroce",
                Kind::MegabytesPerSecond,
                v,
            ));
        }
    }
    for (buffers, mb_per_s) in [
        (1, scale_raw.median_baseline()),
        (256, scale_raw.median_xroce()),
    ] {
        if let Some(v) = mb_per_s {
            r.rows.push(Row::new(
                SCALE,
                &format!(
                    "64 KiB messages, {buffers} pair{} of buffers",
                    if buffers == 1 { "" } else { "s" }
                ),
                65536,
                RAW_MESSAGES,
                Kind::MegabytesPerSecond,
                v,
            ));
        }
    }
    r.notes.push(format!(
        "Scale: 1 QP and 256 QPs ran back to back in {} rounds (alternating which went first); \
         their rows are the medians of the rounds, the goal the median of the rounds' ratios. \
         16 QPs ran once.",
        scale.rounds.len()
    ));
    for q in [1, 256] {
        let runs: Vec<Loss> = losses
            .borrow()
            .iter()
            .filter(|(n, _)| *n == q)
            .map(|(_, l)| *l)
            .collect();
        if let Some(note) = Loss::note(q, &runs) {
            r.notes.push(note);
        }
    }
    if damaged.get() > 0 {
        r.notes.push(format!(
            "Scale: raw AF_XDP's message streams received {} damaged frames (a CRC-32 that did \
             not match), not counted as delivered: the path corrupted frames.",
            damaged.get()
        ));
    }
    if let (Some(raw), Some(xroce)) = (scale_raw.median_ratio(), scale.median_ratio()) {
        r.notes.push(format!(
            "Scale, what copying costs: in the same rounds raw AF_XDP moved 64 KiB messages \
             between 256 pairs of 64 KiB buffers (16 MiB a side, as 256 QPs each writing its own \
             64 KiB) \
             and between one pair, the sender copying each 4 KiB frame's payload out of its \
             message's buffer and computing a CRC-32 over the frame, the receiver checking the \
             CRC-32 and copying the payload into the same message's buffer on its side: the \
             work a RoCE stack that copies cannot avoid, without a protocol. 256 against 1: \
             {raw:.2}× (rounds {}); xroce's 256 QPs against 1 QP: {xroce:.2}×, {:.2} of raw's \
             ratio. xroce's 1 QP is {:.2}× raw's one pair of buffers (rounds {}).",
            scale_raw.ratios_text(),
            xroce / raw,
            one_vs_raw.median_ratio().unwrap_or(f64::NAN),
            one_vs_raw.ratios_text(),
        ));
    }

    // CPU per Gbit/s: both processes, all their threads, over a streaming WRITE run, less
    // what a run of a handful of WRITEs costs (start, connection set-up, teardown), so that
    // the CPU divided by the traffic is the traffic's.
    p.say("CPU cost of ib_write_bw 64 KiB (both ends)");
    let setup_cpu_s = x
        .run(
            "ib_write_bw",
            &perftest_args(&["-n", "5"]),
            Duration::from_secs(120),
        )
        .ok()
        .filter(|run| !parse_bw(&run.client).is_empty())
        .map(|run| run.cpu_s);
    match x.run(
        "ib_write_bw",
        &perftest_args(&["-D", &secs.to_string()]),
        Duration::from_secs(300),
    ) {
        Ok(run) => {
            if let Some(l) = parse_bw(&run.client).first() {
                let gbit = l.mb_per_s * 1e6 * 8.0 / 1e9 * secs as f64;
                let traffic_cpu_s = match setup_cpu_s {
                    Some(setup) if setup < run.cpu_s => run.cpu_s - setup,
                    _ => run.cpu_s,
                };
                r.rows.push(Row::new(
                    CPU,
                    "ib_write_bw 64 KiB, both ends",
                    65536,
                    "xroce",
                    Kind::CoresPerGbps,
                    traffic_cpu_s / gbit,
                ));
                r.notes.push(format!(
                    "CPU per Gbit/s: {traffic_cpu_s:.2} CPU s for {gbit:.1} Gbit: the {secs} s \
                     run's {:.2} CPU s ({:.1} s of wall time, both processes and everything \
                     they started) less {} for a run of 5 WRITEs (start, connection set-up and \
                     teardown alone). Both ends poll while traffic flows (the sender's \
                     application, the receiver's progress thread), as raw AF_XDP's do, so on \
                     this 2-CPU host both figures are close to 2 cores over the throughput; \
                     kernel UDP and TCP block instead.",
                    run.cpu_s,
                    run.wall_s,
                    setup_cpu_s.map_or("nothing (that run failed)".to_string(), |s| format!(
                        "{s:.2} CPU s"
                    ))
                ));
            }
        }
        Err(e) => r.notes.push(format!("CPU run failed: {e}")),
    }
    // The baselines' streams, both ends (this process's threads) over the same kind of run.
    let raw_cpu = paired::median(
        b2b.raw_4k
            .iter()
            .filter(|s| s.delivered_gbit > 0.0)
            .map(|s| s.cores_per_gbit_s())
            .collect(),
    );
    for (test, size, method, cores) in [
        (
            "4 KiB frames, both ends",
            4096,
            "raw AF_XDP",
            raw_cpu.unwrap_or(f64::NAN),
        ),
        (
            "4 KiB datagrams, both ends",
            4096,
            "kernel UDP",
            udp_4k.cores_per_gbit_s(),
        ),
        (
            "64 KiB writes, both ends",
            65536,
            "kernel TCP",
            tcp_64k.cores_per_gbit_s(),
        ),
    ] {
        r.rows
            .push(Row::new(CPU, test, size, method, Kind::CoresPerGbps, cores));
    }
    r.notes.push(
        "CPU per Gbit/s of the baselines: every thread of both ends from the receiver's start \
         to its stop (raw AF_XDP's receiver busy-polls, as xroce's engine does while traffic \
         flows; raw AF_XDP is the median of the back-to-back rounds); the kernel's work in the \
         threads' system calls is included, on both sides, as it is for xroce."
            .to_string(),
    );
    // Idle cost and memory with connected QPs (qp_scale.c, compiled here).
    match compile_qp_scale() {
        Ok(prog) => {
            for n in [1u32, 1000] {
                let idle = if opts.quick { 3 } else { 10 };
                p.say(&format!(
                    "{n} connected QP(s): memory, and idle CPU over {idle} s"
                ));
                let args = vec!["1".to_string(), n.to_string(), idle.to_string()];
                let cmd = x.exec(0, &prog.to_string_lossy(), &args);
                match xroce_datapath::netns::run_bounded(cmd, Duration::from_secs(120)) {
                    Ok(o) if o.status.success() => {
                        let text = String::from_utf8_lossy(&o.stdout).into_owned();
                        let field = |k: &str| {
                            text.split_whitespace()
                                .find_map(|f| f.strip_prefix(k))
                                .and_then(|v| v.parse::<f64>().ok())
                                .unwrap_or(f64::NAN)
                        };
                        let label = format!("{n} QP{}", if n == 1 { "" } else { "s" });
                        if n == 1 {
                            r.rows.push(Row::new(
                                MEMORY,
                                "device open",
                                0,
                                "xroce",
                                Kind::Mebibytes,
                                field("rss_base_kib=") / 1024.0,
                            ));
                        }
                        r.rows.push(Row::new(
                            MEMORY,
                            &format!("{label} connected"),
                            0,
                            "xroce",
                            Kind::Mebibytes,
                            field("rss_kib=") / 1024.0,
                        ));
                        r.rows.push(Row::new(
                            IDLE,
                            &format!("{label} connected"),
                            0,
                            "xroce",
                            Kind::CorePercent,
                            field("idle_cpu_ms=") / 10.0 / idle as f64,
                        ));
                    }
                    Ok(o) => r.notes.push(format!(
                        "qp_scale {n} failed: {}",
                        String::from_utf8_lossy(&o.stderr)
                    )),
                    Err(e) => r.notes.push(format!("qp_scale {n} failed: {e}")),
                }
            }
        }
        Err(e) => r.notes.push(format!("qp_scale not built: {e}")),
    }
    drop(x);

    // ---------------------------------------------------------------- netdev MTU 1500
    p.say("namespaces at MTU 1500");
    let x = XrocePair::new(xroce_bench::interrupt::NAMESPACE_PREFIX, 1500, &bin_dir)
        .unwrap_or_else(|e| fail("set-up", e));
    let _ = x
        .pair
        .exec(0, &format!("ping -c 1 -W 1 {}", x.pair.ipv4(1)));
    // The baselines of path MTU 1024: frames and datagrams of 1 KiB, what a path MTU of 1024
    // puts in each frame.
    p.say("baselines at MTU 1500: raw AF_XDP, kernel UDP and TCP");
    let raw_1k = baseline::xsk_stream(&x.pair, 1024, stream_for, Sink::Counting);
    for (test, size, method, mb) in [
        ("1 KiB frames", 1024, "raw AF_XDP", raw_1k.mb_per_s),
        (
            "1 KiB datagrams",
            1024,
            "kernel UDP",
            baseline::udp_stream(&x.pair, 1024, stream_for).mb_per_s,
        ),
        (
            "64 KiB writes",
            65536,
            "kernel TCP",
            baseline::tcp_stream(&x.pair, 65536, stream_for).mb_per_s,
        ),
    ] {
        r.rows.push(Row::new(
            BW1024,
            test,
            size,
            method,
            Kind::MegabytesPerSecond,
            mb,
        ));
    }
    let at_1024 = bandwidth(&x, &mut r, BW1024, bw_sizes, secs, &[], &p);
    if let Some((_, l)) = at_1024
        .iter()
        .find(|(program, l)| *program == "ib_write_bw" && l.size == 65536)
    {
        r.notes.push(format!(
            "Path MTU 1024: ib_write_bw 64 KiB is {:.2}× raw AF_XDP's stream of 1 KiB frames \
             ({} / {} MB/s, measured once each, minutes apart)",
            l.mb_per_s / raw_1k.mb_per_s,
            number(l.mb_per_s),
            number(raw_1k.mb_per_s)
        ));
    }
    drop(x);

    // ---------------------------------------------------------------- guests
    let mut guest_rounds = Vec::new();
    if opts.guests {
        for kernel in GUEST_KERNELS {
            p.say(&format!("QEMU guests ({kernel} kernel): rdma_rxe vs xroce"));
            match guests::compare(&bin_dir, kernel, &mut |m| p.say(m)) {
                Ok(c) => {
                    report_guests(&mut r, kernel, &c);
                    guest_rounds.push(GuestRounds {
                        kernel,
                        floors: c.floors.iter().map(guests::RcFloor::lower).collect(),
                        rounds: c.rounds,
                    });
                }
                Err(e) => r
                    .notes
                    .push(format!("guest comparison ({kernel} kernel) failed: {e}")),
            }
        }
    } else {
        r.notes
            .push("QEMU guest comparison skipped (--quick or --no-guests)".into());
    }

    goals(&mut r, &b2b, &scale, &guest_rounds);
    r.notes.push(format!(
        "Baselines: raw AF_XDP is xroce's own AF_XDP socket code sending the same prebuilt \
         UDP frame (no protocol, no checksum) as fast as the ring takes it, round trips \
         busy-polled on both ends; kernel UDP and TCP use blocking sockets. Latencies in the \
         latency table are one-way (half the round trip), as perftest reports SEND and WRITE; \
         perftest's READ latency is a full round trip. perftest's MB/s (MiB/s) are converted \
         to 10^6 B/s. {} s per bandwidth run, {pings} round trips per baseline.",
        secs
    ));

    if let Err(e) = std::fs::create_dir_all(&opts.out) {
        fail("creating the output directory", e);
    }
    let svg_name = "perf.svg";
    let md = r.markdown(Some(svg_name));
    let md_path = opts.out.join("perf.md");
    let svg_path = opts.out.join(svg_name);
    std::fs::write(&md_path, &md).unwrap_or_else(|e| fail("writing perf.md", e));
    std::fs::write(&svg_path, plot::svg(&r)).unwrap_or_else(|e| fail("writing perf.svg", e));
    println!("{md}");
    p.say(&format!(
        "wrote {} and {}",
        md_path.display(),
        svg_path.display()
    ));
}

/// Runs a perftest latency program `runs` times and returns the run with the median p50: a
/// burst of noise from a neighbour on this shared machine then moves one run, not the result.
fn median_latency(
    x: &XrocePair,
    r: &mut Report,
    program: &str,
    args: &[String],
    runs: usize,
) -> Option<LatLine> {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut lines = Vec::new();
    for _ in 0..runs {
        match perftest_line(x, program, &args, parse_lat) {
            Ok(l) => lines.push(l),
            Err(e) => r.notes.push(e),
        }
    }
    paired::median_index(&lines, |l| l.typical).map(|i| lines[i])
}

/// perftest's options for every run: the xroce device, GID 1 (IPv4), no CPU-frequency check.
fn perftest_args(extra: &[&str]) -> Vec<String> {
    ["-d", DEV, "-x", "1", "-F"]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect()
}

/// SEND, WRITE and READ bandwidth at each size, as rows of `section`; returns every result
/// line with its program. A program and size in `measured` (the back-to-back rounds) is not
/// run again: its line from there is used.
fn bandwidth(
    x: &XrocePair,
    r: &mut Report,
    section: &str,
    sizes: &[u64],
    secs: u64,
    measured: &[(&str, BwLine)],
    p: &Progress,
) -> Vec<(&'static str, BwLine)> {
    let mut lines = Vec::new();
    for program in ["ib_send_bw", "ib_write_bw", "ib_read_bw"] {
        for &size in sizes {
            let known = measured
                .iter()
                .find(|(prog, l)| *prog == program && l.size == size)
                .map(|(_, l)| *l);
            let line = match known {
                Some(l) => Ok(l),
                None => {
                    p.say(&format!("{program} {} over xroce", size_text(size)));
                    let size = size.to_string();
                    let secs = secs.to_string();
                    perftest_line(x, program, &["-s", &size, "-D", &secs], parse_bw)
                }
            };
            match line {
                Ok(l) => {
                    r.rows.push(Row::new(
                        section,
                        program,
                        size,
                        "xroce",
                        Kind::MegabytesPerSecond,
                        l.mb_per_s,
                    ));
                    lines.push((program, l));
                }
                Err(e) => r.notes.push(e),
            }
        }
    }
    lines
}

/// One perftest run over xroce and its first result line.
fn perftest_line<T: Copy>(
    x: &XrocePair,
    program: &str,
    args: &[&str],
    parse: fn(&str) -> Vec<T>,
) -> Result<T, String> {
    perftest_run_line(x, program, args, parse).map(|(line, _)| line)
}

/// [`perftest_line`], and the run it came from (its engines' counters).
fn perftest_run_line<T: Copy>(
    x: &XrocePair,
    program: &str,
    args: &[&str],
    parse: fn(&str) -> Vec<T>,
) -> Result<(T, Run), String> {
    let run = x
        .run(program, &perftest_args(args), Duration::from_secs(300))
        .map_err(|e| format!("{program} {args:?} failed: {e}"))?;
    let line = parse(&run.client)
        .first()
        .copied()
        .ok_or_else(|| format!("{program} {args:?}: no result line"))?;
    Ok((line, run))
}

/// What a run lost on the way, from its engines' counters.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Loss {
    /// Frames the kernel dropped on their way into the receiving engine's socket.
    dropped: u64,
    /// Frames the receiving engine took.
    received: u64,
    /// The sender's go-back-N restarts on a sequence NAK, its retransmission timeouts, its
    /// probes for a lost tail, and the go-back-Ns that halved a QP's send window.
    seq_naks: u64,
    timeouts: u64,
    tail_probes: u64,
    window_cuts: u64,
}

impl Loss {
    fn of(run: &Run) -> Loss {
        let client = |k: &str| run.client_stats.get(k).copied().unwrap_or(0);
        Loss {
            dropped: run.server_receive_drops(),
            received: run.server_stats.get("rx_frames").copied().unwrap_or(0),
            seq_naks: client("seq_naks_received"),
            timeouts: client("timeouts"),
            tail_probes: client("tail_probes"),
            window_cuts: client("send_window_cuts"),
        }
    }

    /// The share of the frames that reached the receiving socket's door that it dropped.
    fn dropped_share(&self) -> f64 {
        let arrived = self.dropped + self.received;
        if arrived == 0 {
            0.0
        } else {
            self.dropped as f64 / arrived as f64
        }
    }

    /// A note on the losses of the runs with `qps` QPs (medians over the runs), if any ran.
    fn note(qps: u32, runs: &[Loss]) -> Option<String> {
        if runs.is_empty() {
            return None;
        }
        let median =
            |f: &dyn Fn(&Loss) -> f64| paired::median(runs.iter().map(f).collect()).unwrap_or(0.0);
        let shares: Vec<String> = runs
            .iter()
            .map(|l| format!("{:.2} %", 100.0 * l.dropped_share()))
            .collect();
        Some(format!(
            "Scale, losses with {qps} QP{s} (the engines' counters, medians of {n} run{rs}): the \
             receiving engine's socket dropped {:.0} frames a run, {:.2} % of those that reached \
             it (runs: {}), when it had no room for them; the sender went back on {:.0} \
             sequence NAKs and {:.0} retransmission timeouts a run; tail-loss probes a run: \
             {:.0}; send windows halved a run: {:.0}.",
            median(&|l| l.dropped as f64),
            100.0 * median(&|l| l.dropped_share()),
            shares.join(", "),
            median(&|l| l.seq_naks as f64),
            median(&|l| l.timeouts as f64),
            median(&|l| l.tail_probes as f64),
            median(&|l| l.window_cuts as f64),
            s = if qps == 1 { "" } else { "s" },
            n = runs.len(),
            rs = if runs.len() == 1 { "" } else { "s" },
        ))
    }
}

/// The latency row of `ib_send_lat` with completion events.
const EVENT_LATENCY: &str = "ib_send_lat -e";

/// Number of back-to-back rounds behind the goals that compare xroce with raw AF_XDP. Five:
/// with three, the goals at 0.8 came out between 0.73 and 0.98 in runs of one build (stops
/// 27-29), single rounds between 0.59 and 1.09; the median of five moves less. About 20 s a
/// round.
const ROUNDS: usize = 5;
/// The same for `--quick`.
const QUICK_ROUNDS: usize = 3;

/// The measurements behind the goals that compare xroce with raw AF_XDP, taken in rounds
/// with both back to back (see `xroce_bench::paired`), all at netdev MTU 9000.
#[derive(Default)]
struct BackToBack {
    raw_one_frame: Vec<RoundTrip>,
    raw_two_frames: Vec<RoundTrip>,
    /// Two frames per turn, each numbered and CRC'd by its sender and checked by its
    /// receiver (`baseline::xsk_pingpong_checked`): the floor of any RC stack.
    raw_two_checked: Vec<RoundTrip>,
    /// 64 B `ib_send_lat` over RC.
    send_lat: Vec<LatLine>,
    raw_64: Vec<baseline::Stream>,
    /// 64 B `ib_send_bw`.
    send_bw_64: Vec<BwLine>,
    raw_4k: Vec<baseline::Stream>,
    /// Raw AF_XDP's 4 KiB stream to a receiver that reads each frame (`Sink::Reading`).
    raw_4k_reading: Vec<baseline::Stream>,
    /// 64 KiB `ib_write_bw`.
    write_bw_64k: Vec<BwLine>,
    /// Kernel UDP's 64 B ping-pong and 4 KiB stream, measured in the rounds.
    udp_64_rt: Vec<RoundTrip>,
    udp_4k: Vec<baseline::Stream>,
    /// `ib_send_lat` one-way against raw's one-frame one-way, per round.
    latency: Paired,
    /// `ib_send_lat` against raw's two frames per turn (RC's floor).
    floor: Paired,
    /// `ib_send_lat` against raw's two checked frames per turn (RC's floor with the ICRC's
    /// work).
    floor_checked: Paired,
    /// Raw's two frames per turn, bare and checked, against its one frame (the floors as
    /// multiples of the path's one-frame turn).
    two_vs_one: Paired,
    checked_vs_one: Paired,
    /// 64 B message rate against raw's 64 B packet rate.
    rate: Paired,
    /// 64 KiB `ib_write_bw` against raw's 4 KiB frames.
    write: Paired,
    /// 64 B `ib_send_lat` one-way against kernel UDP's 64 B ping-pong one-way, per round.
    udp_latency: Paired,
    /// RC's checked floor (raw's two checked frames per turn) one-way against kernel UDP's
    /// one-way, per round: at or above 1, no RC stack's turn beats kernel UDP's there.
    checked_vs_udp: Paired,
    /// 64 KiB `ib_write_bw` against kernel UDP's 4 KiB datagrams, per round.
    udp_write: Paired,
    /// 64 KiB `ib_write_bw` against raw's 4 KiB frames to a reading receiver.
    write_vs_reading: Paired,
    /// The floor of xroce's own way of sending a 64 KiB WRITE on this path, UDP GSO batches
    /// to a raw AF_XDP receiver, copied and checked at both ends
    /// (`baseline::udp_gso_message_stream`).
    gso_floor: Vec<baseline::Stream>,
    /// 64 KiB `ib_write_bw` against that floor, per round.
    write_vs_gso_floor: Paired,
    /// The better of the two floors a RoCE stack has on this path (raw AF_XDP to a reading
    /// receiver, and the UDP GSO floor) against kernel UDP's 4 KiB datagrams, per round.
    best_floor_vs_udp: Paired,
}

fn back_to_back(
    x: &XrocePair,
    r: &mut Report,
    rounds: usize,
    pings: usize,
    secs: u64,
    lat_iters: usize,
    p: &Progress,
) -> BackToBack {
    let mut b = BackToBack::default();
    let stream_for = Duration::from_secs(secs);
    let (secs, lat_iters) = (secs.to_string(), lat_iters.to_string());
    for round in 0..rounds {
        p.say(&format!(
            "xroce and raw AF_XDP back to back, round {} of {rounds}: 64 B latency, 64 B \
             message rate, 64 KiB WRITE",
            round + 1
        ));
        let first = paired::xroce_first(round);
        let (lat, (one, two, checked, udp)) = paired::in_order(
            first,
            || perftest_line(x, "ib_send_lat", &["-s", "64", "-n", &lat_iters], parse_lat),
            || {
                (
                    baseline::xsk_pingpong(&x.pair, 64, pings),
                    baseline::xsk_pingpong_turns(&x.pair, 64, pings, 2),
                    baseline::xsk_pingpong_checked(&x.pair, 64, pings),
                    baseline::udp_pingpong(&x.pair, 64, pings),
                )
            },
        );
        let (send_bw, raw_64) = paired::in_order(
            first,
            || perftest_line(x, "ib_send_bw", &["-s", "64", "-D", &secs], parse_bw),
            || baseline::xsk_stream(&x.pair, 64, stream_for, Sink::Counting),
        );
        let (write_bw, (raw_4k, raw_4k_reading, udp_4k, gso_floor)) = paired::in_order(
            first,
            || perftest_line(x, "ib_write_bw", &["-s", "65536", "-D", &secs], parse_bw),
            || {
                // Which receiver goes first alternates too.
                let run = |sink| baseline::xsk_stream(&x.pair, 4096, stream_for, sink);
                let (a, b) = paired::in_order(first, || run(Sink::Counting), || run(Sink::Reading));
                (
                    a,
                    b,
                    baseline::udp_stream(&x.pair, 4096, stream_for),
                    baseline::udp_gso_message_stream(&x.pair, 1, stream_for),
                )
            },
        );
        let lat = lat.map_err(|e| r.notes.push(e)).ok();
        let send_bw = send_bw.map_err(|e| r.notes.push(e)).ok();
        let write_bw = write_bw.map_err(|e| r.notes.push(e)).ok();
        b.latency.push(lat.map(|l| l.typical), Some(one.p50 / 2.0));
        b.floor.push(lat.map(|l| l.typical), Some(two.p50 / 2.0));
        b.floor_checked
            .push(lat.map(|l| l.typical), Some(checked.p50 / 2.0));
        b.two_vs_one.push(Some(two.p50), Some(one.p50));
        b.checked_vs_one.push(Some(checked.p50), Some(one.p50));
        b.rate.push(send_bw.map(|l| l.mpps), Some(raw_64.mpps));
        b.write
            .push(write_bw.map(|l| l.mb_per_s), Some(raw_4k.mb_per_s));
        b.write_vs_reading
            .push(write_bw.map(|l| l.mb_per_s), Some(raw_4k_reading.mb_per_s));
        b.udp_latency
            .push(lat.map(|l| l.typical), Some(udp.p50 / 2.0));
        b.checked_vs_udp
            .push(Some(checked.p50 / 2.0), Some(udp.p50 / 2.0));
        b.udp_write
            .push(write_bw.map(|l| l.mb_per_s), Some(udp_4k.mb_per_s));
        // A stream that carried nothing failed: no ratio from it.
        let carried = |s: &baseline::Stream| (s.delivered_gbit > 0.0).then_some(s.mb_per_s);
        b.write_vs_gso_floor
            .push(write_bw.map(|l| l.mb_per_s), carried(&gso_floor));
        b.best_floor_vs_udp.push(
            better_floor(carried(&raw_4k_reading), carried(&gso_floor)),
            carried(&udp_4k),
        );
        b.gso_floor.push(gso_floor);
        b.udp_64_rt.push(udp);
        b.udp_4k.push(udp_4k);
        b.raw_4k_reading.push(raw_4k_reading);
        b.raw_one_frame.push(one);
        b.raw_two_frames.push(two);
        b.raw_two_checked.push(checked);
        b.raw_64.push(raw_64);
        b.raw_4k.push(raw_4k);
        b.send_lat.extend(lat);
        b.send_bw_64.extend(send_bw);
        b.write_bw_64k.extend(write_bw);
    }
    r.notes.push(format!(
        "Back to back: the goals that compare xroce with raw AF_XDP (64 B latency, 64 B message \
         rate, 64 KiB WRITE) and with kernel UDP (64 B latency, 64 KiB WRITE) come from \
         {rounds} rounds, each running xroce and the baselines one after the other (xroce \
         second in the first round, first in the second, and so on); a goal's ratio is the \
         median of the rounds' ratios. This host's path drifts by tens of percent within \
         minutes, which a ratio of two numbers measured minutes apart would carry. The tables \
         show the medians of the rounds for raw AF_XDP, for kernel UDP's 64 B ping-pong and \
         4 KiB stream, and for those xroce tests (for ib_send_lat, ib_send_bw and ib_write_bw, \
         the round with the median)."
    ));
    b
}

/// Raw AF_XDP's ping-pong, one message (and no ACK) per turn.
const RAW_ONE_WAY: &str = "raw AF_XDP (busy-polled)";
/// The raw AF_XDP ping-pong that sends what an RC turn needs: the message and an ACK-sized
/// frame in one kick (see `baseline::xsk_pingpong_turns`).
const RAW_TWO_FRAMES: &str = "raw AF_XDP, 2 frames per turn (RC's answer + ACK)";
/// The same, each frame numbered and CRC'd by its sender and checked by its receiver
/// (`baseline::xsk_pingpong_checked`).
const RAW_TWO_CHECKED: &str = "raw AF_XDP, 2 frames per turn, each CRC-32'd and checked";
/// The same, each turn sent as one UDP batch (guests only; `guest-stream ... batched`).
const RAW_TWO_CHECKED_BATCHED: &str =
    "raw, 2 frames per turn as one UDP batch, each CRC-32'd and checked";
/// The raw AF_XDP stream whose receiver reads each frame as a RoCE receiver must.
const RAW_READING: &str = "raw AF_XDP, receiver reads each frame (CRC-32 + copy)";
/// 64 KiB messages sent as xroce's engines send a WRITE's packets on this path, to a raw
/// AF_XDP receiver, copied and checked at both ends (`baseline::udp_gso_message_stream`).
const GSO_FLOOR: &str =
    "UDP GSO (1 + 15 frames) to raw AF_XDP, copied from and into the buffers (CRC-32 both ends)";
/// Raw AF_XDP moving 64 KiB messages between buffers as a copying RoCE stack must
/// (`baseline::xsk_message_stream`).
const RAW_MESSAGES: &str = "raw AF_XDP, copied from and into the buffers (CRC-32 both ends)";

/// A baseline's round trip as one-way latency (half), like perftest's SEND/WRITE numbers.
fn one_way(section: &str, size: u64, method: &str, rt: RoundTrip) -> Row {
    Row {
        p99: Some(rt.p99 / 2.0),
        ..Row::new(
            section,
            &format!("{} ping-pong, one way", size_text(size)),
            size,
            method,
            Kind::LatencyUs,
            rt.p50 / 2.0,
        )
    }
}

/// A goal from two numbers of this run.
fn ratio_goal(
    out: &mut Vec<Goal>,
    what: &str,
    (num, den): (Option<f64>, Option<f64>),
    target: f64,
    at_least: bool,
    unit: &str,
) {
    if let (Some(n), Some(d)) = (num, den) {
        out.push(Goal {
            what: what.into(),
            ratio: n / d,
            target,
            at_least,
            detail: format!("{n:.2} / {d:.2} {unit}"),
            out_of_reach: None,
        });
    }
}

/// A goal from rounds of xroce and its baseline back to back.
fn paired_goal(
    out: &mut Vec<Goal>,
    what: &str,
    paired: &Paired,
    target: f64,
    at_least: bool,
    unit: &str,
) {
    if let Some(ratio) = paired.median_ratio() {
        out.push(Goal {
            what: what.into(),
            ratio,
            target,
            at_least,
            detail: paired.describe(unit),
            out_of_reach: None,
        });
    }
}

/// The guests' rows and notes for the comparison `c` in guests booting `kernel`.
fn report_guests(r: &mut Report, kernel: GuestKernel, c: &guests::Comparison) {
    let label = format!("{kernel} kernel {}", c.kernel_version);
    if !c.incidents.is_empty() {
        r.notes.push(format!(
            "Guests ({kernel}): runs that failed and were run again, after booting the guest \
             again or bouncing its link: {}.",
            c.incidents.join("; ")
        ));
    }
    let lat_section = format!("{GUESTS}, {label}: latency, path MTU 1024");
    let bw_section = format!("{GUESTS}, {label}: bandwidth, path MTU 1024");
    let (rxe, xroce) = (c.rxe, c.xroce);
    for (method, n) in [("rdma_rxe", rxe), ("xroce", xroce)] {
        r.rows.push(Row {
            p99: Some(n.send_lat_p99_us),
            ..Row::new(
                &lat_section,
                "ib_send_lat",
                64,
                method,
                Kind::LatencyUs,
                n.send_lat_us,
            )
        });
    }
    for (method, n) in [("rdma_rxe", rxe), ("xroce", xroce)] {
        r.rows.push(Row::new(
            &bw_section,
            "ib_write_bw",
            65536,
            method,
            Kind::MegabytesPerSecond,
            n.write_bw_mb_s,
        ));
    }
    let per_round: Vec<String> = c
        .rounds
        .iter()
        .map(|(rxe, xroce)| {
            format!(
                "{} / {}",
                paired::round_ratio_text(xroce.write_bw_mb_s, rxe.write_bw_mb_s, "rdma_rxe"),
                paired::round_ratio_text(xroce.send_lat_us, rxe.send_lat_us, "rdma_rxe")
            )
        })
        .collect();
    r.notes.push(format!(
        "Guests ({kernel}): each number is the median of {} rounds, each round running both \
         back to back (rdma_rxe first in the first round, xroce first in the \
         second, and so on); xroce's bandwidth / latency as a multiple of \
         rdma_rxe's in each round: {} (the goals are the medians of these). ib_send_lat 64 B minimum (the path without scheduling delays): \
         rdma_rxe {:.0} µs, xroce {:.0} µs. Under TCG both pay mostly for the \
         emulated kernel network path (virtio, interrupts, softirq), which they share.",
        c.rounds.len(),
        per_round.join(", "),
        rxe.send_lat_min_us,
        xroce.send_lat_min_us
    ));
    let host_cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let [rxe_in, rxe_out] = rxe.write_bw_vcpu_cores;
    let [xroce_in, xroce_out] = xroce.write_bw_vcpu_cores;
    r.notes.push(format!(
        "Guests ({kernel}): host CPU of the guests' vCPU threads during ib_write_bw (median of \
         the rounds), as cores of the host's {host_cpus}: with rdma_rxe the \
         receiving guest's {rxe_in:.2} and the sending guest's {rxe_out:.2}, with \
         xroce {xroce_in:.2} and {xroce_out:.2}. A vCPU that computed all the time \
         would use a whole core; below that, the guest spent the rest waiting on \
         QEMU's emulated devices, or idle."
    ));
    match &c.raw_stream_mb_s {
        Ok(raw) => {
            let batched = raw.batched.as_ref().ok().copied();
            for (method, value) in [
                (
                    "raw AF_XDP (copy mode, a notification per frame)",
                    Some(raw.copy_mode),
                ),
                ("kernel UDP in batches (UDP GSO) to raw AF_XDP", batched),
            ] {
                if let Some(value) = value {
                    r.rows.push(Row::new(
                        &bw_section,
                        "1 KiB UDP frames",
                        guests::RAW_PAYLOAD as u64,
                        method,
                        Kind::MegabytesPerSecond,
                        value,
                    ));
                }
            }
            let batched_text = match &raw.batched {
                Ok(b) => format!("{b:.1} MB/s (the better of {} runs)", guests::BATCHED_RUNS),
                Err(e) => format!("nothing measured ({e})"),
            };
            let ceiling = raw.ceiling();
            r.notes.push(format!(
                "Guests ({kernel}): raw streams of 1 KiB payloads from one guest to an AF_XDP \
                 receiver in the other that counts frames: {:.1} MB/s sent through AF_XDP's \
                 copy mode, which notifies the virtio-net device for every frame, and \
                 {batched_text} sent through a kernel UDP socket in batches (UDP GSO), one \
                 notification per batch, as xroce's engines send runs of frames there. The \
                 better of the two, {ceiling:.1} MB/s, is the most a sender put on this path; \
                 twice rdma_rxe's bandwidth would be {:.1} MB/s, {:.2}× it. rdma_rxe reaches \
                 {:.2}× of it, xroce {:.2}×.",
                raw.copy_mode,
                2.0 * rxe.write_bw_mb_s,
                2.0 * rxe.write_bw_mb_s / ceiling,
                rxe.write_bw_mb_s / ceiling,
                xroce.write_bw_mb_s / ceiling
            ));
        }
        Err(e) => r
            .notes
            .push(format!("guests ({kernel}): the raw streams failed: {e}")),
    }
    let half = rxe.send_lat_us / 2.0;
    let rc_floor = c.floor_medians();
    // The raw ping-pongs' rows: the one- and two-frame ones once after the rounds, RC's
    // floor each way as its median over the rounds.
    let mut pings = Vec::new();
    if let Ok(raw) = &c.raw_one_way_us {
        pings.extend([
            (RAW_ONE_WAY, raw.one_frame),
            (RAW_TWO_FRAMES, raw.two_frames),
        ]);
    }
    for (method, t) in [
        (RAW_TWO_CHECKED, &rc_floor.through_xdp),
        (RAW_TWO_CHECKED_BATCHED, &rc_floor.batched),
    ] {
        pings.extend(t.as_ref().ok().map(|t| (method, *t)));
    }
    for (method, t) in pings {
        r.rows.push(Row::new(
            &lat_section,
            "64 B ping-pong, one way",
            64,
            method,
            Kind::LatencyUs,
            t.p50,
        ));
    }
    match &c.raw_one_way_us {
        Ok(raw) => {
            let floor = raw.two_frames.p50;
            r.notes.push(format!(
                "Guests ({kernel}): raw AF_XDP ping-pong between the guests takes {:.0} µs \
                 one-way (minimum {:.0}) with one frame per turn and {floor:.0} µs \
                 (minimum {:.0}) with RC's two (the answer and an ACK-sized frame, \
                 one kick), busy-polled as perftest polls: the floor of RC there. \
                 Half rdma_rxe's ib_send_lat would be {half:.0} µs, {:.2}× that \
                 floor; rdma_rxe takes {:.2}× it, xroce {:.2}×.",
                raw.one_frame.p50,
                raw.one_frame.min,
                raw.two_frames.min,
                half / floor,
                rxe.send_lat_us / floor,
                xroce.send_lat_us / floor
            ));
        }
        Err(e) => r.notes.push(format!(
            "guests ({kernel}): the raw AF_XDP ping-pong failed: {e}"
        )),
    }
    let lower: Vec<_> = c.floors.iter().map(guests::RcFloor::lower).collect();
    let against_rxe = floor_vs_rxe(&c.rounds, &lower);
    let said = |t: &Result<guests::PingTimes, String>| match t {
        Ok(t) => format!("{:.0} µs (minimum {:.0})", t.p50, t.min),
        Err(e) => format!("not measured ({e})"),
    };
    r.notes.push(format!(
        "Guests ({kernel}): the floor of a RoCE stack's RC turn between the guests, the \
         same two frames each numbered and given a CRC-32 by its sender and checked by \
         its receiver (the ICRC's work, the least any RoCE stack does), sent the two ways \
         a stack can send there that this suite measures, one-way, measured in each \
         round right after its two stacks (medians of the rounds): {} sent through \
         AF_XDP, {} sent as one UDP batch (one notification of the virtio device per \
         turn, the ACK-sized frame its shorter last segment).{}",
        said(&rc_floor.through_xdp),
        said(&rc_floor.batched),
        match (rc_floor.lower(), against_rxe.median_ratio()) {
            (Some((f, how)), Some(ratio)) => format!(
                " The lower of the two in each round was {ratio:.2}× that round's rdma_rxe \
                 ib_send_lat (median of the rounds' ratios: {}; the goal asks xroce for \
                 0.50×); the lower median was sent {how}, and xroce takes {:.2}× it.",
                against_rxe.ratios_text(),
                xroce.send_lat_us / f.p50
            ),
            _ => String::new(),
        }
    ));
}

/// What the guest goals come from, per kernel.
struct GuestRounds {
    kernel: GuestKernel,
    /// (rdma_rxe, xroce) of each round.
    rounds: Vec<(guests::GuestNumbers, guests::GuestNumbers)>,
    /// RC's floor between the guests in each round, in the rounds' order, and how it was
    /// sent ([`guests::RcFloor::lower`]).
    floors: Vec<Option<(guests::PingTimes, &'static str)>>,
}

/// The issue's goals, each a ratio of two numbers of this run.
fn goals(r: &mut Report, b2b: &BackToBack, scale: &Paired, guests: &[GuestRounds]) {
    let mut out = Vec::new();
    paired_goal(
        &mut out,
        SEND_LAT_GOAL,
        &b2b.latency,
        SEND_LAT_TARGET,
        false,
        "µs",
    );
    // Kernel UDP's blocking ping-pong waits on the host's wake-ups, whose speed changes by
    // ten times from one hour to the next here (2 µs one-way in one run, 32 µs an hour
    // earlier): measured in every round, next to ib_send_lat.
    paired_goal(&mut out, UDP_LAT_GOAL, &b2b.udp_latency, 1.0, false, "µs");
    // Kernel UDP's ping-pong sends one datagram per turn; RC's turn is two frames, each
    // CRC'd and checked. When kernel UDP's wake-ups are fast, that floor reaches it.
    if let Some(why) = udp_latency_out_of_reach(&b2b.checked_vs_udp) {
        mark_out_of_reach(&mut out, UDP_LAT_GOAL, why);
    }
    if let (Some(f), Some(floor)) = (
        b2b.checked_vs_udp.median_ratio(),
        b2b.checked_vs_udp.median_xroce(),
    ) {
        r.notes.push(format!(
            "RC's floor against kernel UDP's 64 B ping-pong (one datagram per turn, blocking \
             recv), in the same rounds: {floor:.2} µs one-way, {f:.2}× kernel UDP's (median of \
             the rounds' ratios: {}); the goal (below kernel UDP) is {} that floor.",
            b2b.checked_vs_udp.ratios_text(),
            if f >= 1.0 { "below" } else { "at or above" },
        ));
    }
    let send_lat = r_value(r, LAT, "ib_send_lat", 64);
    // Kernel UDP's one-way as the latency table gives it: the median of the rounds.
    let udp_one_way = paired::median(b2b.udp_64_rt.iter().map(|t| t.p50 / 2.0).collect());
    if let (Some(events), Some(udp)) = (r_value(r, LAT, EVENT_LATENCY, 64), udp_one_way) {
        r.notes.push(format!(
            "64 B ib_send_lat with completion events (-e), each side asleep in \
             ibv_get_cq_event until each event (measured once, not back to back): {} µs, \
             {:.2}× kernel UDP's one-way ({} µs). A turn wakes each side twice, for the ACK \
             of its message (its send completion) and for the answer, where kernel UDP's \
             ping-pong sleeps once in recv; how long a wake-up takes on this host varies by \
             ten times from one run to another. The waiting thread takes the frames its \
             events come from itself.",
            number(events),
            events / udp,
            number(udp)
        ));
    }
    // RC's floor with the ICRC's work against raw's one frame, per round (both ran back to
    // back in every round): above the goal, no RC stack could meet it on this path.
    let checked_over_raw = b2b.checked_vs_one.median_ratio();
    if let (Some(f), Some(checked)) = (checked_over_raw, b2b.floor_checked.median_baseline()) {
        if f > SEND_LAT_TARGET {
            mark_out_of_reach(
                &mut out,
                SEND_LAT_GOAL,
                format!(
                    "RC's floor, raw AF_XDP's two frames per turn each CRC-32'd and checked, \
                     is {f:.2}× raw's one frame"
                ),
            );
        }
        r.notes.push(format!(
            "The floor of any RC stack on this path: raw AF_XDP sending RC's two frames per \
             turn, each numbered and given a CRC-32 over the whole frame by its sender as it \
             sends it (the ICRC's work) and read whole and checked by its receiver, and no \
             other protocol: {checked:.2} µs one-way, {f:.2}× raw's one frame (median of the \
             rounds' ratios: {}); the {SEND_LAT_TARGET}× goal is {} that floor. ib_send_lat \
             over RC is {:.2}× it (median of the rounds: {}).",
            b2b.checked_vs_one.ratios_text(),
            if f > SEND_LAT_TARGET {
                "below"
            } else {
                "at or above"
            },
            b2b.floor_checked.median_ratio().unwrap_or(f64::NAN),
            b2b.floor_checked.describe("µs"),
        ));
    }
    if let (Some(ud), Some(rc), Some(raw), Some(floor)) = (
        r_value(r, LAT, "ib_send_lat UD", 64),
        send_lat,
        b2b.latency.median_baseline(),
        b2b.floor.median_baseline(),
    ) {
        let floor_over_raw = b2b.two_vs_one.median_ratio().unwrap_or(floor / raw);
        r.notes.push(format!(
            "64 B ib_send_lat over UD (one frame per turn, no ACK; measured once, not back to \
             back): {ud:.2} µs, {:.2}× raw AF_XDP one-way (median of the rounds); over RC \
             (answer + ACK per turn): {rc:.2} µs, {:.2}×",
            ud / raw,
            rc / raw
        ));
        r.notes.push(format!(
            "The path's own floor for RC: raw AF_XDP sending RC's two frames per turn (the \
             message and an ACK-sized frame, one kick, nothing computed or read) takes \
             {floor:.2} µs one-way, {:.2}× its one-frame ping-pong (median of the rounds' \
             ratios); the {SEND_LAT_TARGET}× goal is {} that floor. ib_send_lat over RC is \
             {:.2}× the floor (median of the rounds: {}), over UD {:.2}× raw's one frame.",
            floor_over_raw,
            if floor_over_raw >= SEND_LAT_TARGET {
                "at or below"
            } else {
                "above"
            },
            b2b.floor.median_ratio().unwrap_or(f64::NAN),
            b2b.floor.describe("µs"),
            ud / raw
        ));
    }
    paired_goal(
        &mut out,
        "ib_write_bw 64 KiB vs raw AF_XDP 4 KiB frames",
        &b2b.write,
        0.8,
        true,
        "MB/s",
    );
    if let (Some(counting), Some(reading)) = (
        b2b.write.median_baseline(),
        b2b.write_vs_reading.median_baseline(),
    ) {
        r.notes.push(format!(
            "Raw AF_XDP's 4 KiB stream with a receiver that reads each frame as a RoCE receiver \
             must (a CRC-32 over the frame, the work of the ICRC check, and the payload copied \
             into memory): {reading:.0} MB/s, {:.2}× the counting receiver's {counting:.0} \
             (rounds {}). On a veth pair the sender's CPU copies each frame into the \
             receiver's UMEM, and the lines the receiving CPU has read make that copy dearer. \
             ib_write_bw 64 KiB is {:.2}× the reading receiver's stream (rounds {}).",
            reading / counting,
            b2b.raw_4k
                .iter()
                .zip(&b2b.raw_4k_reading)
                .map(|(c, r)| format!("{:.2}", r.mb_per_s / c.mb_per_s))
                .collect::<Vec<_>>()
                .join(", "),
            b2b.write_vs_reading.median_ratio().unwrap_or(f64::NAN),
            b2b.write_vs_reading.ratios_text(),
        ));
    }
    paired_goal(
        &mut out,
        UDP_WRITE_GOAL,
        &b2b.udp_write,
        UDP_WRITE_TARGET,
        true,
        "MB/s",
    );
    if let Some(why) = write_vs_udp_out_of_reach(&b2b.best_floor_vs_udp) {
        mark_out_of_reach(&mut out, UDP_WRITE_GOAL, why);
    }
    if let (Some(raw), Some(reading), Some(udp)) = (
        b2b.write.median_baseline(),
        b2b.write_vs_reading.median_baseline(),
        b2b.udp_write.median_baseline(),
    ) {
        r.notes.push(format!(
            "For scale, the goal against kernel UDP: raw AF_XDP's 4 KiB stream (median of the \
             rounds, {raw:.0} MB/s) is {:.2}× kernel UDP's (median of the rounds, {udp:.0} MB/s), \
             {:.2}× with a receiver that reads each frame as a RoCE receiver must \
             ({reading:.0} MB/s). On this veth pair xroce's engines send runs of frames through a \
             UDP socket in batches (UDP GSO), not through AF_XDP's copy mode.{}",
            raw / udp,
            reading / udp,
            match (
                b2b.write_vs_gso_floor.median_baseline(),
                b2b.write_vs_gso_floor.median_ratio(),
                b2b.best_floor_vs_udp.median_ratio(),
            ) {
                (Some(floor), Some(xroce), Some(best)) => format!(
                    " The floor of that way, 64 KiB messages sent as a WRITE's packets go (its \
                     first frame alone, it is 16 bytes longer; the other 15 in one UDP GSO \
                     batch) to a raw AF_XDP receiver, each 4 KiB frame copied out of its \
                     buffer and CRC-32'd by the sender and checked and copied into its buffer \
                     by the receiver, and no protocol: {floor:.0} MB/s (median of the rounds). \
                     ib_write_bw 64 KiB is {xroce:.2}× it (rounds {}). The better of the two \
                     floors is {best:.2}× kernel UDP (median of the rounds' ratios: {}); the \
                     {UDP_WRITE_TARGET}× goal is {} it.",
                    b2b.write_vs_gso_floor.ratios_text(),
                    b2b.best_floor_vs_udp.ratios_text(),
                    if best < UDP_WRITE_TARGET {
                        "above"
                    } else {
                        "at or below"
                    },
                ),
                _ => String::new(),
            }
        ));
    }
    paired_goal(
        &mut out,
        "64 B ib_send_bw message rate vs raw AF_XDP 64 B packets",
        &b2b.rate,
        0.8,
        true,
        "M/s",
    );
    paired_goal(
        &mut out,
        "ib_write_bw 256 QPs vs 1 QP",
        scale,
        0.8,
        true,
        "MB/s",
    );
    let idle = r
        .rows
        .iter()
        .filter(|row| row.kind == Kind::CorePercent)
        .map(|row| row.value)
        .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))));
    ratio_goal(
        &mut out,
        "idle CPU with connected QPs (% of a core)",
        (idle, Some(1.0)),
        1.0,
        false,
        "%",
    );
    for GuestRounds {
        kernel,
        rounds,
        floors,
    } in guests
    {
        // As on the host: the median of the rounds' ratios, each from two runs back to back.
        let (mut bw, mut lat) = (Paired::default(), Paired::default());
        for (rxe, xroce) in rounds {
            bw.push(Some(xroce.write_bw_mb_s), Some(rxe.write_bw_mb_s));
            lat.push(Some(xroce.send_lat_us), Some(rxe.send_lat_us));
        }
        paired_goal(
            &mut out,
            &format!("guests ({kernel} kernel): xroce vs rdma_rxe ib_write_bw"),
            &bw,
            2.0,
            true,
            "MB/s",
        );
        let lat_goal = format!("guests ({kernel} kernel): xroce vs rdma_rxe ib_send_lat");
        paired_goal(&mut out, &lat_goal, &lat, 0.5, false, "µs");
        if let Some(why) = guest_latency_out_of_reach(rounds, floors) {
            mark_out_of_reach(&mut out, &lat_goal, why);
        }
    }
    r.goals.extend(out);
}

/// Why no RC stack could be below kernel UDP's one-way in these rounds, if none could: RC's
/// checked floor (`checked_vs_udp`, the floor on its "xroce" side) at or above kernel UDP's
/// one-way, as the median of the rounds' ratios.
fn udp_latency_out_of_reach(checked_vs_udp: &Paired) -> Option<String> {
    let f = checked_vs_udp.median_ratio().filter(|f| *f >= 1.0)?;
    Some(format!(
        "RC's floor, raw AF_XDP's two frames per turn each CRC-32'd and checked, is {f:.2}× \
         kernel UDP's one-way (rounds {})",
        checked_vs_udp.ratios_text()
    ))
}

/// The better (faster) of a round's two floors for a WRITE's frames, either alone when the
/// other's stream failed.
fn better_floor(reading: Option<f64>, gso: Option<f64>) -> Option<f64> {
    match (reading, gso) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

/// Why no RoCE stack could stream 1.5× kernel UDP's 4 KiB datagrams in these rounds, if none
/// could: the better of the path's two floors for a WRITE's frames (`best_floor_vs_udp`, the
/// floor on its "xroce" side) below 1.5× kernel UDP, as the median of the rounds' ratios.
fn write_vs_udp_out_of_reach(best_floor_vs_udp: &Paired) -> Option<String> {
    let f = best_floor_vs_udp
        .median_ratio()
        .filter(|f| *f < UDP_WRITE_TARGET)?;
    Some(format!(
        "the better of the path's floors for a WRITE's frames (raw AF_XDP to a receiver that \
         checks and copies each frame; UDP GSO batches copied, CRC-32'd and checked) is {f:.2}× \
         kernel UDP (rounds {})",
        best_floor_vs_udp.ratios_text()
    ))
}

/// RC's floor between the guests (the lower way in each round) against rdma_rxe's latency
/// of the same round ("xroce" is the floor's side of each pair).
fn floor_vs_rxe(
    rounds: &[(guests::GuestNumbers, guests::GuestNumbers)],
    floors: &[Option<(guests::PingTimes, &str)>],
) -> Paired {
    let mut p = Paired::default();
    for ((rxe, _), floor) in rounds.iter().zip(floors) {
        p.push(floor.map(|(f, _)| f.p50), Some(rxe.send_lat_us));
    }
    p
}

/// Why the guests' latency goal (at most half rdma_rxe's) is out of reach, if it is: a stack
/// at RC's floor there would still take more than half rdma_rxe's time. The floor is set
/// against rdma_rxe's latency of its own round, as every goal's ratio is.
fn guest_latency_out_of_reach(
    rounds: &[(guests::GuestNumbers, guests::GuestNumbers)],
    floors: &[Option<(guests::PingTimes, &str)>],
) -> Option<String> {
    let floor_vs_rxe = floor_vs_rxe(rounds, floors);
    let ratio = floor_vs_rxe.median_ratio()?;
    (ratio > 0.5).then(|| {
        format!(
            "RC's floor between the guests, raw two frames per turn each CRC-32'd and checked \
             (the lower of two ways of sending them in each round), is {ratio:.2}× rdma_rxe's \
             latency (median of the rounds' ratios; floor {:.0} µs one-way; rounds {})",
            floor_vs_rxe.median_xroce().unwrap_or(f64::NAN),
            floor_vs_rxe.ratios_text()
        )
    })
}

/// The goal on 64 B `ib_send_lat` against raw AF_XDP, and its target.
const SEND_LAT_GOAL: &str = "64 B ib_send_lat vs raw AF_XDP one-way";
const UDP_LAT_GOAL: &str = "64 B ib_send_lat vs kernel UDP one-way";
const UDP_WRITE_GOAL: &str = "ib_write_bw 64 KiB vs kernel UDP 4 KiB datagrams";
const UDP_WRITE_TARGET: f64 = 1.5;
const SEND_LAT_TARGET: f64 = 1.5;

/// Says why the goal `what` (if measured) is out of reach.
fn mark_out_of_reach(out: &mut [Goal], what: &str, why: String) {
    if let Some(g) = out.iter_mut().find(|g| g.what == what) {
        g.out_of_reach = Some(why);
    }
}

fn r_value(r: &Report, section: &str, test: &str, size: u64) -> Option<f64> {
    r.value(section, test, size, "xroce")
}

/// Compiles `bench/c/qp_scale.c` next to this executable.
fn compile_qp_scale() -> Result<PathBuf, String> {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("c/qp_scale.c");
    let exe = std::env::current_exe()
        .map_err(|e| e.to_string())?
        .with_file_name("qp_scale");
    let out = std::process::Command::new("cc")
        .args(["-O2", "-Wall", "-Werror", "-o"])
        .arg(&exe)
        .arg(&source)
        .arg("-libverbs")
        .output()
        .map_err(|e| format!("cannot run cc: {e}"))?;
    if out.status.success() {
        Ok(exe)
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

fn machine() -> String {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_default();
    format!("{cpus} CPUs, {cpu}, kernel {}", capture("uname", &["-r"]))
}

fn capture(program: &str, args: &[&str]) -> String {
    std::process::Command::new(program)
        .args(args)
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

fn fail(what: &str, e: impl std::fmt::Display) -> ! {
    eprintln!("suite: {what}: {e}");
    xroce_bench::interrupt::exit(1);
}

#[cfg(test)]
mod tests {
    use super::*;
    use guests::{GuestNumbers, PingTimes};

    fn lat(send_lat_us: f64) -> GuestNumbers {
        GuestNumbers {
            send_lat_us,
            send_lat_p99_us: f64::NAN,
            send_lat_min_us: f64::NAN,
            write_bw_mb_s: f64::NAN,
            write_bw_vcpu_cores: [f64::NAN; 2],
        }
    }

    /// A run's losses come from the receiver's socket drops (both kinds) and frames, and the
    /// sender's NAKs, timeouts and tail probes; the note gives medians over the runs and each
    /// run's share.
    #[test]
    fn the_scale_note_tells_what_the_receiving_socket_dropped() {
        let stats = |pairs: &[(&str, u64)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), *v))
                .collect::<std::collections::BTreeMap<_, _>>()
        };
        let run = Run {
            server: String::new(),
            client: String::new(),
            cpu_s: 0.0,
            wall_s: 0.0,
            server_stats: stats(&[
                ("rx_dropped_other", 7),
                ("rx_dropped_ring_full", 3),
                ("rx_frames", 90),
                ("seq_naks_sent", 2),
            ]),
            client_stats: stats(&[
                ("seq_naks_received", 2),
                ("timeouts", 1),
                ("tail_probes", 6),
                ("send_window_cuts", 4),
                ("rx_frames", 5),
            ]),
        };
        let loss = Loss::of(&run);
        assert_eq!(
            loss,
            Loss {
                dropped: 10,
                received: 90,
                seq_naks: 2,
                timeouts: 1,
                tail_probes: 6,
                window_cuts: 4,
            }
        );
        assert!((loss.dropped_share() - 0.1).abs() < 1e-12);
        assert_eq!(Loss::default().dropped_share(), 0.0);

        assert_eq!(Loss::note(256, &[]), None);
        let runs = [
            Loss {
                dropped: 10,
                received: 990,
                seq_naks: 5,
                timeouts: 0,
                tail_probes: 1,
                window_cuts: 5,
            },
            Loss {
                dropped: 30,
                received: 970,
                seq_naks: 9,
                timeouts: 4,
                tail_probes: 3,
                window_cuts: 8,
            },
            Loss {
                dropped: 20,
                received: 980,
                seq_naks: 7,
                timeouts: 2,
                tail_probes: 2,
                window_cuts: 6,
            },
        ];
        let note = Loss::note(256, &runs).expect("a note");
        assert!(note.contains("with 256 QPs"), "{note}");
        assert!(note.contains("medians of 3 runs"), "{note}");
        assert!(note.contains("dropped 20 frames a run, 2.00 %"), "{note}");
        assert!(note.contains("(runs: 1.00 %, 3.00 %, 2.00 %)"), "{note}");
        assert!(
            note.contains(
                "on 7 sequence NAKs and 2 retransmission timeouts a run; tail-loss probes a run: \
                 2; send windows halved a run: 6."
            ),
            "{note}"
        );
        let one = Loss::note(
            1,
            &[Loss {
                received: 500,
                ..Loss::default()
            }],
        )
        .expect("a note");
        assert!(
            one.contains("with 1 QP (the engines' counters, medians of 1 run)"),
            "{one}"
        );
        assert!(one.contains("dropped 0 frames a run, 0.00 %"), "{one}");
    }

    fn floor(p50: f64) -> Option<(PingTimes, &'static str)> {
        Some((PingTimes { p50, min: p50 }, "as one UDP batch"))
    }

    #[test]
    fn the_guests_floor_is_set_against_rdma_rxe_of_its_own_round() {
        // rdma_rxe's latency drifts from round to round and the floor with it: each round's
        // floor above half its rdma_rxe, though the medians of the two would say otherwise
        // (floor median 130 µs against rdma_rxe's 300).
        let rounds = [
            (lat(240.0), lat(200.0)),
            (lat(300.0), lat(200.0)),
            (lat(320.0), lat(200.0)),
        ];
        let floors = [floor(125.0), floor(155.0), floor(130.0)];
        let why = guest_latency_out_of_reach(&rounds, &floors).expect("out of reach");
        assert!(why.contains("0.52×"), "{why}");
        assert!(why.contains("rounds 0.52, 0.52, 0.41"), "{why}");
        assert!(why.contains("floor 130 µs"), "{why}");
        // Below half in most rounds: within reach.
        let floors = [floor(110.0), floor(140.0), floor(150.0)];
        assert_eq!(guest_latency_out_of_reach(&rounds, &floors), None);
    }

    #[test]
    fn below_kernel_udp_is_out_of_reach_only_when_rcs_floor_is_not() {
        let rounds = |pairs: &[(f64, f64)]| {
            let mut p = Paired::default();
            for &(floor, udp) in pairs {
                p.push(Some(floor), Some(udp));
            }
            p
        };
        // Kernel UDP awake in two rounds of three, at or below the floor's one-way there.
        let awake = rounds(&[(2.10, 2.00), (2.20, 30.0), (2.10, 2.05)]);
        let why = udp_latency_out_of_reach(&awake).expect("out of reach");
        assert!(why.contains("is 1.02× kernel UDP's one-way"), "{why}");
        assert!(why.contains("(rounds 1.05, 0.07, 1.02)"), "{why}");
        // The floor just below kernel UDP's: a stack at the floor would meet the goal.
        let reachable = rounds(&[(2.00, 2.10), (2.00, 30.0), (2.00, 2.20)]);
        assert_eq!(udp_latency_out_of_reach(&reachable), None);
        assert_eq!(udp_latency_out_of_reach(&Paired::default()), None);
    }

    #[test]
    fn the_write_goal_against_kernel_udp_is_out_of_reach_only_when_both_floors_are_below_it() {
        // (raw AF_XDP to a reading receiver, UDP GSO floor, kernel UDP) per round, MB/s.
        let rounds = |rows: &[(Option<f64>, Option<f64>, f64)]| {
            let mut p = Paired::default();
            for &(reading, gso, udp) in rows {
                p.push(better_floor(reading, gso), Some(udp));
            }
            p
        };
        // One floor at 1.5× kernel UDP in every round: a stack at that floor meets the goal.
        let reachable = rounds(&[
            (Some(2800.0), Some(3000.0), 2000.0),
            (Some(3100.0), Some(2900.0), 2000.0),
            (Some(2900.0), Some(3000.0), 2000.0),
        ]);
        assert_eq!(write_vs_udp_out_of_reach(&reachable), None);
        // Both below it in two rounds of three; a failed floor leaves the other alone.
        let below = rounds(&[
            (Some(2800.0), Some(2900.0), 2000.0),
            (Some(3200.0), Some(2600.0), 2000.0),
            (None, Some(2700.0), 2000.0),
        ]);
        let why = write_vs_udp_out_of_reach(&below).expect("out of reach");
        assert!(why.contains("is 1.45× kernel UDP"), "{why}");
        assert!(why.contains("(rounds 1.45, 1.60, 1.35)"), "{why}");
        assert_eq!(write_vs_udp_out_of_reach(&Paired::default()), None);
        assert_eq!(better_floor(None, None), None);
    }

    #[test]
    fn a_round_without_its_floor_is_left_out_and_none_decides_nothing() {
        let rounds = [(lat(200.0), lat(150.0)), (lat(200.0), lat(150.0))];
        let why = guest_latency_out_of_reach(&rounds, &[None, floor(110.0)]).expect("out of reach");
        assert!(why.contains("rounds 0.55)"), "{why}");
        assert_eq!(guest_latency_out_of_reach(&rounds, &[None, None]), None);
    }
}
