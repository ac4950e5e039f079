//! The Confluent schema registry client, for Avro values in the Confluent
//! wire format (magic byte 0, a 4-byte big-endian schema id, the Avro
//! body; decoded by [`crate::avro`]).
//!
//! Writer schemas are fetched once by id and cached for the life of the
//! source; an id the registry does not know is remembered as such, so
//! every record carrying it is a bad record without another request. The
//! reader schema (the topic subject's latest schema when the query first
//! ran, kept in the checkpoint, cut down to the declared columns) drives
//! Avro schema resolution: fields added with defaults, removed fields,
//! promoted types.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::{Error, Result};

/// Where the registry is and how to reach it.
#[derive(Clone, Default)]
pub struct RegistryOptions {
    /// Base URLs (`http://host:8081`), tried in turn.
    pub urls: Vec<String>,
    /// HTTP basic authentication: user and password.
    pub basic_auth: Option<(String, String)>,
    /// A PEM file of CA certificates to trust besides the system's.
    pub ca_location: Option<String>,
    /// How long one request may take.
    pub request_timeout: Duration,
}

impl std::fmt::Debug for RegistryOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryOptions")
            .field("urls", &self.urls)
            .field("user", &self.basic_auth.as_ref().map(|(u, _)| u))
            .field("ca_location", &self.ca_location)
            .finish()
    }
}

/// What the registry holds under one schema id.
#[derive(Debug, Clone)]
pub enum Registered {
    /// An Avro schema (its JSON).
    Avro(Arc<str>),
    /// A Protobuf schema: its file, imports resolved.
    Protobuf(prost_reflect::FileDescriptor),
    /// A schema of another type (`JSON`).
    OtherType(String),
    /// The registry does not know the id (404).
    Unknown,
}

/// The latest version of a subject.
#[derive(Debug, Clone)]
pub struct SubjectVersion {
    /// The subject.
    pub subject: String,
    /// Its version number.
    pub version: i64,
    /// The schema's global id.
    pub id: u32,
    /// The schema (Avro JSON).
    pub schema: String,
}

/// A Confluent-compatible schema registry, with schemas cached by id.
pub struct SchemaRegistry {
    options: RegistryOptions,
    client: reqwest::Client,
    by_id: Mutex<HashMap<u32, Registered>>,
}

impl std::fmt::Debug for SchemaRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchemaRegistry")
            .field("options", &self.options)
            .finish()
    }
}

/// How often a request the registry did not answer is tried.
const ATTEMPTS: u32 = 3;

