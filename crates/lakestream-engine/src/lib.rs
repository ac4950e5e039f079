//! The lakestream engine: runs a streaming query one micro-batch at a time,
//! exactly once, and is the public API boundary of the library.
//!
//! ```text
//!  sources ──plan──► offsets/N ──► DataFusion plan over the batch ──► sink files
//!     ▲                (write-ahead)                                     │
//!     └── recover ◄── checkpoint ◄── commits/N ◄── one Delta commit (txn = N)
//! ```
//!
//! Build a query with [`QueryBuilder`] (sources, SQL or a DataFrame, a sink,
//! a checkpoint, a trigger), or from a SQL job file with [`job::load_job`];
//! [`QueryBuilder::start`] returns a [`QueryHandle`] to watch progress, stop
//! gracefully and await the end. The engine decides the order and when a
//! batch runs again: sources plan and read, sinks write and commit (a sink
//! retries only a commit that lost the race for the table's next version),
//! the checkpoint records. [`connectors::Connectors`] turns a job's tables
//! into sources and sinks.

pub mod connectors;
pub mod dead_letter;
mod driver;
pub mod for_each;
pub mod job;
/// What each commit records of where its rows came from (the protocol's
/// lineage record and its helpers).
pub use lakestream_protocol::lineage;
pub mod metrics;
mod progress;
mod provider;
mod query;
mod stateful;
pub mod static_delta;

use std::sync::Arc;
use std::time::Duration;

use datafusion::error::DataFusionError;

pub use lakestream_job::{MAX_DURATION, parse_duration, parse_size};
pub use progress::{BatchProgress, Durations, OutputProgress, SourceProgress};
pub use query::{
    DEFAULT_MIN_BATCHES_TO_RETAIN, DEFAULT_SNAPSHOT_INTERVAL, Output, PROGRESS_EVENTS_BUFFER,
    QueryBuilder, QueryHandle, QuerySummary, StopHandle,
};
pub use stateful::{EventTime, OutputMode, StateProgress};
pub use static_delta::StaticDeltaTable;

pub use lakestream_checkpoint as checkpoint;
pub use lakestream_delta as delta;
#[cfg(feature = "kafka")]
pub use lakestream_kafka as kafka;
pub use lakestream_protocol as protocol;
pub use lakestream_sink as sink;
pub use lakestream_source as source;
pub use lakestream_state as state;
pub use lakestream_storage as storage;

/// Errors of a running query. Each says what failed and what to do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The checkpoint log failed or refused (in use, corrupt, unknown version).
    #[error(transparent)]
    Checkpoint(Box<lakestream_checkpoint::Error>),
    /// A location could not be resolved, or its store failed.
    #[error(transparent)]
    Storage(Box<lakestream_storage::Error>),
    /// A source failed: bad option, planning or start-up failure.
    #[error(transparent)]
    Source(Box<lakestream_source::Error>),
    /// A source failed while batch `batch_id` read its range: malformed
    /// input, a missing file, a broker error. The batch is not committed;
    /// a restart re-runs it with the same range.
    #[error("batch {batch_id}: {source}")]
    SourceInBatch {
        /// The batch id.
        batch_id: u64,
        /// The source's error (shared: DataFusion may have handed copies
        /// of it to several operators).
        #[source]
        source: Arc<lakestream_source::Error>,
    },
    /// A source stayed unavailable (broker unreachable, topic missing)
    /// longer than its `unavailable_timeout`.
    #[error(
        "source {source_name}: {what}: still unavailable after {waited:.1?}: {last}; check that \
         the brokers in LOCATION are reachable and the topics exist, or raise the source's \
         'unavailable_timeout'"
    )]
    SourceUnavailable {
        /// The source's table name.
        source_name: String,
        /// What was being done.
        what: String,
        /// How long the query waited.
        waited: Duration,
        /// The last error seen.
        last: Box<lakestream_source::Error>,
    },
    /// The state of a stateful query could not be read or written.
    #[error(transparent)]
    State(Box<lakestream_state::Error>),
    /// A bug in lakestream (a panicked task); not caused by the job.
    #[error("internal error: {0}")]
    Internal(String),
    /// The sink failed: schema mismatch, write or commit error.
    #[error(transparent)]
    Sink(Box<lakestream_sink::Error>),
    /// The job file is invalid.
    #[error(transparent)]
    Job(Box<lakestream_job::Error>),
    /// A connector registered by the embedding program failed building its
    /// source or sink (its own error, as it gave it).
    #[error(transparent)]
    Connector(Box<dyn std::error::Error + Send + Sync>),
    /// The query cannot run as a stream: no sink, source or SQL was
    /// given, or its shape is refused (what and why in the message).
    #[error("query: {0}")]
    InvalidQuery(String),
    /// DataFusion could not plan the query (a syntax error, an unknown
    /// column or function, a type error).
    #[error("query: {}", .0.strip_backtrace())]
    Plan(#[source] Box<DataFusionError>),
    /// DataFusion failed while running batch `batch_id` (a failed cast,
    /// a division by zero, memory exhausted). The batch is not committed.
    #[error("batch {batch_id}: query execution failed: {}", source.strip_backtrace())]
    Execution {
        /// The batch id.
        batch_id: u64,
        /// DataFusion's error.
        #[source]
        source: Box<DataFusionError>,
    },
    /// A test fail point fired (see [`FailPoint`]).
    #[error("fail point {point:?} fired at batch {batch_id}")]
    InjectedFault {
        /// Which point.
        point: FailPoint,
        /// The batch id.
        batch_id: u64,
    },
    /// The query was aborted before it finished.
    #[error("the query was aborted")]
    Aborted,
}

