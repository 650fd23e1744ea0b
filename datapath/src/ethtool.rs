//! What the kernel's ethtool interface says about a network interface: its driver, and whether
//! one of its offloads is on. Asked with `SIOCETHTOOL` in the calling thread's network
//! namespace; an interface that does not answer gives `None`.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

const ETHTOOL_GDRVINFO: u32 = 0x03;
const ETHTOOL_GSTRINGS: u32 = 0x1b;
const ETHTOOL_GSSET_INFO: u32 = 0x37;
const ETHTOOL_GFEATURES: u32 = 0x3a;
/// The string set naming the features (`ETH_SS_FEATURES`).
const ETH_SS_FEATURES: u32 = 4;
const ETH_GSTRING_LEN: usize = 32;
/// More feature names than any kernel has (about 70 in 6.x): a bound on what is allocated for
/// a count the kernel reports.
const MAX_FEATURES: usize = 1024;

/// A socket to ask through, in the calling thread's network namespace.
pub(crate) fn any_socket() -> Option<OwnedFd> {
    // SAFETY: socket(2) with constant arguments; the descriptor is owned below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` was just returned by socket(2) and nothing else owns it.
    Some(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Sends ethtool command `data` (a `struct ethtool_*` whose first field is the command) to
/// `iface`, through socket `fd`: the interface is looked up in the socket's namespace.
///
/// # Safety
///
/// `data` must point to writable memory laid out as the command's structure, as large as the
/// kernel will write for it, and valid for the duration of the call.
pub(crate) unsafe fn ethtool(fd: RawFd, iface: &str, data: *mut libc::c_void) -> Option<()> {
    let name = iface.as_bytes();
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains(&0) {
        return None;
    }
    // SAFETY: an all-zero ifreq is a valid value; the name and data pointer are set below.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, &b) in req.ifr_name.iter_mut().zip(name) {
        *dst = b as libc::c_char;
    }
    req.ifr_ifru.ifru_data = data.cast();
    // SAFETY: SIOCETHTOOL reads `req` (a NUL-terminated name: the rest of ifr_name is zero)
    // and writes at the data pointer what the caller vouched for.
    let rc = unsafe { libc::ioctl(fd, libc::SIOCETHTOOL, &mut req) };
    (rc >= 0).then_some(())
}

/// The interface's driver (`ETHTOOL_GDRVINFO`).
pub fn driver_name(iface: &str) -> Option<String> {
    /// `struct ethtool_drvinfo` (linux/ethtool.h).
    #[repr(C)]
    struct DrvInfo {
        cmd: u32,
        driver: [u8; 32],
        version: [u8; 32],
        fw_version: [u8; 32],
        bus_info: [u8; 32],
        erom_version: [u8; 32],
        reserved2: [u8; 12],
        counts: [u32; 5],
    }
    let mut info = DrvInfo {
        cmd: ETHTOOL_GDRVINFO,
        driver: [0; 32],
        version: [0; 32],
        fw_version: [0; 32],
        bus_info: [0; 32],
        erom_version: [0; 32],
        reserved2: [0; 12],
        counts: [0; 5],
    };
    let socket = any_socket()?;
    // SAFETY: `info` is a `struct ethtool_drvinfo`, which is all GDRVINFO writes.
    unsafe {
        ethtool(
            socket.as_raw_fd(),
            iface,
            (&mut info as *mut DrvInfo).cast(),
        )
    }?;
    let end = info.driver.iter().position(|&b| b == 0).unwrap_or(32);
    Some(String::from_utf8_lossy(&info.driver[..end]).into_owned())
}

/// Where a feature sits among the kernel's (they are numbered differently from one kernel to
/// another, and named alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FeatureIndex {
    index: usize,
    count: usize,
}

/// Whether the feature `ethtool -k` calls `feature` (e.g. `tx-udp-segmentation`) is active on
/// the interface.
pub fn feature_active(iface: &str, feature: &str) -> Option<bool> {
    let socket = any_socket()?;
    let at = feature_index_via(socket.as_raw_fd(), iface, feature)?;
    feature_bit_via(socket.as_raw_fd(), iface, at)
}

/// Where `feature` sits, asked through socket `fd` (so in its network namespace).
pub fn feature_index_via(fd: RawFd, iface: &str, feature: &str) -> Option<FeatureIndex> {
    let count = feature_count(fd, iface)?;
    let index = feature_names(fd, iface, count)?
        .iter()
        .position(|n| n == feature)?;
    Some(FeatureIndex { index, count })
}

