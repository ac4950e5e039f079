//! Reading a planned range: one consumer per partition set, assigned at
//! explicit offsets, reading exactly `[start, end)` of each partition
//! (transaction markers and aborted records skipped), with bounded retries
//! of transient broker errors.

use super::*;

impl KafkaSource {
    pub(super) fn range_stream(&self, ranges: Vec<PartitionRange>) -> BatchStream {
        let cfg = self.client_config();
        let name = self.name.clone();
        let schema = self.schema.clone();
        let value_schema = self.value_schema.clone();
        let format = self.options.format.clone();
        let batch_size = self.options.batch_size.max(1);
        let timeout = self.options.read_timeout;
        let request_timeout = self.options.request_timeout;
        let fail_on_data_loss = self.options.fail_on_data_loss;
        let skipped = self.skipped.clone();
        let rejects = match self.options.on_error {
            crate::OnError::Fail => None,
            crate::OnError::DeadLetter => Some(self.rejected.clone()),
        };
        let fut = async move {
            let consumer: StreamConsumer = cfg.create().map_err(|e| create_err(&name, e))?;
            let consumer = Arc::new(consumer);
            let mut tpl = TopicPartitionList::new();
            let mut remaining: HashMap<(String, i32), (i64, i64)> = HashMap::new();
            for PartitionRange {
                topic: t,
                partition: p,
                start: s,
                end: e,
            } in &ranges
            {
                tpl.add_partition_offset(t, *p, KOffset::Offset(*s))
                    .map_err(|e| Error::Kafka {
                        source_name: name.clone(),
                        what: format!("assign {t}/{p}"),
                        reason: e.to_string(),
                        transient: false,
                    })?;
                remaining.insert((t.clone(), *p), (*s, *e));
            }
            consumer.assign(&tpl).map_err(|e| Error::Kafka {
                source_name: name.clone(),
                what: "assign partitions".into(),
                reason: e.to_string(),
                transient: false,
            })?;
            let builder = RowBuilder::new(
                name.clone(),
                schema,
                value_schema,
                format,
                batch_size,
                rejects,
            )?;
            let reader = RangeReader {
                name,
                consumer,
                remaining,
                builder,
                timeout,
                request_timeout,
                fail_on_data_loss,
                skipped,
                last_progress: Instant::now(),
                last_bounds_check: Instant::now(),
                backoff: MIN_READ_BACKOFF,
            };
            Ok::<_, Error>(stream::try_unfold(reader, RangeReader::next_batch).boxed())
        };
        stream::once(fut).try_flatten().boxed()
    }
}

use futures::TryStreamExt;

/// What a reader found missing of the rest `pos..end` of a planned range,
/// given the partition's current offsets `lo..hi`.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum RangeGap {
    /// Offsets `pos..to` were deleted (retention); reading goes on at `lo`
    /// when `to < end`.
    StartDeleted {
        /// The end of the deleted part: `min(lo, end)`.
        to: i64,
    },
    /// The reader is at the partition's end, before the planned end:
    /// `pos..end` no longer exists (the log was truncated, or the topic
    /// recreated).
    TailGone,
}

/// See [`RangeGap`]; `None` while the rest of the range can still be read.
pub(super) fn range_gap(pos: i64, end: i64, lo: i64, hi: i64) -> Option<RangeGap> {
    if pos >= end {
        None
    } else if pos < lo {
        Some(RangeGap::StartDeleted { to: lo.min(end) })
    } else if hi <= pos {
        Some(RangeGap::TailGone)
    } else {
        None
    }
}

/// First wait after a transient consume error; doubled up to
/// [`MAX_READ_BACKOFF`] while errors go on.
pub(super) const MIN_READ_BACKOFF: Duration = Duration::from_millis(50);
pub(super) const MAX_READ_BACKOFF: Duration = Duration::from_secs(2);
/// How often an idle reader asks whether its ranges still exist.
pub(super) const BOUNDS_CHECK_EVERY: Duration = Duration::from_secs(1);

pub(super) struct RangeReader {
    name: String,
    consumer: Arc<StreamConsumer>,
    /// (topic, partition) -> (next expected offset, end)
    remaining: HashMap<(String, i32), (i64, i64)>,
    builder: RowBuilder,
    timeout: Duration,
    request_timeout: Duration,
    fail_on_data_loss: bool,
    skipped: Arc<Mutex<Vec<Skipped>>>,
    last_progress: Instant,
    last_bounds_check: Instant,
    backoff: Duration,
}

