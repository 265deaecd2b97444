//! Out-of-range settings are refused with a typed error when a driver
//! starts, before it touches the store or the broker: a batch size of 0
//! would spin or do nothing for ever, a zero idle poll would spin.

use std::time::Duration;

use inbox_core::drivers::processor::{Processor, ProcessorConfig, ProcessorError};
use inbox_core::{BatchConfig, CancellationToken, Runner, RunnerConfig, ValidationError};
use inbox_testkit::scenarios::{Act, ScriptedHandler};
use inbox_testkit::{MemBroker, MemStore};

fn runner_config() -> RunnerConfig {
    RunnerConfig::new("billing", "worker-1").expect("config")
}

#[tokio::test]
async fn a_runner_refuses_an_out_of_range_configuration_at_start() {
    let mut idle = runner_config();
    idle.idle_poll = Duration::ZERO;
    let mut zero_batch = BatchConfig::new(10);
    zero_batch.max_messages = 0;
    let mut no_timeout = runner_config();
    no_timeout.handler_timeout = Duration::ZERO;
    for config in [idle, runner_config().batched(zero_batch), no_timeout] {
        let broker = MemBroker::new();
        let mut runner = Runner::new(
            MemStore::new(),
            broker.consumer("billing"),
            ScriptedHandler::new([], Act::Succeed),
            config,
        );
        // not cancelled: only the refusal ends it
        let run =
            tokio::time::timeout(Duration::from_secs(5), runner.run(CancellationToken::new()))
                .await
                .expect("refused at once");
        assert!(
            matches!(run, Err(ValidationError::Config { .. })),
            "{run:?}"
        );
    }
    let mut spent = runner_config().failure_budget(3);
    spent.failure_budget = Some(0);
    assert!(spent.validate().is_err());
    assert!(runner_config().failure_budget(3).validate().is_ok());
}

#[tokio::test]
async fn a_processor_refuses_a_batch_size_of_zero() {
    let mut config = ProcessorConfig::new("processor-1").expect("config");
    config.batch_size = 0;
    let mut processor = Processor::new(
        MemStore::new(),
        ScriptedHandler::new([], Act::Succeed),
        config,
    );
    assert!(matches!(
        processor.process_batch().await,
        Err(ProcessorError::Config(ValidationError::Config { .. }))
    ));
    let run = tokio::time::timeout(
        Duration::from_secs(5),
        processor.run(CancellationToken::new()),
    )
    .await
    .expect("refused at once");
    assert!(run.is_err(), "{run:?}");
}

#[test]
fn the_relay_configuration_is_checked() {
    use inbox_core::outbox::RelayConfig;
    let ok = RelayConfig::new("relay-1").expect("config");
    assert!(ok.validate().is_ok());
    let mut zero = ok.clone();
    zero.batch_size = 0;
    let mut poll = ok.clone();
    poll.poll_interval = Duration::ZERO;
    let mut lease = ok.clone();
    lease.session_timeout = lease.heartbeat;
    let mut bytes = ok.clone();
    bytes.max_round_bytes = 0;
    let mut group = ok;
    group.group = " ".into();
    for bad in [zero, poll, lease, bytes, group] {
        assert!(bad.validate().is_err(), "{bad:?}");
    }
}
