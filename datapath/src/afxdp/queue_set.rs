//! One engine's AF_XDP sockets on an interface with several receive queues.
//!
//! A NIC with several receive queues spreads flows over them (RSS: a hash of addresses and
//! ports), and a RoCEv2 QP's flow is one UDP source port among many, so its frames may arrive on
//! any queue; the XDP program can only hand a frame to a socket bound to the queue it arrived
//! on. So an engine binds a socket on every receive queue: its own queue's socket sends and
//! receives, the others only receive, and all of them wake the progress thread through one
//! epoll descriptor. On an interface with one queue the engine uses its socket directly.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use super::{XskConfig, XskError, XskSocket};
use crate::port::{Port, RxDrops};

/// The geometry of a socket that only receives: 512 frames (2 MiB), all of them in the fill
/// ring, since an interface may have dozens of queues. Its RX ring takes all 512: one QP may
/// have a whole send window of packets on the way (`MAX_UNACKED_PSNS` past the oldest
/// unacknowledged one, so 513 at most), and RSS puts them all on one queue. A ring of 256
/// (sized when the window was 128) would drop what is beyond it while the receiving thread is
/// busy elsewhere, and go-back-N would resend up to a window; 512 takes all but the last
/// packet of a full window. Packets larger than a UMEM frame (path MTU 4096) take two slots
/// each, so a full window of those can still overflow it; holding that too would cost 2 MiB
/// more per queue.
pub const RECEIVE_ONLY: XskConfig = XskConfig {
    queue: 0,
    frames: 512,
    ring_size: 512,
    mode: super::BindMode::Auto,
    receive_only: true,
    single_buffer: false,
    fits_one_frame: false,
    leave_received_lines: false,
};

const _: () = assert!(
    RECEIVE_ONLY.ring_size >= xroce_core::transport::requester::MAX_UNACKED_PSNS
        && RECEIVE_ONLY.frames >= RECEIVE_ONLY.ring_size
        && RECEIVE_ONLY.frames <= 2 * RECEIVE_ONLY.ring_size,
    "a receive-only socket's RX ring holds a send window but its last packet, and its fill ring all its frames"
);

/// A sending and receiving socket plus receive-only sockets on the interface's other queues.
pub struct QueueSet {
    main: XskSocket,
    others: Vec<XskSocket>,
    /// Readable when any socket has frames.
    epoll: OwnedFd,
    /// The socket the next receive starts with, so that no queue waits behind a busy one.
    next: usize,
}

impl QueueSet {
    /// `main` sends and receives; `others` (on the other queues of the same interface) receive.
    pub fn new(main: XskSocket, others: Vec<XskSocket>) -> Result<QueueSet, XskError> {
        let setup = |source| XskError::Setup {
            step: "epoll over the queues' sockets",
            source,
        };
        // SAFETY: epoll_create1 takes only flags.
        let raw = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if raw < 0 {
            return Err(setup(io::Error::last_os_error()));
        }
        // SAFETY: `raw` is a new descriptor nobody else owns.
        let epoll = unsafe { OwnedFd::from_raw_fd(raw) };
        for sock in std::iter::once(&main).chain(&others) {
            let mut event = libc::epoll_event {
                events: libc::EPOLLIN as u32,
                u64: sock.queue().into(),
            };
            // SAFETY: both descriptors are open and `event` is valid for the call.
            let rc = unsafe {
                libc::epoll_ctl(
                    epoll.as_raw_fd(),
                    libc::EPOLL_CTL_ADD,
                    sock.as_raw_fd(),
                    &mut event,
                )
            };
            if rc != 0 {
                return Err(setup(io::Error::last_os_error()));
            }
        }
        Ok(QueueSet {
            main,
            others,
            epoll,
            next: 0,
        })
    }

    /// The descriptor that is readable when any socket has frames.
    pub fn wait_fd_raw(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    /// The sockets, the sending one first.
    pub fn sockets(&self) -> impl Iterator<Item = &XskSocket> {
        std::iter::once(&self.main).chain(&self.others)
    }

    fn socket_mut(&mut self, i: usize) -> &mut XskSocket {
        match i {
            0 => &mut self.main,
            i => &mut self.others[i - 1],
        }
    }
}

impl Port for QueueSet {
    fn recv(&mut self, max: usize, deliver: &mut dyn FnMut(&[u8])) -> usize {
        let count = 1 + self.others.len();
        let start = self.next;
        self.next = (self.next + 1) % count;
        let mut got = 0;
        for k in 0..count {
            if got >= max {
                break;
            }
            got += self
                .socket_mut((start + k) % count)
                .recv(max - got, deliver);
        }
        got
    }

    fn send(&mut self, frame: &[u8]) -> bool {
        self.main.send(frame)
    }

    fn send_with(&mut self, build: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> bool {
        self.main.send_with(build)
    }

    /// Also evicts what the receive-only sockets took (see `eviction`): they are never
    /// flushed themselves.
    fn flush(&mut self) -> io::Result<()> {
        let flushed = self.main.flush();
        for other in &mut self.others {
            other.evict_taken();
        }
        flushed
    }

    fn tx_pending(&self) -> bool {
        self.main.tx_pending()
    }

    fn wait_fd(&self) -> Option<RawFd> {
        Some(self.wait_fd_raw())
    }

    fn rx_drops(&self) -> RxDrops {
        self.sockets().fold(RxDrops::default(), |sum, s| {
            let d = Port::rx_drops(s);
            RxDrops {
                ring_full: sum.ring_full + d.ring_full,
                other: sum.other + d.other,
            }
        })
    }
}
