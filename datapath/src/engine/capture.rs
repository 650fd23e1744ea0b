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
//!
//! With a size limit ([`super::EngineConfig::capture_max`], `XROCE_PCAP_MAX`) the file is
//! rotated as `tcpdump -C SIZE -W 2` would: once it holds that much, it is renamed to
//! `FILE.1` (replacing the older one) and a new `FILE` begins. A long run that hangs then
//! leaves its last frames, at least `SIZE` of them, in `FILE.1` and `FILE`, with at most twice
//! that on disk, and a process killed outright loses only what was not yet flushed.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use pcap_parser::{LegacyPcapBlock, Linktype, PcapHeader, ToVec};

/// Paths open for capture in this process: two engines writing one file would interleave two
/// pcap headers and streams into garbage.
static OPEN: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Files this process finished capturing to, as it left them: an engine started again on the
/// same path (the device closed and opened again, or opened again after it failed) goes on at
/// the end of the file instead of truncating the frames before it, which may be what the user
/// wants to read. Only the very file, as long as it was left: one replaced since (by tcpdump,
/// say) or written to by anything else, or one whose last write failed, starts afresh.
static FINISHED: Mutex<Vec<Finished>> = Mutex::new(Vec::new());

struct Finished {
    path: PathBuf,
    /// `st_dev`, `st_ino` and length of the file when its capture ended.
    dev: u64,
    ino: u64,
    len: u64,
}

/// Longest frame written whole: a 9000-byte MTU frame with two VLAN tags fits.
const SNAPLEN: u32 = 9022;

/// The classic pcap file header's length.
const PCAP_HEADER_LEN: u64 = 24;

pub(crate) struct Capture {
    path: PathBuf,
    out: BufWriter<File>,
    /// Bytes in the current file, its header included.
    len: u64,
    /// Rotate once the file would grow beyond this many bytes (see the module's notes).
    max: Option<u64>,
    /// A write failed (disk full, say): reported once, nothing more is written.
    failed: bool,
}

/// The name a rotated capture file takes: `FILE.1`.
pub fn rotated_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_os_string();
    name.push(".1");
    PathBuf::from(name)
}

/// The size `XROCE_PCAP_MAX` (or `xroce engine --pcap-max`) gives: bytes, or a number with
/// a K, M or G suffix (KiB, MiB, GiB). Not zero: a file must hold a frame.
pub fn parse_capture_max(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let (digits, unit) = match t.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => t.split_at(i),
        None => (t, ""),
    };
    let scale: u64 = match unit.to_ascii_uppercase().as_str() {
        "" => 1,
        "K" | "KIB" => 1 << 10,
        "M" | "MIB" => 1 << 20,
        "G" | "GIB" => 1 << 30,
        _ => 0,
    };
    match digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(scale))
    {
        Some(n) if n > 0 => Ok(n),
        _ => Err(format!(
            "capture size {text:?} not understood: give bytes, or a number with K, M or G \
             (e.g. 64M), more than zero"
        )),
    }
}

impl Capture {
    /// Opens `path` for this engine's frames: a new file, or one this process captured to
    /// before (continued at its end), else truncated, with the pcap file header. Refused while
    /// another engine, in this process or another, captures to it: the file is then left as
    /// it is (`flock`: a second program started by mistake with the same `XROCE_PCAP` must
    /// not cut the first one's file under it).
    pub(crate) fn create(path: &Path, max: Option<u64>) -> io::Result<Self> {
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
        match Self::open_locked(path, max.is_some()) {
            Ok((out, len)) => Ok(Self {
                path: path.to_path_buf(),
                out,
                len,
                max,
                failed: false,
            }),
            Err(e) => {
                forget(path);
                Err(e)
            }
        }
    }

