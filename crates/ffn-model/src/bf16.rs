//! # bf16 matrix products with f32 accumulation
//!
//! bfloat16 keeps f32's 8-bit exponent and 7 of its 23 mantissa bits: `bf16(x)` is `x` rounded
//! to nearest (ties to even) at bit 16, so its relative error is at most `2⁻⁹` and its range is
//! f32's. Mixed precision (the autocast recipe) multiplies bf16 operands and adds the products in
//! f32:
//!
//! ```text
//! C = Σ_k bf16(A)[i,k] · bf16(B)[k,j]        every product exact in f32, every sum in f32
//! ```
//!
//! On x86 with `avx512_bf16`, `vdpbf16ps` computes 16 lanes of `c += a₀b₀ + a₁b₁` from 32 bf16
//! pairs in one instruction: twice the multiply-adds of an f32 FMA of the same width. [`gemm`]
//! is a packed GEMM on it (Goto's blocking): `B` is packed once per block of `K_BLOCK` rows into
//! panels of `NR` columns, each row pair interleaved (`b[2p][j], b[2p+1][j]`), `A` per thread
//! into panels of `MR` rows (`a[i][2p], a[i][2p+1]`), and an `MR × NR` tile of `C` lives in
//! registers while the kernel runs down the pairs of `K`.
//!
//! The products are exact in f32 (8-bit mantissas), so the result differs from an f64 sum of
//! the same rounded products only by the order and rounding of the f32 additions; the fallback
//! of CPUs without `avx512_bf16` ([`reference`], and the op's route through the f32 GEMM on
//! operands rounded to bf16) computes the same function.
//!
//! ## Where it pays
//!
//! Twice the multiply-adds of an FMA holds where `vdpbf16ps` issues as often as the FMA: AMD
//! Zen 4 and Zen 5 (two a cycle). Intel's server cores issue one a cycle, on one port, where
//! they issue two f32 FMAs; the bf16 product then has no more multiply-adds per cycle than the
//! f32 one and still pays for its rounding and packing. Measured on an Intel Xeon (Emerald
//! Rapids, family 6 model 207, AMX not exposed), 2 threads, FFN forward + backward with the
//! input's gradient: this kernel ran at 0.56× ffn's own f32 pass, and the widening fallback
//! (rounded operands, the f32 SGEMM) at 0.75×; PyTorch's autocast there ran at 0.55× its f32.
//! So [`chosen`] takes this kernel on CPUs with `avx512_bf16` except Intel's, and `FFN_BF16`
//! (`kernel` or `widen`) overrides it. Either way the function is the same: only the order of
//! the f32 sums differs.

use rayon::prelude::*;

/// `x` rounded to bf16 (to nearest, ties to even), as its 16 bits. NaN stays NaN (quiet). (The
/// op rounds through Flex's cast, which rounds the same way; this is the tests' oracle.)
#[cfg(test)]
pub fn round(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    let lsb = (bits >> 16) & 1;
    ((bits.wrapping_add(0x7fff + lsb)) >> 16) as u16
}

/// The f32 that a bf16 holds.
#[cfg(test)]
pub fn widen(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// A matrix of bf16 bits: element `(i, j)` at `ptr + i·row_stride + j·col_stride`.
#[derive(Debug, Clone, Copy)]
pub struct Matrix {
    pub ptr: *const u16,
    pub row_stride: usize,
    pub col_stride: usize,
}

// SAFETY: a matrix is read only, and lives while the product that reads it runs.
unsafe impl Send for Matrix {}
unsafe impl Sync for Matrix {}

#[cfg(test)]
impl Matrix {
    /// # Safety
    ///
    /// `(i, j)` must be inside the matrix.
    #[inline]
    unsafe fn at(&self, i: usize, j: usize) -> u16 {
        unsafe { *self.ptr.add(i * self.row_stride + j * self.col_stride) }
    }
}

/// Rows of a tile of `C` held in registers.
const MR: usize = 6;
/// 16-lane vectors across a tile.
const NV: usize = 4;
/// Columns of a tile.
const NR: usize = 16 * NV;
/// Elements of `K` per packed block: an `A` panel of `MR × K_BLOCK` bf16 is 12 KiB (L1), a `B`
/// panel of `K_BLOCK × NR` 128 KiB (L2). Measured on Zen 4, one thread, FFN shapes: 256 gave
/// 134–175 GF/s, 512 167–191, 1024 176–195 (fewer passes that read and write the tile of `C`).
///
/// The tile's shape, measured on Zen 5 (one thread, packed panels, `[4096, 512]·[512, 2048]` and
/// `[2048, 768]·[768, 3072]`; the peak of `vdpbf16ps` there is 529 GF/s): 12 × 32 ran at 475 and
/// 434 GF/s, 8 × 48 at 501 and 479, 6 × 64 at 499 and 492, 4 × 96 at 490 and 475. Per pair of `K`
/// a tile of `MR × NV` registers loads `NV` vectors of `B` and broadcasts `MR` lanes of `A`:
/// 6 × 4 needs 10 loads for 24 `vdpbf16ps`, 12 × 2 needs 14.
const K_BLOCK: usize = 1024;
/// Panels of a transposed `A` packed at once: `GROUP · MR` = 48 rows, three vectors of sixteen.
const GROUP: usize = 8;
/// Rows of `A` a thread packs and sweeps across every panel of `B` (192 × 1024 bf16 = 384 KiB).
const M_BLOCK: usize = 32 * MR;

/// Whether [`gemm`] can run here (x86-64 with AVX-512 F, BW, VL and BF16).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether bf16 products run on [`gemm`] here: the CPU can ([`available`]) and it pays there
/// (module docs), or `FFN_BF16=kernel` asks for it. `false` means the rounded operands are
/// widened to f32 and multiplied by the f32 product: the same function.
pub fn chosen() -> bool {
    choice().0
}

/// How bf16 products run here, as `ffn_model::cpu_kernels` says it.
pub fn report() -> &'static str {
    &choice().1
}

