//! `xroce exec -- PROGRAM [ARGS...]`: runs an unmodified libibverbs program with the xroce
//! devices of the current network namespace visible to it.
//!
//! On a kernel without RDMA, libibverbs falls back to reading `$SYSFS_PATH/class/...`; the
//! program gets `SYSFS_PATH` pointing at the tree the registry generates for this namespace
//! (rebuilt first, since addresses may have changed since `xroce link add`), and the provider
//! library preloaded (`LD_PRELOAD`): it registers itself with libibverbs from its constructor,
//! and interposes the few calls libibverbs would otherwise send to the kernel.

use std::ffi::OsString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use xroce_datapath::registry::{self, RegistryError};

/// File name of the provider library as cargo builds it (`cargo build -p xroce-provider`).
pub const PROVIDER_FILE: &str = "libxroce_provider.so";
/// Environment variable naming the provider library explicitly.
pub const PROVIDER_ENV: &str = "XROCE_PROVIDER";
/// Set to `1` in the program's environment, so the provider knows it runs under `xroce exec`.
pub const EXEC_ENV: &str = "XROCE_EXEC";

/// Runs `command` (program and arguments) in place of this process; returns only on failure.
pub fn run(command: &[OsString]) -> ExitCode {
    let Some((program, args)) = command.split_first() else {
        eprintln!("xroce exec: no program given (usage: xroce exec -- PROGRAM [ARGS...])");
        return ExitCode::from(2);
    };
    if let Some(why) = secure_exec_reason(program) {
        eprintln!(
            "xroce exec: warning: {} {why}, so it runs in secure-execution mode: the loader \
             ignores LD_PRELOAD and libibverbs ignores SYSFS_PATH, and it will see no xroce \
             device. Run a copy without that as root, or give it the capabilities through \
             the ambient set instead.",
            Path::new(program).display()
        );
    }
    let prepared = refresh_tree().and_then(|sysfs| Ok((sysfs, find_provider()?)));
    let (sysfs, provider) = match prepared {
        Ok(found) => found,
        Err(e) => {
            eprintln!("xroce exec: {e}");
            return ExitCode::FAILURE;
        }
    };
    let err = Command::new(program)
        .args(args)
        .env("SYSFS_PATH", &sysfs)
        .env(
            "LD_PRELOAD",
            ld_preload(&provider, std::env::var_os("LD_PRELOAD")),
        )
        .env(EXEC_ENV, "1")
        .exec();
    eprintln!(
        "xroce exec: cannot run {}: {err}",
        Path::new(program).display()
    );
    // The shell's conventions: 127 for a command not found, 126 for one that cannot run.
    ExitCode::from(if err.kind() == std::io::ErrorKind::NotFound {
        127
    } else {
        126
    })
}

/// Why `program` would run in secure-execution mode (`AT_SECURE`) for this process, if it
/// would: set-user-ID to another user, set-group-ID to another group, or with file
/// capabilities while this process is not root. `None` when it cannot be told (not found:
/// exec reports that).
fn secure_exec_reason(program: &OsString) -> Option<&'static str> {
    use std::os::unix::fs::MetadataExt;
    let path = resolve_program(Path::new(program))?;
    let meta = std::fs::metadata(&path).ok()?;
    // SAFETY: getuid and getgid cannot fail and touch no memory.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    if meta.mode() & libc::S_ISUID != 0 && meta.uid() != uid {
        return Some("is set-user-ID to another user");
    }
    if meta.mode() & libc::S_ISGID != 0 && meta.gid() != gid {
        return Some("is set-group-ID to another group");
    }
    let name = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: a NUL-terminated path and attribute name; size 0 asks for the length only.
    let caps = unsafe {
        libc::getxattr(
            name.as_ptr(),
            c"security.capability".as_ptr(),
            std::ptr::null_mut(),
            0,
        )
    };
    (caps > 0 && uid != 0).then_some("has file capabilities")
}

