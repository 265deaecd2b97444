//! What the per-message driver carries from a decision to its result:
//! the decision and what running it gathered (shared by the per-message
//! path and the failure budget's).

use crate::decision::{self, Decision};
use crate::error::{InboxPersistError, PersistStage, StoreError, StoreErrorKind};
use crate::model::RowId;
use crate::outcome::Outcome;

use super::ProcessError;

/// A message's decision with what the driver gathered carrying it out.
pub(super) struct Work {
    pub(super) decision: Decision,
    pub(super) row_id: Option<RowId>,
    pub(super) outcome: Option<Outcome>,
    pub(super) error: Option<ProcessError>,
    /// The acknowledgement before the transaction succeeded.
    pub(super) acked_before: bool,
}

impl Work {
    pub(super) fn new(decision: Decision, row_id: Option<RowId>, outcome: Option<Outcome>) -> Self {
        Self {
            decision,
            row_id,
            outcome,
            error: None,
            acked_before: false,
        }
    }

    /// The decision for a storage failure at `stage`, keeping what ran;
    /// `acked_before`: the message was acknowledged before its transaction.
    pub(super) fn storage_failure(
        acked_before: bool,
        stage: PersistStage,
        source: StoreError,
        row_id: Option<RowId>,
        outcome: Option<Outcome>,
    ) -> Self {
        tracing::warn!(%stage, error = %source, "inbox storage failure");
        let ran = outcome.is_some();
        let decision = if source.kind == StoreErrorKind::Fenced {
            decision::on_fenced(ran)
        } else {
            decision::on_storage_failure(acked_before, ran)
        };
        let mut work = Self::new(decision, row_id, outcome);
        work.error = Some(ProcessError::Persist(InboxPersistError { stage, source }));
        work
    }
}
