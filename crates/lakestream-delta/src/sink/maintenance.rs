//! Work off the batch path: Delta checkpoints on a task of their own, and
//! auto-compaction.

use super::*;

impl DeltaSink {
    /// Write a Delta checkpoint at the table's latest version (at least
    /// `version`) on a task of its own. While the previous one still runs,
    /// this one waits as `due` and starts when that one is collected (one
    /// checkpoint, at the then latest version, stands for all that fell
    /// due meanwhile).
    pub(super) fn spawn_checkpoint(&self, version: u64, cleanup: bool) {
        // checkpointProtection: this writer never removes history.
        let cleanup = cleanup
            && !self
                .contract
                .lock()
                .expect("contract lock")
                .features
                .checkpoint_protection;
        let mut slot = self.checkpointing.lock().expect("checkpoint slot");
        if slot.running.as_ref().is_some_and(|h| !h.is_finished()) {
            tracing::debug!(table = %self.name, version, "the previous Delta checkpoint is still being written; this one starts after it");
            slot.due = Some(slot.due.unwrap_or(false) || cleanup);
            return;
        }
        let location = self.location.clone();
        let name = self.name.clone();
        slot.running = Some(tokio::spawn(async move {
            let table_err = |source: DeltaTableError| Error::Table {
                table: name.clone(),
                source: Box::new(source),
            };
            location.ensure_local_dir()?;
            let mut table = open_table(&location).map_err(table_err)?;
            load_checked(&location, &mut table)
                .await
                .map_err(table_err)?;
            checkpoints::create_checkpoint(&table, None)
                .await
                .map_err(table_err)?;
            if cleanup {
                checkpoints::cleanup_metadata(&table, None)
                    .await
                    .map_err(table_err)?;
            }
            Ok(table)
        }));
    }

    /// Take the result of a finished background checkpoint (with `wait`,
    /// wait for a running one). Its freshly loaded table replaces the
    /// sink's file list when the sink holds one (a state reloaded from a
    /// checkpoint does not replay the commits since the old one); the
    /// sink does not start holding one for it.
    pub(super) async fn collect_checkpoint(&self, loaded: &mut Loaded, wait: bool) {
        let handle = {
            let mut slot = self.checkpointing.lock().expect("checkpoint slot");
            if wait || slot.running.as_ref().is_some_and(|h| h.is_finished()) {
                slot.running.take()
            } else {
                None
            }
        };
        let Some(handle) = handle else { return };
        let due = self
            .checkpointing
            .lock()
            .expect("checkpoint slot")
            .due
            .take();
        match handle.await {
            Ok(Ok(fresh)) => {
                if let Some(v) = fresh.version() {
                    self.set_head(v);
                }
                if let Some(full) = loaded.full.as_mut()
                    && fresh.version() >= full.version()
                {
                    *full = fresh;
                }
            }
            Ok(Err(e)) => {
                tracing::warn!(table = %self.name, error = %e, "Delta checkpoint failed; the next one retries");
            }
            Err(e) => {
                tracing::warn!(table = %self.name, error = %e, "Delta checkpoint task failed; the next one retries");
            }
        }
        if let Some(cleanup) = due {
            self.spawn_checkpoint(self.head(loaded).unwrap_or_default(), cleanup);
        }
    }

    /// Compact after every `auto_compact_every` batches.
    pub(super) async fn maybe_compact(&self, loaded: &mut Loaded, batch_id: u64) {
        if let Some(n) = self.options.auto_compact_every
            && (batch_id + 1).is_multiple_of(n)
        {
            let full = match self.full(loaded).await {
                Ok(full) => full,
                Err(e) => {
                    tracing::warn!(table = %self.name, batch_id, error = %e, "auto-compaction skipped: the table could not be read");
                    return;
                }
            };
            self.compact(full, batch_id).await;
            if let Some(v) = full.version() {
                self.set_head(v);
            }
        }
    }

    /// Bin-pack the table's small files (auto-compaction after `batch_id`).
    /// The compaction commit only rearranges data (`dataChange: false`); a
    /// failure is logged and the stream goes on: compaction is an
    /// optimization, never part of the batch.
    pub(super) async fn compact(&self, table: &mut DeltaTable, batch_id: u64) {
        let target = std::num::NonZeroU64::new(self.options.target_file_size)
            .unwrap_or(std::num::NonZeroU64::MIN);
        match table.clone().optimize().with_target_size(target).await {
            Ok((compacted, m)) => {
                tracing::info!(
                    table = %self.name,
                    batch_id,
                    files_removed = m.num_files_removed,
                    files_added = m.num_files_added,
                    "auto-compaction"
                );
                *table = compacted;
            }
            Err(e) => {
                tracing::warn!(table = %self.name, batch_id, error = %e, "auto-compaction failed; the next one retries");
            }
        }
    }
}

/// The table's `delta.checkpointInterval` (delta-rs's default: 100).
pub(super) fn checkpoint_interval(meta: &BlindDeltaTable) -> u64 {
    meta.table_properties()
        .checkpoint_interval
        .map(|n| n.get())
        .unwrap_or(100)
}

/// Versions between expired-log cleanups: a multiple of the checkpoint
/// interval, at least CLEANUP_EVERY_VERSIONS.
pub(super) fn cleanup_every(interval: u64) -> u64 {
    let interval = interval.max(1);
    interval * (CLEANUP_EVERY_VERSIONS / interval).max(1)
}
