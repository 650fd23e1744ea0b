//! The ports: MTUs and multi-buffer, an application in another namespace, batching by the
//! interface's driver and the peer's program, loopback and the idle cost, and a second
//! engine refused on a DPDK engine's interface.

use super::*;

/// A path MTU above the port's active MTU, as `ibv_rc_pingpong -m 4096` asks for on a
/// 1500-byte veth: a message that fits the link in one packet still arrives (1200 bytes, more
/// than the port's 1024), as with rdma_rxe; a longer one makes a packet the veth drops, which
/// the engine counts (and reports once on stderr) so that the hang that follows has a reason.
/// (3000 bytes: one packet that fits a UMEM frame, so the test holds on kernels without
/// multi-buffer too.)
#[test]
fn packets_longer_than_the_interfaces_mtu_are_counted() {
    if !root_or_skip() {
        return;
    }
    const FITS: usize = 1200;
    const TOO_LONG: usize = 3000;
    let setup = Setup::new(1500);
    let results = setup.on_both_sides(move |me: Side<Endpoint>| {
        let (side, pd, engine) = (me.index, me.pd, &me.engine);
        let mut buf = Buffer::new(engine, pd, 2 * TOO_LONG);
        let qp = create_qp(engine, pd, QpType::Rc);
        to_init(engine, &qp);
        let psn = 0xb00 + side as u32;
        let peer = connect_at(&me, &qp, &buf, TOO_LONG, psn, PathMtu::Mtu4096);
        let too_long = || engine.counters().tx_too_long.load(Ordering::Relaxed);
        let mut outcome = (0, 0, Vec::new());
        if side == 0 {
            buf.write(0, &pattern(7, TOO_LONG));
            let write = |id: u64, len: usize| {
                let op = SendOp::RdmaWrite {
                    remote_addr: peer.va,
                    rkey: peer.rkey,
                };
                engine
                    .post_send(qp.qpn, SendWr::new(id, op, vec![buf.sge(0, len)]))
                    .expect("post_send");
            };
            write(1, FITS);
            expect_completions(engine, qp.send_cq, 1, "the WRITE that fits one packet");
            let before = too_long();
            write(2, TOO_LONG);
            let deadline = Instant::now() + WAIT;
            while too_long() == before && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            outcome = (before, too_long(), Vec::new());
        }
        // Side 1 looks at its memory once side 0 has seen what it waited for.
        me.connected.wait();
        if side == 1 {
            outcome.2 = buf.read(TOO_LONG, TOO_LONG);
        }
        outcome
    });
    let [(before, after, _), (_, _, landed)] = results;
    assert_eq!(
        before, 0,
        "a packet that fits the link was counted as too long"
    );
    assert!(after > 0, "the {TOO_LONG}-byte packet was not counted");
    let sent = pattern(7, TOO_LONG);
    assert_eq!(&landed[..FITS], &sent[..FITS], "the WRITE that fits");
    assert!(
        landed[FITS..].iter().all(|&b| b == 0),
        "the packet too long for the veth arrived"
    );
}

