//! Recovery: what a restart reads back from the checkpoint before its
//! first new batch.
//!
//! Sources learn what earlier batches took (from their newest snapshot and
//! the write-ahead entries after it); a batch written ahead but not marked
//! done is handed back to be re-run with exactly its logged range; each
//! source's starting point is resolved once and kept in the checkpoint.

use std::collections::BTreeMap;

use lakestream_checkpoint::OffsetsEntry;
use tokio::sync::watch;

use super::Driver;
use super::wait::retry_transient;
use crate::Result;

/// Where the query stands after a restart.
pub(super) struct Recovered {
    /// Each source's end of the last planned batch (its start in the next).
    pub(super) prev: BTreeMap<String, Option<serde_json::Value>>,
    /// The id of the next batch to plan.
    pub(super) next_id: u64,
    /// The last batch, when it was written ahead but not marked done: it
    /// re-runs with exactly its logged range before anything new.
    pub(super) pending: Option<OffsetsEntry>,
    /// The event-time watermark the last planned batch ran with.
    pub(super) watermark_ms: Option<i64>,
}

impl Driver {
    /// Read the checkpoint back and bring the sources to where the last
    /// planned batch left them.
    pub(super) async fn recover(&self) -> Result<Recovered> {
        let ids = self.ckpt.offset_ids().await?;
        let last_id = ids.last().copied();
        // Each source's newest summary; only the batches after it are read.
        let mut snapshots: BTreeMap<String, (u64, serde_json::Value)> = BTreeMap::new();
        if let Some(last_id) = last_id {
            for t in &self.tables {
                let name = t.source().name();
                if let Some(s) = self.ckpt.latest_source_snapshot(name, last_id).await? {
                    snapshots.insert(name.to_string(), s);
                }
            }
        }
        let first_needed = lakestream_protocol::recovery::first_needed(
            &self
                .tables
                .iter()
                .map(|t| snapshots.get(t.source().name()).map(|(id, _)| *id))
                .collect::<Vec<_>>(),
        );
        // Write-ahead files before the oldest kept one were purged because
        // snapshots covered them: without a readable snapshot, a source
        // would take their input again.
        if let Some(&oldest) = ids.first()
            && first_needed < oldest
        {
            let missing: Vec<&str> = self
                .tables
                .iter()
                .map(|t| t.source().name())
                .filter(|n| !snapshots.contains_key(*n))
                .collect();
            return Err(lakestream_checkpoint::Error::Corrupt {
                file: format!("{}sources/", self.ckpt.location().url()),
                reason: format!(
                    "offsets before batch {oldest} were removed as covered by source \
                     snapshots, but no readable snapshot is left for {}",
                    missing.join(", ")
                ),
            }
            .into());
        }
        let mut ends: BTreeMap<String, Vec<serde_json::Value>> = BTreeMap::new();
        let mut last: Option<OffsetsEntry> = None;
        for id in ids
            .iter()
            .filter(|id| **id >= first_needed || Some(**id) == last_id)
        {
            if let Some(entry) = self.ckpt.offsets(*id).await? {
                for (name, r) in &entry.sources {
                    let covered = snapshots.get(name).is_some_and(|(s, _)| *id <= *s);
                    if !r.end.is_null() && !covered {
                        ends.entry(name.clone()).or_default().push(r.end.clone());
                    }
                }
                last = Some(entry);
            }
        }
        // A stateful aggregation keeps a batch's groups in memory, several
        // outputs its rows (`BatchScans::materialize`): smaller batches.
        let queries = self
            .outputs
            .iter()
            .filter(|o| matches!(o.kind, super::OutputKind::Query(_)))
            .count();
        if self.stateful.is_some() || queries > 1 {
            for t in &self.tables {
                t.source().hold_batches_in_memory();
            }
        }
        for t in &self.tables {
            let name = t.source().name();
            // Always called: it also clears what this source object learned
            // in an earlier run (an embedder may hand it to a new query).
            t.source()
                .restore(snapshots.get(name).map(|(_, s)| s))
                .await?;
            t.source()
                .recover(ends.get(name).map(|v| v.as_slice()).unwrap_or(&[]))
                .await?;
        }
        let mut prev: BTreeMap<String, Option<serde_json::Value>> = BTreeMap::new();
        let watermark_ms = last.as_ref().and_then(|e| e.watermark_ms);
        let marked = match &last {
            Some(_) => self.ckpt.latest_commit().await?.map(|c| c.batch_id),
            None => None,
        };
        let resume = lakestream_protocol::resume(last.as_ref().map(|e| e.batch_id), marked);
        let mut pending = None;
        if let Some(entry) = last {
            for (name, r) in &entry.sources {
                prev.insert(
                    name.clone(),
                    if r.end.is_null() {
                        r.start.clone()
                    } else {
                        Some(r.end.clone())
                    },
                );
            }
            if resume.pending == Some(entry.batch_id) {
                pending = Some(entry);
            }
        }
        Ok(Recovered {
            prev,
            next_id: resume.next_id,
            pending,
            watermark_ms,
        })
    }

    /// Give every source without a position its starting offset: the one
    /// stored in the checkpoint, or (first run) the source's, stored.
    pub(super) async fn resolve_starts(
        &self,
        prev: &mut BTreeMap<String, Option<serde_json::Value>>,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<()> {
        // A source's starting point is resolved once and kept in the
        // checkpoint, so restarting before the first batch does not move it.
        for t in &self.tables {
            let name = t.source().name().to_string();
            if prev.get(&name).is_some_and(|p| p.is_some()) {
                continue;
            }
            let stored = match self.ckpt.source_state(&name, "initial").await? {
                Some(v) => Some(v),
                None => {
                    let source = t.source();
                    let initial =
                        retry_transient(source.as_ref(), "resolve starting offsets", stop, || {
                            source.initial_offset()
                        })
                        .await?;
                    match initial.flatten() {
                        Some(v) => Some(self.ckpt.init_source_state(&name, "initial", v).await?),
                        None => None,
                    }
                }
            };
            if stored.is_some() {
                prev.insert(name, stored);
            }
        }
        Ok(())
    }
}
