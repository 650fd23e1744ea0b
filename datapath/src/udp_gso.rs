//! Sending through a kernel UDP socket in batches (UDP GSO), receiving through AF_XDP.
//!
//! AF_XDP's copy mode hands the driver one frame at a time and never says more are coming, so
//! a virtio-net NIC is notified (a VM exit, under emulation a trip into QEMU's device code) for
//! every frame. A UDP socket with `UDP_SEGMENT` gives the kernel a batch of equal-sized
//! segments as one buffer; the kernel cuts it into datagrams and hands them to the driver with
//! "more to come", one notification per batch. In Debian 12 guests under TCG batches of 16 to
//! 60 1 KiB datagrams per `sendmsg` carried 61-66 MB/s to an AF_XDP receiver where AF_XDP's
//! copy mode carried 31-38 (`docs/decisions.md`, "Stop 62").
//!
//! The engine still builds whole frames. For each IPv4 RoCEv2 frame this port keeps the UDP
//! payload (BTH to ICRC) and lets the kernel write the Ethernet, IP and UDP headers. What the
//! kernel writes differs from the engine's in two fields the ICRC covers: the IP
//! identification counts from 0 within a batch (an unconnected socket sending with DF), and
//! the UDP source port is the socket's. The ICRC is changed for both
//! ([`xroce_core::icrc::IcrcRewriter`]). The addresses, TOS, DF and lengths are the engine's:
//! the source address and TOS go with each batch, and the socket is bound to the interface.
//!
//! Batching pays only for frames that come in runs: a `sendmsg` for a frame or two costs more
//! than AF_XDP's copy. So frames go straight into the AF_XDP ring, as without this port, until
//! a round of the engine (from one flush to the next) has four frames in a row for one batch
//! ([`MIN_BATCH`]); from the next round on they are sorted into batches, and a batch that ends
//! shorter goes through AF_XDP as built. A round that took several frames and sent no batch
//! turns batching off again. A stream batches, and so do messages of four packets or more; a
//! ping-pong of one-packet messages (an answer and an ACK per round) never does. The AF_XDP socket is kicked before each batch goes to the UDP socket, so
//! frames leave in the order they were built.
//!
//! Frames it does not take this way (IPv6, VLAN-tagged, anything not RoCEv2) go out through
//! the AF_XDP socket as before. What is lost: the per-QP UDP source port (every batched frame
//! carries the socket's), which spreads QPs over the paths of a multi-path fabric.

use std::collections::VecDeque;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use xroce_core::icrc::IcrcRewriter;
use xroce_core::wire::udp::{self, UdpPacket};
use xroce_core::wire::{
    ethernet, ipv4, EtherType, EthernetFrame, Ipv4Packet, ICRC_LEN, ROCEV2_UDP_PORT,
};

use crate::port::{Port, RxDrops};

/// The environment variable that picks how frames are sent: `auto` (the default), `udp-gso`
/// or `af-xdp`.
pub const TRANSMIT_ENV: &str = "XROCE_TRANSMIT";

/// How an AF_XDP engine sends its frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Transmit {
    /// [`Transmit::UdpGso`] where the sending socket is in copy mode on virtio-net
    /// ([`batching_pays_on`]), [`Transmit::AfXdp`] elsewhere.
    #[default]
    Auto,
    /// Everything through the AF_XDP socket's TX ring.
    AfXdp,
    /// Runs of IPv4 RoCEv2 frames through a kernel UDP socket in batches, the rest through
    /// AF_XDP (this module).
    UdpGso,
}

impl Transmit {
    /// What `XROCE_TRANSMIT` names (unset or empty: auto).
    pub fn from_env() -> Result<Transmit, String> {
        match std::env::var(TRANSMIT_ENV) {
            Ok(v) => v.parse(),
            Err(_) => Ok(Transmit::Auto),
        }
    }
}

impl std::str::FromStr for Transmit {
    type Err = String;

    fn from_str(s: &str) -> Result<Transmit, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(Transmit::Auto),
            "af-xdp" | "af_xdp" | "afxdp" => Ok(Transmit::AfXdp),
            "udp-gso" | "udp_gso" => Ok(Transmit::UdpGso),
            other => Err(format!(
                "unknown transmit path {other:?} in {TRANSMIT_ENV}: use auto (the default: \
                 udp-gso on virtio-net in copy mode), udp-gso or af-xdp"
            )),
        }
    }
}

/// Segments per batch: Linux takes 64 in one `UDP_SEGMENT` send (128 from 6.10); kernels
/// before 5.16 counted the UDP header against that limit, so 63 leave room for it.
const MAX_SEGMENTS: usize = 63;
/// The most a UDP datagram over IPv4 carries, and so a batch.
const MAX_BATCH_BYTES: usize = 65_507;
/// Fewer frames in a row than this go through AF_XDP as built: a `sendmsg` costs more than
/// AF_XDP's copy of a frame or two (a ping-pong's answer and ACK, of one length when the
/// message is a few bytes).
const MIN_BATCH: usize = 4;
/// Batches closed and waiting for the socket; more and the port takes no frame until they go.
const MAX_WAITING_BATCHES: usize = 16;
const ETHERNET_LEN: usize = ethernet::HEADER_LEN;
const IPV4_LEN: usize = ipv4::HEADER_LEN;
const UDP_LEN: usize = udp::HEADER_LEN;
const HEADERS_LEN: usize = ETHERNET_LEN + IPV4_LEN + UDP_LEN;

