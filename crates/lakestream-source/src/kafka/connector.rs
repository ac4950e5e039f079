//! `STORED AS KAFKA`: topics read exactly once by explicit offset range.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::Source;
use crate::avro::{as_record, project_reader_schema};
use crate::kafka::registry::{AvroValues, ProtobufValues, RegistryOptions, SchemaRegistry};
use crate::kafka::{
    EndingOffsets, IsolationLevel, KafkaOffset, KafkaSource, KafkaSourceOptions, KeyFormat,
    RESERVED_CLIENT_KEYS, StartingOffsets, Topics, ValueFormat,
};
use async_trait::async_trait;

use crate::SourceConnector;
use lakestream_job::connector::TableContext;
use lakestream_job::settings::{bootstrap_servers, client_settings, expand_env};
use lakestream_job::{Error, Result};

/// Builds [`KafkaSource`]s from `LOCATION 'kafka://HOST:PORT[,...]/TOPIC[,...]'`
/// and the options below; `kafka.*` keys go to librdkafka (the source
/// refuses the ones its exactly-once reading owns).
#[derive(Debug, Default)]
pub struct KafkaConnector;

#[async_trait]
impl SourceConnector for KafkaConnector {
    fn describe_range(
        &self,
        kind: &str,
        start: &crate::Offset,
        end: &crate::Offset,
    ) -> Option<Vec<String>> {
        if kind != "kafka" {
            return None;
        }
        let end: KafkaOffset = serde_json::from_value(end.clone()).ok()?;
        let start: Option<KafkaOffset> = serde_json::from_value(start.clone()).ok();
        Some(end.describe_range(start.as_ref()))
    }

    fn options(&self) -> &'static [&'static str] {
        &[
            "format",
            "key_format",
            "starting_offsets",
            "starting_timestamp",
            "ending_offsets",
            "max_offsets_per_trigger",
            "fail_on_data_loss",
            "isolation_level",
            "topic_pattern",
            "read_timeout",
            "request_timeout",
            "unavailable_timeout",
            "commit_offsets_to_group",
            "batch_size",
            "consumers",
            "on_error",
            "dead_letter_location",
            "partitions",
            "group_id",
            "properties_file",
            "schema_registry_url",
            "schema_registry_user",
            "schema_registry_password",
            "schema_registry_ca_location",
            "value_subject",
            "key_subject",
            "key_columns",
            "value_message",
        ]
    }

    fn passthrough_prefix(&self) -> Option<&'static str> {
        Some("kafka.")
    }

    async fn create(&self, ctx: &TableContext<'_>) -> Result<Arc<dyn Source>> {
        let t = ctx.table();
        let (servers, topics) = location(ctx)?;
        let mut settings = client_settings(
            ctx,
            "kafka.",
            RESERVED_CLIENT_KEYS,
            "the exactly-once reader",
        )?;
        // Kafka clients' files carry the registry's settings too.
        let registry_file: BTreeMap<String, String> = settings
            .extract_if(.., |k, _| {
                k.starts_with("schema.registry.") || k.starts_with("basic.auth.")
            })
            .collect();
        let servers = bootstrap_servers(ctx, servers, &settings)?;
        let mut o = KafkaSourceOptions::new(&servers, topics);
        o.key_format = key_format(ctx).await?;
        positions(ctx, &mut o)?;
        reading(ctx, &mut o)?;
        let mut value_schema = t.schema.clone();
        o.format = value_format(ctx, &o, &registry_file, &mut value_schema).await?;
        let avro_keys = ctx
            .option("key_format")
            .is_some_and(|f| f.eq_ignore_ascii_case("avro"));
        if avro_keys {
            o.key_format =
                KeyFormat::Avro(avro_values(ctx, &o, &registry_file, AvroPart::Key).await?);
        }
        check_registry_options(ctx, &o.format, avro_keys)?;
        o.client_config = settings;
        o.client_config.remove("bootstrap.servers");
        Ok(Arc::new(KafkaSource::try_new(&t.name, value_schema, o)?))
    }
}