/// A program whose threads sit in different network namespaces: the QPs are connected (the
/// transition to RTR resolves the peer's MAC) by threads that have moved into the *other*
/// side's namespace, where the peer's address is one of their own. The engine still looks the
/// peer up in its own namespace, where it started, and the WRITEs that follow arrive whole.
#[test]
fn a_thread_in_another_namespace_connects_through_the_engines_namespace() {
    if !root_or_skip() {
        return;
    }
    const MSG: usize = 8192;
    let setup = Setup::new(1500);
    let names = [0, 1].map(|side| setup.pair.ns_name(side).to_string());
    let results = setup.on_both_sides(move |me: Side<Endpoint>| {
        let (side, pd, engine) = (me.index, me.pd, &me.engine);
        let mut buf = Buffer::new(engine, pd, 2 * MSG);
        let qp = create_qp(engine, pd, QpType::Rc);
        to_init(engine, &qp);
        let psn = 0xd00 + side as u32;
        let peer = me.swap(Endpoint {
            qpn: qp.qpn,
            psn,
            ip: me.ip,
            va: buf.addr(MSG),
            rkey: buf.mr.rkey,
        });
        let elsewhere = &names[1 - side];
        std::thread::scope(|s| {
            s.spawn(|| {
                xroce_datapath::netns::enter(elsewhere).expect("enter the other namespace");
                bring_up(engine, &qp, me.ip, &peer, psn, PathMtu::Mtu1024);
            })
            .join()
            .expect("connected from the other namespace");
        });
        me.connected.wait();
        buf.write(0, &pattern(20 + side as u64, MSG));
        post_writes(engine, &qp, &buf, &peer, 0..1, MSG);
        expect_completions(engine, qp.send_cq, 1, "the WRITE");
        // Both WRITEs are done once both sides pass here.
        me.connected.wait();
        buf.read(MSG, MSG)
    });
    assert!(results[1] == pattern(20, MSG), "side 0's WRITE");
    assert!(results[0] == pattern(21, MSG), "side 1's WRITE");
}

/// Sockets without multi-buffer, as on kernels before 6.6 (Debian 12's own 6.1), forced here
/// on a 9000-byte veth: the port's active MTU is 2048, and a QP at that path MTU moves a
/// 64 KiB WRITE and READ intact. A QP asking for 4096 still sends a message that fits one
/// frame; one that makes a packet larger than a frame fails its work request at once with a
/// local QP operation error, counted, where it used to be left unsent.
#[test]
fn sockets_without_multi_buffer_cap_the_port_and_fail_what_no_frame_holds() {
    if !root_or_skip() {
        return;
    }
    const LONG: usize = 64 * 1024;
    const FITS: usize = 3000;
    let setup = Setup::new(9000);
    let ifaces = [0, 1].map(|side| setup.pair.iface(side).to_string());
    let results = setup.on_both_sides_configured(
        |_, config| config.single_buffer = true,
        move |me: Side<Endpoint>| {
            let (side, pd, engine) = (me.index, me.pd, &me.engine);
            // Another process (`xroce link show`, `ibv_devinfo`) learns it from the queue's
            // note, and reports the same active MTU.
            let holder = xroce_datapath::engine::queue_holder(&ifaces[side], 0);
            assert_eq!(
                holder.map(|h| h.multi_buffer),
                Some(Some(false)),
                "the queue's note"
            );
            assert_eq!(
                xroce_datapath::engine::holder_multi_buffer(&ifaces[side]),
                Some(false)
            );
            let port_mtu = (
                engine.with_device(|d| d.port_mtu()),
                engine.is_multi_buffer(),
            );
            // [0, LONG): side 0's WRITE lands here on side 1, and side 1's memory that side 0
            // READs back; [LONG, 2 LONG): what the QP at 4096 writes.
            let mut buf = Buffer::new(engine, pd, 3 * LONG);
            let small = create_qp(engine, pd, QpType::Rc);
            let big = create_qp(engine, pd, QpType::Rc);
            to_init(engine, &small);
            to_init(engine, &big);
            let psn = 0xc00 + side as u32;
            let peer_small = connect_at(&me, &small, &buf, 0, psn, PathMtu::Mtu2048);
            let peer_big = connect_at(&me, &big, &buf, LONG, psn, PathMtu::Mtu4096);
            let mut outcome = (port_mtu, Vec::new(), Vec::new(), 0, Vec::new());
            if side == 0 {
                buf.write(0, &pattern(11, LONG));
                buf.write(LONG, &pattern(12, FITS));
                let op = SendOp::RdmaWrite {
                    remote_addr: peer_small.va,
                    rkey: peer_small.rkey,
                };
                let wr = SendWr::new(1, op, vec![buf.sge(0, LONG)]);
                engine.post_send(small.qpn, wr).expect("post_send");
                expect_completions(engine, small.send_cq, 1, "the 64 KiB WRITE at 2048");
                let op = SendOp::RdmaRead {
                    remote_addr: peer_small.va,
                    rkey: peer_small.rkey,
                };
                let wr = SendWr::new(2, op, vec![buf.sge(2 * LONG, LONG)]);
                engine.post_send(small.qpn, wr).expect("post_send");
                expect_completions(engine, small.send_cq, 1, "the 64 KiB READ at 2048");
                outcome.1 = buf.read(2 * LONG, LONG);

                let write = |id: u64, len: usize| {
                    let op = SendOp::RdmaWrite {
                        remote_addr: peer_big.va,
                        rkey: peer_big.rkey,
                    };
                    let wr = SendWr::new(id, op, vec![buf.sge(LONG, len)]);
                    engine.post_send(big.qpn, wr).expect("post_send");
                };
                write(3, FITS);
                write(4, 2 * FITS);
                let wcs = poll_completions(engine, big.send_cq, 2, "the WRITEs at 4096");
                outcome.2 = wcs.iter().map(|wc| (wc.wr_id, wc.status)).collect();
                outcome.3 = engine.with_device(|d| d.counters().tx_too_big_for_buffer);
            }
            // Side 1 looks at its memory once side 0 has its completions.
            me.connected.wait();
            if side == 1 {
                outcome.4 = buf.read(LONG, FITS);
            }
            outcome
        },
    );
    let [(mtu0, read_back, statuses, too_big, _), (mtu1, _, _, _, landed)] = results;
    assert_eq!(
        (mtu0, mtu1),
        ((PathMtu::Mtu2048, false), (PathMtu::Mtu2048, false)),
        "both ports at 2048, neither taking frames longer than one UMEM frame"
    );
    assert!(
        read_back == pattern(11, LONG),
        "the 64 KiB WRITE and READ at path MTU 2048 came back changed"
    );
    assert_eq!(
        statuses,
        [(3, WcStatus::Success), (4, WcStatus::LocQpOpErr)],
        "at 4096: the WRITE that fits a frame, then the one that does not"
    );
    assert_eq!(too_big, 1, "the packet no frame holds was not counted");
    assert!(landed == pattern(12, FITS), "the WRITE that fits a frame");
}

