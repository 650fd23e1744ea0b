//! The generated sysfs tree: the files libibverbs reads to find and describe a device when the
//! kernel has no RDMA support (netlink `NETLINK_RDMA` fails, so `ibverbs_get_device_list` falls
//! back to scanning `$SYSFS_PATH/class/infiniband_verbs`).
//!
//! Contents follow what the kernel's `drivers/infiniband/core/sysfs.c` prints for an rdma_rxe
//! device, limited to the files libibverbs (rdma-core v44) and the xroce provider read; each
//! file's reader is named in [`device_files`]. Values end in a newline as in sysfs (libibverbs'
//! `ibv_read_sysfs_file` strips one).

use std::fs::{self, File};
use std::net::{IpAddr, Ipv6Addr};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use crate::netlink::gid_raw;

use super::store::{mkdir, remove_tree, shared_lock, write_file};
use super::{
    format_guid, uverbs_name, Device, RegistryError, CDEV_MAJOR, CDEV_MINOR, GID_TABLE_LEN,
    MODALIAS_PREFIX, NETDEV_FILE, UVERBS_ABI_VERSION,
};

/// The GID type file of a RoCE v2 GID, as the kernel writes it (`ports/1/gid_attrs/types/N`).
pub const GID_TYPE_ROCE_V2: &str = "RoCE v2";
/// The type file of an empty GID slot. The kernel fails the read of an empty slot's type with
/// `EINVAL`, which libibverbs (`query_sysfs_gid_type`, cmd_device.c) turns into "IB/RoCE v1";
/// a regular file cannot fail a read, so it holds that answer. An empty or missing file would
/// not do: libibverbs then sees the `gid_attrs` directory, fails with `EFAULT`, and
/// `ibv_query_gid_table` / `ibv_query_gid_ex` fail for the whole table.
pub const GID_TYPE_EMPTY_SLOT: &str = "IB/RoCE v1";

/// One file of the tree: path relative to the root, and content (without the final newline).
pub(crate) type TreeFile = (PathBuf, String);

/// A GID as sysfs prints it (`%pI6`): eight groups of four lower-case hex digits.
pub fn format_gid(raw: [u8; 16]) -> String {
    let groups: Vec<String> = raw
        .chunks_exact(2)
        .map(|c| format!("{:02x}{:02x}", c[0], c[1]))
        .collect();
    groups.join(":")
}

/// The GID of a table entry as an IPv6 address (IPv4 addresses as `::ffff:a.b.c.d`).
pub fn gid_ipv6(ip: IpAddr) -> Ipv6Addr {
    Ipv6Addr::from(gid_raw(ip))
}

/// The global file: `class/infiniband_verbs/abi_version`, read by `check_abi_version`
/// (init.c) as soon as any device was found; libibverbs v44 accepts 3..6.
pub(crate) fn global_files() -> Vec<TreeFile> {
    vec![(
        PathBuf::from("class/infiniband_verbs/abi_version"),
        UVERBS_ABI_VERSION.to_string(),
    )]
}

