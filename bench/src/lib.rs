//! xroce benchmarks. The criterion micro-benchmarks are in `benches/`; the side-by-side
//! comparisons (`cargo xtask bench`) are the `suite` and `datapath` binaries, built from:
//!
//! - [`baseline`]: raw AF_XDP, kernel UDP and kernel TCP doing the same exchanges.
//! - [`cpu`]: CPU time of a thread, the process or its children.
//! - [`perftest`]: perftest over xroce between two namespaces, and its result lines.
//! - [`paired`]: comparisons measured in rounds, xroce and its baseline back to back.
//! - [`interrupt`]: Ctrl-C removes the namespaces a run made, and what runs in them.
//! - [`guests`]: rdma_rxe↔rdma_rxe next to xroce↔xroce in identical QEMU guests.
//! - [`report`]: the measured numbers and goals of one run, and their Markdown rendering.
//! - [`plot`]: the same report drawn as one SVG image.

pub mod baseline;
pub mod cpu;
pub mod guests;
pub mod interrupt;
pub mod paired;
pub mod perftest;
pub mod plot;
pub mod report;
