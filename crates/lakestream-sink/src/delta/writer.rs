//! Streaming one batch's output into new Parquet files.

use super::*;

/// One writer of a batch: files roll at the target size.
pub(super) struct DeltaBatchWriter {
    pub(super) table: String,
    pub(super) batch_id: u64,
    pub(super) schema: SchemaRef,
    pub(super) writer: RecordBatchWriter,
    pub(super) rows: u64,
}

#[async_trait]
impl BatchWriter for DeltaBatchWriter {
    async fn write(&mut self, batch: RecordBatch) -> Result<()> {
        if batch.num_rows() == 0 {
            return Ok(());
        }
        let batch = cast_batch(&batch, &self.schema).map_err(|reason| Error::SchemaMismatch {
            table: self.table.clone(),
            reason,
        })?;
        self.rows += batch.num_rows() as u64;
        self.writer.write(batch).await.map_err(|e| Error::Write {
            table: self.table.clone(),
            batch_id: self.batch_id,
            source: Box::new(e),
        })
    }

    async fn finish(mut self: Box<Self>) -> Result<Staged> {
        let adds = self.writer.flush().await.map_err(|e| Error::Write {
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
