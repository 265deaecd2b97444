//! The docs name settings, metrics, environment variables and the
//! command's flags: each one they name exists in the code. A setting
//! renamed in the code and left in the docs fails here (issue 59).
//!
//! Read from `docs/*.md`, the READMEs and `CHANGELOG.md` is left out (it
//! names what was renamed, on purpose).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| panic!("the workspace root"))
}

/// Every file under `dir` ending in `ext`, recursively (no `target`).
fn files(dir: &Path, ext: &str, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        if path.is_dir() {
            if name != "target" && !name.to_string_lossy().starts_with('.') {
                files(&path, ext, out);
            }
        } else if path.extension().is_some_and(|e| e == ext) {
            out.push(path);
        }
    }
}

/// The docs a user reads: docs/*.md and the READMEs.
fn docs() -> Vec<(String, String)> {
    let root = root();
    let mut paths = Vec::new();
    files(&root.join("docs"), "md", &mut paths);
    for readme in [
        "README.md",
        "inbox/README.md",
        "inbox-core/README.md",
        "inbox-kafka/README.md",
        "inbox-postgres/README.md",
    ] {
        let p = root.join(readme);
        if p.exists() {
            paths.push(p);
        }
    }
    paths
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{p:?}: {e}"));
            (p.display().to_string(), text)
        })
        .collect()
}

