//! How many receive and transmit queues an interface uses now.
//!
//! `IFLA_NUM_RX_QUEUES` (rtnetlink) counts the queues a driver allocated, often one per
//! possible CPU, while it runs fewer (a default veth allocates one per CPU and uses one;
//! virtio-net uses as many as its device negotiated). Binding an AF_XDP socket past the queues
//! in use fails with `EINVAL`, which forcing zero-copy reports as "zero-copy unsupported". The
//! queues in use are what ethtool's channels say (`ETHTOOL_GCHANNELS`: receive-only channels
//! plus combined ones), asked on a socket of the calling thread's network namespace.

use std::os::fd::AsRawFd;

/// `ETHTOOL_GCHANNELS` from `<linux/ethtool.h>`.
const ETHTOOL_GCHANNELS: u32 = 0x3c;

/// `struct ethtool_channels` from `<linux/ethtool.h>`.
#[repr(C)]
#[derive(Default)]
struct EthtoolChannels {
    cmd: u32,
    max_rx: u32,
    max_tx: u32,
    max_other: u32,
    max_combined: u32,
    rx_count: u32,
    tx_count: u32,
    other_count: u32,
    combined_count: u32,
}

/// The receive queues `iface` uses now, or `None` when its driver does not report channels.
pub fn receive_queues_in_use(iface: &str) -> Option<u32> {
    let channels = channels(iface)?;
    receive_queues(&channels)
}

/// Receive-only channels plus combined ones; `None` when the driver reports neither.
fn receive_queues(c: &EthtoolChannels) -> Option<u32> {
    let n = c.rx_count.saturating_add(c.combined_count);
    (n > 0).then_some(n)
}

/// The transmit queues `iface` uses now (the kernel's `real_num_tx_queues`), or `None` when its
/// driver does not report channels. A socket bound to a queue at or past this count receives
/// but cannot send: copy mode's transmit path skips such a queue and reports success.
pub fn transmit_queues_in_use(iface: &str) -> Option<u32> {
    let channels = channels(iface)?;
    transmit_queues(&channels)
}

/// Transmit-only channels plus combined ones; `None` when the driver reports neither.
fn transmit_queues(c: &EthtoolChannels) -> Option<u32> {
    let n = c.tx_count.saturating_add(c.combined_count);
    (n > 0).then_some(n)
}

fn channels(iface: &str) -> Option<EthtoolChannels> {
    let socket = crate::ethtool::any_socket()?;
    let mut channels = EthtoolChannels {
        cmd: ETHTOOL_GCHANNELS,
        ..EthtoolChannels::default()
    };
    // SAFETY: `channels` is a `struct ethtool_channels`, which is all GCHANNELS writes.
    unsafe {
        crate::ethtool::ethtool(
            socket.as_raw_fd(),
            iface,
            (&mut channels as *mut EthtoolChannels).cast(),
        )
    }?;
    Some(channels)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn receive_queues_count_receive_only_and_combined_channels() {
        let c = |rx_count, combined_count| EthtoolChannels {
            rx_count,
            combined_count,
            ..EthtoolChannels::default()
        };
        assert_eq!(receive_queues(&c(1, 0)), Some(1)); // veth
        assert_eq!(receive_queues(&c(0, 4)), Some(4)); // virtio-net, mlx5
        assert_eq!(receive_queues(&c(2, 2)), Some(4));
        assert_eq!(receive_queues(&c(0, 0)), None);
    }

    #[test]
    fn transmit_queues_count_transmit_only_and_combined_channels() {
        let c = |tx_count, combined_count| EthtoolChannels {
            tx_count,
            combined_count,
            ..EthtoolChannels::default()
        };
        assert_eq!(transmit_queues(&c(1, 0)), Some(1)); // veth
        assert_eq!(transmit_queues(&c(0, 4)), Some(4)); // virtio-net, mlx5
        assert_eq!(transmit_queues(&c(0, 0)), None);
    }

    #[test]
    fn names_the_kernel_cannot_take_are_refused_before_asking() {
        assert!(channels("").is_none());
        assert!(channels("a-name-far-too-long-for-linux").is_none());
    }
}