/// Whether the feature at `at` is active, asked through socket `fd`: one request, where
/// [`feature_active`] makes three.
pub fn feature_bit_via(fd: RawFd, iface: &str, at: FeatureIndex) -> Option<bool> {
    let FeatureIndex { index, count } = at;
    let blocks = count.div_ceil(32);
    // `struct ethtool_gfeatures`: cmd, size, then per 32 features {available, requested,
    // active, never_changed}.
    let mut buf = vec![0u32; 2 + 4 * blocks];
    buf[0] = ETHTOOL_GFEATURES;
    buf[1] = u32::try_from(blocks).ok()?;
    // SAFETY: `buf` holds the header and `blocks` blocks, as many as `size` asks for.
    unsafe { ethtool(fd, iface, buf.as_mut_ptr().cast()) }?;
    let active = *buf.get(2 + 4 * (index / 32) + 2)?;
    Some(active & (1 << (index % 32)) != 0)
}

/// How many features the kernel names (`ETHTOOL_GSSET_INFO`).
fn feature_count(fd: RawFd, iface: &str) -> Option<usize> {
    /// `struct ethtool_sset_info` with room for one set's count.
    #[repr(C)]
    struct SsetInfo {
        cmd: u32,
        reserved: u32,
        sset_mask: u64,
        data: [u32; 1],
    }
    let mut info = SsetInfo {
        cmd: ETHTOOL_GSSET_INFO,
        reserved: 0,
        sset_mask: 1 << ETH_SS_FEATURES,
        data: [0],
    };
    // SAFETY: with one bit in the mask the kernel writes one count after the header.
    unsafe { ethtool(fd, iface, (&mut info as *mut SsetInfo).cast()) }?;
    // The kernel clears bits of sets it does not have.
    if info.sset_mask & (1 << ETH_SS_FEATURES) == 0 {
        return None;
    }
    let count = usize::try_from(info.data[0]).ok()?;
    (count > 0 && count <= MAX_FEATURES).then_some(count)
}

/// The features' names, in their numbers' order (`ETHTOOL_GSTRINGS`).
fn feature_names(fd: RawFd, iface: &str, count: usize) -> Option<Vec<String>> {
    // `struct ethtool_gstrings`: cmd, string_set, len, then `len` names of 32 bytes.
    let words = 3 + count * ETH_GSTRING_LEN / 4;
    let mut buf = vec![0u32; words];
    buf[0] = ETHTOOL_GSTRINGS;
    buf[1] = ETH_SS_FEATURES;
    buf[2] = u32::try_from(count).ok()?;
    // SAFETY: `buf` has room for the header and `count` names. The kernel ignores the `len`
    // asked for and writes as many names as the set has: `count`, which it gave for this
    // same set of the same kernel (the feature names are fixed when it is built).
    unsafe { ethtool(fd, iface, buf.as_mut_ptr().cast()) }?;
    let written = usize::try_from(buf[2]).ok()?.min(count);
    let bytes: Vec<u8> = buf[3..].iter().flat_map(|w| w.to_ne_bytes()).collect();
    Some(
        bytes
            .chunks(ETH_GSTRING_LEN)
            .take(written)
            .map(|n| {
                let end = n.iter().position(|&b| b == 0).unwrap_or(n.len());
                String::from_utf8_lossy(&n[..end]).into_owned()
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_answers_and_a_missing_interface_does_not() {
        // Every namespace has a loopback device, whose driver has no ethtool name but whose
        // features are named (it segments nothing in software: `tx-udp-segmentation` on).
        assert_eq!(driver_name("lo"), None);
        let socket = any_socket().unwrap();
        let fd = socket.as_raw_fd();
        let count = feature_count(fd, "lo").unwrap();
        assert!(count > 32, "{count} features");
        let names = feature_names(fd, "lo", count).unwrap();
        assert_eq!(names.len(), count);
        assert!(names.iter().any(|n| n == "tx-checksum-ipv4"), "{names:?}");
        assert_eq!(feature_active("lo", "tx-udp-segmentation"), Some(true));
        assert_eq!(feature_active("lo", "no-such-feature"), None);
        assert_eq!(driver_name("xroce-no-such"), None);
        assert_eq!(feature_active("xroce-no-such", "tx-udp-segmentation"), None);
        assert_eq!(driver_name(&"x".repeat(40)), None);
    }
}
