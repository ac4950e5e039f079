//! Storage for lakestream: where every location (stream sources, static
//! tables, the output table, the checkpoint) is turned into an object store.
//!
//! This crate owns:
//! - [`Location`]: a plain path, a `file://` URL or an `s3://`, `gs://`,
//!   `az://` URL parsed into a store and a root path, with credentials from
//!   the environment and storage options, never shown in errors or logs;
//! - [`StoreRegistry`]: an embedder's own stores for some buckets, scoped
//!   to the queries it is handed to;
//! - [`Location::verify_atomic_create`]: the probe that refuses a store
//!   without atomic create-if-absent writes (exactly-once rests on them);
//! - durability of local writes: [`sync_local_file`], [`Location::sync`],
//!   and [`FastLocalStore`], the local store the Delta sink writes through
//!   (fsync on every put, a listing that stays cheap in big directories).
//!
//! It links no DataFusion, Delta or Kafka code.

pub mod local_store;
pub mod location;

pub use local_store::FastLocalStore;
pub use location::{Location, StoreRegistry, normalize_option_key, sync_local_file, to_url};

/// Errors of the storage layer. Messages never include option values
/// (they may be secrets).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The store does not guarantee atomic create-if-absent writes.
    #[error(
        "{location} cannot be used: exactly-once needs atomic create-if-absent writes \
         (conditional PUT, S3 If-None-Match) and this store does not honour them ({detail}); \
         use a store that does (AWS S3, Google Cloud Storage, Azure Blob, SeaweedFS, MinIO)"
    )]
    NoAtomicCreate {
        /// The location.
        location: String,
        /// What the probe saw.
        detail: String,
    },
    /// A location string could not be turned into an object store.
    #[error("invalid location {location:?}: {reason}")]
    InvalidLocation {
        /// The location as given.
        location: String,
        /// Why it was refused.
        reason: String,
    },
    /// The object store failed.
    #[error("storage error at {file}: {source}")]
    Store {
        /// The file's URL.
        file: String,
        /// The store's error.
        #[source]
        source: object_store::Error,
    },
    /// A local file operation failed.
    #[error("i/o error at {path}: {source}")]
    Io {
        /// The local path.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
