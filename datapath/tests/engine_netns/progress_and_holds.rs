//! Who moves the frames: the application in its verbs or the progress thread, ACKs held for the
//! application's answer, the thread kept asleep next to a polling application and off the
//! engine lock it holds, and timers the application starts that the thread must keep.

use super::*;

/// An application that posts and never polls (unsignalled UD sends in a loop) still takes
/// the frames that come for its device: its posts look at the receive ring when nothing has
/// for `APP_ACTIVE_NS`. The peer's RC SEND to it is taken by those posts (not by its progress
/// thread, which keeps off while the application is in its verbs, and took it only after
/// about 100 ms of posting when posts never looked) and acknowledged while it goes on posting.
#[test]
fn an_application_that_only_posts_still_takes_its_frames() {
    if !root_or_skip() {
        return;
    }
    within_bounds_once_in_five(only_posting_run);
}

/// One run of [`an_application_that_only_posts_still_takes_its_frames`]: `Err` when the
/// poster's own verbs took none of the frames that came while it posted (its progress thread
/// did, which a host that preempts the poster can also cause).
fn only_posting_run() -> Result<(), String> {
    use std::sync::atomic::AtomicBool;
    // Set by side 0 once it is posting in its loop; side 1 sends only then.
    static POSTING: AtomicBool = AtomicBool::new(false);
    // Set by side 1 when its SEND's completion came; side 0 posts until then (or the limit).
    static ACKED: AtomicBool = AtomicBool::new(false);
    POSTING.store(false, Ordering::SeqCst);
    ACKED.store(false, Ordering::SeqCst);
    const POSTING_FOR: Duration = Duration::from_secs(3);
    let setup = Setup::new(1500);
    let [taken_by_posts, _] = setup.on_both_sides(|me: Side<(Endpoint, Endpoint)>| {
        let (side, ip, pd, engine) = (me.index, me.ip, me.pd, &me.engine);
        let mut buf = Buffer::new(engine, pd, 4096);
        buf.write(0, &pattern(30 + side as u64, 64));
        let rc = create_qp(engine, pd, QpType::Rc);
        let ud = create_qp(engine, pd, QpType::Ud);
        to_init(engine, &rc);
        to_init(engine, &ud);
        if side == 0 {
            engine
                .post_recv(
                    rc.qpn,
                    RecvWr {
                        wr_id: 1,
                        sg_list: vec![buf.sge(1024, 64)].into(),
                    },
                )
                .expect("post_recv");
        }
        let endpoint = |qpn, psn| Endpoint {
            qpn,
            psn,
            ip,
            va: 0,
            rkey: 0,
        };
        let (me_rc, me_ud) = (endpoint(rc.qpn, 0x900 + side as u32), endpoint(ud.qpn, 0));
        let (peer_rc, peer_ud) = me.swap((me_rc, me_ud));
        bring_up(engine, &rc, ip, &peer_rc, me_rc.psn, PathMtu::Mtu1024);
        bring_up(engine, &ud, ip, &peer_ud, 0x77, PathMtu::Mtu1024);
        me.connected.wait();
        let mut taken_by_posts = 0;
        if side == 1 {
            let t0 = Instant::now();
            while !POSTING.load(Ordering::SeqCst) {
                assert!(t0.elapsed() < WAIT, "side 0 never started posting");
                std::thread::sleep(Duration::from_millis(1));
            }
            engine
                .post_send(rc.qpn, SendWr::new(2, SendOp::Send, vec![buf.sge(0, 64)]))
                .expect("post_send");
            let wc = spin_for_one(
                engine,
                rc.send_cq,
                "the SEND's ACK from a peer that only posts",
            );
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
            ACKED.store(true, Ordering::SeqCst);
        } else {
            let ah = address_handle(engine, pd, ip, peer_ud.ip);
            let counters = engine.counters();
            // Frames taken other than by the progress thread: here, only by the posts.
            let by_verbs = || {
                counters.rx_frames.load(Ordering::SeqCst)
                    - counters.rx_frames_by_thread.load(Ordering::SeqCst)
            };
            let t0 = Instant::now();
            let mut posts = 0u64;
            let mut before = 0;
            while !ACKED.load(Ordering::SeqCst) && t0.elapsed() < POSTING_FOR {
                let mut wr = SendWr::new(posts, SendOp::Send, vec![buf.sge(0, 64)]);
                wr.ud = Some(UdDest {
                    ah,
                    remote_qpn: peer_ud.qpn,
                    remote_qkey: 0x1111_1111,
                });
                // Unsignalled: the send queue empties as each datagram goes, no CQ fills.
                wr.flags = SendFlags::NONE;
                engine.post_send(ud.qpn, wr).expect("post UD send");
                posts += 1;
                if posts == 1000 {
                    // Well inside its loop: from here on nothing but its posts looks for frames
                    // in its verbs.
                    before = by_verbs();
                    POSTING.store(true, Ordering::SeqCst);
                }
            }
            taken_by_posts = by_verbs() - before;
            eprintln!(
                "side 0: {posts} datagrams posted in {:?}, {taken_by_posts} frames taken by them",
                t0.elapsed()
            );
            assert!(posts > 1000, "side 0 stopped before side 1 sent");
            assert!(
                ACKED.load(Ordering::SeqCst),
                "the peer's SEND was not acknowledged in {POSTING_FOR:?} of posting without \
                 polling ({posts} posts)"
            );
            let wc = spin_for_one(engine, rc.recv_cq, "the peer's SEND");
            assert_eq!((wc.wr_id, wc.byte_len), (1, 64), "{wc:?}");
            assert!(
                buf.read(1024, 64) == pattern(31, 64),
                "the SEND's data differs"
            );
        }
        me.connected.wait();
        drop(buf);
        taken_by_posts
    });
    if taken_by_posts == 0 {
        return Err("the poster's progress thread, not its posts, took the peer's SEND".into());
    }
    Ok(())
}

/// Polls `cq` from this thread (the application's own progress, as a spinning verbs program
/// does) until one completion arrives.
fn spin_for_one(engine: &Engine, cq: CqId, what: &str) -> WorkCompletion {
    let deadline = Instant::now() + WAIT;
    let mut out = Vec::with_capacity(1);
    while out.is_empty() {
        engine.poll_cq(cq, 1, &mut out).expect("poll_cq");
        assert!(
            Instant::now() < deadline,
            "{what}: no completion after {WAIT:?}; counters {:?}",
            engine.with_device(|d| d.counters())
        );
    }
    assert_eq!(out[0].status, WcStatus::Success, "{what}: {:?}", out[0]);
    out[0]
}

