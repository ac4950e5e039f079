//! Planning: the broker's watermarks, a batch's end offsets under the
//! per-trigger cap, starting and ending offsets, and where to resume when
//! the log changed under a recorded range (retention, truncation, a
//! recreated topic).

use super::*;

/// The offsets `[start, end)` of one partition that a batch reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct PartitionRange {
    pub(super) topic: String,
    pub(super) partition: i32,
    pub(super) start: i64,
    pub(super) end: i64,
}

/// Where a partition's reading goes on when the checkpoint's next offset
/// `s` is not where it was (outside the partition's offsets `lo..hi`, or in
/// a topic that was recreated), with a description of the loss, or `None`
/// when reading goes on at `s`.
///
/// A changed topic id proves that the topic was deleted and recreated: its
/// offsets describe other records. When `s` lies past the new partition's
/// end, no batch can have read the new topic, and it is read from `lo`;
/// when `s` lies inside it, batches since the last id check may have read
/// the new topic from `s` on, so reading goes on at `s` (never a record
/// twice) and the offsets before `s` are recorded as possibly unread.
/// Below `lo` the records were deleted (retention): resume at `lo`. Above
/// `hi` without a changed id the log was truncated (an unclean leader
/// election), or a recreation went unproven: reading resumes at `hi`, so
/// no offset the table already holds a record for is read again.
pub(super) fn resume_point(
    s: i64,
    lo: i64,
    hi: i64,
    recorded_id: Option<&str>,
    current_id: Option<&str>,
) -> Option<(i64, String)> {
    if let (Some(was), Some(now)) = (recorded_id, current_id)
        && was != now
    {
        let recreated = format!(
            "the topic was recreated (topic id {was} is now {now}): the checkpoint expects \
             offset {s} of the old topic, and the new one holds offsets {lo}..{hi}"
        );
        return Some(if s > hi {
            (lo, recreated)
        } else {
            (
                s.max(lo),
                format!(
                    "{recreated}; reading goes on at {}, and offsets {lo}..{s} of the new \
                     topic may never have been read",
                    s.max(lo)
                ),
            )
        });
    }
    if s < lo {
        return Some((
            lo,
            format!("offsets {s}..{lo} are no longer available (earliest is {lo})"),
        ));
    }
    if s <= hi {
        return None;
    }
    Some((
        hi,
        format!(
            "the checkpoint expects offset {s} but the partition ends at {hi}: the log was \
             truncated (an unclean leader election?) or the topic recreated; offsets \
             {hi}..{s} are gone"
        ),
    ))
}

