//! One batch's commit, however it is made: the request (actions, the
//! txn of the batch, the commitInfo), the skip of a batch the table holds,
//! the fast append with its retries at the new head, and delta-rs's commit
//! (tables with newer writer protocols, MERGE for upserts, a replacement,
//! after a lost race).

use super::*;

/// What one batch's commit carries.
pub(super) struct Request<'a> {
    /// The batch.
    pub(super) info: &'a CommitInfo,
    /// Its id, as a txn version.
    pub(super) batch: i64,
    /// The staged files' actions, after a metaData action of columns added.
    pub(super) actions: Vec<Action>,
    /// The batch adds columns (`merge_schema`): `actions` starts with the
    /// new metaData.
    pub(super) evolved: bool,
    /// The commitInfo operation.
    pub(super) operation: DeltaOperation,
    /// lakestream's commitInfo metadata.
    pub(super) app_metadata: HashMap<String, serde_json::Value>,
    /// The txn action `(query id, batch id)`.
    pub(super) transaction: Transaction,
}

/// How the fast append ended.
pub(super) enum FastAppend {
    /// The batch is in the table (committed now or before).
    Done(CommitOutcome),
    /// delta-rs's commit is to make it: `taken` when another writer took
    /// the version tried, `refreshed` when the log was read again since.
    Fallback { taken: bool, refreshed: bool },
}

