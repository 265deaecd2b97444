//! What an operator sees: the [`metrics`] the drivers report and, with
//! the `otel` feature, traces across services (`otel`).

pub mod metrics;
#[cfg(feature = "otel")]
pub mod otel;
