//! `cargo xtask bench datapath`: xroce over AF_XDP next to raw AF_XDP and kernel UDP, on one
//! veth pair between two network namespaces, in one run, reported as ratios.
//!
//! - ping-pong: 64-byte messages bounced N times; round-trip time p50/p99.
//!   xroce: RC SEND/RECV, timed from the post to the answer's receive completion, with each
//!   side taking its SENDs' completions as they come (nothing waits for more than the answer,
//!   as in the raw and UDP ping-pongs), and again with each SEND's ACK awaited before the next
//!   step (perftest's `ib_send_lat` pattern); raw AF_XDP: a UDP frame echoed by the peer's
//!   socket (and with two frames per turn, RC's answer and ACK); kernel UDP:
//!   `send_to`/`recv_from`.
//! - streaming: 4 KiB and 64 KiB messages one way for a fixed time; delivered bytes per second.
//!   xroce: RC WRITE with 64 outstanding; raw AF_XDP: frames of the same payload size
//!   (path MTU 4096 → one frame per 4 KiB, two descriptors each); kernel UDP: datagrams of the
//!   same size.
//!
//! The comparisons with raw AF_XDP run in rounds (5, or `XROCE_BENCH_ROUNDS`), xroce and raw
//! AF_XDP back to back in each, in alternating order: this host's path drifts by tens of
//! percent within a minute, and a ratio of two numbers measured back to back carries much less
//! of that than one of numbers measured a minute apart (see `xroce_bench::paired`). The table
//! gives the medians over the rounds, each ratio as the median of the rounds' ratios, and the
//! rounds' ratios themselves. Kernel UDP, far from the goals, is measured once.
//!
//! Needs root. Timings are noisy; only ratios from one run mean anything.

use std::net::Ipv4Addr;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use xroce_bench::baseline::{self, RoundTrip, Sink};
use xroce_bench::cpu::CpuTime;
use xroce_bench::paired::{self, Paired};
use xroce_core::transport::memory::{Access, MemoryRegion, PdId};
use xroce_core::transport::qp::{QpAttr, QpCap, QpInit};
use xroce_core::transport::verbs::{RecvWr, SendOp, SendWr, SgList, Sge, WcStatus};
use xroce_core::transport::{AddressVector, AttrMask, CqId, QpState, QpType};
use xroce_core::wire::IpAddress;
use xroce_datapath::engine::{Engine, EngineConfig, Transmit};
use xroce_datapath::netns::NetnsPair;
use xroce_datapath::xdp;

const PINGS: usize = 20_000;

/// How long each streaming measurement runs: 2 s, or `XROCE_BENCH_SECS`.
fn stream_for() -> Duration {
    static FOR: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *FOR.get_or_init(|| {
        let secs = std::env::var("XROCE_BENCH_SECS")
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .filter(|s| *s > 0.0)
            .unwrap_or(2.0);
        Duration::from_secs_f64(secs)
    })
}

const USAGE: &str = "usage: datapath   (root; run by `cargo xtask bench datapath`)

xroce's engine over AF_XDP next to raw AF_XDP and kernel UDP on one veth pair (MTU 9000)
between two network namespaces it creates: a 64 B ping-pong and 4 KiB / 64 KiB streams,
printed as a Markdown table with ratios. The comparisons with raw AF_XDP run in rounds,
both back to back in each; ratios are medians of the rounds' ratios. About a minute.

Environment:
  XROCE_BENCH_ROUNDS rounds of the comparisons with raw AF_XDP (default 5)
  XROCE_BENCH_SECS   seconds per stream (default 2)
  XROCE_BENCH_ONLY   pingpong | stream-4k | stream-64k: only xroce's part (for profiling);
                     raw-stream-4k: only raw AF_XDP's 4 KiB stream;
                     raw-stream-4k-reading: the same with a receiver that reads
                     each frame (CRC-32 and a copy, as a RoCE receiver must);
                     raw-stream-64: raw AF_XDP's 64 B packet rate and its sender's
                     CPU per frame (next to `ib_send_bw -s 64`);
                     raw-messages-1, raw-messages-256: raw AF_XDP moving 64 KiB
                     messages between 1 or 256 pairs of buffers, copied and
                     checked as a RoCE stack must (next to `ib_write_bw -q 1/256`);
                     gso-messages-1, gso-messages-256: the same messages sent as
                     xroce's engines send a WRITE's packets (the first alone, then
                     15 in a UDP GSO batch) to a raw AF_XDP receiver";

