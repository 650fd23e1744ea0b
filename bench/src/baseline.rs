//! The baselines xroce is measured against, on the same veth pair in the same run: raw AF_XDP
//! (xroce's own socket code moving bare UDP frames, the ceiling for any stack on this path),
//! kernel UDP and kernel TCP sockets doing the same exchanges.
//!
//! Every function runs the far end in namespace 1 and the near end in namespace 0 of a
//! [`NetnsPair`] whose interfaces carry xroce's XDP program (the raw AF_XDP ends register
//! their sockets in its map, as xroce's engine does). Needs root.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use xroce_datapath::afxdp::{XskConfig, XskSocket};
use xroce_datapath::netlink;
use xroce_datapath::netns::NetnsPair;
use xroce_datapath::udp_gso::GsoSocket;
use xroce_datapath::xdp;

use xroce_core::icrc::crc32_in_use;

use crate::cpu::CpuTime;

/// Round-trip times of a ping-pong, in µs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoundTrip {
    pub p50: f64,
    pub p99: f64,
}

impl RoundTrip {
    /// From samples in µs (sorted here).
    pub fn from_samples(mut v: Vec<f64>) -> RoundTrip {
        if v.is_empty() {
            return RoundTrip {
                p50: f64::NAN,
                p99: f64::NAN,
            };
        }
        v.sort_by(|a, b| a.total_cmp(b));
        let p = |q: f64| v[((v.len() as f64 - 1.0) * q) as usize];
        RoundTrip {
            p50: p(0.5),
            p99: p(0.99),
        }
    }
}

/// What a one-way stream delivered.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stream {
    /// Payload bytes received per second, in 10^6.
    pub mb_per_s: f64,
    /// Messages (datagrams, frames, writes) received per second, in millions.
    pub mpps: f64,
    /// CPU the sending thread used while it sent.
    pub sender_cpu: CpuTime,
    /// CPU both ends used (every thread of this process, the kernel's work in their system
    /// calls included), from the receiver's start until it stopped: the stream, plus a busy
    /// receiver's spinning for a moment before and 50 ms after.
    pub both_ends_cpu: CpuTime,
    /// Payload delivered, Gbit.
    pub delivered_gbit: f64,
    /// Frames the receiver found damaged (a checksum that did not match), not counted as
    /// delivered; none on a working path.
    pub damaged: u64,
}

impl Stream {
    /// Cores used per Gbit/s delivered (CPU seconds per Gbit), both ends.
    pub fn cores_per_gbit_s(&self) -> f64 {
        self.both_ends_cpu.total_s() / self.delivered_gbit
    }
}

/// UDP port the socket baselines use (not 4791: the kernel's own stack carries them).
const UDP_PORT: u16 = 7001;
const TCP_PORT: u16 = 7003;

// ---------------------------------------------------------------- kernel UDP

/// The largest piece of a message one frame or datagram of the baselines carries: a 4096 path
/// MTU's payload. A larger message goes as several, as RoCE segments it (and as a 64 KiB
/// message must over UDP, whose datagrams end below 64 KiB).
pub const MAX_PIECE: usize = 4096;

/// `payload`'s pieces of at most [`MAX_PIECE`] bytes, in order.
fn pieces(payload: usize) -> Vec<usize> {
    let mut v = vec![MAX_PIECE; payload / MAX_PIECE];
    if !payload.is_multiple_of(MAX_PIECE) || payload == 0 {
        v.push(payload % MAX_PIECE);
    }
    v
}

/// `count` round trips of `payload`-byte messages (datagrams of at most [`MAX_PIECE`] bytes,
/// each echoed on arrival) to a socket in namespace 1; blocking receives on both ends, as an
/// application would. A round trip ends when every datagram of the message came back.
pub fn udp_pingpong(pair: &NetnsPair, payload: usize, count: usize) -> RoundTrip {
    let (a, b) = (pair.ipv4(0), pair.ipv4(1));
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let (ready_tx, ready_rx) = mpsc::channel();
    let echo = pair.spawn_in(1, move || {
        let s = UdpSocket::bind((b, UDP_PORT)).expect("bind");
        s.set_read_timeout(Some(Duration::from_millis(100))).ok();
        ready_tx.send(()).ok();
        let mut buf = vec![0u8; 65536];
        while !stop2.load(Ordering::Relaxed) {
            if let Ok((n, from)) = s.recv_from(&mut buf) {
                let _ = s.send_to(&buf[..n], from);
            }
        }
    });
    ready_rx.recv().ok();
    let rtts = pair.run_in(0, move || {
        let s = UdpSocket::bind((a, 0)).expect("bind");
        s.connect((b, UDP_PORT)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(1))).ok();
        let datagrams = pieces(payload);
        let msg = vec![7u8; MAX_PIECE];
        let mut buf = vec![0u8; 65536];
        let mut rtts = Vec::with_capacity(count);
        'turns: for _ in 0..count {
            let t = Instant::now();
            for &len in &datagrams {
                s.send(&msg[..len]).expect("send");
            }
            for _ in &datagrams {
                if s.recv(&mut buf).is_err() {
                    // A lost datagram: no sample. Stragglers of this turn are dropped.
                    s.set_read_timeout(Some(Duration::from_millis(10))).ok();
                    while s.recv(&mut buf).is_ok() {}
                    s.set_read_timeout(Some(Duration::from_secs(1))).ok();
                    continue 'turns;
                }
            }
            rtts.push(t.elapsed().as_secs_f64() * 1e6);
        }
        rtts
    });
    stop.store(true, Ordering::Relaxed);
    echo.join().expect("echo");
    RoundTrip::from_samples(rtts)
}

/// `payload`-byte datagrams sent as fast as the socket takes them for `duration`.
pub fn udp_stream(pair: &NetnsPair, payload: usize, duration: Duration) -> Stream {
    let (a, b) = (pair.ipv4(0), pair.ipv4(1));
    let sink = Counter::new();
    let (ready_tx, ready_rx) = mpsc::channel();
    let counter = sink.clone();
    let receiver = pair.spawn_in(1, move || {
        let s = UdpSocket::bind((b, UDP_PORT + 1)).expect("bind");
        s.set_read_timeout(Some(Duration::from_millis(100))).ok();
        ready_tx.send(()).ok();
        let mut buf = vec![0u8; 65536];
        while !counter.stopped() {
            if let Ok(n) = s.recv(&mut buf) {
                counter.add(n);
            }
        }
    });
    ready_rx.recv().ok();
    let (elapsed, cpu) = pair.run_in(0, move || {
        let s = UdpSocket::bind((a, 0)).expect("bind");
        s.connect((b, UDP_PORT + 1)).expect("connect");
        let msg = vec![1u8; payload];
        let t = Instant::now();
        let cpu = CpuTime::thread();
        while t.elapsed() < duration {
            for _ in 0..64 {
                let _ = s.send(&msg);
            }
        }
        (t.elapsed(), CpuTime::thread().minus(cpu))
    });
    sink.finish(receiver, elapsed, cpu)
}

// ---------------------------------------------------------------- kernel TCP

