//! Wire-layer micro-benchmarks: ICRC alone, parse + full verification, and frame building, for
//! RC SEND_ONLY packets carrying 64 B, 1 KiB and 4 KiB of payload; and a payload copied out of
//! the application's memory and hashed, each way the CPU can; a plain CRC-32 in each code.
//!
//! Run: `cargo bench -p xroce-bench --bench wire`. Figures are recorded in
//! `bench/results/wire.md`; compare runs on the same machine only.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use xroce_core::icrc;
use xroce_core::wire::{
    emit_frame, BthRepr, EtherType, EthernetAddress, EthernetRepr, FrameHeaders, IpRepr,
    Ipv4Address, Ipv4Repr, Opcode, RoceFrame, TransportRepr, UdpRepr, ROCEV2_UDP_PORT,
};
use xroce_datapath::engine::hashing_copy::{copy_slice_hashing, Fold};

const SIZES: [usize; 3] = [64, 1024, 4096];

fn headers() -> FrameHeaders {
    FrameHeaders {
        eth: Some(EthernetRepr {
            src: EthernetAddress([2, 0, 0, 0, 0, 1]),
            dst: EthernetAddress([2, 0, 0, 0, 0, 2]),
            vlan: None,
            ethertype: EtherType::Ipv4,
        }),
        ip: IpRepr::V4(Ipv4Repr {
            src: Ipv4Address([10, 0, 0, 1]),
            dst: Ipv4Address([10, 0, 0, 2]),
            tos: 0,
            ident: 0x1234,
            dont_frag: true,
            ttl: 64,
            protocol: 17,
            payload_len: 0,
        }),
        udp: UdpRepr {
            src_port: 0xc132,
            dst_port: ROCEV2_UDP_PORT,
            payload_len: 0,
        },
        transport: TransportRepr::new(BthRepr {
            ack_req: true,
            ..BthRepr::new(Opcode::RC_SEND_ONLY, 0x11, 0x123456)
        }),
    }
}

fn frame(payload_len: usize) -> Vec<u8> {
    let payload: Vec<u8> = (0..payload_len).map(|i| i as u8).collect();
    let mut buf = vec![0u8; payload_len + 128];
    let n = emit_frame(&mut buf, &headers(), &payload).expect("emit");
    buf.truncate(n);
    buf
}

fn bench_icrc(c: &mut Criterion) {
    let mut g = c.benchmark_group("icrc");
    for size in SIZES {
        let f = frame(size);
        let ip = &f[14..];
        g.throughput(Throughput::Bytes(ip.len() as u64));
        g.bench_with_input(BenchmarkId::from_parameter(size), ip, |b, ip| {
            b.iter(|| icrc::compute(black_box(ip)).expect("icrc"))
        });
    }
    g.finish();
}

fn bench_parse_verify(c: &mut Criterion) {
    let mut g = c.benchmark_group("parse_verify");
    for size in SIZES {
        let f = frame(size);
        g.throughput(Throughput::Bytes(f.len() as u64));
        g.bench_with_input(BenchmarkId::from_parameter(size), &f[..], |b, f| {
            b.iter(|| {
                let p = RoceFrame::parse_ethernet(black_box(f)).expect("parse");
                p.verify().expect("verify");
                p.payload.len()
            })
        });
    }
    g.finish();
}

fn bench_build(c: &mut Criterion) {
    let mut g = c.benchmark_group("build");
    let h = headers();
    for size in SIZES {
        let payload = vec![0xa5u8; size];
        let mut buf = vec![0u8; size + 128];
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_function(BenchmarkId::from_parameter(size), |b| {
            b.iter(|| emit_frame(&mut buf, black_box(&h), black_box(&payload)).expect("emit"))
        });
    }
    g.finish();
}

/// A payload copied and hashed: a copy then crc32fast, and each fused loop the CPU runs.
fn bench_copy_and_hash(c: &mut Criterion) {
    let mut g = c.benchmark_group("copy_and_hash");
    for size in SIZES {
        let src: Vec<u8> = (0..size).map(|i| i as u8).collect();
        let mut out = vec![0u8; size];
        g.throughput(Throughput::Bytes(size as u64));
        for (name, fold) in [
            ("copy then crc32fast", None),
            ("narrow fold", Some(Fold::Narrow)),
            ("wide fold", Some(Fold::Wide)),
        ] {
            if fold.is_some_and(|fold| !fold.runs_here()) {
                continue;
            }
            g.bench_function(BenchmarkId::new(name, size), |b| {
                b.iter(|| copy_slice_hashing(fold, black_box(&src), &mut out, 0))
            });
        }
    }
    g.finish();
}

/// A plain CRC-32 in each code the ICRC can take (`icrc::Crc32Code`): crc32fast's carry-less
/// multiplication and the tables, which engines choose where the multiply is emulated (TCG).
fn bench_crc32_codes(c: &mut Criterion) {
    let mut g = c.benchmark_group("crc32_codes");
    for size in SIZES {
        let bytes: Vec<u8> = (0..size).map(|i| (i * 7) as u8).collect();
        g.throughput(Throughput::Bytes(size as u64));
        for code in [icrc::Crc32Code::CarryLess, icrc::Crc32Code::Table] {
            g.bench_function(BenchmarkId::new(code.name(), size), |b| {
                b.iter(|| icrc::crc32(code, black_box(&bytes)))
            });
        }
    }
    g.finish();
}

criterion_group!(
    benches,
    bench_icrc,
    bench_parse_verify,
    bench_build,
    bench_copy_and_hash,
    bench_crc32_codes
);
criterion_main!(benches);
