//! One engine per netdev per process, started on first use and stopped with its last context
//! (where its events go: `event_routes`).
//!
//! An AF_XDP queue takes one socket, so two contexts of the same device in one process share
//! the engine; a second process on the same device gets a clear error from the first verb that
//! needs the engine (xroce serves one process per device at a time).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, TryLockError, Weak};

use libc::c_int;
use xroce_datapath::afxdp::BindMode;
use xroce_datapath::engine::{
    parse_capture_max, Backend, Engine, EngineConfig, EngineError, EventSink, Transmit,
};

use crate::device::ContextState;
use crate::event_routes::{attach_context, post_device_fatal, route, Routes};

/// A running engine and the key its events are routed by.
pub struct EngineRef {
    pub id: u64,
    pub engine: Engine,
    /// The netdev it drives.
    pub netdev: String,
    /// Contexts using it (see [`EngineRef::release_context`]).
    contexts: AtomicUsize,
    finished: AtomicBool,
    stats_written: AtomicBool,
    /// The process that started it: a child forked from that one inherits the record (and
    /// the exit handler), but the rings are its parent's to use.
    pid: u32,
}

/// Environment variable naming a file to which each engine appends its counters when it
/// stops or the process exits, whichever comes first (one line: `netdev=NAME pid=PID
/// backend=af_xdp|dpdk name=value ...`), for tests and for people who want to see what a
/// program did on the wire.
pub const STATS_FILE_ENV: &str = "XROCE_STATS_FILE";

fn stats_file() -> Option<std::ffi::OsString> {
    std::env::var_os(STATS_FILE_ENV).filter(|p| !p.is_empty())
}

/// Environment variable naming a pcap file to which each engine writes every frame it sends
/// and receives (`tcpdump` on the interface does not see them: AF_XDP bypasses its taps).
/// `{netdev}` in the name is replaced by the engine's netdev, for programs that use several
/// devices (each engine needs a file of its own).
pub const CAPTURE_ENV: &str = "XROCE_PCAP";

fn capture_path(netdev: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var(CAPTURE_ENV).ok().filter(|p| !p.is_empty())?;
    Some(path.replace("{netdev}", netdev).into())
}

/// Environment variable bounding each `XROCE_PCAP` file: once it holds this much (bytes, or
/// a number with K, M or G), it is renamed to `FILE.1` and a new `FILE` begins, so a long
/// run keeps its last frames with at most twice this on disk.
pub const CAPTURE_MAX_ENV: &str = "XROCE_PCAP_MAX";

fn capture_max() -> Result<Option<u64>, EngineError> {
    match std::env::var(CAPTURE_MAX_ENV) {
        Ok(v) if !v.is_empty() => parse_capture_max(&v)
            .map(Some)
            .map_err(|e| EngineError::BadCaptureMax(format!("{CAPTURE_MAX_ENV}: {e}"))),
        _ => Ok(None),
    }
}

impl EngineRef {
    /// Whether this process started the engine (a forked child's is its parent's; see
    /// [`inherited`], which also says so on stderr). Asks the kernel only when the id the
    /// fork handlers keep differs (a child made without them keeps its parent's).
    pub fn started_by_this_process(&self) -> bool {
        if self.pid == process_id() {
            return true;
        }
        let me = std::process::id();
        PROCESS_ID.store(me, Ordering::Relaxed);
        self.pid == me
    }

    /// A context stopped using this engine. When none is left the engine stops, whatever
    /// objects the application did not destroy (perftest's ib_send_bw client leaks a CQ): as
    /// closing a kernel device's command file cleans up after the application, closing the
    /// last context ends the engine.
    ///
    /// The count and the stop's mark are taken under the engine list's lock, like
    /// `engine_for`'s look-up: a context of the same netdev opened meanwhile must neither join
    /// this engine as it stops (its verbs would succeed and nothing would ever be sent) nor
    /// start a second one while this one still holds the queue; it waits for the stop (the
    /// netdev is busy until then) and then starts afresh. The stop itself, which lets
    /// destroyed QPs answer their peers' resends for a while, runs with the list free.
    pub fn release_context(&self) {
        let mut all = lock(&ENGINES);
        if self.contexts.fetch_sub(1, Ordering::SeqCst) != 1 || !self.mark_finished() {
            return;
        }
        let busy = BusyNetdev::enter(&mut all, &self.netdev);
        drop(all);
        self.stop_and_report();
        drop(busy);
    }