/// `program` as exec would find it: itself when it has a '/', else the first executable
/// file of that name in `$PATH`.
fn resolve_program(program: &Path) -> Option<PathBuf> {
    if program.as_os_str().as_bytes().contains(&b'/') {
        return Some(program.to_path_buf());
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
}

/// The provider library: `$XROCE_PROVIDER`, else `libxroce_provider.so` next to this
/// executable (where cargo puts both).
pub fn find_provider() -> Result<PathBuf, String> {
    let path = match std::env::var_os(PROVIDER_ENV).filter(|v| !v.is_empty()) {
        Some(path) => {
            let path = PathBuf::from(path);
            if !path.is_file() {
                return Err(format!(
                    "{PROVIDER_ENV}={} is not a file (it should name the xroce provider \
                     library, {PROVIDER_FILE})",
                    path.display()
                ));
            }
            path
        }
        None => std::env::current_exe()
            .ok()
            .and_then(|exe| Some(exe.parent()?.join(PROVIDER_FILE)))
            .filter(|p| p.is_file())
            .ok_or_else(|| {
                format!(
                    "cannot find the xroce provider library (build it with cargo build -p \
                     xroce-provider, or set {PROVIDER_ENV})"
                )
            })?,
    };
    // The dynamic loader splits LD_PRELOAD at ':' and ' ', and resolves relative names
    // against the program's working directory, which the program may change.
    let path = path
        .canonicalize()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if path
        .as_os_str()
        .as_bytes()
        .iter()
        .any(|b| b" :".contains(b))
    {
        return Err(format!(
            "the provider's path {} contains ':' or a space, which LD_PRELOAD cannot carry; \
             move it or set {PROVIDER_ENV}",
            path.display()
        ));
    }
    Ok(path)
}

/// `LD_PRELOAD` with the provider first, before whatever the caller preloads.
pub fn ld_preload(provider: &Path, existing: Option<OsString>) -> OsString {
    let mut value = provider.as_os_str().to_os_string();
    if let Some(existing) = existing.filter(|e| !e.is_empty()) {
        value.push(":");
        value.push(existing);
    }
    value
}

/// Regenerates this namespace's tree and returns its root, or says why there is nothing to
/// run on.
fn refresh_tree() -> Result<PathBuf, String> {
    let no_devices = "no xroce devices in this network namespace; create one with xroce link add \
                      NAME netdev DEV";
    match registry::regenerate() {
        Ok(tree) => {
            for (link, e) in &tree.hidden {
                eprintln!("xroce exec: warning: device {} is left out: {e}", link.name);
            }
            match tree.root {
                Some(root) if !tree.devices.is_empty() => Ok(root),
                Some(_) => Err("the netdevs of this network namespace's xroce devices are \
                                unavailable (see the warnings above); remove those links with \
                                xroce link del NAME"
                    .to_string()),
                None => Err(no_devices.to_string()),
            }
        }
        // Without root the tree cannot be rewritten; the one from the last refresh is still
        // right unless addresses changed since.
        Err(e @ RegistryError::PermissionDenied { .. }) => {
            let links = registry::links().map_err(|e| e.to_string())?;
            let root = registry::sysfs_root().map_err(|e| e.to_string())?;
            if links.is_empty() {
                return Err(no_devices.to_string());
            }
            if !root.is_dir() {
                return Err(e.to_string());
            }
            eprintln!(
                "xroce exec: warning: cannot refresh {} (needs root); using it as it is",
                root.display()
            );
            Ok(root)
        }
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provider_goes_first_in_ld_preload() {
        let p = Path::new("/opt/x/libxroce_provider.so");
        assert_eq!(
            ld_preload(p, None),
            OsString::from("/opt/x/libxroce_provider.so")
        );
        assert_eq!(
            ld_preload(p, Some(OsString::new())),
            OsString::from("/opt/x/libxroce_provider.so")
        );
        assert_eq!(
            ld_preload(p, Some(OsString::from("/lib/a.so:/lib/b.so"))),
            OsString::from("/opt/x/libxroce_provider.so:/lib/a.so:/lib/b.so")
        );
    }
}
