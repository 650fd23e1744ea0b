//! Ctrl-C, SIGTERM and SIGHUP during a benchmark. An interrupted process runs no `Drop`, so
//! without this its namespaces would stay behind, and with them the perftest programs (which
//! run in process groups of their own, out of the terminal's reach) and the guests in them.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use xroce_datapath::netns;

/// From now on a SIGINT, SIGTERM or SIGHUP makes `program` remove the namespaces it made
/// ([`netns::remove_tracked`]: pairs, and whatever else was [`netns::track`]ed) and everything
/// running in them, then exit with 128 + the signal's number.
pub fn remove_namespaces_when_interrupted(program: &'static str) {
    let mut signals = match Signals::new([SIGINT, SIGTERM, SIGHUP]) {
        Ok(signals) => signals,
        Err(e) => {
            eprintln!("{program}: cannot watch for Ctrl-C ({e}); an interrupted run will leave its namespaces");
            return;
        }
    };
    let watcher = std::thread::Builder::new()
        .name("interrupt".into())
        .spawn(move || {
            if let Some(signal) = signals.forever().next() {
                eprintln!(
                    "\n{program}: interrupted; removing the network namespaces this run made, and \
                     the programs and guests in them"
                );
                let mut removed = netns::remove_tracked();
                // After the namespaces: the guests writing into these directories are gone.
                for dir in WORK_DIRS.lock().unwrap_or_else(|p| p.into_inner()).iter() {
                    if std::fs::remove_dir_all(dir).is_ok() {
                        removed.push(dir.display().to_string());
                    }
                }
                eprintln!(
                    "{program}: removed {}",
                    if removed.is_empty() {
                        "nothing (no namespace was left)".to_string()
                    } else {
                        removed.join(", ")
                    }
                );
                std::process::exit(128 + signal);
            }
        });
    if let Err(e) = watcher {
        eprintln!("{program}: cannot start the Ctrl-C watcher ({e}); an interrupted run will leave its namespaces");
    }
}

/// Directories of [`TrackedNamespace`]s, removed after their namespaces.
static WORK_DIRS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Lists a namespace made outside [`netns::NetnsPair`] (the guests' lab), and the directory
/// of files that goes with it, for removal on interruption while the guard lives. Declare it
/// before what owns them, so that it is dropped after it.
pub struct TrackedNamespace {
    ns: String,
    work_dir: PathBuf,
}

impl TrackedNamespace {
    pub fn new(ns: &str, work_dir: &Path) -> TrackedNamespace {
        netns::track(ns, &[]);
        WORK_DIRS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(work_dir.to_path_buf());
        TrackedNamespace {
            ns: ns.to_string(),
            work_dir: work_dir.to_path_buf(),
        }
    }
}

impl Drop for TrackedNamespace {
    fn drop(&mut self) {
        netns::untrack(&self.ns);
        WORK_DIRS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|dir| *dir != self.work_dir);
    }
}
