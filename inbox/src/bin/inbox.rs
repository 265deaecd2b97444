//! `inbox`: the operator's command. Reads and moves a group's offsets,
//! works with dead letters, the outbox's pending and dead events, and
//! prints the status of the groups, each with `--json` for scripts.
//!
//! ```text
//! export DATABASE_URL=postgres://...
//! inbox status                      # with KAFKA_BROKERS set: lag too
//! inbox dead-letters list --group billing --error "unknown event"
//! inbox dead-letters show 42
//! inbox dead-letters replay 42 --group billing --wait 30   # billing's DeadLetterReplayer applies it
//! inbox dead-letters discard 43
//! inbox dead-letters replay --group billing --error "unknown event" --execute   # all of them
//! inbox dead-letters discard --group billing --until 2026-11-01T00:00:00Z        # the plan
//! inbox outbox pending | dead | retry 7 | release 7
//! inbox offsets --brokers b1:9092 --group billing --topic orders show
//! inbox migrate                     # create or update the tables
//! inbox offsets --brokers b1:9092 --group billing --topic orders --partition 3 move --to 2026-12-01T09:00:00Z --execute
//! inbox offsets --brokers b1:9092 --group billing move --shift-by -100   # every topic of the group: the plan
//! ```
//!
//! Moving offsets claims each partition (its reader is fenced; a
//! `run_group` member claims it back and reads on from the new offset).
//! The database URL and the SASL password come from the environment,
//! never the command line, and are never printed.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use clap::{Args, Parser, Subcommand, ValueEnum};
use serde_json::{Value, json};
use transactional_inbox::dead_letters::{DeadLetter, DeadLetterQuery, DeadLetterStore, GoneHow};
use transactional_inbox::kafka::{
    KafkaConfig, OffsetTarget, Sasl, Tls, log_bounds, move_offsets, plan_offsets, read_offsets,
    topic_partitions,
};
use transactional_inbox::postgres::{OutboxEvents, PartitionStatus, PgStore, TableName};

type Failure = Box<dyn std::error::Error>;

/// The exit codes, as `--help` lists them: none is clap's usage error (2).
mod exit {
    /// An error: the database or a broker could not be reached, or the
    /// input was refused.
    pub(crate) const FAILED: u8 = 1;
    /// No such dead letter or outbox event.
    pub(crate) const NOT_FOUND: u8 = 3;
    /// A replay asked for and not done within `--wait`.
    pub(crate) const NOT_YET: u8 = 4;
    /// A replay refused, or the letter discarded or gone meanwhile.
    pub(crate) const NOT_REPLAYED: u8 = 5;
}

const EXIT_CODES: &str = "Exit codes: 0 done; 1 failed (the database or a broker, refused input); \
2 usage error; 3 not found (no such dead letter or outbox event); \
4 replay asked for, not done within --wait; 5 replay refused, or the letter discarded or gone.";

#[derive(Parser, Debug)]
#[command(
    name = "inbox",
    version,
    about = "Operate a transactional inbox and outbox: offsets, dead letters, outbox, status",
    after_help = EXIT_CODES
)]
struct Cli {
    /// The inbox table (`schema.table` or `table`); the other tables are
    /// named after it.
    #[arg(long, global = true, default_value = "inbox")]
    table: String,
    /// Print JSON (one document) instead of text.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// A consumer group's offsets: show them, or move them.
    Offsets(Offsets),
    /// Dead letters: list, show, replay, discard.
    #[command(subcommand, name = "dead-letters")]
    DeadLetters(DeadLetters),
    /// The outbox: pending and dead events, retry, release.
    #[command(subcommand)]
    Outbox(OutboxCommand),
    /// Members, partitions and their owners, dead letters, outbox backlog;
    /// with brokers (`--brokers` or `KAFKA_BROKERS`), each partition's log
    /// end and lag.
    Status(Brokers),
    /// Create the inbox's and the outbox's tables, or bring them up to
    /// date (every step idempotent: safe to run on every deploy, and beside
    /// a service's own sea-orm migrator that applies the same steps).
    Migrate,
}

