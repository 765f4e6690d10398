/* Float32 rows times a weight held in bfloat16, for a float32 drafter's weights where the
 * CPU has AVX2 and FMA but no bfloat16 instructions (runner/models/linear_draft.py).
 *
 * Built at first use by runner/native.py (gcc -O3 -march=native -fopenmp) and called
 * through ctypes. A drafter's call of a row or a few is bound by reading its weight:
 * on a CPU whose memory delivers ~8 GB/s to two cores (the AVX2 EPYC this project ran
 * on, 2026-12-07) one row through the default eagle head's matrices spends its time
 * streaming them. Held in bfloat16 they are half the bytes; each 32-byte load of the
 * weight widens to sixteen float32 lanes (a shift into the high half of each lane,
 * which is what a bfloat16 is) and feeds two FMAs per row.
 *
 * Sums are in float32, each output's over the inputs in order, then the bias and the
 * residual added. The weight's rounding to bfloat16 and these sums are not what the
 * target's kernel would compute, and a drafter needs no more: what it proposes is
 * verified.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#define LANES 16  /* outputs a block: two registers of eight floats */
#define ROWS 6    /* rows whose sums are held at once (12 of 16 registers): a weight
                   * load serves each */
#define AHEAD 512 /* bytes of weight fetched ahead of use */

/* Sixteen outputs of each of B_ blocks from `nb` for ROWS_ rows, both constants at each
 * call (`block` below) so that the compiler holds every sum in a register: a loop over
 * a variable count of rows kept them on the stack, and a 5-row call cost 1.7x a 1-row
 * one. One row takes two blocks at once: four FMA chains, where two waited on the
 * multiply-add's latency. The weight is packed as [N / 16][K][16]: a block's sixteen
 * outputs for one input, then the next input. The two widenings interleave the lanes:
 * the low register holds outputs 0-3 and 8-11, the high one 4-7 and 12-15. */
static inline __attribute__((always_inline)) void block_rows(
        const int ROWS_, const int B_, const uint16_t *w, const float *x, int64_t xs, int K,
        int N, int nb, float *y, int64_t ys, const float *res, int64_t rs,
        const float *bias) {
    __m256 lo_acc[ROWS], hi_acc[ROWS];
#pragma GCC unroll 8
    for (int i = 0; i < ROWS_ * B_; i++) lo_acc[i] = hi_acc[i] = _mm256_setzero_ps();
    const uint16_t *wb = w + (int64_t)nb * LANES * K;
    const __m256i zero = _mm256_setzero_si256();
    for (int k = 0; k < K; k++) {
#pragma GCC unroll 2
        for (int b = 0; b < B_; b++) {
            const uint16_t *at = wb + ((int64_t)b * K + k) * LANES;
            if ((k & 1) == 0) _mm_prefetch((const char *)at + AHEAD, _MM_HINT_T0);
            const __m256i raw = _mm256_loadu_si256((const __m256i *)at);
            const __m256 lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw));
            const __m256 hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw));
#pragma GCC unroll 8
            for (int m = 0; m < ROWS_; m++) {
                const __m256 xv = _mm256_broadcast_ss(x + m * xs + k);
                lo_acc[m * B_ + b] = _mm256_fmadd_ps(lo, xv, lo_acc[m * B_ + b]);
                hi_acc[m * B_ + b] = _mm256_fmadd_ps(hi, xv, hi_acc[m * B_ + b]);
            }
        }
    }
    /* unrolled as the loops above: indexed by a variable, the sums had to live in
     * memory, and the loop over inputs stored every one of them after each FMA (five
     * rows 12.8 -> 5.4 cycles a block of 16 weights; AVX2 EPYC, 2 threads, 8,192 x 576
     * in cache) */
#pragma GCC unroll 8
    for (int i = 0; i < ROWS_ * B_; i++) {
        const int m = i / B_, at = nb + i % B_;
        const int valid = N - at * LANES < LANES ? N - at * LANES : LANES;
        float lo_out[8], hi_out[8], out[LANES];
        _mm256_storeu_ps(lo_out, lo_acc[i]);
        _mm256_storeu_ps(hi_out, hi_acc[i]);
        for (int j = 0; j < 4; j++) {  /* undo the interleave */
            out[j] = lo_out[j];
            out[j + 4] = hi_out[j];
            out[j + 8] = lo_out[j + 4];
            out[j + 12] = hi_out[j + 4];
        }
        for (int l = 0; l < valid; l++) {
            const int64_t n = (int64_t)at * LANES + l;
            float v = out[l];
            if (bias) v += bias[n];
            if (res) v += res[m * rs + n];
            y[m * ys + n] = v;
        }
    }
}

/* `block_rows` for 1 to ROWS rows (one row: two blocks where `pair`), each its own copy. */
static void block(const uint16_t *w, const float *x, int64_t xs, int rows, int pair, int K,
                  int N, int nb, float *y, int64_t ys, const float *res, int64_t rs,
                  const float *bias) {
    if (rows == 1 && pair) {
        block_rows(1, 2, w, x, xs, K, N, nb, y, ys, res, rs, bias);
        return;
    }
    switch (rows) {
#define CASE(R) case R: block_rows(R, 1, w, x, xs, K, N, nb, y, ys, res, rs, bias); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6)
#undef CASE
        default: break;
    }
}

/* y[m] = w @ x[m] (+ bias) (+ res[m]) for M rows. x: rows of K floats, `xs` apart;
 * w: packed as `block` reads it, N rounded up to 16 with zero rows; y and res: rows of
 * N floats, `ys` and `rs` apart; bias: N floats or NULL. Each thread streams its own
 * contiguous run of output blocks. */
void specbudget_gemv_f32(const uint16_t *w, const float *x, int64_t xs, int M, int K, int N,
                         float *y, int64_t ys, const float *res, int64_t rs,
                         const float *bias) {
    const int blocks = (N + LANES - 1) / LANES;
#pragma omp parallel
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int lo = (int)((int64_t)blocks * t / T), hi = (int)((int64_t)blocks * (t + 1) / T);
        for (int nb = lo; nb < hi; nb += M == 1 && nb + 1 < hi ? 2 : 1)
            for (int m0 = 0; m0 < M; m0 += ROWS)
                block(w, x + m0 * xs, xs, M - m0 < ROWS ? M - m0 : ROWS, nb + 1 < hi, K, N,
                      nb, y + m0 * ys, ys, res ? res + m0 * rs : NULL, rs, bias);
    }
}
