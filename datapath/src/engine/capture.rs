//! A pcap file of every frame an engine sends and receives.
//!
//! xroce's frames are invisible to `tcpdump` on the interface: AF_XDP's copy-mode transmit
//! hands them to the driver past the packet taps, and the XDP program redirects received ones
//! before the taps see them. So the engine writes them itself when asked
//! ([`super::EngineConfig::capture`]): classic pcap, Ethernet link type, nanosecond timestamps
//! of the moment the engine built or took the frame, whole frames (the ICRC is at the end).
//! Wireshark, tshark and `xroce pcap check` read it.
//!
//! Frames a QP sends to a QP of the same device (loopback) never touch the wire; they are
//! written too, with the interface's own address as both Ethernet addresses.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use pcap_parser::{LegacyPcapBlock, Linktype, PcapHeader, ToVec};

/// Paths open for capture in this process: two engines writing one file would interleave two
/// pcap headers and streams into garbage.
static OPEN: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Longest frame written whole: a 9000-byte MTU frame with two VLAN tags fits.
const SNAPLEN: u32 = 9022;

pub(crate) struct Capture {
    path: PathBuf,
    out: BufWriter<File>,
    /// A write failed (disk full, say): reported once, nothing more is written.
    failed: bool,
}

impl Capture {
    /// Creates (or truncates) `path` and writes the pcap file header.
    pub(crate) fn create(path: &Path) -> io::Result<Self> {
        {
            let mut open = OPEN.lock().unwrap_or_else(|p| p.into_inner());
            if open.iter().any(|p| p == path) {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    "another engine of this process already captures to it (give each \
                     interface a file of its own)",
                ));
            }
            open.push(path.to_path_buf());
        }
        let opened = File::create(path).and_then(|file| {
            let mut out = BufWriter::with_capacity(1 << 16, file);
            let mut header = PcapHeader::new();
            // Nanosecond timestamps.
            header.magic_number = 0xa1b2_3c4d;
            header.snaplen = SNAPLEN;
            header.network = Linktype::ETHERNET;
            out.write_all(&header.to_vec_raw().map_err(io::Error::other)?)?;
            out.flush()?;
            Ok(out)
        });
        match opened {
            Ok(out) => Ok(Self {
                path: path.to_path_buf(),
                out,
                failed: false,
            }),
            Err(e) => {
                forget(path);
                Err(e)
            }
        }
    }

    /// Appends one frame, stamped with the wall clock. Out of line and cold: the send and
    /// receive loops that call it stay as small as they are without a capture.
    #[cold]
    #[inline(never)]
    pub(crate) fn record(&mut self, frame: &[u8]) {
        if self.failed {
            return;
        }
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid timespec for the call to fill.
        unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
        let caplen = frame.len().min(SNAPLEN as usize);
        let block = LegacyPcapBlock {
            ts_sec: ts.tv_sec as u32,
            ts_usec: ts.tv_nsec as u32,
            caplen: caplen as u32,
            origlen: frame.len() as u32,
            data: &frame[..caplen],
        };
        let written = block
            .to_vec_raw()
            .map_err(io::Error::other)
            .and_then(|bytes| self.out.write_all(&bytes));
        if let Err(e) = written {
            self.fail(e);
        }
    }

    /// Hands what is buffered to the file (the engine does this whenever it runs out of work,
    /// so a process that is killed loses little).
    pub(crate) fn flush(&mut self) {
        if !self.failed && !self.out.buffer().is_empty() {
            if let Err(e) = self.out.flush() {
                self.fail(e);
            }
        }
    }

    fn fail(&mut self, e: io::Error) {
        self.failed = true;
        crate::stderr_line!(
            "xroce: capture to {} stopped: {e}; frames are no longer written",
            self.path.display()
        );
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        self.flush();
        forget(&self.path);
    }
}

fn forget(path: &Path) {
    OPEN.lock()
        .unwrap_or_else(|p| p.into_inner())
        .retain(|p| p != path);
}

#[cfg(test)]
mod tests {
    use super::*;
    use pcap_parser::{create_reader, PcapBlockOwned, PcapError};

    fn frames_in(path: &Path) -> (u32, Vec<Vec<u8>>) {
        let mut reader = create_reader(1 << 16, File::open(path).unwrap()).unwrap();
        let mut magic = 0;
        let mut frames = Vec::new();
        loop {
            match reader.next() {
                Ok((offset, block)) => {
                    match block {
                        PcapBlockOwned::LegacyHeader(h) => {
                            assert_eq!(h.network, Linktype::ETHERNET);
                            magic = h.magic_number;
                        }
                        PcapBlockOwned::Legacy(b) => {
                            assert_eq!(b.caplen, b.origlen);
                            frames.push(b.data.to_vec());
                        }
                        PcapBlockOwned::NG(_) => panic!("a pcapng block in a classic pcap file"),
                    }
                    reader.consume(offset);
                }
                Err(PcapError::Eof) => break,
                Err(PcapError::Incomplete(_)) => reader.refill().unwrap(),
                Err(e) => panic!("{e:?}"),
            }
        }
        (magic, frames)
    }

    #[test]
    fn frames_come_back_whole_and_in_order_from_the_file() {
        let path = std::env::temp_dir().join(format!("xroce-capture-{}.pcap", std::process::id()));
        let sent: Vec<Vec<u8>> = (0..50u8)
            .map(|i| vec![i; 60 + usize::from(i) * 7])
            .collect();
        {
            let mut c = Capture::create(&path).unwrap();
            // A second capture to the same file is refused while the first is open.
            let again = Capture::create(&path).err().expect("refused");
            assert_eq!(again.kind(), io::ErrorKind::AlreadyExists);
            for f in &sent {
                c.record(f);
            }
        }
        let (magic, got) = frames_in(&path);
        assert_eq!(magic, 0xa1b2_3c4d, "nanosecond timestamps");
        assert_eq!(got, sent);
        // Closed, the path may be captured to again (and is truncated).
        drop(Capture::create(&path).unwrap());
        assert!(frames_in(&path).1.is_empty());
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn an_unwritable_path_is_an_error_and_is_not_held() {
        let path = Path::new("/nonexistent-dir/capture.pcap");
        assert!(Capture::create(path).is_err());
        assert!(Capture::create(path).is_err_and(|e| e.kind() != io::ErrorKind::AlreadyExists));
    }
}
