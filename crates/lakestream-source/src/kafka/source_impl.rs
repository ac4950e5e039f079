//! [`Source`] for [`KafkaSource`]: planning, reading, recovery and the hooks the engine calls.

use super::*;

#[async_trait]
impl Source for KafkaSource {
    fn name(&self) -> &str {
        &self.name
    }

    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    async fn recover(&self, ends: &[Offset]) -> Result<()> {
        for e in ends {
            self.parse(e)?;
        }
        Ok(())
    }

    async fn restore(&self, _snapshot: Option<&Offset>) -> Result<()> {
        // A bound frozen by an earlier available-now run (or watermarks of an
        // earlier start) must not cap this run.
        *self.state.lock().expect("kafka state") = KafkaState::default();
        self.membership.forget();
        self.live_readers.clear();
        self.bulk_readers.clear();
        self.skipped.lock().expect("kafka skipped").clear();
        self.rejected.lock().expect("kafka rejected").clear();
        Ok(())
    }

    fn take_skipped(&self) -> Vec<Skipped> {
        std::mem::take(&mut *self.skipped.lock().expect("kafka skipped"))
    }

    fn take_rejected(&self) -> Vec<crate::Rejected> {
        std::mem::take(&mut *self.rejected.lock().expect("kafka rejected"))
    }

    fn unavailable_timeout(&self) -> Duration {
        self.options.unavailable_timeout
    }

