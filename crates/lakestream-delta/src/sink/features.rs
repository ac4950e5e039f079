//! What a Delta table's protocol asks of every writer, and what this sink
//! does about each table feature: write what it requires, leave it as it
//! is, or refuse the table before the first batch.
//!
//! A table names its writer features in `protocol.writerFeatures` (writer
//! version 7) or implies them by its legacy writer version (2: appendOnly,
//! invariants; 3: + checkConstraints; 4: + changeDataFeed,
//! generatedColumns; 5: + columnMapping; 6: + identityColumns). Every
//! feature, named or implied, gets one [`Support`]; a feature this module
//! does not know is refused, since its rules are unknown. Some features
//! bind a writer only when the table uses them (a legacy writer-6 table
//! with no identity column asks nothing of identity columns), and some
//! only for some writes (an append-only table refuses MERGE and rewrites):
//! [`TableFeatures::check_write`] decides those per output mode.

use std::collections::{BTreeMap, BTreeSet};

use buoyant_kernel::schema::{ColumnMetadataKey, StructType};

use lakestream_sink::{Error, Result, WriteMode};

/// How this sink handles one table feature.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Support {
    /// The sink writes what the feature requires of writers.
    Supported,
    /// The feature asks nothing of a writer that appends data files; the
    /// sink leaves what it governs as it is (the log keeps it, the Delta
    /// checkpoints the kernel writes carry it).
    Preserved,
    /// The sink cannot write what the feature requires: a table that has
    /// it is refused before any batch.
    Refused {
        /// Why, and what to do instead.
        reason: String,
    },
}

impl Support {
    /// `supported`, `preserved` or `refused`, for reports.
    pub fn label(&self) -> &'static str {
        match self {
            Support::Supported => "supported",
            Support::Preserved => "preserved",
            Support::Refused { .. } => "refused",
        }
    }
}

/// One feature of a table and how the sink handles it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeatureStatus {
    /// The feature's protocol name (`checkConstraints`, `deletionVectors`).
    pub name: String,
    /// Whether the protocol names it (`writerFeatures`) or its legacy
    /// writer version implies it.
    pub implied: bool,
    /// What the sink does with it.
    pub support: Support,
}

/// What a table declares that binds its writers: its features, with how
/// the sink handles each, and the properties that change how a batch is
/// committed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableFeatures {
    /// Every writer feature of the table (named or implied), by name.
    pub features: Vec<FeatureStatus>,
    /// `delta.appendOnly`: no commit may remove data.
    pub append_only: bool,
    /// `delta.enableChangeDataFeed` (with the feature): row changes other
    /// than plain appends are recorded as change data.
    pub change_data_feed: bool,
    /// `delta.enableInCommitTimestamps`: every commit carries a
    /// monotonic `inCommitTimestamp` in its first action.
    pub in_commit_timestamps: bool,
    /// `checkpointProtection`: the log's history may not be cleaned up
    /// by this writer.
    pub checkpoint_protection: bool,
}

/// The protocol's writer versions and the features each legacy version
/// implies (the protocol's table of legacy features).
const LEGACY_WRITER_FEATURES: [(i32, &str); 7] = [
    (2, "appendOnly"),
    (2, "invariants"),
    (3, "checkConstraints"),
    (4, "changeDataFeed"),
    (4, "generatedColumns"),
    (5, "columnMapping"),
    (6, "identityColumns"),
];