/// The brokers (empty when LOCATION leaves them to the settings) and the
/// topics of `LOCATION 'kafka://HOST:PORT[,...]/TOPIC[,...]'` or
/// `topic_pattern`.
fn location<'a>(ctx: &TableContext<'a>) -> Result<(&'a str, Topics)> {
    let t = ctx.table();
    let err = |msg: String| -> Error { ctx.error(msg) };
    let rest = t.location.strip_prefix("kafka://").ok_or_else(|| {
        err(format!(
            "a KAFKA table's LOCATION is kafka://HOST:PORT[,HOST:PORT]/TOPIC[,TOPIC], got {:?}",
            t.location
        ))
    })?;
    let (servers, topics) = rest.split_once('/').unwrap_or((rest, ""));
    let topics: Vec<String> = topics
        .split(',')
        .map(|s| s.trim().trim_end_matches('/').to_string())
        .filter(|s| !s.is_empty())
        .collect();
    let topics = match (t.options.get("topic_pattern"), topics.is_empty()) {
        (Some(p), true) => Topics::Pattern(
            regex::Regex::new(p).map_err(|e| err(format!("topic_pattern {p:?}: {e}")))?,
        ),
        (None, false) => Topics::List(topics),
        (Some(_), false) => {
            return Err(err(
                "name topics in LOCATION or give 'topic_pattern', not both".into(),
            ));
        }
        (None, true) => {
            return Err(err(format!(
                "no topic: write LOCATION 'kafka://{servers}/TOPIC' or set 'topic_pattern'"
            )));
        }
    };
    Ok((servers, topics))
}

/// `key_format` (`raw`, `string`, `json` with `key_columns`; `avro` is
/// built with the registry later, and reads raw until then).
async fn key_format(ctx: &TableContext<'_>) -> Result<KeyFormat> {
    let t = ctx.table();
    let err = |msg: String| -> Error { ctx.error(msg) };
    let key_format = match t
        .options
        .get("key_format")
        .map(|s| s.to_ascii_lowercase())
        .as_deref()
    {
        None | Some("raw") => KeyFormat::Raw,
        Some("string") => KeyFormat::String,
        // Built with the registry, once the timeouts are read.
        Some("avro") => KeyFormat::Raw,
        Some("json") => {
            let Some(cols) = ctx.option("key_columns") else {
                return Err(err(
                    "key_format 'json' needs the key's columns: OPTIONS ('key_columns' \
                         'region VARCHAR, id BIGINT')"
                        .into(),
                ));
            };
            KeyFormat::Json(
                lakestream_job::parse_columns(cols)
                    .await
                    .map_err(|m| err(format!("option key_columns {cols:?}: {m}")))?,
            )
        }
        Some(other) => {
            return Err(err(format!(
                "key_format {other:?} is not supported: use raw, string, json or avro"
            )));
        }
    };
    if ctx.option("key_columns").is_some() && !matches!(key_format, KeyFormat::Json(_)) {
        return Err(err("option key_columns needs 'key_format' 'json'".into()));
    }
    Ok(key_format)
}

/// Option `key`'s JSON map of offsets, `{"topic": {"0": 42}}`.
fn offsets_map(ctx: &TableContext<'_>, key: &str, v: &str) -> Result<PartitionOffsetMap> {
    let err = |msg: String| -> Error { ctx.error(msg) };
    let raw: std::collections::BTreeMap<String, std::collections::BTreeMap<String, i64>> =
        serde_json::from_str(v).map_err(|e| {
            err(format!(
                "option {key}: expected 'earliest', 'latest' or a JSON map like {{\"topic\": {{\"0\": 42}}}}: {e}"
            ))
        })?;
    raw.into_iter()
        .map(|(t, ps)| {
            let ps = ps
                .into_iter()
                .map(|(p, o)| {
                    p.parse::<i32>()
                        .map(|p| (p, o))
                        .map_err(|_| err(format!("option {key}: partition {p:?} is not a number")))
                })
                .collect::<Result<_>>()?;
            Ok((t, ps))
        })
        .collect()
}

/// The offsets of one topic's partitions, by topic.
type PartitionOffsetMap = BTreeMap<String, BTreeMap<i32, i64>>;

