//! Debian 13's RDMA userland (rdma-core 56, perftest 25.01), run on this Debian 12 machine
//! without installing it.
//!
//! The provider accepts libibverbs from rdma-core 36 to 58, but the machine's own packages are
//! rdma-core 44 only. Debian 13 (and Ubuntu 24.04, with rdma-core 50) users run a newer
//! libibverbs, so the tests run that one too: its packages, and those of the glibc it was built
//! against (2.41; Debian 12 has 2.36), are downloaded with apt from Debian's archive (signatures
//! checked against the machine's `debian-archive-keyring`, nothing installed, the machine's
//! apt state untouched) and unpacked under the test's target directory. A program then runs
//! through Debian 13's own dynamic loader, which takes the libraries from there first:
//! `ld-linux-x86-64.so.2 --library-path <unpacked>:<host> PROGRAM`. The xroce provider
//! (`LD_PRELOAD`ed by `xroce exec`) is the one this workspace built; glibc runs programs built
//! against older releases, so it loads under the newer one.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use xroce_datapath::netns::run_bounded;

/// The release the files come from (Debian 13).
const SUITE: &str = "trixie";

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

/// Longest one apt step may take (the index is about 15 MB, the packages about 4 MB).
const APT_TIMEOUT: Duration = Duration::from_secs(300);

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
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("debian-{SUITE}-rdma"));
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
    let apt_dir = dir.join("apt");
    let debs = dir.join("debs");
    for d in [
        apt_dir.join("lists/partial"),
        apt_dir.join("cache/archives/partial"),
        debs.clone(),
        root.clone(),
    ] {
        fs::create_dir_all(&d).unwrap_or_else(|e| panic!("creating {}: {e}", d.display()));
    }
    let sources = apt_dir.join("sources.list");
    fs::write(
        &sources,
        format!(
            "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] \
             http://deb.debian.org/debian {SUITE} main\n"
        ),
    )
    .expect("write the sources list");
    // Only this sources list, its own index and cache, no lock on the machine's apt state.
    let options = [
        format!("Dir::Etc::SourceList={}", sources.display()),
        "Dir::Etc::SourceParts=/nonexistent".into(),
        format!("Dir::State::Lists={}", apt_dir.join("lists").display()),
        format!("Dir::Cache={}", apt_dir.join("cache").display()),
        "Debug::NoLocking=1".into(),
        // The downloads go to a directory only root may write.
        "APT::Sandbox::User=root".into(),
        "Acquire::Languages=none".into(),
        "Acquire::IndexTargets::deb::DEP-11::DefaultEnabled=false".into(),
        "Acquire::IndexTargets::deb::DEP-11-icons::DefaultEnabled=false".into(),
        "Acquire::IndexTargets::deb::DEP-11-icons-small::DefaultEnabled=false".into(),
    ];
    let apt = |args: &[&str], dir: &Path| {
        let mut cmd = Command::new("apt-get");
        for o in &options {
            cmd.args(["-o", o]);
        }
        cmd.args(args).current_dir(dir);
        let out = run_bounded(cmd, APT_TIMEOUT)
            .unwrap_or_else(|e| panic!("apt-get {args:?} for Debian 13's rdma-core: {e}"));
        assert!(
            out.status.success(),
            "apt-get {args:?} for Debian 13's rdma-core failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    };
    apt(&["-q", "update"], &dir);
    let mut download = vec!["-q", "download"];
    download.extend(PACKAGES);
    apt(&download, &debs);
    let mut versions = String::new();
    for package in PACKAGES {
        let deb = fs::read_dir(&debs)
            .expect("list the downloads")
            .flatten()
            .map(|e| e.path())
            .find(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with(&format!("{package}_")))
            })
            .unwrap_or_else(|| panic!("apt-get download left no {package}_*.deb"));
        let mut cmd = Command::new("dpkg-deb");
        cmd.arg("-x").arg(&deb).arg(&root);
        let out = run_bounded(cmd, Duration::from_secs(60)).expect("run dpkg-deb");
        assert!(
            out.status.success(),
            "dpkg-deb -x {}: {out:?}",
            deb.display()
        );
        let mut cmd = Command::new("dpkg-deb");
        cmd.args(["-f"]).arg(&deb).arg("Version");
        let out = run_bounded(cmd, Duration::from_secs(60)).expect("run dpkg-deb");
        versions.push_str(&format!(
            "{package} {}\n",
            String::from_utf8_lossy(&out.stdout).trim()
        ));
    }
    let _ = fs::remove_dir_all(&apt_dir);
    let _ = fs::remove_dir_all(&debs);
    fs::write(dir.join(COMPLETE), versions).expect("mark the userland complete");
    Userland { root }
}