#[derive(Subcommand, Debug)]
enum DeadLetters {
    /// List dead letters, newest first.
    List {
        /// Only this consumer group's.
        #[arg(long)]
        group: Option<String>,
        #[command(flatten)]
        filters: Filters,
        /// Only ids below this one (the next page).
        #[arg(long)]
        before_id: Option<i64>,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
    /// Show one dead letter: the message as recorded, headers in order,
    /// the raw bytes as they arrived, the error.
    Show {
        /// Its id.
        id: i64,
    },
    /// Ask the service to replay a dead letter through its handler (its
    /// group's `DeadLetterReplayer` does it, exactly once), and wait for the
    /// outcome.
    ///
    /// Without an id, every dead letter of the group that the filters
    /// select (as `list` shows them): the ids are printed, and replayed
    /// only with `--execute`.
    Replay {
        /// Its id (none: the letters the filters select).
        id: Option<i64>,
        /// The consumer group it belongs to (`list` shows it): only that
        /// group's replayer, which has its handler, carries it out.
        #[arg(long)]
        group: String,
        #[command(flatten)]
        filters: Filters,
        #[command(flatten)]
        bulk: Bulk,
        /// Seconds to wait for the outcome (0: only ask).
        #[arg(long, default_value_t = 30)]
        wait: u64,
    },
    /// Remove a dead letter without replaying it.
    ///
    /// Without an id, every dead letter the filters select (`--group`
    /// too): the ids are printed, and removed only with `--execute`.
    Discard {
        /// Its id (none: the letters the filters select).
        id: Option<i64>,
        /// Only this consumer group's (without an id).
        #[arg(long, conflicts_with = "id")]
        group: Option<String>,
        #[command(flatten)]
        filters: Filters,
        #[command(flatten)]
        bulk: Bulk,
    },
}

/// Which dead letters: the filters `list`, and a bulk replay or discard,
/// take.
#[derive(Args, Debug, Clone, Default)]
struct Filters {
    /// Only from this topic.
    #[arg(long)]
    topic: Option<String>,
    /// Only recorded at or after this time (RFC 3339).
    #[arg(long)]
    since: Option<chrono::DateTime<chrono::Utc>>,
    /// Only recorded before this time (RFC 3339).
    #[arg(long)]
    until: Option<chrono::DateTime<chrono::Utc>>,
    /// Only those whose error contains this text (case-insensitive).
    #[arg(long)]
    error: Option<String>,
}

impl Filters {
    fn any(&self) -> bool {
        self.topic.is_some() || self.since.is_some() || self.until.is_some() || self.error.is_some()
    }

