//! [`Sink`] for [`DeltaSink`]: the batch id check, staging through the
//! writers, the commit (fast append, delta-rs's commit, MERGE, replace)
//! with its retries, and the reads of positions and versions.

use super::commit::FastAppend;
use super::*;

#[async_trait]
impl Sink for DeltaSink {
    async fn open(&self, schema: SchemaRef) -> Result<()> {
        let wanted = delta_schema(&schema);
        for p in &self.options.partition_columns {
            if wanted.index_of(p).is_err() {
                return Err(Error::InvalidConfig {
                    table: self.name.clone(),
                    reason: format!(
                        "partition column {p} is not in the query's output ({})",
                        describe_schema(&wanted)
                    ),
                });
            }
        }
        self.location.verify_atomic_create().await?;
        let mut guard = self.table.lock().await;
        let meta = match self.load_meta().await? {
            Some(meta) => meta,
            None => {
                let kernel: StructType =
                    wanted
                        .as_ref()
                        .try_into_kernel()
                        .map_err(|e| Error::InvalidConfig {
                            table: self.name.clone(),
                            reason: format!("the query's output cannot be a Delta schema: {e}"),
                        })?;
                let created = open_table(&self.location)
                    .map_err(|e| self.table_err(e))?
                    .create()
                    .with_columns(kernel.fields().cloned())
                    .with_partition_columns(self.options.partition_columns.clone())
                    .with_configuration_property(
                        TableProperty::CheckpointInterval,
                        Some(self.options.checkpoint_interval.max(1).to_string()),
                    )
                    .with_save_mode(SaveMode::Ignore)
                    .await;
                // Created by someone else meanwhile: check it like any table.
                match (self.load_meta().await?, created) {
                    (Some(meta), _) => meta,
                    (None, Err(e)) => return Err(self.table_err(e)),
                    (None, Ok(_)) => {
                        return Err(self.table_err(DeltaTableError::Generic(
                            "the table was created but its log cannot be read back; check the \
                             store"
                                .into(),
                        )));
                    }
                }
            }
        };
        let table_features = features_of(&meta);
        table_features.check(&self.name)?;
        if self.options.auto_compact_every.is_some() {
            table_features.check_maintenance(&self.name, "auto-compaction (auto_compact_every)")?;
        }
        let existing = meta.arrow_schema().map_err(|e| self.table_err(e))?;
        let have = delta_schema(&existing);
        let produced: Vec<String> = wanted.fields().iter().map(|f| f.name().clone()).collect();
        // Generated columns the query leaves out are computed by the sink.
        let kernel_schema = meta.schema();
        let omitted: Vec<&str> = kernel_schema
            .fields()
            .filter(|f| {
                f.get_config_value(&buoyant_kernel::schema::ColumnMetadataKey::GenerationExpression)
                    .is_some()
                    && !produced.iter().any(|p| p == f.name())
            })
            .map(|f| f.name().as_str())
            .collect();
        let without_omitted = Schema::new(
            have.fields()
                .iter()
                .filter(|f| !omitted.contains(&f.name().as_str()))
                .cloned()
                .collect::<Vec<_>>(),
        );
        let mut computes_columns = false;
        let evolution = if lakestream_sink::same_columns(&have, &wanted) {
            None
        } else if !omitted.is_empty() && lakestream_sink::same_columns(&without_omitted, &wanted) {
            computes_columns = true;
            None
        } else if self.options.merge_schema {
            Some(self.evolve(&meta, &existing, &wanted)?)
        } else {
            return Err(Error::SchemaMismatch {
                table: self.name.clone(),
                reason: format!(
                    "the table has ({}), the query produces ({}); to add the new columns to \
                     the table, set OPTIONS ('merge_schema' 'true') on it",
                    describe_schema(&have),
                    describe_schema(&wanted)
                ),
            });
        };
        let written = match &evolution {
            Some(ev) => delta_schema(&ev.schema),
            None => have.clone(),
        };
        let rules = rules::TableRules::compile(
            &self.name,
            &kernel_schema,
            meta.metadata().configuration(),
            &written,
            &produced,
        )?;
        *self.contract.lock().expect("contract lock") = Contract {
            features: table_features,
            rules: rules.map(Arc::new),
            computes_columns,
            source: contract_source(&meta),
            last_ict: None,
        };
        *self.evolution.lock().expect("evolution lock") = evolution;
        let parts: Vec<String> = meta.metadata().partition_columns().to_vec();
        if !self.options.partition_columns.is_empty() && parts != self.options.partition_columns {
            return Err(Error::SchemaMismatch {
                table: self.name.clone(),
                reason: format!(
                    "the table is partitioned by ({}), the job asks for ({})",
                    parts.join(", "),
                    self.options.partition_columns.join(", ")
                ),
            });
        }
        if meta
            .table_properties()
            .column_mapping_mode
            .is_some_and(|m| m != ColumnMappingMode::None)
        {
            return Err(Error::InvalidConfig {
                table: self.name.clone(),
                reason: "the table uses column mapping, which lakestream cannot write yet; \
                         write to a table without it"
                    .into(),
            });
        }
        self.set_head(meta.version());
        *guard = Some(Loaded { meta, full: None });
        Ok(())
    }