/// A QP talking to a QP of the same engine never touches the wire; and an idle engine with
/// connected QPs sleeps.
#[test]
fn loopback_and_idle_cost() {
    if root_or_skip() {
        loopback_and_idle_cost_on(Backend::AfXdp);
    }
}

/// The same on the DPDK port, whose driver has no descriptor to sleep on: its idle engine
/// sleeps on the port's kernel UDP socket (the doorbell) instead.
#[cfg(feature = "dpdk")]
#[test]
fn dpdk_port_loopback_and_idle_cost() {
    if root_or_skip() {
        loopback_and_idle_cost_on(Backend::Dpdk);
    }
}

/// A second engine on an interface a DPDK engine has is refused with a clear error naming the
/// process, whether on DPDK (its kernel UDP socket on the interface is taken) or on AF_XDP
/// (whose sockets would take the frames before DPDK's driver saw them), and a DPDK engine is
/// refused where an AF_XDP engine runs; each starts once the other is gone. An engine on the
/// other end of the veth, in another namespace, is not in the way.
#[cfg(feature = "dpdk")]
#[test]
fn a_second_engine_on_a_dpdk_engines_interface_is_refused() {
    if !root_or_skip() {
        return;
    }
    let setup = Setup::new(1500);
    let dpdk = |iface: &str| {
        Engine::start(EngineConfig {
            backend: Backend::Dpdk,
            ..EngineConfig::new(iface)
        })
    };
    let iface = setup.pair.iface(0).to_string();
    let other = setup.pair.iface(1).to_string();
    let _peer = setup
        .pair
        .run_in(1, move || dpdk(&other).expect("engine on the other end"));
    setup.pair.run_in(0, move || {
        let refused = |started: Result<Engine, xroce_datapath::engine::EngineError>| {
            let err = started
                .err()
                .expect("a second engine on the interface started");
            let text = err.to_string();
            assert!(
                matches!(
                    err,
                    xroce_datapath::engine::EngineError::InterfaceInUse { .. }
                ) && text.contains(&format!("process {}", std::process::id()))
                    && text.contains("one RDMA process at a time"),
                "{text}"
            );
        };
        let first = dpdk(&iface).expect("first engine");
        assert_eq!(first.backend(), Backend::Dpdk);
        refused(dpdk(&iface));
        refused(Engine::start(EngineConfig::new(&iface)));
        drop(first);
        let af_xdp = Engine::start(EngineConfig::new(&iface)).expect("AF_XDP after DPDK");
        refused(dpdk(&iface));
        drop(af_xdp);
        dpdk(&iface).expect("DPDK after AF_XDP");
    });
}

