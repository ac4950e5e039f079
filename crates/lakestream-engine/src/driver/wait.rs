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
/// store briefly unavailable), wait with backoff (250 ms doubling to 30 s,
/// [`backon`]), say so, and call again, for at most the source's
/// [`Source::unavailable_timeout`]; then fail with
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
    use backon::{ExponentialBuilder, Retryable};

    let name = source.name();
    let limit = source.unavailable_timeout();
    let started = Instant::now();
    let backoff = ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(250))
        .with_max_delay(Duration::from_secs(30))
        .without_max_times();
    let stop_seen = stop.clone();
    // `None`: a stop was requested before the call.
    let attempt = || {
        let stopped = *stop_seen.borrow();
        let call = (!stopped).then(&mut call);
        async move {
            match call {
                Some(c) => c.await.map_err(Some),
                None => Err(None),
            }
        }
    };
    let sleeper = stop.clone();
    let outcome = attempt
        .retry(backoff)
        .sleep(move |d| {
            let mut stop = sleeper.clone();
            async move {
                tokio::select! {
                    _ = tokio::time::sleep(d) => {}
                    _ = stop.wait_for(|s| *s) => {}
                }
            }
        })
        .when(|e| e.as_ref().is_some_and(|e| e.is_transient()))
        // The last wait ends at the limit; past it, no more.
        .adjust(|_, d| {
            let left = limit.saturating_sub(started.elapsed());
            d.map(|d| d.min(left)).filter(|d| !d.is_zero())
        })
        .notify(|e, d| {
            if let Some(e) = e {
                tracing::warn!(
                    source = name,
                    error = %e,
                    "{what}: source unavailable; waiting {d:?} before trying again (giving up after {limit:?})",
                );
            }
        })
        .await;
    match outcome {
        Ok(v) => Ok(Some(v)),
        Err(None) => Ok(None),
        Err(Some(e)) if e.is_transient() && *stop.borrow() => Ok(None),
        Err(Some(e)) if e.is_transient() => Err(Error::SourceUnavailable {
            source_name: name.to_string(),
            what: what.to_string(),
            waited: started.elapsed(),
            last: Box::new(e),
        }),
        Err(Some(e)) => Err(e.into()),
    }
}

/// Sleep for `d` or until a stop is requested.
pub(super) async fn wait(stop: &mut watch::Receiver<bool>, d: Duration) {
    tokio::select! {
        _ = tokio::time::sleep(d) => {}
        _ = stop.changed() => {}
    }
}
