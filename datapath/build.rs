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

use std::path::PathBuf;
use std::process::Command;

const APT_HINT: &str = "apt-get install -y clang libbpf-dev linux-libc-dev";

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
