//! Work requests, work completions, events and errors: the verbs-level vocabulary of the
//! transport. Numeric values follow `<infiniband/verbs.h>` so the provider can pass them through.

use super::address::AhId;
use super::cq::CqId;
use super::srq::SrqId;

/// One scatter/gather element: `length` bytes at `addr` in the region named by `lkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// What a send work request asks for, with the operands each operation needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    Send,
    SendWithImm {
        imm: u32,
    },
    RdmaWrite {
        remote_addr: u64,
        rkey: u32,
    },
    RdmaWriteWithImm {
        remote_addr: u64,
        rkey: u32,
        imm: u32,
    },
    RdmaRead {
        remote_addr: u64,
        rkey: u32,
    },
    CompareSwap {
        remote_addr: u64,
        rkey: u32,
        compare: u64,
        swap: u64,
    },
    FetchAdd {
        remote_addr: u64,
        rkey: u32,
        add: u64,
    },
}

impl SendOp {
    /// READ or atomic: needs a response and an initiator-depth slot.
    pub const fn is_read_or_atomic(&self) -> bool {
        matches!(
            self,
            SendOp::RdmaRead { .. } | SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. }
        )
    }
    pub const fn is_atomic(&self) -> bool {
        matches!(self, SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. })
    }
    pub const fn is_send(&self) -> bool {
        matches!(self, SendOp::Send | SendOp::SendWithImm { .. })
    }
    pub const fn is_write(&self) -> bool {
        matches!(
            self,
            SendOp::RdmaWrite { .. } | SendOp::RdmaWriteWithImm { .. }
        )
    }
    pub const fn immediate(&self) -> Option<u32> {
        match self {
            SendOp::SendWithImm { imm } | SendOp::RdmaWriteWithImm { imm, .. } => Some(*imm),
            _ => None,
        }
    }
    /// The completion opcode a successful send completion carries.
    pub const fn wc_opcode(&self) -> WcOpcode {
        match self {
            SendOp::Send | SendOp::SendWithImm { .. } => WcOpcode::Send,
            SendOp::RdmaWrite { .. } | SendOp::RdmaWriteWithImm { .. } => WcOpcode::RdmaWrite,
            SendOp::RdmaRead { .. } => WcOpcode::RdmaRead,
            SendOp::CompareSwap { .. } => WcOpcode::CompSwap,
            SendOp::FetchAdd { .. } => WcOpcode::FetchAdd,
        }
    }
}

/// `enum ibv_send_flags`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct SendFlags(pub u32);

impl SendFlags {
    pub const NONE: SendFlags = SendFlags(0);
    pub const FENCE: SendFlags = SendFlags(1 << 0);
    pub const SIGNALED: SendFlags = SendFlags(1 << 1);
    pub const SOLICITED: SendFlags = SendFlags(1 << 2);
    pub const INLINE: SendFlags = SendFlags(1 << 3);

    pub const fn contains(self, o: SendFlags) -> bool {
        self.0 & o.0 == o.0
    }
}

impl core::ops::BitOr for SendFlags {
    type Output = SendFlags;
    fn bitor(self, o: SendFlags) -> SendFlags {
        SendFlags(self.0 | o.0)
    }
}

/// Where a UD send goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdDest {
    pub ah: AhId,
    pub remote_qpn: u32,
    pub remote_qkey: u32,
}

/// A send work request (`struct ibv_send_wr`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendWr {
    pub wr_id: u64,
    pub op: SendOp,
    pub sg_list: SgList,
    pub flags: SendFlags,
    /// Required on UD QPs, ignored on RC/UC.
    pub ud: Option<UdDest>,
}

impl SendWr {
    pub fn new(wr_id: u64, op: SendOp, sg_list: impl Into<SgList>) -> Self {
        SendWr {
            wr_id,
            op,
            sg_list: sg_list.into(),
            flags: SendFlags::SIGNALED,
            ud: None,
        }
    }

    /// Total bytes named by the scatter/gather list.
    pub fn length(&self) -> u64 {
        self.sg_list.iter().map(|s| u64::from(s.length)).sum()
    }
}

/// The scatter/gather list of a work request. Almost every WR names one or two
/// buffers; holding those in place saves an allocation and a free per WR on the posting
/// path (5 % of a 64 B `ib_send_bw` sender's instructions).
pub type SgList = smallvec::SmallVec<[Sge; 2]>;

/// A receive work request (`struct ibv_recv_wr`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecvWr {
    pub wr_id: u64,
    /// Held in place up to two entries, like a send WR's: every receive posted and consumed
    /// would otherwise allocate and free.
    pub sg_list: SgList,
}

