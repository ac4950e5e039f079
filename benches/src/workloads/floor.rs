//! The raw floor: the backfill's work (decode, filter, day column, Parquet)
//! without the engine, in a process of its own.

use super::*;

/// `lakestream-bench bench-floor`: the raw floor over `input`, in this
/// process (the parent times it from spawn to exit and reads its CPU time
/// and peak RSS when it ends).
pub(crate) fn floor_process(input: &Path, out: &Path, partitioned: bool) -> anyhow::Result<()> {
    raw_limit(input, out, partitioned)
}

/// What one run of the raw floor took.
#[derive(Clone, Copy)]
pub(super) struct Floor {
    /// Spawn to exit (s).
    pub(super) wall: f64,
    /// The process's CPU seconds.
    pub(super) cpu: f64,
    /// Its peak RSS (bytes).
    pub(super) peak_rss: u64,
}

/// The raw floor over `input` in a child process (`lakestream-bench
/// bench-floor`), as the backfill runs: a fresh process, timed from spawn
/// to exit.
pub(super) fn raw_limit_process(
    input: &Path,
    out: &Path,
    partitioned: bool,
) -> anyhow::Result<Floor> {
    let start = Instant::now();
    let mut child = Command::new(std::env::current_exe()?)
        .arg("bench-floor")
        .arg(input)
        .arg(out)
        .args((!partitioned).then_some("--flat"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let err = read_all(child.stderr.take().expect("piped"));
    let m = wait_measured(&mut child)?;
    let wall = start.elapsed().as_secs_f64();
    let err = err.join().expect("stderr thread");
    if !m.status.success() {
        bail!(
            "the raw floor's process failed: {}",
            String::from_utf8_lossy(&err)
        );
    }
    Ok(Floor {
        wall,
        cpu: m.cpu_seconds,
        peak_rss: m.peak_rss,
    })
}

/// Decode the JSON files with arrow-json, filter, add the day column and
/// write snappy Parquet with the same writer settings, on 2 threads: no
/// checkpoint, no Delta, no DataFusion.
///
/// `partitioned`: as the backfill's table, each thread writes one file per
/// day instead of one per input file. A day's file stays open across input
/// files and is closed once the input has moved past that day (the bench's
/// input is in time order), so the floor holds a few days' row groups in
/// memory rather than the whole output.
pub(super) fn raw_limit(input: &Path, out: &Path, partitioned: bool) -> anyhow::Result<()> {
    std::fs::create_dir_all(out)?;
    let mut files: Vec<PathBuf> = std::fs::read_dir(input)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    files.sort();
    let schema = Arc::new(Schema::new(vec![
        Field::new("event_id", DataType::Utf8, false),
        Field::new("user_id", DataType::Int64, true),
        Field::new("event_type", DataType::Utf8, true),
        Field::new("amount", DataType::Float64, true),
        Field::new("ts", DataType::Timestamp(TimeUnit::Nanosecond, None), true),
    ]));
    let threads = std::thread::available_parallelism()?.get().min(2);
    std::thread::scope(|s| -> anyhow::Result<()> {
        let mut handles = Vec::new();
        for t in 0..threads {
            let mine: Vec<PathBuf> = files.iter().skip(t).step_by(threads).cloned().collect();
            let schema = schema.clone();
            handles.push(s.spawn(move || -> anyhow::Result<()> {
                let mut sink = RawSink::new(out, t, partitioned);
                for f in mine {
                    raw_one(&f, &mut sink, schema.clone())?;
                }
                sink.close()
            }));
        }
        for h in handles {
            h.join().expect("raw thread")?;
        }
        Ok(())
    })
}

/// Where the raw loop writes: one file per input file, or one per day.
pub(super) struct RawSink<'a> {
    pub(super) out: &'a Path,
    pub(super) thread: usize,
    pub(super) partitioned: bool,
    /// The open writers: per day (partitioned), or the current file's.
    pub(super) writers: std::collections::HashMap<i32, parquet::arrow::ArrowWriter<std::fs::File>>,
    /// Files closed so far per day (partitioned): a day seen again after
    /// its file was closed gets a new file.
    pub(super) closed: std::collections::HashMap<i32, usize>,
    /// The `fsync`s of closed files, each on a thread of its own (the
    /// engine's data files are synced in the background too).
    pub(super) syncs: Vec<std::thread::JoinHandle<std::io::Result<()>>>,
}

impl<'a> RawSink<'a> {
    fn new(out: &'a Path, thread: usize, partitioned: bool) -> Self {
        Self {
            out,
            thread,
            partitioned,
            writers: Default::default(),
            closed: Default::default(),
            syncs: Vec::new(),
        }
    }

    fn props() -> parquet::file::properties::WriterProperties {
        parquet::file::properties::WriterProperties::builder()
            .set_compression(parquet::basic::Compression::SNAPPY)
            .build()
    }

    /// Start input `name` (a file per input when not partitioned).
    fn begin(&mut self, name: &std::ffi::OsStr, schema: &Arc<Schema>) -> anyhow::Result<()> {
        if !self.partitioned {
            self.close_all()?;
            let w = parquet::arrow::ArrowWriter::try_new(
                std::fs::File::create(self.out.join(name).with_extension("parquet"))?,
                schema.clone(),
                Some(Self::props()),
            )?;
            self.writers.insert(0, w);
        }
        Ok(())
    }

    /// Write `batch`, whose last column is the day. Partitioned, the day
    /// is in the file's path and not written into it, as in the table.
    fn write(&mut self, batch: &RecordBatch) -> anyhow::Result<()> {
        if !self.partitioned {
            self.writers.get_mut(&0).expect("begun").write(batch)?;
            return Ok(());
        }
        let day = batch.column(batch.num_columns() - 1);
        let data = batch.project(&(0..batch.num_columns() - 1).collect::<Vec<_>>())?;
        let runs = arrow::compute::partition(std::slice::from_ref(day))?;
        let days = day.as_primitive::<arrow::datatypes::Date32Type>();
        for r in runs.ranges() {
            let d = days.value(r.start);
            let w = match self.writers.entry(d) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    let dir = self.out.join(format!("day={d}"));
                    std::fs::create_dir_all(&dir)?;
                    let n = self.closed.get(&d).copied().unwrap_or(0);
                    e.insert(parquet::arrow::ArrowWriter::try_new(
                        std::fs::File::create(
                            dir.join(format!("part-{}-{n}.parquet", self.thread)),
                        )?,
                        data.schema(),
                        Some(Self::props()),
                    )?)
                }
            };
            w.write(&data.slice(r.start, r.end - r.start))?;
        }
        // Days before this batch's first one are done when the input is in
        // time order (the bench's is): their files are closed now, so the
        // floor holds a few days' row groups, not the whole output.
        if let Some(first) = runs.ranges().first().map(|r| days.value(r.start)) {
            let done: Vec<i32> = self
                .writers
                .keys()
                .copied()
                .filter(|d| *d < first)
                .collect();
            for d in done {
                if let Some(w) = self.writers.remove(&d) {
                    self.finish(w)?;
                    *self.closed.entry(d).or_default() += 1;
                }
            }
        }
        Ok(())
    }

    /// Close `w`'s file and start its `fsync`.
    fn finish(&mut self, w: parquet::arrow::ArrowWriter<std::fs::File>) -> anyhow::Result<()> {
        let file = w.into_inner()?;
        self.syncs.push(std::thread::spawn(move || file.sync_all()));
        Ok(())
    }

    fn close_all(&mut self) -> anyhow::Result<()> {
        let open: Vec<_> = self.writers.drain().map(|(_, w)| w).collect();
        for w in open {
            self.finish(w)?;
        }
        Ok(())
    }

    /// Close every file and wait until all are on disk.
    fn close(mut self) -> anyhow::Result<()> {
        self.close_all()?;
        for s in self.syncs.drain(..) {
            s.join().expect("sync thread")?;
        }
        Ok(())
    }
}

