//! A fault-injecting object store under the input, the checkpoint and the
//! table: the Nth put, get or list fails (before or after doing its work) or
//! is delayed, the query fails or carries on, and a restart leaves the table
//! with every input row exactly once. A store that overwrites on create is
//! refused before anything is written.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arrow::array::AsArray;
use arrow::datatypes::{DataType, Field, Schema};
use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use lakestream::QueryBuilder;
use lakestream::delta::{DeltaSink, DeltaSinkOptions};
use lakestream::source::files::{FileFormat, FileSource, FileSourceOptions};
use lakestream::storage::StoreRegistry;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    ObjectStoreExt, PutMode, PutMultipartOptions, PutOptions, PutPayload, PutResult,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Put,
    Get,
    List,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Fail without doing the operation.
    FailBefore,
    /// Do the operation, then report a failure (a lost response).
    FailAfter,
    /// Do the operation after a pause.
    Delay,
}

#[derive(Debug, Clone, Copy)]
struct Fault {
    op: Op,
    nth: u64,
    mode: Mode,
}

/// An in-memory store that counts operations and fires one armed fault.
#[derive(Debug, Default)]
struct FaultStore {
    inner: InMemory,
    fault: Mutex<Option<Fault>>,
    puts: AtomicU64,
    gets: AtomicU64,
    lists: AtomicU64,
    /// Turn create-if-absent into overwrite (a store without conditional PUT).
    ignore_create: bool,
}

impl fmt::Display for FaultStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FaultStore")
    }
}

fn injected() -> object_store::Error {
    object_store::Error::Generic {
        store: "FaultStore",
        source: "injected fault: connection reset".into(),
    }
}

impl FaultStore {
    /// Count an operation of `op`; the armed fault's mode if it fires now.
    fn tick(&self, op: Op) -> Option<Mode> {
        let counter = match op {
            Op::Put => &self.puts,
            Op::Get => &self.gets,
            Op::List => &self.lists,
        };
        let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
        let mut fault = self.fault.lock().unwrap();
        match *fault {
            Some(f) if f.op == op && f.nth == n => {
                *fault = None;
                Some(f.mode)
            }
            _ => None,
        }
    }

    fn counts(&self) -> (u64, u64, u64) {
        (
            self.puts.load(Ordering::SeqCst),
            self.gets.load(Ordering::SeqCst),
            self.lists.load(Ordering::SeqCst),
        )
    }
}

#[async_trait]
impl ObjectStore for FaultStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        mut opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        if self.ignore_create && opts.mode == PutMode::Create {
            opts.mode = PutMode::Overwrite;
        }
        match self.tick(Op::Put) {
            Some(Mode::FailBefore) => Err(injected()),
            Some(Mode::FailAfter) => {
                self.inner.put_opts(location, payload, opts).await?;
                Err(injected())
            }
            Some(Mode::Delay) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                self.inner.put_opts(location, payload, opts).await
            }
            None => self.inner.put_opts(location, payload, opts).await,
        }
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        match self.tick(Op::Put) {
            Some(Mode::FailBefore | Mode::FailAfter) => Err(injected()),
            Some(Mode::Delay) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                self.inner.put_multipart_opts(location, opts).await
            }
            None => self.inner.put_multipart_opts(location, opts).await,
        }
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        match self.tick(Op::Get) {
            Some(Mode::FailBefore) => Err(injected()),
            Some(Mode::FailAfter) => {
                self.inner.get_opts(location, options).await?;
                Err(injected())
            }
            Some(Mode::Delay) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                self.inner.get_opts(location, options).await
            }
            None => self.inner.get_opts(location, options).await,
        }
    }

    async fn get_ranges(
        &self,
        location: &Path,
        ranges: &[Range<u64>],
    ) -> object_store::Result<Vec<Bytes>> {
        match self.tick(Op::Get) {
            Some(Mode::FailBefore | Mode::FailAfter) => Err(injected()),
            Some(Mode::Delay) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                self.inner.get_ranges(location, ranges).await
            }
            None => self.inner.get_ranges(location, ranges).await,
        }
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.faulty_list(self.inner.list(prefix))
    }

    fn list_with_offset(
        &self,
        prefix: Option<&Path>,
        offset: &Path,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.faulty_list(self.inner.list_with_offset(prefix, offset))
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        match self.tick(Op::List) {
            Some(Mode::FailBefore | Mode::FailAfter) => Err(injected()),
            Some(Mode::Delay) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                self.inner.list_with_delimiter(prefix).await
            }
            None => self.inner.list_with_delimiter(prefix).await,
        }
    }

    async fn copy_opts(
        &self,
        from: &Path,
        to: &Path,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

impl FaultStore {
    fn faulty_list(
        &self,
        inner: BoxStream<'static, object_store::Result<ObjectMeta>>,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        match self.tick(Op::List) {
            // Fail part-way: the first entry arrives, then the error.
            Some(Mode::FailBefore | Mode::FailAfter) => inner
                .take(1)
                .chain(futures::stream::once(async { Err(injected()) }))
                .boxed(),
            Some(Mode::Delay) => {
                futures::stream::once(tokio::time::sleep(Duration::from_millis(200)))
                    .flat_map(move |()| futures::stream::empty())
                    .chain(inner)
                    .boxed()
            }
            None => inner,
        }
    }
}

