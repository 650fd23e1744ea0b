//! Following the kernel's changes: a netlink socket subscribed to link, address and neighbour
//! notifications, for the engine's `poll()` set.

use std::io;
use std::net::IpAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};

use netlink_packet_core::{NetlinkBuffer, NetlinkMessage, NetlinkPayload};
use netlink_packet_route::neighbour::NeighbourMessage;
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::Socket;

use super::neighbour::{dst_from, mac_from, usable};
use super::socket::{align4, open_socket, recv_datagram};
use super::NetlinkError;

/// `RTMGRP_LINK`: interfaces appearing, changing (flags, MTU, MAC), disappearing.
pub(crate) const RTMGRP_LINK: u32 = 0x1;
/// `RTMGRP_NEIGH`: neighbour entries changing state.
pub(crate) const RTMGRP_NEIGH: u32 = 0x4;
/// `RTMGRP_IPV4_IFADDR`.
pub(crate) const RTMGRP_IPV4_IFADDR: u32 = 0x10;
/// `RTMGRP_IPV6_IFADDR`.
pub(crate) const RTMGRP_IPV6_IFADDR: u32 = 0x100;
/// `RTMGRP_IPV4_ROUTE`: IPv4 routes added, changed, removed.
pub(crate) const RTMGRP_IPV4_ROUTE: u32 = 0x40;
/// `RTMGRP_IPV6_ROUTE`.
pub(crate) const RTMGRP_IPV6_ROUTE: u32 = 0x400;

/// Socket receive buffer asked for (the kernel caps it at `net.core.rmem_max`). Notifications
/// that do not fit are lost; [`Change::Resync`] reports it.
const WATCH_RCVBUF: usize = 1 << 20;
/// Datagrams read by one [`AddressWatcher::drain`], so that a storm cannot hold the caller;
/// what is left keeps the descriptor readable.
const DRAIN_MAX: usize = 256;

/// Something about addressing changed. Each names what to read again; none carries the whole
/// new state (read it with [`gid_table`](super::gid_table), [`interface_by_index`](super::interface_by_index)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Change {
    /// Interface `ifindex` appeared, changed (up/down, carrier, MTU, MAC, name) or went away.
    Link(u32),
    /// An address of interface `ifindex` was added, removed or changed flags (e.g. finished
    /// duplicate address detection): its GID table may differ.
    Addresses(u32),
    /// The neighbour entry for the IP on interface `ifindex` changed: `Some(mac)` when it is in
    /// a usable state, `None` when it is gone, INCOMPLETE or FAILED.
    Neighbour(u32, IpAddr, Option<[u8; 6]>),
    /// A route was added, changed or removed: destinations may have another next hop.
    Routes,
    /// Notifications were lost (socket buffer overrun, or one could not be decoded): re-read
    /// everything of interest.
    Resync,
}

/// A non-blocking netlink socket subscribed to link, IPv4/IPv6 address and neighbour
/// notifications of the network namespace it was created in.
pub struct AddressWatcher {
    sock: Socket,
    buf: Vec<u8>,
    /// Each link notification's interface and whether it showed the link up, since the last
    /// [`Self::take_link_states`], when asked for ([`Self::note_link_states`]).
    link_states: Option<Vec<(u32, bool)>>,
}

impl std::fmt::Debug for AddressWatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AddressWatcher")
            .field("fd", &self.sock.as_raw_fd())
            .finish()
    }
}

impl AddressWatcher {
    /// Subscribes to `RTMGRP_LINK`, `RTMGRP_IPV4_IFADDR`, `RTMGRP_IPV6_IFADDR` and
    /// `RTMGRP_NEIGH`.
    pub fn new() -> Result<AddressWatcher, NetlinkError> {
        AddressWatcher::with_groups(
            RTMGRP_LINK | RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR | RTMGRP_NEIGH,
        )
    }

    /// As [`Self::new`], and route changes too ([`Change::Routes`]): for an engine, whose
    /// next hops depend on them. (Watchers that only follow a port's state leave them out: a
    /// host with a routing daemon can change routes often.)
    pub fn with_route_changes() -> Result<AddressWatcher, NetlinkError> {
        AddressWatcher::with_groups(
            RTMGRP_LINK
                | RTMGRP_IPV4_IFADDR
                | RTMGRP_IPV6_IFADDR
                | RTMGRP_NEIGH
                | RTMGRP_IPV4_ROUTE
                | RTMGRP_IPV6_ROUTE,
        )
    }

