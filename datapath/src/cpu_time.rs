//! CPU time of a thread or a process as `/proc` accounts it: the engine reports its progress
//! thread's, and the benchmarks read other processes' (a guest's vCPU thread).

use std::path::Path;
use std::time::Duration;

/// User plus system time from a `/proc/PID/stat` or `/proc/PID/task/TID/stat` file (a
/// process's file sums its threads); `None` if it cannot be read.
pub fn from_stat_file(path: &Path) -> Option<Duration> {
    let ticks = ticks_of_stat(&std::fs::read_to_string(path).ok()?)?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = u64::try_from(hz).ok().filter(|h| *h > 0)?;
    Some(Duration::from_nanos(ticks * 1_000_000_000 / hz))
}

/// User plus system time, in clock ticks, from the text of a stat file: utime is field 14 and
/// stime 15.
fn ticks_of_stat(stat: &str) -> Option<u64> {
    let utime = stat_field(stat, 14)?;
    let stime = stat_field(stat, 15)?;
    Some(utime + stime)
}

/// Field `n` (counted from 1, as in proc(5)) of the text of a stat file, as a number, for `n`
/// from 3. The command name (field 2), in parentheses, may itself hold spaces and
/// parentheses, so the fields are counted from the last ')'.
pub(crate) fn stat_field(stat: &str, n: usize) -> Option<u64> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name
        .split_whitespace()
        .nth(n.checked_sub(3)?)?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_is_read_past_a_command_name_with_spaces_and_parentheses() {
        let stat = "4242 (CPU 0/TCG (x)) S 1 4242 4242 0 -1 4194560 1029 0 0 0 \
                    1234 567 0 0 20 0 3 0 1000 1000000 500 18446744073709551615";
        assert_eq!(ticks_of_stat(stat), Some(1234 + 567));
        assert_eq!(ticks_of_stat("4242 (qemu) S 1 2"), None);
        assert_eq!(ticks_of_stat("no parenthesis"), None);
    }

    #[test]
    fn any_field_is_read_after_any_command_name() {
        let fields: Vec<String> = (3..=25).map(|n| n.to_string()).collect();
        let stat = format!("77 (a (b) c) {}", fields.join(" "));
        assert_eq!(stat_field(&stat, 22), Some(22));
        assert_eq!(stat_field(&stat, 3), Some(3));
        assert_eq!(stat_field(&stat, 2), None, "the name is no number field");
        assert_eq!(stat_field("77 (short) 3 4", 22), None);
        assert_eq!(stat_field("garbage", 22), None);
    }

    /// CPU time this thread burns shows in its stat file, in the right unit: 60 ms of it
    /// (by the kernel's own thread clock) reads as at least 30 ms (the file counts in ticks,
    /// 10 ms each, sampled), and not as a thousandth or a thousand times that.
    #[test]
    fn a_thread_s_burnt_cpu_time_shows_in_its_stat_file() {
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        let path = format!("/proc/self/task/{tid}/stat");
        let before = from_stat_file(Path::new(&path)).expect("own stat file");
        let thread_clock = || {
            let mut t = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            // SAFETY: clock_gettime writes one timespec into `t`.
            unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
            Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
        };
        let start = thread_clock();
        while thread_clock() - start < Duration::from_millis(60) {
            std::hint::black_box(0u64);
        }
        let burnt = from_stat_file(Path::new(&path)).expect("own stat file") - before;
        assert!(
            burnt >= Duration::from_millis(30) && burnt < Duration::from_secs(60),
            "{burnt:?}"
        );
        assert!(from_stat_file(Path::new("/proc/self/no-such-file")).is_none());
    }
}
