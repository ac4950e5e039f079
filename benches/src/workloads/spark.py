"""Spark Structured Streaming on the backfill input, for `lakestream-bench --spark-python`.

Runs the backfill (filter, project, day column, Parquet partitioned by day)
and the windowed aggregation (1-minute tumbling window x event type, count
and sum, 1-minute watermark, append mode; with 2 shuffle partitions, then
again with Spark's default 200) over the JSON events the bench generated,
each as an available-now streaming query on local[2], and
prints one JSON line per workload: wall seconds of the query (session
start excluded, reported apart), CPU seconds and peak RSS of the Spark
JVM, rows read, rows written. Spark writes its own Parquet file sink:
Delta's Spark connector is a separate download.

Usage: python spark.py BENCH_DIR
"""

import json
import os
import sys
import time

from pyspark.sql import SparkSession
from pyspark.sql import functions as F


def jvm_cpu(pid):
    """CPU seconds the JVM has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def jvm_peak_rss(pid):
    """The JVM's peak resident memory, bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def emit(**figures):
    print(json.dumps(figures), flush=True)


def main():
    bench_dir = sys.argv[1]
    t0 = time.monotonic()
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("lakestream-bench")
        # Two cores: Spark's default of 200 shuffle partitions would make
        # the aggregation pay for 200 tasks a batch.
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", "2g")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    emit(workload="start", wall=time.monotonic() - t0)
    pid = spark.sparkContext._gateway.proc.pid
    schema = "event_id STRING, user_id BIGINT, event_type STRING, amount DOUBLE, ts TIMESTAMP"
    out = os.path.join(bench_dir, "spark")

    def backfill(events):
        return (
            events.where("amount > 0")
            .select("event_id", "user_id", "event_type", "amount", "ts",
                    F.col("ts").cast("date").alias("day"))
            .writeStream.format("parquet")
            .partitionBy("day")
            .outputMode("append")
        )

    def windowed(events):
        return (
            events.withWatermark("ts", "1 minute")
            .groupBy(F.window("ts", "1 minute"), "event_type")
            .agg(F.count("*").alias("n"), F.sum("amount").alias("total"))
            .select(F.col("window.start").alias("minute"), "event_type", "n", "total")
            .writeStream.format("parquet")
            .outputMode("append")
        )

    # The windowed query twice: with 2 shuffle partitions (tuned for two
    # cores) and with Spark's default of 200 (what a query gets untuned).
    for name, build, shuffle in [
        ("backfill", backfill, "2"),
        ("windowed", windowed, "2"),
        ("windowed_default", windowed, "200"),
    ]:
        spark.conf.set("spark.sql.shuffle.partitions", shuffle)
        events = spark.readStream.schema(schema).json(os.path.join(bench_dir, "events"))
        writer = build(events).option(
            "checkpointLocation", os.path.join(out, name, "_checkpoint")
        ).trigger(availableNow=True)
        cpu0 = jvm_cpu(pid)
        t = time.monotonic()
        query = writer.start(os.path.join(out, name, "table"))
        query.awaitTermination()
        wall = time.monotonic() - t
        cpu = jvm_cpu(pid) - cpu0
        progress = query.recentProgress
        # Rows the source handed on (after a filter Spark pushed into
        # its JSON parsing, so fewer than the file rows for the backfill).
        read = sum(p["numInputRows"] for p in progress)
        written = spark.read.parquet(os.path.join(out, name, "table")).count()
        emit(workload=name, wall=wall, cpu=cpu, batches=len(progress), rows_read=read,
             rows_written=written, peak_rss=jvm_peak_rss(pid))
    spark.stop()


if __name__ == "__main__":
    main()