/// How the sink handles each feature it knows, before looking at how the
/// table uses it (see [`TableFeatures::of`] for the features whose answer
/// depends on that).
fn known(name: &str) -> Option<Support> {
    use Support::*;
    let refused = |reason: &str| Refused {
        reason: reason.to_string(),
    };
    Some(match name {
        "appendOnly"
        | "invariants"
        | "checkConstraints"
        | "changeDataFeed"
        | "generatedColumns"
        | "deletionVectors"
        | "inCommitTimestamp"
        | "v2Checkpoint"
        | "timestampNtz"
        | "timestampWithoutTimezone"
        | "vacuumProtocolCheck"
        | "checkpointProtection" => Supported,
        // Decided by how the table uses them.
        "identityColumns" | "columnMapping" => Supported,
        "domainMetadata"
        | "clustering"
        | "variantType"
        | "variantType-preview"
        | "typeWidening"
        | "typeWidening-preview" => Preserved,
        "rowTracking" => refused(
            "its writers must assign every new row a row id and commit version (baseRowId, \
             defaultRowCommitVersion, the delta.rowTracking high-water mark), which this writer \
             does not do; write to a table without row tracking, or drop the feature with \
             ALTER TABLE ... DROP FEATURE rowTracking in Spark",
        ),
        "catalogManaged" | "catalogOwned-preview" => refused(
            "the table's commits are coordinated by its catalog (Unity Catalog managed \
             commits) and the protocol forbids committing to it through the file system; \
             write to a table the catalog does not manage, or through the catalog",
        ),
        "icebergCompatV1" | "icebergCompatV2" | "icebergCompatV3" => refused(
            "its writers must keep the table readable as Iceberg (column mapping, Iceberg \
             metadata), which this writer does not do; write to a table without Iceberg \
             compatibility (UniForm)",
        ),
        "materializePartitionColumns" => refused(
            "its writers must also store the partition columns in every data file, which this \
             writer does not do; write to a table without the feature",
        ),
        "allowColumnDefaults" => refused(
            "its writers must fill columns a write leaves out with their DEFAULT values, which \
             this writer does not do; write to a table without column defaults",
        ),
        _ => return None,
    })
}

impl TableFeatures {
    /// The features of a table with writer version `min_writer_version`,
    /// the writer features `named` in its protocol (version 7), its
    /// `configuration` and `schema`.
    pub fn of(
        min_reader_version: i32,
        min_writer_version: i32,
        named: &[String],
        configuration: &std::collections::HashMap<String, String>,
        schema: &StructType,
    ) -> TableFeatures {
        let mut names: BTreeMap<String, bool> = BTreeMap::new();
        if min_writer_version >= 7 {
            for n in named {
                names.insert(n.clone(), false);
            }
        } else {
            for (version, n) in LEGACY_WRITER_FEATURES {
                if min_writer_version >= version {
                    names.insert(n.to_string(), true);
                }
            }
        }
        let flag = |key: &str| {
            configuration
                .get(key)
                .is_some_and(|v| v.eq_ignore_ascii_case("true"))
        };
        let mut features = Vec::new();
        if min_writer_version > 7 || min_reader_version > 3 {
            features.push(FeatureStatus {
                name: format!("protocol {min_reader_version}/{min_writer_version}"),
                implied: false,
                support: Support::Refused {
                    reason: format!(
                        "the table needs a reader of version {min_reader_version} and a writer \
                         of version {min_writer_version}; lakestream knows the Delta protocol \
                         up to reader 3 and writer 7"
                    ),
                },
            });
        }
        for (name, implied) in &names {
            let support = match name.as_str() {
                "identityColumns" => match identity_columns(schema).first() {
                    Some(column) => Support::Refused {
                        reason: format!(
                            "column {column} is an identity column, whose values this writer \
                             cannot generate; write to a table without identity columns"
                        ),
                    },
                    None => Support::Supported,
                },
                "columnMapping" => match configuration.get("delta.columnMapping.mode") {
                    Some(mode) if !mode.eq_ignore_ascii_case("none") => Support::Refused {
                        reason: format!(
                            "the table maps column names to physical names (column mapping \
                             mode '{mode}'), which this writer cannot write; write to a table \
                             without column mapping"
                        ),
                    },
                    _ => Support::Supported,
                },
                other => known(other).unwrap_or_else(|| Support::Refused {
                    reason: "lakestream does not know this table feature, so it cannot keep \
                             its rules; write to another table"
                        .into(),
                }),
            };
            features.push(FeatureStatus {
                name: name.clone(),
                implied: *implied,
                support,
            });
        }
        // A property that makes the txn lookup forget: a batch replayed
        // after the retention would be committed again.
        if configuration.contains_key("delta.setTransactionRetentionDuration") {
            features.push(FeatureStatus {
                name: "delta.setTransactionRetentionDuration".into(),
                implied: false,
                support: Support::Refused {
                    reason: "the table forgets transaction ids after that duration, and \
                             lakestream's exactly-once commit depends on finding them (a batch \
                             replayed later would be written twice); unset the property \
                             (ALTER TABLE ... UNSET TBLPROPERTIES) or write to another table"
                        .into(),
                },
            });
        }
        let has = |n: &str| names.contains_key(n);
        TableFeatures {
            features,
            append_only: has("appendOnly") && flag("delta.appendOnly"),
            change_data_feed: has("changeDataFeed") && flag("delta.enableChangeDataFeed"),
            in_commit_timestamps: has("inCommitTimestamp")
                && flag("delta.enableInCommitTimestamps"),
            checkpoint_protection: has("checkpointProtection"),
        }
    }