    /// Stops the engine and reports its counters (once).
    fn finish(&self) {
        if self.mark_finished() {
            self.stop_and_report();
        }
    }

    /// Marks the engine stopped (no context joins it from now on); false if it already was.
    fn mark_finished(&self) -> bool {
        !self.finished.swap(true, Ordering::SeqCst)
    }

    fn stop_and_report(&self) {
        self.engine.stop();
        self.write_stats(false);
    }

    /// Appends the counters to the stats file, if one is asked for (once per engine).
    /// `at_exit`: from the exit handler, which must not wait for the engine lock (a signal
    /// handler may have called `exit()` while this process's thread held it in a verb).
    fn write_stats(&self, at_exit: bool) {
        let Some(path) = stats_file() else {
            return;
        };
        if self.stats_written.swap(true, Ordering::SeqCst) {
            return;
        }
        let line = format!(
            "netdev={} pid={} backend={} {}\n",
            self.netdev,
            std::process::id(),
            self.engine.backend(),
            if at_exit {
                // Long enough for the progress thread's round, short enough not to hold up
                // an exit that a thread of this process blocks for ever.
                self.engine
                    .stats_line_waiting_at_most(std::time::Duration::from_millis(100))
            } else {
                self.engine.stats_line()
            }
        );
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| std::io::Write::write_all(&mut f, line.as_bytes()));
        if let Err(e) = written {
            xroce_datapath::stderr_line!(
                "xroce: cannot write counters to {}: {e}",
                std::path::Path::new(&path).display()
            );
        }
    }
}

impl Drop for EngineRef {
    fn drop(&mut self) {
        self.finish();
    }
}

/// This process's engines, by netdev, and the netdevs whose engine is starting or stopping.
struct EngineList {
    engines: Vec<(String, Weak<EngineRef>)>,
    /// Netdevs whose engine a thread is starting or stopping, with the process it belongs
    /// to. That runs without the list held: a start can take seconds (the start lock alone
    /// waits up to 20 s), a stop lets destroyed QPs linger, and meanwhile other netdevs' verbs,
    /// the fork handlers and the state dump need the list. Another context of the same netdev
    /// waits until the netdev is no longer busy ([`NETDEV_SETTLED`]), so that one engine at
    /// a time holds its queue. A child forked meanwhile inherits the entry but not the thread
    /// that would clear it: the fork handler clears the child's, and a look-up drops entries of
    /// another process (should a fork have gone on without the list).
    busy: Vec<(String, u32)>,
}

static ENGINES: Mutex<EngineList> = Mutex::new(EngineList {
    engines: Vec::new(),
    busy: Vec::new(),
});
/// Signalled when a netdev stops being busy (see [`EngineList::busy`]).
static NETDEV_SETTLED: Condvar = Condvar::new();
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A netdev marked busy in the engine list (see [`EngineList::busy`]) until this is dropped.
struct BusyNetdev<'a> {
    netdev: &'a str,
}

impl<'a> BusyNetdev<'a> {
    fn enter(all: &mut EngineList, netdev: &'a str) -> BusyNetdev<'a> {
        all.busy.push((netdev.to_string(), std::process::id()));
        BusyNetdev { netdev }
    }
}

impl Drop for BusyNetdev<'_> {
    fn drop(&mut self) {
        let mut all = lock(&ENGINES);
        let me = std::process::id();
        if let Some(i) = all
            .busy
            .iter()
            .position(|(n, p)| n == self.netdev && *p == me)
        {
            all.busy.swap_remove(i);
        }
        drop(all);
        NETDEV_SETTLED.notify_all();
    }
}

