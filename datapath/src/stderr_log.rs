//! The `log` records of xroce's code, written to standard error.
//!
//! The loader, the netlink code, the engine and the transport say what they notice through
//! the `log` macros (a program on an interface that predates the address filter, a
//! registry file that cannot be read, a retransmission, a NAK). With no logger installed the
//! `log` crate drops every record, so [`install`] sets one up where xroce's code starts: the
//! `xroce` command, the provider when a program loads it, and `cargo xtask`.
//!
//! `XROCE_LOG` picks how much is said: `off`, `error`, `warn` (the default), `info`, `debug`
//! or `trace`. At `debug` and `trace` each line carries the time of day (to the microsecond,
//! UTC, the clock `XROCE_PCAP` stamps frames with), the process and where it comes from, so
//! the lines of a client and a server can be merged and set beside a capture. Other crates'
//! records (aya's, netlink-packet-route's) are shown at `trace` only: they are the loaders'
//! and parsers' detail (netlink-packet-route warns, for instance, about every attribute a
//! newer kernel made longer).
//!
//! Not env_logger: the provider runs inside applications, where a logger that takes std's
//! lock on standard error can leave a child forked meanwhile waiting for it for good; this
//! one writes each line with one `write(2)`, as [`crate::stderr_line!`] does.

use std::fmt::Write as _;

use log::{Level, LevelFilter, Log, Metadata, Record};

/// Environment variable that sets how much xroce logs.
pub const LOG_ENV: &str = "XROCE_LOG";

/// The level when `XROCE_LOG` is unset or empty: problems a user should hear of, and no more.
pub const DEFAULT_LEVEL: LevelFilter = LevelFilter::Warn;

/// The level `value` (of `XROCE_LOG`) names; `None` when it names none.
pub fn parse_level(value: &str) -> Option<LevelFilter> {
    value.trim().parse().ok()
}

/// Installs the logger at the level `XROCE_LOG` asks for; an unknown value is said once and
/// the default kept. A second call, or a logger already installed (by an application that
/// links this code statically), leaves things as they are.
pub fn install() {
    let value = std::env::var(LOG_ENV).unwrap_or_default();
    let level = if value.trim().is_empty() {
        DEFAULT_LEVEL
    } else {
        parse_level(&value).unwrap_or_else(|| {
            crate::stderr_line!(
                "xroce: {LOG_ENV}={value:?} is not one of off, error, warn, info, debug, trace; \
                 logging warnings and errors"
            );
            DEFAULT_LEVEL
        })
    };
    if log::set_logger(&STDERR_LOG).is_ok() {
        log::set_max_level(level);
    }
}

/// Whether a record of `target` at `level` is shown when `XROCE_LOG` is `max`.
fn shown(target: &str, level: Level, max: LevelFilter) -> bool {
    level <= max && (target.starts_with("xroce") || max >= LevelFilter::Trace)
}

/// The line a record becomes (without its newline). `clock` is the time of day as seconds and
/// microseconds since the epoch, taken only for `debug` and `trace` lines.
fn line(
    level: Level,
    target: &str,
    message: &std::fmt::Arguments<'_>,
    clock: impl FnOnce() -> (u64, u32),
) -> String {
    let mut out = String::from("xroce: ");
    // A `Display` that fails leaves its part out: inside a verb, a panic would abort.
    let _ = match level {
        Level::Error => write!(out, "error: {message}"),
        Level::Warn => write!(out, "warning: {message}"),
        Level::Info => write!(out, "{message}"),
        Level::Debug | Level::Trace => {
            let (secs, micros) = clock();
            let day = secs % 86_400;
            write!(
                out,
                "{} {:02}:{:02}:{:02}.{micros:06} pid {} {target}: {message}",
                level.as_str().to_ascii_lowercase(),
                day / 3600,
                day / 60 % 60,
                day % 60,
                std::process::id(),
            )
        }
    };
    out
}

fn time_of_day() -> (u64, u32) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    (now.as_secs(), now.subsec_micros())
}

struct StderrLog;

static STDERR_LOG: StderrLog = StderrLog;

impl Log for StderrLog {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        shown(metadata.target(), metadata.level(), log::max_level())
    }

    fn log(&self, record: &Record<'_>) {
        if self.enabled(record.metadata()) {
            let mut text = line(record.level(), record.target(), record.args(), time_of_day);
            text.push('\n');
            crate::write_stderr(text.as_bytes());
        }
    }

    fn flush(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_levels_a_user_types_are_understood_and_others_are_not() {
        assert_eq!(parse_level("off"), Some(LevelFilter::Off));
        assert_eq!(parse_level("warn"), Some(LevelFilter::Warn));
        assert_eq!(parse_level(" Debug\n"), Some(LevelFilter::Debug));
        assert_eq!(parse_level("TRACE"), Some(LevelFilter::Trace));
        assert_eq!(parse_level("verbose"), None);
        assert_eq!(parse_level("3"), None);
    }

    #[test]
    fn xroce_records_follow_the_level_and_other_crates_only_at_trace() {
        assert!(shown("xroce_datapath::xdp", Level::Warn, LevelFilter::Warn));
        assert!(!shown(
            "xroce_datapath::xdp",
            Level::Info,
            LevelFilter::Warn
        ));
        assert!(shown(
            "xroce_core::transport",
            Level::Debug,
            LevelFilter::Debug
        ));
        assert!(!shown(
            "xroce_core::transport",
            Level::Trace,
            LevelFilter::Debug
        ));
        assert!(!shown("xroce_datapath", Level::Error, LevelFilter::Off));
        assert!(!shown("aya::bpf", Level::Warn, LevelFilter::Info));
        assert!(!shown(
            "netlink_packet_route::link",
            Level::Warn,
            LevelFilter::Debug
        ));
        assert!(shown("aya::bpf", Level::Warn, LevelFilter::Trace));
        assert!(shown("aya::bpf", Level::Trace, LevelFilter::Trace));
    }

    #[test]
    fn lines_say_the_level_and_debug_lines_when_who_and_where() {
        let never = || -> (u64, u32) { panic!("the clock is read for debug lines only") };
        assert_eq!(
            line(
                Level::Warn,
                "xroce_datapath::xdp",
                &format_args!("eth0 {}", 7),
                never
            ),
            "xroce: warning: eth0 7"
        );
        assert_eq!(
            line(Level::Error, "xroce_datapath", &format_args!("gone"), never),
            "xroce: error: gone"
        );
        assert_eq!(
            line(Level::Info, "x", &format_args!("said"), never),
            "xroce: said"
        );
        // 2026-12-06 21:40:01.000042 UTC.
        let at = || (1_796_593_201, 42);
        assert_eq!(
            line(
                Level::Debug,
                "xroce_core::transport::completer",
                &format_args!("QP 0x11"),
                at
            ),
            format!(
                "xroce: debug 21:40:01.000042 pid {} xroce_core::transport::completer: QP 0x11",
                std::process::id()
            )
        );
        assert!(
            line(Level::Trace, "t", &format_args!("m"), at).starts_with("xroce: trace 21:40:01")
        );
    }
}
