//! `lakestream table lineage` and `lakestream verify`, on tables written by
//! a real run and then broken on purpose, one way at a time.

use std::path::Path;

use serde_json::Value;

use crate::common::*;

/// A finished 3-batch run (6 files of 20 events, 2 per batch) into `out`,
/// checkpointed at `ckpt`.
fn finished_run(dir: &Path) {
    write_events(&dir.join("in"), 0, 6, 20);
    std::fs::write(
        dir.join("job.sql"),
        events_job(&dir.join("in"), &dir.join("out"), 2),
    )
    .unwrap();
    let o = run_available_now(dir, "job.sql", "ckpt", &[], &[]);
    assert!(o.status.success(), "{}", text(&o));
}

/// A copy of `from` at `to` (the table and checkpoint to break).
fn copy(from: &Path, to: &Path) {
    let st = std::process::Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()
        .unwrap();
    assert!(st.success());
}

/// Rewrite each action of commit `version` of the table at `table`.
fn edit_commit(table: &Path, version: u64, f: impl Fn(&mut Value)) {
    let path = table.join(format!("_delta_log/{version:020}.json"));
    let body = std::fs::read_to_string(&path).unwrap();
    let mut out = String::new();
    for line in body.lines().filter(|l| !l.is_empty()) {
        let mut v: Value = serde_json::from_str(line).unwrap();
        f(&mut v);
        out.push_str(&v.to_string());
        out.push('\n');
    }
    std::fs::write(path, out).unwrap();
}

/// `lakestream verify` of `dir/ckpt` with `extra` arguments: exit code and
/// the JSON report.
fn verify(dir: &Path, extra: &[&str]) -> (i32, Value) {
    let mut args = vec!["verify", "--checkpoint", "ckpt", "--table", "out", "--json"];
    args.extend_from_slice(extra);
    let o = run_in(dir, &args);
    let report: Value = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("verify printed no JSON ({e}): {}", text(&o)));
    (o.status.code().unwrap(), report)
}

fn errors(report: &Value) -> String {
    report["errors"].to_string()
}

