//! xroce RDMA devices ("links", as in `rdma link add NAME type rxe netdev DEV`) and the sysfs
//! tree through which unmodified libibverbs programs find them on a kernel without RDMA.
//!
//! On such a kernel libibverbs' netlink query fails and it scans
//! `$SYSFS_PATH/class/infiniband_verbs` instead (rdma-core v44, `init.c`); `SYSFS_PATH` is
//! honoured unless the program is setuid. So each network namespace gets a generated tree, and
//! `xroce exec` points `SYSFS_PATH` at it:
//!
//! - state lives under `/run/xroce/net-<N>/` ([`run_dir`]), where `N` is the inode number of
//!   the calling thread's network namespace: links of different namespaces do not see each
//!   other, and `/run` is shared across `ip netns exec` (which remounts `/sys` only);
//! - `/run/xroce/net-<N>/links/<NAME>` records a link (`netdev=DEV`);
//! - `/run/xroce/net-<N>/sysfs/` ([`sysfs_root`]) is the tree for every link of the namespace,
//!   rebuilt from the records and the kernel's current addresses by [`regenerate`] (which
//!   `xroce link add`/`del` and `xroce exec` call), and replaced in one step;
//! - `/dev/infiniband/xroce-<NAME>` is a character device 1:7 (the numbers of /dev/full) which
//!   libibverbs insists on finding and opening; any kernel command it still sends fails with
//!   `ENOSPC`. It is shared by the namespaces that use the same NAME.
//!
//! The GID table in the tree is the interface's addresses ([`crate::netlink::gid_table`])
//! merged into the table the tree had ([`merge_gid_table`]: an address keeps its index, a
//! removed one leaves its slot empty, as the kernel's table does), cut to [`GID_TABLE_LEN`].
//! The provider's engine starts from the tree's table merged the same way, so sysfs index `i`
//! and the engine's index `i` are the same GID, and while it runs it keeps the device's GID
//! files equal to its own table ([`write_port_gids`]).
//!
//! Every operation acts on the **calling thread's** network namespace; changes need root.

mod error;
mod store;
mod sysfs;

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::SystemTime;

use crate::netlink::{self, Interface, Netlink};
use crate::xdp::{self, LoadOptions, LoadOutcome, UnloadOutcome, XdpError, XdpMode};

pub use error::RegistryError;
pub use sysfs::{
    format_gid, gid_ipv6, read_port_gids, write_port_gids, GID_TYPE_EMPTY_SLOT, GID_TYPE_ROCE_V2,
};

use store::Store;

/// Root of xroce's runtime state.
pub const RUN_ROOT: &str = "/run/xroce";
/// GID slots per port, as exposed in sysfs (`ports/1/gids/0..15`); the provider reports this
/// as `gid_tbl_len`.
pub const GID_TABLE_LEN: usize = 16;
/// The file in `class/infiniband/<NAME>/` naming the netdev the device runs on.
pub const NETDEV_FILE: &str = "xroce_netdev";
/// Prefix of `device/modalias`; the provider matches `xroce:*`.
pub const MODALIAS_PREFIX: &str = "xroce:";
/// Prefix of the uverbs name: `class/infiniband_verbs/xroce-<NAME>` and
/// `/dev/infiniband/xroce-<NAME>`.
pub const UVERBS_PREFIX: &str = "xroce-";
/// Where libibverbs looks for device nodes (hard-coded in libibverbs).
pub const CDEV_DIR: &str = "/dev/infiniband";
/// Device number of the nodes: that of /dev/full.
pub const CDEV_MAJOR: u32 = 1;
/// See [`CDEV_MAJOR`].
pub const CDEV_MINOR: u32 = 7;
/// The uverbs ABI version written to sysfs (global and per device); the provider's
/// `match_min_abi_version..=match_max_abi_version` must include it.
pub const UVERBS_ABI_VERSION: u32 = 6;
/// Longest link name (it becomes part of file names and of `ibv_device.name`).
pub const NAME_MAX_LEN: usize = 32;