impl RangeReader {
    pub(super) async fn next_batch(mut self) -> Result<Option<(RecordBatch, Self)>> {
        loop {
            self.remaining.retain(|_, (pos, end)| pos < end);
            if self.remaining.is_empty() || self.builder.is_full() {
                let done = self.remaining.is_empty();
                return match self.builder.finish()? {
                    Some(b) => Ok(Some((b, self))),
                    None if done => Ok(None),
                    None => continue,
                };
            }
            if self.last_progress.elapsed() > self.timeout {
                let left: Vec<String> = self
                    .remaining
                    .iter()
                    .map(|((t, p), (s, e))| format!("{t}/{p} offsets {s}..{e}"))
                    .collect();
                return Err(Error::Kafka {
                    source_name: self.name.clone(),
                    what: format!("read {}", left.join(", ")),
                    reason: format!(
                        "no progress for {:?}: is the broker reachable? A restart re-reads the \
                         batch from the checkpoint",
                        self.timeout
                    ),
                    transient: true,
                });
            }
            let msg = tokio::time::timeout(Duration::from_millis(500), self.consumer.recv()).await;
            match msg {
                Err(_) => {
                    self.sync_positions();
                    if self.last_bounds_check.elapsed() >= BOUNDS_CHECK_EVERY {
                        self.check_log_bounds().await?;
                    }
                }
                Ok(Err(e))
                    if matches!(
                        e.rdkafka_error_code(),
                        Some(
                            RDKafkaErrorCode::AutoOffsetReset | RDKafkaErrorCode::OffsetOutOfRange
                        )
                    ) =>
                {
                    // A planned offset is not in the partition (any more):
                    // find which, and fail or skip per fail_on_data_loss.
                    self.sync_positions();
                    if !self.check_log_bounds().await? {
                        tokio::time::sleep(self.backoff).await;
                        self.backoff = (self.backoff * 2).min(MAX_READ_BACKOFF);
                    }
                }
                Ok(Err(e))
                    if is_transient(&e)
                        || e.rdkafka_error_code() == Some(RDKafkaErrorCode::PartitionEOF) =>
                {
                    tracing::debug!(source = %self.name, error = %e, "transient consumer error; retrying after {:?}", self.backoff);
                    tokio::time::sleep(self.backoff).await;
                    self.backoff = (self.backoff * 2).min(MAX_READ_BACKOFF);
                }
                Ok(Err(e)) => {
                    return Err(Error::Kafka {
                        source_name: self.name.clone(),
                        what: "consume".into(),
                        reason: e.to_string(),
                        transient: false,
                    });
                }
                Ok(Ok(m)) => {
                    let key = (m.topic().to_string(), m.partition());
                    let Some((pos, end)) = self.remaining.get_mut(&key) else {
                        continue;
                    };
                    let off = m.offset();
                    if off < *pos || off >= *end {
                        // Past the planned end (or a duplicate after a
                        // retry): not this batch's record.
                        if off >= *end {
                            *pos = *end;
                        }
                        continue;
                    }
                    *pos = off + 1;
                    self.last_progress = Instant::now();
                    self.backoff = MIN_READ_BACKOFF;
                    self.builder.push(&m)?;
                }
            }
        }
    }