/// A SEND ping-pong with both applications spinning on their CQs: each side's ACK for the
/// message it answers leaves in the same batch as the answer (one kick of the kernel), not in
/// a batch of its own ahead of it. Before, every round cost each side two transmit batches.
/// The last ACK still goes when the application destroys its QP right after its last poll.
#[test]
fn ping_pong_sends_each_ack_with_the_answer() {
    ping_pong_batching(SendCompletions::LastOnly);
}

/// The same ping-pong as `ib_send_lat` runs it: every send signalled, and each side spins on
/// its send CQ until the send is acknowledged before it looks for the answer. The question
/// arrives while the answering side still waits there; its ACK must wait for the answer all
/// the same (before, a poll of the send CQ sent it on its own: half the rounds cost an extra
/// batch, and a second system call on the latency path).
#[test]
fn ping_pong_waiting_on_each_send_sends_each_ack_with_the_answer() {
    ping_pong_batching(SendCompletions::EachWaited);
}

/// The same, with applications that take longer than the ACK hold between their send's
/// completion and their look for the answer, as under emulation (a QEMU guest without KVM runs
/// that stretch of perftest and the provider in tens of microseconds, not one). The question
/// is already waiting when the application looks: its ACK must still wait for the answer.
/// Before, the look that found the hold expired sent the ACK on its own first: 60 % of the
/// rounds in the benchmark's guests took two batches.
#[test]
fn ping_pong_with_slow_applications_sends_each_ack_with_the_answer() {
    ping_pong_batching(SendCompletions::EachWaitedThenThink);
}

#[derive(Clone, Copy, PartialEq)]
enum SendCompletions {
    /// Sends are unsignalled but for side 1's last.
    LastOnly,
    /// Every send is signalled and waited for right after it is posted.
    EachWaited,
    /// As `EachWaited`, and the application then spends `THINK` outside the verbs before it
    /// looks for the answer.
    EachWaitedThenThink,
}

/// Twice the ACK hold (5 µs).
const THINK: Duration = Duration::from_micros(10);

fn ping_pong_batching(mode: SendCompletions) {
    if !root_or_skip() {
        return;
    }
    within_bounds_once_in_five(|| ping_pong_batching_run(mode));
}

/// One run of [`ping_pong_batching`]: panics when messages or ACKs go missing; `Err` when
/// the transmit batches exceed their bound.
fn ping_pong_batching_run(mode: SendCompletions) -> Result<(), String> {
    let setup = Setup::alone(1500);
    const ROUNDS: usize = 2000;
    const MSG: usize = 64;
    let unanswered_acked = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let results = setup.on_both_sides(move |me: Side<Endpoint>| {
        let (side, pd, engine) = (me.index, me.pd, &me.engine);
        let buf = Buffer::new(engine, pd, 2 * ROUNDS * MSG + MSG);
        let qp = create_qp(engine, pd, QpType::Rc);
        to_init(engine, &qp);
        for i in 0..=ROUNDS {
            let wr = RecvWr {
                wr_id: i as u64,
                sg_list: vec![buf.sge(ROUNDS * MSG + i * MSG, MSG)].into(),
            };
            engine.post_recv(qp.qpn, wr).expect("post_recv");
        }
        connect_for_sends(&me, &qp, 0x900 + side as u32);
        let send = |i: usize| {
            let mut wr = SendWr::new(i as u64, SendOp::Send, vec![buf.sge(i * MSG, MSG)]);
            let signalled = match mode {
                SendCompletions::LastOnly => side == 1 && i + 1 == ROUNDS,
                SendCompletions::EachWaited | SendCompletions::EachWaitedThenThink => true,
            };
            if !signalled {
                wr.flags = xroce_core::transport::verbs::SendFlags::NONE;
            }
            engine.post_send(qp.qpn, wr).expect("post_send");
            if mode != SendCompletions::LastOnly {
                spin_for_one(engine, qp.send_cq, "the send's ACK");
            }
            if mode == SendCompletions::EachWaitedThenThink {
                let until = Instant::now() + THINK;
                while Instant::now() < until {
                    std::hint::spin_loop();
                }
            }
        };
        for i in 0..ROUNDS {
            if side == 0 {
                send(i);
                spin_for_one(engine, qp.recv_cq, "answer");
            } else {
                spin_for_one(engine, qp.recv_cq, "question");
                send(i);
            }
        }
        if mode != SendCompletions::LastOnly {
            // A message that gets no answer: side 1 takes it and keeps polling its empty
            // CQ, so the ACK held for an answer must go out on its own after a while.
            if side == 0 {
                send(ROUNDS);
                unanswered_acked.store(true, std::sync::atomic::Ordering::SeqCst);
            } else {
                spin_for_one(engine, qp.recv_cq, "the unanswered message");
                let deadline = Instant::now() + WAIT;
                let mut out = Vec::new();
                while !unanswered_acked.load(std::sync::atomic::Ordering::SeqCst) {
                    engine.poll_cq(qp.recv_cq, 1, &mut out).expect("poll_cq");
                    assert!(
                        Instant::now() < deadline,
                        "the ACK for an unanswered message was held for good"
                    );
                }
            }
        }
        if side == 0 {
            // Gone right after the last completion, as programs are: the ACK that
            // completion's poll left for later must still go out.
            engine
                .with_device(|d| d.destroy_qp(qp.qpn))
                .expect("destroy_qp");
        } else if mode == SendCompletions::LastOnly {
            expect_completions(engine, qp.send_cq, 1, "the last answer, acknowledged");
        }
        // Every verb above has returned, so none counts as inside (the progress thread keeps
        // off the engine while one is: for good, were the count wrong).
        let report = engine.state_report();
        assert!(
            report.contains("application threads in verbs 0,"),
            "side {side}: {report}"
        );
        let c = engine.counters();
        let frames = c.tx_frames.load(std::sync::atomic::Ordering::Relaxed) as usize;
        let batches = c.tx_batches.load(std::sync::atomic::Ordering::Relaxed) as usize;
        let acks = engine.with_device(|d| d.counters()).tx_responses as usize;
        (side, frames, batches, acks)
    });
    // What must hold in every run, on both sides, before the bounds that may be retried.
    for &(side, frames, _, acks) in &results {
        assert!(
            acks >= ROUNDS - 1,
            "side {side}: every message is acknowledged ({acks} ACKs for {ROUNDS})"
        );
        assert!(frames >= ROUNDS + acks, "side {side}: {frames} frames");
    }
    for (side, frames, batches, _) in results {
        // One batch per round, with some slack for rounds the progress thread took over. An
        // application that thinks outside the verbs looks gone to the progress thread, which
        // then sends what is held: in 1-25 % of the rounds here, and in CI runs on busy hosts
        // 51 % and once 79 % (3 014 and 3 571 batches). ACKs on their own cost every round
        // two batches, 4 000 in all, in every run.
        let slack = match mode {
            SendCompletions::EachWaitedThenThink => ROUNDS * 3 / 4,
            _ => ROUNDS / 4,
        };
        if batches > ROUNDS + slack {
            return Err(format!(
                "side {side}: {batches} transmit batches for {frames} frames in {ROUNDS} \
                 rounds: ACKs go out on their own"
            ));
        }
    }
    Ok(())
}

