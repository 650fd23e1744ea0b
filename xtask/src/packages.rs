//! The Debian packages the build and the tests need, and installing the missing ones.
//!
//! CI runs `cargo xtask test` as root on a fresh Debian machine: this xtask must build without
//! them (it does: the loader is behind the `xdp` feature) and then install them.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

struct Package {
    /// Debian package name.
    name: &'static str,
    /// Other packages that satisfy the need as well (e.g. a versioned clang).
    alternatives: &'static [&'static str],
    /// Tests cannot run without it.
    required: bool,
    /// What it is for, printed when it is missing.
    why: &'static str,
    /// The demo needs it too (the demo installs only those).
    demo: bool,
}

const TEST_PACKAGES: &[Package] = &[
    Package {
        name: "clang",
        alternatives: &["clang-14", "clang-15", "clang-16", "clang-19"],
        required: true,
        why: "compiles the XDP program (xdp-prog/build.sh)",
        demo: true,
    },
    Package {
        name: "libbpf-dev",
        alternatives: &[],
        required: true,
        why: "bpf/bpf_helpers.h for the XDP program",
        demo: true,
    },
    Package {
        name: "linux-libc-dev",
        alternatives: &[],
        required: true,
        why: "linux/bpf.h and asm/types.h for the XDP program",
        demo: true,
    },
    Package {
        name: "iproute2",
        alternatives: &[],
        required: true,
        why: "`ip`: network namespaces and veth pairs in the tests",
        demo: true,
    },
    Package {
        name: "iputils-ping",
        alternatives: &[],
        required: true,
        why: "`ping` in the namespace tests",
        demo: false,
    },
    Package {
        name: "libibverbs-dev",
        alternatives: &[],
        required: true,
        why: "libibverbs and its headers: the provider's layout test and the C verbs tests",
        demo: true,
    },
    Package {
        name: "ibverbs-utils",
        alternatives: &[],
        required: true,
        why: "ibv_devices, ibv_devinfo and the ibv_*_pingpong programs run over xroce",
        demo: true,
    },
    Package {
        name: "perftest",
        alternatives: &[],
        required: true,
        why: "ib_send_bw, ib_write_lat, ... run over xroce",
        demo: true,
    },
    Package {
        name: "ethtool",
        alternatives: &[],
        required: true,
        why: "`ethtool -L`: a namespace test changes an interface's queues under an engine",
        demo: false,
    },
    Package {
        name: "strace",
        alternatives: &[],
        required: true,
        why: "shows that programs under xroce exec never ask the kernel's RDMA netlink",
        demo: false,
    },
    Package {
        name: "valgrind",
        alternatives: &[],
        required: true,
        why: "checks the provider's memory accesses under ibv_rc_pingpong",
        demo: false,
    },
    Package {
        name: "qemu-system-x86",
        alternatives: &[],
        required: true,
        why: "runs the rdma_rxe peers of the interoperability tests (cargo xtask rxe-peer)",
        demo: false,
    },
    Package {
        name: "kmod",
        alternatives: &[],
        required: true,
        why: "depmod/modprobe pick the rdma_rxe guest's kernel modules",
        demo: false,
    },
    Package {
        name: "binutils",
        alternatives: &[],
        required: true,
        why: "objcopy strips debug information from the xroce files put into guests",
        demo: false,
    },
    Package {
        name: "libdpdk-dev",
        alternatives: &[],
        required: true,
        why: "DPDK's headers, libraries and net_af_packet driver: the DPDK port (feature dpdk)",
        demo: false,
    },
    Package {
        name: "pkg-config",
        alternatives: &["pkgconf"],
        required: true,
        why: "finds DPDK's compiler flags for the DPDK port's shim",
        demo: false,
    },
    Package {
        name: "bpftool",
        alternatives: &[],
        required: false,
        why: "inspecting programs and maps by hand (optional)",
        demo: false,
    },
];

const APT_OPTIONS: &[&str] = &["install", "-y", "--no-install-recommends"];

/// Makes sure the packages of [`TEST_PACKAGES`] are installed: installs the missing ones with
/// apt-get when running as root, otherwise prints the command and fails if a required one is
/// missing.
pub fn ensure_test_packages() -> Result<(), String> {
    ensure_packages(&TEST_PACKAGES.iter().collect::<Vec<_>>())
}

/// The same for the packages the demo needs (no emulator, no valgrind).
pub fn ensure_demo_packages() -> Result<(), String> {
    ensure_packages(&TEST_PACKAGES.iter().filter(|p| p.demo).collect::<Vec<_>>())
}