/// The parts `XROCE_BENCH_ONLY` can pick.
const BENCH_PARTS: [&str; 10] = [
    "pingpong",
    "stream-4k",
    "stream-64k",
    "raw-stream-4k",
    "raw-stream-4k-reading",
    "raw-messages-1",
    "raw-messages-256",
    "gso-messages-1",
    "gso-messages-256",
    "raw-stream-64",
];

fn main() {
    run();
    // Not `return`: a clean-up after Ctrl-C, under way on another thread, must end first.
    xroce_bench::interrupt::exit(0);
}

fn run() {
    // The loader's warnings (and `XROCE_LOG`'s more) reach stderr.
    xroce_datapath::stderr_log::install();
    match std::env::args().nth(1).as_deref() {
        None => {}
        Some("-h" | "--help") => {
            println!("{USAGE}");
            return;
        }
        Some(other) => {
            eprintln!("datapath: unknown argument {other:?}\n{USAGE}");
            std::process::exit(2);
        }
    }
    // Checked before anything is set up: a typo must not cost a minute and leave no table.
    if let Ok(only) = std::env::var("XROCE_BENCH_ONLY") {
        if !BENCH_PARTS.contains(&only.as_str()) {
            eprintln!(
                "datapath: XROCE_BENCH_ONLY={only:?} is not one of {}",
                BENCH_PARTS.join(", ")
            );
            std::process::exit(2);
        }
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("datapath bench: needs root (namespaces, XDP)");
        std::process::exit(1);
    }
    xroce_bench::interrupt::remove_namespaces_when_interrupted("datapath bench");
    let pair = NetnsPair::new(xroce_bench::interrupt::NAMESPACE_PREFIX, 9000).expect("namespaces");
    for side in 0..2 {
        let iface = pair.iface(side).to_string();
        pair.run_in(side, move || {
            xdp::load(&xdp::LoadOptions::new(&iface)).expect("load XDP");
        });
    }
    // Warm ARP both ways so no method pays for resolution.
    let _ = pair.exec(0, &format!("ping -c 1 -W 1 {}", pair.ipv4(1)));

    // Profiling aid: XROCE_BENCH_ONLY=pingpong|stream-4k|stream-64k runs just xroce's part,
    // raw-stream-4k and raw-stream-64 just the baseline's streams.
    if let Ok(only) = std::env::var("XROCE_BENCH_ONLY") {
        match only.as_str() {
            "pingpong" => eprintln!(
                "xroce RTT p50/p99 {:?} µs (each SEND's ACK awaited: {:?} µs)",
                xroce_pingpong(&pair, SendAcks::Reaped),
                xroce_pingpong(&pair, SendAcks::Awaited)
            ),
            "stream-4k" | "stream-64k" => {
                let size = if only == "stream-4k" { 4096 } else { 65536 };
                let cpu0 = CpuTime::process();
                let (mbs, sender) = xroce_write_stream(&pair, size);
                let cpu = CpuTime::process().minus(cpu0).total_s();
                let gb = mbs * stream_for().as_secs_f64() / 1000.0;
                eprintln!(
                    "xroce {} KiB {mbs:.0} MB/s, {:.2} CPU s per GB; {}",
                    size / 1024,
                    cpu / gb,
                    per_frame(sender, mbs)
                );
            }
            // The baseline alone, to profile next to xroce's stream.
            "raw-stream-4k" | "raw-stream-4k-reading" => {
                let sink = if only == "raw-stream-4k" {
                    Sink::Counting
                } else {
                    Sink::Reading
                };
                let s = baseline::xsk_stream(&pair, 4096, stream_for(), sink);
                eprintln!(
                    "raw AF_XDP 4 KiB ({sink:?} receiver) {:.0} MB/s; {}",
                    s.mb_per_s,
                    per_frame(s.sender_cpu, s.mb_per_s)
                );
            }
            "raw-stream-64" => {
                let s = baseline::xsk_stream(&pair, 64, stream_for(), Sink::Counting);
                let frames = s.mb_per_s * 1e6 * stream_for().as_secs_f64() / 64.0;
                eprintln!(
                    "raw AF_XDP 64 B {:.3} M/s; sender user {:.3} µs kernel {:.3} µs per frame",
                    frames / stream_for().as_secs_f64() / 1e6,
                    s.sender_cpu.user_s * 1e6 / frames,
                    s.sender_cpu.sys_s * 1e6 / frames
                );
            }
            "raw-messages-1" | "raw-messages-256" | "gso-messages-1" | "gso-messages-256" => {
                let messages = if only.ends_with("-1") { 1 } else { 256 };
                let (s, how) = if only.starts_with("raw") {
                    (
                        baseline::xsk_message_stream(&pair, messages, stream_for()),
                        "raw AF_XDP",
                    )
                } else {
                    (
                        baseline::udp_gso_message_stream(&pair, messages, stream_for()),
                        "UDP GSO batches to raw AF_XDP,",
                    )
                };
                eprintln!(
                    "{how} 64 KiB messages between {messages} pair(s) of buffers {:.0} MB/s \
                     ({} damaged frames); {}",
                    s.mb_per_s,
                    s.damaged,
                    per_frame(s.sender_cpu, s.mb_per_s)
                );
            }
            other => unreachable!("XROCE_BENCH_ONLY {other:?} was checked on start"),
        }
        return;
    }
    let rounds = rounds();
    let mut rows: Vec<(String, String, f64, String)> = Vec::new();
    eprintln!("==> ping-pong, 64 B ({PINGS} round trips each)");
    let udp_rtt = rt(baseline::udp_pingpong(&pair, 64, PINGS));
    eprintln!(
        "    kernel UDP   p50 {:.1} µs  p99 {:.1} µs",
        udp_rtt.0, udp_rtt.1
    );
    // Raw AF_XDP (one frame per turn, two, and one with an ACK-sized frame trailing it) and
    // xroce (both ways) back to back in each round; the order alternates (see
    // `xroce_bench::paired`).
    let mut pings: Vec<PingRound> = Vec::new();
    for round in 0..rounds {
        eprintln!("  round {} of {rounds}", round + 1);
        let raw = |pair: &NetnsPair| {
            let one = rt(baseline::xsk_pingpong(pair, 64, PINGS));
            eprintln!("    raw AF_XDP   p50 {:.1} µs  p99 {:.1} µs", one.0, one.1);
            let two = rt(baseline::xsk_pingpong_turns(pair, 64, PINGS, 2));
            eprintln!(
                "    raw AF_XDP, 2 frames per turn (RC's answer + ACK)   p50 {:.1} µs  p99 {:.1} µs",
                two.0, two.1
            );
            let trailing = rt(baseline::xsk_pingpong_trailing_ack(pair, 64, PINGS));
            eprintln!(
                "    raw AF_XDP, answer + trailing ACK-sized frame   p50 {:.1} µs  p99 {:.1} µs",
                trailing.0, trailing.1
            );
            let checked = rt(baseline::xsk_pingpong_checked(pair, 64, PINGS));
            eprintln!(
                "    raw AF_XDP, 2 frames per turn, each CRC-32'd and checked   p50 {:.1} µs  p99 {:.1} µs",
                checked.0, checked.1
            );
            (one, two, trailing, checked)
        };
        let xroce = |pair: &NetnsPair| {
            let reaped = xroce_pingpong(pair, SendAcks::Reaped);
            eprintln!(
                "    xroce RC SEND p50 {:.1} µs  p99 {:.1} µs",
                reaped.0, reaped.1
            );
            let awaited = xroce_pingpong(pair, SendAcks::Awaited);
            eprintln!(
                "    xroce RC SEND, each SEND's ACK awaited (perftest's pattern)   p50 {:.1} µs  p99 {:.1} µs",
                awaited.0, awaited.1
            );
            (reaped, awaited)
        };
        let ((reaped, awaited), (raw, raw2, raw_trailing, raw2_checked)) =
            paired::in_order(paired::xroce_first(round), || xroce(&pair), || raw(&pair));
        pings.push(PingRound {
            raw,
            raw2,
            raw_trailing,
            raw2_checked,
            reaped,
            awaited,
        });
    }
    let ping = |f: fn(&PingRound) -> (f64, f64), base: fn(&PingRound) -> (f64, f64), p99: bool| {
        let mut c = Paired::default();
        for r in &pings {
            let (x, b) = (f(r), base(r));
            if p99 {
                c.push(Some(x.1), Some(b.1));
            } else {
                c.push(Some(x.0), Some(b.0));
            }
        }
        c
    };
    let raw1 = |r: &PingRound| r.raw;
    let raw2 = |r: &PingRound| r.raw2;
    let raw_trailing = |r: &PingRound| r.raw_trailing;
    let raw2_checked = |r: &PingRound| r.raw2_checked;
    let reaped = |r: &PingRound| r.reaped;
    let awaited = |r: &PingRound| r.awaited;
    let median_of = |v: Vec<f64>| paired::median(v).unwrap_or(f64::NAN);
    let raw_p50 = median_of(pings.iter().map(|r| r.raw.0).collect());
    let raw_p99 = median_of(pings.iter().map(|r| r.raw.1).collect());
    let raw2_vs_raw = ping(raw2, raw1, false);
    let trailing_vs_raw = ping(raw_trailing, raw1, false);
    let reaped_vs_raw = ping(reaped, raw1, false);
    let reaped_vs_trailing = ping(reaped, raw_trailing, false);
    let awaited_vs_raw = ping(awaited, raw1, false);
    let awaited_vs_raw2 = ping(awaited, raw2, false);
    let checked_vs_raw = ping(raw2_checked, raw1, false);
    let awaited_vs_checked = ping(awaited, raw2_checked, false);
    let reaped_p99 = ping(reaped, raw1, true);
    let awaited_p99 = ping(awaited, raw1, true);
    let xroce_p50 = reaped_vs_raw.median_xroce().unwrap_or(f64::NAN);
    rows.push((
        "64 B ping-pong RTT p50 (µs)".into(),
        "kernel UDP".into(),
        udp_rtt.0,
        String::new(),
    ));
    rows.push(("".into(), "raw AF_XDP".into(), raw_p50, String::new()));
    rows.push((
        "".into(),
        "raw AF_XDP, 2 frames per turn".into(),
        raw2_vs_raw.median_xroce().unwrap_or(f64::NAN),
        ratio(&raw2_vs_raw, "raw AF_XDP"),
    ));
    rows.push((
        "".into(),
        "raw AF_XDP, 2 frames per turn, each CRC-32'd and checked".into(),
        checked_vs_raw.median_xroce().unwrap_or(f64::NAN),
        ratio(&checked_vs_raw, "raw AF_XDP"),
    ));
    rows.push((
        "".into(),
        "raw AF_XDP, answer + trailing ACK-sized frame".into(),
        trailing_vs_raw.median_xroce().unwrap_or(f64::NAN),
        ratio(&trailing_vs_raw, "raw AF_XDP"),
    ));
    rows.push((
        "".into(),
        "xroce RC SEND".into(),
        xroce_p50,
        format!(
            "{}, {:.2}× kernel UDP; {}",
            ratio(&reaped_vs_raw, "raw AF_XDP"),
            xroce_p50 / udp_rtt.0,
            ratio(&reaped_vs_trailing, "raw with a trailing ACK")
        ),
    ));
    rows.push((
        "".into(),
        "xroce RC SEND, each SEND's ACK awaited".into(),
        awaited_vs_raw.median_xroce().unwrap_or(f64::NAN),
        format!(
            "{}, {}, {}",
            ratio(&awaited_vs_raw, "raw AF_XDP"),
            ratio(&awaited_vs_raw2, "raw with 2 frames per turn"),
            ratio(&awaited_vs_checked, "raw with 2 checked frames per turn")
        ),
    ));
    rows.push((
        "64 B ping-pong RTT p99 (µs)".into(),
        "kernel UDP".into(),
        udp_rtt.1,
        String::new(),
    ));
    rows.push(("".into(), "raw AF_XDP".into(), raw_p99, String::new()));
    rows.push((
        "".into(),
        "xroce RC SEND".into(),
        reaped_p99.median_xroce().unwrap_or(f64::NAN),
        ratio(&reaped_p99, "raw AF_XDP"),
    ));
    rows.push((
        "".into(),
        "xroce RC SEND, each SEND's ACK awaited".into(),
        awaited_p99.median_xroce().unwrap_or(f64::NAN),
        ratio(&awaited_p99, "raw AF_XDP"),
    ));

    for size in [4096usize, 65536] {
        eprintln!(
            "==> streaming {size} B messages for {:?} each",
            stream_for()
        );
        // A UDP datagram carries at most 65507 bytes: kernel UDP streams the same bytes as
        // 4 KiB datagrams (one per 4 KiB frame, as xroce and raw AF_XDP put them on the wire).
        let udp = baseline::udp_stream(&pair, size.min(4096), stream_for()).mb_per_s;
        eprintln!("    kernel UDP   {:.0} MB/s", udp);
        let (mut vs_raw, mut vs_reading) = (Paired::default(), Paired::default());
        for round in 0..rounds {
            eprintln!("  round {} of {rounds}", round + 1);
            // The same payload as xroce puts on the wire: 4 KiB per frame (path MTU 4096);
            // with a receiver that only counts the frames, then with one that reads them.
            let raw = |pair: &NetnsPair| {
                let mut mb_per_s = [0.0; 2];
                let mut order = [
                    (0, Sink::Counting, "raw AF_XDP  "),
                    (1, Sink::Reading, "raw, reading"),
                ];
                // Which receiver goes first alternates too.
                if round % 2 == 1 {
                    order.reverse();
                }
                for (at, sink, label) in order {
                    let raw = baseline::xsk_stream(pair, size.min(4096), stream_for(), sink);
                    eprintln!(
                        "    {label} {:.0} MB/s  {}",
                        raw.mb_per_s,
                        per_frame(raw.sender_cpu, raw.mb_per_s)
                    );
                    mb_per_s[at] = raw.mb_per_s;
                }
                mb_per_s
            };
            let xroce = |pair: &NetnsPair| {
                let (roce, roce_cpu) = xroce_write_stream(pair, size);
                eprintln!(
                    "    xroce WRITE  {:.0} MB/s  {}",
                    roce,
                    per_frame(roce_cpu, roce)
                );
                roce
            };
            let (roce, [counting, reading]) =
                paired::in_order(paired::xroce_first(round), || xroce(&pair), || raw(&pair));
            vs_raw.push(Some(roce), Some(counting));
            vs_reading.push(Some(roce), Some(reading));
        }
        let roce = vs_raw.median_xroce().unwrap_or(f64::NAN);
        let what = format!("stream {} KiB (MB/s delivered)", size / 1024);
        rows.push((what, "kernel UDP".into(), udp, String::new()));
        rows.push((
            "".into(),
            "raw AF_XDP".into(),
            vs_raw.median_baseline().unwrap_or(f64::NAN),
            String::new(),
        ));
        rows.push((
            "".into(),
            READING_RECEIVER.into(),
            vs_reading.median_baseline().unwrap_or(f64::NAN),
            String::new(),
        ));
        rows.push((
            "".into(),
            "xroce RC WRITE".into(),
            roce,
            format!(
                "{}, {:.2}× kernel UDP; {}",
                ratio(&vs_raw, "raw AF_XDP"),
                roce / udp,
                ratio(&vs_reading, "the reading receiver")
            ),
        ));
    }
    println!("| measurement | method | value | ratio |");
    println!("|---|---|---:|---|");
    for (what, method, value, ratio) in rows {
        println!("| {what} | {method} | {value:.1} | {ratio} |");
    }
}

