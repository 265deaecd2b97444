//! The idempotent producer's state: the producer id and epoch
//! (InitProducerId), and per partition the sequences and the append in
//! doubt. Pure bookkeeping and the InitProducerId request; the publisher
//! carries it out.

use std::collections::HashMap;
use std::time::Duration;

use inbox_core::PartitionKey;
use rskafka::client::error::ProtocolError;
use rskafka::protocol::primitives::{Int16, Int32};

/// The idempotent producer's state (the Java client's, since Kafka 3.0 by
/// default): its id and epoch (InitProducerId), and per partition the
/// producer id its sequences belong to, the next record's sequence number
/// and the append in doubt, so that an append retried after a timeout or a
/// cut connection is sent again exactly as it was (same producer, records
/// and base sequence) and the broker writes it once.
///
/// A partition whose sequence the broker refuses starts over alone: it
/// takes a new producer id, while every other partition goes on with the
/// id its sequences (and its append in doubt) belong to, so a broker
/// restart that leaves many partitions in doubt writes none of them twice.
#[derive(Debug, Default)]
pub(super) struct Idempotence {
    /// The id a partition starting (or starting over) takes. `None`: to be
    /// asked for; `Some(None)`: the brokers gave none (the appends go
    /// without, as before: not idempotent).
    pub(super) producer: Option<Option<(i64, i16)>>,
    /// After a failed InitProducerId, not asked again before then (and
    /// why it failed, what the appends meanwhile fail with).
    pub(super) ask_after: Option<(std::time::Instant, String)>,
    pub(super) partitions: HashMap<PartitionKey, Sequenced>,
}

impl Idempotence {
    /// An append of `rows` to `key` begins: the producer id and epoch its
    /// sequences belong to (a partition met for the first time takes
    /// `current`, from 0), its first sequence (the append in doubt's again
    /// when these are its rows, the partition's next otherwise; now in
    /// doubt), and whether it is the append in doubt sent again. `None`:
    /// the partition has no sequences and there is no current id.
    pub(super) fn begin_append(
        &mut self,
        key: &PartitionKey,
        current: Option<(i64, i16)>,
        rows: &[i64],
    ) -> Option<((i64, i16), i32, bool)> {
        let seq = match (self.partitions.contains_key(key), current) {
            (true, _) => self.partitions.get_mut(key)?,
            (false, Some(producer)) => self.partitions.entry(key.clone()).or_insert(Sequenced {
                producer,
                next: 0,
                doubt: None,
                short_reads: 0,
            }),
            (false, None) => return None,
        };
        let (base, again) = match &seq.doubt {
            Some((base, ids)) if ids[..] == rows[..] => (*base, true),
            _ => (seq.next, false),
        };
        seq.doubt = Some((base, rows.to_vec()));
        Some((seq.producer, base, again))
    }

    /// Notes a read of `key` that held only the head of its append in
    /// doubt; how many in a row.
    pub(super) fn read_short(&mut self, key: &PartitionKey) -> u32 {
        self.partitions.get_mut(key).map_or(0, |seq| {
            seq.short_reads += 1;
            seq.short_reads
        })
    }

    /// `key`'s sequences start over: it forgets them (and its append in
    /// doubt), and when its producer id is the current one, a new one is
    /// asked for. The other partitions keep their id, sequences and
    /// appends in doubt.
    pub(super) fn start_over(&mut self, key: &PartitionKey) {
        if let Some(seq) = self.partitions.remove(key)
            && self.producer == Some(Some(seq.producer))
        {
            self.producer = None;
        }
    }
}

/// One partition's sequence numbers.
#[derive(Debug)]
pub(super) struct Sequenced {
    /// The producer id and epoch the sequences belong to.
    pub(super) producer: (i64, i16),
    /// The sequence of the next record appended.
    pub(super) next: i32,
    /// An append whose outcome is not known (no answer, an error): its
    /// first sequence and its rows. The next append to the partition is
    /// this one again, or the producer starts over with a new id.
    pub(super) doubt: Option<(i32, Vec<i64>)>,
    /// Reads that held only the head of the append in doubt since its
    /// fate was last known (see [`MAX_SHORT_READS`]).
    pub(super) short_reads: u32,
}