/// Identifies the calling thread's network namespace: the inode number of its nsfs file, as the
/// XDP pins use.
pub fn netns_id() -> Result<u64, RegistryError> {
    xdp::pins::netns_id()
        .map_err(|e| RegistryError::io("identifying the network namespace of", PATH_NETNS, e))
}

const PATH_NETNS: &str = "/proc/thread-self/ns/net";

/// `/run/xroce/net-<N>` for network namespace id `netns`.
pub fn run_dir_of(netns: u64) -> PathBuf {
    PathBuf::from(RUN_ROOT).join(format!("net-{netns}"))
}

/// `/run/xroce/net-<N>` for the calling thread's network namespace.
pub fn run_dir() -> Result<PathBuf, RegistryError> {
    Ok(run_dir_of(netns_id()?))
}

/// The generated sysfs tree of network namespace `netns` (the value of `SYSFS_PATH`).
pub fn sysfs_root_of(netns: u64) -> PathBuf {
    run_dir_of(netns).join("sysfs")
}

/// The generated sysfs tree of the calling thread's network namespace.
pub fn sysfs_root() -> Result<PathBuf, RegistryError> {
    Ok(sysfs_root_of(netns_id()?))
}

/// `xroce-<NAME>`: the uverbs entry and device node name of link `name`.
pub fn uverbs_name(name: &str) -> String {
    format!("{UVERBS_PREFIX}{name}")
}

/// `/dev/infiniband/xroce-<NAME>`.
pub fn cdev_path(name: &str) -> PathBuf {
    PathBuf::from(CDEV_DIR).join(uverbs_name(name))
}

/// The node GUID of a device on a netdev with this MAC, rdma_rxe's rule: the modified EUI-64
/// (`mac0 ^ 0x02, mac1, mac2, ff, fe, mac3, mac4, mac5`) read as a big-endian number. Keep
/// `query_device`'s `node_guid` equal to it (libibverbs reads this one from sysfs).
pub fn node_guid(mac: [u8; 6]) -> u64 {
    u64::from_be_bytes(netlink::eui64(mac))
}

/// A GUID as sysfs prints it: `xxxx:xxxx:xxxx:xxxx`.
pub fn format_guid(guid: u64) -> String {
    let b = guid.to_be_bytes();
    format!(
        "{:02x}{:02x}:{:02x}{:02x}:{:02x}{:02x}:{:02x}{:02x}",
        b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]
    )
}

/// Checks a link name: 1 to [`NAME_MAX_LEN`] ASCII letters, digits, `_` or `-`, not starting
/// with `-` (it would read as an option).
pub fn check_name(name: &str) -> Result<(), RegistryError> {
    let ok = (1..=NAME_MAX_LEN).contains(&name.len())
        && !name.starts_with('-')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(RegistryError::InvalidName {
            name: name.to_string(),
        })
    }
}

/// A recorded link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    /// The device name (`ibv_get_device_name`).
    pub name: String,
    /// The netdev it runs on.
    pub netdev: String,
    /// When it was added.
    pub created: SystemTime,
}

/// A link whose netdev exists, as the tree shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    /// The link.
    pub link: Link,
    /// Its netdev now.
    pub iface: Interface,
    /// Its GID table, at most [`GID_TABLE_LEN`] entries, empty slots `None`: the addresses of
    /// [`netlink::gid_table`] merged into the table the tree had ([`merge_gid_table`]).
    pub gids: Vec<Option<IpAddr>>,
}

impl Device {
    /// See [`node_guid`].
    pub fn node_guid(&self) -> u64 {
        node_guid(self.iface.mac)
    }
}

/// What [`regenerate`] wrote.
#[derive(Debug)]
pub struct Tree {
    /// The tree's root (`SYSFS_PATH`); `None` when the namespace has no links (then there is
    /// no tree).
    pub root: Option<PathBuf>,
    /// The devices in it.
    pub devices: Vec<Device>,
    /// Links left out of it because their netdev cannot be read (usually: it was deleted), with
    /// the reason.
    pub hidden: Vec<(Link, RegistryError)>,
}

