//! `lakestream table`: maintenance of a Delta table through delta-rs —
//! compaction, vacuum, log checkpoints and the commit history.
//!
//! Compaction is safe while a stream appends to the same table: its commit
//! only rearranges data (`dataChange: false`), a stream commit that races it
//! is retried by delta-rs against the new version, and the stream's txn
//! check keeps each batch exactly once.

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::time::Duration;

use anyhow::{Context, bail};
use deltalake::DeltaTable;
use lakestream::storage::Location;
use serde_json::{Value, json};

/// How many times a compaction that lost a race with another writer is
/// re-planned against the new table version.
const OPTIMIZE_ATTEMPTS: usize = 5;

/// Open and load the Delta table at `url`, failing when there is none.
pub(crate) async fn load(
    url: &str,
    options: &HashMap<String, String>,
) -> anyhow::Result<DeltaTable> {
    let loc = Location::parse(url, options)?;
    lakestream::delta::load_table(&loc)
        .await
        .with_context(|| format!("cannot open the Delta table at {url}"))?
        .with_context(|| format!("{url} is not a Delta table (no _delta_log)"))
}

/// Refuse a maintenance command on the table at `url` when the table has
/// a feature lakestream cannot keep, or, for a command that commits
/// (`commit` names it), one that commit would break (delta-rs's commits
/// carry no in-commit timestamp).
async fn check_features(
    url: &str,
    options: &HashMap<String, String>,
    commit: Option<&str>,
) -> anyhow::Result<()> {
    let loc = Location::parse(url, options)?;
    if let Some(features) = lakestream::delta::table_features(&loc).await? {
        features.check(url)?;
        if let Some(what) = commit {
            features.check_maintenance(url, what)?;
        }
    }
    Ok(())
}

fn print(json_out: bool, value: &Value, human: &str) {
    if json_out {
        outln!("{value}");
    } else {
        outln!("{human}");
    }
}

/// Bin-pack small files into files of about `target_size` bytes.
pub(crate) async fn optimize(
    url: &str,
    target_size: u64,
    json_out: bool,
    options: &HashMap<String, String>,
) -> anyhow::Result<()> {
    use backon::{ExponentialBuilder, Retryable};

    let target = NonZeroU64::new(target_size).context("--target-size must be above 0")?;
    check_features(url, options, Some("compaction (table optimize)")).await?;
    let attempt = || async {
        let table = load(url, options).await?;
        Ok::<_, anyhow::Error>(table.optimize().with_target_size(target).await?)
    };
    // A conflict with a concurrent writer: plan again on the new version,
    // after a short backoff. Anything else is final.
    let lost_race = |e: &anyhow::Error| {
        matches!(
            e.downcast_ref::<deltalake::DeltaTableError>(),
            Some(deltalake::DeltaTableError::Transaction { .. })
        )
    };
    let (table, m) = attempt
        .retry(
            ExponentialBuilder::default()
                .with_min_delay(Duration::from_millis(100))
                .with_max_times(OPTIMIZE_ATTEMPTS - 1),
        )
        .when(lost_race)
        .notify(|e, _| {
            eprintln!("lakestream: compaction lost a race with another writer, planning again: {e}")
        })
        .await
        .map_err(|e| {
            let why = if lost_race(&e) {
                format!("compaction of {url} failed {OPTIMIZE_ATTEMPTS} times")
            } else {
                format!("compaction of {url} failed")
            };
            e.context(why)
        })?;
    let version = table.version();
    print(
        json_out,
        &json!({
            "files_removed": m.num_files_removed,
            "files_added": m.num_files_added,
            "partitions_optimized": m.partitions_optimized,
            "table_version": version,
        }),
        &format!(
            "compacted {} files into {} in {} partitions; table version {}",
            m.num_files_removed,
            m.num_files_added,
            m.partitions_optimized,
            version.map(|v| v.to_string()).unwrap_or_else(|| "-".into())
        ),
    );
    Ok(())
}

