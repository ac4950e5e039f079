//! [`Checkpoint`]: opening or creating a checkpoint under its fence, and writing and reading its logs (offsets, commits, progress, source state and snapshots).

use super::*;

impl Checkpoint {
    /// Open (creating when absent) the checkpoint at `location`.
    ///
    /// On a local path this takes an exclusive OS lock on `<checkpoint>/lock`
    /// and fails with [`Error::InUse`] while another process holds it. On an
    /// object store the create-if-absent write of each `offsets/N` is the fence.
    pub async fn open(location: &str, options: &HashMap<String, String>) -> Result<Self> {
        Self::open_at(Location::parse(location, options)?).await
    }

    /// [`Checkpoint::open`] at a location already resolved (for instance
    /// with an embedder's [`lakestream_storage::StoreRegistry`]).
    pub async fn open_at(location: Location) -> Result<Self> {
        location.ensure_local_dir()?;
        let lock = match location.local_dir() {
            Some(dir) => Some(take_lock(dir, location.url().as_str())?),
            None => None,
        };
        location.verify_atomic_create().await?;
        let metadata = match read_metadata(&location).await? {
            Some(m) => m,
            None => {
                let m = Metadata {
                    version: FORMAT_VERSION,
                    query_id: Uuid::new_v4(),
                    created_at_ms: now_ms(),
                };
                let path = location.child("metadata");
                match put_json(&location, &path, &m, PutMode::Create).await {
                    Ok(()) => m,
                    // Another process created it first: theirs is the query id.
                    Err(Error::Storage(lakestream_storage::Error::Store {
                        source: object_store::Error::AlreadyExists { .. },
                        ..
                    })) => read_metadata(&location)
                        .await?
                        .ok_or_else(|| Error::Corrupt {
                            file: file_url(&location, "metadata"),
                            reason: "metadata vanished after it was created".into(),
                        })?,
                    Err(e) => return Err(e),
                }
            }
        };
        Ok(Self {
            location,
            metadata,
            _lock: lock,
        })
    }

    /// Read a checkpoint without taking the fence (for `status`). Returns
    /// `None` when no checkpoint exists at `location`.
    pub async fn inspect(
        location: &str,
        options: &HashMap<String, String>,
    ) -> Result<Option<CheckpointView>> {
        let location = Location::parse(location, options)?;
        let Some(metadata) = read_metadata(&location).await? else {
            return Ok(None);
        };
        Ok(Some(CheckpointView { location, metadata }))
    }

    /// The query id recorded in `metadata`.
    pub fn query_id(&self) -> Uuid {
        self.metadata.query_id
    }

    /// The parsed `metadata` file.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// Where this checkpoint lives.
    pub fn location(&self) -> &Location {
        &self.location
    }

    /// Write `offsets/N` with create-if-absent.
    ///
    /// Durable when this returns. If the file already exists another process
    /// planned this batch: [`Error::InUse`] (never overwritten).
    pub async fn write_offsets(&self, entry: &OffsetsEntry) -> Result<()> {
        let name = format!("offsets/{}", entry.batch_id);
        let path = self.location.child(&name);
        match put_json(&self.location, &path, entry, PutMode::Create).await {
            Err(Error::Storage(lakestream_storage::Error::Store {
                source: object_store::Error::AlreadyExists { .. },
                ..
            })) => Err(Error::InUse {
                location: self.location.url().to_string(),
                detail: format!(
                    "{} was written by someone else while this process planned batch {}",
                    file_url(&self.location, &name),
                    entry.batch_id
                ),
            }),
            other => other,
        }
    }

