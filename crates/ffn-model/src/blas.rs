//! # A tuned SGEMM, found at run time
//!
//! On the CPU the FFN's time is its matrix products. Flex computes them with the `gemm` crate;
//! an optimised BLAS (OpenBLAS, BLIS, Accelerate, MKL) is faster on the FFN's shapes (BENCHMARKS.md).
//! This module loads one at run time with `dlopen`, so nothing has to be installed to build or
//! run ffn: without a library the op uses Flex's own matrix product.
//!
//! - `FFN_BLAS=off` (or `0`, `none`) never loads one; `FFN_BLAS=/path/to/libfoo.so` loads that
//!   file only; unset, the first of [`CANDIDATES`] that loads is used.
//! - `FFN_BLAS_THREADS=rayon` (the default) runs the library single-threaded and splits each
//!   product into one block per rayon thread, so the library's threads never compete with
//!   Flex's rayon pool; `FFN_BLAS_THREADS=blas` leaves the threading to the library.

use std::cell::Cell;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::sync::OnceLock;

/// Shared libraries tried in turn when `FFN_BLAS` is unset.
pub const CANDIDATES: &[&str] = &[
    "libopenblas.so.0",
    "libopenblas.so",
    "libblis.so.4",
    "libblis.so",
    "libmkl_rt.so.2",
    "libmkl_rt.so",
    "/System/Library/Frameworks/Accelerate.framework/Accelerate",
    "libopenblas.dylib",
];

const ROW_MAJOR: c_int = 101;
const NO_TRANS: c_int = 111;
const TRANS: c_int = 112;

type CblasSgemm = unsafe extern "C" fn(
    layout: c_int,
    trans_a: c_int,
    trans_b: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: f32,
    a: *const f32,
    lda: c_int,
    b: *const f32,
    ldb: c_int,
    beta: f32,
    c: *mut f32,
    ldc: c_int,
);
type SetThreads = unsafe extern "C" fn(c_int);

/// A loaded BLAS: its `cblas_sgemm` and how to thread it.
#[derive(Debug)]
pub struct Blas {
    sgemm: CblasSgemm,
    /// The file it was loaded from.
    pub path: String,
    /// Whether products are split over rayon's threads (the library then runs single-threaded).
    pub rayon: bool,
}

/// A matrix operand: a row-major `rows × cols` matrix at `ptr` with row stride `ld`, used as is
/// or transposed.
#[derive(Debug, Clone, Copy)]
pub struct Operand {
    pub ptr: *const f32,
    pub ld: usize,
    pub trans: bool,
}

// SAFETY: an operand is read only, and lives while the product that reads it runs.
unsafe impl Send for Operand {}
unsafe impl Sync for Operand {}

/// The BLAS this process uses, loaded on first use; `None` if there is none.
pub fn get() -> Option<&'static Blas> {
    static BLAS: OnceLock<Option<Blas>> = OnceLock::new();
    BLAS.get_or_init(load).as_ref()
}

fn load() -> Option<Blas> {
    let setting = std::env::var("FFN_BLAS").unwrap_or_default();
    let rayon = std::env::var("FFN_BLAS_THREADS").map_or(true, |v| v != "blas");
    let candidates: Vec<&str> = match setting.trim() {
        "" => CANDIDATES.to_vec(),
        "off" | "0" | "none" => return None,
        path => vec![path],
    };
    candidates.into_iter().find_map(|path| open(path, rayon))
}

fn open(path: &str, rayon: bool) -> Option<Blas> {
    let name = CString::new(path).ok()?;
    // SAFETY: dlopen with a valid C string; the handle is kept for the life of the process.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return None;
    }
    // OpenBLAS as PyPI's `scipy-openblas32` ships it prefixes every symbol with `scipy_`.
    let (sgemm, prefix) = match symbol(handle, c"cblas_sgemm") {
        Some(sgemm) => (sgemm, ""),
        None => (symbol(handle, c"scipy_cblas_sgemm")?, "scipy_"),
    };
    // SAFETY: `cblas_sgemm` has this C signature in every CBLAS.
    let sgemm: CblasSgemm = unsafe { std::mem::transmute::<*mut c_void, CblasSgemm>(sgemm) };
    if rayon {
        for setter in [
            "openblas_set_num_threads",
            "bli_thread_set_num_threads",
            "MKL_Set_Num_Threads",
        ] {
            let setter = CString::new(format!("{prefix}{setter}")).expect("no NUL");
            if let Some(set) = symbol(handle, &setter) {
                // SAFETY: each of these takes one C int.
                unsafe { std::mem::transmute::<*mut c_void, SetThreads>(set)(1) };
            }
        }
    }
    Some(Blas {
        sgemm,
        path: path.to_string(),
        rayon,
    })
}

