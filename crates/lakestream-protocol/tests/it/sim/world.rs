//! The simulated world: a source log, a checkpoint, sink tables and the
//! faults they inject, all in memory and driven by one seeded generator.

use std::collections::BTreeMap;

use lakestream_protocol::{Mark, OutputRole};

/// A small, fast, seedable generator (SplitMix64): one seed gives one
/// schedule, on every machine.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed ^ 0x5DEE_CE66_D1CE_4E5B)
    }

    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// True with probability `per_mille / 1000`.
    pub(crate) fn chance(&mut self, per_mille: u64) -> bool {
        per_mille > 0 && self.below(1000) < per_mille
    }

    /// One of `items`.
    pub(crate) fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
}

/// A protocol bug planted on purpose, to show the simulation finds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mutation {
    /// Sinks commit without checking the batch id they hold.
    SinkIgnoresBatchId,
    /// A stateful output starts from the newest state, not its batch's base.
    StateFromNewest,
    /// The batch is marked done before its outputs commit.
    MarkBeforeCommit,
    /// A restart plans new batches without re-running the pending one.
    ForgetPending,
    /// The write-ahead record overwrites another process's.
    WriteAheadOverwrites,
    /// Group mode: a commit lands whatever position the table holds.
    ClaimsIgnored,
}

/// What an output computes from the batch's records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Output {
    /// Each good record, doubled.
    Doubled,
    /// Each good record with the number of good records before it in the
    /// stream: state that a wrong restore shows at once.
    Numbered,
    /// The bad records.
    DeadLetters,
}

impl Output {
    pub(crate) fn role(self) -> OutputRole {
        match self {
            Output::DeadLetters => OutputRole::DeadLetters,
            _ => OutputRole::Query,
        }
    }
}

/// A record the sources reject (it goes to the dead letters, if any).
pub(crate) fn is_bad(v: i64) -> bool {
    v % 4 == 0
}

/// One row of an output table.
pub(crate) type Row = (i64, u64);

/// The schedule's shape and fault rates, drawn from its seed.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub(crate) records: usize,
    pub(crate) max_batch: usize,
    pub(crate) outputs: Vec<Output>,
    /// Faults the schedule may inject in all (crashes, failed calls, lost
    /// answers, second processes); after that, it runs clean.
    pub(crate) fault_budget: u32,
    /// Per scheduler step: a process is killed (kill -9).
    pub(crate) crash_per_mille: u64,
    /// Of those kills, how many leave the process paused rather than dead,
    /// with a second one started beside it.
    pub(crate) zombie_per_mille: u64,
    /// Per call: it fails before doing anything.
    pub(crate) fail_per_mille: u64,
    /// Per write: it is done, and its answer lost.
    pub(crate) lost_per_mille: u64,
    /// Per read of a table's batch id or of the checkpoint's newest mark:
    /// an older state is seen.
    pub(crate) stale_per_mille: u64,
    /// Commits another writer makes to the first output's table.
    pub(crate) foreign_commits: usize,
    /// Group mode: two members, each with its own checkpoint and query id,
    /// share the source; its position lives in the one output's table and
    /// each commit claims the range it read (compare-and-set).
    pub(crate) group: bool,
}

impl Config {
    /// The members sharing the source: their checkpoints and query ids.
    pub(crate) fn members(&self) -> usize {
        if self.group { 2 } else { 1 }
    }
}

