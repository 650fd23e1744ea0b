//! Application memory as the transport reaches it inside one process.
//!
//! Verbs register memory by address: the application promises that `[addr, addr + len)` stays
//! valid while the region is registered, and the device reads and writes it directly (a NIC by
//! DMA, the engine by pointer). The transport checks keys, bounds and rights before every access;
//! this map checks again that the bytes lie inside a registered range, and that a write lands
//! in one registered for writing (`IBV_ACCESS_LOCAL_WRITE`, which every right to write implies),
//! so a transport bug cannot turn into a wild write, nor into a write to memory the application
//! registered read-only (which may be mapped read-only: the write would kill the process).

use xroce_core::transport::{HostMemory, MemFault};

use super::hashing_copy::{copy_hashing, fold_here};

/// Registered address ranges of this process, with how many registrations cover each.
#[derive(Debug, Default)]
pub struct ProcessMemory {
    /// (start, end, registrations), sorted by start; ranges never overlap (overlapping
    /// registrations are merged into one entry counted once per registration).
    ranges: Vec<Range>,
}

#[derive(Debug, Clone, Copy)]
struct Range {
    start: u64,
    end: u64,
    refs: u32,
    /// Registered with local write access.
    writable: bool,
}

impl ProcessMemory {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a registration of `[addr, addr + len)`, `writable` when it was registered with
    /// local write access.
    ///
    /// # Safety
    /// The caller promises the range is memory of this process, readable (and writable, when
    /// `writable`), and stays so until `remove` is called for it; accesses from the engine
    /// thread may happen at any time until then (as from a NIC).
    pub unsafe fn add(&mut self, addr: u64, len: u64, writable: bool) {
        if len == 0 {
            return;
        }
        let end = addr.saturating_add(len);
        // Registrations are usually disjoint; keep exact duplicates as one counted entry and
        // otherwise store separately (lookups scan the few ranges containing an address).
        if let Some(r) = self
            .ranges
            .iter_mut()
            .find(|r| r.start == addr && r.end == end && r.writable == writable)
        {
            r.refs += 1;
            return;
        }
        let at = self.ranges.partition_point(|r| r.start < addr);
        self.ranges.insert(
            at,
            Range {
                start: addr,
                end,
                refs: 1,
                writable,
            },
        );
    }

    /// Forgets one registration of `[addr, addr + len)` made with `writable`.
    pub fn remove(&mut self, addr: u64, len: u64, writable: bool) {
        let end = addr.saturating_add(len);
        if let Some(i) = self
            .ranges
            .iter()
            .position(|r| r.start == addr && r.end == end && r.writable == writable)
        {
            if self.ranges[i].refs > 1 {
                self.ranges[i].refs -= 1;
            } else {
                self.ranges.remove(i);
            }
        }
    }

    /// One registration contains all of `[addr, addr + len)` (one registered for writing, when
    /// `write`).
    fn covered(&self, addr: u64, len: usize, write: bool) -> bool {
        let Some(end) = addr.checked_add(len as u64) else {
            return false;
        };
        // The ranges starting at or before `addr`, one of which must contain the whole access.
        let upto = self.ranges.partition_point(|r| r.start <= addr);
        self.ranges[..upto]
            .iter()
            .rev()
            .any(|r| end <= r.end && (r.writable || !write))
    }
}

impl HostMemory for ProcessMemory {
    fn read(&self, addr: u64, out: &mut [u8]) -> Result<(), MemFault> {
        if out.is_empty() {
            return Ok(());
        }
        if !self.covered(addr, out.len(), false) {
            return Err(MemFault {
                addr,
                len: out.len(),
            });
        }
        // SAFETY: the range lies inside a registration, which the application promised (see
        // `add`) is valid memory of this process until deregistered.
        unsafe {
            std::ptr::copy_nonoverlapping(addr as usize as *const u8, out.as_mut_ptr(), out.len())
        };
        Ok(())
    }

