//! rdma_rxe↔rdma_rxe next to xroce↔xroce in identical QEMU guests on one bridge: the same two
//! guests (a Debian kernel, 1 vCPU under the same emulation) run perftest over their rdma_rxe
//! devices, then over xroce devices on the same interfaces, in alternating rounds. Which
//! kernel matters to rdma_rxe, the kernel's own code: the suite compares on Debian 13's
//! (the current release's rdma_rxe) and on Debian 12's (an older one, this machine's). Emulated CPUs
//! make the absolute numbers meaningless; the ratio between the two stacks is what counts, and
//! the emulation's speed drifts with what else the host runs: one pair of runs moved the ratio
//! between 0.75 and 1.35 on the same build, so each number is the median of several rounds.

use std::cell::RefCell;
use std::path::Path;
use std::time::{Duration, Instant};

use xroce_datapath::netns;
use xroce_rxe_peer::{
    default_cache_dir, ensure_image_for, run_pair, Guest, GuestConfig, GuestKernel, Lab, Output,
    PairOutput, Recovery,
};

use crate::perftest::{parse_bw, parse_lat};

/// Longest one perftest run may take inside the guests.
const RUN_TIMEOUT: Duration = Duration::from_secs(240);
/// perftest's TCP port for exchanging QP details.
const PERFTEST_PORT: u16 = 18515;

/// What both stacks did in the guests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GuestNumbers {
    /// `ib_send_lat` 64 B, median, µs.
    pub send_lat_us: f64,
    pub send_lat_p99_us: f64,
    /// Its minimum: the cost of the path itself, without scheduling delays.
    pub send_lat_min_us: f64,
    /// `ib_write_bw` 64 KiB, MB/s.
    pub write_bw_mb_s: f64,
    /// Host CPU the guests' vCPU threads used while `ib_write_bw` ran, in cores (CPU seconds
    /// per second): the receiving guest's, then the sending guest's. A vCPU that computes all
    /// the time uses a whole core, so less says the guest spent the rest waiting (on QEMU's
    /// emulated devices, or idle). NaN where it could not be read.
    pub write_bw_vcpu_cores: [f64; 2],
}

/// Rounds of the comparison; each runs both stacks (rdma_rxe first in the first round, xroce
/// first in the second, and so on), then RC's floor. rdma_rxe's own latency moved by a third
/// between the three rounds of one run (Debian 12's), so five.
pub const ROUNDS: usize = 5;

/// The comparison: each stack's median over [`ROUNDS`] rounds (each number's own median), and
/// every round's numbers.
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    /// The guests' kernel release (`uname -r`).
    pub kernel_version: String,
    pub rxe: GuestNumbers,
    pub xroce: GuestNumbers,
    /// (rdma_rxe, xroce) of each round, in order.
    pub rounds: Vec<(GuestNumbers, GuestNumbers)>,
    /// RC's floor in each round, measured right after the round's two stacks, in order: a
    /// floor set against rdma_rxe measured minutes away would carry the emulation's drift.
    pub floors: Vec<RcFloor>,
    /// What went wrong in a run and was recovered from by running it again (a guest whose
    /// kernel panicked or whose link stalled), one line each.
    pub incidents: Vec<String>,
    /// What the path carries at all: raw streams of 1 KiB UDP payloads from one guest to an
    /// AF_XDP receiver in the other, or why they could not be measured.
    pub raw_stream_mb_s: Result<RawStreams, String>,
    /// The path's floor for latency: raw AF_XDP ping-pong between the guests, one-way p50 in
    /// µs, with one frame per turn (UD's exchange) and with two (RC's: the answer and an
    /// ACK), measured once after the rounds, or why it could not be measured.
    pub raw_one_way_us: Result<RawOneWay, String>,
}

impl Comparison {
    /// RC's floor each way as the median of the rounds that measured it (p50 and minimum
    /// each their own median), or the first round's error when none did.
    pub fn floor_medians(&self) -> RcFloor {
        let median = |way: fn(&RcFloor) -> &Result<PingTimes, String>| {
            let measured: Vec<PingTimes> = self
                .floors
                .iter()
                .filter_map(|f| way(f).as_ref().ok().copied())
                .collect();
            let of = |v: fn(&PingTimes) -> f64| {
                crate::paired::median(measured.iter().map(v).collect()).unwrap_or(f64::NAN)
            };
            if measured.is_empty() {
                Err(self
                    .floors
                    .iter()
                    .find_map(|f| way(f).as_ref().err().cloned())
                    .unwrap_or_else(|| "no round measured it".to_string()))
            } else {
                Ok(PingTimes {
                    p50: of(|t| t.p50),
                    min: of(|t| t.min),
                })
            }
        };
        RcFloor {
            through_xdp: median(|f| &f.through_xdp),
            batched: median(|f| &f.batched),
        }
    }
}