/// What a batch's datagrams share: the kernel writes one IP and UDP header for them all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BatchKey {
    src: Ipv4Addr,
    dst: Ipv4Addr,
    tos: u8,
    /// The UDP payload of every segment.
    segment: u16,
}

#[derive(Debug)]
struct Batch {
    key: BatchKey,
    segments: usize,
    bytes: Vec<u8>,
    /// While the batch is shorter than [`MIN_BATCH`], its segments are kept as built, and
    /// these are their frames' headers: a batch that ends so short goes out through AF_XDP as
    /// those frames.
    built_headers: [[u8; HEADERS_LEN]; MIN_BATCH - 1],
    /// Of a short batch, the frames already handed to AF_XDP.
    sent_built: usize,
}

impl Batch {
    /// Writes segment `index` of a short batch back into the frame the engine built; its
    /// length. (`None` for a batch of [`MIN_BATCH`] or more, whose segments are no longer as
    /// built.)
    fn write_built_frame(&self, index: usize, buf: &mut [u8]) -> Option<usize> {
        if self.segments >= MIN_BATCH {
            return None;
        }
        let seg = usize::from(self.key.segment);
        let len = HEADERS_LEN + seg;
        let frame = buf.get_mut(..len)?;
        frame[..HEADERS_LEN].copy_from_slice(self.built_headers.get(index)?);
        frame[HEADERS_LEN..].copy_from_slice(self.bytes.get(index * seg..(index + 1) * seg)?);
        Some(len)
    }
}

/// The IP identification and UDP source port in a frame's headers.
fn ident_and_port(headers: &[u8; HEADERS_LEN]) -> (u16, u16) {
    let ip = Ipv4Packet::new_unchecked(&headers[ETHERNET_LEN..]);
    let udp = UdpPacket::new_unchecked(&headers[ETHERNET_LEN + IPV4_LEN..]);
    (ip.ident(), udp.src_port())
}

/// One IPv4 RoCEv2 frame as this port sends it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Segment {
    key: BatchKey,
    ident: u16,
    src_port: u16,
    /// The UDP payload's place in the frame.
    start: usize,
    end: usize,
}

/// The frame as an IPv4 RoCEv2 datagram this port can send: untagged Ethernet, an IPv4 header
/// without options, with DF (the flags are covered by the ICRC, and the socket sends with DF)
/// and not a fragment, UDP to port 4791 with a length that agrees. `None` for anything else,
/// which goes out through AF_XDP.
fn segment_of(frame: &[u8]) -> Option<Segment> {
    let eth = EthernetFrame::new_checked(frame).ok()?;
    if eth.is_vlan_tagged() || eth.ethertype() != EtherType::Ipv4 {
        return None;
    }
    let ip_bytes = frame.get(ETHERNET_LEN..)?;
    let ip = Ipv4Packet::new_checked(ip_bytes).ok()?;
    if ip.protocol() != ipv4::PROTOCOL_UDP || !ip.dont_frag() || ip.is_fragment() {
        return None;
    }
    let total = usize::from(ip.total_len());
    let udp = UdpPacket::new_checked(ip_bytes.get(IPV4_LEN..total)?).ok()?;
    if udp.dst_port() != ROCEV2_UDP_PORT || usize::from(udp.len()) != total - IPV4_LEN {
        return None;
    }
    let end = ETHERNET_LEN + total;
    if end < HEADERS_LEN + ICRC_LEN {
        return None;
    }
    Some(Segment {
        key: BatchKey {
            src: Ipv4Addr::from(ip.src_addr().0),
            dst: Ipv4Addr::from(ip.dst_addr().0),
            tos: ip.tos(),
            segment: u16::try_from(end - HEADERS_LEN).ok()?,
        },
        ident: ip.ident(),
        src_port: udp.src_port(),
        start: HEADERS_LEN,
        end,
    })
}

/// The ICRC in a segment's last four bytes.
fn icrc_of(segment: &[u8]) -> u32 {
    let mut stored = [0u8; ICRC_LEN];
    stored.copy_from_slice(&segment[segment.len() - ICRC_LEN..]);
    u32::from_le_bytes(stored)
}

/// Builds the batches: each segment's ICRC changed for the identification and source port the
/// kernel will write (see the module's notes).
#[derive(Debug)]
struct Batcher {
    /// The socket's source port.
    src_port: u16,
    rewriter: IcrcRewriter,
    /// The batch still taking segments.
    open: Option<Batch>,
    /// Closed batches, oldest first.
    closed: VecDeque<Batch>,
    /// Buffers of batches sent, for the next ones.
    spare: Vec<Vec<u8>>,
}

