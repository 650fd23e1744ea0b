//! The RoCEv2 invariant CRC, computed exactly as rdma_rxe does (`rxe_icrc.c`).
//!
//! ICRC = CRC-32 (IEEE, reflected, as zlib) over
//! `8 × 0xFF ‖ masked IP header ‖ masked UDP header ‖ masked BTH ‖ extension headers ‖ payload ‖ pad`,
//! stored after the pad least-significant byte first. The masks replace the fields routers may
//! change with ones:
//!
//! * IPv4: TOS, TTL and header checksum;
//! * IPv6: traffic class, flow label and hop limit;
//! * UDP: checksum;
//! * BTH: byte 4 (FECN, BECN, reserved).
//!
//! The headers (at most 60 bytes) are copied into a stack buffer and masked; the rest of the
//! packet is hashed in place in the same streaming pass, so the payload is read once and nothing
//! is allocated. A short packet (at most 128 bytes covered) is copied whole and hashed in one
//! call.
//!
//! Two CRC-32 codes give the same ICRC: crc32fast's carry-less multiplication and a table-driven
//! one. Which is faster depends on the CPU (under QEMU's TCG, which emulates PCLMULQDQ slowly,
//! the tables are), so the first ICRC a process computes times both and keeps the faster, unless
//! `XROCE_ICRC` names one ([`code_in_use`]). This is the one place the core reads a clock or
//! the environment; what it computes does not depend on either.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crc32fast::Hasher;

use crate::wire::{bth, ipv4, ipv6, udp, WireError, ICRC_LEN};

mod rewrite;
mod table;
pub use rewrite::IcrcRewriter;

/// CRC-32 state after hashing the 8-byte all-ones pseudo-LRH (`crc32(&[0xff; 8])`). rdma_rxe
/// seeds its register with the equivalent un-complemented value 0xDEBB20E3.
const AFTER_PSEUDO_LRH: u32 = 0x2144_df1c;

/// Finds the IP family, header length and the end of the ICRC-covered region of `ip_packet`.
/// Returns `(ip_header_len, covered_end)`; `ip_packet[covered_end..covered_end + 4]` is the ICRC.
fn layout(ip_packet: &[u8]) -> Result<(usize, usize), WireError> {
    let (ip_len, total) = match ip_packet.first().map(|b| b >> 4) {
        Some(4) => {
            let p = ipv4::Ipv4Packet::new_checked(ip_packet)?;
            (ipv4::HEADER_LEN, usize::from(p.total_len()))
        }
        Some(6) => {
            let p = ipv6::Ipv6Packet::new_checked(ip_packet)?;
            (
                ipv6::HEADER_LEN,
                ipv6::HEADER_LEN + usize::from(p.payload_len()),
            )
        }
        Some(v) => return Err(WireError::IpVersion(v)),
        None => {
            return Err(WireError::Truncated {
                layer: "IP header",
                need: 1,
                have: 0,
            })
        }
    };
    let min = ip_len + udp::HEADER_LEN + bth::HEADER_LEN + ICRC_LEN;
    if total < min {
        return Err(WireError::Truncated {
            layer: "RoCEv2 packet (IP length)",
            need: min,
            have: total,
        });
    }
    Ok((ip_len, total - ICRC_LEN))
}

/// Computes the ICRC of an IP packet (IPv4 without options, or IPv6 without extension headers)
/// that carries UDP/BTH and ends with a 4-byte ICRC slot. The length is taken from the IP header,
/// so trailing link-layer padding in `ip_packet` is ignored; the slot's content is not read.
pub fn compute(ip_packet: &[u8]) -> Result<u32, WireError> {
    compute_with_end(ip_packet).map(|(crc, _)| crc)
}

/// Packets whose covered part is at most this long are hashed from one masked copy in one
/// call. Each call into the CRC-32 code has a fixed cost: for a 64-byte SEND, one call instead
/// of two saved a sixth of crc32fast's instructions; the copy costs less than that.
const ONE_CALL_MAX: usize = 128;

