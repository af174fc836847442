/* The bf16 tile's shape, measured outside ffn: the peak of vdpbf16ps on one core, and a model of
 * bf16.rs's packed GEMM (Goto's blocking, packed panels, one thread) for a tile of MR rows and
 * NV vectors of 16 columns. BENCHMARKS.md (2026-11-26, later) has what it gave on Zen 5.
 *
 *   gcc -O3 -march=cooperlake -DMR=6 -DNV=4 -o /tmp/tile tools/bf16_tile.c
 *   /tmp/tile peak                      # GF/s of 24 independent vdpbf16ps chains
 *   /tmp/tile 4096 2048 512 [KB] [MB]   # m n k, K block, rows per block: GF/s, best of 5
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifndef MR
#define MR 6
#endif
#ifndef NV
#define NV 4
#endif
#define NR (16 * NV)

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

static void peak(void) {
  __m512 acc[24];
  for (int i = 0; i < 24; i++) acc[i] = _mm512_setzero_ps();
  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = a;
  long n = 100000000;
  double t0 = now();
  for (long i = 0; i < n; i++) {
#pragma GCC unroll 24
    for (int j = 0; j < 24; j++) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
    __asm__ volatile("" : "+v"(a));
  }
  double s = now() - t0;
  float x = 0;
  for (int i = 0; i < 24; i++) x += _mm512_reduce_add_ps(acc[i]);
  printf("vdpbf16ps peak: %.1f GF/s (%g)\n", n * 24 * 64.0 / s / 1e9, x);
}

/* C[MR x NR] (+)= A panel [pair][MR] . B panel [pair][NR] */
static inline void tile(const uint32_t *pa, const uint32_t *pb, int pairs, float *c, int ldc,
                        int accumulate) {
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; r++)
    for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_ps();
  for (int p = 0; p < pairs; p++) {
    __m512bh b[NV];
    for (int v = 0; v < NV; v++) b[v] = (__m512bh)_mm512_loadu_si512(pb + 16 * v);
    for (int r = 0; r < MR; r++) {
      __m512bh a = (__m512bh)_mm512_set1_epi32(pa[r]);
      for (int v = 0; v < NV; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
    pa += MR;
    pb += NR;
  }
  for (int r = 0; r < MR; r++)
    for (int v = 0; v < NV; v++) {
      float *d = c + r * ldc + 16 * v;
      __m512 x = acc[r][v];
      if (accumulate) x = _mm512_add_ps(x, _mm512_loadu_ps(d));
      _mm512_storeu_ps(d, x);
    }
}

int main(int argc, char **argv) {
  if (argc > 1 && !strcmp(argv[1], "peak")) {
    peak();
    return 0;
  }
  if (argc < 4) {
    fprintf(stderr, "usage: %s peak | m n k [K_BLOCK] [M_BLOCK]\n", argv[0]);
    return 2;
  }
  int m = atoi(argv[1]), n = atoi(argv[2]), k = atoi(argv[3]);
  int kb = argc > 4 ? atoi(argv[4]) : 1024, mb = argc > 5 ? atoi(argv[5]) : 192;
  m = m / MR * MR;
  n = n / NR * NR;
  int pairs = k / 2;
  uint32_t *A = aligned_alloc(64, (size_t)m * pairs * 4);
  uint32_t *B = aligned_alloc(64, (size_t)n * pairs * 4);
  float *C = aligned_alloc(64, (size_t)m * n * 4);
  for (size_t i = 0; i < (size_t)m * pairs; i++) A[i] = 0x3f803f80;
  for (size_t i = 0; i < (size_t)n * pairs; i++) B[i] = 0x3f803f80;
  double best = 1e9;
  for (int rep = 0; rep < 5; rep++) {
    double t0 = now();
    for (int k0 = 0; k0 < pairs; k0 += kb / 2) {
      int pc = pairs - k0 < kb / 2 ? pairs - k0 : kb / 2;
      for (int i0 = 0; i0 < m; i0 += mb) {
        int mc = m - i0 < mb ? m - i0 : mb;
        for (int j = 0; j < n; j += NR) {
          const uint32_t *pb = B + (size_t)(j / NR) * pairs * NR + (size_t)k0 * NR;
          for (int i = i0; i < i0 + mc; i += MR) {
            const uint32_t *pa = A + (size_t)(i / MR) * pairs * MR + (size_t)k0 * MR;
            tile(pa, pb, pc, C + (size_t)i * n + j, n, k0 > 0);
          }
        }
      }
    }
    double t = now() - t0;
    if (t < best) best = t;
  }
  printf("MR=%d NR=%d K_BLOCK=%d M_BLOCK=%d m=%d n=%d k=%d: %.1f GF/s\n", MR, NR, kb, mb, m, n,
         k, 2.0 * m * n * k / best / 1e9);
  return 0;
}
