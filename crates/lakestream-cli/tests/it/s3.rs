//! Input, checkpoint and table on a real S3-compatible server (SeaweedFS,
//! started on 127.0.0.1 by scripts/test.sh): a backfill killed with SIGKILL
//! at random moments and restarted keeps every row exactly once, the table
//! is read by Python `deltalake` from S3, stores without conditional PUT are
//! refused, and secrets never reach the output.

use std::time::Duration;

use lakestream_testkit::s3::S3Server;

use crate::common::*;

/// The test S3 server scripts/test.sh started.
fn s3() -> S3Server {
    S3Server::from_env()
}

/// The events job with its input, table and checkpoint under `prefix`.
fn s3_events_job(prefix: &str, max_files: usize) -> String {
    format!(
        "CREATE UNBOUNDED EXTERNAL TABLE events (\n  event_id VARCHAR NOT NULL, user_id BIGINT, event_type VARCHAR, amount DOUBLE, ts TIMESTAMP\n) STORED AS JSON LOCATION '{prefix}input/'\nOPTIONS ('max_files_per_trigger' '{max_files}');\n\n\
         CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION '{prefix}table/' PARTITIONED BY (day);\n\n\
         INSERT INTO out\nSELECT event_id, user_id, event_type, amount, ts, CAST(ts AS DATE) AS day\nFROM events WHERE amount > 0;\n"
    )
}

#[test]
fn s3_backfill_survives_sigkill_with_input_checkpoint_and_table_on_s3() {
    let s3 = s3();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let prefix = s3.prefix("crash");
    let expected = {
        let mut v = write_events(&dir.join("in"), 0, 30, 20);
        v.sort();
        v
    };
    s3.upload_dir(&dir.join("in"), &format!("{prefix}input/"));
    std::fs::write(dir.join("job.sql"), s3_events_job(&prefix, 1)).unwrap();
    let ckpt = format!("{prefix}ckpt/");
    let args = run_job_args(&ckpt);
    let kills = kill_until_done(
        dir,
        &args,
        &s3.env(),
        6,
        clock_seed(),
        Duration::from_secs(300),
    );
    assert!(kills >= 2, "only {kills} kills landed");

    // Everything lives on S3: nothing was written locally but the job file.
    let mut local: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    local.sort();
    assert_eq!(local, ["in", "job.sql"]);
    let keys = s3.list(&prefix);
    assert!(
        keys.iter().any(|k| k.starts_with("ckpt/commits/")),
        "{keys:?}"
    );
    assert!(
        keys.iter().any(|k| k.starts_with("table/_delta_log/")),
        "{keys:?}"
    );
    // A kill between a store probe's create and delete may leave its object;
    // nothing else is left behind.
    let probes = keys
        .iter()
        .filter(|k| k.contains("_lakestream_probe"))
        .count();
    assert!(
        probes <= kills,
        "{probes} probe objects left behind: {keys:?}"
    );

    let table = format!("{prefix}table/");
    let rows = read_py(&table);
    assert_exactly_once(&rows, &expected);

    // Table and checkpoint on S3 agree batch by batch (the orphan listing
    // runs against the store too).
    let o = bin()
        .current_dir(dir)
        .envs(s3.env())
        .args(["verify", "--checkpoint", &ckpt, "--json"])
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "verify after {kills} kills: {}",
        text(&o)
    );
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["batches_in_table"], 30, "{report}");

    // Our own reader agrees, through the same environment.
    let out = bin()
        .current_dir(dir)
        .envs(s3.env())
        .args([
            "query",
            "--format",
            "json",
            &format!("SELECT count(*) AS n, count(DISTINCT event_id) AS d FROM '{table}'"),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let v: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().next().unwrap()).unwrap();
    assert_eq!(v["n"], expected.len() as u64, "{v}");
    assert_eq!(v["d"], expected.len() as u64, "{v}");

    // `status` reads the checkpoint on S3.
    let out = bin()
        .current_dir(dir)
        .envs(s3.env())
        .args(["status", "--checkpoint", &ckpt])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("last committed batch: 29"),
        "status names the last batch (29): {}",
        text(&out)
    );
}