/// `count` round trips of `payload` bytes over one TCP connection (TCP_NODELAY).
pub fn tcp_pingpong(pair: &NetnsPair, payload: usize, count: usize) -> RoundTrip {
    let (a, b) = (pair.ipv4(0), pair.ipv4(1));
    let (ready_tx, ready_rx) = mpsc::channel();
    let echo = pair.spawn_in(1, move || {
        let l = TcpListener::bind((b, TCP_PORT)).expect("listen");
        ready_tx.send(()).ok();
        let (mut s, _) = l.accept().expect("accept");
        s.set_nodelay(true).ok();
        let mut buf = vec![0u8; payload];
        while s.read_exact(&mut buf).is_ok() {
            if s.write_all(&buf).is_err() {
                break;
            }
        }
    });
    ready_rx.recv().ok();
    let rtts = pair.run_in(0, move || {
        let _ = a;
        let mut s = TcpStream::connect((b, TCP_PORT)).expect("connect");
        s.set_nodelay(true).ok();
        let msg = vec![7u8; payload];
        let mut buf = vec![0u8; payload];
        let mut rtts = Vec::with_capacity(count);
        for _ in 0..count {
            let t = Instant::now();
            s.write_all(&msg).expect("send");
            s.read_exact(&mut buf).expect("echo");
            rtts.push(t.elapsed().as_secs_f64() * 1e6);
        }
        rtts
    });
    echo.join().expect("echo");
    RoundTrip::from_samples(rtts)
}

/// `write_size`-byte writes into one TCP connection for `duration`; `mpps` counts writes'
/// worth of bytes received.
pub fn tcp_stream(pair: &NetnsPair, write_size: usize, duration: Duration) -> Stream {
    let b = pair.ipv4(1);
    let sink = Counter::new();
    let (ready_tx, ready_rx) = mpsc::channel();
    let counter = sink.clone();
    let receiver = pair.spawn_in(1, move || {
        let l = TcpListener::bind((b, TCP_PORT + 1)).expect("listen");
        ready_tx.send(()).ok();
        let (mut s, _) = l.accept().expect("accept");
        let mut buf = vec![0u8; 1 << 20];
        while let Ok(n) = s.read(&mut buf) {
            if n == 0 {
                break;
            }
            counter.add(n);
        }
    });
    ready_rx.recv().ok();
    let (elapsed, cpu) = pair.run_in(0, move || {
        let mut s = TcpStream::connect((b, TCP_PORT + 1)).expect("connect");
        let msg = vec![1u8; write_size];
        let t = Instant::now();
        let cpu = CpuTime::thread();
        while t.elapsed() < duration {
            if s.write_all(&msg).is_err() {
                break;
            }
        }
        (t.elapsed(), CpuTime::thread().minus(cpu))
    });
    let mut st = sink.finish(receiver, elapsed, cpu);
    st.mpps = st.mb_per_s / write_size as f64;
    st
}

// ---------------------------------------------------------------- raw AF_XDP

/// Ethernet + IPv4 + UDP to port 4791 (so the XDP program redirects it) around `payload` bytes.
pub fn udp_frame(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: Ipv4Addr,
    dst: Ipv4Addr,
    payload: usize,
) -> Vec<u8> {
    let mut f = vec![0u8; 14 + 20 + 8 + payload];
    f[0..6].copy_from_slice(&dst_mac);
    f[6..12].copy_from_slice(&src_mac);
    f[12..14].copy_from_slice(&[0x08, 0x00]);
    let ip_len = (20 + 8 + payload) as u16;
    let ip = &mut f[14..34];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&ip_len.to_be_bytes());
    ip[6] = 0x40;
    ip[8] = 64;
    ip[9] = 17;
    ip[12..16].copy_from_slice(&src.octets());
    ip[16..20].copy_from_slice(&dst.octets());
    let mut sum = 0u32;
    for c in ip.chunks(2) {
        sum += u32::from(u16::from_be_bytes([c[0], c[1]]));
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    ip[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    let udp = &mut f[34..42];
    udp[0..2].copy_from_slice(&4791u16.to_be_bytes());
    udp[2..4].copy_from_slice(&4791u16.to_be_bytes());
    udp[4..6].copy_from_slice(&((8 + payload) as u16).to_be_bytes());
    f
}

/// One end of a raw AF_XDP exchange: a socket on queue 0, registered in the XDP program's map.
struct RawEnd {
    sock: XskSocket,
    _map: xdp::XsksMap,
    mac: [u8; 6],
    peer_mac: [u8; 6],
}

fn raw_end(iface: &str, peer: Ipv4Addr, reads_frames: bool) -> RawEnd {
    try_raw_end(iface, peer, reads_frames)
        .unwrap_or_else(|e| panic!("raw AF_XDP end on {iface}: {e}"))
}

/// The socket evicts the lines of the frames it received, as xroce's do, unless the end never
/// reads its frames (`reads_frames` false: a counting receiver, the path's ceiling), where
/// eviction could only slow it.
fn try_raw_end(iface: &str, peer: Ipv4Addr, reads_frames: bool) -> Result<RawEnd, String> {
    let i = netlink::interface_by_name(iface).map_err(|e| format!("interface: {e}"))?;
    let peer_mac = netlink::resolve(i.index, peer.into(), None, Duration::from_secs(3))
        .map_err(|e| format!("MAC of {peer}: {e}"))?;
    let config = XskConfig {
        leave_received_lines: !reads_frames,
        ..XskConfig::default()
    };
    let sock = XskSocket::open_when_free(i.index, config, Duration::from_secs(1))
        .map_err(|e| format!("AF_XDP socket: {e}"))?;
    let mut map = xdp::XsksMap::open(iface)
        .map_err(|e| format!("the XDP program's socket map (is xroce's program loaded?): {e}"))?;
    map.set(0, sock.as_raw_fd())
        .map_err(|e| format!("registering the socket: {e}"))?;
    Ok(RawEnd {
        sock,
        _map: map,
        mac: i.mac,
        peer_mac,
    })
}

/// `count` round trips of frames with `payload` bytes of UDP payload, both ends busy-polling
/// their rings.
pub fn xsk_pingpong(pair: &NetnsPair, payload: usize, count: usize) -> RoundTrip {
    xsk_pingpong_turns(pair, payload, count, 1)
}

/// Payload of the second frame of an RC turn: BTH, AETH and ICRC, the size of an ACK.
const ACK_PAYLOAD: usize = 12 + 4 + 4;

/// Like [`xsk_pingpong`], but each turn is `frames` frames in one kick of the kernel: the
/// message, then `frames - 1` ACK-sized frames, and the other end answers once it has them
/// all. Two frames per turn is what an RC ping-pong needs (the answer, and the ACK of the
/// message it answers, which `ib_send_lat` waits for as its send completion): the floor of
/// RC on this path, where UD's is one frame.
pub fn xsk_pingpong_turns(
    pair: &NetnsPair,
    payload: usize,
    count: usize,
    frames: usize,
) -> RoundTrip {
    raw_pingpong(pair, PingTurn::waiting(payload, frames), count)
}

/// Like [`xsk_pingpong_turns`] with RC's two frames per turn, each made and checked as any
/// RoCE stack must at the least: its sender numbers it (as a PSN would) and computes a CRC-32
/// over it (the ICRC's work) as it sends it, and its receiver reads it whole to compute the
/// CRC-32 again and compare. No protocol besides: the floor of any RC stack on this path.
pub fn xsk_pingpong_checked(pair: &NetnsPair, payload: usize, count: usize) -> RoundTrip {
    let turn = PingTurn {
        checked: true,
        ..PingTurn::waiting(payload, 2)
    };
    raw_pingpong(pair, turn, count)
}

/// Like [`xsk_pingpong_turns`] with two frames per turn, but each end answers as soon as the
/// message is in and takes the ACK-sized frame behind it whenever it comes: the floor of an
/// RC ping-pong whose ends wait for nothing but the answer (the ACK still crosses the path
/// and costs both ends' CPUs, but no turn waits for it).
pub fn xsk_pingpong_trailing_ack(pair: &NetnsPair, payload: usize, count: usize) -> RoundTrip {
    let turn = PingTurn {
        trailing_acks: true,
        ..PingTurn::waiting(payload, 2)
    };
    raw_pingpong(pair, turn, count)
}

fn raw_pingpong(pair: &NetnsPair, turn: PingTurn, count: usize) -> RoundTrip {
    let (a, b) = (pair.ipv4(0), pair.ipv4(1));
    let (ib, ia) = (pair.iface(1).to_string(), pair.iface(0).to_string());
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let (ready_tx, ready_rx) = mpsc::channel();
    let echo = pair.spawn_in(1, move || {
        let ready = || {
            ready_tx.send(()).ok();
        };
        xsk_echo(&ib, b, a, turn, &stop2, None, ready)
            .unwrap_or_else(|e| panic!("raw AF_XDP echo: {e}"));
    });
    ready_rx.recv().ok();
    let rtts = pair.run_in(0, move || {
        xsk_ping(&ia, a, b, turn, count).unwrap_or_else(|e| panic!("raw AF_XDP ping: {e}"))
    });
    stop.store(true, Ordering::Relaxed);
    echo.join().expect("echo");
    RoundTrip::from_samples(rtts)
}

/// What one turn of a raw ping-pong sends: the message (`payload` bytes of UDP payload, in
/// frames of at most [`MAX_PIECE`] bytes), then `frames - 1` ACK-sized frames, all in one
/// kick. (`frames` counts a message of one frame: 2 is RC's answer and ACK.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PingTurn {
    pub payload: usize,
    pub frames: usize,
    /// The other end answers once the message is in, without waiting for the ACK-sized
    /// frames behind it (taken as they come). Told apart by their length, so the message's
    /// frames must differ from it.
    pub trailing_acks: bool,
    /// Each frame is numbered and given a CRC-32 by its sender as it sends it, and read and
    /// checked by its receiver; a frame that fails the check is dropped, as a RoCE receiver
    /// drops one whose ICRC fails (see [`xsk_pingpong_checked`]).
    pub checked: bool,
    /// The turn leaves as one send on a kernel UDP socket, the ACK-sized frame as the shorter
    /// last segment of a UDP GSO batch behind the message: one notification of a virtio-net
    /// device per turn, where AF_XDP's copy mode notifies it for every frame. (The kernel
    /// writes the headers, so a checked frame's CRC-32 covers its UDP payload.) Receiving
    /// stays AF_XDP's. At most two frames, the message in one.
    pub batched: bool,
}

