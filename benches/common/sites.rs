//! Where the memory at a peak was allocated: with [`enable`], every live allocation of
//! [`MIN_BYTES`] or more keeps the call stack that made it, and the live ones are copied each
//! time such an allocation sets a new high; [`report`] groups that copy by the first frames of
//! ffn's code in each stack (function names only, from the symbol table: inlined functions are
//! named by their callers).

use std::backtrace::Backtrace;
use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

/// The smallest allocation followed: a `[1024, 64]` f32 tensor.
pub const MIN_BYTES: usize = 256 << 10;

/// An allocation's size and the call stack that made it.
type Made = (usize, Arc<Backtrace>);

static ON: AtomicBool = AtomicBool::new(false);
/// The followed allocations live now, by address.
static LIVE: Mutex<Option<HashMap<usize, Made>>> = Mutex::new(None);
/// The followed allocations live at the highest peak so far.
static AT_PEAK: Mutex<Vec<Made>> = Mutex::new(Vec::new());

thread_local! {
    /// Set while this thread is inside [`made`] or [`freed`]: their own allocations are not
    /// followed.
    static BUSY: Cell<bool> = const { Cell::new(false) };
}

/// Follows allocations from now on.
pub fn enable() {
    ON.store(true, Relaxed);
}

/// Runs `f` unless this thread is inside it already or nothing is followed.
fn guarded(bytes: usize, f: impl FnOnce()) {
    if bytes < MIN_BYTES || !ON.load(Relaxed) || BUSY.with(|b| b.replace(true)) {
        return;
    }
    f();
    BUSY.with(|b| b.set(false));
}

/// `bytes` allocated at `addr`; `peak` when the live bytes are at their highest so far.
pub fn made(addr: usize, bytes: usize, peak: bool) {
    guarded(bytes, || {
        let stack = Arc::new(Backtrace::force_capture());
        let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
        let live = live.get_or_insert_with(HashMap::new);
        live.insert(addr, (bytes, stack));
        if peak {
            *AT_PEAK.lock().unwrap_or_else(|e| e.into_inner()) = live.values().cloned().collect();
        }
    });
}

/// The allocation at `addr` freed.
pub fn freed(addr: usize, bytes: usize) {
    guarded(bytes, || {
        if let Some(live) = LIVE.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            live.remove(&addr);
        }
    });
}

/// The allocations live at the peak, grouped by where ffn's code made them, largest first: a
/// line each, MiB, count, and up to three frames (innermost first).
pub fn report() -> String {
    BUSY.with(|b| b.set(true));
    let at_peak = AT_PEAK.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut by_site: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for (bytes, stack) in at_peak {
        let text = stack.to_string();
        let frames: Vec<&str> = text
            .lines()
            .filter_map(|l| l.trim_start().split_once(": "))
            .filter(|(n, _)| n.chars().all(|c| c.is_ascii_digit()))
            .map(|(_, f)| f)
            .filter(|f| f.contains("ffn") && !f.contains("alloc::"))
            .take(3)
            .collect();
        let site = by_site.entry(frames.join(" < ")).or_default();
        site.0 += bytes;
        site.1 += 1;
    }
    let mut sites: Vec<_> = by_site.into_iter().collect();
    sites.sort_by_key(|(_, (bytes, _))| std::cmp::Reverse(*bytes));
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let total: usize = sites.iter().map(|(_, (b, _))| b).sum();
    let mut out = format!(
        "allocations of {} KiB or more live at the peak: {:.1} MiB\n",
        MIN_BYTES >> 10,
        mib(total)
    );
    for (site, (bytes, count)) in sites {
        out += &format!("{:8.2} MiB {count:4}×  {site}\n", mib(bytes));
    }
    BUSY.with(|b| b.set(false));
    out
}
