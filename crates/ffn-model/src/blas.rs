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
//!
//! ## The right kernel on a CPU the library does not know
//!
//! OpenBLAS picks its kernels by the CPU model it recognises, and takes a CPU newer than itself
//! for an older one: OpenBLAS 0.3.21 (Debian 12) and 0.3.34 (PyPI) run their AVX2 (`Haswell`)
//! kernels on AMD Zen 5, whose AVX-512 units then sit idle (its `cblas_sgemm` at about half the
//! speed it reaches with its AVX-512 kernels, and 0.55–0.6× Flex's own AVX-512 product on the
//! FFN: BENCHMARKS.md). OpenBLAS 0.3.21 takes an Intel Xeon it does not know (Emerald Rapids,
//! family 6 model 207) for a Pentium 4 and runs its SSE3 (`Prescott`) kernels: a fifth of the
//! speed of its AVX-512 ones there. So when the OpenBLAS found (not one named by `FFN_BLAS`)
//! reports kernels narrower than the CPU's vectors (AVX2 kernels on an AVX-512 CPU, SSE or AVX
//! kernels on an AVX2 one), ffn passes it over and uses Flex's product, whose `gemm` crate
//! chooses its kernels from the CPU's features. That holds whether OpenBLAS chose
//! the narrow kernels itself or was told to by `OPENBLAS_CORETYPE` (an environment variable
//! that machine images and tox set for whole sessions, so rarely a choice made for ffn):
//! `FFN_BLAS` is ffn's override, and `OPENBLAS_CORETYPE=SkylakeX` (or `Cooperlake`) gives
//! OpenBLAS's AVX-512 kernels, which ffn then takes (on Zen 5 about 1.1× Flex's product, on
//! the Emerald Rapids Xeon 1.1–1.2×). [`report`] names what was chosen and why.
//!
//! ## Asking OpenBLAS for its AVX-512 kernels
//!
//! OpenBLAS reads `OPENBLAS_CORETYPE` once, when it is loaded, and has no call that changes its
//! kernels afterwards. So on Linux x86-64, before `main` (while the process has one thread, so
//! that writing the environment races with no reader), a CPU with AVX-512 gets
//! `OPENBLAS_CORETYPE=SkylakeX` when neither it nor `FFN_BLAS` is set: every OpenBLAS since
//! 0.3.x has those kernels, they are the ones it picks for the AVX-512 CPUs it knows (Cooper
//! Lake's and Sapphire Rapids' add bf16 and int8 products only), and a CPU it does not know then
//! gets them too instead of its SSE3 or AVX2 fallbacks. The variable is then the process's, and
//! a child process inherits it. A variable already set is left alone (and judged as above);
//! `FFN_BLAS` set to anything leaves OpenBLAS to its own choice. [`report`] names the variable
//! with the kernels it asked for.

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
type GetText = unsafe extern "C" fn() -> *const c_char;

/// A loaded BLAS: its `cblas_sgemm` and how to thread it.
#[derive(Debug)]
pub struct Blas {
    sgemm: CblasSgemm,
    /// The file it was loaded from.
    pub path: String,
    /// Whether products are split over rayon's threads (the library then runs single-threaded).
    pub rayon: bool,
    /// The library: `OpenBLAS 0.3.21`, or the file's name for libraries that do not say.
    library: String,
    /// OpenBLAS's name for the kernels it runs on this CPU (`None` for other libraries).
    core: Option<String>,
}

impl Blas {
    /// The library and its kernels, as a person reads them: `OpenBLAS 0.3.21, Cooperlake
    /// kernels`.
    fn kernel(&self) -> String {
        match &self.core {
            Some(core) => format!("{}, {core} kernels", self.library),
            None => self.library.clone(),
        }
    }
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
    chosen().0.as_ref()
}

/// What the op's f32 matrix products run on: the library and its kernels (and file), or Flex's
/// `gemm` and why.
pub fn report() -> &'static str {
    &chosen().1
}

fn chosen() -> &'static (Option<Blas>, String) {
    static CHOSEN: OnceLock<(Option<Blas>, String)> = OnceLock::new();
    CHOSEN.get_or_init(|| {
        let (blas, why) = load();
        let report = match (&blas, why) {
            (Some(blas), _) => format!("{} ({})", blas.described(), blas.path),
            (None, Some(why)) => format!("Flex's gemm: {why}"),
            (None, None) => "Flex's gemm: no BLAS library found".to_string(),
        };
        (blas, report)
    })
}

