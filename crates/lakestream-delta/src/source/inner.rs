//! The Delta source's reads of the table: snapshots, new commits, change checks, deletion vectors and the change data feed.

use super::*;

impl Inner {
    pub(super) fn parse(&self, offset: &Offset) -> Result<DeltaOffset> {
        serde_json::from_value(offset.clone()).map_err(|e| Error::InvalidOffset {
            source_name: self.name.clone(),
            offset: offset.to_string(),
            reason: e.to_string(),
        })
    }

    pub(super) fn err(&self, what: &str, e: impl std::fmt::Display) -> Error {
        delta_err(&self.name, &self.location, what, e)
    }

    pub(super) async fn latest_version(&self) -> Result<u64> {
        let table = self.table.lock().await;
        table
            .get_latest_version()
            .await
            .map_err(|e| self.err("cannot find the table's latest version", e))
    }

    /// The first version committed at or after `ts_ms` (one past the
    /// latest when there is none yet: the query then reads the commits
    /// still to come). Commits are in time order; a binary search reads
    /// about log2(versions) of them.
    pub(super) async fn first_version_at(&self, ts_ms: i64) -> Result<u64> {
        let latest = self.latest_version().await?;
        let store = self.table.lock().await.log_store();
        let (mut lo, mut hi) = (0u64, latest + 1);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let at = match store
                .read_commit_entry(mid)
                .await
                .map_err(|e| self.err(&format!("cannot read commit {mid}"), e))?
            {
                // Removed by log retention: older than anything kept.
                None => i64::MIN,
                Some(bytes) => bytes
                    .split(|b| *b == b'\n')
                    .filter_map(|l| serde_json::from_slice::<serde_json::Value>(l).ok())
                    .find_map(|a| a["commitInfo"]["timestamp"].as_i64())
                    .unwrap_or(i64::MIN),
            };
            if at >= ts_ms {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        Ok(lo)
    }

    /// The files of the snapshot at `version` (ordered by path) or of
    /// commit `version` (in log order), cached.
    pub(super) async fn files(&self, version: u64, snapshot: bool) -> Result<Files> {
        if let Some(f) = self
            .cache
            .lock()
            .expect("delta cache")
            .get(&(version, snapshot))
        {
            return Ok(f.clone());
        }
        let files = if snapshot {
            self.snapshot_files(version).await?
        } else {
            self.commit_files(version).await?
        };
        let files = Arc::new(files);
        let mut cache = self.cache.lock().expect("delta cache");
        cache.insert((version, snapshot), files.clone());
        // Bounded: the oldest units go first (a replay reloads them).
        while cache.len() > 64 {
            let first = *cache.keys().next().expect("non-empty");
            cache.remove(&first);
        }
        Ok(files)
    }

    pub(super) async fn snapshot_files(&self, version: u64) -> Result<Vec<DataFile>> {
        let mut table = crate::sink::open_table(&self.location)
            .map_err(|e| self.err("cannot open the table", e))?;
        table.load_version(version).await.map_err(|e| {
            self.err(
                &format!("cannot load version {version} (the query's starting snapshot)"),
                e,
            )
        })?;
        let snapshot = table
            .snapshot()
            .map_err(|e| self.err("cannot read the table's state", e))?;
        check_readable(
            &self.name,
            &self.location,
            snapshot.protocol(),
            snapshot.metadata(),
        )?;
        let mut files: Vec<DataFile> = snapshot
            .log_data()
            .iter()
            .map(|f| DataFile {
                path: decode(&f.path()),
                size: u64::try_from(f.size()).unwrap_or(0),
                partition_values: f.partition_values_map().into_iter().collect(),
                deletion_vector: f.deletion_vector_descriptor(),
                change: None,
                vector_change: None,
            })
            .collect();
        files.sort_by(|a, b| a.path.cmp(&b.path));
        if self.options.read_change_feed {
            // The snapshot's rows are inserts at its version.
            let actions = self.commit_actions(version).await?;
            let timestamp_ms = self.commit_timestamp(version, &actions).await?;
            for f in &mut files {
                f.change = Some(Change {
                    kind: Some("insert"),
                    version,
                    timestamp_ms,
                });
            }
        }
        Ok(files)
    }

    /// The actions of commit `version`, in log order.
    pub(super) async fn commit_actions(&self, version: u64) -> Result<Vec<serde_json::Value>> {
        let store = self.table.lock().await.log_store();
        let bytes = store
            .read_commit_entry(version)
            .await
            .map_err(|e| self.err(&format!("cannot read commit {version}"), e))?
            .ok_or_else(|| Error::Delta {
                source_name: self.name.clone(),
                table: self.location.url().to_string(),
                reason: format!(
                    "commit {version} is no longer in the table's log (log retention removed \
                     it before the query read it); start a new query with 'starting_version' \
                     past it"
                ),
            })?;
        bytes
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|line| {
                serde_json::from_slice(line)
                    .map_err(|e| self.err(&format!("commit {version} is not valid JSON"), e))
            })
            .collect()
    }

