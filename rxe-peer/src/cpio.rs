//! Writing initramfs archives: the "newc" cpio format the kernel unpacks (ASCII hex headers,
//! names and data padded to four bytes, a `TRAILER!!!` entry at the end). Several archives
//! concatenated into one initrd are unpacked in order, so per-boot files can follow a cached
//! base archive.

use std::io::{self, Write};

/// An archive being written to `W`.
pub struct CpioWriter<W: Write> {
    out: W,
    ino: u32,
    written: u64,
}

impl<W: Write> CpioWriter<W> {
    pub fn new(out: W) -> Self {
        CpioWriter {
            out,
            ino: 1,
            written: 0,
        }
    }

    /// A directory (parents must come first).
    pub fn dir(&mut self, path: &str, mode: u32) -> io::Result<()> {
        self.entry(path, 0o040000 | (mode & 0o7777), &[])
    }

    /// A regular file.
    pub fn file(&mut self, path: &str, mode: u32, data: &[u8]) -> io::Result<()> {
        self.entry(path, 0o100000 | (mode & 0o7777), data)
    }

    /// A symbolic link pointing at `target`.
    pub fn symlink(&mut self, path: &str, target: &str) -> io::Result<()> {
        self.entry(path, 0o120777, target.as_bytes())
    }

    /// Ends the archive and returns the writer.
    pub fn finish(mut self) -> io::Result<W> {
        self.entry("TRAILER!!!", 0, &[])?;
        Ok(self.out)
    }

    fn entry(&mut self, path: &str, mode: u32, data: &[u8]) -> io::Result<()> {
        let name = path.trim_start_matches('/');
        let name = if name.is_empty() { "." } else { name };
        let namesize = name.len() + 1;
        let ino = self.ino;
        self.ino += 1;
        let header = format!(
            "070701{ino:08x}{mode:08x}{uid:08x}{gid:08x}{nlink:08x}{mtime:08x}{size:08x}\
             {devmajor:08x}{devminor:08x}{rdevmajor:08x}{rdevminor:08x}{namesize:08x}{check:08x}",
            uid = 0,
            gid = 0,
            nlink = if mode & 0o170000 == 0o040000 { 2 } else { 1 },
            mtime = 0,
            size = data.len(),
            devmajor = 0,
            devminor = 0,
            rdevmajor = 0,
            rdevminor = 0,
            check = 0,
        );
        self.put(header.as_bytes())?;
        self.put(name.as_bytes())?;
        self.put(&[0])?;
        self.pad()?;
        self.put(data)?;
        self.pad()
    }

    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.out.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    fn pad(&mut self) -> io::Result<()> {
        let n = (4 - (self.written % 4) as usize) % 4;
        self.put(&[0u8; 3][..n])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads back what the writer made (the format as the kernel's `init/initramfs.c` parses
    /// it): (name, mode, data) per entry.
    fn parse(mut b: &[u8]) -> Vec<(String, u32, Vec<u8>)> {
        let mut out = Vec::new();
        let mut offset = 0usize;
        loop {
            assert_eq!(&b[..6], b"070701", "magic at {offset}");
            let field = |i: usize| {
                u32::from_str_radix(std::str::from_utf8(&b[6 + 8 * i..14 + 8 * i]).unwrap(), 16)
                    .unwrap()
            };
            let mode = field(1);
            let size = field(6) as usize;
            let namesize = field(11) as usize;
            let name_end = 110 + namesize;
            let name = String::from_utf8(b[110..name_end - 1].to_vec()).unwrap();
            let data_start = (offset + name_end).div_ceil(4) * 4 - offset;
            let data = b[data_start..data_start + size].to_vec();
            let next = (offset + data_start + size).div_ceil(4) * 4 - offset;
            b = &b[next..];
            offset += next;
            if name == "TRAILER!!!" {
                assert!(b.is_empty());
                return out;
            }
            out.push((name, mode, data));
        }
    }

    #[test]
    fn entries_round_trip_with_alignment() {
        let mut w = CpioWriter::new(Vec::new());
        w.dir("/bin", 0o755).unwrap();
        w.file("/bin/a", 0o755, b"abc").unwrap();
        w.file("init", 0o700, b"#!/bin/bash\n").unwrap();
        w.symlink("/bin/sh", "bash").unwrap();
        let bytes = w.finish().unwrap();
        assert_eq!(bytes.len() % 4, 0);
        let entries = parse(&bytes);
        assert_eq!(
            entries,
            vec![
                ("bin".into(), 0o040755, vec![]),
                ("bin/a".into(), 0o100755, b"abc".to_vec()),
                ("init".into(), 0o100700, b"#!/bin/bash\n".to_vec()),
                ("bin/sh".into(), 0o120777, b"bash".to_vec()),
            ]
        );
    }
}