/// The core type to ask OpenBLAS for before it loads: `SkylakeX` on a CPU with AVX-512 when
/// neither `OPENBLAS_CORETYPE` nor `FFN_BLAS` is set to a value (module docs), else none.
fn coretype_to_ask(
    vectors: cpu::Vectors,
    coretype_set: bool,
    ffn_blas_set: bool,
) -> Option<&'static str> {
    (vectors == cpu::Vectors::Avx512 && !coretype_set && !ffn_blas_set).then_some("SkylakeX")
}

/// Sets `OPENBLAS_CORETYPE` as [`coretype_to_ask`] says, before `main` (module docs).
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
extern "C" fn ask_for_wide_kernels() {
    let set = |name: &str| std::env::var_os(name).is_some_and(|v| !v.is_empty());
    if let Some(core) = coretype_to_ask(cpu::vectors(), set("OPENBLAS_CORETYPE"), set("FFN_BLAS")) {
        // SAFETY: this runs from `.init_array`, before `main`, while the process has one
        // thread: nothing reads the environment while it is written.
        unsafe { std::env::set_var("OPENBLAS_CORETYPE", core) };
    }
}

/// Runs [`ask_for_wide_kernels`] as the process starts, before `main`, as a C constructor does.
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
#[used]
#[unsafe(link_section = ".init_array")]
static ASK_FOR_WIDE_KERNELS: extern "C" fn() = ask_for_wide_kernels;

/// The library to use, or `None` and why not.
fn load() -> (Option<Blas>, Option<String>) {
    let setting = std::env::var("FFN_BLAS").unwrap_or_default();
    let rayon = std::env::var("FFN_BLAS_THREADS").map_or(true, |v| v != "blas");
    let (candidates, named): (Vec<&str>, bool) = match setting.trim() {
        "" => (CANDIDATES.to_vec(), false),
        "off" | "0" | "none" => return (None, Some("FFN_BLAS=off".into())),
        path => (vec![path], true),
    };
    let Some(blas) = candidates.into_iter().find_map(|path| open(path, rayon)) else {
        return (None, None);
    };
    match &blas.core {
        Some(core) if !named && lags(core, cpu::vectors()) => {
            let told = match std::env::var("OPENBLAS_CORETYPE") {
                Ok(coretype) => format!(" (OPENBLAS_CORETYPE={coretype})"),
                Err(_) => String::new(),
            };
            (
                None,
                Some(format!(
                    "{} runs its {core} kernels{told} on this {} CPU",
                    blas.library,
                    cpu::vectors().name()
                )),
            )
        }
        _ => (Some(blas), None),
    }
}

impl Blas {
    /// The library and its kernels, and the `OPENBLAS_CORETYPE` that asked for them (the
    /// user's, or the one ffn set: module docs).
    fn described(&self) -> String {
        match (&self.core, std::env::var("OPENBLAS_CORETYPE")) {
            (Some(_), Ok(core)) if !core.is_empty() => {
                format!("{} (OPENBLAS_CORETYPE={core})", self.kernel())
            }
            _ => self.kernel(),
        }
    }
}