/// The raw AF_XDP stream whose receiver reads every frame as a RoCE receiver must (see
/// `baseline::Sink::Reading`).
const READING_RECEIVER: &str = "raw AF_XDP, receiver reads each frame (CRC-32 + copy)";

/// The sender's CPU per 4 KiB frame, user and kernel: where a stream's time goes.
fn per_frame(cpu: CpuTime, mb_per_s: f64) -> String {
    let frames = mb_per_s * 1e6 * stream_for().as_secs_f64() / 4096.0;
    if frames < 1.0 {
        return String::new();
    }
    format!(
        "sender CPU per 4 KiB frame: user {:.2} µs, kernel {:.2} µs",
        cpu.user_s * 1e6 / frames,
        cpu.sys_s * 1e6 / frames
    )
}

fn rt(r: RoundTrip) -> (f64, f64) {
    (r.p50, r.p99)
}

/// How many rounds compare xroce with raw AF_XDP: 5, or `XROCE_BENCH_ROUNDS`.
fn rounds() -> usize {
    std::env::var("XROCE_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(5)
}

/// One round of the ping-pongs: (p50, p99) in µs of each.
struct PingRound {
    raw: (f64, f64),
    raw2: (f64, f64),
    /// Raw AF_XDP with an ACK-sized frame behind each answer that nobody waits for.
    raw_trailing: (f64, f64),
    /// Raw AF_XDP with two frames per turn, each CRC-32'd by its sender and checked by its
    /// receiver: the floor of any RC stack.
    raw2_checked: (f64, f64),
    reaped: (f64, f64),
    awaited: (f64, f64),
}

/// "1.47× raw AF_XDP (rounds 1.45, 1.52, 1.47)": the median of the rounds' ratios to `of`,
/// and each round's.
fn ratio(c: &Paired, of: &str) -> String {
    format!(
        "{:.2}× {of} (rounds {})",
        c.median_ratio().unwrap_or(f64::NAN),
        c.ratios_text()
    )
}

// ---------------------------------------------------------------- xroce

struct Side {
    engine: Engine,
    _mem: Vec<u8>,
    mr: MemoryRegion,
    qpn: u32,
    send_cq: CqId,
    recv_cq: CqId,
}

#[derive(Clone, Copy)]
struct Peer {
    qpn: u32,
    ip: Ipv4Addr,
    va: u64,
    rkey: u32,
}

fn xroce_side(iface: &str, ip: Ipv4Addr, len: usize) -> Side {
    let mut config = EngineConfig::new(iface);
    // As a program's engine would: XROCE_TRANSMIT picks the transmit path (auto by default).
    config.transmit = Transmit::from_env().unwrap_or_else(|e| panic!("{e}"));
    let engine = Engine::start(config).expect("engine");
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        eprintln!(
            "    (xroce's engines send {})",
            if engine.sends_through_udp_gso() {
                "runs of frames in batches through a UDP socket (UDP GSO) where the link takes them"
            } else {
                "every frame through AF_XDP"
            }
        )
    });
    let pd: PdId = engine.with_device(|d| d.alloc_pd());
    let mut mem = vec![0u8; len];
    let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    // SAFETY: `mem` lives in `Side` with the engine and is never reallocated; the engine is
    // dropped first (field order).
    let (_, mr) = unsafe { engine.reg_mr(pd, mem.as_mut_ptr(), len, access) }.expect("reg_mr");
    let (qpn, send_cq, recv_cq) = engine.with_device(|d| {
        let send_cq = d.create_cq(4096).expect("cq");
        let recv_cq = d.create_cq(4096).expect("cq");
        let qpn = d
            .create_qp(QpInit {
                ty: QpType::Rc,
                pd,
                send_cq,
                recv_cq,
                srq: None,
                cap: QpCap {
                    max_send_wr: 256,
                    max_recv_wr: 256,
                    max_send_sge: 1,
                    max_recv_sge: 1,
                    max_inline_data: 64,
                },
                sq_sig_all: false,
            })
            .expect("qp");
        (qpn, send_cq, recv_cq)
    });
    let a = QpAttr {
        state: QpState::Init,
        port_num: 1,
        access,
        ..QpAttr::default()
    };
    engine
        .modify_qp(
            qpn,
            &a,
            AttrMask::STATE | AttrMask::PKEY_INDEX | AttrMask::PORT | AttrMask::ACCESS_FLAGS,
        )
        .expect("INIT");
    let _ = ip;
    Side {
        engine,
        _mem: mem,
        mr,
        qpn,
        send_cq,
        recv_cq,
    }
}

