//! Route lookups (`RTM_GETROUTE` for one destination, what `ip route get` does).

use std::net::IpAddr;

use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteMessage, RouteType, RouteVia,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};

use super::socket::{Kind, Netlink};
use super::NetlinkError;

/// The kernel's answer to "how do I reach this destination".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    /// The interface packets leave by (the loopback interface for the host's own addresses).
    pub oif: u32,
    /// The router to send to, or `None` when the destination is on-link.
    pub gateway: Option<IpAddr>,
    /// The source address the kernel would choose.
    pub prefsrc: Option<IpAddr>,
    /// The destination is one of this namespace's own addresses (a `local` route: the kernel
    /// would deliver it to itself, through the loopback interface).
    pub local: bool,
}

impl Route {
    /// The address whose MAC the Ethernet header needs: the gateway, or `dst` itself on-link.
    pub fn next_hop(&self, dst: IpAddr) -> IpAddr {
        self.gateway.unwrap_or(dst)
    }
}

impl Netlink {
    /// The route the kernel would use for `dst`, optionally forcing the outgoing interface
    /// (needed for IPv6 link-local destinations, which exist on every link).
    ///
    /// Fails with [`NetlinkError::Unreachable`] when the routing table has no route, or an
    /// unreachable, prohibit, blackhole or throw route.
    pub fn route_get_on(&mut self, dst: IpAddr, oif: Option<u32>) -> Result<Route, NetlinkError> {
        let mut req = RouteMessage::default();
        req.header.address_family = match dst {
            IpAddr::V4(_) => AddressFamily::Inet,
            IpAddr::V6(_) => AddressFamily::Inet6,
        };
        req.header.destination_prefix_length = match dst {
            IpAddr::V4(_) => 32,
            IpAddr::V6(_) => 128,
        };
        req.attributes
            .push(RouteAttribute::Destination(RouteAddress::from(dst)));
        if let Some(oif) = oif {
            req.attributes.push(RouteAttribute::Oif(oif));
        }
        let op = "RTM_GETROUTE";
        let replies = match self.request(
            op,
            RouteNetlinkMessage::GetRoute(req),
            Kind::Single { flags: 0 },
        ) {
            Ok(r) => r,
            Err(e) => {
                return Err(match e.errno() {
                    // No route (ENETUNREACH), an unreachable route (EHOSTUNREACH), a prohibit
                    // route (EACCES), a blackhole route (EINVAL: the request itself is always
                    // well-formed, so this is what EINVAL means here; checked on 6.18).
                    Some(libc::ENETUNREACH | libc::EHOSTUNREACH | libc::EACCES | libc::EINVAL) => {
                        NetlinkError::Unreachable {
                            dst,
                            reason: kernel_reason(&e),
                        }
                    }
                    Some(libc::ENODEV) => match oif {
                        Some(i) => NetlinkError::NoSuchInterfaceIndex(i),
                        None => e,
                    },
                    _ => e,
                });
            }
        };
        let msg = replies
            .into_iter()
            .find_map(|m| match m {
                RouteNetlinkMessage::NewRoute(r) => Some(r),
                _ => None,
            })
            .ok_or_else(|| NetlinkError::Decode {
                op,
                detail: format!("no route message in the answer for {dst}"),
            })?;
        route_from(&msg, dst, op)
    }

    /// The route for `dst` from interface `ifindex`'s point of view: for an IPv6 link-local
    /// destination (which exists on every link, each with its own `fe80::/64` route) the
    /// route out of `ifindex`; for any other destination the kernel's own choice, which may
    /// be another interface (the caller tells the user so). Forcing the interface for those
    /// would make the kernel call any destination on-link there.
    pub fn route_from(&mut self, dst: IpAddr, ifindex: u32) -> Result<Route, NetlinkError> {
        let scoped = matches!(dst, IpAddr::V6(a) if a.is_unicast_link_local());
        self.route_get_on(dst, scoped.then_some(ifindex))
    }

    /// The route the kernel would use for `dst` (`ip route get DST`).
    pub fn route_get(&mut self, dst: IpAddr) -> Result<Route, NetlinkError> {
        self.route_get_on(dst, None)
    }
}

fn kernel_reason(e: &NetlinkError) -> String {
    match e {
        NetlinkError::Kernel { message, .. } => message.clone(),
        other => other.to_string(),
    }
}

fn route_from(msg: &RouteMessage, dst: IpAddr, op: &'static str) -> Result<Route, NetlinkError> {
    let unusable = match msg.header.kind {
        RouteType::Unreachable => Some("unreachable route"),
        RouteType::Prohibit => Some("administratively prohibited route"),
        RouteType::BlackHole => Some("blackhole route"),
        RouteType::Throw => Some("throw route"),
        _ => None,
    };
    if let Some(reason) = unusable {
        return Err(NetlinkError::Unreachable {
            dst,
            reason: reason.to_string(),
        });
    }
    let mut oif = None;
    let mut gateway = None;
    let mut prefsrc = None;
    for a in &msg.attributes {
        match a {
            RouteAttribute::Oif(i) => oif = Some(*i),
            RouteAttribute::Gateway(g) => gateway = route_ip(g),
            // RFC 5549: an IPv4 route through an IPv6 router.
            RouteAttribute::Via(RouteVia::Inet(g)) => gateway = Some(IpAddr::V4(*g)),
            RouteAttribute::Via(RouteVia::Inet6(g)) => gateway = Some(IpAddr::V6(*g)),
            RouteAttribute::PrefSource(s) => prefsrc = route_ip(s),
            _ => {}
        }
    }
    let oif = oif.ok_or_else(|| NetlinkError::Decode {
        op,
        detail: format!("the route to {dst} names no outgoing interface (RTA_OIF)"),
    })?;
    Ok(Route {
        oif,
        gateway,
        prefsrc,
        local: msg.header.kind == RouteType::Local,
    })
}

fn route_ip(a: &RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
        RouteAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
        _ => None,
    }
}