/// The files of one device.
pub(crate) fn device_files(dev: &Device) -> Vec<TreeFile> {
    let name = dev.link.name.as_str();
    let netdev = dev.link.netdev.as_str();
    let uverbs = PathBuf::from("class/infiniband_verbs").join(uverbs_name(name));
    let ibdev = PathBuf::from("class/infiniband").join(name);
    let port = ibdev.join("ports/1");
    let guid = format_guid(dev.node_guid());
    let mut files: Vec<TreeFile> = vec![
        // setup_sysfs_dev (init.c): the ib device this uverbs entry belongs to; libibverbs
        // builds ibdev_path = $SYSFS_PATH/class/infiniband/<ibdev> from it.
        (uverbs.join("ibdev"), name.to_string()),
        // setup_sysfs_uverbs (init.c): "MAJOR:MINOR" of /dev/infiniband/<uverbs>; open_cdev
        // (util/open_cdev.c) insists the node has this number.
        (uverbs.join("dev"), format!("{CDEV_MAJOR}:{CDEV_MINOR}")),
        // setup_sysfs_uverbs: compared with the provider's match_{min,max}_abi_version
        // (match_device, init.c).
        (uverbs.join("abi_version"), UVERBS_ABI_VERSION.to_string()),
        // setup_sysfs_dev: decoded to IBV_NODE_CA (1 = RDMA_NODE_IB_CA), as rxe reports.
        (ibdev.join("node_type"), "1: CA".to_string()),
        // ibv_get_device_guid (device.c; ibv_devices prints it): "%hx:%hx:%hx:%hx".
        (ibdev.join("node_guid"), guid.clone()),
        // Not read by libibverbs; the kernel has it for every device, and it equals node_guid
        // for rxe.
        (ibdev.join("sys_image_guid"), guid),
        // Not read by libibverbs; the kernel's node_desc (rxe: "rxe"), for people and tools.
        (ibdev.join("node_desc"), format!("xroce {name}")),
        // match_modalias_device (init.c): the provider matches "xroce:*".
        (
            ibdev.join("device/modalias"),
            format!("{MODALIAS_PREFIX}{name}"),
        ),
        // Read by the xroce provider: the netdev its engine drives.
        (ibdev.join(NETDEV_FILE), netdev.to_string()),
        // Not read by libibverbs (link_layer comes from the provider's query_port); the
        // kernel has it, and it documents the device.
        (port.join("link_layer"), "Ethernet".to_string()),
        // ibv_query_pkey / ibv_get_pkey_index (verbs.c): "%hx"; rxe's P_Key table is the
        // default P_Key alone.
        (port.join("pkeys/0"), "0xffff".to_string()),
    ];
    files.extend(gid_files(&port, netdev, &dev.gids));
    files
}

/// The GID table in the GID files of the device directory `ibdev_dir` (empty slots `None`,
/// trailing ones left out), if the directory is that of a device on `netdev` and its files
/// read as GIDs.
pub fn read_port_gids(ibdev_dir: &Path, netdev: &str) -> Option<Vec<Option<IpAddr>>> {
    let owner = fs::read_to_string(ibdev_dir.join(NETDEV_FILE)).ok()?;
    if owner.trim() != netdev {
        return None;
    }
    let mut table = Vec::with_capacity(GID_TABLE_LEN);
    for index in 0..GID_TABLE_LEN {
        let text = fs::read_to_string(ibdev_dir.join(format!("ports/1/gids/{index}"))).ok()?;
        let gid: Ipv6Addr = text.trim().parse().ok()?;
        table.push(if gid.is_unspecified() {
            None
        } else {
            Some(gid.to_ipv4_mapped().map_or(IpAddr::V6(gid), IpAddr::V4))
        });
    }
    while table.last() == Some(&None) {
        table.pop();
    }
    Some(table)
}

/// The GID files of a port directory (`ports/1`, relative to the tree or not) for a table
/// whose empty slots are `None`.
///
/// query_sysfs_gid / query_sysfs_gid_type / query_sysfs_gid_ndev_ifindex (cmd_device.c) read
/// them for every index below the provider's gid_tbl_len, on every call: ibv_query_gid,
/// ibv_query_gid_type, ibv_query_gid_ex, ibv_query_gid_table (and so ibv_devinfo -v, perftest,
/// rc_pingpong -g).
fn gid_files(port: &Path, netdev: &str, gids: &[Option<IpAddr>]) -> Vec<TreeFile> {
    let mut files = Vec::with_capacity(3 * GID_TABLE_LEN);
    for index in 0..GID_TABLE_LEN {
        let gid = gids.get(index).copied().flatten();
        let raw = gid.map(gid_raw).unwrap_or([0; 16]);
        files.push((port.join(format!("gids/{index}")), format_gid(raw)));
        let (gid_type, ndev) = match gid {
            Some(_) => (GID_TYPE_ROCE_V2, netdev),
            None => (GID_TYPE_EMPTY_SLOT, ""),
        };
        files.push((
            port.join(format!("gid_attrs/types/{index}")),
            gid_type.to_string(),
        ));
        // if_nametoindex of the content; an empty file reads as "no netdev" (index 0), as
        // the kernel's EINVAL for an empty slot does.
        files.push((
            port.join(format!("gid_attrs/ndevs/{index}")),
            ndev.to_string(),
        ));
    }
    files
}