#[test]
fn a_store_without_conditional_put_is_refused_before_writing() {
    let s3 = s3();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let prefix = s3.prefix("no-cas");
    write_events(&dir.join("in"), 0, 2, 5);
    s3.upload_dir(&dir.join("in"), &format!("{prefix}input/"));
    std::fs::write(dir.join("job.sql"), s3_events_job(&prefix, 1)).unwrap();
    let out = run_available_now(
        dir,
        "job.sql",
        &format!("{prefix}ckpt/"),
        &s3.env(),
        &["--storage-option", "aws_conditional_put=disabled"],
    );
    assert!(!out.status.success(), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("atomic create-if-absent") && err.contains(&prefix),
        "{}",
        text(&out)
    );
    let keys = s3.list(&prefix);
    assert!(
        keys.iter().all(|k| k.starts_with("input/")),
        "written despite the refusal: {keys:?}"
    );
}

#[test]
fn secrets_never_reach_output_or_errors() {
    let s3 = s3();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let prefix = s3.prefix("secrets");
    write_events(&dir.join("in"), 0, 1, 5);
    s3.upload_dir(&dir.join("in"), &format!("{prefix}input/"));
    let secret = "s3cr3t-DO-NOT-PRINT-4711";
    // A wrong secret in the job's OPTIONS: the store refuses the requests.
    let job = s3_events_job(&prefix, 1).replace(
        "OPTIONS ('max_files_per_trigger' '1')",
        &format!(
            "OPTIONS ('max_files_per_trigger' '1', 'aws.secret_access_key' '{secret}', \
             'aws.max_retries' '1', 'aws.retry_timeout' '2')"
        ),
    );
    std::fs::write(dir.join("job.sql"), job).unwrap();
    let mut env = s3.env();
    env.push(("LAKESTREAM_LOG", "debug".into()));
    let out = run_available_now(dir, "job.sql", "ckpt", &env, &["--progress-json"]);
    assert!(!out.status.success(), "{}", text(&out));
    let all = text(&out);
    assert!(!all.contains(secret), "the secret was printed: {all}");
    assert!(all.contains("input"), "the error names the location: {all}");
}

#[test]
fn a_backfill_of_thousands_of_small_files_on_s3() {
    let s3 = s3();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let prefix = s3.prefix("many");
    const FILES: usize = 2000;
    let mut expected = Vec::new();
    let files: Vec<(String, String)> = (0..FILES)
        .map(|f| {
            let mut body = String::new();
            for r in 0..3 {
                let id = format!("ev-{f:05}-{r}");
                body.push_str(&format!(
                    "{{\"event_id\":\"{id}\",\"user_id\":1,\"event_type\":\"view\",\"amount\":1.5,\"ts\":\"2026-01-0{}T00:00:00Z\"}}\n",
                    1 + f % 3
                ));
                expected.push(id);
            }
            // Hive-style days, as a backfill prefix usually is.
            (format!("date=2026-01-0{}/part-{f:05}.json", 1 + f % 3), body)
        })
        .collect();
    expected.sort();
    let t = std::time::Instant::now();
    s3.upload_many(&format!("{prefix}input/"), files);
    eprintln!("uploaded {FILES} files in {:?}", t.elapsed());
    // The endpoint from SET statements in the job, the keys from the
    // environment.
    let job = format!(
        "SET aws.endpoint = '{}';\nSET aws.allow_http = 'true';\n{}",
        s3.endpoint(),
        s3_events_job(&prefix, 500)
    );
    std::fs::write(dir.join("job.sql"), job).unwrap();
    let env: Vec<_> = s3
        .env()
        .into_iter()
        .filter(|(k, _)| !matches!(*k, "AWS_ENDPOINT" | "AWS_ALLOW_HTTP"))
        .collect();
    let ckpt = format!("{prefix}ckpt/");
    let t = std::time::Instant::now();
    let out = run_available_now(dir, "job.sql", &ckpt, &env, &[]);
    assert!(out.status.success(), "{}", text(&out));
    eprintln!("backfilled {FILES} files from S3 in {:?}", t.elapsed());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("500/2000 files"), "{}", text(&out));
    assert!(
        err.contains("2000/2000 files (100% of bytes)"),
        "{}",
        text(&out)
    );
    assert!(err.contains("done: 4 batches"), "{}", text(&out));
    assert_exactly_once(&read_py(&format!("{prefix}table/")), &expected);
}

