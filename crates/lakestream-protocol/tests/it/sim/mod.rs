//! Deterministic simulation of the exactly-once protocol.
//!
//! A seed draws a schedule: the source's size, the batch size, the outputs
//! (stateless, stateful, dead letters), the fault rates and budget. Actors
//! (a producer appending records, another writer committing to the first
//! output's table, and lakestream processes) run as futures polled one step
//! at a time, in an order the seed decides. Between steps the scheduler may
//! kill a process (drop its future: kill -9 at any call), or leave it
//! paused and start a second process beside it. Calls fail, answers to
//! done writes are lost, reads of table versions and of the newest mark
//! are stale, all as the seed says.
//!
//! Invariant after every schedule: each output table holds, from the
//! query, exactly the rows of a failure-free run, in order, once; the
//! write-ahead records chain without a gap; every batch is marked; each
//! mark's versions hold the batch; the other writer's commits are intact.

pub(crate) mod process;
pub(crate) mod world;

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use process::{Exit, Shared, process, yield_now};
use world::{Config, Injected, Mutation, Output, Rng, Row, World, is_bad};

/// Scheduler steps after which a schedule counts as stuck.
const STEP_LIMIT: u64 = 200_000;

/// What a schedule that kept the invariant went through.
pub(crate) struct Ran {
    pub(crate) steps: u64,
    pub(crate) injected: Injected,
}

/// A schedule that broke the invariant.
#[derive(Debug)]
pub(crate) struct Broken {
    pub(crate) seed: u64,
    pub(crate) what: String,
    pub(crate) config: String,
    pub(crate) trace: Vec<String>,
}

enum Kind {
    Producer,
    OtherWriter,
    Process(u32),
}

struct Actor {
    kind: Kind,
    fut: Pin<Box<dyn Future<Output = Exit>>>,
}

async fn producer(w: Shared) -> Exit {
    loop {
        yield_now().await;
        let mut world = w.borrow_mut();
        if world.source.len() == world.cfg.records {
            return Exit::Finished;
        }
        let v = world.source.len() as i64 + 1;
        world.source.push(v);
    }
}

async fn other_writer(w: Shared) -> Exit {
    let n = w.borrow().cfg.foreign_commits;
    for k in 0..n {
        yield_now().await;
        let mut world = w.borrow_mut();
        world.tables[0].commits.push(world::TableCommit {
            query: None,
            batch: k as u64,
            rows: vec![(-1, k as u64)],
            claim: None,
        });
    }
    Exit::Finished
}

/// Run the schedule of `seed`, with `mutation` planted if any; `trace`
/// keeps every call for the report.
pub(crate) fn run(seed: u64, mutation: Option<Mutation>, trace: bool) -> Result<Ran, Broken> {
    let mut rng = Rng::new(seed);
    let cfg = Config::draw(&mut rng);
    let config = format!("{cfg:?}");
    let world: Shared = Rc::new(RefCell::new(World::new(
        cfg,
        Rng::new(rng.next()),
        mutation,
        trace,
    )));
    let broken = |what: String, world: &Shared| Broken {
        seed,
        what,
        config: config.clone(),
        trace: world.borrow_mut().trace.take().unwrap_or_default(),
    };
    let mut actors: Vec<Actor> = vec![
        Actor {
            kind: Kind::Producer,
            fut: Box::pin(producer(world.clone())),
        },
        Actor {
            kind: Kind::OtherWriter,
            fut: Box::pin(other_writer(world.clone())),
        },
    ];
    let mut next_pid = 0u32;
    let members = world.borrow().cfg.members() as u32;
    let spawn = |actors: &mut Vec<Actor>, next_pid: &mut u32| {
        // In group mode processes take turns being each member.
        let member = (*next_pid % members) as usize;
        actors.push(Actor {
            kind: Kind::Process(*next_pid),
            fut: Box::pin(process(world.clone(), *next_pid, member)),
        });
        *next_pid += 1;
    };
    let mut cx = Context::from_waker(Waker::noop());
    let mut steps = 0u64;
    loop {
        steps += 1;
        if steps > STEP_LIMIT {
            return Err(broken(
                format!("no progress after {STEP_LIMIT} steps"),
                &world,
            ));
        }
        let live = actors
            .iter()
            .filter(|a| matches!(a.kind, Kind::Process(_)))
            .count();
        if live == 0 {
            if complete(&world.borrow()) {
                if actors.is_empty() {
                    break;
                }
            } else {
                spawn(&mut actors, &mut next_pid);
                world
                    .borrow_mut()
                    .log(|| format!("start p{}", next_pid - 1));
                continue;
            }
        } else {
            // A kill -9, or a pause with a second process started beside.
            let mut w = world.borrow_mut();
            let p = w.cfg.crash_per_mille;
            if w.fault(p) {
                let procs: Vec<usize> = (0..actors.len())
                    .filter(|i| matches!(actors[*i].kind, Kind::Process(_)))
                    .collect();
                let victim = procs[w.rng.below(procs.len() as u64) as usize];
                let Kind::Process(pid) = actors[victim].kind else {
                    unreachable!()
                };
                let z = w.cfg.zombie_per_mille;
                if live < 2 && w.rng.chance(z) {
                    w.injected.zombies += 1;
                    w.log(|| format!("p{pid} paused; p{next_pid} starts beside it"));
                    drop(w);
                    spawn(&mut actors, &mut next_pid);
                } else {
                    w.injected.crashes += 1;
                    w.log(|| format!("p{pid} killed"));
                    drop(w);
                    actors.swap_remove(victim);
                }
                continue;
            }
        }
        if actors.is_empty() {
            continue;
        }
        let i = world.borrow_mut().rng.below(actors.len() as u64) as usize;
        if let Poll::Ready(exit) = actors[i].fut.as_mut().poll(&mut cx) {
            if let Kind::Process(pid) = actors[i].kind {
                world.borrow_mut().log(|| format!("p{pid} exits: {exit:?}"));
            }
            actors.swap_remove(i);
        }
    }
    let verdict = check(&world.borrow());
    if let Err(what) = verdict {
        return Err(broken(what, &world));
    }
    let injected = world.borrow().injected;
    Ok(Ran { steps, injected })
}

