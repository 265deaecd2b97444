//! Installs what the tests and the demo need on a fresh machine, so the
//! README's two commands work as they are: the PostgreSQL server binaries
//! (and a `postgres` user, since `initdb` refuses root).

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

fn has_pg_server() -> bool {
    std::fs::read_dir("/usr/lib/postgresql")
        .map(|dirs| dirs.flatten().any(|d| d.path().join("bin/initdb").exists()))
        .unwrap_or(false)
}

fn sh(cmd: &str) -> Result<()> {
    println!("$ {cmd}");
    let status = Command::new("sh")
        .args(["-c", cmd])
        .status()
        .with_context(|| format!("running {cmd}"))?;
    if !status.success() {
        bail!("{cmd} failed ({status})");
    }
    Ok(())
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Makes sure a PostgreSQL can be started (or `DATABASE_URL` is set).
pub(crate) fn postgres() -> Result<()> {
    if std::env::var("DATABASE_URL").is_ok_and(|u| !u.is_empty()) {
        return Ok(());
    }
    if !has_pg_server() {
        if !is_root() || !Path::new("/usr/bin/apt-get").exists() {
            bail!(
                "the PostgreSQL server binaries are missing (no /usr/lib/postgresql/*/bin/initdb): install them or set DATABASE_URL"
            );
        }
        println!("setup: PostgreSQL server binaries missing, installing them with apt-get");
        sh("apt-get update -qq")?;
        sh("DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql")?;
    }
    if is_root()
        && !Command::new("id")
            .arg("postgres")
            .output()
            .is_ok_and(|o| o.status.success())
    {
        println!("setup: creating the postgres user (initdb refuses to run as root)");
        sh("useradd --system --home-dir /var/lib/postgresql --shell /bin/bash postgres")?;
    }
    Ok(())
}
