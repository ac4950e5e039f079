//! Group mode (`group_id`): several processes run the same job, Kafka's
//! consumer-group protocol shares the partitions among them, and each
//! partition's position lives in the output table.
//!
//! A process joins the group with a consumer that never reads: its
//! partitions are paused as soon as they are assigned, and it is polled
//! between batches only, so a revocation takes effect between two batches
//! (the batch in flight is committed or dropped first). Reads stay
//! explicit-offset reads, as in the default mode.
//!
//! Each batch reads, for every partition the process owns, from the
//! partition's position to its end and commits `txn(<group>/<topic>/<partition>,
//! end)` with the rows ([`PositionClaim`]). The commit lands only if the
//! table still holds the batch's start for each of them, so whatever the
//! group protocol does (a rebalance racing a commit, a process that lost
//! its partitions without noticing, a replay after kill -9), the ranges of
//! a partition in the table form one chain: every offset once. A position
//! comes from the table when a process takes a partition over, then from
//! its own commits.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::ClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance};

use super::*;
use crate::{PositionClaim, PositionStore};

/// The membership consumer's context: pauses what it is assigned (it is
/// never read from) and notes what it loses.
#[derive(Default)]
pub(super) struct GroupContext {
    revoked: Mutex<BTreeSet<(String, i32)>>,
}

impl ClientContext for GroupContext {}

impl ConsumerContext for GroupContext {
    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(tpl) => {
                if let Err(e) = consumer.pause(tpl) {
                    tracing::warn!(error = %e, "pausing assigned partitions failed");
                }
                tracing::info!(
                    partitions = tpl.count(),
                    protocol = match consumer.rebalance_protocol() {
                        rdkafka::consumer::RebalanceProtocol::Cooperative => "cooperative",
                        rdkafka::consumer::RebalanceProtocol::Eager => "eager",
                        rdkafka::consumer::RebalanceProtocol::None => "none",
                    },
                    "partitions assigned"
                );
            }
            Rebalance::Revoke(tpl) => {
                let mut revoked = self.revoked.lock().expect("revoked");
                for el in tpl.elements() {
                    revoked.insert((el.topic().to_string(), el.partition()));
                }
                tracing::info!(partitions = tpl.count(), "partitions revoked");
            }
            Rebalance::Error(e) => tracing::warn!(error = %e, "group rebalance failed"),
        }
    }
}

/// A process's membership of the group and the positions of the
/// partitions it owns.
pub(super) struct Group {
    consumer: Arc<BaseConsumer<GroupContext>>,
    /// Next offset to read of each owned partition: read from the table
    /// when the partition was taken over, then moved by this process's
    /// commits.
    positions: Mutex<BTreeMap<(String, i32), i64>>,
    /// The topic ids seen, compared at each plan as in the default mode.
    topic_ids: Mutex<BTreeMap<String, String>>,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("positions", &self.positions)
            .finish()
    }
}

/// The slot holding the group membership (joined at the first plan) and
/// the position store.
#[derive(Default)]
pub(super) struct GroupSlot {
    group: Mutex<Option<Arc<Group>>>,
    store: Mutex<Option<Arc<dyn PositionStore>>>,
}

impl std::fmt::Debug for GroupSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GroupSlot")
    }
}

impl GroupSlot {
    pub(super) fn set_store(&self, store: Arc<dyn PositionStore>) {
        *self.store.lock().expect("position store") = Some(store);
    }

    /// Forget every position: the next plan reads them from the table.
    pub(super) fn forget(&self) {
        if let Some(g) = self.group.lock().expect("group").as_ref() {
            g.positions.lock().expect("positions").clear();
        }
    }

    /// A committed batch moved the positions of the partitions it read.
    pub(super) fn advance(&self, end: &KafkaOffset) {
        let Some(g) = self.group.lock().expect("group").clone() else {
            return;
        };
        let mut positions = g.positions.lock().expect("positions");
        for (t, ps) in &end.partitions {
            for (p, o) in ps {
                if let Some(pos) = positions.get_mut(&(t.clone(), *p)) {
                    *pos = *o;
                }
            }
        }
    }
}

/// The transaction app id holding `topic`/`partition`'s position for
/// `group`.
pub fn position_app_id(group: &str, topic: &str, partition: i32) -> String {
    format!("{group}/{topic}/{partition}")
}

