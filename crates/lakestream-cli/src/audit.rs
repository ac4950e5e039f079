//! Audit of a query's table: `lakestream table lineage` (where a version's
//! rows came from) and `lakestream verify` (the table against its
//! checkpoint, batch by batch).
//!
//! Both read the lineage every lakestream commit records in
//! `commitInfo.lakestream` (see the engine's `lineage` module): batch id,
//! query id, SQL fingerprint, row counts and each source's exact range.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use anyhow::{Context, bail};
use deltalake::DeltaTable;
use futures::TryStreamExt;
use lakestream::storage::Location;
use lakestream_engine::checkpoint::{Checkpoint, CheckpointView};
use lakestream_engine::lineage::{CommitLineage, same_offset};

use crate::table::load;
use serde_json::{Value, json};

/// One commit of the table, as the audit reads it from `_delta_log`.
#[derive(Debug, Default)]
struct LogCommit {
    version: u64,
    /// `commitInfo`, or null.
    info: Value,
    /// `txn` app id -> version.
    txns: BTreeMap<String, u64>,
    /// Paths of `add` actions with their record counts (when stats have them).
    adds: Vec<(String, Option<u64>)>,
    /// Paths of `remove` actions.
    removes: Vec<String>,
    /// `commitInfo.lakestream`, when the commit is a lakestream query's (or
    /// why it does not parse).
    lineage: Option<Result<CommitLineage, String>>,
}

impl LogCommit {
    /// The lineage of a lakestream commit that parses.
    fn lakestream(&self) -> Option<&CommitLineage> {
        self.lineage.as_ref()?.as_ref().ok()
    }
}

/// Positions kept in the table (Kafka group mode): over every commit of
/// every process, each partition's ranges (`commitInfo.lakestream.positions`)
/// must follow one another with no gap and no overlap, and each commit's
/// txn must record where its range ended.
fn check_position_chains(commits: &[LogCommit], r: &mut Report) {
    let mut last: BTreeMap<String, (u64, i64)> = BTreeMap::new();
    for c in commits {
        let Some(l) = c.lakestream() else {
            continue;
        };
        for (app_id, &(from, to)) in &l.positions {
            if c.txns.get(app_id).map(|v| *v as i64) != Some(to) {
                r.errors.push(format!(
                    "version {}: position {app_id} ends at {to} but the commit's txn for it \
                     says {:?}",
                    c.version,
                    c.txns.get(app_id)
                ));
            }
            if let Some((pv, prev_to)) = last.get(app_id)
                && *prev_to != from
            {
                r.errors.push(format!(
                    "position {app_id}: version {} reads from {from} but version {pv} ended at \
                     {prev_to}: {}",
                    c.version,
                    if from > *prev_to {
                        "offsets skipped (lost)"
                    } else {
                        "offsets read twice (duplicated)"
                    }
                ));
            }
            last.insert(app_id.clone(), (c.version, to));
        }
    }
    r.positions_checked = last.len() as u64;
}

/// Read commit `version` of `table`; `None` when the log no longer has it
/// (removed by log retention).
async fn read_commit(table: &DeltaTable, version: u64) -> anyhow::Result<Option<LogCommit>> {
    let Some(bytes) = table
        .log_store()
        .read_commit_entry(version)
        .await
        .with_context(|| format!("cannot read commit {version} of {}", table.table_url()))?
    else {
        return Ok(None);
    };
    let mut c = LogCommit {
        version,
        info: Value::Null,
        ..Default::default()
    };
    for line in bytes.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
        let action: Value = serde_json::from_slice(line)
            .with_context(|| format!("commit {version} has a line that is not JSON"))?;
        if let Some(i) = action.get("commitInfo") {
            c.info = i.clone();
        } else if let Some(t) = action.get("txn") {
            if let (Some(app), Some(v)) = (t["appId"].as_str(), t["version"].as_u64()) {
                c.txns.insert(app.to_string(), v);
            }
        } else if let Some(a) = action.get("add") {
            let rows = a["stats"]
                .as_str()
                .and_then(|s| serde_json::from_str::<Value>(s).ok())
                .and_then(|s| s["numRecords"].as_u64());
            c.adds
                .push((decode(a["path"].as_str().unwrap_or_default()), rows));
        } else if let Some(r) = action.get("remove") {
            c.removes
                .push(decode(r["path"].as_str().unwrap_or_default()));
        }
    }
    c.lineage = c.info.get("lakestream").and_then(CommitLineage::from_value);
    Ok(Some(c))
}

