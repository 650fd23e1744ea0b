//! The AF_XDP socket on its own, on a veth pair in network namespaces the test creates (run as
//! root; skipped otherwise).

use xroce_datapath::afxdp::{BindMode, XskConfig, XskSocket};
use xroce_datapath::netlink;
use xroce_datapath::netns::{root_or_skip, NetnsPair};

/// Frames the peer's interface has received so far.
fn rx_packets(pair: &NetnsPair, side: usize) -> u64 {
    let out = pair
        .exec(
            side,
            &format!(
                "cat /sys/class/net/{}/statistics/rx_packets",
                pair.iface(side)
            ),
        )
        .expect("read the interface's statistics");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("a packet count")
}

/// One `flush` sends everything queued, however many kicks that takes. A copy-mode kick sends
/// at most 32 descriptors and then fails with EAGAIN, the rest still queued; taken for the
/// kernel pushing back, that ended the flush, and the rest waited for the next one: the ACK
/// behind a 64 KiB message (sixteen frames of two descriptors each) waited for a progress
/// thread woken to send it, on every turn of `ib_write_lat` at 64 KiB.
#[test]
fn one_flush_sends_a_batch_larger_than_a_kick() {
    if !root_or_skip() {
        return;
    }
    const FRAMES: u64 = 100;
    let pair = NetnsPair::new("xrxsk-fl", 1500).expect("namespaces");
    let iface = pair.iface(0).to_string();
    let before = rx_packets(&pair, 1);
    let pending_after_flush = pair.run_in(0, move || {
        let veth = netlink::interface_by_name(&iface).expect("the veth is in this namespace");
        let config = XskConfig {
            mode: BindMode::Copy,
            ..XskConfig::default()
        };
        let mut xsk = XskSocket::open(veth.index, config).expect("an AF_XDP socket");
        for _ in 0..FRAMES {
            let queued = xsk.send_with(&mut |buf| {
                // Broadcast, from the veth's address, with the IEEE local experimental
                // EtherType: the peer's kernel counts and drops it.
                buf[..6].fill(0xff);
                buf[6..12].copy_from_slice(&veth.mac);
                buf[12..14].copy_from_slice(&0x88b5u16.to_be_bytes());
                buf[14..60].fill(0);
                Some(60)
            });
            assert!(queued, "room for {FRAMES} frames in the transmit ring");
        }
        xsk.flush().expect("flush");
        xsk.tx_pending()
    });
    assert!(
        !pending_after_flush,
        "frames still queued after one flush of {FRAMES}"
    );
    // The kernel may send a frame of its own meanwhile (IPv6 neighbour discovery).
    let received = rx_packets(&pair, 1) - before;
    assert!(
        received >= FRAMES,
        "the peer received {received} frames of {FRAMES}"
    );
}

/// A queue that receives but cannot transmit (the interface has fewer transmit queues than
/// receive ones) is refused for a socket that sends, naming the count: copy mode's transmit
/// path skips such a queue and reports success, so frames were silently never sent while the
/// progress thread kicked the kernel again and again. A receive-only socket may use it.
#[test]
fn a_queue_without_a_transmit_queue_is_refused_for_sending() {
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::new("xrxsk-tx", 1500).expect("namespaces");
    let made = pair
        .exec(
            0,
            "ip link add xrq0 numtxqueues 1 numrxqueues 4 type veth peer name xrq1 \
             numtxqueues 1 numrxqueues 4 && ip link set xrq0 up && ip link set xrq1 up",
        )
        .expect("ip");
    assert!(made.status.success(), "{made:?}");
    let (refused, receives) = pair.run_in(0, || {
        let veth = netlink::interface_by_name("xrq0").expect("the veth is in this namespace");
        let on_queue_2 = |receive_only| XskConfig {
            queue: 2,
            mode: BindMode::Copy,
            receive_only,
            ..XskConfig::default()
        };
        // Worded here, in the namespace that has the interface it names.
        let refused = XskSocket::open(veth.index, on_queue_2(false)).map_err(|e| e.to_string());
        let receives = XskSocket::open(veth.index, on_queue_2(true)).map(|_| ());
        (refused.map(|_| ()), receives)
    });
    let message = match refused {
        Err(message) => message,
        Ok(()) => panic!("a sending socket on queue 2 of 1 transmit queue was opened"),
    };
    assert!(
        message.contains("transmits on 1 queue(s)") && message.contains("xrq0"),
        "{message}"
    );
    receives.expect("a receive-only socket on queue 2");
}