fn connect(side: &Side, me: Ipv4Addr, peer: Peer) {
    let me = IpAddress::V4(me.into());
    let sgid_index = side
        .engine
        .gids()
        .iter()
        .position(|g| *g == Some(me))
        .expect("own GID") as u8;
    let mut a = QpAttr {
        state: QpState::Rtr,
        // 4096, or 2048 on a kernel without AF_XDP multi-buffer.
        path_mtu: side.engine.with_device(|d| d.port_mtu()),
        dest_qpn: peer.qpn,
        rq_psn: 0,
        max_dest_rd_atomic: 16,
        min_rnr_timer: 1,
        av: Some(AddressVector {
            dgid: IpAddress::V4(peer.ip.into()),
            sgid_index,
            traffic_class: 0,
            hop_limit: 64,
            flow_label: 0,
        }),
        ..QpAttr::default()
    };
    side.engine
        .modify_qp(
            side.qpn,
            &a,
            AttrMask::STATE
                | AttrMask::AV
                | AttrMask::PATH_MTU
                | AttrMask::DEST_QPN
                | AttrMask::RQ_PSN
                | AttrMask::MAX_DEST_RD_ATOMIC
                | AttrMask::MIN_RNR_TIMER,
        )
        .expect("RTR");
    a.state = QpState::Rts;
    a.sq_psn = 0;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.max_rd_atomic = 16;
    side.engine
        .modify_qp(
            side.qpn,
            &a,
            AttrMask::STATE
                | AttrMask::SQ_PSN
                | AttrMask::TIMEOUT
                | AttrMask::RETRY_CNT
                | AttrMask::RNR_RETRY
                | AttrMask::MAX_QP_RD_ATOMIC,
        )
        .expect("RTS");
}