fn choice() -> &'static (bool, String) {
    static CHOICE: std::sync::OnceLock<(bool, String)> = std::sync::OnceLock::new();
    CHOICE.get_or_init(|| choose(available(), std::env::var("FFN_BF16").ok(), intel()))
}

/// What [`chosen`] and [`report`] say for a CPU that can run the kernel or not, an `FFN_BF16`
/// setting and a vendor.
fn choose(available: bool, setting: Option<String>, intel: bool) -> (bool, String) {
    const KERNEL: &str = "ffn's avx512_bf16 kernel";
    const WIDENED: &str = "rounded operands widened to f32";
    if !available {
        return (false, format!("{WIDENED} (no avx512_bf16)"));
    }
    let unknown = match setting.as_deref().map(str::trim) {
        Some("kernel") => return (true, format!("{KERNEL} (FFN_BF16=kernel)")),
        Some("widen") => return (false, format!("{WIDENED} (FFN_BF16=widen)")),
        None | Some("") => String::new(),
        Some(other) => format!("; FFN_BF16={other} ignored: kernel or widen"),
    };
    if intel {
        let why = "on this Intel CPU the avx512_bf16 kernel is slower (one vdpbf16ps a cycle)";
        (false, format!("{WIDENED}: {why}{unknown}"))
    } else {
        (true, format!("{KERNEL}{unknown}"))
    }
}

/// Whether the CPU is Intel's (`GenuineIntel`).
fn intel() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `cpuid` leaf 0 exists on every x86-64 CPU.
        #[allow(unused_unsafe)]
        let id = unsafe { std::arch::x86_64::__cpuid(0) };
        let vendor = [id.ebx, id.edx, id.ecx].map(u32::to_le_bytes).concat();
        vendor == b"GenuineIntel"
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `C = A · B` for `A: m × k`, `B: k × n` (bf16) and `C` a contiguous row-major `m × n` f32
/// buffer, in parallel over rayon's threads. Panics unless [`available`].
///
/// # Safety
///
/// `a` and `b` must address matrices of those shapes, and `c` must point to `m · n` writable
/// floats.
pub unsafe fn gemm(m: usize, n: usize, k: usize, a: Matrix, b: Matrix, c: *mut f32) {
    // SAFETY: the caller's contract.
    unsafe { gemm_then(m, n, k, a, b, Some(c), &|_, _| {}) }
}