/// How many reads holding only the head of an append in doubt the
/// partition waits for the whole of it before it starts over (a read is
/// cut by its size and by the other partitions' rows; the next one
/// usually holds it all).
pub(super) const MAX_SHORT_READS: u32 = 10;

/// InitProducerId for a producer that is idempotent, not transactional
/// (versions 2 to 4, the flexible ones: tansu 0.6 closes the connection on
/// versions 0 and 1; librdkafka sends 4).
pub(super) struct InitProducerId;

/// What InitProducerId answered.
pub(super) struct ProducerIdentity {
    pub(super) error: Option<rskafka::protocol::error::Error>,
    pub(super) id: i64,
    pub(super) epoch: i16,
}

impl rskafka::protocol::messages::RequestBody for InitProducerId {
    type ResponseBody = ProducerIdentity;
    const API_KEY: rskafka::protocol::api_key::ApiKey =
        rskafka::protocol::api_key::ApiKey::InitProducerId;
    const API_VERSION_RANGE: rskafka::protocol::api_version::ApiVersionRange =
        rskafka::protocol::api_version::ApiVersionRange::new(
            rskafka::protocol::api_version::ApiVersion(Int16(2)),
            rskafka::protocol::api_version::ApiVersion(Int16(4)),
        );
    const FIRST_TAGGED_FIELD_IN_REQUEST_VERSION: rskafka::protocol::api_version::ApiVersion =
        rskafka::protocol::api_version::ApiVersion(Int16(2));
}

impl<W: std::io::Write> rskafka::protocol::messages::WriteVersionedType<W> for InitProducerId {
    fn write_versioned(
        &self,
        w: &mut W,
        v: rskafka::protocol::api_version::ApiVersion,
    ) -> Result<(), rskafka::protocol::messages::WriteVersionedError> {
        use rskafka::protocol::primitives::{CompactNullableString, Int64, TaggedFields};
        use rskafka::protocol::traits::WriteType;
        CompactNullableString(None).write(w)?; // no transactional id
        Int32(60_000).write(w)?; // transaction timeout (unused without one)
        if v.0.0 >= 3 {
            Int64(-1).write(w)?; // no producer id yet
            Int16(-1).write(w)?; // nor epoch
        }
        TaggedFields::default().write(w)?;
        Ok(())
    }
}

impl<R: std::io::Read> rskafka::protocol::messages::ReadVersionedType<R> for ProducerIdentity {
    fn read_versioned(
        r: &mut R,
        _v: rskafka::protocol::api_version::ApiVersion,
    ) -> Result<Self, rskafka::protocol::messages::ReadVersionedError> {
        use rskafka::protocol::primitives::{Int64, TaggedFields};
        use rskafka::protocol::traits::ReadType;
        Int32::read(r)?; // throttle
        let error = rskafka::protocol::error::Error::new(Int16::read(r)?.0);
        let id = Int64::read(r)?.0;
        let epoch = Int16::read(r)?.0;
        TaggedFields::read(r)?;
        Ok(Self { error, id, epoch })
    }
}

/// How long after a retriable InitProducerId answer it is asked again
/// (within the request timeout), and after a failed one the next append
/// asks again (until then the appends fail with its error, and the relay
/// backs off).
pub(super) const INIT_RETRY: Duration = Duration::from_millis(100);

/// Whether an InitProducerId error means the brokers will not give this
/// producer an id (no retry helps): not allowed, or not understood. Every
/// other code (a coordinator loading, moving or not available, a timeout,
/// too few replicas) passes, as the Java client retries it.
pub(super) fn init_refused_for_good(e: ProtocolError) -> bool {
    matches!(
        e,
        ProtocolError::ClusterAuthorizationFailed
            | ProtocolError::TransactionalIdAuthorizationFailed
            | ProtocolError::UnsupportedVersion
            | ProtocolError::InvalidRequest
            | ProtocolError::UnsupportedForMessageFormat
    )
}
