//! What a restart does with what it finds in the checkpoint.

/// Where a query stands after a restart.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resume {
    /// The id of the next batch to plan.
    pub next_id: u64,
    /// The last planned batch, when it was written ahead and not marked
    /// done: it runs again, with exactly its logged ranges, before
    /// anything new is planned.
    pub pending: Option<u64>,
}

/// The restart point, from the newest write-ahead record (`offsets/N`) and
/// the newest done mark (`commits/N`) in the checkpoint.
///
/// A mark newer than every write-ahead record is damage the caller reports
/// before calling this; here it simply means nothing is pending.
pub fn resume(last_planned: Option<u64>, last_marked: Option<u64>) -> Resume {
    match last_planned {
        None => Resume {
            next_id: 0,
            pending: None,
        },
        Some(n) => Resume {
            next_id: n + 1,
            pending: last_marked.is_none_or(|m| m < n).then_some(n),
        },
    }
}

/// The first batch whose write-ahead record a restart must read, given the
/// batch each source's newest readable snapshot covers (`None`: a source
/// without one). Every source must have a snapshot for any record to be
/// skipped; the earliest of them bounds what is needed.
pub fn first_needed(snapshots: &[Option<u64>]) -> u64 {
    if snapshots.iter().any(Option::is_none) {
        return 0;
    }
    snapshots.iter().flatten().map(|s| s + 1).min().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_checkpoint_starts_at_batch_zero() {
        assert_eq!(
            resume(None, None),
            Resume {
                next_id: 0,
                pending: None
            }
        );
    }

    #[test]
    fn a_batch_written_ahead_and_not_marked_runs_again_first() {
        assert_eq!(resume(Some(4), Some(3)).pending, Some(4));
        assert_eq!(resume(Some(0), None).pending, Some(0));
        assert_eq!(resume(Some(4), Some(3)).next_id, 5);
    }

    #[test]
    fn a_marked_batch_is_not_run_again() {
        assert_eq!(
            resume(Some(4), Some(4)),
            Resume {
                next_id: 5,
                pending: None
            }
        );
    }

    #[test]
    fn write_ahead_records_are_needed_after_the_oldest_source_snapshot() {
        assert_eq!(first_needed(&[Some(9), Some(4)]), 5);
        assert_eq!(first_needed(&[Some(9), None]), 0);
        assert_eq!(first_needed(&[]), 0);
    }
}
