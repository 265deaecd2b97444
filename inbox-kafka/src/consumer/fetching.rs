//! A consumer's partitions: fetches started and applied, rewinds, fencing, out-of-range starts, the offsets copied and stored.

#[allow(clippy::wildcard_imports)]
use super::*;

impl<O: OffsetStore> KafkaConsumer<O> {
    pub(super) fn next_to_deliver(&self, p: &Partition) -> i64 {
        p.buffer.front().map_or(p.next_fetch, |r| r.offset)
    }

    pub(super) fn index_of(&self, message: &Message) -> Option<usize> {
        let pos = message.position.as_ref()?;
        self.partitions
            .iter()
            .position(|p| p.topic == pos.topic && p.partition == pos.partition)
    }

    /// Starts fetching partition `index` from its next offset in a task of
    /// its own, unless a fetch is running already.
    pub(super) fn start_fetch(&mut self, index: usize) {
        let max_wait = i32::try_from(self.config.max_wait.as_millis()).unwrap_or(i32::MAX);
        let max_bytes = self.config.fetch_max_bytes;
        let timeout = self.config.fetch_timeout;
        let p = &mut self.partitions[index];
        if p.inflight.is_some() || p.fenced || p.stopped {
            return;
        }
        let client = p.client.clone();
        let offset = p.next_fetch;
        let done = self.fetched.clone();
        let (tx, result) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let fetched =
                tokio::time::timeout(timeout, client.fetch(offset, 1..max_bytes, max_wait)).await;
            // the result first: whoever is woken finds it
            let _ = tx.send(fetched);
            done.notify_one();
        });
        p.inflight = Some(Inflight {
            offset,
            task,
            result,
        });
    }

    /// The result of partition `index`'s fetch, when it has finished (and
    /// is not stale: fetched from the offset the partition reads next).
    pub(super) async fn take_finished(
        &mut self,
        index: usize,
    ) -> Option<Result<(), ConsumerError>> {
        use tokio::sync::oneshot::error::TryRecvError;
        let p = &mut self.partitions[index];
        let inflight = p.inflight.as_mut()?;
        let fetched = match inflight.result.try_recv() {
            Err(TryRecvError::Empty) => return None,
            Ok(fetched) => Ok(fetched),
            Err(TryRecvError::Closed) => Err(ConsumerError::Fetch(format!(
                "{}:{}: the fetch task ended without an answer",
                p.topic, p.partition
            ))),
        };
        let offset = inflight.offset;
        p.inflight = None;
        if offset != p.next_fetch {
            return None;
        }
        Some(match fetched {
            Ok(fetched) => self.apply(index, fetched).await,
            Err(e) => Err(e),
        })
    }

    /// Puts what a fetch of partition `index` gave into its buffer.
    pub(super) async fn apply(
        &mut self,
        index: usize,
        fetched: FetchResult,
    ) -> Result<(), ConsumerError> {
        let timeout = self.config.fetch_timeout;
        let p = &mut self.partitions[index];
        let Ok(fetched) = fetched else {
            return Err(ConsumerError::Fetch(format!(
                "{}:{}: no answer in {} ms",
                p.topic,
                p.partition,
                timeout.as_millis()
            )));
        };
        self.stats.fetches += 1;
        let Page {
            records,
            high_watermark,
            first_batch,
            examined_end,
        } = match fetched {
            Ok(page)
                if page.records.is_empty()
                    && p.next_fetch > page.high_watermark
                    && page.high_watermark >= 0 =>
            {
                let hw = page.high_watermark;
                // past the end of the log (some brokers answer so rather
                // than with an error), or a high watermark not caught up yet
                // (a new leader's): only the log's bounds tell
                return self.outside_the_log(index, Some(hw)).await;
            }
            Ok(fetched) => fetched,
            Err(FetchError::OutOfRange) => return self.outside_the_log(index, None).await,
            Err(e) => {
                return Err(ConsumerError::Fetch(format!(
                    "{}:{}: {e}",
                    p.topic, p.partition
                )));
            }
        };
        let p = &mut self.partitions[index];
        p.high_watermark = high_watermark;
        if high_watermark >= 0 {
            p.end_at_start.get_or_insert(high_watermark);
        }
        let mut expected = p.next_fetch;
        // a fetch that continues the previous one reads on; so does one
        // whose first batch holds the requested offset (the broker answered
        // from the right place; a hole there is a marker or a compacted
        // record). The first after a move (claim, rewind fetched again,
        // resync, reset) without that says nothing of the offsets between.
        let mut reading_on =
            p.read_on == Some(expected) || first_batch.is_some_and(|b| b <= expected);
        for record in records {
            if record.offset < expected {
                continue;
            }
            if record.offset > expected {
                let missing = record.offset - expected;
                if reading_on {
                    // offsets holding no record: transaction markers,
                    // compacted records. Normal.
                    skipped(&mut self.stats, &self.metrics, p, expected, record.offset);
                } else {
                    tracing::error!(
                        topic = %p.topic,
                        partition = p.partition,
                        requested = expected,
                        returned = record.offset,
                        "the first fetch from offset {expected} began {missing} offsets later: on a topic without compaction or transactions this is a broker fault"
                    );
                    self.stats.gaps += 1;
                    self.stats.missing += missing;
                    inbox_core::record_safely(
                        &self.metrics,
                        MetricEvent::OffsetGap {
                            topic: p.label,
                            partition: p.partition,
                            missing,
                        },
                    );
                }
            }
            reading_on = true;
            expected = record.offset + 1;
            p.buffered_bytes += record.record.approximate_size();
            p.buffer.push_back(record);
        }
        // past what the fetch examined and did not deliver (aborted
        // records, markers): without it a fetch of nothing but those is
        // asked again for ever, and a partition ending in a marker shows a
        // lag of 1 and answers at once instead of long-polling
        let mut past_markers = None;
        if reading_on
            && let Some(end) = examined_end
            && end > expected
        {
            skipped(&mut self.stats, &self.metrics, p, expected, end);
            past_markers = Some((expected, end));
            expected = end;
        }
        if reading_on {
            p.read_on = Some(expected);
        }
        self.stats.records += u64::try_from(p.buffer.len()).unwrap_or(0);
        self.stats.max_buffered_bytes = self.stats.max_buffered_bytes.max(p.buffered_bytes);
        p.next_fetch = expected;
        let next_offset = p.buffer.front().map_or(p.next_fetch, |r| r.offset);
        let lag = p.high_watermark - next_offset;
        // behind in time: the age of the oldest record not handled
        let behind = match p.buffer.front() {
            _ if lag <= 0 => Some(Duration::ZERO),
            Some(r) => Some(
                (chrono::Utc::now() - r.record.timestamp)
                    .to_std()
                    .unwrap_or_default(),
            ),
            None => None,
        };
        let high_watermark = p.high_watermark;
        self.config
            .health
            .update(self.reporter, &p.topic, p.partition, |h| {
                h.next_offset = next_offset;
                h.high_watermark = high_watermark;
                h.lag_records = lag.max(0);
                h.lag_seconds = behind.map(|b| b.as_secs_f64());
            });
        inbox_core::record_safely(
            &self.metrics,
            MetricEvent::Lag {
                topic: p.label,
                partition: p.partition,
                lag,
            },
        );
        if let Some(behind) = behind {
            inbox_core::record_safely(
                &self.metrics,
                MetricEvent::LagTime {
                    topic: p.label,
                    partition: p.partition,
                    behind,
                },
            );
        }
        if past_markers.is_some() {
            p.markers = past_markers;
            self.store_past_markers(index).await;
        }
        Ok(())
    }

    /// The store refused an acknowledgement of partition `index` because
    /// its stored offset moved: read it, and deliver from there (or stop
    /// reading the partition if another consumer owns it now).
    pub(super) async fn resync(&mut self, index: usize) -> Result<(), ConsumerError> {
        let (topic, partition, epoch) = {
            let p = &self.partitions[index];
            (p.topic.clone(), p.partition, p.epoch)
        };
        let now = self
            .store
            .read_partition(&self.group, &topic, partition)
            .await
            .map_err(|e| ConsumerError::Fetch(format!("{topic}:{partition}: {e}")))?;
        self.stats.offset_resyncs += 1;
        let p = &mut self.partitions[index];
        p.resync = false;
        match now {
            Some(claim) if claim.owner_epoch == epoch => {
                let from = claim.next_offset.unwrap_or(p.start);
                tracing::warn!(%topic, partition, stored = ?claim.next_offset, expected = ?p.stored, from,
                    "the stored offset is not where this consumer left it (the database lost commits, or a commit reported lost had applied): reading from the stored offset");
                p.forget();
                p.next_fetch = from;
                p.stored = claim.next_offset;
                inbox_core::record_safely(&self.metrics, MetricEvent::OffsetMoved { partition });
            }
            _ => self.fence(index),
        }
        Ok(())
    }

    /// Stops reading partition `index`: another consumer owns it now.
    pub(super) fn fence(&mut self, index: usize) {
        let p = &mut self.partitions[index];
        if !p.fenced {
            tracing::warn!(
                topic = %p.topic,
                partition = p.partition,
                epoch = p.epoch,
                "fenced: another consumer owns this partition now; it is no longer read here"
            );
            p.fenced = true;
            p.forget();
            self.config
                .health
                .update(self.reporter, &p.topic, p.partition, |h| h.owned = false);
            inbox_core::record_safely(
                &self.metrics,
                MetricEvent::Fenced {
                    partition: p.partition,
                },
            );
        }
    }

    /// A fetch of partition `index` looked out of range: the log's bounds
    /// (ListOffsets earliest and latest) decide. Inside them (a high
    /// watermark that has not caught up, right after a leader change, or a
    /// stale answer) it is an empty fetch, and the partition is fetched
    /// again from the same offset; outside, the [`OutOfRange`] policy.
    pub(super) async fn outside_the_log(
        &mut self,
        index: usize,
        high_watermark: Option<i64>,
    ) -> Result<(), ConsumerError> {
        let p = &self.partitions[index];
        let bounds = async {
            let earliest = p.client.offset_at(OffsetAt::Earliest).await?;
            let latest = p.client.offset_at(OffsetAt::Latest).await?;
            Ok::<_, FetchError>((earliest, latest))
        };
        let (earliest, latest) = bounds
            .await
            .map_err(|e| ConsumerError::Fetch(format!("{}:{}: {e}", p.topic, p.partition)))?;
        if (earliest..=latest).contains(&p.next_fetch) {
            tracing::debug!(topic = %p.topic, partition = p.partition, offset = p.next_fetch,
                ?high_watermark, earliest, latest,
                "the fetch looked out of range, but the offset is inside the log: fetching again");
            return Ok(());
        }
        self.out_of_range(index, high_watermark).await
    }

    /// The stored offset of partition `index` is outside the log: follow
    /// the configured [`OutOfRange`] policy, logged and counted.
    pub(super) async fn out_of_range(
        &mut self,
        index: usize,
        high_watermark: Option<i64>,
    ) -> Result<(), ConsumerError> {
        self.stats.out_of_range += 1;
        let policy = self.config.out_of_range;
        let p = &mut self.partitions[index];
        let from = p.next_fetch;
        inbox_core::record_safely(
            &self.metrics,
            MetricEvent::OffsetOutOfRange {
                partition: p.partition,
            },
        );
        let at = match policy {
            OutOfRange::Stop => {
                tracing::error!(topic = %p.topic, partition = p.partition, offset = from, ?high_watermark,
                    "the stored offset is outside the log; the partition is stopped (policy Stop)");
                p.stopped = true;
                p.forget();
                self.config
                    .health
                    .update(self.reporter, &p.topic, p.partition, |h| h.owned = false);
                return Ok(());
            }
            OutOfRange::Earliest => OffsetAt::Earliest,
            OutOfRange::Latest => OffsetAt::Latest,
        };
        let to = p
            .client
            .offset_at(at)
            .await
            .map_err(|e| ConsumerError::Fetch(format!("{}:{}: {e}", p.topic, p.partition)))?;
        tracing::warn!(topic = %p.topic, partition = p.partition, offset = from, to, ?policy,
            "the stored offset is outside the log; reading from {to}");
        p.forget();
        p.next_fetch = to;
        Ok(())
    }

    pub(super) fn pop(&mut self, index: usize) -> Option<Message> {
        let limit = usize::try_from(self.config.fetch_max_bytes).unwrap_or(usize::MAX);
        let p = &mut self.partitions[index];
        let record = p.buffer.pop_front()?;
        let size = record.record.approximate_size();
        p.buffered_bytes = p.buffered_bytes.saturating_sub(size);
        // Kept until acknowledged, so that a rewind is a step back in memory.
        p.delivered.push_back(record.clone());
        p.delivered_bytes += size;
        while (p.delivered_bytes > limit || p.delivered.len() > MAX_KEPT_RECORDS)
            && p.delivered.len() > 1
        {
            if let Some(old) = p.delivered.pop_front() {
                p.delivered_bytes = p
                    .delivered_bytes
                    .saturating_sub(old.record.approximate_size());
            }
        }
        let view = RecordView {
            topic: &p.topic,
            partition: p.partition,
            offset: record.offset,
            key: record.record.key.as_deref(),
            value: record.record.value.as_deref(),
            headers: &record.record.headers,
            timestamp: Some(record.record.timestamp),
        };
        let mut message = decode_or_poison(self.config.decoder.as_ref(), &view);
        // Moved, not copied: kept so a message that fails validation later
        // is dead-lettered with the bytes that arrived.
        message.raw = Some(record.record.value.unwrap_or_default());
        Some(message)
    }

    /// When a copy to the group coordinator is due, starts one of the
    /// offsets PostgreSQL holds for the partitions whose epoch this
    /// consumer still holds there (a member fenced by a claim it has not
    /// seen yet, `inbox offsets move`'s or a rebalance's, copies nothing of
    /// those partitions). Nothing is held in the database while the copy
    /// waits on the broker, so a claim can come before the copy lands: the
    /// group's copies are checked (see `broker_group::copies`) and those a
    /// claim or a move overtook are copied again with what PostgreSQL holds
    /// then, so a late copy never leaves the coordinator ahead of it.
    pub(super) async fn copy_offsets(&mut self) {
        let Some(broker) = self.broker.as_mut() else {
            return;
        };
        if broker.busy() {
            return;
        }
        let to_check = broker.due_checks(&self.config.partitions);
        let again = if to_check.is_empty() {
            Vec::new()
        } else {
            let checked = tokio::time::timeout(
                crate::broker_group::COPY_DEADLINE,
                overtaken(&self.store, &self.group, &to_check),
            )
            .await;
            match checked {
                Ok(Ok(again)) => {
                    if let Some(broker) = self.broker.as_ref() {
                        broker.checked(&to_check);
                    }
                    again
                }
                Ok(Err(e)) => {
                    tracing::warn!(group = %self.group, error = %e, "checking the offsets copied to the group coordinator failed; checked again at the next interval");
                    Vec::new()
                }
                Err(_) => {
                    tracing::warn!(group = %self.group, "checking the offsets copied to the group coordinator took too long; checked again at the next interval");
                    Vec::new()
                }
            }
        };
        let owned: Vec<(String, i32, i64)> = self
            .partitions
            .iter()
            .filter(|p| !p.fenced && p.stored.is_some())
            .map(|p| (p.topic.clone(), p.partition, p.epoch))
            .collect();
        let live = || {
            self.partitions
                .iter()
                .filter(|p| !p.fenced)
                .filter_map(|p| p.stored.map(|o| (p.topic.clone(), p.partition, p.epoch, o)))
                .collect()
        };
        let Some(broker) = self.broker.as_mut() else {
            return;
        };
        let due = broker.due(live);
        if !due && again.is_empty() {
            return;
        }
        // one copy of the group (on these brokers) at a time in this
        // process: tried again at the next poll when another's copy runs
        // (what was overtaken is found again at the next check)
        let Some(turn) = broker.turn() else {
            return;
        };
        let offsets = if due {
            let read = tokio::time::timeout(
                crate::broker_group::COPY_DEADLINE,
                self.store.owned_offsets(&self.group, &owned),
            )
            .await;
            match read {
                Ok(Ok(offsets)) => with_epochs(offsets, &owned),
                Ok(Err(e)) => {
                    tracing::warn!(group = %self.group, error = %e, "reading the offsets to copy to the group coordinator failed; tried again at the next interval");
                    Vec::new()
                }
                Err(_) => {
                    tracing::warn!(group = %self.group, "reading the offsets to copy to the group coordinator took too long; tried again at the next interval");
                    Vec::new()
                }
            }
        } else {
            Vec::new()
        };
        let Some(broker) = self.broker.as_mut() else {
            return;
        };
        if offsets.is_empty() && again.is_empty() {
            broker.postpone();
            return;
        }
        broker.start(offsets, again, &self.metrics, turn);
    }

    /// Stores partition `index`'s offset at `end` when the offsets from
    /// `from` hold nothing to handle (markers, aborted records) and every
    /// record before them is acknowledged: so a partition whose log ends in
    /// a commit marker (every transactional topic at rest) shows lag 0 in
    /// PostgreSQL and, through the broker commits, to Kafka's tools, as the
    /// Java consumer's committed position does. Compare-and-set on the
    /// stored offset and the owner's epoch, as every acknowledgement: a
    /// fenced or moved partition writes nothing (tried again at the next
    /// such fetch).
    pub(super) async fn store_past_markers(&mut self, index: usize) {
        let p = &mut self.partitions[index];
        let Some((from, end)) = p.markers else {
            return;
        };
        if p.stored.is_some_and(|s| s >= end) || p.next_fetch < end {
            p.markers = None;
            return;
        }
        if !p.buffer.is_empty() || !p.delivered.is_empty() || p.stored != Some(from) {
            return;
        }
        let p = &self.partitions[index];
        let ack = TxAck {
            consumer_group: self.group.clone(),
            position: Position::new(p.topic.clone(), p.partition, end - 1),
            owner_epoch: p.epoch,
            expected_next: p.stored,
        };
        match self.store.store_ack(&ack).await {
            Ok(()) => {
                let p = &mut self.partitions[index];
                p.acknowledged(end - 1);
                p.markers = None;
            }
            Err(e) => {
                tracing::debug!(topic = %p.topic, partition = p.partition, error = %e, "the offset past the markers was not stored");
            }
        }
    }

    pub(super) fn tx_ack(&self, message: &Message) -> Option<TxAck> {
        let index = self.index_of(message)?;
        let p = &self.partitions[index];
        Some(TxAck {
            consumer_group: self.group.clone(),
            position: message.position.clone()?,
            owner_epoch: p.epoch,
            expected_next: p.stored,
        })
    }
}

