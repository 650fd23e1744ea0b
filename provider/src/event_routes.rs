//! Where each engine's events go: the completion channels and asynchronous event pipes that
//! libibverbs reads, by engine and object (CQs, QPs, SRQs, and the contexts for device
//! events).

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use xroce_core::transport::verbs::AsyncEvent;
use xroce_core::transport::{CqId, Event, SrqId};

use crate::abi::verbs::{
    async_event_desc, IBV_EVENT_CQ_ERR, IBV_EVENT_DEVICE_FATAL, IBV_EVENT_QP_FATAL,
    IBV_EVENT_QP_LAST_WQE_REACHED, IBV_EVENT_SQ_DRAINED, IBV_EVENT_SRQ_LIMIT_REACHED,
};
use crate::device::ContextState;
use crate::engines::{lock, EngineRef};

/// Device events of `engine` reach `ctx` from now on.
pub(crate) fn attach_context(engine: &EngineRef, ctx: &ContextState) {
    with_routes(|r| {
        r.contexts
            .entry(engine.id)
            .or_default()
            .push((ctx.async_tx.clone(), ctx.fatal_posted.clone()))
    });
}

/// Device events of `engine` no longer reach `ctx` (it is being freed).
pub fn detach_context(engine: &EngineRef, ctx: &ContextState) {
    with_routes(|r| {
        if let Some(list) = r.contexts.get_mut(&engine.id) {
            list.retain(|(fd, _)| !Arc::ptr_eq(fd, &ctx.async_tx));
            if list.is_empty() {
                r.contexts.remove(&engine.id);
            }
        }
    });
}

/// Posts `IBV_EVENT_DEVICE_FATAL` (no object: element 0, as the kernel reports it) unless
/// `posted` says it already was.
pub fn post_device_fatal(fd: &OwnedFd, posted: &AtomicBool) {
    if !posted.swap(true, Ordering::SeqCst) {
        post_async(fd, 0, IBV_EVENT_DEVICE_FATAL);
    }
}

/// Where the events of one CQ go.
pub struct CqRoute {
    /// The `struct ibv_cq *` the application knows.
    pub cq: usize,
    /// Write end of its completion channel, if it has one.
    pub channel: Option<Arc<OwnedFd>>,
    pub async_tx: Arc<OwnedFd>,
    /// Records written to the channel and to the async pipe, for the destroy's wait (see
    /// `destroyed_events`).
    pub comp_posted: u32,
    pub async_posted: u32,
}

impl CqRoute {
    pub fn new(cq: usize, channel: Option<Arc<OwnedFd>>, async_tx: Arc<OwnedFd>) -> CqRoute {
        CqRoute {
            cq,
            channel,
            async_tx,
            comp_posted: 0,
            async_posted: 0,
        }
    }
}

/// Where the asynchronous events of a QP or SRQ go.
pub struct ObjectRoute {
    pub object: usize,
    pub async_tx: Arc<OwnedFd>,
    /// Records written to the async pipe (see `destroyed_events`).
    pub async_posted: u32,
}

impl ObjectRoute {
    pub fn new(object: usize, async_tx: Arc<OwnedFd>) -> ObjectRoute {
        ObjectRoute {
            object,
            async_tx,
            async_posted: 0,
        }
    }
}

/// Where the device events of one context go: its async event pipe, and whether it was told
/// the device failed.
pub type ContextRoute = (Arc<OwnedFd>, Arc<AtomicBool>);

#[derive(Default)]
pub struct Routes {
    /// The contexts using each engine, for device events.
    pub contexts: HashMap<u64, Vec<ContextRoute>>,
    pub cqs: HashMap<(u64, CqId), CqRoute>,
    pub qps: HashMap<(u64, u32), ObjectRoute>,
    pub srqs: HashMap<(u64, SrqId), ObjectRoute>,
}

impl Routes {
    /// Forgets the objects whose events go to the async pipe `async_tx` (a context being
    /// freed): nothing may be written to a pipe whose read end libibverbs is about to close,
    /// and another context may keep the engine running (a write there would raise SIGPIPE).
    /// Returns the QP numbers, SRQs and CQs it forgot (all of the context's one engine).
    pub fn forget_context_objects(
        &mut self,
        async_tx: &Arc<OwnedFd>,
    ) -> (Vec<u32>, Vec<SrqId>, Vec<CqId>) {
        let of_context = |tx: &Arc<OwnedFd>| Arc::ptr_eq(tx, async_tx);
        let qps = self.qps.extract_if(|_, o| of_context(&o.async_tx));
        let qps = qps.map(|((_, qpn), _)| qpn).collect();
        let srqs = self.srqs.extract_if(|_, o| of_context(&o.async_tx));
        let srqs = srqs.map(|((_, srq), _)| srq).collect();
        let cqs = self.cqs.extract_if(|_, c| of_context(&c.async_tx));
        let cqs = cqs.map(|((_, cq), _)| cq).collect();
        (qps, srqs, cqs)
    }
}

