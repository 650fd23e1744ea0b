//! What rtnetlink says about an interface: index, MTU and the XDP programs attached to it.
//!
//! The socket is opened by the calling thread, so the answer is about that thread's network
//! namespace (a thread that did `setns(CLONE_NEWNET)` sees its namespace's interfaces).

use std::io;
use std::os::fd::AsRawFd;
use std::time::Duration;

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_DUMP, NLM_F_REQUEST,
};
use netlink_packet_route::link::{LinkAttribute, LinkMessage, LinkXdp};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};

/// The longest any netlink answer may take.
const TIMEOUT: Duration = Duration::from_secs(5);

/// An interface as rtnetlink describes it.
#[derive(Debug, Clone, Default)]
pub(crate) struct Link {
    pub ifindex: u32,
    pub name: String,
    pub mtu: u32,
    /// `IFLA_XDP_DRV_PROG_ID`: native (driver) mode program, 0 if none.
    pub drv_prog_id: u32,
    /// `IFLA_XDP_SKB_PROG_ID`: generic mode program, 0 if none.
    pub skb_prog_id: u32,
    /// `IFLA_XDP_HW_PROG_ID`: offloaded program, 0 if none.
    pub hw_prog_id: u32,
}

impl Link {
    fn from_message(msg: &LinkMessage) -> Link {
        let mut link = Link {
            ifindex: msg.header.index,
            ..Link::default()
        };
        for attr in &msg.attributes {
            match attr {
                LinkAttribute::IfName(name) => link.name = name.clone(),
                LinkAttribute::Mtu(mtu) => link.mtu = *mtu,
                LinkAttribute::Xdp(xdp) => {
                    for x in xdp {
                        match x {
                            LinkXdp::DrvProgId(id) => link.drv_prog_id = *id,
                            LinkXdp::SkbProgId(id) => link.skb_prog_id = *id,
                            LinkXdp::HwProgId(id) => link.hw_prog_id = *id,
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
        }
        link
    }
}

/// `RTM_GETLINK` by name; `None` when the interface does not exist in this namespace.
pub(crate) fn link_by_name(name: &str) -> io::Result<Option<Link>> {
    let mut msg = LinkMessage::default();
    msg.attributes.push(LinkAttribute::IfName(name.to_string()));
    match request(msg, false) {
        Ok(mut links) => Ok(links.pop()),
        Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(None),
        Err(e) => Err(e),
    }
}

/// `RTM_GETLINK` dump: every interface of this namespace.
pub(crate) fn all_links() -> io::Result<Vec<Link>> {
    request(LinkMessage::default(), true)
}

fn request(msg: LinkMessage, dump: bool) -> io::Result<Vec<Link>> {
    let mut socket = Socket::new(NETLINK_ROUTE)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    set_receive_timeout(&socket, TIMEOUT)?;

    let mut packet = NetlinkMessage::new(
        NetlinkHeader::default(),
        NetlinkPayload::from(RouteNetlinkMessage::GetLink(msg)),
    );
    packet.header.flags = NLM_F_REQUEST | if dump { NLM_F_DUMP } else { 0 };
    packet.header.sequence_number = 1;
    packet.finalize();
    let mut buf = vec![0u8; packet.buffer_len()];
    packet.serialize(&mut buf[..]);
    socket.send(&buf, 0)?;

    let mut links = Vec::new();
    let mut rx = vec![0u8; 64 * 1024];
    loop {
        let size = socket.recv(&mut &mut rx[..], 0)?;
        let mut offset = 0;
        while offset < size {
            let reply: NetlinkMessage<RouteNetlinkMessage> =
                NetlinkMessage::deserialize(&rx[offset..size])
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
            let len = reply.header.length as usize;
            match reply.payload {
                // A dump that failed part way says so here.
                NetlinkPayload::Done(d) if d.code < 0 => {
                    return Err(io::Error::from_raw_os_error(
                        d.code.checked_neg().unwrap_or(1),
                    ))
                }
                NetlinkPayload::Done(_) => return Ok(links),
                NetlinkPayload::Error(err) => {
                    if err.code.is_none() {
                        // An acknowledgement.
                        return Ok(links);
                    }
                    return Err(err.to_io());
                }
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(link)) => {
                    links.push(Link::from_message(&link));
                    if !dump {
                        return Ok(links);
                    }
                }
                _ => {}
            }
            if len == 0 {
                break;
            }
            offset += len;
        }
    }
}

fn set_receive_timeout(socket: &Socket, timeout: Duration) -> io::Result<()> {
    let tv = libc::timeval {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_usec: timeout.subsec_micros() as libc::suseconds_t,
    };
    // SAFETY: `tv` is a valid timeval and the length passed is its size; the descriptor is
    // the socket's own, open for the duration of the call.
    let ret = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            &tv as *const libc::timeval as *const libc::c_void,
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if ret != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
