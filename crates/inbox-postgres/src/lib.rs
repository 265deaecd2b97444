//! # inbox-postgres
//!
//! The PostgreSQL adapter of the inbox, on `sea-orm`. It will hold the
//! migration that creates the inbox table and its indexes, the store that
//! implements [`inbox_core::InboxStore`] over one `DatabaseTransaction` per
//! message (the handler writes its business rows through that same
//! transaction), and the mapping of database errors to
//! [`inbox_core::StoreError`].
//!
//! ```
//! // The adapter is not built yet; the core it will plug into is:
//! use inbox_core::InboxStore as _;
//! ```