/// Rewrites the GID files of the device whose directory in a generated tree is `ibdev_dir`
/// (`.../class/infiniband/NAME`, what libibverbs calls `ibdev_path`) with `gids`, the table
/// of the engine that runs the device: libibverbs reads them on every GID query, so a
/// program sees the table its engine uses, empty slots and all, after addresses change.
/// Each file is replaced in one step (written beside it, then renamed over it), so a reader
/// sees the old content or the new, and under the registry's lock taken shared, so that a
/// regeneration never swaps the tree in the middle. Only files that change are written. A
/// directory that is not there (the tree was regenerated without the device), or that now
/// belongs to a device on another netdev (deleted and made again under the same name), is
/// an error, and nothing is written.
pub fn write_port_gids(
    ibdev_dir: &Path,
    netdev: &str,
    gids: &[Option<IpAddr>],
) -> Result<(), RegistryError> {
    let _lock = shared_lock()?;
    let owner = ibdev_dir.join(NETDEV_FILE);
    match fs::read_to_string(&owner) {
        Ok(name) if name.trim() == netdev => {}
        Ok(name) => {
            return Err(RegistryError::io(
                "writing GIDs into",
                ibdev_dir,
                std::io::Error::other(format!(
                    "the device there now runs on {}, not {netdev}",
                    name.trim()
                )),
            ))
        }
        Err(e) => return Err(RegistryError::io("reading", &owner, e)),
    }
    for (path, content) in gid_files(&ibdev_dir.join("ports/1"), netdev, gids) {
        let content = format!("{content}\n");
        if fs::read_to_string(&path).is_ok_and(|old| old == content) {
            continue;
        }
        write_file(&path, &content)?;
    }
    Ok(())
}

/// Directories whose modification time libibverbs uses to tell a device apart from a new one
/// with the same name (`setup_sysfs_uverbs` stats ibdev_path; `same_sysfs_dev` compares the
/// times when a program lists devices again). They get the link's creation time, so
/// regenerating the tree does not make a program see its device replaced.
fn stable_dirs(dev: &Device) -> [PathBuf; 2] {
    [
        PathBuf::from("class/infiniband").join(&dev.link.name),
        PathBuf::from("class/infiniband_verbs").join(uverbs_name(&dev.link.name)),
    ]
}

/// Writes the tree for `devices` at `root`, replacing what was there in one step: the new tree
/// is built next to it and exchanged with it (`renameat2(RENAME_EXCHANGE)`), so a program
/// reading the tree sees the old or the new one, never a half-written one.
pub(crate) fn write(root: &Path, devices: &[Device]) -> Result<(), RegistryError> {
    let staging = staging_path(root);
    remove_tree(&staging)?;
    mkdir(&staging)?;
    let result = write_into(&staging, devices).and_then(|()| swap_in(&staging, root));
    // After a successful exchange the staging path holds the old tree.
    let cleanup = remove_tree(&staging);
    result.and(cleanup)
}

fn staging_path(root: &Path) -> PathBuf {
    let mut name = root.file_name().unwrap_or_default().to_os_string();
    name.push(".new");
    root.with_file_name(name)
}

fn write_into(dir: &Path, devices: &[Device]) -> Result<(), RegistryError> {
    let mut files = global_files();
    for dev in devices {
        files.extend(device_files(dev));
    }
    for (rel, content) in &files {
        let path = dir.join(rel);
        if let Some(parent) = path.parent() {
            mkdir(parent)?;
        }
        fs::write(&path, format!("{content}\n"))
            .map_err(|e| RegistryError::io("writing", &path, e))?;
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644))
            .map_err(|e| RegistryError::io("setting the mode of", &path, e))?;
    }
    link_real_devices(dir, Path::new(REAL_SYSFS), devices)?;
    // Last: creating entries inside a directory updates its modification time.
    for dev in devices {
        for rel in stable_dirs(dev) {
            set_mtime(&dir.join(rel), dev.link.created)?;
        }
    }
    Ok(())
}

/// Where the kernel's own sysfs is.
const REAL_SYSFS: &str = "/sys";