    /// Check that `record` (this run's sources and sink) is the query the
    /// checkpoint belongs to, recording it on the first run.
    ///
    /// A checkpoint written before `query` existed is checked against the
    /// source names of its newest `offsets/N`, then given `record`. Fails
    /// with [`Error::QueryChanged`] listing every difference.
    pub async fn check_query(&self, record: &QueryRecord) -> Result<()> {
        if let Some(recorded) = read_entry::<QueryRecord>(&self.location, "query").await? {
            let differences = record.differences(&recorded);
            if differences.is_empty() {
                if record.dead_letters != recorded.dead_letters {
                    // Dead-letter tables came or went: recorded so `verify`
                    // finds them; no offset changes meaning.
                    let path = self.location.child("query");
                    return put_json(&self.location, &path, record, PutMode::Overwrite).await;
                }
                return Ok(());
            }
            if self.offset_ids().await?.is_empty() {
                // Nothing was ever planned (a first run found no input, or
                // failed before its first batch, say on a mistyped
                // location): no offset can be misapplied, so the corrected
                // query takes the checkpoint over. Starting points resolved
                // for the old sources are dropped.
                tracing::warn!(location = %self.location.url(), differences = %differences.join("; "), "the checkpoint's query changed before any batch was planned; recording the new one");
                for name in recorded.sources.keys() {
                    let _ = self
                        .location
                        .store()
                        .delete(&self.location.child(&format!("sources/{name}/initial")))
                        .await;
                }
                let path = self.location.child("query");
                return put_json(&self.location, &path, record, PutMode::Overwrite).await;
            }
            return self.refuse_differences(differences);
        }
        if let Some(last) = self.latest_offsets().await? {
            let mut differences = Vec::new();
            for name in last.sources.keys() {
                if !record.sources.contains_key(name) {
                    differences.push(format!("source {name} is no longer in the query"));
                }
            }
            for name in record.sources.keys() {
                if !last.sources.contains_key(name) {
                    differences.push(format!("source {name} is new"));
                }
            }
            self.refuse_differences(differences)?;
        }
        let path = self.location.child("query");
        match put_json(&self.location, &path, record, PutMode::Create).await {
            Ok(()) => Ok(()),
            // Another process recorded it first: compare with theirs.
            Err(Error::Storage(lakestream_storage::Error::Store {
                source: object_store::Error::AlreadyExists { .. },
                ..
            })) => match read_entry::<QueryRecord>(&self.location, "query").await? {
                Some(recorded) => self.refuse_differences(record.differences(&recorded)),
                None => Ok(()),
            },
            Err(e) => Err(e),
        }
    }

    pub(super) fn refuse_differences(&self, differences: Vec<String>) -> Result<()> {
        if differences.is_empty() {
            return Ok(());
        }
        Err(Error::QueryChanged {
            location: self.location.url().to_string(),
            differences,
        })
    }

    /// Remove `offsets/N`, `commits/N` and `progress/N` for every
    /// `N < keep_from`: the caller has made sure snapshots cover them. Best
    /// effort: a file that cannot be removed is left for the next purge.
    pub async fn purge_before(&self, keep_from: u64) -> Result<usize> {
        let mut removed = 0;
        for dir in ["offsets", "commits", "progress"] {
            for id in list_ids(&self.location, dir).await? {
                if id >= keep_from {
                    break;
                }
                if self
                    .location
                    .store()
                    .delete(&self.location.child(&format!("{dir}/{id}")))
                    .await
                    .is_ok()
                {
                    removed += 1;
                }
            }
        }
        Ok(removed)
    }

    /// The batch ids of the snapshots kept for `source`, ascending.
    pub async fn source_snapshot_ids(&self, source: &str) -> Result<Vec<u64>> {
        list_ids(&self.location, &format!("sources/{source}/snapshots")).await
    }

    /// Write `commits/N`. Idempotent: rewriting the same batch is allowed, so a
    /// crash between the table commit and this write is harmless.
    pub async fn write_commit(&self, entry: &CommitEntry) -> Result<()> {
        let path = self.location.child(&format!("commits/{}", entry.batch_id));
        put_json(&self.location, &path, entry, PutMode::Overwrite).await
    }

    /// Read `offsets/N`, if present.
    pub async fn offsets(&self, batch_id: u64) -> Result<Option<OffsetsEntry>> {
        read_entry(&self.location, &format!("offsets/{batch_id}")).await
    }

