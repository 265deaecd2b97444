//! The text of a caught panic: the runner, the processor and the metrics
//! wrapper catch user code's panics and report them with it (a module of
//! its own, so that those modules need not import each other for it).

/// The text of a caught panic of the handler.
pub(crate) fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic_message(panic).unwrap_or_else(|| "handler panicked".to_owned())
}

/// The message of a caught panic (a `&str` or `String` payload), if it has
/// one: for the places that catch user code's panics (the handler, a
/// decoder, a `Metrics`, a runner task) to report them.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> Option<String> {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
}
