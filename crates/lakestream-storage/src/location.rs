//! Turning a user's location string into an object store and a root path.
//!
//! Every location in lakestream (stream sources, static tables, the sink, the
//! checkpoint) goes through [`Location::parse`], so a plain path, a `file://`
//! URL and an `s3://`, `gs://` or `az://` URL behave the same way everywhere.
//!
//! Cloud stores take their credentials and endpoint from the standard
//! environment variables (`AWS_*`, `GOOGLE_*`, `AZURE_*`), overridden by
//! storage options (`aws_endpoint` or `aws.endpoint`, ...), and retry
//! transient errors (5xx, timeouts, resets) with object_store's backoff.
//! An embedding program can serve a bucket with its own store through a
//! [`StoreRegistry`] it hands to its queries.
//!
//! Exactly-once rests on atomic create-if-absent writes (S3
//! `If-None-Match`); [`Location::verify_atomic_create`] proves a store
//! honours them before anything is written.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock, RwLock};

#[cfg(feature = "s3")]
use object_store::aws::AmazonS3Builder;
#[cfg(feature = "azure")]
use object_store::azure::MicrosoftAzureBuilder;
#[cfg(feature = "gcs")]
use object_store::gcp::GoogleCloudStorageBuilder;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use url::Url;

use crate::{Error, Result};

/// A resolved location: the URL it names, the store that serves it and the
/// path of its root inside that store.
#[derive(Debug, Clone)]
pub struct Location {
    url: Url,
    store: Arc<dyn ObjectStore>,
    root: Path,
    local_dir: Option<PathBuf>,
}

impl Location {
    /// Resolve `location` (a relative or absolute path, or a URL with a scheme
    /// object_store knows) with store options such as `aws_endpoint`.
    ///
    /// Relative paths are taken from the current directory. Local directories
    /// are not created here; see [`Location::ensure_local_dir`].
    pub fn parse(location: &str, options: &HashMap<String, String>) -> Result<Self> {
        Self::parse_with(location, options, &StoreRegistry::default())
    }

    /// [`Location::parse`], with the buckets `stores` holds served by
    /// their registered store.
    pub fn parse_with(
        location: &str,
        options: &HashMap<String, String>,
        stores: &StoreRegistry,
    ) -> Result<Self> {
        let url = to_url(location)?;
        if url.scheme() == "file" {
            let dir = url.to_file_path().map_err(|()| Error::InvalidLocation {
                location: location.to_string(),
                reason: "not a valid local path".into(),
            })?;
            let store: Arc<dyn ObjectStore> = Arc::new(LocalFileSystem::new());
            let root = Path::from_absolute_path(&dir).map_err(|e| Error::InvalidLocation {
                location: location.to_string(),
                reason: e.to_string(),
            })?;
            return Ok(Self {
                url,
                store,
                root,
                local_dir: Some(dir),
            });
        }
        let root = Path::from_url_path(url.path()).map_err(|e| Error::InvalidLocation {
            location: location.to_string(),
            reason: e.to_string(),
        })?;
        let store = match stores.get(&url) {
            Some(store) => store,
            None => cloud_store(&url, options).map_err(|reason| Error::InvalidLocation {
                location: location.to_string(),
                reason,
            })?,
        };
        Ok(Self {
            url,
            store,
            root,
            local_dir: None,
        })
    }