impl SchemaRegistry {
    /// A client of the registry at `options.urls` for source `source`.
    pub fn new(source: &str, options: RegistryOptions) -> Result<Self> {
        let invalid = |reason: String| Error::InvalidOption {
            source_name: source.to_string(),
            option: "schema_registry_url".into(),
            reason,
        };
        if options.urls.is_empty() {
            return Err(invalid("give the registry's URL".into()));
        }
        for u in &options.urls {
            if !(u.starts_with("http://") || u.starts_with("https://")) {
                return Err(invalid(format!("{u:?} is not an http:// or https:// URL")));
            }
        }
        let mut b = reqwest::Client::builder()
            .timeout(options.request_timeout)
            .connect_timeout(options.request_timeout);
        if let Some(ca) = &options.ca_location {
            let pem = std::fs::read(ca).map_err(|e| Error::InvalidOption {
                source_name: source.to_string(),
                option: "schema_registry_ca_location".into(),
                reason: format!("cannot read {ca}: {e}"),
            })?;
            let certs =
                reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| Error::InvalidOption {
                    source_name: source.to_string(),
                    option: "schema_registry_ca_location".into(),
                    reason: format!("{ca} holds no PEM certificate: {e}"),
                })?;
            for c in certs {
                b = b.add_root_certificate(c);
            }
        }
        let client = b
            .build()
            .map_err(|e| invalid(format!("cannot make an HTTP client: {e}")))?;
        Ok(Self {
            options,
            client,
            by_id: Mutex::new(HashMap::new()),
        })
    }

    /// The registry's URLs, for messages.
    pub fn urls(&self) -> String {
        self.options.urls.join(",")
    }

    /// The schema under `id` if it was fetched before.
    pub fn cached(&self, id: u32) -> Option<Registered> {
        self.by_id.lock().expect("registry cache").get(&id).cloned()
    }

    /// The schema under `id`, fetched once (an unknown id included).
    pub async fn schema_by_id(&self, source: &str, id: u32) -> Result<Registered> {
        if let Some(r) = self.cached(id) {
            return Ok(r);
        }
        let got = self.get(source, &format!("/schemas/ids/{id}")).await?;
        let r = match got {
            None => Registered::Unknown,
            Some(v) => {
                let kind = v
                    .get("schemaType")
                    .and_then(|t| t.as_str())
                    .unwrap_or("AVRO");
                match (kind, v.get("schema").and_then(|s| s.as_str())) {
                    ("AVRO", Some(s)) => Registered::Avro(Arc::from(s)),
                    ("PROTOBUF", Some(_)) => Registered::Protobuf(
                        self.protobuf_file(source, v, &format!("/schemas/ids/{id}"))
                            .await?,
                    ),
                    ("AVRO", None) => {
                        return Err(self.error(
                            source,
                            &format!("GET /schemas/ids/{id}"),
                            "the answer has no \"schema\"".into(),
                            false,
                        ));
                    }
                    (other, _) => Registered::OtherType(other.to_string()),
                }
            }
        };
        self.by_id
            .lock()
            .expect("registry cache")
            .insert(id, r.clone());
        Ok(r)
    }

    /// The Protobuf file of a registry `answer` to GET `path` (a schema
    /// by id, or a subject's version): its serialized descriptor (asked
    /// for with `?format=serialized` when it was registered as text) on
    /// top of the files its references name.
    async fn protobuf_file(
        &self,
        source: &str,
        answer: serde_json::Value,
        path: &str,
    ) -> Result<prost_reflect::FileDescriptor> {
        let (bytes, answer) = match serialized_descriptor(&answer) {
            Some(bytes) => (bytes, answer),
            None => {
                let path = format!("{path}?format=serialized");
                let v = self.get(source, &path).await?.unwrap_or_default();
                let bytes = serialized_descriptor(&v).ok_or_else(|| {
                    self.error(
                        source,
                        &format!("GET {path}"),
                        "no base64 FileDescriptorProto in the answer".into(),
                        false,
                    )
                })?;
                (bytes, v)
            }
        };
        let mut deps = Vec::new();
        self.references(source, &answer, &mut deps, 0).await?;
        crate::protobuf::file_descriptor(&bytes, &deps).map_err(|reason| {
            self.error(
                source,
                &format!("read the Protobuf schema of GET {path}"),
                reason,
                false,
            )
        })
    }

    /// The registry's answer for the latest version of `subject`, and the
    /// path asked.
    async fn latest_answer(
        &self,
        source: &str,
        subject: &str,
    ) -> Result<(serde_json::Value, String)> {
        let path = format!(
            "/subjects/{}/versions/latest",
            percent_encoding::utf8_percent_encode(subject, percent_encoding::NON_ALPHANUMERIC)
        );
        match self.get(source, &path).await? {
            Some(v) => Ok((v, path)),
            None => Err(self.error(
                source,
                &format!("read the latest schema of subject {subject}"),
                format!(
                    "the registry has no subject {subject}: register the topic's schema, \
                     declare the columns, or name the subject ('value_subject', \
                     'key_subject')"
                ),
                false,
            )),
        }
    }

    /// The latest Protobuf file of `subject`.
    pub async fn latest_protobuf(
        &self,
        source: &str,
        subject: &str,
    ) -> Result<prost_reflect::FileDescriptor> {
        let (v, path) = self.latest_answer(source, subject).await?;
        if v.get("schemaType").and_then(|t| t.as_str()) != Some("PROTOBUF") {
            return Err(self.error(
                source,
                &format!("read the latest schema of subject {subject}"),
                "its latest schema is not a Protobuf schema".into(),
                false,
            ));
        }
        self.protobuf_file(source, v, &path).await
    }

    /// The serialized files `answer`'s references name (and theirs,
    /// first), appended to `deps` in dependency order; the well-known
    /// types are built in.
    fn references<'a>(
        &'a self,
        source: &'a str,
        answer: &'a serde_json::Value,
        deps: &'a mut Vec<Vec<u8>>,
        depth: usize,
    ) -> futures::future::BoxFuture<'a, Result<()>> {
        use futures::FutureExt;
        async move {
            let refs = answer
                .get("references")
                .and_then(|r| r.as_array())
                .cloned()
                .unwrap_or_default();
            for r in refs {
                let name = r.get("name").and_then(|n| n.as_str()).unwrap_or_default();
                if name.starts_with("google/protobuf/") {
                    continue;
                }
                let (Some(subject), Some(version)) = (
                    r.get("subject").and_then(|s| s.as_str()),
                    r.get("version").and_then(|v| v.as_i64()),
                ) else {
                    continue;
                };
                if depth > 32 {
                    return Err(self.error(
                        source,
                        &format!("resolve the reference {name}"),
                        "references nest more than 32 deep".into(),
                        false,
                    ));
                }
                let path = format!(
                    "/subjects/{}/versions/{version}?format=serialized",
                    percent_encoding::utf8_percent_encode(
                        subject,
                        percent_encoding::NON_ALPHANUMERIC
                    )
                );
                let v = self.get(source, &path).await?.ok_or_else(|| {
                    self.error(
                        source,
                        &format!("GET {path}"),
                        format!("the referenced schema {name} is not in the registry"),
                        false,
                    )
                })?;
                self.references(source, &v, deps, depth + 1).await?;
                if let Some(bytes) = serialized_descriptor(&v) {
                    deps.push(bytes);
                }
            }
            Ok(())
        }
        .boxed()
    }

    /// The latest version of `subject`.
    pub async fn latest(&self, source: &str, subject: &str) -> Result<SubjectVersion> {
        let (v, _) = self.latest_answer(source, subject).await?;
        let kind = v
            .get("schemaType")
            .and_then(|t| t.as_str())
            .unwrap_or("AVRO");
        let (Some(id), Some(schema), "AVRO") = (
            v.get("id").and_then(|i| i.as_u64()),
            v.get("schema").and_then(|s| s.as_str()),
            kind,
        ) else {
            return Err(self.error(
                source,
                &format!("read the latest schema of subject {subject}"),
                format!("expected an Avro schema with an id, got {v}"),
                false,
            ));
        };
        self.by_id
            .lock()
            .expect("registry cache")
            .insert(id as u32, Registered::Avro(Arc::from(schema)));
        Ok(SubjectVersion {
            subject: subject.to_string(),
            version: v.get("version").and_then(|n| n.as_i64()).unwrap_or(0),
            id: id as u32,
            schema: schema.to_string(),
        })
    }

    fn error(&self, source: &str, what: &str, reason: String, transient: bool) -> Error {
        Error::SchemaRegistry {
            source_name: source.to_string(),
            url: self.urls(),
            what: what.to_string(),
            reason,
            transient,
        }
    }

    /// GET `path` from the first URL that answers: its JSON, `None` on
    /// 404. Connection failures, timeouts and 5xx are tried again
    /// ([`ATTEMPTS`] rounds over the URLs, with backoff), then are a
    /// transient error; 401/403 are not.
    async fn get(&self, source: &str, path: &str) -> Result<Option<serde_json::Value>> {
        use backon::BackoffBuilder;
        let mut last = String::new();
        // 100 ms, then 400 ms, ... between rounds.
        let mut backoff = backon::ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(100))
            .with_factor(4.0)
            .with_max_delay(Duration::from_secs(30))
            .without_max_times()
            .build();
        for attempt in 0..ATTEMPTS {
            if attempt > 0 {
                tokio::time::sleep(backoff.next().unwrap_or(Duration::from_secs(30))).await;
            }
            for base in &self.options.urls {
                let url = format!("{}{path}", base.trim_end_matches('/'));
                let mut req = self
                    .client
                    .get(&url)
                    .header("Accept", "application/vnd.schemaregistry.v1+json");
                if let Some((u, p)) = &self.options.basic_auth {
                    req = req.basic_auth(u, Some(p));
                }
                let resp = match req.send().await {
                    Ok(r) => r,
                    Err(e) => {
                        last = format!("{base}: {}", error_chain(&e));
                        continue;
                    }
                };
                let status = resp.status();
                let body = resp.bytes().await.unwrap_or_default();
                if status.as_u16() == 404 {
                    return Ok(None);
                }
                if status.is_success() {
                    return serde_json::from_slice(&body).map(Some).map_err(|e| {
                        self.error(
                            source,
                            &format!("GET {path}"),
                            format!("the answer is not JSON: {e}"),
                            false,
                        )
                    });
                }
                let text = String::from_utf8_lossy(&body);
                if status.as_u16() == 401 || status.as_u16() == 403 {
                    return Err(self.error(
                        source,
                        &format!("GET {path}"),
                        format!(
                            "{status}: {text}; check schema_registry_user and \
                             schema_registry_password"
                        ),
                        false,
                    ));
                }
                last = format!("{base}: {status}: {text}");
                if status.is_client_error() {
                    return Err(self.error(source, &format!("GET {path}"), last, false));
                }
            }
        }
        Err(self.error(source, &format!("GET {path}"), last, true))
    }
}

