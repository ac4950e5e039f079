//! Listing: which files under the location a source reads, in read order.

use super::*;

/// The object path of a listed file. `FileEntry::path` holds the path as
/// the store listed it (already encoded): it must be parsed, not built
/// with `Path::from`, which would encode `%`, `~`, `#`, ... a second time
/// and name another object.
pub(super) fn object_path(p: &str) -> Path {
    Path::parse(p).unwrap_or_else(|_| Path::from(p))
}

/// Which listed files a source reads.
#[derive(Debug, Default)]
pub(super) struct ListFilter<'a> {
    glob: Option<&'a glob::Pattern>,
    after_ms: Option<i64>,
    before_ms: Option<i64>,
}

impl<'a> ListFilter<'a> {
    pub(super) fn new(glob: Option<&'a glob::Pattern>, options: &FileSourceOptions) -> Self {
        Self {
            glob,
            after_ms: options.modified_after_ms,
            before_ms: options.modified_before_ms,
        }
    }
}

/// The source's `path_glob`, compiled.
pub(super) fn compile_glob(
    name: &str,
    options: &FileSourceOptions,
) -> Result<Option<glob::Pattern>> {
    options
        .path_glob
        .as_deref()
        .map(glob::Pattern::new)
        .transpose()
        .map_err(|e| Error::InvalidOption {
            source_name: name.to_string(),
            option: "path_glob".into(),
            reason: e.to_string(),
        })
}

/// List the readable files under `location` in read order: (modification
/// time, path). Names starting with `.` or `_` (hidden, temporary, Delta or
/// Spark metadata) are skipped, and so are files `filter` rejects. With
/// `after`, only paths that sort after it are listed (`list_with_offset`).
pub(super) async fn list_files(
    name: &str,
    location: &Location,
    filter: &ListFilter<'_>,
    after: Option<&str>,
) -> Result<Vec<FileEntry>> {
    let store = location.store();
    let listing = match after {
        Some(a) => store.list_with_offset(Some(location.root()), &object_path(a)),
        None => store.list(Some(location.root())),
    };
    let metas: Vec<ObjectMeta> = match listing.try_collect().await {
        Ok(m) => m,
        Err(object_store::Error::NotFound { .. }) => Vec::new(),
        Err(e) => {
            return Err(Error::Store {
                source_name: name.to_string(),
                file: location.url().to_string(),
                source: e,
            });
        }
    };
    let root_depth = location.root().parts().count();
    let glob_opts = glob::MatchOptions {
        case_sensitive: true,
        require_literal_separator: true,
        require_literal_leading_dot: false,
    };
    let mut files: Vec<FileEntry> = metas
        .into_iter()
        .filter(|m| {
            let rel: Vec<_> = m.location.parts().skip(root_depth).collect();
            if rel.iter().any(|p| {
                let p = p.as_ref();
                p.starts_with('.') || p.starts_with('_')
            }) {
                return false;
            }
            let mtime = m.last_modified.timestamp_millis();
            if filter.after_ms.is_some_and(|a| mtime < a)
                || filter.before_ms.is_some_and(|b| mtime >= b)
            {
                return false;
            }
            match filter.glob {
                Some(g) => {
                    let rel = rel.iter().map(|p| p.as_ref()).collect::<Vec<_>>().join("/");
                    g.matches_with(&rel, glob_opts)
                }
                None => true,
            }
        })
        .map(|m| FileEntry {
            path: m.location.to_string(),
            size: m.size,
            mtime_ms: m.last_modified.timestamp_millis(),
        })
        .collect();
    files.sort_by(|a, b| a.mtime_ms.cmp(&b.mtime_ms).then(a.path.cmp(&b.path)));
    Ok(files)
}
