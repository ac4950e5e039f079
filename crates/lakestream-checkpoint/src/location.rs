//! Turning a user's location string into an object store and a root path.
//!
//! Every location in lakestream (stream sources, static tables, the sink, the
//! checkpoint) goes through [`Location::parse`], so a plain path, a `file://`
//! URL and an `s3://`, `gs://` or `az://` URL behave the same way everywhere.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use object_store::ObjectStore;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
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
        let (store, root) = object_store::parse_url_opts(&url, options.iter()).map_err(|e| {
            Error::InvalidLocation {
                location: location.to_string(),
                reason: e.to_string(),
            }
        })?;
        Ok(Self {
            url,
            store: Arc::from(store),
            root,
            local_dir: None,
        })
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