/// The base64 `FileDescriptorProto` of a registry answer's `schema`, if
/// it is one (a schema registered as `.proto` text is not).
fn serialized_descriptor(answer: &serde_json::Value) -> Option<Vec<u8>> {
    use base64::Engine;
    let s = answer.get("schema")?.as_str()?;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(s.trim())
        .ok()?;
    use prost::Message;
    prost_types::FileDescriptorProto::decode(bytes.as_slice())
        .ok()
        .filter(|f| f.name.is_some())
        .map(|_| bytes)
}

/// An error with its causes (reqwest's own message is only the outermost).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Protobuf values through a registry: what a Kafka source decodes with.
#[derive(Debug, Clone)]
pub struct ProtobufValues {
    /// The registry the files come from.
    pub registry: Arc<SchemaRegistry>,
}

impl PartialEq for ProtobufValues {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.registry, &other.registry)
    }
}

impl Eq for ProtobufValues {}

/// Avro values through a registry: what a Kafka source decodes with.
#[derive(Debug, Clone)]
pub struct AvroValues {
    /// The registry the writer schemas come from.
    pub registry: Arc<SchemaRegistry>,
    /// The subject whose schema is the reader schema.
    pub subject: String,
    /// The reader schema (Avro JSON), already cut down to the columns.
    pub reader_schema: String,
}

impl PartialEq for AvroValues {
    fn eq(&self, other: &Self) -> bool {
        self.subject == other.subject && self.reader_schema == other.reader_schema
    }
}

impl Eq for AvroValues {}
