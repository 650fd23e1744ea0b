//! Neighbours (ARP / IPv6 ND entries): lookup (`RTM_GETNEIGH`), starting resolution, and
//! waiting for it.
//!
//! The kernel keeps doing address resolution; the engine only reads its answers. Because the
//! engine's frames bypass the kernel, the kernel never sees them "use" an entry: a reachable
//! entry ages to STALE and stays there. STALE still names the right MAC almost always (and the
//! kernel itself sends to a STALE entry while it re-checks), so it counts as usable here; an
//! engine that wants the kernel to re-confirm an entry it keeps using can call
//! [`Netlink::solicit`] on it now and then, which is exactly the kernel's own "entry used"
//! signal.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6, UdpSocket};
use std::time::{Duration, Instant};

use netlink_packet_core::NLM_F_CREATE;
use netlink_packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourFlags, NeighbourMessage, NeighbourState,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};

use super::socket::{Kind, Netlink};
use super::watch::{AddressWatcher, Change, RTMGRP_NEIGH};
use super::NetlinkError;

/// `NUD_VALID`: the states in which an entry's MAC can be used (REACHABLE, STALE, DELAY, PROBE,
/// PERMANENT, NOARP; not NONE, INCOMPLETE or FAILED).
const NUD_VALID: u16 = 0x02 | 0x04 | 0x08 | 0x10 | 0x40 | 0x80;
/// `NUD_INCOMPLETE`: resolution under way.
const NUD_INCOMPLETE: u16 = 0x01;
/// The UDP discard port, the target of the fallback solicitation datagram.
const DISCARD_PORT: u16 = 9;
/// Longest sleep between two looks while [`Netlink::resolve`] waits (events usually wake it
/// sooner).
const RESOLVE_POLL: Duration = Duration::from_millis(100);
/// Shortest interval between two solicitations of the same neighbour during one `resolve`.
const RESOLVE_RESOLICIT: Duration = Duration::from_millis(100);

/// One neighbour entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    /// The raw `NUD_*` state.
    pub state: u16,
    pub mac: Option<[u8; 6]>,
}

impl Entry {
    /// The MAC, if the entry is in a usable state.
    pub fn usable_mac(&self) -> Option<[u8; 6]> {
        self.mac.filter(|_| usable(self.state))
    }
}

pub(crate) fn usable(state: u16) -> bool {
    state & NUD_VALID != 0
}

pub(crate) fn mac_from(attrs: &[NeighbourAttribute]) -> Option<[u8; 6]> {
    attrs.iter().find_map(|a| match a {
        NeighbourAttribute::LinkLocalAddress(b) => <[u8; 6]>::try_from(b.as_slice()).ok(),
        _ => None,
    })
}

pub(crate) fn dst_from(attrs: &[NeighbourAttribute]) -> Option<IpAddr> {
    attrs.iter().find_map(|a| match a {
        NeighbourAttribute::Destination(NeighbourAddress::Inet(v4)) => Some(IpAddr::V4(*v4)),
        NeighbourAttribute::Destination(NeighbourAddress::Inet6(v6)) => Some(IpAddr::V6(*v6)),
        _ => None,
    })
}

fn request_for(ifindex: u32, ip: IpAddr) -> NeighbourMessage {
    let mut m = NeighbourMessage::default();
    m.header.family = match ip {
        IpAddr::V4(_) => AddressFamily::Inet,
        IpAddr::V6(_) => AddressFamily::Inet6,
    };
    m.header.ifindex = ifindex;
    m.attributes.push(NeighbourAttribute::Destination(match ip {
        IpAddr::V4(a) => NeighbourAddress::from(a),
        IpAddr::V6(a) => NeighbourAddress::from(a),
    }));
    m
}

impl Netlink {
    /// The kernel's entry for `ip` on interface `ifindex`, in whatever state (`RTM_GETNEIGH`
    /// for one entry, kernel 4.20 and later).
    pub(crate) fn neighbour_entry(
        &mut self,
        ifindex: u32,
        ip: IpAddr,
    ) -> Result<Option<Entry>, NetlinkError> {
        let op = "RTM_GETNEIGH";
        let replies = match self.request(
            op,
            RouteNetlinkMessage::GetNeighbour(request_for(ifindex, ip)),
            Kind::Single { flags: 0 },
        ) {
            Ok(r) => r,
            Err(e) if e.errno() == Some(libc::ENOENT) => return Ok(None),
            Err(e) if e.errno() == Some(libc::ENODEV) => {
                return Err(NetlinkError::NoSuchInterfaceIndex(ifindex))
            }
            Err(e) => return Err(e),
        };
        Ok(replies.into_iter().find_map(|m| match m {
            RouteNetlinkMessage::NewNeighbour(n) => Some(Entry {
                state: u16::from(n.header.state),
                mac: mac_from(&n.attributes),
            }),
            _ => None,
        }))
    }

