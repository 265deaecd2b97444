//! `cargo xtask`: the project's automation.
//!
//! - `cargo xtask test`: installs what is missing (PostgreSQL server
//!   binaries, tansu), then fmt check, clippy with `-D warnings`, docs with
//!   warnings denied, and every test of the workspace.
//! - `cargo xtask demo`: the main job, the pipeline through the outbox and
//!   the inbox with a relay and the billing consumer killed (see
//!   `pipeline.rs`); `--inbox-only` runs the billing consumer alone.
//! - `cargo xtask bench`: throughput beside the baselines (see `bench.rs`).
//! - `cargo xtask soak`: real server faults end to end (see `soak.rs`); a
//!   short one (20,000 messages) ends `cargo xtask test`.
//! - `cargo xtask scale`: member
//!   processes of one group sharing its partitions (see `scale.rs`); run by
//!   `cargo xtask test`.

mod bench;
mod bench_outbox;
mod bench_slow;
mod demo;
mod examples;
mod guide;
mod operator;
mod pipeline;
mod pooler;
mod scale;
mod setup;
mod soak;
mod sql;

use std::process::{Command, ExitCode};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

/// `cargo xtask`: the project's automation.
#[derive(Parser, Debug)]
#[command(name = "cargo xtask", bin_name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
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
    Demo(demo::DemoArgs),
    /// Throughput table beside the baselines (for real figures: cargo run
    /// --release -p xtask -- bench).
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
    /// The billing consumer process of the pipeline demo.
    #[command(hide = true)]
    PipelineBilling {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let services = || setup::postgres().and_then(|()| setup::apache_kafka());
    let result = match cli.command {
        Cmd::Test => test(),
        Cmd::Demo(args) => services().and_then(|()| demo::run(args)),
        Cmd::Bench(o) => services()
            .and_then(|()| setup::tansu())
            .and_then(|()| bench::run(o)),
        Cmd::BenchLine { args } => bench::line(&args),
        Cmd::Soak(o) => services().and_then(|()| soak::run(o)),
        Cmd::SoakConsumer { args } => soak::consumer(&args),
        Cmd::Scale => services().and_then(|()| scale::run()),
        Cmd::Examples => services().and_then(|()| examples::run()),
        Cmd::Pooler => services()
            .and_then(|()| setup::pgbouncer())
            .and_then(|()| pooler::run()),
        Cmd::ScaleMember { args } => scale::member(&args),
        Cmd::PipelineRelay { args } => pipeline::relay(&args),
        Cmd::PipelineBilling { args } => pipeline::billing(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Removes the sources cargo extracted from the local registries of earlier
/// `cargo package` and `cargo publish --dry-run` runs
/// (`$CARGO_HOME/registry/src/-<hash>/inbox-*`). cargo
/// names that registry after the target directory, and reuses an extracted
/// crate of the same name and version without looking at it again, so a
/// second run from the same checkout path built the dependents against the
/// first run's copy of `inbox-core` (seen: "could not find `outbox` in
/// `inbox_core`"). The packages themselves are made afresh each run.
fn clear_packaged_sources() -> Result<()> {
    let home = std::env::var_os("CARGO_HOME").map_or_else(
        || std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cargo")),
        |h| Some(std::path::PathBuf::from(h)),
    );
    let Some(src) = home.map(|h| h.join("registry").join("src")) else {
        return Ok(());
    };
    let Ok(registries) = std::fs::read_dir(&src) else {
        return Ok(());
    };
    for registry in registries.flatten() {
        if !registry.file_name().to_string_lossy().starts_with('-') {
            continue; // a real registry's sources
        }
        for krate in std::fs::read_dir(registry.path())?.flatten() {
            let name = krate.file_name().to_string_lossy().into_owned();
            if name.starts_with("inbox") || name.starts_with("transactional-inbox") {
                std::fs::remove_dir_all(krate.path())
                    .with_context(|| format!("removing {}", krate.path().display()))?;
            }
        }
    }
    Ok(())
}

pub(crate) fn cargo(args: &[&str], env: &[(&str, &str)]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    println!("$ cargo {}", args.join(" "));
    let status = Command::new(&cargo)
        .args(args)
        .envs(env.iter().copied())
        .current_dir(workspace_root())
        .status()
        .with_context(|| format!("running cargo {}", args.join(" ")))?;
    if !status.success() {
        bail!("cargo {} failed ({status})", args.join(" "));
    }
    Ok(())
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

pub(crate) fn workspace_root() -> std::path::PathBuf {
    let manifest = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .map_or_else(|| manifest.clone(), std::path::Path::to_path_buf)
}

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
            "--allow-dirty",
        ],
        &[],
    )?;
    println!("$ cargo xtask examples");
    examples::run()?;
    println!("$ cargo xtask pooler");
    pooler::run()?;
    println!("$ cargo xtask demo --processes 2");
    pipeline::run(2)?;
    println!("$ cargo xtask bench --smoke");
    bench::run(bench::Options::smoke())?;
    println!("$ cargo xtask scale");
    scale::run()?;
    println!("$ cargo xtask soak --messages 20000");
    soak::run(soak::Options::of(20_000))?;
    println!("$ cargo xtask soak --messages 10000 --synchronous-commit-off");
    soak::run(soak::Options {
        synchronous_commit_off: true,
        ..soak::Options::of(10_000)
    })?;
    println!("$ cargo xtask soak --messages 40000 --keys");
    soak::run(soak::Options {
        keys: true,
        ..soak::Options::of(40_000)
    })?;
    println!("xtask test: all checks passed");
    Ok(())
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
