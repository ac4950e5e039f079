//! `lakestream chaos`: prove exactly-once for one job on this machine.
//!
//! Runs the job to the end of its input into a scratch table as the
//! control, then again into a second scratch table while killing it with
//! SIGKILL at random moments (seeded) and restarting it, then compares the
//! two tables as row multisets (SQL `EXCEPT ALL` both ways) and runs
//! `verify` on the killed run's checkpoint. The job's own table and
//! checkpoint are never touched: both runs write below the scratch
//! directory (`run --output-location`). A job whose rows depend on the
//! wall clock (`now()` in a projection) or on chance (`random()`) differs
//! between any two runs and is reported as such.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use datafusion::prelude::SessionContext;
use lakestream::storage::Location;

/// At most this many restarts beyond the kills asked for.
const EXTRA_ATTEMPTS: usize = 20;

/// A small seeded generator (splitmix64): the same seed, the same delays.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[lo, hi]`.
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

/// What to run and how.
pub(crate) struct Chaos {
    /// The job file.
    pub(crate) job: PathBuf,
    /// Kills to aim for.
    pub(crate) kills: usize,
    /// Seed of the kill delays.
    pub(crate) seed: u64,
    /// Where the two runs write.
    pub(crate) scratch: PathBuf,
    /// Keep the scratch directory after a pass.
    pub(crate) keep: bool,
    /// Storage options for every location (passed to the runs).
    pub(crate) storage: Vec<(String, String)>,
}