    /// The MAC of neighbour `ip` on interface `ifindex`, if the kernel has a usable entry
    /// (REACHABLE, STALE, DELAY, PROBE, PERMANENT or NOARP); `None` when it has none, or one
    /// still INCOMPLETE or FAILED.
    pub fn neighbour(&mut self, ifindex: u32, ip: IpAddr) -> Result<Option<[u8; 6]>, NetlinkError> {
        Ok(self
            .neighbour_entry(ifindex, ip)?
            .and_then(|e| e.usable_mac()))
    }

    /// Makes the kernel start address resolution for `ip` on interface `ifindex` (or re-confirm
    /// a STALE entry), without waiting for the answer.
    ///
    /// How: an `RTM_NEWNEIGH` with the `NTF_USE` flag and `NLM_F_CREATE`. The kernel creates
    /// the entry if needed and calls `neigh_event_send()` on it, exactly what it does when it
    /// has a packet for that neighbour: an absent/FAILED entry goes INCOMPLETE and the usual
    /// ARP requests / neighbour solicitations go out (mcast_solicit of them, then FAILED); a
    /// STALE entry goes DELAY and is re-probed; a REACHABLE or PERMANENT entry is untouched.
    /// No MAC is ever written, so this cannot corrupt the table. Verified on kernel 6.18.
    ///
    /// Rejected alternatives: `RTM_NEWNEIGH` with state `NUD_INCOMPLETE` creates an entry but
    /// sends nothing (`__neigh_update()` does not start the timer for a non-valid state), so it
    /// sits there until garbage collection; and a "real" datagram would send the peer traffic
    /// it never asked for.
    ///
    /// That datagram is nevertheless the fallback when the caller lacks `CAP_NET_ADMIN`
    /// (RTM_NEWNEIGH answers EPERM): an empty UDP datagram to the discard port (9) of `ip`,
    /// which the kernel holds in the neighbour's queue while it resolves (and then delivers).
    ///
    /// IPv6 detail: the kernel sends a solicitation without a packet to take the source address
    /// from only when the interface has a usable (non-tentative) link-local address.
    pub fn solicit(&mut self, ifindex: u32, ip: IpAddr) -> Result<(), NetlinkError> {
        match self.use_neighbour(ifindex, ip, NLM_F_CREATE) {
            Err(e) if matches!(e.errno(), Some(libc::EPERM | libc::EACCES)) => {
                log::debug!("RTM_NEWNEIGH not permitted ({e}); soliciting {ip} with a datagram");
                solicit_by_datagram(ifindex, ip)
            }
            other => other,
        }
    }

