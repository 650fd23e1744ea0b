//! `xroce_datapath::netlink` against a real kernel: two network namespaces joined by a veth
//! pair, created by each test and removed when it ends (also when it fails).
//!
//! Namespace A holds `xrnl0` with 10.231.N.1/24 and fd00:231:N::1/64, namespace B holds the
//! peer `xrnl1` with 10.231.N.2/24 and fd00:231:N::2/64 (N unique per test). The netlink code
//! runs in a thread that entered namespace A. Traffic only ever goes to the peer's addresses,
//! except the ARP/ND probes for an on-link address nobody has, which stay on the veth pair.
//!
//! Needs root. Without root these tests fail unless `XROCE_SKIP_ROOT_TESTS=1` says to skip.

use std::collections::HashSet;
use std::fs::File;
use std::io;
use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use xroce_datapath::netns::root_or_skip;

use xroce_datapath::netlink::{self, AddressWatcher, Change, NetlinkError};

const DEV_A: &str = "xrnl0";
const DEV_B: &str = "xrnl1";
/// Longest wait for a notification that must come.
const EVENT_WAIT: Duration = Duration::from_secs(3);

fn ip_of(s: &str) -> IpAddr {
    s.parse().expect("test address")
}

/// Runs a command, panicking with its output when it fails.
fn run(args: &[&str]) -> String {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

static NEXT: AtomicU32 = AtomicU32::new(0);
/// `ip netns add` run concurrently can race on setting up /run/netns; create one at a time.
static SETUP: Mutex<()> = Mutex::new(());

/// Two namespaces and a veth pair, deleted on drop.
struct Lab {
    /// Third octet / third group of the addresses.
    n: u32,
    a: String,
    b: String,
    /// Namespaces created so far (removed by `Drop`).
    created: Vec<String>,
}

impl Lab {
    fn new() -> Lab {
        let k = NEXT.fetch_add(1, Ordering::SeqCst);
        let n = k % 250 + 1;
        let pid = std::process::id();
        let mut lab = Lab {
            n,
            a: format!("xrnl-{pid}-{k}a"),
            b: format!("xrnl-{pid}-{k}b"),
            created: Vec::new(),
        };
        {
            let _g = SETUP.lock().unwrap_or_else(|p| p.into_inner());
            for ns in [lab.a.clone(), lab.b.clone()] {
                run(&["ip", "netns", "add", &ns]);
                lab.created.push(ns.clone());
                // No duplicate address detection: link-local addresses are usable at once
                // (the kernel sends neighbour solicitations from one).
                run(&[
                    "ip",
                    "netns",
                    "exec",
                    &ns,
                    "sysctl",
                    "-qw",
                    "net.ipv6.conf.all.accept_dad=0",
                    "net.ipv6.conf.default.accept_dad=0",
                ]);
            }
        }
        let (a, b) = (lab.a.clone(), lab.b.clone());
        run(&[
            "ip", "-n", &a, "link", "add", DEV_A, "type", "veth", "peer", "name", DEV_B, "netns",
            &b,
        ]);
        lab.ip_a(&["addr", "add", &format!("10.231.{n}.1/24"), "dev", DEV_A]);
        lab.ip_a(&[
            "addr",
            "add",
            &format!("fd00:231:{n}::1/64"),
            "dev",
            DEV_A,
            "nodad",
        ]);
        run(&[
            "ip",
            "-n",
            &b,
            "addr",
            "add",
            &format!("10.231.{n}.2/24"),
            "dev",
            DEV_B,
        ]);
        run(&[
            "ip",
            "-n",
            &b,
            "addr",
            "add",
            &format!("fd00:231:{n}::2/64"),
            "dev",
            DEV_B,
            "nodad",
        ]);
        lab.ip_a(&["link", "set", DEV_A, "up"]);
        run(&["ip", "-n", &b, "link", "set", DEV_B, "up"]);
        lab
    }

    /// `ip -n A ARGS...`
    fn ip_a(&self, args: &[&str]) -> String {
        let mut v = vec!["ip", "-n", self.a.as_str()];
        v.extend_from_slice(args);
        run(&v)
    }

    fn addr(&self, host: u32) -> IpAddr {
        ip_of(&format!("10.231.{}.{host}", self.n))
    }

    fn addr6(&self, host: u32) -> IpAddr {
        ip_of(&format!("fd00:231:{}::{host:x}", self.n))
    }

    /// Runs `f` in a thread inside namespace `ns`.
    fn in_ns<R: Send>(ns: &str, f: impl FnOnce() -> R + Send) -> R {
        let path = format!("/var/run/netns/{ns}");
        std::thread::scope(|s| {
            s.spawn(|| {
                let file = File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
                // SAFETY: `file` is an open namespace file for the whole call; setns only
                // changes the network namespace of this (scoped, short-lived) thread.
                let r = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
                assert_eq!(r, 0, "setns({path}): {}", io::Error::last_os_error());
                f()
            })
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
        })
    }

    fn in_a<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        Lab::in_ns(&self.a, f)
    }

    fn in_b<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        Lab::in_ns(&self.b, f)
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        // Deleting A destroys the veth pair with it.
        for ns in self.created.iter().rev() {
            let ok = Command::new("ip")
                .args(["netns", "del", ns])
                .status()
                .is_ok_and(|s| s.success());
            if !ok {
                eprintln!("warning: could not delete network namespace {ns}");
            }
        }
    }
}

