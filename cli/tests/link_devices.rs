//! `xroce link add | del | show` and `xroce exec` as a user runs them: the real binary inside
//! network namespaces, checked against the files it writes, the device node, the XDP program
//! and libibverbs itself (`ibv_devices`).
//!
//! Needs root (namespaces, XDP, /run, /dev); fails without it unless
//! `XROCE_SKIP_ROOT_TESTS=1`. Needs ibverbs-utils (`ibv_devices`). Link names are unique per
//! test process, and every link is deleted again, also when a test fails.

use std::net::Ipv4Addr;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use xroce_datapath::netns::{root_or_skip, run_bounded, NetnsPair};
use xroce_datapath::xdp;

const XROCE: &str = env!("CARGO_BIN_EXE_xroce");
/// Bound on every command a test runs.
const TIMEOUT: Duration = Duration::from_secs(30);

static NAMES: AtomicU32 = AtomicU32::new(0);

/// A link name no other test (or test process) uses.
fn unique_name() -> String {
    format!(
        "lt{}x{}",
        std::process::id(),
        NAMES.fetch_add(1, Ordering::Relaxed)
    )
}

fn run(cmd: Command) -> Output {
    let shown = format!("{cmd:?}");
    run_bounded(cmd, TIMEOUT).unwrap_or_else(|e| panic!("{shown}: {e}"))
}

/// `xroce ARGS` inside namespace `side`, with extra environment.
fn xroce_env(pair: &NetnsPair, side: usize, env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut cmd = pair.command(side, XROCE);
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    run(cmd)
}

fn xroce(pair: &NetnsPair, side: usize, args: &[&str]) -> Output {
    xroce_env(pair, side, &[], args)
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn assert_ok(o: &Output, what: &str) {
    assert!(
        o.status.success(),
        "{what} failed ({}): stdout {:?} stderr {:?}",
        o.status,
        stdout(o),
        stderr(o)
    );
}

/// A failure the way the command promises: non-zero exit, one line on stderr containing
/// `needle`, no panic.
fn assert_clear_error(o: &Output, what: &str, needle: &str) {
    let err = stderr(o);
    assert!(!o.status.success(), "{what} succeeded: {}", stdout(o));
    assert_eq!(o.status.code(), Some(1), "{what}: {err}");
    assert_eq!(
        err.lines().count(),
        1,
        "{what}: stderr is not one line: {err:?}"
    );
    assert!(!err.contains("panicked"), "{what}: {err}");
    assert!(err.contains(needle), "{what}: {err:?} lacks {needle:?}");
}

/// Deletes link `name` in namespace `side` when dropped (declare after the pair, so it runs
/// before the namespaces go).
struct LinkGuard<'a> {
    pair: &'a NetnsPair,
    side: usize,
    name: String,
}

impl Drop for LinkGuard<'_> {
    fn drop(&mut self) {
        let mut cmd = self.pair.command(self.side, XROCE);
        cmd.args(["link", "del", &self.name]);
        let _ = run_bounded(cmd, TIMEOUT);
    }
}

/// Adds link `name` on the veth end of `side`, checking it worked; deleted when the guard goes.
fn add_link<'a>(pair: &'a NetnsPair, side: usize, name: &str) -> (LinkGuard<'a>, Output) {
    let guard = LinkGuard {
        pair,
        side,
        name: name.to_string(),
    };
    let o = xroce(
        pair,
        side,
        &["link", "add", name, "netdev", pair.iface(side)],
    );
    assert_ok(&o, "link add");
    (guard, o)
}

/// `/run/xroce/net-<N>` of namespace `side`: N is the inode of the namespace, which the
/// `/run/netns/NAME` bind mount shows.
fn run_dir(pair: &NetnsPair, side: usize) -> PathBuf {
    let ino = std::fs::metadata(Path::new("/run/netns").join(pair.ns_name(side)))
        .expect("stat /run/netns/NS")
        .ino();
    PathBuf::from(format!("/run/xroce/net-{ino}"))
}