impl DeltaSink {
    /// The request of batch `info` with its staged `actions`.
    pub(super) fn request<'a>(
        &self,
        info: &'a CommitInfo,
        mut actions: Vec<Action>,
    ) -> Result<Request<'a>> {
        // New columns reach the table with the first batch that has them.
        let new_metadata = self
            .evolution
            .lock()
            .expect("evolution lock")
            .as_ref()
            .and_then(|ev| ev.metadata.clone());
        if let Some(m) = &new_metadata {
            if info.write != WriteMode::Append {
                return Err(Error::InvalidConfig {
                    table: self.name.clone(),
                    reason: "merge_schema adds columns with appended batches only; an \
                             aggregation in update or complete mode cannot change the \
                             table's columns"
                        .into(),
                });
            }
            actions.insert(0, Action::Metadata(m.clone()));
        }
        let batch = i64::try_from(info.batch_id).expect("batch ids fit in i64");
        let mut meta = info.metadata.clone();
        meta.insert("batchId".into(), serde_json::json!(info.batch_id));
        meta.insert("queryId".into(), serde_json::json!(info.query_id));
        let app_metadata: HashMap<String, serde_json::Value> =
            HashMap::from([("lakestream".to_string(), serde_json::Value::Object(meta))]);
        let operation = DeltaOperation::StreamingUpdate {
            output_mode: match info.write {
                WriteMode::Append => OutputMode::Append,
                WriteMode::ReplaceAll { .. } => OutputMode::Complete,
                WriteMode::Upsert { .. } => OutputMode::Update,
            },
            query_id: info.query_id.clone(),
            epoch_id: batch,
        };
        Ok(Request {
            info,
            batch,
            actions,
            evolved: new_metadata.is_some(),
            operation,
            app_metadata,
            transaction: Transaction::new(&info.query_id, batch),
        })
    }

    /// The outcome when the table already holds the batch (the query's
    /// txn version is at least its id).
    pub(super) async fn known_committed(
        &self,
        loaded: &mut Loaded,
        req: &Request<'_>,
    ) -> Result<Option<CommitOutcome>> {
        let info = req.info;
        // With this query's txn known at the newest version this sink has
        // seen, the log is not re-read: a commit by another writer since
        // then makes our create-if-absent fail (or, on the delta-rs path,
        // is caught by its conflict check), and that path re-reads.
        let head = self.head(loaded);
        let cached = self.txn.lock().await.clone();
        let txn = match cached {
            Some(c) if c.app_id == info.query_id && Some(c.table_version) == head => c.txn,
            _ => {
                self.refresh(loaded).await?;
                self.check_contract(loaded, info.batch_id)?;
                self.txn_version(loaded, &info.query_id).await?
            }
        };
        Ok(txn
            .is_some_and(|v| v >= req.batch)
            .then(|| CommitOutcome::AlreadyCommitted {
                version: self.head(loaded).unwrap_or_default(),
            }))
    }

    /// An append as one create-if-absent write of the commit file.
    ///
    /// A replacement removes every file of the table and an upsert
    /// rewrites the files holding its keys: both need the file list, so
    /// they go through delta-rs. When another writer took the version, an
    /// append is tried again at the new head (appends do not conflict with
    /// appends), unless it carries a metaData action or a winner changed
    /// the table's metadata or protocol: then delta-rs's conflict check
    /// decides.
    pub(super) async fn fast_append(
        &self,
        loaded: &mut Loaded,
        req: &Request<'_>,
    ) -> Result<FastAppend> {
        let info = req.info;
        let mut append = Append::NotApplicable;
        let mut refreshed = false;
        if info.write == WriteMode::Append {
            for attempt in 0..=COMMIT_RETRIES {
                if attempt > 0 {
                    if req.evolved {
                        break;
                    }
                    let tried = self.head(loaded).unwrap_or_default();
                    if let Some(done) = self
                        .after_lost_version(loaded, &info.query_id, req.batch)
                        .await?
                    {
                        return Ok(FastAppend::Done(done));
                    }
                    self.check_contract(loaded, info.batch_id)?;
                    refreshed = true;
                    let latest = self.head(loaded).unwrap_or_default();
                    if txn::changes_table(loaded.meta.log_store().as_ref(), tried, latest).await {
                        break;
                    }
                }
                append = self
                    .append_commit(
                        loaded,
                        &req.actions,
                        req.operation.clone(),
                        req.app_metadata.clone(),
                        vec![req.transaction.clone()],
                        info.batch_id,
                    )
                    .await?;
                if append != Append::Taken {
                    break;
                }
            }
        }
        if let Append::Committed(version) = append {
            if req.evolved {
                self.schema_evolved(loaded).await?;
            }
            self.after_append(loaded, version, info).await;
            return Ok(FastAppend::Done(CommitOutcome::Committed { version }));
        }
        Ok(FastAppend::Fallback {
            taken: append == Append::Taken,
            refreshed,
        })
    }

    /// delta-rs's commit: for tables with newer writer protocols, upserts
    /// (MERGE), replacements, and after another writer committed the
    /// version the fast append tried.
    pub(super) async fn commit_with_delta_rs(
        &self,
        loaded: &mut Loaded,
        mut req: Request<'_>,
        taken: bool,
        refreshed: bool,
    ) -> Result<CommitOutcome> {
        let (info, batch) = (req.info, req.batch);
        let done = if taken && !refreshed {
            self.after_lost_version(loaded, &info.query_id, batch)
                .await?
        } else {
            self.already_committed(loaded, &info.query_id, batch)
                .await?
        };
        if let Some(done) = done {
            return Ok(done);
        }
        self.check_contract(loaded, info.batch_id)?;
        let props = self.commit_properties(loaded, &mut req).await?;
        // A complete batch into a table with a change data feed is merged
        // too, so the feed records the groups that changed as updates (and
        // only those), not every row deleted and inserted again.
        let change_data_feed = self
            .contract
            .lock()
            .expect("contract lock")
            .features
            .change_data_feed;
        let merge = match &info.write {
            WriteMode::Upsert { keys } => Some((keys, false)),
            WriteMode::ReplaceAll { keys: Some(keys) } if change_data_feed => Some((keys, true)),
            _ => None,
        };
        if let Some((keys, replace)) = merge
            && req.actions.iter().any(|a| matches!(a, Action::Add(_)))
        {
            return self.commit_merge(loaded, &req, keys, replace, props).await;
        }
        self.commit_actions(loaded, req, props).await
    }

    /// The properties of delta-rs's commit of `req` (its retries, log
    /// cleanup, txn and metadata, with an in-commit timestamp when the
    /// table has them).
    async fn commit_properties(
        &self,
        loaded: &mut Loaded,
        req: &mut Request<'_>,
    ) -> Result<CommitProperties> {
        // delta-rs writes a Delta checkpoint with commit `v` when `v + 1` is
        // a multiple of the interval. Expired-log cleanup lists the whole
        // log: it runs with such a commit, and at most once per
        // CLEANUP_EVERY_VERSIONS versions, so a commit's cost does not grow
        // with the log.
        let interval = checkpoint_interval(&loaded.meta);
        let protected = self
            .contract
            .lock()
            .expect("contract lock")
            .features
            .checkpoint_protection;
        let next = self.full(loaded).await?.version().unwrap_or_default() + 1;
        let mut retries = COMMIT_RETRIES;
        if let Some(ict) = self.in_commit_timestamp(loaded, next).await? {
            // delta-rs puts commitInfo first and keeps this key in it. Its
            // rebase onto a later version would keep a timestamp chosen
            // for this one: a lost race fails the batch instead (a
            // restart re-runs it).
            req.app_metadata
                .insert("inCommitTimestamp".into(), serde_json::json!(ict));
            retries = 0;
        }
        Ok(CommitProperties::default()
            .with_max_retries(retries)
            .with_cleanup_expired_logs(Some(
                !protected && (next + 1).is_multiple_of(cleanup_every(interval)),
            ))
            .with_application_transaction(req.transaction.clone())
            .with_metadata(req.app_metadata.clone()))
    }

    /// An upsert (or a complete batch into a table with a change data
    /// feed) as a MERGE on `keys`.
    async fn commit_merge(
        &self,
        loaded: &mut Loaded,
        req: &Request<'_>,
        keys: &[String],
        replace: bool,
        props: CommitProperties,
    ) -> Result<CommitOutcome> {
        let (info, batch) = (req.info, req.batch);
        let table = self.full(loaded).await?;
        let merged = self
            .upsert(table, &req.actions, keys, replace, props, info.batch_id)
            .await;
        match merged {
            Ok(version) => {
                if let Some(meta) = self.load_meta().await? {
                    loaded.meta = meta;
                }
                self.set_head(version);
                self.remember_txn(&info.query_id, version, Some(batch))
                    .await;
                Ok(CommitOutcome::Committed { version })
            }
            Err(e) => {
                // Another attempt of this batch may have merged first.
                self.refresh(loaded).await?;
                match self.txn_version(loaded, &info.query_id).await? {
                    Some(v) if v >= batch => Ok(CommitOutcome::AlreadyCommitted {
                        version: self.head(loaded).unwrap_or_default(),
                    }),
                    _ => Err(e),
                }
            }
        }
    }

    /// `req`'s actions (after removes of every file, for a replacement)
    /// through delta-rs's commit and its conflict check.
    async fn commit_actions(
        &self,
        loaded: &mut Loaded,
        req: Request<'_>,
        props: CommitProperties,
    ) -> Result<CommitOutcome> {
        let (info, batch) = (req.info, req.batch);
        let mut actions = req.actions;
        let table = self.full(loaded).await?;
        let state = table.snapshot().map_err(|e| self.table_err(e))?;
        if matches!(info.write, WriteMode::ReplaceAll { .. }) {
            use futures::TryStreamExt;
            let removes: Vec<Action> = state
                .snapshot()
                .file_views(&table.log_store(), None)
                .map_ok(|f| Action::Remove(f.remove_action(true)))
                .try_collect()
                .await
                .map_err(|e| self.table_err(e))?;
            actions.splice(0..0, removes);
        }
        let result = CommitBuilder::from(props)
            .with_actions(actions)
            .build(Some(state), table.log_store(), req.operation)
            .await;
        match result {
            Ok(done) => {
                let version = done.version();
                if done.metrics.new_checkpoint_created {
                    // This commit wrote a Delta checkpoint. A state carried
                    // from commit to commit keeps every commit's actions as
                    // its own piece, and replaying them all makes each
                    // commit slower than the last; reloading from the fresh
                    // checkpoint keeps the cost of a commit flat.
                    *table = self.load_full().await?;
                } else {
                    // The commit returns the new state: no need to re-read the log.
                    table.state = Some(done.snapshot());
                }
                if req.evolved {
                    self.schema_evolved(loaded).await?;
                }
                self.set_head(version);
                self.remember_txn(&info.query_id, version, Some(batch))
                    .await;
                self.maybe_compact(loaded, info.batch_id).await;
                Ok(CommitOutcome::Committed { version })
            }
            Err(err) => {
                // A conflict on our own app id means another attempt of this
                // query committed first: if it holds this batch, we are done.
                let conflict = matches!(
                    &err,
                    DeltaTableError::Transaction {
                        source: TransactionError::CommitConflict(_)
                    }
                );
                if conflict {
                    self.refresh(loaded).await?;
                    if let Some(done) = self
                        .already_committed(loaded, &info.query_id, batch)
                        .await?
                    {
                        return Ok(done);
                    }
                }
                Err(Error::Commit {
                    table: self.name.clone(),
                    batch_id: info.batch_id,
                    source: Box::new(err),
                })
            }
        }
    }
}