/// Makes the kernel's RDMA devices (if any) part of the tree, as symbolic links to their real
/// sysfs directories, so that a program reading this tree (`xroce exec`) still finds the
/// host's real devices next to the xroce ones. A real device whose name an xroce device uses
/// is left out.
fn link_real_devices(dir: &Path, sysfs: &Path, devices: &[Device]) -> Result<(), RegistryError> {
    let taken = |name: &str| {
        devices
            .iter()
            .any(|d| d.link.name == name || uverbs_name(&d.link.name) == name)
    };
    for class in ["class/infiniband_verbs", "class/infiniband"] {
        let Ok(entries) = fs::read_dir(sysfs.join(class)) else {
            continue; // no RDMA in this kernel
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name_str) = name.to_str() else {
                continue;
            };
            // Only device entries: the class's own files (abi_version) stay ours.
            if taken(name_str) || !entry.path().is_dir() {
                continue;
            }
            let link = dir.join(class).join(&name);
            mkdir(&dir.join(class))?;
            std::os::unix::fs::symlink(entry.path(), &link)
                .map_err(|e| RegistryError::io("linking", &link, e))?;
        }
    }
    Ok(())
}

fn set_mtime(dir: &Path, time: SystemTime) -> Result<(), RegistryError> {
    File::open(dir)
        .and_then(|f| f.set_modified(time))
        .map_err(|e| RegistryError::io("setting the time of", dir, e))
}

/// Puts `staging` at `root`; afterwards `staging` holds the previous tree, if there was one.
fn swap_in(staging: &Path, root: &Path) -> Result<(), RegistryError> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|_| RegistryError::io("renaming", p, std::io::ErrorKind::InvalidInput.into()))
    };
    let (from, to) = (c(staging)?, c(root)?);
    // SAFETY: both paths are NUL-terminated and live across the call.
    let ret = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if ret == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        // No tree yet: a plain rename.
        Some(libc::ENOENT) => {}
        // A file system without RENAME_EXCHANGE: not atomic, but correct.
        Some(libc::EINVAL) => remove_tree(root)?,
        _ => return Err(RegistryError::io("replacing", root, err)),
    }
    fs::rename(staging, root).map_err(|e| RegistryError::io("replacing", root, e))
}

#[cfg(test)]
mod tests {
    use super::super::Link;
    use super::*;
    use crate::netlink::Interface;

    fn device(gids: Vec<IpAddr>) -> Device {
        let mac = [0x02, 0x42, 0xac, 0x11, 0x00, 0x02];
        Device {
            link: Link {
                name: "xr_0".to_string(),
                netdev: "veth7".to_string(),
                created: SystemTime::UNIX_EPOCH,
            },
            iface: Interface {
                index: 3,
                name: "veth7".to_string(),
                mac,
                mtu: 1500,
                up: true,
                admin_up: true,
                rx_queues: 1,
            },
            gids: gids.into_iter().map(Some).collect(),
        }
    }