/// The value of `"key":` in `ip -j` output (flat fields only; enough for these tests).
fn json_field(json: &str, key: &str) -> String {
    let pat = format!("\"{key}\":");
    let start = json
        .find(&pat)
        .unwrap_or_else(|| panic!("no {key} in {json}"))
        + pat.len();
    let rest = json[start..].trim_start();
    if let Some(s) = rest.strip_prefix('"') {
        s[..s.find('"').expect("closing quote")].to_string()
    } else {
        let end = rest.find([',', '}', ']']).expect("end of value");
        rest[..end].trim().to_string()
    }
}

fn parse_mac(s: &str) -> [u8; 6] {
    let v: Vec<u8> = s
        .split(':')
        .map(|h| u8::from_str_radix(h, 16).expect("hex"))
        .collect();
    v.try_into().expect("6 bytes")
}

/// Collects changes until `want` returns true or `EVENT_WAIT` passes; returns all seen.
fn wait_for(watcher: &mut AddressWatcher, want: impl Fn(&Change) -> bool) -> Vec<Change> {
    let deadline = Instant::now() + EVENT_WAIT;
    let mut seen = Vec::new();
    loop {
        let changes = watcher.drain();
        let hit = changes.iter().any(&want);
        seen.extend(changes);
        if hit {
            return seen;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "expected change not reported; saw {seen:?}"
        );
        let mut pfd = libc::pollfd {
            fd: watcher.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        unsafe { libc::poll(&mut pfd, 1, left.as_millis() as i32 + 1) };
    }
}

/// `struct __user_cap_header_struct`.
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

/// `struct __user_cap_data_struct`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
const CAP_NET_ADMIN: u32 = 12;

/// The calling thread's capability sets (capabilities are per thread on Linux).
fn capget() -> [CapData; 2] {
    let mut hdr = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: a version-3 header and the two data structs capget(2) fills; both outlive the
    // call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_capget,
            &mut hdr as *mut CapHeader,
            data.as_mut_ptr(),
        )
    };
    assert_eq!(r, 0, "capget: {}", io::Error::last_os_error());
    data
}

/// Removes CAP_NET_ADMIN from the calling thread's effective set.
fn drop_net_admin_in_this_thread() {
    let mut data = capget();
    data[0].effective &= !(1 << CAP_NET_ADMIN);
    let mut hdr = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    // SAFETY: a version-3 header and the two data structs capset(2) reads; both outlive the
    // call. Only this thread's credentials change.
    let r = unsafe { libc::syscall(libc::SYS_capset, &mut hdr as *mut CapHeader, data.as_ptr()) };
    assert_eq!(r, 0, "capset: {}", io::Error::last_os_error());
    assert_eq!(capget()[0].effective & (1 << CAP_NET_ADMIN), 0);
}

