//! A copy that computes a CRC-32 of what it copies in the same pass.
//!
//! Every payload a request carries is copied out of the application's memory into the frame,
//! then read again for the ICRC. On a 64 KiB stream the sending CPU spent about a tenth of its
//! time on that copy and a tenth on the CRC (crc32fast's carry-less multiplies), and the
//! sender's CPU is that stream's bottleneck. Folded into one loop, the copy's loads and stores
//! run beside the multiplies, and each 64 bytes are loaded once: 4 KiB copied and hashed in
//! 312 ns against 416 ns for the copy and crc32fast one after the other, on this project's AMD
//! EPYC hosts (`docs/decisions.md`, "Stop 80").
//!
//! The fold is the one of Intel's "Fast CRC Computation for Generic Polynomials Using
//! PCLMULQDQ Instruction" (2009), for zlib's reflected CRC-32: four 128-bit lanes, each
//! multiplied forward by 512 bits per 64-byte block, folded into one at the end. The 16-byte
//! remainder is not reduced here: hashed from a zero register with crc32fast, it gives the
//! message's CRC (the fold keeps the message's remainder modulo the polynomial), and the tail
//! of fewer than 64 bytes follows it there.

use xroce_core::icrc::crc32_continue;

/// The constants of the fold (bit-reflected, as the CRC is): x^(512+32) and x^(512-32)
/// modulo the polynomial, for moving a lane 64 bytes on; x^(128+32) and x^(128-32), for
/// moving one 16 bytes on.
#[cfg(target_arch = "x86_64")]
mod constants {
    pub const FOLD_64_LOW: i64 = 0x1_5444_2bd4;
    pub const FOLD_64_HIGH: i64 = 0x1_c6e4_1596;
    pub const FOLD_16_LOW: i64 = 0x1_7519_97d0;
    pub const FOLD_16_HIGH: i64 = 0x0_ccaa_009e;
}