    async fn accepts(&self, write: &WriteMode) -> Result<()> {
        let contract = self.contract.lock().expect("contract lock");
        contract.features.check_write(&self.name, write)?;
        if *write != WriteMode::Append && contract.computes_columns {
            return Err(Error::InvalidConfig {
                table: self.name.clone(),
                reason: "the update and complete output modes write the query's columns as \
                         they are; produce the table's generated columns in the query"
                    .into(),
            });
        }
        Ok(())
    }

    async fn committed_batch(&self, query_id: &str) -> Result<Option<u64>> {
        let mut guard = self.table.lock().await;
        let Some(loaded) = self.loaded(&mut guard).await? else {
            return Ok(None);
        };
        self.refresh(loaded).await?;
        Ok(self
            .txn_version(loaded, query_id)
            .await?
            .and_then(|v| u64::try_from(v).ok()))
    }

    async fn begin(&self, batch_id: u64) -> Result<Box<dyn BatchWriter>> {
        let guard = self.table.lock().await;
        let loaded = guard.as_ref().ok_or_else(|| Error::InvalidConfig {
            table: self.name.clone(),
            reason: "the sink was not opened".into(),
        })?;
        let write_err = |e: DeltaTableError| Error::Write {
            table: self.name.clone(),
            batch_id,
            source: Box::new(e),
        };
        let props = WriterProperties::builder()
            .set_compression(self.options.compression)
            .build();
        let evolution = self.evolution.lock().expect("evolution lock").clone();
        let writer = match &evolution {
            // The table lacks columns this batch writes: files of the
            // evolved schema (the metadata comes with the commit).
            Some(ev) if ev.metadata.is_some() => {
                use deltalake::datafile::writer::{DeltaWriter as FilesWriter, WriterConfig};
                let config = WriterConfig::new(
                    ev.schema.clone(),
                    loaded.meta.metadata().partition_columns().to_vec(),
                    Some(props.clone()),
                    std::num::NonZeroU64::new(self.options.target_file_size),
                    None,
                    buoyant_kernel::table_properties::DataSkippingNumIndexedCols::NumColumns(32),
                    None,
                );
                writer::FileWriter::Evolving(Box::new(FilesWriter::new(
                    loaded.meta.object_store(),
                    config,
                )))
            }
            _ => writer::FileWriter::Blind(Box::new(
                RecordBatchWriter::for_blind_appends(&loaded.meta)
                    .map_err(write_err)?
                    .with_writer_properties(props.clone())
                    .with_target_file_size(self.options.target_file_size),
            )),
        };
        let table_schema = loaded.meta.arrow_schema().map_err(write_err)?;
        let (rules, computes_columns) = {
            let contract = self.contract.lock().expect("contract lock");
            (contract.rules.clone(), contract.computes_columns)
        };
        let (schema, by_name) = match evolution {
            Some(ev) => (delta_schema(&ev.schema), true),
            None => (delta_schema(table_schema.as_ref()), computes_columns),
        };
        // Where the partition columns sit in the batches, for the run split
        // (the blind writer only: an evolving writer has no partitions).
        let partitions = match &writer {
            writer::FileWriter::Blind(_) => loaded
                .meta
                .metadata()
                .partition_columns()
                .iter()
                .map(|name| Some((name.clone(), schema.index_of(name).ok()?)))
                .collect::<Option<Vec<_>>>()
                .unwrap_or_default(),
            writer::FileWriter::Evolving(_) => Vec::new(),
        };
        let files = if partitions.is_empty() {
            None
        } else {
            partition_files::PartitionFiles::new(
                loaded.meta.object_store(),
                &table_schema,
                loaded.meta.metadata().partition_columns(),
                &schema,
                props,
                std::num::NonZeroU64::new(self.options.target_file_size),
                loaded.meta.metadata().configuration(),
            )
        };
        Ok(Box::new(DeltaBatchWriter {
            table: self.name.clone(),
            batch_id,
            schema,
            by_name,
            writer,
            partitions,
            files,
            rows: 0,
            flush_after: usize::try_from(self.options.unordered_flush_size).unwrap_or(usize::MAX),
            unflushed: 0,
            flushed: Vec::new(),
            rules,
            violations: Vec::new(),
        }))
    }

