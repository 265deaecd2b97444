//! Records built by hand: tokens, control batches, JSON and raw records.

#[allow(clippy::wildcard_imports)]
use super::*;

/// An unsigned JWS (`alg: none`) for `subject`, valid for `lifetime`: what
/// Kafka's unsecured OAUTHBEARER validator accepts, and what a broker
/// started with [`Security::oauthbearer`] lets in.
pub fn unsecured_token(subject: &str, lifetime: Duration) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let header = URL_SAFE_NO_PAD.encode(br#"{"alg":"none"}"#);
    let claims = serde_json::json!({
        "sub": subject,
        "iat": now,
        "exp": now + lifetime.as_secs(),
    });
    let claims = URL_SAFE_NO_PAD.encode(claims.to_string());
    format!("{header}.{claims}.")
}

/// A transaction's marker as Kafka writes it: a control batch (message
/// format 2, transactional) at `base_offset` of `producer_id` and
/// `producer_epoch`, holding one record whose key is version 0 and the
/// marker's type (1 commit, 0 abort) and whose value is version 0 and
/// coordinator epoch 0, its CRC-32C over what follows the CRC. rskafka 0.6
/// writes (and reads) a control batch's body as two bare `int16`s instead:
/// what a test broker serves must be what Apache Kafka serves.
pub fn control_batch(
    base_offset: i64,
    producer_id: i64,
    producer_epoch: i16,
    commit: bool,
    timestamp: i64,
) -> Vec<u8> {
    use rskafka::protocol::record::Record as WireRecord;
    use rskafka::protocol::traits::WriteType;
    let record = WireRecord {
        timestamp_delta: 0,
        offset_delta: 0,
        key: Some(vec![0, 0, 0, u8::from(commit)]),
        value: Some(vec![0, 0, 0, 0, 0, 0]),
        headers: Vec::new(),
    };
    let mut body = Vec::new();
    body.extend_from_slice(&0x30_i16.to_be_bytes()); // transactional, control
    body.extend_from_slice(&0_i32.to_be_bytes()); // last offset delta
    body.extend_from_slice(&timestamp.to_be_bytes()); // first timestamp
    body.extend_from_slice(&timestamp.to_be_bytes()); // max timestamp
    body.extend_from_slice(&producer_id.to_be_bytes());
    body.extend_from_slice(&producer_epoch.to_be_bytes());
    body.extend_from_slice(&(-1_i32).to_be_bytes()); // base sequence
    body.extend_from_slice(&1_i32.to_be_bytes()); // one record
    // writing to a Vec cannot fail
    let _ = record.write(&mut body);
    let crc = crc32c::crc32c(&body);
    let mut out = Vec::with_capacity(21 + body.len());
    out.extend_from_slice(&base_offset.to_be_bytes());
    let length = i32::try_from(4 + 1 + 4 + body.len()).unwrap_or(i32::MAX);
    out.extend_from_slice(&length.to_be_bytes());
    out.extend_from_slice(&0_i32.to_be_bytes()); // partition leader epoch
    out.push(2); // magic
    out.extend_from_slice(&crc.to_be_bytes());
    out.extend_from_slice(&body);
    out
}

/// A record with a JSON value and string headers.
pub fn json_record(value: &serde_json::Value, headers: &[(&str, &str)]) -> Record {
    raw_record(
        Some(value.to_string().into_bytes()),
        headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec()))
            .collect(),
    )
}

/// A record from raw parts.
pub fn raw_record(value: Option<Vec<u8>>, headers: BTreeMap<String, Vec<u8>>) -> Record {
    Record {
        key: None,
        value,
        headers,
        timestamp: chrono::Utc::now(),
    }
}