/// Raw streams between the guests (MB/s received by an AF_XDP receiver that counts frames).
#[derive(Debug, Clone, PartialEq)]
pub struct RawStreams {
    /// Sent through AF_XDP's copy mode, which notifies the guest's virtio-net device for
    /// every frame.
    pub copy_mode: f64,
    /// Sent through a kernel UDP socket in batches (UDP GSO), one notification per batch, as
    /// xroce's engines send runs of frames there: the better of [`BATCHED_RUNS`] runs, or why
    /// none could be measured.
    pub batched: Result<f64, String>,
}

impl RawStreams {
    /// The most a sender put on the path.
    pub fn ceiling(&self) -> f64 {
        match self.batched {
            Ok(batched) => self.copy_mode.max(batched),
            Err(_) => self.copy_mode,
        }
    }
}

/// Runs of the batched raw stream (its rate under TCG varied by half from run to run).
pub const BATCHED_RUNS: usize = 2;

/// One-way latencies of raw AF_XDP ping-pong between the guests, µs.
#[derive(Debug, Clone, PartialEq)]
pub struct RawOneWay {
    pub one_frame: PingTimes,
    pub two_frames: PingTimes,
}

/// RC's floor for any RoCE stack between the guests, one-way: raw ping-pong of RC's two
/// frames per turn, each numbered and given a CRC-32 by the sender and checked by the
/// receiver (the ICRC's work), sent two ways: through AF_XDP, or as one UDP GSO send (one
/// notification of the virtio device); each, or why it could not be measured.
#[derive(Debug, Clone, PartialEq)]
pub struct RcFloor {
    pub through_xdp: Result<PingTimes, String>,
    pub batched: Result<PingTimes, String>,
}

impl RcFloor {
    /// The lower of the two ways, with how it was sent, if either was measured.
    pub fn lower(&self) -> Option<(PingTimes, &'static str)> {
        [
            (&self.through_xdp, "through AF_XDP"),
            (&self.batched, "as one UDP batch"),
        ]
        .into_iter()
        .filter_map(|(t, how)| t.as_ref().ok().map(|t| (*t, how)))
        .min_by(|a, b| a.0.p50.total_cmp(&b.0.p50))
    }
}

/// Median and minimum of a ping-pong's one-way latency, µs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PingTimes {
    pub p50: f64,
    pub min: f64,
}

/// UDP payload of the raw stream: 1 KiB, the payload of a full RoCE packet at path MTU 1024.
pub const RAW_PAYLOAD: usize = 1024;

