//! inbox status: the groups' partitions, lag, the relays, the outbox.

use super::*;
#[allow(clippy::wildcard_imports)]
use transactional_inbox::PartitionKey;

/// The topic under which relays keep their slots (not a Kafka topic).
pub(super) const RELAY_SLOTS: &str = "__outbox_slots";

pub(super) async fn status(
    args: &StatusArgs,
    store: &PgStore,
    out: Out,
) -> Result<ExitCode, Failure> {
    let brokers = &args.brokers;
    let status = store.status().await?;
    // the log's end of each partition, when brokers are given
    let topics: Vec<PartitionKey> = status
        .partitions
        .iter()
        .filter(|p| p.topic != RELAY_SLOTS)
        .map(|p| (p.topic.clone(), p.partition))
        .collect();
    let mut ends = std::collections::BTreeMap::new();
    if let Some(kafka) = brokers.config("inbox-cli")? {
        for (at, bounds) in topics.iter().zip(log_bounds(&kafka, &topics).await?) {
            match bounds {
                Ok((_, latest)) => {
                    ends.insert(at.clone(), latest);
                }
                Err(e) => eprintln!("inbox: {}:{}: {e}", at.0, at.1),
            }
        }
    }
    let end_of = |p: &PartitionStatus| ends.get(&(p.topic.clone(), p.partition)).copied();
    let lag_of = |p: &PartitionStatus| Some((end_of(p)? - p.next_offset?).max(0));
    let problems = if args.check {
        problems(&status, &lag_of, args.stalled_after)
    } else {
        Vec::new()
    };
    let code = if problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(exit::NEEDS_AN_OPERATOR)
    };
    if out.json {
        let mut doc = serde_json::to_value(&status)?;
        if let Some(list) = doc["partitions"].as_array_mut() {
            for (value, p) in list.iter_mut().zip(&status.partitions) {
                value["log_end"] = json!(end_of(p));
                value["lag"] = json!(lag_of(p));
            }
        }
        if args.check {
            doc["check"] = json!({ "ok": problems.is_empty(), "problems": problems });
        }
        out.doc(&doc);
        return Ok(code);
    }
    println!("members");
    for m in &status.members {
        println!("  {}\t{}\theartbeat {}", m.group, m.member, m.heartbeat_at);
    }
    println!("partitions (group, topic, partition, next offset, log end, lag, epoch, assigned to)");
    let mut slots: std::collections::BTreeMap<(&str, &str), usize> = Default::default();
    for p in &status.partitions {
        if p.topic == RELAY_SLOTS {
            let owner = p.assigned_to.as_deref().unwrap_or("-");
            *slots.entry((p.group.as_str(), owner)).or_default() += 1;
            continue;
        }
        println!(
            "  {}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
            p.group,
            p.topic,
            p.partition,
            dash(p.next_offset),
            dash(end_of(p)),
            dash(lag_of(p)),
            p.owner_epoch,
            p.assigned_to.as_deref().unwrap_or("-")
        );
    }
    if ends.is_empty() && !topics.is_empty() {
        println!("  (log end and lag: give --brokers or set KAFKA_BROKERS)");
    }
    if !slots.is_empty() {
        println!("outbox relay slots (group, relay, slots)");
        for ((group, owner), n) in &slots {
            println!("  {group}\t{owner}\t{n}");
        }
    }
    println!("dead letters");
    for d in &status.dead_letters {
        let replayer = match (d.replayer_running, d.replayer_seen_at) {
            (true, _) => String::new(),
            (false, Some(at)) if d.replay_requested > 0 => format!(
                "; no replayer running, the last one looked at {}",
                at.to_rfc3339()
            ),
            (false, None) if d.replay_requested > 0 => "; no replayer has ever run".to_owned(),
            (false, _) => String::new(),
        };
        println!(
            "  {}\t{} ({} replay requested{replayer})",
            d.group, d.count, d.replay_requested
        );
    }
    if !status.parked.is_empty() {
        print_parked(&status.parked);
    }
    let o = &status.outbox;
    println!(
        "outbox: {} pending (oldest {} s), {} dead",
        o.pending,
        o.oldest_pending_seconds
            .map_or_else(|| "-".to_owned(), |s| format!("{s:.1}")),
        o.dead
    );
    if status.unplaced_completed > 0 {
        let n = if status.unplaced_completed > transactional_inbox::postgres::UNPLACED_COUNTED {
            format!(
                "more than {}",
                transactional_inbox::postgres::UNPLACED_COUNTED
            )
        } else {
            status.unplaced_completed.to_string()
        };
        println!(
            "warning: {n} completed rows keep no record position: maintenance deletes them by its retention alone, and a record of theirs delivered again after that is handled again (see docs/operations.md, Retention)"
        );
    }
    if args.check {
        if problems.is_empty() {
            println!("check: nothing needs an operator");
        }
        for p in &problems {
            println!("check: {p}");
        }
    }
    Ok(code)
}

/// What `status --check` finds that needs an operator.
fn problems(
    status: &transactional_inbox::postgres::Status,
    lag_of: &dyn Fn(&PartitionStatus) -> Option<i64>,
    stalled_after: u64,
) -> Vec<String> {
    let mut problems = Vec::new();
    for d in &status.dead_letters {
        if d.count > 0 {
            problems.push(format!("group {}: {} dead letters", d.group, d.count));
        }
        if d.replay_requested > 0 && !d.replayer_running {
            problems.push(format!(
                "group {}: {} replays asked for and no replayer running",
                d.group, d.replay_requested
            ));
        }
    }
    if status.outbox.dead > 0 {
        problems.push(format!("outbox: {} dead events", status.outbox.dead));
    }
    for k in &status.parked {
        problems.push(format!(
            "group {}: key {:?} of {}:{} parked with {} messages since {}",
            k.group,
            k.key,
            k.topic,
            k.partition,
            k.messages,
            k.parked_since.to_rfc3339()
        ));
    }
    let now = chrono::Utc::now();
    for p in &status.partitions {
        let still = (now - p.updated_at).num_seconds();
        if p.topic != RELAY_SLOTS
            && lag_of(p).is_some_and(|lag| lag > 0)
            && u64::try_from(still).is_ok_and(|s| s > stalled_after)
        {
            problems.push(format!(
                "group {}: {}:{} is {} records behind and its offset has not moved for {still} s",
                p.group,
                p.topic,
                p.partition,
                lag_of(p).unwrap_or(0)
            ));
        }
    }
    problems
}
