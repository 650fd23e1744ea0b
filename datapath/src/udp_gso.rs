//! Sending through a kernel UDP socket in batches (UDP GSO), receiving through AF_XDP.
//!
//! AF_XDP's copy mode hands the driver one frame at a time and never says more are coming, so
//! a virtio-net NIC is notified (a VM exit, under emulation a trip into QEMU's device code) for
//! every frame. A UDP socket with `UDP_SEGMENT` gives the kernel a batch of equal-sized
//! segments (the last may be shorter) as one buffer; the kernel cuts it into datagrams and
//! hands them to the driver with "more to come", one notification per batch. In Debian 12 guests under TCG batches of 16 to
//! 60 1 KiB datagrams per `sendmsg` carried 61-66 MB/s to an AF_XDP receiver where AF_XDP's
//! copy mode carried 31-38 (`docs/decisions.md`, "Stop 62").
//!
//! On a veth pair the kernel's path per frame is cheaper this way too: the UDP stack builds a
//! batch's frames from one buffer where AF_XDP's copy mode allocates and fills an skb per
//! descriptor. Between two namespaces the sender's kernel time per 4 KiB frame fell by about
//! a tenth and the 64 B message rate rose by about a seventh (`docs/decisions.md`, "Stop 64").
//! There batching waits on the veth not offloading UDP segmentation ([`AutoBatching`]), read
//! when the port opens and again after each link notification (the offload changes with the
//! peer's XDP program, and the kernel notifies the change).
//!
//! The engine still builds whole frames. For each IPv4 RoCEv2 frame this port keeps the UDP
//! payload (BTH to ICRC) and lets the kernel write the Ethernet, IP and UDP headers. What the
//! kernel writes differs from the engine's in two fields the ICRC covers: the IP
//! identification counts from 0 within a batch (an unconnected socket sending with DF), and
//! the UDP source port is the socket's. The ICRC is changed for both
//! ([`xroce_core::icrc::IcrcRewriter`]). The addresses, TOS, DF and lengths are the engine's:
//! the source address and TOS go with each batch, and the socket is bound to the interface.
//!
//! On a veth batching pays only for frames that come in runs: a `sendmsg` for a frame or two
//! costs more than AF_XDP's copy. So frames go straight into the AF_XDP ring, as without this
//! port, until a round of the engine (from one flush to the next) has four frames in a row for
//! one batch (`MIN_BATCH`); from the next round on they are sorted into batches, and a batch
//! that ends shorter goes through AF_XDP as built. A round that took several frames and sent
//! no batch turns batching off again. A stream batches, and so do messages of four packets or
//! more. Where each frame costs a notification (virtio-net), two frames in a row already make
//! a batch (`MIN_PAIR`): a ping-pong's answer and the ACK behind it leave with one
//! notification. A batch's segments are of one length, and its last may be shorter (as
//! `UDP_SEGMENT` cuts a send), which ends it: an ACK behind an answer joins the answer's
//! batch. The AF_XDP
//! socket is kicked before each batch goes to the UDP socket, so frames leave in the order
//! they were built. While a batch is open, the engine builds the next frame where its segment
//! would follow in the batch's buffer (`Batcher::build_at_tail`), so a stream's payloads are
//! copied once, from the application's memory, as into AF_XDP's ring.
//!
//! Frames it does not take this way (IPv6, VLAN-tagged, anything not RoCEv2) go out through
//! the AF_XDP socket as before. What is lost: the per-QP UDP source port (every batched frame
//! carries the socket's), which spreads QPs over the paths of a multi-path fabric.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    /// [`Transmit::UdpGso`] where the sending socket is in copy mode on virtio-net, or on a
    /// veth while it does not offload UDP segmentation ([`auto_batching`]);
    /// [`Transmit::AfXdp`] elsewhere.
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
        crate::setting_from_env(TRANSMIT_ENV)
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
                 udp-gso in copy mode on virtio-net and on a veth whose peer runs native XDP), \
                 udp-gso or af-xdp"
            )),
        }
    }
}

/// Segments per batch: Linux takes 64 in one `UDP_SEGMENT` send (128 from 6.10); kernels
/// before 5.16 counted the UDP header against that limit, so 63 leave room for it.
pub(crate) const MAX_SEGMENTS: usize = 63;
/// The most a UDP datagram over IPv4 carries, and so a batch.
const MAX_BATCH_BYTES: usize = 65_507;
/// Fewer frames in a row than this go through AF_XDP as built (but see [`MIN_PAIR`]): on a
/// veth a `sendmsg` costs more than AF_XDP's copy of a frame or two (a ping-pong's answer and
/// ACK).
const MIN_BATCH: usize = 4;
/// Where frames cost the NIC a notification each ([`notifies_per_frame`]: virtio-net), two
/// frames in a row already go as a batch: a ping-pong's answer and the ACK behind it leave
/// with one notification instead of two. Between two Debian 12 guests under TCG a raw
/// two-frame turn sent so took 156-180 µs a round trip against 184-212 through AF_XDP's copy
/// mode, and `ib_send_lat`'s typical one-way 109-116 µs against 119-133
/// (`docs/decisions.md`, "Stop 94").
const MIN_PAIR: usize = 2;
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
    /// The UDP payload of every segment (of a batch's: but the last, which may be shorter).
    segment: u16,
}

impl BatchKey {
    /// Whether a segment of key `next` can follow one of this key in a batch (this key being
    /// the batch's): the same addresses and TOS, and as long, or shorter to end the batch
    /// (`UDP_SEGMENT` cuts a send into segments of one size and a shorter last one).
    fn takes(&self, next: &BatchKey) -> bool {
        self.src == next.src
            && self.dst == next.dst
            && self.tos == next.tos
            && next.segment <= self.segment
    }
}

#[derive(Debug)]
struct Batch {
    key: BatchKey,
    segments: usize,
    /// Room for a frame's headers (see [`Batcher::build_at_tail`]), then the segments up to `end`,
    /// then room for the next frame.
    buf: Vec<u8>,
    end: usize,
    /// The UDP payload of the last segment: `key.segment`, or shorter, which ends the batch.
    last: u16,
    /// The segments' ICRCs are the socket's: the batch reached [`MIN_BATCH`], or is a pair
    /// that goes through the socket ([`Batcher::pair_for_socket`]).
    for_socket: bool,
    /// While the batch is shorter than [`MIN_BATCH`], its segments are kept as built, and
    /// these are their frames' headers: a batch that ends so short goes out through AF_XDP as
    /// those frames, unless it goes through the socket as a pair (`for_socket`).
    built_headers: [[u8; HEADERS_LEN]; MIN_BATCH - 1],
    /// Of a short batch, the frames already handed to AF_XDP.
    sent_built: usize,
}

impl Batch {
    /// The segments, as the socket sends them.
    fn bytes(&self) -> &[u8] {
        &self.buf[HEADERS_LEN..self.end]
    }