/// The topic ids (KIP-516) the broker gives for `names`, as 32 hex digits;
/// topics without one (an older broker, an error) are left out. `None`
/// when no answer came within `timeout` (some brokers name a controller
/// that is not among their brokers, and librdkafka then waits for it
/// until the timeout). Asked only when a topic is first seen, its offsets
/// went missing, or now and then: an id is evidence of recreation, never
/// needed for reading.
pub(super) fn fetch_topic_ids<X: ConsumerContext>(
    consumer: &BaseConsumer<X>,
    names: &[String],
    timeout: Duration,
) -> Option<BTreeMap<String, String>> {
    use rdkafka::bindings as rd;
    use std::ffi::{CStr, CString};
    let mut out = BTreeMap::new();
    let c_names: Vec<CString> = names
        .iter()
        .filter_map(|n| CString::new(n.as_str()).ok())
        .collect();
    if c_names.is_empty() {
        return Some(out);
    }
    let mut ptrs: Vec<*const std::ffi::c_char> = c_names.iter().map(|s| s.as_ptr()).collect();
    let timeout_ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    // SAFETY: librdkafka's admin API on the consumer's live handle. The
    // collection and options are copied by DescribeTopics and destroyed
    // right after it; everything read from the result event belongs to the
    // event and is copied out before the event is destroyed; the queue is
    // destroyed last. Null results (timeout, errors) are checked.
    unsafe {
        let rk = consumer.client().native_ptr();
        let opts = rd::rd_kafka_AdminOptions_new(
            rk,
            rd::rd_kafka_admin_op_t::RD_KAFKA_ADMIN_OP_DESCRIBETOPICS,
        );
        // The request gives up when the wait does.
        let mut errstr = [0 as std::ffi::c_char; 256];
        rd::rd_kafka_AdminOptions_set_request_timeout(
            opts,
            timeout_ms,
            errstr.as_mut_ptr(),
            errstr.len(),
        );
        let coll = rd::rd_kafka_TopicCollection_of_topic_names(ptrs.as_mut_ptr(), ptrs.len());
        let queue = rd::rd_kafka_queue_new(rk);
        rd::rd_kafka_DescribeTopics(rk, coll, opts, queue);
        rd::rd_kafka_TopicCollection_destroy(coll);
        rd::rd_kafka_AdminOptions_destroy(opts);
        // A little longer than the request's own timeout, so its timeout
        // result is the one taken.
        let ev = rd::rd_kafka_queue_poll(queue, timeout_ms.saturating_add(200));
        if ev.is_null()
            || rd::rd_kafka_event_error(ev) == rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__TIMED_OUT
        {
            if !ev.is_null() {
                rd::rd_kafka_event_destroy(ev);
            }
            rd::rd_kafka_queue_destroy(queue);
            return None;
        }
        if rd::rd_kafka_event_type(ev) == rd::RD_KAFKA_EVENT_DESCRIBETOPICS_RESULT
            && rd::rd_kafka_event_error(ev) == rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR
        {
            let res = rd::rd_kafka_event_DescribeTopics_result(ev);
            let mut n = 0usize;
            let tds = rd::rd_kafka_DescribeTopics_result_topics(res, &mut n);
            for i in 0..n {
                let td = *tds.add(i);
                if td.is_null() || !rd::rd_kafka_TopicDescription_error(td).is_null() {
                    continue;
                }
                let name = CStr::from_ptr(rd::rd_kafka_TopicDescription_name(td))
                    .to_string_lossy()
                    .into_owned();
                let id = rd::rd_kafka_TopicDescription_topic_id(td);
                if id.is_null() {
                    continue;
                }
                let hi = rd::rd_kafka_Uuid_most_significant_bits(id) as u64;
                let lo = rd::rd_kafka_Uuid_least_significant_bits(id) as u64;
                if hi != 0 || lo != 0 {
                    out.insert(name, format!("{hi:016x}{lo:016x}"));
                }
            }
        }
        rd::rd_kafka_event_destroy(ev);
        rd::rd_kafka_queue_destroy(queue);
    }
    Some(out)
}

/// Planning state gathered from the broker.
#[derive(Debug, Clone)]
pub(super) struct Watermarks {
    /// (low, high) per topic and partition.
    pub(super) marks: BTreeMap<String, BTreeMap<i32, (i64, i64)>>,
}

/// The most a topic-id lookup waits (or `request_timeout`, if shorter):
/// the ids are evidence, and a start or a plan must not wait on a broker
/// that never answers them.
pub(super) const TOPIC_ID_WAIT: Duration = Duration::from_secs(2);

/// The partitions of every topic of `topics` (only those in `only`, when
/// given), from the brokers' metadata.
pub(super) fn fetch_partitions<X: ConsumerContext>(
    consumer: &BaseConsumer<X>,
    topics: &Topics,
    only_partitions: Option<&std::collections::BTreeSet<i32>>,
    timeout: Duration,
) -> Result<BTreeMap<String, Vec<i32>>, KafkaError> {
    // One named topic: ask for its metadata only.
    let only = match topics {
        Topics::List(list) if list.len() == 1 => Some(list[0].as_str()),
        _ => None,
    };
    let md = consumer.fetch_metadata(only, timeout)?;
    let mut found = BTreeMap::new();
    for t in md.topics() {
        let wanted = match topics {
            Topics::List(list) => list.iter().any(|n| n == t.name()),
            Topics::Pattern(re) => !t.name().starts_with("__") && re.is_match(t.name()),
        };
        if !wanted {
            continue;
        }
        if let Some(e) = t.error() {
            return Err(KafkaError::MetadataFetch(e.into()));
        }
        let ids: Vec<i32> = t
            .partitions()
            .iter()
            .map(|p| p.id())
            .filter(|p| only_partitions.is_none_or(|o| o.contains(p)))
            .collect();
        found.insert(t.name().to_string(), ids);
    }
    if let Topics::List(list) = topics {
        for n in list {
            if !found.contains_key(n) {
                return Err(KafkaError::MetadataFetch(
                    RDKafkaErrorCode::UnknownTopicOrPartition,
                ));
            }
        }
    }
    Ok(found)
}

