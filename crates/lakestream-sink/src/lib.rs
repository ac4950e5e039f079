//! Sinks of a lakestream query: where each micro-batch's output goes, at most
//! once per batch id.
//!
//! A [`Sink`] writes a batch in two steps. [`Sink::begin`] returns a
//! [`BatchWriter`] that streams record batches into new, invisible files;
//! [`Sink::commit`] then makes them visible in one atomic step that also
//! records the batch id, unless the sink already holds that batch id for this
//! query, in which case nothing is committed ([`CommitOutcome::AlreadyCommitted`]).
//!
//! ```text
//!   begin(N) ─► write(batch)* ─► finish() ─► commit(staged, N)
//!                (files, invisible)             (one Delta commit: adds + txn(query id, N))
//! ```
//!
//! The sink sees a batch id and record batches, never source offsets; the
//! only retry it makes on its own is a table format's optimistic-concurrency
//! rebase over other writers' commits (Delta's).
//!
//! This crate holds the interface, the [`SinkConnector`] factory a sink is
//! registered by, and [`memory::MemorySink`] (batches kept in memory, for
//! tests and embedders who consume the output themselves). The Delta Lake
//! sink is `lakestream-delta`'s.

mod connector;
pub mod memory;

pub use connector::SinkConnector;

use std::any::Any;
use std::collections::BTreeMap;

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use async_trait::async_trait;

/// Errors of the sinks.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The query's output does not fit the existing table.
    #[error(
        "table {table}: the query's output does not match the table's schema: {reason}; \
         change the query, or write to a new table"
    )]
    SchemaMismatch {
        /// The table location.
        table: String,
        /// What differs.
        reason: String,
    },
    /// The sink was configured wrongly.
    #[error("table {table}: {reason}")]
    InvalidConfig {
        /// The table location.
        table: String,
        /// What is wrong.
        reason: String,
    },
    /// Writing data files failed.
    #[error("table {table}: writing batch {batch_id} failed: {source}")]
    Write {
        /// The table location.
        table: String,
        /// The batch id.
        batch_id: u64,
        /// The underlying error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The atomic commit failed; the batch is not in the table and may be
    /// retried.
    #[error("table {table}: committing batch {batch_id} failed: {source}")]
    Commit {
        /// The table location.
        table: String,
        /// The batch id.
        batch_id: u64,
        /// The underlying error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Opening, creating or reading the table failed.
    #[error("table {table}: {source}")]
    Table {
        /// The table location.
        table: String,
        /// The underlying error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The table has a feature (or a property) this writer cannot keep:
    /// refused before any batch, since writing would break the table's
    /// rules for its other readers and writers.
    #[error("table {table}: table feature {feature} is not supported by this writer: {reason}")]
    UnsupportedFeature {
        /// The table location.
        table: String,
        /// The feature's protocol name (or the property's key).
        feature: String,
        /// Why, and what to do.
        reason: String,
    },
    /// Rows of batch `batch_id` break a rule of the table (a CHECK
    /// constraint, a NOT NULL column, an invariant, a generated column)
    /// and the query has no dead-letter table to take them: nothing of the
    /// batch is committed.
    #[error(
        "table {table}: batch {batch_id}: {rows} row(s) violate {rule}; the first: {row}; \
         nothing of the batch was committed: fix the query or the input, or give the source \
         OPTIONS ('on_error' 'dead_letter') to set such rows aside"
    )]
    ConstraintViolation {
        /// The table location.
        table: String,
        /// The batch id.
        batch_id: u64,
        /// The rule, with its expression.
        rule: String,
        /// How many rows break it (and no earlier rule).
        rows: usize,
        /// The first violating row's values, as JSON.
        row: String,
    },
    /// The table's location or store failed.
    #[error("sink: {0}")]
    Storage(#[from] lakestream_storage::Error),
}

pub use lakestream_job::describe_schema;

/// Whether two schemas have the same column names and types, in order
/// (nullability aside).
pub fn same_columns(a: &arrow::datatypes::Schema, b: &arrow::datatypes::Schema) -> bool {
    a.fields().len() == b.fields().len()
        && a.fields()
            .iter()
            .zip(b.fields())
            .all(|(x, y)| x.name() == y.name() && x.data_type() == y.data_type())
}

/// What kind of rule a row broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleKind {
    /// A column declared NOT NULL held NULL.
    NotNull,
    /// A generated column's value differs from its expression.
    Generated,
    /// A column invariant (`delta.invariants`) is false or NULL.
    Invariant,
    /// A CHECK constraint is false or NULL.
    Check,
}