/// Where reading starts (`starting_offsets`, `starting_timestamp`) and
/// ends (`ending_offsets`).
fn positions(ctx: &TableContext<'_>, o: &mut KafkaSourceOptions) -> Result<()> {
    let t = ctx.table();
    let err = |msg: String| -> Error { ctx.error(msg) };
    match (
        t.options.get("starting_offsets"),
        t.options.get("starting_timestamp"),
    ) {
        (Some(_), Some(_)) => {
            return Err(err(
                "give 'starting_offsets' or 'starting_timestamp', not both".into(),
            ));
        }
        (None, Some(ts)) => {
            o.starting_offsets = StartingOffsets::Timestamp(ts.parse().map_err(|_| {
                err(format!(
                    "starting_timestamp must be milliseconds since the epoch, got {ts:?}"
                ))
            })?)
        }
        (Some(v), None) => {
            o.starting_offsets = match v.as_str() {
                "earliest" => StartingOffsets::Earliest,
                "latest" => StartingOffsets::Latest,
                json => StartingOffsets::Map(offsets_map(ctx, "starting_offsets", json)?),
            }
        }
        (None, None) => {}
    }
    if let Some(v) = t.options.get("ending_offsets") {
        o.ending_offsets = Some(match v.as_str() {
            "latest" => EndingOffsets::Latest,
            json => EndingOffsets::Map(offsets_map(ctx, "ending_offsets", json)?),
        });
    }
    Ok(())
}

/// How batches read: caps, data loss, timeouts, groups, partitions,
/// consumers, isolation, undecodable records.
fn reading(ctx: &TableContext<'_>, o: &mut KafkaSourceOptions) -> Result<()> {
    let t = ctx.table();
    let err = |msg: String| -> Error { ctx.error(msg) };
    o.max_offsets_per_trigger = ctx.number("max_offsets_per_trigger")?;
    if let Some(v) = t.options.get("fail_on_data_loss") {
        o.fail_on_data_loss = match v.to_ascii_lowercase().as_str() {
            "true" => true,
            "false" => false,
            _ => {
                return Err(err(format!(
                    "fail_on_data_loss must be true or false, got {v:?}"
                )));
            }
        };
    }
    for (key, field) in [
        ("read_timeout", &mut o.read_timeout),
        ("request_timeout", &mut o.request_timeout),
        ("unavailable_timeout", &mut o.unavailable_timeout),
    ] {
        if let Some(d) = ctx.duration(key, |v| {
            format!("{key} must be a duration like 30s, got {v:?}")
        })? {
            *field = d;
        }
    }
    o.commit_group = t.options.get("commit_offsets_to_group").cloned();
    o.group_id = t.options.get("group_id").cloned();
    if let Some(b) = ctx.count("batch_size")? {
        o.batch_size = b;
    }
    o.on_error = crate::on_error(ctx)?;
    if let Some(v) = ctx.option("partitions") {
        let parsed: Option<std::collections::BTreeSet<i32>> = v
            .split(',')
            .map(|p| p.trim().parse::<i32>().ok().filter(|p| *p >= 0))
            .collect();
        o.partitions = Some(parsed.filter(|p| !p.is_empty()).ok_or_else(|| {
            ctx.error(format!(
                "option partitions of {}: {v:?} is not a list of partition numbers; give \
                     e.g. '0,2,4'",
                t.name
            ))
        })?);
    }
    if let Some(n) = ctx.count("consumers")? {
        o.consumers = n;
    }
    if let Some(v) = t.options.get("isolation_level") {
        o.isolation_level = IsolationLevel::from_name(v).ok_or_else(|| {
            err(format!(
                "isolation_level {v:?}: use read_committed or read_uncommitted"
            ))
        })?;
    }
    Ok(())
}

/// `format`: the values' format, with the registry for Avro and Protobuf
/// (Protobuf's columns come from the schema when none are declared).
async fn value_format(
    ctx: &TableContext<'_>,
    o: &KafkaSourceOptions,
    registry_file: &BTreeMap<String, String>,
    value_schema: &mut Option<arrow::datatypes::SchemaRef>,
) -> Result<ValueFormat> {
    let t = ctx.table();
    let err = |msg: String| -> Error { ctx.error(msg) };
    Ok(
        match t
            .options
            .get("format")
            .map(|s| s.to_ascii_lowercase())
            .as_deref()
        {
            None | Some("json") => ValueFormat::Json,
            Some("raw") => ValueFormat::Raw,
            Some("string") => ValueFormat::String,
            Some("avro") => {
                ValueFormat::Avro(avro_values(ctx, o, registry_file, AvroPart::Value).await?)
            }
            Some("protobuf") => {
                let registry = registry_client(ctx, o, registry_file)?;
                if t.schema.as_ref().is_none_or(|s| s.fields().is_empty()) {
                    *value_schema = Some(protobuf_columns(ctx, o, &registry).await?);
                }
                ValueFormat::Protobuf(ProtobufValues { registry })
            }
            Some(other) => {
                return Err(err(format!(
                    "format {other:?} is not supported: use json, avro, protobuf, raw or string"
                )));
            }
        },
    )
}