/// A WRITE ping-pong as `ib_write_lat` runs it: each side writes the round's tag into the
/// peer's buffer, spins on its send CQ until that WRITE is acknowledged, and otherwise spins
/// on its own memory, outside the verbs, until the peer's WRITE lands there. A WRITE stores
/// no completion at the responder, and one that lands while its application spins on memory
/// is taken by the progress thread; either way its ACK must wait for the answer and leave in
/// the same batch, so that the peer, polling for that ACK, also receives the answer and never
/// needs its progress thread. Before, those ACKs went out on their own: 1.5-1.8 batches per
/// round on each side, a progress thread woken for every turn, and `ib_write_lat` 40-50 µs
/// one-way on this VM's two busy cores (8-12 µs after).
#[test]
fn write_ping_pong_spinning_on_memory_sends_each_ack_with_the_answer() {
    // 0-159 frames taken by the progress threads in 2000 rounds here; 270-400 with the
    // ACK sent ahead of the answer when the wait for it ran out.
    write_ping_pong_spinning_on_memory(64, WRITE_ROUNDS / 6);
}

/// The same with WRITEs of four packets (path MTU 1024): the whole answer must go ahead of
/// the ACK, or the peer's application takes its completion and leaves for its memory before
/// the answer's last packets arrive, and its progress thread has to take them. (The wait for
/// the answer must also start when the message is whole, which
/// `ack_only_requests_count_messages_when_they_are_whole` checks; started at the first
/// packet, it made 1.2-1.35 batches per round here against 1.05-1.1.)
#[test]
fn multi_packet_write_ping_pong_sends_each_ack_with_the_answer() {
    // 12-134 frames in 2000 rounds here, and on busy CI hosts 402, 550 and once three runs
    // in a row of 510-782; 3800-4300 (two per round) with the answer's packets behind the
    // ACK. One frame per round tells the two apart. A wait for the answer that runs out too
    // early (500-1200) cannot be told from a busy host's noise by this count; the simulator's
    // `ack_only_requests_count_messages_when_they_are_whole` checks that wait without timing.
    write_ping_pong_spinning_on_memory(4096, WRITE_ROUNDS);
}

/// The rounds of one [`write_ping_pong_run`].
const WRITE_ROUNDS: usize = 2000;

/// Runs [`write_ping_pong_run`] (see [`within_bounds_once_in_five`]); `max_by_thread`
/// bounds the frames each side's progress thread may take in a run.
fn write_ping_pong_spinning_on_memory(msg: usize, max_by_thread: usize) {
    if !root_or_skip() {
        return;
    }
    within_bounds_once_in_five(|| write_ping_pong_run(msg, max_by_thread));
}

/// Runs `run` until one run keeps within its bounds (`Ok`), at most five times; panics with
/// every run's excess when none did.
///
/// For counts that follow the host's scheduling (transmit batches, frames the progress
/// threads took): on a busy host a run now and then exceeds its bound with nothing wrong,
/// while a regression shows in every run. Noise comes in bursts: this binary's other tests
/// run beside it on the host's two CPUs, and CI has had three runs in a row out of bounds
/// (once right after its build, and once in stop 80, whose trials of the multi-packet WRITE
/// ping-pong found a first run out of bounds about one time in five, with and without that
/// stop's change alike). So a run that failed is repeated after a pause that grows, for the
/// burst to pass.
fn within_bounds_once_in_five(mut run: impl FnMut() -> Result<(), String>) {
    const RUNS: u64 = 5;
    let mut failures = Vec::new();
    for attempt in 0..RUNS {
        if attempt > 0 {
            std::thread::sleep(Duration::from_secs(2 * attempt));
        }
        match run() {
            Ok(()) => return,
            Err(e) => {
                eprintln!("{e}; running again");
                failures.push(e);
            }
        }
    }
    panic!("{RUNS} runs out of bounds:\n{}", failures.join("\n"));
}

