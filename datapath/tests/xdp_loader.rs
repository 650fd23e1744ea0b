//! The XDP loader on real veth pairs in network namespaces: load, idempotence, status, counters
//! with real traffic, the drop knob, unload, the errors (no such interface, MTU too large,
//! another program attached, not root), jumbo frames with the frags build, and loading from
//! `ip netns exec` outliving the command.
//!
//! Needs root (namespaces, XDP). Without root these tests fail, unless
//! `XROCE_SKIP_ROOT_TESTS=1` says to skip them. Each test makes its own namespace pair, so they
//! run in parallel.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Output;
use std::time::{Duration, Instant};
use xroce_datapath::netns::root_or_skip;

use xroce_datapath::netns::{run_bounded, NetnsPair};
use xroce_datapath::xdp::{
    self, AttachMode, InterfaceStatus, LoadOptions, LoadOutcome, ProgramBuild, UnloadOutcome,
    XdpCounters, XdpError, XdpMode, XsksMap,
};

/// Environment variable that turns `subprocess_helper` into a loader command (see there).
const HELPER_ENV: &str = "XROCE_XDP_LOADER_HELPER";
/// With this set to 1 the helper drops to uid/gid 65534 first.
const HELPER_DROP_ENV: &str = "XROCE_XDP_LOADER_HELPER_UNPRIVILEGED";
const HELPER_PREFIX: &str = "XROCE-HELPER ";
const ROCE_PORT: u16 = 4791;

fn status_of(pair: &NetnsPair, side: usize) -> InterfaceStatus {
    let iface = pair.iface(side).to_string();
    let mut all = pair.run_in(side, move || xdp::status(Some(&iface)).expect("status"));
    assert_eq!(all.len(), 1, "{all:?}");
    all.remove(0)
}

fn counters(pair: &NetnsPair, side: usize) -> XdpCounters {
    let iface = pair.iface(side).to_string();
    pair.run_in(side, move || xdp::read_counters(&iface).expect("counters"))
}

