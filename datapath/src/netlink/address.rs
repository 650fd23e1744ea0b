//! Interface addresses (`RTM_GETADDR`), the GID table built from them, and conversions between
//! the standard library's addresses, raw GIDs and the core's [`IpAddress`].

use std::net::{IpAddr, Ipv6Addr};

use netlink_packet_route::address::{AddressAttribute, AddressFlags, AddressMessage};
use netlink_packet_route::RouteNetlinkMessage;
use xroce_core::wire::IpAddress;

use super::link::Interface;
use super::socket::{Kind, Netlink};
use super::NetlinkError;

/// One address of an interface, with the flags that say whether it can be used yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InterfaceAddress {
    pub ip: IpAddr,
    pub prefix_len: u8,
    /// IPv6 duplicate address detection is still running (`IFA_F_TENTATIVE`): the kernel will
    /// not use the address yet.
    pub tentative: bool,
    /// Duplicate address detection found another owner (`IFA_F_DADFAILED`): never usable.
    pub dad_failed: bool,
    /// Preferred lifetime over (`IFA_F_DEPRECATED`): still valid, no longer chosen as source.
    pub deprecated: bool,
    /// An IPv4 address in the subnet of another one (`IFA_F_SECONDARY`).
    pub secondary: bool,
}

impl InterfaceAddress {
    /// Whether traffic can use the address now (neither tentative nor failed DAD).
    pub fn usable(&self) -> bool {
        !self.tentative && !self.dad_failed
    }

    /// Whether `ip` lies in this address's subnet (its prefix length), in the same family.
    pub fn subnet_contains(&self, ip: IpAddr) -> bool {
        let (own, other, bits) = match (self.ip, ip) {
            (IpAddr::V4(a), IpAddr::V4(b)) => {
                (u128::from(u32::from(a)), u128::from(u32::from(b)), 32)
            }
            (IpAddr::V6(a), IpAddr::V6(b)) => (u128::from(a), u128::from(b), 128),
            _ => return false,
        };
        let len = u32::from(self.prefix_len).min(bits);
        // A /0 holds everything (and a shift by the full width would overflow).
        len == 0 || own >> (bits - len) == other >> (bits - len)
    }
}

impl Netlink {
    /// Every address of interface `ifindex`: IPv4 first, then IPv6, each family in the kernel's
    /// own order (IPv4: primary addresses in the order they were added, then secondaries;
    /// IPv6: by scope, global before link-local, newest first within a scope).
    pub fn interface_addresses(
        &mut self,
        ifindex: u32,
    ) -> Result<Vec<InterfaceAddress>, NetlinkError> {
        // Without strict checking the kernel ignores ifa_index in a dump request; filter here.
        let mut v4 = Vec::new();
        let mut v6 = Vec::new();
        for a in self.all_addresses()? {
            if a.header.index != ifindex {
                continue;
            }
            if let Some(entry) = entry_from(&a) {
                match entry.ip {
                    IpAddr::V4(_) => v4.push(entry),
                    IpAddr::V6(_) => v6.push(entry),
                }
            }
        }
        v4.extend(v6);
        Ok(v4)
    }

    /// Another interface than `ifindex` that has address `ip` (tentative or not), when `ip`
    /// lies in the subnet of one of `ifindex`'s own addresses: the one case in which `ip`
    /// can be taken to sit on `ifindex`'s link (two interfaces of one host, on one link, in
    /// one subnet; not the host's addresses on other networks, a bridge or the loopback).
    pub fn other_interface_on_subnet(
        &mut self,
        ifindex: u32,
        ip: IpAddr,
    ) -> Result<Option<u32>, NetlinkError> {
        let entries: Vec<(u32, InterfaceAddress)> = self
            .all_addresses()?
            .iter()
            .filter_map(|a| Some((a.header.index, entry_from(a)?)))
            .collect();
        let on_subnet = entries
            .iter()
            .any(|(i, a)| *i == ifindex && a.subnet_contains(ip));
        Ok(entries
            .iter()
            .find(|(i, a)| on_subnet && *i != ifindex && a.ip == ip)
            .map(|(i, _)| *i))
    }

    /// Every address of every interface, as the kernel lists them (`RTM_GETADDR` dump).
    fn all_addresses(&mut self) -> Result<Vec<AddressMessage>, NetlinkError> {
        let replies = self.request(
            "RTM_GETADDR (dump)",
            RouteNetlinkMessage::GetAddress(AddressMessage::default()),
            Kind::Dump,
        )?;
        Ok(replies
            .into_iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewAddress(a) => Some(a),
                _ => None,
            })
            .collect())
    }

    /// The addresses of interface `ifindex`, all of them (tentative ones included), in the
    /// order of [`Netlink::interface_addresses`].
    pub fn addresses(&mut self, ifindex: u32) -> Result<Vec<IpAddr>, NetlinkError> {
        Ok(self
            .interface_addresses(ifindex)?
            .into_iter()
            .map(|a| a.ip)
            .collect())
    }

    /// The RoCE v2 GID table of `iface`, as [`gid_table`](super::gid_table) documents.
    pub fn gid_table(&mut self, iface: &Interface) -> Result<Vec<IpAddr>, NetlinkError> {
        Ok(build_gid_table(
            iface.mac,
            &self.interface_addresses(iface.index)?,
        ))
    }
}