impl Batcher {
    fn new(src_port: u16) -> Self {
        Batcher {
            src_port,
            rewriter: IcrcRewriter::new(),
            open: None,
            closed: VecDeque::new(),
            spare: Vec::new(),
        }
    }

    /// Adds the segment of `frame` to the open batch, or closes it and opens another. The
    /// segments of a batch shorter than [`MIN_BATCH`] are kept as built; the batch's ICRCs
    /// change when it reaches that length. `false` when an ICRC could not be changed (a length
    /// no RoCEv2 packet has); nothing is added.
    fn add(&mut self, frame: &[u8], seg: &Segment) -> bool {
        let (Some(payload), Some(headers)) = (
            frame.get(seg.start..seg.end),
            frame
                .get(..HEADERS_LEN)
                .and_then(|h| <[u8; HEADERS_LEN]>::try_from(h).ok()),
        ) else {
            return false;
        };
        let fits = self.open.as_ref().is_some_and(|b| {
            b.key == seg.key
                && b.segments < MAX_SEGMENTS
                && b.bytes.len() + payload.len() <= MAX_BATCH_BYTES
        });
        if !fits {
            if let Some(b) = self.open.take() {
                self.closed.push_back(b);
            }
        }
        let Some(batch) = &mut self.open else {
            let mut bytes = self.spare.pop().unwrap_or_default();
            bytes.clear();
            bytes.extend_from_slice(payload);
            let mut built_headers = [[0u8; HEADERS_LEN]; MIN_BATCH - 1];
            built_headers[0] = headers;
            self.open = Some(Batch {
                key: seg.key,
                segments: 1,
                bytes,
                built_headers,
                sent_built: 0,
            });
            return true;
        };
        let index = batch.segments;
        if index < MIN_BATCH - 1 {
            batch.built_headers[index] = headers;
            batch.bytes.extend_from_slice(payload);
            batch.segments += 1;
            return true;
        }
        // The identification the kernel gives a segment is its place in the batch.
        let ip_total_len = IPV4_LEN + UDP_LEN + payload.len();
        let Some(icrc) = self.rewriter.rewritten(
            icrc_of(payload),
            ip_total_len,
            seg.ident ^ index as u16,
            seg.src_port ^ self.src_port,
        ) else {
            return false;
        };
        if index == MIN_BATCH - 1 {
            // The batch is long enough: the segments kept as built become the batch's.
            let len = payload.len();
            let mut rewritten = [0u32; MIN_BATCH - 1];
            for (i, headers) in batch.built_headers.iter().enumerate() {
                let (ident, port) = ident_and_port(headers);
                let kept = &batch.bytes[i * len..(i + 1) * len];
                let Some(icrc) = self.rewriter.rewritten(
                    icrc_of(kept),
                    ip_total_len,
                    ident ^ i as u16,
                    port ^ self.src_port,
                ) else {
                    return false;
                };
                rewritten[i] = icrc;
            }
            for (i, icrc) in rewritten.iter().enumerate() {
                batch.bytes[(i + 1) * len - ICRC_LEN..(i + 1) * len]
                    .copy_from_slice(&icrc.to_le_bytes());
            }
        }
        batch
            .bytes
            .extend_from_slice(&payload[..payload.len() - ICRC_LEN]);
        batch.bytes.extend_from_slice(&icrc.to_le_bytes());
        batch.segments += 1;
        true
    }

    fn waiting(&self) -> usize {
        self.closed.len() + usize::from(self.open.is_some())
    }

    /// The oldest batch, closing the open one when no other waits.
    fn oldest(&mut self) -> Option<&mut Batch> {
        if self.closed.is_empty() {
            if let Some(b) = self.open.take() {
                self.closed.push_back(b);
            }
        }
        self.closed.front_mut()
    }

    fn sent_oldest(&mut self) {
        if let Some(b) = self.closed.pop_front() {
            self.spare.push(b.bytes);
        }
    }
}

/// Whether batching is what `auto` does on `iface`: on virtio-net, where it was measured (see
/// the module's notes). Elsewhere it stays off unless asked for: where a virtual link hands a
/// batch on whole (a bridge's port, say), a receiver in generic XDP mode gets it as one
/// oversized frame and loses it; and a NIC that segments in hardware might number the IP
/// identifications otherwise than Linux does, which the ICRCs count on.
pub fn batching_pays_on(iface: &str) -> bool {
    driver_name(iface).is_some_and(|d| d == "virtio_net")
}