/// The watermarks of every partition in `partitions` (topic → ids), asked
/// of each partition's leader in two requests for all its partitions (the
/// earliest offsets and the latest, at once), under the consumer's
/// `isolation.level`. Asking per partition (librdkafka's
/// `query_watermark_offsets`) costs two requests a partition: on a broker
/// whose offset lookups are slow, a plan then waits on them partition by
/// partition.
pub(super) fn fetch_watermarks<X: ConsumerContext, C: Consumer<X> + Sync>(
    consumer: &C,
    partitions: &BTreeMap<String, Vec<i32>>,
    timeout: Duration,
) -> Result<Watermarks, KafkaError> {
    let mut marks: BTreeMap<String, BTreeMap<i32, (i64, i64)>> = partitions
        .keys()
        .map(|name| (name.clone(), BTreeMap::new()))
        .collect();
    if partitions.values().all(Vec::is_empty) {
        return Ok(Watermarks { marks });
    }
    // The offsets at `at` (earliest or latest) of every partition.
    let ask = |at: KOffset| -> Result<Vec<(String, i32, i64)>, KafkaError> {
        let mut tpl = TopicPartitionList::new();
        for (name, ids) in partitions {
            for &p in ids {
                tpl.add_partition_offset(name, p, at)?;
            }
        }
        let got = consumer.offsets_for_times(tpl, timeout)?;
        got.elements()
            .iter()
            .map(|e| {
                e.error().map_err(|err| {
                    KafkaError::MetadataFetch(
                        err.rdkafka_error_code()
                            .unwrap_or(RDKafkaErrorCode::UnknownTopicOrPartition),
                    )
                })?;
                match e.offset() {
                    KOffset::Offset(o) => Ok((e.topic().to_string(), e.partition(), o)),
                    // Unanswered: no offset came back for the partition.
                    _ => Err(KafkaError::MetadataFetch(
                        RDKafkaErrorCode::UnknownTopicOrPartition,
                    )),
                }
            })
            .collect()
    };
    let (lows, highs) = std::thread::scope(|s| {
        let lows = s.spawn(|| ask(KOffset::Beginning));
        let highs = ask(KOffset::End);
        (lows.join().expect("watermark request thread"), highs)
    });
    let lows: HashMap<(String, i32), i64> =
        lows?.into_iter().map(|(t, p, o)| ((t, p), o)).collect();
    for (t, p, hi) in highs? {
        let lo = *lows.get(&(t.clone(), p)).ok_or(KafkaError::MetadataFetch(
            RDKafkaErrorCode::UnknownTopicOrPartition,
        ))?;
        marks.entry(t).or_default().insert(p, (lo, hi));
    }
    Ok(Watermarks { marks })
}

/// Split `cap` offsets over partitions in proportion to their backlog; every
/// partition with a backlog gets at least one offset while the cap allows.
pub(super) fn split_cap(backlogs: &[(usize, i64)], cap: u64) -> Vec<(usize, i64)> {
    let total: i64 = backlogs.iter().map(|(_, b)| *b).sum();
    if total <= cap as i64 {
        return backlogs.to_vec();
    }
    let mut out: Vec<(usize, i64)> = backlogs
        .iter()
        .map(|(i, b)| (*i, ((*b as i128 * cap as i128) / total as i128) as i64))
        .collect();
    let mut left = cap as i64 - out.iter().map(|(_, n)| *n).sum::<i64>();
    for (k, (_, b)) in backlogs.iter().enumerate() {
        if left == 0 {
            break;
        }
        if out[k].1 < *b {
            out[k].1 += 1;
            left -= 1;
        }
    }
    out
}

