//! Comparisons measured in rounds, xroce and its baseline back to back.
//!
//! On a shared host the speed of the network path drifts by tens of percent within minutes
//! (raw AF_XDP's 64 B packet rate moved between 0.39 and 0.60 M/s in five rounds of one run).
//! A ratio of two numbers measured minutes apart carries that drift as if it were a
//! difference between the two methods; a ratio of two numbers measured one after the other
//! mostly does not. So the goals that compare xroce with raw AF_XDP or kernel UDP are measured
//! in rounds, each round running both back to back, and a goal's ratio is the median of the
//! rounds' ratios. The order inside a round alternates, so that neither method always runs
//! second.

/// xroce's number and its baseline's from one round.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pair {
    pub xroce: f64,
    pub baseline: f64,
}

/// The rounds of one comparison.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Paired {
    pub rounds: Vec<Pair>,
}

impl Paired {
    /// Adds a round; a round where either measurement failed (missing, or not a positive
    /// number) is left out rather than counted as zero.
    pub fn push(&mut self, xroce: Option<f64>, baseline: Option<f64>) {
        let usable = |v: Option<f64>| v.filter(|v| v.is_finite() && *v > 0.0);
        if let (Some(xroce), Some(baseline)) = (usable(xroce), usable(baseline)) {
            self.rounds.push(Pair { xroce, baseline });
        }
    }

    /// xroce / baseline for each round, in the order measured.
    pub fn ratios(&self) -> Vec<f64> {
        self.rounds.iter().map(|p| p.xroce / p.baseline).collect()
    }

    /// The median of the rounds' ratios (not the ratio of the medians: each ratio is formed
    /// from two numbers measured back to back, which is the point).
    pub fn median_ratio(&self) -> Option<f64> {
        median(self.ratios())
    }

    pub fn median_xroce(&self) -> Option<f64> {
        median(self.rounds.iter().map(|p| p.xroce).collect())
    }

    pub fn median_baseline(&self) -> Option<f64> {
        median(self.rounds.iter().map(|p| p.baseline).collect())
    }

    /// Each round's ratio, in the order measured: "0.89, 0.96, 0.86".
    pub fn ratios_text(&self) -> String {
        let ratios: Vec<String> = self.ratios().iter().map(|r| format!("{r:.2}")).collect();
        ratios.join(", ")
    }

    /// For the goals table: the medians of both sides and each round's ratio, e.g.
    /// "medians 0.36 / 0.41 M/s; rounds 0.89, 0.96, 0.86".
    pub fn describe(&self, unit: &str) -> String {
        format!(
            "medians {:.2} / {:.2} {unit}; rounds {}",
            self.median_xroce().unwrap_or(f64::NAN),
            self.median_baseline().unwrap_or(f64::NAN),
            self.ratios_text()
        )
    }
}

/// One round's xroce / baseline for a note, "0.89×"; "none (… measured nothing)" when a side
/// measured nothing (zero or not a number), which [`Paired::push`] leaves out of the goal.
pub fn round_ratio_text(xroce: f64, baseline: f64, baseline_name: &str) -> String {
    let usable = |v: f64| v.is_finite() && v > 0.0;
    match (usable(xroce), usable(baseline)) {
        (true, true) => format!("{:.2}×", xroce / baseline),
        (false, true) => "none (xroce measured nothing)".to_string(),
        (true, false) => format!("none ({baseline_name} measured nothing)"),
        (false, false) => format!("none (xroce and {baseline_name} measured nothing)"),
    }
}

/// The middle value (the mean of the middle two for an even count); `None` when empty.
pub fn median(mut v: Vec<f64>) -> Option<f64> {
    v.retain(|x| !x.is_nan());
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    })
}