/// The interface's driver, asked with `ETHTOOL_GDRVINFO` in the calling thread's network
/// namespace.
pub fn driver_name(iface: &str) -> Option<String> {
    /// `struct ethtool_drvinfo` (linux/ethtool.h).
    #[repr(C)]
    struct DrvInfo {
        cmd: u32,
        driver: [u8; 32],
        version: [u8; 32],
        fw_version: [u8; 32],
        bus_info: [u8; 32],
        erom_version: [u8; 32],
        reserved2: [u8; 12],
        counts: [u32; 5],
    }
    const ETHTOOL_GDRVINFO: u32 = 0x3;
    let name = iface.as_bytes();
    if name.len() >= libc::IFNAMSIZ {
        return None;
    }
    // SAFETY: socket(2) with constant arguments; the descriptor is owned below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` was just returned by socket(2) and nothing else owns it.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut info = DrvInfo {
        cmd: ETHTOOL_GDRVINFO,
        driver: [0; 32],
        version: [0; 32],
        fw_version: [0; 32],
        bus_info: [0; 32],
        erom_version: [0; 32],
        reserved2: [0; 12],
        counts: [0; 5],
    };
    // SAFETY: an all-zero ifreq is a valid value; the name and data pointer are set below.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, &b) in req.ifr_name.iter_mut().zip(name) {
        *dst = b as libc::c_char;
    }
    req.ifr_ifru.ifru_data = (&mut info as *mut DrvInfo).cast();
    // SAFETY: SIOCETHTOOL reads `req` and writes at most a `struct ethtool_drvinfo` at its
    // data pointer, which `info` is and which outlives the call.
    let rc = unsafe { libc::ioctl(socket.as_raw_fd(), libc::SIOCETHTOOL, &mut req) };
    if rc < 0 {
        return None;
    }
    let end = info.driver.iter().position(|&b| b == 0).unwrap_or(32);
    Some(String::from_utf8_lossy(&info.driver[..end]).into_owned())
}

/// The UDP socket batches leave through.
#[derive(Debug)]
pub struct GsoSocket {
    fd: OwnedFd,
    src_port: u16,
}

impl GsoSocket {
    /// A socket bound to `iface`, in the calling thread's network namespace, and to a port the
    /// kernel picks.
    pub fn open(iface: &str) -> io::Result<GsoSocket> {
        let fd = udp_socket(iface)?;
        let src_port = bound_port(&fd)?;
        Ok(GsoSocket { fd, src_port })
    }
}

/// An AF_XDP port whose IPv4 RoCEv2 frames leave through a UDP socket (see the module's notes).
pub struct UdpGsoPort<P> {
    inner: P,
    socket: OwnedFd,
    ifindex: u32,
    batcher: Batcher,
    /// Where frames are built before they are sorted.
    scratch: Vec<u8>,
    /// A frame for the AF_XDP socket that found no room there; it goes first.
    held: Option<Vec<u8>>,
    /// The kernel refused a batch for a reason that would come again: no more batching.
    refused: bool,
    /// Frames went into the AF_XDP ring since its last kick.
    unkicked: bool,
    iface: String,
    /// Frames are sorted into batches (after a round that had [`MIN_BATCH`] frames in a row
    /// for one batch); otherwise they go straight into the AF_XDP ring, as without this port.
    batching: bool,
    /// Batching: a batch went to the UDP socket since the last flush, and how many frames
    /// were taken.
    batched_since_flush: bool,
    taken_since_flush: usize,
    /// Not batching: the last frame's batch, how many frames in a row were for it, and
    /// whether that reached [`MIN_BATCH`] since the last flush.
    last_key: Option<BatchKey>,
    run: usize,
    long_run_since_flush: bool,
}

impl<P: Port> UdpGsoPort<P> {
    /// Wraps `inner` (the engine's AF_XDP sockets on `iface`), whose frames are at most
    /// `max_frame` bytes.
    pub fn new(inner: P, socket: GsoSocket, iface: &str, ifindex: u32, max_frame: usize) -> Self {
        UdpGsoPort {
            inner,
            socket: socket.fd,
            ifindex,
            batcher: Batcher::new(socket.src_port),
            scratch: vec![0u8; max_frame],
            held: None,
            refused: false,
            unkicked: false,
            iface: iface.to_string(),
            batching: false,
            batched_since_flush: false,
            taken_since_flush: 0,
            last_key: None,
            run: 0,
            long_run_since_flush: false,
        }
    }

    /// Whether a frame can be taken now: the held frame went, and not too many batches wait.
    fn room(&mut self) -> bool {
        if let Some(frame) = &self.held {
            if !self.inner.send(frame) {
                return false;
            }
            self.held = None;
            self.unkicked = true;
        }
        if self.batcher.waiting() >= MAX_WAITING_BATCHES {
            // An error here is the flush's to report; the frames wait meanwhile.
            let _ = self.send_batches();
        }
        self.batcher.waiting() < MAX_WAITING_BATCHES
    }

    /// Not batching: notes which batch the frame in `frame` would have joined.
    fn note_frame(&mut self, frame: &[u8]) {
        self.note_key(segment_of(frame).map(|s| s.key));
    }

    fn note_key(&mut self, key: Option<BatchKey>) {
        self.run = if key.is_some() && key == self.last_key {
            self.run + 1
        } else {
            1
        };
        self.long_run_since_flush |= key.is_some() && self.run >= MIN_BATCH;
        self.last_key = key;
    }

    /// Sorts the frame in `scratch[..len]`: a batch's segment, or a frame for AF_XDP.
    fn take(&mut self, len: usize) {
        self.taken_since_flush += 1;
        let frame = &self.scratch[..len];
        if let Some(seg) = segment_of(frame) {
            if self.batcher.add(frame, &seg) {
                return;
            }
        }
        if self.inner.send(frame) {
            self.unkicked = true;
        } else {
            self.held = Some(frame.to_vec());
        }
    }