fn loopback_and_idle_cost_on(backend: Backend) {
    let setup = Setup::new(1500);
    let iface = setup.pair.iface(0).to_string();
    let ip = IpAddress::V4(setup.pair.ipv4(0).into());
    let (cpu_used, idle_for) = setup.pair.run_in(0, move || {
        let engine = Engine::start(EngineConfig {
            backend,
            ..EngineConfig::new(&iface)
        })
        .expect("engine");
        let pd = engine.with_device(|d| d.alloc_pd());
        const LEN: usize = 4 * MIB;
        let mut buf = Buffer::new(&engine, pd, 2 * LEN);
        buf.write(0, &pattern(7, LEN));
        let a = create_qp(&engine, pd, QpType::Rc);
        let b = create_qp(&engine, pd, QpType::Rc);
        to_init(&engine, &a);
        to_init(&engine, &b);
        let ea = Endpoint {
            qpn: a.qpn,
            psn: 1,
            ip,
            va: buf.addr(0),
            rkey: buf.mr.rkey,
        };
        let eb = Endpoint {
            qpn: b.qpn,
            psn: 2,
            ip,
            va: buf.addr(LEN),
            rkey: buf.mr.rkey,
        };
        bring_up(&engine, &a, ip, &eb, ea.psn, PathMtu::Mtu1024);
        bring_up(&engine, &b, ip, &ea, eb.psn, PathMtu::Mtu1024);
        let redirected_before = xdp::read_counters(&iface).expect("counters").redirected;
        stream(&engine, &a, LEN / (64 * 1024), 16, "loopback WRITE", |i| {
            SendWr::new(
                i as u64,
                SendOp::RdmaWrite {
                    remote_addr: eb.va + (i * 64 * 1024) as u64,
                    rkey: eb.rkey,
                },
                vec![buf.sge(i * 64 * 1024, 64 * 1024)],
            )
        });
        assert!(
            buf.read(LEN, LEN) == pattern(7, LEN),
            "loopback WRITE data differs"
        );
        let loopback = engine
            .counters()
            .tx_loopback
            .load(std::sync::atomic::Ordering::Relaxed);
        assert!(
            loopback >= (LEN / 1024) as u64,
            "only {loopback} packets looped back"
        );
        assert_eq!(
            engine
                .counters()
                .tx_frames
                .load(std::sync::atomic::Ordering::Relaxed),
            0
        );
        assert_eq!(
            xdp::read_counters(&iface).expect("counters").redirected,
            redirected_before,
            "loopback traffic reached the wire"
        );
        // Idle: QPs connected, nothing to do. Measure the progress thread's CPU over 10 s (the
        // test binary runs other tests' engines in parallel, so not the whole process's).
        std::thread::sleep(Duration::from_millis(300));
        let (cpu0, t0) = (
            engine.progress_cpu_time().expect("thread CPU"),
            Instant::now(),
        );
        std::thread::sleep(Duration::from_secs(10));
        let used = engine.progress_cpu_time().expect("thread CPU") - cpu0;
        let wall = t0.elapsed();
        drop(buf);
        drop(engine);
        (used, wall)
    });
    let share = cpu_used.as_secs_f64() / idle_for.as_secs_f64() * 100.0;
    eprintln!(
        "idle engine ({backend:?}): {cpu_used:?} CPU over {idle_for:?} = {share:.3} % of a core"
    );
    // Reported, not a timing assertion: a progress thread that never sleeps uses ~100 %, so
    // this bound only catches that, whatever the machine's noise.
    assert!(share < 5.0, "an idle engine used {share:.2} % of a core");
}

