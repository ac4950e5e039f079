//! [`StatefulAggregate`]: finding the aggregation in a batch's plan, running it against the state store, the watermark and what it closes.

use super::*;

impl StatefulAggregate {
    /// The stateful aggregation of a query whose batch plans look like
    /// `plan`, keeping its state under the checkpoint at `checkpoint`.
    /// `distinct_on`: the aggregation is a `DISTINCT ON`'s (`first_value`
    /// of each column per key), a deduplication that keeps each key's
    /// first row. `None` when the plan has no aggregation.
    pub(crate) fn new(
        plan: &Arc<dyn ExecutionPlan>,
        checkpoint: &Location,
        mode: OutputMode,
        event_times: BTreeMap<String, EventTime>,
        distinct_on: bool,
    ) -> Result<Option<Self>> {
        let Some(found) = find(plan).map_err(|e| Error::Plan(Box::new(e)))? else {
            return Ok(None);
        };
        let schema = found
            .partial(found.raw.clone())
            .map_err(|e| Error::Plan(Box::new(e)))?
            .schema();
        let keys = found.group_by.expr().len();
        let session = found.window.as_ref().and_then(|w| w.3.then_some(w.0));
        let dedup = (found.aggr.is_empty() || distinct_on) && session.is_none();
        let operator = match (dedup, session) {
            (true, _) => "dedup",
            (false, Some(_)) => "session",
            (false, None) => "aggregate",
        };
        let mut store = StateStore::new(checkpoint.clone(), operator, schema, keys)?;
        if let Some(window) = session {
            // A group's sessions are found by its keys without the window.
            store = store.with_index((0..keys).filter(|&k| k != window).collect())?;
        }
        let evict = match &found.window {
            Some((index, _, unit, session)) => Some(Evict {
                index: *index,
                input: EvictInput::Key(*index),
                unit: *unit,
                kind: if *session {
                    EvictKind::Session
                } else {
                    EvictKind::Window
                },
            }),
            // `date_bin(stride, ts)`: a tumbling window named by its start.
            None if !dedup => date_bin_key(&found.group_by).map(|(index, unit, width)| Evict {
                index,
                input: EvictInput::Key(index),
                unit,
                kind: EvictKind::Time(width),
            }),
            // A deduplication keyed by a stream's event time forgets a key
            // once the watermark passes its time.
            None if dedup => found
                .group_by
                .expr()
                .iter()
                .enumerate()
                .find_map(|(index, (e, _))| {
                    let c = e.downcast_ref::<Column>()?;
                    if !event_times.values().any(|et| et.column == c.name()) {
                        return None;
                    }
                    match e.data_type(&found.input_schema).ok()? {
                        DataType::Timestamp(unit, _) => Some(Evict {
                            index,
                            input: EvictInput::Key(index),
                            unit,
                            kind: EvictKind::Time(0),
                        }),
                        _ => None,
                    }
                })
                .or_else(|| {
                    if distinct_on {
                        distinct_on_expiry(&found, &event_times)
                    } else {
                        None
                    }
                }),
            None => None,
        };
        if evict.is_some_and(|e| matches!(e.kind, EvictKind::Expire(_))) {
            // A key's bucket comes from its first row: found by the key.
            store = store.with_index((0..keys).collect())?;
        }
        Ok(Some(Self {
            store: tokio::sync::Mutex::new(store),
            evict,
            dedup,
            mode,
            event_times,
            keys: Vec::new(),
            replace_keys: None,
        }))
    }

    /// Merge update-mode output into the table by these output columns.
    pub(crate) fn set_keys(&mut self, keys: Vec<String>) {
        self.keys = keys;
    }

    /// Complete-mode output names its rows by these output columns.
    pub(crate) fn set_replace_keys(&mut self, keys: Option<Vec<String>>) {
        self.replace_keys = keys;
    }

    /// How the aggregation's output changes the table.
    pub(crate) fn write_mode(&self) -> lakestream_sink::WriteMode {
        match self.mode {
            OutputMode::Complete => lakestream_sink::WriteMode::ReplaceAll {
                keys: self.replace_keys.clone(),
            },
            OutputMode::Update => lakestream_sink::WriteMode::Upsert {
                keys: self.keys.clone(),
            },
            OutputMode::Append => lakestream_sink::WriteMode::Append,
        }
    }

