//! kill -9 at random moments, restart until done: every row exactly once.

use std::time::Duration;

use crate::common::*;

#[test]
fn sigkill_at_random_moments_then_restart_keeps_every_row_exactly_once() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let input = dir.join("in");
    let expected = {
        let mut v = write_events(&input, 0, 60, 20);
        v.sort();
        v
    };
    std::fs::write(dir.join("job.sql"), events_job(&input, &dir.join("out"), 1)).unwrap();
    let args = [
        "run",
        "job.sql",
        "--checkpoint",
        "ckpt",
        "--trigger",
        "available-now",
    ];
    let kills = kill_until_done(dir, &args, &[], 8, clock_seed(), Duration::from_secs(240));
    // 60 one-file batches take far longer than the longest delay: a run of
    // this test that killed nothing would prove nothing.
    assert!(kills >= 3, "only {kills} kills landed");
    let rows = read_py(&dir.join("out"));
    assert_exactly_once(&rows, &expected);
    let ours = query(
        dir,
        "SELECT count(*) AS n, count(DISTINCT event_id) AS d FROM 'out'",
    );
    assert_eq!(ours[0]["n"], expected.len() as u64);
    assert_eq!(ours[0]["d"], expected.len() as u64);
}