/// Whether every record the source will hold is in, and every planned
/// batch of every member marked (then no process needs to run).
fn complete(w: &World) -> bool {
    let consumed = if w.cfg.group {
        w.tables[0].position_as_of(w.tables[0].version()) == Some(w.cfg.records)
    } else {
        w.ckpts[0].offsets.values().next_back().map_or(0, |p| p.end) == w.cfg.records
    };
    w.source.len() == w.cfg.records
        && consumed
        && w.ckpts
            .iter()
            .all(|c| c.offsets.keys().all(|n| c.marks.contains_key(n)))
}

/// The invariant.
fn check(w: &World) -> Result<(), String> {
    let good: Vec<i64> = w.source.iter().copied().filter(|v| !is_bad(*v)).collect();
    let bad: Vec<i64> = w.source.iter().copied().filter(|v| is_bad(*v)).collect();
    for (i, out) in w.cfg.outputs.iter().enumerate() {
        let expected: Vec<Row> = match out {
            Output::Doubled => good.iter().map(|v| (v * 2, 0)).collect(),
            Output::Numbered => good
                .iter()
                .enumerate()
                .map(|(k, v)| (*v, k as u64))
                .collect(),
            Output::DeadLetters => bad.iter().map(|v| (*v, 0)).collect(),
        };
        let ours: Vec<&world::TableCommit> = w.tables[i]
            .commits
            .iter()
            .filter(|c| c.query.is_some())
            .collect();
        let got: Vec<Row> = ours.iter().flat_map(|c| c.rows.iter().copied()).collect();
        if got != expected {
            return Err(format!(
                "output {i} ({out:?}) holds {got:?}, a failure-free run {expected:?}"
            ));
        }
        for q in 0..w.cfg.members() {
            let batches: Vec<u64> = ours
                .iter()
                .filter(|c| c.query == Some(q))
                .map(|c| c.batch)
                .collect();
            if batches.windows(2).any(|p| p[0] >= p[1]) {
                return Err(format!(
                    "output {i} ({out:?}) holds a batch of member {q} twice or out of order"
                ));
            }
        }
    }
    let foreign = w.tables[0]
        .commits
        .iter()
        .filter(|c| c.query.is_none())
        .count();
    if foreign != w.cfg.foreign_commits {
        return Err(format!(
            "the other writer made {} commits, the table keeps {foreign}",
            w.cfg.foreign_commits
        ));
    }
    if w.cfg.group {
        // The claims chain: each commit starts where the one before ended.
        let mut at = 0;
        for c in &w.tables[0].commits {
            if let Some((from, to)) = c.claim {
                if from != at {
                    return Err(format!("a claim starts at {from}, the position was {at}"));
                }
                at = to;
            }
        }
        if at != w.cfg.records {
            return Err(format!(
                "the claims reach {at} of {} records",
                w.cfg.records
            ));
        }
    }
    for (q, c) in w.ckpts.iter().enumerate() {
        let mut end = 0;
        for (n, p) in &c.offsets {
            if !w.cfg.group && p.start != end {
                return Err(format!(
                    "offsets/{n} starts at {}, the batch before ended at {end}",
                    p.start
                ));
            }
            end = p.end;
            let Some(m) = c.marks.get(n) else {
                return Err(format!(
                    "batch {n} of member {q} is planned and never marked"
                ));
            };
            for (i, v) in m.versions.iter().enumerate() {
                if let Some(v) = v
                    && w.tables[i].batch_as_of(*v, q).is_none_or(|b| b < *n)
                {
                    return Err(format!(
                        "commits/{n} of member {q} names version {v} of output {i}, which lacks \
                         the batch"
                    ));
                }
            }
        }
        if !w.cfg.group && end != w.cfg.records {
            return Err(format!("batches read {end} of {} records", w.cfg.records));
        }
    }
    Ok(())
}