/// The library and command sources, as one text.
fn sources() -> String {
    let root = root();
    let mut paths = Vec::new();
    for krate in [
        "inbox-core",
        "inbox-postgres",
        "inbox-kafka",
        "inbox-testkit",
        "inbox",
    ] {
        files(&root.join(krate).join("src"), "rs", &mut paths);
    }
    paths
        .iter()
        .map(|p| std::fs::read_to_string(p).unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n")
}

/// The spans in backticks of `text`.
fn ticked(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

/// The configuration types whose settings the docs name as
/// `Type::setting` or `Type.setting`.
const CONFIGS: [&str; 11] = [
    "RunnerConfig",
    "BatchConfig",
    "GroupConfig",
    "KafkaConfig",
    "RelayConfig",
    "MaintenanceConfig",
    "ProcessorConfig",
    "InboxConsumer",
    "OutboxRelay",
    "KafkaPublisher",
    "DeadLetterReplayer",
];

/// `Type::name` for the configuration types, from spans like
/// `RunnerConfig::handler_timeout` or `RunnerConfig::failure_budget(3)`.
fn settings_named(text: &str) -> BTreeSet<(String, String)> {
    let mut out = BTreeSet::new();
    for span in ticked(text) {
        for ty in CONFIGS {
            for sep in ["::", "."] {
                let mut rest = span;
                while let Some(at) = rest.find(&format!("{ty}{sep}")) {
                    // the whole type name, not a longer one ending in it
                    let before = rest[..at].chars().next_back();
                    rest = &rest[at + ty.len() + sep.len()..];
                    if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                        continue;
                    }
                    let name: String = rest
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    if name.starts_with(|c: char| c.is_ascii_lowercase()) {
                        out.insert((ty.to_owned(), name));
                    }
                }
            }
        }
    }
    out
}

/// Whether the sources define `name` as a public method or field.
fn defined(sources: &str, name: &str) -> bool {
    [
        format!("pub fn {name}("),
        format!("pub fn {name}<"),
        format!("pub async fn {name}("),
        format!("pub {name}:"),
        format!("pub(crate) {name}:"),
    ]
    .iter()
    .any(|p| sources.contains(p.as_str()))
}

#[test]
fn every_setting_the_docs_name_exists() {
    let sources = sources();
    let mut missing = Vec::new();
    let mut seen = 0;
    for (path, text) in docs() {
        for (ty, name) in settings_named(&text) {
            seen += 1;
            if !defined(&sources, &name) {
                missing.push(format!("{path}: {ty}::{name}"));
            }
        }
    }
    assert!(seen > 30, "the docs name settings: found only {seen}");
    assert_eq!(
        missing,
        Vec::<String>::new(),
        "named in the docs, not in the code"
    );
}

/// Metric names: `inbox_...` spans ending in `_total`, `_seconds`, or
/// naming a gauge the docs list.
#[test]
fn every_metric_the_docs_name_is_recorded() {
    let sources = sources();
    let mut missing = BTreeSet::new();
    let mut seen = 0;
    for (path, text) in docs() {
        for span in ticked(&text) {
            // a metric, possibly with its labels: inbox_x_total{outcome="y"}
            let name: String = span
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            let metric = name.starts_with("inbox_")
                && (name.ends_with("_total")
                    || name.ends_with("_seconds")
                    || name.ends_with("_keys")
                    || name.ends_with("_lag")
                    || name.ends_with("_bytes"));
            if !metric {
                continue;
            }
            seen += 1;
            if !sources.contains(&format!("\"{name}\"")) {
                missing.insert(format!("{path}: {name}"));
            }
        }
    }
    assert!(seen > 5, "the docs name metrics: found only {seen}");
    assert_eq!(
        missing,
        BTreeSet::new(),
        "named in the docs, never recorded"
    );
}

/// Environment variables the docs name (`INBOX_...`, `DATABASE_URL`,
/// `KAFKA_...`) are read by the code (or its tests' harness).
#[test]
fn every_environment_variable_the_docs_name_is_read() {
    let mut sources = sources();
    for extra in ["xtask/src", "runs/src", ".ci"] {
        let mut paths = Vec::new();
        files(&root().join(extra), "rs", &mut paths);
        files(&root().join(extra), "sh", &mut paths);
        for p in paths {
            sources.push_str(&std::fs::read_to_string(p).unwrap_or_default());
        }
    }
    if let Ok(run) = std::fs::read_to_string(root().join(".ci/run")) {
        sources.push_str(&run);
    }
    let mut missing = BTreeSet::new();
    for (path, text) in docs() {
        for span in ticked(&text) {
            let name: String = span
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            let env = name.len() > 4
                && (name.starts_with("INBOX_")
                    || name.starts_with("KAFKA_")
                    || name == "DATABASE_URL");
            if env && !sources.contains(&name) {
                missing.insert(format!("{path}: {name}"));
            }
        }
    }
    assert_eq!(missing, BTreeSet::new(), "named in the docs, read nowhere");
}

/// The flags of the `inbox` command in the docs' examples (lines that
/// run `inbox ...`) are flags of the command.
#[test]
fn every_flag_of_the_command_the_docs_use_exists() {
    let mut cli = String::new();
    let mut paths = Vec::new();
    files(&root().join("inbox/src/bin"), "rs", &mut paths);
    for p in paths {
        cli.push_str(&std::fs::read_to_string(p).unwrap_or_default());
    }
    let mut missing = BTreeSet::new();
    let mut seen = 0;
    for (path, text) in docs() {
        // the command as the docs write it: `inbox ...` in backticks, a
        // line that runs it, or what follows `--bin inbox --`
        let mut uses: Vec<&str> = ticked(&text)
            .into_iter()
            .filter(|s| s.starts_with("inbox "))
            .collect();
        for line in text.lines() {
            let line = line.trim_start().trim_start_matches("$ ");
            if line.starts_with("inbox ") {
                uses.push(line);
            } else if let Some((_, args)) = line.split_once("--bin inbox -- ") {
                uses.push(args);
            }
        }
        for line in uses {
            for word in line.split_whitespace() {
                let Some(flag) = word.strip_prefix("--") else {
                    continue;
                };
                let flag: String = flag
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                    .collect();
                if flag.is_empty() || flag == "help" {
                    continue;
                }
                seen += 1;
                // clap's derive: a field `dry_run` is `--dry-run`
                let field = flag.replace('-', "_");
                let known = cli.contains(&format!("{field}:"))
                    || cli.contains(&format!("\"{flag}\""))
                    || cli.contains(&format!("long = \"{flag}\""));
                if !known {
                    missing.insert(format!("{path}: --{flag}"));
                }
            }
        }
    }
    assert!(
        seen > 5,
        "the docs use the command's flags: found only {seen}"
    );
    assert_eq!(
        missing,
        BTreeSet::new(),
        "flags in the docs the command lacks"
    );
}
