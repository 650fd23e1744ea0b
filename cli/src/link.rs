//! `xroce link add | del | show`: xroce RDMA devices, managed like `rdma link` manages
//! rdma_rxe devices. The work is in [`xroce_datapath::registry`]; this is the wording.

use std::io::{self, Write};
use std::process::ExitCode;

use xroce_datapath::afxdp::{kernel_supports_multi_buffer, port_path_mtu};
use xroce_datapath::engine;
use xroce_datapath::netlink::{self, Interface};
use xroce_datapath::registry::{self, gid_ipv6, Link, RegistryError, GID_TABLE_LEN};
use xroce_datapath::xdp::{self, LoadOutcome, UnloadOutcome, XdpError, XdpMode};

/// `xroce link add NAME netdev DEV`; `mode` `None` lets the loader choose.
pub fn add(name: &str, netdev: &str, mode: Option<XdpMode>) -> ExitCode {
    let added = match registry::add(name, netdev, mode) {
        Ok(added) => added,
        Err(e) => return fail("link add", &e),
    };
    let (verb, attachment) = match &added.xdp {
        LoadOutcome::Loaded(a) => ("loaded", a),
        LoadOutcome::AlreadyLoaded(a) => ("already loaded", a),
    };
    // The link exists now whatever happens to the output (a closed pipe must not panic).
    let mut out = io::stdout().lock();
    // Generic mode nobody asked for: the kernel picks it when the driver has no native XDP,
    // the loader when the driver refused native XDP here. Say so, and why, since it costs
    // speed and rules out zero-copy. And a program already attached keeps its mode whatever
    // was asked.
    let why = match (mode, &added.xdp) {
        (None, LoadOutcome::Loaded(a)) if a.mode == XdpMode::Generic => match &a.native_refused {
            Some(answer) => format!("; the driver refused native XDP: {answer}"),
            None => "; the driver has no native XDP".to_string(),
        },
        (Some(asked), LoadOutcome::AlreadyLoaded(a)) if a.mode != asked => {
            format!("; not {asked} as asked: `xroce link del {name}` unloads it, then add again")
        }
        _ => String::new(),
    };
    let _ = writeln!(
        out,
        "{name}: netdev {netdev}, XDP program {verb} ({}, {} build{why})",
        attachment.mode, attachment.build
    )
    .and_then(|()| writeln!(out, "{name}: GIDs {}", gid_list(&added.device.gids)));
    // A program that was already there keeps its knob (a test's loss, say).
    if let Ok(one_in @ 1..) = xdp::drop_one_in(netdev) {
        eprintln!(
            "xroce: link add: {netdev}{}",
            drop_knob_note(netdev, one_in)
        );
    }
    ExitCode::SUCCESS
}

/// `xroce link del NAME`.
pub fn del(name: &str) -> ExitCode {
    let deleted = match registry::delete(name) {
        Ok(deleted) => deleted,
        Err(e) => return fail("link del", &e),
    };
    let xdp = match deleted.xdp {
        Some(UnloadOutcome::Unloaded) => "XDP program unloaded",
        Some(UnloadOutcome::NotLoaded) => "XDP program was not loaded",
        None => "netdev no longer exists",
    };
    let _ = writeln!(
        io::stdout().lock(),
        "{name}: removed from netdev {} ({xdp})",
        deleted.link.netdev
    );
    ExitCode::SUCCESS
}

/// `xroce link show [NAME]`.
pub fn show(name: Option<&str>) -> ExitCode {
    let mut out = io::stdout().lock();
    match write_show(name, &mut out) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail("link show", &e),
    }
}

/// Writes what `xroce link show [NAME]` prints: per link, a summary line, its GIDs, and the
/// state of the XDP program on its netdev. Nothing when there are no links (like
/// `rdma link show`).
pub fn write_show(name: Option<&str>, out: &mut dyn Write) -> Result<(), RegistryError> {
    if let Some(name) = name {
        registry::check_name(name)?;
    }
    let links: Vec<Link> = registry::links()?
        .into_iter()
        .filter(|l| name.is_none_or(|n| l.name == n))
        .collect();
    if let (Some(name), true) = (name, links.is_empty()) {
        return Err(RegistryError::NoSuchLink {
            name: name.to_string(),
        });
    }
    // Output errors (a closed pipe) end the listing quietly.
    let _ = links.iter().try_for_each(|link| show_link(link, out));
    Ok(())
}

