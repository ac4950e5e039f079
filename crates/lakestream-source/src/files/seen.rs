//! Planning state: the files already taken (with `max_file_age`, only the
//! recent ones), rebuilt on restart from the write-ahead and summarized in
//! snapshots.

use super::*;

#[derive(Debug, Default)]
pub(super) struct SeenState {
    /// Path -> modification time (ms; `i64::MAX` when unknown, from an old
    /// snapshot: never aged out).
    pub(super) seen: HashMap<String, i64>,
    /// The newest modification time of a taken file (never later than
    /// the clock when it was taken: one file stamped in the future must not
    /// age out every file after it).
    pub(super) newest_ms: Option<i64>,
    /// The highest age cutoff ever applied: files older than this were
    /// forgotten, so they are never new again, whatever `max_file_age` says
    /// later (the option may be raised or removed on a running checkpoint).
    pub(super) forgotten_before_ms: Option<i64>,
    /// Listed files ignored for their age at the last plan, to log changes.
    pub(super) aged_out_reported: usize,
    /// Files and bytes taken by all planned batches.
    pub(super) done_files: u64,
    pub(super) done_bytes: u64,
    /// `available-now`: the files still to take, in read order.
    pub(super) pending: Option<VecDeque<FileEntry>>,
    /// Files and bytes listed and not taken, as of the latest listing.
    pub(super) left_files: u64,
    pub(super) left_bytes: u64,
    /// The greatest path taken (incremental listing).
    pub(super) max_path: Option<String>,
}

impl SeenState {
    pub(super) fn take(&mut self, f: &FileEntry) {
        if self.seen.insert(f.path.clone(), f.mtime_ms).is_none() {
            self.done_files += 1;
            self.done_bytes += f.size;
        }
        if self.max_path.as_deref().is_none_or(|m| f.path.as_str() > m) {
            self.max_path = Some(f.path.clone());
        }
        let mtime = f.mtime_ms.min(lakestream_checkpoint::now_ms());
        if self.newest_ms.is_none_or(|n| mtime > n) {
            self.newest_ms = Some(mtime);
        }
    }

    /// Files modified before this are ignored: older than `max_file_age`
    /// before the newest file taken, or older than any cutoff applied
    /// before (those files were forgotten).
    pub(super) fn age_cutoff(&self, max_age_ms: Option<i64>) -> Option<i64> {
        let now = self
            .newest_ms
            .zip(max_age_ms)
            .map(|(n, age)| n.saturating_sub(age));
        match (now, self.forgotten_before_ms) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    }

    /// Whether a listed file is new to this source.
    pub(super) fn is_new(&self, f: &FileEntry, cutoff: Option<i64>) -> bool {
        !self.seen.contains_key(&f.path) && cutoff.is_none_or(|c| f.mtime_ms >= c)
    }

    /// Forget taken files older than the cutoff: listing ignores them now,
    /// and for good.
    pub(super) fn forget_aged(&mut self, cutoff: Option<i64>) {
        if let Some(c) = cutoff {
            self.seen.retain(|_, mtime| *mtime >= c);
            if self.forgotten_before_ms.is_none_or(|b| c > b) {
                self.forgotten_before_ms = Some(c);
            }
        }
    }
}

/// The file source's [`Source::snapshot`]: every path taken (and still
/// remembered), with its modification time.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct SeenSnapshot {
    pub(super) files: Vec<String>,
    /// Modification times of `files`, in the same order (absent in
    /// snapshots written before `max_file_age` existed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(super) mtimes: Vec<i64>,
    pub(super) bytes: u64,
    pub(super) max_path: Option<String>,
    /// Files taken in all, including forgotten ones.
    #[serde(default)]
    pub(super) done_files: Option<u64>,
    #[serde(default)]
    pub(super) newest_ms: Option<i64>,
    #[serde(default)]
    pub(super) forgotten_before_ms: Option<i64>,
}