/// [`gemm`], then `then(rows, c)` on each block of rows of `C` as soon as it is complete, on the
/// thread that computed it, while the block is still in its cache: `c` holds the block's rows
/// (`rows.len() × n`, row-major). With `c = Some(ptr)` they are rows of that buffer (`then` may
/// change them in place); with `None` each block is computed into a buffer of its own, freed
/// after `then`, and `C` is never whole in memory (`then` must take what it needs; with more
/// than one block of `K` the blocks are summed into a whole `C` after all). This is how
/// the FFN fuses its element-wise passes into the products they follow: no `[T, d_ff]` f32 pass
/// through memory of its own. Blocks are disjoint and cover `0..m` once each. Panics unless
/// [`available`].
///
/// # Safety
///
/// `a` and `b` must address matrices of those shapes, and `c`, when given, must point to `m · n`
/// writable floats.
pub unsafe fn gemm_then(
    m: usize,
    n: usize,
    k: usize,
    a: Matrix,
    b: Matrix,
    c: Option<*mut f32>,
    then: &(dyn Fn(std::ops::Range<usize>, &mut [f32]) + Sync),
) {
    assert!(available(), "bf16::gemm needs avx512_bf16");
    if m == 0 || n == 0 {
        return;
    }
    // More than one K block with no `C` to sum into: a whole `C` after all.
    let mut whole = Vec::new();
    let c = match c {
        Some(c) => Some(c),
        None if k > K_BLOCK => {
            whole.resize(m * n, 0.0f32);
            Some(whole.as_mut_ptr())
        }
        None => None,
    };
    if k == 0 {
        let mut zeros = vec![0.0f32; m * n];
        let c = c.map_or(zeros.as_mut_ptr(), |c| {
            // SAFETY: the caller's contract.
            unsafe { std::ptr::write_bytes(c, 0, m * n) };
            c
        });
        // SAFETY: m·n floats, written above.
        then(0..m, unsafe { std::slice::from_raw_parts_mut(c, m * n) });
        return;
    }
    let c = c.map(|c| Ptr(c as usize));
    let panels = n.div_ceil(NR);
    // Blocks of rows of at most M_BLOCK, as many as a multiple of the threads (a [512, k] A
    // as four blocks of 128 rows on two threads, not 192 + 192 + 128).
    let threads = rayon::current_num_threads().max(1);
    let blocks = m.div_ceil(M_BLOCK).next_multiple_of(threads);
    let m_block = m.div_ceil(blocks).next_multiple_of(MR);
    // The packed `B`, one `K` block at a time, freed when the product ends: kept from one
    // product to the next it would be up to `n × K_BLOCK` bf16 held through the whole step
    // (4 MiB at d_ff 2048), at its memory peak too. A fresh allocation costs nothing measurable.
    let len = panels * NR * k.min(K_BLOCK).div_ceil(2);
    let mut packed_b = vec![0u32; len];
    for k0 in (0..k).step_by(K_BLOCK) {
        let kc = K_BLOCK.min(k - k0);
        let pairs = kc.div_ceil(2);
        // B's rows k0..k0+kc, one panel of NR columns per chunk.
        packed_b[..panels * NR * pairs]
            .par_chunks_mut(NR * pairs)
            .enumerate()
            .for_each(|(panel, out)| {
                // SAFETY: rows k0..k0+kc and columns of the panel are inside B.
                unsafe { pack_b(b, k0, kc, panel * NR, NR.min(n - panel * NR), out) }
            });
        let packed_b = &packed_b[..panels * NR * pairs];
        let accumulate = k0 > 0;
        (0..m.div_ceil(m_block)).into_par_iter().for_each(|block| {
            let i0 = block * m_block;
            let mc = m_block.min(m - i0);
            // This block's rows of C: in the caller's buffer, or in a buffer of its own, freed
            // once `then` has taken them (not kept per thread: between products, and in
            // recompute mode's chunks, it would be memory held for nothing).
            let mut own: Vec<std::mem::MaybeUninit<f32>> = Vec::new();
            let base = match c {
                // SAFETY: row i0 is inside C.
                Some(c) => unsafe { (c.0 as *mut f32).add(i0 * n) },
                None => {
                    own.reserve_exact(mc * n);
                    own.as_mut_ptr().cast::<f32>()
                }
            };
            // A row-major `A` is read where it is: its pairs are already adjacent, so a full
            // panel of MR rows needs no copy (the kernel reads each row in order); with an odd
            // `kc` the last pair (`a[i][k0 + kc - 1]`, 0) is packed on its own and run as a
            // second, one-pair pass over the tile. Other panels are packed into this thread's
            // buffer, kept from one block to the next: `pack_a` writes every lane of it, so what
            // a block leaves behind is never read.
            let direct = |rows: usize| a.col_stride == 1 && rows == MR;
            let odd = !kc.is_multiple_of(2);
            PACKED_A.with_borrow_mut(|buffer| {
                let len = mc.div_ceil(MR) * MR * pairs;
                if buffer.len() < len {
                    buffer.resize(len, 0);
                }
                let packed_a = &mut buffer[..len];
                // A stored transposed (`Xᵀ` in `dW = Xᵀ·dY`), an even number of its columns:
                // GROUP panels at once, each of its columns read whole (not MR elements of it
                // per panel), the last group as many panels as are left.
                let grouped = cfg!(target_arch = "x86_64")
                    && a.row_stride == 1
                    && a.col_stride != 1
                    && kc.is_multiple_of(2);
                if grouped {
                    for (g, out) in packed_a.chunks_mut(GROUP * MR * pairs).enumerate() {
                        let first = g * GROUP * MR;
                        let rows = (GROUP * MR).min(mc - first);
                        // SAFETY: rows i0+first.. (`rows` of them) and columns k0..k0+kc are
                        // inside A; `out` holds their panels.
                        #[cfg(target_arch = "x86_64")]
                        unsafe {
                            let origin = a.ptr.add(i0 + first + k0 * a.col_stride);
                            x86::pack_column_group(origin, a.col_stride, rows, pairs, out)
                        };
                    }
                }
                let chunks = packed_a.chunks_mut(MR * pairs).enumerate();
                for (p, out) in chunks.filter(|_| !grouped) {
                    let rows = MR.min(mc - p * MR);
                    if !direct(rows) {
                        // SAFETY: rows i0+p·MR.. and columns k0..k0+kc are inside A.
                        unsafe { pack_a(a, i0 + p * MR, rows, k0, kc, out) };
                    } else if odd {
                        // SAFETY: rows i0+p·MR.. (MR of them) and column k0+kc-1 are inside A.
                        unsafe { pack_a(a, i0 + p * MR, rows, k0 + kc - 1, 1, out) };
                    }
                }
                for (jp, panel_b) in packed_b.chunks(NR * pairs).enumerate() {
                    let j0 = jp * NR;
                    let cols = NR.min(n - j0);
                    for (ip, panel_a) in packed_a.chunks(MR * pairs).enumerate() {
                        let i = i0 + ip * MR;
                        let rows = MR.min(m - i);
                        // The panel's lane (row r, pair q) is at `start + r·row + q·pair` bytes.
                        let (start, row, pair) = if direct(rows) {
                            // SAFETY: row i, column k0 is inside A.
                            let start = unsafe { a.ptr.add(i * a.row_stride + k0) };
                            (start as *const u8, 2 * a.row_stride, 4)
                        } else {
                            (panel_a.as_ptr() as *const u8, 4, 4 * MR)
                        };
                        #[cfg(target_arch = "x86_64")]
                        let panel = x86::Panel { start, row, pair };
                        // SAFETY: the tile (i.., j0..) of rows × cols is inside C, and tiles of
                        // different threads are disjoint (different rows); the panel's lanes
                        // are inside A or the packed buffer.
                        #[cfg(target_arch = "x86_64")]
                        unsafe {
                            let tile = base.add((i - i0) * n + j0);
                            if direct(rows) && odd {
                                let full = pairs - 1;
                                x86::tile(panel, panel_b, full, tile, n, rows, cols, accumulate);
                                let last = x86::Panel {
                                    start: panel_a.as_ptr() as *const u8,
                                    row: 4,
                                    pair: 4 * MR,
                                };
                                let b = &panel_b[full * NR..];
                                x86::tile(last, b, 1, tile, n, rows, cols, true);
                            } else {
                                x86::tile(panel, panel_b, pairs, tile, n, rows, cols, accumulate);
                            }
                        }
                    }
                }
            });
            if k0 + kc == k {
                // SAFETY: the block's mc rows of n floats, every one written by its tiles.
                then(i0..i0 + mc, unsafe {
                    std::slice::from_raw_parts_mut(base, mc * n)
                });
            }
            drop(own);
        });
    }
}