    /// The time of commit `version` (its `actions`): its in-commit
    /// timestamp, else its commitInfo's time, else (a commit without
    /// commitInfo) the modification time of its log file.
    pub(super) async fn commit_timestamp(
        &self,
        version: u64,
        actions: &[serde_json::Value],
    ) -> Result<i64> {
        if let Some(t) = commit_time(actions) {
            return Ok(t);
        }
        let path = self
            .location
            .child(&format!("_delta_log/{version:020}.json"));
        let meta = object_store::ObjectStoreExt::head(self.location.store(), &path)
            .await
            .map_err(|e| self.err(&format!("cannot read the time of commit {version}"), e))?;
        Ok(meta.last_modified.timestamp_millis())
    }

    /// The file an `add`, `remove` or `cdc` action of commit `version`
    /// names.
    pub(super) fn action_file(&self, version: u64, a: &serde_json::Value) -> Result<DataFile> {
        let partition_values = a["partitionValues"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (k.clone(), v.as_str().map(str::to_string)))
                    .collect()
            })
            .unwrap_or_default();
        let deletion_vector = match a.get("deletionVector") {
            Some(dv) if !dv.is_null() => Some(serde_json::from_value(dv.clone()).map_err(|e| {
                self.err(
                    &format!("commit {version} has a malformed deletion vector"),
                    e,
                )
            })?),
            _ => None,
        };
        Ok(DataFile {
            path: decode(a["path"].as_str().unwrap_or_default()),
            // Unknown (0) for a remove without extended metadata: the
            // reader asks the store.
            size: a["size"].as_u64().unwrap_or(0),
            partition_values,
            deletion_vector,
            change: None,
            vector_change: None,
        })
    }

    pub(super) async fn commit_files(&self, version: u64) -> Result<Vec<DataFile>> {
        let actions = self.commit_actions(version).await?;
        let data_change = |a: &serde_json::Value| a["dataChange"].as_bool().unwrap_or(true);
        let mut adds = Vec::new();
        let mut removes = Vec::new();
        let mut cdc = Vec::new();
        for action in &actions {
            if let Some(a) = action.get("add") {
                if data_change(a) {
                    adds.push(self.action_file(version, a)?);
                }
            } else if let Some(r) = action.get("remove") {
                if data_change(r) {
                    removes.push(self.action_file(version, r)?);
                }
            } else if let Some(c) = action.get("cdc") {
                cdc.push(self.action_file(version, c)?);
            } else if let Some(m) = action.get("metaData") {
                let schema_string = m["schemaString"].as_str().unwrap_or_default();
                if !self.same_schema(schema_string) {
                    return Err(Error::Delta {
                        source_name: self.name.clone(),
                        table: self.location.url().to_string(),
                        reason: format!(
                            "commit {version} changed the table's schema; the query reads the \
                             schema it started with: start a new query (a new checkpoint) to \
                             read the new one"
                        ),
                    });
                }
            } else if action.get("protocol").is_some() {
                // Checked when the table is loaded; a new feature here is
                // caught by the reads of its files.
            }
        }
        if self.options.read_change_feed {
            if adds.is_empty() && removes.is_empty() && cdc.is_empty() {
                return Ok(Vec::new());
            }
            let timestamp_ms = self.commit_timestamp(version, &actions).await?;
            return self.change_files(version, timestamp_ms, adds, removes, cdc);
        }
        if !removes.is_empty() {
            if self.options.skip_change_commits {
                tracing::info!(source = %self.name, version, "skipping a commit that removes data (skip_change_commits)");
                return Ok(Vec::new());
            }
            return Err(Error::Delta {
                source_name: self.name.clone(),
                table: self.location.url().to_string(),
                reason: format!(
                    "commit {version} removes or rewrites data (DELETE, UPDATE, MERGE or an \
                     overwrite), which a stream of appended rows cannot follow; set OPTIONS \
                     ('skip_change_commits' 'true') to pass over such commits (their changes \
                     are then not read), or read its changes with ('read_change_feed' 'true')"
                ),
            });
        }
        Ok(adds)
    }

    /// A commit's files as the change data feed reads them: its change-data
    /// files when it has them, else its added files as inserts and its
    /// removed files as deletes (the protocol's rule).
    pub(super) fn change_files(
        &self,
        version: u64,
        timestamp_ms: i64,
        adds: Vec<DataFile>,
        removes: Vec<DataFile>,
        cdc: Vec<DataFile>,
    ) -> Result<Vec<DataFile>> {
        let change = |kind| Change {
            kind,
            version,
            timestamp_ms,
        };
        if !cdc.is_empty() {
            return Ok(cdc
                .into_iter()
                .map(|mut f| {
                    f.change = Some(change(None));
                    f
                })
                .collect());
        }
        // A file both removed and added again changed only its deletion
        // vector: its deleted rows are those the new vector adds, its
        // inserted rows those the new vector no longer deletes.
        let mut removes = removes;
        let mut adds = adds;
        let mut changed = Vec::new();
        adds.retain(|a| {
            let Some(i) = removes.iter().position(|r| r.path == a.path) else {
                return true;
            };
            let before = removes.remove(i).deletion_vector;
            for (kind, restored) in [("delete", false), ("insert", true)] {
                let mut f = a.clone();
                f.change = Some(change(Some(kind)));
                f.vector_change = Some(VectorChange {
                    before: before.clone(),
                    restored,
                });
                changed.push(f);
            }
            false
        });
        let inserts = adds.into_iter().map(|mut f| {
            f.change = Some(change(Some("insert")));
            f
        });
        let deletes = removes.into_iter().map(|mut f| {
            f.change = Some(change(Some("delete")));
            f
        });
        Ok(changed.into_iter().chain(inserts).chain(deletes).collect())
    }

    /// Whether a `metaData.schemaString` describes the schema this source
    /// reads (same field names and types).
    pub(super) fn same_schema(&self, schema_string: &str) -> bool {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(schema_string) else {
            return false;
        };
        let fields: Vec<(String, String)> = v["fields"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|f| {
                (
                    f["name"].as_str().unwrap_or("").to_string(),
                    f["type"].to_string(),
                )
            })
            .collect();
        fields.len() == self.table_schema.fields().len()
            && fields
                .iter()
                .zip(self.table_schema.fields())
                .all(|((n, _), f)| n == f.name())
    }

    /// The files of `(start, end]`, in order.
    pub(super) async fn range_files(
        &self,
        start: Option<DeltaOffset>,
        end: DeltaOffset,
    ) -> Result<Vec<DataFile>> {
        let start = match start {
            Some(s) => s,
            None => self.first_position(),
        };
        let mut out = Vec::new();
        let mut cur = start;
        loop {
            let files = self.files(cur.version, cur.snapshot).await?;
            let last = (cur.version, cur.snapshot) == (end.version, end.snapshot);
            let to = if last { end.index } else { files.len() as u64 };
            let from = cur.index.min(to);
            out.extend(files[from as usize..to as usize].iter().cloned());
            if last || cur.version >= end.version {
                break;
            }
            cur = DeltaOffset {
                version: cur.version + 1,
                index: 0,
                snapshot: false,
            };
        }
        Ok(out)
    }

    /// Where a query without an offset starts: `starting_version`'s
    /// commit, else the snapshot at the latest version the source loaded.
    pub(super) fn first_position(&self) -> DeltaOffset {
        match self.options.starting_version {
            Some(v) => DeltaOffset {
                version: v,
                index: 0,
                snapshot: false,
            },
            None => DeltaOffset {
                version: self
                    .table
                    .try_lock()
                    .ok()
                    .and_then(|t| t.version())
                    .unwrap_or(0),
                index: 0,
                snapshot: true,
            },
        }
    }

    /// Read one data file as batches of the source's schema, partition
    /// columns filled from the file's partition values.
    pub(super) async fn read_file(
        &self,
        file: DataFile,
        engine: Arc<dyn buoyant_kernel::Engine>,
    ) -> Result<BatchStream> {
        let name = self.name.clone();
        let store = self.location.store().clone();
        let path = self.location.child(&file.path);
        let url = self.location.url_of(&path);
        let malformed = |reason: String| Error::Malformed {
            source_name: name.clone(),
            file: url.clone(),
            line: None,
            reason,
        };
        let filter = self.row_filter(&file, engine, &malformed).await?;
        let mut row = 0u64;
        let size = match file.size {
            // A remove action without its size: ask the store.
            0 => {
                object_store::ObjectStoreExt::head(&store, &path)
                    .await
                    .map_err(|e| malformed(format!("cannot read the file: {e}")))?
                    .size
            }
            n => n,
        };
        let (file_schema, stream) =
            lakestream_source::files::open_parquet(store, path, size, self.options.batch_size)
                .await
                .map_err(malformed)?;
        let columns = FileColumns {
            schema: self.schema.clone(),
            partitions: self
                .schema
                .fields()
                .iter()
                .enumerate()
                .filter(|(_, f)| self.partition_columns.iter().any(|p| p == f.name()))
                .map(|(i, f)| (i, file.partition_values.get(f.name()).cloned().flatten()))
                .collect(),
            file_schema,
            change: file.change.clone(),
        };
        Ok(stream
            .map(move |b| {
                let b = b.map_err(|e| Error::Malformed {
                    source_name: name.clone(),
                    file: url.clone(),
                    line: None,
                    reason: e.to_string(),
                })?;
                let schema_err = |reason: String| Error::Schema {
                    source_name: name.clone(),
                    file: url.clone(),
                    reason,
                };
                let out = columns.conform(&b).map_err(schema_err)?;
                // Rows are numbered across the file as it was written.
                let first = row;
                row += out.num_rows() as u64;
                let Some(mask) = filter.mask(first, out.num_rows()) else {
                    return Ok(out);
                };
                arrow::compute::filter_record_batch(&out, &mask)
                    .map_err(|e| schema_err(e.to_string()))
            })
            .boxed())
    }

    /// The rows of `file` to read: all but those its deletion vector
    /// deletes, or, for a file whose vector a commit replaced, those whose
    /// state changed.
    async fn row_filter(
        &self,
        file: &DataFile,
        engine: Arc<dyn buoyant_kernel::Engine>,
        malformed: &(impl Fn(String) -> Error + Sync),
    ) -> Result<Arc<RowFilter>> {
        let mut root = self.location.url().clone();
        if !root.path().ends_with('/') {
            root.set_path(&format!("{}/", root.path()));
        }
        // The rows each deletion vector deletes, ascending.
        let rows_of = |dv: Option<deltalake::kernel::DeletionVectorDescriptor>| {
            let engine = engine.clone();
            let root = root.clone();
            async move {
                let Some(dv) = dv else {
                    return Ok(Vec::new());
                };
                let mut rows = tokio::task::spawn_blocking(move || {
                    let dv: buoyant_kernel::actions::deletion_vector::DeletionVectorDescriptor =
                        dv.try_into().map_err(|e| format!("{e}"))?;
                    dv.row_indexes(engine.storage_handler(), &root)
                        .map_err(|e| format!("{e}"))
                })
                .await
                .map_err(|e| malformed(format!("reading its deletion vector: {e}")))?
                .map_err(|e| malformed(format!("reading its deletion vector: {e}")))?;
                rows.sort_unstable();
                Ok::<_, Error>(rows)
            }
        };
        let deleted = rows_of(file.deletion_vector.clone()).await?;
        Ok(Arc::new(match &file.vector_change {
            None => RowFilter::Exclude(deleted),
            Some(vc) => {
                let before = rows_of(vc.before.clone()).await?;
                let (from, minus) = if vc.restored {
                    (&before, &deleted)
                } else {
                    (&deleted, &before)
                };
                RowFilter::Include(
                    from.iter()
                        .filter(|r| minus.binary_search(r).is_err())
                        .copied()
                        .collect(),
                )
            }
        }))
    }
}