    /// Prove that the store refuses a second create of the same object.
    ///
    /// The checkpoint's `offsets/N` and every Delta commit are written with
    /// create-if-absent; on a store that silently overwrites instead, two
    /// writers (or a retry after a lost response) could both "win" and a
    /// batch could be lost or doubled. Local directories always qualify. On
    /// an object store a probe object below the root is created twice and
    /// removed; a store that accepts the second create is refused with
    /// [`Error::NoAtomicCreate`].
    pub async fn verify_atomic_create(&self) -> Result<()> {
        if self.local_dir.is_some() {
            return Ok(());
        }
        let probe = self.child(&format!("_lakestream_probe/{}", uuid::Uuid::new_v4()));
        let create = || PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        let store_err = |source| Error::Store {
            file: format!("{}{}", self.url, "_lakestream_probe"),
            source,
        };
        let not_implemented = || Error::NoAtomicCreate {
            location: self.url.to_string(),
            detail: "the store does not implement create-if-absent writes".into(),
        };
        match self
            .store
            .put_opts(&probe, PutPayload::from_static(b"1"), create())
            .await
        {
            Ok(_) => {}
            Err(object_store::Error::NotImplemented { .. }) => return Err(not_implemented()),
            Err(e) => return Err(store_err(e)),
        }
        let second = self
            .store
            .put_opts(&probe, PutPayload::from_static(b"2"), create())
            .await;
        // Best effort: a leftover probe object is harmless. Probes left by
        // processes killed mid-probe are removed once they are old enough
        // that no live probe can be among them.
        let _ = self.store.delete(&probe).await;
        self.remove_stale_probes().await;
        match second {
            Err(object_store::Error::AlreadyExists { .. }) => Ok(()),
            Err(object_store::Error::NotImplemented { .. }) => Err(not_implemented()),
            Err(e) => Err(store_err(e)),
            Ok(_) => Err(Error::NoAtomicCreate {
                location: self.url.to_string(),
                detail: "a second create of the same object succeeded and overwrote the first"
                    .into(),
            }),
        }
    }

    /// The location as a URL (`file:///abs/path/` for local paths), always
    /// ending in `/` so it joins as a directory.
    pub fn url(&self) -> &Url {
        &self.url
    }

    /// The object store serving this location.
    pub fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    /// The root path of this location inside [`Location::store`].
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The path of `rel` (slash-separated) below the root.
    pub fn child(&self, rel: &str) -> Path {
        let mut p = self.root.clone();
        for part in rel.split('/').filter(|s| !s.is_empty()) {
            p = p.clone().join(part);
        }
        p
    }

    /// The URL of `path` (a path below [`Location::root`]), for messages.
    pub fn url_of(&self, path: &Path) -> String {
        let root = self.root.as_ref();
        let rel = path
            .as_ref()
            .strip_prefix(root)
            .unwrap_or(path.as_ref())
            .trim_start_matches('/');
        format!("{}{rel}", self.url)
    }

    /// The bytes of the object at `path`, or `None` when there is none.
    pub async fn read(&self, path: &Path) -> Result<Option<bytes::Bytes>> {
        use object_store::ObjectStoreExt;
        let store_err = |source| Error::Store {
            file: self.url_of(path),
            source,
        };
        match self.store.get(path).await {
            Ok(r) => Ok(Some(r.bytes().await.map_err(store_err)?)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(store_err(e)),
        }
    }

    /// The local directory, when the location is on the local file system.
    pub fn local_dir(&self) -> Option<&std::path::Path> {
        self.local_dir.as_deref()
    }

    /// Create the local directory (and parents) if this is a local location.
    pub fn ensure_local_dir(&self) -> Result<()> {
        if let Some(dir) = &self.local_dir {
            std::fs::create_dir_all(dir).map_err(|e| Error::Io {
                path: dir.display().to_string(),
                source: e,
            })?;
        }
        Ok(())
    }
}

/// Make a local file and its directory entry durable: `fsync` the file,
/// then its parent directory (so a rename or link that created it survives
/// a power loss too), and, once per process for each directory above it,
/// that directory's parent, so a directory created for it (`offsets/`, a
/// new partition directory of a table) is durable as well. The local object
/// store writes through the page cache and syncs nothing; every file the
/// protocol relies on after a crash goes through here.
pub fn sync_local_file(path: &std::path::Path) -> std::io::Result<()> {
    std::fs::File::open(path)?.sync_all()?;
    let Some(dir) = path.parent() else {
        return Ok(());
    };
    std::fs::File::open(dir)?.sync_all()?;
    // Directories whose own entry was made durable by this process: a
    // directory entry, once synced, stays, so each costs one fsync per run.
    static DURABLE_DIRS: OnceLock<std::sync::Mutex<std::collections::HashSet<PathBuf>>> =
        OnceLock::new();
    let durable = DURABLE_DIRS.get_or_init(Default::default);
    let mut current = dir;
    while let Some(parent) = current.parent() {
        if durable.lock().expect("durable dirs").contains(current) {
            break;
        }
        std::fs::File::open(parent)?.sync_all()?;
        durable
            .lock()
            .expect("durable dirs")
            .insert(current.to_path_buf());
        current = parent;
    }
    Ok(())
}

impl Location {
    /// On a local location, make the object at `path` durable
    /// ([`sync_local_file`]); on an object store a successful put already
    /// is, and this does nothing.
    pub async fn sync(&self, path: &Path) -> Result<()> {
        if self.local_dir.is_none() {
            return Ok(());
        }
        let fs_path = PathBuf::from(format!("/{path}"));
        let shown = fs_path.display().to_string();
        tokio::task::spawn_blocking(move || sync_local_file(&fs_path))
            .await
            .map_err(|e| Error::Io {
                path: shown.clone(),
                source: std::io::Error::other(e),
            })?
            .map_err(|source| Error::Io {
                path: shown,
                source,
            })
    }

