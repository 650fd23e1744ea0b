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
    let dir = std::env::temp_dir().join(format!("xroce-abi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let mut src = String::from(
        "#include <stddef.h>\n#include <stdio.h>\n#include <infiniband/verbs.h>\n\
         #include <rdma/ib_user_verbs.h>\nint main(void) {\n",
    );
    for (s, m, _) in items {
        let ty = format!("struct {s}");
        if m.is_empty() {
            src += &format!("  printf(\"{s} %zu\\n\", sizeof({ty}));\n");
        } else {
            src += &format!("  printf(\"{s}.{m} %zu\\n\", offsetof({ty}, {m}));\n");
        }
    }
    src += "  return 0;\n}\n";
    let c = dir.join("layout.c");
    let exe = dir.join("layout");
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
        "compiling the layout probe failed (is libibverbs-dev installed?):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(&exe).output().expect("run layout probe");
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
            other => wrong.push(format!("{key}: C {other:?}, Rust {rust}")),
        }
    }
    assert!(wrong.is_empty(), "layout mismatches:\n{}", wrong.join("\n"));
    // The fact the private verbs_context_ops layout relies on: `struct ibv_context` sits at
    // byte 320 of `struct verbs_context` in rdma-core 36..=48.
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
