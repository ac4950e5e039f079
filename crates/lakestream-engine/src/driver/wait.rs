//! Waiting: trigger intervals, stop requests, and retries of a source's
//! transient failures.

use std::time::{Duration, Instant};

use lakestream_source::Source;
use tokio::sync::watch;

use crate::{Error, Result};

/// The start of the next interval after `previous`: one interval later, or
/// one interval from `now` when the query fell behind (a batch that ran
/// longer than the interval), never an overflow.
pub(super) fn next_trigger(previous: Instant, interval: Duration, now: Instant) -> Instant {
    match previous.checked_add(interval) {
        Some(t) if t >= now => t,
        _ => now.checked_add(interval).unwrap_or(now),
    }
}

/// Run a source call; while it reports a transient failure (a broker or
/// store briefly unavailable), wait with backoff, say so, and call again,
/// for at most the source's [`Source::unavailable_timeout`]; then fail with
/// [`Error::SourceUnavailable`]. Returns `None` when a stop is requested
/// while waiting.
pub(super) async fn retry_transient<T, F, Fut>(
    source: &dyn Source,
    what: &str,
    stop: &mut watch::Receiver<bool>,
    mut call: F,
) -> Result<Option<T>>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = lakestream_source::Result<T>>,
{
    let name = source.name();
    let limit = source.unavailable_timeout();
    let started = Instant::now();
    let mut delay = Duration::from_millis(250);
    loop {
        match call().await {
            Ok(v) => return Ok(Some(v)),
            Err(e) if e.is_transient() && !*stop.borrow() => {
                let waited = started.elapsed();
                if waited >= limit {
                    return Err(Error::SourceUnavailable {
                        source_name: name.to_string(),
                        what: what.to_string(),
                        waited,
                        last: Box::new(e),
                    });
                }
                tracing::warn!(
                    source = name,
                    error = %e,
                    "{what}: source unavailable; waiting {:?} before trying again (giving up after {:?})",
                    delay,
                    limit
                );
                wait(stop, delay.min(limit - waited)).await;
                if *stop.borrow() {
                    return Ok(None);
                }
                delay = (delay * 2).min(Duration::from_secs(30));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Sleep for `d` or until a stop is requested.
pub(super) async fn wait(stop: &mut watch::Receiver<bool>, d: Duration) {
    tokio::select! {
        _ = tokio::time::sleep(d) => {}
        _ = stop.changed() => {}
    }
}
