//! The UMEM: the memory a socket shares with the kernel, where received frames land and frames
//! to send are built.
//!
//! Anonymous memory, never hugetlbfs: nothing to reserve or configure on the host. A UMEM of at
//! least one transparent huge page is mapped aligned to one and the kernel is asked to back it
//! with transparent huge pages (`MADV_HUGEPAGE`). It does where its mode
//! (`/sys/kernel/mm/transparent_hugepage/enabled`) is `always` or `madvise` and it finds the
//! memory; otherwise the pages stay 4 KiB and nothing else changes.
//!
//! Why: receive frames cycle through the whole receive area (the fill ring hands them out in
//! order), so in 4 KiB pages nearly every frame is a page the TLB no longer holds, for the
//! kernel's copy into it and for the engine reading it. Backed by huge pages, a 64 B `ib_send_lat`
//! over RC ran 3-4 % faster in 17 of 17 alternating pairs, and the 64 B message rate and 64 KiB
//! streams 1-3 % faster in four of four (`docs/decisions.md`, "Stop 76").
//!
//! The pages are not touched here: registering the UMEM with a socket pins (and so faults in)
//! every one of them, and fails there if memory is short. A child process made by `fork` does
//! not inherit the UMEM (`MADV_DONTFORK`): it could not use it, and copying it would cost the
//! fork 16 MiB per socket and the parent its huge pages.

use std::io;
use std::ptr::NonNull;
use std::sync::OnceLock;

use super::socket::{XskError, FRAME_SIZE};

/// Memory the kernel writes frames into and reads frames from.
pub(super) struct Umem {
    area: NonNull<u8>,
    /// Bytes of frames.
    len: usize,
    /// Bytes mapped: `len` rounded up to whole pages.
    mapped_len: usize,
}

// SAFETY: plain memory owned by the socket; moves with it to the thread that drives it.
unsafe impl Send for Umem {}

/// The size of a page here (4 KiB on x86-64; 16 or 64 KiB on some arm64 kernels).
fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(page).unwrap_or(0).max(FRAME_SIZE as usize)
}

/// The size of a transparent huge page here, if the kernel has them.
fn huge_page_size() -> Option<usize> {
    static SIZE: OnceLock<Option<usize>> = OnceLock::new();
    *SIZE.get_or_init(|| {
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
            .ok()?
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|s| s.is_power_of_two())
    })
}

impl Umem {
    /// `frames` frames of [`FRAME_SIZE`] bytes, in transparent huge pages where the kernel
    /// gives them (see the module's comment).
    pub(super) fn new(frames: u32) -> Result<Self, XskError> {
        let len = frames as usize * FRAME_SIZE as usize;
        let failed = |source| XskError::Umem { bytes: len, source };
        let too_big = || failed(io::Error::from(io::ErrorKind::OutOfMemory));
        // Mapped and unmapped in whole pages, which may be larger than a frame.
        let mapped_len = len
            .checked_next_multiple_of(page_size())
            .ok_or_else(too_big)?;
        let huge = huge_page_size().filter(|&h| mapped_len >= h);
        // Room to align the start to a huge page; the slack is unmapped below.
        let slack = huge.unwrap_or(0);
        let reserved = mapped_len.checked_add(slack).ok_or_else(too_big)?;
        // SAFETY: anonymous private mapping; no file, no aliasing.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                reserved,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(failed(io::Error::last_os_error()));
        }
        let start = p as usize;
        let aligned = match huge {
            Some(h) => start.next_multiple_of(h),
            None => start,
        };
        let Some(area) = NonNull::new(aligned as *mut u8) else {
            // SAFETY: the whole mapping just made, which nothing refers to.
            unsafe { libc::munmap(p, reserved) };
            return Err(too_big());
        };
        let head = aligned - start;
        let tail = slack - head;
        // SAFETY: both ranges lie inside the mapping just made, outside the part kept
        // ([aligned, aligned + mapped_len), all whole pages), and nothing refers to them.
        unsafe {
            if head > 0 {
                let rc = libc::munmap(p, head);
                debug_assert_eq!(rc, 0, "unmapping the slack before the UMEM");
            }
            if tail > 0 {
                let rc = libc::munmap((aligned + mapped_len) as *mut libc::c_void, tail);
                debug_assert_eq!(rc, 0, "unmapping the slack after the UMEM");
            }
        }
        // SAFETY: advice on the mapping just made; it changes no contents.
        unsafe {
            // Not inherited by a child process: the child cannot use its parent's engine (the
            // provider refuses its verbs), while a fork would copy every pinned page of the
            // UMEM into it at once, and split the parent's huge pages.
            libc::madvise(area.as_ptr().cast(), mapped_len, libc::MADV_DONTFORK);
            if huge.is_some() {
                // A hint. Where the mode is `never` the kernel records it but backs the UMEM
                // with ordinary pages, which work the same. (A kernel without transparent huge
                // pages has no `hpage_pmd_size`, so `huge` is `None` there.)
                libc::madvise(area.as_ptr().cast(), mapped_len, libc::MADV_HUGEPAGE);
            }
        }
        Ok(Self {
            area,
            len,
            mapped_len,
        })
    }

    /// Where the UMEM starts in this process (for `XDP_UMEM_REG`).
    pub(super) fn base(&self) -> *mut u8 {
        self.area.as_ptr()
    }

    /// Its length in bytes.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The bytes at UMEM address `addr`, `len` long, if they lie inside the UMEM.
    pub(super) fn slice(&self, addr: u64, len: u32) -> Option<&[u8]> {
        let start = self.start_of(addr, len)?;
        // SAFETY: in bounds (`start_of`); the kernel finished writing this frame before it
        // published the descriptor, and we do not hand the frame back until the slice is gone.
        Some(unsafe { std::slice::from_raw_parts(start, len as usize) })
    }

    /// The address of UMEM address `addr`, if `len` bytes from there lie inside the UMEM. On
    /// its own for frames that may be the kernel's again (see `eviction`): no slice may cover
    /// those.
    pub(super) fn start_of(&self, addr: u64, len: u32) -> Option<*const u8> {
        let end = addr.checked_add(u64::from(len))?;
        if end > self.len as u64 {
            return None;
        }
        // In bounds (checked above), so inside the mapping.
        Some(self.area.as_ptr().wrapping_add(addr as usize).cast_const())
    }

    pub(super) fn slice_mut(&mut self, addr: u64, len: u32) -> Option<&mut [u8]> {
        let start = self.start_of(addr, len)?.cast_mut();
        // SAFETY: in bounds (`start_of`), in the writable mapping; the frame is ours (on the
        // free list), the kernel does not touch it.
        Some(unsafe { std::slice::from_raw_parts_mut(start, len as usize) })
    }
}

