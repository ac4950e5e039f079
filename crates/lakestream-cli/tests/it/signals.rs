//! A continuous job with data arriving while it runs, stopped by SIGTERM.

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::common::*;
use crate::errors::unsafe_kill;

#[test]
fn sigterm_finishes_the_batch_in_flight_and_nothing_is_lost() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let input = dir.join("in");
    let mut expected = write_events(&input, 0, 2, 10);
    std::fs::write(dir.join("job.sql"), events_job(&input, &dir.join("out"), 1)).unwrap();
    let mut child = bin()
        .current_dir(dir)
        .args([
            "run",
            "job.sql",
            "--checkpoint",
            "ckpt",
            "--trigger",
            "100ms",
            "--progress-json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        BufReader::new(stdout)
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(&l.unwrap()).unwrap())
            .collect::<Vec<_>>()
    });
    // Produce while the job runs.
    for round in 0..5 {
        std::thread::sleep(Duration::from_millis(150));
        expected.extend(write_events(&input, 2 + round, 1, 10));
    }
    // Wait until the job has caught up, then stop it.
    let deadline = Instant::now() + Duration::from_secs(60);
    wait_caught_up(dir, 7, deadline);
    unsafe_kill(child.id(), 15);
    let status = child.wait().unwrap();
    assert!(status.success(), "exit {:?}", status.code());
    let progress = reader.join().unwrap();
    assert_eq!(progress.len(), 7, "one batch per file: {progress:?}");
    expected.sort();
    assert_eq!(ids(&read_py(&dir.join("out"))), expected);
}