fn read(path: impl AsRef<Path>) -> String {
    let path = path.as_ref();
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
        .trim_end_matches('\n')
        .to_string()
}

/// The MAC of the veth end of `side`, as the kernel shows it in the namespace's sysfs.
fn mac(pair: &NetnsPair, side: usize) -> [u8; 6] {
    let o = pair
        .exec(
            side,
            &format!("cat /sys/class/net/{}/address", pair.iface(side)),
        )
        .expect("read the MAC");
    let text = stdout(&o);
    let bytes: Vec<u8> = text
        .trim()
        .split(':')
        .map(|h| u8::from_str_radix(h, 16).expect("MAC byte"))
        .collect();
    bytes.try_into().expect("6-byte MAC")
}

/// Sysfs text of `fe80::` + modified EUI-64 of `mac`, written out independently of the code
/// under test.
fn link_local_gid(mac: [u8; 6]) -> String {
    format!(
        "fe80:0000:0000:0000:{:02x}{:02x}:{:02x}ff:fe{:02x}:{:02x}{:02x}",
        mac[0] ^ 2,
        mac[1],
        mac[2],
        mac[3],
        mac[4],
        mac[5]
    )
}

fn node_guid_text(mac: [u8; 6]) -> String {
    link_local_gid(mac)["fe80:0000:0000:0000:".len()..].to_string()
}

fn ipv4_gid(ip: Ipv4Addr) -> String {
    let o = ip.octets();
    format!(
        "0000:0000:0000:0000:0000:ffff:{:02x}{:02x}:{:02x}{:02x}",
        o[0], o[1], o[2], o[3]
    )
}