/// Refuse registry options the formats do not use.
fn check_registry_options(
    ctx: &TableContext<'_>,
    format: &ValueFormat,
    avro_keys: bool,
) -> Result<()> {
    let err = |msg: String| -> Error { ctx.error(msg) };
    let registry_values = matches!(format, ValueFormat::Avro(_) | ValueFormat::Protobuf(_));
    if !registry_values {
        if ctx.option("value_subject").is_some() {
            return Err(err("option value_subject needs 'format' 'avro'".into()));
        }
        if ctx.option("schema_registry_url").is_some() && !avro_keys {
            return Err(err(
                    "option schema_registry_url needs 'format' 'avro' or 'protobuf', or 'key_format' 'avro'"
                        .into(),
                ));
        }
    }
    if ctx.option("key_subject").is_some() && !avro_keys {
        return Err(err("option key_subject needs 'key_format' 'avro'".into()));
    }
    Ok(())
}

/// Which part of a record is Avro.
#[derive(Clone, Copy, PartialEq, Eq)]
enum AvroPart {
    Value,
    Key,
}

impl AvroPart {
    /// The option naming the subject, its default suffix, and the
    /// checkpoint file keeping the reader schema
    /// (`sources/<table>/<file>`).
    fn names(self) -> (&'static str, &'static str, &'static str) {
        match self {
            AvroPart::Value => ("value_subject", "value", "avro_reader_schema"),
            AvroPart::Key => ("key_subject", "key", "avro_key_schema"),
        }
    }
}

/// `format 'avro'` (or `key_format 'avro'`): the registry client, and the
/// reader schema: the subject's latest schema when the query first ran
/// (kept in the checkpoint, so a restart resolves every record the same
/// way), for values cut down to the declared columns, for keys a record
/// (a primitive key schema wrapped as one field).
async fn avro_values(
    ctx: &TableContext<'_>,
    o: &KafkaSourceOptions,
    from_file: &BTreeMap<String, String>,
    part: AvroPart,
) -> Result<AvroValues> {
    let (subject_option, suffix, state_file) = part.names();
    let t = ctx.table();
    let registry = registry_client(ctx, o, from_file)?;
    let subject = match (ctx.option(subject_option), &o.topics) {
        (Some(s), _) => s.to_string(),
        (None, Topics::List(topics)) if topics.len() == 1 => format!("{}-{suffix}", topics[0]),
        (None, _) => {
            return Err(ctx.error(format!(
                "Avro in {} that reads several topics: name the subject whose latest schema \
                 is the reader schema with '{subject_option}'",
                t.name
            )));
        }
    };
    let ckpt = ctx
        .checkpoint_location()
        .map_err(lakestream_checkpoint::Error::from)?;
    let stored = lakestream_checkpoint::read_source_state(&ckpt, &t.name, state_file).await?;
    let pinned = match stored {
        Some(v) => v,
        None => {
            let latest = registry.latest(&t.name, &subject).await?;
            lakestream_checkpoint::init_source_state(
                &ckpt,
                &t.name,
                state_file,
                serde_json::json!({
                    "subject": latest.subject,
                    "version": latest.version,
                    "id": latest.id,
                    "schema": latest.schema,
                }),
            )
            .await?
        }
    };
    let Some(schema) = pinned.get("schema").and_then(|s| s.as_str()) else {
        return Err(lakestream_checkpoint::Error::Corrupt {
            file: format!(
                "{}/sources/{}/{state_file}",
                ctx.checkpoint().trim_end_matches('/'),
                t.name
            ),
            reason: "no \"schema\" in the stored reader schema".into(),
        }
        .into());
    };
    let reader_schema = match &t.schema {
        _ if part == AvroPart::Key => {
            as_record(schema)
                .map_err(|m| {
                    ctx.error(format!(
                        "the key schema of subject {subject} (table {}): {m}",
                        t.name
                    ))
                })?
                .0
        }
        Some(cols) if !cols.fields().is_empty() => {
            project_reader_schema(schema, cols).map_err(|m| {
                ctx.error(format!(
                    "{} (the value schema of subject {subject} version {}, kept in the \
                     checkpoint since the query's first run)",
                    m,
                    pinned.get("version").unwrap_or(&serde_json::Value::Null)
                ))
            })?
        }
        _ => schema.to_string(),
    };
    Ok(AvroValues {
        registry,
        subject,
        reader_schema,
    })
}

