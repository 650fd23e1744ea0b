//! Where a frame for a destination goes: to this device itself, or to the wire behind an
//! Ethernet header built once per destination and round.

use std::sync::atomic::Ordering;

use xroce_core::wire::{EtherType, EthernetAddress, EthernetRepr, IpAddress};

use super::ETH_HEADER;
use crate::engine::addressing::{Neighbours, NextHop};
use crate::engine::Shared;

/// Where a frame for a destination goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Route {
    /// To a GID of this device: handed to the transport without touching the wire.
    Loopback,
    /// To the wire, behind this Ethernet header (this interface's MAC to the next hop's).
    Wire([u8; ETH_HEADER]),
}

/// The Ethernet header of frames from `src` to the next hop `mac` carrying packets to `dst`:
/// built once per destination and round, and copied into each frame (emitting it field by
/// field was about 30 instructions per frame).
pub(super) fn ethernet_header(
    src: [u8; 6],
    mac: [u8; 6],
    dst: IpAddress,
) -> Option<[u8; ETH_HEADER]> {
    let eth = EthernetRepr {
        src: EthernetAddress(src),
        dst: EthernetAddress(mac),
        vlan: None,
        ethertype: match dst {
            IpAddress::V4(_) => EtherType::Ipv4,
            IpAddress::V6(_) => EtherType::Ipv6,
        },
    };
    let mut header = [0u8; ETH_HEADER];
    eth.emit(&mut header).ok()?;
    Some(header)
}

/// The route of the last destination a frame went to, kept from round to round while the
/// tables it came from stay as they were ([`Neighbours::routes_version`] and
/// [`Device::gids_version`](xroce_core::transport::Device::gids_version)). A stream sends a
/// whole round to one peer and a ping-pong every turn's, and finding the route (a scan of the
/// GID table, a hash lookup in the neighbour cache, the Ethernet header) was about 100
/// instructions per frame, on a ping-pong turn's path before its answer's kick. A destination
/// without a route is not remembered: every frame for it is counted where it is dropped.
#[derive(Default)]
pub(super) struct RouteMemo {
    last: Option<(IpAddress, Route)>,
    /// The tables' version the route was found in.
    version: u64,
}

impl RouteMemo {
    pub(super) fn route(
        &mut self,
        dst: IpAddress,
        version: u64,
        resolve: impl FnOnce(IpAddress) -> Option<Route>,
    ) -> Option<Route> {
        match self.last {
            Some((known, route)) if known == dst && self.version == version => Some(route),
            _ => {
                self.last = None;
                let route = resolve(dst)?;
                self.last = Some((dst, route));
                self.version = version;
                Some(route)
            }
        }
    }
}

/// The destination MAC for a packet to `dst`, or `None` (packet dropped, counted) when the
/// route leaves by another interface or the neighbour is not resolved yet.
pub(super) fn next_hop_mac(
    shared: &Shared,
    neighbours: &mut Neighbours,
    dst: IpAddress,
) -> Option<[u8; 6]> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use xroce_core::wire::{EthernetFrame, Ipv4Address, Ipv6Address};

    /// The prebuilt header is the one `EthernetRepr` writes: next hop first, then this
    /// interface, then the destination's IP version.
    #[test]
    fn the_prebuilt_ethernet_header_names_both_macs_and_the_ip_version() {
        let (src, mac) = ([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]);
        let v4 =
            ethernet_header(src, mac, IpAddress::V4(Ipv4Address([10, 0, 0, 2]))).expect("header");
        assert_eq!(v4[..6], mac);
        assert_eq!(v4[6..12], src);
        assert_eq!(v4[12..], [0x08, 0x00]);
        let v6 = ethernet_header(src, mac, IpAddress::V6(Ipv6Address([0xfe; 16]))).expect("header");
        assert_eq!(v6[..12], v4[..12]);
        assert_eq!(v6[12..], [0x86, 0xdd]);
        let parsed = EthernetRepr::parse(&EthernetFrame::new_checked(&v6[..]).expect("frame"))
            .expect("parses");
        assert_eq!(parsed.ethertype, EtherType::Ipv6);
    }

    /// The memo answers for the destination it saw last while the tables' version stays,
    /// asks again for any other destination or after the version moved, and does not
    /// remember a destination that had no route.
    #[test]
    fn a_destination_is_resolved_once_until_another_comes_or_the_tables_change() {
        let a = IpAddress::V4(Ipv4Address([10, 0, 0, 1]));
        let b = IpAddress::V4(Ipv4Address([10, 0, 0, 2]));
        let mut memo = RouteMemo::default();
        let mut asked = Vec::new();
        let mut route = |memo: &mut RouteMemo, dst, version, answer: Option<Route>| {
            memo.route(dst, version, |d| {
                asked.push(d);
                answer
            })
        };
        let mac = Route::Wire([2; ETH_HEADER]);
        let other_mac = Route::Wire([3; ETH_HEADER]);
        assert_eq!(route(&mut memo, a, 0, Some(mac)), Some(mac));
        assert_eq!(route(&mut memo, a, 0, None), Some(mac));
        assert_eq!(
            route(&mut memo, b, 0, Some(Route::Loopback)),
            Some(Route::Loopback)
        );
        assert_eq!(route(&mut memo, a, 0, Some(mac)), Some(mac));
        // The tables changed (a neighbour's new MAC, say): asked again, and the new answer
        // is the one kept.
        assert_eq!(route(&mut memo, a, 1, Some(other_mac)), Some(other_mac));
        assert_eq!(route(&mut memo, a, 1, Some(mac)), Some(other_mac));
        // A route that went away with the change is not kept either.
        assert_eq!(route(&mut memo, a, 2, None), None);
        assert_eq!(route(&mut memo, a, 2, Some(mac)), Some(mac));
        // No route: dropped, and asked again for the next frame.
        assert_eq!(route(&mut memo, b, 2, None), None);
        assert_eq!(route(&mut memo, b, 2, None), None);
        assert_eq!(route(&mut memo, b, 2, Some(mac)), Some(mac));
        assert_eq!(asked, vec![a, b, a, a, a, a, b, b, b]);
    }
}
