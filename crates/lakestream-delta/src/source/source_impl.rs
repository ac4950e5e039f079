//! [`Source`] for [`DeltaSource`]: planning by table version, reading, recovery.

use super::*;

#[async_trait]
impl Source for DeltaSource {
    fn name(&self) -> &str {
        &self.0.name
    }

    fn schema(&self) -> SchemaRef {
        self.0.schema.clone()
    }

    async fn initial_offset(&self) -> Result<Option<Offset>> {
        // Fixed when the query first runs: the snapshot of the table as it
        // is now (or the starting version's or time's commit), so a restart
        // before the first batch does not move it.
        let first = match (
            self.0.options.starting_version,
            self.0.options.starting_timestamp_ms,
        ) {
            (Some(_), _) => self.0.first_position(),
            (None, Some(ts)) => DeltaOffset {
                version: self.0.first_version_at(ts).await?,
                index: 0,
                snapshot: false,
            },
            (None, None) => DeltaOffset {
                version: self.0.latest_version().await?,
                index: 0,
                snapshot: true,
            },
        };
        Ok(Some(
            serde_json::to_value(first).expect("offset serializes"),
        ))
    }

    async fn recover(&self, ends: &[Offset]) -> Result<()> {
        for e in ends {
            self.0.parse(e)?;
        }
        Ok(())
    }

    async fn restore(&self, _snapshot: Option<&Offset>) -> Result<()> {
        *self.0.frozen.lock().expect("delta state") = None;
        self.0.cache.lock().expect("delta cache").clear();
        Ok(())
    }

    fn identity(&self) -> SourceIdentity {
        SourceIdentity {
            kind: "delta".into(),
            location: self.0.location.url().to_string(),
        }
    }

    fn backlog(&self) -> Option<Backlog> {
        *self.0.backlog.lock().expect("delta state")
    }

    async fn freeze(&self) -> Result<()> {
        let v = self.0.latest_version().await?;
        *self.0.frozen.lock().expect("delta state") = Some(v);
        Ok(())
    }

    async fn plan(&self, start: Option<&Offset>) -> Result<Option<Offset>> {
        let mut cur = match start {
            Some(s) => self.0.parse(s)?,
            None => match self.initial_offset().await? {
                Some(v) => self.0.parse(&v)?,
                None => self.0.first_position(),
            },
        };
        let mut latest = self.0.latest_version().await?;
        if let Some(f) = *self.0.frozen.lock().expect("delta state") {
            latest = latest.min(f);
        }
        let (mut taken, mut bytes) = (0u64, 0u64);
        let mut end = None;
        let (mut known, mut known_bytes) = (0u64, 0u64);
        while cur.version <= latest {
            let files = self.0.files(cur.version, cur.snapshot).await?;
            let rest = &files[(cur.index as usize).min(files.len())..];
            known += rest.len() as u64;
            known_bytes += rest.iter().map(|f| f.size).sum::<u64>();
            while (cur.index as usize) < files.len() && taken < self.0.options.max_files_per_trigger
            {
                let f = &files[cur.index as usize];
                if taken > 0
                    && self
                        .0
                        .options
                        .max_bytes_per_trigger
                        .is_some_and(|cap| bytes + f.size > cap)
                {
                    break;
                }
                taken += 1;
                bytes += f.size;
                cur.index += 1;
                end = Some(cur);
            }
            if (cur.index as usize) < files.len() || cur.version == latest {
                break;
            }
            cur = DeltaOffset {
                version: cur.version + 1,
                index: 0,
                snapshot: false,
            };
        }
        *self.0.backlog.lock().expect("delta state") = Some(Backlog {
            done: taken,
            total: known,
            bytes_done: bytes,
            bytes_total: known_bytes,
        });
        Ok(end.map(|e| serde_json::to_value(e).expect("offset serializes")))
    }

    fn read(
        &self,
        start: Option<&Offset>,
        end: &Offset,
        partitions: usize,
    ) -> Result<Vec<BatchStream>> {
        let start = start.map(|s| self.0.parse(s)).transpose()?;
        let end = self.0.parse(end)?;
        let n = partitions.max(1);
        // The range's files are resolved once, by whichever stream is
        // polled first; stream k reads files k, k + n, ...
        let list: Arc<OnceCell<Vec<DataFile>>> = Arc::new(OnceCell::new());
        Ok((0..n)
            .map(|k| {
                let list = list.clone();
                let inner = self.0.clone();
                stream::once(async move {
                    let files = list
                        .get_or_try_init(|| inner.range_files(start, end))
                        .await?;
                    let mine: Vec<DataFile> = files.iter().skip(k).step_by(n).cloned().collect();
                    Ok::<_, Error>(stream::iter(mine).then(move |f| {
                        let inner = inner.clone();
                        async move {
                            let engine = inner.table.lock().await.log_store().engine(None);
                            inner.read_file(f, engine).await
                        }
                    }))
                })
                .try_flatten()
                .try_flatten()
                .boxed()
            })
            .collect())
    }

    fn describe(&self, start: Option<&Offset>, end: &Offset) -> String {
        let show = |o: DeltaOffset| {
            format!(
                "{} {} file {}",
                if o.snapshot { "snapshot of v" } else { "v" },
                o.version,
                o.index
            )
        };
        let s = start
            .and_then(|s| self.0.parse(s).ok())
            .map(show)
            .unwrap_or_else(|| "start".into());
        let e = self.0.parse(end).map(show).unwrap_or_else(|_| "?".into());
        format!("{s} .. {e}")
    }
}
