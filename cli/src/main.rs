//! `xroce`: the user command.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use xroce_cli::{engine, exec, link, pcap_check};
use xroce_datapath::xdp::XdpMode;

/// xroce: RDMA over Converged Ethernet v2 in userspace, on AF_XDP.
#[derive(Parser)]
#[command(
    name = "xroce",
    version,
    about,
    after_help = "Environment: XROCE_LOG=off|error|warn|info|debug|trace sets how much xroce \
                  logs to stderr (default warn: what needs attention)."
)]
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
    /// Manage xroce RDMA devices (add, del, show), like `rdma link` for rdma_rxe.
    ///
    /// Example: `xroce link add xroce0 netdev eth0`, then `xroce exec -- ibv_devinfo`.
    Link {
        #[command(subcommand)]
        command: LinkCommand,
    },
    /// Run an unmodified RDMA (libibverbs) program on the xroce devices of this network
    /// namespace.
    ///
    /// Rewrites the namespace's sysfs tree (addresses may have changed since `xroce link add`),
    /// then executes PROGRAM with SYSFS_PATH=/run/xroce/net-<N>/sysfs (where libibverbs looks
    /// for devices on a kernel without RDMA), LD_PRELOAD=<the xroce provider library> (put
    /// before any LD_PRELOAD already set) and XROCE_EXEC=1. The provider is $XROCE_PROVIDER
    /// if set, else libxroce_provider.so next to the xroce executable. Exit status: PROGRAM's;
    /// 127 when it cannot be found, 126 when it cannot be run, 1 when xroce fails before.
    ///
    /// For the program, XROCE_STATS_FILE=PATH appends each engine's counters to PATH when it
    /// stops; XROCE_PCAP=PATH writes every frame it sends and receives to the pcap file PATH
    /// (`{netdev}` in PATH becomes the device's netdev; `tcpdump` on the interface does not
    /// see xroce's frames), and with XROCE_PCAP_MAX=SIZE (e.g. 64M) it keeps only the last
    /// frames: a full PATH becomes PATH.1 and a new PATH begins; XROCE_DUMP_SIGNAL=USR1 makes
    /// `kill -USR1 PID` write what every engine is doing (a line per QP and CQ: PSNs, timers,
    /// queues) to stderr, for a program that seems stuck; XROCE_BACKEND=dpdk moves the frames
    /// through DPDK's net_af_packet driver instead of AF_XDP sockets (an xroce built with
    /// `--features dpdk`; extra DPDK arguments in XROCE_DPDK_EAL_ARGS); XROCE_LOG=debug
    /// logs the transport's events to stderr (retransmissions, NAKs, QPs failing, address
    /// changes), each line with the time of day and the process (the default, warn, says only
    /// what needs attention; off, error, info and trace too).
    ///
    /// Example: `xroce exec -- ibv_rc_pingpong -d xroce0 -g 1`
    #[command(override_usage = "xroce exec -- PROGRAM [ARGS]...")]
    Exec {
        /// The program and its arguments.
        #[arg(
            required = true,
            trailing_var_arg = true,
            allow_hyphen_values = true,
            value_name = "PROGRAM"
        )]
        command: Vec<OsString>,
    },
    /// Run an xroce engine on an interface, in the foreground, until SIGINT, SIGTERM or SIGHUP, or
    /// until its device fails (its interface removed: exit status 1) (root).
    ///
    /// The engine binds an AF_XDP socket to each receive queue of the interface (a NIC spreads
    /// flows over its queues; it sends on `--queue`) and registers them with xroce's XDP
    /// program, which must be loaded on the interface first (`xroce link add NAME netdev IF`
    /// loads it, or `cargo xtask xdp load --iface IF` from the source tree). RDMA programs run
    /// engines of their own (`xroce exec`); this one serves the queue with no application, to
    /// see that RoCEv2 frames reach it (its counters) or to hold the queue.
    /// It prints one line when ready and its counters when it stops. Only one engine can
    /// serve a queue; a second one exits with an error saying so. When the engine exits (or is
    /// killed) its socket goes away and RoCEv2 frames go to the kernel again. With
    /// XROCE_BACKEND=dpdk (a build with `--features dpdk`) it runs on DPDK's net_af_packet
    /// driver on the interface instead, and `--queue`/`--mode` do not apply.
    Engine {
        /// The network interface (in the current network namespace).
        #[arg(long, value_name = "IF")]
        iface: String,
        /// The queue to send on (it receives on every receive queue).
        #[arg(long, default_value_t = 0)]
        queue: u32,
        /// AF_XDP bind mode: auto binds zero-copy where the driver supports it (not on
        /// virtio-net built as a module, whose zero-copy sends frames behind a header read
        /// from the wrong memory), copy mode elsewhere; or force one. Programs under `xroce
        /// exec` take it from XROCE_BIND_MODE.
        #[arg(long, default_value = "auto", value_parser = ["auto", "copy", "zero-copy"])]
        mode: String,
        /// Write every frame the engine sends and receives to this pcap file (created or
        /// truncated; refused while another engine writes to it).
        #[arg(long, value_name = "FILE")]
        pcap: Option<PathBuf>,
        /// Keep only the last frames: once the pcap file holds SIZE (bytes, or a number with K,
        /// M or G, e.g. 64M), it is renamed to FILE.1 (replacing the older one) and a new FILE
        /// begins, so at most twice SIZE is on disk.
        #[arg(
            long,
            value_name = "SIZE",
            requires = "pcap",
            value_parser = xroce_datapath::engine::parse_capture_max
        )]
        pcap_max: Option<u64>,
    },
}