    pub(crate) fn with_groups(groups: u32) -> Result<AddressWatcher, NetlinkError> {
        let sock = open_socket(groups)?;
        if let Err(e) = sock.set_rx_buf_sz(WATCH_RCVBUF) {
            log::debug!("netlink watcher: cannot enlarge the receive buffer: {e}");
        }
        Ok(AddressWatcher {
            sock,
            buf: Vec::new(),
            link_states: None,
        })
    }

    /// The descriptor to include in a `poll()` set (readable when changes are pending).
    pub fn as_raw_fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }

    /// The changes announced since the last call, oldest first, without blocking. Repeated
    /// `Link` and `Addresses` changes of one interface are reported once; for a neighbour only
    /// its latest state is reported (at the place of its first change).
    pub fn drain(&mut self) -> Vec<Change> {
        let mut out = Vec::new();
        for _ in 0..DRAIN_MAX {
            match recv_datagram(&self.sock, &mut self.buf) {
                Ok(()) => parse_datagram(&self.buf, &mut out, self.link_states.as_mut()),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                    log::debug!("netlink watcher: notifications lost (socket buffer overrun)");
                    push(&mut out, Change::Resync);
                }
                Err(e) => {
                    // A datagram too large for the buffer (consumed, so lost) or a socket
                    // error: the caller must re-read; a persistent error must not spin.
                    log::warn!("netlink watcher: {e}");
                    push(&mut out, Change::Resync);
                    break;
                }
            }
        }
        out
    }

    /// From now on, [`Self::drain`] also keeps each link notification's state (up: `IFF_UP`
    /// and `IFF_RUNNING`), in order: a link that went down and came back before the caller
    /// read its state has still been down, which rdma_rxe reports as two port events. (Off by
    /// default: a watcher that never takes the list would keep every notification.)
    pub fn note_link_states(&mut self) {
        self.link_states.get_or_insert_with(Vec::new);
    }

    /// The `(ifindex, up)` of each link notification since the last call, oldest first (see
    /// [`Self::note_link_states`]).
    pub fn take_link_states(&mut self) -> Vec<(u32, bool)> {
        self.link_states
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }
}

impl AsRawFd for AddressWatcher {
    fn as_raw_fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }
}

impl AsFd for AddressWatcher {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.sock.as_fd()
    }
}

fn parse_datagram(
    buf: &[u8],
    out: &mut Vec<Change>,
    mut link_states: Option<&mut Vec<(u32, bool)>>,
) {
    let mut off = 0;
    while off < buf.len() {
        let rest = &buf[off..];
        let Ok(nb) = NetlinkBuffer::new_checked(rest) else {
            push(out, Change::Resync);
            return;
        };
        let len = nb.length() as usize;
        off += align4(len).max(16);
        let bytes = rest.get(..len).unwrap_or(rest);
        match NetlinkMessage::<RouteNetlinkMessage>::deserialize(bytes) {
            Ok(m) => {
                if let NetlinkPayload::InnerMessage(inner) = m.payload {
                    if let (Some(states), RouteNetlinkMessage::NewLink(l)) =
                        (link_states.as_deref_mut(), &inner)
                    {
                        states.push((l.header.index, super::link::is_up(l.header.flags)));
                    }
                    if let Some(c) = change_from(inner) {
                        push(out, c);
                    }
                }
            }
            Err(e) => {
                log::warn!(
                    "netlink watcher: undecodable notification (type {}): {e}",
                    nb.message_type()
                );
                push(out, Change::Resync);
            }
        }
    }
}

fn change_from(msg: RouteNetlinkMessage) -> Option<Change> {
    match msg {
        RouteNetlinkMessage::NewLink(l) | RouteNetlinkMessage::DelLink(l) => {
            Some(Change::Link(l.header.index))
        }
        RouteNetlinkMessage::NewAddress(a) | RouteNetlinkMessage::DelAddress(a) => {
            Some(Change::Addresses(a.header.index))
        }
        RouteNetlinkMessage::NewRoute(_) | RouteNetlinkMessage::DelRoute(_) => Some(Change::Routes),
        RouteNetlinkMessage::NewNeighbour(n) => neighbour_change(&n, true),
        RouteNetlinkMessage::DelNeighbour(n) => neighbour_change(&n, false),
        _ => None,
    }
}

