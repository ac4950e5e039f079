//! Which write-ahead and done records the checkpoint may drop.

/// After batch `batch_id`, the first batch whose records (`offsets/N`,
/// `commits/N`, state changes) are kept: the newest `min_batches_to_retain`
/// batches, and everything after the oldest snapshot each source keeps (a
/// restart that finds the newest snapshot unreadable falls back to the
/// oldest and reads the batches after it). `None`: a source keeps no
/// snapshot, so nothing may go.
pub fn keep_from(
    batch_id: u64,
    min_batches_to_retain: u64,
    oldest_snapshots: &[Option<u64>],
) -> Option<u64> {
    let mut keep = (batch_id + 1).saturating_sub(min_batches_to_retain);
    for s in oldest_snapshots {
        keep = keep.min(s.as_ref()? + 1);
    }
    Some(keep)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_batches_and_what_follows_the_oldest_snapshot_are_kept() {
        assert_eq!(keep_from(99, 10, &[Some(95)]), Some(90));
        assert_eq!(keep_from(99, 10, &[Some(79), Some(95)]), Some(80));
        assert_eq!(keep_from(3, 10, &[Some(1)]), Some(0));
    }

    #[test]
    fn nothing_goes_while_a_source_keeps_no_snapshot() {
        assert_eq!(keep_from(99, 10, &[Some(95), None]), None);
    }
}
