//! Queue-pair states, the attributes a `modify` carries, and which transitions are legal.
//!
//! The legality table is the IBTA one as Linux applies it to every provider
//! (`ib_modify_qp_is_ok()` in `drivers/infiniband/core/verbs.c`): for each (current, next) state
//! and QP type, the attributes that must be present and those that may be. rdma_rxe's own checks
//! (`rxe_qp_chk_attr()`) come on top: port 1 only, path MTU ≤ 4096, `max_rd_atomic` ≤ 128,
//! timeouts ≤ 31, a source GID index inside the table, and so on. Errors are values
//! ([`ModifyError`]) that the provider maps to errnos (all of them are `EINVAL` there).

/// QP states, numbered as `enum ibv_qp_state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpState {
    Reset = 0,
    Init = 1,
    Rtr = 2,
    Rts = 3,
    Sqd = 4,
    Sqe = 5,
    Error = 6,
}

impl QpState {
    pub const ALL: [QpState; 7] = [
        QpState::Reset,
        QpState::Init,
        QpState::Rtr,
        QpState::Rts,
        QpState::Sqd,
        QpState::Sqe,
        QpState::Error,
    ];

    /// From the `ibv_qp_state` value.
    pub fn from_ibv(v: u32) -> Option<QpState> {
        QpState::ALL.get(usize::try_from(v).ok()?).copied()
    }

    /// True when incoming requests are processed (responder active): RTR and later, not ERR.
    pub fn receives(self) -> bool {
        matches!(
            self,
            QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
        )
    }

    /// True when the requester may start new work: RTS only.
    pub fn sends(self) -> bool {
        self == QpState::Rts
    }
}

/// QP transport types xroce implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpType {
    Rc,
    Uc,
    Ud,
}

/// Which attributes a modify carries; bit values are those of `enum ibv_qp_attr_mask`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AttrMask(pub u32);

impl AttrMask {
    pub const STATE: AttrMask = AttrMask(1 << 0);
    pub const CUR_STATE: AttrMask = AttrMask(1 << 1);
    pub const EN_SQD_ASYNC_NOTIFY: AttrMask = AttrMask(1 << 2);
    pub const ACCESS_FLAGS: AttrMask = AttrMask(1 << 3);
    pub const PKEY_INDEX: AttrMask = AttrMask(1 << 4);
    pub const PORT: AttrMask = AttrMask(1 << 5);
    pub const QKEY: AttrMask = AttrMask(1 << 6);
    pub const AV: AttrMask = AttrMask(1 << 7);
    pub const PATH_MTU: AttrMask = AttrMask(1 << 8);
    pub const TIMEOUT: AttrMask = AttrMask(1 << 9);
    pub const RETRY_CNT: AttrMask = AttrMask(1 << 10);
    pub const RNR_RETRY: AttrMask = AttrMask(1 << 11);
    pub const RQ_PSN: AttrMask = AttrMask(1 << 12);
    pub const MAX_QP_RD_ATOMIC: AttrMask = AttrMask(1 << 13);
    pub const ALT_PATH: AttrMask = AttrMask(1 << 14);
    pub const MIN_RNR_TIMER: AttrMask = AttrMask(1 << 15);
    pub const SQ_PSN: AttrMask = AttrMask(1 << 16);
    pub const MAX_DEST_RD_ATOMIC: AttrMask = AttrMask(1 << 17);
    pub const PATH_MIG_STATE: AttrMask = AttrMask(1 << 18);
    pub const CAP: AttrMask = AttrMask(1 << 19);
    pub const DEST_QPN: AttrMask = AttrMask(1 << 20);

    pub const NONE: AttrMask = AttrMask(0);

    pub const fn or(self, o: AttrMask) -> AttrMask {
        AttrMask(self.0 | o.0)
    }
    pub const fn contains(self, o: AttrMask) -> bool {
        self.0 & o.0 == o.0
    }
    pub const fn intersects(self, o: AttrMask) -> bool {
        self.0 & o.0 != 0
    }
    pub const fn without(self, o: AttrMask) -> AttrMask {
        AttrMask(self.0 & !o.0)
    }
}

