//! A simulated lakestream process: recovery, planning and each batch's
//! steps decided by `lakestream_protocol`, carried out against the
//! in-memory world. Every call to the world is a point where the scheduler
//! may run another actor or kill this one.

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};

use lakestream_protocol::{Action, BatchSteps, Committed, resume, state_base};

use super::world::{Mutation, Output, Plan, Row, World, is_bad};

pub(crate) type Shared = Rc<RefCell<World>>;

/// How a process ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Exit {
    /// It planned everything the source will ever hold.
    Finished,
    /// A call failed: the process exits, as the engine's run does.
    Failed(String),
}

/// Gives the scheduler a turn: pending once, then ready.
struct YieldNow(bool);

impl Future for YieldNow {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            Poll::Ready(())
        } else {
            self.0 = true;
            Poll::Pending
        }
    }
}

pub(crate) fn yield_now() -> impl Future<Output = ()> {
    YieldNow(false)
}

/// A call to the world: a scheduling point, then `f`, unless the call
/// fails first.
async fn call<T>(
    w: &Shared,
    pid: u32,
    what: &'static str,
    f: impl FnOnce(&mut World) -> T,
) -> Result<T, String> {
    yield_now().await;
    let mut world = w.borrow_mut();
    let p = world.cfg.fail_per_mille;
    if world.fault(p) {
        world.injected.failed_calls += 1;
        world.log(|| format!("p{pid} {what}: failed"));
        return Err(format!("{what} failed"));
    }
    world.log(|| format!("p{pid} {what}"));
    Ok(f(&mut world))
}

/// A write: as [`call`], and once done, its answer may be lost; the process
/// may also be killed before it sees the answer.
async fn write<T>(
    w: &Shared,
    pid: u32,
    what: &'static str,
    f: impl FnOnce(&mut World) -> T,
) -> Result<T, String> {
    let t = call(w, pid, what, f).await?;
    yield_now().await;
    let mut world = w.borrow_mut();
    let p = world.cfg.lost_per_mille;
    if world.fault(p) {
        world.injected.lost_answers += 1;
        world.log(|| format!("p{pid} {what}: done, answer lost"));
        return Err(format!("{what}: answer lost"));
    }
    Ok(t)
}

/// One process of member `q` (its checkpoint and query id), from its
/// start to its exit.
pub(crate) async fn process(w: Shared, pid: u32, q: usize) -> Exit {
    match run(&w, pid, q).await {
        Ok(()) => Exit::Finished,
        Err(e) => Exit::Failed(e),
    }
}

async fn run(w: &Shared, pid: u32, q: usize) -> Result<(), String> {
    let (max_batch, mutation, group) = {
        let world = w.borrow();
        (world.cfg.max_batch, world.mutation, world.cfg.group)
    };
    let last_planned = call(w, pid, "list offsets", |w| {
        w.ckpts[q].offsets.keys().next_back().copied()
    })
    .await?;
    let last_marked = call(w, pid, "read the newest mark", |w| w.newest_mark(q)).await?;
    let r = resume(last_planned, last_marked);
    let mut prev_end = match last_planned {
        Some(n) => {
            call(w, pid, "read the last offsets", |w| {
                w.ckpts[q].offsets[&n].end
            })
            .await?
        }
        None => 0,
    };
    if let Some(n) = r.pending
        && mutation != Some(Mutation::ForgetPending)
    {
        let plan = call(w, pid, "read the pending offsets", |w| {
            w.ckpts[q].offsets[&n]
        })
        .await?;
        run_batch(w, pid, q, n, plan, true).await?;
    }
    let mut next = r.next_id;
    loop {
        if group {
            // The source's position lives in the table: read at each plan,
            // possibly stale (a stale start is superseded at its commit).
            prev_end = call(w, pid, "read the position", World::position).await?;
        }
        let (len, all) = call(w, pid, "plan", |w| {
            (w.source.len(), w.source.len() == w.cfg.records)
        })
        .await?;
        let end = len.min(prev_end + max_batch);
        if end == prev_end {
            if all {
                return Ok(());
            }
            continue;
        }
        let plan = Plan {
            start: prev_end,
            end,
        };
        let fenced = write(w, pid, "write ahead", |w| {
            let overwrite = w.mutation == Some(Mutation::WriteAheadOverwrites);
            let offsets = &mut w.ckpts[q].offsets;
            if offsets.contains_key(&next) && !overwrite {
                return false;
            }
            offsets.insert(next, plan);
            true
        })
        .await?;
        if !fenced {
            return Err(format!("offsets/{next} was written by another process"));
        }
        run_batch(w, pid, q, next, plan, false).await?;
        prev_end = end;
        next += 1;
    }
}