/// The two CRC-32 codes the ICRC can be hashed with. Which is faster depends on the CPU, by up
/// to tenfold, so the first ICRC measures both ([`code_in_use`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Crc32Code {
    /// crc32fast: carry-less multiplication (PCLMULQDQ) where the CPU has it (about 30 ns for
    /// a 1 KiB packet on this project's hosts, a tenth of the tables' time), its own tables
    /// where it has not.
    CarryLess,
    /// Sixteen 256-entry tables, a byte per table look-up (`icrc/table.rs`). Under QEMU's
    /// TCG, which emulates each carry-less multiply bit by bit, it took 0.5-0.9 of crc32fast's
    /// time for a 1 KiB packet and 0.2-0.5 for a 64-byte one, with the `crc` crate's tables;
    /// the loop of its own that replaced them takes a third less there.
    Table,
}

impl Crc32Code {
    /// The name `XROCE_ICRC` takes and the state dump shows.
    pub fn name(self) -> &'static str {
        match self {
            Crc32Code::CarryLess => "carry-less",
            Crc32Code::Table => "table",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        [Crc32Code::CarryLess, Crc32Code::Table]
            .into_iter()
            .find(|c| c.name() == name)
    }
}

/// A CRC-32 in progress, in either code, that has taken in the pseudo-LRH. The table code's
/// is the CRC-32 of what it has taken so far, as crc32fast's initial value is.
#[derive(Clone)]
enum IcrcHasher {
    CarryLess(Hasher),
    Table(u32),
}

impl IcrcHasher {
    fn new(code: Crc32Code) -> Self {
        match code {
            Crc32Code::CarryLess => {
                IcrcHasher::CarryLess(Hasher::new_with_initial(AFTER_PSEUDO_LRH))
            }
            Crc32Code::Table => IcrcHasher::Table(AFTER_PSEUDO_LRH),
        }
    }

    #[inline]
    fn update(&mut self, bytes: &[u8]) {
        match self {
            IcrcHasher::CarryLess(h) => h.update(bytes),
            IcrcHasher::Table(crc) => *crc = table::update(*crc, bytes),
        }
    }

    #[inline]
    fn finalize(self) -> u32 {
        match self {
            IcrcHasher::CarryLess(h) => h.finalize(),
            IcrcHasher::Table(crc) => crc,
        }
    }
}

/// The code this process hashes ICRCs with: the one `XROCE_ICRC` names (`carry-less` or
/// `table`, for comparing them or for instruction counts that must not depend on a timing),
/// else the faster of the two on this CPU, measured the first time it is asked (a few µs on a
/// CPU with PCLMULQDQ, about 0.1 ms under TCG). Any other value of `XROCE_ICRC` is ignored.
pub fn code_in_use() -> Crc32Code {
    seeded().0
}

/// A hasher that has taken in the pseudo-LRH, in the chosen code. Made once and cloned:
/// `Hasher::new_with_initial` looks up the CPU's features on every call, a tenth of a short
/// packet's ICRC.
fn seeded_hasher() -> IcrcHasher {
    seeded().1.clone()
}

fn seeded() -> &'static (Crc32Code, IcrcHasher) {
    static SEEDED: OnceLock<(Crc32Code, IcrcHasher)> = OnceLock::new();
    SEEDED.get_or_init(|| {
        let named = std::env::var("XROCE_ICRC").ok();
        let code = named
            .as_deref()
            .and_then(Crc32Code::from_name)
            .unwrap_or_else(faster_code);
        (code, IcrcHasher::new(code))
    })
}

