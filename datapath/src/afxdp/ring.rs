//! The four single-producer/single-consumer rings an AF_XDP socket shares with the kernel.
//!
//! Each ring is an mmap of the socket at a fixed page offset: a producer index, a consumer index,
//! a flags word (where the kernel says it needs a wakeup) and a power-of-two array of entries. We
//! produce into the fill and TX rings and consume from the RX and completion rings. Indices are
//! free-running `u32`s; the entry is `index & mask`.

use std::io;
use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

/// One mmap'd ring. `T` is `u64` (UMEM addresses: fill, completion) or `libc::xdp_desc` (RX, TX).
pub(crate) struct Ring<T> {
    map: NonNull<u8>,
    map_len: usize,
    producer: NonNull<AtomicU32>,
    consumer: NonNull<AtomicU32>,
    flags: NonNull<AtomicU32>,
    entries: NonNull<T>,
    mask: u32,
    size: u32,
    /// Our copy of the index we advance (producer for fill/TX, consumer for RX/completion).
    local: u32,
    /// The last value read of the index the kernel advances.
    cached_remote: u32,
}

// SAFETY: the ring is plain shared memory; it moves with its socket, which one thread at a time
// uses through `&mut` (the progress thread, or an application thread in a verb, under the
// engine lock), and the kernel side synchronises through the atomics.
unsafe impl<T> Send for Ring<T> {}

impl<T: Copy> Ring<T> {
    /// Maps a ring of `size` entries of socket `fd` at page offset `pgoff`, laid out as `off` says.
    pub(crate) fn map(
        fd: RawFd,
        size: u32,
        pgoff: u64,
        off: &libc::xdp_ring_offset,
    ) -> io::Result<Self> {
        let map_len = off.desc as usize + size as usize * std::mem::size_of::<T>();
        // SAFETY: a fresh shared mapping of the socket's ring; the kernel validated `size` when
        // the ring was created and the length covers exactly the entries it allocated.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd,
                pgoff as libc::off_t,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let map = NonNull::new(base.cast::<u8>()).ok_or_else(io::Error::last_os_error)?;
        let at = |o: u64| {
            // SAFETY: the offsets come from XDP_MMAP_OFFSETS and lie inside the mapping.
            unsafe { map.add(o as usize) }
        };
        let producer = at(off.producer).cast();
        let consumer = at(off.consumer).cast();
        let flags = at(off.flags).cast();
        let entries = at(off.desc).cast();
        Ok(Self {
            map,
            map_len,
            producer,
            consumer,
            flags,
            entries,
            mask: size - 1,
            size,
            // A fresh socket's rings start with both indices at zero.
            local: 0,
            cached_remote: 0,
        })
    }

    fn producer(&self) -> &AtomicU32 {
        // SAFETY: points into the live mapping, 4-byte aligned by the kernel's layout.
        unsafe { self.producer.as_ref() }
    }

    fn consumer(&self) -> &AtomicU32 {
        // SAFETY: as for `producer`.
        unsafe { self.consumer.as_ref() }
    }

    /// Whether the kernel asked to be woken (XDP_RING_NEED_WAKEUP) before it services this ring.
    pub(crate) fn needs_wakeup(&self) -> bool {
        // SAFETY: as for `producer`.
        let flags = unsafe { self.flags.as_ref() };
        flags.load(Ordering::Relaxed) & libc::XDP_RING_NEED_WAKEUP != 0
    }

    fn slot(&self, index: u32) -> *mut T {
        // SAFETY: `index & mask` < size, inside the entries array of the mapping.
        unsafe { self.entries.as_ptr().add((index & self.mask) as usize) }
    }

    // --- producer side (fill, TX) ---

    /// Free slots we may produce into.
    pub(crate) fn free(&mut self) -> u32 {
        self.cached_remote = self.consumer().load(Ordering::Acquire);
        self.size - self.local.wrapping_sub(self.cached_remote)
    }

    /// Writes one entry at the next producer slot; `submit` publishes it. Caller checked `free`.
    pub(crate) fn push(&mut self, entry: T) {
        // SAFETY: the slot is free (the kernel has consumed it), so nobody reads it concurrently.
        unsafe { self.slot(self.local).write(entry) };
        self.local = self.local.wrapping_add(1);
    }

    /// Publishes what was pushed.
    pub(crate) fn submit(&mut self) {
        self.producer().store(self.local, Ordering::Release);
    }

    /// Entries produced but not yet taken by the kernel.
    pub(crate) fn outstanding(&self) -> u32 {
        self.local
            .wrapping_sub(self.consumer().load(Ordering::Acquire))
    }

    // --- consumer side (RX, completion) ---

    /// Entries the kernel has produced that we have not consumed.
    pub(crate) fn available(&mut self) -> u32 {
        self.cached_remote = self.producer().load(Ordering::Acquire);
        self.cached_remote.wrapping_sub(self.local)
    }

    /// The `i`-th available entry (i < `available()`).
    pub(crate) fn peek(&self, i: u32) -> T {
        // SAFETY: the kernel published this slot (Acquire in `available`) and will not touch it
        // until we release it.
        unsafe { self.slot(self.local.wrapping_add(i)).read() }
    }

    /// Gives `n` consumed entries back to the kernel.
    pub(crate) fn release(&mut self, n: u32) {
        self.local = self.local.wrapping_add(n);
        self.consumer().store(self.local, Ordering::Release);
    }
}

impl<T> Drop for Ring<T> {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `map` mapped; no references outlive the ring.
        unsafe {
            libc::munmap(self.map.as_ptr().cast(), self.map_len);
        }
    }
}