impl PingTurn {
    /// `frames` frames per turn, bare, the other end waiting for all of them.
    pub fn waiting(payload: usize, frames: usize) -> Self {
        PingTurn {
            payload,
            frames,
            trailing_acks: false,
            checked: false,
            batched: false,
        }
    }
}

/// Bytes of UDP payload a checked frame needs: its number and its CRC-32.
const CHECKED_MIN_PAYLOAD: usize = 4 + 4;

/// Ready-made frames of a turn, from `own` to `peer`.
struct TurnFrames {
    message: Vec<Vec<u8>>,
    ack: Vec<u8>,
    acks: usize,
    trailing_acks: bool,
    checked: bool,
    /// Where a checked frame's CRC-32 starts: the frame's start, or its UDP payload's when
    /// the kernel writes the headers (a batched turn).
    crc_from: usize,
    /// The socket a batched turn leaves through (see [`PingTurn::batched`]), and the buffer
    /// its batch is put together in (kept: an allocation per turn is no part of a floor).
    udp: Option<UdpSocket>,
    batch: Vec<u8>,
    /// The number the next checked frame carries.
    sequence: u32,
}

impl TurnFrames {
    fn new(
        end: &RawEnd,
        iface: &str,
        own: Ipv4Addr,
        peer: Ipv4Addr,
        turn: PingTurn,
    ) -> Result<Self, String> {
        let mut frames = Self::from_frames(
            pieces(turn.payload)
                .into_iter()
                .map(|len| udp_frame(end.mac, end.peer_mac, own, peer, len))
                .collect(),
            udp_frame(end.mac, end.peer_mac, own, peer, ACK_PAYLOAD),
            turn,
        )?;
        if turn.batched {
            frames.udp = Some(gso_socket(iface, peer, turn.payload)?);
        }
        Ok(frames)
    }

    fn from_frames(message: Vec<Vec<u8>>, ack: Vec<u8>, turn: PingTurn) -> Result<Self, String> {
        if turn.trailing_acks && message.iter().any(|m| m.len() == ack.len()) {
            return Err(format!(
                "a message of {} bytes has frames as long as an ACK's: trailing ACKs would \
                 count as the message",
                turn.payload
            ));
        }
        if turn.checked && turn.payload < CHECKED_MIN_PAYLOAD {
            return Err(format!(
                "a checked turn needs at least {CHECKED_MIN_PAYLOAD} bytes of payload, for \
                 each frame's number and CRC-32, not {}",
                turn.payload
            ));
        }
        if turn.batched && (message.len() != 1 || turn.frames > 2 || turn.payload < ACK_PAYLOAD) {
            return Err(format!(
                "a batched turn is a message of one frame, at least as long as an ACK's, and at \
                 most one ACK-sized frame behind it, not {} bytes in {} frames",
                turn.payload, turn.frames
            ));
        }
        Ok(TurnFrames {
            message,
            ack,
            acks: turn.frames.max(1) - 1,
            trailing_acks: turn.trailing_acks,
            checked: turn.checked,
            crc_from: if turn.batched { UDP_HEADERS } else { 0 },
            udp: None,
            batch: Vec::new(),
            sequence: 0,
        })
    }

    /// Frames in a turn.
    fn frames(&self) -> usize {
        self.message.len() + self.acks
    }

    /// Frames of a turn the other end waits for before it answers.
    fn awaited(&self) -> usize {
        if self.trailing_acks {
            self.message.len()
        } else {
            self.frames()
        }
    }

    /// Whether a received frame is one of those [`Self::awaited`] counts (for a checked turn,
    /// only if it passes its check).
    fn awaits(&self, frame: &[u8]) -> bool {
        (!self.checked || check_passes(frame, self.crc_from))
            && (!self.trailing_acks || frame.len() != self.ack.len())
    }

    fn send(&mut self, end: &mut RawEnd) -> Result<(), String> {
        let frames = self.frames();
        self.batch.clear();
        for i in 0..frames {
            let frame = match self.message.get_mut(i) {
                Some(f) => f,
                None => &mut self.ack,
            };
            if self.checked {
                self.sequence = self.sequence.wrapping_add(1);
                seal(frame, self.crc_from, self.sequence);
            }
            if self.udp.is_some() {
                self.batch.extend_from_slice(&frame[UDP_HEADERS..]);
                continue;
            }
            while !end.sock.send(frame) {
                let _ = end.sock.flush();
            }
        }
        match &self.udp {
            Some(udp) => send_batch(udp, &self.batch),
            None => {
                let _ = end.sock.flush();
                Ok(())
            }
        }
    }
}

