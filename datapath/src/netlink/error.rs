//! The one error type of the netlink module.

use std::io;
use std::net::IpAddr;
use std::time::Duration;

/// Everything that can go wrong asking the kernel about addressing.
///
/// The messages are meant for the person running the program: they name the interface, address
/// or request involved and, where the kernel explained itself (extended ACK), its explanation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NetlinkError {
    /// The rtnetlink socket could not be created or bound.
    #[error("cannot open a netlink (rtnetlink) socket: {0}")]
    Socket(#[source] io::Error),
    /// Sending a request or receiving its answer failed at the socket level.
    #[error("netlink {op} request failed: {source}")]
    Io {
        op: &'static str,
        #[source]
        source: io::Error,
    },
    /// The kernel did not answer in time (every call is bounded; the default bound is
    /// [`DEFAULT_TIMEOUT`](super::DEFAULT_TIMEOUT)).
    #[error("the kernel did not answer the netlink {op} request within {timeout:?}")]
    Timeout { op: &'static str, timeout: Duration },
    /// The kernel answered with an error code.
    #[error("the kernel refused the netlink {op} request: {message}")]
    Kernel {
        op: &'static str,
        /// The positive errno value (`libc::ENOENT`, ...).
        errno: i32,
        /// The errno text, followed by the kernel's extended-ACK explanation when it gave one.
        message: String,
    },
    /// The kernel's answer could not be decoded.
    #[error("cannot decode the kernel's answer to the netlink {op} request: {detail}")]
    Decode { op: &'static str, detail: String },
    /// No interface has this name (in the caller's network namespace).
    #[error("no network interface named \"{0}\" (see `ip link show`)")]
    NoSuchInterface(String),
    /// No interface has this index (in the caller's network namespace); it may have gone away.
    #[error("no network interface with index {0} (it may have been removed)")]
    NoSuchInterfaceIndex(u32),
    /// The name cannot be an interface name (1 to 15 bytes, no '/', ':', NUL or whitespace).
    #[error(
        "\"{0}\" is not a valid network interface name (1 to 15 bytes, no '/', ':' or whitespace)"
    )]
    InvalidInterfaceName(String),
    /// The interface exists but has no 6-byte MAC address; RoCEv2 runs over Ethernet only.
    #[error("interface {name} is not an Ethernet interface: its link-layer address has {len} bytes, RoCEv2 needs a 6-byte MAC")]
    NotEthernet { name: String, len: usize },
    /// The kernel's routing table has no usable route to the destination.
    #[error("no route to {dst}: {reason}")]
    Unreachable { dst: IpAddr, reason: String },
    /// Nobody answered address resolution (ARP for IPv4, neighbour discovery for IPv6) for this
    /// next hop within the time given to [`resolve`](super::resolve).
    #[error("no MAC address for {0}: it did not answer ARP / IPv6 neighbour discovery in time")]
    NeighbourUnresolved(IpAddr),
}

impl NetlinkError {
    /// The errno the kernel answered with, if this error is the kernel's refusal.
    pub fn errno(&self) -> Option<i32> {
        match self {
            NetlinkError::Kernel { errno, .. } => Some(*errno),
            _ => None,
        }
    }
}