    /// Tells the kernel that its entry for `ip` is in use, as sending a packet through it
    /// would (`NTF_USE`): a STALE entry is probed again, a FAILED one resolved again. Unlike
    /// [`Self::solicit`] it creates no entry: one that is gone is `Ok(false)`. An entry the
    /// kernel flushed (its interface's MAC changed, say) must not come back by itself, since
    /// creating it broadcasts a request that tells the neighbour this side's MAC at that moment,
    /// while the engine sends only when it has a packet. The kernel's refusal (`EPERM` without
    /// `CAP_NET_ADMIN`) is returned as it is: there is no datagram fallback.
    pub fn touch_neighbour(&mut self, ifindex: u32, ip: IpAddr) -> Result<bool, NetlinkError> {
        match self.use_neighbour(ifindex, ip, 0) {
            Ok(()) => Ok(true),
            Err(e) if e.errno() == Some(libc::ENOENT) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// `RTM_NEWNEIGH` with `NTF_USE` and the netlink `flags` (`NLM_F_CREATE` or none).
    fn use_neighbour(&mut self, ifindex: u32, ip: IpAddr, flags: u16) -> Result<(), NetlinkError> {
        let mut m = request_for(ifindex, ip);
        m.header.flags = NeighbourFlags::Use;
        m.header.state = NeighbourState::None;
        match self.request(
            "RTM_NEWNEIGH (NTF_USE)",
            RouteNetlinkMessage::NewNeighbour(m),
            Kind::Single { flags },
        ) {
            Ok(_) => Ok(()),
            Err(e) if e.errno() == Some(libc::ENODEV) => {
                Err(NetlinkError::NoSuchInterfaceIndex(ifindex))
            }
            Err(e) => Err(e),
        }
    }

    /// The MAC to put in the Ethernet header of packets to `ip`: that of `next_hop` when the
    /// route names a gateway (pass [`Route::gateway`](super::Route::gateway)), else of `ip`
    /// itself (`next_hop` = `None`: on-link).
    ///
    /// Looks in the kernel's neighbour table; when the entry is missing or unusable, starts
    /// resolution ([`Netlink::solicit`]) and waits, woken by neighbour events (and at least
    /// every 100 ms), until the kernel has the MAC or `timeout` has passed:
    /// [`NetlinkError::NeighbourUnresolved`] names the next hop that did not answer. Never
    /// takes much longer than `timeout` (each request is bounded too).
    pub fn resolve(
        &mut self,
        ifindex: u32,
        ip: IpAddr,
        next_hop: Option<IpAddr>,
        timeout: Duration,
    ) -> Result<[u8; 6], NetlinkError> {
        let hop = next_hop.unwrap_or(ip);
        let deadline = Instant::now() + timeout;
        // Subscribe before the first look, so an answer arriving in between wakes us.
        let mut events = AddressWatcher::with_groups(RTMGRP_NEIGH)?;
        let saved = self.timeout();
        let r = self.resolve_loop(ifindex, hop, deadline, saved, &mut events);
        self.set_timeout(saved);
        if r.is_err() && hop != ip {
            log::debug!("resolving {ip} through gateway {hop} failed");
        }
        r
    }

    fn resolve_loop(
        &mut self,
        ifindex: u32,
        hop: IpAddr,
        deadline: Instant,
        request_bound: Duration,
        events: &mut AddressWatcher,
    ) -> Result<[u8; 6], NetlinkError> {
        let mut last_solicit: Option<Instant> = None;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            // Each request may take the time left (at least 10 ms, at most the usual bound).
            self.set_timeout(left.clamp(Duration::from_millis(10), request_bound));
            let entry = self.neighbour_entry(ifindex, hop)?;
            if let Some(mac) = entry.and_then(|e| e.usable_mac()) {
                return Ok(mac);
            }
            // Start resolution unless it is under way (even with no time left to wait: a zero
            // timeout means "look up, or start resolving and return").
            let now = Instant::now();
            let in_progress = entry.is_some_and(|e| e.state & NUD_INCOMPLETE != 0);
            let may_solicit =
                last_solicit.is_none_or(|t| now.duration_since(t) >= RESOLVE_RESOLICIT);
            if !in_progress && may_solicit {
                self.solicit(ifindex, hop)?;
                last_solicit = Some(now);
            }
            if now >= deadline {
                return Err(NetlinkError::NeighbourUnresolved(hop));
            }
            let wait = deadline
                .saturating_duration_since(Instant::now())
                .min(RESOLVE_POLL);
            if wait_readable(events.as_raw_fd(), wait) {
                for change in events.drain() {
                    if let Change::Neighbour(i, a, Some(mac)) = change {
                        if i == ifindex && a == hop {
                            return Ok(mac);
                        }
                    }
                }
            }
        }
    }
}

/// Waits up to `wait` for `fd` to become readable.
fn wait_readable(fd: i32, wait: Duration) -> bool {
    let ms = i32::try_from(wait.as_micros().div_ceil(1000)).unwrap_or(i32::MAX);
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: `pfd` is one valid, initialised pollfd that outlives the call; nfds is 1.
    let r = unsafe { libc::poll(&mut pfd, 1, ms) };
    r > 0
}

/// The unprivileged way to start resolution: one empty UDP datagram to the discard port.
fn solicit_by_datagram(ifindex: u32, ip: IpAddr) -> Result<(), NetlinkError> {
    let op = "neighbour solicitation (UDP datagram)";
    let io_err = |source: io::Error| NetlinkError::Io { op, source };
    let (local, target): (SocketAddr, SocketAddr) = match ip {
        IpAddr::V4(a) => ((Ipv4Addr::UNSPECIFIED, 0).into(), (a, DISCARD_PORT).into()),
        IpAddr::V6(a) => {
            // Link-local addresses need the interface as scope.
            let scope = if a.is_unicast_link_local() {
                ifindex
            } else {
                0
            };
            (
                (Ipv6Addr::UNSPECIFIED, 0).into(),
                SocketAddrV6::new(a, DISCARD_PORT, 0, scope).into(),
            )
        }
    };
    let sock = UdpSocket::bind(local).map_err(io_err)?;
    sock.set_nonblocking(true).map_err(io_err)?;
    match sock.send_to(&[], target) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(()),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::ENETUNREACH | libc::EHOSTUNREACH)
            ) =>
        {
            Err(NetlinkError::Unreachable {
                dst: ip,
                reason: e.to_string(),
            })
        }
        Err(e) => Err(io_err(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usable_states_are_the_kernels_nud_valid() {
        for (state, ok) in [
            (NeighbourState::Incomplete, false),
            (NeighbourState::Reachable, true),
            (NeighbourState::Stale, true),
            (NeighbourState::Delay, true),
            (NeighbourState::Probe, true),
            (NeighbourState::Failed, false),
            (NeighbourState::Noarp, true),
            (NeighbourState::Permanent, true),
            (NeighbourState::None, false),
        ] {
            assert_eq!(usable(u16::from(state)), ok, "{state:?}");
        }
        let e = Entry {
            state: u16::from(NeighbourState::Failed),
            mac: Some([2, 0, 0, 0, 0, 1]),
        };
        assert_eq!(e.usable_mac(), None);
    }

    #[test]
    fn macs_of_other_lengths_are_ignored() {
        assert_eq!(
            mac_from(&[NeighbourAttribute::LinkLocalAddress(vec![1, 2, 3, 4])]),
            None
        );
        assert_eq!(
            mac_from(&[NeighbourAttribute::LinkLocalAddress(vec![1, 2, 3, 4, 5, 6])]),
            Some([1, 2, 3, 4, 5, 6])
        );
    }
}
