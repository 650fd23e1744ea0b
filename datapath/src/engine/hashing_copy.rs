//! A copy that computes a CRC-32 of what it copies in the same pass.
//!
//! Every payload a request carries is copied out of the application's memory into the frame,
//! then read again for the ICRC. On a 64 KiB stream the sending CPU spent about a tenth of its
//! time on that copy and a tenth on the CRC (crc32fast's carry-less multiplies), and the
//! sender's CPU is that stream's bottleneck. Folded into one loop, the copy's loads and stores
//! run beside the multiplies, and each byte is loaded once: 4 KiB copied and hashed in 312 ns
//! against 416 ns for the copy and crc32fast one after the other, on this project's AMD EPYC
//! hosts (`docs/decisions.md`, "Stop 80"), with 128-bit lanes ([`Fold::Narrow`]). CPUs with
//! VPCLMULQDQ and AVX-512 fold 512 bits per multiply ([`Fold::Wide`]), as crc32fast does there:
//! on this project's Intel Xeon hosts 4 KiB in 51-61 ns against 67-80 for a copy and
//! crc32fast, and 1 KiB in 22 against 33-46 (crc32fast takes its 512-bit code from 2 KiB on),
//! "Stop 81".
//!
//! The fold is the one of Intel's "Fast CRC Computation for Generic Polynomials Using
//! PCLMULQDQ Instruction" (2009), for zlib's reflected CRC-32: four lanes, each multiplied
//! forward by the distance the loop steps per turn, folded into one at the end. The 16-byte
//! remainder is not reduced here: hashed from a zero register with crc32fast, it gives the
//! message's CRC (the fold keeps the message's remainder modulo the polynomial), and the tail
//! of fewer than one step follows it there.

use xroce_core::icrc::crc32_continue;

/// The constants of the fold (bit-reflected, as the CRC is, and shifted left by one): x^(d+32)
/// and x^(d-32) modulo the polynomial, for moving a 128-bit lane d bits on.
#[cfg(target_arch = "x86_64")]
mod constants {
    /// 2 048 bits: a 512-bit lane of [`super::Fold::Wide`], one turn (256 bytes) on.
    pub const FOLD_256_LOW: i64 = 0x1_1542_778a;
    pub const FOLD_256_HIGH: i64 = 0x1_322d_1430;
    /// 512 bits: a lane of [`super::Fold::Narrow`] one turn (64 bytes) on, and a 512-bit lane
    /// into the next.
    pub const FOLD_64_LOW: i64 = 0x1_5444_2bd4;
    pub const FOLD_64_HIGH: i64 = 0x1_c6e4_1596;
    /// 128 bits: a 128-bit lane into the next.
    pub const FOLD_16_LOW: i64 = 0x1_7519_97d0;
    pub const FOLD_16_HIGH: i64 = 0x0_ccaa_009e;
}

/// A fused copy-and-fold loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fold {
    /// Four 512-bit lanes, 256 bytes a turn: VPCLMULQDQ with AVX-512.
    Wide,
    /// Four 128-bit lanes, 64 bytes a turn: PCLMULQDQ.
    Narrow,
}

impl Fold {
    /// Whether this CPU can run the loop.
    pub fn runs_here(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            match self {
                Fold::Wide => has!("pclmulqdq") && has!("vpclmulqdq") && has!("avx512f"),
                Fold::Narrow => has!("pclmulqdq"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = self;
            false
        }
    }

    /// The bytes one turn of the loop takes: the least a payload needs to take it.
    #[cfg(target_arch = "x86_64")]
    fn step(self) -> usize {
        match self {
            Fold::Wide => 256,
            Fold::Narrow => 64,
        }
    }
}

/// The loop `copy_hashing` takes on this CPU, if any: the wide one where the CPU can run it;
/// else the narrow one where the CPU has PCLMULQDQ but not VPCLMULQDQ. Where the CPU has
/// VPCLMULQDQ without AVX-512, crc32fast multiplies 256 bits at a time, faster than the
/// narrow loop, and a copy then crc32fast stays.
pub fn fold_here() -> Option<Fold> {
    static FOLD: std::sync::OnceLock<Option<Fold>> = std::sync::OnceLock::new();
    *FOLD.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if Fold::Wide.runs_here() {
                return Some(Fold::Wide);
            }
            if Fold::Narrow.runs_here() && !std::arch::is_x86_feature_detected!("vpclmulqdq") {
                return Some(Fold::Narrow);
            }
        }
        None
    })
}

