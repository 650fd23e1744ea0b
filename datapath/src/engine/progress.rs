//! The progress thread: frames in, transport, frames out, timers, sleep when idle.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use xroce_core::transport::Event;
use xroce_core::wire::{EtherType, EthernetAddress, EthernetFrame, EthernetRepr, IpAddress};

use super::addressing::{AddressWatcher, Neighbours, NextHop};
use super::{Shared, State};
use crate::port::Port;
use crate::xdp::XsksMap;

/// Frames taken from the port per lock hold.
const RX_BATCH: usize = 64;
/// Packets built per lock hold.
const TX_BATCH: usize = 64;
/// Ethernet header without VLAN tag (xroce sends untagged).
const ETH_HEADER: usize = 14;
/// An application that polled an empty CQ within this long counts as actively polling. Short,
/// because an application may stop polling its CQ and spin on memory instead (`ib_write_lat`
/// waits for the peer's WRITE to land): the progress thread must take over within about this
/// long. (It was 1 ms: `ib_write_lat` then measured 1.3 ms.)
pub(crate) const APP_ACTIVE_NS: u64 = 100_000;
/// An application that polled a CQ within this long is a poller (see `run`).
const APP_POLLER_NS: u64 = 10_000_000;
/// How long the progress thread naps after a round of work next to a poller.
const POLLER_NAP_NS: u64 = 50_000;
/// How often a busy progress thread reads the address watcher.
const WATCH_EVERY_NS: u64 = 1_000_000;

/// The port and its buffers, kept under the engine lock so that whichever thread holds the
/// lock (the progress thread, or an application polling its CQ) can move frames.
pub(crate) struct PortState {
    pub(crate) port: Box<dyn Port>,
    /// The port had no room for the last packet: more are waiting in the transport.
    tx_full: bool,
    pub(crate) failed: bool,
}

impl PortState {
    pub(crate) fn new(port: Box<dyn Port>) -> Self {
        Self {
            port,
            tx_full: false,
            failed: false,
        }
    }
}

/// One round of work: receive a batch, run due timers, transmit a batch, flush. Returns
/// whether anything happened or is still in flight (so the caller keeps polling).
pub(crate) fn progress_once(shared: &Shared, st: &mut State) -> bool {
    let now = shared.now();
    st.tx_deferred = false;
    let State {
        dev,
        mem,
        neighbours,
        io,
        ..
    } = st;
    let mut work = false;

    // Receive.
    let n = io.port.recv(RX_BATCH, &mut |frame| {
        shared.counters.rx_frames.fetch_add(1, Ordering::Relaxed);
        match ip_payload(frame) {
            Some(ip) => dev.handle_packet(now, ip, mem),
            None => {
                shared.counters.rx_not_roce.fetch_add(1, Ordering::Relaxed);
            }
        }
    });
    work |= n > 0;

    // Timers.
    if dev.poll_timeout().is_some_and(|t| t <= now) {
        dev.handle_timeout(now);
        work = true;
    }

    // Transmit: the transport writes each packet straight into the port's buffer, behind room
    // for the Ethernet header, and is asked only when there is room.
    let mut built = 0;
    while built < TX_BATCH {
        let mut produced = false;
        let room = io.port.send_with(&mut |buf| {
            let tx = dev.poll_transmit(now, mem, buf.get_mut(ETH_HEADER..)?)?;
            produced = true;
            let frame_len = ETH_HEADER + tx.len;
            if dev.gids().contains(&Some(tx.dst)) {
                // Loopback: a QP talking to a QP of this device never touches the wire.
                shared.counters.tx_loopback.fetch_add(1, Ordering::Relaxed);
                dev.handle_packet(now, &buf[ETH_HEADER..frame_len], mem);
                return None;
            }
            let mac = next_hop_mac(shared, neighbours, tx.dst)?;
            let eth = EthernetRepr {
                src: EthernetAddress(neighbours.mac()),
                dst: EthernetAddress(mac),
                vlan: None,
                ethertype: match tx.dst {
                    IpAddress::V4(_) => EtherType::Ipv4,
                    IpAddress::V6(_) => EtherType::Ipv6,
                },
            };
            eth.emit(&mut buf[..ETH_HEADER]).ok()?;
            shared.counters.tx_frames.fetch_add(1, Ordering::Relaxed);
            Some(frame_len)
        });
        if !room {
            // The transport keeps its packets until the kernel frees transmit slots.
            io.tx_full = true;
            break;
        }
        if !produced {
            io.tx_full = false;
            break;
        }
        built += 1;
        work = true;
    }

    // Completion-channel and asynchronous events go to whoever asked for them (the provider
    // writes them to the application's event file descriptors).
    while let Some(ev) = dev.poll_event() {
        if matches!(ev, Event::CqNotify(_)) {
            work = true;
        }
        if let Some(sink) = &shared.config.on_event {
            (sink.0)(ev);
        }
    }
    if let Err(e) = io.port.flush() {
        io.failed = true;
        st.failed = Some(format!("the interface stopped accepting frames: {e}"));
        return false;
    }
    work || io.tx_full || io.port.tx_pending()
}