pub(super) fn resolve_ending(spec: &EndingOffsets, marks: &Watermarks) -> PartitionOffsets {
    let mut out = PartitionOffsets::new();
    for (t, ps) in &marks.marks {
        for (&p, &(_, hi)) in ps {
            let e = match spec {
                EndingOffsets::Latest => hi,
                EndingOffsets::Map(m) => match m.get(t).and_then(|x| x.get(&p)) {
                    Some(-1) | None => hi,
                    Some(e) => *e,
                },
            };
            out.entry(t.clone()).or_default().insert(p, e);
        }
    }
    out
}

impl KafkaSource {
    /// `(topic, partition, first offset, end offset)` of each partition with
    /// records between `start` and `end`.
    pub(super) fn ranges(
        &self,
        start: &KafkaOffset,
        end: &KafkaOffset,
    ) -> Result<Vec<PartitionRange>> {
        let mut ranges = Vec::new();
        for (topic, parts) in &end.partitions {
            for (&p, &e) in parts {
                let lost = end
                    .data_loss
                    .iter()
                    .find(|l| &l.topic == topic && l.partition == p);
                let s = match lost {
                    Some(l) => Some(l.resumed_at),
                    None => start
                        .partitions
                        .get(topic)
                        .and_then(|m| m.get(&p))
                        .or_else(|| end.added.get(topic).and_then(|m| m.get(&p)))
                        .copied(),
                };
                let Some(s) = s else {
                    return Err(Error::InvalidOffset {
                        source_name: self.name.clone(),
                        offset: format!("{topic}/{p}"),
                        reason: "the partition has an end but no start".into(),
                    });
                };
                if e > s {
                    ranges.push(PartitionRange {
                        topic: topic.clone(),
                        partition: p,
                        start: s,
                        end: e,
                    });
                }
            }
        }
        Ok(ranges)
    }

    /// Watermarks read at most [`STARTUP_MARKS_AGE`] ago while starting, or
    /// fresh ones (kept for the next start-up call and the first plan).
    pub(super) async fn startup_watermarks(&self) -> Result<Watermarks> {
        if let Some((at, marks)) = &self.state.lock().expect("kafka state").startup_marks
            && at.elapsed() < STARTUP_MARKS_AGE
        {
            return Ok(marks.clone());
        }
        let marks = self.watermarks().await?;
        self.state.lock().expect("kafka state").startup_marks =
            Some((Instant::now(), marks.clone()));
        Ok(marks)
    }

    /// [`fetch_topic_ids`] on the planning client, off the async threads,
    /// waiting at most [`TOPIC_ID_WAIT`]. Brokers that leave the lookup
    /// unanswered are not asked again in this run (a warning says so):
    /// recreation is then told from offsets alone until the query
    /// restarts.
    pub(super) async fn topic_ids(&self, names: Vec<String>) -> Result<BTreeMap<String, String>> {
        if self.state.lock().expect("kafka state").ids_unanswered {
            return Ok(BTreeMap::new());
        }
        let consumer = self.planner()?;
        let timeout = self.options.request_timeout.min(TOPIC_ID_WAIT);
        let ids = tokio::task::spawn_blocking(move || fetch_topic_ids(&consumer, &names, timeout))
            .await
            .unwrap_or_default();
        Ok(match ids {
            Some(ids) => ids,
            None => {
                tracing::warn!(
                    source = %self.name,
                    brokers = %self.options.bootstrap_servers,
                    "the brokers did not answer a topic-id lookup (DescribeTopics) within \
                     {timeout:?}: until the query restarts, a recreated topic is told from \
                     its offsets alone"
                );
                self.state.lock().expect("kafka state").ids_unanswered = true;
                BTreeMap::new()
            }
        })
    }