/// A one-entry scatter/gather list over `len` bytes at `off` in the side's region, held
/// inline (no allocation per work request, as none is made by a C application's
/// `ibv_post_send`).
fn sge(side: &Side, off: usize, len: usize) -> SgList {
    SgList::from_slice(&[Sge {
        addr: side.mr.va + off as u64,
        length: len as u32,
        lkey: side.mr.lkey,
    }])
}

/// Runs `server` in namespace 1 and `client` in namespace 0, each with a connected RC QP.
fn xroce_pair<R: Send + 'static>(
    pair: &NetnsPair,
    len: usize,
    server: impl FnOnce(&Side, Peer) + Send + 'static,
    client: impl FnOnce(&Side, Peer) -> R + Send + 'static,
) -> R {
    let (a, b) = (pair.ipv4(0), pair.ipv4(1));
    let (ia, ib) = (pair.iface(0).to_string(), pair.iface(1).to_string());
    let (to_client, from_server) = mpsc::channel::<Peer>();
    let (to_server, from_client) = mpsc::channel::<Peer>();
    // Each side: set up, tell the other its QP and memory, learn the other's, connect.
    fn meet(
        iface: &str,
        ip: Ipv4Addr,
        len: usize,
        tx: mpsc::Sender<Peer>,
        rx: mpsc::Receiver<Peer>,
    ) -> (Side, Peer) {
        let side = xroce_side(iface, ip, len);
        let me = Peer {
            qpn: side.qpn,
            ip,
            va: side.mr.va,
            rkey: side.mr.rkey,
        };
        tx.send(me).ok();
        let peer = rx.recv().expect("the other side's endpoint");
        connect(&side, ip, peer);
        (side, peer)
    }
    let s = pair.spawn_in(1, move || {
        let (side, peer) = meet(&ib, b, len, to_client, from_client);
        server(&side, peer);
    });
    let r = pair.run_in(0, move || {
        let (side, peer) = meet(&ia, a, len, to_server, from_server);
        client(&side, peer)
    });
    s.join().expect("server side");
    r
}