/// Whether OpenBLAS's kernels for `core` leave a CPU with `vectors` below its width. The cores
/// with AVX-512 kernels are SkylakeX, Cooperlake and SapphireRapids; on an AVX2 CPU the kernels
/// OpenBLAS falls back to for a CPU it does not know (SSE3 `Prescott`, and the SSE and AVX
/// cores before Haswell) lag. A core this list does not name (another architecture's, or one
/// newer than it) lags only on an AVX-512 CPU, where Flex's product is as wide as the CPU.
fn lags(core: &str, vectors: cpu::Vectors) -> bool {
    const AVX512: [&str; 3] = ["skylakex", "cooperlake", "sapphirerapids"];
    const NARROW: [&str; 21] = [
        "katmai",
        "coppermine",
        "northwood",
        "prescott",
        "banias",
        "atom",
        "core2",
        "penryn",
        "dunnington",
        "nehalem",
        "athlon",
        "opteron",
        "opteron(sse3)",
        "barcelona",
        "nano",
        "bobcat",
        "sandybridge",
        "bulldozer",
        "piledriver",
        "steamroller",
        "unknown",
    ];
    let core = core.to_ascii_lowercase();
    match vectors {
        cpu::Vectors::Avx512 => !AVX512.contains(&core.as_str()),
        cpu::Vectors::Avx2 => NARROW.contains(&core.as_str()),
        cpu::Vectors::Other => false,
    }
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
    // OpenBLAS names its version (`openblas_get_config`: "OpenBLAS 0.3.21 DYNAMIC_ARCH …") and
    // the kernels it chose for this CPU (`openblas_get_corename`: "Haswell", "Cooperlake", …).
    let text = |name: &str| {
        let name = CString::new(format!("{prefix}{name}")).expect("no NUL");
        let f = symbol(handle, &name)?;
        // SAFETY: both OpenBLAS functions take nothing and return a static C string.
        let s = unsafe { std::mem::transmute::<*mut c_void, GetText>(f)() };
        // SAFETY: a NUL-terminated string owned by the library.
        (!s.is_null()).then(|| unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned())
    };
    let core = text("openblas_get_corename").map(|c| c.trim().to_string());
    let version =
        text("openblas_get_config").and_then(|c| c.split_whitespace().nth(1).map(str::to_string));
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
    let library = match (&core, version) {
        (Some(_), Some(v)) => format!("OpenBLAS {v}"),
        (Some(_), None) => "OpenBLAS".to_string(),
        _ => path.rsplit('/').next().unwrap_or(path).to_string(),
    };
    Some(Blas {
        sgemm,
        path: path.to_string(),
        rayon,
        library,
        core,
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
    /// `c = op(a) · op(b)` with `op(a)` `m × k`, `op(b)` `k × n` and `c` a row-major `m × n`
    /// matrix whose rows are `ldc ≥ n` floats apart.
    ///
    /// # Safety
    ///
    /// `a` and `b` must point to matrices of those shapes under their strides, and `c` to
    /// `m` writable rows of `n` floats, `ldc` apart.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn sgemm(
        &self,
        m: usize,
        n: usize,
        k: usize,
        a: Operand,
        b: Operand,
        c: *mut f32,
        ldc: usize,
    ) {
        let threads = if self.rayon {
            rayon::current_num_threads()
        } else {
            1
        };
        // Small products, one thread, or inside `unsplit`: one call.
        if threads <= 1 || m * n * k < 1 << 21 || UNSPLIT.with(Cell::get) {
            unsafe { self.call(m, n, k, a, b, c, ldc) };
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
                            let c = (c0.0 as *mut f32).add(start * ldc);
                            self.call(size, n, k, a, b, c, ldc);
                        } else {
                            // Columns start..start+size of op(b) and of c.
                            let step = if b.trans { b.ld } else { 1 };
                            b.ptr = b.ptr.add(start * step);
                            let c = (c0.0 as *mut f32).add(start);
                            self.call(m, size, k, a, b, c, ldc);
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

/// The CPU, as the reports name it.
pub mod cpu {
    /// The widest vectors a CPU's f32 products can use.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub enum Vectors {
        /// 512-bit: [`avx512`].
        Avx512,
        /// 256-bit with fused multiply-adds: AVX2 and FMA.
        Avx2,
        /// Anything else (older x86, other architectures).
        Other,
    }

    impl Vectors {
        /// `AVX-512`, `AVX2`, or `this`.
        pub fn name(self) -> &'static str {
            match self {
                Vectors::Avx512 => "AVX-512",
                Vectors::Avx2 => "AVX2",
                Vectors::Other => "this",
            }
        }
    }

    /// This CPU's [`Vectors`].
    pub fn vectors() -> Vectors {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if avx512() {
                return Vectors::Avx512;
            }
            if has!("avx2") && has!("fma") {
                return Vectors::Avx2;
            }
        }
        Vectors::Other
    }

    /// Whether the CPU has the AVX-512 subsets that BLAS kernels and Flex's `gemm` use (F, BW,
    /// VL, DQ).
    pub fn avx512() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vl")
                && std::arch::is_x86_feature_detected!("avx512dq")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// `AMD EPYC (family 25, model 17), avx2 fma avx512f avx512bw avx512vl avx512_bf16`: the
    /// name, family and model the OS reports (Linux), and the vector features that decide the
    /// kernels.
    pub fn describe() -> String {
        let mut name = std::env::consts::ARCH.to_string();
        if let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") {
            let field = |key: &str| {
                info.lines()
                    .find(|l| l.split(':').next().is_some_and(|k| k.trim() == key))
                    .and_then(|l| l.split_once(':'))
                    .map(|(_, v)| v.trim().to_string())
            };
            if let Some(model_name) = field("model name") {
                name = model_name;
            }
            if let (Some(family), Some(model)) = (field("cpu family"), field("model")) {
                name = format!("{name} (family {family}, model {model})");
            }
        }
        #[allow(unused_mut)]
        let mut flags: Vec<&str> = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            for (flag, present) in [
                ("avx2", has!("avx2")),
                ("fma", has!("fma")),
                ("avx512f", has!("avx512f")),
                ("avx512bw", has!("avx512bw")),
                ("avx512vl", has!("avx512vl")),
                ("avx512_bf16", has!("avx512bf16")),
            ] {
                if present {
                    flags.push(flag);
                }
            }
        }
        if flags.is_empty() {
            name
        } else {
            format!("{name}, {}", flags.join(" "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Kernels narrower than the CPU's vectors are passed over: AVX2 ones on an AVX-512 CPU,
    /// SSE and AVX ones (OpenBLAS's fallbacks for a CPU it does not know) on an AVX2 one.
    #[test]
    fn only_kernels_narrower_than_the_cpu_lag() {
        use cpu::Vectors::{Avx2, Avx512, Other};
        for core in ["Haswell", "Zen", "Excavator"] {
            assert!(lags(core, Avx512), "{core}");
            assert!(!lags(core, Avx2), "{core}");
        }
        for core in [
            "Prescott",
            "Sandybridge",
            "Nehalem",
            "Piledriver",
            "Unknown",
        ] {
            assert!(lags(core, Avx512), "{core}");
            assert!(lags(core, Avx2), "{core}");
            assert!(!lags(core, Other), "{core}");
        }
        for core in ["SkylakeX", "Cooperlake", "SAPPHIRERAPIDS"] {
            assert!(!lags(core, Avx512), "{core}");
            assert!(!lags(core, Avx2), "{core}");
        }
        // Another architecture's kernels, or a name newer than the list: kept below AVX-512.
        for core in ["NeoverseN1", "armv8", "Zen5"] {
            assert!(!lags(core, Avx2), "{core}");
            assert!(!lags(core, Other), "{core}");
        }
    }

    /// OpenBLAS is asked for its AVX-512 kernels on an AVX-512 CPU only, and only when neither
    /// `OPENBLAS_CORETYPE` nor `FFN_BLAS` has a value.
    #[test]
    fn openblas_is_asked_for_avx512_kernels_on_an_avx512_cpu_left_alone() {
        use cpu::Vectors::{Avx2, Avx512, Other};
        assert_eq!(coretype_to_ask(Avx512, false, false), Some("SkylakeX"));
        for (coretype_set, ffn_blas_set) in [(true, false), (false, true), (true, true)] {
            assert_eq!(coretype_to_ask(Avx512, coretype_set, ffn_blas_set), None);
        }
        for vectors in [Avx2, Other] {
            assert_eq!(coretype_to_ask(vectors, false, false), None);
        }
        // The constructor ran in this process: on an AVX-512 CPU the variable has a value
        // (ffn's, or one that was there before).
        if cpu::vectors() == Avx512 && cfg!(all(target_os = "linux", target_arch = "x86_64")) {
            let value = std::env::var("OPENBLAS_CORETYPE").unwrap_or_default();
            let ffn_blas = std::env::var("FFN_BLAS").unwrap_or_default();
            assert!(
                !value.is_empty() || !ffn_blas.is_empty(),
                "OPENBLAS_CORETYPE unset"
            );
        }
    }

    #[test]
    fn the_report_names_the_kernel() {
        let report = report();
        match get() {
            Some(blas) => assert!(report.starts_with(&blas.kernel()), "{report}"),
            None => assert!(report.starts_with("Flex's gemm: "), "{report}"),
        }
    }
}
