//! The contract's scenarios on the real servers: the same generic functions
//! of `inbox_testkit::scenarios`, with the same asserted results, that run
//! on the in-memory broker, here with a `KafkaConsumer` reading Apache Kafka and
//! PostgreSQL keeping the inbox and the offsets. One test per scenario, from
//! the testkit's one list; every test has its own database; every scenario
//! makes its own topics. (The processor's scenarios need no broker: they
//! run in `inbox-postgres`.)

mod common;

use common::harness;

// fewer seeds than in memory: every seed produces to two topics and runs
// two consumers; the fault seeds restart consumers (each a new
// `KafkaConsumer` that claims the partitions again)
inbox_testkit::scenario_tests! {
    harness = harness().await,
    seeds = 0..8,
    fault_seeds = 0..8,
}
