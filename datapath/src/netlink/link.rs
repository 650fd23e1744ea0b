//! Interfaces (`RTM_GETLINK`).

use std::net::Ipv6Addr;

use netlink_packet_route::link::{LinkAttribute, LinkFlags, LinkMessage};
use netlink_packet_route::RouteNetlinkMessage;

use super::socket::{Kind, Netlink};
use super::{address, NetlinkError};

/// The request that reads one link by its index.
const LINK_BY_INDEX: &str = "RTM_GETLINK (by index)";

/// `IFNAMSIZ - 1`: the longest interface name the kernel accepts.
const IFNAME_MAX: usize = 15;

/// An Ethernet interface as the kernel sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface {
    pub index: u32,
    pub name: String,
    pub mac: [u8; 6],
    /// The netdev MTU (IP packet size, Ethernet header not included).
    pub mtu: u32,
    /// Administratively up (`IFF_UP`) and operationally up (`IFF_RUNNING`: carrier present),
    /// the condition under which rdma_rxe reports its port ACTIVE.
    pub up: bool,
    /// Administratively up (`IFF_UP`), carrier or not: an interface taken down loses its
    /// routes, one without carrier keeps them.
    pub admin_up: bool,
    /// Receive queues the netdev has (`IFLA_NUM_RX_QUEUES`; 1 when the kernel does not say).
    /// A NIC spreads flows over them; an AF_XDP socket receives from one.
    pub rx_queues: u32,
}

impl Interface {
    /// The interface's default GID, `fe80::` + EUI-64 of its MAC (index 0 of the GID table).
    pub fn default_gid(&self) -> Ipv6Addr {
        address::default_gid(self.mac)
    }
}

impl Netlink {
    /// The interface called `name`.
    pub fn interface_by_name(&mut self, name: &str) -> Result<Interface, NetlinkError> {
        if !valid_name(name) {
            return Err(NetlinkError::InvalidInterfaceName(name.to_string()));
        }
        let mut req = LinkMessage::default();
        req.attributes.push(LinkAttribute::IfName(name.to_string()));
        let op = "RTM_GETLINK (by name)";
        match self.request(
            op,
            RouteNetlinkMessage::GetLink(req),
            Kind::Single { flags: 0 },
        ) {
            Err(e) if e.errno() == Some(libc::ENODEV) => {
                Err(NetlinkError::NoSuchInterface(name.to_string()))
            }
            Err(e) => Err(e),
            Ok(replies) => {
                let link = first_link(replies)
                    .ok_or_else(|| NetlinkError::NoSuchInterface(name.to_string()))?;
                interface_from(&link, op)
            }
        }
    }

    /// The interface with index `index`.
    pub fn interface_by_index(&mut self, index: u32) -> Result<Interface, NetlinkError> {
        let link = self
            .link_by_index(index)?
            .ok_or(NetlinkError::NoSuchInterfaceIndex(index))?;
        interface_from(&link, LINK_BY_INDEX)
    }

    /// The name of interface `index`, whatever its kind (the loopback interface too, which
    /// [`Netlink::interface_by_index`] refuses for having no MAC); `None` if there is none.
    pub fn interface_name(&mut self, index: u32) -> Result<Option<String>, NetlinkError> {
        Ok(self.link_by_index(index)?.and_then(|l| {
            l.attributes.into_iter().find_map(|a| match a {
                LinkAttribute::IfName(n) => Some(n),
                _ => None,
            })
        }))
    }

    /// The kernel's description of link `index`, of any kind; `None` if there is none.
    fn link_by_index(&mut self, index: u32) -> Result<Option<LinkMessage>, NetlinkError> {
        if index == 0 {
            return Ok(None);
        }
        let mut req = LinkMessage::default();
        req.header.index = index;
        match self.request(
            LINK_BY_INDEX,
            RouteNetlinkMessage::GetLink(req),
            Kind::Single { flags: 0 },
        ) {
            Err(e) if e.errno() == Some(libc::ENODEV) => Ok(None),
            Err(e) => Err(e),
            Ok(replies) => Ok(first_link(replies)),
        }
    }

    /// Every Ethernet interface (interfaces without a 6-byte MAC, such as tunnels, are left
    /// out), in index order as the kernel lists them.
    pub fn interfaces(&mut self) -> Result<Vec<Interface>, NetlinkError> {
        let op = "RTM_GETLINK (dump)";
        let replies = self.request(
            op,
            RouteNetlinkMessage::GetLink(LinkMessage::default()),
            Kind::Dump,
        )?;
        Ok(replies
            .into_iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewLink(l) => interface_from(&l, op).ok(),
                _ => None,
            })
            .collect())
    }
}

fn first_link(replies: Vec<RouteNetlinkMessage>) -> Option<LinkMessage> {
    replies.into_iter().find_map(|m| match m {
        RouteNetlinkMessage::NewLink(l) => Some(l),
        _ => None,
    })
}

/// What the kernel accepts as a name (`dev_valid_name()`).
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= IFNAME_MAX
        && name != "."
        && name != ".."
        && !name
            .bytes()
            .any(|b| b == b'/' || b == b':' || b == 0 || b.is_ascii_whitespace())
}

pub(crate) fn interface_from(
    msg: &LinkMessage,
    op: &'static str,
) -> Result<Interface, NetlinkError> {
    let mut name = None;
    let mut mac = None;
    let mut mtu = None;
    let mut rx_queues = 1;
    for a in &msg.attributes {
        match a {
            LinkAttribute::IfName(n) => name = Some(n.clone()),
            LinkAttribute::Address(b) => mac = Some(b.as_slice()),
            LinkAttribute::Mtu(m) => mtu = Some(*m),
            LinkAttribute::NumRxQueues(n) => rx_queues = (*n).max(1),
            _ => {}
        }
    }
    let index = msg.header.index;
    let name = name.ok_or_else(|| NetlinkError::Decode {
        op,
        detail: format!("interface {index} has no name (IFLA_IFNAME)"),
    })?;
    let mtu = mtu.ok_or_else(|| NetlinkError::Decode {
        op,
        detail: format!("interface {name} has no MTU (IFLA_MTU)"),
    })?;
    let raw = mac.unwrap_or(&[]);
    let mac: [u8; 6] = raw.try_into().map_err(|_| NetlinkError::NotEthernet {
        name: name.clone(),
        len: raw.len(),
    })?;
    let flags = msg.header.flags;
    Ok(Interface {
        index,
        name,
        mac,
        mtu,
        up: is_up(flags),
        admin_up: flags.contains(LinkFlags::Up),
        rx_queues,
    })
}

/// Up as rdma_rxe means it for its port: administratively (`IFF_UP`) and operationally
/// (`IFF_RUNNING`: carrier present).
pub(crate) fn is_up(flags: LinkFlags) -> bool {
    flags.contains(LinkFlags::Up) && flags.contains(LinkFlags::Running)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_names_are_checked_like_the_kernel_does() {
        assert!(valid_name("eth0"));
        assert!(valid_name("veth-a.100"));
        assert!(valid_name("a23456789012345"));
        assert!(!valid_name("a234567890123456"));
        assert!(!valid_name(""));
        assert!(!valid_name("."));
        assert!(!valid_name(".."));
        assert!(!valid_name("a/b"));
        assert!(!valid_name("a b"));
        assert!(!valid_name("a:1"));
    }
}