    /// The first feature the sink refuses, as the error that names it.
    pub fn check(&self, table: &str) -> Result<()> {
        for f in &self.features {
            if let Support::Refused { reason } = &f.support {
                return Err(Error::UnsupportedFeature {
                    table: table.to_string(),
                    feature: f.name.clone(),
                    reason: reason.clone(),
                });
            }
        }
        Ok(())
    }

    /// Whether batches written with `write` keep the table's rules.
    pub fn check_write(&self, table: &str, write: &WriteMode) -> Result<()> {
        let mode = match write {
            WriteMode::Append => return Ok(()),
            WriteMode::ReplaceAll { .. } => "complete",
            WriteMode::Upsert { .. } => "update",
        };
        let refuse = |feature: &str, reason: String| {
            Err(Error::UnsupportedFeature {
                table: table.to_string(),
                feature: feature.to_string(),
                reason,
            })
        };
        if self.append_only {
            return refuse(
                "appendOnly",
                format!(
                    "delta.appendOnly is true, so no commit may remove or change rows, and the \
                     {mode} output mode rewrites them; use append mode (an aggregation with a \
                     watermark), or write to another table"
                ),
            );
        }
        if self.in_commit_timestamps {
            return refuse(
                "inCommitTimestamp",
                format!(
                    "the {mode} output mode commits through delta-rs's MERGE and overwrite, \
                     which write no in-commit timestamp; use append mode, or write to a table \
                     without delta.enableInCommitTimestamps"
                ),
            );
        }
        Ok(())
    }

    /// Whether table maintenance that rewrites files (compaction) may run.
    pub fn check_maintenance(&self, table: &str, what: &str) -> Result<()> {
        if self.in_commit_timestamps {
            return Err(Error::UnsupportedFeature {
                table: table.to_string(),
                feature: "inCommitTimestamp".into(),
                reason: format!(
                    "{what} commits through delta-rs, which writes no in-commit timestamp; \
                     run it with a writer that supports the feature (Spark)"
                ),
            });
        }
        Ok(())
    }

    /// The names of the features the sink refuses.
    pub fn refused(&self) -> BTreeSet<&str> {
        self.features
            .iter()
            .filter(|f| matches!(f.support, Support::Refused { .. }))
            .map(|f| f.name.as_str())
            .collect()
    }
}

