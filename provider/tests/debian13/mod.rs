//! Debian 13's RDMA userland (rdma-core 56, perftest 25.01), run on this Debian 12 machine
//! without installing it.
//!
//! The provider accepts libibverbs from rdma-core 36 to 58, but the machine's own packages are
//! rdma-core 44 only. Debian 13 (and Ubuntu 24.04, with rdma-core 50) users run a newer
//! libibverbs, so the tests run that one too: its packages, and those of the glibc it was built
//! against (2.41; Debian 12 has 2.36), are downloaded from Debian's archive
//! (`xroce_rxe_peer::debian::Archive`: nothing installed, the machine's apt set-up untouched)
//! and unpacked under the test's target directory. A program then runs through Debian 13's own
//! dynamic loader, which takes the libraries from there first:
//! `ld-linux-x86-64.so.2 --library-path <unpacked>:<host> PROGRAM`. The xroce provider
//! (`LD_PRELOAD`ed by `xroce exec`) is the one this workspace built; glibc runs programs built
//! against older releases, so it loads under the newer one.
//!
//! Not all of it is Debian 13's: libibverbs looks for hardware providers where its build says
//! (`/etc/libibverbs.d`, `/usr/lib/x86_64-linux-gnu/libibverbs`), so it loads the machine's
//! rdma-core 44 providers (same private ABI; they find no device), and perftest also links
//! Debian 13's copies of three of them. Neither touches the xroce device.

use std::fs;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use xroce_datapath::netns::run_bounded;
use xroce_rxe_peer::cache;
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
        let versions = fs::read_to_string(self.root.parent()?.join(cache::COMPLETE)).ok()?;
        versions
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{package} ")))
            .map(str::to_string)
    }
}

/// The userland under `CARGO_TARGET_TMPDIR`, fetched and unpacked on first use (a few seconds;
/// needs root and Debian's archive, as `cargo xtask test`'s package step does). The directory
/// is named after the package list, so a changed list is fetched afresh.
pub fn ensure() -> Userland {
    let mut h = DefaultHasher::new();
    PACKAGES.hash(&mut h);
    let dir =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("debian-13-rdma-{:016x}", h.finish()));
    if !cache::is_complete(&dir) {
        eprintln!(
            "fetching Debian 13's rdma-core and perftest ({}) into {}",
            PACKAGES.join(" "),
            dir.display()
        );
    }
    cache::build_once(&dir, |tmp| {
        let archive = Archive::open(DEBIAN_13, &tmp.join("apt"))?;
        let debs = archive.download(&PACKAGES, &tmp.join("debs"))?;
        let mut versions = String::new();
        for (package, deb) in PACKAGES.iter().zip(&debs) {
            let version = unpack(deb, &tmp.join("root"))?;
            versions.push_str(&format!("{package} {version}\n"));
        }
        let _ = fs::remove_dir_all(tmp.join("apt"));
        let _ = fs::remove_dir_all(tmp.join("debs"));
        fs::write(tmp.join(cache::COMPLETE), versions).map_err(|source| {
            xroce_rxe_peer::PeerError::Io {
                what: "marking the userland complete".into(),
                source,
            }
        })
    })
    .unwrap_or_else(|e| panic!("fetching Debian 13's rdma-core and perftest: {e}"));
    Userland {
        root: dir.join("root"),
    }
}
