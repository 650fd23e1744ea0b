//! The frame I/O an engine drives: whole Ethernet frames in and out.
//!
//! AF_XDP implements it here; the DPDK backend and test doubles implement the same trait, so the
//! engine does not know which one it drives.

use std::io;
use std::os::fd::{AsRawFd, RawFd};

use crate::afxdp::XskSocket;

pub trait Port: Send {
    /// Hands up to `max` received frames to `deliver`; returns how many.
    fn recv(&mut self, max: usize, deliver: &mut dyn FnMut(&[u8])) -> usize;
    /// Queues a frame; `false` when there is no room until the next `flush`.
    fn send(&mut self, frame: &[u8]) -> bool;
    /// Lets `build` write a frame directly into the device's transmit buffer and queues it;
    /// `build` returns its length, or `None` to send nothing. `false`, without calling
    /// `build`, when there is no room until the next `flush`.
    fn send_with(&mut self, build: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> bool;
    /// Makes queued frames go out.
    fn flush(&mut self) -> io::Result<()>;
    /// `flush` for a round that its limits cut short, with the transport's next packets
    /// built in the round that follows: a batching port may keep its open batch open for
    /// them, so that a run of frames is not cut where the round was.
    fn flush_before_more(&mut self) -> io::Result<()> {
        self.flush()
    }
    /// Sends what [`Port::flush_before_more`] kept back, when the round it waits for may not
    /// come soon (the engine holds ACKs, or is flushed or stopped).
    fn send_kept(&mut self) -> io::Result<()> {
        Ok(())
    }
    /// Makes the frames queued so far go out in the middle of a round, leaving to the round's
    /// `flush` what it decides for the next round (a batching port judges each round there).
    fn kick(&mut self) -> io::Result<()> {
        self.flush()
    }
    /// Frames are queued that the device has not sent yet.
    fn tx_pending(&self) -> bool;
    /// A descriptor that becomes readable when frames arrive, for sleeping in `poll()`.
    fn wait_fd(&self) -> Option<RawFd>;
    /// Whether [`Port::wait_fd`] is a doorbell: it rings when frames arrive but stays readable
    /// until read ([`silence_doorbell`]), whoever took the frames (an AF_XDP socket is
    /// readable exactly while frames wait in it). The progress thread silences it before it
    /// takes frames, so that a sleep after taking them wakes only for newer ones.
    fn wait_fd_is_doorbell(&self) -> bool {
        false
    }
    /// Interface `ifindex` of the port's namespace changed (a link notification), or, with
    /// `None`, notifications were lost: a port that follows a setting of its interface reads
    /// it again.
    fn link_changed(&mut self, _ifindex: Option<u32>) {}
    /// Addresses or routes of the port's namespace changed, or notifications were lost: a port
    /// that keeps answers about addresses asks again.
    fn addresses_changed(&mut self) {}
    /// Frames for this port that the device dropped before they could be received: with no
    /// room in the receive ring, and for any other reason. Lost frames look like loss on the
    /// path to the transport (NAKs, retransmissions); these say where they were lost.
    fn rx_drops(&self) -> RxDrops {
        RxDrops::default()
    }
}

/// Reads what a doorbell socket holds (see [`Port::wait_fd_is_doorbell`]), without waiting:
/// it is readable again only when something newer arrives. Bounded, so that a flood cannot
/// hold the caller here (the socket's buffer holds a datagram or two anyway).
pub fn silence_doorbell(fd: RawFd) {
    let mut byte = [0u8; 1];
    for _ in 0..64 {
        // SAFETY: one byte of room at `byte`; a longer datagram is cut, the rest discarded.
        let n = unsafe { libc::recv(fd, byte.as_mut_ptr().cast(), 1, libc::MSG_DONTWAIT) };
        if n < 0 {
            break;
        }
    }
}

/// See [`Port::rx_drops`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RxDrops {
    pub ring_full: u64,
    pub other: u64,
}

impl Port for XskSocket {
    fn recv(&mut self, max: usize, deliver: &mut dyn FnMut(&[u8])) -> usize {
        XskSocket::recv(self, max, deliver)
    }

    fn send(&mut self, frame: &[u8]) -> bool {
        XskSocket::send(self, frame)
    }

    fn send_with(&mut self, build: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> bool {
        XskSocket::send_with(self, build)
    }

    fn flush(&mut self) -> io::Result<()> {
        XskSocket::flush(self)
    }

    fn tx_pending(&self) -> bool {
        XskSocket::tx_pending(self)
    }

    fn wait_fd(&self) -> Option<RawFd> {
        Some(self.as_raw_fd())
    }

    fn rx_drops(&self) -> RxDrops {
        // The socket's statistics cannot fail to read on an open socket; if they did, no
        // drops is the honest fallback for a diagnostic counter.
        self.stats().map_or(RxDrops::default(), |s| RxDrops {
            ring_full: s.rx_ring_full,
            other: s.rx_dropped,
        })
    }
}

/// A port that is gone (the engine stopped): nothing comes in, nothing goes out.
pub struct ClosedPort;

impl Port for ClosedPort {
    fn recv(&mut self, _max: usize, _deliver: &mut dyn FnMut(&[u8])) -> usize {
        0
    }

    fn send(&mut self, _frame: &[u8]) -> bool {
        true
    }

    fn send_with(&mut self, _build: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> bool {
        false
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