/// Numbers a checked frame (at the start of its UDP payload) and puts a CRC-32 over the rest
/// of it from `crc_from` on (the frame's start, or its UDP payload's when the kernel writes
/// the headers) in its last 4 bytes, as a RoCE sender writes a PSN and an ICRC. The CRC-32 is
/// hashed in the code xroce's engine picks on this CPU (carry-less multiplication, or tables
/// under QEMU's TCG, which emulates that slowly): the floor pays what xroce pays.
fn seal(frame: &mut [u8], crc_from: usize, sequence: u32) {
    frame[UDP_HEADERS..UDP_HEADERS + 4].copy_from_slice(&sequence.to_be_bytes());
    let body = frame.len() - 4;
    let crc = crc32_in_use(&frame[crc_from..body]);
    frame[body..].copy_from_slice(&crc.to_le_bytes());
}

/// A UDP socket on `iface` sending to `peer`'s RoCEv2 port, each send cut into datagrams of
/// `segment` bytes (UDP GSO), the last one shorter if the send ends so.
fn gso_socket(iface: &str, peer: Ipv4Addr, segment: usize) -> Result<UdpSocket, String> {
    let s: UdpSocket = GsoSocket::open(iface)
        .map_err(|e| format!("a UDP socket on {iface}: {e}"))?
        .into();
    s.set_nonblocking(false)
        .map_err(|e| format!("a blocking UDP socket: {e}"))?;
    s.connect((peer, 4791))
        .map_err(|e| format!("connecting a UDP socket to {peer}: {e}"))?;
    let segment = libc::c_int::try_from(segment).map_err(|_| format!("segment {segment}"))?;
    // SAFETY: `s` is open; the option value is a c_int that lives for the call, its size
    // passed with it.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_UDP,
            libc::UDP_SEGMENT,
            (&segment as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(format!("UDP_SEGMENT: {}", std::io::Error::last_os_error()));
    }
    Ok(s)
}

/// Sends a batch on a [`gso_socket`]. A full qdisc is waited out; a refusal (datagrams that
/// came before the receiver's socket was in the XDP program's map went to the kernel, which
/// answered that no one listens) drops the batch, as a lost frame.
fn send_batch(s: &UdpSocket, batch: &[u8]) -> Result<(), String> {
    loop {
        match s.send(batch) {
            Ok(_) => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => std::thread::yield_now(),
            Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => return Ok(()),
            Err(e) => return Err(format!("sending a batch: {e}")),
        }
    }
}

/// Whether a received frame's last 4 bytes are the CRC-32 of the rest from `crc_from` on
/// (see [`seal`]).
fn check_passes(frame: &[u8], crc_from: usize) -> bool {
    let Some(body) = frame.len().checked_sub(4).filter(|b| *b >= crc_from) else {
        return false;
    };
    frame[body..] == crc32_in_use(&frame[crc_from..body]).to_le_bytes()
}

/// A pause within a turn's frames that means the rest were lost: far longer than a turn
/// takes to arrive (microseconds here, a few milliseconds under emulation), far shorter than
/// the second [`xsk_ping`] waits before it gives a turn up.
const TURN_GAP: Duration = Duration::from_millis(100);

/// Turns lost in a row after which [`xsk_ping`] stops: the path does not carry its frames
/// (a frame larger than the socket sends, say), and waiting a second for each would take
/// hours.
const LOST_IN_A_ROW: usize = 10;

/// When [`xsk_echo`] gives up on its own (besides its stop flag).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EchoLimits {
    /// No frame came this long after the last one.
    pub quiet: Duration,
    /// No frame came at all this long after the start (an error).
    pub wait: Duration,
}

/// The answering end of a raw ping-pong on its own: busy-polls `iface` and answers every
/// turn's worth of frames (or, with `turn.trailing_acks`, every message, whatever ACK-sized
/// frames come behind it) with a turn of its own to `peer`, until `stop` is set or `limits`
/// say so. `ready` runs once the socket takes frames. Returns how many turns it answered.
/// Needs xroce's XDP program on `iface`.
pub fn xsk_echo(
    iface: &str,
    own: Ipv4Addr,
    peer: Ipv4Addr,
    turn: PingTurn,
    stop: &AtomicBool,
    limits: Option<EchoLimits>,
    ready: impl FnOnce(),
) -> Result<u64, String> {
    let mut end = try_raw_end(iface, peer, true)?;
    let mut reply = TurnFrames::new(&end, iface, own, peer, turn)?;
    ready();
    let (mut got, mut answered) = (0, 0u64);
    let started = Instant::now();
    let mut last = started;
    while !stop.load(Ordering::Relaxed) {
        if end
            .sock
            .recv(64, &mut |f| got += usize::from(reply.awaits(f)))
            > 0
        {
            last = Instant::now();
        } else if got > 0 && last.elapsed() > TURN_GAP {
            // Part of a turn, then nothing for longer than a turn takes: the rest was lost,
            // and the asking end has given up on it. Counting on would answer the next turn
            // after its first frames.
            got = 0;
        } else if let Some(l) = limits {
            if answered > 0 && last.elapsed() > l.quiet {
                break;
            }
            if answered == 0 && got == 0 && started.elapsed() > l.wait {
                return Err(format!("no frame from {peer} within {:?}", l.wait));
            }
        }
        while got >= reply.awaited() {
            got -= reply.awaited();
            reply.send(&mut end)?;
            answered += 1;
        }
    }
    Ok(answered)
}

/// The asking end of a raw ping-pong on its own: `count` turns to `peer`, each waiting for
/// the answering turn, both busy-polled. Returns the round trips in µs; a turn not answered
/// within a second is lost and has no sample. Needs xroce's XDP program on `iface`.
pub fn xsk_ping(
    iface: &str,
    own: Ipv4Addr,
    peer: Ipv4Addr,
    turn: PingTurn,
    count: usize,
) -> Result<Vec<f64>, String> {
    let mut end = try_raw_end(iface, peer, true)?;
    let mut ping = TurnFrames::new(&end, iface, own, peer, turn)?;
    let mut rtts = Vec::with_capacity(count);
    let mut lost_in_a_row = 0;
    'pings: for _ in 0..count {
        let t = Instant::now();
        ping.send(&mut end)?;
        let mut got = 0;
        while got < ping.awaited() {
            // Up to a whole turn: trailing ACKs of the last turn may come first.
            end.sock
                .recv(ping.frames(), &mut |f| got += usize::from(ping.awaits(f)));
            if t.elapsed() > Duration::from_secs(1) {
                // Lost: no sample. Let stragglers of this turn arrive and drop them.
                lost_in_a_row += 1;
                if lost_in_a_row == LOST_IN_A_ROW {
                    return Err(format!(
                        "{LOST_IN_A_ROW} turns in a row unanswered ({} bytes in {} frames each)",
                        turn.payload,
                        ping.frames()
                    ));
                }
                std::thread::sleep(Duration::from_millis(10));
                while end.sock.recv(64, &mut |_| {}) > 0 {}
                continue 'pings;
            }
        }
        lost_in_a_row = 0;
        rtts.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(rtts)
}

