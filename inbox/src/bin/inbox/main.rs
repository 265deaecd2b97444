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
use transactional_inbox::drivers::dead_letters::{
    DeadLetter, DeadLetterQuery, DeadLetterStore, GoneHow,
};
use transactional_inbox::kafka::{
    KafkaConfig, OffsetTarget, Sasl, Tls, log_bounds, move_offsets, plan_offsets, read_offsets,
    topic_partitions,
};
use transactional_inbox::postgres::{OutboxEvents, PartitionStatus, PgStore, TableName};

type Failure = Box<dyn std::error::Error>;

mod dead_letters;
mod offsets;
mod outbox;
mod parked;
mod status;

#[allow(clippy::wildcard_imports)]
use dead_letters::*;
#[allow(clippy::wildcard_imports)]
use offsets::*;
#[allow(clippy::wildcard_imports)]
use outbox::*;
#[allow(clippy::wildcard_imports)]
use parked::*;
#[allow(clippy::wildcard_imports)]
use status::*;

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
    /// `status --check`: something needs an operator.
    pub(crate) const NEEDS_AN_OPERATOR: u8 = 6;
}

const EXIT_CODES: &str = "Exit codes: 0 done; 1 failed (the database or a broker, refused input); \
2 usage error; 3 not found (no such dead letter or outbox event); \
4 replay asked for, not done within --wait; 5 replay refused, or the letter discarded or gone; \
6 status --check found something that needs an operator.";

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
    /// Parked keys (keys side by side park a key that keeps failing): list
    /// them, or discard one's queue into the dead letters.
    #[command(subcommand)]
    Parked(ParkedCommand),
    /// Members, partitions and their owners, dead letters, outbox backlog;
    /// with brokers (`--brokers` or `KAFKA_BROKERS`), each partition's log
    /// end and lag.
    Status(StatusArgs),
    /// Create the inbox's and the outbox's tables, or bring them up to
    /// date (every step idempotent: safe to run on every deploy, and beside
    /// a service's own sea-orm migrator that applies the same steps).
    Migrate,
}

/// `inbox status`'s arguments.
#[derive(Args, Debug)]
struct StatusArgs {
    #[command(flatten)]
    brokers: Brokers,
    /// Exit with code 6 when something needs an operator (dead letters,
    /// dead outbox events, parked keys, replays asked for with no replayer
    /// running, a partition behind that has not moved for
    /// `--stalled-after`): for cron and alerting. The reasons are printed
    /// (under `--json`, as `check.problems`).
    #[arg(long)]
    check: bool,
    /// With `--check`: how long a partition may be behind without its
    /// stored offset moving before it is stalled, in seconds (needs
    /// brokers, for the lag).
    #[arg(long, default_value_t = 300, value_name = "SECONDS")]
    stalled_after: u64,
}

#[derive(Subcommand, Debug)]
enum ParkedCommand {
    /// Every parked key with its queue's depth, first message and age,
    /// oldest first.
    List,
    /// Move a parked key's messages to the dead letters (from where they
    /// can be replayed); the key then runs live again. Without
    /// `--execute`, only says how many would move.
    Discard {
        /// The consumer group.
        #[arg(long)]
        group: String,
        /// The topic.
        #[arg(long)]
        topic: String,
        /// The partition.
        #[arg(long)]
        partition: i32,
        /// The key, as text (as `parked list` shows it).
        #[arg(long)]
        key: String,
        /// Move them: without it, nothing is written.
        #[arg(long)]
        execute: bool,
    },
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
    let json = cli.json;
    match run(cli).await {
        Ok(code) => code,
        Err(e) => {
            // under --json the error is a document too (on stderr, so a
            // pipe reading stdout sees no half document)
            if json {
                eprintln!("{}", json!({ "error": e.to_string() }));
            } else {
                eprintln!("inbox: {e}");
            }
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
        Command::Parked(p) => parked(p, &store, out).await,
        Command::Status(args) => status(&args, &store, out).await,
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