/// Copies `out.len()` bytes from `src` into `out` and returns the CRC-32 of `crc`'s message
/// followed by them.
///
/// # Safety
/// `src` is readable for `out.len()` bytes and does not overlap `out`, and nothing writes
/// it meanwhile: the verbs contract, under which an application leaves a buffer alone from
/// posting it to its completion, and which `ProcessMemory::read` relies on too. It is read
/// through raw loads only, never as a slice.
pub(crate) unsafe fn copy_hashing(src: *const u8, out: &mut [u8], crc: u32) -> u32 {
    // SAFETY: `fold_here` only names a loop the CPU runs; the rest is the caller's promise.
    unsafe { copy_hashing_by(fold_here(), src, out, crc) }
}

/// `copy_hashing` with the loop `fold` (or none: a copy, then crc32fast), for benchmarks and
/// tests that set the ways side by side. `None` when the CPU cannot run `fold`.
///
/// # Panics
/// When `src` is shorter than `out`.
pub fn copy_slice_hashing(fold: Option<Fold>, src: &[u8], out: &mut [u8], crc: u32) -> Option<u32> {
    let src = &src[..out.len()];
    if fold.is_some_and(|fold| !fold.runs_here()) {
        return None;
    }
    // SAFETY: the CPU runs `fold` (checked above); `src` is a slice of `out.len()` bytes, and
    // a shared slice cannot overlap `out` nor be written meanwhile.
    Some(unsafe { copy_hashing_by(fold, src.as_ptr(), out, crc) })
}

/// [`copy_hashing`] with the loop `fold`: the loop over the whole turns it can take, then a
/// copy and crc32fast over the rest. Under 256 bytes crc32fast's own 128-bit fold after the
/// copy is as fast as the narrow loop or faster (`bench/results/wire.md`), so the wide loop's
/// rest, and a payload too short for it, go there.
///
/// # Safety
/// The CPU runs `fold`; `src` as for [`copy_hashing`].
unsafe fn copy_hashing_by(fold: Option<Fold>, src: *const u8, out: &mut [u8], crc: u32) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if let Some(fold) = fold.filter(|fold| out.len() >= fold.step()) {
        let folded = out.len() / fold.step() * fold.step();
        let (whole, rest) = out.split_at_mut(folded);
        // SAFETY: the CPU runs `fold`; `src` is readable for `whole.len()` <= `out.len()`
        // bytes, apart from `whole`.
        let after = unsafe {
            match fold {
                Fold::Wide => fold_copy_wide(src, whole, crc),
                Fold::Narrow => fold_copy_narrow(src, whole, crc),
            }
        };
        // SAFETY: as above, for the bytes after the folded ones.
        return unsafe { copy_hashing_by(None, src.add(folded), rest, after) };
    }
    let _ = fold;
    // SAFETY: the caller's promise covers `out.len()` bytes at `src`.
    unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
    crc32_continue(crc, out)
}

/// The CRC of the message whose fold left `x`, the 16-byte remainder.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse2")]
fn crc_of_remainder(x: std::arch::x86_64::__m128i) -> u32 {
    let mut remainder = [0u8; 16];
    // SAFETY: a 16-byte store into a 16-byte array.
    unsafe { std::arch::x86_64::_mm_storeu_si128(remainder.as_mut_ptr().cast(), x) };
    // The remainder hashed from a zero register (the value 0xffff_ffff) is the message's.
    crc32_continue(0xffff_ffff, &remainder)
}

/// Moves the 128-bit lane `x` on by the distance of `k` and adds `next` to it.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "pclmulqdq,sse2")]
fn fold_128(
    x: std::arch::x86_64::__m128i,
    k: std::arch::x86_64::__m128i,
    next: std::arch::x86_64::__m128i,
) -> std::arch::x86_64::__m128i {
    use std::arch::x86_64::*;
    _mm_xor_si128(
        _mm_xor_si128(
            _mm_clmulepi64_si128::<0x00>(x, k),
            _mm_clmulepi64_si128::<0x11>(x, k),
        ),
        next,
    )
}

