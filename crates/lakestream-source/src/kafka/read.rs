//! Reading a planned range: consumers assigned at explicit offsets, reading
//! exactly `[start, end)` of each partition (transaction markers and aborted
//! records skipped), with bounded retries of transient broker errors.
//!
//! Consumers are kept across batches in a [`ReaderPool`]: a consumer that
//! read a batch to its end is still connected and already fetching what
//! follows, so the next batch, which starts where this one ended, reads on
//! without a new connection or a new fetch. What the consumer delivers past
//! a batch's end is kept (bounded, [`MAX_STASH_BYTES`]) for the next batch.
//! A consumer is reused only when its position in every partition of the
//! range is exactly the range's start; otherwise it is assigned afresh at
//! the explicit start offsets, so a replay reads exactly what it planned.
//! A read that fails or is dropped midway drops its consumer.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};

use rdkafka::message::OwnedMessage;

use super::*;

/// Bytes of messages a pooled consumer keeps past the ranges it read
/// (over all its partitions): past it, a partition's kept messages are
/// dropped and the next read of it assigns it afresh.
pub(super) const MAX_STASH_BYTES: usize = 16 << 20;

/// How long a live reader may get nothing while its ranges are unread
/// before it falls back to a bulk consumer.
pub(super) const LIVE_STALL: Duration = Duration::from_secs(2);

/// Where a pooled consumer stands in one partition it is assigned.
#[derive(Default)]
pub(super) struct PartitionCursor {
    /// The offset the next range of this partition must start at for the
    /// consumer to read on (the end of what it last read, or where it was
    /// assigned).
    next: i64,
    /// Messages at or past `next` the consumer already delivered, in order.
    stash: VecDeque<OwnedMessage>,
}

/// A consumer kept between reads, with its cursors.
pub(super) struct PooledReader {
    consumer: Arc<Detached<StreamConsumer>>,
    parts: HashMap<(String, i32), PartitionCursor>,
    stash_bytes: usize,
}

impl PooledReader {
    fn new(consumer: StreamConsumer) -> Self {
        Self {
            consumer: Arc::new(Detached::new(consumer)),
            parts: HashMap::new(),
            stash_bytes: 0,
        }
    }

    /// Whether the consumer reads on at exactly `starts`.
    fn continues(&self, starts: &[((String, i32), i64)]) -> bool {
        starts
            .iter()
            .all(|(k, s)| self.parts.get(k).is_some_and(|c| c.next == *s))
    }

    /// Assign exactly `starts` (dropping every cursor and kept message).
    fn assign(&mut self, starts: &[((String, i32), i64)]) -> std::result::Result<(), KafkaError> {
        let mut tpl = TopicPartitionList::new();
        for ((t, p), s) in starts {
            tpl.add_partition_offset(t, *p, KOffset::Offset(*s))?;
        }
        self.consumer.assign(&tpl)?;
        self.stash_bytes = 0;
        self.parts = starts
            .iter()
            .map(|(k, s)| {
                (
                    k.clone(),
                    PartitionCursor {
                        next: *s,
                        stash: VecDeque::new(),
                    },
                )
            })
            .collect();
        Ok(())
    }

    /// Keep `m` for a later read if it is at or past its partition's
    /// cursor; forget the partition when the kept messages grow too big.
    fn keep(&mut self, m: &rdkafka::message::BorrowedMessage<'_>) {
        let key = (m.topic().to_string(), m.partition());
        let Some(c) = self.parts.get_mut(&key) else {
            return;
        };
        if m.offset() < c.next || c.stash.back().is_some_and(|b| b.offset() >= m.offset()) {
            return;
        }
        let size = m.payload().map_or(0, <[u8]>::len) + m.key().map_or(0, <[u8]>::len) + 64;
        if self.stash_bytes + size > MAX_STASH_BYTES {
            let c = self.parts.remove(&key).expect("present");
            self.stash_bytes -= c.stash.iter().map(stash_size).sum::<usize>();
            return;
        }
        self.stash_bytes += size;
        c.stash.push_back(m.detach());
    }

