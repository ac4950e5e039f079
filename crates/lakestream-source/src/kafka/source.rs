//! [`KafkaSource`]'s own work: opening it, its consumers, the partitions and watermarks planning reads, parsing offsets.

use super::*;

impl KafkaSource {
    /// A Kafka source named `name`. `value_schema` gives the columns decoded
    /// from JSON values (ignored for `raw` and `string`).
    pub fn try_new(
        name: &str,
        value_schema: Option<SchemaRef>,
        options: KafkaSourceOptions,
    ) -> Result<Self> {
        options.validate(name)?;
        let value_schema = match options.format {
            ValueFormat::Json | ValueFormat::Protobuf(_) => value_schema
                .filter(|s| {
                    !s.fields().is_empty() || !matches!(options.format, ValueFormat::Protobuf(_))
                })
                .ok_or_else(|| Error::InvalidOption {
                    source_name: name.to_string(),
                    option: "format".into(),
                    reason: "format 'json' or 'protobuf' needs the value's columns declared in \
                             the table"
                        .into(),
                })?,
            ValueFormat::Raw => Arc::new(Schema::new(vec![Field::new(
                "value",
                DataType::Binary,
                true,
            )])),
            ValueFormat::String => {
                Arc::new(Schema::new(vec![Field::new("value", DataType::Utf8, true)]))
            }
            // The declared columns, or (none declared) the reader
            // schema's fields.
            ValueFormat::Avro(ref a) => match value_schema.filter(|s| !s.fields().is_empty()) {
                Some(s) => s,
                None => crate::avro::arrow_schema_of(&a.reader_schema).map_err(|reason| {
                    Error::InvalidOption {
                        source_name: name.to_string(),
                        option: "format".into(),
                        reason: format!(
                            "the Avro schema of subject {} has no columns lakestream reads: \
                             {reason}",
                            a.subject
                        ),
                    }
                })?,
            },
        };
        let mut fields: Vec<Field> = value_schema
            .fields()
            .iter()
            .map(|f| f.as_ref().clone())
            .collect();
        for m in metadata_fields(name, &options.key_format)? {
            if fields.iter().any(|f| f.name() == m.name()) {
                return Err(Error::InvalidOption {
                    source_name: name.to_string(),
                    option: "columns".into(),
                    reason: format!("column {} is reserved for Kafka metadata", m.name()),
                });
            }
            fields.push(m);
        }
        Ok(Self {
            name: name.to_string(),
            schema: Arc::new(Schema::new(fields)),
            value_schema,
            options,
            state: Arc::new(Mutex::new(KafkaState::default())),
            planner: PlannerSlot::default(),
            connection: ConnectionErrors::default(),
            skipped: Arc::new(Mutex::new(Vec::new())),
            rejected: Arc::new(Mutex::new(Vec::new())),
            membership: group::GroupSlot::default(),
            live_readers: read::ReaderPool::default(),
            bulk_readers: read::ReaderPool::default(),
            live_stalls: Default::default(),
        })
    }