/// Left to choose, batching through a UDP socket happens on a veth only while the veth does
/// not offload UDP segmentation, which it takes off when its peer runs native XDP: every veth
/// gets the port (`xroce_datapath::udp_gso::auto_batching`), which reads the offload in the
/// engine's namespace (`segmented_in_software`). Generic XDP on the peer leaves
/// the offload on: a batch would cross whole and the peer's program would lose it.
#[test]
fn batching_is_chosen_by_the_interfaces_driver_and_offloads() {
    use xroce_datapath::udp_gso::{auto_batching, segmented_in_software, AutoBatching};
    use xroce_datapath::xdp::XdpMode;
    if !root_or_skip() {
        return;
    }
    let pair = NetnsPair::new("xrdrv", 1500).expect("namespaces");
    let (iface0, iface1) = (pair.iface(0).to_string(), pair.iface(1).to_string());
    let choice = || {
        let iface = iface0.clone();
        pair.run_in(0, move || {
            (
                xroce_datapath::ethtool::driver_name(&iface),
                auto_batching(&iface),
                segmented_in_software(&iface),
            )
        })
    };
    let while_in_software = AutoBatching::WhileSegmentedInSoftware;
    assert_eq!(
        choice(),
        (Some("veth".to_string()), while_in_software, false)
    );
    for (mode, expected) in [(XdpMode::Generic, false), (XdpMode::Native, true)] {
        let iface = iface1.clone();
        pair.run_in(1, move || {
            let mut options = xdp::LoadOptions::new(&iface);
            options.mode = Some(mode);
            xdp::load(&options).expect("load XDP program");
        });
        assert_eq!(
            choice().1,
            while_in_software,
            "peer in {mode:?} mode: decided as it goes"
        );
        assert_eq!(choice().2, expected, "peer in {mode:?} mode");
        let iface = iface1.clone();
        pair.run_in(1, move || xdp::unload(&iface).expect("unload"));
    }
    assert!(!choice().2, "peer without XDP again");
}