/// What the receiving end of a raw AF_XDP stream does with each frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sink {
    /// Counts it without reading its bytes: the path's ceiling.
    Counting,
    /// Reads it as every RoCE receiver must: a CRC-32 over the whole frame (the work of the
    /// ICRC check) and its payload copied into memory (a WRITE's placement). On a veth pair the
    /// sender's CPU copies each frame into the receiver's UMEM, and lines the receiving CPU
    /// still holds cost that copy more; its socket evicts them once read, as xroce's do (see
    /// `xroce_datapath::afxdp`), which took this receiver from 0.7-0.83× the counting one to
    /// 0.89-0.96× on this machine's veth pair.
    Reading,
}

/// Frames with `payload` bytes of UDP payload (up to 4096: one frame of a 4096 path MTU, two
/// UMEM descriptors), sent for `duration` in batches as fast as the transmit ring takes them;
/// the same frame each time, so this is the ceiling of the path, not of a protocol. The
/// receiving end treats each frame as `sink` says.
pub fn xsk_stream(pair: &NetnsPair, payload: usize, duration: Duration, sink: Sink) -> Stream {
    let mut reader = FrameReader::new(READ_INTO);
    raw_stream(
        pair,
        sink == Sink::Reading,
        move |f| {
            if sink == Sink::Reading {
                reader.take(f);
            }
            true
        },
        move |iface, own, peer| xsk_send_stream(iface, own, peer, payload, duration),
    )
}

/// A raw AF_XDP stream from namespace 0 to namespace 1 of `pair`: the receiver hands each
/// frame to `take` until the sender is done, which says whether the frame was intact (a
/// damaged one is counted as such, not as delivered); `send` runs in namespace 0 with its
/// interface, its address and the receiver's, and returns the time it sent for and the CPU
/// it used.
fn raw_stream(
    pair: &NetnsPair,
    reads_frames: bool,
    mut take: impl FnMut(&[u8]) -> bool + Send + 'static,
    send: impl FnOnce(&str, Ipv4Addr, Ipv4Addr) -> Result<(Duration, CpuTime), String> + Send,
) -> Stream {
    let (a, b) = (pair.ipv4(0), pair.ipv4(1));
    let (ib, ia) = (pair.iface(1).to_string(), pair.iface(0).to_string());
    let total = Counter::new();
    let (ready_tx, ready_rx) = mpsc::channel();
    let counter = total.clone();
    let receiver = pair.spawn_in(1, move || {
        let mut end = raw_end(&ib, a, reads_frames);
        ready_tx.send(()).ok();
        while !counter.stopped() {
            end.sock.recv(64, &mut |f| {
                if take(f) {
                    counter.add(f.len().saturating_sub(UDP_HEADERS))
                } else {
                    counter.add_damaged()
                }
            });
        }
        // What `take` kept (checksums, placed payloads) must not be optimised away.
        std::hint::black_box(&mut take);
    });
    ready_rx.recv().ok();
    let (elapsed, cpu) = pair
        .run_in(0, move || send(&ia, a, b))
        .unwrap_or_else(|e| panic!("raw AF_XDP sender: {e}"));
    total.finish(receiver, elapsed, cpu)
}

/// The sending end of [`xsk_stream`] on its own: frames of `payload` bytes of UDP payload from
/// `iface` (address `own`) to `peer` for `duration`, as fast as the ring takes them. Returns
/// the time it sent for and the CPU it used. Needs xroce's XDP program on `iface`.
pub fn xsk_send_stream(
    iface: &str,
    own: Ipv4Addr,
    peer: Ipv4Addr,
    payload: usize,
    duration: Duration,
) -> Result<(Duration, CpuTime), String> {
    let mut end = try_raw_end(iface, peer, true)?;
    let frame = udp_frame(end.mac, end.peer_mac, own, peer, payload);
    send_for(&mut end, duration, &mut |buf| {
        buf.get_mut(..frame.len())?.copy_from_slice(&frame);
        Some(frame.len())
    })
}

/// Segments per `sendmsg` of [`udp_gso_send_stream`]: xroce's batches hold up to 63.
pub const GSO_SEGMENTS: usize = 32;

/// The batched sending end of a raw stream: UDP datagrams of `payload` bytes from `iface` (its
/// address) to `peer`'s RoCEv2 port for `duration`, [`GSO_SEGMENTS`] to a `sendmsg` through
/// the kernel UDP socket xroce's engines batch through ([`GsoSocket`]: bound to the interface,
/// DF set), with `UDP_SEGMENT`: the kernel cuts the batch into datagrams and hands them to the
/// driver with "more to come". On a link where AF_XDP's copy mode notifies a virtio-net device
/// for every frame, this, not [`xsk_send_stream`], is the most a sender can put on the path.
/// An AF_XDP receiver behind xroce's XDP program takes the datagrams as it takes raw frames.
/// Returns the time it sent for.
pub fn udp_gso_send_stream(
    iface: &str,
    peer: Ipv4Addr,
    payload: usize,
    duration: Duration,
) -> Result<Duration, String> {
    let s = gso_socket(iface, peer, payload)?;
    let batch = vec![1u8; payload * GSO_SEGMENTS];
    let t = Instant::now();
    while t.elapsed() < duration {
        for _ in 0..8 {
            match s.send(&batch) {
                Ok(_) => {}
                // A full qdisc: the next batch tries again. Refused: datagrams that came
                // before the receiver's socket was in the XDP program's map went to the
                // kernel, which answered that no one listens.
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::ENOBUFS) | Some(libc::ECONNREFUSED)
                    ) => {}
                Err(e) => return Err(format!("sending a batch: {e}")),
            }
        }
    }
    Ok(t.elapsed())
}

/// Sends the frames `build` writes (see [`XskSocket::send_with`]) for `duration`, as fast as
/// the ring takes them, 32 to a kick. Returns the time it sent for and the CPU it used.
fn send_for(
    end: &mut RawEnd,
    duration: Duration,
    build: &mut dyn FnMut(&mut [u8]) -> Option<usize>,
) -> Result<(Duration, CpuTime), String> {
    let t = Instant::now();
    let cpu = CpuTime::thread();
    while t.elapsed() < duration {
        for _ in 0..32 {
            if !end.sock.send_with(build) {
                break;
            }
        }
        end.sock.flush().map_err(|e| format!("sending: {e}"))?;
    }
    Ok((t.elapsed(), CpuTime::thread().minus(cpu)))
}

/// Bytes of a message in [`xsk_message_stream`]: a 64 KiB `ib_write_bw` WRITE.
pub const MESSAGE: usize = 64 * 1024;
/// Payload bytes per frame of a message: one packet of a 4096 path MTU.
const MESSAGE_FRAME: usize = 4096;