#[test]
fn the_s3_backfill_example_runs_against_the_test_server() {
    let s3 = s3();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let prefix = s3.prefix("example");
    // Day-partitioned gzip'd JSON lines, as the example expects, plus a
    // stray file its glob leaves out.
    let mut expected = Vec::new();
    let mut files = Vec::new();
    for day in 1..=4 {
        for part in 0..5 {
            let mut body = String::new();
            for r in 0..10 {
                let id = format!("ev-{day}-{part}-{r}");
                let amount = if r == 9 { -1.0 } else { 2.5 };
                if amount > 0.0 {
                    expected.push(id.clone());
                }
                body.push_str(&format!(
                    "{{\"event_id\":\"{id}\",\"user_id\":{r},\"event_type\":\"view\",\"amount\":{amount},\"ts\":\"2026-01-0{day}T08:00:00Z\"}}\n"
                ));
            }
            let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            std::io::Write::write_all(&mut gz, body.as_bytes()).unwrap();
            files.push((
                format!("date=2026-01-0{day}/part-{part:04}.json.gz"),
                gz.finish().unwrap(),
            ));
        }
    }
    files.push(("date=2026-01-01/_SUCCESS".into(), Vec::new()));
    files.push(("manifest.txt".into(), b"not data".to_vec()));
    expected.sort();
    s3.upload_many(&format!("{prefix}raw/events/"), files);

    let job = std::fs::read_to_string(root().join("examples/s3_backfill.sql"))
        .unwrap()
        .replace("s3://my-bucket/", &prefix);
    std::fs::write(dir.join("job.sql"), job).unwrap();
    let out = run_available_now(
        dir,
        "job.sql",
        &format!("{prefix}checkpoints/events-backfill/"),
        &s3.env(),
        &[],
    );
    assert!(out.status.success(), "{}", text(&out));
    let table = format!("{prefix}tables/events/");
    let rows = read_py(&table);
    assert_exactly_once(&rows, &expected);
    for r in &rows {
        let id = r["event_id"].as_str().unwrap();
        assert_eq!(r["day"], format!("2026-01-0{}", &id[3..4]), "{r}");
    }
}

#[test]
fn a_windowed_aggregation_keeps_its_state_on_s3_through_sigkills() {
    let s3 = s3();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    write_timed_events(&dir.join("in"), 20, 30);
    let prefix = s3.prefix("windowed");
    s3.upload_dir(&dir.join("in"), &format!("{prefix}input/"));

    // The reference: local input and table, no kills.
    std::fs::write(
        dir.join("clean.sql"),
        windowed_job(
            &dir.join("in").display().to_string(),
            &dir.join("clean").display().to_string(),
            "append",
        ),
    )
    .unwrap();
    let o = run_available_now(dir, "clean.sql", "clean_ckpt", &[], &[]);
    assert!(o.status.success(), "{}", text(&o));
    let clean = multiset(&read_py(&dir.join("clean")));
    assert!(clean.len() >= 20, "only {} groups written", clean.len());

    // Input, checkpoint (with the state) and table on S3, killed at random.
    let table = format!("{prefix}table/");
    std::fs::write(
        dir.join("job.sql"),
        windowed_job(&format!("{prefix}input/"), &table, "append"),
    )
    .unwrap();
    let ckpt = format!("{prefix}ckpt/");
    let args = run_job_args(&ckpt);
    let kills = kill_until_done(
        dir,
        &args,
        &s3.env(),
        4,
        clock_seed(),
        Duration::from_secs(300),
    );
    assert!(kills >= 1, "no kill landed");
    assert_eq!(multiset(&read_py(&table)), clean);
    let keys = s3.list(&prefix);
    let state: Vec<&String> = keys
        .iter()
        .filter(|k| k.starts_with("ckpt/state/aggregate/"))
        .collect();
    assert!(
        state.iter().any(|k| k.ends_with(".snapshot.arrow")),
        "{state:?}"
    );

    // Corrupt state stops the restart before any batch, the file named.
    s3.upload_many(
        &prefix,
        state
            .iter()
            .map(|k| ((*k).clone(), b"not arrow".to_vec()))
            .collect(),
    );
    let o = bin()
        .current_dir(dir)
        .envs(s3.env())
        .args(args)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = text(&o);
    assert!(
        err.contains(&format!("{prefix}ckpt/state/aggregate/"))
            && err.contains(".arrow is corrupt"),
        "the error names the file: {err}"
    );
}