fn assert_dev_node(name: &str) {
    let path = format!("/dev/infiniband/xroce-{name}");
    let meta = std::fs::symlink_metadata(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    assert!(
        meta.file_type().is_char_device(),
        "{path} is not a char device"
    );
    assert_eq!(
        (libc::major(meta.rdev()), libc::minor(meta.rdev())),
        (1, 7),
        "{path}"
    );
    assert_eq!(meta.permissions().mode() & 0o777, 0o666, "{path}");
}

fn xdp_attached(pair: &NetnsPair, side: usize) -> bool {
    let iface = pair.iface(side).to_string();
    pair.run_in(side, move || {
        xdp::status(Some(&iface))
            .expect("xdp status")
            .first()
            .is_some_and(|s| s.xroce.is_some())
    })
}

#[test]
fn link_add_writes_the_tree_show_lists_it_and_del_removes_it() {
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::new("xrlink", 1500).expect("namespaces");
    let name = unique_name();
    let (guard, added) = add_link(&pair, 0, &name);
    let mac = mac(&pair, 0);
    let out = stdout(&added);
    assert!(
        out.contains(&format!("{name}: netdev xr0, XDP program loaded (native")),
        "{out}"
    );
    assert!(out.contains(&format!("::ffff:{}", pair.ipv4(0))), "{out}");
    assert!(
        xdp_attached(&pair, 0),
        "XDP program not attached after link add"
    );

    // The record and the tree.
    let dir = run_dir(&pair, 0);
    assert_eq!(read(dir.join("links").join(&name)), "netdev=xr0");
    let sysfs = dir.join("sysfs");
    let verbs = sysfs.join("class/infiniband_verbs");
    assert_eq!(read(verbs.join("abi_version")), "6");
    let uverbs = verbs.join(format!("xroce-{name}"));
    assert_eq!(read(uverbs.join("ibdev")), name);
    assert_eq!(read(uverbs.join("dev")), "1:7");
    assert_eq!(read(uverbs.join("abi_version")), "6");
    let ibdev = sysfs.join("class/infiniband").join(&name);
    assert_eq!(read(ibdev.join("node_type")), "1: CA");
    assert_eq!(read(ibdev.join("node_guid")), node_guid_text(mac));
    assert_eq!(read(ibdev.join("sys_image_guid")), node_guid_text(mac));
    assert_eq!(read(ibdev.join("device/modalias")), format!("xroce:{name}"));
    assert_eq!(read(ibdev.join("xroce_netdev")), "xr0");
    let port = ibdev.join("ports/1");
    assert_eq!(read(port.join("gids/0")), link_local_gid(mac));
    assert_eq!(read(port.join("gids/1")), ipv4_gid(pair.ipv4(0)));
    for i in 0..2 {
        assert_eq!(read(port.join(format!("gid_attrs/types/{i}"))), "RoCE v2");
        assert_eq!(read(port.join(format!("gid_attrs/ndevs/{i}"))), "xr0");
    }
    for i in 2..16 {
        assert_eq!(
            read(port.join(format!("gids/{i}"))),
            "0000:0000:0000:0000:0000:0000:0000:0000"
        );
        // Every slot has a type, or libibverbs' ibv_query_gid_table fails.
        assert!(
            port.join(format!("gid_attrs/types/{i}")).is_file(),
            "types/{i}"
        );
    }
    assert!(!port.join("gids/16").exists());
    assert_eq!(read(port.join("pkeys/0")), "0xffff");
    assert_eq!(read(port.join("link_layer")), "Ethernet");
    assert_dev_node(&name);

    // show
    let o = xroce(&pair, 0, &["link", "show"]);
    assert_ok(&o, "link show");
    let shown = stdout(&o);
    assert!(
        shown.contains(&format!(
            "link {name} netdev xr0 state ACTIVE mtu 1500 (path MTU 1024)"
        )),
        "{shown}"
    );
    assert!(shown.contains("gid 0 fe80::"), "{shown}");
    assert!(
        shown.contains(&format!("gid 1 ::ffff:{}", pair.ipv4(0))),
        "{shown}"
    );
    assert!(shown.contains("xdp attached (native"), "{shown}");
    assert!(shown.contains("queue 0: no socket bound"), "{shown}");
    let o = xroce(&pair, 0, &["link", "show", &name]);
    assert_ok(&o, "link show NAME");
    assert!(
        stdout(&o).starts_with(&format!("link {name} ")),
        "{}",
        stdout(&o)
    );
    let o = xroce(&pair, 0, &["link", "show", "nosuchlink"]);
    assert_clear_error(&o, "link show of a missing link", "no xroce link named");

    // The errors.
    let o = xroce(&pair, 0, &["link", "add", &name, "netdev", "xr0"]);
    assert_clear_error(&o, "second link add", "already exists");
    let other = unique_name();
    let o = xroce(&pair, 0, &["link", "add", &other, "netdev", "xr0"]);
    assert_clear_error(&o, "second link on the netdev", "already has an xroce link");
    let o = xroce(&pair, 0, &["link", "add", &other, "netdev", "nosuchdev0"]);
    assert_clear_error(
        &o,
        "link add on a missing netdev",
        "no network interface named",
    );
    let too_long = "x".repeat(33);
    for bad in ["a/b", "a.b", too_long.as_str(), "-x"] {
        let o = xroce(&pair, 0, &["link", "add", "--", bad, "netdev", "xr0"]);
        assert_clear_error(
            &o,
            &format!("link add {bad:?}"),
            "not a valid xroce link name",
        );
    }
    let o = xroce(&pair, 0, &["link", "add", &other, "type", "xr0"]);
    assert_eq!(o.status.code(), Some(2), "usage error: {}", stderr(&o));
    assert!(!dir.join("links").join(&other).exists());
    assert!(!Path::new(&format!("/dev/infiniband/xroce-{other}")).exists());

    // del
    let o = xroce(&pair, 0, &["link", "del", &name]);
    assert_ok(&o, "link del");
    assert!(
        stdout(&o).contains("XDP program unloaded"),
        "{}",
        stdout(&o)
    );
    assert!(
        !xdp_attached(&pair, 0),
        "XDP program still attached after link del"
    );
    assert!(
        !dir.exists(),
        "{} left behind by the last link",
        dir.display()
    );
    assert!(!Path::new(&format!("/dev/infiniband/xroce-{name}")).exists());
    let o = xroce(&pair, 0, &["link", "show"]);
    assert_ok(&o, "link show with no links");
    assert_eq!(stdout(&o), "");
    let o = xroce(&pair, 0, &["link", "del", &name]);
    assert_clear_error(&o, "second link del", "no xroce link named");
    drop(guard);
}

/// GID indices are what programs exchange, so an address keeps its index when the tree is
/// written again (`xroce exec` does, as `link add` and `link del` do): the first IPv4 address
/// removed leaves its slot empty, and the second stays at index 2 instead of moving up, as in
/// the kernel's GID table of an rdma_rxe device. `link show` lists the same table.
/// What the registry code notices and a user should hear of reaches stderr: a link record
/// that cannot be read is skipped with a warning (before `XROCE_LOG` existed, no logger was
/// installed and such warnings went nowhere). `XROCE_LOG=error` silences it; an unknown
/// level is said and the default kept.
#[test]
fn a_link_record_without_its_netdev_is_skipped_with_a_warning() {
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::new("xrlw", 1500).expect("namespaces");
    let name = unique_name();
    let (_guard, _) = add_link(&pair, 0, &name);
    let broken = unique_name();
    let record = run_dir(&pair, 0).join("links").join(&broken);
    std::fs::write(&record, "mtu=1500\n").expect("write a broken record");
    let warning = format!(
        "xroce: warning: ignoring {}: no netdev= line",
        record.display()
    );

    let o = xroce(&pair, 0, &["link", "show"]);
    assert_ok(&o, "link show");
    assert!(
        stdout(&o).contains(&format!("link {name} netdev")) && !stdout(&o).contains(&broken),
        "{}",
        stdout(&o)
    );
    assert_eq!(stderr(&o).trim_end(), warning);

    let quiet = xroce_env(&pair, 0, &[("XROCE_LOG", "error")], &["link", "show"]);
    assert_ok(&quiet, "link show with XROCE_LOG=error");
    assert_eq!(stderr(&quiet), "");

    let typo = xroce_env(&pair, 0, &[("XROCE_LOG", "loud")], &["link", "show"]);
    assert_ok(&typo, "link show with XROCE_LOG=loud");
    let err = stderr(&typo);
    assert!(
        err.contains("XROCE_LOG=\"loud\" is not one of off, error, warn, info, debug, trace")
            && err.contains(&warning),
        "{err}"
    );
    std::fs::remove_file(&record).expect("remove the broken record");
}

#[test]
fn gid_indices_stay_put_when_the_tree_is_written_again() {
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::new("xrlg", 1500).expect("namespaces");
    let iface = pair.iface(0).to_string();
    let second: Ipv4Addr = "10.251.7.1".parse().unwrap();
    let ip = |args: String| {
        let o = pair.exec(0, &args).expect("run ip");
        assert!(o.status.success(), "{args}: {o:?}");
    };
    ip(format!("ip addr add {second}/24 dev {iface}"));
    let name = unique_name();
    let (_guard, _) = add_link(&pair, 0, &name);
    let port = run_dir(&pair, 0)
        .join("sysfs/class/infiniband")
        .join(&name)
        .join("ports/1");
    assert_eq!(read(port.join("gids/1")), ipv4_gid(pair.ipv4(0)));
    assert_eq!(read(port.join("gids/2")), ipv4_gid(second));

    ip(format!("ip addr del {}/24 dev {iface}", pair.ipv4(0)));
    assert_ok(&xroce(&pair, 0, &["exec", "--", "true"]), "exec");
    assert_eq!(
        read(port.join("gids/1")),
        "0000:0000:0000:0000:0000:0000:0000:0000"
    );
    assert_eq!(read(port.join("gid_attrs/ndevs/1")), "");
    assert_eq!(read(port.join("gids/2")), ipv4_gid(second));
    let shown = stdout(&xroce(&pair, 0, &["link", "show", &name]));
    assert!(
        shown.contains(&format!("gid 2 ::ffff:{second}")) && !shown.contains("gid 1 "),
        "{shown}"
    );
}

#[test]
fn links_of_the_same_name_in_two_namespaces_are_separate() {
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::new("xrlink2", 1500).expect("namespaces");
    let name = unique_name();
    let (_g0, _) = add_link(&pair, 0, &name);
    let (_g1, _) = add_link(&pair, 1, &name);
    let (dir0, dir1) = (run_dir(&pair, 0), run_dir(&pair, 1));
    assert_ne!(dir0, dir1);
    for (side, dir) in [(0, &dir0), (1, &dir1)] {
        let ibdev = dir.join("sysfs/class/infiniband").join(&name);
        assert_eq!(read(ibdev.join("xroce_netdev")), pair.iface(side));
        assert_eq!(
            read(ibdev.join("ports/1/gids/1")),
            ipv4_gid(pair.ipv4(side))
        );
        assert_eq!(
            read(ibdev.join("ports/1/gids/0")),
            link_local_gid(mac(&pair, side))
        );
        let shown = stdout(&xroce(&pair, side, &["link", "show"]));
        assert_eq!(
            shown.lines().filter(|l| l.starts_with("link ")).count(),
            1,
            "{shown}"
        );
        assert!(
            shown.contains(&format!("link {name} netdev {} ", pair.iface(side))),
            "{shown}"
        );
    }
    assert_dev_node(&name);

    // Deleting in namespace 0 leaves namespace 1's link, tree and the shared node alone.
    let o = xroce(&pair, 0, &["link", "del", &name]);
    assert_ok(&o, "link del in namespace 0");
    assert!(!dir0.exists());
    assert_eq!(
        read(
            dir1.join("sysfs/class/infiniband")
                .join(&name)
                .join("xroce_netdev")
        ),
        "xr1"
    );
    assert_dev_node(&name);
    assert!(xdp_attached(&pair, 1));
    assert!(!xdp_attached(&pair, 0));

    let o = xroce(&pair, 1, &["link", "del", &name]);
    assert_ok(&o, "link del in namespace 1");
    assert!(!Path::new(&format!("/dev/infiniband/xroce-{name}")).exists());
}

/// A stand-in for the provider when only the environment is checked: a library every
/// libibverbs program loads anyway, so preloading it changes nothing.
fn libibverbs_path() -> PathBuf {
    [
        "/usr/lib/x86_64-linux-gnu/libibverbs.so.1",
        "/usr/lib/aarch64-linux-gnu/libibverbs.so.1",
        "/usr/lib64/libibverbs.so.1",
        "/usr/lib/libibverbs.so.1",
    ]
    .iter()
    .map(PathBuf::from)
    .find(|p| p.exists())
    .expect("libibverbs.so.1 not found: install libibverbs1 and ibverbs-utils")
}

/// The real provider, if it has been built: next to the xroce binary (where `xroce exec`
/// looks), or in the workspace's own target directory.
fn built_provider() -> Option<PathBuf> {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut candidates = vec![Path::new(XROCE).with_file_name("libxroce_provider.so")];
    for profile in ["debug", "release"] {
        candidates.push(
            workspace
                .join("target")
                .join(profile)
                .join("libxroce_provider.so"),
        );
    }
    candidates.into_iter().find(|p| p.is_file())
}

fn have_ibv_devices() {
    let found = std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|d| d.join("ibv_devices").is_file()))
        .unwrap_or(false);
    assert!(found, "ibv_devices not found: install ibverbs-utils");
}

