//! The message's validation rules: ids, event types, payloads, headers.

#[allow(clippy::wildcard_imports)]
use super::*;

/// Checks a consumer group's name: non-empty, no NUL, at most 255
/// characters.
///
/// # Errors
///
/// The [`ValidationError`] for the first rule broken.
pub fn validate_consumer_group(group: &str) -> Result<(), ValidationError> {
    check_id("consumer_group", group)
}

pub(super) fn check_id(field: &'static str, value: &str) -> Result<(), ValidationError> {
    if value.is_empty() {
        return Err(ValidationError::Empty { field });
    }
    no_nul(field, value)?;
    let chars = value.chars().count();
    if chars > MAX_ID_CHARS {
        return Err(ValidationError::TooLong {
            field,
            max: MAX_ID_CHARS,
            actual: chars,
        });
    }
    Ok(())
}

/// Checks an event type: non-empty after trimming, at most 100 characters.
///
/// # Errors
///
/// [`ValidationError::Empty`] or [`ValidationError::TooLong`].
pub fn validate_event_type(event_type: &str) -> Result<(), ValidationError> {
    no_nul("event_type", event_type)?;
    let trimmed = event_type.trim();
    if trimmed.is_empty() {
        return Err(ValidationError::Empty {
            field: "event_type",
        });
    }
    let chars = trimmed.chars().count();
    if chars > MAX_EVENT_TYPE_CHARS {
        return Err(ValidationError::TooLong {
            field: "event_type",
            max: MAX_EVENT_TYPE_CHARS,
            actual: chars,
        });
    }
    Ok(())
}

/// Checks a payload: a non-empty JSON object of at most 1,000,000 bytes
/// serialized, with finite numbers only.
///
/// # Errors
///
/// [`ValidationError::PayloadNotObject`], [`ValidationError::PayloadEmpty`],
/// [`ValidationError::PayloadTooLarge`] or [`ValidationError::PayloadNotFinite`].
pub fn validate_payload(payload: &Value) -> Result<(), ValidationError> {
    let Value::Object(map) = payload else {
        return Err(ValidationError::PayloadNotObject {
            found: json_kind(payload),
        });
    };
    if map.is_empty() {
        return Err(ValidationError::PayloadEmpty);
    }
    if !all_finite(payload) {
        return Err(ValidationError::PayloadNotFinite);
    }
    if has_nul(payload) {
        return Err(ValidationError::NulCharacter {
            field: "payload".to_owned(),
        });
    }
    let bytes = json_len(payload).ok_or(ValidationError::PayloadNotFinite)?;
    if bytes > MAX_PAYLOAD_BYTES {
        return Err(ValidationError::PayloadTooLarge {
            max: MAX_PAYLOAD_BYTES,
            actual: bytes,
        });
    }
    Ok(())
}

/// Checks a binary payload: non-empty, at most 1,000,000 bytes.
///
/// # Errors
///
/// [`ValidationError::PayloadEmpty`] or [`ValidationError::PayloadTooLarge`].
pub fn validate_bytes(bytes: &[u8]) -> Result<(), ValidationError> {
    if bytes.is_empty() {
        return Err(ValidationError::PayloadEmpty);
    }
    if bytes.len() > MAX_PAYLOAD_BYTES {
        return Err(ValidationError::PayloadTooLarge {
            max: MAX_PAYLOAD_BYTES,
            actual: bytes.len(),
        });
    }
    Ok(())
}

/// A NUL character in `value`, refused by name.
pub(super) fn no_nul(field: &str, value: &str) -> Result<(), ValidationError> {
    if value.contains('\0') {
        return Err(ValidationError::NulCharacter {
            field: field.to_owned(),
        });
    }
    Ok(())
}

/// Whether a string or a key anywhere in `value` holds a NUL character.
pub(super) fn has_nul(value: &Value) -> bool {
    match value {
        Value::String(s) => s.contains('\0'),
        Value::Array(items) => items.iter().any(has_nul),
        Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || has_nul(v)),
        Value::Null | Value::Bool(_) | Value::Number(_) => false,
    }
}