impl Config {
    pub(crate) fn draw(rng: &mut Rng) -> Self {
        use Output::*;
        let shapes: [&[Output]; 7] = [
            &[Doubled],
            &[Numbered],
            &[Doubled, DeadLetters],
            &[DeadLetters, Numbered],
            &[Doubled, Numbered],
            &[Numbered, DeadLetters, Doubled],
            &[DeadLetters, Doubled, DeadLetters],
        ];
        let group = rng.chance(250);
        Self {
            records: 1 + rng.below(24) as usize,
            max_batch: 1 + rng.below(5) as usize,
            // Group mode writes exactly one table, without dead letters.
            outputs: if group {
                vec![Doubled]
            } else {
                rng.pick(&shapes).to_vec()
            },
            group,
            fault_budget: rng.below(7) as u32,
            crash_per_mille: rng.pick(&[0, 10, 40, 120]),
            zombie_per_mille: rng.pick(&[0, 250, 600]),
            fail_per_mille: rng.pick(&[0, 20, 80]),
            lost_per_mille: rng.pick(&[0, 30, 150]),
            stale_per_mille: rng.pick(&[0, 200, 500]),
            foreign_commits: rng.pick(&[0, 0, 2, 5]),
        }
    }
}

/// `offsets/N`: the range of source records batch N reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    pub(crate) start: usize,
    pub(crate) end: usize,
}

/// One commit in a table.
#[derive(Clone, Debug)]
pub(crate) struct TableCommit {
    /// Whose commit: a member's query, or (`None`) another writer.
    pub(crate) query: Option<usize>,
    pub(crate) batch: u64,
    pub(crate) rows: Vec<Row>,
    /// Group mode: the source range `[from, to)` it claimed.
    pub(crate) claim: Option<(usize, usize)>,
}

/// A sink table: its commits, the version being the index + 1.
#[derive(Clone, Debug, Default)]
pub(crate) struct Table {
    pub(crate) commits: Vec<TableCommit>,
}

impl Table {
    /// The version the table is at (0: empty).
    pub(crate) fn version(&self) -> u64 {
        self.commits.len() as u64
    }

    /// The newest batch of `query` in the first `version` commits.
    pub(crate) fn batch_as_of(&self, version: u64, query: usize) -> Option<u64> {
        self.commits[..version as usize]
            .iter()
            .rev()
            .find(|c| c.query == Some(query))
            .map(|c| c.batch)
    }

    /// The source position the first `version` commits moved to (group
    /// mode), if any claimed one.
    pub(crate) fn position_as_of(&self, version: u64) -> Option<usize> {
        self.commits[..version as usize]
            .iter()
            .rev()
            .find_map(|c| c.claim.map(|(_, to)| to))
    }
}

/// One member's checkpoint.
#[derive(Default)]
pub(crate) struct Ckpt {
    pub(crate) offsets: BTreeMap<u64, Plan>,
    pub(crate) marks: BTreeMap<u64, Mark>,
    /// The newest mark before each write, for stale reads.
    pub(crate) mark_history: Vec<Option<u64>>,
    /// The state after each batch: good records seen so far.
    pub(crate) state: BTreeMap<u64, u64>,
}

/// Everything the processes share.
pub(crate) struct World {
    pub(crate) cfg: Config,
    pub(crate) rng: Rng,
    pub(crate) mutation: Option<Mutation>,
    pub(crate) faults_left: u32,
    /// Faults injected, by kind, for the summary.
    pub(crate) injected: Injected,
    /// The source's records so far.
    pub(crate) source: Vec<i64>,
    /// Each member's checkpoint (one but in group mode).
    pub(crate) ckpts: Vec<Ckpt>,
    pub(crate) tables: Vec<Table>,
    /// What happened, when a single schedule is traced.
    pub(crate) trace: Option<Vec<String>>,
}

/// Counts of the faults a schedule injected.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Injected {
    pub(crate) crashes: u64,
    pub(crate) zombies: u64,
    pub(crate) failed_calls: u64,
    pub(crate) lost_answers: u64,
    pub(crate) stale_reads: u64,
    /// Group-mode commits refused because another member moved the
    /// position first (not a fault: the protocol's own race).
    pub(crate) superseded: u64,
}

impl Injected {
    pub(crate) fn add(&mut self, o: &Injected) {
        self.crashes += o.crashes;
        self.zombies += o.zombies;
        self.failed_calls += o.failed_calls;
        self.lost_answers += o.lost_answers;
        self.stale_reads += o.stale_reads;
        self.superseded += o.superseded;
    }
}

