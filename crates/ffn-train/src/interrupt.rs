//! # Stopping cleanly
//!
//! SIGINT and SIGTERM (the binary's handler calls [`request_stop`]) ask a running training
//! loop ([`crate::Trainer::run`]) or sweep to stop after its current step: the loop writes a
//! checkpoint and returns [`crate::Error::Interrupted`], so that `resume` continues exactly.

use std::sync::atomic::{AtomicBool, Ordering};

/// Set by [`request_stop`].
static STOP: AtomicBool = AtomicBool::new(false);

/// Asks a running training loop or sweep to stop cleanly after its current step. Only an
/// atomic store: safe in a signal handler.
pub fn request_stop() {
    STOP.store(true, Ordering::SeqCst);
}

/// Whether [`request_stop`] was called.
pub fn stop_requested() -> bool {
    STOP.load(Ordering::SeqCst)
}
