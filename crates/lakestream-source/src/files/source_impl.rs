//! [`Source`] for [`FileSource`]: planning, reading a batch's files in pieces, recovery and snapshots.

use super::*;

#[async_trait]
impl Source for FileSource {
    fn name(&self) -> &str {
        &self.name
    }

    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    async fn recover(&self, ends: &[Offset]) -> Result<()> {
        let mut parsed = Vec::with_capacity(ends.len());
        for end in ends {
            parsed.push(self.parse_offset(end)?);
        }
        let mut state = self.state.lock().expect("file source state");
        for end in parsed {
            for f in &end.files {
                state.take(f);
            }
        }
        let cutoff = state.age_cutoff(self.options.max_file_age_ms);
        state.forget_aged(cutoff);
        Ok(())
    }

    fn snapshot(&self) -> Option<Offset> {
        let state = self.state.lock().expect("file source state");
        let mut files: Vec<(&String, &i64)> = state.seen.iter().collect();
        files.sort();
        let snap = SeenSnapshot {
            mtimes: files.iter().map(|(_, m)| **m).collect(),
            files: files.into_iter().map(|(p, _)| p.clone()).collect(),
            bytes: state.done_bytes,
            max_path: state.max_path.clone(),
            done_files: Some(state.done_files),
            newest_ms: state.newest_ms,
            forgotten_before_ms: state.forgotten_before_ms,
        };
        Some(serde_json::to_value(snap).expect("snapshot serializes"))
    }

    async fn restore(&self, snapshot: Option<&Offset>) -> Result<()> {
        let snap: Option<SeenSnapshot> = match snapshot {
            None => None,
            Some(v) => {
                Some(
                    serde_json::from_value(v.clone()).map_err(|e| Error::InvalidOffset {
                        source_name: self.name.clone(),
                        offset: "seen-files snapshot".into(),
                        reason: e.to_string(),
                    })?,
                )
            }
        };
        // Everything is replaced: files an earlier plan took without a
        // durable write-ahead must be taken again.
        let mut state = self.state.lock().expect("file source state");
        *state = SeenState::default();
        if let Some(snap) = snap {
            state.done_files = snap.done_files.unwrap_or(snap.files.len() as u64);
            state.done_bytes = snap.bytes;
            state.max_path = snap.max_path;
            state.newest_ms = snap.newest_ms;
            state.forgotten_before_ms = snap.forgotten_before_ms;
            let mtimes = snap.mtimes.into_iter().chain(std::iter::repeat(i64::MAX));
            state.seen = snap.files.into_iter().zip(mtimes).collect();
        }
        self.skipped.lock().expect("skipped files").clear();
        self.rejected.lock().expect("rejected lines").clear();
        Ok(())
    }

    fn take_skipped(&self) -> Vec<Skipped> {
        std::mem::take(&mut *self.skipped.lock().expect("skipped files"))
    }

    fn take_rejected(&self) -> Vec<Rejected> {
        std::mem::take(&mut *self.rejected.lock().expect("rejected lines"))
    }

