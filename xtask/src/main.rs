//! `cargo xtask`: project automation. Run `cargo xtask --help` for the list.
//!
//! The XDP commands (`cargo xtask xdp ...`) need the loader in `xroce-datapath`, which needs
//! clang to build; they live behind the `xdp` feature (see `Cargo.toml`), and the default build
//! re-runs itself with that feature when one of them is asked for.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

use clap::{Args, Parser, Subcommand, ValueEnum};

mod demo;
mod interrupt;
mod packages;
mod rxe_peer;
#[cfg(feature = "xdp")]
mod xdp;

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    bin_name = "cargo xtask",
    about = "xroce project automation"
)]
struct Cli {
    #[command(subcommand)]
    command: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Run everything CI runs: install missing Debian packages the tests need (as root), rustfmt
    /// check, clippy with warnings denied, and the whole test suite (about 25 minutes on 2 cores
    /// from a fresh clone, 16 of them the tests; the first run also downloads Debian's kernel
    /// packages for the rdma_rxe guests). This is the README's test command and what `.ci/run` calls. The
    /// XDP, namespace and guest tests need root: without it they fail, unless
    /// XROCE_SKIP_ROOT_TESTS=1 asks to skip them.
    Test,
    /// The main demo (root): installs what is missing, builds xroce, creates two network
    /// namespaces joined by a veth pair with an xroce device in each, runs the unmodified
    /// `ibv_rc_pingpong` and perftest `ib_write_bw` between them, prints their results, traces
    /// a short run to target/xroce-demo.pcap (XROCE_PCAP) and checks it with `xroce pcap
    /// check`, and removes everything again (also on failure or Ctrl-C). Under a minute once
    /// built.
    Demo,
    /// Build, load, unload and inspect the XDP steering program (xdp-prog/). Loading and
    /// unloading need root and act on the network namespace the command runs in (use
    /// `ip netns exec NS cargo xtask xdp ...` for an interface inside a namespace).
    Xdp(XdpArgs),
    /// Real rdma_rxe peers: Debian-kernel guests under QEMU on a bridge in a network
    /// namespace (root). `image` builds the guest image, `up` boots guests and leaves them
    /// running, `run` runs a command in one, `status` shows them, `down` removes them.
    #[command(subcommand)]
    RxePeer(rxe_peer::RxePeerCommand),
    /// The performance suite (root): perftest over xroce between two namespaces on a veth
    /// pair (latency, bandwidth at path MTU 1024 and 4096, message rate, many QPs, CPU per
    /// Gbit/s, idle CPU, memory) next to raw AF_XDP, kernel UDP and kernel TCP on the same pair,
    /// and rdma_rxe↔rdma_rxe next to xroce↔xroce in identical QEMU guests. Builds in release
    /// mode, takes about 13 minutes (5 rounds of the goals against raw AF_XDP, then 5 rounds in
    /// the guests of each of two kernels), and writes bench/results/perf.md and perf.svg.
    /// `cargo xtask bench datapath` runs the older engine-level comparison instead
    /// (bench/results/datapath.md).
    Bench {
        /// `datapath` for the engine-level comparison; nothing for the suite.
        #[arg(value_parser = ["datapath"])]
        what: Option<String>,
        /// Fewer sizes, 1-second runs, no guests: a quick look while optimising (results go
        /// to target/perf-quick/ instead of bench/results/).
        #[arg(long)]
        quick: bool,
        /// Skip the QEMU guest comparison.
        #[arg(long)]
        no_guests: bool,
    },
}

#[derive(Args)]
struct XdpArgs {
    #[command(subcommand)]
    command: XdpCommand,
}