    /// Writes segment `index` of a short batch back into the frame the engine built; its
    /// length. (`None` for a batch whose segments are no longer as built: one of
    /// [`MIN_BATCH`] or more, or a pair readied for the socket.)
    fn write_built_frame(&self, index: usize, buf: &mut [u8]) -> Option<usize> {
        if self.for_socket {
            return None;
        }
        let (at, seg) = self.segment_at(index)?;
        let len = HEADERS_LEN + seg;
        let frame = buf.get_mut(..len)?;
        frame[..HEADERS_LEN].copy_from_slice(self.built_headers.get(index)?);
        frame[HEADERS_LEN..].copy_from_slice(self.bytes().get(at..at + seg)?);
        Some(len)
    }

    /// Where segment `index` starts in [`Batch::bytes`], and its length.
    fn segment_at(&self, index: usize) -> Option<(usize, usize)> {
        if index >= self.segments {
            return None;
        }
        let seg = usize::from(self.key.segment);
        let len = if index + 1 == self.segments {
            usize::from(self.last)
        } else {
            seg
        };
        Some((index * seg, len))
    }

    /// Whether the batch still takes segments of its length: a shorter one ended it.
    fn open_to_more(&self) -> bool {
        self.last == self.key.segment
    }

    /// Makes a short batch's segments, kept as built, the socket's: each ICRC changed for the
    /// identification and source port the kernel will write. `false` when an ICRC could not
    /// be changed; the segments are then as they were.
    fn rewrite_kept(&mut self, rewriter: &mut IcrcRewriter, src_port: u16) -> bool {
        let kept = self.segments.min(MIN_BATCH - 1);
        let mut rewritten = [(0usize, 0u32); MIN_BATCH - 1];
        for (i, slot) in rewritten.iter_mut().enumerate().take(kept) {
            let Some((at, len)) = self.segment_at(i) else {
                return false;
            };
            let (ident, port) = ident_and_port(&self.built_headers[i]);
            let segment = &self.bytes()[at..at + len];
            let Some(icrc) = rewriter.rewritten(
                icrc_of(segment),
                IPV4_LEN + UDP_LEN + len,
                ident ^ i as u16,
                port ^ src_port,
            ) else {
                return false;
            };
            *slot = (HEADERS_LEN + at + len - ICRC_LEN, icrc);
        }
        for &(icrc_at, icrc) in &rewritten[..kept] {
            self.buf[icrc_at..icrc_at + ICRC_LEN].copy_from_slice(&icrc.to_le_bytes());
        }
        true
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

/// What became of a frame built at the open batch's tail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TailBuild {
    /// It joined the batch.
    Added,
    /// It is for elsewhere (another batch, or AF_XDP), copied out: its length.
    Elsewhere(usize),
    /// Nothing was built.
    Nothing,
}

/// Builds the batches: each segment's ICRC changed for the identification and source port the
/// kernel will write (see the module's notes).
#[derive(Debug)]
struct Batcher {
    /// The socket's source port.
    src_port: u16,
    /// The longest frame the engine builds.
    max_frame: usize,
    rewriter: IcrcRewriter,
    /// The batch still taking segments.
    open: Option<Batch>,
    /// Closed batches, oldest first.
    closed: VecDeque<Batch>,
    /// Buffers of batches sent, for the next ones.
    spare: Vec<Vec<u8>>,
}

impl Batcher {
    fn new(src_port: u16, max_frame: usize) -> Self {
        Batcher {
            src_port,
            max_frame,
            rewriter: IcrcRewriter::new(),
            open: None,
            closed: VecDeque::new(),
            spare: Vec::new(),
        }
    }

    /// Whether the open batch takes `seg`'s segment of `len` bytes.
    fn fits(&self, seg: &Segment, len: usize) -> bool {
        self.open.as_ref().is_some_and(|b| {
            b.open_to_more()
                && b.key.takes(&seg.key)
                && b.segments < MAX_SEGMENTS
                && b.end - HEADERS_LEN + len <= MAX_BATCH_BYTES
        })
    }

    /// Adds the segment of `frame` to the open batch, or closes it and opens another. The
    /// segments of a batch shorter than [`MIN_BATCH`] are kept as built; the batch's ICRCs
    /// change when it reaches that length (or when a pair is readied for the socket,
    /// [`Batcher::pair_for_socket`]). `false` when an ICRC could not be changed (a length
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
        if !self.fits(seg, payload.len()) {
            if let Some(b) = self.open.take() {
                self.closed.push_back(b);
            }
        }
        let Some(batch) = &mut self.open else {
            let mut buf = self.spare.pop().unwrap_or_default();
            // Never shrunk: a frame is built into it without clearing it first.
            buf.resize(HEADERS_LEN + MAX_BATCH_BYTES + self.max_frame, 0);
            let end = HEADERS_LEN + payload.len();
            buf[HEADERS_LEN..end].copy_from_slice(payload);
            let mut built_headers = [[0u8; HEADERS_LEN]; MIN_BATCH - 1];
            built_headers[0] = headers;
            self.open = Some(Batch {
                key: seg.key,
                segments: 1,
                buf,
                end,
                last: seg.key.segment,
                for_socket: false,
                built_headers,
                sent_built: 0,
            });
            return true;
        };
        let at = batch.end;
        let Some(place) = batch.buf.get_mut(at..at + payload.len()) else {
            return false;
        };
        place.copy_from_slice(payload);
        Self::take_segment(
            &mut self.rewriter,
            self.src_port,
            batch,
            seg,
            headers,
            payload.len(),
        )
    }

    /// Builds a frame with `build` where its segment would follow the open batch's last, so
    /// that a stream's segments are not copied once more: the frame's headers go over the end
    /// of that segment, whose bytes are put back once the headers are read. A frame for the
    /// open batch joins it there; any other is copied, headers and all, into `elsewhere` (at
    /// least as long as the longest frame).
    fn build_at_tail(
        &mut self,
        build: &mut dyn FnMut(&mut [u8]) -> Option<usize>,
        elsewhere: &mut [u8],
    ) -> TailBuild {
        let Some(batch) = &mut self.open else {
            return TailBuild::Nothing;
        };
        let at = batch.end - HEADERS_LEN;
        let max = self
            .max_frame
            .min(batch.buf.len() - at)
            .min(elsewhere.len());
        let tail = &mut batch.buf[at..at + max];
        let mut saved = [0u8; HEADERS_LEN];
        saved.copy_from_slice(&tail[..HEADERS_LEN]);
        let built = build(tail).filter(|&l| l > 0 && l <= max);
        let Some(len) = built else {
            tail[..HEADERS_LEN].copy_from_slice(&saved);
            return TailBuild::Nothing;
        };
        let seg = segment_of(&tail[..len]);
        let mut headers = [0u8; HEADERS_LEN];
        let head = len.min(HEADERS_LEN);
        headers[..head].copy_from_slice(&tail[..head]);
        tail[..HEADERS_LEN].copy_from_slice(&saved);
        if let Some(seg) = seg {
            let seg_len = seg.end - seg.start;
            if self.fits(&seg, seg_len) {
                if let Some(batch) = &mut self.open {
                    if Self::take_segment(
                        &mut self.rewriter,
                        self.src_port,
                        batch,
                        &seg,
                        headers,
                        seg_len,
                    ) {
                        return TailBuild::Added;
                    }
                }
            }
        }
        let Some(batch) = &self.open else {
            // Not reached: nothing above closes the batch.
            debug_assert!(
                false,
                "the open batch went while a frame was built at its tail"
            );
            return TailBuild::Nothing;
        };
        elsewhere[..head].copy_from_slice(&headers[..head]);
        if len > head {
            elsewhere[head..len].copy_from_slice(&batch.buf[at + head..at + len]);
        }
        TailBuild::Elsewhere(len)
    }

