//! The kernel's view of addressing, over rtnetlink.
//!
//! xroce writes its own Ethernet and IP headers onto AF_XDP frames, but the kernel stays the
//! authority on addressing: it owns the interfaces and their addresses, the routes, and the
//! neighbour tables (it answers and sends ARP and IPv6 neighbour discovery). This module only
//! asks it:
//!
//! - [`interface_by_name`] / [`interface_by_index`]: index, name, MAC, MTU, up;
//! - [`addresses`] and [`gid_table`]: the interface's addresses and the RoCE v2 GID table the
//!   Linux RDMA core would build for an rdma_rxe device on it;
//! - [`route_get`]: the outgoing interface, gateway and source for a destination;
//! - [`neighbour`], [`solicit`], [`resolve`]: the next hop's MAC, starting and awaiting
//!   resolution when the kernel does not know it yet;
//! - [`AddressWatcher`]: change notifications for the engine's `poll()` set.
//!
//! All calls are blocking and synchronous (no async runtime), and bounded in time: each
//! request waits at most [`DEFAULT_TIMEOUT`] (1 s) for the kernel's answer and fails with
//! [`NetlinkError::Timeout`] rather than hang; [`resolve`] is bounded by the timeout its caller
//! gives. The free functions open a socket per call, in the calling thread's network
//! namespace; a [`Netlink`] handle keeps one open for repeated calls.
//!
//! # The GID table
//!
//! rdma_rxe declares only RoCE v2, so the RDMA core's GID manager (`roce_gid_mgmt.c`) fills the
//! table with RoCE v2 GIDs only. [`gid_table`] returns it in the order the core builds it for a
//! freshly added device:
//!
//! 1. index 0: the default GID `fe80::` + modified EUI-64 of the MAC ([`default_gid`]: the MAC
//!    with `ff:fe` inserted in the middle and the universal/local bit flipped);
//! 2. the interface's IPv4 addresses, in the kernel's order (primaries, then secondaries);
//! 3. its IPv6 addresses, in the kernel's order (global before link-local);
//!
//! leaving out an address already present (the EUI-64 link-local address is normally the
//! default GID already) and addresses that are still tentative (IPv6 duplicate address
//! detection running) or failed DAD. The kernel itself lists tentative addresses; they are left
//! out here because the engine could not use them yet, and the [`AddressWatcher`] reports an
//! [`Change::Addresses`] change when DAD completes.
//!
//! IPv4 addresses appear as [`IpAddr::V4`]: their GID is the IPv4-mapped IPv6 address
//! `::ffff:a.b.c.d` ([`gid_raw`] gives the 16 bytes; [`gid_from_raw`] maps back), and the core's
//! `DeviceConfig::gids` represents them as `IpAddress::V4`, which is what [`core_gids`] and
//! [`core_address`] produce. A GID of the IPv4-mapped kind makes packets IPv4, any other IPv6.
//!
//! Indices are positions in a list rebuilt from scratch. The kernel instead keeps an address at
//! its index and puts new ones in the first free slot; an engine following changes should merge
//! the new list into its table the same way rather than replace it.

mod address;
mod error;
mod link;
mod neighbour;
mod route;
mod socket;
mod watch;

use std::net::IpAddr;
use std::time::Duration;

pub use address::{
    build_gid_table, core_address, core_gids, default_gid, eui64, gid_from_raw, gid_raw,
    std_address, InterfaceAddress,
};
pub use error::NetlinkError;
pub use link::Interface;
pub use route::Route;
pub use socket::{Netlink, DEFAULT_TIMEOUT};
pub use watch::{AddressWatcher, Change};

/// The interface called `name` (see [`Netlink::interface_by_name`]);
/// [`NetlinkError::NoSuchInterface`] if there is none.
pub fn interface_by_name(name: &str) -> Result<Interface, NetlinkError> {
    Netlink::open()?.interface_by_name(name)
}

/// The interface with index `index`; [`NetlinkError::NoSuchInterfaceIndex`] if there is none.
pub fn interface_by_index(index: u32) -> Result<Interface, NetlinkError> {
    Netlink::open()?.interface_by_index(index)
}

/// Every Ethernet interface (see [`Netlink::interfaces`]).
pub fn interfaces() -> Result<Vec<Interface>, NetlinkError> {
    Netlink::open()?.interfaces()
}

/// Every address of interface `ifindex`, IPv4 first, then IPv6, tentative ones included (see
/// [`Netlink::interface_addresses`] for the flags).
pub fn addresses(ifindex: u32) -> Result<Vec<IpAddr>, NetlinkError> {
    Netlink::open()?.addresses(ifindex)
}

/// The RoCE v2 GID table of `iface`, in the order described in the [module documentation](self):
/// default GID, IPv4 addresses, IPv6 addresses, without duplicates or unusable addresses.
pub fn gid_table(iface: &Interface) -> Result<Vec<IpAddr>, NetlinkError> {
    Netlink::open()?.gid_table(iface)
}

/// The route the kernel would use for `dst` (`ip route get DST`);
/// [`NetlinkError::Unreachable`] when there is none.
pub fn route_get(dst: IpAddr) -> Result<Route, NetlinkError> {
    Netlink::open()?.route_get(dst)
}

/// The route for `dst` from interface `ifindex` (see [`Netlink::route_from`]).
pub fn route_from(dst: IpAddr, ifindex: u32) -> Result<Route, NetlinkError> {
    Netlink::open()?.route_from(dst, ifindex)
}

/// The MAC of neighbour `ip` on interface `ifindex` if the kernel has a usable entry (see
/// [`Netlink::neighbour`]).
pub fn neighbour(ifindex: u32, ip: IpAddr) -> Result<Option<[u8; 6]>, NetlinkError> {
    Netlink::open()?.neighbour(ifindex, ip)
}

/// Makes the kernel start address resolution for `ip` on interface `ifindex` without waiting
/// (see [`Netlink::solicit`] for how).
pub fn solicit(ifindex: u32, ip: IpAddr) -> Result<(), NetlinkError> {
    Netlink::open()?.solicit(ifindex, ip)
}

/// The destination MAC for packets to `ip` leaving by interface `ifindex`: the MAC of
/// `next_hop` (the route's gateway) if given, else of `ip` (on-link). Looks it up, solicits it
/// when missing and waits until it is known or `timeout` passes
/// ([`NetlinkError::NeighbourUnresolved`]). See [`Netlink::resolve`].
pub fn resolve(
    ifindex: u32,
    ip: IpAddr,
    next_hop: Option<IpAddr>,
    timeout: Duration,
) -> Result<[u8; 6], NetlinkError> {
    Netlink::open()?.resolve(ifindex, ip, next_hop, timeout)
}