/// How many queued events one poll of the membership consumer serves at
/// most (rebalance callbacks, errors).
const MAX_EVENTS_PER_POLL: usize = 64;

impl KafkaSource {
    fn group_id(&self) -> &str {
        self.options
            .group_id
            .as_deref()
            .expect("group mode has a group id")
    }

    /// The group membership, joining at the first call.
    fn group(&self) -> Result<Arc<Group>> {
        let mut slot = self.membership.group.lock().expect("group");
        if let Some(g) = slot.as_ref() {
            return Ok(g.clone());
        }
        let mut cfg = self.client_config();
        cfg.set("group.id", self.group_id())
            // Never read from: nothing to reset to, nothing to commit.
            .set("auto.offset.reset", "latest");
        // Cooperative-sticky unless the job chose its strategy
        // (`kafka.partition.assignment.strategy`): a rebalance then moves
        // only the partitions that change owner.
        if !self
            .options
            .client_config
            .keys()
            .any(|k| k.eq_ignore_ascii_case("partition.assignment.strategy"))
        {
            cfg.set("partition.assignment.strategy", "cooperative-sticky");
        }
        let consumer: BaseConsumer<GroupContext> = cfg
            .create_with_context(GroupContext::default())
            .map_err(|e| create_err(&self.name, e))?;
        match &self.options.topics {
            Topics::List(list) => {
                let names: Vec<&str> = list.iter().map(String::as_str).collect();
                consumer.subscribe(&names)
            }
            Topics::Pattern(re) => consumer.subscribe(&[&format!("^{}", re.as_str())]),
        }
        .map_err(|e| self.kafka_err(&format!("join consumer group {}", self.group_id()), e))?;
        let g = Arc::new(Group {
            consumer: Arc::new(consumer),
            positions: Mutex::new(BTreeMap::new()),
            topic_ids: Mutex::new(BTreeMap::new()),
        });
        *slot = Some(g.clone());
        Ok(g)
    }

    /// Serve the membership consumer's queued events (rebalances) and
    /// return the partitions owned now.
    async fn owned_partitions(&self, group: &Arc<Group>) -> Result<BTreeSet<(String, i32)>> {
        let consumer = group.consumer.clone();
        let name = self.name.clone();
        tokio::task::spawn_blocking(move || {
            for _ in 0..MAX_EVENTS_PER_POLL {
                match consumer.poll(Duration::ZERO) {
                    None => break,
                    // Assigned partitions are paused; a message fetched
                    // before the pause is not ours to read.
                    Some(Ok(_)) => {}
                    Some(Err(e)) => {
                        tracing::warn!(source = %name, error = %e, "consumer group event");
                        break;
                    }
                }
            }
            let owned = consumer.assignment().map_err(|e| Error::Kafka {
                source_name: name.clone(),
                what: "read the consumer group's assignment".into(),
                reason: e.to_string(),
                transient: true,
            })?;
            Ok(owned
                .elements()
                .iter()
                .map(|e| (e.topic().to_string(), e.partition()))
                .collect())
        })
        .await
        .map_err(|e| Error::Kafka {
            source_name: self.name.clone(),
            what: "poll the consumer group".into(),
            reason: e.to_string(),
            transient: false,
        })?
    }

