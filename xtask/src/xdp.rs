//! `cargo xtask xdp ...`: the XDP loader of `xroce_datapath::xdp` at the command line.

use std::path::Path;

use xroce_datapath::xdp::{
    self, InterfaceStatus, LoadOptions, LoadOutcome, ProgramBuild, UnloadOutcome, XdpMode,
};

use crate::{BuildArg, ModeArg, XdpCommand};

pub fn run(root: &Path, command: XdpCommand) -> Result<(), String> {
    match command {
        XdpCommand::Build => build(root),
        XdpCommand::Load { iface, mode, build } => {
            let mut opts = LoadOptions::new(&iface);
            opts.mode = match mode {
                ModeArg::Auto => None,
                ModeArg::Native => Some(XdpMode::Native),
                ModeArg::Generic => Some(XdpMode::Generic),
            };
            if let Some(build) = build {
                opts = opts.with_build(match build {
                    BuildArg::Plain => ProgramBuild::Plain,
                    BuildArg::Frags => ProgramBuild::Frags,
                });
            }
            load(&opts)
        }
        XdpCommand::Unload { iface } => unload(&iface),
        XdpCommand::Status { iface } => status(iface.as_deref()),
        XdpCommand::SetDrop { iface, one_in } => set_drop(&iface, one_in),
    }
}

/// The objects were compiled by xroce-datapath's build script when this xtask was built (with
/// clang, from xdp-prog/); write them where `xdp-prog/build.sh` would.
fn build(root: &Path) -> Result<(), String> {
    let dir = root.join("xdp-prog/build");
    println!(
        "==> the XDP program was compiled from xdp-prog/xroce_xdp.c by xroce-datapath's build \
         script (clang) while building this command"
    );
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    for build in [ProgramBuild::Plain, ProgramBuild::Frags] {
        let path = dir.join(build.object_file_name());
        std::fs::write(&path, build.object())
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
        println!(
            "==> {}: {} build, section \"{}\", program {}, {} bytes",
            path.display(),
            build,
            build.section(),
            build.program_name(),
            build.object().len()
        );
    }
    println!(
        "==> attach one by hand with e.g. `ip link set dev IF xdpgeneric obj {} sec xdp`, or \
         use `cargo xtask xdp load --iface IF`",
        dir.join(ProgramBuild::Plain.object_file_name()).display()
    );
    Ok(())
}

fn load(opts: &LoadOptions) -> Result<(), String> {
    println!(
        "==> loading xroce's XDP program on {} ({}, {})",
        opts.iface,
        match opts.mode {
            Some(mode) => format!("{mode} mode"),
            None => "native mode where the driver takes it, else generic".to_string(),
        },
        match opts.build {
            Some(build) => format!("{build} build"),
            None => "build chosen from the MTU".to_string(),
        }
    );
    match xdp::load(opts).map_err(|e| e.to_string())? {
        LoadOutcome::Loaded(a) => {
            println!(
                "==> loaded {} ({} build, {} mode) on {}: program id {}, link id {}",
                a.build.program_name(),
                a.build,
                a.mode,
                a.iface,
                a.prog_id,
                a.link_id
            );
            if let Some(answer) = &a.native_refused {
                println!("==> generic mode: the driver refused native XDP ({answer})");
            }
            println!(
                "==> pinned in {} (it stays attached after this command; \
                 `cargo xtask xdp unload --iface {}` removes it)",
                a.pin_dir.display(),
                a.iface
            );
        }
        LoadOutcome::AlreadyLoaded(a) => {
            println!(
                "==> already loaded on {}: {} ({} build, {} mode), program id {}, link id {}; \
                 nothing changed",
                a.iface,
                a.build.program_name(),
                a.build,
                a.mode,
                a.prog_id,
                a.link_id
            );
            let mode_differs = opts.mode.is_some_and(|m| m != a.mode);
            let build_differs = opts.build.is_some_and(|b| b != a.build);
            if mode_differs || build_differs {
                println!(
                    "==> to change mode or build, unload first: cargo xtask xdp unload --iface {}",
                    a.iface
                );
            }
        }
    }
    Ok(())
}

fn unload(iface: &str) -> Result<(), String> {
    match xdp::unload(iface).map_err(|e| e.to_string())? {
        UnloadOutcome::Unloaded => println!("==> unloaded xroce's XDP program from {iface}"),
        UnloadOutcome::NotLoaded => {
            println!("==> nothing to unload: xroce's XDP program is not loaded on {iface}");
            // Say so when something else is attached, since that is not ours to remove.
            if let Ok(status) = xdp::status(Some(iface)) {
                for s in &status {
                    for other in &s.foreign {
                        println!(
                            "==> note: another XDP program is attached to {iface} ({} mode, \
                             program id {}{}); xroce leaves it alone",
                            other.mode,
                            other.prog_id,
                            other
                                .name
                                .as_deref()
                                .map(|n| format!(", '{n}'"))
                                .unwrap_or_default()
                        );
                    }
                }
            }
        }
    }
    Ok(())
}

fn status(iface: Option<&str>) -> Result<(), String> {
    let all = xdp::status(iface).map_err(|e| e.to_string())?;
    if all.is_empty() {
        println!("no XDP program is attached to any interface of this network namespace");
    }
    for s in &all {
        print_status(s);
    }
    Ok(())
}

fn print_status(s: &InterfaceStatus) {
    match (s.ifindex, s.mtu) {
        (Some(index), Some(mtu)) => println!("{} (ifindex {index}, MTU {mtu})", s.iface),
        _ => println!("{} (no longer exists)", s.iface),
    }
    match &s.xroce {
        Some(x) => {
            let a = &x.attachment;
            println!(
                "  xroce: {} ({} build), {} mode, program id {}, link id {}",
                a.build.program_name(),
                a.build,
                a.mode,
                a.prog_id,
                a.link_id
            );
            println!("  pins: {}", a.pin_dir.display());
            let c = &x.counters;
            println!(
                "  counters: redirected {}, passed {}, malformed {}, dropped_by_knob {}, \
                 roce_no_socket {}",
                c.redirected, c.passed, c.malformed, c.dropped_by_knob, c.roce_no_socket
            );
            match x.drop_one_in {
                0 => println!("  drop knob: off"),
                n => println!("  drop knob: drops 1 in {n} RoCEv2 frames (test only)"),
            }
            match &x.xsk_queues {
                Some(q) if q.is_empty() => {
                    println!("  AF_XDP sockets in xsks_map: none (RoCEv2 frames go to the kernel)")
                }
                Some(q) => println!(
                    "  AF_XDP sockets in xsks_map: queue {}",
                    q.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
                ),
                None => println!("  AF_XDP sockets in xsks_map: could not be probed"),
            }
        }
        None if s.foreign.is_empty() => println!("  xroce: not loaded"),
        None => {}
    }
    for other in &s.foreign {
        println!(
            "  another XDP program (not attached by xroce's loader): {} (program id {}, {} mode)",
            other.name.as_deref().unwrap_or("(name unknown)"),
            other.prog_id,
            other.mode
        );
    }
    if let Some(dir) = &s.stale_pins {
        println!(
            "  left-over pins of a detached link: {} (the next load or unload removes them)",
            dir.display()
        );
    }
}

fn set_drop(iface: &str, n: u32) -> Result<(), String> {
    xdp::set_drop_one_in(iface, n).map_err(|e| e.to_string())?;
    match n {
        0 => println!("==> drop knob on {iface}: off"),
        n => println!("==> drop knob on {iface}: drops 1 in {n} RoCEv2 frames (test only)"),
    }
    Ok(())
}