    /// Write `progress/N` (overwriting: a replayed batch reports again).
    /// Not synced: the history is best effort, and a file torn by a crash
    /// is passed over by its readers. The returned future owns what it
    /// needs, so it can run off the batch path.
    pub fn write_progress(
        &self,
        entry: ProgressEntry,
    ) -> impl std::future::Future<Output = Result<()>> + Send + 'static {
        let location = self.location.clone();
        async move {
            let path = location.child(&format!("progress/{}", entry.batch_id));
            let bytes = serde_json::to_vec(&entry).expect("checkpoint types serialize");
            location
                .store()
                .put_opts(&path, PutPayload::from(bytes), PutOptions::default())
                .await
                .map_err(|e| lakestream_storage::Error::Store {
                    file: format!("{}{}", location.url(), path_below_root(&location, &path)),
                    source: e,
                })?;
            Ok(())
        }
    }

    /// The highest planned batch, if any.
    pub async fn latest_offsets(&self) -> Result<Option<OffsetsEntry>> {
        latest(&self.location, "offsets").await
    }

    /// The highest committed batch, if any.
    pub async fn latest_commit(&self) -> Result<Option<CommitEntry>> {
        latest(&self.location, "commits").await
    }

    /// A source's private state file `sources/<source>/<file>`, if present.
    pub async fn source_state(
        &self,
        source: &str,
        file: &str,
    ) -> Result<Option<serde_json::Value>> {
        read_state_at(&self.location, source, file).await
    }

    /// Write `sources/<source>/<file>` unless it exists; returns what is
    /// stored afterwards (an existing value wins).
    pub async fn init_source_state(
        &self,
        source: &str,
        file: &str,
        state: serde_json::Value,
    ) -> Result<serde_json::Value> {
        init_state_at(&self.location, source, file, state).await
    }

    /// Replace `sources/<source>/<file>` (a source's schema that evolved:
    /// the next run reads the new one). Durable when it returns.
    pub async fn replace_source_state(
        &self,
        source: &str,
        file: &str,
        state: serde_json::Value,
    ) -> Result<()> {
        let path = self.location.child(&format!("sources/{source}/{file}"));
        let body = serde_json::json!({ "version": FORMAT_VERSION, "state": state });
        put_json(&self.location, &path, &body, PutMode::Overwrite).await
    }

    /// Every planned batch id, ascending.
    pub async fn offset_ids(&self) -> Result<Vec<u64>> {
        list_ids(&self.location, "offsets").await
    }

    /// Write `sources/<source>/snapshots/<batch_id>`: the source's summary
    /// of every batch up to and including `batch_id` (written after that
    /// batch committed). Snapshots older than the previous one are removed.
    pub async fn write_source_snapshot(
        &self,
        source: &str,
        batch_id: u64,
        snapshot: serde_json::Value,
    ) -> Result<()> {
        let dir = format!("sources/{source}/snapshots");
        let path = self.location.child(&format!("{dir}/{batch_id}"));
        let body = serde_json::json!({ "version": FORMAT_VERSION, "state": snapshot });
        put_json(&self.location, &path, &body, PutMode::Overwrite).await?;
        let ids = list_ids(&self.location, &dir).await?;
        // Keep the newest two: a reader that listed just before this write
        // still finds the one it chose.
        for old in ids.iter().rev().skip(2) {
            let _ = self
                .location
                .store()
                .delete(&self.location.child(&format!("{dir}/{old}")))
                .await;
        }
        Ok(())
    }

    /// The newest readable snapshot of `source` taken at a batch
    /// `<= max_batch`, with its batch id. A corrupt snapshot (torn by a
    /// crash, damaged on disk) is passed over with a warning for the one
    /// kept before it: the write-ahead files after that one are kept too.
    pub async fn latest_source_snapshot(
        &self,
        source: &str,
        max_batch: u64,
    ) -> Result<Option<(u64, serde_json::Value)>> {
        let dir = format!("sources/{source}/snapshots");
        let ids = list_ids(&self.location, &dir).await?;
        for id in ids.into_iter().rev().filter(|id| *id <= max_batch) {
            match read_state_at(&self.location, source, &format!("snapshots/{id}")).await {
                Ok(Some(v)) => return Ok(Some((id, v))),
                Ok(None) => {}
                Err(e @ Error::Corrupt { .. }) => {
                    tracing::warn!(source, batch_id = id, error = %e, "a source snapshot is unreadable; removing it and using the one before it");
                    // Removed, so it no longer counts as one of the two
                    // snapshots kept (nor bounds what is purged).
                    let _ = self
                        .location
                        .store()
                        .delete(&self.location.child(&format!("{dir}/{id}")))
                        .await;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }
}