    fn identity(&self) -> SourceIdentity {
        let location = match &self.options.topics {
            Topics::List(list) => {
                let mut l = list.clone();
                l.sort();
                format!("topics {}", l.join(","))
            }
            Topics::Pattern(re) => format!("topic pattern {}", re.as_str()),
        };
        // The isolation level decides where a planned range may end (the
        // last stable offset or the high watermark): a change would make a
        // checkpoint's offsets look truncated or reach past open
        // transactions.
        let location = format!("{location} ({})", self.options.isolation_level.as_str());
        // A checkpoint of one share of the partitions must not be reused by
        // another.
        let location = match &self.options.partitions {
            Some(p) => format!(
                "{location} partitions {}",
                p.iter()
                    .map(|p| p.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            ),
            None => location,
        };
        let location = match &self.options.group_id {
            Some(g) => format!("{location} group {g}"),
            None => location,
        };
        SourceIdentity {
            kind: "kafka".into(),
            location,
        }
    }

    async fn freeze(&self) -> Result<()> {
        if self.options.group_id.is_some() {
            return Err(Error::InvalidOption {
                source_name: self.name.clone(),
                option: "group_id".into(),
                reason: "group mode runs continuously (partitions move between processes): use \
                         a continuous trigger, or static 'partitions' for available-now"
                    .into(),
            });
        }
        let marks = self.startup_watermarks().await?;
        let frozen = marks
            .marks
            .into_iter()
            .map(|(t, ps)| (t, ps.into_iter().map(|(p, (_, hi))| (p, hi)).collect()))
            .collect();
        self.state.lock().expect("kafka state").frozen = Some(frozen);
        Ok(())
    }

    async fn initial_offset(&self) -> Result<Option<Offset>> {
        if self.options.group_id.is_some() {
            // Each partition starts at its position in the table.
            return Ok(None);
        }
        let marks = self.startup_watermarks().await?;
        let topics: Vec<String> = marks.marks.keys().cloned().collect();
        let initial = KafkaOffset {
            partitions: self.resolve_starting(&marks).await?,
            ending: self
                .options
                .ending_offsets
                .as_ref()
                .map(|spec| resolve_ending(spec, &marks)),
            added: PartitionOffsets::new(),
            data_loss: Vec::new(),
            topic_ids: self.topic_ids(topics).await?,
            group_from: None,
        };
        Ok(Some(
            serde_json::to_value(initial).expect("offset serializes"),
        ))
    }

    async fn plan(&self, start: Option<&Offset>) -> Result<Option<Offset>> {
        if self.options.group_id.is_some() {
            return Ok(self
                .plan_group()
                .await?
                .map(|o| serde_json::to_value(o).expect("offset serializes")));
        }
        let prev = match start {
            Some(s) => self.parse(s)?,
            // Used without an engine that stores the initial offset.
            None => match self.initial_offset().await? {
                Some(v) => self.parse(&v)?,
                None => KafkaOffset::default(),
            },
        };
        // The first plan may use the watermarks read while starting; every
        // later plan asks the broker.
        let startup = self.state.lock().expect("kafka state").startup_marks.take();
        let marks = match startup {
            Some((at, marks)) if at.elapsed() < STARTUP_MARKS_AGE => marks,
            _ => self.watermarks().await?,
        };
        Ok(self
            .plan_next(&prev, &marks)
            .await?
            .map(|o| serde_json::to_value(o).expect("offset serializes")))
    }

    fn read(
        &self,
        start: Option<&Offset>,
        end: &Offset,
        partitions: usize,
    ) -> Result<Vec<BatchStream>> {
        let end = self.parse(end)?;
        let start = match (&end.group_from, start) {
            (Some(from), _) => KafkaOffset {
                partitions: from.clone(),
                ..Default::default()
            },
            (None, Some(s)) => self.parse(s)?,
            (None, None) => KafkaOffset::default(),
        };
        let ranges = self.ranges(&start, &end)?;
        let n = partitions
            .min(self.options.consumers)
            .max(1)
            .min(ranges.len().max(1));
        let mut groups: Vec<Vec<PartitionRange>> = vec![Vec::new(); n];
        for (i, r) in ranges.into_iter().enumerate() {
            groups[i % n].push(r);
        }
        Ok(groups
            .into_iter()
            .filter(|g| !g.is_empty())
            .map(|g| self.range_stream(g))
            .collect())
    }

    async fn wait_for_data(&self, after: Option<&Offset>, max: Duration) {
        let started = Instant::now();
        // Group mode: the partitions owned move between plans, and the
        // plan asks the group; waiting on a fetch is for fixed partitions.
        let after = match after.map(|a| self.parse(a)) {
            Some(Ok(a)) if self.options.group_id.is_none() => a,
            _ => return tokio::time::sleep(max).await,
        };
        let starts: Vec<((String, i32), i64)> = after
            .partitions
            .iter()
            .flat_map(|(t, ps)| ps.iter().map(move |(p, o)| ((t.clone(), *p), *o)))
            .collect();
        if starts.is_empty() {
            return tokio::time::sleep(max).await;
        }
        let waited = self
            .live_readers
            .wait_for_message(
                &client_config_for(&self.options, Some(ReaderKind::Live)),
                &starts,
                max,
                self.options.consumers,
            )
            .await;
        if let Err(e) = waited {
            // The next plan reports what is wrong; until then, no busy loop.
            tracing::debug!(source = %self.name, error = %e, "waiting for records failed");
            tokio::time::sleep(max.saturating_sub(started.elapsed())).await;
        }
    }

    fn latest(&self) -> Option<crate::Latest> {
        self.state.lock().expect("kafka state").latest.clone()
    }

    fn describe(&self, start: Option<&Offset>, end: &Offset) -> String {
        let Ok(end) = self.parse(end) else {
            return "offsets ?".into();
        };
        let start = match &end.group_from {
            Some(from) => KafkaOffset {
                partitions: from.clone(),
                ..Default::default()
            },
            None => start.and_then(|s| self.parse(s).ok()).unwrap_or_default(),
        };
        let ranges = self.ranges(&start, &end).unwrap_or_default();
        let total: i64 = ranges.iter().map(|r| r.end - r.start).sum();
        let parts = ranges.len();
        let mut d = format!("{total} offsets over {parts} partitions");
        for l in &end.data_loss {
            d.push_str(&format!(
                "; data loss skipped {}/{}: expected offset {}, resumed at {}",
                l.topic, l.partition, l.expected, l.resumed_at
            ));
        }
        d
    }

    fn table_positions(&self) -> Option<&dyn crate::TablePositions> {
        self.options
            .group_id
            .is_some()
            .then_some(self as &dyn crate::TablePositions)
    }

    async fn committed(&self, end: &Offset) -> Result<()> {
        if self.options.group_id.is_some() {
            self.membership.advance(&self.parse(end)?);
            return Ok(());
        }
        let Some(group) = self.options.commit_group.clone() else {
            return Ok(());
        };
        let end = self.parse(end)?;
        let mut cfg = self.client_config();
        cfg.set("group.id", &group);
        let name = self.name.clone();
        tokio::task::spawn_blocking(move || -> Result<()> {
            let consumer: Detached<BaseConsumer> =
                Detached::new(cfg.create().map_err(|e| create_err(&name, e))?);
            let mut tpl = TopicPartitionList::new();
            for (t, ps) in &end.partitions {
                for (p, o) in ps {
                    let _ = tpl.add_partition_offset(t, *p, KOffset::Offset(*o));
                }
            }
            consumer
                .commit(&tpl, rdkafka::consumer::CommitMode::Sync)
                .map_err(|e| Error::Kafka {
                    source_name: name,
                    what: format!("commit offsets to group {group} (monitoring only)"),
                    reason: e.to_string(),
                    transient: true,
                })
        })
        .await
        .unwrap_or(Ok(()))
    }
}
