//! `inbox-offsets`: read and move a consumer group's offsets (kept in
//! PostgreSQL beside the inbox) while its members run.
//!
//! ```text
//! DATABASE_URL=postgres://... inbox-offsets --brokers b1:9092 --group billing --topic orders show
//! DATABASE_URL=postgres://... inbox-offsets --brokers b1:9092 --group billing --topic orders \
//!     --partition 3 move --to 2026-12-01T09:00:00Z
//! ```
//!
//! Moving claims each partition (its reader is fenced; a `run_group`
//! member claims it back and reads on from the new offset). The database
//! URL and the SASL password come from the environment, never the command
//! line, and are never printed.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use inbox::kafka::{
    KafkaConfig, OffsetTarget, Sasl, Tls, move_offsets, read_offsets, topic_partitions,
};
use inbox::postgres::{PgStore, TableName};

#[derive(Parser, Debug)]
#[command(
    name = "inbox-offsets",
    version,
    about = "Read and move a consumer group's inbox offsets"
)]
struct Cli {
    /// Bootstrap brokers, comma separated.
    #[arg(long, env = "KAFKA_BROKERS", value_delimiter = ',', required = true)]
    brokers: Vec<String>,
    /// The consumer group.
    #[arg(long)]
    group: String,
    /// The topic.
    #[arg(long)]
    topic: String,
    /// Partitions (repeat the flag; default: every partition of the topic).
    #[arg(long = "partition")]
    partitions: Vec<i32>,
    /// The inbox table (`schema.table` or `table`); the offsets table is
    /// named after it.
    #[arg(long, default_value = "inbox")]
    table: String,
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
    /// SASL user.
    #[arg(long)]
    sasl_user: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Mechanism {
    Plain,
    #[value(name = "scram-sha-256")]
    ScramSha256,
    #[value(name = "scram-sha-512")]
    ScramSha512,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Print each partition's stored offset, owner epoch, log bounds and lag.
    Show,
    /// Move the stored offsets, then print them as they are.
    Move {
        /// `earliest`, `latest`, an offset, or an RFC 3339 time (the first
        /// record at or after it).
        #[arg(long)]
        to: String,
    },
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("inbox-offsets: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")
        .map_err(|_| "DATABASE_URL is not set (the database that keeps the inbox)")?;
    let table = match cli.table.split_once('.') {
        Some((schema, table)) => TableName::new(Some(schema), table)?,
        None => TableName::new(None, &cli.table)?,
    };
    let mut kafka = KafkaConfig::new(cli.brokers.clone(), cli.group.clone(), Vec::new());
    kafka.client_id = "inbox-offsets".to_owned();
    kafka.tls = match (&cli.ca_file, cli.tls) {
        (Some(ca), _) => Some(Tls::ca_file(ca)),
        (None, true) => Some(Tls::system_roots()),
        (None, false) => None,
    };
    if let (Some(cert), Some(key)) = (&cli.client_cert, &cli.client_key) {
        kafka.tls = Some(
            kafka
                .tls
                .take()
                .unwrap_or_else(Tls::system_roots)
                .client_cert_files(cert, key),
        );
    }
    if let (Some(mechanism), Some(user)) = (cli.sasl_mechanism, &cli.sasl_user) {
        let password = std::env::var("KAFKA_SASL_PASSWORD")
            .map_err(|_| "KAFKA_SASL_PASSWORD is not set (the SASL password)")?;
        kafka.sasl = Some(match mechanism {
            Mechanism::Plain => Sasl::plain(user, password),
            Mechanism::ScramSha256 => Sasl::scram_sha256(user, password),
            Mechanism::ScramSha512 => Sasl::scram_sha512(user, password),
        });
    }
    kafka.partitions = if cli.partitions.is_empty() {
        topic_partitions(&kafka, std::slice::from_ref(&cli.topic)).await?
    } else {
        cli.partitions
            .iter()
            .map(|p| (cli.topic.clone(), *p))
            .collect()
    };
    let store = PgStore::connect(&url, table).await?;
    if let Command::Move { to } = &cli.command {
        let target: OffsetTarget = to.parse()?;
        for m in move_offsets(&kafka, &store, target).await? {
            let from = m.from.map_or_else(|| "-".to_owned(), |f| f.to_string());
            println!("moved {}:{} from {from} to {}", m.topic, m.partition, m.to);
        }
    }
    println!("topic\tpartition\tstored\tepoch\tearliest\tlatest\tlag");
    for p in read_offsets(&kafka, &store).await? {
        let stored = p.stored.map_or_else(|| "-".to_owned(), |s| s.to_string());
        let lag = p.lag().map_or_else(|| "-".to_owned(), |l| l.to_string());
        println!(
            "{}\t{}\t{stored}\t{}\t{}\t{}\t{lag}",
            p.topic, p.partition, p.owner_epoch, p.earliest, p.latest
        );
    }
    Ok(())
}