fn neighbour_change(n: &NeighbourMessage, new: bool) -> Option<Change> {
    // Bridge FDB entries arrive on the same group; they have no IP destination.
    let ip = dst_from(&n.attributes)?;
    let mac = mac_from(&n.attributes).filter(|_| new && usable(u16::from(n.header.state)));
    Some(Change::Neighbour(n.header.ifindex, ip, mac))
}

/// Appends `c`, folding it into an earlier change about the same thing.
fn push(out: &mut Vec<Change>, c: Change) {
    match c {
        Change::Neighbour(i, ip, _) => {
            if let Some(slot) = out
                .iter_mut()
                .find(|e| matches!(e, Change::Neighbour(j, a, _) if *j == i && *a == ip))
            {
                *slot = c;
                return;
            }
        }
        _ => {
            if out.contains(&c) {
                return;
            }
        }
    }
    out.push(c);
}

#[cfg(test)]
mod tests {
    use super::*;
    use netlink_packet_route::link::LinkFlags;

    #[test]
    fn changes_are_folded() {
        let ip: IpAddr = "10.0.0.2".parse().expect("ip");
        let mut out = Vec::new();
        push(&mut out, Change::Addresses(3));
        push(&mut out, Change::Neighbour(3, ip, None));
        push(&mut out, Change::Link(3));
        push(&mut out, Change::Addresses(3));
        push(&mut out, Change::Addresses(4));
        push(&mut out, Change::Neighbour(3, ip, Some([2, 0, 0, 0, 0, 2])));
        push(&mut out, Change::Neighbour(4, ip, None));
        assert_eq!(
            out,
            vec![
                Change::Addresses(3),
                Change::Neighbour(3, ip, Some([2, 0, 0, 0, 0, 2])),
                Change::Link(3),
                Change::Addresses(4),
                Change::Neighbour(4, ip, None),
            ]
        );
    }

    /// One datagram of `RTM_NEWLINK` notifications for interface 3 with `flags` each.
    fn link_datagram(flags: &[LinkFlags]) -> Vec<u8> {
        let mut d = Vec::new();
        for &f in flags {
            let mut l = netlink_packet_route::link::LinkMessage::default();
            l.header.index = 3;
            l.header.flags = f;
            let mut m = NetlinkMessage::from(RouteNetlinkMessage::NewLink(l));
            m.finalize();
            let mut b = vec![0u8; m.buffer_len()];
            m.serialize(&mut b);
            d.extend_from_slice(&b);
        }
        d
    }

    /// A link that went down and up again between two reads is one `Link` change, but each
    /// notification's state is kept, in order, when that is asked for.
    #[test]
    fn each_link_notifications_state_is_kept_in_order() {
        let up = LinkFlags::Up | LinkFlags::Running;
        let no_carrier = LinkFlags::Up;
        for (flags, states) in [
            (vec![up], vec![(3, true)]),
            (vec![LinkFlags::empty(), up], vec![(3, false), (3, true)]),
            (
                vec![no_carrier, up, no_carrier],
                vec![(3, false), (3, true), (3, false)],
            ),
        ] {
            let mut out = Vec::new();
            let mut seen = Vec::new();
            parse_datagram(&link_datagram(&flags), &mut out, Some(&mut seen));
            assert_eq!(out, vec![Change::Link(3)], "{flags:?}");
            assert_eq!(seen, states, "{flags:?}");
        }
    }

    #[test]
    fn garbage_datagrams_ask_for_a_resync_and_never_panic() {
        let mut out = Vec::new();
        parse_datagram(&[1, 2, 3], &mut out, None);
        assert_eq!(out, vec![Change::Resync]);
        let mut out = Vec::new();
        // A header claiming 20 bytes of type RTM_NEWADDR with a truncated body.
        let mut d = Vec::new();
        d.extend_from_slice(&20u32.to_ne_bytes());
        d.extend_from_slice(&20u16.to_ne_bytes());
        d.extend_from_slice(&0u16.to_ne_bytes());
        d.extend_from_slice(&0u32.to_ne_bytes());
        d.extend_from_slice(&0u32.to_ne_bytes());
        d.extend_from_slice(&[0; 4]);
        parse_datagram(&d, &mut out, None);
        assert_eq!(out, vec![Change::Resync]);
    }
}
