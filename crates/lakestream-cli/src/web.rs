//! The status page and `/metrics`: `lakestream ui`, and `run --metrics-addr`.
//!
//! hyper's HTTP/1.1 server (GET and HEAD only, bounded header size and
//! time per connection) on the address given, serving:
//! - `/`: the status page (`ui/index.html`, assets embedded in the binary:
//!   nothing is fetched from elsewhere), with the checkpoint's status and
//!   batch history in the page, redrawn from `/api/status` every few
//!   seconds;
//! - `/api/status`: that JSON (what `status --json` prints, plus `history`,
//!   the progress of the last batches);
//! - `/metrics`: Prometheus metrics in the OpenMetrics text format, during
//!   a run.
//!
//! The page reads the checkpoint on each request; it works the same for a
//! running query and for one that has stopped.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{ALLOW, CACHE_CONTROL, CONTENT_TYPE, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use lakestream_engine::BatchProgress;
use lakestream_engine::metrics::Metrics;
use serde_json::{Value, json};
use tokio::net::TcpListener;

/// The page, with `/*DATA*/null` replaced by the status JSON.
const PAGE: &str = include_str!("ui/index.html");

/// Batches of history the page plots.
const HISTORY: usize = 500;

/// What the server shows.
pub(crate) struct Site {
    /// The checkpoint of the query shown.
    pub(crate) checkpoint: String,
    /// Storage options for it.
    pub(crate) options: HashMap<String, String>,
    /// The running query's metrics (none for `lakestream ui`).
    pub(crate) metrics: Option<Arc<Metrics>>,
    /// Progress entries read so far, by batch id: they do not change once
    /// written (but for a replayed batch, re-read when its file is newer),
    /// so each page load reads only the new ones.
    pub(crate) history: tokio::sync::Mutex<std::collections::BTreeMap<u64, BatchProgress>>,
}

impl Site {
    /// A site for `checkpoint`, with `metrics` when a query runs.
    pub(crate) fn new(
        checkpoint: String,
        options: HashMap<String, String>,
        metrics: Option<Arc<Metrics>>,
    ) -> Self {
        Self {
            checkpoint,
            options,
            metrics,
            history: Default::default(),
        }
    }
}

/// Bind `addr` and serve `site` on it in the background; returns the
/// address bound (port 0 picks a free one).
pub(crate) async fn start(addr: &str, site: Site) -> anyhow::Result<std::net::SocketAddr> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {addr}: {e}"))?;
    let local = listener.local_addr()?;
    let site = Arc::new(site);
    tokio::spawn(async move {
        loop {
            let Ok((conn, _)) = listener.accept().await else {
                continue;
            };
            let site = site.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| {
                    let site = site.clone();
                    async move { Ok::<_, Infallible>(route(&site, req).await) }
                });
                let serve = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    // A client that sends its request slowly is dropped,
                    // and a header block beyond 16 KiB answered 431.
                    .header_read_timeout(Duration::from_secs(10))
                    .max_buf_size(16 * 1024)
                    .serve_connection(TokioIo::new(conn), service);
                let _ = tokio::time::timeout(Duration::from_secs(30), serve).await;
            });
        }
    });
    Ok(local)
}

/// The response to `req`.
async fn route(site: &Site, req: Request<Incoming>) -> Response<Full<Bytes>> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = respond(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "only GET and HEAD\n",
        );
        r.headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    match req.uri().path() {
        "/metrics" => match &site.metrics {
            Some(m) => respond(StatusCode::OK, Metrics::CONTENT_TYPE, m.encode()),
            None => respond(
                StatusCode::NOT_FOUND,
                "text/plain",
                "no metrics here: they are served by `lakestream run --metrics-addr` while the query runs\n",
            ),
        },
        "/api/status" => respond(
            StatusCode::OK,
            "application/json",
            status_json(site).await.to_string(),
        ),
        "/" | "/index.html" => {
            let data = status_json(site).await.to_string().replace("</", "<\\/");
            let page = PAGE.replace("/*DATA*/null", &data);
            respond(StatusCode::OK, "text/html; charset=utf-8", page)
        }
        "/favicon.ico" => respond(StatusCode::NO_CONTENT, "text/plain", ""),
        _ => respond(StatusCode::NOT_FOUND, "text/plain", "not found\n"),
    }
}

/// A response of `body`, never cached.
fn respond(code: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = code;
    let h = r.headers_mut();
    if let Ok(v) = HeaderValue::from_str(content_type) {
        h.insert(CONTENT_TYPE, v);
    }
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

/// The checkpoint's status with its batch history, or `{"error": ..}`.
async fn status_json(site: &Site) -> Value {
    let status = crate::status::collect(&site.checkpoint, 0, &site.options).await;
    let history = history(site).await;
    match (status, history) {
        (Ok((mut status, _)), Ok(history)) => {
            status["checkpoint"] = json!(site.checkpoint);
            status["history"] = json!(history);
            status
        }
        (Err(e), _) | (_, Err(e)) => {
            json!({ "checkpoint": site.checkpoint, "error": format!("{e:#}") })
        }
    }
}

/// The last [`HISTORY`] batches' progress, oldest first: one listing of
/// `progress/`, and reads of the entries not read before (and of the
/// newest, which a replay may have rewritten).
async fn history(site: &Site) -> anyhow::Result<Vec<BatchProgress>> {
    let view = lakestream_engine::checkpoint::Checkpoint::inspect(&site.checkpoint, &site.options)
        .await?
        .ok_or_else(|| anyhow::anyhow!("no checkpoint at {}", site.checkpoint))?;
    let ids = view.progress_ids().await?;
    let keep: Vec<u64> = ids.iter().rev().take(HISTORY).rev().copied().collect();
    let mut cache = site.history.lock().await;
    cache.retain(|id, _| keep.binary_search(id).is_ok());
    let newest = keep.last().copied();
    for id in &keep {
        if cache.contains_key(id) && Some(*id) != newest {
            continue;
        }
        // An unreadable entry (torn by a crash) is passed over.
        if let Ok(Some(e)) = view.progress(*id).await
            && let Ok(p) = serde_json::from_value::<BatchProgress>(e.progress)
        {
            cache.insert(*id, p);
        }
    }
    Ok(cache.values().cloned().collect())
}
