//! Errors of the XDP loader, worded for the person at the terminal: what failed, on which
//! interface, and what to do about it.

use std::fmt;
use std::io;

use super::{AttachMode, ProgramBuild, XdpMode};

/// Why loading, unloading or using the XDP program failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum XdpError {
    /// The interface does not exist in the caller's network namespace.
    #[error(
        "no network interface named '{iface}' in this network namespace; check the name with \
         `ip link` (for an interface inside a namespace, run the command with \
         `ip netns exec NS ...`)"
    )]
    NoSuchInterface {
        /// The name asked for.
        iface: String,
    },

    /// The kernel refused for lack of privileges (`EPERM`/`EACCES`).
    #[error(
        "{}{action} was refused: {source}. This needs root (CAP_BPF and CAP_NET_ADMIN, and \
         CAP_SYS_ADMIN to mount bpffs); run it as root, e.g. with sudo",
        OnIface(.iface)
    )]
    PermissionDenied {
        /// The interface concerned, when there is one.
        iface: Option<String>,
        /// What was being done.
        action: String,
        /// The kernel's answer.
        source: io::Error,
    },

    /// Another XDP program (not xroce's, or xroce's attached by other means than this loader)
    /// is attached to the interface.
    #[error(
        "{iface} already has another XDP program attached ({mode} mode): {}; xroce does not \
         replace it. Detach it first (for example `ip link set dev {iface} {} off`, or with the \
         tool that attached it), then load again",
        ProgramName(.prog_id, .name),
        .mode.iproute2_keyword()
    )]
    AnotherProgram {
        /// The interface.
        iface: String,
        /// Kernel id of the attached program (0 if the kernel did not say).
        prog_id: u32,
        /// Its name, when it could be read.
        name: Option<String>,
        /// How it is attached.
        mode: AttachMode,
    },

    /// The interface's MTU is above what the chosen build of the program accepts.
    #[error("{}", mtu_too_large(iface, *mtu, *build, *limit))]
    MtuTooLarge {
        /// The interface.
        iface: String,
        /// Its MTU.
        mtu: u32,
        /// The build that does not fit.
        build: ProgramBuild,
        /// The largest MTU that build is used for.
        limit: u32,
    },

    /// The driver does not support this mode (or this build in this mode).
    #[error(
        "the driver of {iface} refused {mode} XDP with the {build} build ({source}); try \
         `--mode generic`"
    )]
    ModeNotSupported {
        /// The interface.
        iface: String,
        /// The requested mode.
        mode: XdpMode,
        /// The build that was being attached.
        build: ProgramBuild,
        /// The kernel's answer.
        source: io::Error,
    },

    /// The driver refused the program without saying why (`EINVAL`): most often a driver that
    /// takes XDP only at MTUs whose frames fit its receive buffers.
    #[error(
        "the driver of {iface} refused {mode} XDP with the {build} build at MTU {mtu} \
         ({source}); drivers refuse XDP at MTUs their receive buffers do not take (the kernel \
         log may say why: `dmesg | tail`). Try {}`--mode generic` (slower, works with any \
         driver), or a lower MTU",
        if *build == ProgramBuild::Plain { "`--build frags` (multi-buffer), " } else { "" }
    )]
    DriverRefused {
        /// The interface.
        iface: String,
        /// The requested mode.
        mode: XdpMode,
        /// The build that was being attached.
        build: ProgramBuild,
        /// The interface's MTU.
        mtu: u32,
        /// The kernel's answer.
        source: io::Error,
    },

    /// The driver refused native mode for a reason of its own (veth with fewer receive queues
    /// than its peer has transmit queues answers `ENOSPC`).
    #[error(
        "the driver of {iface} refused native XDP with the {build} build: {source}; try \
         `--mode generic`"
    )]
    AttachRefused {
        /// The interface.
        iface: String,
        /// The build that was being attached.
        build: ProgramBuild,
        /// The kernel's answer.
        source: io::Error,
    },

    /// The BPF filesystem cannot be found, mounted or used.
    #[error(
        "cannot use the BPF filesystem at /sys/fs/bpf: {detail}. Mount it as root with \
         `mount -t bpf bpf /sys/fs/bpf` and try again"
    )]
    Bpffs {
        /// What went wrong.
        detail: String,
    },

    /// xroce's program is not loaded on the interface (for map access).
    #[error(
        "xroce's XDP program is not loaded on {iface}; load it first (as root, in the \
         interface's network namespace) with `xroce link add NAME netdev {iface}`, which also \
         makes an RDMA device (with the name of a device already on {iface}, it reloads the \
         program for it), or from the source tree with `cargo xtask xdp load --iface {iface}`"
    )]
    NotLoaded {
        /// The interface.
        iface: String,
    },

    /// A receive queue beyond the socket map.
    #[error(
        "queue {queue} of {iface} cannot be steered: xsks_map has {entries} entries (queues 0 to \
         {})",
        .entries - 1
    )]
    QueueOutOfRange {
        /// The interface.
        iface: String,
        /// The queue asked for.
        queue: u32,
        /// Entries of the map.
        entries: u32,
    },

    /// The kernel refused to load the program (verifier, BTF, map creation).
    #[error("the kernel refused to load the {build} XDP program for {iface}: {detail}")]
    Load {
        /// The interface.
        iface: String,
        /// The build.
        build: ProgramBuild,
        /// aya's error, with the verifier log when there is one.
        detail: String,
    },

    /// Any other kernel error.
    #[error("{what} for {iface} failed: {source}")]
    Kernel {
        /// The interface.
        iface: String,
        /// What was being done.
        what: String,
        /// The kernel's answer.
        source: io::Error,
    },
}

