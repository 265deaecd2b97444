//! Partition assignment over a group's live members: deterministic, sticky,
//! balanced within one. Pure: the partitions, the live members and the
//! previous assignment go in, the new assignment comes out.
//!
//! - **Balanced**: each member gets `P / M` or `P / M + 1` partitions.
//! - **Sticky**: a partition stays with its previous owner while that
//!   member is live and within its share; only the excess of members over
//!   their share, and the partitions of members gone, move (the fewest
//!   moves that balance allows). The members that keep one partition more
//!   than the others are those that held the most.
//! - **Deterministic**: the result depends only on the sets given, not on
//!   their order, so every member computes the same assignment.
//!
//! ```
//! use std::collections::BTreeMap;
//! use inbox_core::group::assignment::assign;
//!
//! let partitions: Vec<inbox_core::PartitionKey> = (0..4).map(|p| ("orders".to_owned(), p)).collect();
//! let members = vec!["a".to_owned(), "b".to_owned()];
//! let first = assign(&partitions, &members, &BTreeMap::new());
//! assert_eq!(first.values().filter(|m| *m == "a").count(), 2);
//! // c joins: it takes one partition, the other three stay where they were
//! let members = vec!["a".to_owned(), "b".to_owned(), "c".to_owned()];
//! let second = assign(&partitions, &members, &first);
//! let moved = second.iter().filter(|(p, m)| first.get(*p) != Some(*m)).count();
//! assert_eq!(moved, 1);
//! ```

use std::collections::{BTreeMap, BTreeSet};

use crate::model::PartitionKey;

/// The assignment of `partitions` over the live `members`, as sticky to
/// `previous` as balance allows. Empty when there is no member.
pub fn assign(
    partitions: &[PartitionKey],
    members: &[String],
    previous: &BTreeMap<PartitionKey, String>,
) -> BTreeMap<PartitionKey, String> {
    let partitions: BTreeSet<&PartitionKey> = partitions.iter().collect();
    let members: BTreeSet<&String> = members.iter().collect();
    let mut result = BTreeMap::new();
    if members.is_empty() {
        return result;
    }
    let base = partitions.len() / members.len();
    let extra = partitions.len() % members.len();
    // what each live member holds now, of the partitions that still exist
    let mut held: BTreeMap<&String, usize> = members.iter().map(|m| (*m, 0)).collect();
    for p in &partitions {
        if let Some(owner) = previous.get(*p)
            && let Some(n) = held.get_mut(owner)
        {
            *n += 1;
        }
    }
    // the members that hold the most get the `extra` larger shares
    let mut by_holding: Vec<&String> = members.iter().copied().collect();
    by_holding.sort_by(|a, b| held[b].cmp(&held[a]).then_with(|| a.cmp(b)));
    let quota: BTreeMap<&String, usize> = by_holding
        .iter()
        .enumerate()
        .map(|(i, m)| (*m, base + usize::from(i < extra)))
        .collect();
    let mut count: BTreeMap<&String, usize> = members.iter().map(|m| (*m, 0)).collect();
    let mut free: Vec<&PartitionKey> = Vec::new();
    for p in &partitions {
        match previous.get(*p).and_then(|o| members.get(o)) {
            Some(owner) if count[owner] < quota[owner] => {
                *count.entry(owner).or_default() += 1;
                result.insert((*p).clone(), (*owner).clone());
            }
            _ => free.push(p),
        }
    }
    for p in free {
        let Some(member) = members.iter().find(|m| count[**m] < quota[**m]) else {
            break;
        };
        *count.entry(member).or_default() += 1;
        result.insert(p.clone(), (*member).clone());
    }
    result
}

/// The partitions `member` owns in `assignment`, in order.
pub fn owned_by<'a>(
    assignment: &'a BTreeMap<PartitionKey, String>,
    member: &str,
) -> Vec<&'a PartitionKey> {
    assignment
        .iter()
        .filter(|(_, m)| m.as_str() == member)
        .map(|(p, _)| p)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parts(n: i32) -> Vec<PartitionKey> {
        (0..n).map(|p| ("t".to_owned(), p)).collect()
    }

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn a_member_leaving_moves_only_its_partitions() {
        let p = parts(8);
        let three = assign(&p, &names(&["a", "b", "c"]), &BTreeMap::new());
        let two = assign(&p, &names(&["a", "c"]), &three);
        for (k, m) in &three {
            if m != "b" {
                assert_eq!(two.get(k), Some(m), "{k:?} stayed with {m}");
            }
        }
        assert_eq!(owned_by(&two, "a").len(), 4);
        assert_eq!(owned_by(&two, "c").len(), 4);
        assert!(assign(&p, &[], &two).is_empty());
    }

    /// The larger shares go to the members that hold the most, so a
    /// balanced assignment stays exactly as it is, whoever holds the extra
    /// partition; `owned_by` lists exactly a member's partitions.
    #[test]
    fn a_balanced_assignment_is_kept_as_it_is() {
        let p = parts(7);
        let members = names(&["a", "b", "c"]);
        let held: BTreeMap<PartitionKey, String> = p
            .iter()
            .zip(["b", "b", "b", "a", "a", "c", "c"])
            .map(|(k, m)| (k.clone(), m.to_owned()))
            .collect();
        assert_eq!(assign(&p, &members, &held), held, "nothing moves");
        let b: Vec<i32> = owned_by(&held, "b").iter().map(|k| k.1).collect();
        assert_eq!(b, [0, 1, 2]);
        let c: Vec<i32> = owned_by(&held, "c").iter().map(|k| k.1).collect();
        assert_eq!(c, [5, 6]);
    }

    proptest! {
        #[test]
        fn balanced_complete_deterministic_and_sticky(
            n in 0i32..24,
            before in prop::collection::btree_set("[a-f]", 0..6),
            after in prop::collection::btree_set("[a-f]", 1..6),
            seed in any::<u64>(),
        ) {
            let p = parts(n);
            let before: Vec<String> = before.into_iter().collect();
            let after: Vec<String> = after.into_iter().collect();
            let previous = assign(&p, &before, &BTreeMap::new());
            let next = assign(&p, &after, &previous);
            // complete, to live members only
            prop_assert_eq!(next.len(), p.len());
            prop_assert!(next.values().all(|m| after.contains(m)));
            // balanced within one
            let counts: Vec<usize> = after.iter().map(|m| owned_by(&next, m).len()).collect();
            let (lo, hi) = (counts.iter().min().copied().unwrap_or(0), counts.iter().max().copied().unwrap_or(0));
            prop_assert!(hi - lo <= 1, "{:?}", counts);
            // deterministic whatever the order of the inputs
            let mut shuffled_p = p.clone();
            let mut shuffled_m = after.clone();
            let k = usize::try_from(seed % 7).unwrap_or(0).min(shuffled_p.len());
            shuffled_p.rotate_left(k);
            shuffled_m.reverse();
            prop_assert_eq!(&assign(&shuffled_p, &shuffled_m, &previous), &next);
            // sticky: only the excess over each live member's share moves,
            // besides the partitions of members gone
            let moved_from_live = p.iter().filter(|k| {
                previous.get(*k).is_some_and(|o| after.contains(o) && next.get(*k) != Some(o))
            }).count();
            let base = p.len() / after.len();
            let over_share: usize = after
                .iter()
                .map(|m| owned_by(&previous, m).len().saturating_sub(base))
                .sum();
            prop_assert!(moved_from_live <= over_share, "{} moved, {} over the share", moved_from_live, over_share);
            let same = assign(&p, &after, &next);
            prop_assert_eq!(same, next, "stable when nothing changes");
        }
    }
}
