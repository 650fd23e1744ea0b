//! The public verbs structs the provider shares with libibverbs, checked against the system's
//! `<infiniband/verbs.h>`: a C program prints `offsetof`/`sizeof` for every field the provider
//! defines, and each must equal the Rust layout.

use std::collections::HashMap;
use std::mem::{offset_of, size_of};
use std::process::Command;

use xroce_provider::abi::verbs::*;

/// (C expression kind, struct, member or "" for sizeof, Rust value)
fn rust_layout() -> Vec<(&'static str, &'static str, usize)> {
    macro_rules! fields {
        ($out:ident, $t:ident { $($f:ident),* $(,)? }) => {
            $out.push((stringify!($t), "", size_of::<$t>()));
            $( $out.push((stringify!($t), stringify!($f), offset_of!($t, $f))); )*
        };
    }
    let mut v = Vec::new();
    fields!(
        v,
        ibv_device {
            node_type,
            transport_type,
            name,
            dev_name,
            dev_path,
            ibdev_path
        }
    );
    fields!(
        v,
        ibv_context {
            device,
            ops,
            cmd_fd,
            async_fd,
            num_comp_vectors,
            mutex,
            abi_compat
        }
    );
    fields!(v, verbs_context { sz, context });
    fields!(
        v,
        ibv_comp_channel {
            context,
            fd,
            refcnt
        }
    );
    fields!(v, ibv_pd { context, handle });
    fields!(
        v,
        ibv_mr {
            context,
            pd,
            addr,
            length,
            handle,
            lkey,
            rkey
        }
    );
    fields!(
        v,
        ibv_cq {
            context,
            channel,
            cq_context,
            handle,
            cqe,
            mutex,
            cond,
            comp_events_completed,
            async_events_completed
        }
    );
    fields!(
        v,
        ibv_srq {
            context,
            srq_context,
            pd,
            handle,
            mutex,
            cond,
            events_completed
        }
    );
    fields!(
        v,
        ibv_qp {
            context,
            qp_context,
            pd,
            send_cq,
            recv_cq,
            srq,
            handle,
            qp_num,
            state,
            qp_type,
            mutex,
            cond,
            events_completed
        }
    );
    fields!(
        v,
        ibv_ah {
            context,
            pd,
            handle
        }
    );
    fields!(v, ibv_sge { addr, length, lkey });
    fields!(
        v,
        ibv_wc {
            wr_id,
            status,
            opcode,
            vendor_err,
            byte_len,
            imm_data,
            qp_num,
            src_qp,
            wc_flags,
            pkey_index,
            slid,
            sl,
            dlid_path_bits
        }
    );
    fields!(
        v,
        ibv_send_wr {
            wr_id,
            next,
            sg_list,
            num_sge,
            opcode,
            send_flags,
            imm_data,
            wr,
            qp_type
        }
    );
    fields!(
        v,
        ibv_recv_wr {
            wr_id,
            next,
            sg_list,
            num_sge
        }
    );
    fields!(
        v,
        ibv_qp_cap {
            max_send_wr,
            max_recv_wr,
            max_send_sge,
            max_recv_sge,
            max_inline_data
        }
    );
    fields!(
        v,
        ibv_qp_init_attr {
            qp_context,
            send_cq,
            recv_cq,
            srq,
            cap,
            qp_type,
            sq_sig_all
        }
    );
    fields!(
        v,
        ibv_global_route {
            dgid,
            flow_label,
            sgid_index,
            hop_limit,
            traffic_class
        }
    );
    fields!(
        v,
        ibv_ah_attr {
            grh,
            dlid,
            sl,
            src_path_bits,
            static_rate,
            is_global,
            port_num
        }
    );
    fields!(
        v,
        ibv_qp_attr {
            qp_state,
            cur_qp_state,
            path_mtu,
            path_mig_state,
            qkey,
            rq_psn,
            sq_psn,
            dest_qp_num,
            qp_access_flags,
            cap,
            ah_attr,
            alt_ah_attr,
            pkey_index,
            alt_pkey_index,
            en_sqd_async_notify,
            sq_draining,
            max_rd_atomic,
            max_dest_rd_atomic,
            min_rnr_timer,
            port_num,
            timeout,
            retry_cnt,
            rnr_retry,
            alt_port_num,
            alt_timeout,
            rate_limit
        }
    );
    fields!(
        v,
        ibv_srq_attr {
            max_wr,
            max_sge,
            srq_limit
        }
    );
    fields!(v, ibv_srq_init_attr { srq_context, attr });
    fields!(
        v,
        ibv_device_attr {
            fw_ver,
            node_guid,
            sys_image_guid,
            max_mr_size,
            page_size_cap,
            vendor_id,
            vendor_part_id,
            hw_ver,
            max_qp,
            max_qp_wr,
            device_cap_flags,
            max_sge,
            max_sge_rd,
            max_cq,
            max_cqe,
            max_mr,
            max_pd,
            max_qp_rd_atom,
            max_ee_rd_atom,
            max_res_rd_atom,
            max_qp_init_rd_atom,
            max_ee_init_rd_atom,
            atomic_cap,
            max_ee,
            max_rdd,
            max_mw,
            max_raw_ipv6_qp,
            max_raw_ethy_qp,
            max_mcast_grp,
            max_mcast_qp_attach,
            max_total_mcast_qp_attach,
            max_ah,
            max_fmr,
            max_map_per_fmr,
            max_srq,
            max_srq_wr,
            max_srq_sge,
            max_pkeys,
            local_ca_ack_delay,
            phys_port_cnt
        }
    );
    fields!(
        v,
        ibv_port_attr {
            state,
            max_mtu,
            active_mtu,
            gid_tbl_len,
            port_cap_flags,
            max_msg_sz,
            bad_pkey_cntr,
            qkey_viol_cntr,
            pkey_tbl_len,
            lid,
            sm_lid,
            lmc,
            max_vl_num,
            sm_sl,
            subnet_timeout,
            init_type_reply,
            active_width,
            active_speed,
            phys_state,
            link_layer,
            flags,
            port_cap_flags2
        }
    );
    // The unions of `struct ibv_send_wr`, read through the accessors in abi::verbs.
    let wr = offset_of!(ibv_send_wr, wr);
    v.push(("ibv_send_wr", "wr.rdma.remote_addr", wr));
    v.push((
        "ibv_send_wr",
        "wr.rdma.rkey",
        wr + offset_of!(ibv_send_wr_wr, compare_add),
    ));
    v.push((
        "ibv_send_wr",
        "wr.atomic.compare_add",
        wr + offset_of!(ibv_send_wr_wr, compare_add),
    ));
    v.push((
        "ibv_send_wr",
        "wr.atomic.swap",
        wr + offset_of!(ibv_send_wr_wr, swap),
    ));
    v.push((
        "ibv_send_wr",
        "wr.atomic.rkey",
        wr + offset_of!(ibv_send_wr_wr, rkey),
    ));
    v.push(("ibv_send_wr", "wr.ud.ah", wr));
    v.push((
        "ibv_send_wr",
        "wr.ud.remote_qpn",
        wr + offset_of!(ibv_send_wr_wr, compare_add),
    ));
    v.push((
        "ibv_send_wr",
        "wr.ud.remote_qkey",
        wr + offset_of!(ibv_send_wr_wr, compare_add) + 4,
    ));
    v.push((
        "ib_uverbs_async_event_desc",
        "",
        size_of::<async_event_desc>(),
    ));
    v.push((
        "ib_uverbs_async_event_desc",
        "event_type",
        offset_of!(async_event_desc, event_type),
    ));
    v
}