fn wait_one(side: &Side, cq: CqId) {
    let mut wcs = Vec::with_capacity(1);
    let t = Instant::now();
    loop {
        if side.engine.poll_cq(cq, 1, &mut wcs).expect("poll") > 0 {
            assert_eq!(wcs[0].status, WcStatus::Success, "{:?}", wcs[0]);
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(5), "completion lost");
        std::hint::spin_loop();
    }
}

/// How a ping-pong side treats the completions of its own SENDs (all are signaled).
#[derive(Clone, Copy, PartialEq)]
enum SendAcks {
    /// Takes them as they come and moves on when its answer arrives, as a request/response
    /// application does: the same exchange as the raw and UDP ping-pongs, where nothing waits
    /// for more than the answer. At most `MAX_UNREAPED_SENDS` stay untaken.
    Reaped,
    /// Waits for each SEND's completion (its ACK) before the next step, as perftest's
    /// `ib_send_lat` does: the ACK frame behind each answer is then on the turn's path.
    Awaited,
}

/// SENDs a [`SendAcks::Reaped`] side leaves uncompleted before it waits for one.
const MAX_UNREAPED_SENDS: usize = 8;

/// After posting a SEND: wait for its completion, or take what completions are there.
/// `unreaped` counts this side's SENDs not yet completed.
fn after_send(side: &Side, acks: SendAcks, unreaped: &mut usize) {
    *unreaped += 1;
    if acks == SendAcks::Reaped {
        let mut wcs = Vec::with_capacity(MAX_UNREAPED_SENDS);
        let n = side
            .engine
            .poll_cq(side.send_cq, MAX_UNREAPED_SENDS, &mut wcs)
            .expect("poll");
        for wc in &wcs {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        }
        *unreaped -= n;
    }
    let keep = if acks == SendAcks::Reaped {
        MAX_UNREAPED_SENDS - 1
    } else {
        0
    };
    while *unreaped > keep {
        wait_one(side, side.send_cq);
        *unreaped -= 1;
    }
}

