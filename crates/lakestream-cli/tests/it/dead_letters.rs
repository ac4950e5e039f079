//! `on_error 'dead_letter'`: records a source cannot decode go to a Delta
//! table of their own, exactly once per batch, and the batch goes on with
//! the good rows. Checked by Python `deltalake` and under SIGKILL.

use std::path::Path;

use crate::broker::{Broker, kafka_job, orders};
use crate::common::*;

const COLUMNS: &str = "event_id VARCHAR NOT NULL, user_id BIGINT, amount DOUBLE";

/// `files` JSON files of 20 lines; in each, lines 4 (not JSON), 9 (a
/// string amount), 13 (no event_id, which is NOT NULL) and 17 (invalid
/// UTF-8) are bad. Returns the good event ids and the bad lines as
/// (file name, line).
fn write_mixed(dir: &Path, files: usize) -> (Vec<String>, Vec<(String, u64)>) {
    std::fs::create_dir_all(dir).unwrap();
    let (mut good, mut bad) = (Vec::new(), Vec::new());
    for f in 0..files {
        let name = format!("part-{f:03}.json");
        let mut body: Vec<u8> = Vec::new();
        for line in 1..=20u64 {
            let id = format!("e-{f:03}-{line:02}");
            let text: Vec<u8> = match line {
                4 => b"{\"event_id\": \"broken".to_vec(),
                9 => format!("{{\"event_id\":\"{id}\",\"user_id\":1,\"amount\":\"lots\"}}")
                    .into_bytes(),
                13 => b"{\"user_id\":2,\"amount\":1.5}".to_vec(),
                17 => {
                    let mut v =
                        format!("{{\"event_id\":\"{id}\",\"user_id\":3,\"amount\":2.0,\"note\":\"")
                            .into_bytes();
                    v.extend_from_slice(&[0xff, 0xfe]);
                    v.extend_from_slice(b"\"}");
                    v
                }
                _ => {
                    good.push(id.clone());
                    format!("{{\"event_id\":\"{id}\",\"user_id\":{line},\"amount\":{line}.5}}")
                        .into_bytes()
                }
            };
            if matches!(line, 4 | 9 | 13 | 17) {
                bad.push((name.clone(), line));
            }
            body.extend_from_slice(&text);
            body.push(b'\n');
        }
        let tmp = dir.join(format!(".tmp-{f}"));
        std::fs::write(&tmp, body).unwrap();
        std::fs::rename(&tmp, dir.join(&name)).unwrap();
    }
    good.sort();
    bad.sort();
    (good, bad)
}

fn files_job(extra: &str) -> String {
    format!(
        "CREATE UNBOUNDED EXTERNAL TABLE events ({COLUMNS}) STORED AS JSON LOCATION 'in/'\n\
         OPTIONS ('max_files_per_trigger' '2', 'batch_size' '6'{extra});\n\
         CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out';\n\
         INSERT INTO out SELECT event_id, user_id, amount FROM events;\n"
    )
}

const DEAD: &str = ", 'on_error' 'dead_letter', 'dead_letter_location' 'bad_events'";