fn symbol(handle: *mut c_void, name: &CStr) -> Option<*mut c_void> {
    // SAFETY: a valid handle and C string.
    let ptr = unsafe { libc::dlsym(handle, name.as_ptr() as *const c_char) };
    (!ptr.is_null()).then_some(ptr)
}

thread_local! {
    /// Set while this thread runs [`unsplit`] work.
    static UNSPLIT: Cell<bool> = const { Cell::new(false) };
}

/// Runs `work` with every product on this thread in one library call, not split over
/// rayon's threads (for work that is itself one of several pieces run in parallel).
pub fn unsplit<T>(work: impl FnOnce() -> T) -> T {
    let before = UNSPLIT.with(|u| u.replace(true));
    let out = work();
    UNSPLIT.with(|u| u.set(before));
    out
}

/// Pointers cross to rayon's threads as addresses.
#[derive(Clone, Copy)]
struct Ptr(usize);

impl Blas {
    /// `c = op(a) · op(b)` with `op(a)` `m × k`, `op(b)` `k × n` and `c` a contiguous `m × n`
    /// row-major buffer.
    ///
    /// # Safety
    ///
    /// `a` and `b` must point to matrices of those shapes under their strides, and `c` to
    /// `m · n` writable floats.
    pub unsafe fn sgemm(&self, m: usize, n: usize, k: usize, a: Operand, b: Operand, c: *mut f32) {
        let threads = if self.rayon {
            rayon::current_num_threads()
        } else {
            1
        };
        // Small products, one thread, or inside `unsplit`: one call.
        if threads <= 1 || m * n * k < 1 << 21 || UNSPLIT.with(Cell::get) {
            unsafe { self.call(m, n, k, a, b, c, n) };
            return;
        }
        // One block of rows (or of columns, when there are more) of `c` per thread, in
        // multiples of 16.
        let (split_rows, len) = if m >= n { (true, m) } else { (false, n) };
        let block = len.div_ceil(threads).next_multiple_of(16);
        let c0 = Ptr(c as usize);
        rayon::scope(|scope| {
            for start in (0..len).step_by(block) {
                let size = block.min(len - start);
                scope.spawn(move |_| {
                    let (mut a, mut b) = (a, b);
                    let c0 = c0;
                    // SAFETY: offsets stay inside the operands and blocks of `c` are disjoint.
                    unsafe {
                        if split_rows {
                            // Rows start..start+size of op(a) and of c.
                            let step = if a.trans { 1 } else { a.ld };
                            a.ptr = a.ptr.add(start * step);
                            let c = (c0.0 as *mut f32).add(start * n);
                            self.call(size, n, k, a, b, c, n);
                        } else {
                            // Columns start..start+size of op(b) and of c.
                            let step = if b.trans { b.ld } else { 1 };
                            b.ptr = b.ptr.add(start * step);
                            let c = (c0.0 as *mut f32).add(start);
                            self.call(m, size, k, a, b, c, n);
                        }
                    }
                });
            }
        });
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn call(
        &self,
        m: usize,
        n: usize,
        k: usize,
        a: Operand,
        b: Operand,
        c: *mut f32,
        ldc: usize,
    ) {
        let int = |v: usize| c_int::try_from(v).expect("matrix dimension fits a C int");
        let trans = |t: bool| if t { TRANS } else { NO_TRANS };
        // SAFETY: the caller's contract.
        unsafe {
            (self.sgemm)(
                ROW_MAJOR,
                trans(a.trans),
                trans(b.trans),
                int(m),
                int(n),
                int(k),
                1.0,
                a.ptr,
                int(a.ld),
                b.ptr,
                int(b.ld),
                0.0,
                c,
                int(ldc),
            )
        }
    }
}