#[test]
fn interface_lookup_matches_ip_link() {
    if !root_or_skip() {
        return;
    }
    let lab = Lab::new();
    lab.ip_a(&["link", "set", DEV_A, "mtu", "4200"]);
    let json = lab.ip_a(&["-j", "link", "show", "dev", DEV_A]);
    let index: u32 = json_field(&json, "ifindex").parse().expect("ifindex");
    let mtu: u32 = json_field(&json, "mtu").parse().expect("mtu");
    let mac = parse_mac(&json_field(&json, "address"));
    assert_eq!(mtu, 4200);

    lab.in_a(|| {
        let by_name = netlink::interface_by_name(DEV_A).expect("interface_by_name");
        assert_eq!(by_name.index, index);
        assert_eq!(by_name.name, DEV_A);
        assert_eq!(by_name.mac, mac);
        assert_eq!(by_name.mtu, 4200);
        assert!(by_name.up, "{by_name:?} should be up");
        let by_index = netlink::interface_by_index(index).expect("interface_by_index");
        assert_eq!(by_index, by_name);
        let all = netlink::Netlink::open()
            .and_then(|mut nl| nl.interfaces())
            .expect("interfaces");
        assert!(all.contains(&by_name), "{all:?}");
        assert_eq!(by_name.default_gid(), netlink::default_gid(mac));

        // The peer lives in the other namespace: not visible here.
        match netlink::interface_by_name(DEV_B) {
            Err(NetlinkError::NoSuchInterface(n)) => assert_eq!(n, DEV_B),
            other => panic!("expected NoSuchInterface, got {other:?}"),
        }
        let e = netlink::interface_by_name("xrnl-missing").expect_err("missing interface");
        assert!(matches!(&e, NetlinkError::NoSuchInterface(n) if n == "xrnl-missing"));
        assert!(e.to_string().contains("xrnl-missing"), "{e}");
        assert!(matches!(
            netlink::interface_by_index(0x7fff_fff0),
            Err(NetlinkError::NoSuchInterfaceIndex(0x7fff_fff0))
        ));
        assert!(matches!(
            netlink::interface_by_name("no/such"),
            Err(NetlinkError::InvalidInterfaceName(_))
        ));
    });

    // Down is reported as not up.
    lab.ip_a(&["link", "set", DEV_A, "down"]);
    lab.in_a(|| {
        let i = netlink::interface_by_index(index).expect("interface_by_index");
        assert!(!i.up);
    });
}

