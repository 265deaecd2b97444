//! `cargo xtask pooler`: the suites that carry the consumer (per message
//! and batched), the relay, the processor, the dead-letter replay and the
//! `inbox` command run again through PgBouncer in transaction pooling mode
//! (Debian's 1.18), in front of a throwaway PostgreSQL: `DATABASE_URL`
//! names the pooler, with `pgbouncer=true`.

use anyhow::{Result, anyhow};

/// The suites, as `cargo test` arguments, with the handlers that end the
/// inbox's transaction themselves (`ended.rs`, `ended_then_failed.rs`:
/// behind a pooler the transaction's server connection goes back to the
/// pool at their `COMMIT`, so the checks after it go in the simple
/// protocol, one exchange the pooler cannot split). Left out: the plan and round-trip counts (`round_trips.rs`, the unit
/// tests: a pooler adds its own), and `migrations.rs` (a sea-orm migrator
/// of the service's own, which docs/postgres.md says to run on a direct
/// connection), and one processor test whose premise is a fresh session
/// (the pooler's server connections outlive the test's pool).
const SUITES: &[&[&str]] = &[
    &[
        "-p",
        "inbox-postgres",
        "--test",
        "scenarios",
        "--test",
        "processor",
        "--test",
        "dead_letters",
        "--test",
        "conformance",
        "--test",
        "outbox_conformance",
        "--test",
        "writers",
        "--test",
        "sqlx",
        "--test",
        "crash",
        "--test",
        "membership",
        "--test",
        "owned_offsets",
        "--test",
        "transient",
        "--test",
        "integrity",
        "--test",
        "aborted",
        "--test",
        "ended",
        "--test",
        "ended_then_failed",
        "--test",
        "refused_commit",
        "--",
        // sets the database's synchronous_commit for new sessions: the
        // pooler's server connections were opened before
        "--skip",
        "the_claims_asynchronous_commit_stays_with_the_claim",
    ],
    &[
        "-p",
        "inbox-kafka",
        "--all-features",
        "--test",
        "e2e",
        "--test",
        "outbox",
        "--test",
        "smoke",
    ],
    &[
        "-p",
        "transactional-inbox",
        "--all-features",
        "--test",
        "cli",
    ],
];

/// Starts PostgreSQL and PgBouncer, then runs [`SUITES`] through it.
pub(crate) fn run() -> Result<()> {
    let server = inbox_testkit::pg::PgServer::start_dedicated(
        "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=500",
    )
    .map_err(|e| anyhow!("{e}"))?;
    let bouncer = inbox_testkit::pg::PgBouncer::start(&server, 10).map_err(|e| anyhow!("{e}"))?;
    let url = bouncer.url().to_owned();
    for suite in SUITES {
        let mut args = vec!["test"];
        args.extend_from_slice(suite);
        crate::cargo(&args, &[("DATABASE_URL", &url)])?;
    }
    println!(
        "pooler passed: {} suites through PgBouncer in transaction mode",
        SUITES.len()
    );
    Ok(())
}