// The wrapped errors are boxed: they carry paths and store errors, and a
// large `Err` would bloat every `Result` on the batch path.
impl From<lakestream_checkpoint::Error> for Error {
    fn from(e: lakestream_checkpoint::Error) -> Self {
        Error::Checkpoint(Box::new(e))
    }
}
impl From<lakestream_storage::Error> for Error {
    fn from(e: lakestream_storage::Error) -> Self {
        Error::Storage(Box::new(e))
    }
}
impl From<lakestream_state::Error> for Error {
    fn from(e: lakestream_state::Error) -> Self {
        Error::State(Box::new(e))
    }
}
impl From<lakestream_source::Error> for Error {
    fn from(e: lakestream_source::Error) -> Self {
        Error::Source(Box::new(e))
    }
}
impl From<lakestream_sink::Error> for Error {
    fn from(e: lakestream_sink::Error) -> Self {
        Error::Sink(Box::new(e))
    }
}
/// A connector's own error (a store, the checkpoint) keeps its kind: only
/// errors about the job itself become [`Error::Job`].
impl From<lakestream_job::Error> for Error {
    fn from(e: lakestream_job::Error) -> Self {
        match e {
            lakestream_job::Error::Connector(e) => match e.downcast::<lakestream_source::Error>() {
                Ok(e) => Error::Source(e),
                Err(e) => match e.downcast::<lakestream_sink::Error>() {
                    Ok(e) => Error::Sink(e),
                    Err(e) => Error::Connector(e),
                },
            },
            lakestream_job::Error::Checkpoint(e) => Error::Checkpoint(e),
            lakestream_job::Error::Storage(e) => Error::Storage(e),
            e @ lakestream_job::Error::Job { .. } => Error::Job(Box::new(e)),
        }
    }
}

impl Error {
    /// True when the error is the checkpoint being held by another process.
    pub fn is_checkpoint_in_use(&self) -> bool {
        matches!(self, Error::Checkpoint(e) if matches!(**e, lakestream_checkpoint::Error::InUse { .. }))
    }

    /// True when the error is in the job or query itself (fix the job, not
    /// the environment): [`ErrorKind::User`].
    pub fn is_user_error(&self) -> bool {
        self.kind() == ErrorKind::User
    }

