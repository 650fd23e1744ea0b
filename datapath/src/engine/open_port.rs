//! Opening the port an engine drives: AF_XDP sockets on the interface's queues (with the
//! UDP socket that sends runs of frames in batches where that pays), or a DPDK driver.

use std::net::IpAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use super::{home_netns, queue_claim, EngineConfig, EngineError, Neighbours, Transmit};
use crate::afxdp::{BindMode, QueueSet, XskConfig, XskError, XskSocket, RECEIVE_ONLY};
use crate::udp_gso::{AutoBatching, GsoSocket, UdpGsoPort};

/// The port an engine drives, and what goes with it.
pub(super) struct OpenedPort {
    pub(super) port: Box<dyn crate::port::Port>,
    /// What the progress thread sleeps on for frames.
    pub(super) wait_fd: RawFd,
    /// The steering program's socket map the port's sockets are entered in (AF_XDP).
    pub(super) xsks: Option<crate::xdp::XsksMap>,
    /// The steering program's copy of the device's addresses (AF_XDP, a program that has it).
    pub(super) local_addrs: Option<crate::xdp::LocalAddrs>,
    /// The queues received on, the one sent on first.
    pub(super) queues: Vec<u32>,
    pub(super) queue_claims: Vec<queue_claim::QueueClaim>,
    pub(super) zero_copy: bool,
    /// Why auto mode bound copy mode although the driver may have zero-copy.
    pub(super) zero_copy_avoided: Option<&'static str>,
    /// Whether the port carries frames larger than one UMEM frame (DPDK's does); the
    /// configuration asked for it, but zero-copy may have done without (see
    /// [`XskSocket::open`]).
    pub(super) multi_buffer: bool,
    /// IPv4 frames in runs may leave through a UDP socket ([`crate::udp_gso`]): the frames
    /// that did so far.
    pub(super) udp_gso: Option<Arc<AtomicU64>>,
}

/// AF_XDP sockets on the interface's queues, entered into the steering program's map.
pub(super) fn open_af_xdp(
    config: &EngineConfig,
    ifindex: u32,
    neighbours: &Neighbours,
    gids: &[IpAddr],
) -> Result<OpenedPort, EngineError> {
    // A DPDK engine's driver would see none of the frames this one's sockets take.
    if let Some(holder) = queue_claim::interface_holder(&config.iface) {
        return Err(EngineError::InterfaceInUse {
            iface: config.iface.clone(),
            holder: Some(holder),
        });
    }
    let mut xsks = crate::xdp::XsksMap::open(&config.iface)?;
    let mut local_addrs = crate::xdp::LocalAddrs::open(&config.iface)?;
    // The test-only knob outlives the test that set it: said here, since it would otherwise
    // show only as retransmissions.
    if let Ok(one_in @ 1..) = crate::xdp::drop_one_in(&config.iface) {
        crate::stderr_line!(
            "xroce: netdev {}: the XDP program's test-only drop knob is on: 1 RoCEv2 frame in \
             {one_in} is dropped (`cargo xtask xdp set-drop --iface {} --one-in 0` turns it off; so does \
             `xroce link del`, which unloads the program)",
            config.iface,
            config.iface
        );
    }
    let rx_queues = crate::afxdp::receive_queues_in_use(&config.iface)
        .unwrap_or_else(|| neighbours.rx_queues());
    let known_flaw = crate::afxdp::auto_mode_avoids_zero_copy(&config.iface);
    let (socket, others) = open_sockets(ifindex, config, known_flaw, rx_queues, neighbours.mtu())?;
    let zero_copy = socket.is_zero_copy();
    // Each socket chose its own way; frames too large for one that went without multi-buffer
    // would be lost on its queue, so the port carries them only if every socket does.
    let multi_buffer = std::iter::once(&socket)
        .chain(&others)
        .all(XskSocket::is_multi_buffer);
    let bound: Vec<(u32, RawFd)> = std::iter::once(&socket)
        .chain(&others)
        .map(|s| (s.queue(), s.as_raw_fd()))
        .collect();
    let queue_claims: Vec<_> = bound
        .iter()
        .filter_map(|&(queue, _)| queue_claim::claim(&config.iface, queue, multi_buffer))
        .collect();
    let max_frame = socket.max_tx_frame();
    // Zero-copy sockets hand the driver frames without a copy; batching through the kernel's
    // UDP stack pays where copy mode hands the driver one frame at a time (see `udp_gso`).
    let batching = match config.transmit {
        Transmit::Auto if zero_copy => AutoBatching::Off,
        Transmit::Auto => crate::udp_gso::auto_batching(&config.iface),
        Transmit::AfXdp => AutoBatching::Off,
        Transmit::UdpGso => AutoBatching::On,
    };
    let ((port, udp_gso), wait_fd) = if others.is_empty() {
        let fd = socket.as_raw_fd();
        (
            with_transmit(config, ifindex, max_frame, batching, socket)?,
            fd,
        )
    } else {
        let set = QueueSet::new(socket, others)?;
        let fd = set.wait_fd_raw();
        (
            with_transmit(config, ifindex, max_frame, batching, set)?,
            fd,
        )
    };
    // Before the sockets: from their first frame on, the program steers only what is the
    // device's (a previous engine's addresses are replaced).
    if let Some(map) = &mut local_addrs {
        map.set(gids)?;
    }
    // Entered once all are bound: a start that failed above left the map as it was.
    for &(queue, fd) in &bound {
        xsks.set(queue, fd)?;
    }
    Ok(OpenedPort {
        port,
        wait_fd,
        xsks: Some(xsks),
        local_addrs,
        queues: bound.iter().map(|&(q, _)| q).collect(),
        queue_claims,
        zero_copy,
        zero_copy_avoided: known_flaw.filter(|_| config.bind_mode == BindMode::Auto),
        multi_buffer,
        udp_gso,
    })
}