/// Whether the engine that carries (or will carry) the context's frames has multi-buffer
/// sockets: the context's own engine, else one this process runs on the same netdev; `None`
/// when neither has started yet (nothing is bound, so what the sockets will get is a guess).
///
/// Waits on no lock: `ibv_query_port` is quick on an RDMA NIC, and runtimes call it often.
/// Another thread starting the engine holds the context's lock for the whole start (then the
/// queue note or the kernel answers, as before the start), and in a forked child a lock
/// another of the parent's threads held at the fork is never released.
/// An inherited context is skipped: its engine is the parent's, whose note answers for it.
pub fn running_multi_buffer(ctx: &ContextState) -> Option<bool> {
    if ctx.pid != std::process::id() {
        return None;
    }
    if let Some(e) = &*try_lock(&ctx.engine)? {
        return Some(e.engine.is_multi_buffer());
    }
    running_on(&try_lock(&ENGINES)?.engines, &ctx.netdev).map(|e| e.engine.is_multi_buffer())
}

/// The lock if it is free now (poisoned or not).
fn try_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

/// This process's engine on `netdev` among `all`, if one is running. A stopped engine stays
/// listed while objects the application never destroyed hold it; a live one on the same
/// netdev may come after it. Only this process's own: a forked child inherits its parent's
/// records, whose engine has no progress thread here and whose rings are the parent's.
fn running_on(all: &[(String, Weak<EngineRef>)], netdev: &str) -> Option<Arc<EngineRef>> {
    let me = std::process::id();
    all.iter()
        .filter(|(n, _)| n == netdev)
        .filter_map(|(_, w)| w.upgrade())
        .find(|e| e.pid == me && !e.finished.load(Ordering::SeqCst))
}

/// This process's id, kept in memory: the verbs on a device's objects compare it with their
/// engine's on every call, and `getpid` is a system call. The fork handler clears it in the
/// child.
static PROCESS_ID: AtomicU32 = AtomicU32::new(0);

fn process_id() -> u32 {
    match PROCESS_ID.load(Ordering::Relaxed) {
        0 => {
            let me = std::process::id();
            PROCESS_ID.store(me, Ordering::Relaxed);
            me
        }
        me => me,
    }
}

/// Whether `engine` is a parent's, inherited across `fork` with the objects on it. Its
/// progress thread and rings are the parent's: a verb here would write into the parent's
/// rings, or wait for good on a lock one of the parent's threads held at the fork. Such a
/// verb is refused (`EIO`), and a destroy leaves the object to the parent and returns 0 (as
/// closing an inherited context does). Said once per process.
///
/// A child made without the fork handlers (`clone`, glibc's `_Fork`) keeps its parent's id in
/// memory: a mismatch is checked against `getpid` before it is believed, so that such a
/// child's own objects work (its use of the parent's is not caught).
pub fn inherited(engine: &EngineRef) -> bool {
    if engine.started_by_this_process() {
        return false;
    }
    let me = std::process::id();
    static SAID_IN: AtomicU32 = AtomicU32::new(0);
    if SAID_IN.swap(me, Ordering::Relaxed) != me {
        xroce_datapath::stderr_line!(
            "xroce: a forked child cannot use the RDMA objects its parent created (they stay \
             the parent's; destroying them here leaves them be): open the device again in the \
             child"
        );
    }
    true
}

/// The context's engine, starting it (or joining this process's engine on the same netdev).
/// On failure prints why, once per attempt, and returns the errno for the verb.
pub fn engine_for(ctx: &ContextState) -> Result<Arc<EngineRef>, c_int> {
    engine_for_with(ctx, |mut config| {
        config.backend = Backend::from_env()?;
        config.transmit = Transmit::from_env().map_err(EngineError::UnknownTransmit)?;
        config.bind_mode = BindMode::from_env().map_err(EngineError::UnknownBindMode)?;
        config.capture_max = capture_max()?;
        Engine::start(config)
    })
}

