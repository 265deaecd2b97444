//! The `inbox` binary run as an operator runs it, for the demo and the
//! examples: built once, then each command printed with what it printed.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};

/// Where cargo puts its builds (`CARGO_TARGET_DIR`, or the workspace's
/// `target`).
pub(crate) fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| crate::workspace_root().join("target"), Into::into)
}

/// The built `inbox` binary, on one inbox table.
pub(crate) struct Operator {
    exe: PathBuf,
    table: &'static str,
}

impl Operator {
    /// Builds the binary (the facade's `cli` feature); its commands name
    /// the inbox table `table`.
    pub(crate) fn build(table: &'static str) -> Result<Self> {
        crate::cargo(
            &[
                "build",
                "-p",
                "transactional-inbox",
                "--features",
                "cli",
                "--bin",
                "inbox",
            ],
            &[],
        )?;
        Ok(Self {
            exe: target_dir().join("debug/inbox"),
            table,
        })
    }

    /// Runs `inbox --table TABLE ARGS` on the database `url` (and the
    /// brokers, when given), prints the command and what it printed; what
    /// it printed, if it succeeded.
    pub(crate) async fn run(
        &self,
        url: &str,
        brokers: Option<&str>,
        args: &[&str],
    ) -> Result<String> {
        println!("  $ inbox {}", args.join(" "));
        let mut command = tokio::process::Command::new(&self.exe);
        command
            .args(["--table", self.table])
            .args(args)
            .env("DATABASE_URL", url)
            .env_remove("KAFKA_BROKERS");
        if let Some(brokers) = brokers {
            command.env("KAFKA_BROKERS", brokers);
        }
        let out = command
            .output()
            .await
            .with_context(|| format!("starting {}", self.exe.display()))?;
        let printed = String::from_utf8_lossy(&out.stdout).into_owned();
        for line in printed.lines() {
            println!("    {line}");
        }
        if !out.status.success() {
            bail!(
                "inbox {} failed ({}): {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(printed)
    }
}
