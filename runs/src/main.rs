//! `inbox-runs`: the end-to-end runs, whose assertions `cargo xtask`
//! runs (it installs the services first and starts this binary):
//!
//! - `demo`: the main job, the pipeline through the outbox and the inbox
//!   with a relay and the billing consumer killed (see `pipeline.rs`);
//!   `--inbox-only` runs the billing consumer alone.
//! - `bench`: throughput beside the baselines (see `bench.rs`).
//! - `soak`: real server faults end to end (see `soak.rs`).
//! - `scale`: member processes of one group sharing its partitions (see
//!   `scale.rs`).
//! - `examples`: the guide's program and every example, built and run,
//!   their effects checked with SQL.
//! - `pooler`: the suites again through PgBouncer.
//!
//! Not published; `cargo xtask` (set-up and orchestration only) depends on
//! no crate of the workspace, this one on all of them.

mod bench;
mod bench_outbox;
mod bench_slow;
mod demo;
mod examples;
mod failing_for;
mod guide;
mod operator;
mod pipeline;
mod pooler;
mod scale;
mod soak;
mod sql;

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};
pub(crate) use xtask::{cargo, workspace_root};

/// `inbox-runs`: the end-to-end runs (started by `cargo xtask`).
#[derive(Parser, Debug)]
#[command(name = "inbox-runs", bin_name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// The pipeline: orders and their events written through the outbox,
    /// relayed to Kafka, invoiced by the inbox which announces each invoice
    /// through the outbox, announcements consumed; a relay and the billing
    /// consumer killed once each; every order invoiced and every invoice
    /// announced exactly once (checked with SQL).
    Demo(demo::DemoArgs),
    /// Throughput table beside the baselines (for real figures: cargo xtask
    /// bench --release).
    Bench(bench::Options),
    /// One bench line in a process of its own (run by `bench`).
    #[command(hide = true)]
    BenchLine {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Real server faults end to end: PostgreSQL crashed (pg_ctl stop -m
    /// immediate), the broker and the consumer process killed, three times
    /// each, backends terminated at random; checks every effect exactly
    /// once.
    Soak(soak::Options),
    /// The soak's consumer process (run by `soak`).
    #[command(hide = true)]
    SoakConsumer {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Keys that fail for minutes beside healthy traffic (no failure
    /// budget, parked in PostgreSQL): the member's resident set every 30 s,
    /// the healthy messages all handled.
    FailingFor(failing_for::Options),
    /// Every example of the facade built and run against the throwaway
    /// PostgreSQL and broker, its effects checked with SQL.
    Examples,
    /// The suites of the consumer, the relay, the processor and the
    /// command again, through PgBouncer in transaction pooling mode.
    Pooler,
    /// Member processes of one group share 8 partitions through
    /// PostgreSQL: one killed (SIGKILL), one joining, one leaving; checks
    /// every order once, every partition owned by one live member, and the
    /// failover time.
    Scale,
    /// A member process of `scale`.
    #[command(hide = true)]
    ScaleMember {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// A relay process of the pipeline demo.
    #[command(hide = true)]
    PipelineRelay {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Resolves Apache Kafka's jars with Maven (run by `cargo xtask`'s
    /// set-up, so the first broker of the tests starts at once).
    #[command(hide = true)]
    ResolveKafka,
    /// The billing consumer process of the pipeline demo.
    #[command(hide = true)]
    PipelineBilling {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Cmd::Demo(args) => demo::run(args),
        Cmd::Bench(o) => bench::run(o),
        Cmd::BenchLine { args } => bench::line(&args),
        Cmd::Soak(o) => soak::run(o),
        Cmd::SoakConsumer { args } => soak::consumer(&args),
        Cmd::Scale => scale::run(),
        Cmd::Examples => examples::run(),
        Cmd::FailingFor(o) => failing_for::run(&o),
        Cmd::Pooler => pooler::run(),
        Cmd::ScaleMember { args } => scale::member(&args),
        Cmd::PipelineRelay { args } => pipeline::relay(&args),
        Cmd::PipelineBilling { args } => pipeline::billing(&args),
        Cmd::ResolveKafka => resolve_kafka(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("inbox-runs: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// For a child process of a run (the soak's consumer, the scale's
/// members): a runtime, and a token cancelled when stdin closes (the
/// parent's way to ask for a graceful stop).
pub(crate) fn child_runtime() -> Result<(tokio::runtime::Runtime, inbox_core::CancellationToken)> {
    use std::io::Read;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let cancel = inbox_core::CancellationToken::new();
    let on_eof = cancel.clone();
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
        on_eof.cancel();
    });
    Ok((rt, cancel))
}

/// Resolves the Apache Kafka release the tests run, timing it.
fn resolve_kafka() -> Result<()> {
    println!(
        "setup: resolving Apache Kafka {} with Maven (the first run downloads about 60 MB into ~/.m2)",
        inbox_testkit::apache::version()
    );
    let started = std::time::Instant::now();
    inbox_testkit::apache::classpath().map_err(|e| anyhow::anyhow!("{e}"))?;
    println!(
        "setup: Apache Kafka resolved in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The database the demo and the pipeline use: `DATABASE_URL` when set,
/// else a new database on the throwaway server.
pub(crate) async fn database() -> Result<String> {
    if let Ok(url) = std::env::var("DATABASE_URL")
        && !url.is_empty()
    {
        println!("PostgreSQL: using DATABASE_URL");
        return Ok(url);
    }
    let server = inbox_testkit::pg::server().map_err(|e| anyhow::anyhow!("{e}"))?;
    println!("PostgreSQL: started a throwaway server (DATABASE_URL not set)");
    server.create_database().map_err(|e| anyhow::anyhow!("{e}"))
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::Cli;

    /// The command line is consistent, and each command's help lists every
    /// option it takes (the hand-written help had lost `--no-faults`).
    #[test]
    fn the_help_lists_every_option() {
        Cli::command().debug_assert();
        let mut cli = Cli::command();
        let help = |cli: &mut clap::Command, name: &str| -> String {
            cli.find_subcommand_mut(name)
                .map(|c| c.render_long_help().to_string())
                .unwrap_or_default()
        };
        let soak = help(&mut cli, "soak");
        for flag in [
            "--messages",
            "--fail-percent",
            "--no-faults",
            "--synchronous-commit-off",
            "--keys",
            "--group",
        ] {
            assert!(soak.contains(flag), "soak --help lacks {flag}: {soak}");
        }
        let bench = help(&mut cli, "bench");
        for flag in [
            "--messages",
            "--rows",
            "--fail-percent",
            "--only",
            "--repeat",
            "--smoke",
        ] {
            assert!(bench.contains(flag), "bench --help lacks {flag}: {bench}");
        }
        let demo = help(&mut cli, "demo");
        for flag in [
            "--inbox-only",
            "--per-message",
            "--prometheus",
            "--processes",
        ] {
            assert!(demo.contains(flag), "demo --help lacks {flag}: {demo}");
        }
    }
}
