//! Source positions kept in the table ([`PositionClaim`], Kafka group
//! mode): read fresh for a process taking over a partition, and moved by
//! a commit that lands only if no other writer moved them first.
//!
//! The check is lakestream's own, on every commit path: a commit is
//! written as version `head + 1` with create-if-absent after checking the
//! claims at `head`, so nothing can land in between; a version found
//! taken means reading the newer commits and checking again. delta-rs's
//! rebase (which would move a commit past another writer's without our
//! check) is never used for a commit with claims.

use super::*;
use lakestream_sink::{CommitOutcome, PositionClaim};

/// The positions known as of one table version: `None` for an app id the
/// table never recorded.
#[derive(Debug, Default)]
pub(super) struct PositionCache {
    version: Option<u64>,
    known: HashMap<String, Option<i64>>,
}

impl DeltaSink {
    /// The positions of `app_ids` as of the newest version this sink has
    /// seen: from the cache, brought forward by reading the commits made
    /// since (usually only this process's own), else from the snapshot.
    pub(super) async fn positions_at_head(
        &self,
        loaded: &Loaded,
        app_ids: &[String],
    ) -> Result<HashMap<String, Option<i64>>> {
        let head = self.head(loaded).unwrap_or_default();
        let log_store = loaded.meta.log_store();
        let mut cache = self.positions.lock().await;
        match cache.version {
            Some(v) if v == head => {}
            Some(v) if v < head && head - v <= MAX_INCREMENTAL_TXN_SCAN => {
                match scan_txns(log_store.as_ref(), v, head).await {
                    Some(seen) => {
                        for (id, txn) in seen {
                            cache.known.insert(id, Some(txn));
                        }
                    }
                    None => cache.known.clear(),
                }
            }
            _ => cache.known.clear(),
        }
        cache.version = Some(head);
        let mut out = HashMap::new();
        for id in app_ids {
            let txn = match cache.known.get(id) {
                Some(t) => *t,
                None => {
                    let t = txn::snapshot_txn(&log_store, head, id)
                        .await
                        .map_err(|e| self.table_err(e))?;
                    cache.known.insert(id.clone(), t);
                    t
                }
            };
            out.insert(id.clone(), txn);
        }
        Ok(out)
    }

    /// Record the positions our own commit `version` wrote.
    async fn note_positions(&self, version: u64, claims: &[PositionClaim]) {
        let mut cache = self.positions.lock().await;
        if cache.version.is_some_and(|v| v + 1 == version) {
            cache.version = Some(version);
            for c in claims {
                cache.known.insert(c.app_id.clone(), Some(c.to));
            }
        }
    }