    async fn remove_stale_probes(&self) {
        use futures::StreamExt;
        let dir = self.child("_lakestream_probe");
        let cutoff = chrono::Utc::now() - chrono::Duration::minutes(10);
        let mut listed = self.store.list(Some(&dir));
        while let Some(Ok(meta)) = listed.next().await {
            if meta.last_modified < cutoff {
                let _ = self.store.delete(&meta.location).await;
            }
        }
    }
}

/// The object stores an embedding program serves some buckets with,
/// scoped to the queries it is handed to (as DataFusion's object-store
/// registry is scoped to a runtime), never to the process.
///
/// Each store serves every location under its `scheme://authority/`
/// (`s3://bucket/`) instead of a store built from the URL and storage
/// options. Clones share their stores: register once, then hand the same
/// registry to the query ([`Location::parse_with`] and the `object_stores`
/// of the engine's builder, sources and sinks). The default registry is
/// empty, so every location gets a store built from its URL.
#[derive(Clone, Default)]
pub struct StoreRegistry {
    stores: Arc<RwLock<Vec<Registered>>>,
}

/// A registered store and the `scheme://authority/` it serves.
type Registered = (String, Arc<dyn ObjectStore>);

impl std::fmt::Debug for StoreRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let stores = self.stores.read().unwrap_or_else(|e| e.into_inner());
        f.debug_list()
            .entries(stores.iter().map(|(k, _)| k))
            .finish()
    }
}

impl StoreRegistry {
    /// Serve every location under `url`'s scheme and bucket with `store`.
    ///
    /// `store` addresses objects by their path below the bucket, as the
    /// stores object_store builds for a URL do. For embedding programs
    /// with their own credentials provider or client, and for tests that
    /// inject faults. A later registration for the same bucket replaces
    /// the earlier one.
    pub fn register(&self, url: &Url, store: Arc<dyn ObjectStore>) {
        let key = store_key(url);
        let mut stores = self.stores.write().unwrap_or_else(|e| e.into_inner());
        stores.retain(|(k, _)| *k != key);
        stores.push((key, store));
    }

    /// The store registered for `url`'s scheme and bucket, if any.
    pub fn get(&self, url: &Url) -> Option<Arc<dyn ObjectStore>> {
        let key = store_key(url);
        let stores = self.stores.read().unwrap_or_else(|e| e.into_inner());
        stores
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, s)| s.clone())
    }
}

fn store_key(url: &Url) -> String {
    format!("{}://{}/", url.scheme(), url.authority())
}

/// A storage option key as object_store spells it: `aws.endpoint` and
/// `AWS_ENDPOINT` both become `aws_endpoint`. Normalize keys before merging
/// option maps, so one key cannot be present in two spellings.
pub fn normalize_option_key(key: &str) -> String {
    key.to_ascii_lowercase().replace('.', "_")
}

fn normalized(options: &HashMap<String, String>) -> Vec<(String, String)> {
    options
        .iter()
        .map(|(k, v)| (normalize_option_key(k), v.clone()))
        .collect()
}