/// One run of [`write_ping_pong_spinning_on_memory`]: panics when data or ACKs go missing;
/// `Err` when the transmit batches or the frames the progress threads took exceed their
/// bounds.
fn write_ping_pong_run(msg: usize, max_by_thread: usize) -> Result<(), String> {
    let setup = Setup::alone(1500);
    const ROUNDS: usize = WRITE_ROUNDS;
    let results = setup.on_both_sides(move |me: Side<Endpoint>| {
        let (side, pd, engine) = (me.index, me.pd, &me.engine);
        // [0, msg): what this side writes; [msg, 2 msg): where the peer writes.
        let mut buf = Buffer::new(engine, pd, 2 * msg);
        let qp = create_qp(engine, pd, QpType::Rc);
        to_init(engine, &qp);
        let peer = connect_at(&me, &qp, &buf, msg, 0xa00 + side as u32, PathMtu::Mtu1024);
        // 1..=255, never the buffer's initial 0, and each round's differs from the last.
        let tag = |round: usize| (round % 255) as u8 + 1;
        let write = |buf: &mut Buffer, round: usize| {
            buf.write(0, &vec![tag(round); msg]);
            let wr = SendWr::new(
                round as u64,
                SendOp::RdmaWrite {
                    remote_addr: peer.va,
                    rkey: peer.rkey,
                },
                vec![buf.sge(0, msg)],
            );
            engine.post_send(qp.qpn, wr).expect("post_send");
            spin_for_one(engine, qp.send_cq, "the WRITE's ACK");
        };
        let wait_for_peer = |buf: &Buffer, round: usize| {
            let deadline = Instant::now() + WAIT;
            // The peer's WRITE lands in one piece; its last byte comes last, as perftest
            // assumes.
            while buf.read_volatile(2 * msg - 1) != tag(round) {
                assert!(
                    Instant::now() < deadline,
                    "side {side}: round {round}'s WRITE never landed"
                );
                std::hint::spin_loop();
            }
            for off in msg..2 * msg {
                assert_eq!(
                    buf.read_volatile(off),
                    tag(round),
                    "round {round}, byte {off}"
                );
            }
        };
        for round in 0..ROUNDS {
            if side == 0 {
                write(&mut buf, round);
                wait_for_peer(&buf, round);
            } else {
                wait_for_peer(&buf, round);
                write(&mut buf, round);
            }
        }
        // Side 1's last WRITE is acknowledged (held for an answer that never comes, its ACK
        // goes out after the hold) before side 1 gets here: after this, side 0 has sent every
        // ACK it will count.
        me.connected.wait();
        let c = engine.counters();
        let batches = c.tx_batches.load(std::sync::atomic::Ordering::Relaxed) as usize;
        let by_thread = c
            .rx_frames_by_thread
            .load(std::sync::atomic::Ordering::Relaxed) as usize;
        let acks = engine.with_device(|d| d.counters()).tx_responses as usize;
        (side, batches, by_thread, acks)
    });
    // What must hold in every run, on both sides, before the bounds that may be retried.
    for &(side, batches, by_thread, acks) in &results {
        eprintln!(
            "side {side}: {batches} transmit batches, {by_thread} frames taken by the progress \
             thread, {acks} ACKs in {ROUNDS} rounds"
        );
        assert!(
            acks >= ROUNDS,
            "side {side}: every WRITE is acknowledged ({acks} ACKs for {ROUNDS})"
        );
    }
    for (side, batches, by_thread, _) in results {
        // One batch per round (the WRITE with the ACK for the peer's), with slack for rounds
        // the progress threads took over: 2003-2149 batches in 2000 rounds here. ACKs on their
        // own cost most rounds two (1.65-2.0 per round); with the ACK's wait for the answer
        // running out before the ACK for this side's own WRITE came in (5 µs, stop 28),
        // 1.05-1.27.
        if batches > ROUNDS + ROUNDS / 5 {
            return Err(format!(
                "side {side}: {batches} transmit batches in {ROUNDS} rounds: ACKs go out on \
                 their own"
            ));
        }
        // The answer reaches the peer ahead of the ACK, so the peer's application, polling
        // for that ACK, takes the answer too: the progress threads took 0-159 frames in 2000
        // rounds at 64 B here and 12-134 at 4 KiB. 3800-4300 at 4 KiB when the answer's
        // packets came behind the ACK (the application left for its memory after the ACK, and
        // the thread took the rest); 270-400 at 64 B and 500-1200 at 4 KiB when a wait that
        // ran out sent the ACK ahead of the answer.
        if by_thread > max_by_thread {
            return Err(format!(
                "side {side}: the progress thread took {by_thread} frames in {ROUNDS} rounds: \
                 the answer arrives after the application left its verbs"
            ));
        }
    }
    Ok(())
}