/// The narrow loop over `out.len()` bytes, a non-zero multiple of 64.
///
/// # Safety
/// The CPU has PCLMULQDQ; `src` is readable for `out.len()` bytes and does not overlap
/// `out`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "pclmulqdq,sse2")]
unsafe fn fold_copy_narrow(src: *const u8, out: &mut [u8], crc: u32) -> u32 {
    use constants::*;
    use std::arch::x86_64::*;

    debug_assert!(out.len() >= 64 && out.len().is_multiple_of(64));
    let s = src.cast::<__m128i>();
    let d = out.as_mut_ptr().cast::<__m128i>();
    let lanes = out.len() / 16;
    let fold_64 = _mm_set_epi64x(FOLD_64_HIGH, FOLD_64_LOW);
    let fold_16 = _mm_set_epi64x(FOLD_16_HIGH, FOLD_16_LOW);
    // SAFETY (every load and store below): lane `i` < `lanes` lies inside both `out` and the
    // caller's `out.len()` readable bytes at `src`; unaligned loads and stores.
    let load_store = |i: usize| unsafe {
        let v = _mm_loadu_si128(s.add(i));
        _mm_storeu_si128(d.add(i), v);
        v
    };
    // The running register (the complement of the CRC value) enters with the first bytes.
    let mut x0 = _mm_xor_si128(load_store(0), _mm_cvtsi32_si128(!crc as i32));
    let mut x1 = load_store(1);
    let mut x2 = load_store(2);
    let mut x3 = load_store(3);
    let mut i = 4;
    while i < lanes {
        x0 = fold_128(x0, fold_64, load_store(i));
        x1 = fold_128(x1, fold_64, load_store(i + 1));
        x2 = fold_128(x2, fold_64, load_store(i + 2));
        x3 = fold_128(x3, fold_64, load_store(i + 3));
        i += 4;
    }
    crc_of_remainder(fold_128(
        fold_128(fold_128(x0, fold_16, x1), fold_16, x2),
        fold_16,
        x3,
    ))
}