    async fn commit(&self, staged: Staged, info: &CommitInfo) -> Result<CommitOutcome> {
        // Rows that break the table's rules were left out of the files:
        // unless the engine set them aside, the batch is refused whole.
        staged.check_violations()?;
        self.contract
            .lock()
            .expect("contract lock")
            .features
            .check_write(&self.name, &info.write)?;
        let mut guard = self.table.lock().await;
        let loaded = guard.as_mut().ok_or_else(|| Error::InvalidConfig {
            table: self.name.clone(),
            reason: "the sink was not opened".into(),
        })?;
        self.collect_checkpoint(loaded, false).await;
        let actions: Vec<Action> = staged
            .into_parts::<Vec<Action>>(&self.name)?
            .into_iter()
            .flatten()
            .collect();
        let req = self.request(info, actions)?;
        if let Some(done) = self.known_committed(loaded, &req).await? {
            return Ok(done);
        }
        if !info.claims.is_empty() {
            if info.write != WriteMode::Append {
                return Err(Error::InvalidConfig {
                    table: self.name.clone(),
                    reason: "source positions kept in the table (Kafka group mode) go with \
                             appended batches only"
                        .into(),
                });
            }
            return self
                .commit_claimed(
                    loaded,
                    req.actions,
                    info,
                    req.operation,
                    req.app_metadata,
                    req.evolved,
                )
                .await;
        }
        match self.fast_append(loaded, &req).await? {
            FastAppend::Done(done) => Ok(done),
            FastAppend::Fallback { taken, refreshed } => {
                self.commit_with_delta_rs(loaded, req, taken, refreshed)
                    .await
            }
        }
    }

    fn identity(&self) -> String {
        format!("delta {}", self.location.url())
    }

    fn commit_retries(&self) -> u64 {
        self.retries.load(std::sync::atomic::Ordering::Relaxed)
    }

    async fn flush(&self) {
        let mut guard = self.table.lock().await;
        let Some(loaded) = guard.as_mut() else { return };
        // Collecting a checkpoint may start one that fell due meanwhile.
        while self
            .checkpointing
            .lock()
            .expect("checkpoint slot")
            .running
            .is_some()
        {
            self.collect_checkpoint(loaded, true).await;
        }
    }

    async fn positions(
        &self,
        app_ids: &[String],
    ) -> Result<std::collections::BTreeMap<String, i64>> {
        self.fresh_positions(app_ids).await
    }

    async fn version(&self) -> Result<Option<u64>> {
        let mut guard = self.table.lock().await;
        let Some(loaded) = self.loaded(&mut guard).await? else {
            return Ok(None);
        };
        Ok(self.head(loaded))
    }
}