/// Compiles and runs the C side; returns "struct.member" (or "struct") → value.
fn c_layout(items: &[(&str, &str, usize)]) -> HashMap<String, usize> {
    let mut body = String::new();
    for (s, m, _) in items {
        let ty = format!("struct {s}");
        if m.is_empty() {
            body += &format!("  printf(\"{s} %zu\\n\", sizeof({ty}));\n");
        } else {
            body += &format!("  printf(\"{s}.{m} %zu\\n\", offsetof({ty}, {m}));\n");
        }
    }
    run_c_probe(&body)
        .into_iter()
        .filter_map(|(k, v)| Some((k, usize::try_from(v).ok()?)))
        .collect()
}

/// Compiles and runs `main_body` (lines printing "key value") against the system's verbs
/// headers; returns key → value.
fn run_c_probe(main_body: &str) -> HashMap<String, i64> {
    let dir = std::env::temp_dir().join(format!(
        "xroce-abi-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let src = format!(
        "#include <stddef.h>\n#include <stdio.h>\n#include <infiniband/verbs.h>\n\
         #include <rdma/ib_user_verbs.h>\nint main(void) {{\n{main_body}  return 0;\n}}\n"
    );
    let c = dir.join("probe.c");
    let exe = dir.join("probe");
    std::fs::write(&c, src).expect("write C source");
    let out = Command::new("cc")
        .arg("-Wall")
        .arg("-o")
        .arg(&exe)
        .arg(&c)
        .output()
        .expect("run cc (install a C compiler and libibverbs-dev: cargo xtask test does)");
    assert!(
        out.status.success(),
        "compiling the probe failed (is libibverbs-dev installed?):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(&exe).output().expect("run the probe");
    let _ = std::fs::remove_dir_all(&dir);
    String::from_utf8_lossy(&run.stdout)
        .lines()
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

#[test]
fn public_structs_match_the_system_header() {
    let items = rust_layout();
    let c = c_layout(&items);
    let mut wrong = Vec::new();
    for (s, m, rust) in &items {
        let key = if m.is_empty() {
            s.to_string()
        } else {
            format!("{s}.{m}")
        };
        match c.get(&key) {
            Some(cv) if cv == rust => {}
            // rdma-core 49 and later end the struct with `uint32_t active_speed_ex`, which
            // libibverbs zeroes before the provider's query_port fills the rest (see
            // `abi::version`): the fields the provider writes are where it writes them.
            Some(&cv) if key == "ibv_port_attr" && cv == rust + 4 => {}
            other => wrong.push(format!("{key}: C {other:?}, Rust {rust}")),
        }
    }
    assert!(wrong.is_empty(), "layout mismatches:\n{}", wrong.join("\n"));
    // The fact the private verbs_context_ops layout relies on: `struct ibv_context` sits at
    // byte 320 of `struct verbs_context` in rdma-core 36..=58.
    assert_eq!(c.get("verbs_context.context"), Some(&320));
}

#[test]
fn private_ops_table_has_the_known_slot_count() {
    use xroce_provider::abi::driver::{verbs_context_ops, VERBS_CONTEXT_OPS_SLOTS};
    assert_eq!(
        size_of::<verbs_context_ops>(),
        VERBS_CONTEXT_OPS_SLOTS * size_of::<usize>()
    );
}

/// Every value the provider and the transport exchange with applications through libibverbs
/// (event types, completion statuses and opcodes, QP states, MTUs, attribute masks, flags),
/// against the system's `<infiniband/verbs.h>`. A wrong one is silent: an application gets
/// another event or status than the one meant (`IBV_EVENT_SQ_DRAINED` went out as
/// `IBV_EVENT_PATH_MIG_ERR`, and SRQ limit events as `IBV_EVENT_SRQ_ERR`).
#[test]
fn verbs_constants_match_the_system_header() {
    use xroce_core::transport::memory::Access;
    use xroce_core::transport::qp_state::{AttrMask, PathMtu, QpState};
    use xroce_core::transport::verbs::{SendFlags, WcOpcode, WcStatus};
    let mut rust: Vec<(&str, i64)> = vec![
        ("IBV_QPT_RC", IBV_QPT_RC.into()),
        ("IBV_QPT_UC", IBV_QPT_UC.into()),
        ("IBV_QPT_UD", IBV_QPT_UD.into()),
        ("IBV_WR_RDMA_WRITE", IBV_WR_RDMA_WRITE.into()),
        (
            "IBV_WR_RDMA_WRITE_WITH_IMM",
            IBV_WR_RDMA_WRITE_WITH_IMM.into(),
        ),
        ("IBV_WR_SEND", IBV_WR_SEND.into()),
        ("IBV_WR_SEND_WITH_IMM", IBV_WR_SEND_WITH_IMM.into()),
        ("IBV_WR_RDMA_READ", IBV_WR_RDMA_READ.into()),
        (
            "IBV_WR_ATOMIC_CMP_AND_SWP",
            IBV_WR_ATOMIC_CMP_AND_SWP.into(),
        ),
        (
            "IBV_WR_ATOMIC_FETCH_AND_ADD",
            IBV_WR_ATOMIC_FETCH_AND_ADD.into(),
        ),
        ("IBV_ACCESS_LOCAL_WRITE", IBV_ACCESS_LOCAL_WRITE.into()),
        ("IBV_ACCESS_REMOTE_WRITE", IBV_ACCESS_REMOTE_WRITE.into()),
        ("IBV_ACCESS_REMOTE_READ", IBV_ACCESS_REMOTE_READ.into()),
        ("IBV_ACCESS_REMOTE_ATOMIC", IBV_ACCESS_REMOTE_ATOMIC.into()),
        ("IBV_ACCESS_MW_BIND", IBV_ACCESS_MW_BIND.into()),
        (
            "IBV_ACCESS_OPTIONAL_RANGE",
            IBV_ACCESS_OPTIONAL_RANGE.into(),
        ),
        ("IBV_EVENT_CQ_ERR", IBV_EVENT_CQ_ERR.into()),
        ("IBV_EVENT_QP_FATAL", IBV_EVENT_QP_FATAL.into()),
        ("IBV_EVENT_SQ_DRAINED", IBV_EVENT_SQ_DRAINED.into()),
        ("IBV_EVENT_DEVICE_FATAL", IBV_EVENT_DEVICE_FATAL.into()),
        ("IBV_EVENT_PORT_ACTIVE", IBV_EVENT_PORT_ACTIVE.into()),
        ("IBV_EVENT_PORT_ERR", IBV_EVENT_PORT_ERR.into()),
        (
            "IBV_EVENT_SRQ_LIMIT_REACHED",
            IBV_EVENT_SRQ_LIMIT_REACHED.into(),
        ),
        (
            "IBV_EVENT_QP_LAST_WQE_REACHED",
            IBV_EVENT_QP_LAST_WQE_REACHED.into(),
        ),
        ("IBV_EVENT_GID_CHANGE", IBV_EVENT_GID_CHANGE.into()),
        ("IBV_PORT_DOWN", IBV_PORT_DOWN.into()),
        ("IBV_PORT_ACTIVE", IBV_PORT_ACTIVE.into()),
        ("IBV_LINK_LAYER_ETHERNET", IBV_LINK_LAYER_ETHERNET.into()),
        ("IBV_ATOMIC_HCA", IBV_ATOMIC_HCA.into()),
        ("IBV_WC_WITH_IMM", IBV_WC_WITH_IMM.into()),
        ("IBV_WC_GRH", IBV_WC_GRH.into()),
        ("IBV_SRQ_MAX_WR", IBV_SRQ_MAX_WR.into()),
        ("IBV_SRQ_LIMIT", IBV_SRQ_LIMIT.into()),
        ("IBV_SEND_FENCE", SendFlags::FENCE.0.into()),
        ("IBV_SEND_SIGNALED", SendFlags::SIGNALED.0.into()),
        ("IBV_SEND_SOLICITED", SendFlags::SOLICITED.0.into()),
        ("IBV_SEND_INLINE", SendFlags::INLINE.0.into()),
        ("IBV_ACCESS_LOCAL_WRITE", Access::LOCAL_WRITE.0.into()),
        ("IBV_ACCESS_REMOTE_WRITE", Access::REMOTE_WRITE.0.into()),
        ("IBV_ACCESS_REMOTE_READ", Access::REMOTE_READ.0.into()),
        ("IBV_ACCESS_REMOTE_ATOMIC", Access::REMOTE_ATOMIC.0.into()),
        ("IBV_MTU_256", PathMtu::Mtu256 as i64),
        ("IBV_MTU_512", PathMtu::Mtu512 as i64),
        ("IBV_MTU_1024", PathMtu::Mtu1024 as i64),
        ("IBV_MTU_2048", PathMtu::Mtu2048 as i64),
        ("IBV_MTU_4096", PathMtu::Mtu4096 as i64),
        ("IBV_WC_SEND", WcOpcode::Send as i64),
        ("IBV_WC_RDMA_WRITE", WcOpcode::RdmaWrite as i64),
        ("IBV_WC_RDMA_READ", WcOpcode::RdmaRead as i64),
        ("IBV_WC_COMP_SWAP", WcOpcode::CompSwap as i64),
        ("IBV_WC_FETCH_ADD", WcOpcode::FetchAdd as i64),
        ("IBV_WC_RECV", WcOpcode::Recv as i64),
        (
            "IBV_WC_RECV_RDMA_WITH_IMM",
            WcOpcode::RecvRdmaWithImm as i64,
        ),
    ];
    let statuses = [
        ("IBV_WC_SUCCESS", WcStatus::Success),
        ("IBV_WC_LOC_LEN_ERR", WcStatus::LocLenErr),
        ("IBV_WC_LOC_QP_OP_ERR", WcStatus::LocQpOpErr),
        ("IBV_WC_LOC_EEC_OP_ERR", WcStatus::LocEecOpErr),
        ("IBV_WC_LOC_PROT_ERR", WcStatus::LocProtErr),
        ("IBV_WC_WR_FLUSH_ERR", WcStatus::WrFlushErr),
        ("IBV_WC_MW_BIND_ERR", WcStatus::MwBindErr),
        ("IBV_WC_BAD_RESP_ERR", WcStatus::BadRespErr),
        ("IBV_WC_LOC_ACCESS_ERR", WcStatus::LocAccessErr),
        ("IBV_WC_REM_INV_REQ_ERR", WcStatus::RemInvReqErr),
        ("IBV_WC_REM_ACCESS_ERR", WcStatus::RemAccessErr),
        ("IBV_WC_REM_OP_ERR", WcStatus::RemOpErr),
        ("IBV_WC_RETRY_EXC_ERR", WcStatus::RetryExcErr),
        ("IBV_WC_RNR_RETRY_EXC_ERR", WcStatus::RnrRetryExcErr),
        ("IBV_WC_LOC_RDD_VIOL_ERR", WcStatus::LocRddViolErr),
        ("IBV_WC_REM_INV_RD_REQ_ERR", WcStatus::RemInvRdReqErr),
        ("IBV_WC_REM_ABORT_ERR", WcStatus::RemAbortErr),
        ("IBV_WC_INV_EECN_ERR", WcStatus::InvEecnErr),
        ("IBV_WC_INV_EEC_STATE_ERR", WcStatus::InvEecStateErr),
        ("IBV_WC_FATAL_ERR", WcStatus::FatalErr),
        ("IBV_WC_RESP_TIMEOUT_ERR", WcStatus::RespTimeoutErr),
        ("IBV_WC_GENERAL_ERR", WcStatus::GeneralErr),
    ];
    rust.extend(statuses.map(|(n, s)| (n, s as i64)));
    let states = [
        "IBV_QPS_RESET",
        "IBV_QPS_INIT",
        "IBV_QPS_RTR",
        "IBV_QPS_RTS",
        "IBV_QPS_SQD",
        "IBV_QPS_SQE",
        "IBV_QPS_ERR",
    ];
    for (name, state) in states.iter().zip(QpState::ALL) {
        let value = (0..8).find(|&v| QpState::from_ibv(v) == Some(state));
        rust.push((name, value.map_or(-1, i64::from)));
    }
    let masks = [
        ("IBV_QP_STATE", AttrMask::STATE),
        ("IBV_QP_CUR_STATE", AttrMask::CUR_STATE),
        ("IBV_QP_EN_SQD_ASYNC_NOTIFY", AttrMask::EN_SQD_ASYNC_NOTIFY),
        ("IBV_QP_ACCESS_FLAGS", AttrMask::ACCESS_FLAGS),
        ("IBV_QP_PKEY_INDEX", AttrMask::PKEY_INDEX),
        ("IBV_QP_PORT", AttrMask::PORT),
        ("IBV_QP_QKEY", AttrMask::QKEY),
        ("IBV_QP_AV", AttrMask::AV),
        ("IBV_QP_PATH_MTU", AttrMask::PATH_MTU),
        ("IBV_QP_TIMEOUT", AttrMask::TIMEOUT),
        ("IBV_QP_RETRY_CNT", AttrMask::RETRY_CNT),
        ("IBV_QP_RNR_RETRY", AttrMask::RNR_RETRY),
        ("IBV_QP_RQ_PSN", AttrMask::RQ_PSN),
        ("IBV_QP_MAX_QP_RD_ATOMIC", AttrMask::MAX_QP_RD_ATOMIC),
        ("IBV_QP_ALT_PATH", AttrMask::ALT_PATH),
        ("IBV_QP_MIN_RNR_TIMER", AttrMask::MIN_RNR_TIMER),
        ("IBV_QP_SQ_PSN", AttrMask::SQ_PSN),
        ("IBV_QP_MAX_DEST_RD_ATOMIC", AttrMask::MAX_DEST_RD_ATOMIC),
        ("IBV_QP_PATH_MIG_STATE", AttrMask::PATH_MIG_STATE),
        ("IBV_QP_CAP", AttrMask::CAP),
        ("IBV_QP_DEST_QPN", AttrMask::DEST_QPN),
    ];
    rust.extend(masks.map(|(n, m)| (n, i64::from(m.0))));

    let body: String = rust
        .iter()
        .map(|(name, _)| format!("  printf(\"{name} %lld\\n\", (long long)({name}));\n"))
        .collect();
    let c = run_c_probe(&body);
    let wrong: Vec<String> = rust
        .iter()
        .filter(|(name, value)| c.get(*name) != Some(value))
        .map(|(name, value)| format!("{name}: C {:?}, Rust {value}", c.get(*name)))
        .collect();
    assert!(wrong.is_empty(), "constants differ:\n{}", wrong.join("\n"));
}
