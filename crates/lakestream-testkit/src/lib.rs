//! Conformance suites for lakestream's connectors, shared by the test
//! binaries (the library's and the CLI's, which runs the Kafka broker).
//!
//! [`source_conformance`] checks what the engine relies on from every
//! source:
//! - every planned range, read again (and read as several partitions),
//!   gives the same rows;
//! - a new source object (a restarted process) recovering the first
//!   batches' ends plans the rest: every row once across the restart;
//! - once the input is exhausted, a plan is empty, and an empty input plans
//!   nothing;
//! - a read streams: no record batch is larger than the source's
//!   `batch_size`, however large the range.
//!
//! [`sink::sink_idempotence`] checks what the engine relies on from every
//! sink (a batch id commits at most once per query, whoever writes it).
//!
//! [`broker::Broker`] starts a real Kafka-protocol broker process (tansu)
//! on 127.0.0.1, plain, with SASL or behind TLS, for the tests and the
//! benchmark's smoke test; [`python`] is the Python environment the test
//! script sets up (the broker's wheel, the `deltalake` reader).
//!
//! [`slt`] runs SQL logic test files of whole jobs (`tests/slt/*.slt`):
//! declare a job, feed its sources, run a batch, check the table.

pub mod broker;
pub mod s3;
pub mod sink;
pub mod slt;

use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::util::display::{ArrayFormatter, FormatOptions};
use futures::StreamExt;
use lakestream_source::{Offset, Source};

/// Rows of a batch as text, one string per row.
pub fn rows_of(batch: &RecordBatch) -> Vec<String> {
    cells_of(batch, &FormatOptions::default())
        .expect("every arrow type formats")
        .into_iter()
        .map(|row| row.join("|"))
        .collect()
}

/// Every value of a batch as arrow displays it with `options`, row by row.
pub fn cells_of(
    batch: &RecordBatch,
    options: &FormatOptions,
) -> Result<Vec<Vec<String>>, arrow::error::ArrowError> {
    let columns = batch
        .columns()
        .iter()
        .map(|c| ArrayFormatter::try_new(c.as_ref(), options))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((0..batch.num_rows())
        .map(|r| columns.iter().map(|c| c.value(r).to_string()).collect())
        .collect())
}

/// Read `(start, end]` as `partitions` streams; the rows sorted, and the
/// largest record batch seen.
async fn read(
    source: &dyn Source,
    start: Option<&Offset>,
    end: &Offset,
    partitions: usize,
) -> (Vec<String>, usize) {
    let mut rows = Vec::new();
    let mut largest = 0;
    for mut stream in source.read(start, end, partitions).unwrap() {
        while let Some(batch) = stream.next().await {
            let batch = batch.unwrap();
            largest = largest.max(batch.num_rows());
            rows.extend(rows_of(&batch));
        }
    }
    rows.sort();
    (rows, largest)
}

/// Start `source` as the engine does on a fresh checkpoint, with the ends
/// of the batches already planned.
async fn start(source: &dyn Source, planned: &[Offset]) {
    source.restore(None).await.unwrap();
    source.recover(planned).await.unwrap();
    source.freeze().await.unwrap();
}

/// Plan batches after `from` until the source has nothing more.
async fn plan_all(source: &dyn Source, from: Option<Offset>) -> Vec<(Option<Offset>, Offset)> {
    let mut ranges = Vec::new();
    let mut start = from;
    for _ in 0..10_000 {
        match source.plan(start.as_ref()).await.unwrap() {
            Some(end) => {
                ranges.push((start.clone(), end.clone()));
                start = Some(end);
            }
            None => return ranges,
        }
    }
    panic!("{}: plans never ended", source.name());
}

