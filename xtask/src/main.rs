//! `cargo xtask`: the project's automation.
//!
//! - `cargo xtask test`: installs what is missing (PostgreSQL server
//!   binaries, tansu), then fmt check, clippy with `-D warnings`, docs with
//!   warnings denied, and every test of the workspace.
//! - `cargo xtask demo`: the main job, the billing scenario.
//! - `cargo xtask bench`: throughput beside the baselines (see `bench.rs`).
//! - `cargo xtask soak`: real server faults end to end (see `soak.rs`); a
//!   short one (20,000 messages) ends `cargo xtask test`.
//! - `cargo xtask scale` (also `cargo xtask demo --processes 3`): member
//!   processes of one group sharing its partitions (see `scale.rs`); run by
//!   `cargo xtask test`.

mod bench;
mod demo;
mod scale;
mod setup;
mod soak;
mod sql;

use std::process::{Command, ExitCode};

use anyhow::{Context, Result, bail};

const HELP: &str = "\
cargo xtask <command>

commands:
  test    fmt check, clippy -D warnings, cargo doc, every test of the workspace,
          cargo package of every published crate, bench smoke, scale, soak
  demo    run the billing demo and check every order has exactly one invoice
          (--per-message: one transaction per message instead of batches;
          --prometheus ADDR: serve the metrics at http://ADDR/metrics;
          --processes 3: the group demo, as `scale`)
  bench   throughput table beside the baselines; options: --messages N,
          --rows N (preload the inbox table), --fail-percent P (the
          handler of the runner lines fails P% of its calls), --only LINE,LINE,
          --repeat N (N rounds, lines interleaved, medians), --smoke
          (for real figures: cargo run --release -p xtask -- bench)
  soak    real server faults end to end: PostgreSQL crashed (pg_ctl stop -m
          immediate), the broker and the consumer process killed, three times
          each, backends terminated at random; checks every effect exactly once;
          options: --messages N (default 1000000), --fail-percent P (default 1),
          --synchronous-commit-off (a PostgreSQL crash loses its last commits:
          the consumer must notice and handle those messages again)
  scale   member processes of one group share 8 partitions through PostgreSQL:
          one killed (SIGKILL), one joining, one leaving; checks every order once,
          every partition owned by one live member, and the failover time
  help    this text
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        None | Some("help" | "--help" | "-h") => {
            print!("{HELP}");
            Ok(())
        }
        Some("test") => test(),
        Some("demo") => setup::postgres()
            .and_then(|()| setup::tansu())
            .and_then(|()| demo::run(&args[1..])),
        Some("bench") => setup::postgres()
            .and_then(|()| setup::tansu())
            .and_then(|()| bench::run(&args[1..])),
        Some("bench-line") => bench::line(&args[1..]),
        Some("soak") => setup::postgres()
            .and_then(|()| setup::tansu())
            .and_then(|()| soak::run(&args[1..])),
        Some("soak-consumer") => soak::consumer(&args[1..]),
        Some("scale") => setup::postgres()
            .and_then(|()| setup::tansu())
            .and_then(|()| scale::run(&args[1..])),
        Some("scale-member") => scale::member(&args[1..]),
        Some(other) => {
            eprint!("unknown command {other:?}\n\n{HELP}");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn cargo(args: &[&str], env: &[(&str, &str)]) -> Result<()> {
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

fn workspace_root() -> std::path::PathBuf {
    let manifest = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .map_or_else(|| manifest.clone(), std::path::Path::to_path_buf)
}

fn test() -> Result<()> {
    setup::postgres()?;
    setup::tansu()?;
    setup::librdkafka()?;
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
    // every crate packaged as it would be published, in dependency order
    // (cargo resolves the workspace's own crates from the packages it
    // made), each package built on its own
    cargo(
        &[
            "package",
            "--workspace",
            "--exclude",
            "xtask",
            "--allow-dirty",
        ],
        &[],
    )?;
    println!("$ cargo xtask bench --smoke");
    bench::run(&["--smoke".to_owned()])?;
    println!("$ cargo xtask scale");
    scale::run(&[])?;
    println!("$ cargo xtask soak --messages 20000");
    soak::run(&["--messages".to_owned(), "20000".to_owned()])?;
    println!("$ cargo xtask soak --messages 10000 --synchronous-commit-off");
    soak::run(&[
        "--messages".to_owned(),
        "10000".to_owned(),
        "--synchronous-commit-off".to_owned(),
    ])?;
    println!("xtask test: all checks passed");
    Ok(())
}