/// The schema registry client of a Kafka table: `schema_registry_url`,
/// `schema_registry_user` / `schema_registry_password` (or a properties
/// file's `schema.registry.url` and `basic.auth.user.info`), and
/// `schema_registry_ca_location`.
fn registry_client(
    ctx: &TableContext<'_>,
    o: &KafkaSourceOptions,
    from_file: &BTreeMap<String, String>,
) -> Result<Arc<SchemaRegistry>> {
    let t = ctx.table();
    let setting = |key: &str, file_key: &str| -> Result<Option<String>> {
        match ctx.option(key) {
            Some(v) => expand_env(key, v)
                .map(Some)
                .map_err(|m| ctx.error(format!("{m} (table {})", t.name))),
            None => Ok(from_file.get(file_key).cloned()),
        }
    };
    let urls = setting("schema_registry_url", "schema.registry.url")?.ok_or_else(|| {
        ctx.error(format!(
            "Avro in {} needs 'schema_registry_url' (the Confluent-compatible registry \
             the schema ids refer to)",
            t.name
        ))
    })?;
    let user_info = from_file
        .get("basic.auth.user.info")
        .and_then(|ui| ui.split_once(':'))
        .map(|(u, p)| (u.to_string(), p.to_string()));
    let basic_auth = match (
        setting("schema_registry_user", "")?,
        setting("schema_registry_password", "")?,
    ) {
        (Some(u), Some(p)) => Some((u, p)),
        (None, None) => user_info,
        _ => {
            return Err(ctx.error(format!(
                "{}: give both schema_registry_user and schema_registry_password, or neither",
                t.name
            )));
        }
    };
    Ok(Arc::new(SchemaRegistry::new(
        &t.name,
        RegistryOptions {
            urls: urls
                .split(',')
                .map(|u| u.trim().to_string())
                .filter(|u| !u.is_empty())
                .collect(),
            basic_auth,
            ca_location: setting(
                "schema_registry_ca_location",
                "schema.registry.ssl.ca.location",
            )?,
            request_timeout: o.request_timeout,
        },
    )?))
}

/// `format 'protobuf'` without declared columns: those of the value
/// subject's latest file's message (`value_message`, or its first) when
/// the query first ran, kept in the checkpoint (`sources/<table>/schema`).
async fn protobuf_columns(
    ctx: &TableContext<'_>,
    o: &KafkaSourceOptions,
    registry: &SchemaRegistry,
) -> Result<arrow::datatypes::SchemaRef> {
    let t = ctx.table();
    crate::files::connector::pinned_columns(ctx, async {
        let subject = match (ctx.option("value_subject"), &o.topics) {
            (Some(s), _) => s.to_string(),
            (None, Topics::List(topics)) if topics.len() == 1 => format!("{}-value", topics[0]),
            (None, _) => {
                return Err(ctx.error(format!(
                    "format 'protobuf' of {} without columns reads several topics: declare \
                     the columns, or name the subject whose latest schema gives them with \
                     'value_subject'",
                    t.name
                )));
            }
        };
        let file = registry.latest_protobuf(&t.name, &subject).await?;
        crate::protobuf::message_of(&file, ctx.option("value_message"))
            .and_then(|m| crate::protobuf::arrow_schema(&m))
            .map_err(|m| ctx.error(format!("{} (subject {subject}): {m}", t.name)))
    })
    .await
}