/// The source suite (see the crate docs). `make` builds a new source object over the same input (as a
/// restarted process would); `empty` one over no input; `rows` is the
/// input's row count and `batch_size` the source's read batch size.
pub async fn source_conformance(
    make: impl Fn() -> Arc<dyn Source>,
    empty: Arc<dyn Source>,
    rows: usize,
    batch_size: usize,
) {
    let a = make();
    let name = a.name().to_string();
    start(&*a, &[]).await;
    // The engine starts the first batch at the source's initial offset.
    let initial = a.initial_offset().await.unwrap();
    let ranges = plan_all(&*a, initial.clone()).await;
    assert!(
        ranges.len() >= 3,
        "{name}: the suite needs several batches, got {}",
        ranges.len()
    );

    let mut all = Vec::new();
    for (s, e) in &ranges {
        let (first, largest) = read(&*a, s.as_ref(), e, 1).await;
        let (again, _) = read(&*a, s.as_ref(), e, 1).await;
        let (split, largest_split) = read(&*a, s.as_ref(), e, 2).await;
        assert_eq!(first, again, "{name}: a range read twice differs");
        assert_eq!(
            first, split,
            "{name}: a range read as two partitions differs"
        );
        assert!(
            largest.max(largest_split) <= batch_size,
            "{name}: a record batch of {} rows, above batch_size {batch_size}",
            largest.max(largest_split)
        );
        all.extend(first);
    }
    all.sort();
    let mut distinct = all.clone();
    distinct.dedup();
    assert_eq!(all.len(), rows, "{name}: every input row once");
    assert_eq!(distinct.len(), rows, "{name}: no row twice");
    assert_eq!(
        a.plan(ranges.last().map(|r| &r.1)).await.unwrap(),
        None,
        "{name}: exhausted"
    );

    // A restart after the first two batches: a new object recovers their
    // ends and plans the rest; together, every row once.
    let b = make();
    let kept: Vec<Offset> = ranges[..2].iter().map(|r| r.1.clone()).collect();
    start(&*b, &kept).await;
    let mut across = Vec::new();
    for (s, e) in &ranges[..2] {
        across.extend(read(&*b, s.as_ref(), e, 1).await.0);
    }
    for (s, e) in plan_all(&*b, kept.last().cloned()).await {
        across.extend(read(&*b, s.as_ref(), &e, 1).await.0);
    }
    across.sort();
    assert_eq!(across, all, "{name}: a restart loses or repeats rows");

    // No input: nothing to plan.
    start(&*empty, &[]).await;
    assert_eq!(
        empty.plan(None).await.unwrap(),
        None,
        "{name}: an empty input plans a batch"
    );
}

/// A finished process's exit code, stdout and stderr as text, for
/// assertion messages.
pub fn output_text(o: &std::process::Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}\n--- stderr\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The repository's root directory.
pub fn repo_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The Python with `deltalake`, `pyarrow` and the tansu broker's wheel:
/// `LAKESTREAM_PYTHON`, or the `.venv` that `scripts/test.sh` sets up.
pub fn python() -> std::path::PathBuf {
    if let Ok(p) = std::env::var("LAKESTREAM_PYTHON") {
        return std::path::PathBuf::from(p);
    }
    let p = repo_root().join(".venv/bin/python");
    assert!(
        p.exists(),
        "no Python reader: run ./scripts/test.sh, or set LAKESTREAM_PYTHON to a Python \
         with deltalake and pyarrow installed"
    );
    p
}

/// Run `tests/py/<script>` with `args`, `lines` as JSON lines on its
/// stdin; asserts it succeeds and returns its stdout.
pub fn run_py_lines(
    script: &str,
    args: &[&std::ffi::OsStr],
    lines: &[serde_json::Value],
) -> String {
    use std::io::Write;
    let mut child = std::process::Command::new(python())
        .arg(repo_root().join("tests/py").join(script))
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run python");
    let mut input = String::new();
    for line in lines {
        input.push_str(&line.to_string());
        input.push('\n');
    }
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{script}: {}", output_text(&o));
    String::from_utf8(o.stdout).unwrap()
}
