//! The operational surface: `/metrics` during a run (parsed by Python's
//! strict OpenMetrics parser) and the status page (rendered by a real
//! headless Chromium, with a screenshot kept as an artifact).

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;

/// GET `path` from `addr`: status code and body.
fn get(addr: &str, path: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").unwrap();
    let code = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (code, body.to_string())
}

/// Send `request` as is to `addr`; the whole answer as text.
fn raw(addr: &str, request: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut resp = Vec::new();
    // The server may close while the rest of a refused request is unsent.
    let _ = s.read_to_end(&mut resp);
    String::from_utf8_lossy(&resp).into_owned()
}

/// Read `child`'s stderr until a line holds `http://ADDR/`; return ADDR.
/// The rest of stderr is drained in the background.
fn served_addr(child: &mut Child) -> String {
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        let Some(Ok(line)) = lines.next() else { break };
        if let Some(i) = line.find("http://") {
            let addr = line[i + 7..].split('/').next().unwrap().to_string();
            std::thread::spawn(move || lines.for_each(drop));
            return addr;
        }
    }
    panic!("the server never said where it listens");
}

/// Samples of OpenMetrics `text`, parsed by Python's prometheus_client.
fn parse_metrics(text: &str) -> Vec<serde_json::Value> {
    let mut child = Command::new(python())
        .arg(root().join("tests/py/parse_metrics.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(
        o.status.success(),
        "not valid OpenMetrics: {}\n{text}",
        crate::common::text(&o)
    );
    String::from_utf8(o.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn sample<'a>(
    samples: &'a [serde_json::Value],
    name: &str,
    label: (&str, &str),
) -> Option<&'a serde_json::Value> {
    samples
        .iter()
        .find(|s| s["name"] == name && s["labels"][label.0] == label.1)
}

#[test]
fn metrics_are_served_during_a_run_in_valid_openmetrics() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    write_events(&dir.join("in"), 0, 4, 20);
    std::fs::write(
        dir.join("job.sql"),
        events_job(&dir.join("in"), &dir.join("out"), 1),
    )
    .unwrap();
    // Continuous: the query keeps running (and serving) after the input.
    let mut child = bin()
        .current_dir(dir)
        .args([
            "run",
            "job.sql",
            "--checkpoint",
            "ckpt",
            "--metrics-addr",
            "127.0.0.1:0",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let addr = served_addr(&mut child);
    let deadline = Instant::now() + Duration::from_secs(60);
    let samples = loop {
        let (code, body) = get(&addr, "/metrics");
        assert_eq!(code, 200, "{body}");
        let samples = parse_metrics(&body);
        let done = samples
            .iter()
            .any(|s| s["name"] == "lakestream_batches_total" && s["value"] == 4.0);
        if done {
            break samples;
        }
        assert!(Instant::now() < deadline, "4 batches never showed:\n{body}");
        std::thread::sleep(Duration::from_millis(200));
    };
    let query = samples
        .iter()
        .find(|s| s["name"] == "lakestream_batches_total")
        .unwrap()["labels"]["query"]
        .as_str()
        .unwrap()
        .to_string();
    let q = ("query", query.as_str());
    let value = |name: &str, label: (&str, &str)| {
        sample(&samples, name, label).unwrap_or_else(|| panic!("no {name} {label:?}"))["value"]
            .as_f64()
            .unwrap()
    };
    assert_eq!(
        value("lakestream_input_rows_total", ("source", "events")),
        80.0
    );
    assert_eq!(value("lakestream_output_rows_total", q), 64.0);
    assert_eq!(value("lakestream_last_committed_batch", q), 3.0);
    assert_eq!(value("lakestream_table_version", q), 4.0);
    assert_eq!(
        value("lakestream_file_backlog_files", ("source", "events")),
        0.0
    );
    assert_eq!(value("lakestream_batch_duration_seconds_count", q), 4.0);
    for phase in ["plan", "write_ahead", "execute", "commit"] {
        assert_eq!(
            value(
                "lakestream_batch_phase_duration_seconds_count",
                ("phase", phase)
            ),
            4.0
        );
    }
    let family = samples
        .iter()
        .find(|s| s["name"] == "lakestream_batch_duration_seconds_count")
        .unwrap();
    assert_eq!(family["type"], "histogram");
    // The status page and its data are served on the same address; the
    // history grows as batches are kept (read once each, then cached).
    let history = loop {
        let (code, body) = get(&addr, "/api/status");
        assert_eq!(code, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        let ids: Vec<u64> = v["history"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["batch_id"].as_u64().unwrap())
            .collect();
        if ids.len() == 4 {
            break ids;
        }
        assert!(
            Instant::now() < deadline,
            "history never had 4 batches: {v}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(history, [0, 1, 2, 3]);
    let (code, page) = get(&addr, "/");
    assert_eq!(code, 200);
    assert!(page.contains(&query), "the page names the query");
    let (code, _) = get(&addr, "/nope");
    assert_eq!(code, 404);
    // Other methods and oversized requests get the status that says so.
    let head = raw(
        &addr,
        &format!("POST /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"),
    );
    assert!(
        head.starts_with("HTTP/1.1 405 Method Not Allowed"),
        "{head}"
    );
    assert!(
        head.to_ascii_lowercase().contains("allow: get, head"),
        "{head}"
    );
    let big = "x".repeat(20 * 1024);
    let head = raw(
        &addr,
        &format!("GET / HTTP/1.1\r\nHost: {addr}\r\nX-Big: {big}\r\n\r\n"),
    );
    assert!(
        head.starts_with("HTTP/1.1 431 Request Header Fields Too Large"),
        "{head}"
    );
    let head = raw(
        &addr,
        &format!("HEAD /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"),
    );
    assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
    assert!(
        head.ends_with("\r\n\r\n"),
        "a HEAD answer has no body: {head}"
    );

    // SIGTERM: the run ends cleanly.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let st = child.wait().unwrap();
    assert!(st.success(), "{st:?}");
}

/// Debian's Chromium, which scripts/test.sh installs.
fn chromium() -> PathBuf {
    let p =
        PathBuf::from(std::env::var("LAKESTREAM_CHROMIUM").unwrap_or("/usr/bin/chromium".into()));
    assert!(
        p.exists(),
        "no Chromium at {}: run ./scripts/test.sh (it installs Debian's chromium) or set \
         LAKESTREAM_CHROMIUM",
        p.display()
    );
    p
}

/// Run headless Chromium on `url` with `args` (a fresh profile under
/// `dir`, no background network): its stdout.
fn headless(dir: &Path, url: &str, args: &[&str]) -> String {
    let o = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--window-size=1280,1400",
            // Let the page's script run before the DOM is dumped.
            "--virtual-time-budget=3000",
        ])
        .arg(format!(
            "--user-data-dir={}",
            dir.join("chromium-profile").display()
        ))
        .args(args)
        .arg(url)
        .output()
        .unwrap();
    assert!(o.status.success(), "chromium failed: {}", text(&o));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// `data-points` of the plot `id` in the rendered `dom`.
fn plotted_points(dom: &str, id: &str) -> usize {
    let at = dom
        .find(&format!("id=\"plot-{id}\""))
        .unwrap_or_else(|| panic!("no plot {id} in the page"));
    let tag = &dom[dom[..at].rfind('<').unwrap()..at + dom[at..].find('>').unwrap()];
    let v = tag.split("data-points=\"").nth(1).unwrap();
    v[..v.find('"').unwrap()].parse().unwrap()
}

#[test]
fn the_status_page_plots_a_real_checkpoint_in_a_real_browser() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // A windowed job, so that every plot has data: rates, phases, file
    // backlog, watermark delay and state.
    write_timed_events(&dir.join("in"), 8, 30);
    std::fs::write(
        dir.join("job.sql"),
        windowed_job(
            &dir.join("in").display().to_string(),
            &dir.join("out").display().to_string(),
            "append",
        ),
    )
    .unwrap();
    let o = run_available_now(dir, "job.sql", "ckpt", &[], &["--progress-json"]);
    assert!(o.status.success(), "{}", text(&o));
    // A stateful batch's progress in Spark's shape: its state operator and
    // event times.
    let last: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&o.stdout).lines().last().unwrap()).unwrap();
    let op = &last["stateOperators"][0];
    assert_eq!(op["operatorName"], "aggregate", "{last}");
    assert!(op["numRowsTotal"].as_u64().unwrap() > 0, "{last}");
    assert!(op["memoryUsedBytes"].as_u64().unwrap() > 0, "{last}");
    assert!(
        last["eventTime"]["watermark"]
            .as_str()
            .unwrap()
            .starts_with("2026-01-01T"),
        "{last}"
    );
    assert!(
        last["eventTime"]["max"]
            .as_str()
            .unwrap()
            .starts_with("2026-01-01T"),
        "{last}"
    );
    let batches = std::fs::read_dir(dir.join("ckpt/progress"))
        .unwrap()
        .count();
    assert!(batches >= 8, "{batches} batches kept progress");

    let mut ui = bin()
        .current_dir(dir)
        .args(["ui", "--checkpoint", "ckpt", "--addr", "127.0.0.1:0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let addr = served_addr(&mut ui);
    let url = format!("http://{addr}/");
    let dom = headless(dir, &url, &["--dump-dom"]);
    assert!(
        dom.contains(&format!("data-rendered=\"{batches}\"")),
        "the page's script rendered {batches} batches:\n{dom}"
    );
    // Every batch is a point of every plot, but the watermark's: the first
    // batch runs before any event time is seen.
    for (plot, least) in [
        ("rows", batches),
        ("phases", batches),
        ("backlog", batches),
        ("watermark", batches - 1),
        ("state", batches),
    ] {
        let n = plotted_points(&dom, plot);
        assert!(
            n >= least,
            "plot {plot} has {n} points for {batches} batches"
        );
    }
    assert!(dom.matches("class=\"batch\"").count() >= batches.min(20));
    assert!(dom.contains("class=\"series\""), "lines were drawn");

    // The screenshot, kept for people to look at.
    let artifacts = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"))
        .join("test-artifacts");
    std::fs::create_dir_all(&artifacts).unwrap();
    let shot = artifacts.join("status-page.png");
    let _ = std::fs::remove_file(&shot);
    headless(dir, &url, &[&format!("--screenshot={}", shot.display())]);
    let png = std::fs::read(&shot).unwrap();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 20_000,
        "{} bytes",
        png.len()
    );
    eprintln!("screenshot: {}", shot.display());

    let _ = ui.kill();
    let _ = ui.wait();
}

/// The quickstart job and its data, copied into `dir`.
fn quickstart_in(dir: &Path) {
    let st = Command::new("cp")
        .arg("-a")
        .arg(root().join("examples"))
        .arg(dir)
        .status()
        .unwrap();
    assert!(st.success());
}

#[test]
fn chaos_passes_the_quickstart_job_under_sigkills() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    quickstart_in(dir);
    let o = run_in(
        dir,
        &[
            "chaos",
            "examples/quickstart.sql",
            "--kills",
            "4",
            "--seed",
            "11",
            "--scratch",
            "scratch",
        ],
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", text(&o));
    assert!(out.contains("chaos: PASS"), "{out}");
    assert!(out.contains("kill 1/4"), "at least one kill landed: {out}");
    assert!(out.contains("clean: 3 batches"), "verify ran: {out}");
    // The job's own table was never written, and a pass leaves no scratch.
    assert!(!dir.join("target/quickstart").exists());
    assert!(!dir.join("scratch/killed").exists());
}

#[test]
fn chaos_fails_a_job_whose_two_runs_differ_and_prints_the_seed() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    quickstart_in(dir);
    // random(): no two runs write the same rows, which chaos must notice.
    let job = std::fs::read_to_string(dir.join("examples/quickstart.sql"))
        .unwrap()
        .replace("e.amount, e.ts", "random() AS amount, e.ts");
    assert!(job.contains("random()"));
    std::fs::write(dir.join("random.sql"), job).unwrap();
    let o = run_in(
        dir,
        &[
            "chaos",
            "random.sql",
            "--kills",
            "1",
            "--seed",
            "5",
            "--scratch",
            "scratch",
        ],
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(out.contains("chaos: FAIL: the tables differ"), "{out}");
    assert!(
        out.contains("reproduce with: lakestream chaos random.sql --kills 1 --seed 5"),
        "{out}"
    );
    assert!(
        dir.join("scratch/killed/table/_delta_log").exists(),
        "kept for a look"
    );
}