/// Times both codes on packet-sized buffers and returns the faster.
fn faster_code() -> Crc32Code {
    // A full 1 KiB packet (path MTU 1024) and short ones (ACKs, small SENDs).
    let long = [0x5au8; 1024];
    let short = [0xa5u8; 64];
    // Cloned as `seeded_hasher` clones, so that each trial times what a packet costs.
    let carry_less = IcrcHasher::new(Crc32Code::CarryLess);
    let table = IcrcHasher::new(Crc32Code::Table);
    faster_by(|code| {
        let seed = match code {
            Crc32Code::CarryLess => &carry_less,
            Crc32Code::Table => &table,
        };
        let start = Instant::now();
        for packet in [&long[..], &short[..], &short[..], &short[..]] {
            let mut h = seed.clone();
            h.update(std::hint::black_box(packet));
            std::hint::black_box(h.finalize());
        }
        start.elapsed()
    })
}

/// The decision of [`faster_code`], given a trial's timing. Each code's best of several
/// alternating trials counts, so that a trial the scheduler interrupted decides nothing; the
/// table code must win by a tenth, since on a CPU where the carry-less code runs natively it
/// is several times faster and a wrong choice there would cost far more than a wrong choice
/// the other way. A clock that read no time at all (too coarse, or stepped back) decides
/// nothing: the carry-less code stays.
fn faster_by(mut trial: impl FnMut(Crc32Code) -> Duration) -> Crc32Code {
    const TRIALS: usize = 5;
    let (mut carry_less, mut table) = (Duration::MAX, Duration::MAX);
    for _ in 0..TRIALS {
        carry_less = carry_less.min(trial(Crc32Code::CarryLess));
        table = table.min(trial(Crc32Code::Table));
    }
    if !table.is_zero() && table.saturating_mul(10) < carry_less.saturating_mul(9) {
        Crc32Code::Table
    } else {
        Crc32Code::CarryLess
    }
}

/// The ICRC and the offset of its slot, from one look at the IP header.
fn compute_with_end(ip_packet: &[u8]) -> Result<(u32, usize), WireError> {
    compute_with_end_by(ip_packet, seeded_hasher())
}

fn compute_with_end_by(ip_packet: &[u8], mut h: IcrcHasher) -> Result<(u32, usize), WireError> {
    let (ip_len, covered_end) = layout(ip_packet)?;
    if covered_end <= ONE_CALL_MAX {
        let mut copy = [0u8; ONE_CALL_MAX];
        let c = &mut copy[..covered_end];
        c.copy_from_slice(&ip_packet[..covered_end]);
        mask_headers(c, ip_len);
        h.update(c);
    } else {
        // The headers (at most 60 bytes) are masked in a copy; the rest is hashed in place.
        let masked_len = ip_len + udp::HEADER_LEN + bth::HEADER_LEN;
        let mut masked = [0u8; ipv6::HEADER_LEN + udp::HEADER_LEN + bth::HEADER_LEN];
        let m = &mut masked[..masked_len];
        m.copy_from_slice(&ip_packet[..masked_len]);
        mask_headers(m, ip_len);
        h.update(m);
        h.update(&ip_packet[masked_len..covered_end]);
    }
    Ok((h.finalize(), covered_end))
}

/// Sets the fields the ICRC does not cover to ones, in a copy of the packet's start that holds
/// at least the IP header (`ip_len` bytes), the UDP header and the BTH.
#[inline(always)]
fn mask_headers(m: &mut [u8], ip_len: usize) {
    // Inlined into both callers, with the offsets constant in each branch: every packet sent
    // and received comes here.
    if ip_len == ipv4::HEADER_LEN {
        m[1] = 0xff; // TOS
        m[8] = 0xff; // TTL
        m[10] = 0xff; // header checksum
        m[11] = 0xff;
        mask_udp_and_bth(m, ipv4::HEADER_LEN);
    } else {
        m[0] |= 0x0f; // traffic class (low nibble of byte 0) ...
        m[1] = 0xff; // ... and flow label
        m[2] = 0xff;
        m[3] = 0xff;
        m[7] = 0xff; // hop limit
        mask_udp_and_bth(m, ipv6::HEADER_LEN);
    }
}

