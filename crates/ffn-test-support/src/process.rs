//! Tests that need the process to themselves.

use std::process::Command;

/// The variable that tells a test binary's child which test it runs alone.
const ALONE: &str = "FFN_TEST_ALONE";

/// Runs `body` in a process of its own. The tests of a binary share one process, and some of
/// its state is process-wide (burn's device RNG: another test drawing between a seed and a draw
/// changes what is drawn). So the test binary runs itself again with only the test `test` of
/// module `module` (pass `module_path!()`) selected, and `body` runs there; the test here passes
/// when that one does.
pub fn alone(module: &str, test: &str, body: impl FnOnce()) {
    // `module_path!()` starts with the test binary's crate name, which test names leave out.
    let name = match module.split_once("::") {
        Some((_, path)) => format!("{path}::{test}"),
        None => test.to_string(),
    };
    if std::env::var(ALONE).as_deref() == Ok(name.as_str()) {
        body();
        return;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = Command::new(exe)
        .args([name.as_str(), "--exact", "--test-threads=1", "--nocapture"])
        .env(ALONE, &name)
        .output()
        .expect("the test binary runs again");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{name}, alone in its own process, failed:\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("1 passed"),
        "{name} did not run in its own process:\n{stdout}"
    );
}
