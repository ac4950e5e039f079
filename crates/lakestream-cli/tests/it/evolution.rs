//! `merge_schema`: an output table takes a query's new columns in the
//! commit of the batch that first has them; a column the query drops is
//! written as NULL; a changed type is refused. Read back by Python
//! `deltalake`, under SIGKILL.

use std::path::Path;

use crate::common::*;

/// `files` JSON files of 10 events from file number `first`; with
/// `country`, each event has one.
fn write(dir: &Path, first: usize, files: usize, country: bool) -> Vec<String> {
    std::fs::create_dir_all(dir).unwrap();
    let mut ids = Vec::new();
    for f in first..first + files {
        let mut body = String::new();
        for r in 0..10 {
            let id = format!("e-{f:03}-{r}");
            let extra = if country {
                format!(",\"country\":\"c{}\"", r % 3)
            } else {
                String::new()
            };
            body.push_str(&format!(
                "{{\"event_id\":\"{id}\",\"user_id\":{r},\"amount\":{r}.5{extra}}}\n"
            ));
            ids.push(id);
        }
        let tmp = dir.join(format!(".tmp-{f}"));
        std::fs::write(&tmp, body).unwrap();
        std::fs::rename(&tmp, dir.join(format!("f-{f:03}.json"))).unwrap();
    }
    ids
}

fn job(select: &str, out_options: &str) -> String {
    format!(
        "CREATE UNBOUNDED EXTERNAL TABLE events (event_id VARCHAR NOT NULL, user_id BIGINT, amount DOUBLE, country VARCHAR)\n\
         STORED AS JSON LOCATION 'in/' OPTIONS ('max_files_per_trigger' '1');\n\
         CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out'{out_options};\n\
         INSERT INTO out SELECT {select} FROM events;\n"
    )
}

/// The table `out` holds `all` once each, with a country exactly for the
/// events of files 3 and later.
fn assert_events_once_with_country_from_file_3(dir: &Path, all: &mut [String]) {
    all.sort();
    let rows = read_py(&dir.join("out"));
    assert_exactly_once(&rows, all);
    for r in &rows {
        let old = r["event_id"].as_str().unwrap() < "e-003";
        assert_eq!(r["country"].is_null(), old, "{r}");
    }
}

const MERGE: &str = " OPTIONS ('merge_schema' 'true')";

/// The `_delta_log` commits (version, actions) of the table at `table`.
fn log(table: &Path) -> Vec<(u64, Vec<serde_json::Value>)> {
    let mut out: Vec<(u64, Vec<serde_json::Value>)> = std::fs::read_dir(table.join("_delta_log"))
        .unwrap()
        .filter_map(|e| {
            let p = e.unwrap().path();
            let name = p.file_name()?.to_str()?.to_string();
            let v: u64 = name.strip_suffix(".json")?.parse().ok()?;
            let actions = std::fs::read_to_string(&p)
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect();
            Some((v, actions))
        })
        .collect();
    out.sort_by_key(|(v, _)| *v);
    out
}

#[test]
fn new_columns_join_the_table_in_the_batchs_own_commit_through_sigkills() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut all = write(&dir.join("in"), 0, 3, false);
    std::fs::write(dir.join("job.sql"), job("event_id, user_id, amount", "")).unwrap();
    let o = run_available_now(dir, "job.sql", "ckpt", &[], &[]);
    assert!(o.status.success(), "{}", text(&o));

    // The query now writes a country: refused without merge_schema.
    all.extend(write(&dir.join("in"), 3, 30, true));
    std::fs::write(
        dir.join("job.sql"),
        job("event_id, user_id, amount, country", ""),
    )
    .unwrap();
    let o = run_available_now(dir, "job.sql", "ckpt", &[], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains("'merge_schema' 'true'"), "{}", text(&o));

    std::fs::write(
        dir.join("job.sql"),
        job("event_id, user_id, amount, country", MERGE),
    )
    .unwrap();
    kill_run_job(dir, 4, 1);
    assert_events_once_with_country_from_file_3(dir, &mut all);
    assert_eq!(
        meta_py(&dir.join("out"))["columns"],
        serde_json::json!(["event_id", "user_id", "amount", "country"])
    );
    // One commit changed the schema, and it is a batch's: metaData with
    // the batch's files and its txn.
    let evolving: Vec<(u64, Vec<serde_json::Value>)> = log(&dir.join("out"))
        .into_iter()
        .filter(|(v, a)| *v > 0 && a.iter().any(|x| x.get("metaData").is_some()))
        .collect();
    assert_eq!(evolving.len(), 1, "{evolving:?}");
    let actions = &evolving[0].1;
    assert!(
        actions.iter().any(|x| x.get("add").is_some()),
        "{actions:?}"
    );
    assert!(
        actions.iter().any(|x| x.get("txn").is_some()),
        "{actions:?}"
    );
    let o = run_in(dir, &["verify", "--checkpoint", "ckpt"]);
    assert!(o.status.success(), "verify: {}", text(&o));

    // A column the query drops is written as NULL.
    let more = write(&dir.join("in"), 33, 2, true);
    std::fs::write(dir.join("job.sql"), job("event_id, amount, country", MERGE)).unwrap();
    let o = run_available_now(dir, "job.sql", "ckpt", &[], &[]);
    assert!(o.status.success(), "{}", text(&o));
    let rows = read_py(&dir.join("out"));
    for r in rows
        .iter()
        .filter(|r| more.contains(&r["event_id"].as_str().unwrap().to_string()))
    {
        assert!(r["user_id"].is_null() && !r["country"].is_null(), "{r}");
    }
    assert_eq!(rows.len(), all.len() + more.len());

    // A changed type is refused before anything runs.
    std::fs::write(
        dir.join("job.sql"),
        job(
            "event_id, user_id, CAST(amount AS VARCHAR) AS amount, country",
            MERGE,
        ),
    )
    .unwrap();
    let o = run_available_now(dir, "job.sql", "ckpt", &[], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        stderr(&o).contains("never changes a column's type"),
        "{}",
        text(&o)
    );
}

