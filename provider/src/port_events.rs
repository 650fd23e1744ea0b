//! Port events for `ibv_get_async_event`: the netdev going down or up (`IBV_EVENT_PORT_ERR` /
//! `IBV_EVENT_PORT_ACTIVE`), its addresses changing (`IBV_EVENT_GID_CHANGE`) and its removal
//! (`IBV_EVENT_DEVICE_FATAL`), as rdma_rxe reports them. One thread per open context sleeps in
//! `poll()` on a netlink subscription and costs nothing while nothing changes.

use std::net::IpAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::thread::JoinHandle;

use xroce_datapath::netlink::{self, AddressWatcher, Change, NetlinkError};

use crate::abi::verbs::{IBV_EVENT_GID_CHANGE, IBV_EVENT_PORT_ACTIVE, IBV_EVENT_PORT_ERR};
use crate::event_routes::{post_async, post_device_fatal, with_routes};

/// The watcher thread of one context; dropping it stops the thread.
pub struct PortWatch {
    stop: OwnedFd,
    thread: Option<JoinHandle<()>>,
}

/// What is compared between changes.
#[derive(PartialEq)]
struct PortState {
    up: bool,
    gids: Vec<IpAddr>,
}

fn port_state(iface: &netlink::Interface) -> PortState {
    let gids = netlink::gid_table(iface).unwrap_or_default();
    PortState { up: iface.up, gids }
}

fn read_state(netdev: &str) -> Option<(u32, PortState)> {
    let iface = netlink::interface_by_name(netdev).ok()?;
    Some((iface.index, port_state(&iface)))
}

/// The state of interface `ifindex` now: `Err(true)` when it no longer exists, `Err(false)`
/// when it cannot be read just now.
fn state_now(ifindex: u32) -> Result<PortState, bool> {
    let iface = netlink::interface_by_index(ifindex)
        .map_err(|e| matches!(e, NetlinkError::NoSuchInterfaceIndex(_)))?;
    Ok(port_state(&iface))
}

impl PortWatch {
    /// Starts watching `netdev`; `None` if netlink or the thread cannot be set up (the context
    /// then works without port events).
    pub fn start(
        netdev: String,
        async_tx: Arc<OwnedFd>,
        fatal_posted: Arc<AtomicBool>,
    ) -> Option<PortWatch> {
        let mut watcher = AddressWatcher::new().ok()?;
        watcher.note_link_states();
        let (ifindex, mut last) = read_state(&netdev)?;
        // The link's state as the last notification gave it, and whether the notifications
        // since the last state read went down from up (kept over a read that failed).
        let mut notified_up = last.up;
        let mut went_down = false;
        // SAFETY: a fresh eventfd, owned at once.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if efd < 0 {
            return None;
        }
        // SAFETY: `efd` is a valid descriptor nobody else owns.
        let stop = unsafe { OwnedFd::from_raw_fd(efd) };
        let stop_fd = stop.as_raw_fd();
        let thread = std::thread::Builder::new()
            .name("xroce-port-events".into())
            .spawn(move || loop {
                let mut fds = [
                    libc::pollfd {
                        fd: watcher.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    },
                    libc::pollfd {
                        fd: stop_fd,
                        events: libc::POLLIN,
                        revents: 0,
                    },
                ];
                // SAFETY: polling two valid descriptors.
                let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
                if n < 0
                    && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted
                {
                    return;
                }
                if fds[1].revents != 0 {
                    return;
                }
                let relevant = watcher.drain().into_iter().any(|c| match c {
                    Change::Link(i) | Change::Addresses(i) => i == ifindex,
                    Change::Resync => true,
                    _ => false,
                });
                // The notifications' own states, read with them: the state read below may
                // already be up again. A down is an edge from up in that stream, so the
                // intermediate states of one `ip link set up` (up, then running) are not one.
                for (i, up) in watcher.take_link_states() {
                    if i == ifindex {
                        went_down |= notified_up && !up;
                        notified_up = up;
                    }
                }
                if !relevant {
                    continue;
                }
                let now = match state_now(ifindex) {
                    Ok(now) => now,
                    Err(true) => {
                        // The netdev is gone, and the device with it (rdma_rxe unregisters
                        // its device then). An engine on it has failed its QPs too.
                        // Under the routes lock, as every write to the async pipe: a
                        // destroy taking its object's events out of the pipe (and writing
                        // the others back) must not have a record slip in between.
                        with_routes(|_| post_device_fatal(&async_tx, &fatal_posted));
                        return;
                    }
                    Err(false) => continue,
                };
                let mut was_up = last.up;
                if std::mem::take(&mut went_down) && was_up {
                    // Down and up again before this thread read the state: both events, as
                    // rdma_rxe posts one per netdev event.
                    with_routes(|_| post_async(&async_tx, 1, IBV_EVENT_PORT_ERR));
                    was_up = false;
                }
                if now.up != was_up {
                    let ty = if now.up {
                        IBV_EVENT_PORT_ACTIVE
                    } else {
                        IBV_EVENT_PORT_ERR
                    };
                    with_routes(|_| post_async(&async_tx, 1, ty));
                }
                if now.gids != last.gids {
                    with_routes(|_| post_async(&async_tx, 1, IBV_EVENT_GID_CHANGE));
                }
                last = now;
            })
            .ok()?;
        Some(PortWatch {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for PortWatch {
    fn drop(&mut self) {
        let one: u64 = 1;
        // SAFETY: an 8-byte write to our eventfd.
        unsafe { libc::write(self.stop.as_raw_fd(), (&one as *const u64).cast(), 8) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
