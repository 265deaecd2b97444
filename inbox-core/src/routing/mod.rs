//! What the user writes and how a message reaches it: the [`handler`]
//! trait, the typed [`router`] from event types to handlers, and the
//! payload [`formats`] a route decodes.

pub mod closures;
pub mod formats;
pub mod handler;
pub mod router;