/// A port, and the count of frames it sent in batches when it may batch.
type PortAndBatched = (Box<dyn crate::port::Port>, Option<Arc<AtomicU64>>);

/// The AF_XDP port, wrapped to send runs of IPv4 frames through a UDP socket as `batching`
/// says. Left to choose (auto), a UDP socket that cannot be opened leaves everything to AF_XDP,
/// said on stderr; asked for, it is an error. Returns, when the port may batch, the count of
/// frames it sent in batches.
fn with_transmit<P: crate::port::Port + 'static>(
    config: &EngineConfig,
    ifindex: u32,
    max_frame: usize,
    batching: AutoBatching,
    port: P,
) -> Result<PortAndBatched, EngineError> {
    if batching == AutoBatching::Off {
        return Ok((Box::new(port), None));
    }
    // Left to choose, `On` already says the interface is virtio-net; asked for, it is read.
    let pairs = match config.transmit {
        Transmit::Auto => batching == AutoBatching::On,
        _ => crate::udp_gso::notifies_per_frame(&config.iface),
    };
    match GsoSocket::open(&config.iface) {
        Ok(socket) => {
            let port = UdpGsoPort::new(
                port,
                socket,
                &config.iface,
                ifindex,
                max_frame,
                batching == AutoBatching::WhileSegmentedInSoftware,
                local_check(),
            )
            .with_pairs(pairs);
            let batched = port.frames_batched();
            Ok((Box::new(port), Some(batched)))
        }
        Err(source) if config.transmit == Transmit::Auto => {
            crate::stderr_line!(
                "xroce: netdev {}: cannot open a UDP socket to send batches through ({source}); \
                 every frame goes through AF_XDP",
                config.iface
            );
            Ok((Box::new(port), None))
        }
        Err(source) => Err(EngineError::UdpGsoSocket {
            iface: config.iface.clone(),
            source,
        }),
    }
}

/// Tells whether an address is one of the namespace's own, asked in the namespace the calling
/// thread is in now (the engine's, while it starts) whichever thread asks later.
fn local_check() -> crate::udp_gso::LocalCheck {
    let home = home_netns::HomeNetns::current();
    Box::new(move |dst| {
        home_netns::run_at_home(home.as_ref(), || crate::udp_gso::is_local_ipv4(dst))
            .unwrap_or(true)
    })
}

/// A DPDK `net_af_packet` device on the interface. One engine per interface: the port's
/// kernel UDP socket is bound to the interface, and a second one is refused; an AF_XDP
/// engine's sockets would take the RoCEv2 frames before the driver sees them.
#[cfg(feature = "dpdk")]
pub(super) fn open_dpdk(config: &EngineConfig) -> Result<OpenedPort, EngineError> {
    let in_use = |holder| EngineError::InterfaceInUse {
        iface: config.iface.clone(),
        holder,
    };
    if let Some(holder) = queue_claim::any_queue_holder(&config.iface) {
        return Err(in_use(Some(holder)));
    }
    let port = match crate::dpdk::DpdkPort::open(&config.iface) {
        Ok(port) => port,
        Err(crate::dpdk::DpdkError::RoceUdpPort { source, .. })
            if source.kind() == std::io::ErrorKind::AddrInUse =>
        {
            return Err(in_use(queue_claim::interface_holder(&config.iface)));
        }
        Err(e) => return Err(e.into()),
    };
    // The DPDK port carries frames of any size the interface takes.
    let multi_buffer = true;
    Ok(OpenedPort {
        wait_fd: port.doorbell_fd(),
        port: Box::new(port),
        xsks: None,
        local_addrs: None,
        queues: vec![0],
        queue_claims: queue_claim::claim_interface(&config.iface, multi_buffer)
            .into_iter()
            .collect(),
        zero_copy: false,
        zero_copy_avoided: None,
        multi_buffer,
        udp_gso: None,
    })
}