    /// Take the next kept message of `key` at or past `pos` and before
    /// `end`; `Err(())` when a kept message at or past `end` says the
    /// range is read whole.
    fn take_kept(
        &mut self,
        key: &(String, i32),
        pos: i64,
        end: i64,
    ) -> std::result::Result<Option<OwnedMessage>, ()> {
        let Some(c) = self.parts.get_mut(key) else {
            return Ok(None);
        };
        while let Some(front) = c.stash.front() {
            if front.offset() >= end {
                return Err(());
            }
            let m = c.stash.pop_front().expect("front");
            self.stash_bytes -= stash_size(&m);
            if m.offset() >= pos {
                return Ok(Some(m));
            }
        }
        Ok(None)
    }

    fn has_kept(&self, key: &(String, i32)) -> bool {
        self.parts.get(key).is_some_and(|c| !c.stash.is_empty())
    }
}

fn stash_size(m: &OwnedMessage) -> usize {
    m.payload().map_or(0, <[u8]>::len) + m.key().map_or(0, <[u8]>::len) + 64
}

/// The kept consumers themselves, shared with the reads that return them.
type SharedPool = Arc<Mutex<Vec<PooledReader>>>;

/// The consumers kept between reads.
#[derive(Default)]
pub(super) struct ReaderPool(SharedPool);

impl std::fmt::Debug for ReaderPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReaderPool")
    }
}

impl ReaderPool {
    /// A kept consumer that reads on at `starts`, else any kept consumer,
    /// else `None`; the bool says whether it reads on.
    fn take(&self, starts: &[((String, i32), i64)]) -> Option<(PooledReader, bool)> {
        let mut pool = self.0.lock().expect("kafka reader pool");
        if let Some(i) = pool.iter().position(|r| r.continues(starts)) {
            return Some((pool.swap_remove(i), true));
        }
        pool.pop().map(|r| (r, false))
    }

    /// Keep `reader` for later reads, up to `max` consumers.
    fn put(&self, reader: PooledReader, max: usize) {
        let mut pool = self.0.lock().expect("kafka reader pool");
        if pool.len() < max.max(1) {
            pool.push(reader);
        }
    }

    /// Wait up to `max` for a message at or past `starts` (every partition's
    /// next offset), on a kept consumer that reads on there (assigned
    /// there if none does); the message is kept for the next read.
    pub(super) async fn wait_for_message(
        &self,
        cfg: &ClientConfig,
        starts: &[((String, i32), i64)],
        max: Duration,
        max_pooled: usize,
    ) -> std::result::Result<(), KafkaError> {
        let mut r = match self.take(starts) {
            Some((r, true)) => r,
            found => {
                let mut r = match found {
                    Some((r, _)) => r,
                    None => PooledReader::new(cfg.create()?),
                };
                r.assign(starts)?;
                r
            }
        };
        let deadline = Instant::now() + max;
        let consumer = r.consumer.clone();
        let mut result = Ok(());
        while !starts.iter().any(|(k, _)| r.has_kept(k)) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            match tokio::time::timeout(left, consumer.recv()).await {
                Err(_) => break,
                Ok(Ok(m)) => r.keep(&m),
                Ok(Err(e)) => {
                    result = Err(e);
                    break;
                }
            }
        }
        self.put(r, max_pooled);
        result
    }

    /// Drop every kept consumer (a new run starts from its checkpoint).
    pub(super) fn clear(&self) {
        self.0.lock().expect("kafka reader pool").clear();
    }
}