/// A WRITE of 64 packets, arriving a few µs apart, for an application that waits on memory
/// outside its verbs: the progress thread takes every packet, and between two packets of the
/// message it waits awake instead of going to sleep and being woken by the next one. On this
/// VM every such wake-up cost the sender an interprocessor interrupt inside its `sendto`
/// (about 25 µs): a 64 KiB message then took 450-590 µs to leave instead of about 80, the
/// tail of `ib_write_lat` at 64 KiB. The packets come from a raw AF_XDP socket that spaces
/// them (an engine would send them back to back in one kick).
#[test]
fn the_progress_thread_takes_a_message_of_many_packets_awake() {
    if !root_or_skip() {
        return;
    }
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        eprintln!("skipped: needs two CPUs (the sender on one, the receiver on the other)");
        return;
    }
    let setup = Setup::alone(1500);
    const ROUNDS: usize = 100;
    const PACKETS: usize = 64;
    const PACKET: usize = 1024;
    const MSG: usize = PACKETS * PACKET;
    const GAP: Duration = Duration::from_micros(8);
    // The sender is not an engine: a QP number no engine uses.
    const SENDER_QPN: u32 = 0x5e0d;
    const FIRST_PSN: u32 = 0xd00;
    let tag = |round: usize| (round % 255) as u8 + 1;
    // Rounds the receiving application has checked (the sender waits for each: a spinning
    // rendezvous, so that the receiving application never enters its verbs).
    let checked = Arc::new(AtomicUsize::new(0));
    let (target_tx, target_rx) = mpsc::channel::<(u32, u64, u32)>();
    let sender_ip = setup.pair.ipv4(0);
    let receiver_ip = setup.pair.ipv4(1);
    let receiver = {
        let checked = checked.clone();
        let iface = setup.pair.iface(1).to_string();
        setup.pair.spawn_in(1, move || {
            // The receiving application on CPU 1 and the sender on CPU 0: the progress
            // thread, started from here, inherits CPU 1.
            pin_to_cpu(1);
            let engine = Engine::start(EngineConfig::new(&iface)).expect("engine");
            let pd = engine.with_device(|d| d.alloc_pd());
            let buf = Buffer::new(&engine, pd, MSG);
            let qp = create_qp(&engine, pd, QpType::Rc);
            to_init(&engine, &qp);
            let sender = Endpoint {
                qpn: SENDER_QPN,
                psn: FIRST_PSN,
                ip: IpAddress::V4(sender_ip.into()),
                va: 0,
                rkey: 0,
            };
            let own_ip = IpAddress::V4(receiver_ip.into());
            bring_up(&engine, &qp, own_ip, &sender, 0, PathMtu::Mtu1024);
            // An application that polls a CQ now and then (as `ib_write_lat` polls for its own
            // WRITE's completion) but waits for the WRITE on memory: next to a poller the
            // progress thread never spins for work in general. It polls before each message
            // is let go, never while one may be arriving: a poll after the sender was let go
            // took the first packet of the next message itself now and then (8 of 6400 in
            // one CI run).
            let mut none = Vec::with_capacity(1);
            engine.poll_cq(qp.send_cq, 1, &mut none).expect("poll_cq");
            target_tx
                .send((qp.qpn, buf.addr(0), buf.mr.rkey))
                .expect("tell the sender");
            for round in 0..ROUNDS {
                let deadline = Instant::now() + WAIT;
                while buf.read_volatile(MSG - 1) != tag(round) {
                    assert!(
                        Instant::now() < deadline,
                        "round {round}'s WRITE never landed; counters {:?}",
                        engine.with_device(|d| d.counters())
                    );
                    std::hint::spin_loop();
                }
                for off in 0..MSG {
                    assert_eq!(
                        buf.read_volatile(off),
                        tag(round),
                        "round {round}, byte {off}"
                    );
                }
                engine.poll_cq(qp.send_cq, 1, &mut none).expect("poll_cq");
                checked.store(round + 1, Ordering::SeqCst);
            }
            let c = engine.counters();
            (
                c.rx_frames_by_thread.load(Ordering::Relaxed) as usize,
                c.frame_wakeups.load(Ordering::Relaxed) as usize,
                c.mid_message_waits.load(Ordering::Relaxed) as usize,
            )
        })
    };
    let (qpn, va, rkey) = target_rx.recv_timeout(WAIT).expect("the receiving QP");
    let iface = setup.pair.iface(0).to_string();
    setup.pair.run_in(0, move || {
        pin_to_cpu(0);
        let own = xroce_datapath::netlink::interface_by_name(&iface).expect("interface");
        let peer_mac = xroce_datapath::netlink::resolve(
            own.index,
            receiver_ip.into(),
            None,
            Duration::from_secs(3),
        )
        .expect("the receiver's MAC");
        let mut sock =
            XskSocket::open_when_free(own.index, XskConfig::default(), Duration::from_secs(1))
                .expect("AF_XDP socket");
        let mut map = xdp::XsksMap::open(&iface).expect("the XDP program's socket map");
        map.set(0, sock.as_raw_fd()).expect("register the socket");
        let mut frame = vec![0u8; 2048];
        let mut psn = FIRST_PSN;
        for round in 0..ROUNDS {
            let deadline = Instant::now() + WAIT;
            while checked.load(Ordering::SeqCst) < round {
                // The receiver's ACKs arrive here; nothing waits for them.
                sock.recv(64, &mut |_| {});
                assert!(
                    Instant::now() < deadline,
                    "round {round}: the receiver left"
                );
                std::hint::spin_loop();
            }
            let payload = vec![tag(round); PACKET];
            for i in 0..PACKETS {
                let (opcode, reth) = match i {
                    0 => (
                        Opcode::RC_RDMA_WRITE_FIRST,
                        Some(RethRepr {
                            va,
                            rkey,
                            dma_len: MSG as u32,
                        }),
                    ),
                    i if i == PACKETS - 1 => (Opcode::RC_RDMA_WRITE_LAST, None),
                    _ => (Opcode::RC_RDMA_WRITE_MIDDLE, None),
                };
                let mut transport = TransportRepr::new(BthRepr {
                    ack_req: i == PACKETS - 1,
                    ..BthRepr::new(opcode, qpn, psn)
                });
                transport.reth = reth;
                let headers = FrameHeaders {
                    eth: Some(EthernetRepr {
                        src: EthernetAddress(own.mac),
                        dst: EthernetAddress(peer_mac),
                        vlan: None,
                        ethertype: EtherType::Ipv4,
                    }),
                    ip: IpRepr::V4(Ipv4Repr {
                        src: sender_ip.into(),
                        dst: receiver_ip.into(),
                        tos: 0,
                        ident: 0,
                        dont_frag: true,
                        ttl: 64,
                        protocol: 17,
                        payload_len: 0,
                    }),
                    udp: UdpRepr {
                        src_port: 0xc000,
                        dst_port: 4791,
                        payload_len: 0,
                    },
                    transport,
                };
                let len = emit_frame(&mut frame, &headers, &payload).expect("build a packet");
                while !sock.send(&frame[..len]) {
                    sock.flush().expect("kick");
                }
                sock.flush().expect("kick");
                psn = (psn + 1) & 0xff_ffff;
                let sent = Instant::now();
                while sent.elapsed() < GAP {
                    std::hint::spin_loop();
                }
            }
        }
    });
    let (by_thread, frame_wakeups, waits) = receiver.join().expect("receiving side");
    eprintln!(
        "the progress thread took {by_thread} packets, was woken by frames {frame_wakeups} \
         times and waited awake for the next packet of a message {waits} times, in {ROUNDS} \
         messages of {PACKETS} packets"
    );
    assert!(
        by_thread >= ROUNDS * PACKETS,
        "the receiving application stays out of its verbs, so its progress thread takes every \
         packet: {by_thread} of {}",
        ROUNDS * PACKETS
    );
    // About one wake-up per message: 130-139 for 100 messages here, the thread waiting awake
    // for the next packet 5900-6200 times. Asleep between packets: 5600-6200 wake-ups.
    assert!(
        frame_wakeups <= ROUNDS * PACKETS / 8,
        "the progress thread was woken {frame_wakeups} times by the packets of {ROUNDS} \
         messages: it sleeps between the packets of a message"
    );
}

/// Keeps the calling thread (and threads it starts later) on `cpu`.
fn pin_to_cpu(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes within it, and
    // sched_setaffinity reads `size_of` bytes of it for the calling thread (pid 0).
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    assert_eq!(
        rc,
        0,
        "pinning to CPU {cpu}: {}",
        std::io::Error::last_os_error()
    );
}

/// Two applications that each send a message at the same moment and wait for its ACK before
/// they look for the peer's: each receives the peer's message while it waits for its own ACK,
/// the shape of a ping-pong turn, so each holds its ACK for an answer (`Engine::poll_cq`), and
/// each holds the ACK the other waits for: only the holds' end lets them go on. After a few
/// such holds ran out in a row, holds stay short for a while; without that, every round
/// stalled for a whole answer hold (50 µs).
///
/// Each application then leaves its verbs to wait for the other outside them, with ACKs
/// still held for an answer it never posts: those waited for its progress thread, which
/// naps next to a steady poller until an alarm milliseconds out (16-30 stalls of 1-17 ms in
/// 1 000 rounds, half the run). The thread counts each such hold it finds (`held_acks_left`),
/// and each turns the polls' holds off for a spell that doubles while the application keeps
/// leaving them (`LeftHolds`).
#[test]
fn simultaneous_sends_do_not_stall_on_each_others_held_acks() {
    if !root_or_skip() {
        return;
    }
    within_bounds_once_in_five(simultaneous_sends_run);
}