/// [`engine_for`], starting an engine with `start` when none runs.
fn engine_for_with(
    ctx: &ContextState,
    start: impl FnOnce(EngineConfig) -> Result<Engine, EngineError>,
) -> Result<Arc<EngineRef>, c_int> {
    // A forked child's inherited context: its engine's thread and rings are the parent's (as
    // a kernel context's queues are not the child's to use after fork), and one started here
    // would never stop (closing the context in the child stops nothing: see `free_context`).
    let me = std::process::id();
    if ctx.pid != me {
        xroce_datapath::stderr_line!(
            "xroce: a forked child cannot use the device context its parent opened; open the \
             device again in the child (on another interface: one process per interface)"
        );
        return Err(libc::EIO);
    }
    let mut mine = lock(&ctx.engine);
    if let Some(e) = &*mine {
        return Ok(e.clone());
    }
    let mut all = lock(&ENGINES);
    loop {
        all.engines.retain(|(_, w)| w.strong_count() > 0);
        if let Some(e) = running_on(&all.engines, &ctx.netdev) {
            if e.engine.failure().is_none() {
                e.contexts.fetch_add(1, Ordering::SeqCst);
                attach_context(&e, ctx);
                // Failed between the look above and the attach: its IBV_EVENT_DEVICE_FATAL
                // went only to the contexts attached then. This one is told too (once), and
                // opens the device again as the others do.
                if e.engine.failure().is_some() {
                    post_device_fatal(&ctx.async_tx, &ctx.fatal_posted);
                }
                *mine = Some(e.clone());
                return Ok(e);
            }
            // The device failed (its steering program was removed, say) while older contexts
            // still hold it. After IBV_EVENT_DEVICE_FATAL an application opens the device
            // again, as on an RDMA NIC, and must get a working one once the cause is gone, not
            // the failed engine. That engine stops here: its socket and queue note go, so the
            // new engine can take the queue; the older contexts keep the failed device's
            // errors. Stopped with the list free, as in `release_context`.
            if e.mark_finished() {
                let busy = BusyNetdev::enter(&mut all, &ctx.netdev);
                drop(all);
                e.stop_and_report();
                drop(busy);
                all = lock(&ENGINES);
                continue;
            }
        }
        all.busy.retain(|(_, pid)| *pid == me);
        if !all.busy.iter().any(|(n, _)| *n == ctx.netdev) {
            break;
        }
        // Another thread starts or stops this netdev's engine: join what it started, or start
        // afresh once the old one let go of the queue.
        all = NETDEV_SETTLED.wait(all).unwrap_or_else(|p| p.into_inner());
    }
    let busy = BusyNetdev::enter(&mut all, &ctx.netdev);
    drop(all);
    // Before the start, so that a start that hangs can be seen in a dump.
    crate::state_dump::install_if_asked(write_state_reports);
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let mut config = EngineConfig::new(ctx.netdev.clone());
    config.on_event = Some(EventSink(Arc::new(move |ev| route(id, ev))));
    config.capture = capture_path(&ctx.netdev);
    config.gid_mirror = Some(ctx.ibdev_dir.clone());
    let started = start(config);
    let engine = match started {
        Ok(engine) => engine,
        Err(err) => {
            xroce_datapath::stderr_line!(
                "xroce: cannot start device {} on netdev {}: {err}",
                ctx.name,
                ctx.netdev
            );
            return Err(match err {
                EngineError::QueueInUse { .. } | EngineError::InterfaceInUse { .. } => libc::EBUSY,
                _ => libc::ENODEV,
            });
        }
    };
    let e = Arc::new(EngineRef {
        id,
        engine,
        netdev: ctx.netdev.clone(),
        contexts: AtomicUsize::new(1),
        finished: AtomicBool::new(false),
        stats_written: AtomicBool::new(false),
        pid: me,
    });
    attach_context(&e, ctx);
    // Listed before the netdev stops being busy, so that a context waiting for it joins.
    lock(&ENGINES)
        .engines
        .push((ctx.netdev.clone(), Arc::downgrade(&e)));
    drop(busy);
    // Always: the ACKs a process's last poll held are sent then (the peer would resend into a
    // dead engine until its retries ran out), and a capture's last frames are still buffered.
    flush_at_exit();
    *mine = Some(e.clone());
    Ok(e)
}