fn ensure_packages(wanted: &[&Package]) -> Result<(), String> {
    if !have_command("dpkg-query") {
        println!(
            "==> packages: no dpkg-query (not Debian/Ubuntu?); make sure these are installed: {}",
            wanted.iter().map(|p| p.name).collect::<Vec<_>>().join(", ")
        );
        return Ok(());
    }
    let missing: Vec<&Package> = wanted.iter().copied().filter(|p| !satisfied(p)).collect();
    if missing.is_empty() {
        println!("==> packages: all installed");
        return Ok(());
    }
    for p in &missing {
        println!("==> packages: {} is missing ({})", p.name, p.why);
    }
    let names: Vec<&str> = missing.iter().map(|p| p.name).collect();
    let any_required = missing.iter().any(|p| p.required);
    if !is_root() || !have_command("apt-get") {
        let why = if is_root() {
            "apt-get is not available"
        } else {
            "not root"
        };
        println!(
            "==> packages: cannot install them here ({why}); as root, run:\n\n    apt-get update && apt-get {} {}\n",
            APT_OPTIONS.join(" "),
            names.join(" ")
        );
        return if any_required {
            Err("required packages are missing (see above)".into())
        } else {
            Ok(())
        };
    }

    apt(&["update"])?;
    let required: Vec<&str> = missing
        .iter()
        .filter(|p| p.required)
        .map(|p| p.name)
        .collect();
    if !required.is_empty() {
        let mut args = APT_OPTIONS.to_vec();
        args.extend(&required);
        apt(&args)?;
    }
    for optional in missing.iter().filter(|p| !p.required) {
        let mut args = APT_OPTIONS.to_vec();
        args.push(optional.name);
        if let Err(e) = apt(&args) {
            println!(
                "==> packages: optional {} not installed ({e}); continuing",
                optional.name
            );
        }
    }
    Ok(())
}

/// Before building the XDP loader: clang and the libbpf headers, or the command that installs
/// them.
#[cfg_attr(feature = "xdp", allow(dead_code))]
pub fn check_xdp_build_deps() -> Result<(), String> {
    let clang = have_command("clang") || have_command("clang-14");
    let headers = Path::new("/usr/include/bpf/bpf_helpers.h").is_file();
    if clang && headers {
        return Ok(());
    }
    let mut what = Vec::new();
    if !clang {
        what.push("clang");
    }
    if !headers {
        what.push("the libbpf headers (bpf/bpf_helpers.h)");
    }
    Err(format!(
        "building the XDP program needs {}; install them as root with:\n\n    apt-get install -y \
         --no-install-recommends clang libbpf-dev linux-libc-dev\n",
        what.join(" and ")
    ))
}

fn satisfied(p: &Package) -> bool {
    std::iter::once(p.name)
        .chain(p.alternatives.iter().copied())
        .any(installed)
}

/// `dpkg-query` says the package is installed ("ii").
fn installed(name: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${db:Status-Abbrev}", name])
        .stderr(Stdio::null())
        .output()
        .is_ok_and(|o| o.status.success() && o.stdout.starts_with(b"ii"))
}

fn have_command(name: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(name).is_file()))
}

/// Effective uid 0, read from /proc.
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|v| v.split_whitespace().nth(1))
            == Some("0")
    })
}

fn apt(args: &[&str]) -> Result<(), String> {
    // `DPkg::Lock::Timeout` covers the dpkg lock only; `update` takes the lists' lock, which
    // a fresh machine's apt-daily holds for a while after boot: tried again for up to about
    // 5 minutes.
    let tries = if args.first() == Some(&"update") {
        30
    } else {
        1
    };
    let mut outcome = apt_once(args);
    for _ in 1..tries {
        if outcome.is_ok() {
            break;
        }
        println!("==> packages: trying again in 10 s (another apt may hold its lock)");
        std::thread::sleep(std::time::Duration::from_secs(10));
        outcome = apt_once(args);
    }
    outcome
}

fn apt_once(args: &[&str]) -> Result<(), String> {
    println!("==> packages: apt-get {}", args.join(" "));
    let start = Instant::now();
    // A fresh machine's apt-daily or unattended-upgrades may hold the dpkg lock for a while
    // after boot: wait for it (up to 10 minutes) rather than fail at once.
    let status = Command::new("apt-get")
        .args(["-o", "DPkg::Lock::Timeout=600"])
        .args(args)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdin(Stdio::null())
        .status()
        .map_err(|e| format!("cannot run apt-get: {e}"))?;
    println!(
        "==> packages: apt-get {}: {} in {:.1} s",
        args.first().copied().unwrap_or(""),
        if status.success() { "ok" } else { "FAILED" },
        start.elapsed().as_secs_f64()
    );
    if status.success() {
        Ok(())
    } else {
        Err(format!("apt-get {} failed ({status})", args.join(" ")))
    }
}
