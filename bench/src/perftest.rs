//! Running perftest (and other libibverbs programs) over xroce between two network
//! namespaces, the way a user does (`xroce link add`, `xroce exec --`), and reading its
//! result lines.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use xroce_datapath::netns::{run_bounded, NetnsPair};
use xroce_datapath::test_support::read_stats;

use crate::cpu::CpuTime;

/// The xroce device name on both sides.
pub const DEV: &str = "xr0";
/// Where each process of a run writes its engine's counters (the provider's `XROCE_STATS_FILE`).
const STATS_FILE_ENV: &str = "XROCE_STATS_FILE";
/// perftest's default TCP port.
const PORT: u16 = 18515;

/// Two namespaces on a veth pair with an xroce device on each end.
pub struct XrocePair {
    pub pair: NetnsPair,
    xroce: PathBuf,
    provider: PathBuf,
}

/// What one server/client run produced.
#[derive(Debug, Clone)]
pub struct Run {
    pub server: String,
    pub client: String,
    /// CPU seconds (user + system) both processes used, all threads.
    pub cpu_s: f64,
    pub wall_s: f64,
    /// The engine counters each side's process reported at its exit (`XROCE_STATS_FILE`):
    /// where frames were lost, retransmissions, batches.
    pub server_stats: BTreeMap<String, u64>,
    pub client_stats: BTreeMap<String, u64>,
}

impl Run {
    /// Frames the kernel dropped on their way into the server's engine (its socket had no room).
    pub fn server_receive_drops(&self) -> u64 {
        ["rx_dropped_ring_full", "rx_dropped_other"]
            .iter()
            .map(|k| self.server_stats.get(*k).copied().unwrap_or(0))
            .sum()
    }
}

impl XrocePair {
    /// Creates the namespaces and `xroce link add xr0` on both ends, with the `xroce` binary
    /// and provider from `bin_dir`.
    pub fn new(prefix: &str, mtu: u32, bin_dir: &Path) -> io::Result<XrocePair> {
        let xroce = bin_dir.join("xroce");
        let provider = bin_dir.join("libxroce_provider.so");
        for needed in [&xroce, &provider] {
            if !needed.is_file() {
                return Err(io::Error::other(format!(
                    "{} is missing (cargo build --release -p xroce-cli -p xroce-provider)",
                    needed.display()
                )));
            }
        }
        let pair = NetnsPair::new(prefix, mtu)?;
        let x = XrocePair {
            pair,
            xroce,
            provider,
        };
        for side in 0..2 {
            let iface = x.pair.iface(side).to_string();
            let out = x.xroce(side, &["link", "add", DEV, "netdev", &iface])?;
            if !out.status.success() {
                return Err(io::Error::other(format!(
                    "xroce link add: {}",
                    String::from_utf8_lossy(&out.stderr)
                )));
            }
        }
        Ok(x)
    }

    fn xroce(&self, side: usize, args: &[&str]) -> io::Result<Output> {
        let mut c = self.pair.command(side, &self.xroce);
        c.args(args).env("XROCE_PROVIDER", &self.provider);
        run_bounded(c, Duration::from_secs(60))
    }

    /// `xroce exec -- program args...` in namespace `side`.
    pub fn exec(&self, side: usize, program: &str, args: &[String]) -> Command {
        let mut c = self.pair.command(side, &self.xroce);
        c.arg("exec")
            .arg("--")
            .arg(program)
            .args(args)
            .env("XROCE_PROVIDER", &self.provider);
        c
    }

    /// Runs `program args` as the server in namespace 1 and `program args <server>` as the
    /// client in namespace 0; both must succeed within `timeout`.
    pub fn run(&self, program: &str, args: &[String], timeout: Duration) -> io::Result<Run> {
        let cpu0 = CpuTime::children();
        let start = Instant::now();
        let stats = StatsFiles::new();
        let mut server_cmd = self.exec(1, program, args);
        server_cmd.env(STATS_FILE_ENV, &stats.server);
        let server = std::thread::spawn(move || run_bounded(server_cmd, timeout));
        self.wait_listening(1)?;
        let mut client_args = args.to_vec();
        client_args.push(self.pair.ipv4(1).to_string());
        let mut client_cmd = self.exec(0, program, &client_args);
        client_cmd.env(STATS_FILE_ENV, &stats.client);
        let client = run_bounded(client_cmd, timeout);
        let server = server
            .join()
            .map_err(|_| io::Error::other("server thread panicked"))?;
        let wall_s = start.elapsed().as_secs_f64();
        let (server, client) = (server?, client?);
        let text = |o: &Output| {
            format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            )
        };
        if !server.status.success() || !client.status.success() {
            return Err(io::Error::other(format!(
                "{program} {}: server {} client {}\n--- server:\n{}\n--- client:\n{}",
                args.join(" "),
                server.status,
                client.status,
                text(&server),
                text(&client)
            )));
        }
        let (server_stats, client_stats) = (read_stats(&stats.server), read_stats(&stats.client));
        Ok(Run {
            server: text(&server),
            client: text(&client),
            cpu_s: CpuTime::children().minus(cpu0).total_s(),
            wall_s,
            server_stats,
            client_stats,
        })
    }

    fn wait_listening(&self, side: usize) -> io::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            let out = self
                .pair
                .exec(side, &format!("ss -Hltn 'sport = :{PORT}'"))?;
            if !String::from_utf8_lossy(&out.stdout).trim().is_empty() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(io::Error::other(format!(
            "nothing listened on {PORT} within 30 s"
        )))
    }
}