fn show_link(link: &Link, out: &mut dyn Write) -> io::Result<()> {
    let iface = match netlink::interface_by_name(&link.netdev) {
        Ok(iface) => iface,
        Err(e) => {
            writeln!(
                out,
                "link {} netdev {} state DOWN (netdev unavailable: {e})",
                link.name, link.netdev
            )?;
            return Ok(());
        }
    };
    writeln!(
        out,
        "link {} netdev {} state {} mtu {} (path MTU {})",
        link.name,
        link.netdev,
        if iface.up { "ACTIVE" } else { "DOWN" },
        iface.mtu,
        // What the engine holding the interface got, else what a new one would get.
        port_path_mtu(
            iface.mtu,
            engine::holder_multi_buffer(&iface.name).unwrap_or_else(kernel_supports_multi_buffer)
        )
        .bytes()
    )?;
    // What programs read: the tree's table (addresses keep their indices there), else the
    // kernel's addresses in order.
    let gids = match registry::device_gids(&link.name, &link.netdev) {
        Some(gids) => Ok(gids),
        None => netlink::gid_table(&iface).map(|g| g.into_iter().map(Some).collect::<Vec<_>>()),
    };
    match gids {
        Ok(gids) => {
            for (index, gid) in gids.iter().take(GID_TABLE_LEN).enumerate() {
                if let Some(gid) = gid {
                    writeln!(out, "    gid {index} {}", gid_ipv6(*gid))?;
                }
            }
        }
        Err(e) => writeln!(out, "    gids unavailable: {e}")?,
    }
    writeln!(out, "    xdp {}", xdp_state(&iface))
}

fn xdp_state(iface: &Interface) -> String {
    // A DPDK engine (`XROCE_BACKEND=dpdk`) binds no socket, needs no steering program, and
    // holds the whole interface.
    let dpdk = engine::interface_holder(&iface.name)
        .map(|h| format!("; in use by {h} on DPDK"))
        .unwrap_or_default();
    format!("{}{dpdk}", steering_state(iface))
}

fn steering_state(iface: &Interface) -> String {
    let status = match xdp::status(Some(&iface.name)) {
        Ok(mut all) if !all.is_empty() => all.swap_remove(0),
        Ok(_) => return "not attached".to_string(),
        Err(XdpError::PermissionDenied { .. }) => {
            return "state unknown (reading it needs root)".to_string()
        }
        Err(e) => return format!("state unknown ({e})"),
    };
    let Some(ours) = status.xroce else {
        return match status.foreign.first() {
            Some(other) => format!(
                "not attached (another XDP program is: program id {}{})",
                other.prog_id,
                other
                    .name
                    .as_deref()
                    .map(|n| format!(" '{n}'"))
                    .unwrap_or_default()
            ),
            None => "not attached".to_string(),
        };
    };
    let a = &ours.attachment;
    let sockets = match &ours.xsk_queues {
        // An engine binds every receive queue; queue 0 is the one it sends on by default.
        Some(queues) if !queues.is_empty() && queues[..] != [0] => format!(
            "sockets bound on queues {}",
            queues
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Some(queues) if !queues.is_empty() => "queue 0: socket bound".to_string(),
        Some(_) => "queue 0: no socket bound".to_string(),
        None => "queue 0: socket unknown".to_string(),
    };
    // Which process holds the device, when an engine left its note: the answer to "why does
    // my program get EBUSY".
    let mut holders: Vec<String> = Vec::new();
    for &queue in ours.xsk_queues.as_deref().unwrap_or_default() {
        if let Some(h) = engine::queue_holder(&iface.name, queue).map(|h| h.to_string()) {
            if !holders.contains(&h) {
                holders.push(h);
            }
        }
    }
    let held = if holders.is_empty() {
        String::new()
    } else {
        format!(", in use by {}", holders.join(" and "))
    };
    format!(
        "attached ({}, {} build, program id {}); {sockets}{held}{}",
        a.mode,
        a.build,
        a.prog_id,
        drop_knob_note(&iface.name, ours.drop_one_in)
    )
}

/// The test-only drop knob, when set: it outlives the test that set it (the program stays
/// loaded), and would drop a real peer's frames with no other sign than retransmissions.
fn drop_knob_note(iface: &str, one_in: u32) -> String {
    if one_in == 0 {
        return String::new();
    }
    format!(
        "; test-only drop knob on: 1 RoCEv2 frame in {one_in} is dropped \
         (`cargo xtask xdp set-drop --iface {iface} --one-in 0` turns it off; so does \
         `xroce link del`, which unloads the program)"
    )
}

/// `0 fe80::..., 1 ::ffff:...` (empty slots left out).
fn gid_list(gids: &[Option<std::net::IpAddr>]) -> String {
    gids.iter()
        .enumerate()
        .filter_map(|(i, g)| g.map(|g| format!("{i} {}", gid_ipv6(g))))
        .collect::<Vec<_>>()
        .join(", ")
}

fn fail(what: &str, e: &RegistryError) -> ExitCode {
    eprintln!("xroce {what}: {e}");
    ExitCode::FAILURE
}
