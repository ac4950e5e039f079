//! Static Delta tables in a streaming query (a dimension table joined by
//! every batch): each batch reads the version of the table its write-ahead
//! recorded.
//!
//! ```text
//!  plan batch N ── latest version of `users` (or the pinned one) ──► offsets/N {"tables": {"users": 7}}
//!  execute N    ── TableVersions {"users": 7} in the session ──► StaticDeltaTable::scan reads version 7
//! ```
//!
//! As Spark does with a static Delta table, a stream joins the table as it
//! is when each batch is planned, so updates to a dimension table reach the
//! next batches without a restart. The version is fixed in `offsets/N`
//! before anything is read, so a replay of N after a crash joins the same
//! rows as the first attempt. With a pinned version every batch joins that
//! one.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use datafusion::catalog::Session;
use datafusion::datasource::{TableProvider, TableType};
use datafusion::error::{DataFusionError, Result as DfResult};
use datafusion::logical_expr::Expr;
use datafusion::physical_plan::ExecutionPlan;
use deltalake::DeltaTable;
use lakestream_storage::Location;

use crate::{Error, Result};

/// The version each static Delta table (by name) is read at in one batch:
/// a `SessionConfig` extension of the batch's session.
#[derive(Debug, Default)]
pub(crate) struct TableVersions(pub(crate) BTreeMap<String, u64>);

/// A Delta table joined by a streaming query, read at the version the
/// batch's write-ahead names (see the module docs). Register it with
/// [`crate::QueryBuilder::static_delta_table`].
pub struct StaticDeltaTable {
    name: String,
    location: Location,
    /// Every batch reads this version, when set.
    pinned: Option<u64>,
    /// The table's columns as of the query's start; each batch reads them
    /// by name from its version (see [`StaticDeltaTable::project`]).
    schema: SchemaRef,
    /// The version read when no batch names one (planning at start).
    start_version: u64,
    /// The table's log, asked for its latest version as each batch is
    /// planned.
    log_store: deltalake::logstore::LogStoreRef,
    /// The version last loaded, with its provider.
    loaded: tokio::sync::Mutex<(u64, Arc<dyn TableProvider>)>,
}

impl std::fmt::Debug for StaticDeltaTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StaticDeltaTable")
            .field("name", &self.name)
            .field("location", &self.location.url().as_str())
            .field("pinned", &self.pinned)
            .finish_non_exhaustive()
    }
}

/// Load the table at `location` as of `version` (the latest when `None`).
async fn load(location: &Location, version: Option<u64>) -> Result<DeltaTable, String> {
    let mut table = lakestream_delta::open_table(location).map_err(|e| e.to_string())?;
    match version {
        Some(v) => table.load_version(v).await,
        None => table.load().await,
    }
    .map_err(|e| e.to_string())?;
    Ok(table)
}

impl StaticDeltaTable {
    /// The Delta table at `location`, known to the query as `name`, read
    /// at `pinned` by every batch when set, else at its latest version as
    /// each batch is planned. Loads the table (its schema comes from the
    /// pinned or latest version).
    pub async fn open(
        name: &str,
        location: Location,
        pinned: Option<u64>,
        ctx: &datafusion::prelude::SessionContext,
    ) -> Result<Arc<Self>> {
        let err = |what: String| {
            Error::InvalidQuery(format!("static table {name} ({}): {what}", location.url()))
        };
        let table = load(&location, pinned).await.map_err(|e| match pinned {
            Some(v) => err(format!("cannot load version {v}: {e}")),
            None => err(format!("cannot load the Delta table: {e}")),
        })?;
        let start_version = table
            .version()
            .ok_or_else(|| err("there is no Delta table there".into()))?;
        table
            .update_datafusion_session(&ctx.state())
            .map_err(|e| err(e.to_string()))?;
        let provider = table
            .table_provider()
            .await
            .map_err(|e| err(e.strip_backtrace()))?;
        Ok(Arc::new(Self {
            name: name.to_string(),
            schema: provider.schema(),
            log_store: table.log_store(),
            location,
            pinned,
            start_version,
            loaded: tokio::sync::Mutex::new((start_version, provider)),
        }))
    }

