//! Completion queues, completion polling and notification.

use std::sync::{Arc, Mutex};

use libc::c_int;
use xroce_core::transport::verbs::{WcFlags, WorkCompletion};
use xroce_core::transport::CqId;

use super::errno;
use crate::abi::verbs::{
    ibv_comp_channel, ibv_context, ibv_cq, ibv_wc, IBV_WC_GRH, IBV_WC_WITH_IMM,
};
use crate::destroyed_events::{covers, events_taken, wait_acknowledged, ASYNC_RECORD, COMP_RECORD};
use crate::device::state;
use crate::engines::{engine_for, inherited, EngineRef};
use crate::event_routes::{with_routes, CqRoute};
use crate::set_errno;

#[repr(C)]
pub struct XroceCq {
    pub cq: ibv_cq,
    pub engine: Arc<EngineRef>,
    pub id: CqId,
    /// Completions taken from the transport, reused between polls.
    scratch: Mutex<Vec<WorkCompletion>>,
}

/// The provider object behind an application's CQ.
///
/// # Safety
/// `cq` must be a live CQ of this provider.
pub unsafe fn cq<'a>(cq: *mut ibv_cq) -> &'a XroceCq {
    // SAFETY: `ibv_cq` is the first field of `XroceCq`.
    unsafe { &*(cq as *mut XroceCq) }
}

