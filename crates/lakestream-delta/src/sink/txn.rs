//! The query's txn version in the table: cached per table version,
//! brought forward by reading the commits since, and read from the
//! snapshot (the checkpoint's txn column, no file list) when needed.

use super::*;

impl DeltaSink {
    /// The txn version recorded for `query_id` as of the newest version
    /// this sink has seen.
    ///
    /// The whole-log lookup costs more as the log grows between Delta
    /// checkpoints, so the answer is cached per table version and brought
    /// up to date by reading only the commits made since (usually none:
    /// this process is the only writer of its query).
    pub(super) async fn txn_version(&self, loaded: &Loaded, query_id: &str) -> Result<Option<i64>> {
        let current = self.head(loaded).unwrap_or_default();
        let log_store = loaded.meta.log_store();
        let cached = self.txn.lock().await.clone();
        if let Some(c) = cached
            && c.app_id == query_id
            && c.table_version <= current
            && current - c.table_version <= MAX_INCREMENTAL_TXN_SCAN
            && let Some(txn) = scan_txn(
                log_store.as_ref(),
                query_id,
                c.table_version,
                current,
                c.txn,
            )
            .await
        {
            self.remember_txn(query_id, current, txn).await;
            return Ok(txn);
        }
        let txn = snapshot_txn(&log_store, current, query_id)
            .await
            .map_err(|e| self.table_err(e))?;
        self.remember_txn(query_id, current, txn).await;
        Ok(txn)
    }

    /// [`CommitOutcome::AlreadyCommitted`] when the table, as of the
    /// newest version this sink has seen, holds batch `batch` of
    /// `query_id` or a later one.
    pub(super) async fn already_committed(
        &self,
        loaded: &Loaded,
        query_id: &str,
        batch: i64,
    ) -> Result<Option<lakestream_sink::CommitOutcome>> {
        Ok(match self.txn_version(loaded, query_id).await? {
            Some(v) if v >= batch => Some(lakestream_sink::CommitOutcome::AlreadyCommitted {
                version: self.head(loaded).unwrap_or_default(),
            }),
            _ => None,
        })
    }

    /// After a commit found its version taken by another writer: count
    /// the retry, learn the latest version, and say whether it holds the
    /// batch already.
    pub(super) async fn after_lost_version(
        &self,
        loaded: &mut Loaded,
        query_id: &str,
        batch: i64,
    ) -> Result<Option<lakestream_sink::CommitOutcome>> {
        self.retries
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.refresh(loaded).await?;
        self.already_committed(loaded, query_id, batch).await
    }

    pub(super) async fn remember_txn(&self, app_id: &str, table_version: u64, txn: Option<i64>) {
        *self.txn.lock().await = Some(TxnCache {
            app_id: app_id.to_string(),
            table_version,
            txn,
        });
    }
}

/// The txn version of `app_id` after the commits `(from, to]`, starting
/// from `txn` at `from`; `None` when a commit cannot be read (then the
/// caller reads the snapshot).
async fn scan_txn(
    store: &dyn LogStore,
    app_id: &str,
    from: u64,
    to: u64,
    txn: Option<i64>,
) -> Option<Option<i64>> {
    let seen = super::positions::scan_txns(store, from, to).await?;
    Some(seen.get(app_id).copied().or(txn))
}

/// The txn version of `app_id` in the table's snapshot at `version`, read
/// by the Delta kernel from the newest checkpoint and the commits after it
/// (the txn column only: no file list is built).
pub(super) async fn snapshot_txn(
    log_store: &LogStoreRef,
    version: u64,
    app_id: &str,
) -> Result<Option<i64>, DeltaTableError> {
    let engine = log_store.engine(None);
    // The kernel joins paths onto the root: it must end with a slash.
    let mut root = log_store.root_url().clone();
    if !root.path().ends_with('/') {
        root.set_path(&format!("{}/", root.path()));
    }
    let app_id = app_id.to_string();
    tokio::task::spawn_blocking(move || {
        let snapshot = buoyant_kernel::snapshot::Snapshot::builder_for(root.as_str())
            .at_version(version)
            .build(engine.as_ref())?;
        Ok(snapshot.get_app_id_version(&app_id, engine.as_ref())?)
    })
    .await
    .map_err(|e| DeltaTableError::Generic(format!("txn lookup task: {e}")))?
}

/// Whether any of the commits `(from, to]` changes the table's metadata or
/// protocol (or cannot be read): an append that lost its version is then
/// not simply tried again at the new head.
pub(super) async fn changes_table(store: &dyn LogStore, from: u64, to: u64) -> bool {
    for v in from + 1..=to {
        let Ok(Some(bytes)) = store.read_commit_entry(v).await else {
            return true;
        };
        // A mention anywhere counts (a commitInfo naming them only sends
        // the append through delta-rs's check: safe, just slower).
        let changes = bytes
            .windows(10)
            .any(|w| w == b"\"metaData\"" || w == b"\"protocol\"");
        if changes {
            return true;
        }
    }
    false
}