    /// True when the aggregation groups by an event-time window.
    pub(crate) fn is_windowed(&self) -> bool {
        self.evict.is_some_and(|e| e.is_window())
    }

    /// True when the aggregation groups by a session window.
    pub(crate) fn is_session(&self) -> bool {
        self.evict.is_some_and(|e| e.kind == EvictKind::Session)
    }

    /// True for a deduplication (no aggregate functions): each group is
    /// written once, when first seen.
    pub(crate) fn is_dedup(&self) -> bool {
        self.dedup
    }

    /// The event-time column per source name.
    pub(crate) fn event_times(&self) -> &BTreeMap<String, EventTime> {
        &self.event_times
    }

    /// The watermark for the batch after `last` (`None`: before the first
    /// batch), given the watermark `prev` that batch `last` ran with.
    pub(crate) async fn next_watermark(
        &self,
        last: Option<u64>,
        prev: Option<i64>,
    ) -> Result<Option<i64>> {
        let mut store = self.store.lock().await;
        if !store.is_at(last) {
            store.load(last).await?;
        }
        let seen = event_time_max(store.meta());
        let candidate = self
            .event_times
            .iter()
            .filter_map(|(source, et)| {
                let max = seen.get(source)?;
                Some(max.saturating_sub(et.delay.as_millis() as i64))
            })
            .min();
        Ok(match (prev, candidate) {
            (Some(p), Some(c)) => Some(p.max(c)),
            (p, c) => p.or(c),
        })
    }

    /// True when a batch without new input would emit rows: in `append`
    /// mode, some window held ends at or before `watermark`.
    pub(crate) async fn has_output_at(&self, watermark: Option<i64>) -> bool {
        let (Some(evict), Some(w), OutputMode::Append, false) =
            (self.evict, watermark, self.mode, self.dedup)
        else {
            return false;
        };
        let unit = evict.unit;
        let store = self.store.lock().await;
        store
            .first_bucket()
            .is_some_and(|b| b <= window::ms_in(unit, w))
    }

