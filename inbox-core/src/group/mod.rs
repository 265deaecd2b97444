//! Group coordination kept in the store: where a consumer keeps its
//! [`offsets`] and partition claims, and the pure, sticky partition
//! [`assignment`] over a group's live members.

pub mod assignment;
pub mod offsets;
