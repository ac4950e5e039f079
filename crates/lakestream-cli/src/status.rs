//! `lakestream status`: what a checkpoint says about its query.

use std::collections::HashMap;

use anyhow::Context;
use lakestream_engine::checkpoint::Checkpoint;

/// What a checkpoint says of its query: the `status --json` object, and
/// the progress of its last `batches` batches, oldest first.
pub(crate) async fn collect(
    location: &str,
    batches: usize,
    options: &HashMap<String, String>,
) -> anyhow::Result<(serde_json::Value, Vec<lakestream_engine::BatchProgress>)> {
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
    // The state of a stateful query, as of the batch the table holds.
    let state = lakestream_engine::state::summaries(
        &lakestream_engine::storage::Location::parse(location, options)?,
        committed.as_ref().map(|c| c.batch_id),
    )
    .await?;
    let state: Vec<serde_json::Value> = state
        .iter()
        .map(|s| {
            serde_json::json!({
                "operator": s.operator,
                "as_of_batch": s.batch_id,
                "rows": s.rows,
                "bytes": s.bytes,
                "event_time_max_ms": s.meta.get("event_time_max_ms"),
            })
        })
        .collect();
    let recent: Vec<lakestream_engine::BatchProgress> = view
        .recent_progress(batches)
        .await?
        .into_iter()
        .filter_map(|e| serde_json::from_value(e.progress).ok())
        .collect();
    let recent_json: Vec<serde_json::Value> = recent
        .iter()
        .map(|p| {
            serde_json::json!({
                "batch_id": p.batch_id,
                "timestamp_ms": p.timestamp_ms,
                "input_rows": p.input_rows,
                "output_rows": p.output_rows,
                "duration_ms": p.durations.total_ms,
                "table_version": p.table_version,
                "skipped": p.skipped,
                "recovered": p.recovered,
                "superseded": p.superseded,
            })
        })
        .collect();
    // Records behind each partition's high watermark at the last batch's
    // plan: in Kafka group mode, exactly the partitions the process owned.
    let lag: serde_json::Map<String, serde_json::Value> = recent
        .last()
        .map(|p| {
            p.sources
                .iter()
                .filter(|(_, s)| !s.lag.is_empty())
                .map(|(k, s)| (k.clone(), serde_json::json!(s.lag)))
                .collect()
        })
        .unwrap_or_default();
    let watermark_ms = planned.as_ref().and_then(|p| p.watermark_ms);
    let out = serde_json::json!({
        "query_id": view.metadata().query_id.to_string(),
        "created_at_ms": view.metadata().created_at_ms,
        "running": running,
        "last_planned_batch": planned.as_ref().map(|p| p.batch_id),
        "last_committed_batch": committed.as_ref().map(|c| c.batch_id),
        "table_version": committed.as_ref().and_then(|c| c.table_version),
        "sources": sources,
        "lag": lag,
        "watermark_ms": watermark_ms,
        "state": state,
        "recent_batches": recent_json,
        "pending_batch": match (&planned, &committed) {
            (Some(p), Some(c)) if p.batch_id > c.batch_id => Some(p.batch_id),
            (Some(p), None) => Some(p.batch_id),
            _ => None,
        },
    });
    Ok((out, recent))
}

/// Print the status of the checkpoint at `location`.
pub(crate) async fn status(
    location: &str,
    json: bool,
    batches: usize,
    options: &HashMap<String, String>,
) -> anyhow::Result<()> {
    let (out, recent) = collect(location, batches, options).await?;
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
    outln!(
        "query id:             {}",
        out["query_id"].as_str().unwrap_or("?")
    );
    outln!(
        "running:              {}",
        match out["running"].as_bool() {
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
    if let Some(p) = out["pending_batch"].as_u64() {
        outln!(
            "pending:              batch {p} is planned but not committed; it re-runs on restart"
        );
    }
    for (name, s) in out["sources"].as_object().into_iter().flatten() {
        outln!("source {name}: {s}");
    }
    for (name, parts) in out["lag"].as_object().into_iter().flatten() {
        let parts: Vec<String> = parts
            .as_object()
            .into_iter()
            .flatten()
            .map(|(p, n)| format!("{p} {n}"))
            .collect();
        outln!(
            "source {name} partitions read at the last batch (records behind): {}",
            parts.join(", ")
        );
    }
    if let Some(w) = out["watermark_ms"].as_i64() {
        let at = chrono::DateTime::from_timestamp_millis(w)
            .map(|t| t.to_rfc3339())
            .unwrap_or_else(|| w.to_string());
        outln!("watermark:            {at} (of the last planned batch)");
    }
    for s in out["state"].as_array().into_iter().flatten() {
        outln!(
            "state {}: {} keys, {} bytes, as of batch {}",
            s["operator"].as_str().unwrap_or("?"),
            s["rows"],
            s["bytes"],
            s["as_of_batch"]
        );
    }
    if !recent.is_empty() {
        outln!("last batches:");
        for p in &recent {
            outln!("  {}", p.human_line());
        }
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