impl RecvWr {
    pub fn length(&self) -> u64 {
        self.sg_list.iter().map(|s| u64::from(s.length)).sum()
    }
}

/// `enum ibv_wc_status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum WcStatus {
    Success = 0,
    LocLenErr = 1,
    LocQpOpErr = 2,
    LocEecOpErr = 3,
    LocProtErr = 4,
    WrFlushErr = 5,
    MwBindErr = 6,
    BadRespErr = 7,
    LocAccessErr = 8,
    RemInvReqErr = 9,
    RemAccessErr = 10,
    RemOpErr = 11,
    RetryExcErr = 12,
    RnrRetryExcErr = 13,
    LocRddViolErr = 14,
    RemInvRdReqErr = 15,
    RemAbortErr = 16,
    InvEecnErr = 17,
    InvEecStateErr = 18,
    FatalErr = 19,
    RespTimeoutErr = 20,
    GeneralErr = 21,
}

/// `enum ibv_wc_opcode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum WcOpcode {
    Send = 0,
    RdmaWrite = 1,
    RdmaRead = 2,
    CompSwap = 3,
    FetchAdd = 4,
    Recv = 128,
    RecvRdmaWithImm = 129,
}

/// `enum ibv_wc_flags` bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct WcFlags(pub u32);

impl WcFlags {
    pub const GRH: WcFlags = WcFlags(1 << 0);
    pub const WITH_IMM: WcFlags = WcFlags(1 << 1);

    pub const fn contains(self, o: WcFlags) -> bool {
        self.0 & o.0 == o.0
    }
}

/// A work completion (`struct ibv_wc`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    pub wr_id: u64,
    pub status: WcStatus,
    pub opcode: WcOpcode,
    pub byte_len: u32,
    /// Immediate data, in the byte order it had on the wire (verbs passes it through).
    pub imm: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub flags: WcFlags,
    /// The receive was a solicited event (the last packet had SE set).
    pub solicited: bool,
}

/// Asynchronous events (`enum ibv_event_type`), with the object they concern.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AsyncEvent {
    /// A completion could not be stored: the CQ is full (`IBV_EVENT_CQ_ERR`).
    CqError(CqId),
    /// The QP entered the error state through a local failure (`IBV_EVENT_QP_FATAL`).
    QpFatal(u32),
    /// An SQD QP has no more outstanding work (`IBV_EVENT_SQ_DRAINED`).
    SqDrained(u32),
    /// The SRQ dropped below its armed limit (`IBV_EVENT_SRQ_LIMIT_REACHED`).
    SrqLimitReached(SrqId),
    /// A QP attached to an SRQ is in error and has no more receives in flight
    /// (`IBV_EVENT_QP_LAST_WQE_REACHED`).
    QpLastWqeReached(u32),
    /// The device cannot work any more (`IBV_EVENT_DEVICE_FATAL`): see
    /// [`Device::fail`](super::Device::fail).
    DeviceFatal,
}

/// Something the owner of a [`Device`](super::Device) must act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Event {
    /// A completion arrived on a CQ armed with `req_notify_cq` (a completion-channel event).
    CqNotify(CqId),
    Async(AsyncEvent),
}

/// Why a verb was refused. [`VerbsError::errno`] gives the errno libibverbs returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum VerbsError {
    #[error("no such {0}")]
    NoSuchObject(&'static str),
    #[error("{0} is still in use")]
    Busy(&'static str),
    #[error("invalid argument: {0}")]
    Invalid(&'static str),
    #[error("queue full: {0}")]
    QueueFull(&'static str),
    #[error("limit exceeded: {0}")]
    Limit(&'static str),
    #[error(transparent)]
    Modify(#[from] super::qp_state::ModifyError),
    #[error(transparent)]
    Register(#[from] super::memory::RegisterError),
    /// The device has failed (see [`Device::fail`](super::Device::fail)): it takes no new
    /// work (`EIO`, as libibverbs reports for a device gone from under its context).
    #[error("the device has failed")]
    DeviceFailed,
}

impl VerbsError {
    /// The positive errno value libibverbs reports for this error.
    pub fn errno(&self) -> i32 {
        const ENOENT: i32 = 2;
        const ENOMEM: i32 = 12;
        const EBUSY: i32 = 16;
        const EINVAL: i32 = 22;
        const EIO: i32 = 5;
        match self {
            VerbsError::NoSuchObject(_) => ENOENT,
            VerbsError::Busy(_) => EBUSY,
            VerbsError::Invalid(_) | VerbsError::Modify(_) | VerbsError::Register(_) => EINVAL,
            VerbsError::QueueFull(_) | VerbsError::Limit(_) => ENOMEM,
            VerbsError::DeviceFailed => EIO,
        }
    }
}
