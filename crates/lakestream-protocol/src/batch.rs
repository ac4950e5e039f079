//! One batch's steps, as a machine the caller drives: [`BatchSteps::next`]
//! says what to do, and the caller reports what happened with
//! [`BatchSteps::checked`], [`BatchSteps::executed`],
//! [`BatchSteps::committed`], [`BatchSteps::marked`] and
//! [`BatchSteps::notified`].
//!
//! An error while carrying out a step ends the attempt: the machine is
//! dropped, and the restart's recovery re-runs the batch from its
//! write-ahead record. Every step is therefore safe to repeat.

use std::collections::VecDeque;

/// What an output of the query writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputRole {
    /// The rows of a query over the batch.
    Query,
    /// The records the sources rejected (and rows breaking a table's
    /// rules): a dead-letter table.
    DeadLetters,
}

/// What the caller carries out next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Ask every output whether its table already holds this batch for the
    /// query, and report with [`BatchSteps::checked`]. Only for a batch
    /// recovered from the write-ahead log: a crash may have come between
    /// two outputs' commits, or after the last one and before the mark.
    CheckOutputs,
    /// Stage the rows of these query outputs (files written, not yet
    /// visible) and read the batch's input to its end, so the records the
    /// sources reject are known; report with [`BatchSteps::executed`]. The
    /// list is empty when only dead letters are missing.
    Execute(Vec<usize>),
    /// Commit output `i`'s staged rows atomically with the batch id, and
    /// report with [`BatchSteps::committed`].
    Commit(usize),
    /// Record the batch as done (`commits/N`), and report with
    /// [`BatchSteps::marked`].
    Mark(Mark),
    /// Tell the sources the batch's ranges are committed (or, when
    /// superseded, that they are not), and report with
    /// [`BatchSteps::notified`]. Best effort.
    Notify {
        /// Whether another process committed the batch's positions first.
        superseded: bool,
    },
    /// The batch is over.
    Done(BatchReport),
}

/// The record that marks a batch done.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mark {
    /// The batch.
    pub batch_id: u64,
    /// Each output's table version holding the batch, when it has one (an
    /// output with nothing to commit has none).
    pub versions: Vec<Option<u64>>,
    /// Whether every output held the batch before this attempt committed
    /// anything.
    pub skipped: bool,
    /// Why the batch was dropped, when another process committed its
    /// positions first.
    pub superseded: Option<String>,
}

/// What committing one output did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Committed {
    /// The rows are in, at this table version.
    Written {
        /// The version the commit made.
        version: u64,
    },
    /// The table held the batch already (an earlier attempt committed it
    /// and the answer was lost, or a second process did): nothing added.
    AlreadyHeld {
        /// The table's version.
        version: u64,
    },
    /// The output had nothing to commit (a dead-letter table with no
    /// rejected record).
    Nothing,
    /// Another process committed the batch's positions first: the batch is
    /// dropped, its remaining outputs are not committed.
    Superseded {
        /// What was found, for the log and the mark.
        reason: String,
    },
}

/// How a batch went, for progress and metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchReport {
    /// The batch.
    pub batch_id: u64,
    /// Each output's table version holding the batch, if any.
    pub versions: Vec<Option<u64>>,
    /// Which outputs held the batch without this attempt adding rows.
    pub held: Vec<bool>,
    /// Which outputs this attempt wrote rows to.
    pub written: Vec<bool>,
    /// Whether nothing was written: every output held the batch.
    pub skipped: bool,
    /// Why the batch was dropped, if it was.
    pub superseded: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Check,
    Execute,
    Commit,
    Mark,
    Notify,
    Done,
}

/// The steps of one attempt at batch `N`.
#[derive(Debug)]
pub struct BatchSteps {
    batch_id: u64,
    roles: Vec<OutputRole>,
    phase: Phase,
    /// Outputs found holding the batch (by the check, or by their commit).
    held: Vec<bool>,
    versions: Vec<Option<u64>>,
    written: Vec<bool>,
    /// Outputs left to commit, dead letters first.
    to_commit: VecDeque<usize>,
    /// Whether every output held the batch at the check.
    skipped_at_check: bool,
    superseded: Option<String>,
}

impl BatchSteps {
    /// The steps of batch `batch_id` for outputs of these roles (at least
    /// one). `recovered`: the batch was written ahead by an earlier attempt
    /// and not marked done, so some outputs may hold it.
    pub fn new(batch_id: u64, roles: Vec<OutputRole>, recovered: bool) -> Self {
        assert!(!roles.is_empty(), "a query has at least one output");
        let n = roles.len();
        Self {
            batch_id,
            roles,
            phase: if recovered {
                Phase::Check
            } else {
                Phase::Execute
            },
            held: vec![false; n],
            versions: vec![None; n],
            written: vec![false; n],
            to_commit: VecDeque::new(),
            skipped_at_check: false,
            superseded: None,
        }
    }

