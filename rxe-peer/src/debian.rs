//! Packages of another Debian release, fetched without touching the machine's apt set-up.
//!
//! The host is Debian 12, but RDMA users run newer releases: Debian 13 ships rdma-core 56 and
//! kernel 6.12, whose rdma_rxe differs from 6.1's. [`Archive`] reads one suite of Debian's
//! archive through apt with a sources list, index and cache of its own (signatures checked
//! against the machine's `debian-archive-keyring`, no lock taken on the machine's apt state,
//! nothing installed, none of the machine's apt configuration or hooks), so that tests and
//! guests can use that release's packages as files.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{run_checked, PeerError, Result};

/// Debian 13.
pub const DEBIAN_13: &str = "trixie";
/// Newer packages built for Debian 13, its kernels among them.
pub const DEBIAN_13_BACKPORTS: &str = "trixie-backports";

/// One suite of Debian's archive (`main`), with apt state under a directory of its own.
pub struct Archive {
    suite: String,
    /// The configuration apt reads instead of the machine's (`APT_CONFIG`).
    config: PathBuf,
}

/// The machine's apt settings a private configuration keeps: how this machine reaches the
/// archive (a proxy) and how it checks the dates of what it gets (a mirror that serves a
/// snapshot needs those checks relaxed, as the machine's own configuration says).
const KEPT_SETTINGS: [&str; 4] = [
    "Acquire::http::Proxy",
    "Acquire::https::Proxy",
    "Acquire::Check-Valid-Until",
    "Acquire::Check-Date",
];

impl Archive {
    /// Reads the index of `suite` into `state` (about 15 MB for `main`; a few seconds).
    ///
    /// apt reads a configuration of its own (`APT_CONFIG`): no part of `/etc/apt` but the
    /// settings in `KEPT_SETTINGS`, so the machine's update hooks (appstream, packagekit,
    /// cache clean-ups) do not run, its installed packages and pins do not steer the choice,
    /// and no lock is taken.
    pub fn open(suite: &str, state: &Path) -> Result<Archive> {
        let empty = state.join("empty");
        for d in [
            state.join("lists/partial"),
            state.join("cache/archives/partial"),
            empty.clone(),
        ] {
            fs::create_dir_all(&d)
                .map_err(|e| PeerError::io(format!("creating {}", d.display()), e))?;
        }
        let sources = state.join("sources.list");
        fs::write(
            &sources,
            format!(
                "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] \
                 http://deb.debian.org/debian {suite} main\n"
            ),
        )
        .map_err(|e| PeerError::io("writing the sources list", e))?;
        let host = run_checked(Command::new("apt-config").arg("dump"), "apt-config dump")?;
        let mut config = format!(
            "Dir::Etc::Main \"/dev/null\";\n\
             Dir::Etc::Parts \"{empty}\";\n\
             Dir::Etc::Preferences \"/dev/null\";\n\
             Dir::Etc::PreferencesParts \"{empty}\";\n\
             Dir::Etc::SourceList \"{sources}\";\n\
             Dir::Etc::SourceParts \"{empty}\";\n\
             Dir::State::Lists \"{lists}\";\n\
             Dir::State::status \"/dev/null\";\n\
             Dir::Cache \"{cache}\";\n\
             Debug::NoLocking \"true\";\n\
             APT::Architectures {{ \"amd64\"; }};\n\
             APT::Sandbox::User \"root\";\n\
             Acquire::Languages \"none\";\n\
             Acquire::Retries \"3\";\n\
             Acquire::http::Timeout \"60\";\n",
            empty = empty.display(),
            sources = sources.display(),
            lists = state.join("lists").display(),
            cache = state.join("cache").display(),
        );
        for key in KEPT_SETTINGS {
            let prefix = format!("{key} \"");
            if let Some(line) = host.lines().find(|l| l.starts_with(&prefix)) {
                config.push_str(line);
                config.push('\n');
            }
        }
        let config_file = state.join("apt.conf");
        fs::write(&config_file, config).map_err(|e| PeerError::io("writing apt.conf", e))?;
        let archive = Archive {
            suite: suite.to_string(),
            config: config_file,
        };
        run_checked(
            &mut archive.command("apt-get", &["-q", "update"]),
            &format!("apt-get update (Debian {suite})"),
        )?;
        Ok(archive)
    }

    fn command(&self, program: &str, args: &[&str]) -> Command {
        let mut cmd = Command::new(program);
        cmd.env("APT_CONFIG", &self.config).args(args);
        cmd
    }

    /// The packages `package` depends on directly (e.g. the concrete kernel behind
    /// `linux-image-amd64`).
    pub fn depends(&self, package: &str) -> Result<Vec<String>> {
        let out = run_checked(
            &mut self.command("apt-cache", &["depends", package]),
            &format!("apt-cache depends {package} (Debian {})", self.suite),
        )?;
        Ok(depends_in(&out))
    }

    /// Downloads `packages` into `into`; returns each package's `.deb`, in the order asked.
    pub fn download(&self, packages: &[&str], into: &Path) -> Result<Vec<PathBuf>> {
        fs::create_dir_all(into)
            .map_err(|e| PeerError::io(format!("creating {}", into.display()), e))?;
        let mut args = vec!["-q", "download"];
        args.extend(packages);
        run_checked(
            self.command("apt-get", &args).current_dir(into),
            &format!(
                "apt-get download {} (Debian {})",
                packages.join(" "),
                self.suite
            ),
        )?;
        let files: Vec<PathBuf> = fs::read_dir(into)
            .map_err(|e| PeerError::io("listing the downloads", e))?
            .flatten()
            .map(|e| e.path())
            .collect();
        packages
            .iter()
            .map(|p| {
                files
                    .iter()
                    .find(|f| {
                        f.file_name().is_some_and(|n| {
                            let n = n.to_string_lossy();
                            n.starts_with(&format!("{p}_")) && n.ends_with(".deb")
                        })
                    })
                    .cloned()
                    .ok_or_else(|| PeerError::Command {
                        what: format!("apt-get download {p}"),
                        status: format!("no {p}_*.deb in {}", into.display()),
                        stderr: "(apt-get reported success)".into(),
                    })
            })
            .collect()
    }
}

/// The direct dependencies `apt-cache depends` printed.
pub(crate) fn depends_in(apt_cache_output: &str) -> Vec<String> {
    apt_cache_output
        .lines()
        .filter_map(|l| l.trim().strip_prefix("Depends: "))
        .map(str::to_string)
        .collect()
}

/// Unpacks `deb` under `root` (`dpkg-deb -x`); returns the package's version.
pub fn unpack(deb: &Path, root: &Path) -> Result<String> {
    run_checked(
        Command::new("dpkg-deb").arg("-x").arg(deb).arg(root),
        &format!("dpkg-deb -x {}", deb.display()),
    )?;
    let version = run_checked(
        Command::new("dpkg-deb").arg("-f").arg(deb).arg("Version"),
        &format!("dpkg-deb -f {} Version", deb.display()),
    )?;
    Ok(version.trim().to_string())
}