/// What [`add`] did.
#[derive(Debug)]
pub struct Added {
    /// The new device.
    pub device: Device,
    /// The XDP program on its netdev: loaded now, or already there.
    pub xdp: LoadOutcome,
    /// The regenerated tree.
    pub tree: Tree,
    /// Whether the device node was created now (`false`: another namespace's link of the same
    /// name had created it).
    pub dev_node_created: bool,
}

/// What [`delete`] did.
#[derive(Debug)]
pub struct Deleted {
    /// The removed link.
    pub link: Link,
    /// The XDP program: unloaded, not loaded, or `None` when the netdev is gone.
    pub xdp: Option<UnloadOutcome>,
    /// Whether the device node was removed (it stays while another namespace uses the name).
    pub dev_node_removed: bool,
}

/// The links of the calling thread's network namespace, by name. Needs no privileges.
pub fn links() -> Result<Vec<Link>, RegistryError> {
    match Store::open_shared()? {
        Some(store) => store.links(),
        None => Ok(Vec::new()),
    }
}

/// Adds link `name` on `netdev`: loads the XDP program there in `mode` (`None`: native where
/// the driver takes it, else generic) if it is not loaded, records the link, creates the device
/// node and regenerates the tree. On failure, undoes what it did.
pub fn add(name: &str, netdev: &str, mode: Option<XdpMode>) -> Result<Added, RegistryError> {
    check_name(name)?;
    let mut nl = Netlink::open().map_err(|e| RegistryError::netlink(netdev, e))?;
    nl.interface_by_name(netdev)
        .map_err(|e| RegistryError::netlink(netdev, e))?;
    let store = Store::open_exclusive()?;
    let links = store.links()?;
    // The same link again is a repair when its program is gone (the interface was deleted and
    // made again, say), which is what engines then tell the user to run.
    let repair = match links.iter().find(|l| l.name == name) {
        Some(l) if l.netdev != netdev => {
            return Err(RegistryError::NameInUse {
                name: name.to_string(),
                netdev: l.netdev.clone(),
            })
        }
        Some(_) => true,
        None => false,
    };
    if let Some(l) = links.iter().find(|l| l.netdev == netdev && !repair) {
        return Err(RegistryError::NetdevInUse {
            netdev: netdev.to_string(),
            name: l.name.clone(),
        });
    }
    // Before changing anything: a foreign file at the node's path would fail the add later.
    store::check_dev_node(name)?;
    let mut load = LoadOptions::new(netdev);
    load.mode = mode;
    let xdp = xdp::load(&load)?;
    if repair && matches!(xdp, LoadOutcome::AlreadyLoaded(_)) {
        return Err(RegistryError::NameInUse {
            name: name.to_string(),
            netdev: netdev.to_string(),
        });
    }
    let mut dev_node_created = false;
    let result = (|| {
        dev_node_created = store::ensure_dev_node(name)?;
        if !repair {
            store.write_link(name, netdev)?;
        }
        let tree = regenerate_locked(&store, &mut nl)?;
        match tree.devices.iter().find(|d| d.link.name == name).cloned() {
            Some(device) => Ok((device, tree)),
            // The netdev went away between the check and the tree.
            None => Err(RegistryError::NoSuchNetdev {
                netdev: netdev.to_string(),
            }),
        }
    })();
    let (device, tree) = match result {
        Ok(done) => done,
        Err(e) => {
            // Undo, best effort; the first error is the one to report. A failed repair leaves
            // the link recorded with its program gone, so that it can be run again.
            if !repair {
                let _ = store.remove_link(name);
                if dev_node_created {
                    let _ = store::remove_dev_node_if_unused(name);
                }
            }
            if matches!(xdp, LoadOutcome::Loaded(_)) {
                let _ = xdp::unload(netdev);
            }
            if !repair {
                let _ = finish_without(&store, &mut nl);
            }
            return Err(e);
        }
    };
    Ok(Added {
        device,
        xdp,
        tree,
        dev_node_created,
    })
}