    pub(super) async fn watermarks(&self) -> Result<Watermarks> {
        let consumer = self.planner()?;
        let topics = self.options.topics.clone();
        let only = self.options.partitions.clone();
        let timeout = self.options.request_timeout;
        let name = self.name.clone();
        let what = format!(
            "read metadata and watermarks of {} from brokers {}",
            self.identity().location,
            self.options.bootstrap_servers
        );
        let known = match &self.state.lock().expect("kafka state").partitions {
            Some((at, known)) if at.elapsed() < PARTITIONS_MAX_AGE => Some(known.clone()),
            _ => None,
        };
        let state = self.state.clone();
        let connection = self.connection.clone();
        let seen = connection.clone();
        tokio::task::spawn_blocking(move || {
            let partitions = match known {
                Some(known) => known,
                None => {
                    let found = fetch_partitions(&consumer, &topics, only.as_ref(), timeout);
                    serve_events(&consumer);
                    if let Ok(found) = &found {
                        state.lock().expect("kafka state").partitions =
                            Some((Instant::now(), found.clone()));
                    }
                    found?
                }
            };
            let marks = fetch_watermarks(&**consumer, &partitions, timeout);
            serve_events(&consumer);
            if marks.is_ok() {
                seen.clear();
            } else {
                // A topic deleted or its partitions moved: list them again.
                state.lock().expect("kafka state").partitions = None;
            }
            marks
        })
        .await
        .map(|r| r.map_err(|e| connection_err(&name, &what, e, &connection)))
        .map_err(|e| Error::Kafka {
            source_name: self.name.clone(),
            what: "plan".into(),
            reason: e.to_string(),
            transient: false,
        })?
    }

    pub(super) async fn resolve_starting(&self, marks: &Watermarks) -> Result<PartitionOffsets> {
        let mut out = PartitionOffsets::new();
        match &self.options.starting_offsets {
            StartingOffsets::Earliest => {
                for (t, ps) in &marks.marks {
                    for (&p, &(lo, _)) in ps {
                        out.entry(t.clone()).or_default().insert(p, lo);
                    }
                }
            }
            StartingOffsets::Latest => {
                for (t, ps) in &marks.marks {
                    for (&p, &(_, hi)) in ps {
                        out.entry(t.clone()).or_default().insert(p, hi);
                    }
                }
            }
            StartingOffsets::Map(m) => {
                for (t, ps) in &marks.marks {
                    for (&p, &(lo, hi)) in ps {
                        let o = match m.get(t).and_then(|x| x.get(&p)) {
                            Some(-1) => hi,
                            Some(-2) | None => lo,
                            Some(o) => *o,
                        };
                        out.entry(t.clone()).or_default().insert(p, o);
                    }
                }
            }
            StartingOffsets::Timestamp(ts) => {
                let consumer = self.planner()?;
                let timeout = self.options.request_timeout;
                let name = self.name.clone();
                let mut tpl = TopicPartitionList::new();
                for (t, ps) in &marks.marks {
                    for &p in ps.keys() {
                        let _ = tpl.add_partition_offset(t, p, KOffset::Offset(*ts));
                    }
                }
                let found =
                    tokio::task::spawn_blocking(move || consumer.offsets_for_times(tpl, timeout))
                        .await
                        .map_err(|e| Error::Kafka {
                            source_name: name.clone(),
                            what: "offsets_for_times".into(),
                            reason: e.to_string(),
                            transient: false,
                        })?
                        .map_err(|e| self.kafka_err("look up offsets for starting_timestamp", e))?;
                for el in found.elements() {
                    let (lo, hi) = marks
                        .marks
                        .get(el.topic())
                        .and_then(|m| m.get(&el.partition()))
                        .copied()
                        .unwrap_or((0, 0));
                    let o = match el.offset() {
                        KOffset::Offset(o) => o,
                        // No record at or after the timestamp: start at the end.
                        KOffset::End => hi,
                        _ => lo,
                    };
                    out.entry(el.topic().to_string())
                        .or_default()
                        .insert(el.partition(), o.max(lo));
                }
            }
        }
        Ok(out)
    }
}