/// 64 B SEND ping-pong, `PINGS` round trips timed at the client from its post to its
/// receive completion: p50 and p99 in µs. The SEND buffer is reused once the answer is in
/// (the peer had the request then, so it is never read again for a retransmission).
fn xroce_pingpong(pair: &NetnsPair, acks: SendAcks) -> (f64, f64) {
    let recv = |side: &Side| {
        side.engine
            .post_recv(
                side.qpn,
                RecvWr {
                    wr_id: 0,
                    sg_list: sge(side, 0, 64),
                },
            )
            .expect("recv");
    };
    let send = |side: &Side| {
        side.engine
            .post_send(side.qpn, SendWr::new(0, SendOp::Send, sge(side, 64, 64)))
            .expect("send");
    };
    let rtts = xroce_pair(
        pair,
        4096,
        move |side, _| {
            let mut unreaped = 0;
            recv(side);
            for _ in 0..PINGS {
                wait_one(side, side.recv_cq);
                recv(side);
                send(side);
                after_send(side, acks, &mut unreaped);
            }
            for _ in 0..unreaped {
                wait_one(side, side.send_cq);
            }
        },
        move |side, _| {
            let mut rtts = Vec::with_capacity(PINGS);
            let mut unreaped = 0;
            for _ in 0..PINGS {
                recv(side);
                let t = Instant::now();
                send(side);
                wait_one(side, side.recv_cq);
                rtts.push(t.elapsed().as_secs_f64() * 1e6);
                after_send(side, acks, &mut unreaped);
            }
            for _ in 0..unreaped {
                wait_one(side, side.send_cq);
            }
            if std::env::var_os("XROCE_BENCH_DEBUG").is_some() {
                eprintln!(
                    "client counters {:?} wakeups {}",
                    side.engine.with_device(|d| d.counters()),
                    side.engine.counters().wakeups.load(Ordering::Relaxed)
                );
            }
            rtts
        },
    );
    rt(RoundTrip::from_samples(rtts))
}

