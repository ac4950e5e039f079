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
    shard: Option<Shard>,
}

impl<'a> ListFilter<'a> {
    pub(super) fn new(glob: Option<&'a glob::Pattern>, options: &FileSourceOptions) -> Self {
        Self {
            glob,
            after_ms: options.modified_after_ms,
            before_ms: options.modified_before_ms,
            shard: options.shard,
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
            let rel_path = || rel.iter().map(|p| p.as_ref()).collect::<Vec<_>>().join("/");
            if let Some(shard) = filter.shard
                && !shard.owns(&rel_path())
            {
                return false;
            }
            match filter.glob {
                Some(g) => g.matches_with(&rel_path(), glob_opts),
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

/// One of `count` processes that share a location's files: it reads the
/// files whose path (below the location) hashes to `index` (option
/// `shard 'index/count'`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// This process's shard, from 0.
    pub index: u64,
    /// How many shards there are.
    pub count: u64,
}

impl Shard {
    /// `"2/8"` as shard 2 of 8 (`index < count`, `count >= 1`).
    pub fn parse(s: &str) -> Option<Self> {
        let (i, n) = s.split_once('/')?;
        let (index, count) = (i.trim().parse().ok()?, n.trim().parse().ok()?);
        (count >= 1 && index < count).then_some(Self { index, count })
    }

    /// Whether the file at `rel` (its path below the location) is this
    /// shard's: FNV-1a (64 bit) of the path's bytes, modulo the count.
    /// Stable across processes, machines and versions, so every file
    /// belongs to exactly one shard.
    pub fn owns(&self, rel: &str) -> bool {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in rel.as_bytes() {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h % self.count == self.index
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_path_belongs_to_exactly_one_shard_and_the_hash_is_fixed() {
        let shards: Vec<Shard> = (0..4).map(|i| Shard { index: i, count: 4 }).collect();
        let mut per = [0usize; 4];
        for n in 0..1000 {
            let path = format!("day=2026-01-{:02}/part-{n:05}.json", n % 28 + 1);
            let owners: Vec<usize> = (0..4).filter(|i| shards[*i].owns(&path)).collect();
            assert_eq!(owners.len(), 1, "{path}");
            per[owners[0]] += 1;
        }
        assert!(per.iter().all(|n| *n > 180), "{per:?}");
        // FNV-1a of "a" is 0xaf63dc4c8601ec8c: a change of hash would move
        // files between shards of running jobs.
        assert!(
            Shard {
                index: 0xaf63dc4c8601ec8c % 7,
                count: 7
            }
            .owns("a")
        );
        assert_eq!(Shard::parse("2/8"), Some(Shard { index: 2, count: 8 }));
        assert_eq!(Shard::parse("8/8"), None);
        assert_eq!(Shard::parse("1/0"), None);
        assert_eq!(Shard::parse("x"), None);
    }
}