/// The dead-letter rows as (file name, line), sorted, asserting each is
/// there once with its error and the batch that read it.
fn dead_lines(dir: &Path) -> Vec<(String, u64)> {
    let rows = read_py(&dir.join("bad_events"));
    let mut v: Vec<(String, u64)> = rows
        .iter()
        .map(|r| {
            assert_eq!(r["source"], "events", "{r}");
            assert!(!r["error"].as_str().unwrap().is_empty(), "{r}");
            assert!(r["batch_id"].as_i64().is_some(), "{r}");
            let file = r["file"].as_str().unwrap();
            (
                file.rsplit('/').next().unwrap().to_string(),
                r["line"].as_u64().unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

#[test]
fn bad_lines_go_to_the_dead_letter_table_once_through_sigkills_and_good_rows_go_on() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (good, bad) = write_mixed(&dir.join("in"), 40);
    // Without the option, the first bad line fails the batch, naming it.
    std::fs::write(dir.join("job.sql"), files_job("")).unwrap();
    let o = run_available_now(dir, "job.sql", "ck_fail", &[], &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = stderr(&o);
    assert!(err.contains(".json at line 4: "), "{err}");
    assert!(
        err.contains("'on_error' 'dead_letter'"),
        "the fix is named: {err}"
    );

    std::fs::write(dir.join("job.sql"), files_job(DEAD)).unwrap();
    kill_run_job(dir, 6, 2);
    assert_exactly_once(&read_py(&dir.join("out")), &good);
    assert_eq!(dead_lines(dir), bad, "every bad line once");
    let rows = read_py(&dir.join("bad_events"));
    let by_line = |line: u64| {
        rows.iter()
            .find(|r| r["line"] == line && r["file"].as_str().unwrap().ends_with("part-003.json"))
            .unwrap()
            .clone()
    };
    assert_eq!(by_line(4)["record"], "{\"event_id\": \"broken");
    assert!(
        by_line(9)["error"].as_str().unwrap().contains("amount"),
        "{}",
        by_line(9)
    );
    assert!(
        by_line(13)["error"].as_str().unwrap().contains("event_id"),
        "{}",
        by_line(13)
    );
    // The exact bytes are kept, invalid UTF-8 and all.
    let raw17 = by_line(17)["record_bytes"].to_string();
    assert!(!raw17.is_empty() && by_line(17)["record"].as_str().unwrap().contains('\u{fffd}'));
    let o = run_in(dir, &["verify", "--checkpoint", "ckpt"]);
    assert!(o.status.success(), "verify (both tables): {}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("bad_events"),
        "{}",
        text(&o)
    );
}

#[test]
fn a_replay_whose_dead_letters_are_in_writes_the_output_once_and_them_once() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (good, bad) = write_mixed(&dir.join("in"), 4);
    std::fs::write(dir.join("job.sql"), files_job(DEAD)).unwrap();
    // A batch's dead letters are committed before its outputs: batch 0's
    // go in, then the process dies before its output's commit.
    let o = run_available_now(
        dir,
        "job.sql",
        "ckpt",
        &[("LAKESTREAM_FAIL_POINT", "after-commit:0".into())],
        &[],
    );
    assert!(!o.status.success(), "{}", text(&o));
    assert!(
        dir.join("bad_events/_delta_log/00000000000000000001.json")
            .exists()
    );
    assert!(
        !dir.join("out/_delta_log/00000000000000000001.json")
            .exists()
    );
    let o = run_available_now(dir, "job.sql", "ckpt", &[], &["--progress-json"]);
    assert!(o.status.success(), "{}", text(&o));
    let progress: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let replay = progress.iter().find(|p| p["batch_id"] == 0).unwrap();
    assert_eq!(replay["outputs"][0]["skipped"], false, "{replay}");
    assert_eq!(replay["outputs"][1]["skipped"], true, "{replay}");
    assert_exactly_once(&read_py(&dir.join("out")), &good);
    assert_eq!(dead_lines(dir), bad);
    let o = run_in(dir, &["verify", "--checkpoint", "ckpt"]);
    assert!(o.status.success(), "verify: {}", text(&o));
}

#[test]
fn csv_rows_of_the_wrong_type_go_to_the_dead_letters_with_their_line() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::create_dir_all(dir.join("in")).unwrap();
    std::fs::write(
        dir.join("in/a.csv"),
        "event_id,user_id,amount\ne1,1,1.5\ne2,two,2.5\ne3,3,3.5\ne4,4,x\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("job.sql"),
        format!(
            "CREATE UNBOUNDED EXTERNAL TABLE events ({COLUMNS}) STORED AS CSV LOCATION 'in/'\n\
             OPTIONS ('has_header' 'true'{DEAD});\n\
             CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out';\n\
             INSERT INTO out SELECT event_id, user_id, amount FROM events;\n"
        ),
    )
    .unwrap();
    let o = run_available_now(dir, "job.sql", "ckpt", &[], &["--progress-json"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("\"deadLetters\":2"),
        "{}",
        text(&o)
    );
    assert!(!stderr(&o).contains("WARN"), "{}", text(&o));
    assert_eq!(ids(&read_py(&dir.join("out"))), vec!["e1", "e3"]);
    let dead = dead_lines(dir);
    assert_eq!(dead, vec![("a.csv".into(), 3), ("a.csv".into(), 5)]);
    let rows = read_py(&dir.join("bad_events"));
    assert!(rows.iter().any(|r| r["record"] == "e2,two,2.5"), "{rows:?}");
}

#[test]
fn dead_letter_options_are_checked_before_anything_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    write_mixed(&dir.join("in"), 1);
    for (extra, says) in [
        (", 'on_error' 'dead_letter'", "without dead_letter_location"),
        (", 'dead_letter_location' 'x'", "not on_error 'dead_letter'"),
        (", 'on_error' 'skip'", "is not a policy"),
    ] {
        std::fs::write(dir.join("job.sql"), files_job(extra)).unwrap();
        let o = run_available_now(dir, "job.sql", "ckpt", &[], &[]);
        assert_eq!(o.status.code(), Some(2), "{extra}: {}", text(&o));
        assert!(stderr(&o).contains(says), "{extra}: {}", text(&o));
    }
    std::fs::write(
        dir.join("job.sql"),
        format!(
            "CREATE UNBOUNDED EXTERNAL TABLE events ({COLUMNS}) STORED AS PARQUET LOCATION 'in/' OPTIONS ('path_glob' '*.parquet'{DEAD});\n\
             CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out';\n\
             INSERT INTO out SELECT event_id FROM events;\n"
        ),
    )
    .unwrap();
    let o = run_available_now(dir, "job.sql", "ckpt", &[], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        stderr(&o).contains("a Parquet or Avro file is read whole"),
        "{}",
        text(&o)
    );
    assert!(!dir.join("out").exists() && !dir.join("bad_events").exists());
}

#[test]
fn kafka_records_that_do_not_decode_go_to_the_dead_letters_with_their_offsets() {
    let broker = Broker::start();
    broker.create_topic("mixed", 2);
    let mut records = orders(0, 40);
    // Not JSON, a type error (found at flush), NULL in the NOT NULL key.
    records[5].1 = "not json".into();
    records[17].1 = "{\"order_id\":\"o-x\",\"amount\":\"much\"}".into();
    records[30].1 = "{\"customer_id\":1}".into();
    let placed = broker.produce("mixed", 2, &records);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::write(
        dir.join("job.sql"),
        kafka_job(
            &broker.bootstrap(),
            "mixed",
            "out",
            "'on_error' 'dead_letter', 'dead_letter_location' 'bad_events', 'max_offsets_per_trigger' '15', 'batch_size' '4'",
        ),
    )
    .unwrap();
    kill_run_job(dir, 3, 1);
    let out = read_py(&dir.join("out"));
    assert_eq!(out.len(), 37);
    let mut dead: Vec<(i64, i64, String)> = read_py(&dir.join("bad_events"))
        .iter()
        .map(|r| {
            assert_eq!(r["topic"], "mixed");
            (
                r["partition"].as_i64().unwrap(),
                r["offset"].as_i64().unwrap(),
                r["record"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    dead.sort();
    let mut expected: Vec<(i64, i64, String)> = [5usize, 17, 30]
        .iter()
        .map(|&i| (placed[i].0 as i64, placed[i].1, records[i].1.clone()))
        .collect();
    expected.sort();
    assert_eq!(dead, expected);
    let o = run_in(dir, &["verify", "--checkpoint", "ckpt"]);
    assert!(o.status.success(), "verify: {}", text(&o));
}
