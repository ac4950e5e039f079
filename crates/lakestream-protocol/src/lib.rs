//! The exactly-once protocol of a lakestream query, without I/O.
//!
//! The engine runs micro-batches against real stores (a checkpoint, source
//! systems, sink tables); this crate holds only the decisions, so every
//! crash and replay case is a plain unit test, and a deterministic
//! simulation (this crate's `tests/it/sim`) drives the same decisions
//! against in-memory stores under injected crashes, lost responses, stale
//! reads and second writers.
//!
//! The protocol, per batch `N`:
//! 1. **Plan and write ahead**: each source's range is fixed in
//!    `offsets/N` (create-if-absent) before anything reads it.
//! 2. **Execute**: each query output's rows are staged (files written, not
//!    yet visible). Stateful operators start from the state of batch
//!    `N − 1` ([`state_base`]), never from newer state.
//! 3. **Commit** each output atomically with the batch id, dead letters
//!    first. A sink that already holds batch `N` for the query answers
//!    "already committed" and adds nothing.
//! 4. **Mark**: `commits/N` records the table versions; the batch is done.
//!
//! Each commit records a [`lineage::CommitLineage`]: the batch, the query
//! and the exact ranges it read, which `verify` checks the chain with.
//!
//! A restart ([`recovery::resume`]) re-runs a batch written ahead but not
//! marked with exactly its logged range ([`batch::BatchSteps`] first asks
//! each output whether it holds it), then plans new batches.

pub mod batch;
pub mod lineage;
pub mod recovery;
pub mod retention;

pub use batch::{Action, BatchReport, BatchSteps, Committed, Mark, OutputRole};
pub use lineage::{CommitLineage, LINEAGE_VERSION, RangeRecord};
pub use recovery::{Resume, first_needed, resume};
pub use retention::keep_from;

/// One position a batch moves forward in an output table, for sources
/// whose positions live there (Kafka group mode): `app_id` goes from
/// `from` to `to` in the batch's commit.
///
/// A commit carrying claims is a compare-and-set on them: it lands only if
/// each `app_id` is still at `from` (or was never written) in the version
/// it lands on; otherwise nothing is written and the batch is superseded
/// ([`Committed::Superseded`]). Successive commits of an app id thus form
/// one chain of ranges, with no gap and no overlap, whichever processes
/// wrote them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PositionClaim {
    /// The transaction app id (`<group>/<topic>/<partition>` for Kafka).
    pub app_id: String,
    /// The position the range starts at: the table must hold this value
    /// (or none) for the commit to land.
    pub from: i64,
    /// The position after the range, recorded by the commit.
    pub to: i64,
}

/// The batch whose state batch `batch_id` starts from: the one before it,
/// or none for the first batch. A replay of batch `N` must see exactly the
/// state batch `N` saw the first time, whatever later attempts wrote.
pub fn state_base(batch_id: u64) -> Option<u64> {
    batch_id.checked_sub(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_starts_from_the_state_of_the_batch_before_it() {
        assert_eq!(state_base(0), None);
        assert_eq!(state_base(7), Some(6));
    }
}
