//! The progress thread: frames in, transport, frames out, timers, sleep when idle.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use xroce_core::transport::Event;
use xroce_core::wire::{EtherType, EthernetAddress, EthernetFrame, EthernetRepr, IpAddress};

use super::addressing::{AddressWatcher, NextHop};
use super::{Shared, State};
use crate::port::Port;
use crate::xdp::XsksMap;

/// Frames taken from the port per lock hold.
const RX_BATCH: usize = 64;
/// Packets built per lock hold.
const TX_BATCH: usize = 64;
/// Ethernet header without VLAN tag (xroce sends untagged).
const ETH_HEADER: usize = 14;
/// Largest frame built: a 4096-byte path MTU packet with every header is 4154 bytes.
const MAX_FRAME: usize = 9216;

pub(crate) fn run(
    shared: Arc<Shared>,
    mut port: Box<dyn Port>,
    mut watcher: AddressWatcher,
    mut xsks: XsksMap,
) {
    let mut tx_buf = vec![0u8; MAX_FRAME];
    // A frame the port had no room for, sent before anything new.
    let mut backlog: Option<usize> = None;
    let mut last_work = Instant::now();
    let queue = shared.config.queue;
    loop {
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        let mut work = false;
        let mut completions = false;
        {
            let mut guard = shared.state.lock().unwrap_or_else(|p| p.into_inner());
            let st = &mut *guard;
            let now = shared.now();

            // Receive.
            let n = port.recv(RX_BATCH, &mut |frame| {
                shared.counters.rx_frames.fetch_add(1, Ordering::Relaxed);
                match ip_payload(frame) {
                    Some(ip) => st.dev.handle_packet(now, ip, &mut st.mem),
                    None => {
                        shared.counters.rx_not_roce.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
            work |= n > 0;

            // Timers.
            if st.dev.poll_timeout().is_some_and(|t| t <= now) {
                st.dev.handle_timeout(now);
                work = true;
            }

            // Transmit.
            if let Some(len) = backlog {
                if port.send(&tx_buf[..len]) {
                    backlog = None;
                }
            }
            let mut built = 0;
            while backlog.is_none() && built < TX_BATCH {
                let Some(tx) = st
                    .dev
                    .poll_transmit(now, &st.mem, &mut tx_buf[ETH_HEADER..])
                else {
                    break;
                };
                built += 1;
                work = true;
                let frame_len = ETH_HEADER + tx.len;
                if st.dev.gids().contains(&Some(tx.dst)) {
                    // Loopback: a QP talking to a QP of this device never touches the wire.
                    shared.counters.tx_loopback.fetch_add(1, Ordering::Relaxed);
                    let packet = tx_buf[ETH_HEADER..frame_len].to_vec();
                    st.dev.handle_packet(now, &packet, &mut st.mem);
                    continue;
                }
                let Some(mac) = next_hop_mac(&shared, st, tx.dst) else {
                    continue;
                };
                let eth = EthernetRepr {
                    src: EthernetAddress(st.neighbours.mac()),
                    dst: EthernetAddress(mac),
                    vlan: None,
                    ethertype: match tx.dst {
                        IpAddress::V4(_) => EtherType::Ipv4,
                        IpAddress::V6(_) => EtherType::Ipv6,
                    },
                };
                if eth.emit(&mut tx_buf[..ETH_HEADER]).is_err() {
                    continue;
                }
                shared.counters.tx_frames.fetch_add(1, Ordering::Relaxed);
                if !port.send(&tx_buf[..frame_len]) {
                    backlog = Some(frame_len);
                }
            }

            // Events: completions wake waiters; address changes update the GID table.
            while let Some(ev) = st.dev.poll_event() {
                if matches!(ev, Event::CqNotify(_)) {
                    completions = true;
                }
                // Async events are kept for the provider (issue 5); nothing to do here yet.
            }
            completions |= work;
            for change in watcher.drain() {
                st.neighbours.apply(&mut st.dev, change);
            }
        }
        if completions {
            shared.progressed.notify_all();
        }
        if let Err(e) = port.flush() {
            let mut st = shared.state.lock().unwrap_or_else(|p| p.into_inner());
            st.failed = Some(format!("the interface stopped accepting frames: {e}"));
            break;
        }
        if work || backlog.is_some() || port.tx_pending() {
            last_work = Instant::now();
            continue;
        }
        if last_work.elapsed() < shared.config.spin {
            std::hint::spin_loop();
            continue;
        }
        sleep(&shared, port.as_ref(), &watcher);
        last_work = Instant::now() - shared.config.spin;
    }
    // Leave the queue to the kernel: with the slot empty the XDP program passes RoCE frames on.
    let _ = xsks.clear(queue);
    shared.progressed.notify_all();
}

/// Sleeps until a frame arrives, the application kicks, an address changes or the next
/// transport timer is due.
fn sleep(shared: &Shared, port: &dyn Port, watcher: &AddressWatcher) {
    shared.sleeping.store(true, Ordering::SeqCst);
    // Work queued between our last look and `sleeping` being visible must not be slept through.
    if shared.kick.swap(false, Ordering::SeqCst) || shared.stop.load(Ordering::SeqCst) {
        shared.sleeping.store(false, Ordering::SeqCst);
        return;
    }
    let timeout_ms: i32 = {
        let st = shared.state.lock().unwrap_or_else(|p| p.into_inner());
        match st.dev.poll_timeout() {
            None => -1,
            Some(t) => {
                let now = shared.now();
                let ns = t.saturating_sub(now);
                // Round up so we do not wake a hair early and spin.
                i32::try_from(ns.div_ceil(1_000_000)).unwrap_or(i32::MAX)
            }
        }
    };
    let mut fds = [
        pollfd(shared.wake.as_raw_fd()),
        pollfd(watcher.as_raw_fd()),
        pollfd(port.wait_fd().unwrap_or(-1)),
    ];
    // SAFETY: `fds` is a valid array of pollfd for the duration of the call.
    unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
    shared.sleeping.store(false, Ordering::SeqCst);
    shared.kick.store(false, Ordering::SeqCst);
    if fds[0].revents != 0 {
        let mut v: u64 = 0;
        // SAFETY: reading 8 bytes into a valid u64 from our non-blocking eventfd.
        unsafe {
            libc::read(
                shared.wake.as_raw_fd(),
                (&mut v as *mut u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
    }
}

fn pollfd(fd: RawFd) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }
}

/// The destination MAC for a packet to `dst`, or `None` (packet dropped, counted) when the
/// route leaves by another interface or the neighbour is not resolved yet.
fn next_hop_mac(shared: &Shared, st: &mut State, dst: IpAddress) -> Option<[u8; 6]> {
    match st.neighbours.lookup(dst) {
        NextHop::Mac(mac) => Some(mac),
        NextHop::Pending => {
            shared
                .counters
                .tx_no_neighbour
                .fetch_add(1, Ordering::Relaxed);
            None
        }
        NextHop::OtherInterface => {
            shared
                .counters
                .tx_wrong_interface
                .fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

/// The IP packet inside an Ethernet frame (after up to two VLAN tags), for IPv4 and IPv6.
fn ip_payload(frame: &[u8]) -> Option<&[u8]> {
    let eth = EthernetFrame::new_checked(frame).ok()?;
    match eth.ethertype() {
        EtherType::Ipv4 | EtherType::Ipv6 => {}
        EtherType::Vlan => {
            // A second (inner) tag: skip it too.
            let inner = frame.get(eth.header_len()..)?;
            let t = u16::from_be_bytes([*inner.first()?, *inner.get(1)?]);
            let _ = t;
        }
        _ => return None,
    }
    frame.get(eth.header_len()..)
}
