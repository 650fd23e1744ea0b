//! Interfaces and addresses changing under an engine: links down and removed, GIDs following
//! addresses, a peer's new MAC, the XDP program unloaded, receive queues added.

use super::*;

/// With its interface down (the kernel then removes the interface's routes), connecting a QP
/// fails with an error that says the interface is down and how to bring it up, not that
/// there is no route to the peer or that it is reached through another interface.
#[test]
fn connecting_through_a_downed_interface_says_it_is_down() {
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::new("xrdown", 1500).expect("namespaces");
    let iface = pair.iface(0).to_string();
    let (me, peer) = (pair.ipv4(0), pair.ipv4(1));
    let message = pair.run_in(0, move || {
        xdp::load(&xdp::LoadOptions::new(&iface)).expect("load");
        let engine = Engine::start(EngineConfig::new(&iface)).expect("engine");
        let sgid_index = engine
            .gids()
            .iter()
            .position(|g| *g == Some(IpAddress::V4(me.into())))
            .expect("own GID") as u8;
        let av = AddressVector {
            dgid: IpAddress::V4(peer.into()),
            sgid_index,
            traffic_class: 0,
            hop_limit: 64,
            flow_label: 0,
        };
        let ip = |state: &str| {
            // This thread is in the namespace; `ip` starts in it.
            let out = std::process::Command::new("ip")
                .args(["link", "set", &iface, state])
                .output()
                .expect("run ip");
            assert!(out.status.success(), "ip link set {state}: {out:?}");
        };
        ip("down");
        let refused = engine.resolve(&av).map_err(|e| e.to_string());
        ip("up");
        refused.expect_err("a peer reached through a downed interface")
    });
    assert!(
        message.contains("is down") && message.contains("ip link set") && message.contains("up"),
        "the error does not say the interface is down: {message}"
    );
}

