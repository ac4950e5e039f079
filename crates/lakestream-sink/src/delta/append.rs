//! The fast append: a batch as one create-if-absent write of commit
//! `head + 1`, with the bytes delta-rs's own commit writes.

use super::*;

impl DeltaSink {
    /// Append a batch as commit `head + 1` with one create-if-absent write
    /// of the commit file: the bytes delta-rs's commit writes, without its
    /// post-commit state update, which re-derives every file of the table
    /// (parsing each file's statistics) and so costs more with every file
    /// the table holds.
    ///
    /// Does not commit when the table's writer protocol is above 2
    /// (delta-rs's commit then checks the table features), or when another
    /// writer created that version first (delta-rs's commit then reads it
    /// and checks for conflicts).
    pub(super) async fn append_commit(
        &self,
        loaded: &Loaded,
        actions: &[Action],
        operation: DeltaOperation,
        app_metadata: HashMap<String, serde_json::Value>,
        transactions: Vec<Transaction>,
        batch_id: u64,
    ) -> Result<Append> {
        let Some(head) = self.head(loaded) else {
            return Ok(Append::NotApplicable);
        };
        if loaded.meta.protocol().min_writer_version() > 2 {
            return Ok(Append::NotApplicable);
        }
        let commit_err = |e: TransactionError| Error::Commit {
            table: self.name.clone(),
            batch_id,
            source: Box::new(DeltaTableError::from(e)),
        };
        let version = head + 1;
        let bytes = CommitData::new(actions.to_vec(), operation, app_metadata, transactions)
            .get_bytes()
            .map_err(commit_err)?;
        match loaded
            .meta
            .log_store()
            .write_commit_entry(
                version,
                CommitOrBytes::LogBytes(bytes),
                uuid::Uuid::new_v4(),
            )
            .await
        {
            Ok(()) => Ok(Append::Committed(version)),
            Err(TransactionError::VersionAlreadyExists(_)) => {
                tracing::debug!(table = %self.name, version, "version taken by another writer; committing through delta-rs");
                Ok(Append::Taken)
            }
            Err(e) => Err(commit_err(e)),
        }
    }

    /// After an [`append_commit`](Self::append_commit) of `version`: remember
    /// it, start a Delta checkpoint when one is due, and compact.
    ///
    /// The checkpoint is written off the batch path, on its own task: it
    /// loads the table (its cost grows with the table's files) and the
    /// next batches do not wait for it.
    /// The batch is committed whatever happens to the checkpoint: a failure
    /// is logged and the next due one tries again.
    pub(super) async fn after_append(&self, loaded: &mut Loaded, version: u64, info: &CommitInfo) {
        let batch = i64::try_from(info.batch_id).expect("batch ids fit in i64");
        self.set_head(version);
        self.remember_txn(&info.query_id, version, Some(batch))
            .await;
        self.collect_checkpoint(loaded, false).await;
        let interval = checkpoint_interval(&loaded.meta);
        if (version + 1).is_multiple_of(interval) {
            let cleanup = (version + 1).is_multiple_of(cleanup_every(interval));
            self.spawn_checkpoint(version, cleanup);
        }
        self.maybe_compact(loaded, info.batch_id).await;
    }
}