pub unsafe extern "C" fn create_cq(
    ctx: *mut ibv_context,
    cqe: c_int,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
) -> *mut ibv_cq {
    // SAFETY: libibverbs passes one of our contexts.
    let st = unsafe { state(ctx) };
    // SAFETY: libibverbs passes the application's channel or NULL.
    let notify = unsafe { crate::comp_channel::writer(channel) };
    if !channel.is_null() && notify.is_none() {
        xroce_datapath::stderr_line!(
            "xroce: this completion channel was not made by xroce; run the program with \
             `xroce exec -- PROGRAM` so that ibv_create_comp_channel reaches xroce"
        );
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    // The kernel refuses a vector at or beyond the context's `num_comp_vectors`.
    if cqe < 1 || !(0..crate::device::NUM_COMP_VECTORS).contains(&comp_vector) {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    let engine = match engine_for(st) {
        Ok(e) => e,
        Err(e) => {
            set_errno(e);
            return std::ptr::null_mut();
        }
    };
    // The CQ holds at least what was asked, rounded up as rdma_rxe rounds it; verbs reports
    // what it holds.
    let created = engine.engine.with_device(|d| {
        let id = d.create_cq(cqe as u32)?;
        let capacity = d.cq(id).map_or(cqe as usize, |q| q.capacity());
        Ok::<_, xroce_core::transport::VerbsError>((id, capacity))
    });
    let (id, capacity) = match created {
        Ok(created) => created,
        Err(e) => {
            set_errno(errno(&e));
            return std::ptr::null_mut();
        }
    };
    let x = Box::new(XroceCq {
        // SAFETY: all-zero is a valid `ibv_cq`; libibverbs (verbs_init_cq) fills in the
        // context, channel, user context, mutex and condition variable.
        cq: ibv_cq {
            cqe: c_int::try_from(capacity).unwrap_or(cqe),
            handle: id.0,
            ..unsafe { std::mem::zeroed() }
        },
        engine: engine.clone(),
        id,
        scratch: Mutex::new(Vec::new()),
    });
    let ptr = Box::into_raw(x);
    with_routes(|r| {
        r.cqs.insert(
            (engine.id, id),
            CqRoute::new(ptr as usize, notify, st.async_tx.clone()),
        )
    });
    ptr as *mut ibv_cq
}

pub unsafe extern "C" fn destroy_cq(c: *mut ibv_cq) -> c_int {
    // SAFETY: libibverbs passes one of our CQs.
    let x = unsafe { cq(c) };
    if inherited(&x.engine) {
        return 0; // the parent's
    }
    if let Err(e) = x.engine.engine.with_device(|d| d.destroy_cq(x.id)) {
        return errno(&e);
    }
    let taken = with_routes(|r| {
        let route = r.cqs.remove(&(x.engine.id, x.id))?;
        // SAFETY: libibverbs set the CQ's context, and its channel (or NULL), when it made it.
        let (async_fd, channel_fd) = unsafe {
            (
                (*(*c).context).async_fd,
                (*c).channel.as_ref().map(|ch| ch.fd),
            )
        };
        let comp = match (&route.channel, channel_fd) {
            (Some(tx), Some(fd)) => events_taken(fd, tx, COMP_RECORD, route.cq, route.comp_posted)?,
            _ => 0,
        };
        let async_ = events_taken(
            async_fd,
            &route.async_tx,
            ASYNC_RECORD,
            route.cq,
            route.async_posted,
        )?;
        Some((comp, async_))
    });
    if let Some((comp, async_)) = taken {
        // SAFETY: the CQ's mutex and condition variable, initialised by libibverbs; the
        // counters are the ones `ibv_ack_cq_events` and `ibv_ack_async_event` raise.
        unsafe {
            wait_acknowledged(&mut (*c).mutex, &mut (*c).cond, || {
                covers(std::ptr::read_volatile(&(*c).comp_events_completed), comp)
                    && covers(
                        std::ptr::read_volatile(&(*c).async_events_completed),
                        async_,
                    )
            })
        };
    }
    // SAFETY: the CQ is gone from the device and the routes; free the box `create_cq` made.
    drop(unsafe { Box::from_raw(c as *mut XroceCq) });
    0
}

/// `struct ibv_wc` for a transport completion.
pub fn to_ibv_wc(wc: &WorkCompletion) -> ibv_wc {
    let mut flags = 0;
    if wc.flags.contains(WcFlags::GRH) {
        flags |= IBV_WC_GRH;
    }
    if wc.flags.contains(WcFlags::WITH_IMM) {
        flags |= IBV_WC_WITH_IMM;
    }
    ibv_wc {
        wr_id: wc.wr_id,
        status: wc.status as u32,
        opcode: wc.opcode as u32,
        vendor_err: 0,
        byte_len: wc.byte_len,
        // The transport keeps the value as read big-endian off the wire; verbs wants the wire
        // bytes in memory (a __be32).
        imm_data: wc.imm.to_be(),
        qp_num: wc.qp_num,
        src_qp: wc.src_qp,
        wc_flags: flags,
        pkey_index: 0,
        slid: 0,
        sl: 0,
        dlid_path_bits: 0,
    }
}

pub unsafe extern "C" fn poll_cq(c: *mut ibv_cq, num_entries: c_int, wc: *mut ibv_wc) -> c_int {
    if num_entries < 0 || (num_entries > 0 && wc.is_null()) {
        return -libc::EINVAL;
    }
    if num_entries == 0 {
        return 0;
    }
    // SAFETY: libibverbs passes one of our CQs.
    let x = unsafe { cq(c) };
    if inherited(&x.engine) {
        return -libc::EIO;
    }
    let mut scratch = x.scratch.lock().unwrap_or_else(|p| p.into_inner());
    scratch.clear();
    match x
        .engine
        .engine
        .poll_cq(x.id, num_entries as usize, &mut scratch)
    {
        Ok(n) => {
            for (i, w) in scratch.iter().take(n).enumerate() {
                // SAFETY: the caller provides `num_entries` entries and n <= num_entries.
                unsafe { wc.add(i).write(to_ibv_wc(w)) };
            }
            n as c_int
        }
        Err(e) => -errno(&e),
    }
}

pub unsafe extern "C" fn req_notify_cq(c: *mut ibv_cq, solicited_only: c_int) -> c_int {
    // SAFETY: libibverbs passes one of our CQs.
    let x = unsafe { cq(c) };
    if inherited(&x.engine) {
        return libc::EIO;
    }
    match x.engine.engine.req_notify_cq(x.id, solicited_only != 0) {
        Ok(()) => 0,
        Err(e) => errno(&e),
    }
}

/// `ops->cq_event`: nothing to re-arm after `ibv_get_cq_event`.
pub unsafe extern "C" fn cq_event(_cq: *mut ibv_cq) {}
