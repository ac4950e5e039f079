//! A crash at each step of the batch protocol, then a restart: the table
//! equals an uninterrupted run's, as a multiset of rows.

use crate::common::*;

fn run_with_fail_point(
    dir: &std::path::Path,
    job: &str,
    ckpt: &str,
    fail: Option<&str>,
) -> std::process::Output {
    let envs: Vec<(&str, String)> = fail
        .map(|f| ("LAKESTREAM_FAIL_POINT", f.to_string()))
        .into_iter()
        .collect();
    run_available_now(dir, job, ckpt, &envs, &["--progress-json"])
}

#[test]
fn a_crash_at_any_protocol_step_leaves_the_table_equal_to_an_uninterrupted_run() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let input = dir.join("in");
    write_events(&input, 0, 6, 20);

    std::fs::write(dir.join("ref.sql"), events_job(&input, &dir.join("ref"), 2)).unwrap();
    let o = run_with_fail_point(dir, "ref.sql", "ref_ckpt", None);
    assert!(o.status.success(), "{}", text(&o));
    let reference = multiset(&read_py(&dir.join("ref")));
    assert_eq!(reference.len(), 6 * 16);

    for point in ["after-write-ahead", "after-files", "after-commit"] {
        for batch in [0, 1] {
            let name = format!("{point}-{batch}");
            let table = dir.join(&name);
            std::fs::write(
                dir.join(format!("{name}.sql")),
                events_job(&input, &table, 2),
            )
            .unwrap();
            let ckpt = format!("{name}_ckpt");
            let o = run_with_fail_point(
                dir,
                &format!("{name}.sql"),
                &ckpt,
                Some(&format!("{point}:{batch}")),
            );
            assert_eq!(o.status.code(), Some(1), "{name}: {}", text(&o));
            assert!(
                String::from_utf8_lossy(&o.stderr).contains("fail point"),
                "{name}: {}",
                text(&o)
            );
            let o = run_with_fail_point(dir, &format!("{name}.sql"), &ckpt, None);
            assert!(o.status.success(), "{name}: {}", text(&o));
            let progress: Vec<serde_json::Value> = String::from_utf8(o.stdout.clone())
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect();
            let first = &progress[0];
            assert_eq!(
                first["batch_id"], batch,
                "{name}: the restart re-runs the crashed batch"
            );
            assert_eq!(first["recovered"], true, "{name}");
            // Only a crash after the Delta commit finds the batch already in
            // the table; the txn check makes the re-run a no-op.
            assert_eq!(first["skipped"], point == "after-commit", "{name}: {first}");
            assert_eq!(
                multiset(&read_py(&table)),
                reference,
                "{name}: table differs from the uninterrupted run"
            );
        }
    }
}