/// A log path, percent-decoded (Delta stores paths URL-encoded).
fn decode(path: &str) -> String {
    percent_encoding::percent_decode_str(path)
        .decode_utf8_lossy()
        .into_owned()
}

/// `lakestream table lineage`: where version `version` (default: the
/// latest) of the table came from.
pub(crate) async fn lineage(
    url: &str,
    version: Option<u64>,
    json_out: bool,
    options: &HashMap<String, String>,
) -> anyhow::Result<()> {
    let table = load(url, options).await?;
    let latest = table.version().context("the table has no version yet")? as u64;
    let version = version.unwrap_or(latest);
    if version > latest {
        bail!("{url} has no version {version} (the latest is {latest})");
    }
    let commit = read_commit(&table, version).await?.with_context(|| {
        format!(
            "commit {version} of {url} is no longer in the log (removed by log retention); \
             lineage is kept in the commits the log keeps"
        )
    })?;
    if let Some(Err(e)) = &commit.lineage {
        bail!(
            "version {version} of {url} has a lakestream lineage record that does not parse: {e}"
        );
    }
    let Some(l) = commit.lakestream() else {
        let op = commit.info["operation"].as_str().unwrap_or("unknown");
        if json_out {
            outln!(
                "{}",
                json!({ "version": version, "lakestream": false, "operation": op })
            );
        } else {
            outln!(
                "version {version} of {url} was not written by a lakestream query (operation {op})"
            );
        }
        return Ok(());
    };
    let rows_added: u64 = commit.adds.iter().filter_map(|(_, r)| *r).sum();
    if json_out {
        outln!(
            "{}",
            json!({
                "version": version,
                "lakestream": true,
                "operation": commit.info["operation"],
                "timestamp": commit.info["timestamp"],
                "query_id": l.query_id,
                "batch_id": l.batch_id,
                "sql_fingerprint": l.sql_fingerprint,
                "input_rows": l.input_rows,
                "output_rows": l.output_rows,
                "files_added": commit.adds.len(),
                "ranges": (!l.ranges.is_empty()).then_some(&l.ranges),
                "skipped": (!l.skipped.is_empty()).then_some(&l.skipped),
            })
        );
        return Ok(());
    }
    let when = commit.info["timestamp"]
        .as_i64()
        .and_then(chrono::DateTime::from_timestamp_millis)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        .unwrap_or_else(|| "-".into());
    outln!(
        "version {version} of {url}: batch {} of query {}, committed {when}",
        l.batch_id,
        l.query_id
    );
    outln!(
        "  rows: {} read, {} written in {} files ({} by the files' stats)",
        opt(l.input_rows),
        opt(l.output_rows),
        commit.adds.len(),
        rows_added
    );
    outln!("  query: {}", l.sql_fingerprint.as_deref().unwrap_or("-"));
    if l.ranges.is_empty() {
        outln!("  (written before lakestream recorded source ranges)");
    }
    // Each range is read by its source kind's connector.
    let connectors = lakestream::connectors::Connectors::builtin();
    for (name, r) in &l.ranges {
        outln!("  source {name} {}:", r.source);
        for line in connectors.describe_range(&r.source, &r.start, &r.end) {
            outln!("    {line}");
        }
    }
    for (name, s) in &l.skipped {
        outln!("  source {name} left out: {s}");
    }
    Ok(())
}

fn opt(v: Option<u64>) -> String {
    v.map_or_else(|| "-".into(), |v| v.to_string())
}