/// Raw AF_XDP moving 64 KiB messages the way a copying RoCE stack must, each between its own
/// pair of buffers as perftest gives each QP its own: the sender takes the messages in
/// turn, copies each 4 KiB frame's payload out of the message's buffer into the frame and
/// computes a CRC-32 over it (the ICRC's work); the receiver checks each frame's CRC-32 and
/// copies its payload into the same message's buffer on its side. With one message the
/// buffers stay in the caches; with `messages` = 256 (16 MiB each side) they do not, which is
/// what `ib_write_bw -q 256` against `-q 1` asks of any stack that copies.
pub fn xsk_message_stream(pair: &NetnsPair, messages: usize, duration: Duration) -> Stream {
    let mut placer = MessagePlacer::new(messages, 0);
    let mut source = MessageSource::new(messages);
    raw_stream(
        pair,
        true,
        move |f| placer.take(f),
        move |iface, own, peer| {
            let mut end = try_raw_end(iface, peer, true)?;
            let headers = udp_frame(end.mac, end.peer_mac, own, peer, MESSAGE_FRAME);
            let headers = &headers[..UDP_HEADERS];
            send_for(&mut end, duration, &mut |buf| source.build(headers, buf))
        },
    )
}

/// [`xsk_message_stream`]'s messages sent the way xroce's engines send a WRITE's packets:
/// through the kernel UDP socket they batch through ([`GsoSocket`]), copied and CRC-32'd as
/// the AF_XDP sender does, each message as its first frame alone and a batch of the other 15
/// (`UDP_SEGMENT`). A RoCE stack cannot send fewer: a WRITE's first packet carries its RETH,
/// 16 bytes more than the rest, and a batch's segments are all of one size but the last (and
/// 16 frames of 4 KiB would not fit a UDP datagram's 64 KiB anyway). The kernel writes the
/// headers, so the CRC-32 covers the UDP payload. The receiver is the same.
pub fn udp_gso_message_stream(pair: &NetnsPair, messages: usize, duration: Duration) -> Stream {
    let mut placer = MessagePlacer::new(messages, UDP_HEADERS);
    let mut source = MessageSource::new(messages);
    raw_stream(
        pair,
        true,
        move |f| placer.take(f),
        move |iface, _own, peer| {
            let s = gso_socket(iface, peer, MESSAGE_FRAME)?;
            let mut message = vec![0u8; MESSAGE];
            let t = Instant::now();
            let cpu = CpuTime::thread();
            while t.elapsed() < duration {
                for frame in message.chunks_exact_mut(MESSAGE_FRAME) {
                    source
                        .build(&[], frame)
                        .ok_or("a frame shorter than its payload")?;
                }
                let (first, rest) = message.split_at(MESSAGE_FRAME);
                send_batch(&s, first)?;
                send_batch(&s, rest)?;
            }
            Ok((t.elapsed(), CpuTime::thread().minus(cpu)))
        },
    )
}

/// The sending side of [`xsk_message_stream`]: `messages` buffers of [`MESSAGE`] bytes, sent
/// a message (16 frames) at a time, in turn.
struct MessageSource {
    memory: Vec<u8>,
    /// Frame slot of the next frame: message × 16 + frame within it.
    next: usize,
}

impl MessageSource {
    fn new(messages: usize) -> Self {
        MessageSource {
            // Written, not zeroed: untouched pages would all read the kernel's one zero page,
            // which is always in the cache.
            memory: (0..messages.max(1) * MESSAGE)
                .map(|i| i as u8 | 1)
                .collect(),
            next: 0,
        }
    }

    /// Writes the next frame into `buf`: the headers, the payload from its message's buffer
    /// with its slot in the first 4 bytes (where a WRITE's RETH names the address), and a
    /// CRC-32 over the rest in the last 4. Returns its length.
    fn build(&mut self, headers: &[u8], buf: &mut [u8]) -> Option<usize> {
        let len = headers.len() + MESSAGE_FRAME;
        let frame = buf.get_mut(..len)?;
        let slot = self.next;
        self.next = (self.next + 1) % (self.memory.len() / MESSAGE_FRAME);
        let (head, payload) = frame.split_at_mut(headers.len());
        head.copy_from_slice(headers);
        let at = slot * MESSAGE_FRAME;
        payload.copy_from_slice(self.memory.get(at..at + MESSAGE_FRAME)?);
        payload[..4].copy_from_slice(&(slot as u32).to_le_bytes());
        let crc = crc32fast::hash(&frame[..len - 4]);
        frame[len - 4..].copy_from_slice(&crc.to_le_bytes());
        Some(len)
    }
}

/// The receiving side of [`xsk_message_stream`]: checks each frame's CRC-32 and places its
/// payload where its slot says.
struct MessagePlacer {
    memory: Vec<u8>,
    /// Where the CRC-32 starts: the frame's first byte, or its UDP payload's when the kernel
    /// wrote the headers.
    crc_from: usize,
}

impl MessagePlacer {
    fn new(messages: usize, crc_from: usize) -> Self {
        MessagePlacer {
            memory: (0..messages.max(1) * MESSAGE).map(|i| i as u8).collect(),
            crc_from,
        }
    }

    /// Checks and places one frame; `false` for one that is damaged (too short, a CRC-32
    /// that does not match), which is dropped as a RoCE receiver drops a bad ICRC.
    fn take(&mut self, frame: &[u8]) -> bool {
        let Some(payload) = frame.get(UDP_HEADERS..) else {
            return false;
        };
        let (Some(slot), Some(crc)) = (payload.first_chunk::<4>(), frame.last_chunk::<4>()) else {
            return false;
        };
        let Some(covered) = frame.get(self.crc_from..frame.len() - 4) else {
            return false;
        };
        if crc32fast::hash(covered) != u32::from_le_bytes(*crc) {
            return false;
        }
        let at = u32::from_le_bytes(*slot) as usize * MESSAGE_FRAME;
        if let Some(place) = self.memory.get_mut(at..at + payload.len()) {
            place.copy_from_slice(payload);
        }
        true
    }
}

/// What [`xsk_receive_stream`] counted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Received {
    pub frames: u64,
    /// UDP payload bytes.
    pub bytes: u64,
    /// From the first frame to the last.
    pub span: Duration,
}

impl Received {
    /// Payload bytes per second over the span, in 10^6.
    pub fn mb_per_s(&self) -> f64 {
        self.bytes as f64 / self.span.as_secs_f64().max(1e-9) / 1e6
    }
}