#[test]
fn gid_table_order_and_changes() {
    if !root_or_skip() {
        return;
    }
    let lab = Lab::new();
    let n = lab.n;
    lab.in_a(|| {
        let iface = netlink::interface_by_name(DEV_A).expect("interface");
        let default = IpAddr::V6(netlink::default_gid(iface.mac));
        let link_local = netlink::addresses(iface.index).expect("addresses");
        // The EUI-64 link-local address exists and is the default GID, so it is not repeated.
        assert!(link_local.contains(&default), "{link_local:?}");
        let table = netlink::gid_table(&iface).expect("gid_table");
        assert_eq!(table, vec![default, lab.addr(1), lab.addr6(1)]);

        // The engine's conversions: IPv4 stays IPv4 (the IPv4-mapped GID), index for index.
        let gids = netlink::core_gids(&table);
        assert_eq!(gids.len(), 3);
        assert_eq!(gids[1], Some(netlink::core_address(lab.addr(1))));
        assert_eq!(
            netlink::gid_from_raw(netlink::gid_raw(lab.addr(1))),
            lab.addr(1)
        );

        let mut watcher = AddressWatcher::new().expect("watcher");
        assert!(watcher.drain().is_empty());

        // New addresses: reported, and in the next table (IPv4 after the IPv4 already there,
        // IPv6 after every IPv4).
        run(&[
            "ip",
            "-n",
            &lab.a,
            "addr",
            "add",
            &format!("10.231.{n}.9/24"),
            "dev",
            DEV_A,
        ]);
        run(&[
            "ip",
            "-n",
            &lab.a,
            "addr",
            "add",
            &format!("fd00:231:{n}::9/64"),
            "dev",
            DEV_A,
            "nodad",
        ]);
        wait_for(&mut watcher, |c| *c == Change::Addresses(iface.index));
        let table = netlink::gid_table(&iface).expect("gid_table");
        assert_eq!(table.len(), 5, "{table:?}");
        assert_eq!(table[..3], [default, lab.addr(1), lab.addr(9)]);
        let v6: HashSet<IpAddr> = table[3..].iter().copied().collect();
        assert_eq!(v6, HashSet::from([lab.addr6(1), lab.addr6(9)]));

        // A tentative address (duplicate address detection running) is not a GID yet.
        run(&[
            "ip",
            "netns",
            "exec",
            &lab.a,
            "sysctl",
            "-qw",
            &format!("net.ipv6.conf.{DEV_A}.accept_dad=1"),
        ]);
        run(&[
            "ip",
            "-n",
            &lab.a,
            "addr",
            "add",
            &format!("fd00:231:{n}::a/64"),
            "dev",
            DEV_A,
        ]);
        let mut nl = netlink::Netlink::open().expect("netlink");
        let entry = nl
            .interface_addresses(iface.index)
            .expect("addresses")
            .into_iter()
            .find(|a| a.ip == lab.addr6(0xa))
            .expect("the new address is listed");
        let table = netlink::gid_table(&iface).expect("gid_table");
        // DAD takes a second or more; the address is still tentative (and, were it not, the
        // table would have to list it).
        assert_eq!(
            entry.tentative,
            !table.contains(&lab.addr6(0xa)),
            "{entry:?} {table:?}"
        );
        // When DAD completes, the kernel announces the flags change and the GID appears.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !netlink::gid_table(&iface)
            .expect("gid_table")
            .contains(&lab.addr6(0xa))
        {
            assert!(Instant::now() < deadline, "DAD did not complete");
            wait_for(&mut watcher, |c| *c == Change::Addresses(iface.index));
        }

        // Removal: reported, and gone from the table.
        watcher.drain();
        run(&[
            "ip",
            "-n",
            &lab.a,
            "addr",
            "del",
            &format!("10.231.{n}.9/24"),
            "dev",
            DEV_A,
        ]);
        wait_for(&mut watcher, |c| *c == Change::Addresses(iface.index));
        let table = netlink::gid_table(&iface).expect("gid_table");
        assert!(!table.contains(&lab.addr(9)), "{table:?}");
        assert_eq!(table[..2], [default, lab.addr(1)]);

        // A link change (MTU) is reported too.
        run(&["ip", "-n", &lab.a, "link", "set", DEV_A, "mtu", "1400"]);
        wait_for(&mut watcher, |c| *c == Change::Link(iface.index));
        assert_eq!(
            netlink::interface_by_index(iface.index)
                .expect("interface")
                .mtu,
            1400
        );
    });
}