    /// Whose move it is: fix the job, look at the environment or input,
    /// or report a bug. The CLI's exit code follows it.
    pub fn kind(&self) -> ErrorKind {
        let user = match self {
            Error::Job(_) | Error::InvalidQuery(_) | Error::Plan(_) => true,
            Error::Sink(e) => matches!(
                **e,
                lakestream_sink::Error::SchemaMismatch { .. }
                    | lakestream_sink::Error::InvalidConfig { .. }
                    | lakestream_sink::Error::UnsupportedFeature { .. }
            ),
            Error::Source(e) => matches!(**e, lakestream_source::Error::InvalidOption { .. }),
            Error::SourceInBatch { source, .. } => {
                matches!(**source, lakestream_source::Error::InvalidOption { .. })
            }
            Error::Checkpoint(e) => {
                matches!(**e, lakestream_checkpoint::Error::QueryChanged { .. })
            }
            Error::State(e) => matches!(
                **e,
                lakestream_state::Error::Changed { .. }
                    | lakestream_state::Error::Unsupported { .. }
            ),
            _ => false,
        };
        let internal = match self {
            Error::Internal(_) => true,
            Error::State(e) => matches!(**e, lakestream_state::Error::Arrow { .. }),
            Error::Execution { source, .. } => matches!(
                source.find_root(),
                DataFusionError::Internal(_) | DataFusionError::NotImplemented(_)
            ),
            _ => false,
        };
        if user {
            ErrorKind::User
        } else if internal {
            ErrorKind::Internal
        } else {
            ErrorKind::External
        }
    }
}

/// What kind of failure an [`Error`] is, for exit codes and supervisors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The job or query is wrong (an option, the SQL, a schema that does
    /// not fit, a checkpoint made for another query): running it again
    /// fails the same way; fix the job.
    User,
    /// The environment or the input failed (a store, a broker, a malformed
    /// record, the checkpoint held by another process): the checkpoint is
    /// consistent and a restart after the cause is fixed (or gone) resumes.
    External,
    /// A bug in lakestream or a library under it: the checkpoint is
    /// consistent; please report it.
    Internal,
}

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// When batches run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Trigger {
    /// The next batch starts as soon as the previous one ends and new data
    /// is there, polling every `poll` while idle.
    #[default]
    Continuous,
    /// A batch starts every interval, when there is new data.
    Interval(Duration),
    /// Take what is available at start, in bounded batches, then stop.
    AvailableNow,
    /// Run one batch (per-trigger caps apply), then stop.
    Once,
}

impl std::str::FromStr for Trigger {
    type Err = String;

    /// `available-now`, `once`, `continuous`, or an interval such as `10s`,
    /// `500ms`, `2m`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "available-now" | "availableNow" | "available_now" => Ok(Trigger::AvailableNow),
            "once" => Ok(Trigger::Once),
            "continuous" => Ok(Trigger::Continuous),
            _ => parse_duration(s).map(Trigger::Interval).ok_or_else(|| {
                format!(
                    "invalid trigger {s:?}: use an interval like 10s, 500ms or 2m (at most a \
                     year), `available-now` or `once`"
                )
            }),
        }
    }
}

/// Points in the batch protocol where tests inject a crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailPoint {
    /// After `offsets/N` is written, before anything is read.
    AfterWriteAhead,
    /// After the batch's data files are written, before the first table
    /// commit (its dead letters' when it has any, else its first output's).
    AfterFiles,
    /// After the first table commit, before `commits/N`; in a query with
    /// several outputs (dead-letter tables first), before the next one's.
    AfterCommit,
}

impl std::str::FromStr for FailPoint {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "after-write-ahead" => Ok(Self::AfterWriteAhead),
            "after-files" => Ok(Self::AfterFiles),
            "after-commit" => Ok(Self::AfterCommit),
            _ => Err(format!(
                "unknown fail point {s:?} (after-write-ahead, after-files, after-commit)"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn odd_triggers_are_refused() {
        for s in ["soon", "400d", "-1s", "", "1e400", "99999999999999999999s"] {
            assert!(s.parse::<Trigger>().is_err(), "{s}");
        }
    }

    #[test]
    fn triggers_parse() {
        assert_eq!(
            "available-now".parse::<Trigger>(),
            Ok(Trigger::AvailableNow)
        );
        assert_eq!(
            "10s".parse::<Trigger>(),
            Ok(Trigger::Interval(Duration::from_secs(10)))
        );
        assert_eq!(
            "250ms".parse::<Trigger>(),
            Ok(Trigger::Interval(Duration::from_millis(250)))
        );
        assert!("soon".parse::<Trigger>().is_err());
    }
}