impl Drop for Umem {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the area `new` kept, which nothing of ours uses any more
        // (in a forked child, where it was never mapped, this unmaps nothing).
        // The kernel pins the pages of a registered UMEM and releases them itself once the
        // socket is gone (zero-copy teardown may finish later), so it never writes into freed
        // memory; the socket is closed first anyway (field order in `XskSocket`, declaration
        // order in `open_with`).
        unsafe {
            libc::munmap(self.area.as_ptr().cast(), self.mapped_len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The flags (`VmFlags`) of the mapping in /proc/self/smaps that holds `addr`.
    fn vm_flags_at(addr: usize) -> Vec<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((a, b)) = range.split_once('-') {
                    if let (Ok(a), Ok(b)) =
                        (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
                    {
                        inside = (a..b).contains(&addr);
                        continue;
                    }
                }
            }
            if inside {
                if let Some(flags) = line.strip_prefix("VmFlags:") {
                    return flags.split_whitespace().map(str::to_string).collect();
                }
            }
        }
        panic!("no mapping holds {addr:#x}");
    }

    #[test]
    fn a_umem_of_a_huge_page_or_more_starts_on_one_and_asks_for_them_and_no_umem_is_forked() {
        let Some(huge) = huge_page_size().filter(|&h| h <= 32 << 20) else {
            // (arm64 with 64 KiB pages has 512 MiB ones: too much for a unit test.)
            eprintln!("skipped: this kernel has no transparent huge pages of 32 MiB or less");
            return;
        };
        let frames = (2 * huge / FRAME_SIZE as usize) as u32;
        let mut umem = Umem::new(frames).expect("UMEM");
        let base = umem.base() as usize;
        assert_eq!(base % huge, 0, "aligned to a huge page");
        assert_eq!(umem.len(), 2 * huge);
        let flags = vm_flags_at(base);
        assert!(flags.iter().any(|f| f == "hg"), "MADV_HUGEPAGE: {flags:?}");
        assert!(flags.iter().any(|f| f == "dc"), "MADV_DONTFORK: {flags:?}");
        // Every byte is usable, to the last.
        let last = (umem.len() - 1) as u64;
        umem.slice_mut(last, 1).expect("last byte")[0] = 7;
        assert_eq!(umem.slice(last, 1).expect("last byte"), &[7]);
        assert!(umem.slice(last, 2).is_none(), "past the end");

        // A smaller one is left in ordinary pages: aligning it would cost more than it maps.
        // Not inherited by a child either.
        let small = Umem::new(8).expect("UMEM");
        let flags = vm_flags_at(small.base() as usize);
        assert!(!flags.iter().any(|f| f == "hg"), "{flags:?}");
        assert!(flags.iter().any(|f| f == "dc"), "MADV_DONTFORK: {flags:?}");
    }
}