#[test]
fn route_get_on_link_via_gateway_and_unreachable() {
    if !root_or_skip() {
        return;
    }
    let lab = Lab::new();
    let n = lab.n;
    lab.ip_a(&[
        "route",
        "add",
        &format!("10.99.{n}.0/24"),
        "via",
        &format!("10.231.{n}.2"),
    ]);
    lab.ip_a(&[
        "-6",
        "route",
        "add",
        &format!("fd00:99:{n}::/64"),
        "via",
        &format!("fd00:231:{n}::2"),
    ]);
    lab.ip_a(&["route", "add", "unreachable", &format!("10.97.{n}.0/24")]);
    lab.ip_a(&["route", "add", "blackhole", &format!("10.96.{n}.0/24")]);
    lab.in_a(|| {
        let ifindex = netlink::interface_by_name(DEV_A).expect("interface").index;

        let r = netlink::route_get(lab.addr(2)).expect("on-link IPv4");
        assert_eq!(r.oif, ifindex);
        assert_eq!(r.gateway, None);
        assert_eq!(r.prefsrc, Some(lab.addr(1)));
        assert_eq!(r.next_hop(lab.addr(2)), lab.addr(2));

        let r = netlink::route_get(lab.addr6(2)).expect("on-link IPv6");
        assert_eq!(r.oif, ifindex);
        assert_eq!(r.gateway, None);
        assert_eq!(r.prefsrc, Some(lab.addr6(1)));

        let far = ip_of(&format!("10.99.{n}.5"));
        let r = netlink::route_get(far).expect("IPv4 via gateway");
        assert_eq!(r.oif, ifindex);
        assert_eq!(r.gateway, Some(lab.addr(2)));
        assert_eq!(r.next_hop(far), lab.addr(2));

        let r = netlink::route_get(ip_of(&format!("fd00:99:{n}::5"))).expect("IPv6 via gateway");
        assert_eq!(r.oif, ifindex);
        assert_eq!(r.gateway, Some(lab.addr6(2)));

        // A link-local destination needs the interface.
        let r = netlink::Netlink::open()
            .and_then(|mut nl| nl.route_get_on(ip_of("fe80::1"), Some(ifindex)))
            .expect("link-local");
        assert_eq!(r.oif, ifindex);
        assert_eq!(r.gateway, None);

        // Our own address: the local route, by the loopback interface; the interface that
        // has it is ours. Destinations elsewhere are not local.
        let r = netlink::route_get(lab.addr(1)).expect("local");
        assert_ne!(r.oif, ifindex);
        assert!(r.local, "{r:?}");
        assert!(!netlink::route_get(lab.addr(2)).expect("on-link").local);
        assert!(!netlink::route_get(far).expect("via gateway").local);
        // Names of any interface, the loopback one too.
        let mut names = netlink::Netlink::open().expect("netlink");
        assert_eq!(names.interface_name(1).expect("lo"), Some("lo".to_string()));
        assert_eq!(
            names.interface_name(ifindex).expect("ours"),
            Some(DEV_A.to_string())
        );
        assert_eq!(names.interface_name(999_999).expect("none"), None);

        // Another interface of this namespace with an address in our subnet is taken for one
        // on our link; one in another subnet, our own address and the peer's (in the other
        // namespace) are not. (Added last: a second route to our subnet could have changed
        // the routes above.)
        lab.ip_a(&[
            "link", "add", "xrnlx0", "type", "veth", "peer", "name", "xrnlx1",
        ]);
        lab.ip_a(&["addr", "add", &format!("10.231.{n}.77/24"), "dev", "xrnlx0"]);
        lab.ip_a(&["addr", "add", &format!("10.232.{n}.1/24"), "dev", "xrnlx1"]);
        lab.ip_a(&["link", "set", "xrnlx0", "up"]);
        lab.ip_a(&["link", "set", "xrnlx1", "up"]);
        let mut nl = netlink::Netlink::open().expect("netlink");
        let other = netlink::interface_by_name("xrnlx0")
            .expect("second veth")
            .index;
        assert_eq!(
            nl.other_interface_on_subnet(ifindex, lab.addr(77))
                .expect("dump"),
            Some(other)
        );
        let elsewhere = ip_of(&format!("10.232.{n}.1"));
        assert!(netlink::route_get(elsewhere).expect("local").local);
        for not_on_link in [elsewhere, lab.addr(1), lab.addr6(1), lab.addr(2)] {
            assert_eq!(
                nl.other_interface_on_subnet(ifindex, not_on_link)
                    .expect("dump"),
                None,
                "{not_on_link}"
            );
        }

        // No route (the namespace has no default route), an unreachable and a blackhole route.
        for dst in [
            format!("10.98.{n}.1"),
            format!("fd00:98:{n}::1"),
            format!("10.97.{n}.1"),
            format!("10.96.{n}.1"),
        ] {
            let dst = ip_of(&dst);
            match netlink::route_get(dst) {
                Err(e @ NetlinkError::Unreachable { .. }) => {
                    assert!(e.to_string().contains(&dst.to_string()), "{e}");
                }
                other => panic!("route_get({dst}): expected Unreachable, got {other:?}"),
            }
        }
    });
}