    /// Compare what is left to read with the partitions' current bounds:
    /// a range whose start was deleted (retention) or whose end lies past
    /// the partition's end while the reader has reached it (the log was
    /// truncated, or the topic recreated) can never be read whole. Such a
    /// range fails the batch with [`Error::DataLoss`], or with
    /// `fail_on_data_loss = false` is skipped (reading resumes at the
    /// earliest offset, or the partition is done) and reported through
    /// [`Source::take_skipped`]. Returns whether anything changed. Asked
    /// only while the reader is idle or the consumer reported an offset
    /// out of range, so the happy path costs nothing.
    pub(super) async fn check_log_bounds(&mut self) -> Result<bool> {
        self.last_bounds_check = Instant::now();
        let parts: Vec<(String, i32)> = self.remaining.keys().cloned().collect();
        let consumer = self.consumer.clone();
        let timeout = self.request_timeout;
        let marks = tokio::task::spawn_blocking(move || {
            // Up to WATERMARK_REQUESTS at once, as planning does.
            let mut out = Vec::with_capacity(parts.len());
            for chunk in parts.chunks(WATERMARK_REQUESTS) {
                std::thread::scope(|sc| {
                    let handles: Vec<_> = chunk
                        .iter()
                        .map(|(t, p)| {
                            let consumer = &consumer;
                            sc.spawn(move || consumer.fetch_watermarks(t, *p, timeout))
                        })
                        .collect();
                    for ((t, p), h) in chunk.iter().zip(handles) {
                        let r = h.join().expect("watermark request thread");
                        out.push(((t.clone(), *p), r));
                    }
                });
            }
            out
        })
        .await
        .unwrap_or_default();
        let mut changed = false;
        for ((topic, partition), r) in marks {
            // A failed request says nothing: the next check asks again.
            let Ok((lo, hi)) = r else { continue };
            let Some(&(pos, end)) = self.remaining.get(&(topic.clone(), partition)) else {
                continue;
            };
            match range_gap(pos, end, lo, hi) {
                None => {}
                Some(RangeGap::StartDeleted { to }) => {
                    self.lost(
                        &topic,
                        partition,
                        pos,
                        to,
                        format!(
                            "deleted before this batch read them (the earliest offset is now {lo})"
                        ),
                    )?;
                    if to < end {
                        let consumer = self.consumer.clone();
                        let t = topic.clone();
                        tokio::task::spawn_blocking(move || {
                            consumer.seek(&t, partition, KOffset::Offset(lo), timeout)
                        })
                        .await
                        .map_err(|e| Error::Kafka {
                            source_name: self.name.clone(),
                            what: format!("seek {topic}/{partition} to {lo}"),
                            reason: e.to_string(),
                            transient: false,
                        })?
                        .map_err(|e| Error::Kafka {
                            source_name: self.name.clone(),
                            what: format!("seek {topic}/{partition} to {lo}"),
                            reason: e.to_string(),
                            transient: is_transient(&e),
                        })?;
                    }
                    self.remaining.insert((topic, partition), (to, end));
                    changed = true;
                }
                Some(RangeGap::TailGone) => {
                    self.lost(
                        &topic,
                        partition,
                        pos,
                        end,
                        format!(
                            "no longer in the partition, which now ends at {hi} (the log was \
                         truncated, or the topic recreated)"
                        ),
                    )?;
                    self.remaining.insert((topic, partition), (end, end));
                    changed = true;
                }
            }
        }
        if changed {
            self.last_progress = Instant::now();
        }
        Ok(changed)
    }

    /// Offsets `from..to` of a planned range are gone: an error, or with
    /// `fail_on_data_loss = false` a recorded skip.
    pub(super) fn lost(
        &self,
        topic: &str,
        partition: i32,
        from: i64,
        to: i64,
        why: String,
    ) -> Result<()> {
        let detail = format!("this batch planned offsets {from}..{to}, which are {why}");
        if self.fail_on_data_loss {
            return Err(Error::DataLoss {
                source_name: self.name.clone(),
                topic: topic.to_string(),
                partition,
                detail,
            });
        }
        tracing::warn!(source = %self.name, topic, partition, %detail, "data loss while reading: skipping (fail_on_data_loss = false)");
        self.skipped.lock().expect("kafka skipped").push(Skipped {
            what: format!("{topic}/{partition} offsets {from}..{to}"),
            reason: format!("{why} (fail_on_data_loss = false)"),
        });
        Ok(())
    }

    /// Step over offset gaps (transaction markers, aborted records): the
    /// consumer's position moves past them even though no message arrives.
    pub(super) fn sync_positions(&mut self) {
        if let Ok(pos) = self.consumer.position() {
            for el in pos.elements() {
                if let KOffset::Offset(o) = el.offset()
                    && let Some((p, _)) = self
                        .remaining
                        .get_mut(&(el.topic().to_string(), el.partition()))
                    && o > *p
                {
                    *p = o;
                    self.last_progress = Instant::now();
                }
            }
        }
    }
}