/// Every engine's [`Engine::state_report`], headed by its netdev and the process id (for
/// `XROCE_DUMP_SIGNAL`, see `state_dump`).
fn write_state_reports(out: &mut dyn std::io::Write) {
    // Bounded, although nothing holds the list for long (starts and stops run without it):
    // the report is wanted most when something is stuck.
    let until = std::time::Instant::now() + std::time::Duration::from_secs(1);
    let me = std::process::id();
    let Some(all) = lock_until(&ENGINES, until) else {
        let _ = writeln!(
            out,
            "xroce: state of pid {me}: the engine list stayed locked for 1 s; no report"
        );
        return;
    };
    let engines: Vec<Arc<EngineRef>> = all
        .engines
        .iter()
        .filter_map(|(_, w)| w.upgrade())
        .collect();
    let busy: Vec<String> = all
        .busy
        .iter()
        .filter(|(_, pid)| *pid == me)
        .map(|(netdev, _)| netdev.clone())
        .collect();
    drop(all);
    let _ = writeln!(
        out,
        "xroce: state of pid {me} ({} engine(s))",
        engines.len()
    );
    for netdev in busy {
        let _ = writeln!(
            out,
            "--- netdev {netdev}: an engine is starting or stopping"
        );
    }
    for e in engines {
        let _ = write!(
            out,
            "--- netdev {}{}\n{}",
            e.netdev,
            if e.finished.load(Ordering::SeqCst) {
                " (stopped)"
            } else {
                ""
            },
            e.engine.state_report()
        );
    }
}

/// Programs that exit without closing their device (perftest's `ib_atomic_lat` server does)
/// never stop their engine; what it has left to send is sent, its capture written out and its
/// counters are written when the process exits instead.
fn flush_at_exit() {
    static REGISTERED: std::sync::Once = std::sync::Once::new();
    extern "C" fn at_exit() {
        // try_lock: exit() may run while another thread holds the list (briefly: starts
        // and stops run without it); then its engines' counters are lost rather than the
        // exit hanging.
        let Some(all) = try_lock(&ENGINES) else {
            return;
        };
        let me = std::process::id();
        // A forked child inherits the handler and its parent's records: only the engines
        // this process started are its own.
        for e in (all.engines)
            .iter()
            .filter_map(|(_, w)| w.upgrade())
            .filter(|e| e.pid == me)
        {
            // The ACKs for the last messages received, which the last poll left for later:
            // the peer is waiting for them. A stopping engine sent its own.
            if !e.finished.load(Ordering::SeqCst) {
                e.engine.flush();
            }
            // Once per engine: a stop another thread has under way writes its full line
            // unless this exit gets there first (the exit does not wait for it).
            e.write_stats(true);
        }
    }
    REGISTERED.call_once(|| {
        // SAFETY: registers a function with no captured state; it only takes locks (never
        // waiting for an engine's for long: `flush` tries it, the counters for 100 ms), hands
        // queued frames to the kernel and writes a file, which is allowed during exit().
        if unsafe { libc::atexit(at_exit) } != 0 {
            xroce_datapath::stderr_line!(
                "xroce: cannot register the exit handler; counters may not be written"
            );
        }
    });
}

