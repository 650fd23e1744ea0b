//! Received frames' cache lines evicted before the kernel copies into their UMEM frames again.
//!
//! In copy mode the kernel copies each received frame into the UMEM on the CPU that runs the
//! interface's receive path. On a veth pair that is the sending CPU: its `sendto` runs the
//! peer's XDP program and the copy. The receiving engine then reads every line of the frame
//! (the ICRC, the payload's placement), and those lines stay in its CPU's cache. When the UMEM
//! frame comes round again, the kernel's copy has to take each line back from that cache
//! before it can write it: on this machine's veth pair that copy cost the sending CPU about a
//! fifth of a 4 KiB stream (`docs/decisions.md`, "Stop 68"). A receiver that only counted
//! frames never paid it, which is why raw AF_XDP's counting receiver outran every reading one.
//!
//! Evicted once the engine is done with them (`clflush`), the lines are nobody's when the
//! kernel writes them next. That costs the receiving CPU an instruction per line, and its data
//! is never wrong either way: eviction writes back what is dirty and changes nothing. Not
//! `clflushopt`, which orders less and so pipelines better: the receiving CPU has time to
//! spare here, `clflush` carried the whole gain in the measurements, and valgrind (which the
//! tests run the provider under) stops at `clflushopt` as an illegal instruction. Zero-copy
//! sockets skip it: there the NIC writes the frames, with no CPU's copy to slow down.
//!
//! Only AMD's CPUs evict by default. On the Intel Xeon hosts of this project a `clflush` took
//! about 40 ns a line (against about 1 for `clflushopt`, and nothing to take back for the
//! kernel's copy): evicting made the receiving engine the bottleneck, and xroce's 64 KiB
//! stream ran at 530 MB/s against 2 900 without it; `clflushopt` still cost 13 %
//! (`docs/decisions.md`, "Stop 81"). [`EVICTION_ENV`] overrides the choice.

const CACHE_LINE: usize = 64;

/// The environment variable that says whether copy-mode sockets evict the lines of the
/// frames they received: `auto` (the default: where the CPU is AMD's), `clflush` or `off`.
pub const EVICTION_ENV: &str = "XROCE_EVICT_RECEIVED_LINES";

/// What [`EVICTION_ENV`] asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum EvictionSetting {
    /// Evict where it was measured to pay: on AMD's CPUs.
    #[default]
    Auto,
    Clflush,
    Off,
}

impl std::str::FromStr for EvictionSetting {
    type Err = String;

    fn from_str(s: &str) -> Result<EvictionSetting, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(EvictionSetting::Auto),
            "clflush" => Ok(EvictionSetting::Clflush),
            "off" => Ok(EvictionSetting::Off),
            other => Err(format!(
                "unknown eviction {other:?} in {EVICTION_ENV}: use auto (the default: clflush \
                 on AMD's CPUs, off elsewhere), clflush or off"
            )),
        }
    }
}

/// How a socket evicts the lines of the frames it received.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LineEviction {
    /// Not at all (zero-copy, a receiver that never reads its frames, a CPU where it costs
    /// more than it saves, or one without the instruction).
    Off,
    /// `clflush`, which every x86-64 CPU has.
    #[cfg(target_arch = "x86_64")]
    Clflush,
}

impl LineEviction {
    /// What a socket bound in copy mode uses on this CPU, as [`EVICTION_ENV`] asks.
    pub(crate) fn for_copy_mode() -> Result<LineEviction, String> {
        let setting: EvictionSetting = crate::setting_from_env(EVICTION_ENV)?;
        Ok(LineEviction::chosen(setting, cpu_is_amds()))
    }

    /// The eviction `setting` picks on a CPU that is AMD's or not.
    fn chosen(setting: EvictionSetting, amds: bool) -> LineEviction {
        #[cfg(target_arch = "x86_64")]
        if setting == EvictionSetting::Clflush || (setting == EvictionSetting::Auto && amds) {
            return LineEviction::Clflush;
        }
        let _ = (setting, amds);
        LineEviction::Off
    }