#[test]
fn schema_evolution_and_dead_letters_work_on_s3() {
    let s3 = s3();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let prefix = s3.prefix("evolve");
    let write = |sub: &str, name: &str, body: &str| {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
        std::fs::write(dir.join(sub).join(name), body).unwrap();
    };
    write(
        "v1",
        "a.json",
        "{\"event_id\":\"a1\",\"amount\":1.5}\n{\"event_id\":\"a2\",\"amount\":2.5}\n",
    );
    write(
        "v2",
        "b.json",
        "{\"event_id\":\"b1\",\"amount\":3.5,\"country\":\"nl\"}\nnot json\n{\"event_id\":\"b2\",\"amount\":4.5,\"country\":\"fr\"}\n",
    );
    let job = |select: &str, options: &str, out_options: &str| {
        format!(
            "CREATE UNBOUNDED EXTERNAL TABLE events (event_id VARCHAR NOT NULL, amount DOUBLE, country VARCHAR)\n\
             STORED AS JSON LOCATION '{prefix}input/' OPTIONS ('max_files_per_trigger' '1'{options});\n\
             CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION '{prefix}table/'{out_options};\n\
             INSERT INTO out SELECT {select} FROM events;\n"
        )
    };
    let run = || {
        bin()
            .current_dir(dir)
            .envs(s3.env())
            .args(run_job_args(&format!("{prefix}ckpt/")))
            .output()
            .unwrap()
    };
    s3.upload_dir(&dir.join("v1"), &format!("{prefix}input/"));
    std::fs::write(dir.join("job.sql"), job("event_id, amount", "", "")).unwrap();
    let o = run();
    assert!(o.status.success(), "{}", text(&o));

    s3.upload_dir(&dir.join("v2"), &format!("{prefix}input/"));
    std::fs::write(
        dir.join("job.sql"),
        job(
            "event_id, amount, country",
            &format!(", 'on_error' 'dead_letter', 'dead_letter_location' '{prefix}dead/'"),
            " OPTIONS ('merge_schema' 'true')",
        ),
    )
    .unwrap();
    let o = run();
    assert!(o.status.success(), "{}", text(&o));
    let mut rows: Vec<(String, Option<String>)> = read_py(&format!("{prefix}table/"))
        .iter()
        .map(|r| {
            (
                r["event_id"].as_str().unwrap().to_string(),
                r["country"].as_str().map(str::to_string),
            )
        })
        .collect();
    rows.sort();
    assert_eq!(
        rows,
        vec![
            ("a1".into(), None),
            ("a2".into(), None),
            ("b1".into(), Some("nl".into())),
            ("b2".into(), Some("fr".into())),
        ]
    );
    let dead = read_py(&format!("{prefix}dead/"));
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0]["record"], "not json");
    assert_eq!(dead[0]["line"], 2);
    let o = bin()
        .current_dir(dir)
        .envs(s3.env())
        .args(["verify", "--checkpoint", &format!("{prefix}ckpt/")])
        .output()
        .unwrap();
    assert!(o.status.success(), "verify: {}", text(&o));
}
