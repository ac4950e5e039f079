-- Ingest a Kafka topic into a Delta table, exactly once.
--
-- Offsets live in the checkpoint (never in consumer-group commits): kill -9
-- at any moment and restart, and every record is in the table once.
--
--   lakestream run examples/kafka_to_delta.sql --checkpoint target/orders/_checkpoint
--
-- Needs a broker on 127.0.0.1:9092 with a topic `orders` holding JSON values
-- like {"order_id": "o-1", "customer_id": 7, "amount": 12.5, "ts": "2026-02-01T10:00:00Z"}.

CREATE UNBOUNDED EXTERNAL TABLE orders (
  order_id VARCHAR NOT NULL, customer_id BIGINT, amount DOUBLE, ts TIMESTAMP
) STORED AS KAFKA LOCATION 'kafka://127.0.0.1:9092/orders'
OPTIONS ('format' 'json', 'starting_offsets' 'earliest', 'max_offsets_per_trigger' '100000');

CREATE EXTERNAL TABLE orders_table STORED AS DELTA LOCATION 'target/orders/orders'
PARTITIONED BY (day);

INSERT INTO orders_table
SELECT order_id, customer_id, amount, ts, CAST(ts AS DATE) AS day,
       _partition AS kafka_partition, _offset AS kafka_offset
FROM orders
WHERE amount > 0;
