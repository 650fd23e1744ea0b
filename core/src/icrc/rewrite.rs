//! The ICRC of an IPv4 RoCEv2 packet after its IP identification or UDP source port changed,
//! from the old ICRC alone.
//!
//! A kernel UDP socket that sends a batch of segments (UDP GSO) writes the IP and UDP headers
//! itself: the identification counts up from 0 within the batch, and the source port is the
//! socket's. Both fields are covered by the ICRC, so a packet built with others needs its ICRC
//! changed. Hashing the packet again would cost as much as building it; this costs three
//! multiplications of 32-bit polynomials, each by a polynomial fixed in advance and so done with
//! four table look-ups.
//!
//! Why it works: CRC-32 is linear over GF(2). For two messages of the same length that differ
//! by `d`, `crc(m ⊕ d) = crc(m) ⊕ L(d)`, where `L` is the CRC's register run from zero with no
//! final complement. When `d` is a few bytes followed by `n` zeros, `L(d)` is the register
//! after those bytes, multiplied by `x^(8n)` modulo the CRC polynomial (a zero byte shifts the
//! register by eight places and reduces it). And the register after `k ≤ 4` bytes, started from
//! zero, is the bytes read as a little-endian word times `x^(8k)`. So with the identification's
//! difference `i` (covered bytes 12-13: 8 pseudo-LRH bytes, then the IP header's bytes 4-5) and
//! the source port's `p` (covered bytes 28-29), `n` covered bytes after the port:
//! `L(d) = x^(8n) · (x^(8·18) · i + x^(8·2) · p)`.
//!
//! Polynomials are held as the CRC's register holds them, reflected: bit 31 is `x^0`.

use crate::wire::{ipv4, ICRC_LEN};

/// The CRC-32 polynomial, reflected.
const POLY: u32 = 0xedb8_8320;
/// The polynomial 1, reflected.
const ONE: u32 = 0x8000_0000;

/// Where the fields sit in what the ICRC covers (the 8-byte pseudo-LRH, then the IP header).
const PSEUDO_LRH_LEN: usize = 8;
const IDENT_AT: usize = PSEUDO_LRH_LEN + ipv4::field::IDENT.start;
const SRC_PORT_AT: usize = PSEUDO_LRH_LEN + ipv4::HEADER_LEN;
/// The first covered byte after the source port.
const AFTER_SRC_PORT: usize = SRC_PORT_AT + 2;

/// `b · x` modulo the CRC polynomial, reflected.
const fn times_x(b: u32) -> u32 {
    if b & 1 != 0 {
        (b >> 1) ^ POLY
    } else {
        b >> 1
    }
}

/// `a · b` modulo the CRC polynomial, both reflected.
const fn mul_mod(a: u32, b: u32) -> u32 {
    let mut product = 0;
    let mut b = b;
    let mut term = 0;
    while term < 32 {
        // Add b · x^term when a has that term; then b becomes b · x (reduced).
        if a & (ONE >> term) != 0 {
            product ^= b;
        }
        b = times_x(b);
        term += 1;
    }
    product
}

/// `x^(8 · bytes)` modulo the CRC polynomial: what `bytes` zero bytes do to the register.
const fn zero_bytes(bytes: usize) -> u32 {
    let mut result = ONE;
    let mut square = ONE >> 8; // x^8, one byte
    let mut n = bytes;
    while n != 0 {
        if n & 1 != 0 {
            result = mul_mod(square, result);
        }
        square = mul_mod(square, square);
        n >>= 1;
    }
    result
}

/// The register after the identification's two bytes and the 16 covered bytes between its end
/// and the source port's end.
const IDENT_TO_PORT_END: u32 = zero_bytes(AFTER_SRC_PORT - IDENT_AT);
/// The register after the source port's two bytes.
const PORT_BYTES: u32 = zero_bytes(2);

/// A field's two bytes (as they are on the wire, big-endian) read as the register reads them.
fn wire_word(value: u16) -> u32 {
    u32::from(u16::from_le_bytes(value.to_be_bytes()))
}