    fn read_hashing(&self, addr: u64, out: &mut [u8], crc: u32) -> Result<u32, MemFault> {
        if out.is_empty() {
            return Ok(crc);
        }
        if !self.covered(addr, out.len(), false) {
            return Err(MemFault {
                addr,
                len: out.len(),
            });
        }
        // SAFETY: as in `read`: the range lies inside a registration, which the application
        // leaves alone while it is sent.
        Ok(unsafe { copy_hashing(addr as usize as *const u8, out, crc) })
    }

    fn hashes_as_it_copies(&self) -> bool {
        fold_here().is_some()
    }

    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), MemFault> {
        if data.is_empty() {
            return Ok(());
        }
        if !self.covered(addr, data.len(), true) {
            return Err(MemFault {
                addr,
                len: data.len(),
            });
        }
        // SAFETY: as in `read`, in a registration made with local write access, which the
        // application may only ask for on memory it can write (see `add`).
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), addr as usize as *mut u8, data.len())
        };
        Ok(())
    }
}

/// The calling application's memory, read through the pointers it passed in a verb call: the
/// source of `IBV_SEND_INLINE` data, which verbs does not require to be registered. Only ever
/// used during that call, through [`Engine::post_send_caller_inline`](super::Engine), whose
/// contract makes the pointers valid.
pub(crate) struct CallerMemory;

impl HostMemory for CallerMemory {
    fn read(&self, addr: u64, out: &mut [u8]) -> Result<(), MemFault> {
        if out.is_empty() {
            return Ok(());
        }
        if addr == 0 {
            return Err(MemFault {
                addr,
                len: out.len(),
            });
        }
        // SAFETY: `post_send_caller_inline`'s contract: the application's inline SGEs name
        // readable memory for the duration of the call, and this runs inside that call.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), MemFault> {
        // Inline data is only ever read.
        Err(MemFault {
            addr,
            len: data.len(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accesses_outside_registrations_fault_and_inside_work() {
        let mut buf = vec![0u8; 64];
        let base = buf.as_mut_ptr() as u64;
        let mut mem = ProcessMemory::new();
        assert!(mem.write(base, &[1]).is_err());
        // SAFETY: `buf` outlives `mem`'s use below and is removed before it is dropped.
        unsafe { mem.add(base + 8, 16, true) };
        assert!(mem.write(base + 8, &[7; 16]).is_ok());
        assert!(mem.write(base + 7, &[7; 2]).is_err());
        assert!(mem.write(base + 20, &[7; 5]).is_err());
        let mut out = [0u8; 4];
        mem.read(base + 10, &mut out).unwrap();
        assert_eq!(out, [7; 4]);
        mem.remove(base + 8, 16, true);
        assert!(mem.read(base + 10, &mut out).is_err());
        assert_eq!(buf[8], 7);
        assert_eq!(buf[7], 0);
    }

    /// A range registered without local write access is read but never written, even where a
    /// writable registration of other bytes lies next to it.
    #[test]
    fn a_read_only_registration_is_never_written() {
        let mut buf = vec![0u8; 64];
        let base = buf.as_mut_ptr() as u64;
        let mut mem = ProcessMemory::new();
        // SAFETY: `buf` outlives `mem`'s use below; both ranges are removed before it is
        // dropped.
        unsafe {
            mem.add(base, 32, false);
            mem.add(base + 32, 16, true);
        }
        assert!(mem.write(base + 4, &[9; 4]).is_err());
        assert!(mem.write(base + 28, &[9; 8]).is_err(), "across the two");
        assert!(mem.write(base + 32, &[9; 8]).is_ok());
        let mut out = [0u8; 4];
        assert!(mem.read(base + 4, &mut out).is_ok());
        // The same bytes registered for writing as well: now they may be written.
        // SAFETY: as above.
        unsafe { mem.add(base, 32, true) };
        assert!(mem.write(base + 4, &[9; 4]).is_ok());
        mem.remove(base, 32, true);
        assert!(
            mem.write(base + 4, &[8; 4]).is_err(),
            "the read-only one stays"
        );
        mem.remove(base, 32, false);
        mem.remove(base + 32, 16, true);
        assert!(mem.read(base + 4, &mut out).is_err());
        assert_eq!(&buf[..12], &[0, 0, 0, 0, 9, 9, 9, 9, 0, 0, 0, 0]);
    }
}
