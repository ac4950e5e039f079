//! The status page and `/metrics`: `lakestream ui`, and `run --metrics-addr`.
//!
//! A small HTTP/1.1 server (GET only, one request per connection, bounded
//! request size and time) on the address given, serving:
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
use std::sync::Arc;
use std::time::Duration;

use lakestream_engine::BatchProgress;
use lakestream_engine::metrics::Metrics;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

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
                let _ = tokio::time::timeout(Duration::from_secs(30), handle(conn, &site)).await;
            });
        }
    });
    Ok(local)
}

async fn handle(mut conn: TcpStream, site: &Site) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        if buf.len() > 16 * 1024 {
            return respond(&mut conn, 431, "text/plain", b"request too large\n").await;
        }
        let n = conn.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let head = String::from_utf8_lossy(&buf);
    let mut parts = head.lines().next().unwrap_or_default().split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or("/"));
    if method != "GET" && method != "HEAD" {
        return respond(&mut conn, 405, "text/plain", b"only GET\n").await;
    }
    let path = target.split('?').next().unwrap_or("/");
    match path {
        "/metrics" => match &site.metrics {
            Some(m) => respond(&mut conn, 200, Metrics::CONTENT_TYPE, m.encode().as_bytes()).await,
            None => {
                respond(
                    &mut conn,
                    404,
                    "text/plain",
                    b"no metrics here: they are served by `lakestream run --metrics-addr` while the query runs\n",
                )
                .await
            }
        },
        "/api/status" => {
            let body = status_json(site).await;
            respond(&mut conn, 200, "application/json", body.to_string().as_bytes()).await
        }
        "/" | "/index.html" => {
            let data = status_json(site).await.to_string().replace("</", "<\\/");
            let page = PAGE.replace("/*DATA*/null", &data);
            respond(&mut conn, 200, "text/html; charset=utf-8", page.as_bytes()).await
        }
        "/favicon.ico" => respond(&mut conn, 204, "text/plain", b"").await,
        _ => respond(&mut conn, 404, "text/plain", b"not found\n").await,
    }
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

async fn respond(
    conn: &mut TcpStream,
    code: u16,
    content_type: &str,
    body: &[u8],
) -> std::io::Result<()> {
    let reason = match code {
        200 => "OK",
        204 => "No Content",
        404 => "Not Found",
        405 => "Method Not Allowed",
        _ => "Request Header Fields Too Large",
    };
    let head = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         Cache-Control: no-store\r\nConnection: close\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).await?;
    conn.write_all(body).await?;
    conn.shutdown().await
}
