//! Starting tansu: its directory, its launch and the wait for it.

#[allow(clippy::wildcard_imports)]
use super::*;

/// The tansu binary, a temporary directory and a free address to listen on.
pub(super) fn prepare() -> Result<(PathBuf, PathBuf, String), HarnessError> {
    let tansu = tansu_binary().ok_or_else(|| {
        HarnessError(
            "tansu not found ($TANSU, ~/.cargo/bin, PATH): run `cargo xtask test`, which installs it, or set KAFKA_BROKERS".into(),
        )
    })?;
    let dir = temp_dir("inbox-tansu")?;
    let listen = format!("127.0.0.1:{}", free_port()?);
    Ok((tansu, dir, listen))
}

impl TansuLaunch {
    /// Starts `tansu` (storage relative to `dir`, logging to
    /// `dir/tansu.log`); waits until it listens. A reaper kills it when this
    /// process ends.
    pub(super) fn start(&self) -> Result<Child, HarnessError> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("tansu.log"))
            .map_err(|e| HarnessError(format!("creating the broker log: {e}")))?;
        let err = log
            .try_clone()
            .map_err(|e| HarnessError(format!("creating the broker log: {e}")))?;
        let mut cmd = Command::new(&self.tansu);
        cmd.current_dir(&self.dir)
            .args([
                "broker",
                "--listener-url",
                &format!("tcp://{}", self.listen),
            ])
            .args([
                "--advertised-listener-url",
                &format!("tcp://{}", self.advertised),
            ])
            // a relative sqlite path is taken from the working directory
            .args(["--storage-engine", &self.storage]);
        if self.authentication {
            cmd.arg("--authentication");
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .map_err(|e| HarnessError(format!("starting {}: {e}", self.tansu.display())))?;
        spawn_reaper(&format!("kill {}", child.id()), &self.dir);
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(&self.listen).is_err() {
            let exited = child.try_wait().ok().flatten();
            if exited.is_some() || Instant::now() > deadline {
                let log = std::fs::read_to_string(self.dir.join("tansu.log")).unwrap_or_default();
                return Err(HarnessError(format!(
                    "tansu did not listen on {} (exit: {exited:?}): {log}",
                    self.listen
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(child)
    }
}