impl core::ops::BitOr for AttrMask {
    type Output = AttrMask;
    fn bitor(self, o: AttrMask) -> AttrMask {
        self.or(o)
    }
}

/// Required and optional attributes of one legal transition for one QP type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransitionRule {
    pub required: AttrMask,
    pub optional: AttrMask,
}

/// The IBTA transition table: `None` when `cur → next` is not a legal transition.
pub fn transition_rule(cur: QpState, next: QpState, ty: QpType) -> Option<TransitionRule> {
    use AttrMask as M;
    use QpState::*;
    use QpType::*;
    let rule = |required, optional| Some(TransitionRule { required, optional });
    let none = M::NONE;
    match (cur, next) {
        // Any state may be reset or moved to ERR (RESET → ERR too, as in Linux's
        // `qp_state_table`: teardown code moves every QP to ERR whatever its state).
        (_, Reset) => rule(none, none),
        (_, Error) => rule(none, none),
        (Reset, Init) => match ty {
            Ud => rule(M::PKEY_INDEX | M::PORT | M::QKEY, none),
            Uc | Rc => rule(M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS, none),
        },
        (Init, Init) => match ty {
            Ud => rule(none, M::PKEY_INDEX | M::PORT | M::QKEY),
            Uc | Rc => rule(none, M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS),
        },
        (Init, Rtr) => match ty {
            Ud => rule(none, M::PKEY_INDEX | M::QKEY),
            Uc => rule(
                M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN,
                M::ALT_PATH | M::ACCESS_FLAGS | M::PKEY_INDEX,
            ),
            Rc => rule(
                M::AV
                    | M::PATH_MTU
                    | M::DEST_QPN
                    | M::RQ_PSN
                    | M::MAX_DEST_RD_ATOMIC
                    | M::MIN_RNR_TIMER,
                M::ALT_PATH | M::ACCESS_FLAGS | M::PKEY_INDEX,
            ),
        },
        (Rtr, Rts) => match ty {
            Ud => rule(M::SQ_PSN, M::CUR_STATE | M::QKEY),
            Uc => rule(
                M::SQ_PSN,
                M::CUR_STATE | M::ALT_PATH | M::ACCESS_FLAGS | M::PATH_MIG_STATE,
            ),
            Rc => rule(
                M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::SQ_PSN | M::MAX_QP_RD_ATOMIC,
                M::CUR_STATE | M::ALT_PATH | M::ACCESS_FLAGS | M::MIN_RNR_TIMER | M::PATH_MIG_STATE,
            ),
        },
        (Rts, Rts) | (Sqd, Rts) => match ty {
            Ud => rule(none, M::CUR_STATE | M::QKEY),
            Uc => rule(
                none,
                M::CUR_STATE | M::ACCESS_FLAGS | M::ALT_PATH | M::PATH_MIG_STATE,
            ),
            Rc => rule(
                none,
                M::CUR_STATE | M::ACCESS_FLAGS | M::ALT_PATH | M::PATH_MIG_STATE | M::MIN_RNR_TIMER,
            ),
        },
        (Rts, Sqd) => rule(none, M::EN_SQD_ASYNC_NOTIFY),
        (Sqd, Sqd) => match ty {
            Ud => rule(none, M::PKEY_INDEX | M::QKEY),
            Uc => rule(
                none,
                M::AV | M::ALT_PATH | M::ACCESS_FLAGS | M::PKEY_INDEX | M::PATH_MIG_STATE,
            ),
            Rc => rule(
                none,
                M::PORT
                    | M::AV
                    | M::TIMEOUT
                    | M::RETRY_CNT
                    | M::RNR_RETRY
                    | M::MAX_QP_RD_ATOMIC
                    | M::MAX_DEST_RD_ATOMIC
                    | M::ALT_PATH
                    | M::ACCESS_FLAGS
                    | M::PKEY_INDEX
                    | M::MIN_RNR_TIMER
                    | M::PATH_MIG_STATE,
            ),
        },
        (Sqe, Rts) => match ty {
            Ud => rule(none, M::CUR_STATE | M::QKEY),
            Uc => rule(none, M::CUR_STATE | M::ACCESS_FLAGS),
            // The kernel table has no RC entry: SQE is not an RC state.
            Rc => None,
        },
        _ => None,
    }
}