/// Streams WRITEs of `size` bytes for `stream_for()`: MB/s delivered, and the CPU of the
/// sending (posting and polling) thread.
fn xroce_write_stream(pair: &NetnsPair, size: usize) -> (f64, CpuTime) {
    const WINDOW: usize = 64;
    let len = size * WINDOW;
    let (done_tx, done_rx) = mpsc::channel::<()>();
    xroce_pair(
        pair,
        len,
        move |_, _| {
            done_rx.recv().ok();
        },
        move |side, peer| {
            let mut posted = 0usize;
            let mut completed = 0usize;
            let mut wcs = Vec::with_capacity(WINDOW);
            let t = Instant::now();
            let cpu = CpuTime::thread();
            // The clock is read once per refill, as the raw AF_XDP sender reads it once per
            // batch of frames.
            let mut sending = true;
            while sending || completed < posted {
                sending = t.elapsed() < stream_for();
                while sending && posted - completed < WINDOW {
                    let slot = posted % WINDOW;
                    side.engine
                        .post_send(
                            side.qpn,
                            SendWr::new(
                                posted as u64,
                                SendOp::RdmaWrite {
                                    remote_addr: peer.va + (slot * size) as u64,
                                    rkey: peer.rkey,
                                },
                                sge(side, slot * size, size),
                            ),
                        )
                        .expect("post WRITE");
                    posted += 1;
                }
                wcs.clear();
                completed += side
                    .engine
                    .poll_cq(side.send_cq, WINDOW, &mut wcs)
                    .expect("poll");
                for wc in &wcs {
                    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
                }
            }
            let elapsed = t.elapsed();
            let cpu = CpuTime::thread().minus(cpu);
            if std::env::var_os("XROCE_BENCH_DEBUG").is_some() {
                eprintln!(
                    "client counters {:?} engine tx {} rx {} wakeups {}",
                    side.engine.with_device(|d| d.counters()),
                    side.engine.counters().tx_frames.load(Ordering::Relaxed),
                    side.engine.counters().rx_frames.load(Ordering::Relaxed),
                    side.engine.counters().wakeups.load(Ordering::Relaxed)
                );
            }
            done_tx.send(()).ok();
            ((completed * size) as f64 / elapsed.as_secs_f64() / 1e6, cpu)
        },
    )
}
