//! Transport cost per message on the simulated link: two devices in one process, a clean link
//! with no serialisation delay, so the figure is the CPU the requester, responder and
//! completer (plus the ICRC and the simulator's packet copies) spend per message.
//!
//! * 64 B SEND at path MTU 1024 (one packet, one ACK), in batches of 64;
//! * 64 KiB RDMA WRITE at path MTU 4096 (16 packets, one ACK), in batches of 16.
//!
//! Run: `cargo bench -p xroce-bench --bench transport`. Figures: `bench/results/transport.md`.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use xroce_core::transport::{
    Access, MemoryRegion, PathMtu, RecvWr, SendFlags, SendOp, SendWr, Sge,
};
use xroce_tests::sim::{connect, ConnectOptions, LinkConfig, QpEnd, Sim};

const RW: Access = Access(
    Access::LOCAL_WRITE.0
        | Access::REMOTE_WRITE.0
        | Access::REMOTE_READ.0
        | Access::REMOTE_ATOMIC.0,
);

struct Setup {
    sim: Sim,
    a: QpEnd,
    b: QpEnd,
    src: MemoryRegion,
    dst: MemoryRegion,
}

fn setup(mtu: PathMtu, len: usize) -> Setup {
    let link = LinkConfig {
        ns_per_byte: 0.0,
        delay_ns: 1_000,
        ..LinkConfig::default()
    };
    let mut sim = Sim::new(7, 2, link);
    let o = ConnectOptions {
        path_mtu: mtu,
        ..ConnectOptions::default()
    };
    let (a, b) = connect(&mut sim, 0, 1, &o);
    let src = sim.nodes[0].alloc(len, RW);
    let dst = sim.nodes[1].alloc(len, RW);
    Setup {
        sim,
        a,
        b,
        src,
        dst,
    }
}

/// Posts `batch` WRs (one signalled at the end) and runs the link until it completes.
fn run_batch(s: &mut Setup, batch: usize, len: u32, op: impl Fn(&Setup) -> SendOp) {
    for i in 0..batch {
        if matches!(op(s), SendOp::Send) {
            let wr = RecvWr {
                wr_id: i as u64,
                sg_list: vec![Sge {
                    addr: s.dst.va,
                    length: len,
                    lkey: s.dst.lkey,
                }]
                .into(),
            };
            s.sim.nodes[1].post_recv(s.b.qpn, wr).expect("post_recv");
        }
        let mut wr = SendWr::new(
            i as u64,
            op(s),
            vec![Sge {
                addr: s.src.va,
                length: len,
                lkey: s.src.lkey,
            }],
        );
        wr.flags = if i + 1 == batch {
            SendFlags::SIGNALED
        } else {
            SendFlags::NONE
        };
        s.sim.nodes[0].post_send(s.a.qpn, wr).expect("post_send");
    }
    let (cq, rcq) = (s.a.send_cq, s.b.recv_cq);
    let done = s.sim.run_until(10_000_000_000, |sim| {
        sim.nodes[1].poll(rcq);
        !sim.nodes[0].poll(cq).is_empty()
    });
    assert!(done, "batch did not complete");
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("transport");

    const SEND_BATCH: usize = 64;
    g.throughput(Throughput::Elements(SEND_BATCH as u64));
    g.bench_function("send_64B_mtu1024_per_batch_of_64", |bch| {
        let mut s = setup(PathMtu::Mtu1024, 64);
        bch.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                run_batch(&mut s, SEND_BATCH, 64, |_| SendOp::Send);
            }
            start.elapsed()
        })
    });

    const WRITE_BATCH: usize = 16;
    g.throughput(Throughput::Bytes((WRITE_BATCH * 65536) as u64));
    g.bench_function("write_64KiB_mtu4096_per_batch_of_16", |bch| {
        let mut s = setup(PathMtu::Mtu4096, 65536);
        bch.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                run_batch(&mut s, WRITE_BATCH, 65536, |s| SendOp::RdmaWrite {
                    remote_addr: s.dst.va,
                    rkey: s.dst.rkey,
                });
            }
            start.elapsed()
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = bench
}
criterion_main!(benches);
