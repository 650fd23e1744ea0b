//! Ctrl-C, SIGTERM and SIGHUP during a benchmark. An interrupted process runs no `Drop`, so
//! without this its namespaces would stay behind, and with them the perftest programs (which
//! run in process groups of their own, out of the terminal's reach) and the guests in them.

use std::fs::File;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, OnceLock};
use std::time::{Duration, Instant};

use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use xroce_datapath::netns;

/// The prefix of every namespace the benchmarks make (`<prefix>-<pid>-...`): their namespace
/// pairs and the guests' lab. An interrupted run removes those named with its process id.
pub const NAMESPACE_PREFIX: &str = "xrbench";

/// How soon after the first signal another one counts as a second Ctrl-C, which ends the
/// program without cleaning up: `cargo xtask bench` passes its signal on, and that copy may
/// come right after the terminal's own.
const SECOND_SIGNAL_AFTER: Duration = Duration::from_secs(1);

/// Set when a clean-up starts: from then on only the clean-up ends the process.
static CLEANING_UP: AtomicBool = AtomicBool::new(false);

/// The terminal's stderr, kept while fd 2 points at /dev/null during a clean-up.
static TERMINAL: OnceLock<File> = OnceLock::new();

/// Writes a line to the terminal, ignoring failures: after SIGHUP it may be gone, and
/// `eprintln!` would panic there. During a clean-up it goes to the saved terminal, without
/// std's stderr lock (a thread parked after a panic may hold it).
fn say(text: &str) {
    match TERMINAL.get() {
        Some(mut terminal) => {
            let _ = writeln!(terminal, "{text}");
        }
        None => {
            let _ = writeln!(std::io::stderr(), "{text}");
        }
    }
}

/// Ends the process with `code`, unless a clean-up after a signal is under way: then the
/// calling thread waits for the clean-up to end the process. For the benchmarks' own exits
/// (`main`'s end, a failure), which would otherwise cut the clean-up short.
pub fn exit(code: i32) -> ! {
    if CLEANING_UP.load(Ordering::SeqCst) {
        park_forever();
    }
    std::process::exit(code)
}

fn park_forever() -> ! {
    loop {
        std::thread::park();
    }
}

/// From now on a SIGINT, SIGTERM or SIGHUP makes `program` remove its namespaces
/// ([`netns::remove_own_namespaces`]) with everything in them, and the guests' files, then
/// exit with 128 + the signal's number. A second signal a second or more later ends it at
/// once. Returns once the signals are watched.
pub fn remove_namespaces_when_interrupted(program: &'static str) {
    let (registered, watching) = mpsc::channel();
    // The thread registers the signals itself, so that if it cannot start none is swallowed.
    let watcher = std::thread::Builder::new()
        .name("interrupt".into())
        .spawn(move || match Signals::new([SIGINT, SIGTERM, SIGHUP]) {
            Ok(signals) => {
                let _ = registered.send(Ok(()));
                watch(program, signals);
            }
            Err(e) => {
                let _ = registered.send(Err(e));
            }
        });
    let outcome = match watcher {
        Ok(_) => watching
            .recv()
            .unwrap_or_else(|_| Err(std::io::Error::other("the watcher thread ended"))),
        Err(e) => Err(e),
    };
    if let Err(e) = outcome {
        say(&format!(
            "{program}: cannot watch for Ctrl-C ({e}); an interrupted run will leave its namespaces"
        ));
    }
}

fn watch(program: &'static str, mut signals: Signals) {
    let mut first: Option<Instant> = None;
    for signal in signals.forever() {
        match first {
            None => {
                first = Some(Instant::now());
                CLEANING_UP.store(true, Ordering::SeqCst);
                say(&format!(
                    "\n{program}: interrupted; removing the network namespaces this run made, \
                     and the programs and guests in them (Ctrl-C again to stop at once)"
                ));
                let cleanup = std::thread::Builder::new()
                    .name("clean-up".into())
                    .spawn(move || clean_up_and_exit(program, signal));
                if cleanup.is_err() {
                    clean_up_and_exit(program, signal);
                }
            }
            Some(at) if at.elapsed() >= SECOND_SIGNAL_AFTER => {
                say(&format!("{program}: stopped without cleaning up"));
                let _ = signal_hook::low_level::emulate_default_handler(signal);
                std::process::exit(128 + signal);
            }
            Some(_) => {}
        }
    }
}

fn clean_up_and_exit(program: &str, signal: i32) -> ! {
    // The benchmark's own threads run on and fail as their namespaces go (engines report
    // their devices failed, checks panic): what they say now is noise, so stderr goes to
    // /dev/null and only the clean-up's lines reach the terminal. A thread that panics now
    // stops where it is, so that its panic cannot end the process before the clean-up does.
    quiet_stderr();
    std::panic::set_hook(Box::new(|_| park_forever()));
    netns::refuse_new_namespaces();
    let mut removed = Vec::new();
    for (name, outcome) in netns::remove_own_namespaces(&[NAMESPACE_PREFIX]) {
        match outcome {
            Ok(()) => removed.push(name),
            Err(e) => say(&format!(
                "{program}: could not remove namespace {name}: {e}"
            )),
        }
    }
    // After the namespaces: the guests writing into these directories are gone.
    let mut dirs = Vec::new();
    for name in &removed {
        let dir = xroce_rxe_peer::lab::work_dir_for(name);
        if std::fs::remove_dir_all(&dir).is_ok() {
            dirs.push(dir.display().to_string());
        }
    }
    say(&format!(
        "{program}: removed {}",
        if removed.is_empty() {
            "nothing (no namespace was left)".to_string()
        } else {
            removed
                .into_iter()
                .chain(dirs)
                .collect::<Vec<_>>()
                .join(", ")
        }
    ));
    std::process::exit(128 + signal);
}

/// Keeps the terminal's stderr in [`TERMINAL`] (close-on-exec, so that programs started
/// meanwhile do not inherit it) and points fd 2 at /dev/null. Leaves stderr as it is if
/// either step fails.
fn quiet_stderr() {
    use std::os::fd::{AsRawFd, FromRawFd};
    let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null") else {
        return;
    };
    // SAFETY: fcntl F_DUPFD_CLOEXEC duplicates fd 2 to a new fd (or returns -1).
    let saved = unsafe { libc::fcntl(2, libc::F_DUPFD_CLOEXEC, 3) };
    if saved < 0 {
        return;
    }
    // SAFETY: `saved` is the fresh fd just returned; nothing else owns it.
    let terminal = unsafe { File::from_raw_fd(saved) };
    if TERMINAL.set(terminal).is_err() {
        return;
    }
    // SAFETY: dup2 onto fd 2 replaces stderr atomically; both fds are open.
    unsafe {
        libc::dup2(null.as_raw_fd(), 2);
    }
}
