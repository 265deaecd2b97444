//! `cargo xtask`: the project's automation, set-up and orchestration only
//! (matklad's rule): this binary depends on no crate of the workspace, so
//! `cargo xtask` answers without building it. The runs themselves (bench,
//! demo, soak, scale, the examples, the pooler suites) are the binary of
//! the unpublished crate `inbox-runs`, which `cargo xtask` starts after
//! installing the services they need.
//!
//! - `cargo xtask test`: installs what is missing (PostgreSQL server
//!   binaries, Apache Kafka, tansu, librdkafka, PgBouncer), then fmt check,
//!   clippy with `-D warnings`, docs with warnings denied, every test of the
//!   workspace, publish dry-runs, and every run of `inbox-runs`.
//! - `cargo xtask demo`: the main job (see `runs/src/pipeline.rs`).
//! - `cargo xtask bench [--release]`, `soak`, `scale`, `examples`, `pooler`,
//!   `failing-for`:
//!   the runs, their options after the command (`cargo xtask soak --help`).

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};
use xtask::{cargo, clear_packaged_sources, setup};

/// `cargo xtask`: the project's automation.
#[derive(Parser, Debug)]
#[command(
    name = "cargo xtask",
    bin_name = "cargo xtask",
    arg_required_else_help = true
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

/// A run's own options, given to `inbox-runs` as they are (`--help`
/// too); `--release` builds it optimised.
#[derive(clap::Args, Debug)]
#[command(disable_help_flag = true)]
struct Pass {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<String>,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Installs what is missing, then fmt check, clippy -D warnings, cargo
    /// doc, every test of the workspace, cargo publish --dry-run of every
    /// crate, the guide's program, the examples, the suites behind PgBouncer,
    /// the pipeline demo, bench smoke, scale, soak.
    Test,
    /// The pipeline: orders and their events written through the outbox,
    /// relayed to Kafka, invoiced by the inbox which announces each invoice
    /// through the outbox, announcements consumed; a relay and the billing
    /// consumer killed once each; every order invoiced and every invoice
    /// announced exactly once (checked with SQL).
    Demo(Pass),
    /// Throughput table beside the baselines (`--release` for real figures).
    Bench(Pass),
    /// Real server faults end to end; checks every effect exactly once.
    Soak(Pass),
    /// Member processes of one group sharing 8 partitions; one killed, one
    /// joining, one leaving.
    Scale(Pass),
    /// Every example of the facade built and run, its effects checked.
    Examples(Pass),
    /// Keys that fail for minutes beside healthy traffic: the member's
    /// resident set over time (`--minutes`, default 10).
    FailingFor(Pass),
    /// The suites of the consumer, the relay, the processor and the
    /// command again, through PgBouncer in transaction pooling mode.
    Pooler(Pass),
}

impl Cmd {
    /// The run of `inbox-runs` this command starts, with its options
    /// (`None` for `test`, which is xtask's own).
    fn run(&self) -> Option<(&'static str, &Pass)> {
        match self {
            Cmd::Test => None,
            Cmd::Demo(p) => Some(("demo", p)),
            Cmd::Bench(p) => Some(("bench", p)),
            Cmd::Soak(p) => Some(("soak", p)),
            Cmd::Scale(p) => Some(("scale", p)),
            Cmd::Examples(p) => Some(("examples", p)),
            Cmd::FailingFor(p) => Some(("failing-for", p)),
            Cmd::Pooler(p) => Some(("pooler", p)),
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let Some((name, p)) = cli.command.run() else {
        return exit(test());
    };
    // a run's help needs no service
    if p.args.iter().any(|a| a == "--help" || a == "-h") {
        return exit(runs(&[name, "--help"], false));
    }
    let services = || {
        setup::postgres()?;
        setup::apache_kafka()?;
        match cli.command {
            // the slow and failing lines write with librdkafka
            Cmd::Bench(_) => setup::tansu().and_then(|()| setup::librdkafka()),
            Cmd::Pooler(_) => setup::pgbouncer(),
            _ => Ok(()),
        }
    };
    exit(services().and_then(|()| pass(name, p)))
}

/// The exit code of `result`, its error printed.
fn exit(result: Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `inbox-runs COMMAND ARGS`, optimised when `ARGS` hold `--release`.
fn pass(command: &str, p: &Pass) -> Result<()> {
    let release = p.args.iter().any(|a| a == "--release");
    let mut args = vec![command];
    args.extend(
        p.args
            .iter()
            .map(String::as_str)
            .filter(|a| *a != "--release"),
    );
    runs(&args, release)
}

/// Runs `inbox-runs ARGS` through cargo.
fn runs(args: &[&str], release: bool) -> Result<()> {
    let mut all = vec!["run", "-q", "-p", "inbox-runs"];
    if release {
        all.push("--release");
    }
    all.push("--");
    all.extend_from_slice(args);
    cargo(&all, &[])
}

/// `cargo xtask test`.
fn test() -> Result<()> {
    setup::postgres()?;
    setup::apache_kafka()?;
    setup::tansu()?;
    setup::librdkafka()?;
    setup::pgbouncer()?;
    cargo(&["fmt", "--all", "--check"], &[])?;
    cargo(
        &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--all-features",
            "--",
            "-D",
            "warnings",
        ],
        &[],
    )?;
    cargo(
        &["doc", "--workspace", "--no-deps", "--all-features"],
        &[("RUSTDOCFLAGS", "-D warnings")],
    )?;
    cargo(&["test", "--workspace", "--all-features"], &[])?;
    // every crate published dry, in dependency order: packaged as it
    // would be uploaded (cargo resolves the workspace's own crates from the
    // packages it made, a registry of its own) and each package built on
    // its own; nothing is uploaded
    clear_packaged_sources()?;
    cargo(
        &[
            "publish",
            "--dry-run",
            "--workspace",
            "--exclude",
            "xtask",
            "--exclude",
            "inbox-runs",
            "--allow-dirty",
        ],
        &[],
    )?;
    // the end-to-end runs, one binary (built by the first)
    for run in [
        &["examples"][..],
        &["pooler"],
        &["demo", "--processes", "2"],
        &["bench", "--smoke"],
        &["scale"],
        &["soak", "--messages", "20000"],
        &["soak", "--messages", "10000", "--synchronous-commit-off"],
        &[
            "soak",
            "--messages",
            "10000",
            "--synchronous-commit-off",
            "--group",
        ],
        &["soak", "--messages", "40000", "--keys"],
        &["failing-for", "--minutes", "1"],
    ] {
        println!("$ cargo xtask {}", run.join(" "));
        runs(run, false)?;
    }
    println!("xtask test: all checks passed");
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::Cli;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }
}