impl std::fmt::Display for RuleKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RuleKind::NotNull => "NOT NULL constraint",
            RuleKind::Generated => "generated column",
            RuleKind::Invariant => "invariant",
            RuleKind::Check => "CHECK constraint",
        })
    }
}

/// Rows of a batch that break one of the table's rules.
#[derive(Debug, Clone)]
pub struct Violation {
    /// The table's URL.
    pub table: String,
    /// The kind of rule.
    pub kind: RuleKind,
    /// The rule's name: the constraint's name, or the column it governs.
    pub name: String,
    /// The rule's expression as the table states it.
    pub expression: String,
    /// The rows, with the table's columns.
    pub rows: RecordBatch,
}

impl Violation {
    /// `CHECK constraint amount_pos (amount > 0)`: the rule, for messages
    /// and dead-letter rows.
    pub fn rule(&self) -> String {
        match self.kind {
            RuleKind::NotNull => format!("NOT NULL constraint on column {}", self.name),
            RuleKind::Generated => format!(
                "generated column {} (GENERATED ALWAYS AS ({}))",
                self.name, self.expression
            ),
            kind => format!("{kind} {} ({})", self.name, self.expression),
        }
    }

    /// Row `i` as a JSON object of its columns (what a dead-letter row
    /// records, and what an error shows).
    pub fn row_json(&self, i: usize) -> String {
        let row = self.rows.slice(i, 1);
        let mut out = Vec::new();
        {
            let mut w = arrow::json::LineDelimitedWriter::new(&mut out);
            if w.write(&row).and_then(|_| w.finish()).is_err() {
                return "(the row cannot be shown as JSON)".into();
            }
        }
        String::from_utf8_lossy(&out).trim_end().to_string()
    }
}

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// How a batch's rows change the table.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum WriteMode {
    /// Add the rows (stateless queries; aggregations in append mode).
    #[default]
    Append,
    /// Replace every row of the table by the batch's (aggregations in
    /// complete mode).
    ReplaceAll {
        /// The columns that name a row (the group keys), when the output
        /// carries them all (empty: one row, a global aggregate). A table
        /// with a change data feed then records the rows that changed as
        /// updates, instead of every row as deleted and inserted again.
        keys: Option<Vec<String>>,
    },
    /// Update the rows whose `keys` columns equal a batch row's (NULLs
    /// equal), insert the others (aggregations in update mode).
    Upsert {
        /// The key columns.
        keys: Vec<String>,
    },
}

/// What a commit carries besides the data: who commits which batch.
#[derive(Debug, Clone)]
pub struct CommitInfo {
    /// The query id: the table's transaction app id.
    pub query_id: String,
    /// The batch id: the transaction version.
    pub batch_id: u64,
    /// Extra metadata recorded with the commit (source ranges, engine
    /// version), as a JSON object.
    pub metadata: serde_json::Map<String, serde_json::Value>,
    /// How the rows change the table.
    pub write: WriteMode,
    /// Source positions this commit moves forward in the table (Kafka
    /// group mode): each claim's `app_id` must be at `from` in the table
    /// (or absent) when the commit lands, and is at `to` after it, in the
    /// same atomic commit as the rows. Empty for sources whose positions
    /// live in the checkpoint.
    pub claims: Vec<PositionClaim>,
}

pub use lakestream_protocol::PositionClaim;

