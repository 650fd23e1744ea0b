//! Debian 13's RDMA userland (rdma-core 56, perftest 25.01), run on this Debian 12 machine
//! without installing it.
//!
//! The provider accepts libibverbs from rdma-core 36 to 58, but the machine's own packages are
//! rdma-core 44 only. Debian 13 (and Ubuntu 24.04, with rdma-core 50) users run a newer
//! libibverbs, so the tests run that one too: its packages, and those of the glibc it was built
//! against (2.41; Debian 12 has 2.36), are downloaded from Debian's archive
//! (`xroce_rxe_peer::debian::Archive`: nothing installed, the machine's apt state untouched) and
//! unpacked under the test's target directory. A program then runs
//! through Debian 13's own dynamic loader, which takes the libraries from there first:
//! `ld-linux-x86-64.so.2 --library-path <unpacked>:<host> PROGRAM`. The xroce provider
//! (`LD_PRELOAD`ed by `xroce exec`) is the one this workspace built; glibc runs programs built
//! against older releases, so it loads under the newer one.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use xroce_datapath::netns::run_bounded;
use xroce_rxe_peer::debian::{unpack, Archive, DEBIAN_13};

/// The packages: glibc, libibverbs and its example programs, perftest and what its programs
/// load. Libraries Debian 12 has in a compatible form (libudev, zlib, libgcc_s) come from
/// the machine.
const PACKAGES: [&str; 10] = [
    "libc6",
    "libibverbs1",
    "ibverbs-utils",
    "libnl-3-200",
    "libnl-route-3-200",
    "perftest",
    "ibverbs-providers",
    "librdmacm1t64",
    "libibumad3",
    "libpci3",
];

/// The machine's own library directories, searched after the unpacked ones.
const HOST_LIBRARIES: [&str; 2] = ["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu"];

/// The unpacked userland.
pub struct Userland {
    /// What the packages unpacked to (`usr/bin`, `usr/lib/x86_64-linux-gnu`).
    root: PathBuf,
}

impl Userland {
    /// The unpacked libraries' directory.
    fn libraries(&self) -> PathBuf {
        self.root.join("usr/lib/x86_64-linux-gnu")
    }

    /// The start of a command line that runs Debian 13's `program` (e.g. `ibv_rc_pingpong`)
    /// with Debian 13's libraries: its loader, the library path, the program.
    pub fn command(&self, program: &str) -> Vec<String> {
        let mut path = vec![self.libraries().display().to_string()];
        path.extend(HOST_LIBRARIES.iter().map(|s| s.to_string()));
        vec![
            self.libraries()
                .join("ld-linux-x86-64.so.2")
                .display()
                .to_string(),
            "--library-path".into(),
            path.join(":"),
            self.root
                .join("usr/bin")
                .join(program)
                .display()
                .to_string(),
        ]
    }

    /// Which file each library `program` needs resolves to, as the loader lists them
    /// (`ld.so --list`): `name => path` lines.
    pub fn resolved_libraries(&self, program: &str) -> String {
        let mut line = self.command(program);
        line.insert(1, "--list".into());
        let mut cmd = Command::new(&line[0]);
        cmd.args(&line[1..]);
        let out = run_bounded(cmd, Duration::from_secs(30)).expect("run ld.so --list");
        assert!(out.status.success(), "ld.so --list {program}: {out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The version of an unpacked package, as recorded when it was fetched.
    pub fn version(&self, package: &str) -> Option<String> {
        let versions = fs::read_to_string(self.root.parent()?.join(COMPLETE)).ok()?;
        versions
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{package} ")))
            .map(str::to_string)
    }
}

/// Written last, with `package version` lines: the unpacked tree is whole.
const COMPLETE: &str = "complete";

/// The userland under `CARGO_TARGET_TMPDIR`, fetched and unpacked on first use (a few seconds;
/// needs root and Debian's archive, as `cargo xtask test`'s package step does).
pub fn ensure() -> Userland {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("debian-13-rdma");
    let root = dir.join("root");
    if dir.join(COMPLETE).exists() {
        return Userland { root };
    }
    eprintln!(
        "fetching Debian 13's rdma-core and perftest ({}) into {}",
        PACKAGES.join(" "),
        dir.display()
    );
    let _ = fs::remove_dir_all(&dir);
    let archive = Archive::open(DEBIAN_13, &dir.join("apt"))
        .unwrap_or_else(|e| panic!("reading Debian 13's package index: {e}"));
    let debs = archive
        .download(&PACKAGES, &dir.join("debs"))
        .unwrap_or_else(|e| panic!("downloading Debian 13's rdma-core: {e}"));
    let mut versions = String::new();
    for (package, deb) in PACKAGES.iter().zip(&debs) {
        let version = unpack(deb, &root).unwrap_or_else(|e| panic!("{e}"));
        versions.push_str(&format!("{package} {version}\n"));
    }
    let _ = fs::remove_dir_all(dir.join("apt"));
    let _ = fs::remove_dir_all(dir.join("debs"));
    fs::write(dir.join(COMPLETE), versions).expect("mark the userland complete");
    Userland { root }
}
