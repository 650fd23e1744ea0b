//! Application memory as the transport reaches it inside one process.
//!
//! Verbs register memory by address: the application promises that `[addr, addr + len)` stays
//! valid while the region is registered, and the device reads and writes it directly (a NIC by
//! DMA, the engine by pointer). The transport checks keys, bounds and rights before every access;
//! this map checks again that the bytes lie inside a registered range, so a transport bug cannot
//! turn into a wild write.

use xroce_core::transport::{HostMemory, MemFault};

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
}

impl ProcessMemory {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a registration of `[addr, addr + len)`.
    ///
    /// # Safety
    /// The caller promises the range is memory of this process, readable and writable, and stays
    /// so until `remove` is called for it; writes into it from the engine thread may happen at
    /// any time until then (as from a NIC).
    pub unsafe fn add(&mut self, addr: u64, len: u64) {
        if len == 0 {
            return;
        }
        let end = addr.saturating_add(len);
        // Registrations are usually disjoint; keep exact duplicates as one counted entry and
        // otherwise store separately (lookups scan the few ranges containing an address).
        if let Some(r) = self
            .ranges
            .iter_mut()
            .find(|r| r.start == addr && r.end == end)
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
            },
        );
    }

    /// Forgets one registration of `[addr, addr + len)`.
    pub fn remove(&mut self, addr: u64, len: u64) {
        let end = addr.saturating_add(len);
        if let Some(i) = self
            .ranges
            .iter()
            .position(|r| r.start == addr && r.end == end)
        {
            if self.ranges[i].refs > 1 {
                self.ranges[i].refs -= 1;
            } else {
                self.ranges.remove(i);
            }
        }
    }

    fn covered(&self, addr: u64, len: usize) -> bool {
        let Some(end) = addr.checked_add(len as u64) else {
            return false;
        };
        // The last range starting at or before `addr` that contains the whole access.
        let upto = self.ranges.partition_point(|r| r.start <= addr);
        self.ranges[..upto].iter().rev().any(|r| end <= r.end)
    }
}

impl HostMemory for ProcessMemory {
    fn read(&self, addr: u64, out: &mut [u8]) -> Result<(), MemFault> {
        if out.is_empty() {
            return Ok(());
        }
        if !self.covered(addr, out.len()) {
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

    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), MemFault> {
        if data.is_empty() {
            return Ok(());
        }
        if !self.covered(addr, data.len()) {
            return Err(MemFault {
                addr,
                len: data.len(),
            });
        }
        // SAFETY: as in `read`; the application granted write access by registering.
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
        unsafe { mem.add(base + 8, 16) };
        assert!(mem.write(base + 8, &[7; 16]).is_ok());
        assert!(mem.write(base + 7, &[7; 2]).is_err());
        assert!(mem.write(base + 20, &[7; 5]).is_err());
        let mut out = [0u8; 4];
        mem.read(base + 10, &mut out).unwrap();
        assert_eq!(out, [7; 4]);
        mem.remove(base + 8, 16);
        assert!(mem.read(base + 10, &mut out).is_err());
        assert_eq!(buf[8], 7);
        assert_eq!(buf[7], 0);
    }
}