/// Of the copies `checked` (topic, partition, the epoch it was copied
/// under, the offset), those a claim or a move overtook: the partition's
/// epoch moved since, or its stored offset is now below the copy's (a move
/// claims, then stores the lower offset under its own epoch). With what the
/// store holds for them now (topic, partition, epoch, next offset): to be
/// copied again, since the copy may have landed after the new owner's.
async fn overtaken<O: OffsetStore>(
    store: &O,
    group: &str,
    checked: &[crate::broker_group::Copied],
) -> Result<Vec<crate::broker_group::Copied>, inbox_core::StoreError> {
    let epochs: Vec<(String, i32, i64)> = checked
        .iter()
        .map(|(t, p, e, _)| (t.clone(), *p, *e))
        .collect();
    let held = store.owned_offsets(group, &epochs).await?;
    let mut again: Vec<crate::broker_group::Copied> = Vec::new();
    for (topic, partition, _, copied) in checked {
        let still = held
            .iter()
            .any(|(t, p, next)| (t, p) == (topic, partition) && next >= copied);
        if still || again.iter().any(|(t, p, ..)| (t, p) == (topic, partition)) {
            continue;
        }
        if let Some(inbox_core::PartitionClaim {
            next_offset: Some(next),
            owner_epoch,
        }) = store.read_partition(group, topic, *partition).await?
        {
            again.push((topic.clone(), *partition, owner_epoch, next));
        }
    }
    Ok(again)
}