/// The index of the element with the median value of `key` (the lower middle for an even
/// count), to report one whole measurement (its p50 with its own p99) rather than a mix.
pub fn median_index<T>(items: &[T], key: impl Fn(&T) -> f64) -> Option<usize> {
    let mut order: Vec<usize> = (0..items.len())
        .filter(|&i| !key(&items[i]).is_nan())
        .collect();
    order.sort_by(|&a, &b| key(&items[a]).total_cmp(&key(&items[b])));
    order.get(order.len().saturating_sub(1) / 2).copied()
}

/// Whether round `round` (from 0) measures xroce before its baseline.
pub fn xroce_first(round: usize) -> bool {
    round % 2 == 1
}

/// Runs `xroce` and `baseline` one after the other, xroce first when `xroce_first` (see
/// [`xroce_first`]); returns their results in that order.
pub fn in_order<A, B>(
    xroce_first: bool,
    xroce: impl FnOnce() -> A,
    baseline: impl FnOnce() -> B,
) -> (A, B) {
    if xroce_first {
        let a = xroce();
        (a, baseline())
    } else {
        let b = baseline();
        (xroce(), b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_that_measured_nothing_reads_as_none_not_as_infinite() {
        assert_eq!(round_ratio_text(33.4, 10.7, "rdma_rxe"), "3.12×");
        assert_eq!(
            round_ratio_text(33.4, 0.0, "rdma_rxe"),
            "none (rdma_rxe measured nothing)"
        );
        assert_eq!(
            round_ratio_text(f64::NAN, 10.7, "rdma_rxe"),
            "none (xroce measured nothing)"
        );
        let mut p = Paired::default();
        p.push(Some(33.4), Some(0.0));
        assert!(p.rounds.is_empty(), "left out of the goal as well");
    }

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(vec![]), None);
        assert_eq!(median(vec![f64::NAN, 5.0]), Some(5.0));
    }

    #[test]
    fn the_goal_is_the_median_of_ratios_not_the_ratio_of_medians() {
        // The host halves its speed in round 2 for both methods: every round's ratio is 0.9.
        let mut p = Paired::default();
        p.push(Some(0.36), Some(0.40));
        p.push(Some(0.18), Some(0.20));
        p.push(Some(0.45), Some(0.50));
        let r = p.median_ratio().unwrap();
        assert!((r - 0.9).abs() < 1e-9, "{r}");
        // Taking the medians first would pair 0.36 with 0.40 here too, but not in general:
        let mut q = Paired::default();
        q.push(Some(1.0), Some(1.0));
        q.push(Some(2.0), Some(4.0));
        q.push(Some(4.0), Some(2.0));
        assert_eq!(q.ratios(), vec![1.0, 0.5, 2.0]);
        assert_eq!(q.median_ratio(), Some(1.0));
        assert_eq!(q.median_xroce(), Some(2.0));
        assert_eq!(q.median_baseline(), Some(2.0));
    }

    #[test]
    fn failed_rounds_are_left_out() {
        let mut p = Paired::default();
        p.push(None, Some(1.0));
        p.push(Some(1.0), Some(0.0));
        p.push(Some(f64::NAN), Some(1.0));
        p.push(Some(2.0), None);
        assert!(p.rounds.is_empty());
        assert_eq!(p.median_ratio(), None);
        p.push(Some(3.0), Some(4.0));
        assert_eq!(p.median_ratio(), Some(0.75));
        assert_eq!(p.describe("M/s"), "medians 3.00 / 4.00 M/s; rounds 0.75");
    }

    #[test]
    fn the_median_index_names_one_whole_measurement() {
        let runs = [(7.0, 30.0), (6.0, 90.0), (8.0, 10.0), (f64::NAN, 0.0)];
        assert_eq!(median_index(&runs, |r| r.0), Some(0));
        assert_eq!(median_index(&runs[..2], |r| r.0), Some(1));
        assert_eq!(median_index::<(f64, f64)>(&[], |r| r.0), None);
    }

    #[test]
    fn the_order_alternates() {
        let firsts: Vec<bool> = (0..4).map(xroce_first).collect();
        assert_eq!(firsts, vec![false, true, false, true]);
    }
}