/// Deletes link `name`: unloads the XDP program from its netdev, removes the record,
/// regenerates the tree (or removes the namespace's state when it was the last link) and
/// removes the device node unless another namespace uses the name.
pub fn delete(name: &str) -> Result<Deleted, RegistryError> {
    check_name(name)?;
    let store = Store::open_exclusive()?;
    let link = store.link(name)?.ok_or_else(|| RegistryError::NoSuchLink {
        name: name.to_string(),
    })?;
    let xdp = match xdp::unload(&link.netdev) {
        Ok(outcome) => Some(outcome),
        // The netdev went away (with its program).
        Err(XdpError::NoSuchInterface { .. }) => None,
        Err(e) => return Err(e.into()),
    };
    store.remove_link(name)?;
    let mut nl = Netlink::open().map_err(|e| RegistryError::netlink(&link.netdev, e))?;
    finish_without(&store, &mut nl)?;
    let dev_node_removed = store::remove_dev_node_if_unused(name)?;
    Ok(Deleted {
        link,
        xdp,
        dev_node_removed,
    })
}

/// After a link was removed: regenerate, or drop the namespace's state if no link is left.
fn finish_without(store: &Store, nl: &mut Netlink) -> Result<(), RegistryError> {
    if store.links()?.is_empty() {
        store.remove_dir()
    } else {
        regenerate_locked(store, nl).map(|_| ())
    }
}

/// Rebuilds the sysfs tree of the calling thread's network namespace from its links and the
/// kernel's current addresses, replacing the old tree in one step. Links whose netdev cannot be
/// read are left out (see [`Tree::hidden`]). With no links, removes the tree. Needs root.
pub fn regenerate() -> Result<Tree, RegistryError> {
    let store = Store::open_exclusive()?;
    let mut nl = Netlink::open().map_err(|e| RegistryError::netlink("(all)", e))?;
    regenerate_locked(&store, &mut nl)
}

fn regenerate_locked(store: &Store, nl: &mut Netlink) -> Result<Tree, RegistryError> {
    let root = sysfs_root_of(store.netns());
    debug_assert!(root.starts_with(store.dir()));
    let links = store.links()?;
    if links.is_empty() {
        store::remove_tree(&root)?;
        return Ok(Tree {
            root: None,
            devices: Vec::new(),
            hidden: Vec::new(),
        });
    }
    let mut devices = Vec::new();
    let mut hidden = Vec::new();
    for link in links {
        match device(nl, &link) {
            Ok(mut dev) => {
                // Addresses keep the indices the tree gave them (a running engine writes its
                // table there), as in the kernel's GID table.
                let dir = root.join("class/infiniband").join(&link.name);
                if let Some(old) = sysfs::read_port_gids(&dir, &link.netdev) {
                    let now: Vec<IpAddr> = dev.gids.iter().flatten().copied().collect();
                    dev.gids = merge_gid_table(&old, &now);
                    dev.gids.truncate(GID_TABLE_LEN);
                }
                devices.push(Device { link, ..dev })
            }
            Err(e) => hidden.push((link, e)),
        }
    }
    sysfs::write(&root, &devices)?;
    Ok(Tree {
        root: Some(root),
        devices,
        hidden,
    })
}

/// The device of `link` as the kernel describes its netdev now.
fn device(nl: &mut Netlink, link: &Link) -> Result<Device, RegistryError> {
    let netdev = link.netdev.as_str();
    let iface = nl
        .interface_by_name(netdev)
        .map_err(|e| RegistryError::netlink(netdev, e))?;
    let mut gids = nl
        .gid_table(&iface)
        .map_err(|e| RegistryError::netlink(netdev, e))?;
    gids.truncate(GID_TABLE_LEN);
    Ok(Device {
        link: link.clone(),
        iface,
        gids: gids.into_iter().map(Some).collect(),
    })
}

