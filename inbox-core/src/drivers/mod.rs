//! The inbox's drivers: the async loops that carry the rules' plans out
//! against a store and a consumer.
//!
//! - [`runner`]: consumes messages and gives each the
//!   [`decision`](mod@crate::decision) module's verdict, one at a time, in
//!   batches or in key lanes.
//! - [`processor`]: drains the rows a runner landed `pending`.
//! - [`maintenance`]: releases stale leases and deletes what has served.
//! - [`dead_letters`]: lists, replays and discards what was given up.
//!
//! One handler run (`handler_run`) is shared by the runner, the processor
//! and the dead-letter replay, so they cannot drift apart.

pub mod dead_letters;
mod handler_run;
pub mod maintenance;
pub mod processor;
pub mod runner;