/// What the writers of a batch produced, not yet visible: counts the
/// engine reports, and each writer's sink-specific part (the Delta sink's
/// `add` actions, the memory sink's record batches), which only the sink
/// that made it reads back in [`Sink::commit`].
pub struct Staged {
    /// The batch id they belong to.
    pub batch_id: u64,
    /// Rows written.
    pub rows: u64,
    /// Files written.
    pub files: usize,
    /// Bytes written.
    pub bytes: u64,
    /// Rows that break a rule of the table and were not written; the
    /// engine hands them to a dead-letter table
    /// ([`Staged::take_violations`]), and [`Sink::commit`] refuses a
    /// batch that still holds any.
    pub violations: Vec<Violation>,
    parts: Vec<Box<dyn Any + Send>>,
}

impl std::fmt::Debug for Staged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Staged")
            .field("batch_id", &self.batch_id)
            .field("rows", &self.rows)
            .field("files", &self.files)
            .field("bytes", &self.bytes)
            .field("violations", &self.violations.len())
            .field("parts", &self.parts.len())
            .finish()
    }
}

impl Staged {
    /// One writer's output of batch `batch_id`: its counts and its
    /// sink-specific `part`.
    pub fn new<T: Any + Send>(batch_id: u64, rows: u64, files: usize, bytes: u64, part: T) -> Self {
        Self {
            batch_id,
            rows,
            files,
            bytes,
            violations: Vec::new(),
            parts: vec![Box::new(part)],
        }
    }

    /// With the rows that break the table's rules.
    pub fn with_violations(mut self, violations: Vec<Violation>) -> Self {
        self.violations = violations;
        self
    }

    /// Take the rows that break the table's rules out of the batch (to
    /// set them aside): the batch can then be committed without them.
    pub fn take_violations(&mut self) -> Vec<Violation> {
        std::mem::take(&mut self.violations)
    }

    /// [`Error::ConstraintViolation`] for the first rule the batch's rows
    /// break, if any row does.
    pub fn check_violations(&self) -> Result<()> {
        match self.violations.first() {
            Some(v) => Err(Error::ConstraintViolation {
                table: v.table.clone(),
                batch_id: self.batch_id,
                rule: v.rule(),
                rows: self
                    .violations
                    .iter()
                    .filter(|o| o.kind == v.kind && o.name == v.name)
                    .map(|o| o.rows.num_rows())
                    .sum(),
                row: v.row_json(0),
            }),
            None => Ok(()),
        }
    }

    /// Combine the output of two writers of the same batch, for one commit.
    pub fn merge(mut self, other: Staged) -> Staged {
        debug_assert_eq!(self.batch_id, other.batch_id);
        self.rows += other.rows;
        self.files += other.files;
        self.bytes += other.bytes;
        self.violations.extend(other.violations);
        self.parts.extend(other.parts);
        self
    }

    /// The writers' parts, as the sink that made them (type `T`) wrote
    /// them; [`Error::InvalidConfig`] naming `table` when a part came from
    /// another kind of sink (a caller mixed sinks up).
    pub fn into_parts<T: Any>(self, table: &str) -> Result<Vec<T>> {
        let batch_id = self.batch_id;
        self.parts
            .into_iter()
            .map(|p| {
                p.downcast::<T>()
                    .map(|p| *p)
                    .map_err(|_| Error::InvalidConfig {
                        table: table.to_string(),
                        reason: format!(
                            "batch {} was staged by another kind of sink; commit it with the \
                             sink that wrote it",
                            batch_id
                        ),
                    })
            })
            .collect()
    }
}

/// The result of [`Sink::commit`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommitOutcome {
    /// The batch is now in the table, at this table version.
    Committed {
        /// The new table version.
        version: u64,
    },
    /// The table already held this batch id for this query (a replay after a
    /// crash); the staged files were not committed and are orphans.
    AlreadyCommitted {
        /// The table version seen.
        version: u64,
    },
    /// Another writer moved a claimed position first
    /// ([`CommitInfo::claims`]): the batch was not committed and must not
    /// be retried as is (its range was read, or is being read, by the
    /// other writer); plan again from the table's positions.
    Superseded {
        /// The table version seen.
        version: u64,
        /// The claim's app id.
        app_id: String,
        /// The position the batch started at.
        expected: i64,
        /// The position the table holds.
        found: i64,
    },
}

impl CommitOutcome {
    /// The table version after the call.
    pub fn version(&self) -> u64 {
        match self {
            Self::Committed { version }
            | Self::AlreadyCommitted { version }
            | Self::Superseded { version, .. } => *version,
        }
    }
}