#[test]
fn an_inferred_json_schema_takes_new_fields_after_one_stop() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut all = write(&dir.join("in"), 0, 3, false);
    std::fs::write(
        dir.join("job.sql"),
        "CREATE UNBOUNDED EXTERNAL TABLE events STORED AS JSON LOCATION 'in/'\n\
         OPTIONS ('max_files_per_trigger' '1', 'schema_evolution' 'add_new_columns');\n\
         CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out' OPTIONS ('merge_schema' 'true');\n\
         INSERT INTO out SELECT * FROM events;\n",
    )
    .unwrap();
    let o = run_available_now(dir, "job.sql", "ckpt", &[], &[]);
    assert!(o.status.success(), "{}", text(&o));

    // New files bring a field: the run stops once, naming it.
    all.extend(write(&dir.join("in"), 3, 3, true));
    let o = run_available_now(dir, "job.sql", "ckpt", &[], &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = stderr(&o);
    assert!(
        err.contains("f-003.json has new fields (country)") && err.contains("restart"),
        "{err}"
    );
    let stored = std::fs::read_to_string(dir.join("ckpt/sources/events/schema")).unwrap();
    assert!(stored.contains("country"), "{stored}");

    // The restart reads them, and the table takes the column.
    let o = run_available_now(dir, "job.sql", "ckpt", &[], &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert_events_once_with_country_from_file_3(dir, &mut all);
    let o = run_in(dir, &["verify", "--checkpoint", "ckpt"]);
    assert!(o.status.success(), "verify: {}", text(&o));

    // Declared columns do not evolve: refused before anything runs.
    std::fs::write(
        dir.join("job2.sql"),
        "CREATE UNBOUNDED EXTERNAL TABLE events (event_id VARCHAR) STORED AS JSON LOCATION 'in/'\n\
         OPTIONS ('schema_evolution' 'add_new_columns');\n\
         CREATE EXTERNAL TABLE out2 STORED AS DELTA LOCATION 'out2';\n\
         INSERT INTO out2 SELECT * FROM events;\n",
    )
    .unwrap();
    let o = run_available_now(dir, "job2.sql", "ckpt2", &[], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains("declares its columns"), "{}", text(&o));
}

#[test]
fn a_csv_stream_takes_columns_added_after_its_header_after_one_stop() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::create_dir_all(dir.join("in")).unwrap();
    std::fs::write(dir.join("in/a.csv"), "event_id,amount\na1,1.5\na2,2.5\n").unwrap();
    std::fs::write(
        dir.join("job.sql"),
        "CREATE UNBOUNDED EXTERNAL TABLE events STORED AS CSV LOCATION 'in/'\n\
         OPTIONS ('has_header' 'true', 'max_files_per_trigger' '1', 'schema_evolution' 'add_new_columns');\n\
         CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out' OPTIONS ('merge_schema' 'true');\n\
         INSERT INTO out SELECT * FROM events;\n",
    )
    .unwrap();
    let o = run_available_now(dir, "job.sql", "ckpt", &[], &[]);
    assert!(o.status.success(), "{}", text(&o));
    std::fs::write(
        dir.join("in/b.csv"),
        "event_id,amount,country,visits\nb1,3.5,nl,3\nb2,4.5,fr,4\n",
    )
    .unwrap();
    let o = run_available_now(dir, "job.sql", "ckpt", &[], &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        stderr(&o).contains("b.csv has new fields (country, visits)"),
        "{}",
        text(&o)
    );
    let o = run_available_now(dir, "job.sql", "ckpt", &[], &[]);
    assert!(o.status.success(), "{}", text(&o));
    let mut rows: Vec<String> = read_py(&dir.join("out"))
        .iter()
        .map(|r| {
            format!(
                "{} {} {} {}",
                r["event_id"], r["amount"], r["country"], r["visits"]
            )
        })
        .collect();
    rows.sort();
    assert_eq!(
        rows,
        [
            "\"a1\" 1.5 null null",
            "\"a2\" 2.5 null null",
            "\"b1\" 3.5 \"nl\" 3",
            "\"b2\" 4.5 \"fr\" 4"
        ]
    );
}