/// The wide loop over `out.len()` bytes, a non-zero multiple of 256.
///
/// # Safety
/// The CPU has PCLMULQDQ, VPCLMULQDQ and AVX-512F; `src` is readable for `out.len()` bytes
/// and does not overlap `out`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,vpclmulqdq,pclmulqdq,sse2")]
unsafe fn fold_copy_wide(src: *const u8, out: &mut [u8], crc: u32) -> u32 {
    use constants::*;
    use std::arch::x86_64::*;

    debug_assert!(out.len() >= 256 && out.len().is_multiple_of(256));
    let s = src.cast::<__m512i>();
    let d = out.as_mut_ptr().cast::<__m512i>();
    let lanes = out.len() / 64;
    // Each 128-bit quarter of a 512-bit lane folds as a lane of its own, by the same distance.
    let fold_256 = _mm512_broadcast_i32x4(_mm_set_epi64x(FOLD_256_HIGH, FOLD_256_LOW));
    let fold_64 = _mm512_broadcast_i32x4(_mm_set_epi64x(FOLD_64_HIGH, FOLD_64_LOW));
    let fold_16 = _mm_set_epi64x(FOLD_16_HIGH, FOLD_16_LOW);
    let fold = |x: __m512i, k: __m512i, next: __m512i| {
        // 0x96: the three-way exclusive or.
        _mm512_ternarylogic_epi64::<0x96>(
            _mm512_clmulepi64_epi128::<0x00>(x, k),
            _mm512_clmulepi64_epi128::<0x11>(x, k),
            next,
        )
    };
    // SAFETY (every load and store below): lane `i` < `lanes` lies inside both `out` and the
    // caller's `out.len()` readable bytes at `src`; unaligned loads and stores.
    let load_store = |i: usize| unsafe {
        let v = _mm512_loadu_si512(s.add(i));
        _mm512_storeu_si512(d.add(i), v);
        v
    };
    // The running register enters with the first four bytes (the mask keeps the others 0).
    let mut x0 = _mm512_xor_si512(load_store(0), _mm512_maskz_set1_epi32(1, !crc as i32));
    let mut x1 = load_store(1);
    let mut x2 = load_store(2);
    let mut x3 = load_store(3);
    let mut i = 4;
    while i < lanes {
        x0 = fold(x0, fold_256, load_store(i));
        x1 = fold(x1, fold_256, load_store(i + 1));
        x2 = fold(x2, fold_256, load_store(i + 2));
        x3 = fold(x3, fold_256, load_store(i + 3));
        i += 4;
    }
    // Four 512-bit lanes into one, then its four quarters into one, in the message's order.
    let x = fold(fold(fold(x0, fold_64, x1), fold_64, x2), fold_64, x3);
    let quarter_0 = _mm512_extracti32x4_epi32::<0>(x);
    let quarter_1 = _mm512_extracti32x4_epi32::<1>(x);
    let quarter_2 = _mm512_extracti32x4_epi32::<2>(x);
    let quarter_3 = _mm512_extracti32x4_epi32::<3>(x);
    crc_of_remainder(fold_128(
        fold_128(fold_128(quarter_0, fold_16, quarter_1), fold_16, quarter_2),
        fold_16,
        quarter_3,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic byte source (xorshift).
    fn bytes(seed: u64, len: usize) -> Vec<u8> {
        let mut s = seed | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s as u8
            })
            .collect()
    }

    /// The ways to copy and hash on this CPU: [`copy_hashing`]'s own choice, and each loop
    /// the CPU can run (also the ones `fold_here` leaves to crc32fast).
    fn ways() -> Vec<(String, Option<Option<Fold>>)> {
        let mut ways = vec![("copy_hashing".to_string(), None)];
        for fold in [Fold::Wide, Fold::Narrow] {
            if fold.runs_here() {
                ways.push((format!("{fold:?}"), Some(Some(fold))));
            }
        }
        ways
    }

    /// Copies `src` into `out` and hashes it the way `way` says.
    fn copy(way: Option<Option<Fold>>, src: &[u8], out: &mut [u8], crc: u32) -> u32 {
        match way {
            // SAFETY: `src` holds `out.len()` readable bytes apart from `out`.
            None => unsafe { copy_hashing(src.as_ptr(), out, crc) },
            Some(fold) => copy_slice_hashing(fold, src, out, crc).expect("the CPU runs it"),
        }
    }

    #[test]
    fn the_copy_is_exact_and_its_crc_is_zlibs_for_any_length_start_and_seed() {
        let lengths = [
            0usize, 1, 63, 64, 65, 127, 128, 200, 255, 256, 257, 319, 320, 1024,
        ];
        let more = [1100, 4096, 4133, 4352, 9000];
        for (name, way) in ways() {
            for (i, len) in lengths.into_iter().chain(more).enumerate() {
                for start in [0usize, 1, 7, 16] {
                    let src = bytes(i as u64 * 31 + start as u64, start + len);
                    let crc = crc32_continue(0, &bytes(len as u64, 11));
                    let mut out = vec![0u8; len];
                    let got = copy(way, &src[start..], &mut out, crc);
                    assert_eq!(out, src[start..], "{name}: copy, len {len} start {start}");
                    assert_eq!(
                        got,
                        crc32_continue(crc, &src[start..]),
                        "{name}: crc, len {len} start {start}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_crc_continued_in_pieces_is_the_crc_of_the_whole() {
        let whole = bytes(5, 5000);
        for (name, way) in ways() {
            let mut crc = 0;
            let mut out = vec![0u8; whole.len()];
            let mut at = 0;
            for piece in [100usize, 64, 1000, 3, 2048, 1785] {
                crc = copy(way, &whole[at..], &mut out[at..at + piece], crc);
                at += piece;
            }
            assert_eq!(at, whole.len());
            assert_eq!(out, whole, "{name}");
            assert_eq!(crc, crc32_continue(0, &whole), "{name}");
        }
    }
}