    /// Takes into `batch` the segment of `len` bytes now at its end, built with `headers`.
    fn take_segment(
        rewriter: &mut IcrcRewriter,
        src_port: u16,
        batch: &mut Batch,
        seg: &Segment,
        headers: [u8; HEADERS_LEN],
        len: usize,
    ) -> bool {
        let index = batch.segments;
        let at = batch.end;
        let Ok(last) = u16::try_from(len) else {
            return false;
        };
        if index < MIN_BATCH - 1 {
            batch.built_headers[index] = headers;
            batch.end += len;
            batch.segments += 1;
            batch.last = last;
            return true;
        }
        let Some(segment) = batch.buf.get(at..at + len) else {
            return false;
        };
        // The identification the kernel gives a segment is its place in the batch.
        let Some(icrc) = rewriter.rewritten(
            icrc_of(segment),
            IPV4_LEN + UDP_LEN + len,
            seg.ident ^ index as u16,
            seg.src_port ^ src_port,
        ) else {
            return false;
        };
        if index == MIN_BATCH - 1 && !batch.rewrite_kept(rewriter, src_port) {
            // The batch is long enough: the segments kept as built become the batch's.
            return false;
        }
        batch.for_socket = true;
        let icrc_at = at + len - ICRC_LEN;
        batch.buf[icrc_at..icrc_at + ICRC_LEN].copy_from_slice(&icrc.to_le_bytes());
        batch.end += len;
        batch.segments += 1;
        batch.last = last;
        true
    }

    /// Whether the open batch has room for another segment of its length.
    fn open_has_room(&self) -> bool {
        self.open.as_ref().is_some_and(|b| {
            b.open_to_more()
                && b.segments < MAX_SEGMENTS
                && b.end - HEADERS_LEN + usize::from(b.key.segment) <= MAX_BATCH_BYTES
        })
    }

    /// Readies the batch that goes next ([`Batcher::oldest`], or the oldest closed one when
    /// `keep_open`) for the socket when it is a pair ([`MIN_PAIR`] to [`MIN_BATCH`] - 1
    /// segments) none of whose frames went through AF_XDP yet.
    fn pair_for_socket(&mut self, keep_open: bool) {
        let (rewriter, src_port) = (&mut self.rewriter, self.src_port);
        let next = if keep_open || !self.closed.is_empty() {
            self.closed.front_mut()
        } else {
            self.open.as_mut()
        };
        if let Some(b) =
            next.filter(|b| !b.for_socket && b.segments >= MIN_PAIR && b.sent_built == 0)
        {
            // A frame that is not a RoCEv2 packet never joins a batch; were its ICRC
            // unchangeable all the same, its frames go through AF_XDP as built.
            b.for_socket = b.rewrite_kept(rewriter, src_port);
        }
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
            self.spare.push(b.buf);
        }
    }

    /// Drops every batch not sent: its frames are lost, as on a wire (the transport resends).
    fn drop_all(&mut self) -> usize {
        let mut frames = 0;
        while let Some(b) = self.oldest() {
            frames += b.segments - b.sent_built;
            self.sent_oldest();
        }
        frames
    }
}

/// What `auto` does on an interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AutoBatching {
    /// Every frame through AF_XDP.
    Off,
    /// Batches (virtio-net).
    On,
    /// Batches while the kernel segments UDP in software (a veth whose `tx-udp-segmentation`
    /// is off), read again after each notification of a change of the interface
    /// ([`Port::link_changed`]).
    WhileSegmentedInSoftware,
}

/// The feature whose absence means the kernel cuts a batch into frames before the driver.
const UDP_SEGMENTATION: &str = "tx-udp-segmentation";

/// What `auto` does on `iface` (read in the calling thread's network namespace):
/// - on virtio-net it batches: there copy mode notifies the device for every frame (see the
///   module's notes);
/// - on a veth it batches while the veth does not offload UDP segmentation, which a veth takes
///   off when its peer runs native XDP (as xroce's engine does): the kernel then cuts each
///   batch into frames before they cross, and the peer's XDP program sees frames. A veth
///   whose peer runs no XDP or generic XDP would hand the batch across whole: a receiver in
///   generic XDP mode gets one oversized frame and loses it (seen with devices on bridges).
///   The offload is read again after each link notification, so an engine that starts
///   before its peer's program is attached batches once it is;
/// - elsewhere it does not: a NIC that segments in hardware might number the IP
///   identifications otherwise than Linux does, which the ICRCs count on; and every batched
///   frame carries the socket's source port, not its QP's, which a multi-path fabric spreads
///   QPs by.
pub fn auto_batching(iface: &str) -> AutoBatching {
    match crate::ethtool::driver_name(iface).as_deref() {
        Some("virtio_net") => AutoBatching::On,
        Some("veth") => AutoBatching::WhileSegmentedInSoftware,
        _ => AutoBatching::Off,
    }
}

/// Whether each frame AF_XDP's copy mode hands `iface`'s driver costs a notification of the
/// device: virtio-net's (under emulation a trip into QEMU each).
pub fn notifies_per_frame(iface: &str) -> bool {
    auto_batching(iface) == AutoBatching::On
}

/// Whether `iface` (in the calling thread's network namespace) segments UDP batches in
/// software before its driver sees them: `tx-udp-segmentation` off. On a veth, while its peer
/// runs native XDP. (The port reads the same through its own socket; this is for callers
/// that want to know, the tests among them.)
pub fn segmented_in_software(iface: &str) -> bool {
    crate::ethtool::feature_active(iface, UDP_SEGMENTATION) == Some(false)
}

/// The UDP socket batches leave through.
#[derive(Debug)]
pub struct GsoSocket {
    fd: OwnedFd,
    src_port: u16,
}

/// The socket as a standard one (blocking as opened: non-blocking), for senders of their own
/// (the benchmark's batched raw stream).
impl From<GsoSocket> for std::net::UdpSocket {
    fn from(s: GsoSocket) -> Self {
        std::net::UdpSocket::from(s.fd)
    }
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
    /// The open batch was kept open by [`Port::flush_before_more`] for the next round.
    kept_open: bool,
    iface: String,
    /// Frames are sorted into batches (after a round that had
    /// [`UdpGsoPort::shortest_batch`] frames in a row for one batch); otherwise they go
    /// straight into the AF_XDP ring, as without this port.
    batching: bool,
    /// Batching: a batch went to the UDP socket since the last flush, and how many frames
    /// were taken.
    batched_since_flush: bool,
    taken_since_flush: usize,
    /// Not batching: the batch the last frames would have made, how many frames in a row
    /// were for it, and whether that reached [`UdpGsoPort::shortest_batch`] since the last
    /// flush.
    last_key: Option<BatchKey>,
    run: usize,
    /// Batches of two or three frames go through the socket too ([`MIN_PAIR`]), not through
    /// AF_XDP as built.
    pairs: bool,
    long_run_since_flush: bool,
    /// Batching waits on the kernel segmenting in software ([`AutoBatching`]): what that
    /// said when last read.
    segmented_in_software: Option<bool>,
    /// Whether an address is one of the engine's namespace's own (see
    /// [`UdpGsoPort::reachable_by_socket`]), and the answers so far.
    is_local: LocalCheck,
    destinations: HashMap<Ipv4Addr, bool>,
    /// The offload's place among the interface's features, once looked up.
    offload_index: Option<crate::ethtool::FeatureIndex>,
    /// The interface changed since the offload was read ([`Port::link_changed`]): read it
    /// again before the next batch.
    offload_stale: bool,
    /// Addresses or routes changed since `destinations` was cleared
    /// ([`Port::addresses_changed`]), and when it was.
    destinations_stale: bool,
    destinations_cleared: Instant,
    /// Frames sent in batches so far.
    batched_frames: Arc<AtomicU64>,
}

