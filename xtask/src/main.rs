//! `cargo xtask`: project automation. Run `cargo xtask --help` for the list.
//!
//! Only what works today is listed; the XDP loader, device demo and benchmarks join as their
//! issues land.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "xroce project automation")]
struct Cli {
    #[command(subcommand)]
    command: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Run everything CI runs: rustfmt check, clippy with warnings denied, and the whole test
    /// suite. This is the README's test command and what `.ci/run` calls.
    Test,
    /// Show what xroce does today: decode and verify real rdma_rxe captures with
    /// `xroce pcap check` (the two-namespace RDMA demo arrives with the verbs provider).
    Demo,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let root = workspace_root();
    let result = match cli.command {
        Task::Test => test(&root),
        Task::Demo => demo(&root),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

fn workspace_root() -> PathBuf {
    // xtask/ lives directly under the workspace root.
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Runs one step, printing what it does and how long it took.
fn step(root: &Path, what: &str, program: &str, args: &[&str]) -> Result<(), String> {
    println!("==> {what}: {program} {}", args.join(" "));
    let start = Instant::now();
    let status = Command::new(program)
        .args(args)
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

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string())
}

fn test(root: &Path) -> Result<(), String> {
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
    step(root, "tests", &cargo, &["test", "--workspace"])?;
    println!("==> all checks passed");
    Ok(())
}

fn demo(root: &Path) -> Result<(), String> {
    let cargo = cargo();
    let dir = root.join("tests/fixtures/pcap");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .map_err(|e| format!("reading {}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "pcap"))
        .map(|p| p.display().to_string())
        .collect();
    files.sort();
    println!("==> decoding real rdma_rxe traffic captured between two hosts, verifying every ICRC");
    let mut args = vec!["run", "--quiet", "-p", "xroce-cli", "--", "pcap", "check"];
    args.extend(files.iter().map(String::as_str));
    step(root, "xroce pcap check", &cargo, &args)
}