    /// The name the query knows the table by.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The version the next batch reads: the pinned one, else the latest.
    pub(crate) async fn version_for_batch(&self) -> Result<u64> {
        if let Some(v) = self.pinned {
            return Ok(v);
        }
        let known = self.loaded.lock().await.0;
        self.log_store.get_latest_version(known).await.map_err(|e| {
            Error::Sink(Box::new(lakestream_sink::Error::Table {
                table: self.location.url().to_string(),
                source: Box::new(e),
            }))
        })
    }

    /// The table's provider as of `version`, loaded when it is not the one
    /// held.
    async fn at(&self, version: u64) -> DfResult<Arc<dyn TableProvider>> {
        let mut loaded = self.loaded.lock().await;
        if loaded.0 != version {
            let table = load(&self.location, Some(version)).await.map_err(|e| {
                DataFusionError::Execution(format!(
                    "static table {}: cannot load version {version}: {e}",
                    self.name
                ))
            })?;
            *loaded = (version, table.table_provider().await?);
        }
        Ok(loaded.1.clone())
    }

    /// The columns of `provider` (the table at `version`) that the query's
    /// `projection` of the start schema names, by name: a version may have
    /// columns added, or in another order, and a replay reads an older
    /// version than the query was planned with. A column the query uses
    /// that the version lacks, or has with another type, fails the batch.
    fn project(
        &self,
        provider: &dyn TableProvider,
        version: u64,
        projection: Option<&Vec<usize>>,
    ) -> DfResult<Vec<usize>> {
        let theirs = provider.schema();
        let wanted: Vec<usize> = match projection {
            Some(p) => p.clone(),
            None => (0..self.schema.fields().len()).collect(),
        };
        wanted
            .iter()
            .map(|&i| {
                let field = self.schema.field(i);
                let differs = |what: String| {
                    DataFusionError::Execution(format!(
                        "static table {} ({}): version {version} {what}, which the query \
                         planned against version {} uses; restart the query to plan it \
                         against the table's columns now",
                        self.name,
                        self.location.url(),
                        self.start_version
                    ))
                };
                let j = theirs
                    .index_of(field.name())
                    .map_err(|_| differs(format!("has no column {}", field.name())))?;
                let got = theirs.field(j).data_type();
                if got != field.data_type() {
                    return Err(differs(format!(
                        "has column {} as {got}, not {}",
                        field.name(),
                        field.data_type()
                    )));
                }
                Ok(j)
            })
            .collect()
    }
}

#[async_trait]
impl TableProvider for StaticDeltaTable {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let version = state
            .config()
            .get_extension::<TableVersions>()
            .and_then(|v| v.0.get(&self.name).copied())
            .unwrap_or(self.start_version);
        let provider = self.at(version).await?;
        let projection = self.project(provider.as_ref(), version, projection)?;
        provider
            .scan(state, Some(&projection), filters, limit)
            .await
    }
}

/// `STORED AS DELTA` on a static table: a [`StaticDeltaTable`], read at
/// each batch's recorded version, or at `version` when the table sets it.
#[derive(Debug, Default)]
pub struct StaticDeltaConnector;

#[async_trait]
impl crate::connectors::StaticConnector for StaticDeltaConnector {
    fn options(&self) -> &'static [&'static str] {
        &["version"]
    }

    async fn add(
        &self,
        ctx: &crate::connectors::TableContext<'_>,
        builder: crate::QueryBuilder,
    ) -> Result<crate::QueryBuilder> {
        let t = ctx.table();
        let pinned = match ctx.option("version") {
            Some(v) => Some(v.trim().parse::<u64>().map_err(|_| {
                ctx.error(format!(
                    "option version of {}: {v:?} is not a table version (a whole number)",
                    t.name
                ))
            })?),
            None => None,
        };
        let location =
            Location::parse_with(&t.location, &ctx.store_options(), ctx.object_stores())?;
        let table = StaticDeltaTable::open(&t.name, location, pinned, builder.context())
            .await
            .map_err(|e| ctx.error(e.to_string()))?;
        builder.static_delta_table(table)
    }
}