    /// Sends the waiting batches, oldest first. Stops, leaving the rest, when the socket has
    /// no room (`Ok`) or the interface takes nothing (`Err`, as AF_XDP's flush reports it); a
    /// batch refused for any other reason is dropped (the transport retransmits), so that it
    /// cannot hold up the others.
    ///
    /// A batch shorter than [`MIN_BATCH`] goes through AF_XDP as the engine built its frames.
    /// The AF_XDP socket is kicked before the next batch goes to the UDP socket, so that
    /// frames leave in the order they were built.
    fn send_batches(&mut self) -> io::Result<()> {
        while let Some(batch) = self.batcher.oldest() {
            if batch.segments < MIN_BATCH {
                while batch.sent_built < batch.segments {
                    let index = batch.sent_built;
                    if !self
                        .inner
                        .send_with(&mut |buf| batch.write_built_frame(index, buf))
                    {
                        // No room in the ring: the rest waits, and so do the batches behind.
                        return Ok(());
                    }
                    batch.sent_built += 1;
                }
                self.unkicked = true;
                self.batcher.sent_oldest();
                continue;
            }
            if self.unkicked {
                // Frames built before this batch go first: kicked, and gone from the ring
                // (a kick the driver refused leaves them there, and the batch waits).
                self.inner.flush()?;
                if self.inner.tx_pending() {
                    return Ok(());
                }
                self.unkicked = false;
            }
            match send_batch(self.socket.as_raw_fd(), self.ifindex, batch) {
                Ok(()) => self.batched_since_flush = true,
                Err(e) => match e.raw_os_error() {
                    Some(libc::EAGAIN) | Some(libc::ENOBUFS) => return Ok(()),
                    // A socket bound to a downed interface finds no route: down, as AF_XDP's
                    // kick says it.
                    Some(libc::ENETDOWN) | Some(libc::ENETUNREACH) => {
                        return Err(io::Error::from_raw_os_error(libc::ENETDOWN))
                    }
                    Some(libc::ENODEV) | Some(libc::ENXIO) => return Err(e),
                    _ => {
                        // A refusal that would come again (no checksum offload: EIO; a
                        // firewall: EPERM; an older kernel's segment limit: EINVAL): batching
                        // ends for good, and the QPs retransmit through AF_XDP.
                        if !self.refused {
                            crate::stderr_line!(
                                "xroce: netdev {}: the kernel refused a batch of {} frames to {} \
                             through a UDP socket ({e}); every frame goes through AF_XDP from \
                             now on, and the QPs retransmit what was lost",
                                self.iface,
                                batch.segments,
                                batch.key.dst
                            );
                        }
                        self.refused = true;
                        self.batching = false;
                    }
                },
            }
            self.batcher.sent_oldest();
        }
        Ok(())
    }
}

impl<P: Port> Port for UdpGsoPort<P> {
    fn recv(&mut self, max: usize, deliver: &mut dyn FnMut(&[u8])) -> usize {
        self.inner.recv(max, deliver)
    }

    fn send(&mut self, frame: &[u8]) -> bool {
        if !self.batching {
            self.note_frame(frame);
            return self.inner.send(frame);
        }
        if frame.len() > self.scratch.len() {
            // As AF_XDP's port does with a frame larger than its slot.
            return self.inner.send(frame);
        }
        if !self.room() {
            return false;
        }
        self.scratch[..frame.len()].copy_from_slice(frame);
        self.take(frame.len());
        true
    }

