//! Streaming one batch's output into new Parquet files.

use super::schema::by_name;
use super::*;

/// What writes a batch's Parquet files.
pub(super) enum FileWriter {
    /// Files of the table's schema, as its metadata says.
    Blind(Box<RecordBatchWriter>),
    /// Files of a schema the table does not have yet (`merge_schema`: the
    /// batch's commit brings the new columns).
    Evolving(Box<deltalake::datafile::writer::DeltaWriter>),
}

/// One writer of a batch: files roll at the target size.
pub(super) struct DeltaBatchWriter {
    pub(super) table: String,
    pub(super) batch_id: u64,
    pub(super) schema: SchemaRef,
    /// Match the batch's columns to `schema` by name, NULL for those it
    /// lacks (`merge_schema`); else by position.
    pub(super) by_name: bool,
    pub(super) writer: FileWriter,
    pub(super) rows: u64,
}

#[async_trait]
impl BatchWriter for DeltaBatchWriter {
    async fn write(&mut self, batch: RecordBatch) -> Result<()> {
        if batch.num_rows() == 0 {
            return Ok(());
        }
        let batch = if self.by_name {
            by_name(&batch, &self.schema)
        } else {
            Ok(batch)
        };
        let batch = batch
            .and_then(|b| cast_batch(&b, &self.schema))
            .map_err(|reason| Error::SchemaMismatch {
                table: self.table.clone(),
                reason,
            })?;
        self.rows += batch.num_rows() as u64;
        let written = match &mut self.writer {
            FileWriter::Blind(w) => w.write(batch).await,
            FileWriter::Evolving(w) => w.write(&batch).await,
        };
        written.map_err(|e| Error::Write {
            table: self.table.clone(),
            batch_id: self.batch_id,
            source: Box::new(e),
        })
    }

    async fn finish(self: Box<Self>) -> Result<Staged> {
        let adds = match self.writer {
            FileWriter::Blind(mut w) => w.flush().await,
            FileWriter::Evolving(w) => w.close().await,
        };
        let adds = adds.map_err(|e| Error::Write {
            table: self.table.clone(),
            batch_id: self.batch_id,
            source: Box::new(e),
        })?;
        let bytes = adds.iter().map(|a| a.size.max(0) as u64).sum();
        let files = adds.len();
        let actions: Vec<Action> = adds.into_iter().map(Action::Add).collect();
        Ok(Staged::new(self.batch_id, self.rows, files, bytes, actions))
    }
}