// Without the `xdp` feature the arguments are only passed on to the re-run, never read.
#[cfg_attr(not(feature = "xdp"), allow(dead_code))]
#[derive(Subcommand)]
enum XdpCommand {
    /// Compile both builds of the XDP program (xroce_xdp.o and xroce_xdp_frags.o, with clang)
    /// and copy them to xdp-prog/build/.
    Build,
    /// Attach the program to an interface through a BPF link pinned under
    /// /sys/fs/bpf/xroce/<netns-id>/<iface>/ (it stays attached after this command exits), and
    /// pin its maps there for the engines. Loading it again changes nothing.
    Load {
        /// The interface, e.g. eth0.
        #[arg(long, value_name = "IF")]
        iface: String,
        /// Attach mode: auto (native where the driver takes it, else generic), native (in the
        /// driver; needed for zero-copy; fails on drivers without it) or generic (works with
        /// any driver, slower).
        #[arg(long, value_enum, default_value_t = ModeArg::Auto)]
        mode: ModeArg,
        /// Program build: plain (single-buffer, MTU up to 3506 in native mode) or frags
        /// (multi-buffer, any MTU). Default: chosen from the interface's MTU.
        #[arg(long, value_enum)]
        build: Option<BuildArg>,
    },
    /// Detach the program from an interface and remove its pins. Nothing loaded is not an
    /// error.
    Unload {
        /// The interface.
        #[arg(long, value_name = "IF")]
        iface: String,
    },
    /// Show what is attached (build, mode, ids, counters, drop knob, AF_XDP sockets), for one
    /// interface or for every interface of this network namespace that has an XDP program.
    Status {
        /// Only this interface.
        #[arg(long, value_name = "IF")]
        iface: Option<String>,
    },
    /// TEST ONLY: drop 1 in N RoCEv2 frames in the XDP program (0 turns it off).
    SetDrop {
        /// The interface.
        #[arg(long, value_name = "IF")]
        iface: String,
        /// N: 1 drops every RoCEv2 frame, 100 about 1 %, 0 none.
        #[arg(long, value_name = "N")]
        one_in: u32,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum ModeArg {
    /// Native where the driver takes it, else generic.
    Auto,
    /// Driver mode.
    Native,
    /// Generic (skb) mode.
    Generic,
}

#[derive(Clone, Copy, ValueEnum)]
enum BuildArg {
    /// Single-buffer build (section xdp).
    Plain,
    /// Multi-buffer build (section xdp.frags).
    Frags,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let root = workspace_root();
    let result = match cli.command {
        Task::Test => test(&root),
        Task::Demo => demo(&root),
        Task::Xdp(args) => run_xdp(&root, args.command),
        Task::RxePeer(command) => rxe_peer::run(&root, command),
        Task::Bench {
            what,
            quick,
            no_guests,
        } => match what.as_deref() {
            Some("datapath") if quick || no_guests => Err(
                "--quick and --no-guests are options of the suite; `bench datapath` has neither \
                 (it runs no guests, and XROCE_BENCH_ONLY=PART runs one part of it)"
                    .into(),
            ),
            Some("datapath") => bench(&root, "datapath"),
            _ => bench_suite(&root, quick, no_guests),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(feature = "xdp")]
fn run_xdp(root: &Path, command: XdpCommand) -> Result<(), String> {
    xroce_datapath::stderr_log::install();
    xdp::run(root, command)
}

/// Without the `xdp` feature: check that the loader can be built, then run this same command
/// through `cargo run -p xtask --features xdp` and exit with its status. Not `--quiet`: the first
/// time, that builds aya and the XDP program, and the progress should show.
#[cfg(not(feature = "xdp"))]
fn run_xdp(root: &Path, _command: XdpCommand) -> Result<(), String> {
    const GUARD: &str = "XROCE_XTASK_XDP_REEXEC";
    if std::env::var_os(GUARD).is_some() {
        return Err("internal: re-run with --features xdp did not enable the feature".into());
    }
    packages::check_xdp_build_deps()?;
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let status = Command::new(cargo())
        .args(["run", "--package", "xtask", "--features", "xdp", "--"])
        .args(&args)
        .env(GUARD, "1")
        .current_dir(root)
        .status()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    // The child printed its own messages.
    std::process::exit(status.code().unwrap_or(1));
}

fn workspace_root() -> PathBuf {
    // xtask/ lives directly under the workspace root.
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Runs one step, printing what it does and how long it took.
pub(crate) fn step(root: &Path, what: &str, program: &str, args: &[&str]) -> Result<(), String> {
    step_with_env(root, what, &[], program, args)
}

/// [`step`] with environment variables set for the program (and shown).
pub(crate) fn step_with_env(
    root: &Path,
    what: &str,
    env: &[(&str, &str)],
    program: &str,
    args: &[&str],
) -> Result<(), String> {
    let shown: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v} ")).collect();
    println!("==> {what}: {}{program} {}", shown.concat(), args.join(" "));
    let start = Instant::now();
    let status = Command::new(program)
        .args(args)
        .envs(env.iter().copied())
        .current_dir(root)
        .status()
        .map_err(|e| format!("{what}: cannot run {program}: {e}"))?;
    println!(
        "==> {what}: {} in {:.1} s",
        if status.success() { "ok" } else { "FAILED" },
        start.elapsed().as_secs_f64()
    );
    if status.success() {
        Ok(())
    } else {
        Err(format!("{what} failed ({status})"))
    }
}

pub(crate) fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string())
}

fn test(root: &Path) -> Result<(), String> {
    packages::ensure_test_packages()?;
    let cargo = cargo();
    step(root, "format", &cargo, &["fmt", "--all", "--", "--check"])?;
    step(
        root,
        "lint",
        &cargo,
        &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ],
    )?;
    // The workspace lint builds xtask without its `xdp` feature; lint those commands too.
    step(
        root,
        "lint (xtask xdp commands)",
        &cargo,
        &[
            "clippy",
            "--package",
            "xtask",
            "--all-targets",
            "--features",
            "xdp",
            "--",
            "-D",
            "warnings",
        ],
    )?;
    // The end-to-end tests run the `xroce` binary and load the provider library from
    // target/debug; build every target first so they exist whichever test runs first.
    step(root, "build", &cargo, &["build", "--workspace"])?;
    step(root, "tests", &cargo, &["test", "--workspace"])?;
    dpdk_port_checks(root, &cargo)?;
    println!("==> all checks passed");
    Ok(())
}

/// The DPDK port (cargo feature `dpdk`, off by default): lint, then its end-to-end tests,
/// which need the provider built with the feature (the build replaces target/debug's provider
/// library with one that also has the DPDK port, which runs everything the default one does).
fn dpdk_port_checks(root: &Path, cargo: &str) -> Result<(), String> {
    const PACKAGES: [&str; 6] = [
        "--package",
        "xroce-datapath",
        "--package",
        "xroce-provider",
        "--package",
        "xroce-cli",
    ];
    let with = |args: &[&'static str], tail: &[&'static str]| {
        let mut all = args.to_vec();
        all.extend(PACKAGES);
        all.extend(["--features", "dpdk"]);
        all.extend(tail);
        all
    };
    step(
        root,
        "lint (DPDK port)",
        cargo,
        &with(&["clippy", "--all-targets"], &["--", "-D", "warnings"]),
    )?;
    step(root, "build (DPDK port)", cargo, &with(&["build"], &[]))?;
    step(
        root,
        "tests (DPDK port)",
        cargo,
        &with(
            &[
                "test",
                "--lib",
                "--test",
                "engine_netns",
                "--test",
                "ibverbs_programs",
            ],
            &["dpdk"],
        ),
    )?;
    // Every rdma-core example and perftest program against rdma_rxe again, xroce's side on
    // the DPDK port (the programs inherit XROCE_BACKEND; the provider built above has it).
    step_with_env(
        root,
        "rdma_rxe interop (DPDK port)",
        &[("XROCE_BACKEND", "dpdk")],
        cargo,
        &[
            "test",
            "--package",
            "xroce-rxe-peer",
            "--test",
            "interop",
            "programs_interoperate_at_mtu_1500",
        ],
    )
}

/// `cargo xtask bench`: builds xroce, the provider, the guest agent and the suite in release
/// mode and runs the suite.
fn bench_suite(root: &Path, quick: bool, no_guests: bool) -> Result<(), String> {
    if !packages::is_root() {
        return Err("the benchmarks create network namespaces and load XDP: run as root".into());
    }
    packages::ensure_test_packages()?;
    step(
        root,
        "build (release)",
        &cargo(),
        &[
            "build",
            "--release",
            "-p",
            "xroce-cli",
            "-p",
            "xroce-provider",
            "-p",
            "xroce-rxe-peer",
            "-p",
            "xroce-bench",
        ],
    )?;
    let mut cmd = Command::new(root.join("target/release/suite"));
    cmd.current_dir(root)
        .env("XROCE_COMMIT", measured_commit(root));
    if quick {
        cmd.args(["--quick", "--out", "target/perf-quick"]);
    } else if no_guests {
        cmd.arg("--no-guests");
    }
    println!("==> run: target/release/suite (progress below)");
    let (status, _) =
        run_benchmark(cmd, false).map_err(|e| format!("cannot run the suite: {e}"))?;
    if status.success() {
        Ok(())
    } else if interrupt::was_interrupted() {
        Err("interrupted".into())
    } else {
        Err(format!("the suite failed ({status})"))
    }
}

/// Runs a benchmark binary (its stdout captured when `capture_stdout`) and waits for it. A
/// Ctrl-C or SIGTERM that reaches this command is passed on to it: after a terminal's Ctrl-C,
/// which reaches both, the benchmark ignores the copy; after a signal sent to this command
/// alone, the benchmark would otherwise go on for minutes. Either way it removes its
/// namespaces before it exits, and this command waits for that instead of handing the
/// terminal back while it still prints.
fn run_benchmark(
    mut cmd: Command,
    capture_stdout: bool,
) -> std::io::Result<(std::process::ExitStatus, Vec<u8>)> {
    interrupt::catch_signals();
    if capture_stdout {
        cmd.stdout(std::process::Stdio::piped());
    }
    let mut child = cmd.spawn()?;
    let reader = child.stdout.take().map(|mut out| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = std::io::Read::read_to_end(&mut out, &mut bytes);
            bytes
        })
    });
    let mut passed_on = false;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if let (Some(signal), false) = (interrupt::signal(), passed_on) {
            if let Ok(pid) = libc::pid_t::try_from(child.id()) {
                // SAFETY: kill has no memory effects; the target is our child, not yet reaped.
                unsafe {
                    libc::kill(pid, signal);
                }
            }
            passed_on = true;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let stdout = reader
        .map(|r| r.join().unwrap_or_default())
        .unwrap_or_default();
    Ok((status, stdout))
}