/// Runs the comparison in two guests booting `kernel`.
pub fn compare(
    bin_dir: &Path,
    kernel: GuestKernel,
    say: &mut dyn FnMut(&str),
) -> Result<Comparison, String> {
    let image = ensure_image_for(&default_cache_dir(), kernel, say).map_err(|e| e.to_string())?;
    let kernel_version = image.kernel_version.clone();
    // Named with the benchmarks' prefix, so that an interrupted run removes it, and made
    // only while the run is not being interrupted (as its namespace pairs are).
    let lab = netns::unless_refused(|| {
        // What a benchmark killed outright left (its guests may still be running).
        netns::remove_orphaned_namespaces(crate::interrupt::NAMESPACE_PREFIX);
        Lab::new(
            crate::interrupt::NAMESPACE_PREFIX,
            1500,
            image,
            bin_dir.join("xroce-guest-agent"),
        )
    })
    .map_err(|e| e.to_string())?
    .map_err(|e| e.to_string())?;
    let guests = (0..2u8)
        .map(|i| {
            let mut c = GuestConfig::rxe(&format!("bench{i}"), 30 + i);
            c.extra_files = ["xroce", "libxroce_provider.so", "guest-stream"]
                .iter()
                .map(|f| (bin_dir.join(f), format!("/opt/xroce/{f}")))
                .collect();
            c
        })
        .collect();
    say(&format!(
        "booting two identical guests, kernel {kernel_version} (rdma_rxe and xroce in each)"
    ));
    let g = lab.boot_all(guests).map_err(|e| e.to_string())?;
    let incidents = RefCell::new(Vec::new());
    let mut rounds = Vec::with_capacity(ROUNDS);
    let mut floors = Vec::with_capacity(ROUNDS);
    for round in 1..=ROUNDS {
        // The order alternates, as on the host, so that neither always runs second.
        let xroce_first = crate::paired::xroce_first(round - 1);
        let first = measure_stack_recovering(&lab, &g, xroce_first, round, &incidents, say)?;
        let second = measure_stack_recovering(&lab, &g, !xroce_first, round, &incidents, say)?;
        rounds.push(if xroce_first {
            (second, first)
        } else {
            (first, second)
        });
        say(&format!(
            "round {round}/{ROUNDS}: RC's floor, raw ping-pong of two frames each CRC-32'd and \
             checked"
        ));
        floors.push(round_floor(&lab, &g, &incidents, say));
    }
    xroce_link(&g, "add xr0 netdev eth0")?;
    say("raw streams between the guests (what their path carries at all)");
    let raw_stream_mb_s = raw_recovering(&lab, &g, &incidents, say, &mut || raw_stream(&g, "send"))
        .map(|copy_mode| {
            let batched = (0..BATCHED_RUNS).try_fold(f64::NAN, |best, _| {
                raw_recovering(&lab, &g, &incidents, say, &mut || {
                    raw_stream(&g, "send-batched")
                })
                .map(|run| best.max(run))
            });
            RawStreams { copy_mode, batched }
        });
    say("raw AF_XDP ping-pong between the guests (the floor of their round trip)");
    let raw_one_way_us = raw_recovering(&lab, &g, &incidents, say, &mut || raw_pingpong(&g, 1, ""))
        .and_then(|one_frame| {
            let two_frames =
                raw_recovering(&lab, &g, &incidents, say, &mut || raw_pingpong(&g, 2, ""))?;
            Ok(RawOneWay {
                one_frame,
                two_frames,
            })
        });
    xroce_link(&g, "del xr0")?;
    Ok(Comparison {
        kernel_version,
        rxe: median_numbers(rounds.iter().map(|r| r.0)),
        xroce: median_numbers(rounds.iter().map(|r| r.1)),
        rounds,
        floors,
        incidents: incidents.into_inner(),
        raw_stream_mb_s,
        raw_one_way_us,
    })
}

/// RC's floor between the guests, both ways. A floor that could not be measured is that
/// round's error, not the comparison's: the round's goal ratio leaves it out. The xroce
/// devices are taken away again in each guest on its own, whatever happened (a guest that
/// died keeps none; the next stack's run boots it again), so that rdma_rxe's next run meets
/// no XDP program.
fn round_floor(lab: &Lab, g: &[Guest], incidents: &RefCell<Vec<String>>, say: Say<'_>) -> RcFloor {
    // guest-stream registers its socket in the XDP program's map, which `link add` loads.
    let floor = match xroce_link(g, "add xr0 netdev eth0") {
        Ok(()) => {
            let mut checked = |words: &str| {
                raw_recovering(lab, g, incidents, say, &mut || raw_pingpong(g, 2, words))
            };
            RcFloor {
                through_xdp: checked("checked"),
                batched: checked("checked batched"),
            }
        }
        Err(e) => RcFloor {
            through_xdp: Err(e.clone()),
            batched: Err(e),
        },
    };
    remove_xroce_devices(g);
    floor
}

/// Removes the xroce device in each guest on its own, errors ignored (a guest may have none,
/// or may have died): what is left of a run that failed, or may have.
fn remove_xroce_devices(g: &[Guest]) {
    for guest in g {
        let _ = guest.run("/opt/xroce/xroce link del xr0", RUN_TIMEOUT);
    }
}

/// [`recovering`] for a raw baseline between the guests (`guest-stream`). A guest booted again
/// has lost its xroce device: it comes back, in each guest on its own (in the others the add
/// fails because the device is there, which must not keep it from the guest that lost it).
fn raw_recovering<T>(
    lab: &Lab,
    g: &[Guest],
    incidents: &RefCell<Vec<String>>,
    say: Say<'_>,
    run: &mut dyn FnMut() -> Result<T, String>,
) -> Result<T, String> {
    let readd_device = || {
        for guest in g {
            let _ = sh(guest, "/opt/xroce/xroce link add xr0 netdev eth0");
        }
    };
    recovering(
        lab,
        g,
        &RAW_PROGRAMS,
        incidents,
        say,
        &mut |_| run(),
        &readd_device,
    )
}