/// Why a modify was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ModifyError {
    #[error("illegal QP state transition {from:?} -> {to:?} for {ty:?}")]
    IllegalTransition {
        from: QpState,
        to: QpState,
        ty: QpType,
    },
    #[error("attribute mask {missing:#x} is required for {from:?} -> {to:?}")]
    MissingAttributes {
        from: QpState,
        to: QpState,
        missing: u32,
    },
    #[error("attribute mask {extra:#x} is not allowed for {from:?} -> {to:?}")]
    UnexpectedAttributes {
        from: QpState,
        to: QpState,
        extra: u32,
    },
    #[error("current state given as {given:?}, but the QP is {actual:?}")]
    CurrentStateMismatch { given: QpState, actual: QpState },
    #[error("invalid attribute: {0}")]
    InvalidAttribute(&'static str),
}

/// Checks a modify against the transition table (the `ib_modify_qp_is_ok()` rules).
/// `next` is the target state (the current one when the mask has no STATE bit).
pub fn check_transition(
    cur: QpState,
    next: QpState,
    ty: QpType,
    mask: AttrMask,
) -> Result<(), ModifyError> {
    if mask.contains(AttrMask::CUR_STATE)
        && !matches!(
            cur,
            QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
        )
    {
        return Err(ModifyError::UnexpectedAttributes {
            from: cur,
            to: next,
            extra: AttrMask::CUR_STATE.0,
        });
    }
    let rule = transition_rule(cur, next, ty).ok_or(ModifyError::IllegalTransition {
        from: cur,
        to: next,
        ty,
    })?;
    let missing = rule.required.without(mask);
    if missing != AttrMask::NONE {
        return Err(ModifyError::MissingAttributes {
            from: cur,
            to: next,
            missing: missing.0,
        });
    }
    let extra = mask.without(rule.required | rule.optional | AttrMask::STATE);
    if extra != AttrMask::NONE {
        return Err(ModifyError::UnexpectedAttributes {
            from: cur,
            to: next,
            extra: extra.0,
        });
    }
    Ok(())
}

/// Path MTU values, numbered as `enum ibv_mtu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PathMtu {
    Mtu256 = 1,
    Mtu512 = 2,
    Mtu1024 = 3,
    Mtu2048 = 4,
    Mtu4096 = 5,
}

impl PathMtu {
    pub fn from_ibv(v: u32) -> Option<PathMtu> {
        Some(match v {
            1 => PathMtu::Mtu256,
            2 => PathMtu::Mtu512,
            3 => PathMtu::Mtu1024,
            4 => PathMtu::Mtu2048,
            5 => PathMtu::Mtu4096,
            _ => return None,
        })
    }

    pub fn bytes(self) -> usize {
        128 << (self as u32)
    }

    /// The active MTU rdma_rxe derives from a netdev MTU: MTU − 80 bytes of headers, rounded
    /// down to a power of two between 256 and 4096 (1500 → 1024, 9000 → 4096).
    pub fn for_netdev_mtu(netdev_mtu: usize) -> PathMtu {
        const HEADROOM: usize = 80;
        let room = netdev_mtu.saturating_sub(HEADROOM);
        [
            PathMtu::Mtu4096,
            PathMtu::Mtu2048,
            PathMtu::Mtu1024,
            PathMtu::Mtu512,
        ]
        .into_iter()
        .find(|m| m.bytes() <= room)
        .unwrap_or(PathMtu::Mtu256)
    }
}

/// Limits rdma_rxe enforces on modify (`rxe_qp_chk_attr()`, `rxe_param.h`).
pub const MAX_QP_RD_ATOM: u8 = 128;
pub const MAX_TIMEOUT: u8 = 31;