/// One run of [`simultaneous_sends_do_not_stall_on_each_others_held_acks`]: panics when a
/// message or an ACK goes missing; `Err` when too many holds ran out.
fn simultaneous_sends_run() -> Result<(), String> {
    let setup = Setup::alone(1500);
    const ROUNDS: usize = 1000;
    const MSG: usize = 64;
    // Rounds each side has started: both start round i once both finished round i - 1 (a
    // spinning rendezvous; a blocking one costs a wake-up per round).
    let started = Arc::new([AtomicUsize::new(0), AtomicUsize::new(0)]);
    let results = setup.on_both_sides(move |me: Side<Endpoint>| {
        let (side, pd, engine) = (me.index, me.pd, &me.engine);
        let buf = Buffer::new(engine, pd, 2 * MSG);
        let qp = create_qp(engine, pd, QpType::Rc);
        to_init(engine, &qp);
        let recv = || {
            let wr = RecvWr {
                wr_id: 0,
                sg_list: vec![buf.sge(MSG, MSG)].into(),
            };
            engine.post_recv(qp.qpn, wr).expect("post_recv");
        };
        recv();
        connect_for_sends(&me, &qp, 0xb00 + side as u32);
        let t0 = Instant::now();
        for i in 0..ROUNDS {
            started[side].store(i + 1, Ordering::SeqCst);
            let deadline = Instant::now() + WAIT;
            while started[1 - side].load(Ordering::SeqCst) < i + 1 {
                assert!(
                    Instant::now() < deadline,
                    "side {side}: the peer left in round {i}"
                );
                std::hint::spin_loop();
            }
            let wr = SendWr::new(i as u64, SendOp::Send, vec![buf.sge(0, MSG)]);
            engine.post_send(qp.qpn, wr).expect("post_send");
            spin_for_one(engine, qp.send_cq, "the send's ACK");
            spin_for_one(engine, qp.recv_cq, "the peer's message");
            recv();
        }
        let elapsed = t0.elapsed();
        let c = engine.counters();
        let holds = c.answer_holds.load(Ordering::Relaxed) as usize;
        let ran_out = c.answer_holds_ran_out.load(Ordering::Relaxed) as usize;
        let left = c.held_acks_left.load(Ordering::Relaxed) as usize;
        (side, holds, ran_out, left, elapsed)
    });
    for (side, holds, ran_out, left, elapsed) in results {
        eprintln!(
            "side {side}: {holds} answer holds, {ran_out} ran out with no ACK, {left} left to \
             the progress thread, {ROUNDS} rounds in {elapsed:?}"
        );
        // Spells of 10 ms and more, a few in all: one such hold here in most runs, two in
        // some. (Counted the same way but not acted on, 276-804 here.) A hold
        // the application answers makes the next spell the shortest again.
        let spells = elapsed.as_millis() as usize / 10 + 1;
        if left > spells.max(4) {
            return Err(format!(
                "side {side}: {left} held ACKs left to the progress thread in {ROUNDS} rounds \
                 ({elapsed:?}): the polls kept holding ACKs for an application that leaves them"
            ));
        }
        // Three in a row, then none for 10 ms: 63-157 in 1000 rounds here, about two per
        // 10 ms, before left holds turned the holds off (a hold that gets its ACK in between
        // starts the count again); 0-3 since. Holds that never stopped ran out in 385-406 of
        // them. A slower host fits more 10 ms spells into the run.
        if ran_out > (ROUNDS / 4).max(5 * spells) {
            return Err(format!(
                "side {side}: {ran_out} answer holds ran out in {ROUNDS} rounds ({elapsed:?}): \
                 the two sides keep holding each other's ACKs"
            ));
        }
    }
    Ok(())
}

/// A one-way stream of `MESSAGES` SENDs of `SEND_MSG` bytes into an application that takes
/// each completion with a poll of its own and never answers (`ib_send_bw`'s receiver), which
/// checks that every message arrives, in order, intact, through `SEND_SLOTS` receives it posts
/// again. The sender, side 0, is `send(engine, qp, post)`, where `post(i, signalled)` writes
/// message `i` into its slot and posts it. Returns each side's engine counters at the end.
fn one_way_sends(
    psn_base: u32,
    send: fn(&Engine, &Qp, &mut dyn FnMut(usize, bool)),
) -> [[u64; 3]; 2] {
    const SEND_SLOTS: usize = 512;
    const SEND_MSG: usize = 64;
    let setup = Setup::alone(1500);
    setup.on_both_sides(move |me: Side<Endpoint>| {
        let (side, pd, engine) = (me.index, me.pd, &me.engine);
        let mut buf = Buffer::new(engine, pd, SEND_SLOTS * SEND_MSG);
        let qp = create_qp(engine, pd, QpType::Rc);
        to_init(engine, &qp);
        let post_recv = |buf: &Buffer, slot: usize| {
            let wr = RecvWr {
                wr_id: slot as u64,
                sg_list: vec![buf.sge(slot * SEND_MSG, SEND_MSG)].into(),
            };
            engine.post_recv(qp.qpn, wr).expect("post_recv");
        };
        if side == 1 {
            (0..SEND_SLOTS).for_each(|slot| post_recv(&buf, slot));
        }
        connect_for_sends(&me, &qp, psn_base + side as u32);
        if side == 0 {
            send(engine, &qp, &mut |i, signalled| {
                let slot = i % SEND_SLOTS;
                buf.write(slot * SEND_MSG, &pattern(i as u64, SEND_MSG));
                let sge = buf.sge(slot * SEND_MSG, SEND_MSG);
                let mut wr = SendWr::new(i as u64, SendOp::Send, vec![sge]);
                if !signalled {
                    wr.flags = xroce_core::transport::verbs::SendFlags::NONE;
                }
                engine.post_send(qp.qpn, wr).expect("post_send");
            });
        } else {
            for i in 0..MESSAGES {
                let wc = spin_for_one(engine, qp.recv_cq, "the next message");
                let slot = wc.wr_id as usize;
                assert_eq!(
                    slot,
                    i % SEND_SLOTS,
                    "message {i} landed in the wrong receive"
                );
                assert_eq!(wc.byte_len as usize, SEND_MSG, "message {i}: {wc:?}");
                assert!(
                    buf.read(slot * SEND_MSG, SEND_MSG) == pattern(i as u64, SEND_MSG),
                    "message {i} arrived changed"
                );
                if i + SEND_SLOTS < MESSAGES {
                    post_recv(&buf, slot);
                }
            }
        }
        let c = engine.counters();
        [
            c.ack_holds_ran_out.load(Ordering::Relaxed),
            c.tx_kicks_for_completions.load(Ordering::Relaxed),
            c.rx_frames_while_draining.load(Ordering::Relaxed),
        ]
    })
}