/// What `verify` found.
#[derive(Debug, Default, serde::Serialize)]
struct Report {
    checkpoint: String,
    table: String,
    query_id: String,
    /// Batches of the query found in the table.
    batches_in_table: u64,
    /// The table versions read.
    versions_checked: u64,
    /// The first version the log still holds.
    first_version: u64,
    /// Problems: each makes the exit code 1.
    errors: Vec<String>,
    /// Worth knowing, not a violation (orphan files unless `--strict`).
    warnings: Vec<String>,
    /// Files in the table's directory no commit references.
    orphans: Vec<String>,
    /// Source positions kept in the table (Kafka group mode) whose chain
    /// of ranges was checked.
    positions_checked: u64,
    /// The table's writer features, each `supported`, `preserved` or
    /// `refused` by lakestream's writer (a refused one is an error).
    features: BTreeMap<String, String>,
}

/// `lakestream verify`: check the tables of the checkpoint's query (each
/// output's, or the one `table_url` names) against the checkpoint.
/// Returns whether they are clean.
pub(crate) async fn verify(
    checkpoint: &str,
    table_url: Option<&str>,
    json_out: bool,
    strict: bool,
    options: &HashMap<String, String>,
) -> anyhow::Result<bool> {
    let view = Checkpoint::inspect(checkpoint, options)
        .await?
        .with_context(|| format!("no checkpoint at {checkpoint}"))?;
    let record = view.query_record().await?;
    let outputs: Vec<String> = record
        .as_ref()
        .map(|r| r.all_outputs().map(str::to_string).collect())
        .unwrap_or_default();
    let dead_letters: Vec<String> = record
        .as_ref()
        .map(|r| r.dead_letters.clone())
        .unwrap_or_default();
    let url_of = |identity: &str| -> anyhow::Result<String> {
        Ok(identity
            .strip_prefix("delta ")
            .with_context(|| format!("the query writes to {identity}, not to a Delta table"))?
            .to_string())
    };
    // (table URL, the output identity commits/N names it by)
    let mut tables: Vec<(String, String)> = Vec::new();
    let mut reports = Vec::new();
    match table_url {
        Some(t) => {
            let wanted = Location::parse(t, options)?.url().to_string();
            let identity = outputs
                .iter()
                .chain(&dead_letters)
                .find(|o| {
                    url_of(o)
                        .ok()
                        .and_then(|u| Location::parse(&u, options).ok())
                        .is_some_and(|l| l.url().as_str() == wanted)
                })
                .or(outputs.first())
                .cloned()
                .unwrap_or_default();
            tables.push((t.to_string(), identity));
        }
        None => {
            if outputs.is_empty() {
                bail!("the checkpoint does not record its table yet; pass --table");
            }
            for o in outputs.iter().chain(&dead_letters) {
                if o.starts_with("kafka://") {
                    reports.push(verify_kafka(&view, checkpoint, o).await?);
                } else {
                    tables.push((url_of(o)?, o.clone()));
                }
            }
        }
    }
    let sink = outputs.first().cloned().unwrap_or_default();
    for (url, identity) in &tables {
        let check = TableCheck {
            identity,
            sink: &sink,
            dead_letters: dead_letters.contains(identity),
            strict,
        };
        reports.push(verify_table(&view, checkpoint, url, &check, options).await?);
    }
    let clean = reports.iter().all(|r| r.errors.is_empty());
    if json_out {
        let mut v = if reports.len() == 1 {
            serde_json::to_value(&reports[0])?
        } else {
            json!({ "checkpoint": checkpoint, "tables": reports })
        };
        v["clean"] = json!(clean);
        outln!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        for r in &reports {
            let read = if r.table.starts_with("kafka://") {
                format!(
                    "the last batch id committed with its records, in group lakestream-{}",
                    r.query_id
                )
            } else {
                format!(
                    "{} versions read from version {}",
                    r.versions_checked, r.first_version
                )
            };
            outln!(
                "{}: {} batches of query {} in {} ({read})",
                if r.errors.is_empty() {
                    "clean"
                } else {
                    "NOT CLEAN"
                },
                r.batches_in_table,
                r.query_id,
                r.table,
            );
            if r.positions_checked > 0 {
                outln!(
                    "positions: {} partitions' ranges chained across every writer of the table",
                    r.positions_checked
                );
            }
            for e in &r.errors {
                outln!("error: {e}");
            }
            for w in &r.warnings {
                outln!("warning: {w}");
            }
            for o in &r.orphans {
                outln!("orphan: {o}");
            }
        }
    }
    Ok(clean)
}

