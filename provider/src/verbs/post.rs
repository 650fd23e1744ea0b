//! Posting work requests.

use libc::c_int;
use xroce_core::transport::device::limits;
use xroce_core::transport::verbs::{RecvWr, SendFlags, SendOp, SendWr, SgList, Sge, UdDest};

use super::ah::ah;
use super::errno;
use super::qp::qp;
use super::srq::srq;
use crate::abi::verbs::{
    ibv_pd, ibv_qp, ibv_recv_wr, ibv_send_wr, ibv_sge, ibv_srq, IBV_QPT_UD,
    IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD, IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE,
    IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_SEND, IBV_WR_SEND_WITH_IMM,
};
use crate::engines::inherited;

/// The scatter/gather list of a work request, as the transport's WRs hold it.
///
/// # Safety
/// `list` must point at `n` SGEs when `n > 0`.
unsafe fn sges(list: *const ibv_sge, n: c_int) -> Result<SgList, c_int> {
    // More SGEs than any QP of the device takes is refused before the list is read: a count
    // like 0x7fffffff must not make this read (and reserve room for) that many.
    if n < 0 || n as u32 > limits::MAX_SGE || (n > 0 && list.is_null()) {
        return Err(libc::EINVAL);
    }
    if n == 0 {
        return Ok(SgList::new());
    }
    // SAFETY: per the contract.
    let list = unsafe { std::slice::from_raw_parts(list, n as usize) };
    let sge = |s: &ibv_sge| Sge {
        addr: s.addr,
        length: s.length,
        lkey: s.lkey,
    };
    // Every posted WR comes here; the lists that fit in place are written there directly
    // instead of through the generic collect (reserve, then a push per element).
    Ok(match list {
        [one] => SgList::from_buf_and_len([sge(one), Sge::default()], 1),
        [a, b] => SgList::from_buf([sge(a), sge(b)]),
        more => more.iter().map(sge).collect(),
    })
}

/// The transport's send WR for a verbs one, for a QP of type `qp_type` in protection domain
/// `qp_pd`.
///
/// # Safety
/// `wr` must be a valid send WR; for a UD QP its `ah` must be null or point at an `ibv_ah`
/// (of any provider: only its public header is read before it is known to be ours).
unsafe fn send_wr(wr: &ibv_send_wr, qp_type: u32, qp_pd: *mut ibv_pd) -> Result<SendWr, c_int> {
    // Immediate data is a __be32 holding the wire bytes; the transport keeps the big-endian
    // value.
    let imm = u32::from_be(wr.imm_data);
    let remote_addr = wr.wr.remote_addr;
    let op = match wr.opcode {
        IBV_WR_SEND => SendOp::Send,
        IBV_WR_SEND_WITH_IMM => SendOp::SendWithImm { imm },
        IBV_WR_RDMA_WRITE => SendOp::RdmaWrite {
            remote_addr,
            rkey: wr.rdma_rkey(),
        },
        IBV_WR_RDMA_WRITE_WITH_IMM => SendOp::RdmaWriteWithImm {
            remote_addr,
            rkey: wr.rdma_rkey(),
            imm,
        },
        IBV_WR_RDMA_READ => SendOp::RdmaRead {
            remote_addr,
            rkey: wr.rdma_rkey(),
        },
        IBV_WR_ATOMIC_CMP_AND_SWP => SendOp::CompareSwap {
            remote_addr,
            rkey: wr.wr.rkey,
            compare: wr.wr.compare_add,
            swap: wr.wr.swap,
        },
        IBV_WR_ATOMIC_FETCH_AND_ADD => SendOp::FetchAdd {
            remote_addr,
            rkey: wr.wr.rkey,
            add: wr.wr.compare_add,
        },
        _ => return Err(libc::EINVAL), // invalidate, memory windows, TSO, driver ops
    };
    let ud = if qp_type == IBV_QPT_UD {
        let handle = wr.ud_ah();
        // Verbs wants the AH in the QP's protection domain (rdma_rxe fails the request
        // otherwise). Checked before the handle is taken as an xroce AH: one of another
        // device, or of another xroce context, has another PD, and reading it as ours would
        // read past its end or look up its number in the wrong engine.
        // SAFETY: a non-null `ah` is an `ibv_ah`, whose public header holds its PD.
        if handle.is_null() || unsafe { (*handle).pd } != qp_pd {
            return Err(libc::EINVAL);
        }
        Some(UdDest {
            // SAFETY: an AH in this QP's PD, which only this device's AHs are.
            ah: unsafe { ah(handle) }.id,
            remote_qpn: wr.ud_remote_qpn(),
            remote_qkey: wr.ud_remote_qkey(),
        })
    } else {
        None
    };
    Ok(SendWr {
        wr_id: wr.wr_id,
        op,
        // SAFETY: the WR's own list.
        sg_list: unsafe { sges(wr.sg_list, wr.num_sge)? },
        flags: SendFlags(wr.send_flags & 0xf),
        ud,
    })
}

/// Counts a WR of one post call; true once the call took more than any queue holds. A queue
/// in the error state completes each WR at once (flushed) and so never fills: without the
/// bound, a chain whose last WR points back into it would keep the call going forever, where
/// a hardware provider answers ENOMEM once its queue is full.
fn chain_too_long(taken: &mut u32) -> bool {
    *taken += 1;
    *taken > limits::MAX_QP_WR.max(limits::MAX_SRQ_WR)
}

/// Reports `wr` (the head of the chain, or the first WR of it that failed) and what follows
/// it as not posted.
///
/// # Safety
/// `bad_wr` must be NULL or the caller's out-pointer.
unsafe fn refuse_from<T>(wr: *mut T, bad_wr: *mut *mut T) {
    if !bad_wr.is_null() {
        // SAFETY: per the contract.
        unsafe { *bad_wr = wr };
    }
}

