//! inbox offsets: show, plan and move a group's offsets.

#[allow(clippy::wildcard_imports)]
use super::*;

/// The topics `group` has stored offsets for, in PostgreSQL.
pub(super) async fn group_topics(store: &PgStore, group: &str) -> Result<Vec<String>, Failure> {
    let mut topics: Vec<String> = store
        .status()
        .await?
        .partitions
        .into_iter()
        .filter(|p| p.group == group && p.topic != RELAY_SLOTS)
        .map(|p| p.topic)
        .collect();
    topics.sort();
    topics.dedup();
    if topics.is_empty() {
        return Err(
            format!("group {group:?} has no stored offsets: name its topics with --topic").into(),
        );
    }
    Ok(topics)
}

pub(super) async fn offsets(cli: Offsets, store: &PgStore, out: Out) -> Result<ExitCode, Failure> {
    let mut kafka = cli
        .brokers
        .config(&cli.group)?
        .ok_or("no brokers: give --brokers or set KAFKA_BROKERS")?;
    let topics = if cli.topics.is_empty() {
        group_topics(store, &cli.group).await?
    } else {
        cli.topics.clone()
    };
    kafka.partitions = match (topics.as_slice(), cli.partitions.is_empty()) {
        (_, true) => topic_partitions(&kafka, &topics).await?,
        ([topic], false) => cli.partitions.iter().map(|p| (topic.clone(), *p)).collect(),
        _ => return Err("--partition needs exactly one --topic".into()),
    };
    let mut moved = Vec::new();
    if let OffsetsAction::Move {
        to,
        shift_by,
        execute,
    } = &cli.action
    {
        let target: OffsetTarget = match (to, shift_by) {
            (_, Some(n)) => OffsetTarget::ShiftBy(*n),
            (Some(to), None) => to.parse()?,
            (None, None) => return Err("give --to or --shift-by".into()),
        };
        if !*execute {
            let plan = plan_offsets(&kafka, store, target).await?;
            let list: Vec<Value> = plan
                .iter()
                .map(|m| json!({ "topic": m.topic, "partition": m.partition, "from": m.from, "to": m.to }))
                .collect();
            if out.json {
                out.doc(&json!({ "planned": list, "executed": false }));
            } else {
                for m in &plan {
                    println!(
                        "would move {}:{} from {} to {}",
                        m.topic,
                        m.partition,
                        dash(m.from),
                        m.to
                    );
                }
                println!("nothing moved: run again with --execute to move them");
            }
            return Ok(ExitCode::SUCCESS);
        }
        for m in move_offsets(&kafka, store, target).await? {
            if !out.json {
                println!(
                    "moved {}:{} from {} to {}",
                    m.topic,
                    m.partition,
                    dash(m.from),
                    m.to
                );
            }
            moved.push(
                json!({ "topic": m.topic, "partition": m.partition, "from": m.from, "to": m.to }),
            );
        }
    }
    let partitions = read_offsets(&kafka, store).await?;
    if out.json {
        let list: Vec<Value> = partitions
            .iter()
            .map(|p| {
                json!({
                    "topic": p.topic, "partition": p.partition, "stored": p.stored,
                    "owner_epoch": p.owner_epoch, "earliest": p.earliest, "latest": p.latest,
                    "lag": p.lag(),
                })
            })
            .collect();
        out.doc(&json!({ "moved": moved, "partitions": list }));
        return Ok(ExitCode::SUCCESS);
    }
    println!("topic\tpartition\tstored\tepoch\tearliest\tlatest\tlag");
    for p in &partitions {
        println!(
            "{}\t{}\t{}\t{}\t{}\t{}\t{}",
            p.topic,
            p.partition,
            dash(p.stored),
            p.owner_epoch,
            p.earliest,
            p.latest,
            dash(p.lag())
        );
    }
    Ok(ExitCode::SUCCESS)
}