/// The retransmission timeout an RC QP's `timeout` attribute selects: 4.096 µs × 2^timeout,
/// in nanoseconds; `None` for 0, which disables retransmission (as in rdma_rxe).
pub fn retransmit_timeout_ns(timeout: u8) -> Option<u64> {
    (timeout != 0).then(|| 4096u64 << timeout.min(MAX_TIMEOUT))
}

/// How long an RC QP with packets outstanding goes without sending or hearing anything before
/// it sends its newest packet once more, asking for an ACK: a tail-loss probe. When the last
/// packets of a burst are lost, nothing behind them draws a sequence NAK, and without the
/// probe only the retransmission timer recovers them: 67 ms at `timeout` 14 (perftest's and
/// the rdma-core examples' setting), a second at 18. The probe's answer says what happened:
/// a duplicate is re-ACKed with everything the responder holds (only the ACK was lost, or it
/// is late), a packet beyond the expected PSN draws the sequence NAK that starts go-back-N, and
/// the lost packet itself is taken in order. Neither peer needs to know of probes (rdma_rxe
/// answers them as any resent packet); RDMA NICs likewise resend sooner than `timeout` says
/// (NVIDIA's adaptive retransmission).
///
/// 4 ms is the delay before a QP has timed any ACK (then it follows the ACKs, see
/// `round_trip`, from 1 ms to [`probe_ceiling_ns`]): far above a round trip between
/// namespaces (10-30 µs), about right between TCG guests (0.4 ms, with pauses of
/// milliseconds), and above the ACKs a responder holds for its application's answer (50 µs).
/// A probe for nothing costs one packet and one ACK.
pub const TAIL_PROBE_NS: u64 = 4_000_000;

/// Whether a QP with this `timeout` attribute probes, and its first probe's delay before it
/// has timed any ACK: [`TAIL_PROBE_NS`] where the retransmission timer is at least four times
/// as long (`timeout` 12 and above), else `None` (the timer itself is soon enough, or off).
/// Once ACKs are timed the delay follows them (see `round_trip` and [`probe_delay_ns`]).
pub fn tail_probe_ns(timeout: u8) -> Option<u64> {
    retransmit_timeout_ns(timeout)
        .filter(|&t| t >= 4 * TAIL_PROBE_NS)
        .map(|_| TAIL_PROBE_NS)
}

/// The longest a tail-loss probe waits: a quarter of the retransmission timeout (16.8 ms at
/// `timeout` 14), so that a probe comes before the timer. The measured delay (see
/// `round_trip`) goes up to it, and each further probe of a stall doubles the delay up to it
/// ([`probe_delay_ns`]). [`TAIL_PROBE_NS`] where the QP has no timer.
pub fn probe_ceiling_ns(timeout: u8) -> u64 {
    retransmit_timeout_ns(timeout).map_or(TAIL_PROBE_NS, |t| t / 4)
}

/// The delay before the next tail-loss probe when `probes` went already since a packet was
/// last timed to its ACK and the first waits `first` (see `round_trip`): doubled for each of
/// them, up to [`probe_ceiling_ns`], where it stays; `None` where [`tail_probe_ns`] is. A
/// probe can be lost as the packets it asks about were; with one probe per stall, that loss
/// cost the whole retransmission timeout (67 ms at `timeout` 14). At `timeout` 14 probes that
/// start at 4 ms go after 4, 8, 16, 16.8 and 16.8 ms of silence, then the timer fires (a probe
/// does not restart it: only a response does); from the measured floor of 1 ms, seven probes
/// (14 packets) go before the timer. A path whose first delay is the ceiling still gets a
/// probe every 16.8 ms until the timer: stopping the doubling there, rather than the probes,
/// keeps a lost probe, and the stalls after it, from falling to the timer.
pub fn probe_delay_ns(timeout: u8, probes: u32, first: u64) -> Option<u64> {
    tail_probe_ns(timeout)?;
    let most = probe_ceiling_ns(timeout);
    // `first << probes`, compared with the ceiling without the shift overflowing.
    Some(if probes < u64::BITS && first <= most >> probes {
        first << probes
    } else {
        most
    })
}

