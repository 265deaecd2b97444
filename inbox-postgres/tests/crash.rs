//! A job whose handler kills its process (here `std::process::abort`, as
//! a stack overflow or an out-of-memory kill would) is charged, so it fails
//! within its `max_attempts` and its neighbours complete: the processor
//! notes the rows it runs before their handlers (`note_running`), and a
//! start after a crash runs the rows of the crashed batch one at a time,
//! charging the one it was running alone when the process died. It used to
//! be taken again for ever, with its whole batch. A child process (this
//! test binary, running the ignored `crash_child`) is started again after
//! each crash, as a supervisor would, by row lock and by lease, on a real
//! PostgreSQL.

mod common;

use std::process::Command;
use std::time::Duration;

use async_trait::async_trait;
use inbox_core::drivers::processor::{ClaimMode, Processor, ProcessorConfig};
use inbox_core::{Backoff, Handler, HandlerError, Message};
use inbox_postgres::{PgStore, PgTx, TableName};
use inbox_testkit::pg::fresh_store_at;
use inbox_testkit::scenarios::{ScenarioStore, WriteInvoice};

const CHILD_URL: &str = "INBOX_CRASH_CHILD_URL";
const CHILD_LEASE: &str = "INBOX_CRASH_CHILD_LEASE";
const MAX_ATTEMPTS: i32 = 3;

/// Invoices each order; aborts the process on `kill-` orders, after its
/// invoice (which must never commit).
struct Killer;

#[async_trait]
impl Handler<PgTx> for Killer {
    type Output = ();
    async fn handle(&self, m: &Message, tx: &mut PgTx) -> Result<(), HandlerError> {
        tx.write_invoice(&m.message_id).await?;
        if m.message_id.starts_with("kill-") {
            eprintln!("crash_child: {} aborts the process", m.message_id);
            std::process::abort();
        }
        Ok(())
    }
}

fn ids() -> Vec<String> {
    (0..10)
        .map(|i| {
            if i == 3 {
                format!("kill-{i}")
            } else {
                format!("ok-{i}")
            }
        })
        .collect()
}

/// Drains the rows of the database `INBOX_CRASH_CHILD_URL` names, batches
/// of 10, as member `crash-child`; exits when none is due. Run only as the
/// child of [`a_job_that_kills_its_process_is_failed_within_its_attempts`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child process of a_job_that_kills_its_process_is_failed_within_its_attempts"]
async fn crash_child() {
    let Ok(url) = std::env::var(CHILD_URL) else {
        panic!("crash_child is run by a_job_that_kills_its_process_is_failed_within_its_attempts");
    };
    let store = PgStore::connect(&url, TableName::default())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut config = ProcessorConfig::new("crash-child").unwrap_or_else(|e| panic!("{e}"));
    config.batch_size = 10;
    config.rules.backoff = Backoff::new(Duration::ZERO, Duration::ZERO, 1.0);
    if std::env::var(CHILD_LEASE).is_ok() {
        config.claim = ClaimMode::Lease;
    }
    let mut processor = Processor::new(store, Killer, config);
    for _ in 0..100 {
        let batch = processor
            .process_batch()
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        if batch.claimed == 0 {
            return;
        }
    }
    panic!("crash_child: still rows after 100 batches");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_kills_its_process_is_failed_within_its_attempts() {
    let me = std::env::current_exe().unwrap_or_else(|e| panic!("{e}"));
    for lease in [false, true] {
        let how = if lease { "by lease" } else { "by row lock" };
        let (url, store) = fresh_store_at(TableName::default())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        common::land(&store, "billing", &ids(), MAX_ATTEMPTS).await;

        let mut crashes = 0;
        loop {
            let mut child = Command::new(&me);
            child
                .args(["--ignored", "--exact", "crash_child", "--test-threads=1"])
                .env(CHILD_URL, &url);
            if lease {
                child.env(CHILD_LEASE, "1");
            }
            let run = child.output().unwrap_or_else(|e| panic!("{e}"));
            if run.status.success() {
                break;
            }
            crashes += 1;
            assert!(
                crashes <= 2 * MAX_ATTEMPTS + 2,
                "{how}: the job is charged, so the crashes end ({crashes} so far)"
            );
        }
        let (status, attempts) = row(&store, "kill-3").await;
        assert_eq!(
            (status.as_str(), attempts),
            ("failed", i64::from(MAX_ATTEMPTS)),
            "{how}: failed within its attempts"
        );
        assert_eq!(
            store.invoices("kill-3").await,
            0,
            "{how}: none of its writes"
        );
        for id in ids().iter().filter(|i| i.starts_with("ok-")) {
            assert_eq!(row(&store, id).await.0, "completed", "{how}: {id}");
            assert_eq!(store.invoices(id).await, 1, "{how}: {id} handled once");
        }
        assert!(
            crashes >= 3,
            "{how}: it crashed each time it ran ({crashes})"
        );
    }
}

async fn row(store: &PgStore, id: &str) -> (String, i64) {
    common::row_of(store, "billing", id).await
}
