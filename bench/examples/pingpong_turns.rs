//! A 64 B RC SEND ping-pong between two devices in one thread, frames handed straight from
//! one device's `poll_transmit` to the other's `handle_packet`: the transport's own work per
//! turn, with no port, simulator queue or clock in between. Meant for instruction counts:
//! `XROCE_ICRC=carry-less valgrind --tool=callgrind target/release/examples/pingpong_turns
//! TURNS`; the difference between two turn counts divided by their difference is one turn's
//! cost. (Without `XROCE_ICRC` the ICRC's code is chosen by a timing, which valgrind's
//! emulation may tip either way from one run to the next.)

use xroce_core::transport::verbs::SgList;
use xroce_core::transport::{Access, Nanos, RecvWr, SendOp, SendWr, Sge, WorkCompletion};
use xroce_tests::sim::{connect, ConnectOptions, LinkConfig, Sim};

fn main() {
    let turns: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(10_000);
    let mut sim = Sim::new(7, 2, LinkConfig::default());
    let (a, b) = connect(&mut sim, 0, 1, &ConnectOptions::default());
    let rw = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    let bufs = [sim.nodes[0].alloc(128, rw), sim.nodes[1].alloc(128, rw)];
    let ends = [a, b];
    let mut frame = vec![0u8; 9000];
    let mut wcs: Vec<WorkCompletion> = Vec::with_capacity(16);
    let mut now: Nanos = sim.now;
    let sge = |i: usize| Sge {
        addr: bufs[i].va,
        length: 64,
        lkey: bufs[i].lkey,
    };
    for (i, end) in ends.iter().enumerate() {
        let wr = RecvWr {
            wr_id: 0,
            sg_list: std::iter::once(sge(i)).collect(),
        };
        sim.nodes[i].post_recv(end.qpn, wr).expect("post_recv");
    }
    let mut sender = 0;
    for turn in 0..turns * 2 {
        now += 1_000;
        let sg_list: SgList = std::iter::once(sge(sender)).collect();
        let wr = SendWr::new(turn, SendOp::Send, sg_list);
        sim.nodes[sender]
            .post_send(ends[sender].qpn, wr)
            .expect("post_send");
        let receiver = 1 - sender;
        // Carry frames both ways until the receiver has the message.
        loop {
            for from in [sender, receiver] {
                let to = 1 - from;
                while let Some(t) = {
                    let n = &mut sim.nodes[from];
                    n.dev.poll_transmit(now, &n.mem, &mut frame)
                } {
                    let n = &mut sim.nodes[to];
                    n.dev.handle_packet(now, &frame[..t.len], &mut n.mem);
                }
            }
            wcs.clear();
            let n = &mut sim.nodes[receiver];
            n.dev
                .poll_cq(ends[receiver].recv_cq, 16, &mut wcs)
                .expect("poll_cq");
            if !wcs.is_empty() {
                break;
            }
        }
        let wr = RecvWr {
            wr_id: turn,
            sg_list: std::iter::once(sge(receiver)).collect(),
        };
        sim.nodes[receiver]
            .post_recv(ends[receiver].qpn, wr)
            .expect("post_recv");
        wcs.clear();
        let n = &mut sim.nodes[sender];
        n.dev
            .poll_cq(ends[sender].send_cq, 16, &mut wcs)
            .expect("poll_cq");
        sender = receiver;
    }
    println!(
        "{turns} round trips, ICRCs hashed with the {} code",
        xroce_core::icrc::code_in_use().name()
    );
}
