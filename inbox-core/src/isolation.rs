//! How handlers sharing one transaction are kept from each other's
//! failures: the one setting of the batched runner
//! ([`BatchConfig::isolation`](crate::BatchConfig::isolation)) and of the
//! processor
//! ([`ProcessorConfig::isolation`](crate::drivers::processor::ProcessorConfig::isolation)).

/// How handlers sharing one transaction are isolated from each other's
/// failures. Either way each message gets exactly the outcome it would get
/// alone; the two differ only in what a failure costs.
///
/// ```
/// use inbox_core::{BatchConfig, Isolation};
/// let mut batch = BatchConfig::new(100);
/// assert_eq!(batch.isolation, Isolation::Optimistic);
/// batch.isolation = Isolation::Savepoints;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Isolation {
    /// No savepoint until a handler fails (the default for both, measured
    /// faster with no failures and level or faster with 3% failing):
    /// - batched runner: the batch is rolled back and the rest replayed,
    ///   again without savepoints: one more transaction per failure;
    /// - processor: the batch is rolled back and replayed with a
    ///   savepoint per row (the failed row's outcome kept, its handler not
    ///   run again), and the next batch starts with savepoints, going back
    ///   to none after a clean one.
    #[default]
    Optimistic,
    /// More savepoints, fewer replays:
    /// - batched runner: after a failure, the replay takes a savepoint
    ///   before each handler, so further failures cost no further replay
    ///   (a batch with several failures costs two transactions);
    /// - processor: a savepoint before every row's handler, always.
    Savepoints,
}
