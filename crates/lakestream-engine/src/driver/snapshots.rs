//! Source snapshots and the purge of the write-ahead they cover, so the
//! checkpoint stays bounded however long the query runs.

use super::Driver;
use crate::Result;

impl Driver {
    /// Store each source's summary as of batch `batch_id` (just committed),
    /// then remove the write-ahead and commit files that every source's
    /// oldest kept snapshot covers, keeping the newest
    /// `min_batches_to_retain`. A failure only costs a longer restart:
    /// logged, not fatal.
    pub(super) async fn write_snapshots(&self, batch_id: u64) {
        let mut all = true;
        for t in &self.tables {
            let source = t.source();
            let Some(snapshot) = source.snapshot() else {
                all = false;
                continue;
            };
            if let Err(e) = self
                .ckpt
                .write_source_snapshot(source.name(), batch_id, snapshot)
                .await
            {
                all = false;
                tracing::warn!(source = source.name(), batch_id, error = %e, "cannot store the source snapshot; restarts read more of the checkpoint until the next one");
            }
        }
        if !all {
            return;
        }
        if let Err(e) = self.purge(batch_id).await {
            tracing::warn!(batch_id, error = %e, "cannot remove old checkpoint files; the next snapshot tries again");
        }
    }

    /// Remove `offsets/N` and `commits/N` below both the newest
    /// `min_batches_to_retain` batches and the oldest snapshot any source
    /// keeps (a restart that finds the newest snapshot corrupt falls back
    /// to that one and reads the batches after it).
    async fn purge(&self, batch_id: u64) -> Result<()> {
        let mut oldest = Vec::with_capacity(self.tables.len());
        for t in &self.tables {
            let ids = self.ckpt.source_snapshot_ids(t.source().name()).await?;
            oldest.push(ids.first().copied());
        }
        let Some(keep_from) =
            lakestream_protocol::keep_from(batch_id, self.min_batches_to_retain, &oldest)
        else {
            return Ok(());
        };
        let mut removed = self.ckpt.purge_before(keep_from).await?;
        if let Some(st) = &self.stateful {
            removed += st.purge_before(keep_from).await?;
        }
        if removed > 0 {
            tracing::debug!(
                batch_id,
                keep_from,
                removed,
                "removed checkpoint files covered by snapshots"
            );
        }
        Ok(())
    }
}