/// The GID table after the interface's addresses became `now`, from the table `old`: every
/// address that stays keeps its index (GID indices are what applications exchange), the slots
/// of addresses that went away are emptied, and new addresses take the first empty slots, as
/// the kernel's GID table of an rdma_rxe device behaves.
pub fn merge_gid_table(old: &[Option<IpAddr>], now: &[IpAddr]) -> Vec<Option<IpAddr>> {
    let mut out: Vec<Option<IpAddr>> = old.iter().map(|g| g.filter(|a| now.contains(a))).collect();
    for &a in now {
        if out.contains(&Some(a)) {
            continue;
        }
        match out.iter().position(Option::is_none) {
            Some(i) => out[i] = Some(a),
            None => out.push(Some(a)),
        }
    }
    out
}

/// The GID table of device `name` in the calling thread's namespace, as its tree has it (what
/// libibverbs reads), or `None` when the tree does not have it.
pub fn device_gids(name: &str, netdev: &str) -> Option<Vec<Option<IpAddr>>> {
    let root = sysfs_root().ok()?;
    sysfs::read_port_gids(&root.join("class/infiniband").join(name), netdev)
}

#[cfg(test)]
mod tests {
    use std::io;

    use super::*;

    #[test]
    fn node_guid_is_rxe_eui64() {
        let mac = [0x00, 0x90, 0x27, 0x17, 0xfc, 0x0f];
        assert_eq!(node_guid(mac), 0x0290_27ff_fe17_fc0f);
        assert_eq!(format_guid(node_guid(mac)), "0290:27ff:fe17:fc0f");
        assert_eq!(node_guid(mac).to_be_bytes(), netlink::eui64(mac));
    }

    #[test]
    fn names() {
        for good in ["xroce0", "a", "rxe_0-1", "A-", &"x".repeat(NAME_MAX_LEN)] {
            assert!(check_name(good).is_ok(), "{good:?}");
        }
        for bad in [
            "",
            "-x",
            "a b",
            "a/b",
            "..",
            "é",
            "x:y",
            &"x".repeat(NAME_MAX_LEN + 1),
        ] {
            assert!(
                matches!(check_name(bad), Err(RegistryError::InvalidName { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn paths() {
        assert_eq!(
            run_dir_of(4026531840),
            PathBuf::from("/run/xroce/net-4026531840")
        );
        assert_eq!(sysfs_root_of(7), PathBuf::from("/run/xroce/net-7/sysfs"));
        assert_eq!(
            cdev_path("xroce0"),
            PathBuf::from("/dev/infiniband/xroce-xroce0")
        );
        assert!(sysfs_root().unwrap().starts_with(run_dir().unwrap()));
    }

    #[test]
    fn errors_are_one_line_and_say_what_to_do() {
        let errors = [
            RegistryError::InvalidName { name: "-x".into() },
            RegistryError::NoSuchNetdev {
                netdev: "veth9".into(),
            },
            RegistryError::NameInUse {
                name: "x".into(),
                netdev: "veth0".into(),
            },
            RegistryError::NetdevInUse {
                netdev: "veth0".into(),
                name: "x".into(),
            },
            RegistryError::NoSuchLink { name: "x".into() },
            RegistryError::PermissionDenied {
                action: "creating /run/xroce".into(),
                source: io::Error::from_raw_os_error(libc::EACCES),
            },
        ];
        for e in errors {
            let text = e.to_string();
            assert!(!text.contains('\n'), "{text}");
        }
        let e: RegistryError = XdpError::PermissionDenied {
            iface: Some("veth0".into()),
            action: "attaching".into(),
            source: io::Error::from_raw_os_error(libc::EPERM),
        }
        .into();
        assert!(e.is_permission());
        assert!(e.to_string().contains("needs root"), "{e}");
        assert!(e.to_string().contains("CAP_NET_ADMIN and CAP_BPF"), "{e}");
    }
}
