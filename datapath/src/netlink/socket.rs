//! A blocking rtnetlink request/answer socket whose every call is bounded in time.
//!
//! Requests are sent with a fresh sequence number; the answer is collected until `NLMSG_DONE`
//! (dumps) or the ACK (single requests, which always ask for one), or until the deadline
//! passes. Answers carrying another sequence number (late answers to an earlier request that
//! timed out) are skipped. The socket itself is non-blocking: waiting is a `poll()` with the
//! remaining time, so no call can hang however the kernel behaves.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::time::{Duration, Instant};

use netlink_packet_core::{
    NetlinkBuffer, NetlinkHeader, NetlinkMessage, NetlinkPayload, NlasIterator, NLMSG_DONE,
    NLMSG_ERROR, NLM_F_ACK, NLM_F_DUMP, NLM_F_DUMP_INTR, NLM_F_REQUEST,
};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};

use super::NetlinkError;

/// How long one request may wait for the kernel's complete answer unless the caller says
/// otherwise ([`Netlink::with_timeout`]).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);

/// Receive buffer. The kernel never builds netlink datagrams larger than 32 KiB for dumps.
const RECV_BUF: usize = 64 * 1024;

/// `NLM_F_CAPPED` in an error message: only the request's header is echoed.
const NLM_F_CAPPED: u16 = 0x100;
/// `NLM_F_ACK_TLVS` in an error message: extended-ACK attributes follow the echoed request.
const NLM_F_ACK_TLVS: u16 = 0x200;
/// `NLMSGERR_ATTR_MSG`: the kernel's human-readable explanation.
const NLMSGERR_ATTR_MSG: u16 = 1;
/// Size of `struct nlmsghdr`.
const NLMSG_HDRLEN: usize = 16;
/// How often a dump the kernel reports as interrupted (the table changed under it) is redone.
const DUMP_RETRIES: usize = 3;

/// An open rtnetlink socket for requests. Cheap to create (one socket); the free functions of
/// this module open one per call, an engine that asks often may keep one.
pub struct Netlink {
    sock: Socket,
    seq: u32,
    timeout: Duration,
    buf: Vec<u8>,
}

impl std::fmt::Debug for Netlink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Netlink")
            .field("fd", &self.sock.as_raw_fd())
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// What one request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `NLM_F_DUMP`: a list, ended by `NLMSG_DONE`.
    Dump,
    /// A single request, acknowledged (`NLM_F_ACK`); `flags` are added (`NLM_F_CREATE`, ...).
    Single { flags: u16 },
}

/// Why a request did not produce an answer.
enum Failure {
    Error(NetlinkError),
    /// `NLM_F_DUMP_INTR`: the dump is inconsistent and must be redone.
    Interrupted,
}

impl From<NetlinkError> for Failure {
    fn from(e: NetlinkError) -> Self {
        Failure::Error(e)
    }
}

impl Netlink {
    /// Opens a socket in the calling thread's network namespace, with [`DEFAULT_TIMEOUT`].
    pub fn open() -> Result<Netlink, NetlinkError> {
        Netlink::with_timeout(DEFAULT_TIMEOUT)
    }

    /// Opens a socket whose requests each wait at most `timeout` for the kernel's answer.
    pub fn with_timeout(timeout: Duration) -> Result<Netlink, NetlinkError> {
        let sock = open_socket(0)?;
        Ok(Netlink {
            sock,
            seq: 0,
            timeout,
            buf: Vec::with_capacity(RECV_BUF),
        })
    }

    /// The bound on each request.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Sends `msg` and collects the answer, redoing interrupted dumps.
    pub(crate) fn request(
        &mut self,
        op: &'static str,
        msg: RouteNetlinkMessage,
        kind: Kind,
    ) -> Result<Vec<RouteNetlinkMessage>, NetlinkError> {
        let mut tries = 0;
        loop {
            match self.request_once(op, msg.clone(), kind) {
                Ok(v) => return Ok(v),
                Err(Failure::Error(e)) => return Err(e),
                Err(Failure::Interrupted) => {
                    tries += 1;
                    if tries >= DUMP_RETRIES {
                        return Err(NetlinkError::Decode {
                            op,
                            detail: format!(
                                "the dump was interrupted by concurrent changes {DUMP_RETRIES} times"
                            ),
                        });
                    }
                    log::debug!("netlink {op}: dump interrupted, retrying");
                }
            }
        }
    }

    fn request_once(
        &mut self,
        op: &'static str,
        msg: RouteNetlinkMessage,
        kind: Kind,
    ) -> Result<Vec<RouteNetlinkMessage>, Failure> {
        self.seq = self.seq.wrapping_add(1).max(1);
        let seq = self.seq;
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST
            | match kind {
                Kind::Dump => NLM_F_DUMP,
                Kind::Single { flags } => NLM_F_ACK | flags,
            };
        header.sequence_number = seq;
        let mut nl = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(msg));
        nl.finalize();
        let mut out = vec![0u8; nl.buffer_len()];
        nl.serialize(&mut out);
        let kernel = SocketAddr::new(0, 0);
        self.sock
            .send_to(&out, &kernel, 0)
            .map_err(|source| NetlinkError::Io { op, source })?;