    /// Evicts every cache line that `len` bytes from `start` touch.
    ///
    /// # Safety
    ///
    /// The bytes must lie in memory mapped in this process (the instruction faults on an
    /// unmapped address). They need not be this thread's to read: the kernel may be writing
    /// them, and eviction changes no data.
    pub(crate) unsafe fn evict(self, start: *const u8, len: usize) {
        for line in lines(start as usize, len) {
            match self {
                LineEviction::Off => return,
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the line holds one of the bytes the caller vouches are mapped (an
                // address, never dereferenced here); `clflush` changes no memory contents.
                LineEviction::Clflush => unsafe {
                    std::arch::x86_64::_mm_clflush(line as *const u8)
                },
            }
        }
    }
}

/// Whether this CPU is AMD's.
fn cpu_is_amds() -> bool {
    cpu_vendor().is_some_and(|vendor| &vendor == b"AuthenticAMD")
}

/// CPUID's vendor string ("AuthenticAMD", "GenuineIntel", ...); none off x86-64.
fn cpu_vendor() -> Option<[u8; 12]> {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: every x86-64 CPU has CPUID (an `unsafe fn` before Rust 1.94, safe since).
        #[allow(unused_unsafe)]
        let id = unsafe { std::arch::x86_64::__cpuid(0) };
        let mut vendor = [0u8; 12];
        for (at, word) in [id.ebx, id.edx, id.ecx].into_iter().enumerate() {
            vendor[at * 4..at * 4 + 4].copy_from_slice(&word.to_le_bytes());
        }
        Some(vendor)
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// The addresses of the cache lines that `len` bytes from address `start` touch.
fn lines(start: usize, len: usize) -> impl Iterator<Item = usize> {
    let first = start & !(CACHE_LINE - 1);
    let count = if len == 0 {
        0
    } else {
        (start + len - first).div_ceil(CACHE_LINE)
    };
    (0..count).map(move |i| first + i * CACHE_LINE)
}

/// The shortest received frame whose lines are evicted: the kernel's copy of a few lines costs
/// little either way, and evicting them cost `ib_send_bw`'s 64 B message rate 2 %.
const MIN_EVICTED: u32 = 512;

/// Frames taken whose eviction may wait no longer (see [`TakenFrames::backlogged`]): a
/// receive's worth.
const BACKLOG: usize = 64;

/// The UMEM ranges of frames a socket took since it last evicted their lines.
///
/// Not evicted as each frame is taken: a ping-pong's answer would then leave only after the
/// eviction, which cost each round trip about 0.3 µs on the veth pair. The socket evicts after
/// its flush's kick (the answer is gone, the peer is answering), or before a receive once
/// [`BACKLOG`] frames wait (a receiver that sends little). The frames went back to the fill
/// ring already; the kernel fills the oldest there first, so it reaches these only after the
/// rest of the ring (and were it sooner, evicting lines it was writing would cost it time but
/// change no data).
#[derive(Debug)]
pub(crate) struct TakenFrames {
    way: LineEviction,
    ranges: Vec<(u64, u32)>,
}

impl TakenFrames {
    pub(crate) fn new(way: LineEviction) -> Self {
        TakenFrames {
            way,
            ranges: Vec::new(),
        }
    }

    /// A frame of `frame_len` bytes taken from `len` bytes of the UMEM at `addr` (kept if
    /// worth evicting).
    pub(crate) fn note(&mut self, frame_len: u32, addr: u64, len: u32) {
        if self.way != LineEviction::Off && frame_len >= MIN_EVICTED {
            self.ranges.push((addr, len));
        }
    }

    /// Enough frames wait that the next receive evicts them first.
    pub(crate) fn backlogged(&self) -> bool {
        self.ranges.len() >= BACKLOG
    }

    /// Evicts the lines of every frame noted and forgets them; `umem` gives the address of
    /// a range's first byte if the whole range lies inside the UMEM.
    pub(crate) fn evict(&mut self, umem: impl Fn(u64, u32) -> Option<*const u8>) {
        for &(addr, len) in &self.ranges {
            if let Some(start) = umem(addr, len) {
                // SAFETY: `umem` vouches that the range lies inside the UMEM, which stays
                // mapped while its socket lives.
                unsafe { self.way.evict(start, len as usize) };
            }
        }
        self.ranges.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_covers_every_line_it_touches_and_no_other() {
        let of = |start, len| lines(start, len).collect::<Vec<_>>();
        assert_eq!(of(0, 0), Vec::<usize>::new());
        assert_eq!(of(0, 1), [0]);
        assert_eq!(of(0, 64), [0]);
        assert_eq!(of(0, 65), [0, 64]);
        assert_eq!(of(63, 2), [0, 64]);
        assert_eq!(of(64, 64), [64]);
        assert_eq!(of(100, 4096).len(), 65);
        assert_eq!(
            of(4096, 4096),
            (0..64).map(|i| 4096 + 64 * i).collect::<Vec<_>>()
        );
    }

    /// By default copy-mode sockets evict on AMD's CPUs alone; `clflush` and `off` force the
    /// choice on any CPU (none evicts off x86-64); other words are refused.
    #[test]
    fn eviction_is_amds_by_default_and_the_setting_overrides_it() {
        use EvictionSetting::*;
        let x86 = cfg!(target_arch = "x86_64");
        for (setting, amds, evicts) in [
            (Auto, true, x86),
            (Auto, false, false),
            (Clflush, false, x86),
            (Clflush, true, x86),
            (Off, true, false),
        ] {
            let way = LineEviction::chosen(setting, amds);
            assert_eq!(
                way != LineEviction::Off,
                evicts,
                "{setting:?}, AMD's: {amds}"
            );
        }
        assert_eq!("".parse(), Ok(Auto));
        assert_eq!(" CLFLUSH".parse(), Ok(Clflush));
        assert_eq!("off".parse(), Ok(Off));
        let refused = "clflushopt".parse::<EvictionSetting>().unwrap_err();
        assert!(refused.contains(EVICTION_ENV), "{refused}");
    }

    /// CPUID's vendor string is read as the kernel reads it (`vendor_id` in `/proc/cpuinfo`).
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    #[test]
    fn the_cpu_vendor_is_the_one_the_kernel_names() {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").expect("/proc/cpuinfo");
        let vendor = cpuinfo
            .lines()
            .find_map(|line| line.strip_prefix("vendor_id"))
            .and_then(|rest| rest.split(':').nth(1))
            .map(str::trim)
            .expect("a vendor_id line");
        let ours = cpu_vendor().expect("x86-64 has a vendor");
        assert_eq!(String::from_utf8_lossy(&ours), vendor);
        assert_eq!(cpu_is_amds(), vendor == "AuthenticAMD");
    }

    /// `clflush` over ranges of any alignment and length inside mapped memory does not fault.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn clflush_evicts_any_range_inside_mapped_memory() {
        let area = vec![1u8; 4 * 4096];
        for (at, len) in [(0, 1), (63, 2), (1, 4095), (100, 9000), (4096 * 3, 4096)] {
            // SAFETY: inside `area`.
            unsafe { LineEviction::Clflush.evict(area[at..].as_ptr(), len) };
        }
        assert_eq!(area, vec![1u8; 4 * 4096], "eviction changes no data");
    }

    /// Frames worth evicting are kept until evicted, then forgotten; a backlog is a
    /// receive's worth; a socket that does not evict keeps nothing.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn taken_frames_wait_for_their_eviction() {
        let area = vec![0u8; 128 * 4096];
        let asked = std::cell::RefCell::new(Vec::new());
        let umem = |addr: u64, len: u32| {
            asked.borrow_mut().push((addr, len));
            area.get(addr as usize..addr as usize + len as usize)
                .map(<[u8]>::as_ptr)
        };
        let mut taken = TakenFrames::new(LineEviction::Clflush);
        taken.note(MIN_EVICTED - 1, 0, MIN_EVICTED - 1);
        taken.note(MIN_EVICTED, 4096, MIN_EVICTED);
        // A frame's short last piece goes with its frame's length.
        taken.note(4096 + 74, 8192 + 256, 74);
        // Outside the UMEM: asked for, skipped.
        taken.note(4096, 1 << 40, 4096);
        assert!(!taken.backlogged());
        taken.evict(umem);
        assert_eq!(
            asked.take(),
            [(4096, MIN_EVICTED), (8192 + 256, 74), (1 << 40, 4096)]
        );
        taken.evict(umem);
        assert!(asked.take().is_empty(), "forgotten once evicted");

        for i in 0..BACKLOG as u64 {
            assert!(!taken.backlogged());
            taken.note(4096, i * 4096, 4096);
        }
        assert!(taken.backlogged());
        taken.evict(umem);
        assert_eq!(asked.take().len(), BACKLOG);
        assert!(!taken.backlogged());

        let mut off = TakenFrames::new(LineEviction::Off);
        off.note(4096, 0, 4096);
        off.evict(umem);
        assert!(asked.take().is_empty());
    }
}