thread_local! {
    /// Each thread's buffer for packed panels of `A` (at most `M_BLOCK × K_BLOCK` bf16).
    static PACKED_A: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Pointers cross to rayon's threads as addresses.
#[derive(Clone, Copy)]
struct Ptr(usize);

/// Two bf16 as one 32-bit lane: `lo` in the low half (the first of the pair).
#[inline]
fn pair(lo: u16, hi: u16) -> u32 {
    lo as u32 | (hi as u32) << 16
}

/// Packs rows `i0..i0+rows` of `A` (columns `k0..k0+kc`) as `[pair][row]`, rows beyond `rows`
/// and an odd last column zero.
unsafe fn pack_a(a: Matrix, i0: usize, rows: usize, k0: usize, kc: usize, out: &mut [u32]) {
    let full = kc / 2;
    // Every lane of rows 0..rows is written below; only the rows past `rows` are padding.
    if rows < MR {
        for p in 0..kc.div_ceil(2) {
            out[p * MR + rows..(p + 1) * MR].fill(0);
        }
    }
    // SAFETY (every read): inside A, by the caller's contract.
    unsafe {
        let origin = a.ptr.add(i0 * a.row_stride + k0 * a.col_stride);
        if a.row_stride == 1 && a.col_stride != 1 {
            // Stored transposed (a column of A is contiguous, as `Xᵀ` in `dW = Xᵀ·dY`): pair by
            // pair, the rows are two contiguous runs, read in memory order. (Row by row, each
            // read would be a cache line of its own, reloaded for every row of the panel.)
            #[cfg(target_arch = "x86_64")]
            x86::pack_columns(origin, a.col_stride, rows, full, out);
            #[cfg(not(target_arch = "x86_64"))]
            for p in 0..full {
                let (c0, c1) = (
                    origin.add(2 * p * a.col_stride),
                    origin.add((2 * p + 1) * a.col_stride),
                );
                let lanes = &mut out[p * MR..p * MR + rows];
                for (r, lane) in lanes.iter_mut().enumerate() {
                    *lane = pair(*c0.add(r), *c1.add(r));
                }
            }
        } else {
            for r in 0..rows {
                let row = origin.add(r * a.row_stride);
                if a.col_stride == 1 {
                    // Row-major: a pair is one unaligned 32-bit read.
                    let row = row as *const u32;
                    for p in 0..full {
                        out[p * MR + r] = row.add(p).read_unaligned();
                    }
                } else {
                    for p in 0..full {
                        let lo = *row.add(2 * p * a.col_stride);
                        out[p * MR + r] = pair(lo, *row.add((2 * p + 1) * a.col_stride));
                    }
                }
            }
        }
        if kc % 2 == 1 {
            let last = origin.add(2 * full * a.col_stride);
            for r in 0..rows {
                out[full * MR + r] = pair(*last.add(r * a.row_stride), 0);
            }
        }
    }
}

/// Packs rows `k0..k0+kc` of `B` (columns `j0..j0+cols`) as `[pair][column]`, columns beyond
/// `cols` and an odd last row zero.
unsafe fn pack_b(b: Matrix, k0: usize, kc: usize, j0: usize, cols: usize, out: &mut [u32]) {
    let full = kc / 2;
    // Every lane of columns 0..cols is written below; only the columns past `cols` are padding.
    if cols < NR {
        for p in 0..kc.div_ceil(2) {
            out[p * NR + cols..(p + 1) * NR].fill(0);
        }
    }
    // SAFETY (every read): inside B, by the caller's contract.
    unsafe {
        let origin = b.ptr.add(k0 * b.row_stride + j0 * b.col_stride);
        #[cfg(target_arch = "x86_64")]
        let done = if b.row_stride == 1 && cols == NR {
            // Stored transposed: sixteen columns and sixteen pairs at a time, one transpose of
            // 16 × 16 lanes in registers.
            x86::pack_transposed(origin, b.col_stride, full, out);
            full - full % 16
        } else {
            0
        };
        #[cfg(not(target_arch = "x86_64"))]
        let done = 0;
        if b.row_stride == 1 {
            // Stored transposed (a column of B is contiguous): a pair is one 32-bit read.
            for j in 0..cols {
                let column = origin.add(j * b.col_stride) as *const u32;
                for p in done..full {
                    out[p * NR + j] = column.add(p).read_unaligned();
                }
            }
        } else if cfg!(target_arch = "x86_64") && b.col_stride == 1 && cols == NR {
            #[cfg(target_arch = "x86_64")]
            x86::pack_rows(origin, b.row_stride, full, out);
        } else {
            for p in 0..full {
                let (r0, r1) = (
                    origin.add(2 * p * b.row_stride),
                    origin.add((2 * p + 1) * b.row_stride),
                );
                let lanes = &mut out[p * NR..p * NR + cols];
                for (j, lane) in lanes.iter_mut().enumerate() {
                    *lane = pair(*r0.add(j * b.col_stride), *r1.add(j * b.col_stride));
                }
            }
        }
        if kc % 2 == 1 {
            let last = origin.add(2 * full * b.row_stride);
            for j in 0..cols {
                out[full * NR + j] = pair(*last.add(j * b.col_stride), 0);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{GROUP, MR, NR, NV};
    use std::arch::x86_64::*;

    /// `pack_a` for an `A` stored transposed: pair `p` of the panel's `rows` rows is the first
    /// `rows` elements of columns `2p` and `2p + 1` (each contiguous), interleaved into 32-bit
    /// lanes `c0[r] | c1[r] << 16`. Sixteen lanes at a time: two masked loads (nothing past
    /// `rows` is read), two widenings, a shift and an or, one masked store.
    ///
    /// # Safety
    ///
    /// AVX-512 F, BW and VL present (every CPU with `avx512_bf16` has them); `origin` addresses
    /// `2·pairs` columns, `col_stride` apart, of at least `rows ≤ MR` elements; `out` holds
    /// `pairs · MR` lanes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn pack_columns(
        origin: *const u16,
        col_stride: usize,
        rows: usize,
        pairs: usize,
        out: &mut [u32],
    ) {
        const { assert!(MR <= 16) };
        assert!(rows <= MR && out.len() >= pairs * MR);
        let mask = ((1u32 << rows) - 1) as u16;
        for p in 0..pairs {
            // SAFETY: the caller's contract; the masked lanes are neither read nor written.
            unsafe {
                let c0 = _mm256_maskz_loadu_epi16(mask, origin.add(2 * p * col_stride).cast());
                let c1 =
                    _mm256_maskz_loadu_epi16(mask, origin.add((2 * p + 1) * col_stride).cast());
                let lanes = _mm512_or_si512(
                    _mm512_cvtepu16_epi32(c0),
                    _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(c1)),
                );
                _mm512_mask_storeu_epi32(out.as_mut_ptr().add(p * MR).cast(), mask, lanes);
            }
        }
    }

    /// `pack_a` for up to `GROUP` panels of an `A` stored transposed (`rows ≤ GROUP · MR` of
    /// its rows): per pair, the rows of columns `2p` and `2p + 1` are three masked loads each
    /// (zero past `rows`), widened and interleaved into three vectors of lanes
    /// `c0[r] | c1[r] << 16`, from which each panel's `MR` lanes are picked by one two-source
    /// permute and stored; the rows of the last panel past `rows` are zero.
    ///
    /// # Safety
    ///
    /// AVX-512 F and BW present; `origin` addresses `2·pairs` columns, `col_stride` apart, of
    /// at least `rows` elements; `out` holds `⌈rows / MR⌉ · pairs · MR` lanes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn pack_column_group(
        origin: *const u16,
        col_stride: usize,
        rows: usize,
        pairs: usize,
        out: &mut [u32],
    ) {
        const { assert!(GROUP * MR == 48 && MR <= 16) };
        let (panel, panels) = (pairs * MR, rows.div_ceil(MR));
        assert!(rows <= GROUP * MR && out.len() >= panels * panel);
        // Panel k's lanes are lanes 6k.. of the three vectors: vector ⌊6k/16⌋ from lane 6k mod
        // 16, running into the next one where they cross.
        let picks: [(usize, __m512i); GROUP] = std::array::from_fn(|k| {
            let first = k * MR;
            let lanes: [i32; 16] = std::array::from_fn(|l| ((first % 16) + l) as i32);
            // SAFETY: 16 lanes read from an array of 16.
            (first / 16, unsafe {
                _mm512_loadu_si512(lanes.as_ptr().cast())
            })
        });
        // The rows of vector i that are inside A.
        let masks: [u16; 3] =
            std::array::from_fn(|i| ((1u32 << rows.saturating_sub(16 * i).min(16)) - 1) as u16);
        let store = ((1u32 << MR) - 1) as u16;
        for p in 0..pairs {
            // SAFETY: the caller's contract; masked lanes are neither read nor written.
            unsafe {
                let (c0, c1) = (
                    origin.add(2 * p * col_stride),
                    origin.add((2 * p + 1) * col_stride),
                );
                let v: [__m512i; 4] = std::array::from_fn(|i| {
                    if i == 3 {
                        return _mm512_setzero_si512();
                    }
                    let load = |c: *const u16| {
                        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(
                            masks[i],
                            c.add(16 * i).cast(),
                        ))
                    };
                    _mm512_or_si512(load(c0), _mm512_slli_epi32::<16>(load(c1)))
                });
                for (k, &(vi, pick)) in picks.iter().enumerate().take(panels) {
                    let lanes = _mm512_permutex2var_epi32(v[vi], pick, v[vi + 1]);
                    let dst = out.as_mut_ptr().add(k * panel + p * MR);
                    _mm512_mask_storeu_epi32(dst.cast(), store, lanes);
                }
            }
        }
    }

    /// `pack_b` for a `B` stored transposed (column `j` contiguous, `col_stride` apart), a full
    /// panel of `NR` columns: the pairs `16q..16q + 16` of sixteen columns are sixteen 64-byte
    /// loads, transposed in registers (4 rounds of 16 shuffles) into sixteen rows of the packed
    /// panel `[pair][column]`. Only whole groups of sixteen pairs; the caller packs the rest.
    ///
    /// # Safety
    ///
    /// AVX-512 F present; `origin` addresses `NR` columns of `2·pairs` elements; `out` holds
    /// `pairs · NR` lanes.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn pack_transposed(
        origin: *const u16,
        col_stride: usize,
        pairs: usize,
        out: &mut [u32],
    ) {
        assert!(out.len() >= pairs * NR);
        for q in 0..pairs / 16 {
            for g in 0..NV {
                // SAFETY: columns 16g.. of the panel, pairs 16q.. are inside B; rows 16q.. of
                // the packed panel inside `out`.
                unsafe {
                    let r: [__m512i; 16] = std::array::from_fn(|c| {
                        let column = origin.add((16 * g + c) * col_stride + 32 * q);
                        _mm512_loadu_si512(column.cast())
                    });
                    for (p, row) in transpose16(r).iter().enumerate() {
                        let dst = out.as_mut_ptr().add((16 * q + p) * NR + 16 * g);
                        _mm512_storeu_si512(dst.cast(), *row);
                    }
                }
            }
        }
    }

    /// `pack_b` for a row-major `B`, a full panel of `NR` columns: each pair of rows is read
    /// sixteen columns at a time, widened and interleaved (`r0[j] | r1[j] << 16`).
    ///
    /// # Safety
    ///
    /// AVX-512 F present; `origin` addresses `2·pairs` rows, `row_stride` apart, of `NR`
    /// contiguous elements; `out` holds `pairs · NR` lanes.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn pack_rows(origin: *const u16, row_stride: usize, pairs: usize, out: &mut [u32]) {
        assert!(out.len() >= pairs * NR);
        for p in 0..pairs {
            for g in 0..NV {
                // SAFETY: rows 2p, 2p + 1 and the panel's columns are inside B; row p of the
                // packed panel inside `out`.
                unsafe {
                    let r0 = origin.add(2 * p * row_stride + 16 * g);
                    let r1 = origin.add((2 * p + 1) * row_stride + 16 * g);
                    let lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(r0.cast()));
                    let hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(r1.cast()));
                    let lanes = _mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi));
                    _mm512_storeu_si512(out.as_mut_ptr().add(p * NR + 16 * g).cast(), lanes);
                }
            }
        }
    }

    /// The transpose of 16 vectors of 16 lanes: lane `c` of vector `p` becomes lane `p` of
    /// vector `c`.
    #[target_feature(enable = "avx512f")]
    pub(super) fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
        // Pairs of rows interleave their 32-bit lanes, then 64-bit lanes, then 128-bit blocks
        // twice: after the four rounds lane c of row p sits at row c, lane p.
        let mut t = [_mm512_setzero_si512(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        let mut u = [_mm512_setzero_si512(); 16];
        for i in 0..4 {
            for j in 0..2 {
                let (a, b) = (t[4 * i + j], t[4 * i + j + 2]);
                u[4 * i + 2 * j] = _mm512_unpacklo_epi64(a, b);
                u[4 * i + 2 * j + 1] = _mm512_unpackhi_epi64(a, b);
            }
        }
        let mut v = [_mm512_setzero_si512(); 16];
        for i in 0..2 {
            for j in 0..4 {
                let (a, b) = (u[8 * i + j], u[8 * i + j + 4]);
                v[8 * i + j] = _mm512_shuffle_i32x4::<0b10_00_10_00>(a, b);
                v[8 * i + j + 4] = _mm512_shuffle_i32x4::<0b11_01_11_01>(a, b);
            }
        }
        let mut w = [_mm512_setzero_si512(); 16];
        for j in 0..8 {
            let (a, b) = (v[j], v[j + 8]);
            w[j] = _mm512_shuffle_i32x4::<0b10_00_10_00>(a, b);
            w[j + 8] = _mm512_shuffle_i32x4::<0b11_01_11_01>(a, b);
        }
        w
    }

    /// A panel of `A`: `MR` rows of `pairs` pairs, the pair `q` of row `r` (two bf16, as one
    /// 32-bit lane) at `start + r·row + q·pair` bytes: packed (`row` 4, `pair` 4·MR), or `A`
    /// itself when row-major (`row` its row stride in bytes, `pair` 4).
    #[derive(Clone, Copy)]
    pub struct Panel {
        pub start: *const u8,
        pub row: usize,
        pub pair: usize,
    }

    /// `C[..rows, ..cols] (+)= A_panel · B_panel` over `pairs` pairs of `K`: the tile in `MR × NV`
    /// = 24 registers, one `vdpbf16ps` per row, vector and pair.
    ///
    /// # Safety
    ///
    /// AVX-512 F and BF16 present; `a` addresses `pairs` pairs of MR rows (of which the first
    /// `rows` are used); `b` a panel of `pairs · NR` lanes; `c` a tile of `rows × cols` with row
    /// stride `ldc`.
    #[target_feature(enable = "avx512f,avx512bf16")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn tile(
        a: Panel,
        b: &[u32],
        pairs: usize,
        c: *mut f32,
        ldc: usize,
        rows: usize,
        cols: usize,
        accumulate: bool,
    ) {
        let mut acc = [[_mm512_setzero_ps(); NV]; MR];
        let (mut pa, mut pb) = (a.start, b.as_ptr());
        for _ in 0..pairs {
            // SAFETY: `pairs` pairs of MR rows and NR lanes in the panels.
            unsafe {
                let b: [__m512bh; NV] = std::array::from_fn(|v| {
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                        pb.add(16 * v) as *const _
                    ))
                });
                for (r, acc) in acc.iter_mut().enumerate() {
                    let lane = (pa.add(r * a.row) as *const i32).read_unaligned();
                    let a = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(lane));
                    for (acc, &b) in acc.iter_mut().zip(&b) {
                        *acc = _mm512_dpbf16_ps(*acc, a, b);
                    }
                }
                pa = pa.add(a.pair);
                pb = pb.add(NR);
            }
        }
        // SAFETY: the tile's rows × cols are inside C.
        unsafe {
            if cols == NR {
                for (r, acc) in acc.iter().enumerate().take(rows) {
                    let row = c.add(r * ldc);
                    for (h, &v) in acc.iter().enumerate() {
                        let dst = row.add(16 * h);
                        let v = if accumulate {
                            _mm512_add_ps(v, _mm512_loadu_ps(dst))
                        } else {
                            v
                        };
                        _mm512_storeu_ps(dst, v);
                    }
                }
            } else {
                let mut buf = [0f32; NR];
                for (r, acc) in acc.iter().enumerate().take(rows) {
                    for (h, &v) in acc.iter().enumerate() {
                        _mm512_storeu_ps(buf.as_mut_ptr().add(16 * h), v);
                    }
                    let row = c.add(r * ldc);
                    for (j, &v) in buf.iter().enumerate().take(cols) {
                        *row.add(j) = if accumulate { *row.add(j) + v } else { v };
                    }
                }
            }
        }
    }
}