/// The perftest programs [`measure`] runs in the guests.
const PROGRAMS: [&str; 2] = ["ib_send_lat", "ib_write_bw"];
/// The program the raw baselines run in the guests.
const RAW_PROGRAMS: [&str; 1] = ["guest-stream"];

/// [`measure_stack`], run a second time if it failed because a guest's link stalled (see
/// [`recovering`]); a failed xroce run's devices are removed before the second.
fn measure_stack_recovering(
    lab: &Lab,
    g: &[Guest],
    xroce: bool,
    round: usize,
    incidents: &RefCell<Vec<String>>,
    say: &mut dyn FnMut(&str),
) -> Result<GuestNumbers, String> {
    let remove_devices = || {
        if xroce {
            // The failed run may have left the xroce devices behind.
            remove_xroce_devices(g);
        }
    };
    recovering(
        lab,
        g,
        &PROGRAMS,
        incidents,
        say,
        &mut |say| measure_stack(g, xroce, round, say),
        &remove_devices,
    )
}

/// Where progress lines go.
type Say<'a> = &'a mut dyn FnMut(&str);

/// `run`, run a second time if it failed because qemu stopped taking a guest's frames
/// ([`Guest::transmit_stalls`], seen twice in about 345 runs of `ib_read_bw` at full speed)
/// or a guest's kernel panicked (its qemu ends; Debian 13's rdma_rxe did, in its receive path,
/// once in the suite's first runs): the stalled guest's link is taken down and up again (or,
/// if it still does not answer, the guest booted again), a panicked guest booted again, what
/// is left of `programs` in both guests killed, and `tidy` called first; each such incident
/// is added to `incidents`. A failure without either, or a second one, is returned with both
/// guests' consoles.
fn recovering<T>(
    lab: &Lab,
    g: &[Guest],
    programs: &[&str],
    incidents: &RefCell<Vec<String>>,
    say: &mut dyn FnMut(&str),
    run: &mut dyn FnMut(Say<'_>) -> Result<T, String>,
    tidy: &dyn Fn(),
) -> Result<T, String> {
    let stalls: Vec<usize> = g.iter().map(Guest::transmit_stalls).collect();
    let with_reports = |e: String| -> String { g.iter().fold(e, |e, guest| e + &guest.report()) };
    let failure = match run(say) {
        Ok(value) => return Ok(value),
        Err(failure) => failure,
    };
    // A guest whose kernel panicked (qemu runs with -no-reboot, so it ends): booted again.
    let panicked: Vec<&Guest> = g.iter().filter(|guest| !guest.qemu_alive()).collect();
    // A stall the guest's kernel reported, or one it did not report but that left the guest
    // answering nothing (see `Guest::answers`).
    let stalled: Vec<&Guest> = g
        .iter()
        .zip(&stalls)
        .filter(|(guest, before)| {
            guest.qemu_alive()
                && (guest.transmit_stalls() > **before || !guest.answers(Duration::from_secs(15)))
        })
        .map(|(guest, _)| guest)
        .collect();
    if stalled.is_empty() && panicked.is_empty() {
        return Err(with_reports(failure));
    }
    for guest in &panicked {
        let report = guest.report();
        let incident = format!(
            "guest {}'s kernel panicked ({}) during: {}",
            guest.name(),
            panic_lines(&report),
            failure.lines().next().unwrap_or("")
        );
        say(&format!(
            "{incident}; booting it again, then running it again"
        ));
        guest
            .restart(lab)
            .map_err(|e| format!("{failure}{report}\nthen restarting the guest: {e}"))?;
        incidents.borrow_mut().push(incident);
    }
    for guest in &stalled {
        incidents.borrow_mut().push(format!(
            "guest {}'s link stalled during: {}",
            guest.name(),
            failure.lines().next().unwrap_or("")
        ));
        say(&format!(
            "qemu stopped taking guest {}'s frames (its transmit queue timed out, or it \
             stopped answering); taking its link down and up (booting it again if that is not \
             enough), then running it again",
            guest.name()
        ));
        let how = guest
            .recover(lab)
            // Its error carries the guest's report already.
            .map_err(|e| format!("{failure}\nthen: {e}"))?;
        if let Recovery::Restarted(why) = how {
            say(&format!("guest {} was booted again: {why}", guest.name()));
        }
    }
    for guest in g {
        guest
            .kill_programs(programs)
            .map_err(|e| with_reports(format!("{failure}\nthen: {e}")))?;
    }
    tidy();
    run(say).map_err(|e| with_reports(format!("{e}\n(a second run, after: {failure})")))
}

/// The lines of a guest's report (its console's end) that say where its kernel panicked.
fn panic_lines(report: &str) -> String {
    let lines: Vec<&str> = report
        .lines()
        .map(str::trim)
        .map(|l| l.split_once("] ").map_or(l, |(_, rest)| rest))
        .filter(|l| {
            l.starts_with("RIP: ") || l.starts_with("Kernel panic") || l.starts_with("BUG: ")
        })
        .take(3)
        .collect();
    if lines.is_empty() {
        "its qemu ended".to_string()
    } else {
        lines.join("; ")
    }
}

/// One stack's numbers in one round: xroce's (its XDP program attached only for its own runs,
/// so that rdma_rxe's packets never pass through it) or rdma_rxe's.
fn measure_stack(
    g: &[Guest],
    xroce: bool,
    round: usize,
    say: &mut dyn FnMut(&str),
) -> Result<GuestNumbers, String> {
    if !xroce {
        say(&format!("round {round}/{ROUNDS}: rdma_rxe <-> rdma_rxe"));
        return measure(g, "", "rxe0", Stack::RdmaRxe, say);
    }
    xroce_link(g, "add xr0 netdev eth0")?;
    say(&format!("round {round}/{ROUNDS}: xroce <-> xroce"));
    let n = measure(g, "/opt/xroce/xroce exec -- ", "xr0", Stack::Xroce, say);
    let removed = xroce_link(g, "del xr0");
    // A failed run's own error says more than the removal's that followed it.
    let n = n?;
    removed?;
    Ok(n)
}

/// Turns of the raw ping-pong, as many as `ib_send_lat` makes in [`measure`].
const RAW_PINGS: usize = 2000;

/// `guest-stream ping` from the second guest to `guest-stream echo` in the first, 64 B
/// messages (as `ib_send_lat` sends) and `frames` frames per turn, both given `words`
/// (`checked`, `batched`: see `guest-stream`); half the round trips, as perftest reports
/// one-way latency.
fn raw_pingpong(g: &[Guest], frames: usize, words: &str) -> Result<PingTimes, String> {
    let (_, pinged) = guest_stream_pair(
        g,
        &format!(
            "echo eth0 {} {} 64 {frames} {words}",
            g[0].ipv4(),
            g[1].ipv4()
        ),
        &format!(
            "ping eth0 {} {} 64 {frames} {RAW_PINGS} {words}",
            g[1].ipv4(),
            g[0].ipv4()
        ),
    )?;
    parse_ping_line(&pinged)
        .map(|rtt| PingTimes {
            p50: rtt.p50 / 2.0,
            min: rtt.min / 2.0,
        })
        .ok_or_else(|| format!("no result from guest-stream ping: {pinged}"))
}

/// `guest-stream LISTENER_ARGS` in the first guest and, once it had time to bind its socket
/// under emulation, `guest-stream SENDER_ARGS` in the second; both must succeed. Returns their
/// standard outputs. (The listener counts or answers from the first frame on, so starting
/// late only costs the sender frames that have no effect.) When one guest's kernel panics,
/// the other's side is stopped rather than waited on ([`run_pair`]).
fn guest_stream_pair(
    g: &[Guest],
    listener_args: &str,
    sender_args: &str,
) -> Result<(String, String), String> {
    let listener_cmd = format!("/opt/xroce/guest-stream {listener_args}");
    let sender_cmd = format!("/opt/xroce/guest-stream {sender_args}");
    let out = run_pair(
        [&g[0], &g[1]],
        [&listener_cmd, &sender_cmd],
        RUN_TIMEOUT,
        || {
            std::thread::sleep(Duration::from_secs(2));
            Ok(())
        },
        &RAW_PROGRAMS,
    )?;
    both_outputs(g, [&listener_cmd, &sender_cmd], out)
}

/// The p50 and minimum round trips (µs) of `guest-stream ping`'s line:
/// `round trips N of COUNT: p50 X us p99 Y us min Z us`, if at least half the turns were
/// answered.
fn parse_ping_line(out: &str) -> Option<PingTimes> {
    let line = out.lines().find(|l| l.starts_with("round trips "))?;
    let (counts, times) = line.strip_prefix("round trips ")?.split_once(": ")?;
    let (n, of) = counts.split_once(" of ")?;
    let (n, of): (usize, usize) = (n.parse().ok()?, of.parse().ok()?);
    if n == 0 || n * 2 < of {
        return None;
    }
    let value = |name: &str| -> Option<f64> {
        let words: Vec<&str> = times.split_whitespace().collect();
        let at = words.iter().position(|w| *w == name)?;
        words.get(at + 1)?.parse().ok()
    };
    Some(PingTimes {
        p50: value("p50")?,
        min: value("min")?,
    })
}

/// `guest-stream SENDER` (`send` or `send-batched`) from the second guest to the first for
/// 5 s; the receiver's MB/s.
fn raw_stream(g: &[Guest], sender: &str) -> Result<f64, String> {
    let (received, _) = guest_stream_pair(
        g,
        &format!("recv eth0 {} 60", g[1].ipv4()),
        &format!(
            "{sender} eth0 {} {} {RAW_PAYLOAD} 5",
            g[1].ipv4(),
            g[0].ipv4()
        ),
    )?;
    parse_stream_line(&received)
        .ok_or_else(|| format!("no result from guest-stream recv: {received}"))
}

/// The MB/s of `guest-stream recv`'s line: `received F frames, B bytes in S s: X MB/s`.
fn parse_stream_line(out: &str) -> Option<f64> {
    out.lines()
        .find(|l| l.starts_with("received "))?
        .rsplit(": ")
        .next()?
        .strip_suffix(" MB/s")?
        .trim()
        .parse()
        .ok()
}

/// Each number's median over the runs (the upper one of an even count). A run that measured
/// nothing for a number (zero, or NaN: perftest reported no bandwidth, say) is left out of
/// that number's median rather than pulling it down.
fn median_numbers(runs: impl Iterator<Item = GuestNumbers> + Clone) -> GuestNumbers {
    let median = |f: fn(&GuestNumbers) -> f64| {
        let mut v: Vec<f64> = runs
            .clone()
            .map(|n| f(&n))
            .filter(|v| v.is_finite() && *v > 0.0)
            .collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    GuestNumbers {
        send_lat_us: median(|n| n.send_lat_us),
        send_lat_p99_us: median(|n| n.send_lat_p99_us),
        send_lat_min_us: median(|n| n.send_lat_min_us),
        write_bw_mb_s: median(|n| n.write_bw_mb_s),
        write_bw_vcpu_cores: [
            median(|n| n.write_bw_vcpu_cores[0]),
            median(|n| n.write_bw_vcpu_cores[1]),
        ],
    }
}

/// `xroce link ARGS` in every guest.
fn xroce_link(g: &[Guest], args: &str) -> Result<(), String> {
    for guest in g {
        sh(guest, &format!("/opt/xroce/xroce link {args}"))?;
    }
    Ok(())
}

fn sh(g: &Guest, cmd: &str) -> Result<String, String> {
    stdout_of(g, cmd, g.run(cmd, RUN_TIMEOUT))
}

/// The standard output of `cmd` run in `g`, if it ran and succeeded.
fn stdout_of(
    g: &Guest,
    cmd: &str,
    out: xroce_rxe_peer::Result<xroce_rxe_peer::Output>,
) -> Result<String, String> {
    let out = out.map_err(|e| e.to_string())?;
    if out.success() {
        Ok(out.stdout)
    } else {
        Err(format!("{cmd} in {}: {}", g.name(), out.text()))
    }
}

/// Server in guest 0, client in guest 1; the client's standard output. When one guest's
/// kernel panics, the other's side is stopped rather than waited on ([`run_pair`]).
fn server_client(g: &[Guest], wrap: &str, program: &str) -> Result<String, String> {
    let server_cmd = format!("{wrap}{program}");
    let client_cmd = format!("{wrap}{program} {}", g[0].ipv4());
    let name = program.split_whitespace().next().unwrap_or(program);
    // perftest listens once its QP is ready; the guest's clock is slow, so wait for it.
    let out = run_pair(
        [&g[0], &g[1]],
        [&server_cmd, &client_cmd],
        RUN_TIMEOUT,
        || g[0].wait_listening(PERFTEST_PORT),
        &[name],
    )?;
    both_outputs(g, [&server_cmd, &client_cmd], out).map(|(_, client)| client)
}

/// The standard outputs of a [`run_pair`] whose sides both ran and succeeded. A side that
/// could not be waited on (its guest's qemu ended, say) is told before a side that failed,
/// which was then likely killed for it; of two failures, the second side's (the client's, the
/// sender's) is told first, as it usually says what went wrong between them.
fn both_outputs(
    g: &[Guest],
    commands: [&str; 2],
    out: PairOutput,
) -> Result<(String, String), String> {
    let first = out
        .first
        .map_err(|e| format!("{} in {}: {e}", commands[0], g[0].name()))?;
    let second = out
        .second
        .map_err(|e| format!("{} in {}: {e}", commands[1], g[1].name()))?;
    let failed = |i: usize, o: &Output| format!("{} in {}: {}", commands[i], g[i].name(), o.text());
    if !second.success() {
        return Err(failed(1, &second));
    }
    if !first.success() {
        return Err(failed(0, &first));
    }
    Ok((first.stdout, second.stdout))
}

/// The stack a run measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stack {
    RdmaRxe,
    Xroce,
}

fn measure(
    g: &[Guest],
    wrap: &str,
    dev: &str,
    stack: Stack,
    say: &mut dyn FnMut(&str),
) -> Result<GuestNumbers, String> {
    let lat = server_client(
        g,
        wrap,
        &format!("ib_send_lat -d {dev} -x 1 -F -s 64 -n 2000"),
    )?;
    let lat = parse_lat(&lat)
        .first()
        .copied()
        .ok_or_else(|| format!("no latency line in:\n{lat}"))?;
    let before = HostCpu::sample(g);
    let bw_output = server_client(g, wrap, &format!("ib_write_bw -d {dev} -x 1 -F -D 5"))?;
    let mut write_bw_vcpu_cores = before.cores_since(g);
    let bw = parse_bw(&bw_output)
        .first()
        .copied()
        .ok_or_else(|| format!("no bandwidth line in:\n{bw_output}"))?;
    if bw.mb_per_s.is_nan() || bw.mb_per_s <= 0.0 {
        // perftest ran to its end but counted nothing in its measured window.
        if stack == Stack::Xroce {
            // xroce moving nothing is what the comparison is there to catch.
            return Err(format!(
                "xroce's ib_write_bw moved nothing (it reported {} MB/s):\n{bw_output}",
                bw.mb_per_s
            ));
        }
        // The baseline's glitch (seen once, Debian 12's rdma_rxe): this round's bandwidth and
        // the CPU it took are left out (see `median_numbers`), not the whole comparison.
        say(&format!(
            "rdma_rxe's ib_write_bw reported {} MB/s; this round's bandwidth is left out. Its \
             output:\n{bw_output}",
            bw.mb_per_s
        ));
        write_bw_vcpu_cores = [f64::NAN; 2];
    }
    Ok(GuestNumbers {
        send_lat_us: lat.typical,
        send_lat_p99_us: lat.p99,
        send_lat_min_us: lat.min,
        write_bw_mb_s: bw.mb_per_s,
        write_bw_vcpu_cores,
    })
}

/// The CPU time the guests' vCPU threads had used at one moment.
struct HostCpu {
    at: Instant,
    spent: [Option<Duration>; 2],
}

impl HostCpu {
    fn sample(g: &[Guest]) -> HostCpu {
        HostCpu {
            at: Instant::now(),
            spent: [0, 1].map(|i| g.get(i).and_then(Guest::vcpu_time)),
        }
    }

    /// Cores each of the guests' vCPUs used on average since the sample.
    fn cores_since(&self, g: &[Guest]) -> [f64; 2] {
        let seconds = self.at.elapsed().as_secs_f64();
        [0, 1].map(
            |i| match (self.spent[i], g.get(i).and_then(Guest::vcpu_time)) {
                (Some(a), Some(b)) if seconds > 0.0 => b.saturating_sub(a).as_secs_f64() / seconds,
                _ => f64::NAN,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(lat: f64, bw: f64) -> GuestNumbers {
        GuestNumbers {
            send_lat_us: lat,
            send_lat_p99_us: lat * 10.0,
            send_lat_min_us: lat / 2.0,
            write_bw_mb_s: bw,
            write_bw_vcpu_cores: [bw / 100.0, lat / 100.0],
        }
    }

    #[test]
    fn the_stream_line_gives_its_rate() {
        let out = "received 1000 frames, 1024000 bytes in 0.500 s: 2.05 MB/s\n";
        assert_eq!(parse_stream_line(out), Some(2.05));
        assert_eq!(parse_stream_line("guest-stream: no frame\n"), None);
    }

    #[test]
    fn the_ping_line_gives_its_median_unless_most_turns_were_lost() {
        let out = "round trips 1990 of 2000: p50 181.5 us p99 950.0 us min 120.2 us\n";
        assert_eq!(
            parse_ping_line(out),
            Some(PingTimes {
                p50: 181.5,
                min: 120.2
            })
        );
        assert_eq!(
            parse_ping_line("round trips 900 of 2000: p50 181.5 us p99 950.0 us min 1.0 us\n"),
            None
        );
        assert_eq!(
            parse_ping_line("round trips 0 of 2000: p50 NaN us p99 NaN us min NaN us\n"),
            None
        );
        assert_eq!(parse_ping_line("guest-stream: no such interface\n"), None);
    }

    #[test]
    fn a_panic_is_told_by_where_the_kernel_was() {
        // From Debian 13's rdma_rxe guest in a suite run.
        let report = "\n--- guest bench0: qemu (pid 4068) has ended; console's last lines:\n\
            [   17.678363]  rxe_xmit_packet+0x27a/0x300 [rdma_rxe]\n\
            [   17.681349] ---[ end trace 0000000000000000 ]---\n\
            [   17.681644] RIP: 0010:net_rx_action+0xef/0x420\n\
            [   17.682192] RSP: 0018:ff609a4500003ea0 EFLAGS: 5074d412\n\
            [   17.683976] Kernel panic - not syncing: Fatal exception in interrupt\n";
        assert_eq!(
            panic_lines(report),
            "RIP: 0010:net_rx_action+0xef/0x420; Kernel panic - not syncing: Fatal exception in \
             interrupt"
        );
        assert_eq!(panic_lines("XROCE-READY bench0\n"), "its qemu ended");
    }

    #[test]
    fn the_floor_is_the_lower_way_and_each_way_takes_its_median_over_the_rounds() {
        let t = |p50: f64, min: f64| Ok(PingTimes { p50, min });
        let failed = || Err("guest-stream: no answer".to_string());
        let floors = vec![
            RcFloor {
                through_xdp: t(140.0, 118.0),
                batched: t(131.0, 110.0),
            },
            RcFloor {
                through_xdp: failed(),
                batched: t(125.0, 112.0),
            },
            RcFloor {
                through_xdp: t(136.0, 120.0),
                batched: failed(),
            },
        ];
        assert_eq!(floors[0].lower().map(|f| f.1), Some("as one UDP batch"));
        assert_eq!(
            floors[2].lower(),
            Some((
                PingTimes {
                    p50: 136.0,
                    min: 120.0
                },
                "through AF_XDP"
            ))
        );
        let c = Comparison {
            kernel_version: String::new(),
            rxe: n(1.0, 1.0),
            xroce: n(1.0, 1.0),
            rounds: Vec::new(),
            floors,
            incidents: Vec::new(),
            raw_stream_mb_s: Err(String::new()),
            raw_one_way_us: Err(String::new()),
        };
        // The rounds that measured a way, each number its own median; a failed round is
        // left out, not counted as zero.
        let m = c.floor_medians();
        assert_eq!(m.through_xdp, t(138.0, 119.0));
        assert_eq!(m.batched, t(128.0, 111.0));
        let none = Comparison {
            floors: vec![RcFloor {
                through_xdp: failed(),
                batched: failed(),
            }],
            ..c
        };
        assert_eq!(none.floor_medians().batched, failed());
        assert_eq!(none.floor_medians().lower(), None);
    }

    #[test]
    fn each_number_takes_its_own_median() {
        let runs = [n(300.0, 10.0), n(100.0, 30.0), n(200.0, 20.0)];
        let m = median_numbers(runs.iter().copied());
        assert_eq!(m.send_lat_us, 200.0);
        assert_eq!(m.send_lat_p99_us, 2000.0);
        assert_eq!(m.write_bw_mb_s, 20.0);
        // The median run of one number need not be the median run of another.
        let runs = [n(100.0, 10.0), n(200.0, 30.0), n(300.0, 20.0)];
        let m = median_numbers(runs.iter().copied());
        assert_eq!((m.send_lat_us, m.write_bw_mb_s), (200.0, 20.0));
        assert_eq!(m.write_bw_vcpu_cores, [0.2, 2.0]);
        // A run whose perftest counted no bandwidth is left out of that median, not taken as
        // the slowest (the upper of the two left).
        let runs = [n(100.0, 10.7), n(200.0, 10.5), n(300.0, 0.0)];
        let m = median_numbers(runs.iter().copied());
        assert_eq!((m.send_lat_us, m.write_bw_mb_s), (200.0, 10.7));
    }
}