/// Tells whether an IPv4 address is one of the engine's namespace's own.
pub type LocalCheck = Box<dyn Fn(Ipv4Addr) -> bool + Send>;

/// The shortest time between two clearings of the destinations' answers after address or
/// route notifications.
const REFRESH: Duration = Duration::from_secs(1);
/// Destinations whose answers are kept; more and the map starts again.
const MAX_DESTINATIONS: usize = 4096;

impl<P: Port> UdpGsoPort<P> {
    /// Wraps `inner` (the engine's AF_XDP sockets on `iface`), whose frames are at most
    /// `max_frame` bytes. With `while_segmented_in_software`, batches go only while the
    /// interface does not offload UDP segmentation ([`AutoBatching::WhileSegmentedInSoftware`]).
    /// `is_local` says which destinations are the namespace's own addresses: frames to those
    /// never go through the socket ([`is_local_ipv4`], asked in the engine's namespace).
    pub fn new(
        inner: P,
        socket: GsoSocket,
        iface: &str,
        ifindex: u32,
        max_frame: usize,
        while_segmented_in_software: bool,
        is_local: LocalCheck,
    ) -> Self {
        let mut port = UdpGsoPort {
            inner,
            socket: socket.fd,
            ifindex,
            batcher: Batcher::new(socket.src_port, max_frame),
            scratch: vec![0u8; max_frame],
            held: None,
            refused: false,
            unkicked: false,
            kept_open: false,
            iface: iface.to_string(),
            batching: false,
            batched_since_flush: false,
            taken_since_flush: 0,
            last_key: None,
            run: 0,
            pairs: false,
            long_run_since_flush: false,
            segmented_in_software: while_segmented_in_software.then_some(true),
            is_local,
            destinations: HashMap::new(),
            offload_index: None,
            offload_stale: false,
            destinations_stale: false,
            destinations_cleared: Instant::now(),
            batched_frames: Arc::new(AtomicU64::new(0)),
        };
        port.read_offload();
        port
    }

    /// Sends pairs through the socket too (two frames in a row for one batch, such as a
    /// ping-pong's answer and the ACK behind it): for an interface that costs a notification
    /// per frame AF_XDP hands it ([`notifies_per_frame`]).
    pub fn with_pairs(mut self, pairs: bool) -> Self {
        self.pairs = pairs;
        self
    }

    /// The count of frames this port has sent in batches, as it goes.
    pub fn frames_batched(&self) -> Arc<AtomicU64> {
        self.batched_frames.clone()
    }

    /// Whether batches may go: always, unless they wait on the kernel segmenting in software
    /// and it no longer does.
    fn may_batch(&mut self) -> bool {
        if std::mem::take(&mut self.offload_stale) {
            self.read_offload();
        }
        self.segmented_in_software.unwrap_or(true)
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
        // Where pairs go, a shorter frame (an ACK behind an answer) ends the run it joins;
        // elsewhere a run is of frames of one length, as before pairs (a message of three
        // packets and its ACK do not start batching on a veth).
        let joins = match (&self.last_key, &key) {
            (Some(run), Some(next)) if self.pairs => run.takes(next),
            (Some(run), Some(next)) => run == next,
            _ => false,
        };
        if joins {
            self.run += 1;
            if let (Some(run), Some(next)) = (&self.last_key, &key) {
                if next.segment < run.segment {
                    // A shorter frame ends the batch it joins: the next starts another run.
                    self.last_key = None;
                }
            }
        } else {
            self.run = 1;
            self.last_key = key;
        }
        if let Some(k) = key.filter(|_| self.run == self.shortest_batch()) {
            self.long_run_since_flush |= self.reachable_by_socket(k.dst);
        }
    }

    /// The fewest frames a batch sent through the socket has.
    fn shortest_batch(&self) -> usize {
        if self.pairs {
            MIN_PAIR
        } else {
            MIN_BATCH
        }
    }

    /// Whether the UDP socket's datagrams to `dst` leave through the interface: not when `dst`
    /// is an address of the engine's own namespace (two devices of one host cabled together),
    /// which the kernel delivers through its loopback interface instead. Asked once per
    /// destination, and again after the namespace's addresses or routes change
    /// ([`Port::addresses_changed`], at most once per [`REFRESH`]).
    fn reachable_by_socket(&mut self, dst: Ipv4Addr) -> bool {
        if self.destinations_stale && self.destinations_cleared.elapsed() >= REFRESH {
            self.destinations_stale = false;
            self.destinations_cleared = Instant::now();
            self.destinations.clear();
        }
        if let Some(&reachable) = self.destinations.get(&dst) {
            return reachable;
        }
        let reachable = !(self.is_local)(dst);
        if self.destinations.len() >= MAX_DESTINATIONS {
            self.destinations.clear();
        }
        self.destinations.insert(dst, reachable);
        reachable
    }

    /// Reads whether the interface segments in software, when batching waits on that (through
    /// the UDP socket, so in the engine's namespace whichever thread asks).
    fn read_offload(&mut self) {
        if let Some(in_software) = &mut self.segmented_in_software {
            let fd = self.socket.as_raw_fd();
            if self.offload_index.is_none() {
                self.offload_index =
                    crate::ethtool::feature_index_via(fd, &self.iface, UDP_SEGMENTATION);
            }
            *in_software = self
                .offload_index
                .and_then(|at| crate::ethtool::feature_bit_via(fd, &self.iface, at))
                == Some(false);
        }
    }

    /// Sorts the frame in `scratch[..len]`: a batch's segment, or a frame for AF_XDP.
    fn take(&mut self, len: usize) {
        self.taken_since_flush += 1;
        if let Some(seg) = segment_of(&self.scratch[..len]) {
            // The open batch's destination was asked about when it opened.
            let reachable = self.batcher.fits(&seg, seg.end - seg.start)
                || self.reachable_by_socket(seg.key.dst);
            if reachable && self.batcher.add(&self.scratch[..len], &seg) {
                return;
            }
        }
        let frame = &self.scratch[..len];
        if self.inner.send(frame) {
            self.unkicked = true;
        } else {
            self.held = Some(frame.to_vec());
        }
    }