    /// Run the aggregation of batch `batch_id` (watermark `watermark_ms`):
    /// returns `plan` with the aggregation replaced by the batch's output
    /// groups, after committing the state as of this batch.
    pub(crate) async fn run(
        &self,
        batch_id: u64,
        watermark_ms: Option<i64>,
        plan: Arc<dyn ExecutionPlan>,
        ctx: Arc<TaskContext>,
        scans: &BatchScans,
    ) -> Result<(Arc<dyn ExecutionPlan>, StateProgress)> {
        let df = |e: DataFusionError| Error::Execution {
            batch_id,
            source: Box::new(e),
        };
        let found = find(&plan).map_err(df)?.ok_or_else(|| {
            Error::Internal(format!(
                "batch {batch_id}: the aggregation is gone from the plan"
            ))
        })?;
        let mut store = self.store.lock().await;
        let prev = lakestream_protocol::state_base(batch_id);
        if !store.is_at(prev) {
            store.load(prev).await?;
        }
        let schema = store.schema().clone();
        // Complete mode keeps every group (and so takes late rows too).
        let threshold = match (self.evict, watermark_ms, self.mode) {
            (_, _, OutputMode::Complete) => None,
            (Some(e), Some(w), _) => Some(window::ms_in(e.unit, w)),
            _ => None,
        };
        let dropped = Arc::new(AtomicU64::new(0));
        let no_time = Arc::new(AtomicU64::new(0));
        let raw = match self.evict {
            Some(evict) => late_filter(
                found.raw.clone(),
                evict,
                match evict.input {
                    EvictInput::Key(i) => found.group_by.expr()[i].0.clone(),
                    EvictInput::Aggregate(j) => found.aggr[j].expressions()[0].clone(),
                },
                threshold,
                dropped.clone(),
                no_time.clone(),
                ctx.clone(),
            )
            .map_err(df)?,
            None => found.raw.clone(),
        };
        let partial = found.partial(raw).map_err(df)?;
        let parts = collect(Arc::new(partial), ctx.clone()).await.map_err(df)?;
        let mut progress = StateProgress {
            operator: store.operator().to_string(),
            ..Default::default()
        };
        let parts = rebatch(&schema, parts).map_err(df)?;
        let changed = if parts.is_empty() {
            Vec::new()
        } else {
            self.merge_parts(&mut store, &found, parts, batch_id, &ctx, &mut progress)
                .await?
        };
        let finished = if self.dedup || self.mode == OutputMode::Update {
            // The groups this batch changed (a deduplication's: the keys it
            // saw first) are the output; a group the watermark passed was
            // written when it last changed, and goes without output.
            if let Some(t) = threshold
                && let Some(gone) = store.evict_through(t)?
            {
                progress.rows_evicted = gone.num_rows() as u64;
            }
            match changed.as_slice() {
                [] => None,
                batches => Some(concat_batches(&schema, batches).map_err(|e| df(e.into()))?),
            }
        } else {
            match (self.mode, threshold) {
                (OutputMode::Complete, _) => store.all()?,
                (_, Some(t)) => store.evict_through(t)?,
                (_, None) => None,
            }
        };
        let top_schema = found.top.schema();
        let mut out = Vec::new();
        if let Some(states) = finished {
            if self.mode == OutputMode::Append && !self.dedup {
                progress.rows_evicted = states.num_rows() as u64;
            }
            let fin = found
                .over_states(AggregateMode::Final, vec![states], &schema)
                .map_err(df)?;
            out =
                rebatch(&top_schema, collect(Arc::new(fin), ctx).await.map_err(df)?).map_err(df)?;
        }
        let mut seen = event_time_max(store.meta());
        for source in self.event_times.keys() {
            if let Some(max) = scans.event_time_max_ms(source) {
                let e = seen.entry(source.clone()).or_insert(max);
                *e = (*e).max(max);
            }
        }
        store
            .commit(batch_id, serde_json::json!({ "event_time_max_ms": seen }))
            .await?;
        progress.rows = store.rows();
        progress.bytes = store.bytes();
        progress.memory_bytes = store.memory();
        progress.rows_dropped_by_watermark = dropped.load(Ordering::Relaxed);
        progress.rows_without_event_time = no_time.load(Ordering::Relaxed);
        drop(store);

        let plan = replace_node(plan, &found.top, out, top_schema).map_err(df)?;
        Ok((plan, progress))
    }

    /// Merge the batch's partial states `parts` (their schema the store's)
    /// with the stored states of the same groups into the store, a slice of
    /// keys at a time; returns the output this batch changed (a
    /// deduplication's new keys, an update-mode aggregation's changed
    /// groups).
    async fn merge_parts(
        &self,
        store: &mut StateStore,
        found: &Found,
        parts: Vec<RecordBatch>,
        batch_id: u64,
        ctx: &Arc<TaskContext>,
        progress: &mut StateProgress,
    ) -> Result<Vec<RecordBatch>> {
        let df = |e: DataFusionError| Error::Execution {
            batch_id,
            source: Box::new(e),
        };
        let schema = store.schema().clone();
        let mut changed: Vec<RecordBatch> = Vec::new();
        let new = concat_batches(&schema, &parts).map_err(|e| df(e.into()))?;
        drop(parts); // only `new` is needed from here: half the memory
        let session = self.evict.filter(|e| e.kind == EvictKind::Session);
        // A batch touching many groups merges them a slice of keys at a
        // time (each key in one slice), so what the merge holds at once
        // (DataFusion's hash table, the stored states looked up, the
        // merged rows) is bounded by the slice, not by the batch.
        let keys = found.group_by.expr().len();
        let slices = match session {
            Some(_) => vec![None],
            None => key_slices(&new, keys, MERGE_SLICE).map_err(df)?,
        };
        for slice in slices {
            let new = match slice {
                None => new.clone(),
                Some(rows) => {
                    arrow::compute::take_record_batch(&new, &rows).map_err(|e| df(e.into()))?
                }
            };
            // What to merge: the batch's states and the stored ones of the
            // same groups. A session window's stored sessions of those
            // groups are merged with the batch's where they overlap, and
            // the merged sessions replace them.
            let (input, replaced) = match session {
                Some(evict) => {
                    let old = store.lookup_indexed(&new)?;
                    let mut all = vec![new];
                    all.extend(old.as_ref().map(|(o, _)| o.clone()));
                    let all = concat_batches(&schema, &all).map_err(|e| df(e.into()))?;
                    let all = merge_sessions(&all, evict.index, keys).map_err(df)?;
                    (vec![all], old)
                }
                None => {
                    let buckets = self.buckets(store, &new, batch_id)?;
                    let old = store.lookup(&new, &buckets)?;
                    (std::iter::once(new).chain(old).collect(), None)
                }
            };
            let merge = found
                .over_states(AggregateMode::PartialReduce, input, &schema)
                .map_err(df)?;
            let merged = rebatch(
                &schema,
                collect(Arc::new(merge), ctx.clone()).await.map_err(df)?,
            )
            .map_err(df)?;
            if let Some((o, buckets)) = replaced {
                store.remove_keys(&o, &buckets)?;
            }
            // Each merged batch is dropped once upserted: a batch opening
            // many groups holds them once in Arrow form, not again until
            // the commit (append and complete modes keep nothing).
            for b in merged {
                let buckets = self.buckets(store, &b, batch_id)?;
                if self.dedup {
                    // Only keys not seen before are new output.
                    let seen = store.contains(&b, &buckets)?;
                    let fresh: BooleanArray = seen.iter().map(|s| Some(!s)).collect();
                    let fresh = filter_record_batch(&b, &fresh).map_err(|e| df(e.into()))?;
                    if fresh.num_rows() > 0 {
                        changed.push(fresh);
                    }
                } else if self.mode == OutputMode::Update {
                    changed.push(b.clone());
                }
                progress.rows_updated += b.num_rows() as u64;
                store.upsert(&b, &buckets)?;
            }
        }
        Ok(changed)
    }

