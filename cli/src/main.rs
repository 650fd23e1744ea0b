//! `xroce`: the user command.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use xroce_cli::{engine, pcap_check};

/// xroce: RDMA over Converged Ethernet v2 in userspace, on AF_XDP.
#[derive(Parser)]
#[command(name = "xroce", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Inspect packet captures (pcap or pcapng) of RoCEv2 traffic.
    Pcap {
        #[command(subcommand)]
        command: PcapCommand,
    },
    /// Run an xroce engine on one queue of an interface, in the foreground, until SIGINT or
    /// SIGTERM.
    ///
    /// The engine binds an AF_XDP socket to the queue and registers it with xroce's XDP
    /// program, which must be loaded on the interface first (`cargo xtask xdp load --iface IF`).
    /// It prints one line when ready and its counters when it stops. Only one engine can
    /// serve a queue; a second one exits with an error saying so. When the engine exits (or is
    /// killed) its socket goes away and RoCEv2 frames go to the kernel again.
    Engine {
        /// The network interface (in the current network namespace).
        #[arg(long, value_name = "IF")]
        iface: String,
        /// The receive queue to serve.
        #[arg(long, default_value_t = 0)]
        queue: u32,
        /// AF_XDP bind mode: zero-copy when the driver supports it (auto), or force one.
        #[arg(long, default_value = "auto", value_parser = ["auto", "copy", "zero-copy"])]
        mode: String,
    },
}

#[derive(Subcommand)]
enum PcapCommand {
    /// Decode every RoCEv2 packet in the captures and verify its ICRC.
    ///
    /// Reads classic pcap (micro- or nanosecond timestamps) and pcapng files with Ethernet,
    /// raw IP or Linux cooked (`tcpdump -i any`) link types. For each RoCEv2 packet (UDP
    /// destination port 4791) it prints one line: time since the first packet, addresses and
    /// UDP ports, opcode, destination QPN, PSN, AckReq/SE flags, the extension headers (RETH
    /// va/rkey/len, AETH syndrome/MSN, DETH Q_Key/source QP, atomics, immediate data) and the
    /// payload length; then it checks the ICRC, the IPv4 header checksum and any non-zero UDP
    /// checksum. Other packets are counted as "not RoCEv2", not as errors.
    ///
    /// Ends with `N packets, N ICRC ok, N bad, N not RoCEv2` per file (and a total for
    /// several files).
    ///
    /// Exit status: 0 when every RoCEv2 packet verifies, 1 when any does not (they are listed),
    /// 2 when a file cannot be read as a capture.
    ///
    /// Capture RoCEv2 with its ICRC intact, e.g. `tcpdump -i eth0 -s 0 -w out.pcap udp port 4791`.
    Check {
        /// Print only failing packets and the summary.
        #[arg(short, long)]
        quiet: bool,
        /// Capture files to check.
        #[arg(required = true, value_name = "FILE")]
        files: Vec<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Engine { iface, queue, mode } => engine::run(&iface, queue, &mode),
        Command::Pcap {
            command: PcapCommand::Check { quiet, files },
        } => {
            let opts = pcap_check::Options { quiet };
            let status = pcap_check::run(
                &files,
                &opts,
                &mut std::io::stdout().lock(),
                &mut std::io::stderr().lock(),
            );
            ExitCode::from(status as u8)
        }
    }
}