    /// Commit an append whose claims must hold: see the module docs.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn commit_claimed(
        &self,
        loaded: &mut Loaded,
        actions: Vec<Action>,
        info: &CommitInfo,
        operation: DeltaOperation,
        app_metadata: HashMap<String, serde_json::Value>,
        evolved: bool,
    ) -> Result<CommitOutcome> {
        let batch = i64::try_from(info.batch_id).expect("batch ids fit in i64");
        let ids: Vec<String> = info.claims.iter().map(|c| c.app_id.clone()).collect();
        let mut txns = vec![Transaction::new(&info.query_id, batch)];
        txns.extend(
            info.claims
                .iter()
                .map(|c| Transaction::new(&c.app_id, c.to)),
        );
        for attempt in 0..=COMMIT_RETRIES {
            if attempt > 0
                && let Some(done) = self
                    .after_lost_version(loaded, &info.query_id, batch)
                    .await?
            {
                return Ok(done);
            }
            let head = self.head(loaded).unwrap_or_default();
            let positions = self.positions_at_head(loaded, &ids).await?;
            for c in &info.claims {
                if let Some(Some(found)) = positions.get(&c.app_id)
                    && *found != c.from
                {
                    tracing::info!(
                        table = %self.name, batch_id = info.batch_id, app_id = %c.app_id,
                        expected = c.from, found, "position moved by another writer: batch dropped"
                    );
                    return Ok(CommitOutcome::Superseded {
                        version: head,
                        app_id: c.app_id.clone(),
                        expected: c.from,
                        found: *found,
                    });
                }
            }
            let version = match self
                .append_commit(
                    loaded,
                    &actions,
                    operation.clone(),
                    app_metadata.clone(),
                    txns.clone(),
                    info.batch_id,
                )
                .await?
            {
                Append::Committed(v) => {
                    self.note_positions(v, &info.claims).await;
                    if evolved {
                        self.schema_evolved(loaded).await?;
                    }
                    self.after_append(loaded, v, info).await;
                    return Ok(CommitOutcome::Committed { version: v });
                }
                Append::Taken => continue,
                Append::NotApplicable => {
                    // delta-rs's commit, at exactly `head + 1`: no rebase
                    // past a commit our check has not seen.
                    let table = self.full(loaded).await?;
                    if table.version() != Some(head) {
                        continue;
                    }
                    let state = table.snapshot().map_err(|e| self.table_err(e))?;
                    let props = CommitProperties::default()
                        .with_max_retries(0)
                        .with_application_transactions(txns.clone())
                        .with_metadata(app_metadata.clone());
                    match CommitBuilder::from(props)
                        .with_actions(actions.clone())
                        .build(Some(state), table.log_store(), operation.clone())
                        .await
                    {
                        Ok(done) => {
                            let v = done.version();
                            table.state = Some(done.snapshot());
                            v
                        }
                        Err(
                            DeltaTableError::VersionAlreadyExists(_)
                            | DeltaTableError::Transaction {
                                source:
                                    TransactionError::MaxCommitAttempts(_)
                                    | TransactionError::VersionAlreadyExists(_)
                                    | TransactionError::CommitConflict(_),
                            },
                        ) => continue,
                        Err(e) => {
                            return Err(Error::Commit {
                                table: self.name.clone(),
                                batch_id: info.batch_id,
                                source: Box::new(e),
                            });
                        }
                    }
                }
            };
            self.set_head(version);
            self.remember_txn(&info.query_id, version, Some(batch))
                .await;
            self.note_positions(version, &info.claims).await;
            if evolved {
                self.schema_evolved(loaded).await?;
            }
            self.maybe_compact(loaded, info.batch_id).await;
            return Ok(CommitOutcome::Committed { version });
        }
        Err(Error::Commit {
            table: self.name.clone(),
            batch_id: info.batch_id,
            source: format!(
                "other writers took every version this commit tried ({} attempts); the batch \
                 was not committed and re-runs from the checkpoint",
                COMMIT_RETRIES + 1
            )
            .into(),
        })
    }

    /// [`Sink::positions`] for the Delta sink: the latest table version's.
    pub(super) async fn fresh_positions(
        &self,
        app_ids: &[String],
    ) -> Result<std::collections::BTreeMap<String, i64>> {
        let mut guard = self.table.lock().await;
        let Some(loaded) = self.loaded(&mut guard).await? else {
            return Ok(Default::default());
        };
        self.refresh(loaded).await?;
        Ok(self
            .positions_at_head(loaded, app_ids)
            .await?
            .into_iter()
            .filter_map(|(id, p)| p.map(|p| (id, p)))
            .collect())
    }
}

/// Every txn written by the commits `(from, to]`, the last per app id;
/// `None` when a commit cannot be read (then the caller reads the
/// snapshot).
pub(super) async fn scan_txns(
    store: &dyn LogStore,
    from: u64,
    to: u64,
) -> Option<HashMap<String, i64>> {
    let mut seen = HashMap::new();
    for v in from + 1..=to {
        let bytes = store.read_commit_entry(v).await.ok()??;
        for line in bytes.split(|b| *b == b'\n') {
            // Cheap pre-filter: most commit lines are adds.
            if !line.windows(6).any(|w| w == b"\"txn\":") {
                continue;
            }
            let action: serde_json::Value = serde_json::from_slice(line).ok()?;
            let t = &action["txn"];
            if let (Some(id), Some(version)) = (t["appId"].as_str(), t["version"].as_i64()) {
                seen.insert(id.to_string(), version);
            }
        }
    }
    Some(seen)
}
