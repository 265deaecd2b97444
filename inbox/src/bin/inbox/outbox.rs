//! inbox outbox: pending and dead events, retry, release.

#[allow(clippy::wildcard_imports)]
use super::*;

pub(super) async fn outbox(
    cmd: OutboxCommand,
    store: &PgStore,
    out: Out,
) -> Result<ExitCode, Failure> {
    let (which, limit) = match cmd {
        OutboxCommand::Retry { id } => {
            let done = store.retry_outbox_event(id).await?;
            return Ok(out.done("put back to be published:", id, done));
        }
        OutboxCommand::Release { id } => {
            let done = store.release_outbox_key(id).await?;
            return Ok(out.done("released its key:", id, done));
        }
        OutboxCommand::Pending { limit } => (OutboxEvents::Pending, limit),
        OutboxCommand::Dead { limit } => (OutboxEvents::Dead, limit),
    };
    let events = store.outbox_events(which, limit).await?;
    if out.json {
        out.doc(&serde_json::to_value(&events)?);
    } else {
        println!("id\tmessage_id\ttopic\tkey\tcreated_at\tholds\terror");
        for e in &events {
            println!(
                "{}\t{}\t{}\t{}\t{}\t{}\t{}",
                e.id,
                e.message_id,
                e.topic,
                e.key.as_deref().unwrap_or("-"),
                e.created_at,
                e.holds,
                e.error.as_deref().unwrap_or("-")
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