/// The counters on `side` once the program has seen `n` RoCEv2 frames more than in `before`
/// (it counts each once, whatever it does with it), or after 10 s: a loaded machine may leave
/// frames in softirq for long.
fn counters_once_seen(pair: &NetnsPair, side: usize, before: &XdpCounters, n: u64) -> XdpCounters {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let c = counters(pair, side);
        if c.roce_seen() >= before.roce_seen() + n || Instant::now() >= deadline {
            return c;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn load(pair: &NetnsPair, side: usize, opts: LoadOptions) -> Result<LoadOutcome, XdpError> {
    pair.run_in(side, move || xdp::load(&opts))
}

fn unload(pair: &NetnsPair, side: usize) -> Result<UnloadOutcome, XdpError> {
    let iface = pair.iface(side).to_string();
    pair.run_in(side, move || xdp::unload(&iface))
}

/// `ip -d link show` of side's veth end.
fn ip_link_show(pair: &NetnsPair, side: usize) -> String {
    let out = pair
        .exec(side, &format!("ip -d link show dev {}", pair.iface(side)))
        .expect("ip link show");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Neither xroce's program nor pins of it on `iface` (a refused load leaves nothing behind).
fn assert_nothing_left(pair: &NetnsPair, side: usize, iface: &'static str) {
    let status = pair.run_in(side, move || xdp::status(Some(iface)).expect("status"));
    assert!(
        status
            .iter()
            .all(|s| s.xroce.is_none() && s.stale_pins.is_none()),
        "{status:?}"
    );
}

fn ping(pair: &NetnsPair, from: usize, to: IpAddr, size: usize) {
    let out = pair
        .exec(from, &format!("ping -c 2 -i 0.2 -W 1 -s {size} {to}"))
        .expect("ping");
    assert!(
        out.status.success(),
        "ping {to} (size {size}) failed while XDP was attached:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A kernel UDP socket on side 1, `port`, any address (v4 and v6).
fn udp_receiver(pair: &NetnsPair, port: u16) -> UdpSocket {
    // A socket belongs to the namespace it was created in, whichever thread uses it later.
    let socket = pair.run_in(1, move || {
        UdpSocket::bind(SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port))
            .expect("bind UDP receiver")
    });
    socket
        .set_read_timeout(Some(Duration::from_millis(50)))
        .expect("timeout");
    socket
}

/// Sends `count` datagrams of `size` bytes from side 0 to `to`:`port`.
fn send_udp(pair: &NetnsPair, to: IpAddr, port: u16, count: usize, size: usize) {
    pair.run_in(0, move || {
        let local: SocketAddr = match to {
            IpAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
            IpAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
        };
        let socket = UdpSocket::bind(local).expect("bind UDP sender");
        let payload = vec![0x5au8; size];
        for _ in 0..count {
            socket.send_to(&payload, (to, port)).expect("send UDP");
        }
    });
}

/// Datagrams `socket` receives until `expected` arrived or `wait` passed with nothing new.
fn receive_udp(socket: &UdpSocket, expected: usize, wait: Duration) -> usize {
    let mut buf = vec![0u8; 65536];
    let mut got = 0;
    let mut last = Instant::now();
    while got < expected && last.elapsed() < wait {
        if socket.recv(&mut buf).is_ok() {
            got += 1;
            last = Instant::now();
        }
    }
    got
}

/// A TCP echo through the pair (side 1 serves, side 0 connects), over `addr`.
fn tcp_echo(pair: &NetnsPair, addr: IpAddr) {
    let bind: SocketAddr = (addr, 0).into();
    let listener = pair.run_in(1, move || TcpListener::bind(bind).expect("listen"));
    let server_addr = listener.local_addr().expect("local addr");
    listener.set_nonblocking(true).expect("nonblocking");
    let server = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(10);
        let (mut stream, _) = loop {
            match listener.accept() {
                Ok(conn) => break conn,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    assert!(Instant::now() < deadline, "no TCP connection arrived");
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => panic!("accept: {e}"),
            }
        };
        stream.set_nonblocking(false).expect("blocking");
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let mut buf = [0u8; 64];
        let n = stream.read(&mut buf).expect("server read");
        stream.write_all(&buf[..n]).expect("server write");
    });
    let mut client = pair.run_in(0, move || {
        TcpStream::connect_timeout(&server_addr, Duration::from_secs(5)).expect("connect")
    });
    client
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    client.write_all(b"xroce tcp echo").expect("client write");
    let mut buf = [0u8; 14];
    client.read_exact(&mut buf).expect("client read");
    assert_eq!(&buf, b"xroce tcp echo");
    server.join().expect("TCP server");
}

/// Runs this test binary's `subprocess_helper` inside side's namespace with `ip netns exec`.
/// Returns the result lines it printed (`ok ...` / `err ...`) and the raw output.
fn run_helper(
    pair: &NetnsPair,
    side: usize,
    actions: &str,
    unprivileged: bool,
) -> (Vec<String>, Output) {
    let exe = std::env::current_exe().expect("test binary path");
    let mut cmd = pair.command(side, exe);
    cmd.args([
        "subprocess_helper",
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(HELPER_ENV, actions)
    .env(HELPER_DROP_ENV, if unprivileged { "1" } else { "0" });
    let out = run_bounded(cmd, Duration::from_secs(30)).expect("run helper");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines = stdout
        .lines()
        // The first line shares its line with libtest's "test subprocess_helper ... ".
        .filter_map(|l| {
            l.find(HELPER_PREFIX)
                .map(|i| l[i + HELPER_PREFIX.len()..].to_string())
        })
        .collect();
    (lines, out)
}

/// Not a test by itself: `run_helper` runs it in a child process (inside a namespace, possibly
/// unprivileged) to act as a separate loader command. `XROCE_XDP_LOADER_HELPER` holds
/// `verb:iface` actions separated by commas (verbs: load, unload, counters, status); each prints one
/// `XROCE-HELPER ok ...` or `XROCE-HELPER err ...` line. Without the variable it does nothing.
#[test]
#[ignore = "helper that other tests run in a subprocess"]
fn subprocess_helper() {
    let Ok(actions) = std::env::var(HELPER_ENV) else {
        return;
    };
    if std::env::var(HELPER_DROP_ENV).as_deref() == Ok("1") {
        drop_privileges();
    }
    for action in actions.split(',') {
        let (verb, iface) = action
            .split_once(':')
            .unwrap_or_else(|| panic!("bad helper action {action:?}"));
        let result = match verb {
            "load" => xdp::load(&LoadOptions::new(iface)).map(|o| format!("{o:?}")),
            "unload" => xdp::unload(iface).map(|o| format!("{o:?}")),
            "counters" => xdp::read_counters(iface).map(|c| format!("{c:?}")),
            "status" => xdp::status(Some(iface)).map(|s| format!("{s:?}")),
            _ => panic!("unknown helper verb {verb:?}"),
        };
        match result {
            Ok(text) => println!("{HELPER_PREFIX}ok {text}"),
            Err(e) => println!("{HELPER_PREFIX}err {e}"),
        }
    }
}

/// Becomes nobody (uid/gid 65534, no supplementary groups); changing the uid from 0 clears the
/// capabilities.
fn drop_privileges() {
    // SAFETY: plain syscalls on this process's credentials; glibc applies them to all threads.
    unsafe {
        assert_eq!(libc::setgroups(0, std::ptr::null()), 0, "setgroups");
        assert_eq!(libc::setgid(65534), 0, "setgid");
        assert_eq!(libc::setuid(65534), 0, "setuid");
    }
}

#[test]
fn load_is_idempotent_shows_in_status_and_unloads() {
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::new("xrld-basic", 1500).expect("namespaces");
    let iface = pair.iface(1).to_string();

    let loaded = match load(&pair, 1, LoadOptions::new(&iface)).expect("load") {
        LoadOutcome::Loaded(a) => a,
        other => panic!("expected Loaded, got {other:?}"),
    };
    assert_eq!(
        loaded.build,
        ProgramBuild::Plain,
        "MTU 1500 picks the plain build"
    );
    assert_eq!(loaded.mode, XdpMode::Native);
    assert!(loaded.prog_id != 0 && loaded.link_id != 0);
    assert!(loaded.pin_dir.join("link").exists(), "{loaded:?}");
    for map in [
        "xsks_map",
        "counters",
        "drop_config",
        "local_addrs",
        "steer_config",
        "local_list",
    ] {
        assert!(loaded.pin_dir.join(map).exists(), "{map} is not pinned");
    }

    // Loading again, even asking for something else, changes nothing.
    for opts in [
        LoadOptions::new(&iface),
        LoadOptions::new(&iface)
            .with_mode(XdpMode::Generic)
            .with_build(ProgramBuild::Frags),
    ] {
        match load(&pair, 1, opts).expect("second load") {
            LoadOutcome::AlreadyLoaded(a) => assert_eq!(a, loaded),
            other => panic!("expected AlreadyLoaded, got {other:?}"),
        }
    }

    let status = status_of(&pair, 1);
    let ours = status.xroce.as_ref().expect("status shows our program");
    assert_eq!(ours.attachment, loaded);
    assert_eq!(ours.drop_one_in, 0);
    assert_eq!(
        ours.xsk_queues.as_deref(),
        Some(&[][..]),
        "no socket entered yet"
    );
    assert!(status.foreign.is_empty() && status.stale_pins.is_none());
    assert_eq!(status.mtu, Some(1500));
    let everything = pair.run_in(1, || xdp::status(None).expect("status"));
    assert_eq!(everything.len(), 1, "only xr1 has XDP: {everything:?}");
    assert_eq!(everything[0].iface, iface);

    let shown = ip_link_show(&pair, 1);
    assert!(
        shown.contains(&format!("prog/xdp id {}", loaded.prog_id)),
        "ip link does not show the program:\n{shown}"
    );
    // The other end has nothing.
    assert!(status_of(&pair, 0).xroce.is_none());

    assert_eq!(unload(&pair, 1).expect("unload"), UnloadOutcome::Unloaded);
    let shown = ip_link_show(&pair, 1);
    assert!(!shown.contains("xdp"), "XDP still attached:\n{shown}");
    let status = status_of(&pair, 1);
    assert!(
        status.xroce.is_none() && status.foreign.is_empty(),
        "{status:?}"
    );
    assert!(!loaded.pin_dir.exists(), "pins left behind");
    assert_eq!(
        unload(&pair, 1).expect("unload again"),
        UnloadOutcome::NotLoaded
    );

    // Map access now says what to do.
    let err = pair.run_in(1, {
        let iface = iface.clone();
        move || XsksMap::open(&iface).expect_err("map of an unloaded program")
    });
    assert!(matches!(err, XdpError::NotLoaded { .. }), "{err:?}");
    assert!(
        err.to_string()
            .contains(&format!("cargo xtask xdp load --iface {iface}")),
        "{err}"
    );
}

#[test]
fn roce_frames_are_counted_and_other_traffic_flows() {
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::with_ipv6("xrld-traffic", 1500).expect("namespaces");
    let v4 = IpAddr::V4(pair.ipv4(1));
    let v6 = IpAddr::V6(pair.ipv6(1).expect("IPv6"));
    load(&pair, 1, LoadOptions::new(pair.iface(1))).expect("load");

    // ICMP over both families (this also resolves the neighbours).
    ping(&pair, 0, v4, 56);
    ping(&pair, 0, v6, 56);
    // TCP over both families.
    tcp_echo(&pair, v4);
    tcp_echo(&pair, v6);

    // RoCEv2-port UDP with no AF_XDP socket: counted as roce_no_socket and given to the
    // kernel, whose UDP socket receives every datagram.
    let roce = udp_receiver(&pair, ROCE_PORT);
    let before = counters(&pair, 1);
    send_udp(&pair, v4, ROCE_PORT, 20, 100);
    send_udp(&pair, v6, ROCE_PORT, 10, 100);
    assert_eq!(receive_udp(&roce, 30, Duration::from_secs(2)), 30);
    let after = counters(&pair, 1);
    assert_eq!(
        after.roce_no_socket - before.roce_no_socket,
        30,
        "{before:?} -> {after:?}"
    );
    assert_eq!(after.redirected, before.redirected);
    assert_eq!(after.dropped_by_knob, before.dropped_by_knob);

    // Another UDP port is just passed.
    let other = udp_receiver(&pair, ROCE_PORT + 1);
    let before = counters(&pair, 1);
    send_udp(&pair, v4, ROCE_PORT + 1, 5, 100);
    assert_eq!(receive_udp(&other, 5, Duration::from_secs(2)), 5);
    let after = counters(&pair, 1);
    assert!(after.passed - before.passed >= 5, "{before:?} -> {after:?}");
    assert_eq!(after.roce_seen(), before.roce_seen());
    assert_eq!(after.malformed, 0);

    assert_eq!(unload(&pair, 1).expect("unload"), UnloadOutcome::Unloaded);
    ping(&pair, 0, v4, 56);
}

#[test]
fn drop_knob_drops_roce_frames_only() {
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::new("xrld-knob", 1500).expect("namespaces");
    let iface = pair.iface(1).to_string();
    let to = IpAddr::V4(pair.ipv4(1));
    load(&pair, 1, LoadOptions::new(&iface)).expect("load");
    ping(&pair, 0, to, 56);
    let roce = udp_receiver(&pair, ROCE_PORT);

    pair.run_in(1, {
        let iface = iface.clone();
        move || xdp::set_drop_one_in(&iface, 1).expect("set knob")
    });
    assert_eq!(status_of(&pair, 1).xroce.expect("loaded").drop_one_in, 1);
    let before = counters(&pair, 1);
    send_udp(&pair, to, ROCE_PORT, 20, 100);
    let after = counters_once_seen(&pair, 1, &before, 20);
    assert_eq!(receive_udp(&roce, 1, Duration::from_millis(300)), 0);
    assert_eq!(after.dropped_by_knob - before.dropped_by_knob, 20);
    assert_eq!(after.roce_no_socket, before.roce_no_socket);
    // Everything else still flows.
    ping(&pair, 0, to, 56);

    pair.run_in(1, {
        let iface = iface.clone();
        move || {
            xdp::set_drop_one_in(&iface, 0).expect("clear knob");
            assert_eq!(xdp::drop_one_in(&iface).expect("read knob"), 0);
        }
    });
    let before = counters(&pair, 1);
    send_udp(&pair, to, ROCE_PORT, 5, 100);
    assert_eq!(receive_udp(&roce, 5, Duration::from_secs(2)), 5);
    let after = counters(&pair, 1);
    assert_eq!(after.dropped_by_knob, before.dropped_by_knob);
    assert_eq!(after.roce_no_socket - before.roce_no_socket, 5);
}

/// A minimal AF_XDP socket bound to `ifindex` queue 0 in copy mode (UMEM of 16 chunks, rings
/// of 64, nothing mmapped): enough to be entered into the XSKMAP and receive redirects.
fn bound_xsk(ifindex: u32) -> (OwnedFd, Umem) {
    // SAFETY: socket() has no memory effects; the result is checked and owned at once.
    let fd = unsafe { libc::socket(libc::AF_XDP, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
    assert!(
        fd >= 0,
        "AF_XDP socket: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: `fd` is a new descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let umem = Umem::new(16 * 4096);
    let reg = libc::xdp_umem_reg {
        addr: umem.ptr as u64,
        len: umem.len as u64,
        chunk_size: 4096,
        headroom: 0,
        flags: 0,
        tx_metadata_len: 0,
    };
    setsockopt(&fd, libc::XDP_UMEM_REG, &reg);
    let ring: u32 = 64;
    setsockopt(&fd, libc::XDP_UMEM_FILL_RING, &ring);
    setsockopt(&fd, libc::XDP_UMEM_COMPLETION_RING, &ring);
    setsockopt(&fd, libc::XDP_RX_RING, &ring);
    let addr = libc::sockaddr_xdp {
        sxdp_family: libc::AF_XDP as u16,
        sxdp_flags: libc::XDP_COPY,
        sxdp_ifindex: ifindex,
        sxdp_queue_id: 0,
        sxdp_shared_umem_fd: 0,
    };
    // SAFETY: `addr` is a valid sockaddr_xdp and its size is passed.
    let ret = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            &addr as *const libc::sockaddr_xdp as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_xdp>() as libc::socklen_t,
        )
    };
    assert_eq!(ret, 0, "bind AF_XDP: {}", std::io::Error::last_os_error());
    (fd, umem)
}

fn setsockopt<T>(fd: &OwnedFd, name: libc::c_int, value: &T) {
    // SAFETY: `value` is a valid T and its size is passed.
    let ret = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_XDP,
            name,
            value as *const T as *const libc::c_void,
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    assert_eq!(
        ret,
        0,
        "setsockopt {name}: {}",
        std::io::Error::last_os_error()
    );
}

/// Page-aligned anonymous memory for a UMEM.
struct Umem {
    ptr: *mut libc::c_void,
    len: usize,
}

// SAFETY: the mapping is plain memory only the kernel writes (through the socket).
unsafe impl Send for Umem {}

impl Umem {
    fn new(len: usize) -> Umem {
        // SAFETY: a fresh private anonymous mapping; the result is checked.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED, "mmap");
        Umem { ptr, len }
    }
}

impl Drop for Umem {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `new`; the socket using it is closed first
        // (see the order of the locals in the test).
        unsafe {
            libc::munmap(self.ptr, self.len);
        }
    }
}

#[test]
fn xsks_map_steers_roce_frames_to_a_socket() {
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::new("xrld-xsk", 1500).expect("namespaces");
    let iface = pair.iface(1).to_string();
    let to = IpAddr::V4(pair.ipv4(1));
    let loaded = load(&pair, 1, LoadOptions::new(&iface)).expect("load");
    let ifindex = loaded.attachment().ifindex;
    ping(&pair, 0, to, 56);
    let roce = udp_receiver(&pair, ROCE_PORT);

    let (xsk, umem) = pair.run_in(1, move || bound_xsk(ifindex));
    let mut map = pair.run_in(1, {
        let iface = iface.clone();
        move || XsksMap::open(&iface).expect("open xsks_map")
    });
    assert_eq!(map.iface(), iface);
    // Out of range and non-XSK descriptors are refused with clear errors.
    let err = map.set(64, xsk.as_raw_fd()).expect_err("queue 64");
    assert!(
        matches!(err, XdpError::QueueOutOfRange { queue: 64, .. }),
        "{err:?}"
    );
    let err = map.set(0, roce.as_raw_fd()).expect_err("a UDP socket");
    assert!(err.to_string().contains(&iface), "{err}");

    map.set(0, xsk.as_raw_fd()).expect("enter the socket");
    let status = status_of(&pair, 1);
    assert_eq!(
        status.xroce.expect("loaded").xsk_queues.as_deref(),
        Some(&[0u32][..]),
        "the probe sees the socket in slot 0"
    );
    let before = counters(&pair, 1);
    send_udp(&pair, to, ROCE_PORT, 10, 100);
    let after = counters_once_seen(&pair, 1, &before, 10);
    // The frames went to the AF_XDP socket (which has no fill buffers, so it drops them), not
    // to the kernel.
    assert_eq!(receive_udp(&roce, 1, Duration::from_millis(300)), 0);
    assert_eq!(
        after.redirected - before.redirected,
        10,
        "{before:?} -> {after:?}"
    );
    assert_eq!(after.roce_no_socket, before.roce_no_socket);

    map.clear(0).expect("clear");
    map.clear(0).expect("clearing an empty slot is fine");
    assert_eq!(
        status_of(&pair, 1)
            .xroce
            .expect("loaded")
            .xsk_queues
            .as_deref(),
        Some(&[][..])
    );
    send_udp(&pair, to, ROCE_PORT, 5, 100);
    assert_eq!(receive_udp(&roce, 5, Duration::from_secs(2)), 5);
    drop(xsk);
    drop(umem);
}

#[test]
fn missing_interface_is_reported_by_name() {
    // No root needed: the interface is looked up before anything else.
    let iface = "xrnope0";
    let check = |e: XdpError| {
        assert!(matches!(e, XdpError::NoSuchInterface { .. }), "{e:?}");
        assert!(e.to_string().contains(iface), "{e}");
    };
    check(xdp::load(&LoadOptions::new(iface)).expect_err("load"));
    check(xdp::unload(iface).expect_err("unload"));
    check(xdp::status(Some(iface)).expect_err("status"));
    check(xdp::read_counters(iface).expect_err("counters"));
    check(xdp::set_drop_one_in(iface, 1).expect_err("knob"));
    check(XsksMap::open(iface).expect_err("xsks_map"));
    let err = xdp::load(&LoadOptions::new("no/such")).expect_err("bad name");
    assert!(matches!(err, XdpError::NoSuchInterface { .. }), "{err:?}");
}

/// Five 8000-byte datagrams to the RoCEv2 port reach side 1's kernel socket `roce`, each
/// counted by the program as steered with no socket bound, none as malformed.
fn jumbo_roce_datagrams_are_steered(pair: &NetnsPair, to: IpAddr, roce: &UdpSocket) {
    let before = counters(pair, 1);
    send_udp(pair, to, ROCE_PORT, 5, 8000);
    assert_eq!(receive_udp(roce, 5, Duration::from_secs(2)), 5);
    let after = counters(pair, 1);
    assert_eq!(after.roce_no_socket - before.roce_no_socket, 5);
    assert_eq!(after.malformed, 0);
}

#[test]
fn jumbo_mtu_needs_the_frags_build() {
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::new("xrld-jumbo", 9000).expect("namespaces");
    let iface = pair.iface(1).to_string();
    let to = IpAddr::V4(pair.ipv4(1));

    let err = load(
        &pair,
        1,
        LoadOptions::new(&iface).with_build(ProgramBuild::Plain),
    )
    .expect_err("plain build at MTU 9000");
    match &err {
        XdpError::MtuTooLarge {
            iface: i,
            mtu,
            build,
            ..
        } => assert_eq!(
            (i.as_str(), *mtu, *build),
            (iface.as_str(), 9000, ProgramBuild::Plain)
        ),
        other => panic!("expected MtuTooLarge, got {other:?}"),
    }
    assert!(err.to_string().contains("--build frags"), "{err}");
    let status = status_of(&pair, 1);
    assert!(
        status.xroce.is_none() && status.stale_pins.is_none(),
        "{status:?}"
    );

    // Chosen by MTU: frags, native on one end and generic on the other.
    let native = load(&pair, 1, LoadOptions::new(&iface)).expect("load frags");
    assert_eq!(native.attachment().build, ProgramBuild::Frags);
    assert_eq!(native.attachment().mode, XdpMode::Native);
    let generic = load(
        &pair,
        0,
        LoadOptions::new(pair.iface(0)).with_mode(XdpMode::Generic),
    )
    .expect("load generic");
    assert_eq!(generic.attachment().build, ProgramBuild::Frags);
    assert_eq!(generic.attachment().mode, XdpMode::Generic);
    assert!(ip_link_show(&pair, 0).contains("xdpgeneric"));

    // Jumbo frames pass, and jumbo RoCEv2-port datagrams are steered (to the kernel here).
    ping(&pair, 0, to, 8000);
    let roce = udp_receiver(&pair, ROCE_PORT);
    jumbo_roce_datagrams_are_steered(&pair, to, &roce);

    // Asked for in generic mode, the plain build takes any MTU: the kernel linearizes each
    // frame for it, and jumbo datagrams are still steered.
    unload(&pair, 1).expect("unload");
    let plain = load(
        &pair,
        1,
        LoadOptions::new(&iface)
            .with_build(ProgramBuild::Plain)
            .with_mode(XdpMode::Generic),
    )
    .expect("plain build in generic mode at MTU 9000");
    assert_eq!(plain.attachment().build, ProgramBuild::Plain);
    assert_eq!(plain.attachment().mode, XdpMode::Generic);
    jumbo_roce_datagrams_are_steered(&pair, to, &roce);
}

#[test]
fn larger_peer_mtu_falls_back_to_the_frags_build() {
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::new("xrld-peer", 1500).expect("namespaces");
    let iface = pair.iface(1).to_string();
    // Our MTU is 1500, but veth checks the peer's.
    let out = pair
        .exec(0, &format!("ip link set dev {} mtu 9000", pair.iface(0)))
        .expect("ip link set mtu");
    assert!(out.status.success(), "{out:?}");

    let err = load(
        &pair,
        1,
        LoadOptions::new(&iface).with_build(ProgramBuild::Plain),
    )
    .expect_err("plain build with a jumbo peer");
    assert!(matches!(err, XdpError::MtuTooLarge { .. }), "{err:?}");
    assert!(err.to_string().contains("its veth peer's"), "{err}");
    assert!(status_of(&pair, 1).stale_pins.is_none());

    let loaded = load(&pair, 1, LoadOptions::new(&iface)).expect("load");
    assert_eq!(loaded.attachment().build, ProgramBuild::Frags);
}

/// A bridge has no native XDP. Asked for native, the loader says so and leaves nothing
/// behind; left to choose, it attaches in generic mode.
#[test]
fn a_driver_without_native_xdp_gets_generic_mode() {
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::new("xrld-bridge", 1500).expect("namespaces");
    let out = pair
        .exec(1, "ip link add xrldbr type bridge && ip link set xrldbr up")
        .expect("ip link add bridge");
    assert!(out.status.success(), "{out:?}");
    let bridge = "xrldbr";

    let err = load(
        &pair,
        1,
        LoadOptions::new(bridge).with_mode(XdpMode::Native),
    )
    .expect_err("native XDP on a bridge");
    assert!(
        matches!(
            err,
            XdpError::ModeNotSupported {
                mode: XdpMode::Native,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("--mode generic"), "{err}");
    assert_nothing_left(&pair, 1, bridge);

    let loaded = load(&pair, 1, LoadOptions::new(bridge)).expect("load on a bridge");
    assert_eq!(loaded.attachment().mode, XdpMode::Generic, "{loaded:?}");
    assert!(matches!(loaded, LoadOutcome::Loaded(_)));
    let out = pair
        .exec(1, "ip -d link show dev xrldbr")
        .expect("ip link show");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("xdpgeneric"),
        "{out:?}"
    );
    let unloaded = pair.run_in(1, move || xdp::unload(bridge)).expect("unload");
    assert_eq!(unloaded, UnloadOutcome::Unloaded);
}

/// A driver that has native XDP but refuses it on this interface (here veth, whose receive
/// queues are fewer than its peer's transmit queues: `ENOSPC`; virtio-net refuses native XDP
/// at MTUs its buffers do not take). Asked for native, the loader says so and leaves nothing
/// behind; left to choose, it attaches in generic mode and says why.
#[test]
fn a_driver_refusing_native_xdp_gets_generic_mode_when_left_to_choose() {
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::new("xrld-queues", 1500).expect("namespaces");
    let out = pair
        .exec(
            1,
            "ip link add xrldq0 numrxqueues 1 numtxqueues 1 type veth peer name xrldq1 \
             numtxqueues 2 numrxqueues 2 && ip link set xrldq0 up && ip link set xrldq1 up",
        )
        .expect("ip link add veth");
    assert!(out.status.success(), "{out:?}");
    let iface = "xrldq0";

    let err = load(&pair, 1, LoadOptions::new(iface).with_mode(XdpMode::Native))
        .expect_err("native XDP on a veth with fewer receive queues than its peer sends on");
    assert!(matches!(err, XdpError::AttachRefused { .. }), "{err:?}");
    assert!(err.to_string().contains("--mode generic"), "{err}");
    assert_nothing_left(&pair, 1, iface);

    let loaded = load(&pair, 1, LoadOptions::new(iface)).expect("load, mode left to choose");
    let LoadOutcome::Loaded(attachment) = &loaded else {
        panic!("not loaded afresh: {loaded:?}");
    };
    assert_eq!(attachment.mode, XdpMode::Generic, "{loaded:?}");
    let answer = attachment.native_refused.as_deref().unwrap_or_default();
    assert!(
        answer.contains(&std::io::Error::from_raw_os_error(libc::ENOSPC).to_string()),
        "{loaded:?}"
    );
    let out = pair
        .exec(1, "ip -d link show dev xrldq0")
        .expect("ip link show");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("xdpgeneric"),
        "{out:?}"
    );
    // Found attached, it is reported as it is, with no refusal to tell.
    let again = load(&pair, 1, LoadOptions::new(iface)).expect("load again");
    assert!(
        matches!(&again, LoadOutcome::AlreadyLoaded(a) if a.mode == XdpMode::Generic && a.native_refused.is_none()),
        "{again:?}"
    );
    let unloaded = pair.run_in(1, move || xdp::unload(iface)).expect("unload");
    assert_eq!(unloaded, UnloadOutcome::Unloaded);
}

#[test]
fn another_program_is_left_alone() {
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::new("xrld-foreign", 1500).expect("namespaces");
    let iface = pair.iface(1).to_string();
    let object = std::env::temp_dir().join(format!("xroce-foreign-{}.o", std::process::id()));
    std::fs::write(&object, ProgramBuild::Plain.object()).expect("write object");
    // Attached by iproute2 (netlink, no link, no pins), as another tool would.
    let out = pair
        .exec(
            1,
            &format!(
                "ip link set dev {iface} xdpgeneric obj {} sec xdp",
                object.display()
            ),
        )
        .expect("ip link set xdpgeneric");
    let _ = std::fs::remove_file(&object);
    assert!(out.status.success(), "{out:?}");

    let err = load(&pair, 1, LoadOptions::new(&iface)).expect_err("load over another program");
    match &err {
        XdpError::AnotherProgram {
            prog_id,
            name,
            mode,
            ..
        } => {
            assert!(*prog_id != 0);
            assert_eq!(name.as_deref(), Some("xroce_xdp"));
            assert_eq!(*mode, AttachMode::Generic);
        }
        other => panic!("expected AnotherProgram, got {other:?}"),
    }
    let text = err.to_string();
    assert!(
        text.contains(&format!("ip link set dev {iface} xdpgeneric off")),
        "{text}"
    );

    let status = status_of(&pair, 1);
    assert!(status.xroce.is_none(), "{status:?}");
    assert_eq!(status.foreign.len(), 1, "{status:?}");
    assert_eq!(unload(&pair, 1).expect("unload"), UnloadOutcome::NotLoaded);
    assert!(
        ip_link_show(&pair, 1).contains("xdpgeneric"),
        "unload touched it"
    );
}

#[test]
fn loading_through_ip_netns_exec_outlives_the_command() {
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::new("xrld-exec", 1500).expect("namespaces");
    let iface = pair.iface(1).to_string();

    // `ip netns exec` runs the loader in a private mount namespace with a fresh /sys.
    let (lines, out) = run_helper(&pair, 1, &format!("load:{iface}"), false);
    assert!(
        lines.len() == 1 && lines[0].starts_with("ok Loaded"),
        "{lines:?}\n{out:?}"
    );

    // The command has exited; the program is still attached and its pins are in the bpffs
    // this process sees.
    let status = status_of(&pair, 1);
    let ours = status.xroce.expect("still loaded after the command exited");
    assert!(ours.attachment.pin_dir.join("link").exists());
    let before = ours.counters;
    ping(&pair, 0, IpAddr::V4(pair.ipv4(1)), 56);
    assert!(
        counters(&pair, 1).passed > before.passed,
        "the program no longer runs"
    );

    // And a later command in its own private mount namespace finds and removes it.
    let (lines, out) = run_helper(&pair, 1, &format!("counters:{iface},unload:{iface}"), false);
    assert!(
        lines.len() == 2 && lines[0].starts_with("ok XdpCounters") && lines[1] == "ok Unloaded",
        "{lines:?}\n{out:?}"
    );
    assert!(status_of(&pair, 1).xroce.is_none());
    assert!(!ip_link_show(&pair, 1).contains("xdp"));
}

#[test]
fn unprivileged_user_is_told_to_be_root() {
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::new("xrld-user", 1500).expect("namespaces");
    let iface = pair.iface(1).to_string();
    // Loaded by root, so that map access is refused for privileges, not absence.
    load(&pair, 1, LoadOptions::new(&iface)).expect("load");

    let (lines, out) = run_helper(
        &pair,
        1,
        &format!("load:{iface},unload:{iface},counters:{iface},status:{iface}"),
        true,
    );
    assert_eq!(lines.len(), 4, "{lines:?}\n{out:?}");
    for line in &lines {
        assert!(line.starts_with("err "), "{line}");
        assert!(line.contains(&iface), "{line}");
        assert!(line.contains("needs root"), "{line}");
        assert!(line.contains("CAP_BPF"), "{line}");
    }
    // Still loaded, untouched.
    assert!(status_of(&pair, 1).xroce.is_some());
}

#[test]
fn pins_of_deleted_interfaces_are_removed() {
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::new("xrld-prune", 1500).expect("namespaces");
    let loaded = load(&pair, 1, LoadOptions::new(pair.iface(1))).expect("load");
    let old_dir = loaded.attachment().pin_dir.clone();

    // Deleting the veth pair detaches the link, but its pins stay, and status shows them
    // (unless a load in a test running in parallel has removed them already).
    let out = pair
        .exec(0, &format!("ip link del dev {}", pair.iface(0)))
        .expect("ip link del");
    assert!(out.status.success(), "{out:?}");
    let gone = pair.run_in(1, || xdp::status(None).expect("status"));
    assert!(gone.len() <= 1, "{gone:?}");
    if let Some(gone) = gone.first() {
        assert_eq!(gone.ifindex, None);
        assert!(gone.xroce.is_none());
        assert_eq!(gone.stale_pins.as_deref(), Some(old_dir.as_path()));
    }

    // The next load anywhere removes them.
    let out = pair
        .exec(
            0,
            &format!(
                "ip link add {} type veth peer name {} netns {} && ip link set {} up",
                pair.iface(0),
                pair.iface(1),
                pair.ns_name(1),
                pair.iface(0)
            ),
        )
        .expect("ip link add");
    assert!(out.status.success(), "{out:?}");
    load(&pair, 0, LoadOptions::new(pair.iface(0))).expect("load on the new veth");
    assert!(
        !old_dir.exists(),
        "pins of the deleted interface were left behind"
    );
    let status = status_of(&pair, 1);
    assert!(
        status.xroce.is_none() && status.stale_pins.is_none(),
        "{status:?}"
    );
}
