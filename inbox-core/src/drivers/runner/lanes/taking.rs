//! Which record a lane takes next, over the partitions' flows.

use super::{Part, State};
use crate::model::Message;

impl State {
    /// The next record for `lane`: one without a position first, else the
    /// next of any partition's flow, round-robin. `own_partitions`: a lane
    /// holding records takes only more of their partitions (under
    /// [`Ordering::Partition`] a batch is one partition's, as a partition
    /// runner's was: a slow partition's batch holds no other partition's
    /// records, and the other lanes take those).
    pub(super) fn take(&mut self, lane: usize, own_partitions: bool) -> Option<Message> {
        if let Some(message) = self.loose.pop_front() {
            return Some(message);
        }
        // tokio's clock, as the runner's holds (paused in tests)
        let now = tokio::time::Instant::now().into_std();
        let n = self.parts.len();
        let start = self.cursor % n.max(1);
        let parts = &mut self.parts;
        let holding = own_partitions && parts.values().any(|p| p.flow.lane_holds(lane));
        let pick = |i: usize, part: &mut Part| {
            if holding && !part.flow.lane_holds(lane) {
                return None;
            }
            part.take(lane, now).map(|message| (i, message))
        };
        let found = parts
            .values_mut()
            .enumerate()
            .skip(start)
            .find_map(|(i, part)| pick(i, part))
            .or_else(|| {
                parts
                    .values_mut()
                    .enumerate()
                    .take(start)
                    .find_map(|(i, part)| pick(i, part))
            });
        let (i, message) = found?;
        self.cursor = i + 1;
        Some(message)
    }
}