/// Messages of [`one_way_sends`].
const MESSAGES: usize = 20_000;

/// A stream of SENDs into an application that takes each completion and never answers
/// (`ib_send_bw`'s receiver): a hold of the ACKs for an answer runs out every time, and its
/// sender, whose send queue refills only with those ACKs, waits meanwhile. After a few holds
/// in a row ran out, the receiver sends its ACKs as soon as it receives their requests, for a
/// while. Before, every receive round held its ACK until the application had taken every
/// completion and the hold had run out: 12 897 such holds in one run of this stream. Every
/// message arrives, in order, intact.
#[test]
fn a_receiver_that_never_answers_sends_its_acks_without_holding_them() {
    if !root_or_skip() {
        return;
    }
    within_bounds_once_in_five(receiver_that_never_answers_run);
}

/// One run of [`a_receiver_that_never_answers_sends_its_acks_without_holding_them`]: panics
/// when a message goes missing or arrives changed; `Err` when too many holds ran out.
fn receiver_that_never_answers_run() -> Result<(), String> {
    let t0 = Instant::now();
    // Sends in flight at most, each signalled: a short queue makes many receive rounds, each
    // a hold before.
    let counters = one_way_sends(0xc00, |engine, qp, post| {
        const WINDOW: usize = 4;
        let mut in_flight = 0;
        for i in 0..MESSAGES {
            if in_flight == WINDOW {
                spin_for_one(engine, qp.send_cq, "a send's ACK");
                in_flight -= 1;
            }
            post(i, true);
            in_flight += 1;
        }
        for _ in 0..in_flight {
            spin_for_one(engine, qp.send_cq, "a send's ACK");
        }
    });
    let elapsed = t0.elapsed();
    let ran_out = counters[1][0] as usize;
    eprintln!("receiver: {ran_out} ACK holds ran out in {MESSAGES} messages ({elapsed:?})");
    // Three in a row, then none for 10 ms. A slower host fits more 10 ms spells into the
    // stream.
    let spells = elapsed.as_millis() as usize / 10 + 2;
    if ran_out > (MESSAGES / 40).max(3 * spells) {
        return Err(format!(
            "{ran_out} ACK holds ran out in a stream of {MESSAGES} messages ({elapsed:?}): the \
             receiver keeps holding ACKs for answers it never sends"
        ));
    }
    Ok(())
}

/// `ib_send_bw`'s pattern: a sender that signals one SEND in 100 and refills its 128-deep
/// window only with those completions, into a receiver that never answers and takes its
/// completions one poll at a time. The sender's engine kicks the frames up to each signalled
/// SEND early (its packet asks for the ACK), and the receiver's polls take the frames that
/// came while they return completions and send their ACKs (its ACKs go at once once its holds
/// have run out). Before, the signalled SEND went with the rest of its round and its ACK
/// waited until the receiver had taken every completion before it: the sender sat idle.
/// Every message arrives, in order, intact.
#[test]
fn a_sender_waiting_for_one_completion_in_many_gets_its_ack_early() {
    if !root_or_skip() {
        return;
    }
    let counters = one_way_sends(0xd00, |engine, qp, post| {
        const WINDOW: usize = 128;
        const SIGNAL_EVERY: usize = 100;
        let mut completed = 0;
        for i in 0..MESSAGES {
            if i - completed == WINDOW {
                spin_for_one(engine, qp.send_cq, "a signalled send's ACK");
                completed += SIGNAL_EVERY;
            }
            post(i, (i + 1) % SIGNAL_EVERY == 0);
        }
        while completed < MESSAGES {
            spin_for_one(engine, qp.send_cq, "a signalled send's ACK");
            completed += SIGNAL_EVERY;
        }
    });
    let (kicks, drained) = (counters[0][1], counters[1][2]);
    eprintln!(
        "sender: {kicks} early kicks; receiver: {drained} frames taken by polls that returned \
         completions ({MESSAGES} messages)"
    );
    assert!(kicks > 0, "the sender never kicked a signalled SEND early");
    assert!(
        drained > 0,
        "the receiver took no frames while it took its completions"
    );
}

/// The progress thread never blocks on the engine lock: its holder is an application inside
/// a verb, which would pay a futex wake-up on its way out (a system call, and an interrupt of
/// the other core), once per nap of the thread. In an `ib_write_bw` stream that was 34 000
/// futex calls in 4 s on the sender. Here a RoCE frame wakes the thread while the lock is
/// held; it must nap in `ppoll`, never wait in `futex` (the system call it is blocked in is
/// read from `/proc/self/task/TID/syscall`). The frame also makes the kernel resolve the
/// sender's address, and the neighbour change it reports must not keep the thread awake:
/// unread, it made every nap return at once, and the thread spun for as long as the lock was
/// held or the application polled.
#[test]
fn the_progress_thread_never_waits_for_the_engine_lock() {
    if !root_or_skip() {
        return;
    }
    let setup = Setup::new(1500);
    let iface = setup.pair.iface(0).to_string();
    let target = std::net::SocketAddr::from((setup.pair.ipv4(0), 4791));
    let pair = &setup.pair;
    let calls = pair.run_in(0, move || {
        let engine = Engine::start(EngineConfig::new(&iface)).expect("engine");
        let tid = progress_thread_id(&engine);
        let syscall = format!("/proc/self/task/{tid}/syscall");
        engine.with_device(|_| {
            // A frame for the XDP program to hand to the engine's socket (not a valid RoCE
            // packet: the engine counts it and drops it).
            pair.spawn_in(1, move || {
                let s = std::net::UdpSocket::bind(("0.0.0.0", 0)).expect("udp");
                s.send_to(b"wake up", target).expect("send");
            })
            .join()
            .expect("sender");
            let mut calls = Vec::new();
            for _ in 0..40 {
                std::thread::sleep(Duration::from_millis(5));
                let text = std::fs::read_to_string(&syscall).unwrap_or_else(|e| e.to_string());
                // "NR args..." while blocked in a system call, "running" otherwise.
                calls.push(text.split(' ').next().and_then(|n| n.parse::<i64>().ok()));
            }
            calls
        })
    });
    assert!(
        !calls.contains(&Some(libc::SYS_futex)),
        "the progress thread waited for the lock: system calls seen {calls:?}"
    );
    assert!(
        calls.contains(&Some(libc::SYS_ppoll)),
        "the progress thread was not seen napping: system calls seen {calls:?}"
    );
}