/// Every IPv6 link has its own `fe80::/64` route. With another interface's link-local route
/// first (here by a lower metric, as on a host whose management NIC came up first), the
/// kernel's plain lookup of a link-local peer names that interface; `route_from` asks for the
/// engine's interface, as an IPv6 link-local GID (GID 0, the default) needs. Other
/// destinations keep the kernel's own choice.
#[test]
fn a_link_local_peer_is_routed_out_of_the_engines_interface() {
    if !root_or_skip() {
        return;
    }
    let lab = Lab::new();
    lab.ip_a(&[
        "link", "add", "xrother0", "type", "veth", "peer", "name", "xrother1",
    ]);
    lab.ip_a(&["link", "set", "xrother0", "up"]);
    lab.ip_a(&["link", "set", "xrother1", "up"]);
    lab.ip_a(&[
        "-6",
        "route",
        "add",
        "fe80::/64",
        "dev",
        "xrother0",
        "metric",
        "1",
    ]);
    lab.in_a(|| {
        let ours = netlink::interface_by_name(DEV_A).expect("interface").index;
        let other = netlink::interface_by_name("xrother0")
            .expect("interface")
            .index;
        let peer = ip_of("fe80::2");
        let plain = netlink::route_get(peer).expect("plain lookup");
        assert_eq!(
            plain.oif, other,
            "the set-up makes the other interface's route first"
        );
        let r = netlink::route_from(peer, ours).expect("link-local from ours");
        assert_eq!(r.oif, ours);
        assert_eq!(r.gateway, None);
        // Not forced for other destinations: from the other interface's point of view, the
        // IPv4 peer is still routed out of ours (the caller reports "other interface").
        let r = netlink::route_from(lab.addr(2), other).expect("IPv4 peer");
        assert_eq!(r.oif, ours);
    });
}

/// Route changes are announced (the engine then looks every destination's next hop up again):
/// an IPv4 and an IPv6 route added.
#[test]
fn route_changes_are_reported() {
    if !root_or_skip() {
        return;
    }
    let lab = Lab::new();
    let n = lab.n;
    let mut watcher = lab.in_a(|| AddressWatcher::with_route_changes().expect("watcher"));
    lab.ip_a(&[
        "route",
        "add",
        &format!("10.95.{n}.0/24"),
        "via",
        &format!("10.231.{n}.2"),
    ]);
    wait_for(&mut watcher, |c| *c == Change::Routes);
    lab.ip_a(&[
        "-6",
        "route",
        "add",
        &format!("fd00:95:{n}::/64"),
        "via",
        &format!("fd00:231:{n}::2"),
    ]);
    wait_for(&mut watcher, |c| *c == Change::Routes);
}