/// Multiplication by one polynomial `c`, modulo the CRC polynomial, by table: the product is
/// linear in the other factor, so it is the XOR of the products of that factor's four bytes,
/// each looked up. Building the tables costs about as much as one [`zero_bytes`] (32 steps of
/// `· x`, then 1 024 XORs); a multiplication then costs four look-ups where [`mul_mod`] takes
/// 32 steps.
#[derive(Clone)]
struct Multiplier {
    /// `bytes[k][b]`: `c` times the polynomial whose register is `b << 8k`.
    bytes: Box<[[u32; 256]; 4]>,
}

impl Multiplier {
    fn new(c: u32) -> Self {
        // basis[t] = c · x^t; the register's bit 31 - t holds x^t.
        let mut basis = [0u32; 32];
        let mut power = c;
        for b in &mut basis {
            *b = power;
            power = times_x(power);
        }
        let mut bytes = Box::new([[0u32; 256]; 4]);
        for (k, table) in bytes.iter_mut().enumerate() {
            for bit in 0..8 {
                let term = basis[31 - (8 * k + bit)];
                let half = 1usize << bit;
                for e in 0..half {
                    table[e | half] = table[e] ^ term;
                }
            }
        }
        Multiplier { bytes }
    }

    /// `c · v` modulo the CRC polynomial, reflected.
    fn times(&self, v: u32) -> u32 {
        let [b0, b1, b2, b3] = v.to_le_bytes();
        self.bytes[0][usize::from(b0)]
            ^ self.bytes[1][usize::from(b1)]
            ^ self.bytes[2][usize::from(b2)]
            ^ self.bytes[3][usize::from(b3)]
    }
}

impl std::fmt::Debug for Multiplier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The tables are what `c` is: c · 1.
        write!(f, "Multiplier({:#010x})", self.times(ONE))
    }
}

/// Changes ICRCs for new identifications and source ports. Keeps the operators for the last
/// few packet lengths it saw (the packets of a batch all have one length; computing one costs
/// about as much as hashing a 1 KiB packet).
#[derive(Debug, Clone)]
pub struct IcrcRewriter {
    /// Multiplication by [`IDENT_TO_PORT_END`] and by [`PORT_BYTES`].
    ident: Multiplier,
    port: Multiplier,
    /// (covered bytes after the source port, multiplication by `x^(8n)` for them), the newest
    /// at `next - 1`.
    tails: [Option<(usize, Multiplier)>; TAILS_KEPT],
    next: usize,
}

const TAILS_KEPT: usize = 4;

impl Default for IcrcRewriter {
    fn default() -> Self {
        IcrcRewriter {
            ident: Multiplier::new(IDENT_TO_PORT_END),
            port: Multiplier::new(PORT_BYTES),
            tails: Default::default(),
            next: 0,
        }
    }
}