impl XdpError {
    /// Builds the error for a failed kernel call, reporting `EPERM`/`EACCES` as
    /// [`XdpError::PermissionDenied`].
    pub(crate) fn kernel(iface: &str, what: impl Into<String>, source: io::Error) -> XdpError {
        let what = what.into();
        if is_permission(&source) {
            XdpError::PermissionDenied {
                iface: Some(iface.to_string()),
                action: what,
                source,
            }
        } else {
            XdpError::Kernel {
                iface: iface.to_string(),
                what,
                source,
            }
        }
    }
}

pub(crate) fn is_permission(err: &io::Error) -> bool {
    matches!(err.raw_os_error(), Some(libc::EPERM) | Some(libc::EACCES))
}

struct OnIface<'a>(&'a Option<String>);

impl fmt::Display for OnIface<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(iface) => write!(f, "on {iface}: "),
            None => Ok(()),
        }
    }
}

struct ProgramName<'a>(&'a u32, &'a Option<String>);

impl fmt::Display for ProgramName<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.0, self.1) {
            (0, _) => write!(f, "program id unknown"),
            (id, Some(name)) if !name.is_empty() => write!(f, "'{name}' (program id {id})"),
            (id, _) => write!(f, "program id {id}"),
        }
    }
}

/// The text of [`XdpError::MtuTooLarge`]. The kernel refuses with the same error when a veth's
/// peer has the large MTU, and then the interface's own MTU is not the one to lower.
fn mtu_too_large(iface: &str, mtu: u32, build: ProgramBuild, limit: u32) -> String {
    let fix = "Load the frags build (`--build frags`, or leave `--build` out to choose by MTU)";
    if mtu > limit {
        format!(
            "the MTU of {iface} ({mtu}) is too large for the {build} build of the XDP program \
             (single-buffer XDP takes frames up to MTU {limit}). {fix}, or lower the MTU"
        )
    } else {
        format!(
            "the kernel refused the {build} build of the XDP program on {iface} for frames too \
             large: its MTU ({mtu}) is within single-buffer XDP's limit (MTU {limit}), so on a \
             veth it is its veth peer's MTU that is above it (other drivers may have a lower \
             limit of their own). {fix}, or lower the peer's MTU"
        )
    }
}
