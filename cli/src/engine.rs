//! `xroce engine`: an engine in the foreground until a signal says stop.

use std::io::Write;
use std::process::ExitCode;
use std::sync::atomic::Ordering;

use xroce_datapath::afxdp::BindMode;
use xroce_datapath::engine::{Backend, Engine, EngineConfig, EngineError, Transmit};

pub fn run(
    iface: &str,
    queue: u32,
    mode: &str,
    pcap: Option<std::path::PathBuf>,
    pcap_max: Option<u64>,
) -> ExitCode {
    // clap allows only the three names, which all parse.
    let bind_mode = mode.parse().unwrap_or(BindMode::Auto);
    // Block the stop signals before any thread exists, so every thread inherits the mask and
    // the main thread can take them with sigwait.
    let signals = stop_signals();
    // SAFETY: `signals` is an initialised sigset; a null old-set pointer is allowed.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &signals, std::ptr::null_mut()) };

    let started = Backend::from_env().and_then(|backend| {
        Engine::start(EngineConfig {
            queue,
            bind_mode,
            capture: pcap,
            capture_max: pcap_max,
            backend,
            transmit: Transmit::from_env().map_err(EngineError::UnknownTransmit)?,
            ..EngineConfig::new(iface)
        })
    });
    let engine = match started {
        Ok(e) => e,
        Err(e) => {
            eprintln!("xroce engine: {e}");
            return ExitCode::FAILURE;
        }
    };
    let gids: Vec<String> = engine
        .gids()
        .iter()
        .enumerate()
        .filter_map(|(i, g)| g.map(|g| format!("{i}:{g}")))
        .collect();
    // Written, not printed: a reader that went away (`| grep -m1 ready`) must not turn the
    // engine's end into a panic.
    let mut stdout = std::io::stdout();
    // Auto mode in copy mode on a driver whose zero-copy loses frames says why.
    let avoided = engine
        .zero_copy_avoided()
        .map(|why| format!(", not zero-copy: {why}"));
    let _ = writeln!(
        stdout,
        "xroce engine ready on {iface} queue {queue}{} ({}{}{}); GIDs {}",
        receiving_also(engine.queues(), queue),
        match engine.backend() {
            Backend::Dpdk => "DPDK net_af_packet",
            Backend::AfXdp if engine.is_zero_copy() => "AF_XDP zero-copy",
            Backend::AfXdp => "AF_XDP copy",
        },
        avoided.unwrap_or_default(),
        if engine.sends_through_udp_gso() {
            ", runs of IPv4 frames through UDP GSO where the link takes them"
        } else {
            ""
        },
        gids.join(" ")
    );
    // Until a stop signal, or the device fails (its interface removed, say: the engine has
    // said why on stderr), looking once a second.
    let second = libc::timespec {
        tv_sec: 1,
        tv_nsec: 0,
    };
    let (why, status) = loop {
        // SAFETY: waits for one of the blocked signals in `signals`, at most `second`; a null
        // siginfo pointer is allowed.
        let sig = unsafe { libc::sigtimedwait(&signals, std::ptr::null_mut(), &second) };
        if sig > 0 {
            break (format!("signal {sig}"), ExitCode::SUCCESS);
        }
        if engine.failure().is_some() {
            break ("the device failed".to_string(), ExitCode::FAILURE);
        }
    };
    let c = engine.counters();
    let dev = engine.with_device(|d| d.counters());
    let _ = writeln!(
        stdout,
        "xroce engine stopping ({why}): {} frames in, {} out, {} looped back; transport {:?}",
        c.rx_frames.load(Ordering::Relaxed),
        c.tx_frames.load(Ordering::Relaxed),
        c.tx_loopback.load(Ordering::Relaxed),
        dev
    );
    drop(engine);
    status
}

fn stop_signals() -> libc::sigset_t {
    // SAFETY: sigemptyset initialises the set before sigaddset reads it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGHUP);
        set
    }
}

/// ", receiving on queues 1, 2" when the engine also receives on queues other than its own.
fn receiving_also(queues: &[u32], own: u32) -> String {
    let others: Vec<String> = queues
        .iter()
        .filter(|&&q| q != own)
        .map(u32::to_string)
        .collect();
    if others.is_empty() {
        String::new()
    } else {
        format!(", receiving on queues {} too", others.join(", "))
    }
}
