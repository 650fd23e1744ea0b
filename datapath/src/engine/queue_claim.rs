//! Which process holds an interface queue.
//!
//! An AF_XDP queue takes one socket, so an xroce device serves one RDMA process at a time, and
//! the kernel only says `EBUSY` to the next one. Each engine leaves a note of its process
//! while it holds the queue, so that a second engine can name the process in its way ("in use
//! by process 1234 (ib_write_bw)") instead of leaving the user to guess. A note outlives a process killed with SIGKILL; it names the
//! process's start time too, so a note whose process is gone (or whose PID was reused) is
//! not believed, and the next engine on the queue overwrites it.
//!
//! A DPDK engine takes the whole interface (its driver sees every frame, and an AF_XDP socket
//! on any queue would take RoCEv2 frames from it): its note is `<iface>.dpdk`, and each kind
//! of engine refuses to start while a live note of the other kind is there. Between the two
//! kinds the notes are the only guard (the kernel refuses a second AF_XDP socket on a queue,
//! and a second DPDK engine's UDP socket, but sees no conflict between the kinds), so an
//! engine checks and writes them holding the start lock (a `flock` on the notes' directory,
//! for every interface: starts are rare and short), and two engines starting at once cannot
//! both pass. Where `/run/xroce` cannot be written there are no notes, and no such guard.
//!
//! The notes sit in one directory of their own, `/run/xroce/queues/<netns-id>.<iface>.<queue>`
//! (the network namespace's id as in the registry), not in the registry's per-namespace
//! directories: those belong to `xroce link`, which removes them with a namespace's last link,
//! and engines run in namespaces without links too.

use std::fmt;
use std::fs;
use std::path::PathBuf;

/// The process named in a queue's note, when it still runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueHolder {
    pub pid: u32,
    /// Its command name (`/proc/PID/comm`).
    pub command: String,
    /// Whether its engine's sockets carry frames longer than one UMEM frame
    /// (`Engine::is_multi_buffer`), which decides the port's active MTU; `None` from a note
    /// of an older xroce, which did not say.
    pub multi_buffer: Option<bool>,
}

impl fmt::Display for QueueHolder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "process {} ({})", self.pid, self.command)
    }
}

/// This process's note on a queue; dropping it removes the note.
#[derive(Debug)]
pub(crate) struct QueueClaim {
    path: PathBuf,
}

