//! `guest-stream`: one end of a raw AF_XDP stream, run inside the benchmark's QEMU guests to
//! measure what their network path carries at all (xroce's own socket code moving bare UDP
//! frames, no protocol): the ceiling any stack in those guests can reach, next to which the
//! rdma_rxe and xroce numbers are read. Needs root and xroce's XDP program on the interface
//! (`xroce link add` loads it).
//!
//! ```text
//! guest-stream send IFACE OWN_IP PEER_IP PAYLOAD SECS
//! guest-stream recv IFACE PEER_IP WAIT_SECS
//! ```
//!
//! The receiver prints `received FRAMES frames, BYTES bytes in SECS s: MB/s MB/s`, counting
//! from the first frame to the last; it ends 0.5 s after the last frame.

use std::net::Ipv4Addr;
use std::process::ExitCode;
use std::time::Duration;

use xroce_bench::baseline::{xsk_receive_stream, xsk_send_stream};

const USAGE: &str = "usage: guest-stream send IFACE OWN_IP PEER_IP PAYLOAD SECS\n       \
                     guest-stream recv IFACE PEER_IP WAIT_SECS";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("guest-stream: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &[String]) -> Result<String, String> {
    let ip = |s: &String| {
        s.parse::<Ipv4Addr>()
            .map_err(|_| format!("not an IPv4 address: {s}"))
    };
    let number = |s: &String| s.parse::<u64>().map_err(|_| format!("not a number: {s}"));
    match args {
        [mode, iface, own, peer, payload, secs] if mode == "send" => {
            let payload = number(payload)? as usize;
            if !(1..=1472).contains(&payload) {
                return Err(format!("PAYLOAD {payload}: 1 to 1472 bytes"));
            }
            let duration = Duration::from_secs(number(secs)?);
            let (sent_for, _) = xsk_send_stream(iface, ip(own)?, ip(peer)?, payload, duration)?;
            Ok(format!("sent for {:.2} s", sent_for.as_secs_f64()))
        }
        [mode, iface, peer, wait] if mode == "recv" => {
            let wait = Duration::from_secs(number(wait)?);
            let r = xsk_receive_stream(iface, ip(peer)?, wait, Duration::from_millis(500))?;
            Ok(format!(
                "received {} frames, {} bytes in {:.3} s: {:.2} MB/s",
                r.frames,
                r.bytes,
                r.span.as_secs_f64(),
                r.mb_per_s()
            ))
        }
        _ => Err(USAGE.to_string()),
    }
}