    /// The file at `path`, locked and positioned for the next frame, with its length: this
    /// process's earlier capture continued, else a fresh file with the pcap header (and,
    /// when the capture rotates, without an older run's `FILE.1`, which would pass for this
    /// run's earlier frames).
    fn open_locked(path: &Path, rotates: bool) -> io::Result<(BufWriter<File>, u64)> {
        use std::io::{Seek, SeekFrom};
        let mut file = Self::open_and_lock(path)?;
        let meta = file.metadata()?;
        let continued = {
            use std::os::unix::fs::MetadataExt;
            let mut finished = FINISHED.lock().unwrap_or_else(|p| p.into_inner());
            let at = finished.iter().position(|f| f.path == path);
            let same = at.is_some_and(|i| {
                let f = &finished[i];
                (f.dev, f.ino, f.len) == (meta.dev(), meta.ino(), meta.len())
            });
            if let Some(i) = at {
                finished.remove(i);
            }
            same && meta.len() >= PCAP_HEADER_LEN
        };
        if continued {
            let len = file.seek(SeekFrom::End(0))?;
            return Ok((BufWriter::with_capacity(1 << 16, file), len));
        }
        if rotates {
            match std::fs::remove_file(rotated_path(path)) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        Ok((Self::start(file)?, PCAP_HEADER_LEN))
    }

    /// `path` opened for writing (created if missing, not truncated) and locked against other
    /// processes' captures.
    fn open_and_lock(path: &Path) -> io::Result<File> {
        use std::os::fd::AsRawFd;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        // SAFETY: flock on a descriptor this function owns; no memory is involved.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EWOULDBLOCK) => {
                    return Err(io::Error::new(
                        io::ErrorKind::AlreadyExists,
                        "another process captures to it (give each program a file of its own)",
                    ))
                }
                // A file system without locks (some NFS set-ups): capture without the guard,
                // as before there was one, rather than refuse the device.
                Some(libc::ENOLCK | libc::EOPNOTSUPP | libc::ENOSYS) => {
                    log::debug!("capture {} not locked: {e}", path.display())
                }
                _ => return Err(e),
            }
        }
        Ok(file)
    }

    /// Empties `file` and writes the pcap file header.
    fn start(file: File) -> io::Result<BufWriter<File>> {
        file.set_len(0)?;
        let mut out = BufWriter::with_capacity(1 << 16, file);
        let mut header = PcapHeader::new();
        // Nanosecond timestamps.
        header.magic_number = 0xa1b2_3c4d;
        header.snaplen = SNAPLEN;
        header.network = Linktype::ETHERNET;
        out.write_all(&header.to_vec_raw().map_err(io::Error::other)?)?;
        out.flush()?;
        Ok(out)
    }

    /// Renames the full file to `FILE.1` and goes on in a fresh `FILE`. (Another process's
    /// capture that takes the path between the rename and the open keeps it; this capture
    /// then stops, saying why.)
    fn rotate(&mut self) -> io::Result<()> {
        self.out.flush()?;
        std::fs::rename(&self.path, rotated_path(&self.path))?;
        let file = Self::open_and_lock(&self.path)?;
        self.out = Self::start(file)?;
        self.len = PCAP_HEADER_LEN;
        Ok(())
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
            .and_then(|bytes| {
                let len = bytes.len() as u64;
                // A file holds at least one frame, however small the limit.
                if self
                    .max
                    .is_some_and(|max| self.len > PCAP_HEADER_LEN && self.len + len > max)
                {
                    self.rotate()?;
                }
                self.out.write_all(&bytes)?;
                self.len += len;
                Ok(())
            });
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
        if !self.failed {
            if let Ok(meta) = self.out.get_ref().metadata() {
                use std::os::unix::fs::MetadataExt;
                FINISHED
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(Finished {
                        path: self.path.clone(),
                        dev: meta.dev(),
                        ino: meta.ino(),
                        len: meta.len(),
                    });
            }
        }
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
            let mut c = Capture::create(&path, None).unwrap();
            // A second capture to the same file is refused while the first is open.
            let again = Capture::create(&path, None).err().expect("refused");
            assert_eq!(again.kind(), io::ErrorKind::AlreadyExists);
            for f in &sent {
                c.record(f);
            }
        }
        let (magic, got) = frames_in(&path);
        assert_eq!(magic, 0xa1b2_3c4d, "nanosecond timestamps");
        assert_eq!(got, sent);
        // Closed, the path may be captured to again by this process: the file goes on.
        {
            let mut c = Capture::create(&path, None).unwrap();
            c.record(&[0xab; 70]);
        }
        let (_, got) = frames_in(&path);
        assert_eq!(
            got.len(),
            sent.len() + 1,
            "one file header, both engines' frames"
        );
        assert_eq!(got.last().map(|f| f.len()), Some(70));
        // A file changed since (another tool wrote to it) is not continued: it starts afresh.
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(b"someone else's bytes"))
            .unwrap();
        {
            let mut c = Capture::create(&path, None).unwrap();
            c.record(&[0xcd; 80]);
        }
        let (_, got) = frames_in(&path);
        assert_eq!(
            got,
            [vec![0xcd; 80]],
            "a fresh file with the new frame alone"
        );
        let _ = std::fs::remove_file(&path);
    }

    /// A file another process captures to is left as it is: a second program started with
    /// the same `XROCE_PCAP` by mistake must not cut it under the first.
    #[test]
    fn a_file_another_process_captures_to_is_refused_and_left_whole() {
        let path =
            std::env::temp_dir().join(format!("xroce-capture-held-{}.pcap", std::process::id()));
        std::fs::write(&path, b"the other process's frames").unwrap();
        // flock(1) holds the same kind of lock as a capturing engine, from another process.
        let mut holder = std::process::Command::new("flock")
            .arg(&path)
            .args(["sleep", "30"])
            .spawn()
            .expect("run flock(1)");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let refused = loop {
            match Capture::create(&path, None) {
                Err(e) => break e,
                // flock(1) has not taken the lock yet: this one got it; let it go, try again.
                Ok(c) => {
                    drop(c);
                    std::fs::write(&path, b"the other process's frames").unwrap();
                    assert!(
                        std::time::Instant::now() < deadline,
                        "flock(1) never took the lock"
                    );
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
            }
        };
        let _ = holder.kill();
        let _ = holder.wait();
        assert_eq!(refused.kind(), io::ErrorKind::AlreadyExists, "{refused}");
        assert!(refused.to_string().contains("another process"), "{refused}");
        assert_eq!(std::fs::read(&path).unwrap(), b"the other process's frames");
        let _ = std::fs::remove_file(&path);
    }

    /// Frame lengths as the file holds them: the 16-byte record header and the frame.
    fn record_len(frame: &[u8]) -> u64 {
        16 + frame.len() as u64
    }

    #[test]
    fn a_bounded_capture_keeps_the_last_frames_in_two_files_none_over_the_bound() {
        let path =
            std::env::temp_dir().join(format!("xroce-capture-rot-{}.pcap", std::process::id()));
        let older = rotated_path(&path);
        // Another run's rotated file: a bounded capture starting afresh removes it.
        std::fs::write(&older, b"an older run's frames").unwrap();
        let max = 2_000;
        let sent: Vec<Vec<u8>> = (0..100u8)
            .map(|i| vec![i; 60 + usize::from(i % 7) * 40])
            .collect();
        {
            let mut c = Capture::create(&path, Some(max)).unwrap();
            assert!(!older.exists(), "the older run's FILE.1 is gone");
            for f in &sent {
                c.record(f);
            }
        }
        let (_, previous) = frames_in(&older);
        let (_, current) = frames_in(&path);
        assert!(!previous.is_empty() && !current.is_empty());
        // Together, the last frames sent, in order, with none missing between the files.
        let kept: Vec<Vec<u8>> = previous.iter().chain(&current).cloned().collect();
        assert_eq!(kept[..], sent[sent.len() - kept.len()..]);
        for (file, frames) in [(&older, &previous), (&path, &current)] {
            let len = std::fs::metadata(file).unwrap().len();
            assert_eq!(
                len,
                PCAP_HEADER_LEN + frames.iter().map(|f| record_len(f)).sum::<u64>()
            );
            assert!(len <= max, "{} holds {len} bytes", file.display());
        }
        // FILE.1 was full: the first frame of FILE did not fit in it.
        let full = std::fs::metadata(&older).unwrap().len() + record_len(&current[0]);
        assert!(full > max, "rotated at {full} of {max}");
        let _ = std::fs::remove_file(&path);
        let _ = std::fs::remove_file(&older);
    }

    #[test]
    fn a_frame_larger_than_the_bound_gets_a_file_of_its_own() {
        let path =
            std::env::temp_dir().join(format!("xroce-capture-big-{}.pcap", std::process::id()));
        {
            let mut c = Capture::create(&path, Some(100)).unwrap();
            c.record(&[1; 500]);
            c.record(&[2; 600]);
        }
        assert_eq!(frames_in(&rotated_path(&path)).1, [vec![1; 500]]);
        assert_eq!(frames_in(&path).1, [vec![2; 600]]);
        let _ = std::fs::remove_file(&path);
        let _ = std::fs::remove_file(rotated_path(&path));
    }

    #[test]
    fn an_unbounded_capture_leaves_a_rotated_file_alone() {
        let path =
            std::env::temp_dir().join(format!("xroce-capture-one-{}.pcap", std::process::id()));
        let older = rotated_path(&path);
        std::fs::write(&older, b"kept").unwrap();
        {
            let mut c = Capture::create(&path, None).unwrap();
            for _ in 0..50 {
                c.record(&[7; 1000]);
            }
        }
        assert_eq!(frames_in(&path).1.len(), 50);
        assert_eq!(std::fs::read(&older).unwrap(), b"kept");
        let _ = std::fs::remove_file(&path);
        let _ = std::fs::remove_file(&older);
    }

    #[test]
    fn capture_sizes_take_bytes_or_k_m_g() {
        assert_eq!(parse_capture_max("4096"), Ok(4096));
        assert_eq!(parse_capture_max("64K"), Ok(64 << 10));
        assert_eq!(parse_capture_max("16m"), Ok(16 << 20));
        assert_eq!(parse_capture_max("2G"), Ok(2 << 30));
        assert_eq!(parse_capture_max(" 8MiB "), Ok(8 << 20));
        for bad in [
            "",
            "0",
            "0M",
            "M",
            "12X",
            "-5",
            "1.5M",
            "99999999999999999999G",
        ] {
            let e = parse_capture_max(bad).expect_err(bad);
            assert!(e.contains("e.g. 64M"), "{bad}: {e}");
        }
    }

    #[test]
    fn an_unwritable_path_is_an_error_and_is_not_held() {
        let path = Path::new("/nonexistent-dir/capture.pcap");
        assert!(Capture::create(path, None).is_err());
        assert!(
            Capture::create(path, None).is_err_and(|e| e.kind() != io::ErrorKind::AlreadyExists)
        );
    }
}