/// Delete files no longer referenced by the table and older than
/// `retention_hours`; only lists them unless `execute`.
pub(crate) async fn vacuum(
    url: &str,
    retention_hours: u64,
    execute: bool,
    allow_short_retention: bool,
    json_out: bool,
    options: &HashMap<String, String>,
) -> anyhow::Result<()> {
    check_features(url, options, execute.then_some("vacuum")).await?;
    let table = load(url, options).await?;
    let retention = i64::try_from(retention_hours)
        .ok()
        .and_then(chrono::Duration::try_hours)
        .context("--retention-hours is too large")?;
    let (_, m) = table
        .vacuum()
        .with_retention_period(retention)
        .with_enforce_retention_duration(!allow_short_retention)
        .with_dry_run(!execute)
        .await
        .with_context(|| {
            format!(
                "vacuum of {url} failed (a retention below the table's \
                 delta.deletedFileRetentionDuration needs --allow-short-retention, and is only \
                 safe when no reader or writer uses older versions)"
            )
        })?;
    let verb = if execute { "deleted" } else { "would delete" };
    let mut human = format!(
        "{verb} {} files older than {retention_hours} h",
        m.files_deleted.len()
    );
    for f in &m.files_deleted {
        human.push_str(&format!("\n  {f}"));
    }
    if !execute {
        human.push_str("\n(dry run: add --execute to delete)");
    }
    print(
        json_out,
        &json!({ "dry_run": !execute, "files": m.files_deleted }),
        &human,
    );
    Ok(())
}

/// Write a Delta log checkpoint at the current version.
pub(crate) async fn checkpoint(
    url: &str,
    json_out: bool,
    options: &HashMap<String, String>,
) -> anyhow::Result<()> {
    check_features(url, options, None).await?;
    let table = load(url, options).await?;
    deltalake::checkpoints::create_checkpoint(&table, None)
        .await
        .with_context(|| format!("cannot write a checkpoint of {url}"))?;
    let version = table.version();
    print(
        json_out,
        &json!({ "checkpoint_version": version }),
        &format!(
            "checkpoint written at version {}",
            version.map(|v| v.to_string()).unwrap_or_else(|| "-".into())
        ),
    );
    Ok(())
}

/// The last `limit` commits, newest first: version, time, operation and,
/// for lakestream's commits, the query and batch id.
pub(crate) async fn history(
    url: &str,
    limit: u64,
    json_out: bool,
    options: &HashMap<String, String>,
) -> anyhow::Result<()> {
    let table = load(url, options).await?;
    let Some(latest) = table.version() else {
        bail!("{url} has no version yet");
    };
    let store = table.log_store();
    let mut version = latest;
    let mut shown = 0;
    loop {
        if shown >= limit {
            break;
        }
        // Commits older than the log retention may be gone (a checkpoint
        // holds their state): the history ends there.
        let Some(bytes) = store
            .read_commit_entry(version)
            .await
            .with_context(|| format!("cannot read commit {version} of {url}"))?
        else {
            break;
        };
        let info = bytes
            .split(|b| *b == b'\n')
            .filter_map(|l| serde_json::from_slice::<Value>(l).ok())
            .find_map(|a| a.get("commitInfo").cloned())
            .unwrap_or(Value::Null);
        let ts = info["timestamp"].as_i64();
        let op = info["operation"].as_str().unwrap_or("-").to_string();
        let batch = info
            .get("lakestream")
            .and_then(lakestream_engine::lineage::CommitLineage::from_value)
            .and_then(Result::ok)
            .map(|l| l.batch_id);
        let time = ts
            .and_then(chrono::DateTime::from_timestamp_millis)
            .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
            .unwrap_or_else(|| "-".into());
        let row = json!({
            "version": version,
            "timestamp": time,
            "operation": op,
            "batch_id": batch,
            "operation_parameters": info["operationParameters"],
        });
        let human = format!(
            "{version:>8}  {time:<24}  {op:<20}{}",
            batch.map(|b| format!("  batch {b}")).unwrap_or_default()
        );
        print(json_out, &row, &human);
        shown += 1;
        if version == 0 {
            break;
        }
        version -= 1;
    }
    Ok(())
}
