//! Drivers whose zero-copy AF_XDP is known to lose frames: auto mode binds their interfaces in
//! copy mode, and a forced zero-copy bind is warned about.
//!
//! virtio-net (zero-copy from Linux 6.13 on) sends each zero-copy frame behind a virtio-net
//! header from a `static` variable of the driver, which it maps for the device with the DMA
//! API. Built into the kernel, that variable lies in the kernel image and the mapping is
//! right. Built as a loadable module, as Debian and most distributions build it, the variable
//! lies in module memory, which the mapping translates as if it were the kernel image's: the
//! device reads the header from an unrelated guest-physical page. Whether a frame goes out
//! depends on what that page holds at the time. Seen here with Debian 13's backports kernel
//! 7.3.4 under QEMU: in about one boot in nine the page held `0xcc` bytes, the pattern Linux
//! writes over memory it frees after boot; QEMU handed each frame to its tap behind twelve of
//! them, and the tap refused every one (`EINVAL`) without counting it, while the guest counted
//! them sent (`docs/decisions.md`, stop 71).

use std::path::Path;

/// Why auto mode does not bind `iface` zero-copy although its driver may have it, if it
/// does not (read in the calling thread's network namespace).
pub fn auto_mode_avoids_zero_copy(iface: &str) -> Option<&'static str> {
    let driver = crate::ethtool::driver_name(iface)?;
    known_flaw(&driver, is_loadable_module(&driver))
}

const VIRTIO_NET_AS_MODULE: &str = "virtio_net is a loadable module here, and its zero-copy \
    transmit maps the header it puts before every frame as if the module's memory were the \
    kernel image's: the device reads the header from unrelated memory, and a host that finds \
    it invalid drops the frame";

fn known_flaw(driver: &str, loadable_module: bool) -> Option<&'static str> {
    (driver == "virtio_net" && loadable_module).then_some(VIRTIO_NET_AS_MODULE)
}

/// Whether `module` is loaded as a loadable module: only those have an `initstate` in their
/// `/sys/module` directory (a driver built into the kernel has the directory, without it).
fn is_loadable_module(module: &str) -> bool {
    Path::new("/sys/module")
        .join(module)
        .join("initstate")
        .exists()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_virtio_net_as_a_loadable_module_is_avoided() {
        assert_eq!(known_flaw("virtio_net", true), Some(VIRTIO_NET_AS_MODULE));
        assert_eq!(known_flaw("virtio_net", false), None);
        assert_eq!(known_flaw("mlx5_core", true), None);
        assert_eq!(known_flaw("veth", false), None);
    }

    #[test]
    fn a_missing_module_is_not_a_loadable_one() {
        assert!(!is_loadable_module("xroce_no_such_module"));
    }
}
