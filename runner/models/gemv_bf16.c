/* A bfloat16 matrix times a few rows, for a drafter's weights (runner/models/linear_draft.py).
 *
 * Built at first use by runner/native.py (gcc -O3 -march=native -fopenmp) and called
 * through ctypes. Only where the CPU has AVX512_BF16: each 64-byte load of the weight
 * feeds one vdpbf16ps per row, sixteen outputs at a time, so a call of a row or two
 * streams the weight once at memory speed and does nothing else. oneDNN spends a fixed
 * cost per call on this shape of work that a drafter's small matrices (0.6-3.5 MB)
 * cannot hide.
 *
 * Sums are in float32, each output's over the inputs in order, the result rounded once
 * to bfloat16 after the bias and the residual are added. A row's bits here are not
 * those of oneDNN, and the drafter needs no more: what it proposes is verified.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define LANES 16
#define ROWS 4 /* rows whose sums are held at once: a weight load serves each */
#define AHEAD 1024 /* bytes of weight fetched ahead of use */

/* Sixteen outputs (block `nb`) for up to ROWS rows. The weight is packed as
 * [N / 16][K / 2][16][2]: a block's 16 outputs take two inputs per lane per load. */
static void block(const uint16_t *w, const uint16_t *x, int64_t xs, int rows, int K, int N,
                  int nb, uint16_t *y, int64_t ys, const uint16_t *res, int64_t rs,
                  const float *bias) {
    __m512 acc[ROWS];
    for (int m = 0; m < ROWS; m++) acc[m] = _mm512_setzero_ps();
    const uint16_t *wb = w + (int64_t)nb * LANES * K;
    for (int k2 = 0; k2 < K / 2; k2++) {
        if ((k2 & 1) == 0) _mm_prefetch((const char *)(wb + (int64_t)k2 * 32) + AHEAD, _MM_HINT_T0);
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(wb + (int64_t)k2 * 32);
        for (int m = 0; m < rows; m++) {
            int32_t pair;
            memcpy(&pair, x + m * xs + 2 * k2, 4);
            acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_set1_epi32(pair));
        }
    }
    const int valid = N - nb * LANES < LANES ? N - nb * LANES : LANES;
    for (int m = 0; m < rows; m++) {
        float out[LANES];
        _mm512_storeu_ps(out, acc[m]);
        for (int l = 0; l < valid; l++) {
            const int64_t n = (int64_t)nb * LANES + l;
            float v = out[l];
            if (bias) v += bias[n];
            if (res) v += bf16_to_f32(res[m * rs + n]);
            y[m * ys + n] = f32_to_bf16(v);
        }
    }
}

/* y[m] = w @ x[m] (+ bias) (+ res[m]) for M rows. x: rows of K bfloat16, `xs` apart
 * (K even); w: packed as `block` reads it, N rounded up to 16 with zero rows; y and res:
 * rows of N bfloat16, `ys` and `rs` apart; bias: N floats or NULL. Each thread streams
 * its own contiguous run of output blocks. */
void specbudget_gemv_bf16(const uint16_t *w, const uint16_t *x, int64_t xs, int M, int K,
                          int N, uint16_t *y, int64_t ys, const uint16_t *res, int64_t rs,
                          const float *bias) {
    const int blocks = (N + LANES - 1) / LANES;
#pragma omp parallel
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int lo = (int)((int64_t)blocks * t / T), hi = (int)((int64_t)blocks * (t + 1) / T);
        for (int nb = lo; nb < hi; nb++)
            for (int m0 = 0; m0 < M; m0 += ROWS)
                block(w, x + m0 * xs, xs, M - m0 < ROWS ? M - m0 : ROWS, K, N, nb,
                      y + m0 * ys, ys, res ? res + m0 * rs : NULL, rs, bias);
    }
}
