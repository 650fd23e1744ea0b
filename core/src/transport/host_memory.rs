//! Access to the bytes behind registered memory.
//!
//! The transport decides *whether* an access is allowed (keys, protection domain, bounds, rights:
//! see [`super::memory`]); a [`HostMemory`] performs it. The engine implements it over the
//! application's address space; the simulator and tests use [`VecMemory`].

use crate::wire::FrameWriter;

/// An access the host could not perform (an address nothing backs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("no host memory at {addr:#x}+{len}")]
pub struct MemFault {
    pub addr: u64,
    pub len: usize,
}

/// Payloads of at least this many bytes are hashed for the ICRC as they are copied into a frame
/// ([`HostMemory::read_hashing`]). Below, the calls that continue a CRC cost more than a second
/// pass over the bytes.
const HASHED_COPY_MIN: usize = 512;

/// Whether the payload of `writer`'s frame is to be hashed for its ICRC as it is copied in
/// from `host`: if so, the CRC over its headers, which [`read_maybe_hashing`] continues and
/// [`FrameWriter::finish_hashed`] completes. Only for long payloads, memory that
/// [`HostMemory::hashes_as_it_copies`], and the carry-less CRC code.
pub(crate) fn payload_hash_start(host: &dyn HostMemory, writer: &FrameWriter) -> Option<u32> {
    (writer.payload_len() >= HASHED_COPY_MIN && host.hashes_as_it_copies())
        .then(|| writer.crc_before_payload())
        .flatten()
}

/// [`HostMemory::read`], or with `hash` [`HostMemory::read_hashing`] continuing it; the CRC
/// after the bytes read, if one was given.
pub(crate) fn read_maybe_hashing(
    host: &dyn HostMemory,
    addr: u64,
    out: &mut [u8],
    hash: Option<u32>,
) -> Result<Option<u32>, MemFault> {
    match hash {
        Some(crc) => host.read_hashing(addr, out, crc).map(Some),
        None => host.read(addr, out).map(|()| None),
    }
}

/// The bytes behind memory regions, addressed by the virtual addresses applications use.
pub trait HostMemory {
    fn read(&self, addr: u64, out: &mut [u8]) -> Result<(), MemFault>;
    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), MemFault>;

    /// [`read`](Self::read), and the CRC-32 (zlib's value) of `crc`'s message followed by the
    /// bytes read: how a payload is copied into a frame and hashed for its ICRC
    /// ([`crate::icrc::crc_before_payload`]), when [`hashes_as_it_copies`](Self::hashes_as_it_copies).
    fn read_hashing(&self, addr: u64, out: &mut [u8], crc: u32) -> Result<u32, MemFault> {
        self.read(addr, out)?;
        Ok(crate::icrc::crc32_continue(crc, out))
    }

    /// Whether long payloads are to be read with [`read_hashing`](Self::read_hashing) rather
    /// than read and then hashed with the rest of their packet: memory that copies and hashes
    /// in one pass faster than the two apart (the engine's, on a CPU where its fused loop
    /// wins) says so.
    fn hashes_as_it_copies(&self) -> bool {
        false
    }
}

/// Host memory made of separate byte vectors at chosen base addresses.
#[derive(Debug, Default, Clone)]
pub struct VecMemory {
    /// (base, bytes), sorted by base, not overlapping.
    areas: Vec<(u64, Vec<u8>)>,
}

impl VecMemory {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `len` zero bytes at `base`. Panics if the area overlaps an existing one (a test bug).
    pub fn add(&mut self, base: u64, len: usize) {
        let end = base + len as u64;
        assert!(
            self.areas
                .iter()
                .all(|(b, v)| end <= *b || base >= *b + v.len() as u64),
            "overlapping host memory areas"
        );
        let at = self.areas.partition_point(|(b, _)| *b < base);
        self.areas.insert(at, (base, vec![0; len]));
    }

    /// The whole area starting at `base`.
    pub fn area(&self, base: u64) -> Option<&[u8]> {
        self.areas
            .iter()
            .find(|(b, _)| *b == base)
            .map(|(_, v)| v.as_slice())
    }

    pub fn area_mut(&mut self, base: u64) -> Option<&mut [u8]> {
        self.areas
            .iter_mut()
            .find(|(b, _)| *b == base)
            .map(|(_, v)| v.as_mut_slice())
    }

    fn locate(&self, addr: u64, len: usize) -> Option<(usize, usize)> {
        let i = self
            .areas
            .partition_point(|(b, _)| *b <= addr)
            .checked_sub(1)?;
        let (base, v) = &self.areas[i];
        let off = usize::try_from(addr - base).ok()?;
        (off.checked_add(len)? <= v.len()).then_some((i, off))
    }
}

impl HostMemory for VecMemory {
    fn read(&self, addr: u64, out: &mut [u8]) -> Result<(), MemFault> {
        let (i, off) = self.locate(addr, out.len()).ok_or(MemFault {
            addr,
            len: out.len(),
        })?;
        out.copy_from_slice(&self.areas[i].1[off..off + out.len()]);
        Ok(())
    }

    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), MemFault> {
        let (i, off) = self.locate(addr, data.len()).ok_or(MemFault {
            addr,
            len: data.len(),
        })?;
        self.areas[i].1[off..off + data.len()].copy_from_slice(data);
        Ok(())
    }

    /// The simulator takes the path the engine takes on its hosts, so that the transport's
    /// tests cover the ICRC hashed around a gathered payload.
    fn hashes_as_it_copies(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_and_writes_inside_areas_only() {
        let mut m = VecMemory::new();
        m.add(0x1000, 16);
        m.add(0x3000, 8);
        m.write(0x1004, b"abcd").unwrap();
        let mut b = [0u8; 4];
        m.read(0x1004, &mut b).unwrap();
        assert_eq!(&b, b"abcd");
        assert!(m.write(0x100e, b"xyz").is_err(), "crosses the end");
        assert!(m.read(0x2000, &mut b).is_err(), "between areas");
        assert!(m.read(0x0fff, &mut b).is_err(), "before the first");
        m.write(0x3000, &[1; 8]).unwrap();
        assert_eq!(m.area(0x3000).unwrap(), &[1; 8]);
    }
}