/// Batch `batch` over `plan`, as the protocol's steps say.
async fn run_batch(
    w: &Shared,
    pid: u32,
    q: usize,
    batch: u64,
    plan: Plan,
    recovered: bool,
) -> Result<(), String> {
    let (outputs, mutation, group) = {
        let world = w.borrow();
        (world.cfg.outputs.clone(), world.mutation, world.cfg.group)
    };
    let roles = outputs.iter().map(|o| o.role()).collect();
    let mut steps = BatchSteps::new(batch, roles, recovered);
    let mut staged: Vec<Option<Vec<Row>>> = vec![None; outputs.len()];
    let mut records: Vec<i64> = Vec::new();
    if mutation == Some(Mutation::MarkBeforeCommit) {
        write(w, pid, "mark (too early)", |w| {
            w.write_mark(
                q,
                lakestream_protocol::Mark {
                    batch_id: batch,
                    versions: vec![None; w.cfg.outputs.len()],
                    skipped: false,
                    superseded: None,
                },
            )
        })
        .await?;
    }
    loop {
        match steps.next() {
            Action::CheckOutputs => {
                let mut found = Vec::with_capacity(outputs.len());
                for i in 0..outputs.len() {
                    found.push(call(w, pid, "check an output", |w| w.holds(i, q, batch)).await?);
                }
                steps.checked(&found);
            }
            Action::Execute(query_outputs) => {
                records = call(w, pid, "read the input", |w| {
                    w.source[plan.start..plan.end].to_vec()
                })
                .await?;
                let good: Vec<i64> = records.iter().copied().filter(|v| !is_bad(*v)).collect();
                for i in query_outputs {
                    staged[i] = Some(match outputs[i] {
                        Output::Doubled => good.iter().map(|v| (v * 2, 0)).collect(),
                        Output::Numbered => {
                            let base = if mutation == Some(Mutation::StateFromNewest) {
                                call(w, pid, "read the newest state", |w| {
                                    w.ckpts[q].state.values().next_back().copied()
                                })
                                .await?
                                .unwrap_or(0)
                            } else {
                                match state_base(batch) {
                                    None => 0,
                                    Some(b) => call(w, pid, "read the state", |w| {
                                        w.ckpts[q].state.get(&b).copied()
                                    })
                                    .await?
                                    .ok_or_else(|| format!("the state of batch {b} is missing"))?,
                                }
                            };
                            let rows: Vec<Row> = good
                                .iter()
                                .enumerate()
                                .map(|(k, v)| (*v, base + k as u64))
                                .collect();
                            let after = base + good.len() as u64;
                            write(w, pid, "write the state", |w| {
                                w.ckpts[q].state.insert(batch, after);
                            })
                            .await?;
                            rows
                        }
                        Output::DeadLetters => unreachable!("dead letters are not a query"),
                    });
                }
                steps.executed();
            }
            Action::Commit(i) => {
                let rows = match outputs[i] {
                    Output::DeadLetters => records
                        .iter()
                        .filter(|v| is_bad(**v))
                        .map(|v| (*v, 0))
                        .collect(),
                    _ => staged[i].take().expect("a query output is staged"),
                };
                let outcome = if rows.is_empty() && outputs[i] == Output::DeadLetters {
                    Committed::Nothing
                } else {
                    write(w, pid, "commit an output", |w| {
                        w.commit(i, q, batch, rows, group.then_some((plan.start, plan.end)))
                    })
                    .await?
                };
                steps.committed(i, outcome);
            }
            Action::Mark(m) => {
                write(w, pid, "mark", |w| w.write_mark(q, m)).await?;
                steps.marked();
            }
            Action::Notify { .. } => steps.notified(),
            Action::Done(_) => return Ok(()),
        }
    }
}