impl Drop for QueueClaim {
    fn drop(&mut self) {
        // Only our own note: a later engine (after this one's socket went) may have written its
        // own in the meantime.
        if read_note(&self.path).is_some_and(|n| n.pid == std::process::id()) {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Leaves a note that this process holds `queue` of `iface` (in the calling thread's network
/// namespace), with whether its engine's sockets carry multi-buffer. `None` when it cannot be
/// written: a second engine on the queue is then still refused by the kernel, only without
/// its holder's name.
pub(crate) fn claim(iface: &str, queue: u32, multi_buffer: bool) -> Option<QueueClaim> {
    claim_note(iface, &queue.to_string(), multi_buffer)
}

/// Leaves a note that this process's DPDK engine holds all of `iface`.
#[cfg_attr(not(feature = "dpdk"), allow(dead_code))]
pub(crate) fn claim_interface(iface: &str, multi_buffer: bool) -> Option<QueueClaim> {
    claim_note(iface, DPDK_NOTE, multi_buffer)
}

/// The note name of a DPDK engine (which takes the whole interface).
const DPDK_NOTE: &str = "dpdk";

fn claim_note(iface: &str, key: &str, multi_buffer: bool) -> Option<QueueClaim> {
    let path = note_path(iface, key)?;
    let pid = std::process::id();
    let started = start_time(pid)?;
    let dir = path.parent()?;
    fs::create_dir_all(dir).ok()?;
    remove_dead_notes(dir);
    // Written aside and renamed, so that a reader never sees half a note.
    let partial = path.with_extension(format!("{key}.{pid}.new"));
    let note = Note {
        pid,
        started,
        multi_buffer: Some(multi_buffer),
    };
    fs::write(&partial, note.to_string()).ok()?;
    if fs::rename(&partial, &path).is_err() {
        let _ = fs::remove_file(&partial);
        return None;
    }
    Some(QueueClaim { path })
}

/// Held while an engine checks the other kind's note, opens its port and leaves its own note
/// (see the module's text); dropping it lets the next start go on. `None` when the lock file
/// cannot be made (no guard then).
pub(crate) struct StartLock {
    _file: fs::File,
}

/// How long a start waits for the start lock. Starts hold it for well under a second; one
/// held far longer is stuck: its process stopped mid-start (in a debugger, say), or a child
/// forked by the starting process meanwhile keeps the locked descriptor until it exits.
const START_LOCK_BOUND: std::time::Duration = std::time::Duration::from_secs(20);

pub(crate) fn start_lock(iface: &str) -> Option<StartLock> {
    note_prefix(iface)?;
    let dir = notes_dir();
    fs::create_dir_all(&dir).ok()?;
    match lock_within(&dir, START_LOCK_BOUND) {
        Ok(file) => Some(StartLock { _file: file }),
        Err(Some(held)) => {
            // Going on without the guard risks what it guards against (an AF_XDP and a DPDK
            // engine both taking the interface); waiting on would hang this verb for good.
            crate::stderr_line!(
                "xroce: another xroce start has held {} for {} s; starting without waiting \
                 for it ({held})",
                dir.display(),
                START_LOCK_BOUND.as_secs()
            );
            None
        }
        Err(None) => None,
    }
}

/// An exclusive `flock` on `dir`, waited for up to `bound`. `Err(Some(why))` when it stayed
/// held that long, `Err(None)` when it cannot be taken at all.
fn lock_within(
    dir: &std::path::Path,
    bound: std::time::Duration,
) -> Result<fs::File, Option<String>> {
    use std::os::fd::AsRawFd;
    let file = fs::File::open(dir).map_err(|_| None)?;
    let until = std::time::Instant::now() + bound;
    loop {
        // SAFETY: flock on a descriptor this function owns; the lock goes with the file.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(file);
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(None);
        }
        if std::time::Instant::now() >= until {
            return Err(Some(err.to_string()));
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Removes the notes of processes that ended without removing theirs (killed, or exited
/// without closing their device), so that the directory does not grow with every network
/// namespace an engine ever ran in. Notes being written (`*.new`) are left alone.
fn remove_dead_notes(dir: &std::path::Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "new") {
            continue;
        }
        let alive = read_note(&path).is_some_and(|n| start_time(n.pid) == Some(n.started));
        if !alive {
            let _ = fs::remove_file(&path);
        }
    }
}

/// The process whose note says it holds `queue` of `iface` (in the calling thread's network
/// namespace), if it still runs.
pub fn holder(iface: &str, queue: u32) -> Option<QueueHolder> {
    holder_of(&note_path(iface, &queue.to_string())?)
}

/// The process whose DPDK engine holds `iface`, if it still runs.
pub fn interface_holder(iface: &str) -> Option<QueueHolder> {
    holder_of(&note_path(iface, DPDK_NOTE)?)
}

/// Whether the engine that holds `iface` (in the calling thread's network namespace), if one
/// runs, carries multi-buffer frames: what its port's active MTU follows, for a process that
/// asks without running that engine (`xroce link show`, `ibv_devinfo` beside the program).
/// `None` when no engine holds it, or its note does not say.
pub fn holder_multi_buffer(iface: &str) -> Option<bool> {
    // Queue 0 first: engines send there unless told otherwise, and two engines on other
    // queues of one interface (each told to take only its own) may differ.
    interface_holder(iface)
        .or_else(|| holder(iface, 0))
        .or_else(|| any_queue_holder(iface))
        .and_then(|h| h.multi_buffer)
}

/// A process whose AF_XDP engine holds a queue of `iface`, if one still runs.
pub fn any_queue_holder(iface: &str) -> Option<QueueHolder> {
    let prefix = note_prefix(iface)?;
    fs::read_dir(notes_dir()).ok()?.flatten().find_map(|entry| {
        let name = entry.file_name();
        let queue = name.to_str()?.strip_prefix(prefix.as_str())?;
        if queue.is_empty() || !queue.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        holder_of(&entry.path())
    })
}

fn holder_of(path: &std::path::Path) -> Option<QueueHolder> {
    let note = read_note(path)?;
    if start_time(note.pid)? != note.started {
        return None;
    }
    let command = fs::read_to_string(format!("/proc/{}/comm", note.pid)).ok()?;
    Some(QueueHolder {
        pid: note.pid,
        command: command.trim().to_string(),
        multi_buffer: note.multi_buffer,
    })
}

fn note_path(iface: &str, key: &str) -> Option<PathBuf> {
    Some(notes_dir().join(format!("{}{key}", note_prefix(iface)?)))
}

fn notes_dir() -> PathBuf {
    std::path::Path::new(crate::registry::RUN_ROOT).join("queues")
}

/// `<netns-id>.<iface>.`, the start of every note on `iface` in this network namespace.
fn note_prefix(iface: &str) -> Option<String> {
    // Interface names never contain '/' (the kernel refuses them), but this is a path.
    if iface.is_empty() || iface.contains('/') || iface.starts_with('.') {
        return None;
    }
    let netns = crate::registry::netns_id().ok()?;
    Some(format!("{netns}.{iface}."))
}

/// What a note says: `"PID START MULTI_BUFFER\n"`, the last `0` or `1` (notes of older xroce
/// end after START, and a reader takes the first two fields of any longer note).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Note {
    pid: u32,
    /// When the process started (see [`start_time`]).
    started: u64,
    multi_buffer: Option<bool>,
}

impl fmt::Display for Note {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.pid, self.started)?;
        if let Some(m) = self.multi_buffer {
            write!(f, " {}", u8::from(m))?;
        }
        writeln!(f)
    }
}

fn read_note(path: &std::path::Path) -> Option<Note> {
    parse_note(&fs::read_to_string(path).ok()?)
}

fn parse_note(text: &str) -> Option<Note> {
    let mut fields = text.split_whitespace();
    let pid = fields.next()?.parse().ok()?;
    let started = fields.next()?.parse().ok()?;
    let multi_buffer = match fields.next() {
        Some("1") => Some(true),
        Some("0") => Some(false),
        _ => None,
    };
    Some(Note {
        pid,
        started,
        multi_buffer,
    })
}

/// When process `pid` started, in clock ticks since boot (`/proc/PID/stat`, field 22): with
/// the PID, it names one process, PIDs being reused.
fn start_time(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    crate::cpu_time::stat_field(&stat, 22)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_start_lock_held_for_good_is_waited_for_only_so_long() {
        use std::os::fd::AsRawFd;
        let dir = std::env::temp_dir().join(format!("xroce-start-lock-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let free = lock_within(&dir, std::time::Duration::ZERO);
        assert!(free.is_ok(), "a free lock is taken at once");
        drop(free);
        // Held by another open file description, as by a stuck process.
        let holder = fs::File::open(&dir).unwrap();
        // SAFETY: flock on a descriptor this test owns.
        assert_eq!(unsafe { libc::flock(holder.as_raw_fd(), libc::LOCK_EX) }, 0);
        let (tx, rx) = std::sync::mpsc::channel();
        let d = dir.clone();
        std::thread::spawn(move || {
            let _ = tx.send(lock_within(&d, std::time::Duration::from_millis(50)).map(drop));
        });
        let waited = rx
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("the start lock was waited for without a bound");
        assert!(matches!(waited, Err(Some(_))), "{waited:?}");
        drop(holder);
        // Not at once: a process another test thread spawns meanwhile holds a copy of the
        // descriptor until it execs.
        assert!(lock_within(&dir, std::time::Duration::from_secs(5)).is_ok());
        let _ = fs::remove_dir(&dir);
    }

    #[test]
    fn this_process_has_a_start_time() {
        assert!(start_time(std::process::id()).is_some());
    }

    #[test]
    fn notes_are_read_back_and_garbage_is_not() {
        let note = |multi_buffer| {
            Some(Note {
                pid: 1234,
                started: 5678,
                multi_buffer,
            })
        };
        assert_eq!(parse_note("1234 5678\n"), note(None));
        assert_eq!(parse_note("1234 5678 0\n"), note(Some(false)));
        assert_eq!(parse_note("1234 5678 1\n"), note(Some(true)));
        assert_eq!(parse_note("1234 5678 yes\n"), note(None));
        for n in [note(None), note(Some(false)), note(Some(true))] {
            let n = n.unwrap();
            assert_eq!(parse_note(&n.to_string()), Some(n), "{n}");
        }
        assert_eq!(parse_note("1234"), None);
        assert_eq!(parse_note("x 5678"), None);
        assert_eq!(parse_note(""), None);
    }

    #[test]
    fn notes_of_ended_processes_are_removed_and_others_kept() {
        let dir = std::env::temp_dir().join(format!("xroce-queue-notes-{}", std::process::id()));
        fs::create_dir_all(&dir).expect("directory");
        let pid = std::process::id();
        let started = start_time(pid).expect("own start time");
        fs::write(dir.join("1.live.0"), format!("{pid} {started}\n")).expect("note");
        // The same PID with another start time: a process that ended, its PID reused.
        fs::write(dir.join("1.reused.0"), format!("{pid} {}\n", started + 1)).expect("note");
        fs::write(dir.join("1.garbage.0"), "not a note").expect("note");
        fs::write(dir.join("1.writing.0.77.new"), "").expect("note");
        remove_dead_notes(&dir);
        let mut left: Vec<String> = fs::read_dir(&dir)
            .expect("read")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["1.live.0", "1.writing.0.77.new"]);
        fs::remove_dir_all(&dir).expect("clean up");
    }

    #[test]
    fn names_that_are_not_file_names_get_no_note() {
        assert!(note_path("../etc", "0").is_none());
        assert!(note_path("", "0").is_none());
        assert!(note_path("a/b", "0").is_none());
    }
}
