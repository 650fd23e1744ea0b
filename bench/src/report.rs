//! What `cargo xtask bench` measured, as data, and its Markdown rendering (the plot is in
//! [`crate::plot`]).

use std::fmt::Write as _;

/// What a number is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Latency in µs (one-way, as perftest reports SEND and WRITE; READ is a round trip).
    LatencyUs,
    /// Throughput in MB/s (10^6 bytes per second of payload delivered).
    MegabytesPerSecond,
    /// Message or packet rate in millions per second.
    Mpps,
    /// CPU cores busy per Gbit/s of payload.
    CoresPerGbps,
    /// Share of one core, in percent.
    CorePercent,
    /// Resident memory in MiB.
    Mebibytes,
}

impl Kind {
    pub fn unit(self) -> &'static str {
        match self {
            Kind::LatencyUs => "µs",
            Kind::MegabytesPerSecond => "MB/s",
            Kind::Mpps => "M/s",
            Kind::CoresPerGbps => "cores per Gbit/s",
            Kind::CorePercent => "% of a core",
            Kind::Mebibytes => "MiB",
        }
    }
}

/// One measured number.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// The table it belongs to, e.g. "Latency (path MTU 4096)".
    pub section: String,
    /// What was run, e.g. "ib_send_lat" or "64 B ping-pong".
    pub test: String,
    /// Message size in bytes (0 when it does not apply).
    pub size: u64,
    /// Who did it: "xroce", "raw AF_XDP", "kernel UDP", "kernel TCP", "rdma_rxe (guests)", ...
    pub method: String,
    pub kind: Kind,
    /// The median (for latency) or the average (for rates).
    pub value: f64,
    /// The 99th percentile, for latency.
    pub p99: Option<f64>,
}

impl Row {
    /// A row without a 99th percentile.
    pub fn new(section: &str, test: &str, size: u64, method: &str, kind: Kind, value: f64) -> Row {
        Row {
            section: section.into(),
            test: test.into(),
            size,
            method: method.into(),
            kind,
            value,
            p99: None,
        }
    }
}

/// A goal of the performance issue: a ratio between two numbers of the same run.
#[derive(Debug, Clone, PartialEq)]
pub struct Goal {
    /// e.g. "64 B ib_send_lat vs raw AF_XDP one-way".
    pub what: String,
    /// The measured ratio.
    pub ratio: f64,
    /// The ratio the goal asks for.
    pub target: f64,
    /// `true` when the ratio must be at least `target` (throughput), `false` when at most
    /// (latency).
    pub at_least: bool,
    /// How the ratio was formed, e.g. "5.6 µs / 2.2 µs".
    pub detail: String,
    /// Why no stack could meet the goal on this path, when a floor measured in the same run
    /// already misses it (e.g. the path's own time for what the exchange must send).
    pub out_of_reach: Option<String>,
}

impl Goal {
    pub fn met(&self) -> bool {
        if self.at_least {
            self.ratio >= self.target
        } else {
            self.ratio <= self.target
        }
    }

    /// The ratio to two decimals, or to as many more (up to four) as it takes not to read as
    /// the target itself when it is not: 0.7992 against 0.80 is "0.799", which a reader can
    /// see missed, where "0.80" next to "**no**" would read as a contradiction.
    pub fn ratio_text(&self) -> String {
        let at = |digits: usize| {
            (
                format!("{:.*}", digits, self.ratio),
                format!("{:.*}", digits, self.target),
            )
        };
        (2..=4)
            .map(at)
            .find(|(ratio, target)| ratio != target)
            .map_or_else(|| at(2).0, |(ratio, _)| ratio)
    }
}

/// A whole run.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// e.g. "2 CPUs, Intel(R) Xeon(R) Processor, kernel 6.18.44".
    pub machine: String,
    pub commit: String,
    pub date: String,
    pub rows: Vec<Row>,
    pub goals: Vec<Goal>,
    /// Free-form remarks (what was skipped, how things were measured).
    pub notes: Vec<String>,
}