/// The files a run's two processes write their engine counters to: this process's own (both
/// namespaces share the file system), empty at the start (the provider appends), removed at
/// the end.
struct StatsFiles {
    server: PathBuf,
    client: PathBuf,
}

impl StatsFiles {
    fn new() -> StatsFiles {
        let file = |side: &str| {
            std::env::temp_dir().join(format!(
                "xroce-bench-{}-{side}-stats.txt",
                std::process::id()
            ))
        };
        let files = StatsFiles {
            server: file("server"),
            client: file("client"),
        };
        files.remove();
        files
    }

    fn remove(&self) {
        for f in [&self.server, &self.client] {
            let _ = std::fs::remove_file(f);
        }
    }
}

impl Drop for StatsFiles {
    fn drop(&mut self) {
        self.remove();
    }
}

impl Drop for XrocePair {
    fn drop(&mut self) {
        for side in 0..2 {
            let _ = self.xroce(side, &["link", "del", DEV]);
        }
    }
}

/// perftest's MB/sec are MiB/s (its `format_factor` is 0x100000).
pub const PERFTEST_MB: f64 = 1_048_576.0;

/// One result line of a bandwidth test.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BwLine {
    pub size: u64,
    pub iterations: u64,
    /// Average bandwidth, 10^6 bytes per second.
    pub mb_per_s: f64,
    pub mpps: f64,
}

/// One result line of a latency test (µs; one-way for SEND and WRITE, a round trip for READ
/// and atomics, as perftest reports them).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatLine {
    pub size: u64,
    pub iterations: u64,
    pub min: f64,
    pub typical: f64,
    pub average: f64,
    pub p99: f64,
}

/// Result lines: those starting with a number after the column header.
fn result_fields(output: &str) -> Vec<Vec<f64>> {
    output
        .lines()
        .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .map(|l| {
            l.split_whitespace()
                .map_while(|f| f.parse::<f64>().ok())
                .collect::<Vec<f64>>()
        })
        .collect()
}

/// `#bytes #iterations BW peak[MB/sec] BW average[MB/sec] MsgRate[Mpps]`.
pub fn parse_bw(output: &str) -> Vec<BwLine> {
    result_fields(output)
        .into_iter()
        .filter(|f| f.len() >= 5)
        .map(|f| BwLine {
            size: f[0] as u64,
            iterations: f[1] as u64,
            mb_per_s: f[3] * PERFTEST_MB / 1e6,
            mpps: f[4],
        })
        .collect()
}

/// `#bytes #iterations t_min t_max t_typical t_avg t_stdev 99% 99.9%`.
pub fn parse_lat(output: &str) -> Vec<LatLine> {
    result_fields(output)
        .into_iter()
        .filter(|f| f.len() >= 9)
        .map(|f| LatLine {
            size: f[0] as u64,
            iterations: f[1] as u64,
            min: f[2],
            typical: f[4],
            average: f[5],
            p99: f[7],
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bandwidth_lines_are_read_and_converted() {
        let out = "\
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]
 65536      5000             344.50             336.86 \t\t   0.005390
---------------------------------------------------------------------------------------
";
        let l = parse_bw(out);
        assert_eq!(l.len(), 1);
        assert_eq!((l[0].size, l[0].iterations), (65536, 5000));
        assert!((l[0].mb_per_s - 336.86 * 1.048576).abs() < 1e-6);
        assert_eq!(l[0].mpps, 0.005390);
    }

    #[test]
    fn latency_lines_are_read() {
        let out = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] \n\
 2       1000          106.04         4252.81      232.54   \t       342.60      \t376.38 \t\t2558.46 \t\t4252.81\n";
        let l = parse_lat(out);
        assert_eq!(l.len(), 1);
        assert_eq!((l[0].size, l[0].typical, l[0].p99), (2, 232.54, 2558.46));
        assert_eq!(l[0].min, 106.04);
        // A bandwidth line is not a latency line.
        assert!(parse_lat(" 65536 5000 1.0 2.0 0.1\n").is_empty());
    }
}