    /// The batch.
    pub fn batch_id(&self) -> u64 {
        self.batch_id
    }

    /// Whether output `i` holds the batch without this attempt's rows.
    pub fn holds(&self, i: usize) -> bool {
        self.held[i]
    }

    /// What to do next. Asking again before reporting gives the same
    /// action.
    pub fn next(&self) -> Action {
        match self.phase {
            Phase::Check => Action::CheckOutputs,
            Phase::Execute => Action::Execute(
                (0..self.roles.len())
                    .filter(|i| self.roles[*i] == OutputRole::Query && !self.held[*i])
                    .collect(),
            ),
            Phase::Commit => match self.to_commit.front() {
                Some(i) => Action::Commit(*i),
                None => unreachable!("the commit phase ends with its last output"),
            },
            Phase::Mark => Action::Mark(Mark {
                batch_id: self.batch_id,
                versions: self.versions.clone(),
                skipped: self.all_held(),
                superseded: self.superseded.clone(),
            }),
            Phase::Notify => Action::Notify {
                superseded: self.superseded.is_some(),
            },
            Phase::Done => Action::Done(BatchReport {
                batch_id: self.batch_id,
                versions: self.versions.clone(),
                held: self.held.clone(),
                written: self.written.clone(),
                skipped: self.all_held(),
                superseded: self.superseded.clone(),
            }),
        }
    }

    fn all_held(&self) -> bool {
        self.held.iter().all(|h| *h)
    }

    /// Report [`Action::CheckOutputs`]: for each output, the table version
    /// when its table holds this batch for the query (its recorded batch is
    /// this one or later), else `None`.
    pub fn checked(&mut self, found: &[Option<u64>]) {
        self.expect(Phase::Check);
        assert_eq!(found.len(), self.roles.len(), "one answer per output");
        for (i, v) in found.iter().enumerate() {
            if let Some(v) = v {
                self.held[i] = true;
                self.versions[i] = Some(*v);
            }
        }
        if self.all_held() {
            // Nothing to write, and nothing the sources need to hear again.
            self.skipped_at_check = true;
            self.phase = Phase::Mark;
        } else {
            self.phase = Phase::Execute;
        }
    }

    /// Report [`Action::Execute`]: the outputs' rows are staged.
    pub fn executed(&mut self) {
        self.expect(Phase::Execute);
        // Dead letters first: a replay after a crash between the two finds
        // the dead letters in their table and stages the outputs again,
        // whose rows set apart by table rules it then drops.
        let (roles, held) = (&self.roles, &self.held);
        let missing =
            |role: OutputRole| (0..roles.len()).filter(move |i| roles[*i] == role && !held[*i]);
        self.to_commit = missing(OutputRole::DeadLetters)
            .chain(missing(OutputRole::Query))
            .collect();
        self.phase = if self.to_commit.is_empty() {
            Phase::Mark
        } else {
            Phase::Commit
        };
    }

    /// Report [`Action::Commit`] of output `i`.
    pub fn committed(&mut self, i: usize, outcome: Committed) {
        self.expect(Phase::Commit);
        assert_eq!(
            self.to_commit.front().copied(),
            Some(i),
            "commits are reported in the order asked"
        );
        self.to_commit.pop_front();
        match outcome {
            Committed::Written { version } => {
                self.versions[i] = Some(version);
                self.written[i] = true;
            }
            Committed::AlreadyHeld { version } => {
                self.versions[i] = Some(version);
                self.held[i] = true;
            }
            Committed::Nothing => {}
            Committed::Superseded { reason } => {
                self.superseded = Some(reason);
                self.to_commit.clear();
            }
        }
        if self.to_commit.is_empty() {
            self.phase = Phase::Mark;
        }
    }

    /// Report [`Action::Mark`]: `commits/N` is durable.
    pub fn marked(&mut self) {
        self.expect(Phase::Mark);
        self.phase = if self.skipped_at_check {
            Phase::Done
        } else {
            Phase::Notify
        };
    }

    /// Report [`Action::Notify`].
    pub fn notified(&mut self) {
        self.expect(Phase::Notify);
        self.phase = Phase::Done;
    }