impl KafkaSource {
    pub(super) fn range_stream(&self, ranges: Vec<PartitionRange>) -> BatchStream {
        let offsets: i64 = ranges.iter().map(|r| (r.end - r.start).max(0)).sum();
        let live_stalls = self.live_stalls.clone();
        let kind = if offsets <= LIVE_RANGE_OFFSETS && !live_stalls.load(Ordering::Relaxed) {
            ReaderKind::Live
        } else {
            ReaderKind::Bulk
        };
        let cfg = client_config_for(&self.options, Some(kind));
        let name = self.name.clone();
        let schema = self.schema.clone();
        let value_schema = self.value_schema.clone();
        let format = self.options.format.clone();
        let key_format = self.options.key_format.clone();
        let batch_size = self.options.batch_size.max(1);
        let timeout = self.options.read_timeout;
        let request_timeout = self.options.request_timeout;
        let fail_on_data_loss = self.options.fail_on_data_loss;
        let skipped = self.skipped.clone();
        let rejects = match self.options.on_error {
            crate::OnError::Fail => None,
            crate::OnError::DeadLetter => Some(self.rejected.clone()),
        };
        let pool = match kind {
            ReaderKind::Live => self.live_readers.0.clone(),
            ReaderKind::Bulk => self.bulk_readers.0.clone(),
        };
        let bulk = (
            client_config_for(&self.options, Some(ReaderKind::Bulk)),
            self.bulk_readers.0.clone(),
        );
        let max_pooled = self.options.consumers;
        let fut = async move {
            let starts: Vec<((String, i32), i64)> = ranges
                .iter()
                .map(|r| ((r.topic.clone(), r.partition), r.start))
                .collect();
            let remaining: HashMap<(String, i32), (i64, i64)> = ranges
                .iter()
                .map(|r| ((r.topic.clone(), r.partition), (r.start, r.end)))
                .collect();
            let pooled = ReaderPool(pool.clone()).take(&starts);
            let mut reader = match pooled {
                Some((r, true)) => r,
                found => {
                    let mut r = match found {
                        Some((r, _)) => r,
                        None => PooledReader::new(cfg.create().map_err(|e| create_err(&name, e))?),
                    };
                    r.assign(&starts).map_err(|e| Error::Kafka {
                        source_name: name.clone(),
                        what: "assign partitions".into(),
                        reason: e.to_string(),
                        transient: false,
                    })?;
                    r
                }
            };
            // Once read, each range's partition continues at its end: only
            // messages from there on are kept for the next batch.
            for r in &ranges {
                if let Some(c) = reader.parts.get_mut(&(r.topic.clone(), r.partition)) {
                    c.next = r.end;
                }
            }
            let builder = RowBuilder::new(
                name.clone(),
                schema,
                value_schema,
                (format, key_format),
                batch_size,
                rejects,
            )?;
            let reader = RangeReader {
                name,
                consumer: reader.consumer.clone(),
                pooled: Some(reader),
                pool: (pool, max_pooled),
                fallback: (kind == ReaderKind::Live).then_some((bulk.0, bulk.1, live_stalls)),
                remaining,
                builder,
                timeout,
                request_timeout,
                fail_on_data_loss,
                skipped,
                last_progress: Instant::now(),
                last_bounds_check: Instant::now(),
                backoff: read_backoff(),
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
/// The longest wait between reads that meet only errors.
pub(super) const MAX_READ_BACKOFF: Duration = Duration::from_secs(2);

/// The waits after transient consume errors: from [`MIN_READ_BACKOFF`],
/// doubling up to [`MAX_READ_BACKOFF`], for as long as errors go on (a
/// read's own timeout bounds them); a record read starts them over.
pub(super) fn read_backoff() -> backon::ExponentialBackoff {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::default()
        .with_min_delay(MIN_READ_BACKOFF)
        .with_max_delay(MAX_READ_BACKOFF)
        .with_factor(2.0)
        .without_max_times()
        .build()
}
/// How long a reader goes without a record of its ranges before it asks
/// whether they still exist, and how often it asks again while nothing
/// comes. A reader that receives records never asks (the plan that made
/// its ranges had just read the partitions' watermarks). Asking whenever
/// the 500 ms receive wait ran out put a watermark lookup between every
/// two fetches of a broker slower than that wait; asking after 1 s still
/// put one behind a large first fetch.
pub(super) const BOUNDS_CHECK_AFTER: Duration = Duration::from_secs(3);

pub(super) struct RangeReader {
    name: String,
    consumer: Arc<Detached<StreamConsumer>>,
    /// The consumer with its cursors, back to the pool when the read ends.
    pooled: Option<PooledReader>,
    pool: (SharedPool, usize),
    /// A live reader's way out when it makes no progress for
    /// [`LIVE_STALL`]: a bulk consumer's settings and pool, and the
    /// source's flag that sends later reads to bulk consumers.
    fallback: Option<(ClientConfig, SharedPool, Arc<AtomicBool>)>,
    /// (topic, partition) -> (next expected offset, end)
    remaining: HashMap<(String, i32), (i64, i64)>,
    builder: RowBuilder,
    timeout: Duration,
    request_timeout: Duration,
    fail_on_data_loss: bool,
    skipped: Arc<Mutex<Vec<Skipped>>>,
    last_progress: Instant,
    last_bounds_check: Instant,
    backoff: backon::ExponentialBackoff,
}

impl RangeReader {
    /// Sleep the next of [`read_backoff`]'s waits.
    async fn wait_after_error(&mut self) {
        tokio::time::sleep(self.backoff.next().unwrap_or(MAX_READ_BACKOFF)).await;
    }

    pub(super) async fn next_batch(mut self) -> Result<Option<(RecordBatch, Self)>> {
        loop {
            self.remaining.retain(|_, (pos, end)| pos < end);
            if self.remaining.is_empty() || self.builder.is_full() {
                let done = self.remaining.is_empty();
                return match self.builder.finish()? {
                    Some(b) => Ok(Some((b, self))),
                    None if done => {
                        self.release();
                        Ok(None)
                    }
                    None => continue,
                };
            }
            // What the consumer delivered before this read comes first.
            if let Some(m) = self.next_kept() {
                *self
                    .remaining
                    .get_mut(&(m.topic().to_string(), m.partition()))
                    .map(|(pos, _)| pos)
                    .expect("a kept message of a range being read") = m.offset() + 1;
                self.last_progress = Instant::now();
                if let Some((id, registry)) = self.builder.missing_schema(&m) {
                    registry.schema_by_id(&self.name, id).await?;
                }
                self.builder.push(&m)?;
                continue;
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
                    if self.last_progress.elapsed() >= BOUNDS_CHECK_AFTER
                        && self.last_bounds_check.elapsed() >= BOUNDS_CHECK_AFTER
                    {
                        self.check_log_bounds().await?;
                    }
                    if self.last_progress.elapsed() >= LIVE_STALL {
                        self.fall_back_to_bulk()?;
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
                        self.wait_after_error().await;
                    }
                }
                Ok(Err(e))
                    if is_transient(&e)
                        || e.rdkafka_error_code() == Some(RDKafkaErrorCode::PartitionEOF) =>
                {
                    tracing::debug!(source = %self.name, error = %e, "transient consumer error; retrying");
                    self.wait_after_error().await;
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
                        // A partition read whole, or not in this read:
                        // kept for the next batch.
                        if let Some(r) = self.pooled.as_mut() {
                            r.keep(&m);
                        }
                        continue;
                    };
                    let off = m.offset();
                    if off < *pos || off >= *end {
                        // Past the planned end (kept for the next batch)
                        // or a duplicate after a retry: not this batch's
                        // record.
                        if off >= *end {
                            *pos = *end;
                            if let Some(r) = self.pooled.as_mut() {
                                r.keep(&m);
                            }
                        }
                        continue;
                    }
                    *pos = off + 1;
                    self.last_progress = Instant::now();
                    self.backoff = read_backoff();
                    if let Some((id, registry)) = self.builder.missing_schema(&m) {
                        // The borrowed message may not live across the
                        // registry request.
                        let m = m.detach();
                        registry.schema_by_id(&self.name, id).await?;
                        self.builder.push(&m)?;
                        continue;
                    }
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
    /// only once the reader got no record for [`BOUNDS_CHECK_AFTER`], or
    /// when the consumer reported an offset out of range, so a read that
    /// receives records costs the broker nothing more. The watermarks of
    /// all the ranges' partitions come in one lookup; when it fails, this
    /// check learns nothing and the next one asks again.
    pub(super) async fn check_log_bounds(&mut self) -> Result<bool> {
        self.last_bounds_check = Instant::now();
        let mut parts: BTreeMap<String, Vec<i32>> = BTreeMap::new();
        for (t, p) in self.remaining.keys() {
            parts.entry(t.clone()).or_default().push(*p);
        }
        let consumer = self.consumer.clone();
        let timeout = self.request_timeout;
        let marks = tokio::task::spawn_blocking(move || {
            fetch_watermarks(&**consumer, &parts, timeout).map(|w| w.marks)
        })
        .await
        .ok()
        .and_then(std::result::Result::ok)
        .unwrap_or_default();
        let marks = marks
            .into_iter()
            .flat_map(|(t, ps)| ps.into_iter().map(move |(p, m)| ((t.clone(), p), m)));
        let mut changed = false;
        for ((topic, partition), (lo, hi)) in marks {
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
                    self.forget(&topic, partition);
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
                    self.forget(&topic, partition);
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

    /// A live consumer that got nothing for [`LIVE_STALL`] while its ranges
    /// are unread: some brokers answer nothing to a fetch whose short wait
    /// ends before they gather the records. Read the rest with a bulk
    /// consumer (librdkafka's fetch defaults) at the positions reached, and
    /// send every later read of the source to bulk consumers.
    fn fall_back_to_bulk(&mut self) -> Result<()> {
        let Some((cfg, pool, stalls)) = self.fallback.take() else {
            return Ok(());
        };
        tracing::warn!(
            source = %self.name,
            "a short-wait fetch got no records for {LIVE_STALL:?}; reading with librdkafka's \
             fetch defaults from now on (set 'kafka.fetch.wait.max.ms' to choose)"
        );
        stalls.store(true, Ordering::Relaxed);
        let starts: Vec<((String, i32), i64)> = self
            .remaining
            .iter()
            .map(|(k, (pos, _))| (k.clone(), *pos))
            .collect();
        let mut r = PooledReader::new(cfg.create().map_err(|e| create_err(&self.name, e))?);
        r.assign(&starts).map_err(|e| Error::Kafka {
            source_name: self.name.clone(),
            what: "assign partitions".into(),
            reason: e.to_string(),
            transient: false,
        })?;
        for (k, (_, end)) in &self.remaining {
            if let Some(c) = r.parts.get_mut(k) {
                c.next = *end;
            }
        }
        self.consumer = r.consumer.clone();
        self.pooled = Some(r);
        self.pool.0 = pool;
        self.last_progress = Instant::now();
        Ok(())
    }

    /// The next kept message of a partition being read, in order; marks a
    /// partition whose kept messages pass its end as read whole.
    fn next_kept(&mut self) -> Option<OwnedMessage> {
        let r = self.pooled.as_mut()?;
        for (key, (pos, end)) in self.remaining.iter_mut() {
            match r.take_kept(key, *pos, *end) {
                Ok(Some(m)) => return Some(m),
                Ok(None) => {}
                Err(()) => *pos = *end,
            }
        }
        None
    }

    /// A partition whose reading jumped (data loss handling): the pooled
    /// consumer's cursor for it means nothing any more.
    fn forget(&mut self, topic: &str, partition: i32) {
        if let Some(r) = self.pooled.as_mut()
            && let Some(c) = r.parts.remove(&(topic.to_string(), partition))
        {
            r.stash_bytes -= c.stash.iter().map(stash_size).sum::<usize>();
        }
    }

    /// The read is whole: the consumer (standing at each range's end) goes
    /// back to the pool for the next batch.
    fn release(&mut self) {
        let Some(r) = self.pooled.take() else {
            return;
        };
        ReaderPool(self.pool.0.clone()).put(r, self.pool.1);
    }

    /// Step over offset gaps (transaction markers, aborted records): the
    /// consumer's position moves past them even though no message arrives.
    /// A partition with kept messages is not stepped: they come first.
    pub(super) fn sync_positions(&mut self) {
        if let Ok(pos) = self.consumer.position() {
            for el in pos.elements() {
                let key = (el.topic().to_string(), el.partition());
                if self.pooled.as_ref().is_some_and(|r| r.has_kept(&key)) {
                    continue;
                }
                if let KOffset::Offset(o) = el.offset()
                    && let Some((p, _)) = self.remaining.get_mut(&key)
                    && o > *p
                {
                    *p = o;
                    self.last_progress = Instant::now();
                }
            }
        }
    }
}
