//! `cargo xtask rxe-peer ...`: real rdma_rxe peers in QEMU guests, for trying xroce against
//! Linux's own soft-RoCE by hand. The interop tests (`rxe-peer/tests/`) use the same library.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Subcommand;
use xroce_rxe_peer::{
    default_cache_dir, ensure_image_for, Guest, GuestConfig, GuestKernel, Lab, RunningLab,
};

#[derive(Subcommand)]
pub enum RxePeerCommand {
    /// Build the guest image (a Debian 12 kernel with rdma_rxe and an initramfs with the
    /// host's rdma-core, ibverbs-utils and perftest), or report the cached one. Downloads only
    /// the kernel package (about 70 MB; Debian 13's about 110 MB, and its package index);
    /// cached under target/rxe-peer (or $XROCE_RXE_PEER_CACHE).
    Image {
        /// The guests' kernel: debian-12 (6.1, from this machine's apt sources), debian-13
        /// (6.12, from Debian's archive; the rdma_rxe Debian 13 users run) or
        /// debian-13-backports (the newest kernel built for Debian 13).
        #[arg(long, default_value_t = GuestKernel::Debian12)]
        kernel: GuestKernel,
    },
    /// Boot guests on a bridge in a new network namespace and leave them running (root; about
    /// 10-15 s under TCG, plus the image on first use). Each guest brings up rxe0 on its eth0
    /// (GID 1 is its IPv4 address: use `-g 1` with the pingpongs, `-x 1` with perftest).
    /// Prints the namespace, the guests' addresses and how to reach them. One lab at a time;
    /// `down` removes it.
    Up {
        /// How many guests (named rxe1, rxe2, ...), 1 to 8.
        #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(1..=8))]
        guests: u8,
        /// MTU of the bridge and of every guest's eth0, 1280 to 9000 (rxe's path MTU is
        /// MTU - 80 rounded down to a power of two: 1500 gives 1024, 9000 gives 4096).
        #[arg(long, default_value_t = 1500, value_parser = clap::value_parser!(u32).range(1280..=9000))]
        mtu: u32,
        /// Also join network namespace NS to the bridge (created when missing): a veth named
        /// `rxepeer0` with an address on the lab subnet, where xroce can run, e.g.
        /// `ip netns exec NS xroce link add xr0 netdev rxepeer0`. May be given several times.
        #[arg(long, value_name = "NS")]
        attach: Vec<String>,
        /// Boot the guests without creating rxe0 (plain Debian-kernel hosts, e.g. for running
        /// xroce inside one).
        #[arg(long)]
        no_rxe: bool,
        /// Build xroce and put it in every guest, as /opt/xroce/xroce with its provider
        /// beside it (`/opt/xroce/xroce link add xr0 netdev eth0`, then
        /// `/opt/xroce/xroce exec -- PROGRAM`): xroce on Debian's stock kernel.
        #[arg(long)]
        xroce: bool,
        /// With --xroce: build xroce in release mode (for measuring it against rdma_rxe)
        /// instead of the debug build.
        #[arg(long, requires = "xroce")]
        release: bool,
        /// Also copy FILE into every guest, as /opt/files/NAME (its file name). May be given
        /// several times: a second provider build to compare (`XROCE_PROVIDER=/opt/files/NAME
        /// /opt/xroce/xroce exec -- ...`), your own test program.
        #[arg(long, value_name = "FILE")]
        file: Vec<PathBuf>,
        /// The guests' kernel: debian-12 (6.1, from this machine's apt sources), debian-13
        /// (6.12, from Debian's archive; the rdma_rxe Debian 13 users run) or
        /// debian-13-backports (the newest kernel built for Debian 13). The userspace is this
        /// machine's (Debian 12) either way.
        #[arg(long, default_value_t = GuestKernel::Debian12)]
        kernel: GuestKernel,
        /// Give the guests NICs that AF_XDP zero-copy can use: virtio-net with
        /// VIRTIO_F_ACCESS_PLATFORM (the guest maps every buffer through its DMA API), which
        /// its zero-copy needs from Linux 6.13 on (`--kernel debian-13-backports`). Every
        /// frame's mapping costs more, rdma_rxe's too. xroce binds zero-copy there only when
        /// asked (`XROCE_BIND_MODE=zero-copy`): Debian's virtio_net is a module, whose
        /// zero-copy sends frames behind a header read from the wrong memory.
        #[arg(long)]
        zero_copy_nic: bool,
    },
    /// Run a shell command in a guest and print its output; exits with the command's status
    /// (124 when it was stopped at the timeout).
    ///
    /// Example: `cargo xtask rxe-peer run rxe1 -- ibv_devinfo -v`
    Run {
        /// The guest's name (see `status`).
        guest: String,
        /// Stop the command after this many seconds (a server started in the background is
        /// stopped too: give it time for its client).
        #[arg(long, default_value_t = 60)]
        timeout: u64,
        /// The command (run by bash in the guest).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
        command: Vec<String>,
    },
    /// Show the running lab: namespace, guests (and whether their qemu runs), attached
    /// namespaces. Says so when none is running.
    Status,
    /// Stop the guests and remove the namespace, the bridge and the veths.
    Down,
}