    fn query(&self, group: Option<String>, before_id: Option<i64>, limit: u32) -> DeadLetterQuery {
        let mut query = DeadLetterQuery::new();
        query.consumer_group = group;
        query.topic.clone_from(&self.topic);
        query.since = self.since;
        query.until = self.until;
        query.error_contains.clone_from(&self.error);
        query.before_id = before_id;
        query.limit = limit;
        query
    }
}

/// A bulk replay's or discard's bounds.
#[derive(Args, Debug, Clone)]
struct Bulk {
    /// Act on the letters selected (without it, only their ids are
    /// printed). Not with an id.
    #[arg(long)]
    execute: bool,
    /// At most this many letters, newest first.
    #[arg(long, default_value_t = 1000)]
    max: u32,
}

#[derive(Subcommand, Debug)]
enum OutboxCommand {
    /// Events waiting to be published, oldest first.
    Pending {
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
    /// Events the relay dead-lettered, newest first.
    Dead {
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
    /// Publish a dead event again (its key's later events follow it).
    Retry {
        /// Its id.
        id: i64,
    },
    /// Let a dead event stop holding its key's later events.
    Release {
        /// Its id.
        id: i64,
    },
}

#[derive(Args, Debug)]
struct Offsets {
    #[command(flatten)]
    brokers: Brokers,
    /// The consumer group.
    #[arg(long)]
    group: String,
    /// Topics (repeat the flag; default: every topic the group has stored
    /// offsets for).
    #[arg(long = "topic")]
    topics: Vec<String>,
    /// Partitions of the one `--topic` (repeat the flag; default: every
    /// partition of the topics).
    #[arg(long = "partition", requires = "topics")]
    partitions: Vec<i32>,
    #[command(subcommand)]
    action: OffsetsAction,
}

/// Where the brokers are and how to reach them.
#[derive(Args, Debug)]
struct Brokers {
    /// Bootstrap brokers, comma separated.
    #[arg(long, env = "KAFKA_BROKERS", value_delimiter = ',')]
    brokers: Vec<String>,
    /// TLS, trusting the system's roots (or `--ca-file`).
    #[arg(long)]
    tls: bool,
    /// TLS, trusting only the CA certificates in this PEM file.
    #[arg(long, value_name = "PEM")]
    ca_file: Option<PathBuf>,
    /// Mutual TLS: the client certificate chain (PEM); needs `--client-key`.
    #[arg(long, value_name = "PEM", requires = "client_key")]
    client_cert: Option<PathBuf>,
    /// Mutual TLS: the client certificate's private key (PEM).
    #[arg(long, value_name = "PEM", requires = "client_cert")]
    client_key: Option<PathBuf>,
    /// SASL mechanism; the password is read from `KAFKA_SASL_PASSWORD`.
    #[arg(long, value_enum, requires = "sasl_user")]
    sasl_mechanism: Option<Mechanism>,
    /// SASL user (or `KAFKA_SASL_USER`, as the examples name it).
    #[arg(long, env = "KAFKA_SASL_USER")]
    sasl_user: Option<String>,
}

impl Brokers {
    /// A client configuration for `group`; `None` when no brokers are given.
    fn config(&self, group: &str) -> Result<Option<KafkaConfig>, Failure> {
        if self.brokers.is_empty() {
            return Ok(None);
        }
        let mut kafka = KafkaConfig::new(self.brokers.clone(), group.to_owned(), Vec::new());
        kafka.client_id = "inbox-cli".to_owned();
        kafka.tls = match (&self.ca_file, self.tls) {
            (Some(ca), _) => Some(Tls::ca_file(ca)),
            (None, true) => Some(Tls::system_roots()),
            (None, false) => None,
        };
        if let (Some(cert), Some(key)) = (&self.client_cert, &self.client_key) {
            kafka.tls = Some(
                kafka
                    .tls
                    .take()
                    .unwrap_or_else(Tls::system_roots)
                    .client_cert_files(cert, key),
            );
        }
        if let (Some(mechanism), Some(user)) = (self.sasl_mechanism, &self.sasl_user) {
            let password = std::env::var("KAFKA_SASL_PASSWORD")
                .map_err(|_| "KAFKA_SASL_PASSWORD is not set (the SASL password)")?;
            kafka.sasl = Some(match mechanism {
                Mechanism::Plain => Sasl::plain(user, password),
                Mechanism::ScramSha256 => Sasl::scram_sha256(user, password),
                Mechanism::ScramSha512 => Sasl::scram_sha512(user, password),
            });
        }
        Ok(Some(kafka))
    }
}

#[derive(Subcommand, Debug)]
enum OffsetsAction {
    /// Print each partition's stored offset, owner epoch, log bounds and lag.
    Show,
    /// Show where the stored offsets would move (nothing is written);
    /// with `--execute`, move them (fencing the partitions' readers), then
    /// print them as they are.
    Move {
        /// `earliest`, `latest`, an offset, an RFC 3339 time (the first
        /// record at or after it), `group:NAME` (where Kafka consumer
        /// group NAME committed), or `shift:N`.
        #[arg(
            long,
            required_unless_present = "shift_by",
            conflicts_with = "shift_by"
        )]
        to: Option<String>,
        /// Move each stored offset by N records, back (negative) or on,
        /// within the log (`--to shift:N`).
        #[arg(long, value_name = "N", allow_negative_numbers = true)]
        shift_by: Option<i64>,
        /// Move them: without it, only the plan is printed (as
        /// `kafka-consumer-groups --reset-offsets` without `--execute`).
        #[arg(long)]
        execute: bool,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Mechanism {
    Plain,
    #[value(name = "scram-sha-256")]
    ScramSha256,
    #[value(name = "scram-sha-512")]
    ScramSha512,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("inbox: {e}");
            ExitCode::from(exit::FAILED)
        }
    }
}

async fn run(cli: Cli) -> Result<ExitCode, Failure> {
    let url = std::env::var("DATABASE_URL")
        .map_err(|_| "DATABASE_URL is not set (the database that keeps the inbox)")?;
    let table = match cli.table.split_once('.') {
        Some((schema, table)) => TableName::new(Some(schema), table)?,
        None => TableName::new(None, &cli.table)?,
    };
    let store = PgStore::connect(&url, table).await?;
    let out = Out { json: cli.json };
    match cli.command {
        Command::Offsets(o) => offsets(o, &store, out).await,
        Command::DeadLetters(d) => dead_letters(d, &store, out).await,
        Command::Outbox(o) => outbox(o, &store, out).await,
        Command::Status(brokers) => status(&brokers, &store, out).await,
        Command::Migrate => {
            store.migrate().await?;
            let steps: Vec<String> =
                transactional_inbox::postgres::inbox_migrations(store.table().clone())
                    .iter()
                    .map(|m| m.name().to_owned())
                    .collect();
            if out.json {
                out.doc(&json!({ "migrated": true, "steps": steps }));
            } else {
                println!(
                    "the tables of {} are up to date ({} steps, each applied if missing)",
                    store.table().qualified(),
                    steps.len()
                );
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// The topic under which relays keep their slots (not a Kafka topic).
const RELAY_SLOTS: &str = "__outbox_slots";

async fn status(brokers: &Brokers, store: &PgStore, out: Out) -> Result<ExitCode, Failure> {
    let status = store.status().await?;
    // the log's end of each partition, when brokers are given
    let topics: Vec<(String, i32)> = status
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
    if out.json {
        let mut doc = serde_json::to_value(&status)?;
        if let Some(list) = doc["partitions"].as_array_mut() {
            for (value, p) in list.iter_mut().zip(&status.partitions) {
                value["log_end"] = json!(end_of(p));
                value["lag"] = json!(lag_of(p));
            }
        }
        out.doc(&doc);
        return Ok(ExitCode::SUCCESS);
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
    let o = &status.outbox;
    println!(
        "outbox: {} pending (oldest {} s), {} dead",
        o.pending,
        o.oldest_pending_seconds
            .map_or_else(|| "-".to_owned(), |s| format!("{s:.1}")),
        o.dead
    );
    Ok(ExitCode::SUCCESS)
}

/// Text or JSON.
#[derive(Clone, Copy)]
struct Out {
    json: bool,
}

impl Out {
    fn doc(self, value: &Value) {
        println!("{value}");
    }

    /// A yes/no outcome: printed, and the exit code (not found: 3).
    fn done(self, what: &str, id: i64, ok: bool) -> ExitCode {
        if self.json {
            self.doc(&json!({ "id": id, "done": ok }));
        } else if ok {
            println!("{what} {id}");
        } else {
            println!("no such {id}");
        }
        if ok {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(exit::NOT_FOUND)
        }
    }
}

impl Out {
    /// A bulk action's plan: the ids selected, nothing done.
    fn planned(self, action: &str, ids: &[i64]) -> ExitCode {
        if self.json {
            self.doc(&json!({ "selected": ids, "executed": false }));
        } else {
            let list: Vec<String> = ids.iter().map(i64::to_string).collect();
            println!(
                "would {action} {} dead letters: {}",
                ids.len(),
                list.join(" ")
            );
            println!("nothing done: run again with --execute to {action} them");
        }
        ExitCode::SUCCESS
    }
}

fn dash<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

fn letter_json(d: &DeadLetter) -> Value {
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

async fn dead_letters(cmd: DeadLetters, store: &PgStore, out: Out) -> Result<ExitCode, Failure> {
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
fn no_filters(filters: &Filters, bulk: &Bulk) -> Result<(), Failure> {
    if filters.any() || bulk.execute {
        return Err(
            "an id names one letter: give either the id, or the filters with --execute".into(),
        );
    }
    Ok(())
}

/// The ids of the dead letters `query` selects, newest first, at most
/// `max` (page by page).
async fn select(store: &PgStore, query: &DeadLetterQuery, max: u32) -> Result<Vec<i64>, Failure> {
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
async fn replay_outcome(
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
async fn no_replayer(store: &PgStore, group: &str) -> Result<Option<String>, Failure> {
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
async fn replay_many(
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
async fn replay(
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

fn dash_error(error: Option<&str>) -> String {
    error.map_or_else(String::new, |e| format!(": {e}"))
}

async fn outbox(cmd: OutboxCommand, store: &PgStore, out: Out) -> Result<ExitCode, Failure> {
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

/// The topics `group` has stored offsets for, in PostgreSQL.
async fn group_topics(store: &PgStore, group: &str) -> Result<Vec<String>, Failure> {
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

async fn offsets(cli: Offsets, store: &PgStore, out: Out) -> Result<ExitCode, Failure> {
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