#[test]
fn exec_runs_programs_with_the_namespace_tree_and_the_provider() {
    if !root_or_skip() {
        return;
    }
    have_ibv_devices();
    let pair = NetnsPair::new("xrexec", 1500).expect("namespaces");
    let stand_in = libibverbs_path();
    let stand_in_env = [("XROCE_PROVIDER", stand_in.to_str().expect("utf-8 path"))];

    // No links yet.
    let o = xroce_env(&pair, 0, &stand_in_env, &["exec", "--", "true"]);
    assert_clear_error(
        &o,
        "exec without links",
        "no xroce devices in this network namespace",
    );

    let name = unique_name();
    let (_guard, _) = add_link(&pair, 0, &name);
    let sysfs = run_dir(&pair, 0).join("sysfs");

    // The environment the program gets.
    let o = xroce_env(
        &pair,
        0,
        &[
            ("XROCE_PROVIDER", stand_in.to_str().expect("utf-8 path")),
            ("LD_PRELOAD", "/nonexistent-preload.so"),
        ],
        &[
            "exec",
            "--",
            "sh",
            "-c",
            "echo \"$SYSFS_PATH\"; echo \"$XROCE_EXEC\"; echo \"$LD_PRELOAD\"",
        ],
    );
    assert_ok(&o, "exec sh");
    let provider = stand_in.canonicalize().expect("canonical path");
    let expected = format!(
        "{}\n1\n{}:/nonexistent-preload.so\n",
        sysfs.display(),
        provider.display()
    );
    assert_eq!(stdout(&o), expected);

    // The tree is rebuilt before each exec: an address added after `link add` shows up.
    let o = pair
        .exec(0, "ip addr add 10.254.77.5/32 dev xr0")
        .expect("ip addr add");
    assert_ok(&o, "ip addr add");
    let o = xroce_env(&pair, 0, &stand_in_env, &["exec", "--", "true"]);
    assert_ok(&o, "exec true");
    let gids: Vec<String> = (0..16)
        .map(|i| read(sysfs.join(format!("class/infiniband/{name}/ports/1/gids/{i}"))))
        .collect();
    assert!(
        gids.contains(&ipv4_gid(Ipv4Addr::new(10, 254, 77, 5))),
        "{gids:?}"
    );

    // libibverbs itself finds the device through the tree and the node: without a provider
    // that claims it, it says so by name.
    let o = xroce_env(
        &pair,
        0,
        &[
            ("XROCE_PROVIDER", stand_in.to_str().expect("utf-8 path")),
            ("IBV_SHOW_WARNINGS", "1"),
        ],
        &["exec", "--", "ibv_devices"],
    );
    assert_ok(&o, "exec ibv_devices with the stand-in");
    assert!(
        stderr(&o).contains(&format!(
            "no userspace device-specific driver found for {name}"
        )),
        "libibverbs did not find the device: {}",
        stderr(&o)
    );

    // With the real provider, ibv_devices lists it with its node GUID.
    match built_provider() {
        Some(provider) => {
            let o = xroce_env(
                &pair,
                0,
                &[("XROCE_PROVIDER", provider.to_str().expect("utf-8 path"))],
                &["exec", "--", "ibv_devices"],
            );
            assert_ok(&o, "exec ibv_devices");
            let guid = node_guid_text(mac(&pair, 0)).replace(':', "");
            assert!(
                stdout(&o)
                    .lines()
                    .any(|l| l.contains(&name) && l.contains(&guid)),
                "ibv_devices did not list {name} with GUID {guid}: {} {}",
                stdout(&o),
                stderr(&o)
            );
        }
        None => eprintln!(
            "note: libxroce_provider.so is not built yet; skipped the ibv_devices check with \
             the real provider"
        ),
    }

    // Failures.
    let o = xroce_env(
        &pair,
        0,
        &stand_in_env,
        &["exec", "--", "no-such-program-xroce"],
    );
    assert_eq!(o.status.code(), Some(127), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("cannot run no-such-program-xroce"),
        "{}",
        stderr(&o)
    );
    let o = xroce_env(
        &pair,
        0,
        &[("XROCE_PROVIDER", "/nonexistent/libxroce_provider.so")],
        &["exec", "--", "true"],
    );
    assert_clear_error(&o, "exec with a missing provider", "XROCE_PROVIDER");
}

