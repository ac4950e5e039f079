//! `lakestream status`: what a checkpoint says about its query.

use std::collections::HashMap;

use anyhow::Context;
use lakestream_engine::checkpoint::Checkpoint;

/// Print the status of the checkpoint at `location`.
pub(crate) async fn status(
    location: &str,
    json: bool,
    options: &HashMap<String, String>,
) -> anyhow::Result<()> {
    let view = Checkpoint::inspect(location, options)
        .await?
        .with_context(|| format!("no checkpoint at {location}"))?;
    let planned = view.latest_offsets().await?;
    let committed = view.latest_commit().await?;
    let running = view.is_in_use();
    let sources: serde_json::Map<String, serde_json::Value> = planned
        .as_ref()
        .map(|p| {
            p.sources
                .iter()
                .map(|(k, r)| (k.clone(), summarize(&r.end)))
                .collect()
        })
        .unwrap_or_default();
    let out = serde_json::json!({
        "query_id": view.metadata().query_id.to_string(),
        "created_at_ms": view.metadata().created_at_ms,
        "running": running,
        "last_planned_batch": planned.as_ref().map(|p| p.batch_id),
        "last_committed_batch": committed.as_ref().map(|c| c.batch_id),
        "table_version": committed.as_ref().and_then(|c| c.table_version),
        "sources": sources,
    });
    if json {
        outln!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    let opt = |v: &serde_json::Value| {
        if v.is_null() {
            "-".to_string()
        } else {
            v.to_string()
        }
    };
    outln!("query id:             {}", view.metadata().query_id);
    outln!(
        "running:              {}",
        match running {
            Some(true) => "yes",
            Some(false) => "no",
            None => "unknown (remote checkpoint)",
        }
    );
    outln!("last planned batch:   {}", opt(&out["last_planned_batch"]));
    outln!(
        "last committed batch: {}",
        opt(&out["last_committed_batch"])
    );
    outln!("table version:        {}", opt(&out["table_version"]));
    if let (Some(p), Some(c)) = (&planned, &committed)
        && p.batch_id > c.batch_id
    {
        outln!(
            "pending:              batch {} is planned but not committed; it re-runs on restart",
            p.batch_id
        );
    }
    for (name, s) in &sources {
        outln!("source {name}: {s}");
    }
    Ok(())
}

/// A short form of an offset: file lists become counts.
fn summarize(end: &serde_json::Value) -> serde_json::Value {
    match end.get("files").and_then(|f| f.as_array()) {
        Some(files) => serde_json::json!({
            "files_taken": end.get("count"),
            "last_batch_files": files.len(),
            "last_file": files.last().and_then(|f| f.get("path")),
        }),
        None => end.clone(),
    }
}