pub(super) fn all_finite(value: &Value) -> bool {
    match value {
        Value::Number(n) => n.as_f64().is_none_or(f64::is_finite),
        Value::Array(items) => items.iter().all(all_finite),
        Value::Object(map) => map.values().all(all_finite),
        Value::Null | Value::Bool(_) | Value::String(_) => true,
    }
}

pub(super) fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Checks headers: at most 100, keys at most 64 and values at most 512
/// characters. (Keys and values are Rust strings, so UTF-8 holds by type;
/// adapters decoding raw bytes report [`ValidationError::HeaderNotUtf8`].)
///
/// # Errors
///
/// [`ValidationError::TooManyHeaders`], [`ValidationError::HeaderKeyTooLong`],
/// [`ValidationError::HeaderValueTooLong`] or [`ValidationError::Empty`] for an
/// empty key.
pub fn validate_headers(headers: &Headers) -> Result<(), ValidationError> {
    if headers.len() > MAX_HEADERS {
        return Err(ValidationError::TooManyHeaders {
            max: MAX_HEADERS,
            actual: headers.len(),
        });
    }
    for (key, value) in headers {
        check_header(key, value.contains('\0'), value.chars().count())?;
    }
    Ok(())
}

/// Checks one header: a key non-empty, without NUL and not too long; a
/// value without NUL (`value_nul` says) and at most
/// [`MAX_HEADER_VALUE_CHARS`] long (`value_len`).
pub(super) fn check_header(
    key: &str,
    value_nul: bool,
    value_len: usize,
) -> Result<(), ValidationError> {
    if key.is_empty() {
        return Err(ValidationError::Empty {
            field: "header key",
        });
    }
    if key.contains('\0') || value_nul {
        return Err(ValidationError::NulCharacter {
            field: format!("header {:?}", key.replace('\0', "\u{fffd}")),
        });
    }
    let key_chars = key.chars().count();
    if key_chars > MAX_HEADER_KEY_CHARS {
        return Err(ValidationError::HeaderKeyTooLong {
            key: key.chars().take(MAX_HEADER_KEY_CHARS).collect(),
            max: MAX_HEADER_KEY_CHARS,
            actual: key_chars,
        });
    }
    if value_len > MAX_HEADER_VALUE_CHARS {
        return Err(ValidationError::HeaderValueTooLong {
            key: key.to_owned(),
            max: MAX_HEADER_VALUE_CHARS,
            actual: value_len,
        });
    }
    Ok(())
}

/// Checks the binary headers beside `text` text headers: at most
/// [`MAX_HEADERS`] in all, keys as for text headers, values at most
/// [`MAX_HEADER_VALUE_CHARS`] bytes.
pub(super) fn validate_binary_headers(
    text: usize,
    headers: &[(String, Vec<u8>)],
) -> Result<(), ValidationError> {
    let all = text + headers.len();
    if all > MAX_HEADERS {
        return Err(ValidationError::TooManyHeaders {
            max: MAX_HEADERS,
            actual: all,
        });
    }
    for (key, value) in headers {
        check_header(key, false, value.len())?;
    }
    Ok(())
}

/// The event type of a [tombstone](Message::tombstone) for which the
/// decoder found none (no header, no type for its topic).
pub const TOMBSTONE_EVENT_TYPE: &str = "tombstone";

/// Decodes one raw header into UTF-8 key and value, as adapters must.
///
/// # Errors
///
/// [`ValidationError::HeaderNotUtf8`] naming the key (lossily) when either
/// part is not UTF-8.
pub fn decode_header(key: &[u8], value: &[u8]) -> Result<(String, String), ValidationError> {
    let lossy_key = String::from_utf8_lossy(key).into_owned();
    let key = String::from_utf8(key.to_vec()).map_err(|_| ValidationError::HeaderNotUtf8 {
        key: lossy_key.clone(),
    })?;
    let value = String::from_utf8(value.to_vec())
        .map_err(|_| ValidationError::HeaderNotUtf8 { key: lossy_key })?;
    Ok((key, value))
}
