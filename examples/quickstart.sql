-- Quickstart: clean JSON events, enrich them with a static users table and
-- append them to a Delta table partitioned by day, exactly once.
--
--   lakestream run examples/quickstart.sql \
--     --checkpoint target/quickstart/_checkpoint --trigger available-now

CREATE UNBOUNDED EXTERNAL TABLE events (
  event_id VARCHAR NOT NULL, user_id BIGINT, event_type VARCHAR, amount DOUBLE, ts TIMESTAMP
) STORED AS JSON LOCATION 'examples/data/events/'
OPTIONS ('max_files_per_trigger' '2');

CREATE EXTERNAL TABLE users STORED AS PARQUET LOCATION 'examples/data/users.parquet';

CREATE EXTERNAL TABLE clean_events STORED AS DELTA LOCATION 'target/quickstart/clean_events'
PARTITIONED BY (day);

INSERT INTO clean_events
SELECT e.event_id, e.user_id, u.country, e.event_type, e.amount, e.ts, CAST(e.ts AS DATE) AS day
FROM events e LEFT JOIN users u ON e.user_id = u.user_id
WHERE e.amount > 0;
