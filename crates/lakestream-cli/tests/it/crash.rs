//! kill -9 at random moments, restart until done: every row exactly once.

use std::process::Stdio;
use std::time::{Duration, Instant};

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
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    eprintln!("crash test seed: {seed}");
    let mut rng = Rng(seed);
    let args = [
        "run",
        "job.sql",
        "--checkpoint",
        "ckpt",
        "--trigger",
        "available-now",
    ];

    let mut kills = 0;
    let deadline = Instant::now() + Duration::from_secs(240);
    let mut finished = false;
    for attempt in 0..40 {
        assert!(Instant::now() < deadline, "crash loop took too long");
        let mut child = bin()
            .current_dir(dir)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        if kills < 8 {
            let delay = Duration::from_millis(20 + rng.below(350));
            let start = Instant::now();
            let mut exited = None;
            while start.elapsed() < delay {
                if let Some(s) = child.try_wait().unwrap() {
                    exited = Some(s);
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            match exited {
                Some(s) => {
                    let out = child.wait_with_output().unwrap();
                    assert!(s.success(), "attempt {attempt}: {}", text(&out));
                    finished = true;
                    break;
                }
                None => {
                    child.kill().unwrap(); // SIGKILL
                    child.wait().unwrap();
                    kills += 1;
                }
            }
        } else {
            let out = child.wait_with_output().unwrap();
            assert!(out.status.success(), "final run: {}", text(&out));
            finished = true;
            break;
        }
    }
    assert!(finished, "the job never completed");
    eprintln!("killed {kills} times");
    // 60 one-file batches take far longer than the longest delay: a run of
    // this test that killed nothing would prove nothing.
    assert!(kills >= 3, "only {kills} kills landed");
    let rows = read_py(&dir.join("out"));
    let dupes: Vec<_> = counts(&rows, "event_id")
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .collect();
    assert!(dupes.is_empty(), "rows written twice: {dupes:?}");
    assert_eq!(ids(&rows), expected, "every kept event exactly once");
    let ours = query(
        dir,
        "SELECT count(*) AS n, count(DISTINCT event_id) AS d FROM 'out'",
    );
    assert_eq!(ours[0]["n"], expected.len() as u64);
    assert_eq!(ours[0]["d"], expected.len() as u64);
}
