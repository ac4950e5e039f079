-- Backfill: months of gzip'd JSON-lines events under an S3 prefix laid out
-- by day (raw/events/date=2026-01-01/part-0000.json.gz, ...) into a Delta
-- table on S3, partitioned by day. Safe to kill and re-run: it resumes where
-- it stopped, and every event lands exactly once.
--
--   lakestream run examples/s3_backfill.sql \
--     --checkpoint s3://my-bucket/checkpoints/events-backfill/ --trigger available-now
--
-- Credentials: the standard AWS environment (AWS_ACCESS_KEY_ID and
-- AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, web identity, or the instance
-- role) and AWS_REGION. For an S3-compatible server, add for example:
--   SET aws.endpoint = 'http://127.0.0.1:9000';
--   SET aws.allow_http = 'true';
-- On a terminal the run shows a progress bar; then compact while it runs or
-- after: lakestream table optimize s3://my-bucket/tables/events/

CREATE UNBOUNDED EXTERNAL TABLE raw_events (
  event_id VARCHAR NOT NULL, user_id BIGINT, event_type VARCHAR, amount DOUBLE, ts TIMESTAMP
) STORED AS JSON LOCATION 's3://my-bucket/raw/events/'
PARTITIONED BY (date)
OPTIONS ('path_glob' 'date=*/*.json.gz', 'max_bytes_per_trigger' '512MB');

CREATE EXTERNAL TABLE events STORED AS DELTA LOCATION 's3://my-bucket/tables/events/'
PARTITIONED BY (day)
OPTIONS ('auto_compact_every' '50');

INSERT INTO events
SELECT event_id, user_id, event_type, amount, ts, CAST(date AS DATE) AS day
FROM raw_events
WHERE amount > 0;