    fn expect(&self, phase: Phase) {
        assert_eq!(
            self.phase, phase,
            "batch {}: a step was reported out of order",
            self.batch_id
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use OutputRole::{DeadLetters, Query};

    /// Drive `steps` to the end, answering commits with `commit` and the
    /// check with `found`; the actions seen, in order.
    fn drive(
        mut steps: BatchSteps,
        found: &[Option<u64>],
        mut commit: impl FnMut(usize) -> Committed,
    ) -> (Vec<Action>, BatchReport) {
        let mut seen = Vec::new();
        loop {
            let a = steps.next();
            seen.push(a.clone());
            match a {
                Action::CheckOutputs => steps.checked(found),
                Action::Execute(_) => steps.executed(),
                Action::Commit(i) => steps.committed(i, commit(i)),
                Action::Mark(_) => steps.marked(),
                Action::Notify { .. } => steps.notified(),
                Action::Done(r) => return (seen, r),
            }
        }
    }

    #[test]
    fn a_new_batch_executes_commits_marks_and_notifies() {
        let (seen, report) = drive(BatchSteps::new(4, vec![Query], false), &[], |_| {
            Committed::Written { version: 9 }
        });
        assert_eq!(
            seen[..4],
            [
                Action::Execute(vec![0]),
                Action::Commit(0),
                Action::Mark(Mark {
                    batch_id: 4,
                    versions: vec![Some(9)],
                    skipped: false,
                    superseded: None
                }),
                Action::Notify { superseded: false },
            ]
        );
        assert_eq!(report.written, vec![true]);
        assert!(!report.skipped);
    }

    #[test]
    fn dead_letters_commit_before_the_query_outputs() {
        let (seen, _) = drive(
            BatchSteps::new(0, vec![Query, DeadLetters, Query], false),
            &[],
            |i| Committed::Written { version: i as u64 },
        );
        let commits: Vec<_> = seen
            .iter()
            .filter_map(|a| match a {
                Action::Commit(i) => Some(*i),
                _ => None,
            })
            .collect();
        assert_eq!(commits, vec![1, 0, 2]);
        assert_eq!(seen[0], Action::Execute(vec![0, 2]));
    }

    #[test]
    fn a_recovered_batch_every_output_holds_is_marked_without_executing() {
        let (seen, report) = drive(
            BatchSteps::new(3, vec![Query, DeadLetters], true),
            &[Some(5), Some(2)],
            |_| panic!("nothing is committed"),
        );
        assert_eq!(
            seen,
            vec![
                Action::CheckOutputs,
                Action::Mark(Mark {
                    batch_id: 3,
                    versions: vec![Some(5), Some(2)],
                    skipped: true,
                    superseded: None
                }),
                Action::Done(report.clone()),
            ]
        );
        assert!(report.skipped);
    }

    #[test]
    fn a_recovered_batch_runs_only_the_outputs_that_lack_it() {
        // Crash between the first output's commit and the second's.
        let (seen, report) = drive(
            BatchSteps::new(3, vec![Query, Query], true),
            &[Some(7), None],
            |i| {
                assert_eq!(i, 1);
                Committed::Written { version: 4 }
            },
        );
        assert_eq!(seen[1], Action::Execute(vec![1]));
        assert_eq!(report.versions, vec![Some(7), Some(4)]);
        assert_eq!(report.held, vec![true, false]);
        assert!(!report.skipped);
    }

    #[test]
    fn only_missing_dead_letters_execute_nothing_but_read_the_input() {
        let (seen, _) = drive(
            BatchSteps::new(1, vec![Query, DeadLetters], true),
            &[Some(3), None],
            |_| Committed::Nothing,
        );
        assert_eq!(seen[1], Action::Execute(vec![]));
        assert_eq!(seen[2], Action::Commit(1));
    }

    #[test]
    fn a_commit_whose_answer_was_lost_counts_as_held() {
        // The check read a stale table; the commit found the batch in.
        let (_, report) = drive(BatchSteps::new(2, vec![Query], true), &[None], |_| {
            Committed::AlreadyHeld { version: 11 }
        });
        assert!(report.skipped);
        assert_eq!(report.versions, vec![Some(11)]);
    }

    #[test]
    fn a_superseded_batch_stops_committing_and_marks_why() {
        let (seen, report) = drive(
            BatchSteps::new(2, vec![DeadLetters, Query], false),
            &[],
            |_| Committed::Superseded {
                reason: "moved".into(),
            },
        );
        assert!(seen.contains(&Action::Notify { superseded: true }));
        assert_eq!(
            seen.iter()
                .filter(|a| matches!(a, Action::Commit(_)))
                .count(),
            1
        );
        assert_eq!(report.superseded.as_deref(), Some("moved"));
    }

    #[test]
    fn a_dead_letter_table_with_nothing_rejected_has_no_version() {
        let (_, report) = drive(
            BatchSteps::new(0, vec![Query, DeadLetters], false),
            &[],
            |i| match i {
                1 => Committed::Nothing,
                _ => Committed::Written { version: 1 },
            },
        );
        assert_eq!(report.versions, vec![Some(1), None]);
        assert_eq!(report.written, vec![true, false]);
    }

    #[test]
    #[should_panic(expected = "out of order")]
    fn a_step_reported_out_of_order_is_a_bug() {
        let mut s = BatchSteps::new(0, vec![Query], false);
        s.marked();
    }
}