impl IcrcRewriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// The ICRC of an IPv4 packet of `ip_total_len` bytes whose ICRC was `icrc`, after its
    /// identification changed by `ident_xor` and its UDP source port by `src_port_xor` (old
    /// value XOR new). `None` when the length cannot hold a RoCEv2 packet.
    pub fn rewritten(
        &mut self,
        icrc: u32,
        ip_total_len: usize,
        ident_xor: u16,
        src_port_xor: u16,
    ) -> Option<u32> {
        let covered = (PSEUDO_LRH_LEN + ip_total_len).checked_sub(ICRC_LEN)?;
        let tail_len = covered.checked_sub(AFTER_SRC_PORT)?;
        if ident_xor == 0 && src_port_xor == 0 {
            return Some(icrc);
        }
        let at_port_end =
            self.ident.times(wire_word(ident_xor)) ^ self.port.times(wire_word(src_port_xor));
        let kept = self
            .tails
            .iter()
            .position(|t| t.as_ref().is_some_and(|(len, _)| *len == tail_len));
        let slot = match kept {
            Some(slot) => slot,
            None => {
                let slot = self.next;
                self.tails[slot] = Some((tail_len, Multiplier::new(zero_bytes(tail_len))));
                self.next = (self.next + 1) % TAILS_KEPT;
                slot
            }
        };
        let (_, tail) = self.tails[slot].as_ref()?;
        Some(icrc ^ tail.times(at_port_end))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::icrc;

    /// An IPv4 RoCEv2 packet of `payload` bytes after the BTH, its ICRC filled in.
    fn packet(payload: usize, ident: u16, src_port: u16, seed: u8) -> Vec<u8> {
        let total = ipv4::HEADER_LEN + 8 + 12 + payload + ICRC_LEN;
        let mut p = vec![0u8; total];
        p[0] = 0x45;
        p[1] = 0x02;
        p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
        p[4..6].copy_from_slice(&ident.to_be_bytes());
        p[6] = 0x40; // DF
        p[8] = 64;
        p[9] = 17;
        p[12..16].copy_from_slice(&[10, 0, 0, 1]);
        p[16..20].copy_from_slice(&[10, 0, 0, 2]);
        p[20..22].copy_from_slice(&src_port.to_be_bytes());
        p[22..24].copy_from_slice(&4791u16.to_be_bytes());
        p[24..26].copy_from_slice(&((total - 20) as u16).to_be_bytes());
        for (i, b) in p[28..total - ICRC_LEN].iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
        }
        icrc::fill(&mut p).unwrap();
        p
    }

    #[test]
    fn zero_bytes_is_what_appending_zeros_does() {
        // crc32 is affine: appending n zeros to a message of register r (before the final
        // complement) gives r · x^(8n); checked against crc32fast on a known message.
        for n in [0usize, 1, 2, 3, 7, 64, 1000, 4096] {
            let mut msg = b"rdma".to_vec();
            let mut h = crc32fast::Hasher::new();
            h.update(&msg);
            let register = !h.finalize();
            msg.resize(4 + n, 0);
            let mut h = crc32fast::Hasher::new();
            h.update(&msg);
            assert_eq!(!h.finalize(), mul_mod(zero_bytes(n), register), "n = {n}");
        }
    }

    #[test]
    fn rewritten_icrcs_match_hashing_the_rewritten_packet() {
        let mut rewriter = IcrcRewriter::new();
        let mut checked = 0;
        for payload in [0usize, 1, 2, 3, 4, 60, 64, 1000, 1024, 4096] {
            for (ident, new_ident) in [(0u16, 0u16), (7, 0), (0, 1), (0x1234, 63), (0xffff, 0x8000)]
            {
                for (port, new_port) in [(0xc000u16, 0xc000u16), (0xc123, 40000), (1, 0xffff)] {
                    let old = packet(payload, ident, port, payload as u8);
                    let new = packet(payload, new_ident, new_port, payload as u8);
                    let got = rewriter.rewritten(
                        icrc::stored(&old).unwrap(),
                        old.len(),
                        ident ^ new_ident,
                        port ^ new_port,
                    );
                    assert_eq!(
                        got,
                        Some(icrc::stored(&new).unwrap()),
                        "payload {payload}, ident {ident:#x}->{new_ident:#x}, port {port}->{new_port}"
                    );
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, 150);
    }

    #[test]
    fn a_multiplier_multiplies_as_mul_mod_does() {
        let factors = [
            0,
            1,
            ONE,
            0xffff_ffff,
            0x1234_5678,
            0x8000_0001,
            0x0000_ff00,
            POLY,
        ];
        for c in [
            ONE,
            IDENT_TO_PORT_END,
            PORT_BYTES,
            zero_bytes(4096),
            0xdead_beef,
        ] {
            let m = Multiplier::new(c);
            for v in factors {
                assert_eq!(m.times(v), mul_mod(c, v), "c {c:#x}, v {v:#x}");
            }
        }
    }

    #[test]
    fn lengths_too_short_for_a_rocev2_packet_are_refused() {
        let mut rewriter = IcrcRewriter::new();
        assert_eq!(rewriter.rewritten(1, 0, 1, 1), None);
        assert_eq!(rewriter.rewritten(1, 21, 1, 1), None);
        assert_eq!(rewriter.rewritten(1, 26, 0, 0), Some(1));
    }
}
