//! Errors of the device registry, worded for the person at the terminal: one line saying what
//! failed and what to do about it.

use std::io;
use std::path::PathBuf;

use crate::netlink::NetlinkError;
use crate::xdp::XdpError;

use super::NAME_MAX_LEN;

/// Why adding, deleting or listing xroce links, or generating their sysfs tree, failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// The link name cannot be used.
    #[error(
        "'{name}' is not a valid xroce link name: use 1 to {NAME_MAX_LEN} letters, digits, '_' \
         or '-', not starting with '-'"
    )]
    InvalidName {
        /// The name given.
        name: String,
    },

    /// The netdev does not exist in the caller's network namespace.
    #[error(
        "no network interface named '{netdev}' in this network namespace; check the name with \
         `ip link` (for an interface inside a namespace, run the command with \
         `ip netns exec NS ...`)"
    )]
    NoSuchNetdev {
        /// The name given.
        netdev: String,
    },

    /// A link of that name exists in this network namespace.
    #[error(
        "an xroce link named '{name}' already exists in this network namespace (on netdev \
         {netdev}); choose another name, or remove it first with `xroce link del {name}`"
    )]
    NameInUse {
        /// The name.
        name: String,
        /// The netdev the existing link is on.
        netdev: String,
    },

    /// The netdev already carries a link (one link per netdev, as with rdma_rxe).
    #[error(
        "netdev {netdev} already has an xroce link ('{name}'); a netdev carries one link (see \
         `xroce link show {name}`)"
    )]
    NetdevInUse {
        /// The netdev.
        netdev: String,
        /// The link it carries.
        name: String,
    },

    /// No link of that name in this network namespace.
    #[error(
        "no xroce link named '{name}' in this network namespace (list them with `xroce link \
         show`)"
    )]
    NoSuchLink {
        /// The name given.
        name: String,
    },

    /// The kernel refused for lack of privileges (`EPERM`/`EACCES`) at some step.
    #[error(
        "{action} was refused ({source}): this needs root (or CAP_NET_ADMIN and CAP_BPF, with \
         write access to /run/xroce and /dev/infiniband); run it as root, e.g. with sudo"
    )]
    PermissionDenied {
        /// What was being done.
        action: String,
        /// The kernel's answer.
        source: io::Error,
    },

    /// Something other than xroce's device node sits at `/dev/infiniband/xroce-NAME`.
    #[error(
        "{} exists and is not an xroce device node (a character device 1:7, like /dev/full): it \
         is {found}; remove it or choose another link name",
        .path.display()
    )]
    DevNodeConflict {
        /// The node's path.
        path: PathBuf,
        /// What is there instead.
        found: String,
    },

    /// Loading or unloading the XDP program failed (other than for privileges).
    #[error(transparent)]
    Xdp(XdpError),

    /// Asking the kernel about the netdev or its addresses failed.
    #[error("reading {netdev} from the kernel: {source}")]
    Netlink {
        /// The netdev.
        netdev: String,
        /// What went wrong.
        source: NetlinkError,
    },

    /// Any other file-system error.
    #[error("{action} {} failed: {source}", .path.display())]
    Io {
        /// What was being done ("writing", "removing", ...).
        action: &'static str,
        /// On which path.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },

    /// Another xroce command holds the registry lock for too long.
    #[error(
        "another xroce command has held the lock {} for more than {seconds} s; try again",
        .path.display()
    )]
    LockTimeout {
        /// The lock file.
        path: PathBuf,
        /// How long was waited.
        seconds: u64,
    },
}

impl RegistryError {
    /// A file-system error on `path`, reporting `EPERM`/`EACCES` as
    /// [`RegistryError::PermissionDenied`].
    pub(crate) fn io(action: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        let path = path.into();
        if is_permission(&source) {
            RegistryError::PermissionDenied {
                action: format!("{action} {}", path.display()),
                source,
            }
        } else {
            RegistryError::Io {
                action,
                path,
                source,
            }
        }
    }

    /// A netlink error about `netdev`: a missing or impossible name is
    /// [`RegistryError::NoSuchNetdev`].
    pub(crate) fn netlink(netdev: &str, source: NetlinkError) -> Self {
        match source {
            NetlinkError::NoSuchInterface(_) | NetlinkError::InvalidInterfaceName(_) => {
                RegistryError::NoSuchNetdev {
                    netdev: netdev.to_string(),
                }
            }
            source => RegistryError::Netlink {
                netdev: netdev.to_string(),
                source,
            },
        }
    }

    /// Whether this is a refusal for lack of privileges.
    pub fn is_permission(&self) -> bool {
        matches!(self, RegistryError::PermissionDenied { .. })
    }
}

impl From<XdpError> for RegistryError {
    fn from(e: XdpError) -> Self {
        match e {
            // One wording for every privilege problem of `xroce link`.
            XdpError::PermissionDenied { action, source, .. } => {
                RegistryError::PermissionDenied { action, source }
            }
            XdpError::NoSuchInterface { iface } => RegistryError::NoSuchNetdev { netdev: iface },
            e => RegistryError::Xdp(e),
        }
    }
}

fn is_permission(err: &io::Error) -> bool {
    matches!(err.raw_os_error(), Some(libc::EPERM) | Some(libc::EACCES))
}