#[cfg(not(feature = "dpdk"))]
pub(super) fn open_dpdk(_config: &EngineConfig) -> Result<OpenedPort, EngineError> {
    Err(EngineError::DpdkNotBuilt)
}

/// Binds the engine's socket on `config.queue` and, unless `config.all_rx_queues` is off, a
/// receive-only socket on each other receive queue of the interface (see [`QueueSet`]), in
/// ascending order of queue, so that of two engines starting together on one interface one
/// gets every queue instead of each waiting for the other's. `rx_queues` are the queues in use
/// (ethtool's channels), or those the driver allocated when it does not report channels: then
/// the first queue that cannot be bound ends the list. A queue another process holds fails the
/// start, naming the holder; so does any other failure to bind the engine's own queue.
/// `known_flaw` (the driver's zero-copy loses frames) turns auto mode into copy mode, and is
/// said on stderr when a forced zero-copy bind succeeds.
fn open_sockets(
    ifindex: u32,
    config: &EngineConfig,
    known_flaw: Option<&'static str>,
    rx_queues: u32,
    netdev_mtu: u32,
) -> Result<(XskSocket, Vec<XskSocket>), EngineError> {
    let fits_one_frame = crate::afxdp::fits_one_frame(netdev_mtu);
    let mode = match (config.bind_mode, known_flaw) {
        (BindMode::Auto, Some(_)) => BindMode::Copy,
        (mode, _) => mode,
    };
    let busy = |queue| EngineError::QueueInUse {
        iface: config.iface.clone(),
        queue,
        holder: queue_claim::holder(&config.iface, queue),
    };
    let steerable = crate::xdp::abi::XSKS_MAP_ENTRIES;
    let others_up_to = if config.all_rx_queues {
        if rx_queues > steerable {
            crate::stderr_line!(
                "xroce: {} uses {rx_queues} receive queues; xroce's XDP program steers RoCEv2 \
                 frames from the first {steerable} only (frames on the others go to the kernel)",
                config.iface
            );
        }
        rx_queues.min(steerable)
    } else {
        0
    };
    let mut main = None;
    let mut others = Vec::new();
    // Lowered when a queue turns out not to be in use: none past it is.
    let mut in_use = others_up_to;
    for queue in 0..others_up_to.max(config.queue + 1) {
        if queue == config.queue {
            let xsk = XskConfig {
                queue,
                mode,
                single_buffer: config.single_buffer,
                fits_one_frame,
                ..XskConfig::default()
            };
            let sock = XskSocket::open_when_free(ifindex, xsk, Duration::from_secs(1)).map_err(
                |e| match e {
                    XskError::QueueBusy { queue, .. } => busy(queue),
                    e => e.into(),
                },
            )?;
            if let (true, Some(flaw)) = (sock.is_zero_copy(), known_flaw) {
                crate::stderr_line!(
                    "xroce: {}: bound zero-copy, as asked, although {flaw}",
                    config.iface
                );
            }
            main = Some(sock);
        } else if queue < in_use {
            let xsk = XskConfig {
                queue,
                mode,
                single_buffer: config.single_buffer,
                fits_one_frame,
                ..RECEIVE_ONLY
            };
            match XskSocket::open_when_free(ifindex, xsk, Duration::from_secs(1)) {
                Ok(sock) => others.push(sock),
                Err(XskError::QueueBusy { queue, .. }) => return Err(busy(queue)),
                // A queue the driver allocated but does not use (the count came from
                // rtnetlink); forcing zero-copy reports such a queue as unsupported.
                Err(XskError::NoSuchQueue { .. } | XskError::ZeroCopyUnsupported { .. }) => {
                    in_use = queue;
                }
                Err(source) => {
                    return Err(EngineError::ReceiveQueue {
                        iface: config.iface.clone(),
                        queue,
                        source,
                    })
                }
            }
        }
    }
    // The loop's range includes `config.queue`, whose failure returned above.
    let main = main.ok_or(EngineError::Socket(XskError::NoSuchQueue {
        ifindex,
        queue: config.queue,
    }))?;
    Ok((main, others))
}