        let deadline = Instant::now() + self.timeout;
        let mut replies = Vec::new();
        let mut undecodable: Option<String> = None;
        let mut interrupted = false;
        loop {
            recv_until(&self.sock, &mut self.buf, deadline, self.timeout, op)?;
            let mut off = 0;
            while off < self.buf.len() {
                let rest = &self.buf[off..];
                let nb = NetlinkBuffer::new_checked(rest).map_err(|e| NetlinkError::Decode {
                    op,
                    detail: e.to_string(),
                })?;
                let len = nb.length() as usize;
                off += align4(len).max(NLMSG_HDRLEN);
                if nb.sequence_number() != seq {
                    continue;
                }
                if nb.flags() & NLM_F_DUMP_INTR != 0 {
                    interrupted = true;
                }
                match nb.message_type() {
                    NLMSG_DONE => {
                        if interrupted {
                            return Err(Failure::Interrupted);
                        }
                        // A dump that failed part way ends with its error here, after the
                        // replies it had: those are not the whole answer.
                        if let Some(errno) = done_errno(nb.payload()) {
                            let message = io::Error::from_raw_os_error(errno).to_string();
                            return Err(NetlinkError::Kernel { op, errno, message }.into());
                        }
                        return Ok(replies);
                    }
                    NLMSG_ERROR => {
                        let payload = nb.payload();
                        let code = payload
                            .get(0..4)
                            .and_then(|b| b.try_into().ok())
                            .map(i32::from_ne_bytes)
                            .ok_or_else(|| NetlinkError::Decode {
                                op,
                                detail: "truncated NLMSG_ERROR".into(),
                            })?;
                        if code == 0 {
                            // The ACK ends a single request.
                            if let Some(detail) = undecodable.filter(|_| replies.is_empty()) {
                                return Err(NetlinkError::Decode { op, detail }.into());
                            }
                            return Ok(replies);
                        }
                        let errno = code.checked_neg().unwrap_or(code);
                        let mut message = io::Error::from_raw_os_error(errno).to_string();
                        if let Some(ext) = extack_message(nb.flags(), payload) {
                            message = format!("{message} ({ext})");
                        }
                        return Err(NetlinkError::Kernel { op, errno, message }.into());
                    }
                    netlink_packet_core::NLMSG_NOOP | netlink_packet_core::NLMSG_OVERRUN => {}
                    _ => {
                        let bytes = rest.get(..len).unwrap_or(rest);
                        match NetlinkMessage::<RouteNetlinkMessage>::deserialize(bytes) {
                            Ok(m) => {
                                if let NetlinkPayload::InnerMessage(inner) = m.payload {
                                    replies.push(inner);
                                }
                            }
                            Err(e) => {
                                log::warn!(
                                    "netlink {op}: skipping an undecodable message (type {}): {e}",
                                    nb.message_type()
                                );
                                undecodable.get_or_insert(e.to_string());
                            }
                        }
                    }
                }
            }
        }
    }
}

impl AsRawFd for Netlink {
    fn as_raw_fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }
}

impl AsFd for Netlink {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.sock.as_fd()
    }
}

/// A non-blocking `NETLINK_ROUTE` socket bound to an automatic port and to `groups`
/// (`RTMGRP_*` bits; 0 for a request socket).
pub(crate) fn open_socket(groups: u32) -> Result<Socket, NetlinkError> {
    let mut sock = Socket::new(NETLINK_ROUTE).map_err(NetlinkError::Socket)?;
    sock.bind(&SocketAddr::new(0, groups))
        .map_err(NetlinkError::Socket)?;
    // Errors then carry the kernel's explanation, and echo only the request's header.
    // Both are optional refinements (kernels since 4.12 / 4.3); failure is harmless.
    let _ = sock.set_ext_ack(true);
    let _ = sock.set_cap_ack(true);
    sock.set_non_blocking(true).map_err(NetlinkError::Socket)?;
    Ok(sock)
}

/// Receives one datagram into `buf`, waiting at most until `deadline`.
fn recv_until(
    sock: &Socket,
    buf: &mut Vec<u8>,
    deadline: Instant,
    timeout: Duration,
    op: &'static str,
) -> Result<(), NetlinkError> {
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Err(NetlinkError::Timeout { op, timeout });
        }
        let left = deadline - now;
        // Round up so the wait does not end a hair early and spin.
        let ms = i32::try_from(left.as_micros().div_ceil(1000)).unwrap_or(i32::MAX);
        let mut pfd = libc::pollfd {
            fd: sock.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `pfd` is one valid, initialised pollfd that outlives the call; nfds is 1.
        let r = unsafe { libc::poll(&mut pfd, 1, ms) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(NetlinkError::Io { op, source: e });
        }
        if r == 0 {
            continue;
        }
        match recv_datagram(sock, buf) {
            Ok(()) => return Ok(()),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) =>
            {
                continue
            }
            Err(e) => return Err(NetlinkError::Io { op, source: e }),
        }
    }
}