/// The record of the lab `up` left running: `$XROCE_RXE_PEER_STATE`, else `running-lab` in
/// the image cache.
fn state_file() -> PathBuf {
    std::env::var_os("XROCE_RXE_PEER_STATE")
        .map(PathBuf::from)
        .unwrap_or_else(|| default_cache_dir().join("running-lab"))
}

pub fn run(root: &Path, command: RxePeerCommand) -> Result<(), String> {
    match command {
        RxePeerCommand::Image { kernel } => {
            need_root("building the image downloads a kernel package with apt-get")?;
            crate::packages::ensure_test_packages()?;
            let image = ensure_image_for(&default_cache_dir(), kernel, &mut say)
                .map_err(|e| e.to_string())?;
            println!("kernel: {}", image.kernel.display());
            println!("initramfs: {}", image.initrd.display());
            Ok(())
        }
        RxePeerCommand::Up {
            guests,
            mtu,
            attach,
            no_rxe,
            xroce,
            release,
            file,
            kernel,
            zero_copy_nic,
        } => up(
            root,
            UpOptions {
                guests,
                mtu,
                attach: &attach,
                no_rxe,
                xroce: xroce.then_some(if release { "release" } else { "debug" }),
                files: &file,
                kernel,
                zero_copy_nic,
            },
        ),
        RxePeerCommand::Run {
            guest,
            timeout,
            command,
        } => {
            let lab = running()?;
            let g = lab.guest(&guest).ok_or_else(|| {
                format!(
                    "no guest {guest:?} in the running lab (guests: {})",
                    lab.guests
                        .iter()
                        .map(|(n, _, _)| n.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })?;
            let out = g
                .run(&command.join(" "), Duration::from_secs(timeout))
                .map_err(|e| e.to_string())?;
            print!("{}", out.stdout);
            eprint!("{}", out.stderr);
            std::process::exit(out.status.clamp(0, 255));
        }
        RxePeerCommand::Status => {
            // Nothing running is an answer, not an error (as `down` and `xdp status` treat it).
            match RunningLab::load(&state_file()).map_err(|e| e.to_string())? {
                None => println!("no rxe-peer lab is running"),
                Some(lab) => print_lab(&lab),
            }
            Ok(())
        }
        RxePeerCommand::Down => {
            need_root("removing the lab's namespace")?;
            match RunningLab::load(&state_file()).map_err(|e| e.to_string())? {
                None => {
                    println!("no rxe-peer lab is running");
                    Ok(())
                }
                Some(lab) => {
                    let ns = lab.ns.clone();
                    lab.teardown();
                    let _ = std::fs::remove_file(state_file());
                    println!("removed lab {ns} and its guests");
                    Ok(())
                }
            }
        }
    }
}

fn say(m: &str) {
    println!("==> {m}");
}

fn need_root(why: &str) -> Result<(), String> {
    if crate::packages::is_root() {
        Ok(())
    } else {
        Err(format!("run as root: {why}"))
    }
}

fn running() -> Result<RunningLab, String> {
    RunningLab::load(&state_file())
        .map_err(|e| e.to_string())?
        .ok_or_else(|| {
            "no rxe-peer lab is running; start one with `cargo xtask rxe-peer up`".into()
        })
}

/// What `up` boots.
struct UpOptions<'a> {
    guests: u8,
    mtu: u32,
    attach: &'a [String],
    no_rxe: bool,
    /// Put xroce into the guests, built with this cargo profile ("debug" or "release").
    xroce: Option<&'static str>,
    /// Copied into every guest under /opt/files.
    files: &'a [PathBuf],
    kernel: GuestKernel,
    zero_copy_nic: bool,
}

fn up(root: &Path, opts: UpOptions) -> Result<(), String> {
    let UpOptions {
        guests,
        mtu,
        attach,
        no_rxe,
        xroce,
        files,
        kernel,
        zero_copy_nic,
    } = opts;
    need_root("the lab is a network namespace with a bridge and taps")?;
    // Ctrl-C while the guests boot: the lab and the namespaces made for it go again (the
    // guests' qemu get the same Ctrl-C).
    crate::interrupt::catch_signals();
    if let Some(lab) = RunningLab::load(&state_file()).map_err(|e| e.to_string())? {
        return Err(format!(
            "a lab is already running (namespace {}); `cargo xtask rxe-peer down` removes it",
            lab.ns
        ));
    }
    let mut extra_files = Vec::new();
    for f in files {
        let name = f
            .file_name()
            .ok_or_else(|| format!("--file {}: not a file name", f.display()))?;
        if !f.is_file() {
            return Err(format!("--file {}: no such file", f.display()));
        }
        let guest_path = format!("/opt/files/{}", name.to_string_lossy());
        if extra_files.iter().any(|(_, g)| *g == guest_path) {
            return Err(format!(
                "--file {}: another --file is also called {}; rename one",
                f.display(),
                name.to_string_lossy()
            ));
        }
        extra_files.push((f.clone(), guest_path));
    }
    crate::packages::ensure_test_packages()?;
    // $XROCE_GUEST_AGENT names a built agent (the tests use it); otherwise build it.
    let agent = match std::env::var_os("XROCE_GUEST_AGENT") {
        Some(p) => PathBuf::from(p),
        None => {
            crate::step(
                root,
                "build the guest agent",
                &crate::cargo(),
                &[
                    "build",
                    "-p",
                    "xroce-rxe-peer",
                    "--bin",
                    "xroce-guest-agent",
                ],
            )?;
            root.join("target/debug/xroce-guest-agent")
        }
    };
    if let Some(profile) = xroce {
        let mut args = vec!["build", "-p", "xroce-cli", "-p", "xroce-provider"];
        if profile == "release" {
            args.push("--release");
        }
        crate::step(root, "build xroce and the provider", &crate::cargo(), &args)?;
        for name in ["xroce", "libxroce_provider.so"] {
            extra_files.push((
                root.join("target").join(profile).join(name),
                format!("/opt/xroce/{name}"),
            ));
        }
    }
    let image =
        ensure_image_for(&default_cache_dir(), kernel, &mut say).map_err(|e| e.to_string())?;
    let lab = Lab::new("xroce-peer", mtu, image, agent).map_err(|e| e.to_string())?;
    let mut created = Vec::new();
    let template = GuestConfig {
        rxe: !no_rxe,
        extra_files,
        dma_api_nic: zero_copy_nic,
        ..GuestConfig::rxe("template", 10)
    };
    let booted = match boot_lab(root, &lab, guests, attach, &template, &mut created)
        .and_then(|b| crate::interrupt::interrupted().map(|()| b))
    {
        Ok(b) => b,
        Err(e) => {
            // Dropping the lab kills what booted and removes its namespace; the namespaces
            // made for it go too.
            drop(lab);
            for ns in &created {
                let _ = std::process::Command::new("ip")
                    .args(["netns", "del", ns])
                    .status();
            }
            return Err(e);
        }
    };
    let mut running = lab.keep_running(booted);
    running.created = created;
    running.save(&state_file()).map_err(|e| e.to_string())?;
    print_lab(&running);
    if let Some((name, ip, _)) = running.guests.first() {
        println!(
            "\nrun a command in a guest:  cargo xtask rxe-peer run {name} -- ibv_devinfo\n\
             reach a guest:             ip netns exec {} ping {ip}\n\
             tear it down:              cargo xtask rxe-peer down",
            running.ns
        );
    }
    Ok(())
}

/// Joins the `attach` namespaces (recording those it creates) and boots the guests.
fn boot_lab(
    root: &Path,
    lab: &Lab,
    guests: u8,
    attach: &[String],
    template: &GuestConfig,
    created: &mut Vec<String>,
) -> Result<Vec<Guest>, String> {
    for (i, ns) in attach.iter().enumerate() {
        if !Path::new("/run/netns").join(ns).exists() {
            crate::step(root, "create namespace", "ip", &["netns", "add", ns])?;
            created.push(ns.clone());
        }
        let addr = lab
            .attach_netns(ns, "rxepeer0", 100 + i as u8)
            .map_err(|e| e.to_string())?;
        say(&format!("namespace {ns}: rxepeer0 {addr}/24 on the bridge"));
    }
    let configs: Vec<GuestConfig> = (1..=guests)
        .map(|i| GuestConfig {
            name: format!("rxe{i}"),
            host: 10 + i,
            ..template.clone()
        })
        .collect();
    say(&format!(
        "booting {guests} guest(s) (about 10-15 s each under TCG emulation, in parallel)"
    ));
    let start = Instant::now();
    let booted = lab.boot_all(configs).map_err(|e| e.to_string())?;
    say(&format!(
        "booted in {:.1} s ({})",
        start.elapsed().as_secs_f64(),
        booted.first().map(|g| g.accelerator()).unwrap_or("?")
    ));
    Ok(booted)
}

fn print_lab(lab: &RunningLab) {
    println!("lab namespace {} (bridge br0, MTU {})", lab.ns, lab.mtu);
    for ((name, ip, pid), alive) in lab.guests.iter().zip(lab.alive()) {
        println!(
            "  guest {name}: {ip} (qemu pid {pid}{})",
            if alive { "" } else { ", NOT RUNNING" }
        );
    }
    for (ns, ifname, ip) in &lab.attached {
        println!("  namespace {ns}: {ifname} {ip}");
    }
}