#[test]
fn state_left_by_a_dead_namespace_is_not_inherited() {
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::new("xrstale", 1500).expect("namespaces");
    // What a namespace that had the same id and was deleted without `link del` leaves.
    let dir = run_dir(&pair, 0);
    let ghost = unique_name();
    std::fs::create_dir_all(dir.join("links")).expect("mkdir");
    std::fs::write(dir.join("netns_cookie"), "1\n").expect("write cookie");
    std::fs::write(dir.join("links").join(&ghost), "netdev=xr0\n").expect("write record");
    struct Cleanup(PathBuf);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _cleanup = Cleanup(dir.clone());

    let o = xroce(&pair, 0, &["link", "show"]);
    assert_ok(&o, "link show");
    assert_eq!(stdout(&o), "", "a dead namespace's link is listed");
    let name = unique_name();
    let (_guard, _) = add_link(&pair, 0, &name);
    assert!(!dir.join("links").join(&ghost).exists());
    let shown = stdout(&xroce(&pair, 0, &["link", "show"]));
    assert!(!shown.contains(&ghost), "{shown}");
    assert!(shown.contains(&name), "{shown}");
}

#[test]
fn link_add_without_privileges_is_refused_clearly() {
    if !root_or_skip() {
        return;
    }
    let setpriv = Path::new("/usr/bin/setpriv");
    assert!(setpriv.exists(), "setpriv (util-linux) is needed");
    let pair = NetnsPair::new("xrpriv", 1500).expect("namespaces");
    // A copy of the binary that user nobody can execute wherever the target directory is.
    let dir = std::env::temp_dir().join(format!("xroce-link-priv-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let bin = dir.join("xroce");
    std::fs::copy(XROCE, &bin).expect("copy xroce");
    let name = unique_name();
    let mut cmd = pair.command(0, setpriv);
    cmd.args([
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "--inh-caps=-all",
    ])
    .arg(&bin)
    .args(["link", "add", &name, "netdev", "xr0"]);
    let o = run(cmd);
    let _ = std::fs::remove_dir_all(&dir);
    assert_clear_error(&o, "unprivileged link add", "needs root");
    assert!(
        stderr(&o).contains("CAP_NET_ADMIN and CAP_BPF"),
        "{}",
        stderr(&o)
    );
    assert!(!run_dir(&pair, 0).join("links").join(&name).exists());
    assert!(!xdp_attached(&pair, 0));
}

/// A namespace deleted without `xroce link del` leaves its registry directory behind; the
/// links in it hold nothing (no program can run there any more), so they do not keep the
/// shared device node alive once the last live namespace's link of that name goes.
#[test]
fn a_namespace_deleted_without_link_del_keeps_no_device_node() {
    if !root_or_skip() {
        return;
    }
    let name = unique_name();
    let gone_dir = {
        let pair = NetnsPair::new("xrlink3", 1500).expect("namespaces");
        let (guard, _) = add_link(&pair, 0, &name);
        std::mem::forget(guard); // the namespace goes without `link del`
        run_dir(&pair, 0)
    };
    assert!(
        gone_dir.join("links").join(&name).exists(),
        "the set-up leaves {} behind",
        gone_dir.display()
    );
    let pair = NetnsPair::new("xrlink4", 1500).expect("namespaces");
    let (_g, _) = add_link(&pair, 0, &name);
    assert_dev_node(&name);
    let o = xroce(&pair, 0, &["link", "del", &name]);
    assert_ok(&o, "link del");
    assert!(
        !Path::new(&format!("/dev/infiniband/xroce-{name}")).exists(),
        "the dead namespace's link kept the device node"
    );
    let _ = std::fs::remove_dir_all(&gone_dir);
}

/// A link whose XDP program is gone (its interface deleted and made again, or the program
/// unloaded by hand) is repaired by adding it again, as the engines' error message says; a
/// link whose program is there is still refused.
#[test]
fn adding_a_link_again_reloads_a_lost_program() {
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::new("xlr", 1500).expect("netns pair");
    let name = unique_name();
    let iface = pair.iface(0).to_string();
    let (_guard, _) = add_link(&pair, 0, &name);
    let unloaded = {
        let iface = iface.clone();
        pair.run_in(0, move || xdp::unload(&iface))
    };
    assert!(
        matches!(unloaded, Ok(xdp::UnloadOutcome::Unloaded)),
        "{unloaded:?}"
    );
    assert!(!xdp_attached(&pair, 0));
    let o = xroce(&pair, 0, &["link", "add", &name, "netdev", &iface]);
    assert_ok(&o, "link add of the same link, its program gone");
    assert!(
        stdout(&o).contains(&format!("{name}: netdev {iface}, XDP program loaded")),
        "{}",
        stdout(&o)
    );
    assert!(xdp_attached(&pair, 0));
    let o = xroce(&pair, 0, &["link", "add", &name, "netdev", &iface]);
    assert_clear_error(&o, "link add of the same link again", "already exists");
}

/// A program that would run in secure-execution mode (here set-user-ID to another user) ignores
/// `LD_PRELOAD` and `SYSFS_PATH`, so it would see no xroce device with no word why: `xroce
/// exec` says so. A plain copy of the same program gets no such warning.
#[test]
fn exec_warns_about_a_program_in_secure_execution_mode() {
    if !root_or_skip() {
        return;
    }
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("secure-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a directory");
    let plain = dir.join("plain-true");
    let setuid = dir.join("setuid-true");
    for copy in [&plain, &setuid] {
        std::fs::copy("/bin/true", copy).expect("copy /bin/true");
    }
    let owned = Command::new("chown")
        .arg("nobody")
        .arg(&setuid)
        .status()
        .expect("chown");
    assert!(owned.success());
    std::fs::set_permissions(&setuid, std::fs::Permissions::from_mode(0o4755)).expect("chmod u+s");
    let warned = |program: &Path| {
        let mut cmd = Command::new(XROCE);
        cmd.arg("exec").arg("--").arg(program);
        let o = run_bounded(cmd, TIMEOUT).expect("run xroce exec");
        String::from_utf8_lossy(&o.stderr).contains("secure-execution mode")
    };
    assert!(warned(&setuid), "no warning for a set-user-ID program");
    assert!(!warned(&plain), "a warning for a plain program");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The test-only drop knob outlives the test that set it (the program stays loaded): a link
/// added over such a program warns, `link show` names it while it is on, and not after.
#[test]
fn a_drop_knob_left_on_is_warned_about_and_shown() {
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::new("xld", 1500).expect("netns pair");
    let name = unique_name();
    let iface = pair.iface(0).to_string();
    let knob = |one_in: u32| {
        let iface = iface.clone();
        pair.run_in(0, move || {
            xdp::load(&xdp::LoadOptions::new(&iface)).expect("load");
            xdp::set_drop_one_in(&iface, one_in).expect("drop knob");
        })
    };
    knob(100);
    let _guard = LinkGuard {
        pair: &pair,
        side: 0,
        name: name.clone(),
    };
    let o = xroce(&pair, 0, &["link", "add", &name, "netdev", &iface]);
    assert_ok(&o, "link add over a program with the knob on");
    assert!(
        stdout(&o).contains("XDP program already loaded"),
        "{}",
        stdout(&o)
    );
    assert!(
        stderr(&o).contains("1 RoCEv2 frame in 100 is dropped"),
        "{}",
        stderr(&o)
    );
    let o = xroce(&pair, 0, &["link", "show", &name]);
    assert_ok(&o, "link show");
    assert!(
        stdout(&o).contains("test-only drop knob on"),
        "{}",
        stdout(&o)
    );
    knob(0);
    let o = xroce(&pair, 0, &["link", "show", &name]);
    assert_ok(&o, "link show");
    assert!(!stdout(&o).contains("drop knob"), "{}", stdout(&o));
}
