//! The SQL logic tests of whole jobs (`tests/slt/*.slt`, run by
//! `lakestream_testkit::slt`): declare a job, feed its sources, run
//! batches (with crashes), check the table after each run.

#[tokio::test]
async fn every_slt_file_passes() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/slt");
    let mut files: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "slt"))
        .collect();
    files.sort();
    assert!(files.len() >= 4, "slt files under {}", root.display());
    let scratch = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for file in &files {
        if let Err(e) = lakestream_testkit::slt::run_file(file, scratch.path()).await {
            failures.push(format!("{}:\n{e}", file.display()));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