/// Check a Kafka output against the checkpoint: the batch id its
/// transactions committed last (the query's consumer-group offset on the
/// topic, see `lakestream::kafka::sink`) must be at least the last batch
/// the checkpoint marks done, and no more than the last it planned.
/// Every batch's records and its batch id are committed in one
/// transaction, so that batch id says which batches the topic holds.
async fn verify_kafka(
    view: &CheckpointView,
    checkpoint: &str,
    identity: &str,
) -> anyhow::Result<Report> {
    use lakestream::kafka::{KafkaSink, KafkaSinkOptions, marker_group};
    use lakestream::sink::Sink;
    let query_id = view.metadata().query_id.to_string();
    let rest = identity.trim_start_matches("kafka://");
    let (servers, topic) = rest.split_once('/').unwrap_or((rest, ""));
    let mut r = Report {
        checkpoint: checkpoint.to_string(),
        table: identity.to_string(),
        query_id: query_id.clone(),
        ..Default::default()
    };
    let sink = KafkaSink::try_new(KafkaSinkOptions::new(servers, topic))?;
    let in_topic = sink.committed_batch(&query_id).await?;
    let marked = view.latest_commit().await?.map(|c| c.batch_id);
    let planned = view.latest_offsets().await?.map(|o| o.batch_id);
    let group = marker_group(&query_id);
    r.batches_in_table = in_topic.map_or(0, |b| b + 1);
    match (marked, in_topic) {
        (Some(m), None) => r.errors.push(format!(
            "the checkpoint marks batches up to {m} done, but group {group} holds no batch of \
             the query on {topic}: the topic lost them (deleted and re-created?) or another \
             cluster is named"
        )),
        (Some(m), Some(t)) if t < m => r.errors.push(format!(
            "the checkpoint marks batch {m} done, but the last batch committed to {topic} is {t}"
        )),
        _ => {}
    }
    if let Some(t) = in_topic
        && planned.is_none_or(|p| t > p)
    {
        r.errors.push(format!(
            "{topic} holds batch {t} of the query, which the checkpoint never planned \
             (its last write-ahead record is {planned:?}): another checkpoint writes there \
             with this query id"
        ));
    }
    if let (Some(t), Some(m)) = (in_topic, marked)
        && t > m
    {
        r.warnings.push(format!(
            "batch {t} is in the topic but not marked done in the checkpoint yet: the next \
             run marks it"
        ));
    }
    Ok(r)
}

/// Which output a table is, for [`verify_table`].
struct TableCheck<'a> {
    /// The output's identity (`delta <url>`).
    identity: &'a str,
    /// The query's first output's identity.
    sink: &'a str,
    /// A dead-letter table: it holds only the batches that rejected
    /// records, so gaps in batch ids and ranges are expected.
    dead_letters: bool,
    /// Orphan files are errors.
    strict: bool,
}

/// Check one output's table against the checkpoint `view`.
async fn verify_table(
    view: &CheckpointView,
    checkpoint: &str,
    table_url: &str,
    check: &TableCheck<'_>,
    options: &HashMap<String, String>,
) -> anyhow::Result<Report> {
    let query_id = view.metadata().query_id.to_string();
    let table_url = table_url.to_string();
    let table = load(&table_url, options).await?;
    let mut r = Report {
        checkpoint: checkpoint.to_string(),
        table: table_url.clone(),
        query_id: query_id.clone(),
        ..Default::default()
    };
    let latest = table.version().context("the table has no version yet")? as u64;
    check_features(&table_url, options, &mut r).await?;
    let commits = read_log(&table, latest, &mut r).await?;
    let by_batch = batches_in_table(&commits, &query_id, &mut r);
    check_position_chains(&commits, &mut r);
    check_marks(view, &by_batch, check, &mut r).await?;
    check_ranges(view, &by_batch, check, &mut r).await?;
    check_orphans(&table, &table_url, &commits, check.strict, options, &mut r).await?;
    Ok(r)
}