/// The GID table follows the interface's addresses.
#[test]
fn gid_table_follows_address_changes() {
    if !root_or_skip() {
        return;
    }
    let setup = Setup::new(1500);
    let iface = setup.pair.iface(0).to_string();
    let ns = setup.pair.ns_name(0).to_string();
    // A device's directory as the generated sysfs tree has it, for the engine's GID files.
    let ibdev = std::env::temp_dir().join(format!("xroce-gids-{}", std::process::id()));
    let port = ibdev.join("ports/1");
    for dir in ["gids", "gid_attrs/types", "gid_attrs/ndevs"] {
        std::fs::create_dir_all(port.join(dir)).expect("mkdir");
    }
    std::fs::write(ibdev.join(registry::NETDEV_FILE), format!("{iface}\n")).expect("netdev file");
    // What libibverbs reads for index `i`: the GID, its type, its netdev.
    let files = move |i: usize| {
        let read = |rel: String| std::fs::read_to_string(port.join(rel)).expect("GID file");
        (
            read(format!("gids/{i}")),
            read(format!("gid_attrs/types/{i}")),
            read(format!("gid_attrs/ndevs/{i}")),
        )
    };
    let expected = |gid: Option<IpAddress>, iface: &str| match gid {
        Some(g) => (
            format!(
                "{}\n",
                registry::format_gid(registry::gid_ipv6(std_address(g)).octets())
            ),
            "RoCE v2\n".to_string(),
            format!("{iface}\n"),
        ),
        None => (
            format!("{}\n", registry::format_gid([0; 16])),
            "IB/RoCE v1\n".to_string(),
            "\n".to_string(),
        ),
    };
    let mirror = ibdev.clone();
    setup.pair.run_in(0, move || {
        // The tree has the interface's two addresses with an empty slot between them (an
        // address removed earlier): the engine starts with the same indices.
        let kernel = xroce_datapath::netlink::interface_by_name(&iface)
            .and_then(|i| xroce_datapath::netlink::gid_table(&i))
            .expect("the interface's addresses");
        assert_eq!(kernel.len(), 2, "{kernel:?}");
        let holey = [Some(kernel[0]), None, Some(kernel[1])];
        registry::write_port_gids(&mirror, &iface, &holey).expect("write the tree's table");
        let config = EngineConfig {
            gid_mirror: Some(mirror),
            ..EngineConfig::new(&iface)
        };
        let engine = Engine::start(config).expect("engine");
        let before = engine.gids();
        let expected_start: Vec<Option<IpAddress>> = holey
            .iter()
            .map(|g| g.map(xroce_datapath::netlink::core_address))
            .collect();
        assert_eq!(before, expected_start, "the engine's table at the start");
        for (i, gid) in before.iter().enumerate() {
            assert_eq!(
                files(i),
                expected(*gid, &iface),
                "GID file {i} at the start"
            );
        }
        assert!(
            matches!(before[0], Some(IpAddress::V6(a)) if a.0[0] == 0xfe && a.0[1] == 0x80),
            "GID 0 is the link-local default: {before:?}"
        );
        let extra = add_extra_v6(&ns, &iface);
        let deadline = Instant::now() + WAIT;
        let index = loop {
            if let Some(i) = engine.gid_index(extra.into()) {
                break i;
            }
            assert!(
                Instant::now() < deadline,
                "new address not in the GID table: {:?}",
                engine.gids()
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        // Addresses already there keep their index.
        let after = engine.gids();
        for (i, g) in before.iter().enumerate() {
            if g.is_some() {
                assert_eq!(after[i], *g, "GID {i} moved");
            }
        }
        // The device's GID files say what the engine's table says.
        for (i, gid) in after.iter().enumerate() {
            assert_eq!(
                files(i),
                expected(*gid, &iface),
                "GID file {i} after the add"
            );
        }
        let out = std::process::Command::new("ip")
            .args(["-n", &ns, "addr", "del", "fd00:4:4::9/64", "dev", &iface])
            .output()
            .expect("ip addr del");
        assert!(out.status.success(), "{out:?}");
        let deadline = Instant::now() + WAIT;
        while engine.gids()[index as usize].is_some() {
            assert!(
                Instant::now() < deadline,
                "removed address still in the GID table"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        // Its slot is empty in the files too, and the others stay where they were.
        for (i, gid) in engine.gids().iter().enumerate() {
            assert_eq!(
                files(i),
                expected(*gid, &iface),
                "GID file {i} after the delete"
            );
        }
        assert_eq!(files(index as usize), expected(None, &iface));
    });
    let _ = std::fs::remove_dir_all(&ibdev);
}

/// An interface taken down and brought up again (`ip link set IF down`, then `up`) under RC
/// WRITEs: while it is down the kernel refuses frames (`ENETDOWN`); the engine keeps them and
/// its QPs, retransmits on its timer, and does not spin; once the interface is up the WRITEs
/// complete, every byte intact. (It used to take `ENETDOWN` for an interface gone for good:
/// its progress thread stopped, and no QP of it ever sent again.)
#[test]
fn an_interface_down_for_a_while_delays_writes_but_loses_nothing() {
    if root_or_skip() {
        interface_down_for_a_while(Backend::AfXdp);
    }
}

/// The same with the writer on the DPDK port, whose driver takes frames into its ring whatever
/// the kernel does with them: the port reports the link down once that ring is full.
#[cfg(feature = "dpdk")]
#[test]
fn an_interface_down_under_a_dpdk_port_delays_writes_but_loses_nothing() {
    if root_or_skip() {
        interface_down_for_a_while(Backend::Dpdk);
    }
}

fn interface_down_for_a_while(backend: Backend) {
    const MSG: usize = 64 * 1024;
    const COUNT: usize = 16;
    const DOWN_FOR: Duration = Duration::from_millis(400);
    let setup = Setup::new(1500);
    let iface = setup.pair.iface(1).to_string();
    let peer_ip = setup.pair.ipv4(0).to_string();
    let peer_mac = setup
        .pair
        .exec(
            0,
            &format!("cat /sys/class/net/{}/address", setup.pair.iface(0)),
        )
        .expect("read side 0's MAC");
    let peer_mac = String::from_utf8_lossy(&peer_mac.stdout).trim().to_string();
    let configure: fn(usize, &mut EngineConfig) = match backend {
        Backend::AfXdp => |_, _| {},
        Backend::Dpdk => |side, config| {
            if side == 1 {
                config.backend = Backend::Dpdk;
            }
        },
    };
    setup.on_both_sides_configured(configure, move |me: Side<Endpoint>| {
        let engine = &me.engine;
        let qp = create_qp(engine, me.pd, QpType::Rc);
        to_init(engine, &qp);
        let mut buf = Buffer::new(engine, me.pd, MSG * COUNT);
        let data = pattern(11, MSG * COUNT);
        if me.index == 1 {
            buf.write(0, &data);
        }
        let peer = connect_with_memory(&me, &qp, &buf, 0x1000 + me.index as u32);
        if me.index == 0 {
            // The WRITEs' target: side 1 says when they are done (or is gone, having failed).
            me.from_peer
                .recv_timeout(WAIT * 2)
                .expect("side 1 completed its WRITEs");
            assert!(
                buf.read(0, MSG * COUNT) == data,
                "the WRITEs' data differs after the interface came back"
            );
            return;
        }
        // This thread runs in side 1's namespace, and so do the commands.
        let link = |state: &str| ip(&["link", "set", "dev", &iface, state]);
        let thread = progress_thread_id(engine);
        link("down");
        // Taking the interface down flushes its neighbours, and with no MAC for the peer the
        // engine drops its frames before the kernel sees them. A permanent entry keeps the
        // MAC, so that frames reach the kernel, which refuses them.
        ip(&[
            "neigh", "replace", &peer_ip, "lladdr", &peer_mac, "dev", &iface, "nud", "permanent",
        ]);
        post_writes(engine, &qp, &buf, &peer, 0..COUNT, MSG);
        let thread_cpu = |e: &Engine| {
            e.progress_cpu_time()
                .unwrap_or_else(|| panic!("the progress thread is gone: {:?}", e.failure()))
        };
        let cpu_before = thread_cpu(engine);
        let t0 = Instant::now();
        std::thread::sleep(DOWN_FOR);
        let cpu = thread_cpu(engine) - cpu_before;
        let share = cpu.as_secs_f64() / t0.elapsed().as_secs_f64() * 100.0;
        let mut wcs = Vec::new();
        engine
            .poll_cq(qp.send_cq, 64, &mut wcs)
            .expect("poll_cq while down");
        let counters = |e: &Engine| e.stats_line();
        assert!(
            wcs.is_empty(),
            "completions while the interface was down: {wcs:?}"
        );
        assert_eq!(engine.failure(), None, "{}", counters(engine));
        link("up");
        expect_completions(engine, qp.send_cq, COUNT, "WRITEs after the interface came back");
        let stats = counters(engine);
        eprintln!("interface down {DOWN_FOR:?}: progress thread (tid {thread}) used {share:.1} % of a core; {stats}");
        assert!(stats.contains(" link_downs=1 "), "ENETDOWN not seen: {stats}");
        assert!(!stats.contains(" timeouts=0 "), "nothing was retransmitted: {stats}");
        // Not a timing assertion: a thread spinning on the refused queue uses ~100 %.
        assert!(share < 50.0, "the progress thread spun while the interface was down: {share:.1} %");
        me.to_peer.send(peer).expect("tell side 0");
    });
}

/// An address handle or a modify that will be refused anyway (a GID index beyond the table,
/// an illegal transition) is refused at once with the verbs error, as rdma_rxe refuses it:
/// not after waiting for an address nobody answers, with an addressing error.
#[test]
fn requests_that_will_be_refused_do_not_wait_for_an_address() {
    if !root_or_skip() {
        return;
    }
    let setup = Setup::new(1500);
    let iface = setup.pair.iface(0).to_string();
    let own = setup.pair.ipv4(0);
    let [a, b, c, _] = own.octets();
    // On the namespace's subnet, and nobody's.
    let nobody = IpAddress::V4(std::net::Ipv4Addr::new(a, b, c, 250).into());
    setup.pair.run_in(0, move || {
        let engine = Engine::start(EngineConfig::new(&iface)).expect("engine");
        let pd = engine.with_device(|d| d.alloc_pd());
        let sgid_index = engine
            .gid_index(std::net::IpAddr::V4(own))
            .expect("own GID");
        let av = |sgid_index| AddressVector {
            dgid: nobody,
            sgid_index,
            traffic_class: 0,
            hop_limit: 64,
            flow_label: 0,
        };
        let refused = engine.create_ah(pd, av(200));
        assert!(
            matches!(refused, Err(VerbError::Verbs(_))),
            "create_ah with GID index 200: {refused:?}"
        );
        let qp = create_qp(&engine, pd, QpType::Rc); // in RESET
        let attr = QpAttr {
            state: QpState::Rtr,
            av: Some(av(sgid_index)),
            ..QpAttr::default()
        };
        let refused = engine.modify_qp(qp.qpn, &attr, AttrMask::STATE | AttrMask::AV);
        assert!(
            matches!(refused, Err(VerbError::Verbs(_))),
            "RESET -> RTR with an address vector: {refused:?}"
        );
    });
}

/// A peer whose MAC changes without telling anyone (no gratuitous ARP: `arp_notify` is 0 by
/// default) is found again: the engine keeps the kernel's neighbour entry in use, so the kernel
/// probes the old MAC, finds nobody, resolves the address again, and the engine follows. The
/// peer's engine, meanwhile, drops frames still sent to its old MAC, as its kernel would. The
/// kernel's neighbour timers are shortened in the writer's namespace so that this takes a
/// couple of seconds, not a minute; the writer's QP retransmits about once a second meanwhile
/// (`retry_cnt` 7: for ever, within the test's wait). The target is told not to announce its
/// new MAC (`arp_notify` 0, which a namespace may otherwise inherit from the host as 1).
#[test]
fn a_peer_whose_mac_changes_is_found_again() {
    if !root_or_skip() {
        return;
    }
    const MSG: usize = 64 * 1024;
    const COUNT: usize = 8;
    let setup = Setup::new(1500);
    let writer_if = setup.pair.iface(0).to_string();
    for (knob, value) in [
        ("base_reachable_time_ms", "200"),
        ("delay_first_probe_time", "1"),
        ("retrans_time_ms", "100"),
        ("ucast_solicit", "1"),
    ] {
        sysctl(
            &setup.pair,
            0,
            &format!("net.ipv4.neigh.{writer_if}.{knob}={value}"),
        );
    }
    let target_if = setup.pair.iface(1).to_string();
    sysctl(
        &setup.pair,
        1,
        &format!("net.ipv4.conf.{target_if}.arp_notify=0"),
    );
    setup.on_both_sides(move |me: Side<Endpoint>| {
        let engine = &me.engine;
        let qp = create_qp(engine, me.pd, QpType::Rc);
        to_init(engine, &qp);
        let mut buf = Buffer::new(engine, me.pd, MSG * COUNT * 2);
        let data = pattern(23, MSG * COUNT * 2);
        // 4.096 µs × 2^18 ≈ 1.07 s per try, 7 retries: time for the kernel to notice.
        let peer = connect_timed(&me, &qp, &buf, 0x2000 + me.index as u32, 18);
        if me.index == 1 {
            // The target: changes its MAC when the first half is in, then checks all of it.
            me.from_peer.recv_timeout(WAIT).expect("first half written");
            const NEW_MAC: [u8; 6] = [0x02, 0, 0, 0x7a, 0x7a, 0x01];
            ip(&[
                "link",
                "set",
                "dev",
                &target_if,
                "address",
                "02:00:00:7a:7a:01",
            ]);
            // veth delivers frames whatever their destination MAC, so until this engine has
            // read its new MAC it would still take the writer's frames for the old one, and
            // the writer would lose nothing (seen on a loaded CI machine).
            let deadline = Instant::now() + WAIT;
            while engine.mac() != NEW_MAC {
                assert!(
                    Instant::now() < deadline,
                    "the engine did not follow its interface's new MAC: {:02x?}",
                    engine.mac()
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            me.to_peer.send(peer).expect("tell the writer");
            me.from_peer
                .recv_timeout(WAIT)
                .expect("second half written");
            assert!(
                buf.read(0, MSG * COUNT * 2) == data,
                "the WRITEs' data differs"
            );
            let stats = engine.stats_line();
            eprintln!("target: {stats}");
            assert!(
                !stats.contains(" rx_other_host=0 "),
                "no frame came to the old MAC, so the test tested nothing: {stats}"
            );
            return;
        }
        buf.write(0, &data);
        post_writes(engine, &qp, &buf, &peer, 0..COUNT, MSG);
        expect_completions(engine, qp.send_cq, COUNT, "WRITEs before the MAC change");
        me.to_peer.send(peer).expect("tell the target");
        me.from_peer
            .recv_timeout(WAIT)
            .expect("the target's MAC changed");
        post_writes(engine, &qp, &buf, &peer, COUNT..2 * COUNT, MSG);
        expect_completions(engine, qp.send_cq, COUNT, "WRITEs after the MAC change");
        // The target checks its side whatever this side finds, so that both are shown.
        me.to_peer.send(peer).expect("tell the target");
        let stats = engine.stats_line();
        eprintln!("writer: {stats}");
        assert!(!stats.contains(" timeouts=0 "), "nothing was lost: {stats}");
    });
}

/// The interface removed under two engines (`ip link del` takes both ends of the veth): each
/// device fails rather than leave its applications waiting forever. WRITEs in flight and
/// posted receives complete with flush errors, so does work posted afterwards, and the engine
/// says why. Side 1 is busy sending (the kernel refuses its next frames); side 0 has nothing
/// to send and spins on its CQ (its progress thread learns of the removal from the kernel's
/// link notification, and must take the engine from the polling application to act on it).
#[test]
fn a_removed_interface_fails_the_device_and_flushes_every_qp() {
    if !root_or_skip() {
        return;
    }
    const MSG: usize = 64 * 1024;
    let setup = Setup::new(1500);
    let (ns0, iface0, iface1) = (
        setup.pair.ns_name(0).to_string(),
        setup.pair.iface(0).to_string(),
        setup.pair.iface(1).to_string(),
    );
    setup.on_both_sides(move |me: Side<Endpoint>| {
        let engine = &me.engine;
        let qp = create_qp(engine, me.pd, QpType::Rc);
        to_init(engine, &qp);
        let buf = Buffer::new(engine, me.pd, 4 * MSG);
        if me.index == 0 {
            for i in 0..4 {
                let wr = RecvWr {
                    wr_id: 100 + i as u64,
                    sg_list: vec![buf.sge(i * 1024, 1024)].into(),
                };
                engine.post_recv(qp.qpn, wr).expect("post_recv");
            }
        }
        let peer = connect_with_memory(&me, &qp, &buf, 0x2000 + me.index as u32);
        if me.index == 0 {
            // Side 1 removes the interface; this side, with nothing to send, spins on its CQ
            // (so its progress thread keeps off the lock) until its receives are flushed.
            let mut wcs = Vec::new();
            let deadline = Instant::now() + WAIT;
            while wcs.len() < 4 {
                assert!(
                    Instant::now() < deadline,
                    "receives of the polling side: {} of 4 flushed after {WAIT:?} ({:?})",
                    wcs.len(),
                    engine.failure()
                );
                engine.poll_cq(qp.recv_cq, 4, &mut wcs).expect("poll_cq");
            }
            me.from_peer
                .recv_timeout(WAIT * 2)
                .expect("side 1 removed the interface");
            for (i, wc) in wcs.iter().enumerate() {
                assert_eq!(wc.status, WcStatus::WrFlushErr, "{wc:?}");
                assert_eq!(wc.wr_id, 100 + i as u64);
            }
            let why = engine.failure().expect("the idle side's engine failed");
            assert!(why.contains("removed"), "{why}");
            return;
        }
        // The peer's end down first: the WRITEs below stay in flight (unacknowledged).
        ip(&["-n", &ns0, "link", "set", "dev", &iface0, "down"]);
        post_writes(engine, &qp, &buf, &peer, 0..4, MSG);
        ip(&["link", "del", "dev", &iface1]);
        let wcs = poll_completions(engine, qp.send_cq, 4, "WRITEs in flight");
        for (i, wc) in wcs.iter().enumerate() {
            assert_eq!(wc.status, WcStatus::WrFlushErr, "{wc:?}");
            assert_eq!(wc.wr_id, i as u64);
        }
        assert!(engine.failure().is_some(), "{}", engine.stats_line());
        // Work posted now completes at once, flushed.
        let wr = SendWr::new(9, SendOp::Send, vec![buf.sge(0, 64)]);
        engine
            .post_send(qp.qpn, wr)
            .expect("post_send after the failure");
        let wcs = poll_completions(engine, qp.send_cq, 1, "a SEND posted after the failure");
        assert_eq!((wcs[0].wr_id, wcs[0].status), (9, WcStatus::WrFlushErr));
        me.to_peer.send(peer).expect("tell side 0");
    });
}

/// The XDP program removed from under a running engine (`xroce link del` while a program
/// uses the device): no RoCEv2 frame reaches the engine any more, and the kernel does not say
/// so. An engine with a WRITE waiting for its ACK finds out when its retransmissions time out
/// (here with the watch of the program's pins turned off, as for a process that cannot reach
/// bpffs), fails its device, and the WRITE completes with a flush error instead of being
/// retried forever.
#[test]
fn an_engine_whose_xdp_program_is_removed_fails_its_device() {
    xdp_program_unloaded_under_an_engine(Waiting::ForAnAck);
}

/// The same with an engine that has nothing to send: it only waits for a message, as a
/// server does. No retransmission times out there, so the engine learns of the unload from
/// the removal of the program's pins (`xdp::PinWatch`), without any verb called meanwhile,
/// fails its device, and the receive it waits on completes with a flush error.
#[test]
fn an_engine_waiting_to_receive_learns_at_once_that_its_xdp_program_was_unloaded() {
    xdp_program_unloaded_under_an_engine(Waiting::ForAMessage);
}

/// What side 1 waits for when its XDP program is unloaded.
#[derive(Clone, Copy, PartialEq)]
enum Waiting {
    ForAnAck,
    ForAMessage,
}

fn xdp_program_unloaded_under_an_engine(waiting: Waiting) {
    if !root_or_skip() {
        return;
    }
    let setup = Setup::new(1500);
    let iface1 = setup.pair.iface(1).to_string();
    let configure = match waiting {
        Waiting::ForAnAck => |_, c: &mut EngineConfig| c.watch_xdp_pins = false,
        Waiting::ForAMessage => |_, _: &mut EngineConfig| {},
    };
    setup.on_both_sides_configured(configure, move |me: Side<Endpoint>| {
        let engine = &me.engine;
        let qp = create_qp(engine, me.pd, QpType::Rc);
        to_init(engine, &qp);
        let buf = Buffer::new(engine, me.pd, 4096);
        if me.index == 1 && waiting == Waiting::ForAMessage {
            let wr = RecvWr {
                wr_id: 5,
                sg_list: vec![buf.sge(0, 1024)].into(),
            };
            engine.post_recv(qp.qpn, wr).expect("post_recv");
        }
        let peer = connect_with_memory(&me, &qp, &buf, 0x3000 + me.index as u32);
        if me.index == 0 {
            me.from_peer
                .recv_timeout(WAIT * 2)
                .expect("side 1 finished");
            assert_eq!(engine.failure(), None, "the side with its program failed");
            return;
        }
        xdp::unload(&iface1).expect("unload the XDP program");
        let (cq, wr_id) = match waiting {
            Waiting::ForAnAck => {
                post_writes(engine, &qp, &buf, &peer, 0..1, 1024);
                (qp.send_cq, 0)
            }
            Waiting::ForAMessage => {
                // No verb until the engine has failed: its progress thread must find out
                // alone.
                let deadline = Instant::now() + WAIT;
                while engine.failure().is_none() {
                    assert!(
                        Instant::now() < deadline,
                        "the engine did not notice the unload within {WAIT:?}; {}",
                        engine.stats_line()
                    );
                    std::thread::sleep(Duration::from_millis(10));
                }
                (qp.recv_cq, 5)
            }
        };
        let wcs = poll_completions(engine, cq, 1, "work the unload left waiting");
        assert_eq!((wcs[0].wr_id, wcs[0].status), (wr_id, WcStatus::WrFlushErr));
        let why = engine.failure().expect("the engine failed");
        assert!(why.contains("XDP program"), "{why}");
        me.to_peer.send(peer).expect("tell side 0");
    });
}

/// A NIC spreads flows over its receive queues, so a QP's frames may arrive on any queue, not
/// only the one its engine sends on. On a veth pair with four queues a frame sent on queue `q`
/// arrives on queue `q`: side 1's engine sends on queue 2, so its WRITEs (and its ACKs) arrive
/// on side 0's queue 2, and side 0's, sent on queue 0, on side 1's queue 0. Both transfers
/// arrive whole only if each engine receives on the queues besides its own (with
/// `all_rx_queues` off, both sides wait in vain).
#[test]
fn an_engine_receives_on_every_queue_of_its_interface() {
    if !root_or_skip() {
        return;
    }
    const MSG: usize = 64 * 1024;
    const COUNT: usize = 16;
    let turn = Turn::Shared(TURNS.read().unwrap_or_else(|p| p.into_inner()));
    let setup = Setup::with_queues(1500, 4, turn);
    setup.on_both_sides_configured(
        |side, c| c.queue = if side == 1 { 2 } else { 0 },
        move |me: Side<Endpoint>| {
            let engine = &me.engine;
            let own = if me.index == 1 { 2 } else { 0 };
            let mut queues = engine.queues().to_vec();
            assert_eq!(
                queues[0], own,
                "the queue it sends on comes first: {queues:?}"
            );
            queues.sort_unstable();
            assert_eq!(queues, [0, 1, 2, 3], "a socket on every queue in use");
            let qp = create_qp(engine, me.pd, QpType::Rc);
            to_init(engine, &qp);
            let mut buf = Buffer::new(engine, me.pd, 2 * MSG * COUNT);
            // Each side writes its pattern from the first half of its buffer into the second
            // half of the peer's.
            let mine = pattern(20 + me.index as u64, MSG * COUNT);
            buf.write(0, &mine);
            let mut peer = connect_with_memory(&me, &qp, &buf, 0x5000 + me.index as u32);
            peer.va += (MSG * COUNT) as u64;
            post_writes(engine, &qp, &buf, &peer, 0..COUNT, MSG);
            let wcs = poll_completions(engine, qp.send_cq, COUNT, "WRITEs to the peer");
            assert!(
                wcs.iter().all(|wc| wc.status == WcStatus::Success),
                "{wcs:?}"
            );
            me.to_peer.send(peer).expect("tell the peer");
            me.from_peer
                .recv_timeout(WAIT * 2)
                .expect("the peer's WRITEs completed");
            let theirs = pattern(20 + (1 - me.index) as u64, MSG * COUNT);
            assert!(
                buf.read(MSG * COUNT, MSG * COUNT) == theirs,
                "side {}: the peer's WRITEs differ",
                me.index
            );
            assert_eq!(engine.failure(), None);
        },
    );
}

/// An interface given more receive queues after its engine started (`ethtool -L`, as a cloud
/// agent may do) spreads frames over queues the engine has no socket on: the steering program
/// passes those to the kernel and their QPs stall. Nothing else would say why; when
/// retransmissions time out the engine looks, and says so (counted as `rx_queues_grown`).
#[test]
fn receive_queues_added_under_an_engine_are_reported() {
    if !root_or_skip() {
        return;
    }
    let turn = Turn::Shared(TURNS.read().unwrap_or_else(|p| p.into_inner()));
    let setup = Setup::with_queues(1500, 4, turn);
    let (iface, peer_iface) = (setup.pair.iface(0).to_string(), setup.pair.iface(1));
    // One receive queue at side 0 (veth with XDP wants the peer to send on no more).
    for (side, what) in [
        (1, format!("{peer_iface} tx 1")),
        (0, format!("{iface} rx 1")),
    ] {
        let out = setup
            .pair
            .exec(side, &format!("ethtool -L {what}"))
            .expect("run ethtool");
        assert!(out.status.success(), "ethtool -L {what}: {out:?}");
    }
    let local = IpAddress::V4(setup.pair.ipv4(0).into());
    let peer = IpAddress::V4(setup.pair.ipv4(1).into());
    setup.pair.run_in(0, move || {
        let engine = Engine::start(EngineConfig::new(&iface)).expect("engine");
        assert_eq!(engine.queues(), [0], "one queue at the start");
        // Nobody answers: the SEND's retransmissions time out.
        let (buf, qp) = connected_to_nobody(&engine, local, peer);
        let grown = || engine.counters().rx_queues_grown.load(Ordering::Relaxed);
        // Timeouts with the queues as they were: nothing to report.
        engine
            .post_send(qp.qpn, SendWr::new(1, SendOp::Send, vec![buf.sge(0, 64)]))
            .expect("post_send");
        let deadline = Instant::now() + WAIT;
        while engine.with_device(|d| d.counters().timeouts) == 0 {
            assert!(
                Instant::now() < deadline,
                "no timeout: {}",
                engine.stats_line()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(grown(), 0, "reported with the queues unchanged");
        // This thread is in the namespace; `ethtool` starts in it.
        let out = std::process::Command::new("ethtool")
            .args(["-L", &iface, "rx", "4"])
            .output()
            .expect("run ethtool");
        assert!(out.status.success(), "ethtool -L {iface} rx 4: {out:?}");
        let deadline = Instant::now() + WAIT;
        while grown() == 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(grown(), 1, "not reported: {}", engine.stats_line());
        drop(buf);
    });
}

/// An address added while an application thread keeps polling a CQ enters the GID table
/// (the progress thread leaves such changes for a moment while the application is busy in
/// its verbs, but not for as long as it polls; before, they waited for the polls to stop).
#[test]
fn gid_table_follows_an_address_added_while_an_application_polls() {
    if !root_or_skip() {
        return;
    }
    let setup = Setup::new(1500);
    let iface = setup.pair.iface(0).to_string();
    let ns = setup.pair.ns_name(0).to_string();
    setup.pair.run_in(0, move || {
        let engine = Arc::new(Engine::start(EngineConfig::new(&iface)).expect("engine"));
        let cq = engine.with_device(|d| d.create_cq(16).expect("create_cq"));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let poller = {
            let (engine, stop) = (engine.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut out = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    engine.poll_cq(cq, 16, &mut out).expect("poll_cq");
                }
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        let added = add_extra_v6(&ns, &iface);
        let start = Instant::now();
        let mut seen = false;
        while !seen && start.elapsed() < WAIT {
            std::thread::sleep(Duration::from_millis(20));
            seen = engine.gid_index(added.into()).is_some();
        }
        let polling = !poller.is_finished();
        stop.store(true, Ordering::Relaxed);
        poller.join().expect("poller");
        assert!(polling, "the poller stopped early");
        assert!(
            seen,
            "{added} not in the GID table after {WAIT:?}: {:?}",
            engine.gids()
        );
    });
}

/// Sends `n` 64-byte UDP datagrams to `to` from namespace `side`, 5 ms apart.
fn send_udp_from(pair: &NetnsPair, side: usize, to: std::net::SocketAddr, n: u8) {
    pair.spawn_in(side, move || {
        let s = std::net::UdpSocket::bind(("0.0.0.0", 0)).expect("udp");
        for i in 0..n {
            s.send_to(&[i; 64], to).expect("send");
            std::thread::sleep(Duration::from_millis(5));
        }
    })
    .join()
    .expect("sender");
}

/// RoCEv2 for an address that is not the xroce device's stays with the kernel while an
/// engine runs: here a kernel UDP socket on port 4791 of an address on the namespace's
/// loopback, reached through the engine's interface (as a macvlan's or a VLAN device's
/// address would be, or a route through the host). The steering program takes only what is
/// addressed to the device's GIDs, and follows them: an address added to the interface is
/// steered. Before, every datagram went to the engine, which dropped it.
#[test]
fn roce_for_another_address_stays_with_the_kernel() {
    if !root_or_skip() {
        return;
    }
    let setup = Setup::new(1500);
    let iface = setup.pair.iface(0).to_string();
    let [a, b, c, _] = setup.pair.ipv4(0).octets();
    let other = std::net::Ipv4Addr::new(a, b, c, 50);
    let ns = setup.pair.ns_name(0);
    ip(&["-n", ns, "addr", "add", &format!("{other}/32"), "dev", "lo"]);
    let pair = &setup.pair;
    let (received, taken, to_engine) = pair.run_in(0, move || {
        let engine = Engine::start(EngineConfig::new(&iface)).expect("engine");
        let listener = std::net::UdpSocket::bind((other, 4791)).expect("bind 4791");
        listener
            // Generous: the loop ends at the tenth datagram.
            .set_read_timeout(Some(WAIT))
            .expect("timeout");
        send_udp_from(pair, 1, (other, 4791).into(), 10);
        let mut received = 0;
        let mut buf = [0u8; 128];
        while received < 10 && listener.recv_from(&mut buf).is_ok() {
            received += 1;
        }
        let taken = engine.with_device(|d| d.counters()).rx_packets;

        // An address added to the interface is the device's: the program follows the GID
        // table, and frames to it reach the engine.
        let added = std::net::Ipv4Addr::new(a, b, c, 51);
        ip(&["addr", "add", &format!("{added}/24"), "dev", &iface]);
        let start = Instant::now();
        while engine.gid_index(added.into()).is_none() && start.elapsed() < WAIT {
            std::thread::sleep(Duration::from_millis(10));
        }
        send_udp_from(pair, 1, (added, 4791).into(), 5);
        let start = Instant::now();
        let mut to_engine = 0;
        while to_engine < 5 && start.elapsed() < WAIT {
            std::thread::sleep(Duration::from_millis(10));
            to_engine = engine.with_device(|d| d.counters()).rx_packets - taken;
        }
        (received, taken, to_engine)
    });
    assert_eq!(
        (received, taken),
        (10, 0),
        "datagrams the kernel's socket received, frames the engine took"
    );
    assert_eq!(
        to_engine, 5,
        "frames to the added address that reached the engine"
    );
}

/// Sets `setting` (`name=value`) in the namespace of `side`.
fn sysctl(pair: &NetnsPair, side: usize, setting: &str) {
    let o = pair
        .exec(side, &format!("sysctl -qw {setting}"))
        .expect("sysctl");
    assert!(o.status.success(), "sysctl {setting}: {o:?}");
}

/// Adds fd00:4:4::9/64 (no duplicate address detection) to `iface` in namespace `ns`.
fn add_extra_v6(ns: &str, iface: &str) -> std::net::Ipv6Addr {
    ip(&[
        "-n",
        ns,
        "addr",
        "add",
        "fd00:4:4::9/64",
        "dev",
        iface,
        "nodad",
    ]);
    std::net::Ipv6Addr::new(0xfd00, 4, 4, 0, 0, 0, 0, 9)
}

/// Runs `ip ARGS` in the calling thread's network namespace; it must succeed.
fn ip(args: &[&str]) {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .expect("run ip");
    assert!(out.status.success(), "ip {args:?}: {out:?}");
}

/// Swaps endpoints (with `buf` open to the peer's WRITEs and READs) with the other side,
/// brings `qp` up to RTS towards it at path MTU 1024, and waits for the other side to be there
/// too. Returns the peer's endpoint.
fn connect_with_memory(me: &Side<Endpoint>, qp: &Qp, buf: &Buffer, psn: u32) -> Endpoint {
    connect_at(me, qp, buf, 0, psn, PathMtu::Mtu1024)
}

/// [`connect_with_memory`] with the local ACK timeout `timeout` (4.096 µs × 2^timeout).
fn connect_timed(me: &Side<Endpoint>, qp: &Qp, buf: &Buffer, psn: u32, timeout: u8) -> Endpoint {
    connect_timed_at(me, qp, buf, 0, psn, PathMtu::Mtu1024, timeout)
}