const FILES: usize = 4;
const ROWS: usize = 25;

/// A bucket served by a fresh fault store, holding the input files.
async fn bucket(name: &str, ignore_create: bool) -> (String, Arc<FaultStore>) {
    let store = Arc::new(FaultStore {
        ignore_create,
        ..Default::default()
    });
    let url = format!("s3://{name}/");
    for f in 0..FILES {
        let body: String = (0..ROWS)
            .map(|r| format!("{{\"id\": {}, \"name\": \"n{r}\"}}\n", f * ROWS + r))
            .collect();
        store
            .inner
            .put(
                &Path::from(format!("input/part-{f:03}.json")),
                PutPayload::from(body),
            )
            .await
            .unwrap();
        // Distinct modification times keep the read order fixed.
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    (url, store)
}

/// A registry serving the bucket at `url` with `store`.
fn stores(url: &str, store: &Arc<FaultStore>) -> StoreRegistry {
    let stores = StoreRegistry::default();
    stores.register(&url::Url::parse(url).unwrap(), store.clone());
    stores
}

/// The backfill of the bucket at `url`, its every location served by `store`.
fn query(url: &str, store: &Arc<FaultStore>) -> QueryBuilder {
    let stores = stores(url, store);
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, true),
        Field::new("name", DataType::Utf8, true),
    ]));
    let mut opts = FileSourceOptions::new(FileFormat::Json);
    opts.max_files_per_trigger = Some(1);
    opts.object_stores = stores.clone();
    let source = FileSource::try_new(
        "events",
        &format!("{url}input/"),
        &Default::default(),
        schema,
        opts,
    )
    .unwrap();
    let sink = DeltaSink::try_new(
        &format!("{url}table/"),
        DeltaSinkOptions {
            object_stores: stores.clone(),
            ..Default::default()
        },
    )
    .unwrap();
    QueryBuilder::new()
        .source(Arc::new(source))
        .unwrap()
        .sql("SELECT id, name FROM events")
        .sink(Arc::new(sink))
        .checkpoint(format!("{url}ckpt/"))
        .object_stores(stores)
        .trigger(lakestream::Trigger::AvailableNow)
}

/// How many times each id is in the table at `url`table/.
async fn id_counts(url: &str, store: &Arc<FaultStore>) -> BTreeMap<i64, usize> {
    let loc = lakestream::storage::Location::parse_with(
        &format!("{url}table/"),
        &Default::default(),
        &stores(url, store),
    )
    .unwrap();
    let table = lakestream::delta::load_table(&loc)
        .await
        .unwrap()
        .expect("a table");
    let ctx = datafusion::prelude::SessionContext::new();
    table.update_datafusion_session(&ctx.state()).unwrap();
    ctx.register_table("t", table.table_provider().await.unwrap())
        .unwrap();
    let batches = ctx
        .sql("SELECT id FROM t")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let mut counts = BTreeMap::new();
    for b in &batches {
        for id in b
            .column(0)
            .as_primitive::<arrow::datatypes::Int64Type>()
            .values()
        {
            *counts.entry(*id).or_default() += 1;
        }
    }
    counts
}

#[tokio::test]
async fn store_faults_at_any_operation_lose_and_double_nothing() {
    // A clean run: how many puts, gets and lists one backfill makes.
    let (url, store) = bucket("faults-clean", false).await;
    let summary = query(&url, &store).run().await.unwrap();
    assert_eq!(summary.batches, FILES as u64);
    let expected: BTreeMap<i64, usize> = (0..(FILES * ROWS) as i64).map(|i| (i, 1)).collect();
    assert_eq!(id_counts(&url, &store).await, expected);
    let (puts, gets, lists) = store.counts();
    assert!(puts > 10 && gets > 5 && lists > 2, "{puts} {gets} {lists}");

    // At most 8 positions per operation, spread over the clean run's count.
    let positions = |total: u64| -> Vec<u64> {
        let step = total.div_ceil(8).max(1);
        (1..=total).step_by(step as usize).collect()
    };
    let mut scenarios = Vec::new();
    for (op, total) in [(Op::Put, puts), (Op::Get, gets), (Op::List, lists)] {
        for nth in positions(total) {
            for mode in [Mode::FailBefore, Mode::FailAfter, Mode::Delay] {
                scenarios.push(Fault { op, nth, mode });
            }
        }
    }
    let mut failed_runs = 0;
    for (i, fault) in scenarios.iter().enumerate() {
        let (url, store) = bucket(&format!("faults-{i}"), false).await;
        *store.fault.lock().unwrap() = Some(*fault);
        let mut done = false;
        // The faulty run, then at most two clean restarts.
        for attempt in 0..3 {
            if attempt > 0 {
                // The restarts run on a healthy store.
                *store.fault.lock().unwrap() = None;
            }
            match tokio::time::timeout(Duration::from_secs(60), query(&url, &store).run())
                .await
                .expect("a run finishes")
            {
                Ok(_) => {
                    done = true;
                    break;
                }
                Err(e) => {
                    eprintln!("{fault:?}: run {attempt} failed: {e}");
                    failed_runs += 1;
                    assert_eq!(attempt, 0, "{fault:?}: a clean restart failed: {e}");
                    let text = e.to_string();
                    assert!(text.contains("injected fault"), "{fault:?}: {text}");
                }
            }
        }
        assert!(done, "{fault:?}: never finished");
        // A fault that never fired (the faulty run took another path) must
        // not hit the reader.
        *store.fault.lock().unwrap() = None;
        assert_eq!(id_counts(&url, &store).await, expected, "{fault:?}");
    }
    // Failures before the work must surface somewhere (not all retried away).
    assert!(failed_runs > 0, "no injected fault failed a run");
}

