//! Tests of `lakestream-bench`: every workload runs against the
//! `lakestream` binary built beside it and prints its figures. No timing is
//! asserted; the figures live in docs/benchmarks.md.

mod smoke;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The `lakestream` binary beside the bench (a workspace test run builds
/// it for the CLI's tests).
fn lakestream() -> PathBuf {
    let bench = Path::new(env!("CARGO_BIN_EXE_lakestream-bench"));
    let exe = bench.with_file_name("lakestream");
    assert!(
        exe.is_file(),
        "no {}: build it first (`cargo build -p lakestream-cli`; `cargo test --workspace` does)",
        exe.display()
    );
    exe
}

/// Run `lakestream-bench` with `args` in `dir`.
fn run_in(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lakestream-bench"))
        .current_dir(dir)
        .arg("--lakestream")
        .arg(lakestream())
        .args(args)
        .output()
        .expect("run lakestream-bench")
}

/// Text of stdout and stderr for assertion messages.
fn text(o: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}\n--- stderr\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}