#[test]
fn lineage_names_the_exact_input_of_a_version() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    finished_run(dir);
    // Version 2 holds batch 1: files 2 and 3.
    let o = run_in(
        dir,
        &["table", "lineage", "out", "--version", "2", "--json"],
    );
    assert!(o.status.success(), "{}", text(&o));
    let l: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(l["batch_id"], 1, "{l}");
    assert_eq!(l["input_rows"], 40, "{l}");
    assert_eq!(l["output_rows"], 32, "{l}");
    assert!(
        l["sql_fingerprint"]
            .as_str()
            .unwrap()
            .starts_with("sha256:")
    );
    let files: Vec<&str> = l["ranges"]["events"]["end"]["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["path"].as_str().unwrap())
        .collect();
    assert_eq!(files.len(), 2, "{l}");
    assert!(files[0].ends_with("in/events-0002.json"), "{l}");
    assert!(files[1].ends_with("in/events-0003.json"), "{l}");
    // The human form, and the default (latest) version.
    let o = run_in(dir, &["table", "lineage", "out"]);
    assert!(o.status.success(), "{}", text(&o));
    let s = String::from_utf8_lossy(&o.stdout);
    assert!(s.contains("batch 2 of query"), "{s}");
    assert!(
        s.contains("events-0004.json") && s.contains("events-0005.json"),
        "{s}"
    );
    // Version 0 (the table's creation) is not a lakestream batch.
    let o = run_in(dir, &["table", "lineage", "out", "--version", "0"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("not written by a lakestream query"));
    let o = run_in(dir, &["table", "lineage", "out", "--version", "9"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("no version 9"), "{}", text(&o));
}

#[test]
fn verify_passes_a_clean_table_and_names_each_kind_of_damage() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base");
    std::fs::create_dir_all(&base).unwrap();
    finished_run(&base);
    let (code, report) = verify(&base, &[]);
    assert_eq!(code, 0, "{report}");
    assert_eq!(report["clean"], true, "{report}");
    assert_eq!(report["batches_in_table"], 3, "{report}");
    assert_eq!(report["orphans"], serde_json::json!([]), "{report}");
    let o = run_in(&base, &["verify", "--checkpoint", "ckpt"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("clean: 3 batches"));

    let broken = |name: &str| {
        let d = tmp.path().join(name);
        copy(&base, &d);
        d
    };

    // A batch committed twice (its commit replayed as a new version).
    let d = broken("twice");
    std::fs::copy(
        d.join("out/_delta_log/00000000000000000002.json"),
        d.join("out/_delta_log/00000000000000000004.json"),
    )
    .unwrap();
    let (code, report) = verify(&d, &[]);
    assert_eq!(code, 1, "{report}");
    assert!(
        errors(&report).contains("batch 1 is in the table 2 times (versions 2, 4)"),
        "{report}"
    );

    // A batch missing from the table.
    let d = broken("missing");
    edit_commit(&d.join("out"), 2, |a| {
        if a.get("txn").is_some() {
            a["txn"]["version"] = 7.into();
        }
        if a.get("commitInfo").is_some() {
            a["commitInfo"]["lakestream"]["batchId"] = 7.into();
        }
    });
    let (code, report) = verify(&d, &[]);
    assert_eq!(code, 1, "{report}");
    let e = errors(&report);
    assert!(e.contains("batches 1, 3, 4, 5, 6 are missing"), "{report}");
    assert!(
        e.contains("commits/1 says batch 1 is in table version 2"),
        "{report}"
    );

    // A gap: batch 2's commit says it started somewhere batch 1 did not end.
    let d = broken("gap");
    edit_commit(&d.join("out"), 3, |a| {
        if a.get("commitInfo").is_some() {
            a["commitInfo"]["lakestream"]["ranges"]["events"]["start"]["count"] = 3.into();
        }
    });
    let (code, report) = verify(&d, &[]);
    assert_eq!(code, 1, "{report}");
    let e = errors(&report);
    assert!(
        e.contains("source events: batch 2 (version 3) starts at"),
        "{report}"
    );
    assert!(e.contains("a gap or an overlap"), "{report}");

    // The checkpoint's write-ahead record of a batch differs from what its
    // commit says it read.
    let d = broken("offsets");
    let path = d.join("ckpt/offsets/1");
    let mut o: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    o["sources"]["events"]["end"]["files"][0]["size"] = 1.into();
    std::fs::write(&path, o.to_string()).unwrap();
    let (code, report) = verify(&d, &[]);
    assert_eq!(code, 1, "{report}");
    assert!(
        errors(&report).contains("batch 1: the range of source events in the commit (version 2) is not the one in offsets/1"),
        "{report}"
    );

    // A write-ahead record lost inside the retained window.
    let d = broken("lost-offsets");
    std::fs::remove_file(d.join("ckpt/offsets/1")).unwrap();
    let (code, report) = verify(&d, &[]);
    assert_eq!(code, 1, "{report}");
    assert!(
        errors(&report).contains(
            "batch 1 is committed (commits/1) but its write-ahead record offsets/1 is missing"
        ),
        "{report}"
    );

    // Row counts that do not add up.
    let d = broken("rows");
    edit_commit(&d.join("out"), 1, |a| {
        if a.get("commitInfo").is_some() {
            a["commitInfo"]["lakestream"]["outputRows"] = 99.into();
        }
    });
    let (code, report) = verify(&d, &[]);
    assert_eq!(code, 1, "{report}");
    assert!(
        errors(&report).contains(
            "batch 0 (version 1): the commit says 99 rows were written but its files hold 32"
        ),
        "{report}"
    );

    // An orphan file: listed, a warning, an error with --strict.
    let d = broken("orphan");
    let part = std::fs::read_dir(d.join("out"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .find(|n| n.starts_with("day="))
        .unwrap();
    std::fs::write(d.join("out").join(&part).join("stray.parquet"), b"x").unwrap();
    let (code, report) = verify(&d, &[]);
    assert_eq!(code, 0, "{report}");
    assert_eq!(
        report["orphans"],
        serde_json::json!([format!("{part}/stray.parquet")]),
        "{report}"
    );
    let (code, report) = verify(&d, &["--strict"]);
    assert_eq!(code, 1, "{report}");
    assert!(
        errors(&report).contains("referenced by no commit"),
        "{report}"
    );
}

#[test]
fn long_file_lists_are_recorded_as_digests_that_verify_still_checks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // 2 batches of 120 files: each batch's file list is far over 8 KiB.
    write_events(&dir.join("in"), 0, 240, 1);
    std::fs::write(
        dir.join("job.sql"),
        events_job(&dir.join("in"), &dir.join("out"), 120),
    )
    .unwrap();
    let o = run_available_now(dir, "job.sql", "ckpt", &[], &[]);
    assert!(o.status.success(), "{}", text(&o));
    let o = run_in(dir, &["table", "lineage", "out", "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let l: Value = serde_json::from_slice(&o.stdout).unwrap();
    let end = &l["ranges"]["events"]["end"];
    assert_eq!(end["checkpoint"], "offsets/1", "{l}");
    assert_eq!(end["sha256"].as_str().unwrap().len(), 64, "{l}");
    assert!(end["bytes"].as_u64().unwrap() > 8 * 1024, "{l}");
    let o = run_in(dir, &["table", "lineage", "out"]);
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("holds it in full"),
        "{}",
        text(&o)
    );
    let (code, report) = verify(dir, &[]);
    assert_eq!(code, 0, "{report}");
    assert_eq!(report["batches_in_table"], 2, "{report}");

    // A changed offsets/1 no longer matches the digest its commit records.
    let path = dir.join("ckpt/offsets/1");
    let mut o: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    o["sources"]["events"]["end"]["files"][7]["size"] = 1.into();
    std::fs::write(&path, o.to_string()).unwrap();
    let (code, report) = verify(dir, &[]);
    assert_eq!(code, 1, "{report}");
    assert!(
        errors(&report).contains("is not the one in offsets/1"),
        "{report}"
    );
}