    fn content<'a>(files: &'a [TreeFile], rel: &str) -> &'a str {
        files
            .iter()
            .find(|(p, _)| p == Path::new(rel))
            .map(|(_, c)| c.as_str())
            .unwrap_or_else(|| panic!("no file {rel}"))
    }

    #[test]
    fn gids_print_like_the_kernel() {
        let lladdr: IpAddr = "fe80::42:acff:fe11:2".parse().unwrap();
        assert_eq!(
            format_gid(gid_raw(lladdr)),
            "fe80:0000:0000:0000:0042:acff:fe11:0002"
        );
        let v4: IpAddr = "10.77.0.11".parse().unwrap();
        assert_eq!(
            format_gid(gid_raw(v4)),
            "0000:0000:0000:0000:0000:ffff:0a4d:000b"
        );
        assert_eq!(gid_ipv6(v4).to_string(), "::ffff:10.77.0.11");
        // libibverbs reads the file into char[41] and parses "%hx" at every 5th character.
        assert_eq!(format_gid([0xab; 16]).len() + 1, 40);
    }

    #[test]
    fn device_files_hold_what_libibverbs_parses() {
        let gids: Vec<IpAddr> = vec![
            "fe80::42:acff:fe11:2".parse().unwrap(),
            "10.1.2.3".parse().unwrap(),
        ];
        let files = device_files(&device(gids));
        let v = "class/infiniband_verbs/xroce-xr_0";
        assert_eq!(content(&files, &format!("{v}/ibdev")), "xr_0");
        assert_eq!(content(&files, &format!("{v}/dev")), "1:7");
        assert_eq!(content(&files, &format!("{v}/abi_version")), "6");
        let d = "class/infiniband/xr_0";
        assert_eq!(content(&files, &format!("{d}/node_type")), "1: CA");
        assert_eq!(
            content(&files, &format!("{d}/node_guid")),
            "0042:acff:fe11:0002"
        );
        assert_eq!(
            content(&files, &format!("{d}/sys_image_guid")),
            "0042:acff:fe11:0002"
        );
        assert_eq!(
            content(&files, &format!("{d}/device/modalias")),
            "xroce:xr_0"
        );
        assert_eq!(content(&files, &format!("{d}/xroce_netdev")), "veth7");
        let p = format!("{d}/ports/1");
        assert_eq!(content(&files, &format!("{p}/pkeys/0")), "0xffff");
        assert_eq!(content(&files, &format!("{p}/link_layer")), "Ethernet");
        assert_eq!(
            content(&files, &format!("{p}/gids/1")),
            "0000:0000:0000:0000:0000:ffff:0a01:0203"
        );
        for i in 0..2 {
            assert_eq!(
                content(&files, &format!("{p}/gid_attrs/types/{i}")),
                "RoCE v2"
            );
            assert_eq!(
                content(&files, &format!("{p}/gid_attrs/ndevs/{i}")),
                "veth7"
            );
        }
        for i in 2..GID_TABLE_LEN {
            assert_eq!(
                content(&files, &format!("{p}/gids/{i}")),
                "0000:0000:0000:0000:0000:0000:0000:0000"
            );
            assert_eq!(
                content(&files, &format!("{p}/gid_attrs/types/{i}")),
                "IB/RoCE v1"
            );
            assert_eq!(content(&files, &format!("{p}/gid_attrs/ndevs/{i}")), "");
        }
        // libibverbs' read buffers, including the newline: types char[11], ndevs char[16],
        // pkeys char[8], node_guid char[24], gids char[41].
        for (rel, c) in &files {
            let limit = match rel.to_string_lossy() {
                r if r.contains("gid_attrs/types/") => 11,
                r if r.contains("gid_attrs/ndevs/") => 16,
                r if r.contains("pkeys/") => 8,
                r if r.ends_with("node_guid") => 24,
                r if r.contains("/gids/") => 41,
                _ => 32,
            };
            assert!(c.len() < limit, "{rel:?}: {c:?}");
        }
    }

    #[test]
    fn the_table_is_cut_at_its_length() {
        let gids: Vec<IpAddr> = (0..20u8).map(|i| IpAddr::from([10, 0, 0, i])).collect();
        let files = device_files(&device(gids));
        let n = files
            .iter()
            .filter(|(p, _)| p.to_string_lossy().contains("/gids/"))
            .count();
        assert_eq!(n, GID_TABLE_LEN);
        assert_eq!(
            content(&files, "class/infiniband/xr_0/ports/1/gids/15"),
            "0000:0000:0000:0000:0000:ffff:0a00:000f"
        );
    }

    #[test]
    fn real_devices_are_linked_into_the_tree() {
        let base = std::env::temp_dir().join(format!("xroce-registry-real-{}", std::process::id()));
        let _ = fs::remove_dir_all(&base);
        // A fake kernel sysfs with one real device (mlx5_0 / uverbs0) and one whose name an
        // xroce device uses.
        let sysfs = base.join("sys");
        for d in [
            "class/infiniband_verbs/uverbs0",
            "class/infiniband/mlx5_0/ports/1",
            "class/infiniband/xr_0",
        ] {
            fs::create_dir_all(sysfs.join(d)).unwrap();
        }
        fs::write(
            sysfs.join("class/infiniband_verbs/uverbs0/ibdev"),
            "mlx5_0\n",
        )
        .unwrap();
        fs::write(sysfs.join("class/infiniband_verbs/abi_version"), "6\n").unwrap();
        let tree = base.join("tree");
        fs::create_dir_all(&tree).unwrap();
        link_real_devices(&tree, &sysfs, &[device(vec![])]).unwrap();
        assert_eq!(
            fs::read_to_string(tree.join("class/infiniband_verbs/uverbs0/ibdev")).unwrap(),
            "mlx5_0\n"
        );
        assert!(tree.join("class/infiniband/mlx5_0/ports/1").is_dir());
        // Ours wins a name clash; class files are not linked.
        assert!(!tree.join("class/infiniband/xr_0").exists());
        assert!(!tree.join("class/infiniband_verbs/abi_version").exists());
        fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn write_swaps_trees_and_keeps_device_times() {
        let base = std::env::temp_dir().join(format!("xroce-registry-unit-{}", std::process::id()));
        let _ = fs::remove_dir_all(&base);
        let root = base.join("sysfs");
        let created = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000);
        let mut dev = device(vec!["10.1.2.3".parse().unwrap()]);
        dev.link.created = created;
        write(&root, std::slice::from_ref(&dev)).expect("first write");
        let ibdev = root.join("class/infiniband/xr_0");
        assert_eq!(fs::metadata(&ibdev).unwrap().modified().unwrap(), created);
        assert_eq!(
            fs::read_to_string(root.join("class/infiniband_verbs/abi_version")).unwrap(),
            "6\n"
        );
        // Second write: another address, same time; the old tree is gone.
        dev.gids = vec![Some("10.9.9.9".parse().unwrap())];
        write(&root, std::slice::from_ref(&dev)).expect("second write");
        assert_eq!(
            fs::read_to_string(ibdev.join("ports/1/gids/0")).unwrap(),
            "0000:0000:0000:0000:0000:ffff:0a09:0909\n"
        );
        assert_eq!(fs::metadata(&ibdev).unwrap().modified().unwrap(), created);
        assert!(!staging_path(&root).exists());
        // No devices: only the global file.
        write(&root, &[]).expect("empty write");
        assert!(!ibdev.exists());
        assert!(root.join("class/infiniband_verbs/abi_version").exists());
        fs::remove_dir_all(&base).unwrap();
    }

    /// An engine's table over a written tree: an empty slot between two addresses, each file
    /// as a fresh tree would have it; no temporary file left; a device not in the tree, or one
    /// on another netdev, is an error.
    #[test]
    fn port_gids_are_rewritten_in_place_with_empty_slots() {
        let base = std::env::temp_dir().join(format!("xroce-gid-mirror-{}", std::process::id()));
        let _ = fs::remove_dir_all(&base);
        let root = base.join("sysfs");
        let (a, b): (IpAddr, IpAddr) = ("10.1.2.3".parse().unwrap(), "10.4.5.6".parse().unwrap());
        write(&root, &[device(vec![a, b])]).expect("write");
        let ibdev = root.join("class/infiniband/xr_0");
        write_port_gids(&ibdev, "veth7", &[Some(a), None, Some(b)]).expect("rewrite");
        let read = |rel: &str| fs::read_to_string(ibdev.join("ports/1").join(rel)).unwrap();
        assert_eq!(read("gids/0"), format!("{}\n", format_gid(gid_raw(a))));
        assert_eq!(read("gids/1"), format!("{}\n", format_gid([0; 16])));
        assert_eq!(
            read("gid_attrs/types/1"),
            format!("{GID_TYPE_EMPTY_SLOT}\n")
        );
        assert_eq!(read("gid_attrs/ndevs/1"), "\n");
        assert_eq!(read("gids/2"), format!("{}\n", format_gid(gid_raw(b))));
        assert_eq!(read("gid_attrs/types/2"), format!("{GID_TYPE_ROCE_V2}\n"));
        assert_eq!(read("gid_attrs/ndevs/2"), "veth7\n");
        let files = fs::read_dir(ibdev.join("ports/1/gids")).unwrap().count();
        assert_eq!(files, GID_TABLE_LEN, "no temporary file is left");
        assert!(write_port_gids(&root.join("class/infiniband/gone"), "veth7", &[Some(a)]).is_err());
        // The directory of a device on another netdev is left alone.
        let before = read("gids/0");
        assert!(write_port_gids(&ibdev, "veth9", &[Some(b)]).is_err());
        assert_eq!(read("gids/0"), before);
        // Read back as written, trailing empty slots left out; not for another netdev.
        assert_eq!(
            read_port_gids(&ibdev, "veth7"),
            Some(vec![Some(a), None, Some(b)])
        );
        assert_eq!(read_port_gids(&ibdev, "veth9"), None);
        fs::remove_dir_all(&base).unwrap();
    }
}