/// Streams one batch's output into new files.
#[async_trait]
pub trait BatchWriter: Send {
    /// Write one record batch (with the schema given to [`Sink::open`]).
    /// An error leaves the batch unusable: drop the writer; nothing is
    /// visible.
    async fn write(&mut self, batch: RecordBatch) -> Result<()>;

    /// Close the files. They stay invisible until [`Sink::commit`].
    async fn finish(self: Box<Self>) -> Result<Staged>;
}

/// A sink whose commit is idempotent per (query id, batch id).
#[async_trait]
pub trait Sink: Send + Sync {
    /// Prepare for output with `schema`: create the target when absent, or
    /// check that it accepts this schema ([`Error::SchemaMismatch`] if not).
    /// Called once before any batch; writes nothing when it fails.
    async fn open(&self, schema: SchemaRef) -> Result<()>;

    /// Whether the target accepts batches changing it as `write` says
    /// (an append-only table refuses the rewrites of the update and
    /// complete modes). Called once after [`Sink::open`], before any
    /// batch; an error stops the query before it reads anything. The
    /// default accepts every mode.
    async fn accepts(&self, write: &WriteMode) -> Result<()> {
        let _ = write;
        Ok(())
    }

    /// The highest batch id committed by `query_id`, if any. Reads the latest
    /// table state.
    async fn committed_batch(&self, query_id: &str) -> Result<Option<u64>>;

    /// Start writing batch `batch_id`. May be called several times for one
    /// batch (one writer per output partition, running in parallel); their
    /// [`Staged`] results are merged and committed once.
    async fn begin(&self, batch_id: u64) -> Result<Box<dyn BatchWriter>>;

    /// Atomically make `staged` visible (added to the table, or replacing
    /// its rows, as `info.write` says), recording `info.batch_id` for
    /// `info.query_id`. If the table already holds a batch id `>=` this one
    /// for the query, commits nothing and returns
    /// [`CommitOutcome::AlreadyCommitted`]. Durable when it returns `Ok`.
    ///
    /// An error does not say whether the batch is in the table: a commit
    /// whose request reached the store but whose answer was lost may have
    /// landed. Either way re-running the batch is safe, since the re-run's
    /// commit finds the batch id and commits nothing; callers must not
    /// assume the batch is absent.
    async fn commit(&self, staged: Staged, info: &CommitInfo) -> Result<CommitOutcome>;

    /// Wait for the work the sink does off the batch path (a Delta
    /// checkpoint being written). Called when a query stops; a process that
    /// dies instead loses only that work. Failures are the sink's to log.
    async fn flush(&self) {}

    /// Commits since this sink was created that found the version they
    /// tried taken by another writer and were retried (the default: the
    /// sink never retries). Reported as `lakestream_commit_retries_total`.
    fn commit_retries(&self) -> u64 {
        0
    }

    /// The positions recorded in the latest table state for `app_ids`
    /// ([`PositionClaim`]), read fresh (another writer may have moved
    /// them); app ids never written are absent from the map.
    /// [`Error::InvalidConfig`] from sinks that cannot keep positions (the
    /// default).
    async fn positions(&self, app_ids: &[String]) -> Result<BTreeMap<String, i64>> {
        let _ = app_ids;
        Err(Error::InvalidConfig {
            table: self.identity(),
            reason: "this sink cannot keep source positions (Kafka group mode needs a Delta \
                     table or a memory sink as its output)"
                .into(),
        })
    }

    /// What the sink writes to (a table URL, never credentials), recorded in
    /// the checkpoint when a query first runs: a restart writing elsewhere
    /// is refused, since the new target would not hold the batches the
    /// checkpoint marks done.
    fn identity(&self) -> String;

    /// The newest table version the sink has seen (at its open, its last
    /// commit or [`Sink::committed_batch`]; loaded when the sink has not
    /// looked yet), if the sink has versions. Another writer's later
    /// commits may be missing: this is not a fresh read of the table.
    async fn version(&self) -> Result<Option<u64>> {
        Ok(None)
    }
}
