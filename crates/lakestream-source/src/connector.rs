//! [`SourceConnector`]: the factory of sources registered under a
//! `STORED AS` name, and what every source factory shares.

use std::sync::Arc;

use async_trait::async_trait;
use lakestream_job::connector::TableContext;

use crate::{Offset, OnError, Source};

/// A factory of stream sources for one `STORED AS` name (the engine's
/// registry holds them; an embedding program registers its own).
#[async_trait]
pub trait SourceConnector: Send + Sync {
    /// The options the connector accepts (storage options aside).
    fn options(&self) -> &'static [&'static str];

    /// Option keys with this prefix go to the connector's client as they
    /// are (Kafka: `kafka.`); the connector checks them itself.
    fn passthrough_prefix(&self) -> Option<&'static str> {
        None
    }

    /// The source for the `UNBOUNDED` table of `ctx`. Errors about the
    /// declaration come from [`TableContext::error`]; the source's own
    /// convert with `?`.
    async fn create(&self, ctx: &TableContext<'_>) -> lakestream_job::Result<Arc<dyn Source>>;

    /// Lines that tell a reader what a recorded range of a source of
    /// `kind` (its `SourceIdentity::kind`) holds, read through the
    /// source's typed offsets (`table lineage` prints them); `None` when
    /// `kind` is not this connector's or the offsets do not parse as its.
    fn describe_range(&self, kind: &str, start: &Offset, end: &Offset) -> Option<Vec<String>> {
        let _ = (kind, start, end);
        None
    }
}

/// A source's error, building it, as a job-loading error that keeps it whole.
impl From<crate::Error> for lakestream_job::Error {
    fn from(e: crate::Error) -> Self {
        lakestream_job::Error::connector(e)
    }
}

/// What the stream of `ctx` does with a record it cannot decode:
/// `on_error` (`fail`, the default, or `dead_letter`), which must come
/// with `dead_letter_location` (the table the engine writes them to) and
/// the other way round.
pub fn on_error(ctx: &TableContext<'_>) -> lakestream_job::Result<OnError> {
    let name = &ctx.table().name;
    let policy = match ctx.option("on_error") {
        None => OnError::Fail,
        Some(v) => OnError::from_name(v).ok_or_else(|| {
            ctx.error(format!(
                "option on_error of {name}: {v:?} is not a policy; use 'fail' (the \
                 default) or 'dead_letter'"
            ))
        })?,
    };
    match (policy, ctx.option("dead_letter_location")) {
        (OnError::DeadLetter, None) => Err(ctx.error(format!(
            "{name} sets on_error 'dead_letter' without dead_letter_location: name the \
             Delta table its undecodable records go to, e.g. 'dead_letter_location' \
             'out/{name}_dead_letters'"
        ))),
        (OnError::Fail, Some(_)) => Err(ctx.error(format!(
            "{name} sets dead_letter_location but not on_error 'dead_letter': without it \
             an undecodable record fails the batch and nothing goes there"
        ))),
        _ => Ok(policy),
    }
}