    fn send_with(&mut self, build: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> bool {
        if !self.batching {
            // The batch the frame would have joined, if one was built.
            let mut built: Option<Option<BatchKey>> = None;
            let queued = self.inner.send_with(&mut |buf| {
                let len = build(buf);
                built = len.map(|l| buf.get(..l).and_then(segment_of).map(|s| s.key));
                len
            });
            if let Some(key) = built {
                self.note_key(key);
            }
            return queued;
        }
        if !self.room() {
            return false;
        }
        let max = self.scratch.len();
        let Some(len) = build(&mut self.scratch).filter(|&l| l > 0 && l <= max) else {
            return true;
        };
        self.take(len);
        true
    }

    /// Also chooses how the next round's frames go: into batches after a round that had
    /// [`MIN_BATCH`] frames in a row for one batch; straight to AF_XDP after a round of
    /// batching that took several frames but sent no batch (a ping-pong's answer and ACK). A
    /// round of one frame (an ACK between a stream's messages) changes nothing. The way
    /// changes only when nothing waits on the way left, so that frames leave in the order
    /// they were built.
    fn flush(&mut self) -> io::Result<()> {
        if !self.batching {
            let flushed = self.inner.flush();
            if std::mem::take(&mut self.long_run_since_flush)
                && !self.inner.tx_pending()
                && !self.refused
            {
                self.batching = true;
            }
            self.last_key = None;
            self.run = 0;
            return flushed;
        }
        if let Some(frame) = &self.held {
            if self.inner.send(frame) {
                self.held = None;
                self.unkicked = true;
            }
        }
        let batches = self.send_batches();
        let inner = self.inner.flush();
        self.unkicked = false;
        let batched = std::mem::take(&mut self.batched_since_flush);
        let taken = std::mem::take(&mut self.taken_since_flush);
        if !batched && taken > 1 && self.held.is_none() && self.batcher.waiting() == 0 {
            self.batching = false;
        }
        batches.and(inner)
    }

    fn tx_pending(&self) -> bool {
        self.held.is_some() || self.batcher.waiting() > 0 || self.inner.tx_pending()
    }

    fn wait_fd(&self) -> Option<RawFd> {
        self.inner.wait_fd()
    }

    fn wait_fd_is_doorbell(&self) -> bool {
        self.inner.wait_fd_is_doorbell()
    }

    fn rx_drops(&self) -> RxDrops {
        self.inner.rx_drops()
    }
}

/// A non-blocking UDP socket bound to `iface` and to a port the kernel picks, sending with DF
/// (so that the kernel writes identification 0 for a batch's first datagram, as the module's
/// notes count on).
fn udp_socket(iface: &str) -> io::Result<OwnedFd> {
    // SAFETY: socket(2) with constant arguments; the descriptor is owned below.
    let fd = unsafe {
        libc::socket(
            libc::AF_INET,
            libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by socket(2) and nothing else owns it.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    let set = |level, name, value: &[u8]| -> io::Result<()> {
        // SAFETY: `value` is valid for its length for the duration of the call.
        let rc = unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                level,
                name,
                value.as_ptr().cast(),
                value.len() as libc::socklen_t,
            )
        };
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    };
    set(libc::SOL_SOCKET, libc::SO_BINDTODEVICE, iface.as_bytes())?;
    set(
        libc::IPPROTO_IP,
        libc::IP_MTU_DISCOVER,
        &libc::IP_PMTUDISC_DO.to_ne_bytes(),
    )?;
    // Room for several batches in flight (the default is a few of them); without the
    // privilege to force it, the system's limit applies.
    let room: libc::c_int = 4 << 20;
    if set(libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, &room.to_ne_bytes()).is_err() {
        let _ = set(libc::SOL_SOCKET, libc::SO_SNDBUF, &room.to_ne_bytes());
    }
    // Nothing is received on this socket; the least buffer the kernel allows.
    let _ = set(libc::SOL_SOCKET, libc::SO_RCVBUF, &0i32.to_ne_bytes());
    let any = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr { s_addr: 0 },
        sin_zero: [0; 8],
    };
    // SAFETY: `any` is a valid sockaddr_in for the duration of the call.
    let rc = unsafe {
        libc::bind(
            socket.as_raw_fd(),
            (&any as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(socket)
}

fn bound_port(socket: &OwnedFd) -> io::Result<u16> {
    // SAFETY: an all-zero sockaddr_in is a valid value.
    let mut addr: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: `addr` has room for `len` bytes, and `len` is written back.
    let rc = unsafe {
        libc::getsockname(
            socket.as_raw_fd(),
            (&mut addr as *mut libc::sockaddr_in).cast(),
            &mut len,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(u16::from_be(addr.sin_port))
}

/// Control messages of one batch: its segment size, source address and TOS.
#[repr(C)]
union Control {
    bytes: [u8; CONTROL_LEN],
    _align: libc::cmsghdr,
}

// SAFETY (all three): CMSG_SPACE only computes a size from its argument.
const CONTROL_LEN: usize = unsafe {
    libc::CMSG_SPACE(std::mem::size_of::<u16>() as u32)
        + libc::CMSG_SPACE(std::mem::size_of::<libc::in_pktinfo>() as u32)
        + libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32)
} as usize;

/// One `sendmsg`: the batch's segments to the destination's RoCEv2 port.
fn send_batch(fd: RawFd, ifindex: u32, batch: &Batch) -> io::Result<()> {
    let dst = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: ROCEV2_UDP_PORT.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(batch.key.dst.octets()),
        },
        sin_zero: [0; 8],
    };
    let mut iov = libc::iovec {
        iov_base: batch.bytes.as_ptr() as *mut libc::c_void,
        iov_len: batch.bytes.len(),
    };
    let mut control = Control {
        bytes: [0; CONTROL_LEN],
    };
    // SAFETY: an all-zero msghdr is a valid value; its pointers are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = (&dst as *const libc::sockaddr_in).cast_mut().cast();
    msg.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    // SAFETY: `control` is CONTROL_LEN bytes, aligned for cmsghdr, and outlives the call.
    msg.msg_control = unsafe { control.bytes.as_mut_ptr() }.cast();
    msg.msg_controllen = CONTROL_LEN;
    let pktinfo = libc::in_pktinfo {
        ipi_ifindex: ifindex as libc::c_int,
        ipi_spec_dst: libc::in_addr {
            s_addr: u32::from_ne_bytes(batch.key.src.octets()),
        },
        ipi_addr: libc::in_addr { s_addr: 0 },
    };
    let tos = libc::c_int::from(batch.key.tos);
    // SAFETY: the control buffer holds exactly these three messages (CONTROL_LEN), so each
    // CMSG_FIRSTHDR/CMSG_NXTHDR is non-null and its data has room for the value written; the
    // unaligned writes do not assume the data's alignment.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_UDP;
        (*c).cmsg_type = libc::UDP_SEGMENT;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<u16>() as u32) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<u16>(), batch.key.segment);
        c = libc::CMSG_NXTHDR(&msg, c);
        (*c).cmsg_level = libc::IPPROTO_IP;
        (*c).cmsg_type = libc::IP_PKTINFO;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::in_pktinfo>() as u32) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<libc::in_pktinfo>(), pktinfo);
        c = libc::CMSG_NXTHDR(&msg, c);
        (*c).cmsg_level = libc::IPPROTO_IP;
        (*c).cmsg_type = libc::IP_TOS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<libc::c_int>(), tos);
    }
    // SAFETY: `msg` and everything it points to are valid for the duration of the call.
    let rc = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use xroce_core::icrc;

    /// An Ethernet frame holding an IPv4 RoCEv2 packet with `payload` bytes after the BTH.
    fn frame(payload: usize, ident: u16, src_port: u16, dst: [u8; 4]) -> Vec<u8> {
        let total = IPV4_LEN + UDP_LEN + 12 + payload + ICRC_LEN;
        let mut f = vec![0u8; ETHERNET_LEN + total];
        f[12..14].copy_from_slice(&[0x08, 0x00]);
        let ip = &mut f[ETHERNET_LEN..];
        ip[0] = 0x45;
        ip[2..4].copy_from_slice(&(total as u16).to_be_bytes());
        ip[4..6].copy_from_slice(&ident.to_be_bytes());
        ip[6] = 0x40;
        ip[8] = 64;
        ip[9] = 17;
        ip[12..16].copy_from_slice(&[10, 0, 0, 1]);
        ip[16..20].copy_from_slice(&dst);
        ip[20..22].copy_from_slice(&src_port.to_be_bytes());
        ip[22..24].copy_from_slice(&ROCEV2_UDP_PORT.to_be_bytes());
        ip[24..26].copy_from_slice(&((total - IPV4_LEN) as u16).to_be_bytes());
        ip[28] = 0x04; // SEND ONLY
        for (i, b) in ip[40..total - ICRC_LEN].iter_mut().enumerate() {
            *b = i as u8;
        }
        icrc::fill(ip).unwrap();
        f
    }

    /// The IP packet the kernel makes of segment `index` of `batch`.
    fn as_sent(batch: &Batch, index: usize, src_port: u16) -> Vec<u8> {
        let seg = usize::from(batch.key.segment);
        let payload = &batch.bytes[index * seg..(index + 1) * seg];
        let total = IPV4_LEN + UDP_LEN + seg;
        let mut p = vec![0u8; total];
        p[0] = 0x45;
        p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
        p[4..6].copy_from_slice(&(index as u16).to_be_bytes());
        p[6] = 0x40;
        p[9] = 17;
        p[12..16].copy_from_slice(&batch.key.src.octets());
        p[16..20].copy_from_slice(&batch.key.dst.octets());
        p[20..22].copy_from_slice(&src_port.to_be_bytes());
        p[22..24].copy_from_slice(&ROCEV2_UDP_PORT.to_be_bytes());
        p[24..26].copy_from_slice(&((UDP_LEN + seg) as u16).to_be_bytes());
        p[28..].copy_from_slice(payload);
        p
    }

    /// Checks every ICRC of `batch` as it leaves: a batch of several as the kernel sends it, a
    /// lone segment in the frame the engine built.
    fn check_as_sent(batch: &Batch, src_port: u16) {
        if batch.segments < MIN_BATCH {
            let mut buf = [0u8; 9000];
            for i in 0..batch.segments {
                let len = batch.write_built_frame(i, &mut buf).unwrap();
                assert!(
                    icrc::verify(&buf[ETHERNET_LEN..len]).unwrap(),
                    "a short batch"
                );
            }
            return;
        }
        for i in 0..batch.segments {
            let p = as_sent(batch, i, src_port);
            assert!(
                icrc::verify(&p).unwrap(),
                "segment {i} of a batch of {}",
                batch.segments
            );
        }
    }

    /// Adds `count` equal frames of `payload` bytes to one peer; returns the batches' sizes,
    /// after checking every segment's ICRC as the kernel will send it.
    fn batch_sizes(count: u16, payload: usize) -> Vec<usize> {
        let mut b = Batcher::new(45_678);
        for i in 0..count {
            let f = frame(payload, 1000 + i, 0xc000 + i, [10, 0, 0, 2]);
            let seg = segment_of(&f).unwrap();
            assert!(b.add(&f, &seg));
        }
        let mut sizes = Vec::new();
        while let Some(batch) = b.oldest() {
            check_as_sent(batch, 45_678);
            sizes.push(batch.segments);
            b.sent_oldest();
        }
        sizes
    }

    #[test]
    fn batched_segments_carry_the_icrc_of_the_headers_the_kernel_writes() {
        // At most 63 segments a batch ...
        assert_eq!(batch_sizes(70, 512), [63, 7]);
        // ... and at most a datagram's 65 507 bytes: 62 segments of 1 040.
        assert_eq!(batch_sizes(70, 1024), [62, 8]);
        assert_eq!(batch_sizes(1, 0), [1]);
    }

    #[test]
    fn a_batch_ends_where_the_destination_or_the_length_changes() {
        let mut b = Batcher::new(5000);
        let frames = [
            frame(1024, 1, 1, [10, 0, 0, 2]),
            frame(1024, 2, 1, [10, 0, 0, 2]),
            frame(1024, 3, 1, [10, 0, 0, 3]),
            frame(100, 4, 1, [10, 0, 0, 3]),
            frame(100, 5, 1, [10, 0, 0, 3]),
        ];
        for f in &frames {
            assert!(b.add(f, &segment_of(f).unwrap()));
        }
        let mut seen = Vec::new();
        while let Some(batch) = b.oldest() {
            check_as_sent(batch, 5000);
            seen.push((batch.key.dst.octets()[3], batch.key.segment, batch.segments));
            b.sent_oldest();
        }
        assert_eq!(seen, [(2, 1040, 2), (3, 1040, 1), (3, 116, 2)]);
    }

    #[test]
    fn a_short_batch_goes_back_into_the_frames_the_engine_built() {
        let mut b = Batcher::new(5000);
        let lone = frame(100, 77, 0xc001, [10, 0, 0, 2]);
        let three = [78, 79, 80].map(|ident| frame(64, ident, 0xc001 + ident, [10, 0, 0, 2]));
        let four = [81, 82, 83, 84].map(|ident| frame(64, ident, 0xc001, [10, 0, 0, 3]));
        for f in std::iter::once(&lone).chain(&three).chain(&four) {
            assert!(b.add(f, &segment_of(f).unwrap()));
        }
        let mut buf = [0u8; 4096];
        let batch = b.oldest().unwrap();
        assert_eq!(batch.segments, 1);
        let len = batch.write_built_frame(0, &mut buf).unwrap();
        assert_eq!(&buf[..len], &lone[..]);
        assert_eq!(batch.write_built_frame(0, &mut buf[..len - 1]), None);
        assert_eq!(batch.write_built_frame(1, &mut buf), None);
        b.sent_oldest();
        let batch = b.oldest().unwrap();
        assert_eq!(batch.segments, 3);
        for (i, built) in three.iter().enumerate() {
            let len = batch.write_built_frame(i, &mut buf).unwrap();
            assert_eq!(&buf[..len], &built[..], "frame {i}");
        }
        b.sent_oldest();
        // Long enough to go as a batch: no longer as built.
        let batch = b.oldest().unwrap();
        assert_eq!(batch.segments, MIN_BATCH);
        assert_eq!(batch.write_built_frame(0, &mut buf), None);
        check_as_sent(batch, 5000);
    }

    #[test]
    fn only_untagged_ipv4_rocev2_frames_are_batched() {
        let good = frame(64, 1, 1, [10, 0, 0, 2]);
        assert!(segment_of(&good).is_some());
        let mut vlan = good.clone();
        vlan[12..14].copy_from_slice(&[0x81, 0x00]);
        assert!(segment_of(&vlan).is_none());
        let mut other_port = good.clone();
        other_port[ETHERNET_LEN + 22..ETHERNET_LEN + 24].copy_from_slice(&4792u16.to_be_bytes());
        assert!(segment_of(&other_port).is_none());
        let mut options = good.clone();
        options[ETHERNET_LEN] = 0x46;
        assert!(segment_of(&options).is_none());
        let mut fragment = good.clone();
        fragment[ETHERNET_LEN + 6] = 0x20; // more fragments
        assert!(segment_of(&fragment).is_none());
        let mut longer = good.clone();
        longer[ETHERNET_LEN + 3] += 1; // IP length past the frame's end
        assert!(segment_of(&longer).is_none());
        assert!(segment_of(&good[..good.len() - 1]).is_none());
    }

    #[test]
    fn the_driver_of_an_interface_is_read() {
        // Every namespace has a loopback device, whose driver has no ethtool name; an
        // interface that does not exist has no driver at all.
        assert_ne!(driver_name("lo").as_deref(), Some("virtio_net"));
        assert_eq!(driver_name("xroce-no-such"), None);
        assert_eq!(driver_name(&"x".repeat(40)), None);
        assert!(!batching_pays_on("lo"));
    }

    #[test]
    fn the_transmit_path_is_named_as_xroce_transmit_takes_it() {
        assert_eq!("udp-gso".parse(), Ok(Transmit::UdpGso));
        assert_eq!("".parse(), Ok(Transmit::Auto));
        assert_eq!("auto".parse(), Ok(Transmit::Auto));
        assert_eq!(" AF-XDP ".parse(), Ok(Transmit::AfXdp));
        assert!("gso".parse::<Transmit>().unwrap_err().contains("udp-gso"));
    }
}