impl Chaos {
    /// `lakestream run` of the job into `dir/table`, checkpointed at
    /// `dir/_checkpoint`, to the end of its input.
    fn command(&self, dir: &Path) -> anyhow::Result<Command> {
        let exe = std::env::current_exe().context("cannot find the lakestream binary")?;
        let mut c = Command::new(exe);
        c.arg("run")
            .arg(&self.job)
            .arg("--checkpoint")
            .arg(dir.join("_checkpoint"))
            .arg("--output-location")
            .arg(dir.join("table"))
            .args(["--trigger", "available-now"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .env_remove("LAKESTREAM_FAIL_POINT");
        for (k, v) in &self.storage {
            c.arg("--storage-option").arg(format!("{k}={v}"));
        }
        Ok(c)
    }

    /// Run it all; prints the verdict and returns whether it passed.
    pub(crate) async fn run(&self) -> anyhow::Result<bool> {
        let control = self.scratch.join("control");
        let killed = self.scratch.join("killed");
        for d in [&control, &killed] {
            if d.exists() {
                bail!(
                    "{} exists: give an empty --scratch directory (chaos never writes over a \
                     table)",
                    d.display()
                );
            }
            std::fs::create_dir_all(d).with_context(|| format!("cannot create {}", d.display()))?;
        }
        println!(
            "chaos: {} with {} kills, seed {}, scratch {}",
            self.job.display(),
            self.kills,
            self.seed,
            self.scratch.display()
        );

        // The control: one run without faults.
        let t0 = Instant::now();
        let out = self.command(&control)?.output()?;
        let control_time = t0.elapsed();
        if !out.status.success() {
            bail!(
                "the control run (no kills) failed, so there is nothing to compare with:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        println!("control run: {} ms", control_time.as_millis());

        // The same job, killed at random moments and restarted.
        let mut rng = Rng(self.seed);
        // Within the first half of a full run's time: a restart that has
        // less left to do must still be killed mid-way, not finish first.
        let longest = (control_time.as_millis() as u64 / 2).max(50);
        let mut landed = 0;
        let deadline = Instant::now() + control_time * 20 + Duration::from_secs(300);
        let mut finished = false;
        for attempt in 0..self.kills + EXTRA_ATTEMPTS {
            if Instant::now() > deadline {
                bail!("the killed run did not finish in time (attempt {attempt})");
            }
            let mut child = self.command(&killed)?.spawn()?;
            if landed < self.kills {
                let delay = Duration::from_millis(rng.between(5, longest));
                let start = Instant::now();
                while start.elapsed() < delay && child.try_wait()?.is_none() {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                if child.try_wait()?.is_none() {
                    child.kill()?; // SIGKILL
                    child.wait()?;
                    landed += 1;
                    println!(
                        "kill {landed}/{}: SIGKILL after {} ms",
                        self.kills,
                        delay.as_millis()
                    );
                    continue;
                }
            }
            let out = child.wait_with_output()?;
            if !out.status.success() {
                println!(
                    "chaos: FAIL: a restart after {landed} kills failed ({}):\n{}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                );
                self.rerun_hint();
                return Ok(false);
            }
            finished = true;
            break;
        }
        if !finished {
            bail!("the killed run never finished");
        }
        if landed < self.kills {
            println!(
                "{landed} of {} kills landed: the restarts finished the input before the next \
                 delay ran out",
                self.kills
            );
        }

        // The two runs' tables (each output's), as row multisets.
        let mut diff = None;
        let tables = self.tables().await?;
        for rel in &tables {
            let name = (tables.len() > 1).then(|| rel.file_name().unwrap_or_default());
            if let Some(d) = compare(&control.join(rel), &killed.join(rel)).await? {
                diff = Some(match name {
                    Some(n) => format!("{}: {d}", n.to_string_lossy()),
                    None => d,
                });
                break;
            }
        }
        let verified = crate::audit::verify(
            &killed.join("_checkpoint").display().to_string(),
            None,
            false,
            false,
            &self.storage.iter().cloned().collect::<HashMap<_, _>>(),
        )
        .await?;
        let passed = diff.is_none() && verified;
        match (&diff, verified) {
            (None, true) => println!(
                "chaos: PASS: {landed} kills, the table equals the control's and verify is clean"
            ),
            (Some(d), _) => println!("chaos: FAIL: {d}"),
            (None, false) => {
                println!("chaos: FAIL: the tables are equal but verify found problems (above)")
            }
        }
        if passed && !self.keep {
            let _ = std::fs::remove_dir_all(&control);
            let _ = std::fs::remove_dir_all(&killed);
        } else {
            println!(
                "the tables and checkpoints are kept under {}",
                self.scratch.display()
            );
        }
        if !passed {
            self.rerun_hint();
        }
        Ok(passed)
    }

    /// Where each output table of the job is below a run's directory:
    /// `table` for one output, `table/<name>` for each of several (as
    /// `run --output-location` places them).
    async fn tables(&self) -> anyhow::Result<Vec<PathBuf>> {
        let text = std::fs::read_to_string(&self.job)
            .with_context(|| format!("cannot read {}", self.job.display()))?;
        let job = lakestream::job::parse_job(&self.job.display().to_string(), &text).await?;
        Ok(if job.inserts.len() == 1 {
            vec![PathBuf::from("table")]
        } else {
            job.inserts
                .iter()
                .map(|i| {
                    let name = job
                        .table(&i.target)
                        .map(|t| t.name.clone())
                        .unwrap_or_else(|| i.target.clone());
                    Path::new("table").join(name)
                })
                .collect()
        })
    }

    fn rerun_hint(&self) {
        println!(
            "reproduce with: lakestream chaos {} --kills {} --seed {}",
            self.job.display(),
            self.kills,
            self.seed
        );
    }
}

/// `None` when the Delta tables at `a` (the control) and `b` hold the same
/// rows the same number of times; else what differs.
async fn compare(a: &Path, b: &Path) -> anyhow::Result<Option<String>> {
    let ctx = SessionContext::new();
    for (name, path) in [("control", a), ("killed", b)] {
        let loc = Location::parse(&path.display().to_string(), &HashMap::new())?;
        let table = lakestream::delta::load_table(&loc)
            .await
            .with_context(|| format!("cannot open the table at {}", path.display()))?
            .with_context(|| format!("no table at {}: the job wrote nothing", path.display()))?;
        table.update_datafusion_session(&ctx.state())?;
        ctx.register_table(name, table.table_provider().await?)?;
    }
    let count = |sql: &str| {
        let ctx = ctx.clone();
        let sql = sql.to_string();
        async move {
            let batches = ctx.sql(&sql).await?.collect().await?;
            let n = batches
                .first()
                .and_then(|b| {
                    b.column(0)
                        .as_any()
                        .downcast_ref::<arrow::array::Int64Array>()
                        .map(|a| a.value(0))
                })
                .unwrap_or(0);
            Ok::<i64, anyhow::Error>(n)
        }
    };
    let rows_a = count("SELECT count(*) FROM control").await?;
    let rows_b = count("SELECT count(*) FROM killed").await?;
    let missing =
        count("SELECT count(*) FROM (SELECT * FROM control EXCEPT ALL SELECT * FROM killed)")
            .await?;
    let extra =
        count("SELECT count(*) FROM (SELECT * FROM killed EXCEPT ALL SELECT * FROM control)")
            .await?;
    println!(
        "control table {}: {rows_a} rows; killed run's: {rows_b} rows",
        a.file_name().unwrap_or_default().to_string_lossy()
    );
    if missing == 0 && extra == 0 && rows_a == rows_b {
        return Ok(None);
    }
    Ok(Some(format!(
        "the tables differ: {missing} rows of the control are missing from the killed run's \
         table and {extra} are in it that the control does not have (lost or duplicated rows, \
         or a job whose output depends on the clock or on chance)"
    )))
}