impl Report {
    /// The rows of one section, in the order they were measured.
    pub fn section<'a>(&'a self, section: &'a str) -> impl Iterator<Item = &'a Row> + 'a {
        self.rows.iter().filter(move |r| r.section == section)
    }

    /// Section names in the order they first appear.
    pub fn sections(&self) -> Vec<&str> {
        let mut out: Vec<&str> = Vec::new();
        for r in &self.rows {
            if !out.contains(&r.section.as_str()) {
                out.push(&r.section);
            }
        }
        out
    }

    /// The value of the first row matching, if measured.
    pub fn value(&self, section: &str, test: &str, size: u64, method: &str) -> Option<f64> {
        self.rows
            .iter()
            .find(|r| {
                r.section == section && r.test == test && r.size == size && r.method == method
            })
            .map(|r| r.value)
    }

    /// The report as Markdown: header, goals, then one table per section.
    pub fn markdown(&self, plot_file: Option<&str>) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "# Performance: xroce next to the kernel, raw AF_XDP and rdma_rxe\n"
        );
        let _ = writeln!(
            s,
            "`cargo xtask bench`, one run: perftest over xroce between two network namespaces \
             on a veth pair, with the baselines measured in the same run on the same pair. \
             These machines are shared and noisy: only ratios within one run mean anything.\n"
        );
        let _ = writeln!(s, "- machine: {}", self.machine);
        let _ = writeln!(s, "- commit: {}", self.commit);
        let _ = writeln!(s, "- date: {}\n", self.date);
        if let Some(plot) = plot_file {
            let _ = writeln!(s, "![the numbers below, plotted]({plot})\n");
        }
        if !self.goals.is_empty() {
            let _ = writeln!(s, "## Goals\n");
            let _ = writeln!(s, "| goal | ratio | target | met | from |");
            let _ = writeln!(s, "|---|---:|---|---|---|");
            for g in &self.goals {
                let _ = writeln!(
                    s,
                    "| {} | {} | {} {:.2} | {} | {}{} |",
                    g.what,
                    g.ratio_text(),
                    if g.at_least { "≥" } else { "≤" },
                    g.target,
                    match (g.met(), &g.out_of_reach) {
                        (true, _) => "yes",
                        (false, None) => "**no**",
                        (false, Some(_)) => "**no**, out of reach",
                    },
                    g.detail,
                    match (g.met(), &g.out_of_reach) {
                        (false, Some(why)) => format!("; out of reach: {why}"),
                        _ => String::new(),
                    }
                );
            }
            let _ = writeln!(s);
        }
        for section in self.sections() {
            let _ = writeln!(s, "## {section}\n");
            let with_p99 = self.section(section).any(|r| r.p99.is_some());
            if with_p99 {
                let _ = writeln!(s, "| test | size | method | p50 | p99 | unit |");
                let _ = writeln!(s, "|---|---:|---|---:|---:|---|");
            } else {
                let _ = writeln!(s, "| test | size | method | value | unit |");
                let _ = writeln!(s, "|---|---:|---|---:|---|");
            }
            for r in self.section(section) {
                let size = if r.size == 0 {
                    String::new()
                } else {
                    size_text(r.size)
                };
                if with_p99 {
                    let p99 = r.p99.map(number).unwrap_or_default();
                    let _ = writeln!(
                        s,
                        "| {} | {size} | {} | {} | {p99} | {} |",
                        r.test,
                        r.method,
                        number(r.value),
                        r.kind.unit()
                    );
                } else {
                    let _ = writeln!(
                        s,
                        "| {} | {size} | {} | {} | {} |",
                        r.test,
                        r.method,
                        number(r.value),
                        r.kind.unit()
                    );
                }
            }
            let _ = writeln!(s);
        }
        if !self.notes.is_empty() {
            let _ = writeln!(s, "## Notes\n");
            for n in &self.notes {
                let _ = writeln!(s, "- {n}");
            }
        }
        s
    }
}

/// "64 B", "4 KiB", "1 MiB".
pub fn size_text(bytes: u64) -> String {
    if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1 << 10 && bytes.is_multiple_of(1 << 10) {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} B")
    }
}