/// A table whose features the writer does not keep cannot take more
/// batches, and its rows may not follow its rules.
async fn check_features(
    table_url: &str,
    options: &HashMap<String, String>,
    r: &mut Report,
) -> anyhow::Result<()> {
    let loc = Location::parse(table_url, options)?;
    if let Some(features) = lakestream::delta::table_features(&loc).await? {
        for f in &features.features {
            r.features
                .insert(f.name.clone(), f.support.label().to_string());
            if let lakestream::delta::features::Support::Refused { reason } = &f.support {
                r.errors.push(format!(
                    "table feature {} is not supported by lakestream's writer: {reason}",
                    f.name
                ));
            }
        }
    }

    Ok(())
}

/// The table's log, oldest first, from the first version it still holds.
async fn read_log(
    table: &DeltaTable,
    latest: u64,
    r: &mut Report,
) -> anyhow::Result<Vec<LogCommit>> {
    let mut commits = Vec::new();
    for v in (0..=latest).rev() {
        match read_commit(table, v).await? {
            Some(c) => commits.push(c),
            None => break,
        }
    }
    commits.reverse();
    r.first_version = commits.first().map(|c| c.version).unwrap_or(latest + 1);
    r.versions_checked = commits.len() as u64;
    if r.first_version > 0 {
        r.warnings.push(format!(
            "versions before {} are no longer in the log (log retention): batches committed \
             there are not checked",
            r.first_version
        ));
    }

    Ok(commits)
}

/// Every batch of query `query_id` in the table, by batch id: each must
/// be there once.
fn batches_in_table<'a>(
    commits: &'a [LogCommit],
    query_id: &str,
    r: &mut Report,
) -> BTreeMap<u64, Vec<&'a LogCommit>> {
    let mut by_batch: BTreeMap<u64, Vec<&LogCommit>> = BTreeMap::new();
    for c in commits {
        let txn = c.txns.get(query_id).copied();
        if let Some(Err(e)) = &c.lineage {
            r.errors.push(format!(
                "version {}: its lineage record (commitInfo.lakestream) does not parse: {e}",
                c.version
            ));
        }
        let info_batch = c
            .lakestream()
            .filter(|l| l.query_id == query_id)
            .map(|l| l.batch_id);
        match (txn, info_batch) {
            (Some(t), Some(b)) if t != b => r.errors.push(format!(
                "version {}: its txn says batch {t} but its commitInfo says batch {b}",
                c.version
            )),
            (Some(b), _) | (None, Some(b)) => by_batch.entry(b).or_default().push(c),
            (None, None) => {}
        }
    }
    r.batches_in_table = by_batch.len() as u64;
    for (b, cs) in &by_batch {
        if cs.len() > 1 {
            let vs: Vec<String> = cs.iter().map(|c| c.version.to_string()).collect();
            r.errors.push(format!(
                "batch {b} is in the table {} times (versions {}): its rows are duplicated",
                cs.len(),
                vs.join(", ")
            ));
        }
    }
    by_batch
}