    /// The next batch after `prev` (each partition's next offset) given
    /// the partitions' watermarks `marks`: each partition's range, capped
    /// by the per-trigger limit; `None` when there is nothing to read.
    pub(super) async fn plan_next(
        &self,
        prev: &KafkaOffset,
        marks: &Watermarks,
    ) -> Result<Option<KafkaOffset>> {
        let frozen = self.state.lock().expect("kafka state").frozen.clone();
        let mut next = KafkaOffset {
            ending: prev.ending.clone(),
            topic_ids: prev.topic_ids.clone(),
            ..Default::default()
        };
        let current_ids = self.current_topic_ids(prev, marks).await?;
        for (topic, id) in &current_ids {
            next.topic_ids
                .entry(topic.clone())
                .or_insert_with(|| id.clone());
        }
        // A partition without a start here is one the previous batches never
        // saw; it is recorded in `added` with the offset it starts at.
        // What each partition could give this batch, before the cap.
        let mut rows: Vec<PartitionRange> = Vec::new();
        for (topic, parts) in &marks.marks {
            for (&p, &(lo, hi)) in parts {
                // A partition (or topic) that appeared after the query started
                // is read from its earliest offset.
                let known = prev.partitions.get(topic).and_then(|m| m.get(&p)).copied();
                let mut s = known.unwrap_or(lo);
                if known.is_none() {
                    next.added.entry(topic.clone()).or_default().insert(p, lo);
                }
                let recorded_id = prev.topic_ids.get(topic).map(String::as_str);
                let current_id = current_ids.get(topic).map(String::as_str);
                if let Some((resume, detail)) = resume_point(s, lo, hi, recorded_id, current_id) {
                    // Planned offsets are gone: retention deleted them, the
                    // log was truncated, or the topic was recreated.
                    if self.options.fail_on_data_loss {
                        return Err(Error::DataLoss {
                            source_name: self.name.clone(),
                            topic: topic.clone(),
                            partition: p,
                            detail,
                        });
                    }
                    tracing::warn!(
                        source = %self.name, topic = %topic, partition = p, %detail,
                        "data loss: skipping forward (fail_on_data_loss = false)"
                    );
                    next.data_loss.push(LostRange {
                        topic: topic.clone(),
                        partition: p,
                        expected: s,
                        resumed_at: resume,
                    });
                    if let Some(id) = current_id {
                        // The current id is the one to compare with from
                        // now on (the new topic's, after a recreation).
                        next.topic_ids.insert(topic.clone(), id.to_string());
                    }
                    s = resume;
                }
                let mut limit = hi;
                if let Some(e) = prev.ending.as_ref().and_then(|e| e.get(topic)) {
                    // A bounded source reads no partition it did not know
                    // when it started.
                    limit = limit.min(e.get(&p).copied().unwrap_or(s));
                }
                if let Some(f) = frozen.as_ref() {
                    // Nor, under available-now, one that appeared later.
                    limit = limit.min(f.get(topic).and_then(|m| m.get(&p)).copied().unwrap_or(s));
                }
                rows.push(PartitionRange {
                    topic: topic.clone(),
                    partition: p,
                    start: s,
                    end: limit.max(s),
                });
            }
        }
        let backlogs: Vec<(usize, i64)> = rows
            .iter()
            .enumerate()
            .map(|(i, r)| (i, r.end - r.start))
            .collect();
        let takes = match self.options.max_offsets_per_trigger {
            Some(cap) => split_cap(&backlogs, cap),
            None => backlogs.clone(),
        };
        let mut any = !next.data_loss.is_empty();
        let mut lag = BTreeMap::new();
        for (i, take) in takes {
            let r = &rows[i];
            any |= take > 0;
            next.partitions
                .entry(r.topic.clone())
                .or_default()
                .insert(r.partition, r.start + take);
            let hi = marks.marks[&r.topic][&r.partition].1;
            lag.insert(
                format!("{}/{}", r.topic, r.partition),
                u64::try_from(hi - (r.start + take)).unwrap_or(0),
            );
        }
        let highs: PartitionOffsets = marks
            .marks
            .iter()
            .map(|(t, parts)| {
                (
                    t.clone(),
                    parts.iter().map(|(p, (_, hi))| (*p, *hi)).collect(),
                )
            })
            .collect();
        self.state.lock().expect("kafka state").latest = Some(crate::Latest {
            offset: serde_json::to_value(highs).expect("offsets serialize"),
            lag,
        });
        if !any {
            return Ok(None);
        }
        Ok(Some(next))
    }

    /// The ids of the topics whose id can tell something now, asked of the
    /// cluster; empty when none needs asking.
    async fn current_topic_ids(
        &self,
        prev: &KafkaOffset,
        marks: &Watermarks,
    ) -> Result<BTreeMap<String, String>> {
        // Ids are asked for when they can tell something: a topic first
        // seen, a planned offset past a partition's end (was it recreated?),
        // and every topic at the first plan of a run (it may have been
        // recreated while the query was down) and now and then.
        let periodic = {
            let mut st = self.state.lock().expect("kafka state");
            let due = st
                .ids_checked
                .is_none_or(|t| t.elapsed() >= TOPIC_ID_CHECK_EVERY);
            if due {
                st.ids_checked = Some(Instant::now());
            }
            due
        };
        let mut wanted: Vec<String> = Vec::new();
        for (topic, parts) in &marks.marks {
            let known = prev.partitions.get(topic);
            let first_seen = known.is_none() && !prev.topic_ids.contains_key(topic);
            let past_end = parts
                .iter()
                .any(|(p, (_, hi))| known.and_then(|m| m.get(p)).is_some_and(|s| s > hi));
            // Now and then every topic, so an id a slow answer missed
            // when the topic was first seen is recorded later.
            if first_seen || past_end || periodic {
                wanted.push(topic.clone());
            }
        }
        if wanted.is_empty() {
            return Ok(BTreeMap::new());
        }
        self.topic_ids(wanted).await
    }

    pub(super) fn client_config(&self) -> ClientConfig {
        client_config(&self.options)
    }

    pub(super) fn parse(&self, v: &Offset) -> Result<KafkaOffset> {
        serde_json::from_value(v.clone()).map_err(|e| Error::InvalidOffset {
            source_name: self.name.clone(),
            offset: v.to_string(),
            reason: e.to_string(),
        })
    }

    /// The planning client, created on first use.
    pub(super) fn planner(&self) -> Result<Arc<Detached<BaseConsumer<PlannerContext>>>> {
        let mut slot = self.planner.0.lock().expect("kafka planner");
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let c = Arc::new(Detached::new(
            self.client_config()
                .create_with_context::<_, BaseConsumer<PlannerContext>>(PlannerContext(
                    self.connection.clone(),
                ))
                .map_err(|e| create_err(&self.name, e))?,
        ));
        *slot = Some(c.clone());
        Ok(c)
    }

    pub(super) fn kafka_err(&self, what: &str, e: KafkaError) -> Error {
        connection_err(&self.name, what, e, &self.connection)
    }
}
