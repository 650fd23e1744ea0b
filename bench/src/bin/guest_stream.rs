//! `guest-stream`: one end of a raw AF_XDP stream, run inside the benchmark's QEMU guests to
//! measure what their network path carries at all (xroce's own socket code moving bare UDP
//! frames, no protocol): the ceiling any stack in those guests can reach, next to which the
//! rdma_rxe and xroce numbers are read. Needs root and xroce's XDP program on the interface
//! (`xroce link add` loads it).
//!
//! It also plays a raw ping-pong, the floor of any stack's round trip there: `echo` answers
//! every FRAMES frames with FRAMES of its own (the message, then ACK-sized frames; two per
//! turn is what RC needs), and `ping` times COUNT such turns, both ends busy-polling. With
//! `checked`, each frame is numbered and given a CRC-32 by its sender and checked by its
//! receiver (the ICRC's work, the least any RoCE stack does); with `batched`, each turn leaves
//! as one send on a kernel UDP socket (UDP GSO, the ACK-sized frame the shorter last segment),
//! one notification of the virtio device per turn. Both ends must be given the same words.
//!
//! `send-batched` sends the same stream through a kernel UDP socket in batches (UDP GSO), as
//! xroce's engines send runs of frames on virtio-net: AF_XDP's copy mode notifies the device
//! for every frame, so on that link the batched sender is the ceiling.
//!
//! ```text
//! guest-stream send IFACE OWN_IP PEER_IP PAYLOAD SECS
//! guest-stream send-batched IFACE OWN_IP PEER_IP PAYLOAD SECS
//! guest-stream recv IFACE PEER_IP WAIT_SECS
//! guest-stream echo IFACE OWN_IP PEER_IP PAYLOAD FRAMES [checked] [batched]
//! guest-stream ping IFACE OWN_IP PEER_IP PAYLOAD FRAMES COUNT [checked] [batched]
//! ```
//!
//! The receiver prints `received FRAMES frames, BYTES bytes in SECS s: MB/s MB/s`, counting
//! from the first frame to the last; it ends 0.5 s after the last frame. `ping` prints
//! `round trips N of COUNT: p50 X us p99 Y us min Z us`; `echo` ends 2 s after the last frame,
//! and fails when none came within 60 s.

use std::net::Ipv4Addr;
use std::process::ExitCode;
use std::time::Duration;

use std::sync::atomic::AtomicBool;

use xroce_bench::baseline::{
    udp_gso_send_stream, xsk_echo, xsk_ping, xsk_receive_stream, xsk_send_stream, EchoLimits,
    PingTurn, RoundTrip,
};

const USAGE: &str = "usage: guest-stream send IFACE OWN_IP PEER_IP PAYLOAD SECS\n       \
                     guest-stream send-batched IFACE OWN_IP PEER_IP PAYLOAD SECS\n       \
                     guest-stream recv IFACE PEER_IP WAIT_SECS\n       \
                     guest-stream echo IFACE OWN_IP PEER_IP PAYLOAD FRAMES [checked] [batched]\n       \
                     guest-stream ping IFACE OWN_IP PEER_IP PAYLOAD FRAMES COUNT [checked] [batched]";

/// `echo` ends this long after the last frame, and fails when none came this long after it
/// started.
const ECHO_LIMITS: EchoLimits = EchoLimits {
    quiet: Duration::from_secs(2),
    wait: Duration::from_secs(60),
};

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
    let turn = |payload: &String, frames: &String, words: &[String]| -> Result<PingTurn, String> {
        let payload = number(payload)? as usize;
        let frames = number(frames)? as usize;
        if !(1..=1472).contains(&payload) || !(1..=8).contains(&frames) {
            return Err(format!(
                "PAYLOAD {payload}, FRAMES {frames}: 1 to 1472 bytes, 1 to 8 frames"
            ));
        }
        let mut turn = PingTurn::waiting(payload, frames);
        for word in words {
            match word.as_str() {
                "checked" => turn.checked = true,
                "batched" => turn.batched = true,
                other => return Err(format!("{other:?}: `checked` or `batched`\n{USAGE}")),
            }
        }
        Ok(turn)
    };
    match args {
        [mode, iface, own, peer, payload, secs] if mode == "send" || mode == "send-batched" => {
            let payload = number(payload)? as usize;
            if !(1..=1472).contains(&payload) {
                return Err(format!("PAYLOAD {payload}: 1 to 1472 bytes"));
            }
            let duration = Duration::from_secs(number(secs)?);
            let (own, peer) = (ip(own)?, ip(peer)?);
            let sent_for = if mode == "send" {
                xsk_send_stream(iface, own, peer, payload, duration)?.0
            } else {
                // The socket takes the interface's address, as xroce's engines' does.
                udp_gso_send_stream(iface, peer, payload, duration)?
            };
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
        [mode, iface, own, peer, payload, frames, words @ ..] if mode == "echo" => {
            let never = AtomicBool::new(false);
            let turn = turn(payload, frames, words)?;
            let answered = xsk_echo(
                iface,
                ip(own)?,
                ip(peer)?,
                turn,
                &never,
                Some(ECHO_LIMITS),
                || {},
            )?;
            Ok(format!("answered {answered} turns"))
        }
        [mode, iface, own, peer, payload, frames, count, words @ ..] if mode == "ping" => {
            let turn = turn(payload, frames, words)?;
            let count = number(count)? as usize;
            let rtts = xsk_ping(iface, ip(own)?, ip(peer)?, turn, count)?;
            let n = rtts.len();
            let min = rtts.iter().copied().fold(f64::NAN, f64::min);
            let rt = RoundTrip::from_samples(rtts);
            Ok(format!(
                "round trips {n} of {count}: p50 {:.1} us p99 {:.1} us min {min:.1} us",
                rt.p50, rt.p99
            ))
        }
        _ => Err(USAGE.to_string()),
    }
}
