//! A record's headers as Kafka carries them: an ordered list in which a
//! name may appear more than once.
//!
//! Kafka allows both, and producers rely on them (a chain of `hop` headers,
//! a `tracestate` per vendor): a map would keep one value per name and sort
//! them. [`Headers`] keeps the list as it arrived; [`Headers::get`] answers
//! the last value of a name, as the Java client's `lastHeader` does.
//!
//! ```
//! use inbox_core::Headers;
//! let mut h = Headers::new();
//! h.push("hop", "gateway");
//! h.push("trace", "t-1");
//! h.push("hop", "billing");
//! assert_eq!(h.get("hop"), Some("billing"));
//! assert_eq!(h.get_all("hop").collect::<Vec<_>>(), ["gateway", "billing"]);
//! assert_eq!(
//!     h.iter().map(|(k, _)| k).collect::<Vec<_>>(),
//!     ["hop", "trace", "hop"]
//! );
//! ```

use std::fmt;

use serde::de::{MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Headers in the order they arrived, names possibly repeated.
///
/// Serialized as a list of `[name, value]` pairs; read from that or from a
/// JSON object (how messages were recorded before headers kept their
/// order).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Headers(Vec<(String, String)>);

impl Headers {
    /// No headers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a header after the others (a name already present is kept:
    /// both stay).
    pub fn push(&mut self, name: impl Into<String>, value: impl Into<String>) {
        self.0.push((name.into(), value.into()));
    }

    /// The last value of `name`, when present (Kafka's `lastHeader`).
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Every value of `name`, in order.
    pub fn get_all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.0
            .iter()
            .filter(move |(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Every header, in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// How many headers (a repeated name counts each time).
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The headers as a list of pairs.
    pub fn into_vec(self) -> Vec<(String, String)> {
        self.0
    }
}

impl From<Vec<(String, String)>> for Headers {
    fn from(pairs: Vec<(String, String)>) -> Self {
        Self(pairs)
    }
}

impl<K: Into<String>, V: Into<String>> FromIterator<(K, V)> for Headers {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        Self(
            iter.into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        )
    }
}

impl<'a> IntoIterator for &'a Headers {
    type Item = (&'a str, &'a str);
    type IntoIter = std::iter::Map<
        std::slice::Iter<'a, (String, String)>,
        fn(&'a (String, String)) -> (&'a str, &'a str),
    >;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }
}

impl Serialize for Headers {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Headers {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Either;
        impl<'de> Visitor<'de> for Either {
            type Value = Headers;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of [name, value] pairs or an object of names to values")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Headers, A::Error> {
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0));
                while let Some(pair) = seq.next_element::<(String, String)>()? {
                    out.push(pair);
                }
                Ok(Headers(out))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Headers, A::Error> {
                let mut out = Vec::with_capacity(map.size_hint().unwrap_or(0));
                while let Some(pair) = map.next_entry::<String, String>()? {
                    out.push(pair);
                }
                Ok(Headers(out))
            }
        }
        deserializer.deserialize_any(Either)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_and_repeats_survive_a_round_trip_through_json() {
        let h: Headers = [("b", "1"), ("a", "2"), ("b", "3")].into_iter().collect();
        let text = serde_json::to_string(&h).unwrap_or_default();
        assert_eq!(text, r#"[["b","1"],["a","2"],["b","3"]]"#);
        let back: Headers = serde_json::from_str(&text).unwrap_or_default();
        assert_eq!(back, h);
        assert_eq!(back.get("b"), Some("3"));
        assert_eq!(back.get("c"), None);
    }

    #[test]
    fn an_object_of_an_older_record_is_read() {
        let h: Headers = serde_json::from_str(r#"{"a": "1", "b": "2"}"#).unwrap_or_default();
        assert_eq!(h.len(), 2);
        assert_eq!(h.get("b"), Some("2"));
        assert!(serde_json::from_str::<Headers>("3").is_err());
    }

    #[test]
    fn the_list_is_given_back_as_it_was_kept() {
        let mut h = Headers::new();
        assert!(h.is_empty());
        assert_eq!(h.len(), 0);
        h.push("hop", "gateway");
        h.push("hop", "");
        assert!(!h.is_empty());
        assert_eq!(h.len(), 2);
        let pairs = h.clone().into_vec();
        assert_eq!(
            pairs,
            [
                ("hop".to_owned(), "gateway".to_owned()),
                ("hop".to_owned(), String::new())
            ]
        );
        assert_eq!(Headers::from(pairs), h);
        assert_eq!((&h).into_iter().count(), 2);
    }
}
