//! Tests of `lakestream-bench`: every workload runs against the
//! `lakestream` binary built beside it (a workspace test run builds it for
//! the CLI's tests) and prints its figures. No timing is asserted; the
//! figures live in docs/benchmarks.md.

mod smoke;

use std::path::Path;
use std::process::{Command, Output};

pub(crate) use lakestream_testkit::output_text as text;

/// Run `lakestream-bench` with `args` in `dir`.
fn run_in(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lakestream-bench"))
        .current_dir(dir)
        .args(args)
        .output()
        .expect("run lakestream-bench")
}