/// The checkpoint's marks against the table: each batch of `commits/N`
/// where it says, none missing between the first and the last, dropped
/// (superseded) batches absent, and no write-ahead record lost inside the
/// retained window.
async fn check_marks(
    view: &CheckpointView,
    by_batch: &BTreeMap<u64, Vec<&LogCommit>>,
    check: &TableCheck<'_>,
    r: &mut Report,
) -> anyhow::Result<()> {
    let (identity, sink) = (check.identity, check.sink);
    // Batches dropped because another process committed their partitions
    // first (Kafka group mode) are not in the table, by design.
    let mut dropped: BTreeSet<u64> = BTreeSet::new();
    for id in view.commit_ids().await? {
        if let Some(entry) = view.commit(id).await?
            && entry.superseded.is_some()
        {
            dropped.insert(id);
            if let Some(cs) = by_batch.get(&id) {
                r.errors.push(format!(
                    "batch {id} is marked dropped (superseded) in the checkpoint's commits/{id} \
                     but the table holds it in version {}",
                    cs[0].version
                ));
            }
        }
    }
    if !check.dead_letters
        && let (Some(&first), Some(&last)) = (by_batch.keys().next(), by_batch.keys().last())
    {
        let from = if r.first_version == 0 { 0 } else { first };
        let missing: Vec<String> = (from..=last)
            .filter(|b| !by_batch.contains_key(b) && !dropped.contains(b))
            .map(|b| b.to_string())
            .collect();
        if !missing.is_empty() {
            r.errors.push(format!(
                "batches {} are missing from the table (between batch {from} and batch {last})",
                missing.join(", ")
            ));
        }
    }

    // The checkpoint's commits/N against the table.
    let committed = view.commit_ids().await?;
    for id in &committed {
        let Some(entry) = view.commit(*id).await? else {
            continue;
        };
        if entry.superseded.is_some() {
            continue;
        }
        match (by_batch.get(id), entry.version_of(identity, sink)) {
            (None, Some(v)) if v >= r.first_version => r.errors.push(format!(
                "the checkpoint's commits/{id} says batch {id} is in table version {v}, but the \
                 table has no commit of batch {id}"
            )),
            (Some(cs), Some(v)) if !entry.skipped && !cs.iter().any(|c| c.version == v) => {
                r.errors.push(format!(
                    "the checkpoint's commits/{id} says table version {v}, but batch {id} is in \
                     version {}",
                    cs[0].version
                ))
            }
            _ => {}
        }
    }
    let last_committed = committed.last().copied();
    for (b, cs) in by_batch.range(last_committed.map_or(0, |c| c + 1)..) {
        // A batch committed to the table whose commits/N was not written
        // yet (a crash in between) is normal: the restart writes it.
        r.warnings.push(format!(
            "batch {b} is in table version {} but not yet marked in the checkpoint's commits/ \
             (a restart marks it)",
            cs[0].version
        ));
    }
    let retained = view.offset_ids().await?;
    if let Some(planned) = retained.last()
        && !by_batch.contains_key(planned)
        && last_committed.is_none_or(|c| c < *planned)
    {
        r.warnings.push(format!(
            "batch {planned} is planned (offsets/{planned}) but not committed: a restart runs it"
        ));
    }
    // Write-ahead records are purged oldest first: a committed batch's
    // missing after the oldest kept one was lost, not purged.
    if !check.dead_letters
        && let (Some(&lo), Some(&hi)) = (retained.first(), retained.last())
    {
        let kept: BTreeSet<u64> = retained.iter().copied().collect();
        for b in committed.iter().filter(|b| **b > lo && !kept.contains(*b)) {
            r.errors.push(format!(
                "batch {b} is committed (commits/{b}) but its write-ahead record offsets/{b} \
                 is missing, while offsets/{lo} (the oldest kept) to offsets/{hi} are kept: the checkpoint is \
                 damaged (a deleted or lost file); restore offsets/{b} from a backup, or start \
                 the query on a new checkpoint"
            ));
        }
    }

    Ok(())
}