#[inline(always)]
fn mask_udp_and_bth(m: &mut [u8], ip_len: usize) {
    m[ip_len + 6] = 0xff; // UDP checksum
    m[ip_len + 7] = 0xff;
    m[ip_len + udp::HEADER_LEN + 4] = 0xff; // BTH FECN | BECN | resv6a
}

fn read_slot(ip_packet: &[u8], end: usize) -> u32 {
    let mut a = [0u8; ICRC_LEN];
    a.copy_from_slice(&ip_packet[end..end + ICRC_LEN]);
    u32::from_le_bytes(a)
}

/// The ICRC stored in the packet (its four trailing bytes, least-significant byte first).
pub fn stored(ip_packet: &[u8]) -> Result<u32, WireError> {
    let (_, end) = layout(ip_packet)?;
    Ok(read_slot(ip_packet, end))
}

/// The computed and the stored ICRC, in one pass.
pub fn computed_and_stored(ip_packet: &[u8]) -> Result<(u32, u32), WireError> {
    let (crc, end) = compute_with_end(ip_packet)?;
    Ok((crc, read_slot(ip_packet, end)))
}

/// The ICRC's CRC-32 so far (zlib's value) over a packet's start, from its IP header up to where
/// its payload begins (`headers`: IP, UDP, BTH and any extension headers), for a payload
/// hashed as it is copied in ([`crate::transport::HostMemory::read_hashing`]) and then
/// [`finish_after_payload`]. `None` when this process hashes ICRCs with the table code (the
/// packet is then hashed whole, as [`fill`] does), or the headers are not a RoCEv2 packet's.
pub fn crc_before_payload(headers: &[u8]) -> Option<u32> {
    let Crc32Code::CarryLess = code_in_use() else {
        return None;
    };
    let ip_len = match headers.first()? >> 4 {
        4 => ipv4::HEADER_LEN,
        6 => ipv6::HEADER_LEN,
        _ => return None,
    };
    let masked_len = ip_len + udp::HEADER_LEN + bth::HEADER_LEN;
    let mut masked = [0u8; ipv6::HEADER_LEN + udp::HEADER_LEN + bth::HEADER_LEN];
    let m = &mut masked[..masked_len];
    m.copy_from_slice(headers.get(..masked_len)?);
    mask_headers(m, ip_len);
    let mut h = seeded_hasher();
    h.update(m);
    h.update(&headers[masked_len..]);
    Some(h.finalize())
}

/// The CRC-32 (zlib's value) of `crc`'s message followed by `bytes`, in the carry-less code:
/// what [`crc_before_payload`]'s value continues with.
pub fn crc32_continue(crc: u32, bytes: &[u8]) -> u32 {
    let mut h = Hasher::new_with_initial(crc);
    h.update(bytes);
    h.finalize()
}

/// The ICRC of a packet whose covered bytes up to its pad hashed to `crc` ([`crc_before_payload`]
/// and the payload after it), with its pad of `pad` zero bytes.
pub fn finish_after_payload(crc: u32, pad: usize) -> u32 {
    if pad == 0 {
        // Most packets (every full one): nothing to hash, and a hasher made for nothing
        // costs a few ns per packet.
        return crc;
    }
    crc32_continue(crc, &[0u8; 3][..pad.min(3)])
}

/// True when the stored ICRC matches the computed one.
pub fn verify(ip_packet: &[u8]) -> Result<bool, WireError> {
    let (computed, stored) = computed_and_stored(ip_packet)?;
    Ok(computed == stored)
}

/// Computes the ICRC and writes it into the packet's trailing slot.
pub fn fill(ip_packet: &mut [u8]) -> Result<u32, WireError> {
    let (crc, end) = compute_with_end(ip_packet)?;
    ip_packet[end..end + ICRC_LEN].copy_from_slice(&crc.to_le_bytes());
    Ok(crc)
}