#[derive(Subcommand)]
enum LinkCommand {
    /// Create an xroce RDMA device NAME on network interface DEV.
    ///
    /// Loads xroce's XDP program on DEV (unless it is loaded already), records the device for
    /// the current network namespace, writes the sysfs tree that `xroce exec` shows to
    /// libibverbs (/run/xroce/net-<N>/sysfs) and creates the device node
    /// /dev/infiniband/xroce-NAME. Prints the device's GID table: fe80::EUI-64 of DEV's MAC,
    /// then DEV's IPv4 addresses (as ::ffff:a.b.c.d), then its other IPv6 addresses, as the
    /// kernel lists them for rdma_rxe.
    ///
    /// NAME: 1 to 32 letters, digits, '_' or '-' (not starting with '-'), unique in the
    /// network namespace; one device per interface. Needs root (CAP_NET_ADMIN and CAP_BPF, and
    /// write access to /run and /dev). Devices belong to the network namespace the command
    /// runs in (`ip netns exec NS xroce link add ...`).
    ///
    /// Example: `xroce link add xroce0 netdev eth0`
    #[command(override_usage = "xroce link add NAME netdev DEV [--mode auto|native|generic]")]
    Add {
        /// NAME, the device name (as ibv_devices shows it); the word `netdev`, as in `rdma
        /// link add NAME type rxe netdev DEV`; DEV, the network interface, in the current
        /// network namespace.
        #[arg(value_name = "NAME netdev DEV", num_args = 1.., required = true)]
        words: Vec<String>,
        /// How to attach the XDP program when it is not loaded yet: auto (native where the
        /// driver takes it, else generic), native (driver mode, needed for zero-copy; fails on
        /// drivers without it) or generic (works with any driver, slower).
        #[arg(long, default_value = "auto", value_parser = ["auto", "native", "generic"])]
        mode: String,
    },
    /// Remove an xroce RDMA device.
    ///
    /// Unloads the XDP program from the device's interface, forgets the device, rewrites the
    /// sysfs tree, and removes /dev/infiniband/xroce-NAME unless a device of the same name
    /// exists in another network namespace. Needs root.
    ///
    /// Example: `xroce link del xroce0`
    #[command(visible_alias = "delete")]
    Del {
        /// The device name.
        #[arg(value_name = "NAME")]
        name: String,
    },
    /// List the xroce RDMA devices of the current network namespace.
    ///
    /// One line per device: name, interface, state (ACTIVE when the interface is up with
    /// carrier, DOWN otherwise), interface MTU and the RoCE path MTU derived from it as
    /// rdma_rxe does (the port's active MTU, which `ibv_devinfo` shows too; at most 2048
    /// where the sockets have no multi-buffer: kernels before 6.6, and zero-copy on some
    /// drivers, as the running engine's note says); then its GIDs by index, and whether the
    /// XDP program is attached and an engine's AF_XDP socket is bound to queue 0. Prints
    /// nothing when there are none.
    ///
    /// Example: `xroce link show` or `xroce link show xroce0`
    Show {
        /// Only this device.
        #[arg(value_name = "NAME")]
        name: Option<String>,
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
    /// 2 when a file cannot be read as a capture, 3 when the files hold no RoCEv2 packet at all
    /// (nothing was verified).
    ///
    /// xroce's own frames: `XROCE_PCAP=out.pcap xroce exec -- PROGRAM` (tcpdump on the
    /// interface an xroce device runs on does not see them: the XDP program takes them first).
    /// Anything else's, with the ICRC intact: e.g. `tcpdump -i eth0 -s 0 -w out.pcap udp port
    /// 4791` on an interface without xroce (rdma_rxe's, or the peer's side of the link).
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
    xroce_datapath::stderr_log::install();
    match cli.command {
        Command::Engine {
            iface,
            queue,
            mode,
            pcap,
            pcap_max,
        } => engine::run(&iface, queue, &mode, pcap, pcap_max),
        Command::Link { command } => match command {
            LinkCommand::Add { words, mode } => {
                let (name, netdev) = match add_words(&words) {
                    Ok(found) => found,
                    Err(why) => {
                        eprintln!("xroce link add: {why}");
                        return ExitCode::from(2);
                    }
                };
                let mode = match mode.as_str() {
                    "generic" => Some(XdpMode::Generic),
                    "native" => Some(XdpMode::Native),
                    _ => None,
                };
                link::add(&name, &netdev, mode)
            }
            LinkCommand::Del { name } => link::del(&name),
            LinkCommand::Show { name } => link::show(name.as_deref()),
        },
        Command::Exec { command } => exec::run(&command),
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

/// NAME and DEV from `xroce link add`'s words, which must be `NAME netdev DEV`; otherwise what
/// to write instead (the usual slips: the word `netdev` left out, rdma's `type rxe` kept).
fn add_words(words: &[String]) -> Result<(String, String), String> {
    const FORM: &str = "expected `xroce link add NAME netdev DEV`, e.g. `xroce link add xroce0 \
                        netdev eth0`";
    match words {
        [name, keyword, dev] if keyword == "netdev" => Ok((name.clone(), dev.clone())),
        [name, dev] => Err(format!(
            "{FORM}: the word `netdev` goes before the interface (`xroce link add {name} netdev \
             {dev}`)"
        )),
        [name, ty, rxe, keyword, dev] if ty == "type" && keyword == "netdev" => Err(format!(
            "{FORM}: xroce devices have one type, so there is no `{ty} {rxe}` (`xroce link add \
             {name} netdev {dev}`)"
        )),
        _ => Err(format!("{FORM}; got `{}`", words.join(" "))),
    }
}

#[cfg(test)]
mod tests {
    use super::add_words;

    fn words(s: &str) -> Vec<String> {
        s.split(' ').map(String::from).collect()
    }

    #[test]
    fn link_add_takes_name_netdev_dev_and_says_what_to_write_otherwise() {
        assert_eq!(
            add_words(&words("xr0 netdev eth0")),
            Ok(("xr0".into(), "eth0".into()))
        );
        let missing = add_words(&words("xr0 eth0")).unwrap_err();
        assert!(
            missing.contains("`xroce link add xr0 netdev eth0`"),
            "{missing}"
        );
        let rxe_style = add_words(&words("xr0 type rxe netdev eth0")).unwrap_err();
        assert!(
            rxe_style.contains("`xroce link add xr0 netdev eth0`"),
            "{rxe_style}"
        );
        let odd = add_words(&words("xr0 device eth0")).unwrap_err();
        assert!(odd.contains("got `xr0 device eth0`"), "{odd}");
        assert!(add_words(&words("xr0")).is_err());
    }
}
