//! [`SinkConnector`]: the factory of sinks registered under a `STORED AS`
//! name.

use std::sync::Arc;

use async_trait::async_trait;
use lakestream_job::connector::TableContext;

use crate::Sink;

/// A factory of sinks for one `STORED AS` name (the engine's registry
/// holds them; an embedding program registers its own).
#[async_trait]
pub trait SinkConnector: Send + Sync {
    /// The options the connector accepts (storage options aside).
    fn options(&self) -> &'static [&'static str];

    /// A prefix of option keys passed through to the sink's client as
    /// they are (Kafka's `kafka.`), or `None` (the default).
    fn passthrough_prefix(&self) -> Option<&'static str> {
        None
    }

    /// The sink for the output table of `ctx` (an `INSERT` target or a
    /// dead-letter table). Errors about the declaration come from
    /// [`TableContext::error`]; the sink's own convert with `?`.
    async fn create(&self, ctx: &TableContext<'_>) -> lakestream_job::Result<Arc<dyn Sink>>;
}

/// A sink's error, building it, as a job-loading error that keeps it whole.
impl From<crate::Error> for lakestream_job::Error {
    fn from(e: crate::Error) -> Self {
        lakestream_job::Error::connector(e)
    }
}