/// The retry policy for transient store errors: `max_retries` (default 10)
/// and `retry_timeout` in seconds (default 180) from the storage options,
/// also accepted with a store prefix (`aws.max_retries`).
#[cfg(any(feature = "s3", feature = "gcs", feature = "azure"))]
fn retry_config(
    options: &[(String, String)],
) -> std::result::Result<object_store::RetryConfig, String> {
    let mut retry = object_store::RetryConfig {
        backoff: object_store::BackoffConfig::default(),
        max_retries: 10,
        retry_timeout: std::time::Duration::from_secs(180),
    };
    for (k, v) in options {
        // `max_retries`, or with a store prefix (`aws.max_retries`).
        let key = ["aws_", "google_", "azure_"]
            .iter()
            .find_map(|p| k.strip_prefix(p))
            .unwrap_or(k);
        match key {
            "max_retries" => {
                retry.max_retries = v
                    .parse()
                    .map_err(|_| format!("max_retries {v:?} is not a whole number"))?;
            }
            "retry_timeout" => {
                let secs: f64 = v
                    .trim_end_matches('s')
                    .parse()
                    .map_err(|_| format!("retry_timeout {v:?} is not a number of seconds"))?;
                retry.retry_timeout = std::time::Duration::try_from_secs_f64(secs.max(0.0))
                    .map_err(|_| format!("retry_timeout {v:?} is out of range"))?;
            }
            _ => {}
        }
    }
    Ok(retry)
}

/// Build the store for a cloud URL: environment first, then `options`.
/// Errors never include option values (they may be secrets).
#[cfg_attr(
    not(any(feature = "s3", feature = "gcs", feature = "azure")),
    allow(unused_variables, unreachable_code)
)]
fn cloud_store(
    url: &Url,
    options: &HashMap<String, String>,
) -> std::result::Result<Arc<dyn ObjectStore>, String> {
    let options = normalized(options);
    #[cfg(any(feature = "s3", feature = "gcs", feature = "azure"))]
    let retry = retry_config(&options)?;
    let bucket_url = store_key(url);
    let inner: Arc<dyn ObjectStore> = match url.scheme() {
        #[cfg(feature = "s3")]
        "s3" | "s3a" => {
            let mut b = AmazonS3Builder::from_env().with_url(bucket_url.clone());
            for (k, v) in &options {
                if let Ok(key) = k.parse() {
                    b = b.with_config(key, v);
                }
            }
            Arc::new(b.with_retry(retry).build().map_err(|e| e.to_string())?)
        }
        #[cfg(feature = "gcs")]
        "gs" => {
            let mut b = GoogleCloudStorageBuilder::from_env().with_url(bucket_url.clone());
            for (k, v) in &options {
                if let Ok(key) = k.parse() {
                    b = b.with_config(key, v);
                }
            }
            Arc::new(b.with_retry(retry).build().map_err(|e| e.to_string())?)
        }
        #[cfg(feature = "azure")]
        "az" | "azure" | "abfs" | "abfss" | "adl" => {
            let mut b = MicrosoftAzureBuilder::from_env().with_url(url.as_str());
            for (k, v) in &options {
                if let Ok(key) = k.parse() {
                    b = b.with_config(key, v);
                }
            }
            Arc::new(b.with_retry(retry).build().map_err(|e| e.to_string())?)
        }
        #[cfg(not(feature = "s3"))]
        "s3" | "s3a" => return Err(not_built("s3", "s3")),
        #[cfg(not(feature = "gcs"))]
        "gs" => return Err(not_built("gs", "gcs")),
        #[cfg(not(feature = "azure"))]
        "az" | "azure" | "abfs" | "abfss" | "adl" => return Err(not_built(url.scheme(), "azure")),
        other => {
            return Err(format!(
                "unsupported scheme {other:?}: use a local path, file://, s3://, gs:// or az://"
            ));
        }
    };
    Ok(Arc::new(Redacted {
        name: bucket_url,
        inner,
    }))
}

/// The message for a scheme whose store this build leaves out.
#[allow(dead_code)] // unused when every store is built in
fn not_built(scheme: &str, feature: &str) -> String {
    format!(
        "{scheme}:// locations need lakestream built with the `{feature}` cargo feature \
         (on by default; this build was made without it)"
    )
}