fn demo(root: &Path) -> Result<(), String> {
    demo::run(root)
}

/// The commit a benchmark measures, marked when the tree has changes beyond it (the results
/// about to be overwritten do not count).
fn measured_commit(root: &Path) -> String {
    let commit = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(root)
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let dirty = Command::new("git")
        .args([
            "status",
            "--porcelain",
            "--untracked-files=no",
            "--",
            ".",
            ":!bench/results",
        ])
        .current_dir(root)
        .output()
        .is_ok_and(|o| !o.stdout.is_empty());
    if dirty {
        format!("{commit} (+ uncommitted changes)")
    } else {
        commit
    }
}

/// `cargo xtask bench datapath`: builds and runs the datapath benchmark (release), shows its
/// progress, and records its table with the machine, commit and date.
fn bench(root: &Path, what: &str) -> Result<(), String> {
    debug_assert_eq!(what, "datapath");
    let cargo = cargo();
    step(
        root,
        "build the benchmark",
        &cargo,
        &[
            "build",
            "--release",
            "-p",
            "xroce-bench",
            "--bin",
            "datapath",
        ],
    )?;
    println!("==> run: target/release/datapath (about a minute)");
    let mut cmd = Command::new(root.join("target/release/datapath"));
    cmd.current_dir(root);
    let (status, stdout) =
        run_benchmark(cmd, true).map_err(|e| format!("cannot run the benchmark: {e}"))?;
    if !status.success() && interrupt::was_interrupted() {
        return Err("interrupted".into());
    }
    if !status.success() {
        return Err(format!("the benchmark failed ({status})"));
    }
    let table = String::from_utf8_lossy(&stdout);
    print!("{table}");
    if table.trim().is_empty() {
        // A partial run (`XROCE_BENCH_ONLY`, a profiling aid) prints no table: the recorded
        // results stay as they were instead of being replaced by an empty one.
        println!("==> no table (a partial run): bench/results/datapath.md left as it was");
        return Ok(());
    }
    let capture = |program: &str, args: &[&str]| {
        Command::new(program)
            .args(args)
            .current_dir(root)
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    };
    let commit = measured_commit(root);
    let date = capture("date", &["-u", "+%Y-%m-%d %H:%M UTC"]);
    let kernel = capture("uname", &["-r"]);
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
    let doc = format!(
        "# Datapath benchmark\n\n`cargo xtask bench datapath` on a veth pair (MTU 9000, path MTU 4096) between two\n\
         network namespaces, one run. Only ratios within one run mean anything. The comparisons\n\
         with raw AF_XDP ran in rounds, xroce and raw AF_XDP back to back in each (in alternating\n\
         order), because this host's path drifts by tens of percent within a minute: values are\n\
         medians over the rounds, a ratio is the median of the rounds' ratios, and the rounds'\n\
         ratios follow it. Kernel UDP was measured once.\n\n\
         - machine: {cpus} CPUs, {cpu}, kernel {kernel}\n- commit: {commit}\n- date: {date}\n\n{table}\n\
         Ping-pong round trips are timed at the client from its post to the answer's receive\n\
         completion. `xroce RC SEND`: both sides take their SENDs' completions as they come and\n\
         wait for nothing but the answer, as the raw AF_XDP and kernel UDP ping-pongs do; each\n\
         answer still carries the ACK for the request it answers (two frames per turn on the\n\
         wire). `each SEND's ACK awaited`: both sides wait for each SEND's completion before the\n\
         next step, as perftest's `ib_send_lat` does, which puts the ACK frame behind each answer\n\
         on the turn's path; `raw AF_XDP, 2 frames per turn` is the path's floor for that\n\
         exchange, and `each CRC-32'd and checked` the floor of any RoCE stack doing it: each\n\
         frame numbered and given a CRC-32 by its sender as it sends it (the ICRC's work), and\n\
         read whole and checked by its receiver.\n\
         `raw AF_XDP, answer + trailing ACK-sized frame` is the floor of `xroce RC SEND`: each end\n\
         answers as soon as the message is in and takes the frame behind it when it comes, so\n\
         the ACK crosses the path and costs both CPUs but no turn waits for it.\n"
    );
    let path = root.join("bench/results/datapath.md");
    std::fs::write(&path, doc).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    println!("==> wrote {}", path.display());
    Ok(())
}
