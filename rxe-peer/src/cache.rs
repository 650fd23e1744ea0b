//! Cache directories built once and published whole.
//!
//! A guest image or an unpacked userland takes seconds to minutes to build, and two processes
//! may want the same one at once (a test binary and `cargo xtask rxe-peer up`, or two test runs).
//! Built in place, one could delete the other's half-built tree, or mark as complete a tree the
//! other was deleting. So each builder fills a directory of its own beside the target, marks it
//! complete, and renames it into place; a builder that finds the target already published
//! keeps that one and drops its own.

use std::fs;
use std::path::{Path, PathBuf};

use crate::{PeerError, Result};

/// The file a published directory holds (what it says is the builder's).
pub const COMPLETE: &str = "complete";

/// Whether `dir` was published.
pub fn is_complete(dir: &Path) -> bool {
    dir.join(COMPLETE).is_file()
}

/// Publishes `dir` unless it already is: `build` fills an empty private directory (and must
/// write [`COMPLETE`] last), which then becomes `dir`. Leftovers of builders that died are
/// removed first.
pub fn build_once(dir: &Path, build: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    if is_complete(dir) {
        return Ok(());
    }
    let (parent, name) = match (dir.parent(), dir.file_name()) {
        (Some(p), Some(n)) => (p, n.to_string_lossy().into_owned()),
        _ => {
            return Err(PeerError::io(
                format!("{}: not a directory to build", dir.display()),
                std::io::ErrorKind::InvalidInput.into(),
            ))
        }
    };
    fs::create_dir_all(parent)
        .map_err(|e| PeerError::io(format!("creating {}", parent.display()), e))?;
    let own = format!(".{name}.building.");
    for entry in fs::read_dir(parent).into_iter().flatten().flatten() {
        let n = entry.file_name().to_string_lossy().into_owned();
        let dead = n
            .strip_prefix(&own)
            .and_then(|pid| pid.parse::<u32>().ok())
            .is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists());
        if dead {
            let _ = fs::remove_dir_all(entry.path());
        }
    }
    let tmp: PathBuf = parent.join(format!("{own}{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp)
        .map_err(|e| PeerError::io(format!("creating {}", tmp.display()), e))?;
    if let Err(e) = build(&tmp) {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if !is_complete(&tmp) {
        let _ = fs::remove_dir_all(&tmp);
        return Err(PeerError::io(
            format!("{}: the build did not mark it complete", dir.display()),
            std::io::ErrorKind::InvalidData.into(),
        ));
    }
    // A target left incomplete (by a builder that wrote in place, before this scheme) goes;
    // one published meanwhile by another builder stays, and this build is dropped.
    if dir.exists() && !is_complete(dir) {
        let _ = fs::remove_dir_all(dir);
    }
    match fs::rename(&tmp, dir) {
        Ok(()) => Ok(()),
        Err(_) if is_complete(dir) => {
            let _ = fs::remove_dir_all(&tmp);
            Ok(())
        }
        Err(e) => {
            let _ = fs::remove_dir_all(&tmp);
            Err(PeerError::io(format!("publishing {}", dir.display()), e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("xroce-cache-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_directory_is_built_once_and_published_whole() {
        let base = scratch("once");
        let dir = base.join("thing");
        let mut builds = 0;
        for _ in 0..2 {
            build_once(&dir, |tmp| {
                builds += 1;
                assert_ne!(tmp, dir.as_path(), "built in place");
                fs::write(tmp.join("data"), "x").unwrap();
                fs::write(tmp.join(COMPLETE), "v1").unwrap();
                Ok(())
            })
            .unwrap();
        }
        assert_eq!(builds, 1);
        assert_eq!(fs::read_to_string(dir.join("data")).unwrap(), "x");
        // Nothing else is left beside it.
        assert_eq!(fs::read_dir(&base).unwrap().count(), 1);
        fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn failed_builds_and_leftovers_leave_no_trace_and_are_not_published() {
        let base = scratch("failed");
        let dir = base.join("thing");
        // An incomplete tree from an in-place builder, and a dead builder's directory.
        fs::create_dir_all(dir.join("half")).unwrap();
        fs::create_dir_all(base.join(".thing.building.4000000000")).unwrap();
        let failed = build_once(&dir, |tmp| {
            fs::write(tmp.join("data"), "x").unwrap();
            Err(PeerError::io("building", std::io::ErrorKind::Other.into()))
        });
        assert!(failed.is_err());
        let unmarked = build_once(&dir, |tmp| {
            fs::write(tmp.join("data"), "x").unwrap();
            Ok(())
        });
        assert!(
            unmarked.is_err(),
            "a build that did not mark itself complete was published"
        );
        assert!(!is_complete(&dir));
        build_once(&dir, |tmp| {
            fs::write(tmp.join(COMPLETE), "v1").unwrap();
            Ok(())
        })
        .unwrap();
        assert!(is_complete(&dir) && !dir.join("half").exists());
        let names: Vec<_> = fs::read_dir(&base)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("thing")]);
        fs::remove_dir_all(&base).unwrap();
    }
}
