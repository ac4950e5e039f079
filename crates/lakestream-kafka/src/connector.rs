//! `STORED AS KAFKA` on an output table: a [`KafkaSink`] from
//! `LOCATION 'kafka://HOST:PORT[,HOST:PORT]/TOPIC'` and the options below;
//! `kafka.*` keys (and a `properties_file`) go to librdkafka, except the
//! ones the sink owns ([`OWNED_PRODUCER_KEYS`]).

use std::sync::Arc;

use async_trait::async_trait;
use lakestream_job::connector::TableContext;
use lakestream_job::settings::{bootstrap_servers, client_settings};
use lakestream_job::{Error, Result};
use lakestream_sink::{Sink, SinkConnector};

use crate::sink::{KafkaSink, KafkaSinkOptions, OWNED_PRODUCER_KEYS};

/// Builds [`KafkaSink`]s for output tables `STORED AS KAFKA`.
#[derive(Debug, Default)]
pub struct KafkaSinkConnector;

#[async_trait]
impl SinkConnector for KafkaSinkConnector {
    fn options(&self) -> &'static [&'static str] {
        &[
            "format",
            "transactional_id",
            "transaction_timeout",
            "unavailable_timeout",
            "properties_file",
        ]
    }

    fn passthrough_prefix(&self) -> Option<&'static str> {
        Some("kafka.")
    }

    async fn create(&self, ctx: &TableContext<'_>) -> Result<Arc<dyn Sink>> {
        let t = ctx.table();
        let err = |msg: String| -> Error { ctx.error(msg) };
        let rest = t.location.strip_prefix("kafka://").ok_or_else(|| {
            err(format!(
                "a KAFKA output's LOCATION is kafka://HOST:PORT[,HOST:PORT]/TOPIC, got {:?}",
                t.location
            ))
        })?;
        let (servers, topic) = rest.split_once('/').unwrap_or((rest, ""));
        let topic = topic.trim_end_matches('/');
        if topic.is_empty() || topic.contains(',') {
            return Err(err(format!(
                "the output {} writes one topic: LOCATION 'kafka://HOST:PORT/TOPIC', got {:?}",
                t.name, t.location
            )));
        }
        if let Some(f) = ctx.option("format")
            && !f.eq_ignore_ascii_case("json")
        {
            return Err(err(format!(
                "format {f:?} of output {}: a Kafka output writes JSON values ('format' 'json')",
                t.name
            )));
        }
        let mut settings =
            client_settings(ctx, "kafka.", OWNED_PRODUCER_KEYS, "the transactional sink")?;
        let servers = bootstrap_servers(ctx, servers, &settings)?;
        settings.remove("bootstrap.servers");
        let mut o = KafkaSinkOptions::new(&servers, topic);
        o.client_config = settings;
        o.transactional_id = ctx.option("transactional_id").map(str::to_string);
        for (key, field) in [
            ("transaction_timeout", &mut o.transaction_timeout),
            ("unavailable_timeout", &mut o.unavailable_timeout),
        ] {
            if let Some(d) = ctx.duration(key, |v| {
                format!("{key} must be a duration like 30s, got {v:?}")
            })? {
                *field = d;
            }
        }
        Ok(Arc::new(KafkaSink::try_new(o)?))
    }
}