/// How one data file's batches become batches of the source's schema.
struct FileColumns {
    /// The source's schema.
    schema: SchemaRef,
    /// The file's own schema.
    file_schema: SchemaRef,
    /// Partition columns (by index in `schema`) and the file's values.
    partitions: Vec<(usize, Option<String>)>,
    /// The change-feed columns' values, in a change-feed source.
    change: Option<Change>,
}

impl FileColumns {
    /// `b` (read from the file) with the source's columns: change-feed
    /// columns and partition values filled in, the file's columns taken by
    /// name (cast when their type differs), missing ones NULL. The error
    /// is the reason.
    fn conform(&self, b: &RecordBatch) -> std::result::Result<RecordBatch, String> {
        let n = b.num_rows();
        let mut cols: Vec<ArrayRef> = Vec::with_capacity(self.schema.fields().len());
        for (i, field) in self.schema.fields().iter().enumerate() {
            if let Some(c) = &self.change {
                match field.name().as_str() {
                    "_change_type" if c.kind.is_some() => {
                        cols.push(Arc::new(StringArray::from(vec![
                            c.kind.unwrap_or_default();
                            n
                        ])));
                        continue;
                    }
                    "_commit_version" => {
                        cols.push(Arc::new(arrow::array::Int64Array::from(vec![
                            c.version
                                as i64;
                            n
                        ])));
                        continue;
                    }
                    "_commit_timestamp" => {
                        cols.push(Arc::new(
                            arrow::array::TimestampMicrosecondArray::from(vec![
                                c.timestamp_ms
                                    * 1000;
                                n
                            ])
                            .with_timezone("UTC"),
                        ));
                        continue;
                    }
                    _ => {}
                }
            }
            if let Some((_, v)) = self.partitions.iter().find(|(p, _)| *p == i) {
                cols.push(match v {
                    None => new_null_array(field.data_type(), n),
                    Some(v) => {
                        let s: ArrayRef = Arc::new(StringArray::from(vec![v.as_str(); n]));
                        arrow::compute::cast(&s, field.data_type()).map_err(|e| {
                            format!(
                                "partition value {v:?} of column {} is not a {}: {e}",
                                field.name(),
                                field.data_type()
                            )
                        })?
                    }
                });
                continue;
            }
            match self.file_schema.index_of(field.name()) {
                Ok(j) if b.column(j).data_type() == field.data_type() => {
                    cols.push(b.column(j).clone())
                }
                Ok(j) => cols.push(
                    arrow::compute::cast(b.column(j), field.data_type()).map_err(|e| {
                        format!(
                            "column {} is {} in the file, not {}: {e}",
                            field.name(),
                            b.column(j).data_type(),
                            field.data_type()
                        )
                    })?,
                ),
                Err(_) => cols.push(new_null_array(field.data_type(), n)),
            }
        }
        RecordBatch::try_new(self.schema.clone(), cols).map_err(|e| e.to_string())
    }
}