/// Reads one datagram without blocking. A datagram larger than the buffer is an error
/// (`InvalidData`), never silently truncated.
pub(crate) fn recv_datagram(sock: &Socket, buf: &mut Vec<u8>) -> io::Result<()> {
    buf.clear();
    if buf.capacity() < RECV_BUF {
        buf.reserve(RECV_BUF);
    }
    let n = sock.recv(buf, libc::MSG_TRUNC | libc::MSG_DONTWAIT)?;
    if n > buf.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "netlink datagram of {n} bytes exceeds the {} byte buffer",
                buf.len()
            ),
        ));
    }
    Ok(())
}

/// The extended-ACK text (`NLMSGERR_ATTR_MSG`) of an error message, if the kernel sent one.
/// `payload` is the error message's payload: the code, the echoed request, the attributes.
fn extack_message(flags: u16, payload: &[u8]) -> Option<String> {
    if flags & NLM_F_ACK_TLVS == 0 {
        return None;
    }
    let echoed = payload.get(4..)?;
    let skip = if flags & NLM_F_CAPPED != 0 {
        NLMSG_HDRLEN
    } else {
        let len = echoed.get(0..4)?.try_into().ok().map(u32::from_ne_bytes)? as usize;
        align4(len)
    };
    let tlvs = echoed.get(skip..)?;
    for nla in NlasIterator::new(tlvs) {
        let nla = nla.ok()?;
        if nla.kind() == NLMSGERR_ATTR_MSG {
            let v = nla.value();
            let end = v.iter().position(|&b| b == 0).unwrap_or(v.len());
            let s = String::from_utf8_lossy(&v[..end]).trim().to_string();
            return (!s.is_empty()).then_some(s);
        }
    }
    None
}

/// The error a dump's `NLMSG_DONE` reports (its payload starts with the dump's result: 0, or
/// a negative errno when the dump failed part way); `None` when it succeeded.
fn done_errno(payload: &[u8]) -> Option<i32> {
    let code = payload
        .get(0..4)
        .and_then(|b| b.try_into().ok())
        .map_or(0, i32::from_ne_bytes);
    (code < 0).then(|| code.checked_neg().unwrap_or(i32::MAX))
}

pub(crate) fn align4(len: usize) -> usize {
    len.saturating_add(3) & !3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_can_move_between_threads() {
        fn send<T: Send>() {}
        send::<Netlink>();
        send::<crate::netlink::AddressWatcher>();
        send::<NetlinkError>();
    }

    #[test]
    fn waiting_for_an_answer_that_never_comes_is_bounded() {
        let sock = open_socket(0).expect("netlink socket");
        let mut buf = Vec::new();
        let timeout = Duration::from_millis(50);
        let t = Instant::now();
        let r = recv_until(&sock, &mut buf, t + timeout, timeout, "test");
        let took = t.elapsed();
        assert!(
            matches!(r, Err(NetlinkError::Timeout { op: "test", .. })),
            "{r:?}"
        );
        // Bounded: it returned (no upper bound on the time is asserted, as a loaded machine
        // may keep this thread off its core for any time).
        assert!(took >= timeout, "gave up early: {took:?}");
        let e = NetlinkError::Timeout {
            op: "RTM_GETLINK",
            timeout,
        };
        assert_eq!(
            e.to_string(),
            "the kernel did not answer the netlink RTM_GETLINK request within 50ms"
        );
    }

    #[test]
    fn a_dump_that_failed_part_way_is_an_error() {
        assert_eq!(done_errno(&0i32.to_ne_bytes()), None);
        assert_eq!(done_errno(&[]), None, "an old kernel's empty NLMSG_DONE");
        assert_eq!(
            done_errno(&(-libc::EMSGSIZE).to_ne_bytes()),
            Some(libc::EMSGSIZE)
        );
        assert_eq!(done_errno(&i32::MIN.to_ne_bytes()), Some(i32::MAX));
    }

    #[test]
    fn extack_text_is_found_after_a_capped_header() {
        let mut p = Vec::new();
        p.extend_from_slice(&(-2i32).to_ne_bytes());
        p.extend_from_slice(&[0u8; NLMSG_HDRLEN]);
        let text = b"Neighbour entry not found\0";
        let nla_len = 4 + text.len();
        p.extend_from_slice(&(nla_len as u16).to_ne_bytes());
        p.extend_from_slice(&NLMSGERR_ATTR_MSG.to_ne_bytes());
        p.extend_from_slice(text);
        while p.len() % 4 != 0 {
            p.push(0);
        }
        assert_eq!(
            extack_message(NLM_F_CAPPED | NLM_F_ACK_TLVS, &p).as_deref(),
            Some("Neighbour entry not found")
        );
        assert_eq!(extack_message(NLM_F_CAPPED, &p), None);
        // Garbage never panics.
        assert_eq!(extack_message(NLM_F_ACK_TLVS, &[1, 2, 3]), None);
        assert_eq!(extack_message(NLM_F_ACK_TLVS, &[0xff; 12]), None);
    }
}
