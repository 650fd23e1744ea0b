//! `xroce pcap check`: decode every RoCEv2 packet of a capture and verify its ICRC.

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use xroce_core::wire::{RoceFrame, WireError};

use crate::capture::{self, CapturedPacket, LinkLayer};

/// Exit status: every RoCEv2 packet verified.
pub const EXIT_OK: i32 = 0;
/// Exit status: at least one RoCEv2 packet failed verification or was malformed.
pub const EXIT_BAD: i32 = 1;
/// Exit status: at least one file could not be read as a capture.
pub const EXIT_UNREADABLE: i32 = 2;
/// Exit status: the files held no RoCEv2 packet, so nothing was verified.
pub const EXIT_NO_ROCE: i32 = 3;

#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Print only failing packets and the summary.
    pub quiet: bool,
}

/// Counts for one file (or all of them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Summary {
    pub packets: usize,
    pub ok: usize,
    pub bad: usize,
    pub not_roce: usize,
}

impl Summary {
    fn add(&mut self, o: &Summary) {
        self.packets += o.packets;
        self.ok += o.ok;
        self.bad += o.bad;
        self.not_roce += o.not_roce;
    }
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} packets, {} ICRC ok, {} bad, {} not RoCEv2",
            self.packets, self.ok, self.bad, self.not_roce
        )
    }
}

/// What one captured packet turned out to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// A RoCEv2 packet that verifies; the decoded line.
    Ok(String),
    /// A RoCEv2 packet that does not verify or cannot be decoded; what is known and why.
    Bad(String),
    NotRoce,
}

/// Decodes and verifies one captured packet.
pub fn check_packet(p: &CapturedPacket) -> Verdict {
    let parsed = match p.link {
        LinkLayer::Ethernet => RoceFrame::parse_ethernet(&p.data),
        link => match capture::ip_offset(link, &p.data) {
            Some(at) => match p.data.get(at..) {
                Some(ip) => RoceFrame::parse_ip(ip),
                None => return Verdict::NotRoce,
            },
            None => return Verdict::NotRoce,
        },
    };
    let frame = match parsed {
        Ok(f) => f,
        Err(WireError::NotRoce(_)) => return Verdict::NotRoce,
        Err(e) if p.data.len() < p.original_len => {
            return Verdict::Bad(format!(
                "captured only {} of {} bytes (snap length too short): {e}",
                p.data.len(),
                p.original_len
            ))
        }
        Err(e) => return Verdict::Bad(format!("malformed RoCEv2 packet: {e}")),
    };
    match frame.verify() {
        Ok(()) => Verdict::Ok(format!("{frame} icrc=ok")),
        Err(WireError::Icrc { computed, stored }) => Verdict::Bad(format!(
            "{frame} ICRC BAD (computed {computed:#010x}, packet has {stored:#010x})"
        )),
        Err(e) => {
            let icrc = if frame.icrc_ok() { "ok" } else { "BAD" };
            Verdict::Bad(format!("{frame} {e} (icrc={icrc})"))
        }
    }
}

/// Checks one file, writing a line per RoCEv2 packet and the summary line. Returns the counts,
/// or the error that made the file unreadable (after reporting the packets it did hold).
pub fn check_file(
    path: &Path,
    opts: &Options,
    out: &mut dyn Write,
) -> io::Result<(Summary, Option<String>)> {
    let (packets, error) = match capture::read_file(path) {
        Ok(p) => (p, None),
        Err(e) => (e.packets, Some(e.message)),
    };
    let start = packets.first().map_or(0, |p| p.timestamp_ns);
    let mut s = Summary::default();
    let mut bad_indices = Vec::new();
    for (i, p) in packets.iter().enumerate() {
        let n = i + 1;
        s.packets += 1;
        let t = p.timestamp_ns.saturating_sub(start);
        let when = format!("{}.{:06}", t / 1_000_000_000, (t % 1_000_000_000) / 1000);
        match check_packet(p) {
            Verdict::Ok(line) => {
                s.ok += 1;
                if !opts.quiet {
                    writeln!(out, "#{n:<5} {when:>12} {line}")?;
                }
            }
            Verdict::Bad(line) => {
                s.bad += 1;
                bad_indices.push(n);
                writeln!(out, "#{n:<5} {when:>12} {line}")?;
            }
            Verdict::NotRoce => s.not_roce += 1,
        }
    }
    if !bad_indices.is_empty() {
        let list: Vec<String> = bad_indices.iter().map(|n| format!("#{n}")).collect();
        writeln!(
            out,
            "{}: {} bad RoCEv2 packet(s): {}",
            path.display(),
            bad_indices.len(),
            list.join(", ")
        )?;
    }
    // A file that held nothing readable gets no count line: its error says it all (a file cut
    // short still reports the packets before the cut).
    if error.is_none() || s.packets > 0 {
        writeln!(out, "{s}")?;
    }
    Ok((s, error))
}

/// Runs `xroce pcap check` over `files`; returns the exit status.
pub fn run(files: &[PathBuf], opts: &Options, out: &mut dyn Write, err: &mut dyn Write) -> i32 {
    let mut total = Summary::default();
    let mut unreadable = false;
    // Once the reader stops reading (`| head`), the rest is checked without output: the exit
    // status still says what the files held.
    let mut sink = io::sink();
    let mut out = out;
    for path in files {
        if files.len() > 1 {
            let _ = writeln!(out, "== {} ==", path.display());
        }
        let checked = match check_file(path, opts, out) {
            Err(e) if e.kind() == io::ErrorKind::BrokenPipe => {
                out = &mut sink;
                check_file(path, opts, out)
            }
            r => r,
        };
        match checked {
            Ok((s, error)) => {
                total.add(&s);
                if let Some(msg) = error {
                    unreadable = true;
                    let _ = writeln!(err, "xroce pcap check: {}: {msg}", path.display());
                }
            }
            Err(e) => {
                let _ = writeln!(err, "xroce pcap check: writing output: {e}");
                return EXIT_UNREADABLE;
            }
        }
    }
    if files.len() > 1 {
        let _ = writeln!(out, "total: {total}");
    }
    if unreadable {
        EXIT_UNREADABLE
    } else if total.bad > 0 {
        EXIT_BAD
    } else if total.ok == 0 {
        let _ = writeln!(
            err,
            "xroce pcap check: no RoCEv2 packet (UDP port 4791) in the capture, so nothing was \
             verified. tcpdump on the interface an xroce device runs on does not see xroce's \
             frames (the XDP program takes them first): capture them with \
             `XROCE_PCAP=FILE xroce exec -- PROGRAM`, or on the peer's side of the link."
        );
        EXIT_NO_ROCE
    } else {
        EXIT_OK
    }
}