/// Whether [`copy_hashing`] takes its fused loop on this CPU: one with PCLMULQDQ but not
/// VPCLMULQDQ. Where the CPU multiplies 256 or 512 bits at a time, crc32fast hashes several
/// times faster than this 128-bit loop (34.5 GiB/s on the Intel Xeon hosts of
/// `bench/results/wire.md`, against 10.8 here), and a copy then crc32fast is the faster way.
pub(crate) fn can_fold() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static CAN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *CAN.get_or_init(|| {
            std::arch::is_x86_feature_detected!("pclmulqdq")
                && !std::arch::is_x86_feature_detected!("vpclmulqdq")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
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
    let blocks = out.len() / 64;
    if blocks == 0 || !can_fold() {
        // SAFETY: the caller's promise covers `out.len()` bytes at `src`.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
        return crc32_continue(crc, out);
    }
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: the CPU has PCLMULQDQ (`can_fold`); the rest is the caller's promise.
        unsafe { fold_copy_with_tail(src, out, crc) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("can_fold is false off x86_64")
}

/// The fused loop over the whole 64-byte blocks of `out` (at least one), then a copy of the
/// tail and crc32fast over it.
///
/// # Safety
/// The CPU has PCLMULQDQ; `src` as for [`copy_hashing`].
#[cfg(target_arch = "x86_64")]
unsafe fn fold_copy_with_tail(src: *const u8, out: &mut [u8], crc: u32) -> u32 {
    let folded = out.len() / 64 * 64;
    // SAFETY: the caller's promises, for `folded` <= `out.len()` bytes.
    let after = unsafe { fold_copy(src, &mut out[..folded], crc) };
    let tail = &mut out[folded..];
    // SAFETY: as above, for the bytes after the folded ones.
    unsafe { std::ptr::copy_nonoverlapping(src.add(folded), tail.as_mut_ptr(), tail.len()) };
    crc32_continue(after, tail)
}

/// The fused loop over `out.len()` bytes, a non-zero multiple of 64.
///
/// # Safety
/// The CPU has PCLMULQDQ; `src` is readable for `out.len()` bytes and does not overlap
/// `out`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "pclmulqdq,sse2")]
unsafe fn fold_copy(src: *const u8, out: &mut [u8], crc: u32) -> u32 {
    use constants::*;
    use std::arch::x86_64::*;

    debug_assert!(out.len() >= 64 && out.len().is_multiple_of(64));
    let s = src.cast::<__m128i>();
    let d = out.as_mut_ptr().cast::<__m128i>();
    let lanes = out.len() / 16;
    let fold_64 = _mm_set_epi64x(FOLD_64_HIGH, FOLD_64_LOW);
    let fold_16 = _mm_set_epi64x(FOLD_16_HIGH, FOLD_16_LOW);
    // Multiplies the lane's two halves forward by the fold's distance and adds `next`.
    let fold = |x: __m128i, k: __m128i, next: __m128i| {
        _mm_xor_si128(
            _mm_xor_si128(
                _mm_clmulepi64_si128::<0x00>(x, k),
                _mm_clmulepi64_si128::<0x11>(x, k),
            ),
            next,
        )
    };
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
        x0 = fold(x0, fold_64, load_store(i));
        x1 = fold(x1, fold_64, load_store(i + 1));
        x2 = fold(x2, fold_64, load_store(i + 2));
        x3 = fold(x3, fold_64, load_store(i + 3));
        i += 4;
    }
    let x = fold(fold(fold(x0, fold_16, x1), fold_16, x2), fold_16, x3);
    let mut remainder = [0u8; 16];
    // SAFETY: a 16-byte store into a 16-byte array.
    unsafe { _mm_storeu_si128(remainder.as_mut_ptr().cast::<__m128i>(), x) };
    // The remainder hashed from a zero register (the value 0xffff_ffff) is the message's.
    crc32_continue(0xffff_ffff, &remainder)
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

    /// A copy that hashes: [`copy_hashing`]'s signature.
    type CopyHashing = unsafe fn(*const u8, &mut [u8], u32) -> u32;

    /// The ways [`copy_hashing`] can take on this CPU: its own choice, and the fused loop
    /// itself wherever the CPU can run it (also where `can_fold` leaves it to crc32fast).
    fn ways() -> Vec<(&'static str, CopyHashing)> {
        let mut ways: Vec<(&'static str, CopyHashing)> = vec![("copy_hashing", copy_hashing)];
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("pclmulqdq") {
            ways.push(("the fused loop", fold_copy_with_tail));
        }
        ways
    }

    #[test]
    fn the_copy_is_exact_and_its_crc_is_zlibs_for_any_length_start_and_seed() {
        for (name, way) in ways() {
            for (i, len) in [0usize, 1, 63, 64, 65, 127, 128, 200, 1024, 4096, 4133, 9000]
                .into_iter()
                .enumerate()
            {
                if len < 64 && name == "the fused loop" {
                    continue; // It takes at least one block; `copy_hashing` sees to that.
                }
                for start in [0usize, 1, 7, 16] {
                    let src = bytes(i as u64 * 31 + start as u64, start + len);
                    let crc = crc32_continue(0, &bytes(len as u64, 11));
                    let mut out = vec![0u8; len];
                    // SAFETY: `src[start..]` holds `len` readable bytes apart from `out`, and
                    // the fused loop is only listed where the CPU has PCLMULQDQ.
                    let got = unsafe { way(src[start..].as_ptr(), &mut out, crc) };
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
        let mut crc = 0;
        let mut out = vec![0u8; whole.len()];
        let mut at = 0;
        for piece in [100usize, 64, 1000, 3, 2048, 1785] {
            // SAFETY: `whole[at..at + piece]` is readable and apart from `out`.
            crc = unsafe { copy_hashing(whole[at..].as_ptr(), &mut out[at..at + piece], crc) };
            at += piece;
        }
        assert_eq!(at, whole.len());
        assert_eq!(out, whole);
        assert_eq!(crc, crc32_continue(0, &whole));
    }
}