/// An engine batches through a UDP socket while its veth segments batches in software, which
/// the veth does while its peer runs native XDP, and it reads that again after each
/// notification of a change of its link (the kernel sends one when the feature changes):
/// - started before the peer's program was attached, it batches once the program is there in
///   native mode (it used to decide once, at its start, and never batched);
/// - once the peer's program is attached in generic mode instead, a batch would cross whole
///   and that program would lose it, so the engine drops what waits in batches and sends
///   through AF_XDP again. An engine that kept batching resent its WRITEs for ever, and this
///   test ran into its bound.
///
/// The WRITEs to the engine behind each program complete, every byte intact.
#[test]
fn batching_follows_the_peers_program() {
    use xroce_datapath::xdp::XdpMode;
    if !root_or_skip() {
        return;
    }
    let setup = Setup::new(1500);
    // The writer starts with no program on the other end.
    let iface = setup.pair.iface(1).to_string();
    setup
        .pair
        .run_in(1, move || xdp::unload(&iface).expect("unload"));
    let (started_tx, started_rx) = mpsc::channel::<()>();
    const MSG: usize = 64 * 1024;
    const MESSAGES: usize = 64;
    const PHASES: usize = 2;
    let (to_writer, from_reader) = mpsc::channel::<Endpoint>();
    let (to_reader, from_writer) = mpsc::channel::<Endpoint>();
    let (written_tx, written_rx) = mpsc::channel::<u64>();

    let writer_iface = setup.pair.iface(0).to_string();
    let writer_ip = IpAddress::V4(setup.pair.ipv4(0).into());
    let writer = setup.pair.spawn_in(0, move || {
        let engine = Engine::start(EngineConfig {
            transmit: Transmit::Auto,
            ..EngineConfig::new(&writer_iface)
        })
        .expect("engine");
        assert!(
            engine.sends_through_udp_gso(),
            "a veth: batches while it segments in software"
        );
        started_tx.send(()).expect("started");
        let pd = engine.with_device(|d| d.alloc_pd());
        let mut buf = Buffer::new(&engine, pd, MESSAGES * MSG);
        for phase in 0..PHASES {
            buf.write(0, &pattern(10 + phase as u64, MESSAGES * MSG));
            let qp = create_qp(&engine, pd, QpType::Rc);
            to_init(&engine, &qp);
            let reader = from_reader.recv_timeout(WAIT).expect("reader's endpoint");
            let me = Endpoint {
                qpn: qp.qpn,
                psn: 0x200 + phase as u32,
                ip: writer_ip,
                va: buf.addr(0),
                rkey: buf.mr.rkey,
            };
            to_reader.send(me).expect("send endpoint");
            bring_up(&engine, &qp, writer_ip, &reader, me.psn, PathMtu::Mtu1024);
            // The offload is read again after a link notification: after the native program
            // came, the writes go on until they go in batches (or for a bounded while).
            let until = Instant::now() + Duration::from_secs(10);
            loop {
                post_writes(&engine, &qp, &buf, &reader, 0..MESSAGES, MSG);
                expect_completions(&engine, qp.send_cq, MESSAGES, "the WRITEs");
                if phase == 1 || engine.frames_sent_in_batches() > 0 || Instant::now() > until {
                    break;
                }
            }
            written_tx
                .send(engine.frames_sent_in_batches())
                .expect("written");
        }
    });
    started_rx
        .recv_timeout(WAIT)
        .expect("the writer's engine started");

    let reader_iface = setup.pair.iface(1).to_string();
    // Each phase's reader thread takes these in turn.
    let from_writer = std::sync::Mutex::new(from_writer);
    let written_rx = std::sync::Mutex::new(written_rx);
    for phase in 0..PHASES {
        // Native, then generic: the writer's veth segments in software, then offloads UDP
        // segmentation again.
        let mode = [XdpMode::Native, XdpMode::Generic][phase];
        let iface = reader_iface.clone();
        setup.pair.run_in(1, move || {
            if mode == XdpMode::Generic {
                xdp::unload(&iface).expect("unload");
            }
            let mut options = xdp::LoadOptions::new(&iface);
            options.mode = Some(mode);
            xdp::load(&options).expect("load XDP program");
        });
        let iface = reader_iface.clone();
        let ip = IpAddress::V4(setup.pair.ipv4(1).into());
        let (to_writer, from_writer, written_rx) = (to_writer.clone(), &from_writer, &written_rx);
        let reader = setup.pair.run_in(1, move || {
            let (from_writer, written_rx) = (
                from_writer.lock().expect("channel"),
                written_rx.lock().expect("channel"),
            );
            let engine = Engine::start(EngineConfig::new(&iface)).expect("engine");
            let pd = engine.with_device(|d| d.alloc_pd());
            let buf = Buffer::new(&engine, pd, MESSAGES * MSG);
            let qp = create_qp(&engine, pd, QpType::Rc);
            to_init(&engine, &qp);
            let me = Endpoint {
                qpn: qp.qpn,
                psn: 0x300 + phase as u32,
                ip,
                va: buf.addr(0),
                rkey: buf.mr.rkey,
            };
            to_writer.send(me).expect("send endpoint");
            let writer = from_writer.recv_timeout(WAIT).expect("writer's endpoint");
            bring_up(&engine, &qp, ip, &writer, me.psn, PathMtu::Mtu1024);
            let batched = written_rx
                .recv_timeout(WAIT * 2)
                .unwrap_or_else(|_| panic!("phase {phase}: the WRITEs did not complete"));
            (
                buf.read(0, MESSAGES * MSG) == pattern(10 + phase as u64, MESSAGES * MSG),
                batched,
            )
        });
        assert!(reader.0, "phase {phase}: the WRITEs' bytes differ");
        if mode == XdpMode::Native {
            assert!(
                reader.1 > 0,
                "no frame went in batches to a peer in native mode"
            );
        }
    }
    writer.join().expect("writer");
}
