//! What [`CheckpointView`] reads: the checkpoint's files, without taking its fence.

use super::*;

impl CheckpointView {
    /// The parsed `metadata` file.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// The highest planned batch, if any.
    pub async fn latest_offsets(&self) -> Result<Option<OffsetsEntry>> {
        latest(&self.location, "offsets").await
    }

    /// The highest committed batch, if any.
    pub async fn latest_commit(&self) -> Result<Option<CommitEntry>> {
        latest(&self.location, "commits").await
    }

    /// The location of the checkpoint.
    pub fn location(&self) -> &Location {
        &self.location
    }

    /// The recorded sources and sink (`query`), if written yet.
    pub async fn query_record(&self) -> Result<Option<QueryRecord>> {
        read_entry(&self.location, "query").await
    }

    /// Read `offsets/N`, if present.
    pub async fn offsets(&self, batch_id: u64) -> Result<Option<OffsetsEntry>> {
        read_entry(&self.location, &format!("offsets/{batch_id}")).await
    }

    /// Read `commits/N`, if present.
    pub async fn commit(&self, batch_id: u64) -> Result<Option<CommitEntry>> {
        read_entry(&self.location, &format!("commits/{batch_id}")).await
    }

    /// Read `progress/N`, if present.
    pub async fn progress(&self, batch_id: u64) -> Result<Option<ProgressEntry>> {
        read_entry(&self.location, &format!("progress/{batch_id}")).await
    }

    /// The retained batch ids of `offsets/`, ascending.
    pub async fn offset_ids(&self) -> Result<Vec<u64>> {
        list_ids(&self.location, "offsets").await
    }

    /// The retained batch ids of `commits/`, ascending.
    pub async fn commit_ids(&self) -> Result<Vec<u64>> {
        list_ids(&self.location, "commits").await
    }

    /// The retained batch ids of `progress/`, ascending.
    pub async fn progress_ids(&self) -> Result<Vec<u64>> {
        list_ids(&self.location, "progress").await
    }

    /// The progress of the last `n` batches that reported one, oldest
    /// first. An unreadable entry (torn by a crash) is passed over.
    pub async fn recent_progress(&self, n: usize) -> Result<Vec<ProgressEntry>> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let ids = self.progress_ids().await?;
        let mut out = Vec::new();
        for id in ids.iter().rev().take(n).rev() {
            match self.progress(*id).await {
                Ok(Some(p)) => out.push(p),
                Ok(None) => {}
                Err(e @ (Error::Corrupt { .. } | Error::UnsupportedVersion { .. })) => {
                    tracing::warn!(batch_id = id, error = %e, "skipping an unreadable progress entry")
                }
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    /// Whether a running process holds the checkpoint (local checkpoints only;
    /// `None` when the store cannot tell).
    pub fn is_in_use(&self) -> Option<bool> {
        let dir = self.location.local_dir()?;
        match take_lock(dir, self.location.url().as_str()) {
            Ok(_lock) => Some(false),
            Err(Error::InUse { .. }) => Some(true),
            Err(_) => None,
        }
    }
}