pub(super) fn raw_one(
    file: &Path,
    sink: &mut RawSink<'_>,
    schema: Arc<Schema>,
) -> anyhow::Result<()> {
    let reader = arrow::json::ReaderBuilder::new(schema)
        .with_batch_size(8192)
        .build(BufReader::with_capacity(
            1 << 20,
            std::fs::File::open(file)?,
        ))?;
    let out_schema = Arc::new(Schema::new(vec![
        Field::new("event_id", DataType::Utf8, true),
        Field::new("user_id", DataType::Int64, true),
        Field::new("event_type", DataType::Utf8, true),
        Field::new("amount", DataType::Float64, true),
        Field::new(
            "ts",
            DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
            true,
        ),
        Field::new("day", DataType::Date32, true),
    ]));
    sink.begin(file.file_name().expect("file name"), &out_schema)?;
    for batch in reader {
        let batch = batch?;
        let amount = batch
            .column(3)
            .as_primitive::<arrow::datatypes::Float64Type>();
        let keep =
            arrow::compute::kernels::cmp::gt(amount, &arrow::array::Float64Array::new_scalar(0.0))?;
        let batch = arrow::compute::filter_record_batch(&batch, &keep)?;
        // The naive time is UTC: the unit is cast and the zone set, as the
        // sink does (arrow's cast to a zone converts every value).
        let ts = arrow::compute::cast(
            batch.column(4),
            &DataType::Timestamp(TimeUnit::Microsecond, None),
        )?;
        let ts = arrow::array::make_array(
            ts.to_data()
                .into_builder()
                .data_type(out_schema.field(4).data_type().clone())
                .build()?,
        );
        let day = arrow::compute::cast(batch.column(4), &DataType::Date32)?;
        let mut cols = batch.columns()[..4].to_vec();
        cols.push(ts);
        cols.push(day);
        sink.write(&RecordBatch::try_new(out_schema.clone(), cols)?)?;
    }
    Ok(())
}