/// Applications that keep polling keep their progress threads asleep: a SEND ping-pong run
/// as `ib_send_lat` runs it. Each progress thread naps next to its polling application, its
/// naps double up to their longest, and from then on the application's polls postpone the
/// nap alarm, so the thread does not wake to check on it. With a timed nap each thread woke
/// about a thousand times a second, once per 30-60 rounds here, and each wake-up took the
/// core of a spinning application: the p99 of every ping-pong. Counted per round (so the
/// machine's speed does not matter) as naps that ran out although the application had just
/// polled: an application the scheduler takes off its core for longer than the alarm's margin
/// (other tests running beside this one) is not polling then, and a wake-up then is the thread
/// doing its job.
#[test]
fn a_ping_pong_keeps_the_progress_threads_asleep() {
    if !root_or_skip() {
        return;
    }
    let setup = Setup::new(1500);
    const ROUNDS: usize = 20_000;
    /// Rounds before counting: the naps grow to their longest meanwhile.
    const WARM_UP: usize = 1_000;
    const MSG: usize = 64;
    const RECVS: usize = 64;
    let results = setup.on_both_sides(move |me: Side<Endpoint>| {
        let (side, pd, engine) = (me.index, me.pd, &me.engine);
        let buf = Buffer::new(engine, pd, (RECVS + 1) * MSG);
        let qp = create_qp(engine, pd, QpType::Rc);
        to_init(engine, &qp);
        let post_recv = |i: usize| {
            let wr = RecvWr {
                wr_id: i as u64,
                sg_list: vec![buf.sge((1 + i) * MSG, MSG)].into(),
            };
            engine.post_recv(qp.qpn, wr).expect("post_recv");
        };
        (0..RECVS).for_each(post_recv);
        connect_for_sends(&me, &qp, 0xa00 + side as u32);
        let checks = || {
            engine
                .counters()
                .naps_out_while_polled
                .load(std::sync::atomic::Ordering::Relaxed)
        };
        // Every send signalled and waited for, then the answer: ib_send_lat's loop.
        let send = |i: usize| {
            let wr = SendWr::new(i as u64, SendOp::Send, vec![buf.sge(0, MSG)]);
            engine.post_send(qp.qpn, wr).expect("post_send");
            spin_for_one(engine, qp.send_cq, "the send's ACK");
        };
        let receive = |what: &str| {
            let wc = spin_for_one(engine, qp.recv_cq, what);
            post_recv(wc.wr_id as usize);
        };
        let mut counted_from = 0;
        for i in 0..ROUNDS {
            if i == WARM_UP {
                counted_from = checks();
            }
            if side == 0 {
                send(i);
                receive("answer");
            } else {
                receive("question");
                send(i);
            }
        }
        (side, checks() - counted_from)
    });
    let counted = (ROUNDS - WARM_UP) as u64;
    for (side, wakes) in results {
        assert!(
            wakes * 100 < counted,
            "side {side}: the progress thread woke {wakes} times in {counted} rounds to find the \
             application still polling"
        );
    }
}

/// Swaps endpoints (for SENDs only: no memory) with the other side, brings `qp` up to RTS
/// towards it, and waits for the other side to be there too.
fn connect_for_sends(me: &Side<Endpoint>, qp: &Qp, psn: u32) {
    let peer = me.swap(Endpoint {
        qpn: qp.qpn,
        psn,
        ip: me.ip,
        va: 0,
        rkey: 0,
    });
    bring_up(&me.engine, qp, me.ip, &peer, psn, PathMtu::Mtu1024);
    me.connected.wait();
}

/// The counters the provider writes at exit never wait for the engine lock: a signal handler
/// may call `exit()` while the program's thread holds it inside a verb, and waiting then would
/// hang the process for ever. Taken, the transport's counters are left out and said to be.
#[test]
fn counters_at_exit_do_not_wait_for_a_verb_in_progress() {
    if !root_or_skip() {
        return;
    }
    let setup = Setup::new(1500);
    let iface = setup.pair.iface(0).to_string();
    setup.pair.run_in(0, move || {
        let engine = Engine::start(EngineConfig::new(&iface)).expect("engine");
        // The progress thread holds the lock for a round at a time: it is waited out.
        let free = engine.stats_line_waiting_at_most(Duration::from_secs(5));
        assert!(
            free.contains(" completions=0") && !free.contains("transport_busy"),
            "{free}"
        );
        // As a verb in progress: the engine lock held by this thread.
        let busy =
            engine.with_device(|_| engine.stats_line_waiting_at_most(Duration::from_millis(50)));
        assert!(
            busy.contains("transport_busy=1") && busy.contains(" rx_frames="),
            "{busy}"
        );
    });
}

/// A SEND posted from the application's thread to an idle RC QP starts its retransmission
/// timer there, while the progress thread sleeps with no timer to wait for. When the packet
/// is lost and the application then waits outside its verbs (blocked in
/// `ibv_get_cq_event`), only the progress thread can resend it: it must learn of the timer.
/// No engine answers at the peer's address, so every resend is lost too, and the QP (with
/// `retry_cnt` 7, which never runs out) must keep resending about every 16 ms without the
/// application having polled. (Before the fix: not one resend in the whole wait.)
#[test]
fn a_lost_send_is_resent_while_the_application_waits_outside_its_verbs() {
    if !root_or_skip() {
        return;
    }
    let setup = Setup::new(1500);
    let iface = setup.pair.iface(0).to_string();
    let local = IpAddress::V4(setup.pair.ipv4(0).into());
    let peer = IpAddress::V4(setup.pair.ipv4(1).into());
    setup.pair.run_in(0, move || {
        let engine = Engine::start(EngineConfig::new(&iface)).expect("engine");
        let (buf, qp) = connected_to_nobody(&engine, local, peer);
        // The progress thread spins a little after the set-up, then sleeps for events. Wait
        // past the new interfaces' IPv6 duplicate address detection (1 s): its end is an
        // address change, which wakes the thread and would let it see the timer anyway.
        std::thread::sleep(Duration::from_secs(3));
        engine
            .post_send(qp.qpn, SendWr::new(1, SendOp::Send, vec![buf.sge(0, 64)]))
            .expect("post_send");
        // Away from the verbs for about 120 retransmission timeouts.
        std::thread::sleep(Duration::from_secs(2));
        let c = engine.with_device(|d| d.counters());
        assert!(
            c.timeouts >= 2 && c.retransmissions >= 2,
            "timeouts and resends while the application waited: {}",
            engine.stats_line()
        );
        drop(buf);
    });
}