static ROUTES: Mutex<Option<Routes>> = Mutex::new(None);
/// The routing table itself, for [`crate::engines::guard_tables_across_fork`].
pub(crate) fn routes_table() -> &'static Mutex<Option<Routes>> {
    &ROUTES
}

/// Runs `f` on the routing table. Never call into an engine from `f`: events are routed with
/// the engine lock held, so the lock order is engine, then routes.
pub fn with_routes<R>(f: impl FnOnce(&mut Routes) -> R) -> R {
    let mut g = lock(&ROUTES);
    f(g.get_or_insert_with(Routes::default))
}

pub(crate) fn route(engine: u64, ev: Event) {
    with_routes(|r| match ev {
        Event::CqNotify(cq) => {
            if let Some(c) = r.cqs.get_mut(&(engine, cq)) {
                if let Some(ch) = &c.channel {
                    if write_all(ch, &(c.cq as u64).to_ne_bytes()) {
                        c.comp_posted = c.comp_posted.wrapping_add(1);
                    }
                }
            }
        }
        Event::Async(a) => {
            let (route, ty) = match a {
                AsyncEvent::CqError(cq) => {
                    if let Some(c) = r.cqs.get_mut(&(engine, cq)) {
                        if post_async(&c.async_tx, c.cq as u64, IBV_EVENT_CQ_ERR) {
                            c.async_posted = c.async_posted.wrapping_add(1);
                        }
                    }
                    return;
                }
                AsyncEvent::QpFatal(qpn) => (r.qps.get_mut(&(engine, qpn)), IBV_EVENT_QP_FATAL),
                AsyncEvent::SqDrained(qpn) => (r.qps.get_mut(&(engine, qpn)), IBV_EVENT_SQ_DRAINED),
                AsyncEvent::QpLastWqeReached(qpn) => {
                    (r.qps.get_mut(&(engine, qpn)), IBV_EVENT_QP_LAST_WQE_REACHED)
                }
                AsyncEvent::SrqLimitReached(srq) => {
                    (r.srqs.get_mut(&(engine, srq)), IBV_EVENT_SRQ_LIMIT_REACHED)
                }
                // Every context on the engine's netdev hears it (its port watcher may have
                // already told it, the netdev gone: see `port_events`).
                AsyncEvent::DeviceFatal => {
                    for (fd, posted) in r.contexts.get(&engine).into_iter().flatten() {
                        post_device_fatal(fd, posted);
                    }
                    return;
                }
            };
            if let Some(o) = route {
                if post_async(&o.async_tx, o.object as u64, ty) {
                    o.async_posted = o.async_posted.wrapping_add(1);
                }
            }
        }
    });
}

/// Queues one asynchronous event record for `ibv_get_async_event`.
/// True when it was queued.
pub fn post_async(fd: &OwnedFd, element: u64, event_type: u32) -> bool {
    let desc = async_event_desc {
        element,
        event_type,
        reserved: 0,
    };
    // SAFETY: `async_event_desc` is plain old data.
    let bytes = unsafe {
        std::slice::from_raw_parts(
            &desc as *const _ as *const u8,
            std::mem::size_of::<async_event_desc>(),
        )
    };
    write_all(fd, bytes)
}

/// Writes one event record. Records are far smaller than PIPE_BUF, so a write is atomic: it
/// lands whole or (pipe full: the application stopped reading events) not at all. True when
/// it landed.
fn write_all(fd: &OwnedFd, bytes: &[u8]) -> bool {
    // SAFETY: writing from a valid buffer to a descriptor we own.
    let n = unsafe { libc::write(fd.as_raw_fd(), bytes.as_ptr().cast(), bytes.len()) };
    if n < 0 {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            xroce_datapath::stderr_line!(
                "xroce: an event could not be queued ({}); the application is not reading its \
                 event channel",
                std::io::Error::last_os_error()
            )
        });
    }
    n == bytes.len() as isize
}
