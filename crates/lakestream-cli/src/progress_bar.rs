//! The progress bar of `run --trigger available-now` on a terminal: files and
//! bytes done of the total listed at start, rows/s and time left, redrawn in
//! place after each batch. Without a terminal the CLI prints one plain line
//! per batch instead.
//!
//! `indicatif` draws the bar (bytes done of the total); the message beside
//! it, and its time left, are computed here: the rate counts only the bytes
//! of this run, so a restart halfway does not promise a finish in seconds.

use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use lakestream_engine::BatchProgress;
use lakestream_engine::source::Backlog;

/// Width of the bar in characters.
const WIDTH: usize = 24;

/// A progress bar drawn on stderr.
pub(crate) struct Bar {
    started: Instant,
    /// Bytes done when the first batch of this run finished, and when.
    first: Option<(u64, Instant)>,
    rows: u64,
    bar: ProgressBar,
}

impl Bar {
    pub(crate) fn new() -> Self {
        Self::with_target(ProgressDrawTarget::stderr())
    }

    fn with_target(target: ProgressDrawTarget) -> Self {
        let bar = ProgressBar::with_draw_target(Some(0), target);
        bar.set_style(
            ProgressStyle::with_template(&format!("[{{bar:{WIDTH}}}] {{msg}}"))
                .expect("a valid template")
                .progress_chars("#."),
        );
        Self {
            started: Instant::now(),
            first: None,
            rows: 0,
            bar,
        }
    }

    /// Redraw after batch `p`, with the sources' summed backlog.
    pub(crate) fn update(&mut self, p: &BatchProgress, backlog: Backlog) {
        self.rows += p.input_rows;
        let now = Instant::now();
        let first = *self.first.get_or_insert((backlog.bytes_done, now));
        self.bar.set_message(render(
            backlog,
            self.rows,
            now - self.started,
            rate(first, (backlog.bytes_done, now)),
        ));
        let (done, total) = position(backlog);
        self.bar.set_length(total);
        self.bar.set_position(done);
    }

    /// Leave the bar's last state on screen; later output starts on a
    /// fresh line.
    pub(crate) fn finish(self) {
        self.bar.abandon();
        if !self.bar.is_hidden() {
            eprintln!();
        }
    }
}

/// Where the bar stands: bytes done of the total, or files when the
/// sizes are unknown.
fn position(b: Backlog) -> (u64, u64) {
    if b.bytes_total > 0 {
        (b.bytes_done.min(b.bytes_total), b.bytes_total)
    } else {
        (b.done.min(b.total), b.total.max(1))
    }
}

/// Bytes per second between two (bytes, time) points, when measurable.
fn rate(from: (u64, Instant), to: (u64, Instant)) -> Option<f64> {
    let secs = (to.1 - from.1).as_secs_f64();
    (secs > 0.0 && to.0 > from.0).then(|| (to.0 - from.0) as f64 / secs)
}

/// The message beside the bar: `12/30 files  1.2 GiB/3.4 GiB  45.1k rows/s  ETA 1m12s`.
pub(crate) fn render(
    b: Backlog,
    rows: u64,
    elapsed: Duration,
    bytes_per_sec: Option<f64>,
) -> String {
    let rows_per_sec = rows as f64 / elapsed.as_secs_f64().max(1e-3);
    let eta = match bytes_per_sec {
        _ if b.bytes_done >= b.bytes_total && b.done >= b.total => "done".to_string(),
        Some(r) if r > 0.0 => format!(
            "ETA {}",
            duration((b.bytes_total - b.bytes_done) as f64 / r)
        ),
        _ => "ETA -".to_string(),
    };
    format!(
        "{}/{} files  {}/{}  {} rows/s  {eta}",
        b.done,
        b.total,
        bytes(b.bytes_done),
        bytes(b.bytes_total),
        count(rows_per_sec),
    )
}

fn bytes(n: u64) -> String {
    let n = n as f64;
    if n >= (1u64 << 30) as f64 {
        format!("{:.1} GiB", n / (1u64 << 30) as f64)
    } else if n >= (1u64 << 20) as f64 {
        format!("{:.1} MiB", n / (1u64 << 20) as f64)
    } else if n >= 1024.0 {
        format!("{:.1} KiB", n / 1024.0)
    } else {
        format!("{n:.0} B")
    }
}

fn count(n: f64) -> String {
    if n >= 1e6 {
        format!("{:.2}M", n / 1e6)
    } else if n >= 1e3 {
        format!("{:.1}k", n / 1e3)
    } else {
        format!("{n:.0}")
    }
}

fn duration(secs: f64) -> String {
    let s = secs.round() as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bar_shows_files_bytes_rate_and_time_left() {
        let b = Backlog {
            done: 12,
            total: 30,
            bytes_done: 1 << 30,
            bytes_total: 4 << 30,
        };
        let line = render(b, 90_000, Duration::from_secs(2), Some((256 << 20) as f64));
        assert_eq!(line, "12/30 files  1.0 GiB/4.0 GiB  45.0k rows/s  ETA 12s");
    }

    #[test]
    fn the_bar_is_drawn_in_place_with_its_message() {
        let term = indicatif::InMemoryTerm::new(4, 120);
        let mut bar = Bar::with_target(ProgressDrawTarget::term_like(Box::new(term.clone())));
        let p = BatchProgress {
            input_rows: 1000,
            ..Default::default()
        };
        for done in [1u64, 3] {
            bar.update(
                &p,
                Backlog {
                    done,
                    total: 4,
                    bytes_done: done << 20,
                    bytes_total: 4 << 20,
                },
            );
            bar.bar.tick();
        }
        let shown = term.contents();
        assert_eq!(shown.lines().count(), 1, "{shown}");
        assert!(
            shown.starts_with("[##################......] 3/4 files  3.0 MiB/4.0 MiB  "),
            "{shown}"
        );
        assert!(shown.trim_end().ends_with('s'), "{shown}");
        bar.finish();
    }

    #[test]
    fn a_finished_or_unmeasured_run_says_so() {
        let done = Backlog {
            done: 3,
            total: 3,
            bytes_done: 300,
            bytes_total: 300,
        };
        assert!(render(done, 10, Duration::from_secs(1), None).ends_with("done"));
        let early = Backlog {
            done: 1,
            total: 3,
            bytes_done: 100,
            bytes_total: 300,
        };
        let line = render(early, 10, Duration::from_secs(1), None);
        assert!(line.ends_with("ETA -"), "{line}");
        assert!(line.starts_with("1/3 files"), "{line}");
        assert_eq!(position(early), (100, 300));
        let unsized_files = Backlog {
            done: 1,
            total: 4,
            bytes_done: 0,
            bytes_total: 0,
        };
        assert_eq!(position(unsized_files), (1, 4));
    }
}
