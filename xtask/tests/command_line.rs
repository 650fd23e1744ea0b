//! Argument handling of `cargo xtask` that needs no root and changes nothing.

use std::process::{Command, Output};

fn xtask(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(args)
        .output()
        .expect("run xtask")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn the_suites_options_are_refused_for_the_datapath_bench() {
    for flag in ["--quick", "--no-guests"] {
        let o = xtask(&["bench", "datapath", flag]);
        assert!(!o.status.success(), "bench datapath {flag} ran");
        assert!(
            stderr(&o).contains("options of the suite"),
            "{flag}: {}",
            stderr(&o)
        );
    }
}

#[test]
fn an_unknown_bench_is_a_usage_error() {
    let o = xtask(&["bench", "datapth"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("datapath"), "{}", stderr(&o));
}