impl World {
    pub(crate) fn new(cfg: Config, rng: Rng, mutation: Option<Mutation>, trace: bool) -> Self {
        Self {
            faults_left: cfg.fault_budget,
            tables: vec![Table::default(); cfg.outputs.len()],
            ckpts: (0..cfg.members()).map(|_| Ckpt::default()).collect(),
            cfg,
            rng,
            mutation,
            injected: Injected::default(),
            source: Vec::new(),
            trace: trace.then(Vec::new),
        }
    }

    /// Spend a fault with this chance, if any is left.
    pub(crate) fn fault(&mut self, per_mille: u64) -> bool {
        if self.faults_left > 0 && self.rng.chance(per_mille) {
            self.faults_left -= 1;
            true
        } else {
            false
        }
    }

    pub(crate) fn log(&mut self, line: impl FnOnce() -> String) {
        if let Some(t) = &mut self.trace {
            t.push(line());
        }
    }

    /// Member `q`'s newest mark, possibly stale.
    pub(crate) fn newest_mark(&mut self, q: usize) -> Option<u64> {
        let newest = self.ckpts[q].marks.keys().next_back().copied();
        let history = self.ckpts[q].mark_history.len();
        if history > 0 && self.rng.chance(self.cfg.stale_per_mille) {
            self.injected.stale_reads += 1;
            let i = self.rng.below(history as u64) as usize;
            return self.ckpts[q].mark_history[i];
        }
        newest
    }

    pub(crate) fn write_mark(&mut self, q: usize, m: Mark) {
        let c = &mut self.ckpts[q];
        let newest = c.marks.keys().next_back().copied();
        c.mark_history.push(newest);
        c.marks.insert(m.batch_id, m);
    }

    /// A version of table `i` a read sees: the newest, or (a stale read)
    /// an older one.
    fn seen_version(&mut self, i: usize) -> u64 {
        let now = self.tables[i].version();
        if now > 0 && self.rng.chance(self.cfg.stale_per_mille) {
            self.injected.stale_reads += 1;
            self.rng.below(now + 1)
        } else {
            now
        }
    }

    /// The version of table `i` when it holds `batch` for query `q`,
    /// reading possibly an older version.
    pub(crate) fn holds(&mut self, i: usize, q: usize, batch: u64) -> Option<u64> {
        let seen = self.seen_version(i);
        match self.tables[i].batch_as_of(seen, q) {
            Some(b) if b >= batch => Some(seen),
            _ => None,
        }
    }

    /// Group mode: the source position the first table holds, possibly
    /// stale (0 before any claim).
    pub(crate) fn position(&mut self) -> usize {
        let seen = self.seen_version(0);
        self.tables[0].position_as_of(seen).unwrap_or(0)
    }

    /// Commit `rows` as query `q`'s batch `batch` to table `i`, atomically
    /// checking the batch id the table holds for the query (as a Delta
    /// commit's `txn` check does, against the newest version) and, in group
    /// mode, that the position is still at the claim's start.
    pub(crate) fn commit(
        &mut self,
        i: usize,
        q: usize,
        batch: u64,
        rows: Vec<Row>,
        claim: Option<(usize, usize)>,
    ) -> lakestream_protocol::Committed {
        let t = &mut self.tables[i];
        let v = t.version();
        if self.mutation != Some(Mutation::SinkIgnoresBatchId)
            && t.batch_as_of(v, q).is_some_and(|b| b >= batch)
        {
            return lakestream_protocol::Committed::AlreadyHeld { version: v };
        }
        if let Some((from, _)) = claim
            && self.mutation != Some(Mutation::ClaimsIgnored)
            && let Some(at) = t.position_as_of(v)
            && at != from
        {
            self.injected.superseded += 1;
            return lakestream_protocol::Committed::Superseded {
                reason: format!("the position is at {at}, not at the claim's {from}"),
            };
        }
        t.commits.push(TableCommit {
            query: Some(q),
            batch,
            rows,
            claim,
        });
        lakestream_protocol::Committed::Written {
            version: t.version(),
        }
    }
}
