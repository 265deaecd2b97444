//! docs/getting-started.md as a program: its first TOML block is a new
//! crate's `[dependencies]` and its Rust blocks, in order, that crate's
//! `src/main.rs`. [`build`] writes the crate outside the workspace (under
//! `target/getting-started`, a workspace of its own), the facade's registry
//! dependency replaced by a path to this checkout's, and builds it;
//! `cargo xtask examples` runs what it built.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// The guide's path in the repository.
const GUIDE: &str = "docs/getting-started.md";

/// The package name of the assembled crate (its binary's name too).
pub(crate) const PACKAGE: &str = "getting-started";

/// The crate a reader of the guide would write: its `Cargo.toml` and its
/// `src/main.rs`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Assembled {
    pub(crate) manifest: String,
    pub(crate) main: String,
}

/// The guide's fenced blocks whose info string starts with `lang`, in
/// order (`rust` takes `rust,ignore` too).
fn blocks<'a>(guide: &'a str, lang: &str) -> Vec<&'a str> {
    let mut out = Vec::new();
    let mut rest = guide;
    while let Some(start) = rest.find("```") {
        let after = &rest[start + 3..];
        let Some(line_end) = after.find('\n') else {
            break;
        };
        let info = after[..line_end].trim();
        let body = &after[line_end + 1..];
        let Some(end) = body.find("```") else {
            break;
        };
        let tag = info.split(',').next().unwrap_or_default();
        if tag == lang {
            out.push(&body[..end]);
        }
        rest = &body[end + 3..];
    }
    out
}

/// Assembles the guide's crate; `facade` is the directory of this
/// checkout's facade crate, which stands in for the registry's.
///
/// # Errors
///
/// A guide without a TOML block, without the facade's dependency line or
/// without Rust blocks.
pub(crate) fn assemble(guide: &str, facade: &Path) -> Result<Assembled> {
    let toml = blocks(guide, "toml");
    let Some(dependencies) = toml.first() else {
        bail!("{GUIDE} has no TOML block");
    };
    if !dependencies.trim_start().starts_with("[dependencies]") {
        bail!("{GUIDE}'s first TOML block is not a [dependencies] table");
    }
    let from = "transactional-inbox = { version = \"0.1\"";
    if !dependencies.contains(from) {
        bail!("{GUIDE}'s dependencies do not name the facade ({from} ...)");
    }
    let path = facade.display().to_string().replace('\\', "/");
    let dependencies =
        dependencies.replace(from, &format!("transactional-inbox = {{ path = \"{path}\""));
    let manifest = format!(
        "[package]\nname = \"{PACKAGE}\"\nversion = \"0.1.0\"\nedition = \"2024\"\npublish = false\n\n\
         # a workspace of its own: built as a crate outside this repository's\n[workspace]\n\n{dependencies}"
    );
    let rust = blocks(guide, "rust");
    if rust.is_empty() {
        bail!("{GUIDE} has no Rust block");
    }
    Ok(Assembled {
        manifest,
        main: rust.join("\n"),
    })
}

/// Writes the guide's crate under `target/getting-started` (this
/// workspace's lock file copied in, so it resolves the same versions),
/// builds it into the workspace's target directory, and returns the
/// binary.
pub(crate) fn build() -> Result<PathBuf> {
    let root = crate::workspace_root();
    let guide =
        std::fs::read_to_string(root.join(GUIDE)).with_context(|| format!("reading {GUIDE}"))?;
    let crate_ = assemble(&guide, &root.join("inbox"))?;
    let target = crate::operator::target_dir();
    let dir = target.join(PACKAGE);
    std::fs::create_dir_all(dir.join("src"))?;
    std::fs::write(dir.join("Cargo.toml"), &crate_.manifest)?;
    std::fs::write(dir.join("src/main.rs"), &crate_.main)?;
    let lock = root.join("Cargo.lock");
    if lock.exists() && !dir.join("Cargo.lock").exists() {
        std::fs::copy(&lock, dir.join("Cargo.lock"))?;
    }
    // the program a reader copies is formatted as rustfmt would
    let status = std::process::Command::new("rustfmt")
        .args(["--check", "--edition", "2024"])
        .arg(dir.join("src/main.rs"))
        .status()
        .context("running rustfmt on the guide's program")?;
    if !status.success() {
        bail!(
            "{GUIDE}'s Rust blocks, put together, are not formatted as rustfmt would (see above)"
        );
    }
    let manifest = dir.join("Cargo.toml").display().to_string();
    let target_dir = target.display().to_string();
    println!(
        "$ (docs/getting-started.md assembled into {}: {} lines of Rust)",
        dir.display(),
        crate_.main.lines().count()
    );
    crate::cargo(
        &["build", "--manifest-path", &manifest],
        &[("CARGO_TARGET_DIR", &target_dir)],
    )?;
    Ok(target.join("debug").join(PACKAGE))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The blocks are taken in order, by their language, `rust,ignore`
    /// included; the facade's line points at the checkout.
    #[test]
    fn a_guide_assembles_into_a_manifest_and_a_main() {
        let guide = "# G\n\n```toml\n[dependencies]\ntransactional-inbox = { version = \"0.1\", features = [\"metrics\"] }\n```\n\ntext\n\n```rust,ignore\nfn main() {\n```\n\n```sh\ncargo run\n```\n\n```rust\n}\n```\n";
        let a = assemble(guide, Path::new("/repo/inbox")).expect("assembles");
        assert!(
            a.manifest.contains(
                "transactional-inbox = { path = \"/repo/inbox\", features = [\"metrics\"] }"
            ),
            "{}",
            a.manifest
        );
        assert!(a.manifest.contains("[workspace]"), "{}", a.manifest);
        assert_eq!(a.main, "fn main() {\n\n}\n");
        assert!(assemble("no blocks", Path::new("/x")).is_err());
        let registry_only =
            "```toml\n[dependencies]\ntokio = \"1\"\n```\n```rust\nfn main() {}\n```\n";
        assert!(assemble(registry_only, Path::new("/x")).is_err());
    }

    /// The real guide assembles: a main function, the handler, the relay.
    #[test]
    fn the_guide_is_one_program() {
        let root = crate::workspace_root();
        let guide = std::fs::read_to_string(root.join(GUIDE)).expect("the guide");
        let a = assemble(&guide, &root.join("inbox")).expect("assembles");
        for part in [
            "async fn main()",
            "impl EventHandler<OrderCreated, PgTx> for Billing",
            "OutboxRelay::new",
            "InboxConsumer::new",
            "DeadLetterReplayer::new",
        ] {
            assert!(a.main.contains(part), "the guide's program lacks {part}");
        }
    }
}
