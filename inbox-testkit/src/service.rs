//! What the throwaway services share: temporary directories, free ports,
//! running commands, and a reaper that cleans up when the test process ends.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

/// Why a test service (PostgreSQL, the broker) could not be had.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HarnessError(pub String);

impl std::fmt::Display for HarnessError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "test service unavailable: {}", self.0)
    }
}

impl std::error::Error for HarnessError {}

/// Whether this process runs as root.
pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// A fresh directory under the system temp dir, named after `prefix`, this
/// process and the time.
pub(crate) fn temp_dir(prefix: &str) -> Result<PathBuf, HarnessError> {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!("{prefix}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir)
        .map_err(|e| HarnessError(format!("creating {}: {e}", dir.display())))?;
    Ok(dir)
}

/// A TCP port on 127.0.0.1 that was free a moment ago.
pub(crate) fn free_port() -> Result<u16, HarnessError> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| HarnessError(format!("finding a free port: {e}")))
}

/// Runs `cmd` to completion; its output becomes the error on failure.
pub(crate) fn run(mut cmd: Command, what: &str) -> Result<(), HarnessError> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| HarnessError(format!("{what}: {e}")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(HarnessError(format!(
            "{what} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )))
    }
}

/// Starts a detached shell that waits for this process to end, then runs
/// `stop` and removes `dir`.
pub(crate) fn spawn_reaper(stop: &str, dir: &Path) {
    let pid = std::process::id();
    let script = format!(
        "while kill -0 {pid} 2>/dev/null; do sleep 0.5; done; {stop} >/dev/null 2>&1; rm -rf '{}'",
        dir.display()
    );
    let spawned = Command::new("setsid")
        .args(["sh", "-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    if spawned.is_err() {
        // Without setsid, a plain sh still outlives us as an orphan.
        let _ = Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
    }
}
