//! # inbox-kafka
//!
//! The Kafka adapter of the inbox, on `rskafka`. It will hold a consumer
//! implementing [`inbox_core::Consumer`] that fetches each partition in
//! order with a bounded prefetch, decodes records into
//! [`inbox_core::Message`], dead-letters poison records, and stores each
//! partition's next offset in PostgreSQL in the same transaction as the
//! inbox row, with epoch fencing.
//!
//! ```
//! // The adapter is not built yet; the core it will plug into is:
//! use inbox_core::Consumer as _;
//! ```
