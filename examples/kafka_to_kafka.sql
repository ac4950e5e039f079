-- Kafka to Kafka, exactly once: large orders republished keyed by order id,
-- and running totals per customer as a changelog keyed by customer.
--
-- Each batch is produced in one Kafka transaction per output, which also
-- commits the batch id; kill -9 at any moment and restart, and consumers
-- reading with isolation.level=read_committed see every row once.
--
--   lakestream run examples/kafka_to_kafka.sql --checkpoint target/kafka_to_kafka/_checkpoint
--
-- Needs a broker on 127.0.0.1:9092 with the topics `orders` (JSON values
-- like {"order_id": "o-1", "customer_id": 7, "amount": 12.5, "ts": "2026-02-01T10:00:00Z"}),
-- `large_orders` and `customer_totals` (compacted, ideally).

CREATE UNBOUNDED EXTERNAL TABLE orders (
  order_id VARCHAR NOT NULL, customer_id BIGINT, amount DOUBLE, ts TIMESTAMP
) STORED AS KAFKA LOCATION 'kafka://127.0.0.1:9092/orders'
OPTIONS ('format' 'json', 'starting_offsets' 'earliest', 'max_offsets_per_trigger' '100000');

CREATE EXTERNAL TABLE large_orders STORED AS KAFKA
LOCATION 'kafka://127.0.0.1:9092/large_orders'
OPTIONS ('format' 'json', 'kafka.compression.type' 'zstd');

CREATE EXTERNAL TABLE customer_totals STORED AS KAFKA
LOCATION 'kafka://127.0.0.1:9092/customer_totals'
OPTIONS ('format' 'json', 'output_mode' 'update');

-- The reserved columns _key, _timestamp and _headers set the record's key,
-- timestamp and headers; the other columns are its JSON value.
INSERT INTO large_orders
SELECT order_id AS _key, ts AS _timestamp,
       map(['source_partition'], [CAST(_partition AS VARCHAR)]) AS _headers,
       order_id, customer_id, amount
FROM orders
WHERE amount >= 25;

-- Update mode: each batch writes the customers whose totals changed; the
-- newest record per key is the customer's total.
INSERT INTO customer_totals
SELECT CAST(customer_id AS VARCHAR) AS _key, customer_id,
       count(*) AS orders, sum(amount) AS total
FROM orders
GROUP BY customer_id;
