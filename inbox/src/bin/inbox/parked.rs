//! inbox parked: the parked keys (keys side by side), list and discard.

#[allow(clippy::wildcard_imports)]
use super::*;

pub(super) async fn parked(
    cmd: ParkedCommand,
    store: &PgStore,
    out: Out,
) -> Result<ExitCode, Failure> {
    match cmd {
        ParkedCommand::List => {
            let keys = store.parked_keys_status().await?;
            if out.json {
                out.doc(&serde_json::to_value(&keys)?);
            } else {
                print_parked(&keys);
            }
            Ok(ExitCode::SUCCESS)
        }
        ParkedCommand::Discard {
            group,
            topic,
            partition,
            key,
            execute,
        } => {
            let keys = store.parked_keys_status().await?;
            let found = keys.iter().find(|k| {
                k.group == group && k.topic == topic && k.partition == partition && k.key == key
            });
            let Some(found) = found else {
                if out.json {
                    out.doc(&json!({ "found": false }));
                } else {
                    println!("no such parked key");
                }
                return Ok(ExitCode::from(exit::NOT_FOUND));
            };
            if !execute {
                if out.json {
                    out.doc(
                        &json!({ "found": true, "messages": found.messages, "executed": false }),
                    );
                } else {
                    println!(
                        "would move {} parked messages of key {:?} to the dead letters (give --execute)",
                        found.messages, found.key
                    );
                }
                return Ok(ExitCode::SUCCESS);
            }
            let done = store
                .discard_parked_key(&group, &topic, partition, key.as_bytes())
                .await?;
            if out.json {
                out.doc(&serde_json::to_value(done)?);
            } else {
                println!(
                    "removed {} parked messages, {} recorded as dead letters",
                    done.removed, done.dead_lettered
                );
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// The parked keys, a line each.
pub(super) fn print_parked(keys: &[transactional_inbox::postgres::ParkedKeyStatus]) {
    println!(
        "parked keys (group, topic, partition, key, messages, first offset, first message, parked since)"
    );
    for k in keys {
        println!(
            "  {}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
            k.group,
            k.topic,
            k.partition,
            k.key,
            k.messages,
            k.first_offset,
            k.first_message_id,
            k.parked_since
        );
    }
}