/// Each batch's ranges in its commit: contiguous per source, equal to
/// `offsets/N`, and its row counts against its files and `progress/N`.
async fn check_ranges(
    view: &CheckpointView,
    by_batch: &BTreeMap<u64, Vec<&LogCommit>>,
    check: &TableCheck<'_>,
    r: &mut Report,
) -> anyhow::Result<()> {
    // Ranges: contiguous per source, and equal to offsets/N.
    let mut last_end: BTreeMap<String, (u64, Value)> = BTreeMap::new();
    for (b, cs) in by_batch {
        let c = cs[0];
        let Some(l) = c.lakestream().filter(|l| !l.ranges.is_empty()) else {
            // Written before lineage was recorded: nothing to compare.
            last_end.clear();
            continue;
        };
        let ranges = &l.ranges;
        for (source, range) in ranges {
            let (start, end) = (&range.start, &range.end);
            // Group mode: a process's batches are not one chain (its
            // partitions change); the chains are per partition, across
            // processes (`check_position_chains`).
            let grouped = end.get("group_from").is_some();
            if !check.dead_letters
                && !grouped
                && let Some((pb, prev)) = last_end.get(source)
                && !same_offset(start, prev)
            {
                r.errors.push(format!(
                    "source {source}: batch {b} (version {}) starts at {} but batch {pb} ended at \
                     {}: a gap or an overlap",
                    c.version,
                    short(start),
                    short(prev)
                ));
            }
            if !end.is_null() {
                last_end.insert(source.clone(), (*b, end.clone()));
            }
        }
        if let Some(planned) = view.offsets(*b).await? {
            for (source, pr) in &planned.sources {
                let Some(range) = ranges.get(source) else {
                    r.errors.push(format!(
                        "batch {b}: offsets/{b} has source {source}, the commit (version {}) \
                         does not",
                        c.version
                    ));
                    continue;
                };
                let start = pr.start.clone().unwrap_or(Value::Null);
                if !same_offset(&range.start, &start) || !same_offset(&range.end, &pr.end) {
                    r.errors.push(format!(
                        "batch {b}: the range of source {source} in the commit (version {}) is \
                         not the one in offsets/{b}: the commit has {} .. {}, the checkpoint {} \
                         .. {}",
                        c.version,
                        short(&range.start),
                        short(&range.end),
                        short(&start),
                        short(&pr.end)
                    ));
                }
            }
        }
        // Row counts: what the commit says it wrote against its files.
        let appended = c.info["operation"] == "STREAMING UPDATE" && c.removes.is_empty();
        let stats: Option<u64> = c.adds.iter().map(|(_, n)| *n).sum();
        if appended
            && let (Some(said), Some(stats)) = (l.output_rows, stats)
            && said != stats
        {
            r.errors.push(format!(
                "batch {b} (version {}): the commit says {said} rows were written but its files \
                 hold {stats}",
                c.version
            ));
        }
        if let Some(p) = view.progress(*b).await.ok().flatten()
            && let (Some(pin), Some(cin)) = (p.progress["input_rows"].as_u64(), l.input_rows)
            && pin != cin
            && p.progress["skipped"] != true
        {
            r.errors.push(format!(
                "batch {b}: progress/{b} says {pin} rows were read, the commit (version {}) {cin}",
                c.version
            ));
        }
    }

    Ok(())
}

/// Files in the table's directory that no commit references: warnings, or
/// errors when `strict`.
async fn check_orphans(
    table: &DeltaTable,
    table_url: &str,
    commits: &[LogCommit],
    strict: bool,
    options: &HashMap<String, String>,
    r: &mut Report,
) -> anyhow::Result<()> {
    // Orphans: files in the table directory that no commit references.
    let loc = Location::parse(table_url, options)?;
    let mut referenced: BTreeSet<String> = BTreeSet::new();
    for c in commits {
        referenced.extend(c.adds.iter().map(|(p, _)| p.clone()));
        referenced.extend(c.removes.iter().cloned());
    }
    if let Ok(uris) = table.get_file_uris() {
        let base = table.table_url().to_string();
        let base = base.trim_end_matches('/');
        for u in uris {
            if let Some(rel) = u.strip_prefix(base) {
                referenced.insert(decode(rel.trim_start_matches('/')));
            }
        }
    }
    let root = loc.root().as_ref().to_string();
    let listed: Vec<object_store::ObjectMeta> = loc
        .store()
        .list(Some(loc.root()))
        .try_collect()
        .await
        .with_context(|| format!("cannot list {table_url}"))?;
    for meta in listed {
        let rel = meta
            .location
            .as_ref()
            .strip_prefix(root.as_str())
            .unwrap_or(meta.location.as_ref())
            .trim_start_matches('/')
            .to_string();
        let rel = decode(&rel);
        let hidden = rel
            .split('/')
            .any(|part| part.starts_with('_') || part.starts_with('.'));
        if !hidden && !referenced.contains(&rel) {
            r.orphans.push(rel);
        }
    }
    if !r.orphans.is_empty() {
        let msg = format!(
            "{} files in the table's directory are referenced by no commit (left by a batch \
             that failed before its commit, or put there by hand); `lakestream table vacuum` \
             removes them",
            r.orphans.len()
        );
        if strict {
            r.errors.push(msg);
        } else {
            r.warnings.push(msg);
        }
    }

    Ok(())
}

/// A short form of an offset for messages.
fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 200 {
        format!(
            "{}... ({} bytes)",
            &s[..s.floor_char_boundary(200)],
            s.len()
        )
    } else {
        s
    }
}