/// rdma_rxe's RNR NAK timer table (`rnrnak_usec[]`), in microseconds, indexed by the 5-bit code.
/// Entry 25 reproduces rdma_rxe's 61410 (IBTA says 61440) so both ends wait alike.
pub const RNR_TIMER_US: [u32; 32] = [
    655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840,
    5120, 7680, 10240, 15360, 20480, 30720, 40960, 61410, 81920, 122_880, 163_840, 245_760,
    327_680, 491_520,
];

/// The initiator depth / responder resources rdma_rxe actually uses: rounded up to a power of
/// two (3 → 4); 0 stays 0.
pub fn rd_atomic_slots(requested: u8) -> u32 {
    match requested {
        0 => 0,
        n => u32::from(n).next_power_of_two(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use AttrMask as M;
    use QpState::*;

    const RC_RTR: AttrMask = AttrMask(
        M::AV.0
            | M::PATH_MTU.0
            | M::DEST_QPN.0
            | M::RQ_PSN.0
            | M::MAX_DEST_RD_ATOMIC.0
            | M::MIN_RNR_TIMER.0,
    );

    /// What `ibv_rc_pingpong` sends, step by step, is accepted.
    #[test]
    fn rc_pingpong_sequence_is_legal() {
        let s = M::STATE;
        check_transition(
            Reset,
            Init,
            QpType::Rc,
            s | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS,
        )
        .unwrap();
        check_transition(Init, Rtr, QpType::Rc, s | RC_RTR).unwrap();
        let rts = M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::SQ_PSN | M::MAX_QP_RD_ATOMIC;
        check_transition(Rtr, Rts, QpType::Rc, s | rts).unwrap();
    }

    #[test]
    fn ud_and_uc_sequences_are_legal() {
        let s = M::STATE;
        check_transition(
            Reset,
            Init,
            QpType::Ud,
            s | M::PKEY_INDEX | M::PORT | M::QKEY,
        )
        .unwrap();
        check_transition(Init, Rtr, QpType::Ud, s).unwrap();
        check_transition(Rtr, Rts, QpType::Ud, s | M::SQ_PSN).unwrap();
        let uc_rtr = M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN;
        check_transition(Init, Rtr, QpType::Uc, s | uc_rtr).unwrap();
        // UC has no responder resources.
        assert!(matches!(
            check_transition(Init, Rtr, QpType::Uc, s | uc_rtr | M::MAX_DEST_RD_ATOMIC),
            Err(ModifyError::UnexpectedAttributes { .. })
        ));
    }

    #[test]
    fn missing_required_attribute_is_named() {
        let e = check_transition(Init, Rtr, QpType::Rc, M::STATE | RC_RTR.without(M::RQ_PSN))
            .unwrap_err();
        assert_eq!(
            e,
            ModifyError::MissingAttributes {
                from: Init,
                to: Rtr,
                missing: M::RQ_PSN.0
            }
        );
    }

    /// Linux's table allows RESET → ERR (teardown code moves every QP to ERR whatever its
    /// state); so does rdma_rxe.
    #[test]
    fn reset_to_error_is_legal_for_every_type() {
        for ty in [QpType::Rc, QpType::Uc, QpType::Ud] {
            assert!(
                check_transition(Reset, Error, ty, M::STATE).is_ok(),
                "{ty:?}"
            );
        }
    }

    #[test]
    fn illegal_transitions_are_refused() {
        for (from, to) in [(Reset, Rtr), (Reset, Rts), (Init, Rts), (Error, Rts)] {
            assert!(
                matches!(
                    check_transition(from, to, QpType::Rc, M::STATE),
                    Err(ModifyError::IllegalTransition { .. })
                ),
                "{from:?} -> {to:?}"
            );
        }
        // Every state can be reset; every state but RESET can go to ERR.
        for s in QpState::ALL {
            check_transition(s, Reset, QpType::Rc, M::STATE).unwrap();
            if s != Reset {
                check_transition(s, Error, QpType::Uc, M::STATE).unwrap();
            }
        }
    }

    #[test]
    fn cur_state_only_from_rtr_and_later() {
        assert!(check_transition(Init, Init, QpType::Rc, M::CUR_STATE).is_err());
        check_transition(Rts, Rts, QpType::Rc, M::CUR_STATE).unwrap();
    }

    #[test]
    fn rxe_active_mtu_from_netdev_mtu() {
        assert_eq!(PathMtu::for_netdev_mtu(1500), PathMtu::Mtu1024);
        assert_eq!(PathMtu::for_netdev_mtu(2200), PathMtu::Mtu2048);
        assert_eq!(PathMtu::for_netdev_mtu(4200), PathMtu::Mtu4096);
        assert_eq!(PathMtu::for_netdev_mtu(9000), PathMtu::Mtu4096);
        assert_eq!(PathMtu::for_netdev_mtu(300), PathMtu::Mtu256);
        assert_eq!(PathMtu::Mtu4096.bytes(), 4096);
        assert_eq!(PathMtu::Mtu256.bytes(), 256);
    }

    #[test]
    fn timers_follow_rxe() {
        assert_eq!(retransmit_timeout_ns(0), None);
        // 14 → 67.1 ms, what ibv_rc_pingpong and perftest use.
        assert_eq!(retransmit_timeout_ns(14), Some(67_108_864));
        assert_eq!(RNR_TIMER_US[12], 640);
        assert_eq!(RNR_TIMER_US[25], 61_410);
        assert_eq!(rd_atomic_slots(3), 4);
        assert_eq!(rd_atomic_slots(0), 0);
        assert_eq!(rd_atomic_slots(128), 128);
    }

    /// A stall's probes wait 4, 8 and 16 ms at `timeout` 14, then the ceiling (16.8 ms: the
    /// timer's 67 ms comes after two of those), 4 ms then 4.2 ms at 12 (16.8 ms), and none
    /// below, or with the timer off.
    #[test]
    fn each_probe_of_a_stall_waits_twice_as_long_up_to_a_quarter_of_the_timer() {
        let delays = |timeout, first| -> Vec<u64> {
            (0..6)
                .map_while(|n| probe_delay_ns(timeout, n, first))
                .map(|d| d / 100_000)
                .collect()
        };
        assert_eq!(delays(14, TAIL_PROBE_NS), [40, 80, 160, 167, 167, 167]);
        assert_eq!(delays(15, TAIL_PROBE_NS), [40, 80, 160, 320, 335, 335]);
        assert_eq!(delays(12, TAIL_PROBE_NS), [40, 41, 41, 41, 41, 41]);
        assert_eq!(delays(11, TAIL_PROBE_NS), [0u64; 0]);
        assert_eq!(delays(0, TAIL_PROBE_NS), [0u64; 0]);
        // From a measured 1 ms: 1, 2, 4, 8, 16, then the ceiling.
        assert_eq!(delays(14, 1_000_000), [10, 20, 40, 80, 160, 167]);
        // The longest timer (2.4 hours): doubling from 4 ms for 20 probes, the last after 35
        // minutes; the ceiling (36.6 minutes) after that.
        let ceiling = probe_ceiling_ns(31);
        assert_eq!(
            probe_delay_ns(31, 19, TAIL_PROBE_NS),
            Some(TAIL_PROBE_NS << 19)
        );
        assert_eq!(probe_delay_ns(31, 20, TAIL_PROBE_NS), Some(ceiling));
        // From the ceiling: the ceiling again; no doubling wraps around, however far it goes.
        let ceiling = probe_ceiling_ns(14);
        assert_eq!(probe_delay_ns(14, 0, ceiling), Some(ceiling));
        assert_eq!(probe_delay_ns(14, 1, ceiling), Some(ceiling));
        assert_eq!(probe_delay_ns(14, 0, u64::MAX), Some(ceiling));
        assert_eq!(probe_delay_ns(31, 63, 1), Some(probe_ceiling_ns(31)));
        assert_eq!(probe_delay_ns(31, 64, 0), Some(probe_ceiling_ns(31)));
        assert_eq!(probe_delay_ns(31, 41, 1), Some(1 << 41));
    }
}
