//! Helpers for the end-to-end tests of several crates: where cargo put the binaries they run,
//! and compiling the small C verbs programs some of them use.

use std::path::{Path, PathBuf};
use std::process::Command;

/// `target/<profile>`, where cargo put the `xroce` binary, the provider library and the guest
/// agent (found from the running test executable, `target/<profile>/deps/NAME-HASH`).
pub fn build_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent()
        .and_then(|deps| deps.parent())
        .expect("test executable lives in target/<profile>/deps")
        .to_path_buf()
}

/// A workspace artifact in [`build_dir`]; fails the test, saying what to run, when it is not
/// built.
pub fn built(name: &str) -> PathBuf {
    let p = build_dir().join(name);
    assert!(
        p.exists(),
        "{} is missing; build the workspace first (cargo build --workspace)",
        p.display()
    );
    p
}

/// Compiles C program `source` against libibverbs (warnings are errors) into
/// `target/<profile>/c-tests/` and returns the executable.
pub fn compile_c(source: &Path) -> PathBuf {
    let name = source.file_stem().expect("a C source file name").to_owned();
    let dir = build_dir().join("c-tests");
    std::fs::create_dir_all(&dir).expect("create target/<profile>/c-tests");
    let exe = dir.join(name);
    let out = Command::new("cc")
        .args(["-O2", "-Wall", "-Wextra", "-Werror", "-pthread", "-o"])
        .arg(&exe)
        .arg(source)
        .arg("-libverbs")
        .output()
        .expect("run cc (install gcc and libibverbs-dev)");
    assert!(
        out.status.success(),
        "compiling {}:\n{}",
        source.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}