/// The GID table from a MAC and the interface's addresses (in [`Netlink::interface_addresses`]
/// order); see [`gid_table`](super::gid_table).
pub fn build_gid_table(mac: [u8; 6], addrs: &[InterfaceAddress]) -> Vec<IpAddr> {
    let mut table = vec![IpAddr::V6(default_gid(mac))];
    let v4 = addrs.iter().filter(|a| a.ip.is_ipv4());
    let v6 = addrs.iter().filter(|a| a.ip.is_ipv6());
    for a in v4.chain(v6) {
        if !a.usable() {
            continue;
        }
        // An IPv4-mapped IPv6 address would be the same GID as the IPv4 address.
        let ip = a.ip.to_canonical();
        if !table.contains(&ip) {
            table.push(ip);
        }
    }
    table
}

fn entry_from(msg: &AddressMessage) -> Option<InterfaceAddress> {
    let mut address = None;
    let mut local = None;
    let mut flags = None;
    for attr in &msg.attributes {
        match attr {
            AddressAttribute::Address(ip) => address = Some(*ip),
            AddressAttribute::Local(ip) => local = Some(*ip),
            AddressAttribute::Flags(f) => flags = Some(*f),
            _ => {}
        }
    }
    // IFA_LOCAL is the interface's own address; IFA_ADDRESS is the peer's on point-to-point
    // links and equal to IFA_LOCAL elsewhere. IPv6 usually sends only IFA_ADDRESS.
    let ip = local.or(address)?;
    // IFA_FLAGS (32 bits) supersedes the 8-bit header field when present.
    let flags =
        flags.unwrap_or_else(|| AddressFlags::from_bits_retain(msg.header.flags.bits().into()));
    Some(InterfaceAddress {
        ip,
        prefix_len: msg.header.prefix_len,
        tentative: flags.contains(AddressFlags::Tentative),
        dad_failed: flags.contains(AddressFlags::Dadfailed),
        deprecated: flags.contains(AddressFlags::Deprecated),
        secondary: flags.contains(AddressFlags::Secondary),
    })
}

/// The modified EUI-64 interface identifier of a MAC (RFC 4291 appendix A): `ff:fe` inserted in
/// the middle and the universal/local bit (0x02 of the first byte) inverted.
pub fn eui64(mac: [u8; 6]) -> [u8; 8] {
    [
        mac[0] ^ 0x02,
        mac[1],
        mac[2],
        0xff,
        0xfe,
        mac[3],
        mac[4],
        mac[5],
    ]
}

/// The default GID of an interface with this MAC: `fe80::` + [`eui64`]`(mac)`, the kernel's
/// `make_default_gid()` (which, like IPv6 SLAAC with `addr_gen_mode eui64`, also yields the
/// interface's own link-local address).
///
/// Not covered: a nonzero `dev_id` (shared zSeries OSA cards), where the kernel puts `dev_id`
/// in place of `ff:fe` and leaves the U/L bit alone.
pub fn default_gid(mac: [u8; 6]) -> Ipv6Addr {
    let mut g = [0u8; 16];
    g[0] = 0xfe;
    g[1] = 0x80;
    g[8..].copy_from_slice(&eui64(mac));
    Ipv6Addr::from(g)
}

/// The 16 bytes of the GID for `ip`: IPv6 as is, IPv4 as the IPv4-mapped address
/// `::ffff:a.b.c.d` (the RDMA core's `rdma_ip2gid()`).
pub fn gid_raw(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
        IpAddr::V6(a) => a.octets(),
    }
}

/// The address a raw GID stands for: an IPv4-mapped GID is IPv4 (the RDMA core sends IPv4
/// packets for it), anything else IPv6.
pub fn gid_from_raw(raw: [u8; 16]) -> IpAddr {
    IpAddr::V6(Ipv6Addr::from(raw)).to_canonical()
}

/// The core's address for `ip`. IPv4-mapped IPv6 addresses become IPv4, as they do in GIDs.
pub fn core_address(ip: IpAddr) -> IpAddress {
    match ip.to_canonical() {
        IpAddr::V4(a) => IpAddress::V4(a.into()),
        IpAddr::V6(a) => IpAddress::V6(a.into()),
    }
}