/// The features of the table at `location` as its newest JSON commits
/// declare them (its newest `protocol` and `metaData` actions), read
/// without the Delta kernel: for a table the kernel refuses to load.
/// `None` when the commits cannot be listed or read, or hold no protocol.
pub(crate) async fn from_log(location: &lakestream_storage::Location) -> Option<TableFeatures> {
    use futures::TryStreamExt;
    use object_store::ObjectStoreExt;
    let log = location.child("_delta_log");
    let mut commits: Vec<object_store::path::Path> = location
        .store()
        .list(Some(&log))
        .try_filter(|m| {
            std::future::ready(m.location.filename().is_some_and(|f| {
                f.len() == 25 && f.ends_with(".json") && f[..20].bytes().all(|b| b.is_ascii_digit())
            }))
        })
        .map_ok(|m| m.location)
        .try_collect()
        .await
        .ok()?;
    commits.sort();
    let (mut protocol, mut metadata): (Option<serde_json::Value>, Option<serde_json::Value>) =
        (None, None);
    // A bounded look back: a protocol older than this needs the kernel.
    for path in commits.iter().rev().take(1000) {
        let bytes = location.store().get(path).await.ok()?.bytes().await.ok()?;
        for line in bytes.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
            let Ok(action) = serde_json::from_slice::<serde_json::Value>(line) else {
                continue;
            };
            if protocol.is_none() {
                protocol = action.get("protocol").cloned();
            }
            if metadata.is_none() {
                metadata = action.get("metaData").cloned();
            }
        }
        if protocol.is_some() && metadata.is_some() {
            break;
        }
    }
    let protocol = protocol?;
    let version = |k: &str| protocol[k].as_i64().and_then(|v| i32::try_from(v).ok());
    let names = |k: &str| -> Vec<String> {
        protocol[k]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|f| f.as_str().map(str::to_string))
            .collect()
    };
    let mut named = names("writerFeatures");
    named.extend(
        names("readerFeatures")
            .into_iter()
            .filter(|r| !named.contains(r))
            .collect::<Vec<_>>(),
    );
    let configuration: std::collections::HashMap<String, String> = metadata
        .as_ref()
        .and_then(|m| m["configuration"].as_object())
        .map(|c| {
            c.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default();
    let schema = metadata
        .as_ref()
        .and_then(|m| m["schemaString"].as_str())
        .and_then(|s| serde_json::from_str::<StructType>(s).ok())
        .unwrap_or_else(|| {
            StructType::try_new(Vec::<buoyant_kernel::schema::StructField>::new())
                .expect("an empty schema")
        });
    Some(TableFeatures::of(
        version("minReaderVersion")?,
        version("minWriterVersion")?,
        &named,
        &configuration,
        &schema,
    ))
}

/// The top-level columns of `schema` that are identity columns.
fn identity_columns(schema: &StructType) -> Vec<String> {
    schema
        .fields()
        .filter(|f| {
            f.get_config_value(&ColumnMetadataKey::IdentityStart)
                .is_some()
        })
        .map(|f| f.name().to_string())
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use buoyant_kernel::schema::{DataType, StructField, StructType};

    use super::*;

    fn schema() -> StructType {
        StructType::try_new(vec![StructField::nullable("a", DataType::LONG)]).unwrap()
    }

    fn of(writer: i32, named: &[&str], conf: &[(&str, &str)]) -> TableFeatures {
        let named: Vec<String> = named.iter().map(|s| s.to_string()).collect();
        let conf: HashMap<String, String> = conf
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        TableFeatures::of(1, writer, &named, &conf, &schema())
    }

    #[test]
    fn legacy_versions_imply_their_features() {
        let f = of(4, &[], &[]);
        let names: Vec<&str> = f.features.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "appendOnly",
                "changeDataFeed",
                "checkConstraints",
                "generatedColumns",
                "invariants"
            ]
        );
        assert!(f.features.iter().all(|f| f.implied));
        assert!(f.check("t").is_ok());
        // Writer 6 implies identity columns, but a table without one asks
        // nothing of them.
        assert!(of(6, &[], &[]).check("t").is_ok());
    }

    #[test]
    fn unknown_and_unwritable_features_are_refused_by_name() {
        let err = of(7, &["appendOnly", "someFutureFeature"], &[])
            .check("t")
            .unwrap_err()
            .to_string();
        assert!(err.contains("someFutureFeature"), "{err}");
        for name in ["rowTracking", "catalogManaged", "icebergCompatV2"] {
            let err = of(7, &[name], &[]).check("t").unwrap_err().to_string();
            assert!(err.contains(name), "{err}");
        }
        let err = of(5, &[], &[("delta.columnMapping.mode", "name")])
            .check("t")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("columnMapping") && err.contains("'name'"),
            "{err}"
        );
        assert!(
            of(
                7,
                &["columnMapping"],
                &[("delta.columnMapping.mode", "none")]
            )
            .check("t")
            .is_ok()
        );
    }

    #[test]
    fn append_only_refuses_rewrites_only_when_set() {
        let on = of(2, &[], &[("delta.appendOnly", "true")]);
        assert!(on.check_write("t", &WriteMode::Append).is_ok());
        let err = on
            .check_write("t", &WriteMode::ReplaceAll { keys: None })
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("appendOnly") && err.contains("complete"),
            "{err}"
        );
        let off = of(2, &[], &[("delta.appendOnly", "false")]);
        assert!(
            off.check_write("t", &WriteMode::Upsert { keys: vec![] })
                .is_ok()
        );
        // The property without the feature (writer 7) binds nobody.
        let unlisted = of(7, &["invariants"], &[("delta.appendOnly", "true")]);
        assert!(!unlisted.append_only);
    }

    #[test]
    fn transaction_retention_is_refused() {
        let err = of(
            2,
            &[],
            &[("delta.setTransactionRetentionDuration", "interval 1 days")],
        )
        .check("t")
        .unwrap_err()
        .to_string();
        assert!(err.contains("setTransactionRetentionDuration"), "{err}");
    }
}