    fn hold_batches_in_memory(&self) {
        self.held.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    fn identity(&self) -> SourceIdentity {
        // A checkpoint of one shard must not be reused by another.
        let location = match self.options.shard {
            Some(s) => format!("{} shard {s}", self.location.url()),
            None => self.location.url().to_string(),
        };
        SourceIdentity {
            kind: "files".into(),
            location,
        }
    }

    fn backlog(&self) -> Option<Backlog> {
        let state = self.state.lock().expect("file source state");
        let (left_files, left_bytes) = match &state.pending {
            Some(p) => (p.len() as u64, p.iter().map(|f| f.size).sum()),
            None => (state.left_files, state.left_bytes),
        };
        Some(Backlog {
            done: state.done_files,
            total: state.done_files + left_files,
            bytes_done: state.done_bytes,
            bytes_total: state.done_bytes + left_bytes,
        })
    }

    async fn freeze(&self) -> Result<()> {
        let after = self.listing_offset();
        let files = self.list(after.as_deref()).await?;
        let mut state = self.state.lock().expect("file source state");
        let cutoff = state.age_cutoff(self.options.max_file_age_ms);
        let pending: VecDeque<FileEntry> = files
            .into_iter()
            .filter(|f| state.is_new(f, cutoff))
            .collect();
        state.pending = Some(pending);
        Ok(())
    }

    async fn plan(&self, start: Option<&Offset>) -> Result<Option<Offset>> {
        let count = match start {
            Some(s) => self.parse_offset(s)?.count,
            None => 0,
        };
        let frozen = self
            .state
            .lock()
            .expect("file source state")
            .pending
            .is_some();
        let listed = if frozen {
            Vec::new()
        } else {
            let after = self.listing_offset();
            self.list(after.as_deref()).await?
        };
        let mut state = self.state.lock().expect("file source state");
        let cutoff = state.age_cutoff(self.options.max_file_age_ms);
        let mut aged_out = 0usize;
        let mut candidates: VecDeque<FileEntry> = match state.pending.take() {
            Some(p) => p,
            None => listed
                .into_iter()
                .filter(|f| {
                    let new = state.is_new(f, cutoff);
                    // Counted: files never taken that the age window
                    // ignores (not the ones this source took and forgot).
                    if !new
                        && !state.seen.contains_key(&f.path)
                        && state.forgotten_before_ms.is_none_or(|b| f.mtime_ms >= b)
                    {
                        aged_out += 1;
                    }
                    new
                })
                .collect(),
        };
        if aged_out != state.aged_out_reported {
            if aged_out > state.aged_out_reported {
                tracing::warn!(
                    source = %self.name,
                    files = aged_out,
                    "listed files never read are ignored: they are older than max_file_age before the newest file taken"
                );
            }
            state.aged_out_reported = aged_out;
        }
        let mut taken = Vec::new();
        let mut bytes = 0u64;
        while let Some(f) = candidates.front() {
            if let Some(max) = self.options.max_files_per_trigger
                && taken.len() >= max
            {
                break;
            }
            if let Some(max) = self.max_bytes_per_trigger()
                && !taken.is_empty()
                && bytes + f.size > max
            {
                break;
            }
            bytes += f.size;
            taken.push(candidates.pop_front().expect("front exists"));
        }
        if frozen {
            state.pending = Some(candidates);
        } else {
            state.left_files = candidates.len() as u64;
            state.left_bytes = candidates.iter().map(|f| f.size).sum();
        }
        if taken.is_empty() {
            return Ok(None);
        }
        for f in &taken {
            state.take(f);
        }
        let cutoff = state.age_cutoff(self.options.max_file_age_ms);
        state.forget_aged(cutoff);
        let end = FilesOffset {
            count: count + taken.len() as u64,
            files: taken,
        };
        Ok(Some(serde_json::to_value(end).expect("offset serializes")))
    }

    fn read(
        &self,
        _start: Option<&Offset>,
        end: &Offset,
        partitions: usize,
    ) -> Result<Vec<BatchStream>> {
        let end = self.parse_offset(end)?;
        let splittable = self.splittable(&end.files);
        let groups = if splittable {
            split_by_bytes(end.files, partitions.max(1))
        } else {
            spread_by_size(end.files, partitions)
        };
        let local = self.local();
        // A group of pieces smaller on average than one read request.
        let chunk = decode::read_chunk(local);
        let small = |g: &[Piece]| g.iter().map(Piece::len).sum::<u64>() < chunk * g.len() as u64;
        if splittable && groups.len() > 1 && !groups.iter().any(|g| small(g)) {
            // Each partition reads its own group in order, then takes the
            // unread tail of the busiest one, so a partition slowed down
            // (by the machine, or by heavier rows) does not leave the other
            // core idle until the batch's end.
            let cut = steal_piece(local);
            let shared = Arc::new(SharedPieces {
                groups: Mutex::new(
                    groups
                        .into_iter()
                        .map(|g| {
                            cut_pieces(g, cut)
                                .into_iter()
                                .map(|p| (p.len(), self.file_stream(p)))
                                .collect()
                        })
                        .collect(),
                ),
            });
            // Each partition's first piece is its own from the start: only
            // pieces no partition has begun can change hands.
            return Ok((0..shared.partitions())
                .map(|own| {
                    let first = shared.next(own);
                    let shared = shared.clone();
                    stream::iter(
                        first
                            .into_iter()
                            .chain(std::iter::from_fn(move || shared.next(own))),
                    )
                    .flatten()
                    .boxed()
                })
                .collect());
        }
        Ok(groups
            .into_iter()
            .map(|pieces| {
                // A few small files at once: they are bound by request
                // latency, not bandwidth. A large file already overlaps its
                // requests (read-ahead), and reading several at once would
                // only multiply the memory held.
                let concurrency = if small(&pieces) {
                    self.options.read_concurrency.max(1)
                } else {
                    1
                };
                let streams: Vec<BatchStream> =
                    pieces.into_iter().map(|p| self.file_stream(p)).collect();
                stream::iter(streams).flatten_unordered(concurrency).boxed()
            })
            .collect())
    }

    fn describe(&self, start: Option<&Offset>, end: &Offset) -> String {
        let from = start
            .and_then(|s| self.parse_offset(s).ok())
            .map(|o| o.count)
            .unwrap_or(0);
        match self.parse_offset(end) {
            Ok(e) => format!("files {from}..{}", e.count),
            Err(_) => "files ?".into(),
        }
    }
}