/// Makes `fork` wait until the provider's process-wide tables (the engine list, the event
/// routes, the completion channels) are free, holding them across the fork, so that the
/// child gets them unlocked. A child forked while another thread held one would otherwise
/// find it held for good, and hang in the first verb it calls on a device it opens itself
/// (which is what a child is told to do with its parent's: see [`engine_for`]). Each is held
/// only briefly (engine starts and stops run without the list); the wait is bounded all the
/// same: past it, the fork goes on without that table.
///
/// Registered once, when the process opens its first xroce device (the tables are used only
/// from then on): not when the library is loaded, which happens in every program
/// `xroce exec` runs and every RDMA program whose libibverbs finds the provider.
pub fn guard_tables_across_fork() {
    extern "C" fn prepare() {
        let until = std::time::Instant::now() + FORK_WAIT;
        let held = HeldAcrossFork {
            engines: lock_until(&ENGINES, until),
            _routes: lock_until(crate::event_routes::routes_table(), until),
            _channels: lock_until(crate::comp_channel::channel_table(), until),
        };
        HELD_ACROSS_FORK.with(|h| **h.borrow_mut() = Some(held));
    }
    extern "C" fn release() {
        let held = HELD_ACROSS_FORK.with(|h| (**h.borrow_mut()).take());
        drop(held);
    }
    extern "C" fn release_in_child() {
        PROCESS_ID.store(0, Ordering::Relaxed);
        // The threads starting or stopping engines stayed in the parent: their marks would
        // never be cleared here (look-ups also drop marks of another process, in case a
        // table could not be held).
        HELD_ACROSS_FORK.with(|h| {
            if let Some(all) = h
                .borrow_mut()
                .as_mut()
                .and_then(|held| held.engines.as_mut())
            {
                all.busy.clear();
            }
        });
        release();
    }
    static REGISTERED: std::sync::Once = std::sync::Once::new();
    let mut r = 0;
    REGISTERED.call_once(|| {
        // SAFETY: three handlers that only take and release this library's own locks, in
        // the forking thread (in the order the rest of the provider takes them: list, then
        // routes; channels are taken with nothing else held).
        r = unsafe { libc::pthread_atfork(Some(prepare), Some(release), Some(release_in_child)) };
    });
    if r != 0 {
        xroce_datapath::stderr_line!(
            "xroce: cannot register the fork handlers ({}); a child forked while another \
             thread uses one of xroce's tables may hang in its first verb",
            std::io::Error::from_raw_os_error(r)
        );
    }
}

/// How long a fork waits for a table; see [`guard_tables_across_fork`].
const FORK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The tables a forking thread holds between the fork handlers (dropping it lets them go).
struct HeldAcrossFork {
    engines: Option<MutexGuard<'static, EngineList>>,
    _routes: Option<MutexGuard<'static, Option<Routes>>>,
    _channels: Option<MutexGuard<'static, crate::comp_channel::ChannelTable>>,
}

thread_local! {
    // No drop glue (`ManuallyDrop`), so no destructor is registered for it: registering one
    // allocates and takes the C library's loader lock with the tables held, and a fork after
    // the thread's destructors ran (from an `atexit` handler) would find the slot gone. The
    // slot is empty whenever no fork is under way, so nothing is leaked.
    static HELD_ACROSS_FORK: std::cell::RefCell<std::mem::ManuallyDrop<Option<HeldAcrossFork>>> =
        const { std::cell::RefCell::new(std::mem::ManuallyDrop::new(None)) };
}