pub(crate) fn run(
    shared: Arc<Shared>,
    mut watcher: AddressWatcher,
    mut xsks: XsksMap,
    wait_fd: RawFd,
) {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };
    shared.progress_tid.store(tid, Ordering::Relaxed);
    let spin_ns = shared.config.spin.as_nanos() as u64;
    let mut last_work = shared.now();
    // 0: read the address watcher on the next round.
    let mut last_watch = 0;
    let queue = shared.config.queue;
    loop {
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        let now = shared.now();
        // While an application polls its CQs (or posts) it drives progress itself (see
        // `Engine::poll_cq`); this thread then stays out of its way and only checks back now
        // and then.
        let active_ns = shared.app_active_at.load(Ordering::Relaxed);
        let since_active = now.saturating_sub(active_ns);
        if active_ns != 0 && since_active < APP_ACTIVE_NS {
            std::thread::sleep(Duration::from_nanos(
                (APP_ACTIVE_NS - since_active).max(20_000),
            ));
            continue;
        }
        let work = {
            let mut guard = shared.state.lock().unwrap_or_else(|p| p.into_inner());
            let st = &mut *guard;
            if st.io.failed {
                break;
            }
            let work = progress_once(&shared, st);
            // Address and neighbour changes are rare: while busy, look every millisecond
            // rather than paying a system call per round.
            if now.saturating_sub(last_watch) >= WATCH_EVERY_NS {
                last_watch = now;
                for change in watcher.drain() {
                    st.neighbours.apply(&mut st.dev, change);
                }
            }
            work
        };
        if work && shared.progress_waiters.load(Ordering::SeqCst) > 0 {
            shared.progressed.notify_all();
        }
        // An application that polls its CQs (a poller: it polled in the last few ms) is
        // preempted now and then; this thread covers for it, one round at a time, but never
        // busy-spins next to it: on two cores a third spinning thread takes the CPU the
        // application and its peer need. After a round with work it naps briefly (the
        // application usually takes over); without work it sleeps in poll(), which the next
        // frame, timer or kick ends.
        let polled_ns = shared.app_polled_at.load(Ordering::Relaxed);
        let poller = polled_ns != 0 && now.saturating_sub(polled_ns) < APP_POLLER_NS;
        if work {
            last_work = now;
            if poller {
                std::thread::sleep(Duration::from_nanos(POLLER_NAP_NS));
            }
            continue;
        }
        if !poller && now.saturating_sub(last_work) < spin_ns {
            std::hint::spin_loop();
            continue;
        }
        sleep(&shared, wait_fd, &watcher);
        last_work = shared.now().saturating_sub(spin_ns);
        last_watch = 0;
    }
    // Leave the queue to the kernel: with the slot empty the XDP program passes RoCE frames on.
    let _ = xsks.clear(queue);
    shared.progressed.notify_all();
}

/// Sleeps until a frame arrives, the application kicks, an address changes or the next
/// transport timer is due.
fn sleep(shared: &Shared, wait_fd: RawFd, watcher: &AddressWatcher) {
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
        pollfd(wait_fd),
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
fn next_hop_mac(shared: &Shared, neighbours: &mut Neighbours, dst: IpAddress) -> Option<[u8; 6]> {
    match neighbours.lookup(dst) {
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
    let mut offset = eth.header_len();
    let mut ethertype = eth.ethertype();
    if ethertype == EtherType::Vlan {
        // A second (inner) tag: its TCI, then the real EtherType.
        let t = frame.get(offset + 2..offset + 4)?;
        ethertype = EtherType::from(u16::from_be_bytes([t[0], t[1]]));
        offset += 4;
    }
    match ethertype {
        EtherType::Ipv4 | EtherType::Ipv6 => frame.get(offset..),
        _ => None,
    }
}