    /// Wait for the state snapshot being written in the background, if
    /// any (a failed one is logged: a restart reads more deltas).
    pub(crate) async fn wait_for_snapshot(&self) {
        let mut store = self.store.lock().await;
        if let Err(e) = store.wait_for_snapshot().await {
            tracing::warn!("{e} (a restart reads more state deltas)");
        }
    }

    /// Remove the state files no restart can need once batches before
    /// `keep_from` are never replayed.
    pub(crate) async fn purge_before(&self, keep_from: u64) -> Result<usize> {
        Ok(self.store.lock().await.purge_before(keep_from).await?)
    }

    /// The bucket of each row of `states`: its eviction time (a window's
    /// end, a deduplicated event time), or `i64::MAX` (never evicted). A
    /// `DISTINCT ON` key expiring by its first row's time stays in the
    /// bucket it is held in (a later row's time does not move it).
    pub(super) fn buckets(
        &self,
        store: &StateStore,
        states: &RecordBatch,
        batch_id: u64,
    ) -> Result<Vec<i64>> {
        let Some(evict) = self.evict else {
            return Ok(vec![i64::MAX; states.num_rows()]);
        };
        let times = evict
            .times(states.column(evict.index))
            .map_err(|e| Error::Execution {
                batch_id,
                source: Box::new(e),
            })?;
        let mut buckets: Vec<i64> = times.iter().map(|e| e.unwrap_or(i64::MAX)).collect();
        if matches!(evict.kind, EvictKind::Expire(_)) {
            for (b, held) in buckets.iter_mut().zip(store.held_buckets(states)?) {
                if let Some(held) = held {
                    *b = held;
                }
            }
        }
        Ok(buckets)
    }
}

/// `plan` with the node `top` replaced by the batches `out` (of schema
/// `schema`).
fn replace_node(
    plan: Arc<dyn ExecutionPlan>,
    top: &Arc<dyn ExecutionPlan>,
    out: Vec<RecordBatch>,
    schema: SchemaRef,
) -> DfResult<Arc<dyn ExecutionPlan>> {
    let leaf: Arc<dyn ExecutionPlan> = MemorySourceConfig::try_new_exec(&[out], schema, None)?;
    Ok(plan
        .transform_down(|node| {
            Ok(if Arc::ptr_eq(&node, top) {
                Transformed::new(leaf.clone(), true, TreeNodeRecursion::Jump)
            } else {
                Transformed::no(node)
            })
        })?
        .data)
}