/// `offsets` (topic, partition, next offset) with the epochs of `owned`
/// they were read under.
fn with_epochs(
    offsets: Vec<(String, i32, i64)>,
    owned: &[(String, i32, i64)],
) -> Vec<(String, i32, i64, i64)> {
    offsets
        .into_iter()
        .filter_map(|(t, p, o)| {
            let epoch = owned.iter().find(|(ot, op, _)| (ot, op) == (&t, &p))?.2;
            Some((t, p, epoch, o))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use inbox_core::{OffsetStore, Position, TxAck};
    use inbox_testkit::MemStore;

    use super::overtaken;

    async fn store_at(store: &MemStore, epoch: i64, expected: Option<i64>, next: i64) {
        store
            .store_ack(&TxAck {
                consumer_group: "billing".into(),
                position: Position::new("orders", 0, next - 1),
                owner_epoch: epoch,
                expected_next: expected,
            })
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }

    /// A copy is overtaken when its partition was claimed since, or when
    /// its offset is now above what the store holds under the same epoch
    /// (a move claims, then stores the lower offset: a member that read
    /// between the two copied the old offset under the move's epoch).
    #[tokio::test]
    async fn a_copy_is_overtaken_by_a_claim_or_a_lower_offset() {
        let store = MemStore::new();
        let first = store
            .claim_partition("billing", "orders", 0)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        store_at(&store, first.owner_epoch, None, 10).await;
        let copied = |epoch, offset| vec![("orders".to_owned(), 0, epoch, offset)];
        let check = |c: Vec<(String, i32, i64, i64)>| {
            let store = store.clone();
            async move {
                overtaken(&store, "billing", &c)
                    .await
                    .unwrap_or_else(|e| panic!("{e}"))
            }
        };
        assert!(check(copied(first.owner_epoch, 10)).await.is_empty());
        assert!(
            check(copied(first.owner_epoch, 7)).await.is_empty(),
            "a lower copy is behind, never ahead"
        );
        // the move claims: the old epoch's copy is overtaken
        let moved = store
            .claim_partition("billing", "orders", 0)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            check(copied(first.owner_epoch, 10)).await,
            copied(moved.owner_epoch, 10)
        );
        // a copy read between the claim and the lower offset's store
        store_at(&store, moved.owner_epoch, Some(10), 3).await;
        assert_eq!(
            check(copied(moved.owner_epoch, 10)).await,
            copied(moved.owner_epoch, 3)
        );
        assert!(check(copied(moved.owner_epoch, 3)).await.is_empty());
    }
}
