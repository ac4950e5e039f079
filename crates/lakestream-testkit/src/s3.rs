//! The S3-compatible server `scripts/test.sh` starts on 127.0.0.1
//! (SeaweedFS), as the tests reach it: a fresh prefix per test, the
//! storage options or environment a user would set, and uploads and
//! listings through `object_store`.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

/// The test S3 server scripts/test.sh started.
pub struct S3Server {
    endpoint: String,
    bucket: String,
    key_id: String,
    secret: String,
}

impl S3Server {
    /// The server from `LAKESTREAM_S3_*`; panics with the way to get one.
    pub fn from_env() -> Self {
        let var = |k: &str| {
            std::env::var(k).unwrap_or_else(|_| {
                panic!(
                    "{k} is not set: run ./scripts/test.sh, which installs and starts the \
                     S3-compatible server these tests use"
                )
            })
        };
        S3Server {
            endpoint: var("LAKESTREAM_S3_ENDPOINT"),
            bucket: var("LAKESTREAM_S3_BUCKET"),
            key_id: var("LAKESTREAM_S3_KEY_ID"),
            secret: var("LAKESTREAM_S3_SECRET"),
        }
    }

    /// The server's endpoint URL (`http://127.0.0.1:PORT`).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// A fresh prefix URL for one test: `s3://bucket/<name>-<nanos>/`.
    pub fn prefix(&self, name: &str) -> String {
        format!(
            "s3://{}/{name}-{}/",
            self.bucket,
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        )
    }

    /// The environment a user sets to reach the server (standard AWS names).
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT", self.endpoint.clone()),
            ("AWS_ACCESS_KEY_ID", self.key_id.clone()),
            ("AWS_SECRET_ACCESS_KEY", self.secret.clone()),
            ("AWS_REGION", "us-east-1".into()),
            ("AWS_ALLOW_HTTP", "true".into()),
        ]
    }

    /// The storage options that reach the server (as a job's `SET` or a
    /// `Location`'s options).
    pub fn options(&self) -> HashMap<String, String> {
        [
            ("aws_endpoint", self.endpoint.clone()),
            ("aws_access_key_id", self.key_id.clone()),
            ("aws_secret_access_key", self.secret.clone()),
            ("aws_region", "us-east-1".into()),
            ("aws_allow_http", "true".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    fn store(&self) -> Arc<dyn ObjectStore> {
        Arc::new(
            AmazonS3Builder::new()
                .with_endpoint(&self.endpoint)
                .with_bucket_name(&self.bucket)
                .with_access_key_id(&self.key_id)
                .with_secret_access_key(&self.secret)
                .with_region("us-east-1")
                .with_allow_http(true)
                .build()
                .unwrap(),
        )
    }

    fn key(&self, url: &str) -> String {
        url.strip_prefix(&format!("s3://{}/", self.bucket))
            .expect("a URL in the test bucket")
            .trim_end_matches('/')
            .to_string()
    }

    /// Upload every file of the local `dir` (not dot files) below `url`,
    /// in name order.
    pub fn upload_dir(&self, dir: &Path, url: &str) {
        let store = self.store();
        let prefix = self.key(url);
        let mut names: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| !n.starts_with('.'))
            .collect();
        names.sort();
        rt().block_on(async {
            for n in names {
                let body = std::fs::read(dir.join(&n)).unwrap();
                store
                    .put(
                        &ObjectPath::from(format!("{prefix}/{n}")),
                        PutPayload::from(body),
                    )
                    .await
                    .unwrap();
            }
        });
    }

    /// Upload `files` (name, body) below `url`, 32 at a time.
    pub fn upload_many(&self, url: &str, files: Vec<(String, impl Into<PutPayload>)>) {
        use futures::StreamExt;
        let store = self.store();
        let prefix = self.key(url);
        rt().block_on(async {
            futures::stream::iter(files)
                .map(|(name, body)| {
                    let store = store.clone();
                    let path = ObjectPath::from(format!("{prefix}/{name}"));
                    let body: PutPayload = body.into();
                    async move { store.put(&path, body).await }
                })
                .buffer_unordered(32)
                .for_each(|r| {
                    r.unwrap();
                    futures::future::ready(())
                })
                .await;
        });
    }

    /// Object keys below `url`, relative to it.
    pub fn list(&self, url: &str) -> Vec<String> {
        use futures::TryStreamExt;
        let store = self.store();
        let prefix = self.key(url);
        rt().block_on(async {
            let metas: Vec<_> = store
                .list(Some(&ObjectPath::from(prefix.clone())))
                .try_collect()
                .await
                .unwrap();
            metas
                .into_iter()
                .map(|m| m.location.as_ref()[prefix.len() + 1..].to_string())
                .collect()
        })
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}