pub unsafe extern "C" fn post_send(
    q: *mut ibv_qp,
    mut wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
) -> c_int {
    // SAFETY: libibverbs passes one of our QPs.
    let x = unsafe { qp(q) };
    if inherited(&x.engine) {
        // SAFETY: the caller's out-pointer.
        unsafe { refuse_from(wr, bad_wr) };
        return libc::EIO;
    }
    let mut taken = 0;
    while !wr.is_null() {
        if chain_too_long(&mut taken) {
            // SAFETY: the caller's out-pointer.
            unsafe { refuse_from(wr, bad_wr) };
            return libc::ENOMEM;
        }
        // SAFETY: the application's WR chain.
        let w = unsafe { &*wr };
        // SAFETY: as above.
        let r = unsafe { send_wr(w, x.qp.qp_type, x.qp.pd) }.and_then(|s| {
            // SAFETY: inline SGEs point at memory the application keeps valid during the call.
            unsafe { x.engine.engine.post_send_caller_inline(x.qp.qp_num, s) }
                .map_err(|e| errno(&e))
        });
        if let Err(e) = r {
            // SAFETY: the caller's out-pointer.
            unsafe { refuse_from(wr, bad_wr) };
            return e;
        }
        wr = w.next;
    }
    0
}

/// Converts and posts a receive WR chain with `post`, reporting the first failure in `bad_wr`.
///
/// # Safety
/// `wr` must be a valid chain.
unsafe fn post_recv_chain(
    mut wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
    mut post: impl FnMut(RecvWr) -> Result<(), c_int>,
) -> c_int {
    let mut taken = 0;
    while !wr.is_null() {
        if chain_too_long(&mut taken) {
            // SAFETY: the caller's out-pointer.
            unsafe { refuse_from(wr, bad_wr) };
            return libc::ENOMEM;
        }
        // SAFETY: per the contract.
        let w = unsafe { &*wr };
        // SAFETY: the WR's own list.
        let r = unsafe { sges(w.sg_list, w.num_sge) }.and_then(|sg_list| {
            post(RecvWr {
                wr_id: w.wr_id,
                sg_list,
            })
        });
        if let Err(e) = r {
            // SAFETY: the caller's out-pointer.
            unsafe { refuse_from(wr, bad_wr) };
            return e;
        }
        wr = w.next;
    }
    0
}

pub unsafe extern "C" fn post_recv(
    q: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: libibverbs passes one of our QPs.
    let x = unsafe { qp(q) };
    if inherited(&x.engine) {
        // SAFETY: the caller's out-pointer.
        unsafe { refuse_from(wr, bad_wr) };
        return libc::EIO;
    }
    if !x.qp.srq.is_null() {
        // SAFETY: the caller's chain and out-pointer.
        unsafe { refuse_from(wr, bad_wr) };
        return libc::EINVAL; // receives go to the SRQ
    }
    // SAFETY: the application's chain.
    unsafe {
        post_recv_chain(wr, bad_wr, |r| {
            x.engine
                .engine
                .post_recv(x.qp.qp_num, r)
                .map_err(|e| errno(&e))
        })
    }
}

pub unsafe extern "C" fn post_srq_recv(
    s: *mut ibv_srq,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: libibverbs passes one of our SRQs.
    let x = unsafe { srq(s) };
    if inherited(&x.engine) {
        // SAFETY: the caller's out-pointer.
        unsafe { refuse_from(wr, bad_wr) };
        return libc::EIO;
    }
    // SAFETY: the application's chain.
    unsafe {
        post_recv_chain(wr, bad_wr, |r| {
            x.engine
                .engine
                .with_device_quiet(|d| d.post_srq_recv(x.id, r))
                .map_err(|e| errno(&e))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(n: usize) -> Vec<ibv_sge> {
        (0..n as u32)
            .map(|i| ibv_sge {
                addr: 0x1000 * u64::from(i + 1),
                length: 10 + i,
                lkey: 100 + i,
            })
            .collect()
    }

    /// Lists of every length come over whole and in order, the ones held in place as well as
    /// the longer ones; a negative count or a missing list is refused.
    #[test]
    fn scatter_gather_lists_convert_whole_and_in_order() {
        for n in 0..5 {
            let raw = list(n);
            // SAFETY: `raw` holds `n` SGEs.
            let got = unsafe { sges(raw.as_ptr(), n as c_int) }.expect("valid list");
            let want: Vec<Sge> = raw
                .iter()
                .map(|s| Sge {
                    addr: s.addr,
                    length: s.length,
                    lkey: s.lkey,
                })
                .collect();
            assert_eq!(got.as_slice(), want.as_slice(), "{n} SGEs");
        }
        // SAFETY: all are refused before the pointer is read (the list holds one SGE).
        unsafe {
            assert_eq!(sges(list(1).as_ptr(), -1), Err(libc::EINVAL));
            assert_eq!(sges(std::ptr::null(), 1), Err(libc::EINVAL));
            for too_many in [limits::MAX_SGE as c_int + 1, c_int::MAX] {
                assert_eq!(sges(list(1).as_ptr(), too_many), Err(libc::EINVAL));
            }
        }
        // The device's maximum itself is a list like any other.
        let max = list(limits::MAX_SGE as usize);
        // SAFETY: `max` holds MAX_SGE SGEs.
        let got = unsafe { sges(max.as_ptr(), limits::MAX_SGE as c_int) }.expect("valid list");
        assert_eq!(got.len(), limits::MAX_SGE as usize);
    }
}