/// `m` locked, waiting for it until `until` at most.
fn lock_until<T>(m: &Mutex<T>, until: std::time::Instant) -> Option<MutexGuard<'_, T>> {
    loop {
        if let Some(g) = try_lock(m) {
            return Some(g);
        }
        if std::time::Instant::now() >= until {
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::OwnedFd;
    use std::sync::mpsc;
    use std::time::Duration;

    /// A context on netdev `netdev` opened by process `pid`, with no engine and no watcher.
    fn context(netdev: &str, pid: u32) -> ContextState {
        let null = std::fs::File::open("/dev/null").expect("open /dev/null");
        ContextState {
            name: format!("xroce_{netdev}"),
            netdev: netdev.to_string(),
            ibdev_dir: std::env::temp_dir(),
            engine: Mutex::new(None),
            async_tx: Arc::new(OwnedFd::from(null)),
            pds: Mutex::new(Vec::new()),
            fatal_posted: Arc::new(AtomicBool::new(false)),
            port_watch: None,
            pid,
        }
    }

    /// A context of this process on `netdev`, for the rest of the test run.
    fn own_context(netdev: &str) -> &'static ContextState {
        Box::leak(Box::new(context(netdev, std::process::id())))
    }

    /// `running_multi_buffer(ctx)` on another thread, while `held` stays locked here. A hang
    /// (what a forked child would do for good) fails after a bound, not a timing claim: the
    /// answer needs no lock that is held.
    fn answer_while_held<T>(ctx: &'static ContextState, held: &Mutex<T>) -> Option<bool> {
        let _guard = lock(held);
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(running_multi_buffer(ctx));
        });
        rx.recv_timeout(Duration::from_secs(20))
            .expect("running_multi_buffer waited on a lock held elsewhere")
    }

    #[test]
    fn an_inherited_context_is_answered_without_its_lock() {
        // As in a child forked while a parent thread held the context's engine lock.
        let ctx: &'static ContextState = Box::leak(Box::new(context(
            "xrtest-inherited",
            std::process::id().wrapping_add(1),
        )));
        let answer = answer_while_held(ctx, &ctx.engine);
        assert_eq!(answer, None, "a parent's engine answers through its note");
    }

    #[test]
    fn a_context_whose_engine_is_starting_is_answered_without_waiting() {
        let ctx = own_context("xrtest-starting");
        let answer = answer_while_held(ctx, &ctx.engine);
        assert_eq!(answer, None, "the note or the kernel answers meanwhile");
    }

    /// A child forked while another thread holds the routes (as a progress thread does for
    /// every event) and the engine list (as every look-up of an engine does) finds both free.
    #[test]
    fn a_forked_child_finds_the_tables_unlocked() {
        guard_tables_across_fork();
        let (held, release) = (mpsc::channel(), mpsc::channel::<()>());
        let holder = std::thread::spawn(move || {
            let _routes = lock(crate::event_routes::routes_table());
            let _list = lock(&ENGINES);
            let _ = held.0.send(());
            // Let go once the fork has begun waiting (or, without the handlers, is over).
            let _ = release.1.recv_timeout(Duration::from_secs(1));
        });
        held.1.recv().expect("the tables are held");
        // SAFETY: the child only takes the provider's locks and exits at once.
        let child = unsafe { libc::fork() };
        if child == 0 {
            crate::event_routes::with_routes(|_| ());
            drop(lock(&ENGINES));
            // SAFETY: ends the child without running the harness's exit handlers.
            unsafe { libc::_exit(0) };
        }
        assert!(child > 0, "fork: {}", std::io::Error::last_os_error());
        let _ = release.0.send(());
        holder.join().expect("holder thread");
        let (mut status, until) = (0, std::time::Instant::now() + Duration::from_secs(20));
        let ended = loop {
            // SAFETY: waiting for our own child.
            if unsafe { libc::waitpid(child, &mut status, libc::WNOHANG) } == child {
                break true;
            }
            if std::time::Instant::now() >= until {
                // SAFETY: our own child.
                unsafe {
                    libc::kill(child, libc::SIGKILL);
                    libc::waitpid(child, &mut status, 0);
                }
                break false;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        assert!(ended, "the child hung on a table held at the fork");
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
    }

    /// A start that fails as a queue in use would (`EBUSY`), without touching the network.
    fn refused(netdev: &str) -> Result<Engine, EngineError> {
        Err(EngineError::QueueInUse {
            iface: netdev.to_string(),
            queue: 0,
            holder: None,
        })
    }

    /// `engine_for_with(ctx)` on a thread of its own, whose start says when it begins and
    /// then waits for `release` before failing. Returns the thread and the "started" receiver.
    fn stuck_start(
        ctx: &'static ContextState,
        release: mpsc::Receiver<()>,
    ) -> (
        std::thread::JoinHandle<Result<Arc<EngineRef>, c_int>>,
        mpsc::Receiver<()>,
    ) {
        let (began, in_start) = mpsc::channel();
        let thread = std::thread::spawn(move || {
            engine_for_with(ctx, |config| {
                let _ = began.send(());
                let _ = release.recv_timeout(Duration::from_secs(20));
                refused(&config.iface)
            })
        });
        (thread, in_start)
    }

    /// While one netdev's engine starts (for seconds, if the start lock is held elsewhere),
    /// another netdev's device opens, the list stays free (for the fork handlers and the
    /// state dump), and the slow start still ends as it would have.
    #[test]
    fn a_slow_start_on_one_netdev_holds_up_no_other() {
        let slow = own_context("xrtest-slow");
        let other = own_context("xrtest-beside");
        let (release, released) = mpsc::channel();
        let (slow_thread, in_start) = stuck_start(slow, released);
        in_start
            .recv_timeout(Duration::from_secs(20))
            .expect("the slow start began");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(engine_for_with(other, |c| refused(&c.iface)).err());
        });
        let answer = rx.recv_timeout(Duration::from_secs(20));
        let list_free = lock_until(&ENGINES, std::time::Instant::now() + Duration::from_secs(5))
            .map(|all| all.busy.iter().any(|(n, _)| n == "xrtest-slow"));
        let _ = release.send(());
        let slow_answer = slow_thread.join().expect("slow thread");
        assert_eq!(
            answer.expect("the other netdev's open waited for the slow start"),
            Some(libc::EBUSY)
        );
        assert_eq!(
            list_free,
            Some(true),
            "the list is free and says who starts"
        );
        assert_eq!(slow_answer.err(), Some(libc::EBUSY));
        let all = lock(&ENGINES);
        assert!(!all.busy.iter().any(|(n, _)| n == "xrtest-slow"));
    }

    /// Two contexts of one netdev never start two engines at once (two sockets on one queue):
    /// the second waits for the first's start to end, then starts afresh when it failed.
    #[test]
    fn a_second_context_waits_for_its_netdevs_start() {
        let first = own_context("xrtest-shared");
        let second = own_context("xrtest-shared");
        let (release, released) = mpsc::channel();
        let (first_thread, in_start) = stuck_start(first, released);
        in_start
            .recv_timeout(Duration::from_secs(20))
            .expect("the first start began");
        let (began, second_in_start) = mpsc::channel();
        let second_thread = std::thread::spawn(move || {
            engine_for_with(second, |c| {
                let _ = began.send(());
                refused(&c.iface)
            })
        });
        // Given time to go wrong: a second start now would run beside the first.
        let overlapped = second_in_start.recv_timeout(Duration::from_secs(2)).is_ok();
        let _ = release.send(());
        assert_eq!(first_thread.join().expect("first").err(), Some(libc::EBUSY));
        assert!(
            !overlapped,
            "the second context started while the first still did"
        );
        second_in_start
            .recv_timeout(Duration::from_secs(20))
            .expect("the second context started once the first start had failed");
        assert_eq!(
            second_thread.join().expect("second").err(),
            Some(libc::EBUSY)
        );
    }

    /// A child forked while its parent started an engine inherits the busy mark, not the
    /// thread that would clear it: the child's own open does not wait for it.
    #[test]
    fn a_parents_start_does_not_hold_up_a_child() {
        let ctx = own_context("xrtest-forked");
        let parent = std::process::id().wrapping_add(1);
        lock(&ENGINES)
            .busy
            .push(("xrtest-forked".to_string(), parent));
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(engine_for_with(ctx, |c| refused(&c.iface)).err());
        });
        let answer = rx.recv_timeout(Duration::from_secs(20));
        assert_eq!(
            answer.expect("the open waited for a start of another process"),
            Some(libc::EBUSY)
        );
        let all = lock(&ENGINES);
        assert!(!all.busy.iter().any(|(n, _)| n == "xrtest-forked"));
    }

    #[test]
    fn the_engine_list_is_not_waited_on() {
        // As while another thread holds it (briefly), or in a child forked meanwhile.
        let ctx = own_context("xrtest-list");
        let answer = answer_while_held(ctx, &ENGINES);
        assert_eq!(answer, None, "no engine of this process runs on the netdev");
    }
}