#[test]
fn resolve_the_peer_from_an_empty_neighbour_table() {
    if !root_or_skip() {
        return;
    }
    let lab = Lab::new();
    let n = lab.n;
    lab.ip_a(&[
        "route",
        "add",
        &format!("10.99.{n}.0/24"),
        "via",
        &format!("10.231.{n}.2"),
    ]);
    let (peer_mac, peer_ll) = lab.in_b(|| {
        let peer = netlink::interface_by_name(DEV_B).expect("peer");
        let ll = IpAddr::V6(peer.default_gid());
        let addrs = netlink::addresses(peer.index).expect("peer addresses");
        assert!(addrs.contains(&ll), "{addrs:?}");
        (peer.mac, ll)
    });
    let json = run(&["ip", "-n", &lab.b, "-j", "link", "show", "dev", DEV_B]);
    assert_eq!(peer_mac, parse_mac(&json_field(&json, "address")));
    let flush = || {
        lab.ip_a(&["neigh", "flush", "dev", DEV_A]);
    };
    lab.in_a(|| {
        let ifindex = netlink::interface_by_name(DEV_A).expect("interface").index;
        let timeout = Duration::from_secs(2);
        let mut watcher = AddressWatcher::new().expect("watcher");

        for peer in [lab.addr(2), lab.addr6(2), peer_ll] {
            flush();
            assert_eq!(netlink::neighbour(ifindex, peer).expect("lookup"), None);
            let mac = netlink::resolve(ifindex, peer, None, timeout).expect("resolve");
            assert_eq!(mac, peer_mac, "{peer}");
            assert_eq!(
                netlink::neighbour(ifindex, peer).expect("lookup"),
                Some(peer_mac)
            );
            wait_for(&mut watcher, |c| {
                *c == Change::Neighbour(ifindex, peer, Some(peer_mac))
            });
        }

        // Behind a gateway: the gateway's MAC.
        flush();
        let far = ip_of(&format!("10.99.{n}.5"));
        let route = netlink::route_get(far).expect("route");
        let mac = netlink::resolve(ifindex, far, route.gateway, timeout).expect("via gateway");
        assert_eq!(mac, peer_mac);

        // The keep-alive's touch creates no entry: one the kernel flushed stays gone.
        flush();
        let mut nl = netlink::Netlink::open().expect("netlink");
        assert!(
            !nl.touch_neighbour(ifindex, lab.addr(2)).expect("touch"),
            "an absent entry was touched"
        );
        let entries = lab.ip_a(&["neigh", "show", "dev", DEV_A]);
        assert!(
            !entries.contains(&format!("{} ", lab.addr(2))),
            "the touch created an entry: {entries}"
        );
        // solicit() alone starts resolution; the entry appears without further help.
        netlink::solicit(ifindex, lab.addr(2)).expect("solicit");
        let deadline = Instant::now() + timeout;
        while netlink::neighbour(ifindex, lab.addr(2))
            .expect("lookup")
            .is_none()
        {
            assert!(
                Instant::now() < deadline,
                "solicit did not lead to resolution"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(
            nl.touch_neighbour(ifindex, lab.addr(2)).expect("touch"),
            "a present entry was not touched"
        );
        // Without CAP_NET_ADMIN (RTM_NEWNEIGH refused), solicit() falls back to a datagram to
        // the peer's discard port, which makes the kernel resolve it just the same.
        flush();
        lab.in_a(|| {
            drop_net_admin_in_this_thread();
            netlink::solicit(ifindex, lab.addr(2)).expect("solicit without CAP_NET_ADMIN");
        });
        let deadline = Instant::now() + timeout;
        while netlink::neighbour(ifindex, lab.addr(2))
            .expect("lookup")
            .is_none()
        {
            assert!(
                Instant::now() < deadline,
                "the fallback did not lead to resolution"
            );
            std::thread::sleep(Duration::from_millis(5));
        }

        // An interface that does not exist.
        assert!(matches!(
            netlink::neighbour(0x7fff_fff0, lab.addr(2)),
            Err(NetlinkError::NoSuchInterfaceIndex(_))
        ));
    });
}

#[test]
fn resolve_gives_up_on_an_address_nobody_has() {
    if !root_or_skip() {
        return;
    }
    let lab = Lab::new();
    let ghosts = [lab.addr(77), lab.addr6(0x77)];
    let timeout = Duration::from_millis(1500);
    let ifindex = lab.in_a(|| netlink::interface_by_name(DEV_A).expect("interface").index);
    // Both families at once, to keep the test short.
    std::thread::scope(|s| {
        let handles: Vec<_> = ghosts
            .iter()
            .map(|&ghost| {
                let lab = &lab;
                s.spawn(move || {
                    lab.in_a(|| {
                        let t = Instant::now();
                        let r = netlink::resolve(ifindex, ghost, None, timeout);
                        let took = t.elapsed();
                        match r {
                            Err(NetlinkError::NeighbourUnresolved(ip)) => assert_eq!(ip, ghost),
                            other => panic!(
                                "resolve({ghost}): expected NeighbourUnresolved, got {other:?}"
                            ),
                        }
                        // That it gives up at all is the bound; how late it returns on a
                        // loaded machine is not asserted.
                        assert!(took >= timeout, "{ghost}: gave up early, after {took:?}");
                    })
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
        }
    });
}