/// A cloud store whose `Debug` and `Display` name only the bucket: the
/// stores' own `Debug` prints their configuration, credentials included
/// (Azure account keys, for one), and libraries log stores at debug level.
struct Redacted {
    name: String,
    inner: Arc<dyn ObjectStore>,
}

impl std::fmt::Debug for Redacted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ObjectStore({})", self.name)
    }
}

impl std::fmt::Display for Redacted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ObjectStore({})", self.name)
    }
}

#[async_trait::async_trait]
impl ObjectStore for Redacted {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<object_store::PutResult> {
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: object_store::PutMultipartOptions,
    ) -> object_store::Result<Box<dyn object_store::MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: object_store::GetOptions,
    ) -> object_store::Result<object_store::GetResult> {
        self.inner.get_opts(location, options).await
    }

    async fn get_ranges(
        &self,
        location: &Path,
        ranges: &[std::ops::Range<u64>],
    ) -> object_store::Result<Vec<bytes::Bytes>> {
        self.inner.get_ranges(location, ranges).await
    }

    fn delete_stream(
        &self,
        locations: futures::stream::BoxStream<'static, object_store::Result<Path>>,
    ) -> futures::stream::BoxStream<'static, object_store::Result<Path>> {
        self.inner.delete_stream(locations)
    }

    fn list(
        &self,
        prefix: Option<&Path>,
    ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>> {
        self.inner.list(prefix)
    }

    fn list_with_offset(
        &self,
        prefix: Option<&Path>,
        offset: &Path,
    ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>> {
        self.inner.list_with_offset(prefix, offset)
    }

    async fn list_with_delimiter(
        &self,
        prefix: Option<&Path>,
    ) -> object_store::Result<object_store::ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &Path,
        to: &Path,
        options: object_store::CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }

    async fn rename_opts(
        &self,
        from: &Path,
        to: &Path,
        options: object_store::RenameOptions,
    ) -> object_store::Result<()> {
        self.inner.rename_opts(from, to, options).await
    }
}

/// Parse a location string into a URL: URLs with a scheme are kept, anything
/// else is a local path made absolute. The result always ends with `/`.
pub fn to_url(location: &str) -> Result<Url> {
    let has_scheme = location
        .split_once("://")
        .is_some_and(|(s, _)| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric()));
    let mut url = if has_scheme {
        Url::parse(location).map_err(|e| Error::InvalidLocation {
            location: location.to_string(),
            reason: e.to_string(),
        })?
    } else {
        let path = std::path::Path::new(location);
        let abs = if path.is_absolute() {
            path.to_path_buf()
        } else {
            std::env::current_dir()
                .map_err(|e| Error::Io {
                    path: ".".into(),
                    source: e,
                })?
                .join(path)
        };
        let abs = normalize(&abs);
        Url::from_directory_path(&abs).map_err(|()| Error::InvalidLocation {
            location: location.to_string(),
            reason: "not an absolute path".into(),
        })?
    };
    if !url.path().ends_with('/') {
        let p = format!("{}/", url.path());
        url.set_path(&p);
    }
    Ok(url)
}

/// Remove `.` and `..` components without touching the file system, so a
/// location that does not exist yet still resolves.
fn normalize(path: &std::path::Path) -> PathBuf {
    use std::path::Component;
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other.as_os_str()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_become_absolute_file_urls() {
        let url = to_url("target/x/../y").unwrap();
        assert_eq!(url.scheme(), "file");
        assert!(url.path().ends_with("/target/y/"), "{url}");
    }

    #[test]
    fn urls_keep_their_scheme_and_gain_a_trailing_slash() {
        let url = to_url("s3://bucket/prefix").unwrap();
        assert_eq!(url.as_str(), "s3://bucket/prefix/");
        let url = to_url("file:///tmp/a/").unwrap();
        assert_eq!(url.as_str(), "file:///tmp/a/");
    }

    #[test]
    fn child_paths_join_below_the_root() {
        let loc = Location::parse("/tmp/ckpt", &HashMap::new()).unwrap();
        assert_eq!(loc.child("offsets/3").as_ref(), "tmp/ckpt/offsets/3");
    }
}