/// The standard library's address for the core's.
pub fn std_address(ip: IpAddress) -> IpAddr {
    match ip {
        IpAddress::V4(a) => IpAddr::from(a.0),
        IpAddress::V6(a) => IpAddr::from(a.0),
    }
}

/// A GID table from [`gid_table`](super::gid_table) as `DeviceConfig::gids` (every slot filled, index for index).
pub fn core_gids(table: &[IpAddr]) -> Vec<Option<IpAddress>> {
    table.iter().map(|&ip| Some(core_address(ip))).collect()
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test address")
    }

    #[test]
    fn eui64_flips_the_universal_local_bit_and_inserts_fffe() {
        // The classic example (RFC 4291 appendix A style; also Cisco's and Linux's SLAAC):
        // MAC 00:90:27:17:fc:0f -> interface id 0290:27ff:fe17:fc0f.
        let mac = [0x00, 0x90, 0x27, 0x17, 0xfc, 0x0f];
        assert_eq!(eui64(mac), [0x02, 0x90, 0x27, 0xff, 0xfe, 0x17, 0xfc, 0x0f]);
        assert_eq!(default_gid(mac), ip("fe80::290:27ff:fe17:fc0f"));
        // A locally administered MAC (U/L bit set) loses the bit.
        let mac = [0x02, 0x42, 0xac, 0x11, 0x00, 0x02];
        assert_eq!(default_gid(mac), ip("fe80::42:acff:fe11:2"));
        // Bits other than 0x02 are left alone.
        let mac = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff];
        assert_eq!(default_gid(mac), ip("fe80::fdff:ffff:feff:ffff"));
    }

    #[test]
    fn a_subnet_holds_what_shares_its_prefix() {
        let with = |s: &str, len: u8| InterfaceAddress {
            prefix_len: len,
            ..addr(s)
        };
        let a = with("10.9.0.1", 24);
        assert!(a.subnet_contains(ip("10.9.0.2")));
        assert!(a.subnet_contains(ip("10.9.0.255")));
        assert!(!a.subnet_contains(ip("10.9.1.2")));
        assert!(!a.subnet_contains(ip("::ffff:10.9.0.2")), "another family");
        assert!(with("10.9.0.1", 32).subnet_contains(ip("10.9.0.1")));
        assert!(!with("10.9.0.1", 32).subnet_contains(ip("10.9.0.2")));
        assert!(with("10.9.0.1", 0).subnet_contains(ip("192.0.2.1")));
        let b = with("fd00:9::1", 64);
        assert!(b.subnet_contains(ip("fd00:9::ffff:2")));
        assert!(!b.subnet_contains(ip("fd00:9:0:1::2")));
        assert!(with("fd00:9::1", 0).subnet_contains(ip("2001:db8::1")));
        assert!(with("fd00:9::1", 128).subnet_contains(ip("fd00:9::1")));
    }

    fn addr(s: &str) -> InterfaceAddress {
        InterfaceAddress {
            ip: ip(s),
            prefix_len: 24,
            tentative: false,
            dad_failed: false,
            deprecated: false,
            secondary: false,
        }
    }

    #[test]
    fn gid_table_order_default_then_ipv4_then_ipv6_without_duplicates() {
        let mac = [0x02, 0x00, 0x00, 0x00, 0x00, 0x01];
        let lladdr = "fe80::ff:fe00:1";
        let mut tentative = addr("fd00::9");
        tentative.tentative = true;
        let mut failed = addr("fd00::8");
        failed.dad_failed = true;
        let addrs = [
            addr("fd00::1"),
            addr("10.0.0.1"),
            tentative,
            addr(lladdr),
            addr("10.0.0.2"),
            failed,
            addr("::ffff:10.0.0.1"),
            addr("fe80::1234"),
        ];
        assert_eq!(
            build_gid_table(mac, &addrs),
            vec![
                ip(lladdr),
                ip("10.0.0.1"),
                ip("10.0.0.2"),
                ip("fd00::1"),
                ip("fe80::1234")
            ]
        );
    }

    #[test]
    fn gid_conversions() {
        let v4 = IpAddr::V4(Ipv4Addr::new(10, 77, 0, 11));
        let raw = gid_raw(v4);
        assert_eq!(
            raw,
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 77, 0, 11]
        );
        assert_eq!(gid_from_raw(raw), v4);
        let v6 = ip("fd00:231::1");
        assert_eq!(gid_from_raw(gid_raw(v6)), v6);
        assert_eq!(std_address(core_address(v4)), v4);
        assert_eq!(std_address(core_address(v6)), v6);
        assert_eq!(core_address(ip("::ffff:10.77.0.11")), core_address(v4));
        assert!(matches!(core_address(v4), IpAddress::V4(_)));
        assert_eq!(
            core_gids(&[v6, v4]),
            vec![Some(core_address(v6)), Some(core_address(v4))]
        );
    }
}
