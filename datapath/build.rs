//! Compiles the XDP steering program (`xdp-prog/xroce_xdp.c`) into its two objects in `OUT_DIR`:
//!
//! - `xroce_xdp.o`: section `xdp`, program `xroce_xdp` (single-buffer frames);
//! - `xroce_xdp_frags.o`: section `xdp.frags`, program `xroce_xdp_frags` (built with
//!   `-DXROCE_FRAGS`, for MTUs above what single-buffer XDP accepts).
//!
//! `src/xdp/` embeds both with `include_bytes!`. The work is done by `xdp-prog/build.sh`, the
//! same script people run by hand, so there is one clang command line to maintain. Without
//! clang (with the BPF target) or the libbpf headers the build stops and names the Debian
//! packages to install.
//!
//! With the `dpdk` feature it also compiles `dpdk/shim.c` (the DPDK port's calls into DPDK's
//! inline functions) against the installed DPDK (`pkg-config libdpdk`) and links the DPDK
//! libraries the port uses.

use std::path::PathBuf;
use std::process::Command;

const APT_HINT: &str = "apt-get install -y clang libbpf-dev linux-libc-dev";
#[cfg(feature = "dpdk")]
const DPDK_APT_HINT: &str = "apt-get install -y libdpdk-dev pkg-config";
/// The DPDK libraries the shim calls into (the drivers are loaded by DPDK itself).
#[cfg(feature = "dpdk")]
const DPDK_LIBS: [&str; 5] = [
    "rte_eal",
    "rte_ethdev",
    "rte_mbuf",
    "rte_mempool",
    "rte_bus_vdev",
];

fn main() {
    let manifest_dir = PathBuf::from(env_or_exit("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env_or_exit("OUT_DIR"));
    let prog_dir = manifest_dir.join("../xdp-prog");
    for file in ["xroce_xdp.c", "xroce_xdp_maps.h", "build.sh"] {
        println!("cargo:rerun-if-changed={}", prog_dir.join(file).display());
    }
    println!("cargo:rerun-if-env-changed=CLANG");

    let script = prog_dir.join("build.sh");
    let output = Command::new("bash").arg(&script).arg(&out_dir).output();
    let output = match output {
        Ok(output) => output,
        Err(e) => fail(&format!("cannot run {} with bash: {e}", script.display())),
    };
    if !output.status.success() {
        let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
        text.push_str(&String::from_utf8_lossy(&output.stderr));
        fail(&format!(
            "building the XDP program failed ({}):\n{}",
            output.status,
            text.trim_end()
        ));
    }
    for object in ["xroce_xdp.o", "xroce_xdp_frags.o"] {
        if !out_dir.join(object).is_file() {
            fail(&format!(
                "{} finished but did not produce {object}",
                script.display()
            ));
        }
    }
    #[cfg(feature = "dpdk")]
    build_dpdk_shim(&manifest_dir);
}

/// Compiles the DPDK shim with the flags DPDK's pkg-config file gives (include paths, the
/// `rte_config.h` every DPDK header expects first, the CPU baseline DPDK was built for).
#[cfg(feature = "dpdk")]
fn build_dpdk_shim(manifest_dir: &std::path::Path) {
    let shim = manifest_dir.join("dpdk/shim.c");
    println!("cargo:rerun-if-changed={}", shim.display());
    let cflags = Command::new("pkg-config")
        .args(["--cflags", "libdpdk"])
        .output();
    let cflags = match cflags {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout).into_owned(),
        Ok(out) => fail_dpdk(&format!(
            "pkg-config does not know libdpdk: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) => fail_dpdk(&format!("cannot run pkg-config: {e}")),
    };
    let mut build = cc::Build::new();
    build.file(&shim).warnings(true).extra_warnings(true);
    // `-include rte_config.h` is two words; the rest are single flags.
    let mut words = cflags.split_whitespace();
    while let Some(word) = words.next() {
        if word == "-include" {
            if let Some(header) = words.next() {
                build.flag("-include").flag(header);
            }
        } else {
            build.flag(word);
        }
    }
    if let Err(e) = build.try_compile("xroce_dpdk_shim") {
        fail_dpdk(&format!("compiling {} failed: {e}", shim.display()));
    }
    for lib in DPDK_LIBS {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
}

/// Like [`fail`], for the DPDK part of the build.
#[cfg(feature = "dpdk")]
fn fail_dpdk(message: &str) -> ! {
    eprintln!("error: xroce-datapath (feature dpdk): {message}");
    eprintln!(
        "error: xroce-datapath: the DPDK port needs DPDK's development files; on Debian/Ubuntu \
         install them as root with:\n\n    {DPDK_APT_HINT}\n"
    );
    std::process::exit(1);
}

fn env_or_exit(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| fail(&format!("{name} is not set (run through cargo)")))
}

/// Prints the reason and the packages that fix the usual cause, then stops the build.
fn fail(message: &str) -> ! {
    eprintln!("error: xroce-datapath: {message}");
    eprintln!(
        "error: xroce-datapath: the XDP program needs clang (with the BPF target) and the libbpf \
         headers; on Debian/Ubuntu install them as root with:\n\n    {APT_HINT}\n"
    );
    std::process::exit(1);
}