/// A plain CRC-32 (zlib's, as the ICRC's) of `bytes` in the code this process hashes ICRCs
/// with ([`code_in_use`]): for benchmarks that do an ICRC's work without the packet's masks,
/// at the cost the engine would pay on this CPU.
pub fn crc32_in_use(bytes: &[u8]) -> u32 {
    crc32(code_in_use(), bytes)
}

/// A plain CRC-32 of `bytes` in `code`.
pub fn crc32(code: Crc32Code, bytes: &[u8]) -> u32 {
    match code {
        Crc32Code::CarryLess => crc32fast::hash(bytes),
        Crc32Code::Table => table::update(0, bytes),
    }
}

#[cfg(test)]
mod tests {
    //! The worked vectors of the digest (`shared/tools/icrc_vectors.py` prints them).
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.chars().filter(|c| c.is_ascii_hexdigit()).collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn pseudo_lrh_seed_is_crc_of_eight_ones() {
        assert_eq!(crc32fast::hash(&[0xff; 8]), AFTER_PSEUDO_LRH);
        assert_eq!(!AFTER_PSEUDO_LRH, 0xdebb_20e3);
    }

    /// ConnectX-4 Lx CNP capture (scapy `test/contrib/roce.uts`): TOS 0xC2, BECN set.
    #[test]
    fn connectx4_cnp_capture() {
        let frame = hex("e41d 2dab 2bc2 7cfe 9064 3b32 0800 45c2
             003c 718c 4000 4011 9161 0a00 1101 0a00
             1201 0000 12b7 0028 0000 8100 ffff 4000
             0118 0000 0000 0000 0000 0000 0000 0000
             0000 0000 0000 82fd 002a");
        let ip = &frame[14..];
        assert_eq!(compute(ip).unwrap(), 0x2a00_fd82);
        assert!(verify(ip).unwrap());
    }

    /// scapy's UC SEND_ONLY example: wire bytes 78 f3 53 f3.
    #[test]
    fn scapy_uc_send_only() {
        let mut pkt = hex("4501 0040 0478 4000 4011 0000 c0a8 0007 c0a8 0007 c000 12b7 002c 0000");
        pkt.extend([0x24, 0x60, 0xff, 0xff, 0, 0, 0, 0xd3]);
        pkt.extend(13_571_856u32.to_be_bytes());
        pkt.extend(b"F0\x81\x8b\xe2\x895\xd9\x0e\x9a\x95PT\x01\xbe\x88^P\x00\x00");
        pkt.extend([0; 4]);
        let crc = fill(&mut pkt).unwrap();
        assert_eq!(crc.to_le_bytes(), [0x78, 0xf3, 0x53, 0xf3]);
    }

    /// The digest's worked rxe-style RC SEND_ONLY "hello" over IPv4.
    pub(crate) const WORKED_V4: &str = "45 00 00 34 12 34 40 00 40 11 a5 31 c0 a8 01 01
        c0 a8 01 02 c1 2f 12 b7 00 20 00 00 04 30 ff ff
        00 00 00 11 80 12 34 56 68 65 6c 6c 6f 00 00 00
        3d 4d 05 94";

    #[test]
    fn worked_rc_send_only_ipv4() {
        let pkt = hex(WORKED_V4);
        assert_eq!(compute(&pkt).unwrap(), 0x9405_4d3d);
        assert_eq!(stored(&pkt).unwrap(), 0x9405_4d3d);
        assert!(verify(&pkt).unwrap());
    }

    #[test]
    fn worked_rc_send_only_ipv6() {
        let v4 = hex(WORKED_V4);
        let mut pkt = hex("6000 0000 0020 1140");
        pkt.extend(hex("fe80 0000 0000 0000 0000 0000 0000 0001"));
        pkt.extend(hex("fe80 0000 0000 0000 0000 0000 0000 0002"));
        pkt.extend(&v4[20..v4.len() - 4]);
        pkt.extend([0; 4]);
        let crc = fill(&mut pkt).unwrap();
        assert_eq!(crc, 0x9413_8a9d);
        assert_eq!(pkt[pkt.len() - 4..], [0x9d, 0x8a, 0x13, 0x94]);
    }

    /// Both codes on the worked IPv4 vector (the definition test below covers IPv6), whichever
    /// this machine chose for `compute`.
    #[test]
    fn both_codes_give_the_worked_icrcs() {
        let pkt = hex(WORKED_V4);
        for code in [Crc32Code::CarryLess, Crc32Code::Table] {
            let (crc, end) = compute_with_end_by(&pkt, IcrcHasher::new(code)).unwrap();
            assert_eq!((crc, end), (0x9405_4d3d, pkt.len() - ICRC_LEN), "{code:?}");
        }
        // Longer than one call's copy, so that the payload is hashed in place.
        let mut long = hex(WORKED_V4);
        let payload_at = long.len() - ICRC_LEN;
        long.splice(payload_at..payload_at, (0..1000u32).map(|i| (i * 13) as u8));
        let total = long.len() as u16;
        long[2..4].copy_from_slice(&total.to_be_bytes());
        long[24..26].copy_from_slice(&(total - 20).to_be_bytes());
        let results: Vec<u32> = [Crc32Code::CarryLess, Crc32Code::Table]
            .map(|code| compute_with_end_by(&long, IcrcHasher::new(code)).unwrap().0)
            .to_vec();
        assert_eq!(results[0], results[1]);
        assert_eq!(compute(&long).unwrap(), results[0]);
    }

    /// `XROCE_ICRC`'s names, and nothing else.
    #[test]
    fn the_codes_are_named_as_xroce_icrc_takes_them() {
        for code in [Crc32Code::CarryLess, Crc32Code::Table] {
            assert_eq!(Crc32Code::from_name(code.name()), Some(code));
        }
        assert_eq!(Crc32Code::from_name("table"), Some(Crc32Code::Table));
        assert_eq!(Crc32Code::from_name("simd"), None);
        assert_eq!(Crc32Code::from_name(""), None);
    }

    /// The choice between the codes: best trials compared, the table code needing a tenth's
    /// lead.
    #[test]
    fn the_faster_code_is_chosen_by_its_best_trial() {
        let us = Duration::from_micros;
        let run = |carry_less: [u64; 5], table: [u64; 5]| {
            let (mut c, mut t) = (carry_less.iter(), table.iter());
            faster_by(|code| match code {
                Crc32Code::CarryLess => us(*c.next().unwrap()),
                Crc32Code::Table => us(*t.next().unwrap()),
            })
        };
        // Native PCLMULQDQ: the carry-less code, even with most of its trials interrupted.
        assert_eq!(
            run([900, 50, 800, 700, 900], [400; 5]),
            Crc32Code::CarryLess
        );
        // Emulated: the table code, though one of its trials was interrupted.
        assert_eq!(
            run([6_500; 5], [4_300, 9_000, 4_400, 4_300, 4_500]),
            Crc32Code::Table
        );
        // A lead of less than a tenth is not enough.
        assert_eq!(run([1_000; 5], [950; 5]), Crc32Code::CarryLess);
        assert_eq!(run([1_000; 5], [880; 5]), Crc32Code::Table);
        // A clock that reads nothing decides nothing.
        assert_eq!(run([0; 5], [0; 5]), Crc32Code::CarryLess);
        assert_eq!(
            run([1_000; 5], [0, 900, 900, 900, 900]),
            Crc32Code::CarryLess
        );
    }

    /// The definition spelled out (the pseudo-LRH, then a masked copy of everything covered)
    /// against both ways `compute` hashes: packets of every length around the one-call limit,
    /// over IPv4 and IPv6, with varied bytes in every masked field.
    #[test]
    fn short_and_long_packets_match_the_definition() {
        let v4 = hex(WORKED_V4);
        let v6_header = hex("6fff ffff 0020 11ff fe80 0000 0000 0000 0000 0000 0000 0001
             fe80 0000 0000 0000 0000 0000 0000 0002");
        for ip_len in [ipv4::HEADER_LEN, ipv6::HEADER_LEN] {
            for payload in 0..=200usize {
                let transport_len = udp::HEADER_LEN + bth::HEADER_LEN + payload + ICRC_LEN;
                let mut pkt = if ip_len == ipv4::HEADER_LEN {
                    let mut h = v4[..20].to_vec();
                    h[2..4].copy_from_slice(&((20 + transport_len) as u16).to_be_bytes());
                    h
                } else {
                    let mut h = v6_header.clone();
                    h[4..6].copy_from_slice(&(transport_len as u16).to_be_bytes());
                    h
                };
                pkt.extend(&v4[20..28]); // UDP header
                pkt.extend(&v4[28..40]); // BTH
                pkt[ip_len + 4..ip_len + 6]
                    .copy_from_slice(&((transport_len) as u16).to_be_bytes());
                pkt.extend((0..payload).map(|i| (i * 7 + payload) as u8));
                pkt.extend([0; ICRC_LEN]);
                // Vary the masked fields: they must not change the result.
                pkt[1] ^= payload as u8;
                pkt[ip_len + 6] = payload as u8;
                pkt[ip_len + udp::HEADER_LEN + 4] = 0xc0;

                let covered = pkt.len() - ICRC_LEN;
                let mut definition = vec![0xff; 8];
                definition.extend(&pkt[..covered]);
                let m = &mut definition[8..];
                if ip_len == ipv4::HEADER_LEN {
                    for i in [1, 8, 10, 11] {
                        m[i] = 0xff;
                    }
                } else {
                    m[0] |= 0x0f;
                    for i in [1, 2, 3, 7] {
                        m[i] = 0xff;
                    }
                }
                for i in [ip_len + 6, ip_len + 7, ip_len + udp::HEADER_LEN + 4] {
                    m[i] = 0xff;
                }
                let want = crc32fast::hash(&definition);
                assert_eq!(
                    compute(&pkt).unwrap(),
                    want,
                    "IP header {ip_len} B, payload {payload} B"
                );
                for code in [Crc32Code::CarryLess, Crc32Code::Table] {
                    let (crc, _) = compute_with_end_by(&pkt, IcrcHasher::new(code)).unwrap();
                    assert_eq!(
                        crc, want,
                        "{code:?}: IP header {ip_len} B, payload {payload} B"
                    );
                }
            }
        }
    }

    #[test]
    fn trailing_link_padding_is_ignored() {
        let mut pkt = hex(WORKED_V4);
        pkt.extend([0xaa; 10]);
        assert!(verify(&pkt).unwrap());
    }

    #[test]
    fn too_short_for_bth_is_an_error() {
        let pkt =
            hex("4500 0020 0000 4000 4011 0000 0a00 0001 0a00 0002 c000 12b7 000c 0000 0000 0000");
        assert!(compute(&pkt).is_err());
    }

    #[test]
    fn both_codes_give_the_same_plain_crc32() {
        // zlib's check value, then lengths around the carry-less code's own thresholds.
        assert_eq!(crc32(Crc32Code::Table, b"123456789"), 0xcbf4_3926);
        assert_eq!(crc32(Crc32Code::CarryLess, b"123456789"), 0xcbf4_3926);
        let bytes: Vec<u8> = (0..300u32).map(|i| (i * 7 + 3) as u8).collect();
        for len in [0, 1, 15, 16, 17, 63, 64, 127, 128, 129, 300] {
            let b = &bytes[..len];
            assert_eq!(
                crc32(Crc32Code::Table, b),
                crc32(Crc32Code::CarryLess, b),
                "{len}"
            );
        }
        assert_eq!(crc32_in_use(&bytes), crc32(Crc32Code::Table, &bytes));
    }
}