    /// Plan a batch over the partitions this process owns, from their
    /// positions: see the module docs.
    pub(super) async fn plan_group(&self) -> Result<Option<KafkaOffset>> {
        let group = self.group()?;
        let owned = self.owned_partitions(&group).await?;
        let revoked =
            std::mem::take(&mut *group.consumer.context().revoked.lock().expect("revoked"));
        let missing: Vec<(String, i32)> = {
            let mut positions = group.positions.lock().expect("positions");
            positions.retain(|k, _| owned.contains(k) && !revoked.contains(k));
            owned
                .iter()
                .filter(|k| !positions.contains_key(*k))
                .cloned()
                .collect()
        };
        if owned.is_empty() {
            self.state.lock().expect("kafka state").latest = Some(crate::Latest::default());
            return Ok(None);
        }
        // Watermarks of the owned partitions only.
        let all = self.watermarks().await?;
        let marks = Watermarks {
            marks: all
                .marks
                .into_iter()
                .map(|(t, ps)| {
                    let ps: BTreeMap<i32, (i64, i64)> = ps
                        .into_iter()
                        .filter(|(p, _)| owned.contains(&(t.clone(), *p)))
                        .collect();
                    (t, ps)
                })
                .filter(|(_, ps)| !ps.is_empty())
                .collect(),
        };
        if !missing.is_empty() {
            // Partitions taken over: from the table, else where the job
            // starts reading a partition never committed.
            let store = self
                .membership
                .store
                .lock()
                .expect("position store")
                .clone()
                .ok_or_else(|| Error::InvalidOption {
                    source_name: self.name.clone(),
                    option: "group_id".into(),
                    reason: "group mode keeps positions in the output table, and this query \
                             gave the source none (run it through the engine with one Delta \
                             output)"
                        .into(),
                })?;
            let ids: Vec<String> = missing
                .iter()
                .map(|(t, p)| position_app_id(self.group_id(), t, *p))
                .collect();
            let in_table = store
                .positions(&ids)
                .await
                .map_err(|source| Error::Positions {
                    source_name: self.name.clone(),
                    source,
                })?;
            let starting = self.resolve_starting(&marks).await?;
            let mut positions = group.positions.lock().expect("positions");
            for ((t, p), id) in missing.iter().zip(&ids) {
                let pos = match in_table.get(id) {
                    Some(pos) => *pos,
                    None => match starting.get(t).and_then(|m| m.get(p)) {
                        Some(s) => *s,
                        // Not in the metadata yet: planned next time.
                        None => continue,
                    },
                };
                tracing::info!(source = %self.name, topic = %t, partition = p, position = pos,
                    from_table = in_table.contains_key(id), "took over a partition");
                positions.insert((t.clone(), *p), pos);
            }
        }
        let mut prev = KafkaOffset {
            topic_ids: group.topic_ids.lock().expect("topic ids").clone(),
            ..Default::default()
        };
        {
            let positions = group.positions.lock().expect("positions");
            for ((t, p), o) in positions.iter() {
                prev.partitions.entry(t.clone()).or_default().insert(*p, *o);
            }
        }
        // Partitions without a position (not in the metadata yet) wait.
        let marks = Watermarks {
            marks: marks
                .marks
                .into_iter()
                .map(|(t, ps)| {
                    let known = prev.partitions.get(&t).cloned().unwrap_or_default();
                    let ps: BTreeMap<i32, (i64, i64)> = ps
                        .into_iter()
                        .filter(|(p, _)| known.contains_key(p))
                        .collect();
                    (t, ps)
                })
                .filter(|(_, ps)| !ps.is_empty())
                .collect(),
        };
        let Some(mut next) = self.plan_next(&prev, &marks).await? else {
            return Ok(None);
        };
        *group.topic_ids.lock().expect("topic ids") = next.topic_ids.clone();
        let mut from = PartitionOffsets::new();
        for (t, ps) in &next.partitions {
            for p in ps.keys() {
                if let Some(o) = prev.partitions.get(t).and_then(|m| m.get(p)) {
                    from.entry(t.clone()).or_default().insert(*p, *o);
                }
            }
        }
        next.group_from = Some(from);
        Ok(Some(next))
    }

    /// The positions batch `end` moves: every partition it planned.
    pub(super) fn group_claims(&self, end: &KafkaOffset) -> Vec<PositionClaim> {
        let (Some(group), Some(from)) = (self.options.group_id.as_deref(), &end.group_from) else {
            return Vec::new();
        };
        let mut claims = Vec::new();
        for (t, ps) in &end.partitions {
            for (p, to) in ps {
                if let Some(f) = from.get(t).and_then(|m| m.get(p)) {
                    claims.push(PositionClaim {
                        app_id: position_app_id(group, t, *p),
                        from: *f,
                        to: *to,
                    });
                }
            }
        }
        claims
    }
}

/// Group mode: the partitions' positions live in the output table.
#[async_trait::async_trait]
impl crate::TablePositions for super::KafkaSource {
    fn set_position_store(&self, store: Arc<dyn PositionStore>) {
        self.membership.set_store(store);
    }

    fn claims(&self, end: &crate::Offset) -> crate::Result<Vec<PositionClaim>> {
        Ok(self.group_claims(&self.parse(end)?))
    }

    async fn superseded(&self, _end: &crate::Offset) {
        self.membership.forget();
    }
}
