//! inbox dead-letters: list, show, replay and discard, one or by filters.

#[allow(clippy::wildcard_imports)]
use super::*;

pub(super) fn letter_json(d: &DeadLetter) -> Value {
    json!({
        "id": d.id,
        "consumer_group": d.consumer_group,
        "message_id": d.message_id,
        "source": d.source,
        "position": d.position,
        "error": d.error,
        "created_at": d.created_at,
        "replay_requested_at": d.replay_requested_at,
        "replay_error": d.replay_error,
        "message": d.recorded,
        "raw": d.raw.as_ref().map(|r| String::from_utf8_lossy(r).into_owned()),
        // every byte, for a binary payload (Protobuf, Avro) that text loses
        "raw_base64": d.raw.as_ref().map(|r| BASE64.encode(r)),
    })
}

pub(super) async fn dead_letters(
    cmd: DeadLetters,
    store: &PgStore,
    out: Out,
) -> Result<ExitCode, Failure> {
    match cmd {
        DeadLetters::List {
            group,
            filters,
            before_id,
            limit,
        } => {
            let query = filters.query(group, before_id, limit);
            let letters = store.list_dead_letters(&query).await?;
            if out.json {
                out.doc(&Value::Array(letters.iter().map(letter_json).collect()));
            } else {
                println!("id\tgroup\tmessage_id\tposition\tcreated_at\terror");
                for d in &letters {
                    let error: String = d.error.chars().take(120).collect();
                    println!(
                        "{}\t{}\t{}\t{}\t{}\t{error}",
                        d.id,
                        d.consumer_group,
                        d.message_id,
                        dash(d.position.as_ref()),
                        d.created_at
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        DeadLetters::Show { id } => {
            let Some(d) = store.dead_letter(id).await? else {
                return Ok(out.done("shown", id, false));
            };
            if out.json {
                out.doc(&letter_json(&d));
            } else {
                println!("id            {}", d.id);
                println!("group         {}", d.consumer_group);
                println!("message_id    {}", d.message_id);
                println!("position      {}", dash(d.position.as_ref()));
                println!("recorded at   {}", d.created_at);
                println!("error         {}", d.error);
                if let Some(e) = &d.replay_error {
                    println!("replay error  {e}");
                }
                if let Ok(m) = d.message() {
                    for (name, value) in &m.headers {
                        println!("header        {name}: {value}");
                    }
                }
                println!("message       {}", d.recorded);
                match d.raw.as_deref().map(std::str::from_utf8) {
                    Some(Ok(text)) => println!("raw           {text}"),
                    Some(Err(_)) => {
                        let bytes = d.raw.as_deref().unwrap_or_default();
                        println!("raw (base64)  {}", BASE64.encode(bytes));
                    }
                    None => {}
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        DeadLetters::Replay {
            id: Some(id),
            group,
            filters,
            bulk,
            wait,
        } => {
            no_filters(&filters, &bulk)?;
            replay(store, out, id, &group, wait).await
        }
        DeadLetters::Replay {
            id: None,
            group,
            filters,
            bulk,
            wait,
        } => {
            let ids = select(
                store,
                &filters.query(Some(group.clone()), None, 0),
                bulk.max,
            )
            .await?;
            if !bulk.execute {
                return Ok(out.planned("replay", &ids));
            }
            replay_many(store, out, &ids, &group, wait).await
        }
        DeadLetters::Discard {
            id: Some(id),
            filters,
            bulk,
            ..
        } => {
            no_filters(&filters, &bulk)?;
            let done = store.discard_dead_letter(id).await?;
            Ok(out.done("discarded", id, done))
        }
        DeadLetters::Discard {
            id: None,
            group,
            filters,
            bulk,
        } => {
            if group.is_none() && !filters.any() {
                return Err("give an id, or select the letters with --group or a filter".into());
            }
            let ids = select(store, &filters.query(group, None, 0), bulk.max).await?;
            if !bulk.execute {
                return Ok(out.planned("discard", &ids));
            }
            let mut discarded = Vec::new();
            for id in &ids {
                if store.discard_dead_letter(*id).await? {
                    discarded.push(*id);
                }
            }
            if out.json {
                out.doc(&json!({ "discarded": discarded }));
            } else {
                println!(
                    "discarded {} of {} dead letters",
                    discarded.len(),
                    ids.len()
                );
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// With an id, filters and `--execute` are refused (they select letters).
pub(super) fn no_filters(filters: &Filters, bulk: &Bulk) -> Result<(), Failure> {
    if filters.any() || bulk.execute {
        return Err(
            "an id names one letter: give either the id, or the filters with --execute".into(),
        );
    }
    Ok(())
}

/// The ids of the dead letters `query` selects, newest first, at most
/// `max` (page by page).
pub(super) async fn select(
    store: &PgStore,
    query: &DeadLetterQuery,
    max: u32,
) -> Result<Vec<i64>, Failure> {
    let mut ids = Vec::new();
    let mut page = query.clone();
    loop {
        let left = max.saturating_sub(u32::try_from(ids.len()).unwrap_or(u32::MAX));
        if left == 0 {
            return Ok(ids);
        }
        page.limit = left.min(500);
        let letters = store.list_dead_letters(&page).await?;
        let Some(last) = letters.last() else {
            return Ok(ids);
        };
        page.before_id = Some(last.id);
        ids.extend(letters.iter().map(|d| d.id));
    }
}

/// What became of dead letter `id` whose replay was asked for: `None`
/// while it waits; else the outcome and why.
pub(super) async fn replay_outcome(
    store: &PgStore,
    id: i64,
) -> Result<Option<(&'static str, Option<String>)>, Failure> {
    Ok(match store.dead_letter(id).await? {
        None => Some(match store.letter_gone(id).await? {
            Some(g) if g.how == GoneHow::Replayed => ("replayed", None),
            Some(g) if g.how == GoneHow::AlreadyApplied => (
                "already_applied",
                Some("its inbox row had completed meanwhile: not applied again".to_owned()),
            ),
            Some(_) => (
                "discarded",
                Some("discarded while its replay was asked for: not replayed".to_owned()),
            ),
            None => (
                "gone",
                Some("removed with no record of a replay: not replayed".to_owned()),
            ),
        }),
        Some(d) if d.replay_requested_at.is_none() => Some(("refused", d.replay_error.clone())),
        Some(_) => None,
    })
}

/// Why nothing came of a replay within the wait: no replayer of `group`
/// running, or none ever (`None` when one runs).
pub(super) async fn no_replayer(store: &PgStore, group: &str) -> Result<Option<String>, Failure> {
    Ok(match store.replayer_seen(group).await? {
        Some(r) if r.running => None,
        Some(r) => Some(format!(
            "no replayer of group {group:?} is running: the last one looked at {}",
            r.seen_at.to_rfc3339()
        )),
        None => Some(format!(
            "no replayer of group {group:?} has ever run: start a DeadLetterReplayer for {group:?} in the service that has its handler"
        )),
    })
}

/// `inbox dead-letters replay --group G FILTERS --execute`: asks for each,
/// then waits up to `wait` seconds for all, and counts the outcomes.
pub(super) async fn replay_many(
    store: &PgStore,
    out: Out,
    ids: &[i64],
    group: &str,
    wait: u64,
) -> Result<ExitCode, Failure> {
    let mut waiting = Vec::new();
    for id in ids {
        if store.request_replay(*id, group).await? {
            waiting.push(*id);
        }
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(wait);
    let mut outcomes: std::collections::BTreeMap<&str, Vec<i64>> = Default::default();
    loop {
        let mut still = Vec::new();
        for id in waiting {
            match replay_outcome(store, id).await? {
                Some((outcome, _)) => outcomes.entry(outcome).or_default().push(id),
                None => still.push(id),
            }
        }
        waiting = still;
        if waiting.is_empty() || tokio::time::Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let not_yet = if waiting.is_empty() {
        None
    } else {
        no_replayer(store, group).await?
    };
    let failed = outcomes
        .iter()
        .any(|(o, _)| !matches!(*o, "replayed" | "already_applied"));
    if out.json {
        out.doc(&json!({
            "selected": ids, "outcomes": outcomes, "requested": waiting, "error": not_yet,
        }));
    } else {
        for (outcome, list) in &outcomes {
            println!("{} {}", outcome.replace('_', " "), list.len());
        }
        if !waiting.is_empty() {
            println!(
                "requested, not done yet {}{}",
                waiting.len(),
                dash_error(not_yet.as_deref())
            );
        }
    }
    Ok(if failed {
        ExitCode::from(exit::NOT_REPLAYED)
    } else if !waiting.is_empty() && wait > 0 {
        ExitCode::from(exit::NOT_YET)
    } else {
        ExitCode::SUCCESS
    })
}

/// `inbox dead-letters replay ID --group G --wait N`: asks, then waits for
/// the outcome, saying what became of the letter (replayed, found applied,
/// refused, discarded, gone by retention) or, when nothing came, whether a
/// replayer of the group is running at all.
pub(super) async fn replay(
    store: &PgStore,
    out: Out,
    id: i64,
    group: &str,
    wait: u64,
) -> Result<ExitCode, Failure> {
    if !store.request_replay(id, group).await? {
        let error = match store.dead_letter(id).await? {
            Some(d) => format!(
                "dead letter {id} is group {:?}'s, not {group:?}'s",
                d.consumer_group
            ),
            None => format!("no dead letter {id}"),
        };
        if out.json {
            out.doc(&json!({ "id": id, "outcome": "not_found", "error": error }));
        } else {
            println!("{error}");
        }
        return Ok(ExitCode::from(exit::NOT_FOUND));
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(wait);
    loop {
        let outcome = replay_outcome(store, id).await?;
        if let Some((outcome, error)) = outcome {
            if out.json {
                out.doc(&json!({ "id": id, "outcome": outcome, "error": error }));
            } else {
                println!(
                    "{} {id}{}",
                    outcome.replace('_', " "),
                    dash_error(error.as_deref())
                );
            }
            return Ok(if matches!(outcome, "replayed" | "already_applied") {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(exit::NOT_REPLAYED)
            });
        }
        if tokio::time::Instant::now() >= deadline {
            let replayer = no_replayer(store, group).await?;
            if out.json {
                out.doc(&json!({ "id": id, "outcome": "requested", "error": replayer }));
            } else {
                println!(
                    "replay of {id} requested; not done yet{}",
                    dash_error(replayer.as_deref())
                );
            }
            return Ok(if wait == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(exit::NOT_YET)
            });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

pub(super) fn dash_error(error: Option<&str>) -> String {
    error.map_or_else(String::new, |e| format!(": {e}"))
}