/// A value as the tables and the plot show it: three significant digits or so, without
/// needless decimals.
pub fn number(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        "0".to_string()
    } else if a >= 1e6 {
        format!("{v:.2e}")
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 0.1 {
        format!("{v:.2}")
    } else {
        format!("{v:.4}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(section: &str, test: &str, size: u64, method: &str, value: f64) -> Row {
        Row {
            p99: Some(value * 2.0),
            ..Row::new(section, test, size, method, Kind::LatencyUs, value)
        }
    }

    #[test]
    fn a_ratio_that_rounds_to_its_target_shows_the_digits_that_tell_them_apart() {
        let goal = |ratio, target| Goal {
            what: "bw".into(),
            ratio,
            target,
            at_least: true,
            detail: String::new(),
            out_of_reach: None,
        };
        assert_eq!(goal(0.7992, 0.8).ratio_text(), "0.799");
        // Past four digits it is left at two.
        assert_eq!(goal(0.80004, 0.8).ratio_text(), "0.80");
        assert_eq!(goal(0.8, 0.8).ratio_text(), "0.80");
        assert_eq!(goal(0.8163, 0.8).ratio_text(), "0.82");
        assert_eq!(goal(0.50142, 0.5).ratio_text(), "0.501");
        let md = Report {
            goals: vec![goal(0.7992, 0.8)],
            ..Report::default()
        }
        .markdown(None);
        assert!(md.contains("| bw | 0.799 | ≥ 0.80 | **no** |"), "{md}");
    }

    #[test]
    fn markdown_has_goals_and_one_table_per_section() {
        let r = Report {
            machine: "m".into(),
            commit: "c".into(),
            date: "d".into(),
            rows: vec![
                row("Latency", "ib_send_lat", 64, "xroce", 5.6),
                row("Latency", "64 B ping-pong", 64, "raw AF_XDP", 2.1),
                row("Other", "x", 4096, "xroce", 123.4),
            ],
            goals: vec![Goal {
                what: "lat".into(),
                ratio: 2.67,
                target: 1.5,
                at_least: false,
                detail: "5.6 / 2.1".into(),
                out_of_reach: None,
            }],
            notes: vec!["n".into()],
        };
        let md = r.markdown(Some("perf.svg"));
        assert!(
            md.contains("| lat | 2.67 | ≤ 1.50 | **no** | 5.6 / 2.1 |"),
            "{md}"
        );
        // A missed goal whose floor misses it too says so; a met one never does.
        let floor = |ratio| Report {
            goals: vec![Goal {
                ratio,
                out_of_reach: Some("the floor is 1.6×".into()),
                ..r.goals[0].clone()
            }],
            ..r.clone()
        };
        let missed = floor(2.67).markdown(None);
        assert!(
            missed.contains(
                "| lat | 2.67 | ≤ 1.50 | **no**, out of reach | 5.6 / 2.1; out of reach: the \
                 floor is 1.6× |"
            ),
            "{missed}"
        );
        let met = floor(1.2).markdown(None);
        assert!(
            met.contains("| lat | 1.20 | ≤ 1.50 | yes | 5.6 / 2.1 |"),
            "{met}"
        );
        assert!(
            md.contains("| ib_send_lat | 64 B | xroce | 5.60 | 11.2 | µs |"),
            "{md}"
        );
        assert!(
            md.contains("| x | 4 KiB | xroce | 123 | 247 | µs |"),
            "{md}"
        );
        assert_eq!(md.matches("## Latency").count(), 1);
        assert!(md.contains("![the numbers below, plotted](perf.svg)"));
        assert_eq!(r.value("Latency", "ib_send_lat", 64, "xroce"), Some(5.6));
        assert_eq!(r.value("Latency", "ib_send_lat", 64, "rxe"), None);
    }

    #[test]
    fn sizes_read_naturally() {
        assert_eq!(size_text(64), "64 B");
        assert_eq!(size_text(4096), "4 KiB");
        assert_eq!(size_text(1 << 20), "1 MiB");
        assert_eq!(size_text(1500), "1500 B");
    }
}