#[tokio::test]
async fn a_store_that_overwrites_on_create_is_refused() {
    let (url, store) = bucket("no-conditional-put", true).await;
    let err = query(&url, &store).run().await.unwrap_err().to_string();
    assert!(
        err.contains("atomic create-if-absent") && err.contains("no-conditional-put"),
        "{err}"
    );
    // Nothing but the probe was written, and the probe is gone.
    let left: Vec<_> = store
        .inner
        .list(None)
        .map(|m| m.unwrap().location.to_string())
        .filter(|p| futures::future::ready(!p.starts_with("input/")))
        .collect()
        .await;
    assert!(left.is_empty(), "{left:?}");
}

#[tokio::test]
async fn each_query_reaches_a_bucket_through_its_own_stores() {
    // Two stores for one bucket name, as two tenants of one service would
    // have: each query writes through the store it was handed.
    let (url, first) = bucket("tenant", false).await;
    let (_, second) = bucket("tenant", false).await;
    query(&url, &first).run().await.unwrap();
    let expected: BTreeMap<i64, usize> = (0..(FILES * ROWS) as i64).map(|i| (i, 1)).collect();
    assert_eq!(id_counts(&url, &first).await, expected);
    let written = |store: &Arc<FaultStore>| {
        let inner = store.inner.clone();
        async move {
            inner
                .list(None)
                .map(|m| m.unwrap().location.to_string())
                .filter(|p| futures::future::ready(!p.starts_with("input/")))
                .count()
                .await
        }
    };
    assert!(written(&first).await > 0);
    assert_eq!(
        written(&second).await,
        0,
        "the other tenant's store was written"
    );
    query(&url, &second).run().await.unwrap();
    assert_eq!(id_counts(&url, &second).await, expected);
}

#[tokio::test]
async fn a_job_files_every_location_goes_through_the_run_stores() {
    // An inferred-schema file stream, a static table, the output, its dead
    // letters and the checkpoint, all in one bucket no real store serves.
    let (url, store) = bucket("job-stores", false).await;
    // A static table, and a file that is not JSON, read last: its line
    // goes to the dead letters.
    for (path, body) in [
        ("names/part-0.csv", "id,label\n0,zero\n99,last\n"),
        ("input/part-zzz.json", "not json\n"),
    ] {
        tokio::time::sleep(Duration::from_millis(3)).await;
        let body = PutPayload::from(body.to_string());
        store.inner.put(&Path::from(path), body).await.unwrap();
    }
    let job = format!(
        "CREATE UNBOUNDED EXTERNAL TABLE events STORED AS JSON LOCATION '{url}input/'\n\
         OPTIONS ('on_error' 'dead_letter', 'dead_letter_location' '{url}dead/',\n\
                  'max_files_per_trigger' '1');\n\
         CREATE EXTERNAL TABLE names STORED AS CSV LOCATION '{url}names/' \
         OPTIONS ('format.has_header' 'true');\n\
         CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION '{url}table/';\n\
         INSERT INTO out SELECT e.id, e.name FROM events e LEFT JOIN names n ON e.id = n.id;\n"
    );
    let mut options = lakestream::job::JobOptions::new(format!("{url}ckpt/"));
    options.trigger = lakestream::Trigger::AvailableNow;
    options.object_stores = stores(&url, &store);
    let summary = lakestream::job::load_job("job.sql", &job, &options)
        .await
        .unwrap()
        .run()
        .await
        .unwrap();
    assert_eq!(summary.batches, FILES as u64 + 1);
    let expected: BTreeMap<i64, usize> = (0..(FILES * ROWS) as i64).map(|i| (i, 1)).collect();
    assert_eq!(id_counts(&url, &store).await, expected);
    let dead = store
        .inner
        .list(Some(&Path::from("dead/_delta_log")))
        .count()
        .await;
    assert!(dead > 0, "no dead-letter table in the bucket");
    // The inferred schema is kept in the checkpoint in that bucket.
    let kept = store
        .inner
        .get(&Path::from("ckpt/sources/events/schema"))
        .await;
    assert!(kept.is_ok(), "{kept:?}");
}