/// `C = A · B` with every product of bf16 operands summed in f64, then rounded to f32: the
/// function [`gemm`] computes, up to the order of its f32 additions. For tests and for the
/// fallback's checks; slow.
///
/// # Safety
///
/// As [`gemm`].
#[cfg(test)]
pub unsafe fn reference(m: usize, n: usize, k: usize, a: Matrix, b: Matrix) -> Vec<f32> {
    let mut c = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut sum = 0f64;
            for p in 0..k {
                // SAFETY: the caller's contract.
                unsafe { sum += widen(a.at(i, p)) as f64 * widen(b.at(p, j)) as f64 };
            }
            c[i * n + j] = sum as f32;
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel runs where the CPU can run it and it pays (not Intel), `FFN_BF16` overrides
    /// that, a value it does not know is named and ignored, and a CPU without `avx512_bf16`
    /// always widens.
    #[test]
    fn the_kernel_is_chosen_where_it_pays_and_ffn_bf16_overrides() {
        let set = |v: &str| Some(v.to_string());
        assert!(choose(true, None, false).0);
        assert!(!choose(true, None, true).0);
        assert!(choose(true, None, true).1.contains("Intel"));
        assert!(choose(true, set("kernel"), true).0);
        assert!(!choose(true, set("widen"), false).0);
        assert!(choose(true, set(" "), false).0);
        let (kernel, report) = choose(true, set("fast"), false);
        assert!(
            kernel && report.contains("FFN_BF16=fast ignored"),
            "{report}"
        );
        for setting in [None, set("kernel"), set("widen")] {
            for intel in [false, true] {
                let (kernel, report) = choose(false, setting.clone(), intel);
                assert!(!kernel && report.contains("no avx512_bf16"), "{report}");
            }
        }
    }

    #[test]
    fn rounding_is_to_nearest_even_and_keeps_nan_and_infinity() {
        // 1 + 2⁻⁸ is halfway between 1 and 1 + 2⁻⁷: ties to the even mantissa (1).
        assert_eq!(widen(round(1.0 + 2f32.powi(-8))), 1.0);
        // 1 + 3·2⁻⁸ is halfway between 1 + 2⁻⁷ and 1 + 2⁻⁶: to the even one, 1 + 2⁻⁶.
        assert_eq!(widen(round(1.0 + 3.0 * 2f32.powi(-8))), 1.0 + 2f32.powi(-6));
        assert_eq!(
            widen(round(1.0 + 2f32.powi(-8) + 2f32.powi(-20))),
            1.0 + 2f32.powi(-7)
        );
        assert_eq!(widen(round(-2.5)), -2.5);
        assert!(widen(round(f32::NAN)).is_nan());
        assert_eq!(widen(round(f32::INFINITY)), f32::INFINITY);
        assert_eq!(widen(round(f32::MAX)), f32::INFINITY);
        // Against an f64 rounding of the same values: the nearest of the two neighbours.
        let mut x = 0.1f32;
        for _ in 0..10_000 {
            x = (x * 1.618_034 + 0.37).fract() * 1e3 - 500.0;
            let r = widen(round(x)) as f64;
            let ulp = 2f64.powi((x.abs() as f64).log2().floor() as i32 - 7);
            assert!((r - x as f64).abs() <= ulp / 2.0, "{x} -> {r}");
        }
    }

    fn matrix(rows: usize, cols: usize, seed: u32) -> Vec<u16> {
        let mut s = seed;
        (0..rows * cols)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                round((s >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0)
            })
            .collect()
    }

    /// The packed kernel equals the f64 sum of the same bf16 products to within f32 rounding
    /// of a sum of `k` terms, for every layout and edge: sizes that are not multiples of the
    /// tile, of the K block or even, and transposed operands.
    #[test]
    fn sixteen_lanes_transpose() {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            use std::arch::x86_64::*;
            // SAFETY: AVX-512 F detected.
            unsafe {
                let rows: [__m512i; 16] = std::array::from_fn(|p| {
                    let lanes: [i32; 16] = std::array::from_fn(|c| (100 * p + c) as i32);
                    _mm512_loadu_si512(lanes.as_ptr().cast())
                });
                let t = x86::transpose16(rows);
                for (c, v) in t.iter().enumerate() {
                    let mut lanes = [0i32; 16];
                    _mm512_storeu_si512(lanes.as_mut_ptr().cast(), *v);
                    let want: [i32; 16] = std::array::from_fn(|p| (100 * p + c) as i32);
                    assert_eq!(lanes, want, "vector {c}");
                }
            }
        }
    }

    #[test]
    fn the_packed_kernel_computes_the_exact_products_summed_in_f32() {
        if !available() {
            eprintln!("no avx512_bf16 on this CPU: the kernel is not run here");
            return;
        }
        for &(m, n, k) in &[
            (1, 1, 1),
            (13, 33, 7),
            (12, 32, 256),
            (6, 64, 2050),
            (18, 128, 64),
            (25, 65, 513),
            (97, 40, 300),
            (200, 70, 1),
            (200, 64, 130),
            (30, 40, 2051),
        ] {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                let a = matrix(m, k, 1);
                let b = matrix(k, n, 2);
                // Stored transposed when asked: the same matrix through other strides.
                let store = |v: &[u16], rows: usize, cols: usize, t: bool| -> (Vec<u16>, Matrix) {
                    let data: Vec<u16> = if t {
                        (0..rows * cols)
                            .map(|idx| v[(idx % rows) * cols + idx / rows])
                            .collect()
                    } else {
                        v.to_vec()
                    };
                    let (rs, cs) = if t { (1, rows) } else { (cols, 1) };
                    let mat = Matrix {
                        ptr: data.as_ptr(),
                        row_stride: rs,
                        col_stride: cs,
                    };
                    (data, mat)
                };
                let (_da, ma) = store(&a, m, k, ta);
                let (_db, mb) = store(&b, k, n, tb);
                let mut c = vec![f32::NAN; m * n];
                let want = unsafe {
                    gemm(m, n, k, ma, mb, c.as_mut_ptr());
                    reference(m, n, k, ma, mb)
                };
                for (idx, (&got, &want)) in c.iter().zip(&want).enumerate() {
                    // Summed in f32 in any order, k terms: |error| ≤ k·2⁻²⁴·Σ|aᵢₚ bₚⱼ| (and
                    // half an ulp for the reference's own rounding to f32).
                    let (i, j) = (idx / n, idx % n);
                    let abs: f64 = (0..k)
                        .map(|p| (widen(a[i * k + p]) as f64 * widen(b[p * n + j]) as f64).abs())
                        .sum();
                    let tol = k as f64 * 2f64.powi(-24) * abs + want.abs() as f64 * 2f64.powi(-24);
                    assert!(
                        ((got - want) as f64).abs() <= tol,
                        "{m}x{n}x{k} t=({ta},{tb}) at ({i},{j}): {got} vs {want}"
                    );
                }
            }
        }
    }

    /// [`gemm_then`] hands on every row of `C` once, in disjoint blocks, and the rows it hands
    /// on are [`gemm`]'s bit for bit: in the caller's buffer, in the threads' own (one `K`
    /// block), and with more `K` than one block (where it makes a whole `C` after all).
    #[test]
    fn each_block_of_rows_is_handed_on_once_as_computed() {
        if !available() {
            eprintln!("no avx512_bf16 on this CPU: the kernel is not run here");
            return;
        }
        for &(m, n, k) in &[(1, 5, 3), (200, 70, 130), (389, 64, 512), (50, 33, 2051)] {
            let (a, b) = (matrix(m, k, 3), matrix(k, n, 4));
            let ma = Matrix {
                ptr: a.as_ptr(),
                row_stride: k,
                col_stride: 1,
            };
            let mb = Matrix {
                ptr: b.as_ptr(),
                row_stride: n,
                col_stride: 1,
            };
            let mut want = vec![f32::NAN; m * n];
            // SAFETY: the shapes are the buffers'.
            unsafe { gemm(m, n, k, ma, mb, want.as_mut_ptr()) };
            for into_c in [false, true] {
                let got = std::sync::Mutex::new(vec![f32::NAN; m * n]);
                let seen = std::sync::Mutex::new(vec![0u32; m]);
                let mut c = vec![f32::NAN; m * n];
                let then = |rows: std::ops::Range<usize>, block: &mut [f32]| {
                    assert_eq!(block.len(), rows.len() * n);
                    got.lock().unwrap()[rows.start * n..rows.end * n].copy_from_slice(block);
                    for r in rows {
                        seen.lock().unwrap()[r] += 1;
                    }
                    block.fill(1.0);
                };
                let target = into_c.then_some(c.as_mut_ptr());
                // SAFETY: as above.
                unsafe { gemm_then(m, n, k, ma, mb, target, &then) };
                let case = format!("{m}x{n}x{k} into C {into_c}");
                assert!(seen.into_inner().unwrap().iter().all(|&s| s == 1), "{case}");
                let got = got.into_inner().unwrap();
                assert!(got.iter().zip(&want).all(|(g, w)| g == w), "{case}");
                // In place: what `then` wrote is what the caller's buffer holds.
                if into_c {
                    assert!(c.iter().all(|&v| v == 1.0), "{case}");
                }
            }
        }
    }
}
