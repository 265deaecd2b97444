//! The project's automation, shared by `cargo xtask` (set-up and
//! orchestration: this crate depends on no crate of the workspace, so
//! `cargo xtask` with no argument answers without building it) and the
//! end-to-end runs of `inbox-runs` (bench, demo, soak, scale, the
//! examples), which `cargo xtask` starts.
//!
//! ```no_run
//! // the PostgreSQL server binaries, installed when missing
//! xtask::setup::postgres()?;
//! xtask::cargo(&["run", "-p", "inbox-runs", "--", "scale"], &[])?;
//! # Ok::<(), anyhow::Error>(())
//! ```

pub mod setup;

use std::process::Command;

use anyhow::{Context, Result, bail};

/// Runs `cargo ARGS` in the workspace root with `env` set, printing the
/// command first.
///
/// # Errors
///
/// When cargo cannot be started or fails.
pub fn cargo(args: &[&str], env: &[(&str, &str)]) -> Result<()> {
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

/// The workspace's root directory.
pub fn workspace_root() -> std::path::PathBuf {
    let manifest = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .map_or_else(|| manifest.clone(), std::path::Path::to_path_buf)
}

/// Removes the sources cargo extracted from the local registries of earlier
/// `cargo package` and `cargo publish --dry-run` runs
/// (`$CARGO_HOME/registry/src/-<hash>/inbox-*`). cargo
/// names that registry after the target directory, and reuses an extracted
/// crate of the same name and version without looking at it again, so a
/// second run from the same checkout path built the dependents against the
/// first run's copy of `inbox-core` (seen: "could not find `outbox` in
/// `inbox_core`"). The packages themselves are made afresh each run.
///
/// # Errors
///
/// When a directory cannot be removed.
pub fn clear_packaged_sources() -> Result<()> {
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