/// The receiving end of a raw AF_XDP stream on its own: counts the frames `peer` sends to
/// `iface` until `quiet` passes without one after the first, or `wait` passes without any.
/// Needs xroce's XDP program on `iface`.
pub fn xsk_receive_stream(
    iface: &str,
    peer: Ipv4Addr,
    wait: Duration,
    quiet: Duration,
) -> Result<Received, String> {
    let mut end = try_raw_end(iface, peer, false)?;
    let started = Instant::now();
    let (mut frames, mut bytes) = (0u64, 0u64);
    let (mut first, mut last) = (None, started);
    loop {
        let mut n = 0u64;
        end.sock.recv(64, &mut |f| {
            n += 1;
            bytes += f.len().saturating_sub(UDP_HEADERS) as u64;
        });
        if n == 0 {
            // Nothing queued: sleep until a frame comes (at most 1 ms) instead of spinning,
            // which on a guest's single vCPU would take the time its softirq needs to deliver
            // them.
            let mut pfd = libc::pollfd {
                fd: end.sock.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd for the duration of the call.
            unsafe { libc::poll(&mut pfd, 1, 1) };
        }
        let now = Instant::now();
        if n > 0 {
            frames += n;
            first.get_or_insert(now);
            last = now;
        } else if first.is_some() && now - last > quiet {
            break;
        } else if first.is_none() && now - started > wait {
            return Err(format!("no frame from {peer} within {wait:?}"));
        }
    }
    Ok(Received {
        frames,
        bytes,
        span: last - first.unwrap_or(last),
    })
}

// ---------------------------------------------------------------- helpers

/// Ethernet, IPv4 and UDP headers of the baselines' frames.
const UDP_HEADERS: usize = 14 + 20 + 8;

/// Memory a [`Sink::Reading`] receiver places payloads in: 16 messages of 64 KiB, as
/// `ib_write_bw`'s window of 64 KiB WRITEs spreads over its buffer.
const READ_INTO: usize = 1 << 20;

/// The work of a [`Sink::Reading`] receiver: each frame's CRC-32 and its payload placed in
/// memory, one after the other, wrapping around at the end.
struct FrameReader {
    memory: Vec<u8>,
    at: usize,
    /// The frames' CRCs folded together, so that nothing can be optimised away.
    checksums: u32,
}

impl FrameReader {
    fn new(bytes: usize) -> Self {
        FrameReader {
            memory: vec![0; bytes],
            at: 0,
            checksums: 0,
        }
    }

    fn take(&mut self, frame: &[u8]) {
        self.checksums ^= crc32fast::hash(frame);
        let payload = frame.get(UDP_HEADERS..).unwrap_or_default();
        let payload = &payload[..payload.len().min(self.memory.len())];
        if self.at + payload.len() > self.memory.len() {
            self.at = 0;
        }
        self.memory[self.at..self.at + payload.len()].copy_from_slice(payload);
        self.at += payload.len();
    }
}

/// Bytes and messages a receiver counted, and the flag that stops it.
#[derive(Clone)]
struct Counter {
    bytes: Arc<AtomicU64>,
    messages: Arc<AtomicU64>,
    damaged: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    /// This process's CPU time before the receiver started.
    process_cpu_at_start: CpuTime,
}

impl Counter {
    fn new() -> Self {
        Counter {
            bytes: Arc::new(AtomicU64::new(0)),
            messages: Arc::new(AtomicU64::new(0)),
            damaged: Arc::new(AtomicU64::new(0)),
            stop: Arc::new(AtomicBool::new(false)),
            process_cpu_at_start: CpuTime::process(),
        }
    }

    fn add(&self, bytes: usize) {
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        self.messages.fetch_add(1, Ordering::Relaxed);
    }

    fn add_damaged(&self) {
        self.damaged.fetch_add(1, Ordering::Relaxed);
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    /// Lets the last messages in flight arrive, stops the receiver and divides by the
    /// sender's time.
    fn finish(
        self,
        receiver: std::thread::JoinHandle<()>,
        elapsed: Duration,
        sender_cpu: CpuTime,
    ) -> Stream {
        std::thread::sleep(Duration::from_millis(50));
        self.stop.store(true, Ordering::Relaxed);
        receiver.join().expect("receiver");
        let secs = elapsed.as_secs_f64();
        Stream {
            mb_per_s: self.bytes.load(Ordering::Relaxed) as f64 / secs / 1e6,
            mpps: self.messages.load(Ordering::Relaxed) as f64 / secs / 1e6,
            sender_cpu,
            both_ends_cpu: CpuTime::process().minus(self.process_cpu_at_start),
            delivered_gbit: self.bytes.load(Ordering::Relaxed) as f64 * 8.0 / 1e9,
            damaged: self.damaged.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_split_into_pieces_of_a_4096_path_mtu() {
        assert_eq!(pieces(64), [64]);
        assert_eq!(pieces(4096), [4096]);
        assert_eq!(pieces(5000), [4096, 904]);
        assert_eq!(pieces(65536), [4096; 16]);
        assert_eq!(pieces(0), [0], "an empty message is still a frame");
    }

    #[test]
    fn a_turn_with_trailing_acks_waits_for_the_message_alone() {
        let turn = |trailing_acks| PingTurn {
            trailing_acks,
            ..PingTurn::waiting(64, 2)
        };
        let (message, ack) = (vec![0u8; 106], vec![0u8; 62]);
        let trailing =
            TurnFrames::from_frames(vec![message.clone()], ack.clone(), turn(true)).unwrap();
        assert_eq!((trailing.frames(), trailing.awaited()), (2, 1));
        assert!(trailing.awaits(&message));
        assert!(!trailing.awaits(&ack));
        let waiting =
            TurnFrames::from_frames(vec![message.clone()], ack.clone(), turn(false)).unwrap();
        assert_eq!((waiting.frames(), waiting.awaited()), (2, 2));
        assert!(waiting.awaits(&message) && waiting.awaits(&ack));
        // A message frame as long as the ACK cannot be told from it.
        assert!(TurnFrames::from_frames(vec![ack.clone()], ack, turn(true)).is_err());
    }

    #[test]
    fn checked_frames_are_numbered_sealed_and_refused_when_damaged() {
        let turn = PingTurn {
            checked: true,
            ..PingTurn::waiting(64, 2)
        };
        let (a, b) = (Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2));
        let message = udp_frame([2; 6], [4; 6], a, b, 64);
        let ack = udp_frame([2; 6], [4; 6], a, b, ACK_PAYLOAD);
        let frames = TurnFrames::from_frames(vec![message.clone()], ack, turn).unwrap();
        // As built, a frame carries no valid CRC: a receiver must not take it.
        assert!(!frames.awaits(&message));
        let mut sealed = Vec::new();
        for sequence in 1..=3u32 {
            let mut m = frames.message[0].clone();
            seal(&mut m, 0, sequence);
            assert_eq!(m[UDP_HEADERS..UDP_HEADERS + 4], sequence.to_be_bytes());
            assert!(frames.awaits(&m));
            sealed.push(m);
        }
        // Each number gives its own CRC: nothing can be sent twice unchanged.
        assert_ne!(
            sealed[0][sealed[0].len() - 4..],
            sealed[1][sealed[1].len() - 4..]
        );
        for at in [0, 20, UDP_HEADERS + 1, sealed[2].len() - 1] {
            let mut damaged = sealed[2].clone();
            damaged[at] ^= 0x10;
            assert!(
                !frames.awaits(&damaged),
                "a bit flipped at {at} went unnoticed"
            );
        }
        assert!(!frames.awaits(&[0u8; 3]));
        // Too short a payload has no room for the number and the CRC.
        let short = PingTurn { payload: 4, ..turn };
        let tiny = udp_frame([2; 6], [4; 6], a, b, 4);
        assert!(TurnFrames::from_frames(vec![tiny.clone()], tiny, short).is_err());
    }

    #[test]
    fn a_batched_turn_checks_the_udp_payload_the_kernel_leaves_alone() {
        let turn = PingTurn {
            checked: true,
            batched: true,
            ..PingTurn::waiting(64, 2)
        };
        let (a, b) = (Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2));
        let message = udp_frame([2; 6], [4; 6], a, b, 64);
        let ack = udp_frame([2; 6], [4; 6], a, b, ACK_PAYLOAD);
        let frames = TurnFrames::from_frames(vec![message.clone()], ack.clone(), turn).unwrap();
        let mut m = message.clone();
        seal(&mut m, frames.crc_from, 7);
        assert!(frames.awaits(&m));
        // The kernel writes its own headers (an IP ID, a source port): the check holds.
        m[18] ^= 0x55;
        m[34] ^= 0x0f;
        assert!(frames.awaits(&m));
        // Not so for the payload.
        m[UDP_HEADERS + 5] ^= 1;
        assert!(!frames.awaits(&m));
        // The ACK-sized frame must be the shorter last segment of one batch: one message frame
        // at least as long as it, and at most one of it.
        let long = PingTurn {
            payload: 8192,
            ..turn
        };
        let pieces = vec![message.clone(), message.clone()];
        assert!(TurnFrames::from_frames(pieces, ack.clone(), long).is_err());
        let three = PingTurn { frames: 3, ..turn };
        assert!(TurnFrames::from_frames(vec![message.clone()], ack.clone(), three).is_err());
        let small = PingTurn {
            payload: 12,
            ..turn
        };
        let twelve = udp_frame([2; 6], [4; 6], a, b, 12);
        assert!(TurnFrames::from_frames(vec![twelve], ack, small).is_err());
    }

    #[test]
    fn percentiles_of_samples() {
        let rt = RoundTrip::from_samples((1..=100).rev().map(f64::from).collect());
        assert_eq!(rt.p50, 50.0);
        assert_eq!(rt.p99, 99.0);
        assert!(RoundTrip::from_samples(Vec::new()).p50.is_nan());
    }

    #[test]
    fn a_reading_sink_checks_every_frame_and_places_its_payload_in_turn() {
        let frame = |fill: u8, payload: usize| {
            let mut f = vec![0xee; UDP_HEADERS];
            f.extend(std::iter::repeat_n(fill, payload));
            f
        };
        let (a, b, c) = (frame(1, 40), frame(2, 40), frame(3, 30));
        let mut reader = FrameReader::new(100);
        reader.take(&a);
        reader.take(&b);
        assert_eq!(&reader.memory[..40], &[1; 40]);
        assert_eq!(&reader.memory[40..80], &[2; 40]);
        // The third payload does not fit behind the second: it starts again at the front.
        reader.take(&c);
        assert_eq!(&reader.memory[..30], &[3; 30]);
        assert_eq!(&reader.memory[30..40], &[1; 10]);
        assert_eq!(
            reader.checksums,
            crc32fast::hash(&a) ^ crc32fast::hash(&b) ^ crc32fast::hash(&c)
        );
        // A runt frame, or one larger than the memory, is read without a panic.
        reader.take(&[0xee; 10]);
        reader.take(&frame(4, 150));
        assert_eq!(&reader.memory[..], &[4; 100]);
    }

    #[test]
    fn messages_go_out_in_turn_and_land_in_the_same_message_on_the_other_side() {
        let headers = [0xee; UDP_HEADERS];
        let mut source = MessageSource::new(2);
        let mut placer = MessagePlacer::new(2, 0);
        let mut buf = vec![0u8; UDP_HEADERS + MESSAGE_FRAME + 100];
        let mut slots = Vec::new();
        // Three messages' worth: both buffers, then the first again.
        for _ in 0..3 * MESSAGE / MESSAGE_FRAME {
            let len = source.build(&headers, &mut buf).expect("room for a frame");
            assert_eq!(len, UDP_HEADERS + MESSAGE_FRAME);
            assert_eq!(&buf[..UDP_HEADERS], &headers);
            slots.push(u32::from_le_bytes(
                buf[UDP_HEADERS..][..4].try_into().unwrap(),
            ));
            assert!(placer.take(&buf[..len]), "an intact frame");
        }
        let per_message = (MESSAGE / MESSAGE_FRAME) as u32;
        let expected: Vec<u32> = (0..2 * per_message).chain(0..per_message).collect();
        assert_eq!(
            slots, expected,
            "16 frames of a message, then the next message"
        );
        // Each frame's payload landed in its slot: the source's bytes, but for the slot number
        // in its first four and the CRC-32 in its last four.
        for slot in [0usize, 17, 31] {
            let at = slot * MESSAGE_FRAME;
            assert_eq!(
                &placer.memory[at + 4..at + MESSAGE_FRAME - 4],
                &source.memory[at + 4..at + MESSAGE_FRAME - 4]
            );
            assert_eq!(&placer.memory[at..at + 4], &(slot as u32).to_le_bytes());
        }
        // A damaged frame and a runt are refused, and the damaged one is not placed; a slot
        // outside the buffers is ignored without a panic.
        let len = source.build(&headers, &mut buf).unwrap();
        let slot = u32::from_le_bytes(buf[UDP_HEADERS..][..4].try_into().unwrap()) as usize;
        buf[UDP_HEADERS + 100] ^= 1;
        assert!(!placer.take(&buf[..len]));
        assert_ne!(
            placer.memory[slot * MESSAGE_FRAME + 100],
            buf[UDP_HEADERS + 100],
            "a damaged frame was placed"
        );
        assert!(!placer.take(&[0xee; 10]));
        buf[UDP_HEADERS + 100] ^= 1;
        buf[UDP_HEADERS..][..4].copy_from_slice(&9999u32.to_le_bytes());
        let crc = crc32fast::hash(&buf[..len - 4]);
        buf[len - 4..len].copy_from_slice(&crc.to_le_bytes());
        assert!(placer.take(&buf[..len]));
        assert!(
            source.build(&headers, &mut [0u8; 100]).is_none(),
            "no room, no frame"
        );
    }

    #[test]
    fn batched_frames_are_checked_from_the_udp_payload_the_sender_built() {
        // The sender builds a frame's payload alone; the kernel writes the headers, which the
        // CRC-32 cannot cover.
        let mut source = MessageSource::new(1);
        let mut payload = vec![0u8; MESSAGE_FRAME];
        assert_eq!(source.build(&[], &mut payload), Some(MESSAGE_FRAME));
        let mut frame = vec![0x11u8; UDP_HEADERS];
        frame.extend_from_slice(&payload);
        let mut placer = MessagePlacer::new(1, UDP_HEADERS);
        assert!(placer.take(&frame), "an intact datagram");
        assert_eq!(
            &placer.memory[4..MESSAGE_FRAME - 4],
            &payload[4..MESSAGE_FRAME - 4]
        );
        frame[..UDP_HEADERS].fill(0x22);
        assert!(placer.take(&frame), "whatever headers the kernel wrote");
        assert!(
            !MessagePlacer::new(1, 0).take(&frame),
            "checked from the frame's first byte, the headers would count"
        );
        frame[UDP_HEADERS + 9] ^= 4;
        assert!(!placer.take(&frame), "a damaged payload");
        assert!(!placer.take(&frame[..UDP_HEADERS + 2]), "a runt");
    }

    #[test]
    fn frames_carry_a_valid_ipv4_header() {
        let f = udp_frame(
            [1; 6],
            [2; 6],
            Ipv4Addr::new(10, 0, 0, 1),
            Ipv4Addr::new(10, 0, 0, 2),
            64,
        );
        assert_eq!(f.len(), 14 + 20 + 8 + 64);
        // The header checksum makes the one's-complement sum of the header 0xffff.
        let mut sum = 0u32;
        for c in f[14..34].chunks(2) {
            sum += u32::from(u16::from_be_bytes([c[0], c[1]]));
        }
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        assert_eq!(sum, 0xffff);
        assert_eq!(u16::from_be_bytes([f[36], f[37]]), 4791);
    }
}
