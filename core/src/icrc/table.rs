//! CRC-32 (zlib's: reflected, polynomial 0xEDB88320) by sixteen 256-entry tables, sixteen bytes
//! a step: the code the ICRC takes where carry-less multiplication is slow, as under QEMU's TCG,
//! which emulates each multiply bit by bit.
//!
//! Written here rather than taken from the `crc` crate, whose 16-table loop was used before.
//! That loop checks its byte indices against the slice, five compares and branches a step, and
//! under TCG each branch ends a translation block; this one has none inside a step (the
//! compiler sees a 16-byte chunk), and fewer instructions. It also looks up the twelve bytes
//! that do not depend on the register first, so that they are ready when the register is (on
//! the host CPU that runs the emulated code, or on a CPU without PCLMULQDQ running it
//! natively). 1 KiB in a Debian 13 guest under TCG: 1.24-1.31 µs against 1.82-2.10 for the
//! crate's loop (and 1.4-1.7 for crc32fast's own tables); natively 191 against 235 ns. Reading
//! a step as two 64-bit words and shifting the bytes out was slower under TCG (1.4-1.7 µs):
//! `docs/decisions.md`, "Stop 87".

/// `TABLES[0]` is the byte-at-a-time table; `TABLES[k][b]` is the register change of byte `b`
/// followed by `k` zero bytes, so that the byte `k` places before the end of a step is looked
/// up in `TABLES[k]`.
static TABLES: [[u32; 256]; 16] = tables();

const POLYNOMIAL: u32 = 0xedb8_8320;

const fn tables() -> [[u32; 256]; 16] {
    let mut t = [[0u32; 256]; 16];
    let mut b = 0;
    while b < 256 {
        let mut r = b as u32;
        let mut bit = 0;
        while bit < 8 {
            r = if r & 1 != 0 {
                (r >> 1) ^ POLYNOMIAL
            } else {
                r >> 1
            };
            bit += 1;
        }
        t[0][b] = r;
        b += 1;
    }
    let mut k = 1;
    while k < 16 {
        let mut b = 0;
        while b < 256 {
            let before = t[k - 1][b];
            t[k][b] = (before >> 8) ^ t[0][(before & 0xff) as usize];
            b += 1;
        }
        k += 1;
    }
    t
}

/// The little-endian word at `at` of a 16-byte step.
#[inline(always)]
fn word(step: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([step[at], step[at + 1], step[at + 2], step[at + 3]])
}

/// Byte `n` (0: the lowest) of `w`, as a table index.
#[inline(always)]
fn byte(w: u32, n: u32) -> usize {
    ((w >> (8 * n)) & 0xff) as usize
}

/// The CRC-32 of the message whose CRC-32 is `crc`, followed by `bytes` (as
/// `crc32fast::Hasher::new_with_initial(crc)` then `update(bytes)` and `finalize`).
pub(crate) fn update(crc: u32, bytes: &[u8]) -> u32 {
    let t = &TABLES;
    let mut reg = !crc;
    let mut steps = bytes.chunks_exact(16);
    for step in &mut steps {
        let w0 = word(step, 0) ^ reg;
        let (w1, w2, w3) = (word(step, 4), word(step, 8), word(step, 12));
        let rest = t[0][byte(w3, 3)]
            ^ t[1][byte(w3, 2)]
            ^ t[2][byte(w3, 1)]
            ^ t[3][byte(w3, 0)]
            ^ t[4][byte(w2, 3)]
            ^ t[5][byte(w2, 2)]
            ^ t[6][byte(w2, 1)]
            ^ t[7][byte(w2, 0)]
            ^ t[8][byte(w1, 3)]
            ^ t[9][byte(w1, 2)]
            ^ t[10][byte(w1, 1)]
            ^ t[11][byte(w1, 0)];
        reg = rest
            ^ t[12][byte(w0, 3)]
            ^ t[13][byte(w0, 2)]
            ^ t[14][byte(w0, 1)]
            ^ t[15][byte(w0, 0)];
    }
    for &b in steps.remainder() {
        reg = (reg >> 8) ^ t[0][byte(reg ^ u32::from(b), 0)];
    }
    !reg
}

#[cfg(test)]
mod tests {
    use super::*;

    /// zlib's check value, and agreement with crc32fast at every length up to three steps and
    /// a rest, from any register and split anywhere (a stream hashed in pieces).
    #[test]
    fn the_tables_give_zlibs_crc32_in_any_pieces() {
        assert_eq!(update(0, b"123456789"), 0xcbf4_3926);
        assert_eq!(update(0, b""), 0);
        let bytes: Vec<u8> = (0..70u32).map(|i| (i * 151 + 7) as u8).collect();
        for len in 0..bytes.len() {
            let whole = &bytes[..len];
            for seed in [0, 0xdebb_20e3, 0xffff_ffff] {
                let mut want = crc32fast::Hasher::new_with_initial(seed);
                want.update(whole);
                let want = want.finalize();
                assert_eq!(update(seed, whole), want, "len {len} seed {seed:#x}");
                for cut in [1, 5, 16, 17] {
                    if cut < len {
                        let (a, b) = whole.split_at(cut);
                        assert_eq!(update(update(seed, a), b), want, "len {len} cut {cut}");
                    }
                }
            }
        }
    }
}
