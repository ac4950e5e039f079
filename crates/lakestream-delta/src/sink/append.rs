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
    /// The table's features were checked when the sink opened it
    /// ([`super::features`]); an append asks nothing more of them but an
    /// `inCommitTimestamp` when the table keeps them, carried by the
    /// commit's first action. Does not commit when another writer created
    /// that version first (delta-rs's commit then reads it and checks for
    /// conflicts).
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
        let commit_err = |e: TransactionError| Error::Commit {
            table: self.name.clone(),
            batch_id,
            source: Box::new(DeltaTableError::from(e)),
        };
        let version = head + 1;
        let mut actions = actions.to_vec();
        let ict = self.in_commit_timestamp(loaded, version).await?;
        if let Some(ict) = ict {
            // Delta readers take the commit's time from its first action.
            let mut info = operation.get_commit_info();
            info.timestamp = Some(ict);
            info.in_commit_timestamp = Some(ict);
            actions.insert(0, Action::CommitInfo(info));
        }
        let bytes = CommitData::new(actions, operation, app_metadata, transactions)
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
            Ok(()) => {
                if let Some(ict) = ict {
                    self.contract.lock().expect("contract lock").last_ict = Some((version, ict));
                }
                Ok(Append::Committed(version))
            }
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

impl DeltaSink {
    /// The `inCommitTimestamp` of commit `version` when the table keeps
    /// them (`None` otherwise): the time now, or one millisecond past the
    /// previous commit's when the clock is behind it (the protocol asks
    /// for strictly increasing timestamps).
    pub(super) async fn in_commit_timestamp(
        &self,
        loaded: &Loaded,
        version: u64,
    ) -> Result<Option<i64>> {
        let known = {
            let contract = self.contract.lock().expect("contract lock");
            if !contract.features.in_commit_timestamps {
                return Ok(None);
            }
            contract.last_ict
        };
        let previous = match (known, version.checked_sub(1)) {
            (_, None) => None,
            (Some((v, t)), Some(p)) if v == p => Some(t),
            (_, Some(p)) => {
                let bytes = loaded
                    .meta
                    .log_store()
                    .read_commit_entry(p)
                    .await
                    .map_err(|e| self.table_err(e))?;
                bytes.and_then(|b| first_in_commit_timestamp(&b))
            }
        };
        let now = chrono::Utc::now().timestamp_millis();
        Ok(Some(previous.map_or(now, |p| now.max(p + 1))))
    }
}

/// The `inCommitTimestamp` of a commit file's first action, if it has one.
fn first_in_commit_timestamp(commit: &[u8]) -> Option<i64> {
    let first = commit.split(|b| *b == b'\n').next()?;
    let action: serde_json::Value = serde_json::from_slice(first).ok()?;
    action.get("commitInfo")?.get("inCommitTimestamp")?.as_i64()
}