    /// Builds a frame where its segment would follow the open batch's last
    /// ([`Batcher::build_at_tail`]); a frame that is not for that batch is sorted as one built
    /// elsewhere.
    fn build_on_open_batch(&mut self, build: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> bool {
        match self.batcher.build_at_tail(build, &mut self.scratch) {
            TailBuild::Added => self.taken_since_flush += 1,
            TailBuild::Elsewhere(len) => self.take(len),
            TailBuild::Nothing => {}
        }
        true
    }

    /// Batching: the held frame, then the waiting batches, then a kick of the AF_XDP ring. When
    /// the interface no longer segments in software, what waits in batches is dropped instead
    /// and batching ends.
    fn send_waiting(&mut self) -> io::Result<()> {
        self.kept_open = false;
        if let Some(frame) = &self.held {
            if self.inner.send(frame) {
                self.held = None;
                self.unkicked = true;
            }
        }
        if !self.may_batch() {
            // The interface would now hand the batches on whole, and the receiver's program
            // would lose them: dropped here instead, and the frames built from now on go
            // through AF_XDP.
            let dropped = self.batcher.drop_all();
            if dropped > 0 {
                crate::stderr_line!(
                    "xroce: netdev {}: the interface now offloads UDP segmentation (its peer's \
                     XDP program went?); {dropped} frames waiting in batches were dropped and \
                     are resent through AF_XDP",
                    self.iface
                );
            }
            self.batching = false;
            self.batched_since_flush = false;
            self.taken_since_flush = 0;
            return self.inner.flush();
        }
        let batches = self.send_batches();
        let inner = self.inner.flush();
        self.unkicked = false;
        batches.and(inner)
    }

    /// Not batching: batches left when batching ended (the socket full as the kernel refused
    /// one) go, or are refused and dropped, before anything built since.
    fn send_leftovers(&mut self) -> io::Result<()> {
        if self.batcher.waiting() > 0 {
            self.send_batches()
        } else {
            Ok(())
        }
    }

    /// Sends the waiting batches, oldest first. Stops, leaving the rest, when the socket has
    /// no room (`Ok`) or the interface takes nothing (`Err`, as AF_XDP's flush reports it); a
    /// batch refused for any other reason is dropped (the transport retransmits), so that it
    /// cannot hold up the others.
    ///
    /// A batch shorter than [`MIN_BATCH`] goes through AF_XDP as the engine built its frames,
    /// but for a pair where the port sends pairs through the socket ([`MIN_PAIR`]). The AF_XDP socket is kicked before the next batch goes to the UDP socket, so that
    /// frames leave in the order they were built.
    fn send_batches(&mut self) -> io::Result<()> {
        self.send_batches_but(false)
    }

    /// [`Self::send_batches`], leaving the open batch open when `keep_open`.
    fn send_batches_but(&mut self, keep_open: bool) -> io::Result<()> {
        loop {
            // Once the kernel refused a batch, what waits goes through AF_XDP.
            if self.pairs && !self.refused {
                self.batcher.pair_for_socket(keep_open);
            }
            let batch = if keep_open {
                self.batcher.closed.front_mut()
            } else {
                self.batcher.oldest()
            };
            let Some(batch) = batch else {
                break;
            };
            if !batch.for_socket {
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
                Ok(()) => {
                    self.batched_since_flush = true;
                    self.batched_frames
                        .fetch_add(batch.segments as u64, Ordering::Relaxed);
                }
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
        if self.batcher.open.is_some() {
            return self.build_on_open_batch(build);
        }
        let max = self.scratch.len();
        let Some(len) = build(&mut self.scratch).filter(|&l| l > 0 && l <= max) else {
            return true;
        };
        self.take(len);
        true
    }

    /// Also chooses how the next round's frames go: into batches after a round that had
    /// `shortest_batch` frames in a row for one batch; straight to AF_XDP after
    /// a round of batching that took several frames but sent no batch (a ping-pong's answer
    /// and ACK, where pairs do not go through the socket, or its ACK built first). A
    /// round of one frame (an ACK between a stream's messages) changes nothing. The way
    /// changes only when nothing waits on the way left, so that frames leave in the order
    /// they were built.
    fn flush(&mut self) -> io::Result<()> {
        self.kept_open = false;
        if !self.batching {
            let flushed = self.send_leftovers().and(self.inner.flush());
            if std::mem::take(&mut self.long_run_since_flush)
                && !self.inner.tx_pending()
                && !self.refused
                && self.may_batch()
            {
                self.batching = true;
            }
            self.last_key = None;
            self.run = 0;
            return flushed;
        }
        let sent = self.send_waiting();
        let batched = std::mem::take(&mut self.batched_since_flush);
        let taken = std::mem::take(&mut self.taken_since_flush);
        if !batched && taken > 1 && self.held.is_none() && self.batcher.waiting() == 0 {
            self.batching = false;
        }
        sent
    }

    /// A round cut short by its limits, whose next packets the transport builds in the round
    /// that follows: the open batch stays open for them, and everything before it goes. A
    /// run of frames is then not cut where the round was: at path MTU 1024 a round of 63
    /// frames ended inside each 64 KiB WRITE's run of 63 (62 fill a batch), at 4096 a round of
    /// 68 KiB inside the next message's, and every piece shorter than `MIN_BATCH` went
    /// through AF_XDP on its own (a kick, and on virtio-net a notification, each). The round's
    /// judgement waits for the next flush, which sends the batch if nothing joins it; a hold
    /// of ACKs that keeps the next round from coming sends it with [`Port::send_kept`].
    fn flush_before_more(&mut self) -> io::Result<()> {
        if !self.batching
            || self.held.is_some()
            || !self.batcher.open_has_room()
            || !self.may_batch()
        {
            return self.flush();
        }
        let batches = self.send_batches_but(true);
        if !self.batching {
            // A batch was refused, and batching ended with it: the open batch goes now,
            // ahead of the frames built from here on (straight into the AF_XDP ring).
            return batches.and(self.flush());
        }
        let inner = self.inner.flush();
        self.unkicked = false;
        self.kept_open = self.batcher.open.is_some();
        batches.and(inner)
    }

    fn send_kept(&mut self) -> io::Result<()> {
        if self.kept_open {
            self.send_waiting()
        } else {
            Ok(())
        }
    }

    /// Sends what waits, in the order `flush` sends it, but leaves the round's judgement (and
    /// its counts) to the round's own flush: the frames after a kick belong to the same round.
    fn kick(&mut self) -> io::Result<()> {
        if !self.batching {
            return self.send_leftovers().and(self.inner.flush());
        }
        self.send_waiting()
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

    /// A veth's offload changes with its peer's XDP program, and the kernel tells the link's
    /// watchers (`NETDEV_FEAT_CHANGE` sends `RTM_NEWLINK`).
    fn link_changed(&mut self, ifindex: Option<u32>) {
        if ifindex.is_none_or(|i| i == self.ifindex) {
            self.offload_stale = true;
        }
        self.inner.link_changed(ifindex);
    }

    /// An address added or removed in the namespace (or a local route) may make a destination
    /// local or not: each is asked again when next used, at most once per `REFRESH` (a
    /// routing daemon may change routes many times a second, and each destination asked
    /// again costs a socket and a bind).
    fn addresses_changed(&mut self) {
        self.destinations_stale = true;
        self.inner.addresses_changed();
    }
}

/// Whether `addr` is one of the calling thread's network namespace's own addresses: a UDP
/// socket can be bound to it. An error other than "not here" counts as yes, so that frames of
/// a destination not known to be elsewhere keep going through AF_XDP.
pub fn is_local_ipv4(addr: Ipv4Addr) -> bool {
    let Some(socket) = crate::ethtool::any_socket() else {
        return true;
    };
    match bind_ipv4(&socket, addr) {
        Ok(()) => true,
        Err(e) => e.raw_os_error() != Some(libc::EADDRNOTAVAIL),
    }
}

/// Binds `socket` to `addr` and a port the kernel picks.
fn bind_ipv4(socket: &OwnedFd, addr: Ipv4Addr) -> io::Result<()> {
    let sa = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(addr.octets()),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: `sa` is a valid sockaddr_in for the duration of the call.
    let rc = unsafe {
        libc::bind(
            socket.as_raw_fd(),
            (&sa as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
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
    bind_ipv4(&socket, Ipv4Addr::UNSPECIFIED)?;
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
    let bytes = batch.bytes();
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
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
        let (at, seg) = batch.segment_at(index).unwrap();
        let payload = &batch.bytes()[at..at + seg];
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
        if !batch.for_socket {
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
        let mut b = Batcher::new(45_678, 9000);
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
        let mut b = Batcher::new(5000, 9000);
        let frames = [
            frame(1024, 1, 1, [10, 0, 0, 2]),
            frame(1024, 2, 1, [10, 0, 0, 2]),
            frame(1024, 3, 1, [10, 0, 0, 3]),
            // A shorter segment ends the batch it joins (the kernel cuts a send into
            // segments of one length and a shorter last one) ...
            frame(100, 4, 1, [10, 0, 0, 3]),
            frame(100, 5, 1, [10, 0, 0, 3]),
            // ... and a longer one starts another.
            frame(512, 6, 1, [10, 0, 0, 3]),
            frame(512, 7, 1, [10, 0, 0, 3]),
            frame(512, 8, 1, [10, 0, 0, 3]),
            frame(512, 9, 1, [10, 0, 0, 3]),
            frame(4, 10, 1, [10, 0, 0, 3]),
            // The shorter one as the segment that makes the batch long enough to be sent so.
            frame(256, 11, 1, [10, 0, 0, 3]),
            frame(256, 12, 1, [10, 0, 0, 3]),
            frame(256, 13, 1, [10, 0, 0, 3]),
            frame(8, 14, 1, [10, 0, 0, 3]),
        ];
        for f in &frames {
            assert!(b.add(f, &segment_of(f).unwrap()));
        }
        let mut seen = Vec::new();
        while let Some(batch) = b.oldest() {
            check_as_sent(batch, 5000);
            seen.push((
                batch.key.dst.octets()[3],
                batch.key.segment,
                batch.last,
                batch.segments,
            ));
            b.sent_oldest();
        }
        assert_eq!(
            seen,
            [
                (2, 1040, 1040, 2),
                (3, 1040, 116, 2),
                (3, 116, 116, 1),
                (3, 528, 20, 5),
                (3, 272, 24, 4)
            ]
        );
    }

    /// A pair (an answer and the shorter ACK behind it) made the socket's carries the ICRCs
    /// of the headers the kernel writes, once however often it is readied; a lone frame, or a
    /// pair part of which went through AF_XDP, stays as built.
    #[test]
    fn a_pair_for_the_socket_carries_the_icrcs_the_kernel_makes() {
        let mut b = Batcher::new(5000, 9000);
        let answer = frame(64, 0x1234, 0xc001, [10, 0, 0, 2]);
        let ack = frame(4, 0x1235, 0xc001, [10, 0, 0, 2]);
        for f in [&answer, &ack] {
            assert!(b.add(f, &segment_of(f).unwrap()));
        }
        assert!(!b.fits(&segment_of(&ack).unwrap(), ack.len() - HEADERS_LEN));
        b.pair_for_socket(false);
        b.pair_for_socket(false);
        let batch = b.oldest().unwrap();
        assert!(batch.for_socket);
        assert_eq!((batch.segments, batch.key.segment, batch.last), (2, 80, 20));
        assert_eq!(batch.bytes().len(), 100);
        let mut buf = [0u8; 256];
        assert_eq!(batch.write_built_frame(0, &mut buf), None);
        check_as_sent(batch, 5000);
        // Not as built any more: the kernel's identifications and port are in the ICRCs.
        let sent = as_sent(batch, 1, 5000);
        assert_eq!(&sent[28..sent.len() - 4], &ack[HEADERS_LEN..ack.len() - 4]);
        assert_ne!(&sent[sent.len() - 4..], &ack[ack.len() - 4..]);
        b.sent_oldest();

        let lone = frame(64, 1, 0xc001, [10, 0, 0, 2]);
        assert!(b.add(&lone, &segment_of(&lone).unwrap()));
        b.pair_for_socket(false);
        let batch = b.oldest().unwrap();
        assert!(!batch.for_socket, "one frame");
        check_as_sent(batch, 5000);
        b.sent_oldest();

        for f in [&answer, &ack] {
            assert!(b.add(f, &segment_of(f).unwrap()));
        }
        b.oldest().unwrap().sent_built = 1;
        b.pair_for_socket(false);
        let batch = b.oldest().unwrap();
        assert!(!batch.for_socket, "half sent through AF_XDP");
        assert_eq!(batch.write_built_frame(1, &mut buf), Some(ack.len()));
        assert_eq!(&buf[..ack.len()], &ack[..]);

        // Kept open (a round cut short), the open batch is left for the next round.
        let mut b = Batcher::new(5000, 9000);
        for f in [&answer, &answer] {
            assert!(b.add(f, &segment_of(f).unwrap()));
        }
        b.pair_for_socket(true);
        assert!(!b.open.as_ref().unwrap().for_socket);
        assert!(b.add(&answer, &segment_of(&answer).unwrap()));
        b.pair_for_socket(false);
        let batch = b.oldest().unwrap();
        assert_eq!(batch.segments, 3);
        check_as_sent(batch, 5000);
        assert!(batch.for_socket);
    }

    #[test]
    fn a_short_batch_goes_back_into_the_frames_the_engine_built() {
        let mut b = Batcher::new(5000, 9000);
        // Shorter than the three behind it, which start a batch of their own.
        let lone = frame(32, 77, 0xc001, [10, 0, 0, 2]);
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
    fn frames_built_at_the_batch_tail_make_the_batches_copying_makes() {
        // Runs broken by a longer frame, ended by a shorter one and broken by new destinations
        // (one for three frames only: a batch that stays short, two of its frames built at
        // its tail), more than a batch holds.
        let frames: Vec<Vec<u8>> = (0..200u16)
            .map(|i| {
                let payload = match i {
                    40 => 1000,
                    45 => 100,
                    _ => 512,
                };
                let dst = match i {
                    60..=62 => [10, 0, 0, 4],
                    0..=89 => [10, 0, 0, 2],
                    _ => [10, 0, 0, 3],
                };
                frame(payload, 1000 + i, 0xc000 + (i % 3), dst)
            })
            .collect();
        let mut vlan = frames[0].clone();
        vlan[12..14].copy_from_slice(&[0x81, 0x00]);
        let mut copied = Batcher::new(45_678, 9000);
        let mut built = Batcher::new(45_678, 9000);
        let mut elsewhere = vec![0u8; 9000];
        let (mut at_tail, mut moved) = (0, 0);
        for (i, f) in frames.iter().enumerate() {
            assert!(copied.add(f, &segment_of(f).unwrap()));
            if i % 7 == 3 {
                // A build that writes and then gives up leaves the batch as it was ...
                let none = built.build_at_tail(
                    &mut |buf| {
                        buf[..64].fill(0xee);
                        None
                    },
                    &mut elsewhere,
                );
                assert!(matches!(none, TailBuild::Nothing));
                // ... and so does a frame that is no batch's, which comes out whole.
                if built.open.is_some() {
                    let out = built.build_at_tail(
                        &mut |buf| {
                            buf[..vlan.len()].copy_from_slice(&vlan);
                            Some(vlan.len())
                        },
                        &mut elsewhere,
                    );
                    assert_eq!(out, TailBuild::Elsewhere(vlan.len()));
                    assert_eq!(&elsewhere[..vlan.len()], &vlan[..]);
                }
            }
            let out = built.build_at_tail(
                &mut |buf| {
                    buf[..f.len()].copy_from_slice(f);
                    Some(f.len())
                },
                &mut elsewhere,
            );
            match out {
                TailBuild::Added => at_tail += 1,
                TailBuild::Elsewhere(len) => {
                    assert_eq!(&elsewhere[..len], &f[..], "frame {i} moved whole");
                    let moved_frame = elsewhere[..len].to_vec();
                    assert!(built.add(&moved_frame, &segment_of(&moved_frame).unwrap()));
                    moved += 1;
                }
                TailBuild::Nothing => {
                    assert!(built.open.is_none());
                    assert!(built.add(f, &segment_of(f).unwrap()));
                }
            }
        }
        // Most frames were built in place; each change of batch moved one.
        assert!(at_tail > 185, "{at_tail} built in place");
        assert!(moved >= 6, "{moved} moved");
        let (mut batches, mut short) = (0, false);
        loop {
            let (a, b) = (copied.oldest(), built.oldest());
            let (Some(a), Some(b)) = (a, b) else {
                assert!(copied.oldest().is_none() && built.oldest().is_none());
                break;
            };
            assert_eq!((a.key, a.segments), (b.key, b.segments));
            assert_eq!(a.bytes(), b.bytes(), "batch {batches}");
            // A short batch goes back into the frames as built, headers and all.
            let (mut fa, mut fb) = ([0u8; 9000], [0u8; 9000]);
            for i in 0..a.segments {
                assert_eq!(
                    a.write_built_frame(i, &mut fa).map(|l| fa[..l].to_vec()),
                    b.write_built_frame(i, &mut fb).map(|l| fb[..l].to_vec()),
                    "batch {batches}, frame {i}"
                );
            }
            short |= b.segments > 1 && b.segments < MIN_BATCH;
            check_as_sent(b, 45_678);
            copied.sent_oldest();
            built.sent_oldest();
            batches += 1;
        }
        assert!(batches >= 5, "{batches} batches");
        assert!(short, "no short batch of several frames");
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
    fn local_addresses_are_told_from_others() {
        assert!(is_local_ipv4(Ipv4Addr::LOCALHOST));
        assert!(is_local_ipv4(Ipv4Addr::new(127, 0, 0, 2)));
        // TEST-NET-1, documentation only: no host has it (the check sends nothing).
        assert!(!is_local_ipv4(Ipv4Addr::new(192, 0, 2, 1)));
    }

    #[test]
    fn auto_batches_on_no_loopback_and_no_missing_interface() {
        assert_eq!(auto_batching("lo"), AutoBatching::Off);
        assert_eq!(auto_batching("xroce-no-such"), AutoBatching::Off);
    }

    #[test]
    fn the_transmit_path_is_named_as_xroce_transmit_takes_it() {
        assert_eq!("udp-gso".parse(), Ok(Transmit::UdpGso));
        assert_eq!("".parse(), Ok(Transmit::Auto));
        assert_eq!("auto".parse(), Ok(Transmit::Auto));
        assert_eq!(" AF-XDP ".parse(), Ok(Transmit::AfXdp));
        assert!("gso".parse::<Transmit>().unwrap_err().contains("udp-gso"));
    }

    /// A port batching through a socket on lo (interface 1) over a port that takes nothing, or
    /// `None` (said) without the privilege to bind the socket.
    fn port_on_lo(is_local: LocalCheck) -> Option<UdpGsoPort<crate::port::ClosedPort>> {
        port_on_lo_over(crate::port::ClosedPort, true, is_local)
    }

    /// [`port_on_lo`] over `inner`, batching pairs too unless `while_segmented_in_software`
    /// (as on a veth).
    fn port_on_lo_over<P: Port>(
        inner: P,
        while_segmented_in_software: bool,
        is_local: LocalCheck,
    ) -> Option<UdpGsoPort<P>> {
        // The socket is bound to its interface, which takes CAP_NET_RAW.
        let socket = match GsoSocket::open("lo") {
            Ok(s) => s,
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
                eprintln!("skipped: binding a socket to an interface needs CAP_NET_RAW");
                return None;
            }
            Err(e) => panic!("a UDP socket on lo: {e}"),
        };
        Some(
            UdpGsoPort::new(
                inner,
                socket,
                "lo",
                1,
                9000,
                while_segmented_in_software,
                is_local,
            )
            .with_pairs(!while_segmented_in_software),
        )
    }

    /// An AF_XDP port's stand-in that counts the frames put in its ring.
    struct CountingPort(Arc<AtomicU64>);

    impl Port for CountingPort {
        fn recv(&mut self, _max: usize, _deliver: &mut dyn FnMut(&[u8])) -> usize {
            0
        }

        fn send(&mut self, _frame: &[u8]) -> bool {
            self.0.fetch_add(1, Ordering::Relaxed);
            true
        }

        fn send_with(&mut self, build: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> bool {
            let mut buf = [0u8; 9000];
            if build(&mut buf).is_some() {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
            true
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }

        fn tx_pending(&self) -> bool {
            false
        }

        fn wait_fd(&self) -> Option<RawFd> {
            None
        }
    }

    /// Where each frame costs a notification (virtio-net), a ping-pong's answer and the
    /// shorter ACK behind it go through the socket as one batch from the round after the
    /// first such pair on; built the other way round (the ACK first) they go through AF_XDP,
    /// and batching stops until a pair comes again. On a veth a pair stays in AF_XDP.
    #[test]
    fn an_answer_and_its_ack_leave_as_one_batch_where_frames_cost_a_notification_each() {
        let local = |payload: usize, ident: u16| {
            let mut f = frame(payload, ident, 1234, [127, 0, 0, 1]);
            f[ETHERNET_LEN + 12..ETHERNET_LEN + 16].copy_from_slice(&[127, 0, 0, 1]);
            icrc::fill(&mut f[ETHERNET_LEN..]).unwrap();
            f
        };
        let (answer, ack) = (local(64, 1), local(4, 2));
        let ring = Arc::new(AtomicU64::new(0));
        let Some(mut port) =
            port_on_lo_over(CountingPort(ring.clone()), false, Box::new(|_| false))
        else {
            return;
        };
        let batched = port.frames_batched();
        let round = |port: &mut UdpGsoPort<CountingPort>, frames: [&Vec<u8>; 2]| {
            for f in frames {
                assert!(port.send(f));
            }
            port.flush().unwrap();
            (
                ring.load(Ordering::Relaxed),
                batched.load(Ordering::Relaxed),
            )
        };
        assert_eq!(round(&mut port, [&answer, &ack]), (2, 0), "the first pair");
        assert!(port.batching);
        assert_eq!(round(&mut port, [&answer, &ack]), (2, 2), "one batch");
        assert_eq!(round(&mut port, [&answer, &ack]), (2, 4), "one batch");
        assert_eq!(round(&mut port, [&ack, &answer]), (4, 4), "the ACK first");
        assert!(!port.batching);
        assert_eq!(round(&mut port, [&ack, &answer]), (6, 4));
        assert!(!port.batching);
        assert_eq!(round(&mut port, [&answer, &ack]), (8, 4));
        assert_eq!(round(&mut port, [&answer, &ack]), (8, 6), "batching again");
        assert!(!port.tx_pending());

        let ring = Arc::new(AtomicU64::new(0));
        let Some(mut port) = port_on_lo_over(CountingPort(ring.clone()), true, Box::new(|_| false))
        else {
            return;
        };
        port.segmented_in_software = Some(true);
        let batched = port.frames_batched();
        for _ in 0..3 {
            for f in [&answer, &ack] {
                assert!(port.send(f));
            }
            port.flush().unwrap();
        }
        assert_eq!(
            (
                ring.load(Ordering::Relaxed),
                batched.load(Ordering::Relaxed)
            ),
            (6, 0),
            "a veth's pairs"
        );
        assert!(!port.batching);
        // Nor does a message of three packets and its ACK start batching there: a run is of
        // frames of one length.
        for f in [&answer, &answer, &answer, &ack] {
            assert!(port.send(f));
        }
        port.flush().unwrap();
        assert!(!port.batching, "three and a shorter one");
        for f in [&answer, &answer, &answer, &answer] {
            assert!(port.send(f));
        }
        port.flush().unwrap();
        assert!(port.batching, "four of one length");
    }

    /// A round cut by its limits leaves its open batch open for the next round's frames, and
    /// the round's flush after that sends it, or `send_kept` when the engine holds that round
    /// back; a full batch, or a round not cut, goes at once.
    #[test]
    fn a_run_cut_where_the_round_was_stays_in_one_batch() {
        let Some(mut port) = port_on_lo(Box::new(|_| false)) else {
            return;
        };
        // Batching as on a link that segments in software; the batches go to lo's own
        // address, where nothing listens.
        port.segmented_in_software = Some(true);
        port.batching = true;
        let sent = port.frames_batched();
        let local = |ident: u16| {
            let mut f = frame(1024, ident, 1234, [127, 0, 0, 1]);
            f[ETHERNET_LEN + 12..ETHERNET_LEN + 16].copy_from_slice(&[127, 0, 0, 1]);
            icrc::fill(&mut f[ETHERNET_LEN..]).unwrap();
            f
        };
        let open = |port: &UdpGsoPort<crate::port::ClosedPort>| {
            port.batcher.open.as_ref().map_or(0, |b| b.segments)
        };
        for i in 0..10 {
            assert!(port.send(&local(i)));
        }
        port.flush_before_more().unwrap();
        assert_eq!(
            (open(&port), sent.load(Ordering::Relaxed)),
            (10, 0),
            "kept open"
        );
        assert!(port.tx_pending(), "the engine must not sleep on it");
        for i in 10..12 {
            assert!(port.send(&local(i)));
        }
        port.flush().unwrap();
        assert!(port.batching, "the rounds sent a batch");
        assert_eq!(
            (open(&port), sent.load(Ordering::Relaxed)),
            (0, 12),
            "one batch"
        );
        assert!(!port.tx_pending());

        // A batch kept open goes when the engine holds its next round back.
        for i in 0..5 {
            assert!(port.send(&local(i)));
        }
        port.send_kept().unwrap();
        assert_eq!(open(&port), 5, "nothing was kept");
        port.flush_before_more().unwrap();
        port.send_kept().unwrap();
        assert_eq!(
            (open(&port), sent.load(Ordering::Relaxed)),
            (0, 17),
            "sent when kept"
        );

        // A batch with no room for another segment goes, cut round or not.
        let full = MAX_BATCH_BYTES / (1024 + 12 + ICRC_LEN);
        for i in 0..full {
            assert!(port.send(&local(i as u16)));
        }
        port.flush_before_more().unwrap();
        assert_eq!(
            (open(&port), sent.load(Ordering::Relaxed)),
            (0, 17 + full as u64)
        );
    }

    /// What the kernel says of the port's interface and addresses is asked again after a
    /// notification of a change, and not before: the offload (read under the RTNL lock, maybe
    /// from an application's thread) and whether a destination is local.
    #[test]
    fn the_port_asks_again_after_a_change_is_notified() {
        let asked = Arc::new(AtomicU64::new(0));
        let local = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let is_local: LocalCheck = {
            let (asked, local) = (asked.clone(), local.clone());
            Box::new(move |_| {
                asked.fetch_add(1, Ordering::Relaxed);
                local.load(Ordering::Relaxed)
            })
        };
        let Some(mut port) = port_on_lo(is_local) else {
            return;
        };
        // lo offloads UDP segmentation: batches would not wait on it there.
        assert!(!port.may_batch(), "read when the port opens");

        // A stale reading stays until a notification for this interface (lo is 1).
        port.segmented_in_software = Some(true);
        assert!(port.may_batch());
        port.addresses_changed();
        port.link_changed(Some(2));
        assert!(
            port.may_batch(),
            "an address change or another interface's leaves the offload alone"
        );
        port.link_changed(Some(1));
        assert!(!port.may_batch(), "read again after its link changed");
        port.segmented_in_software = Some(true);
        port.link_changed(None);
        assert!(!port.may_batch(), "and after notifications were lost");

        let dst = Ipv4Addr::new(192, 0, 2, 7);
        assert!(port.reachable_by_socket(dst));
        local.store(true, Ordering::Relaxed);
        assert!(port.reachable_by_socket(dst), "the answer is kept");
        port.link_changed(Some(1));
        assert!(port.reachable_by_socket(dst), "a link change leaves it");
        assert_eq!(asked.load(Ordering::Relaxed), 1);
        // At most once per REFRESH: the answers were last cleared when the port opened.
        port.addresses_changed();
        assert!(
            port.reachable_by_socket(dst),
            "too soon after the last clearing"
        );
        assert_eq!(asked.load(Ordering::Relaxed), 1);
        port.destinations_cleared = Instant::now().checked_sub(REFRESH).expect("uptime");
        assert!(
            !port.reachable_by_socket(dst),
            "asked again after an address change"
        );
        assert_eq!(asked.load(Ordering::Relaxed), 2);
    }
}
