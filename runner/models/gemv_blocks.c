/* Float32 rows times a weight held as its GGUF blocks (Q4_1 or Q8_0), for a float32 model
 * whose linear layers came from such a file (runner/models/linear_blocks.py).
 *
 * Built at first use by runner/native.py and called through ctypes. The default model is
 * SmolLM2-135M's Q4_1 GGUF dequantized to float32 once (runner/model_prep.py): its
 * weights are 4-bit codes times a per-32-input scale plus a per-32-input minimum, and
 * a decode step that streams them as float32 moves 8x the bytes the codes need. On a
 * CPU whose memory gives two cores ~8 GB/s (the AVX2 EPYC this project ran on,
 * 2026-12-07) that read is the step.
 *
 * Each weight is rebuilt here exactly as the conversion computed it, d * q rounded to
 * float32, then + m rounded: the product of a float16 scale (11 significant bits) and
 * a code of at most 8 bits is exact in float32, so one FMA rounds only the sum and
 * gives the same bits. The model's weights are the float32 ones bit for bit. Sums are in float32, each output's over the inputs in
 * order, then the bias and the residual added: a row's bits do not depend on the other
 * rows of the call, as the target's kernel must ensure (runner/models/linear.py).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>

#define LANES 16  /* outputs a block: two registers of eight floats */
#define GROUP 32  /* inputs sharing a scale (and a minimum) */
#define CHUNK 64  /* inputs a wide call rebuilds at once: K is a multiple */
/* Inputs a row group's sums run over between loading and storing them (the block's
 * rebuilt weights for them: 16 KB, in L1 beside the rows' inputs). At 64, a group's
 * 12 sums were loaded and stored every 64 FMAs a register, and 128 rows ran 1.4x slower
 * (AVX2 EPYC, 2 threads, same run: 576 x 1536, 95 -> 133 GFLOP/s; 16 rows 104 -> 118;
 * 128 and 384 within noise of 256, 512 slower). */
#define SPAN 256
#define TILE 6    /* rows whose sums a wide call holds at once (12 of 16 registers) */
/* Rows a fused call takes: at 6 its sums, rebuilt weights and scales need more than the
 * 16 registers, and the wide path ran 6 rows in 0.75x the time (AVX2 EPYC, 2 threads,
 * 576 x 1536: 135 -> 101 us). */
#define FUSED_ROWS 5
#define AHEAD 2   /* groups fetched ahead of use */

/* R_ rows times one rebuilt block (`w`: [len][16]) over `len` inputs, the sums carried in
 * `acc` ([R_][16]; zero before the first span). R_ is a constant at each call (`tile`
 * below) so that the compiler holds every sum in a register; an output's sum is the
 * same sequence of FMAs as `fused_rows`'. */
static inline __attribute__((always_inline)) void tile_rows(
        const int R_, const float *w, const float *x, int64_t xs, float *acc, int len) {
    __m256 lo_acc[TILE], hi_acc[TILE];
#pragma GCC unroll 8
    for (int r = 0; r < R_; r++) {
        lo_acc[r] = _mm256_load_ps(acc + r * LANES);
        hi_acc[r] = _mm256_load_ps(acc + r * LANES + 8);
    }
    for (int k = 0; k < len; k++) {
        const __m256 lo = _mm256_load_ps(w + (int64_t)k * LANES);
        const __m256 hi = _mm256_load_ps(w + (int64_t)k * LANES + 8);
#pragma GCC unroll 8
        for (int r = 0; r < R_; r++) {
            const __m256 xv = _mm256_broadcast_ss(x + r * xs + k);
            lo_acc[r] = _mm256_fmadd_ps(lo, xv, lo_acc[r]);
            hi_acc[r] = _mm256_fmadd_ps(hi, xv, hi_acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R_; r++) {
        _mm256_store_ps(acc + r * LANES, lo_acc[r]);
        _mm256_store_ps(acc + r * LANES + 8, hi_acc[r]);
    }
}

/* `tile_rows` for one block and 1 to 6 rows, each count its own copy. */
static void tile(int rows, const float *w, const float *x, int64_t xs, float *acc, int len) {
#define CASE(R) if (rows == R) { tile_rows(R, w, x, xs, acc, len); return; }
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6)
#undef CASE
}

/* Output block nb's sums (in `acc`, [M][16]) to outputs, with the bias and the residual. */
static void finish(const float *acc, int M, int N, int nb, float *y, int64_t ys,
                   const float *res, int64_t rs, const float *bias) {
    const int valid = N - nb * LANES < LANES ? N - nb * LANES : LANES;
    for (int r = 0; r < M; r++)
        for (int l = 0; l < valid; l++) {
            const int64_t n = (int64_t)nb * LANES + l;
            float v = acc[(int64_t)r * LANES + l];
            if (bias) v += bias[n];
            if (res) v += res[r * rs + n];
            y[r * ys + n] = v;
        }
}

/* The packed weight (runner/models/linear_blocks.py). Codes: 4-bit, [N / 16][K / 8][16]
 * 32-bit words, word l holding output l's codes for 8 inputs in a row, the first in
 * its lowest nibble; or 8-bit signed, [N / 16][K][16] bytes. Either takes K * 8 (or 16)
 * bytes a block of outputs, a group's codes in one run. Scales and minimums: float16,
 * [N / 16][K / 32][16] (no minimums for 8-bit codes: the weight is d * q).
 *
 * Output block `nb`'s scales (and minimums) for group `g`, as two registers each. */
struct scales { __m256 d_lo, d_hi, m_lo, m_hi; };

static inline __attribute__((always_inline)) struct scales scales_at(
        const int BITS, const uint16_t *d, const uint16_t *m, int K, int nb, int g) {
    const int64_t i = ((int64_t)nb * (K / GROUP) + g) * LANES;
    struct scales s;
    s.d_lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + i)));
    s.d_hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + i + 8)));
    s.m_lo = BITS == 4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + i))) : s.d_lo;
    s.m_hi = BITS == 4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + i + 8))) : s.d_hi;
    return s;
}

/* Output block `nb`'s 4-bit code words for inputs [k8, k8 + 8) (outputs 0-7, 8-15);
 * nothing for 8-bit codes, which `weights_at` loads an input at a time. */
struct words { __m256i lo, hi; };

static inline __attribute__((always_inline)) struct words words_at(
        const int BITS, const uint8_t *codes, int K, int nb, int k8) {
    struct words w = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    if (BITS == 4) {
        const uint8_t *at = codes + ((int64_t)nb * K + k8) * 8;
        w.lo = _mm256_loadu_si256((const __m256i *)at);
        w.hi = _mm256_loadu_si256((const __m256i *)(at + 32));
    }
    return w;
}

/* Code `nib` of every word as an exact float: the nibble under the exponent of 2^23,
 * less 2^23. Integer ops and a subtraction, where a conversion and a widening shuffle
 * competed with the sums' multiply-adds for their ports (AVX2 EPYC, one thread, five
 * rows: 7.8 -> 6.9 cycles a block of 16 weights; one row 4.0 -> 3.2). */
static inline __attribute__((always_inline)) __m256 nibble(__m256i words, const int nib) {
    const __m256i q = _mm256_and_si256(_mm256_srli_epi32(words, 4 * nib), _mm256_set1_epi32(0xF));
    return _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(q, _mm256_set1_epi32(0x4B000000))),
                         _mm256_set1_ps(8388608.0f));
}

/* Sixteen weights of output block `nb` at input `k` (4-bit: nibble `nib` of `w`, the
 * words of the 8 inputs from k - nib), rebuilt in two registers (outputs 0-7 and
 * 8-15): the one place a weight is rebuilt, for the fused and the wide path alike.
 * Callers unroll the inputs of a word, so `nib` (the shift) is a constant. */
static inline __attribute__((always_inline)) void weights_at(
        const int BITS, const uint8_t *codes, const struct words *w, const struct scales *s,
        int K, int nb, int k, const int nib, __m256 *lo, __m256 *hi) {
    if (BITS == 4) {
        *lo = _mm256_fmadd_ps(nibble(w->lo, nib), s->d_lo, s->m_lo);
        *hi = _mm256_fmadd_ps(nibble(w->hi, nib), s->d_hi, s->m_hi);
    } else {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(codes + ((int64_t)nb * K + k) * LANES));
        *lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), s->d_lo);
        *hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8))), s->d_hi);
    }
}

/* Output block `nb`'s codes and scales for group `g`, fetched towards L1 ahead of use: a
 * run's blocks are separate streams, each read slowly enough (rebuilding costs more
 * than streaming) that the hardware prefetcher alone left the memory idle. */
static inline __attribute__((always_inline)) void prefetch_group(
        const int BITS, const uint8_t *codes, const uint16_t *d, const uint16_t *m, int K,
        int nb, int g) {
    if (g >= K / GROUP) return;
    const int bytes = GROUP * LANES * BITS / 8;
    const uint8_t *c = codes + ((int64_t)nb * K + (int64_t)g * GROUP) * LANES * BITS / 8;
    for (int line = 0; line < bytes; line += 64) _mm_prefetch((const char *)(c + line), _MM_HINT_T0);
    const int64_t i = ((int64_t)nb * (K / GROUP) + g) * LANES;
    _mm_prefetch((const char *)(d + i), _MM_HINT_T0);
    if (BITS == 4) _mm_prefetch((const char *)(m + i), _MM_HINT_T0);
}

/* Output block `nb`'s weights for inputs [k0, k0 + CHUNK) rebuilt into `w` as [CHUNK][16]
 * floats, for a call of more than FUSED_ROWS rows: `weights_at`'s values, stored once
 * and read by every row group. */
static inline __attribute__((always_inline)) void rebuild_bits(
        const int BITS, const uint8_t *codes, const uint16_t *d, const uint16_t *m, int K,
        int nb, int k0, float *w) {
    for (int g = k0 / GROUP; g < (k0 + CHUNK) / GROUP; g++) {
        const struct scales s = scales_at(BITS, d, m, K, nb, g);
        for (int k8 = g * GROUP; k8 < (g + 1) * GROUP; k8 += 8) {
            const struct words cw = words_at(BITS, codes, K, nb, k8);
#pragma GCC unroll 8
            for (int nib = 0; nib < 8; nib++) {
                const int k = k8 + nib;
                __m256 lo, hi;
                weights_at(BITS, codes, &cw, &s, K, nb, k, nib, &lo, &hi);
                _mm256_store_ps(w + (int64_t)(k - k0) * LANES, lo);
                _mm256_store_ps(w + (int64_t)(k - k0) * LANES + 8, hi);
            }
        }
    }
}

static void rebuild(int bits, const uint8_t *codes, const uint16_t *d, const uint16_t *m,
                    int K, int nb, int k0, float *w) {
    if (bits == 4) rebuild_bits(4, codes, d, m, K, nb, k0, w);
    else rebuild_bits(8, codes, d, m, K, nb, k0, w);
}

/* A call of R_ <= FUSED_ROWS rows through output block nb, every weight rebuilt in
 * registers as it is used and every sum held in one over all K inputs: for a few rows,
 * storing the rebuilt weights and loading them back cost more than rebuilding them
 * once a row group. The sums are the same FMAs in the same order as `tile_rows`'.
 *
 * One block at a time, one row included. A one-row call had taken two blocks at once
 * (four FMA chains where one block has two): faster on a weight already in the caches
 * (one weight called again and again: 13.4 against 15.3 GFLOP/s one block at a time,
 * 576 x 576), but a decode step reads every weight cold, and there the two blocks' code
 * streams cost more than the chains won: a whole model's layers in a forward's order,
 * one row, 19.4 ms two blocks at a time against 15.0 one, in another run 17.2 against
 * 14.2 (AVX2 EPYC, 2 threads, the builds alternating in one process;
 * `benchmarks/block_kernel.py --sweep`), and speculation off served 1.12x the tok/s
 * (`--engine`). The bits are the same either way: each output's sum runs over its
 * inputs in order. */
static inline __attribute__((always_inline)) void fused_rows(
        const int BITS, const int R_, const uint8_t *codes, const uint16_t *d,
        const uint16_t *m, const float *x, int64_t xs, int K, int nb, float *acc) {
    __m256 lo_acc[FUSED_ROWS], hi_acc[FUSED_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < R_; r++) lo_acc[r] = hi_acc[r] = _mm256_setzero_ps();
    for (int g = 0; g < K / GROUP; g++) {
        const struct scales s = scales_at(BITS, d, m, K, nb, g);
        prefetch_group(BITS, codes, d, m, K, nb, g + AHEAD);
        for (int k8 = g * GROUP; k8 < (g + 1) * GROUP; k8 += 8) {
            const struct words cw = words_at(BITS, codes, K, nb, k8);
#pragma GCC unroll 8
            for (int nib = 0; nib < 8; nib++) {
                const int k = k8 + nib;
                __m256 lo, hi;
                weights_at(BITS, codes, &cw, &s, K, nb, k, nib, &lo, &hi);
#pragma GCC unroll 8
                for (int r = 0; r < R_; r++) {
                    const __m256 xv = _mm256_broadcast_ss(x + r * xs + k);
                    lo_acc[r] = _mm256_fmadd_ps(lo, xv, lo_acc[r]);
                    hi_acc[r] = _mm256_fmadd_ps(hi, xv, hi_acc[r]);
                }
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R_; r++) {
        _mm256_store_ps(acc + r * LANES, lo_acc[r]);
        _mm256_store_ps(acc + r * LANES + 8, hi_acc[r]);
    }
}

/* `fused_rows` for each code width and row count, each its own copy. */
static void fused(int bits, int rows, const uint8_t *codes, const uint16_t *d,
                  const uint16_t *m, const float *x, int64_t xs, int K, int nb, float *acc) {
#define CASE(R)                                                                      \
    if (rows == R) {                                                                 \
        if (bits == 4) fused_rows(4, R, codes, d, m, x, xs, K, nb, acc);             \
        else fused_rows(8, R, codes, d, m, x, xs, K, nb, acc);                       \
        return;                                                                      \
    }
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5)
#undef CASE
}

/* Each thread's buffers (rebuilt weights, then sums), grown to the widest call it has
 * seen. */
static __thread float *scratch;
static __thread int64_t scratch_floats;

static float *scratch_for(int64_t need) {
    if (need > scratch_floats) {
        free(scratch);
        scratch = aligned_alloc(64, (size_t)need * sizeof(float));
        scratch_floats = scratch ? need : 0;
    }
    return scratch;
}

/* Output block nb for a call of more than FUSED_ROWS rows: span by span, the block's
 * weights rebuilt once (a chunk at a time) and every row group's tile run over them. */
static void wide_block(int bits, const uint8_t *codes, const uint16_t *d, const uint16_t *m,
                       const float *x, int64_t xs, int M, int K, int N, int nb, float *w,
                       float *acc, float *y, int64_t ys, const float *res, int64_t rs,
                       const float *bias) {
    for (int64_t i = 0; i < (int64_t)M * LANES; i++) acc[i] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += SPAN) {
        const int len = K - k0 < SPAN ? K - k0 : SPAN;
        for (int c = 0; c < len; c += CHUNK)
            rebuild(bits, codes, d, m, K, nb, k0 + c, w + (int64_t)c * LANES);
        /* Row groups as even as TILE allows (13 rows as 5 + 4 + 4, not 6 + 6 + 1): a group
         * of one or two rows has too few FMA chains to hide their latency. The float32
         * forward after 256 tokens, both kernels alternated in one process: 10 rows 41.0
         * -> 34.7 ms, 13 rows 55.7 -> 47.1, 7 and 8 rows within 5 %. A row's sums are the
         * same in any group. */
        for (int r0 = 0, t = 0; r0 < M; t++) {
            const int groups = (M + TILE - 1) / TILE - t, left = M - r0;
            const int rows = (left + groups - 1) / groups;
            tile(rows, w, x + r0 * xs + k0, xs, acc + (int64_t)r0 * LANES, len);
            r0 += rows;
        }
    }
    finish(acc, M, N, nb, y, ys, res, rs, bias);
}

/* y[r] = w @ x[r] (+ bias) (+ res[r]) for M rows, w as `rebuild` reads it (`bits` 4 or
 * 8; N rounded up to a multiple of 16 x 6 with zero codes and scales; K a multiple of
 * 64). x: rows of K floats, `xs` apart; y and res: rows of N floats, `ys` and `rs`
 * apart; bias: N floats or NULL. Each thread takes its own contiguous run of output
 * blocks. Returns 0, or -1 where a thread's buffer could not be allocated (y then
 * incomplete). */
int specbudget_gemv_blocks(int bits, const uint8_t *codes, const uint16_t *d,
                           const uint16_t *m, const float *x, int64_t xs, int M, int K,
                           int N, float *y, int64_t ys, const float *res, int64_t rs,
                           const float *bias) {
    const int blocks = (N + LANES - 1) / LANES;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int lo = (int)((int64_t)blocks * t / T), hi = (int)((int64_t)blocks * (t + 1) / T);
        if (M <= FUSED_ROWS) {
            float acc[FUSED_ROWS * LANES] __attribute__((aligned(32)));
            for (int nb = lo; nb < hi; nb++) {
                fused(bits, M, codes, d, m, x, xs, K, nb, acc);
                finish(acc, M, N, nb, y, ys, res, rs, bias);
            }
        } else {
            float *w = lo < hi ? scratch_for((int64_t)(SPAN + M) * LANES) : NULL;
            if (lo < hi && !w) failed = 1;
            for (int nb = lo; w && nb < hi; nb++)
                wide_block(bits, codes, d, m, x, xs, M, K, N, nb, w, w + SPAN * LANES, y, ys,
                           res, rs, bias);
        }
    }
    return failed ? -1 : 0;
}

/* ---- finding the blocks in a float32 weight (runner/models/linear_blocks.py) ---------- */

/* `value` rounded to float16 (to nearest, ties to even) and back: the scale a quantizer
 * stored, to within a float16 step. */
static float f16_round(float value) { return _cvtsh_ss(_cvtss_sh(value, 0)); }

static float f16_step(float value, int step) {
    const unsigned short bits = _cvtss_sh(value, 0);
    if (step < 0 && (bits & 0x7FFF) == 0) return _cvtsh_ss(bits);  /* none below zero */
    return _cvtsh_ss((unsigned short)(bits + step));
}

static uint32_t bits_of(float value) {
    union { float f; uint32_t u; } v = {value + 0.0f};  /* + 0: a zero's sign is + */
    return v.u;
}

/* Whether scale `d` (and minimum `mn`) rebuild the group `w` bit for bit; if so its codes
 * into `codes`. */
static int rebuilds(int bits, const float *w, float d, float mn, int lowest, int highest,
                    int8_t *codes) {
    for (int j = 0; j < GROUP; j++) {
        float q = d > 0 ? rintf((w[j] - mn) / d) : 0.0f;
        q = q < lowest ? (float)lowest : q > highest ? (float)highest : q;
        const float rebuilt = bits == 4 ? fmaf(q, d, mn) : q * d;
        if (bits_of(rebuilt) != bits_of(w[j])) return 0;
        codes[j] = (int8_t)q;
    }
    return 1;
}

/* The `groups` groups of 32 weights at `w` as `bits`-bit blocks: codes (uint8 0-15 or
 * int8, one a weight), scales and minimums (one a group; minimums 0 for 8-bit codes).
 * The scale is taken from the group's extreme (a quantizer maps it to the top code) and
 * its float16 neighbours are tried too, each checked by rebuilding the whole group.
 * Returns how many groups no candidate rebuilt (0: the weight is of this format). */
int64_t specbudget_find_blocks(int bits, const float *w, int64_t groups, int8_t *codes,
                               float *scales, float *minimums) {
    const int lowest = bits == 4 ? 0 : -127, highest = bits == 4 ? 15 : 127;
    int64_t failed = 0;
#pragma omp parallel for reduction(+ : failed) schedule(static)
    for (int64_t i = 0; i < groups; i++) {
        const float *g = w + i * GROUP;
        float lo = g[0], hi = g[0], amax = 0.0f;
        for (int j = 0; j < GROUP; j++) {
            lo = g[j] < lo ? g[j] : lo;
            hi = g[j] > hi ? g[j] : hi;
            amax = fabsf(g[j]) > amax ? fabsf(g[j]) : amax;
        }
        const float mn = bits == 4 ? lo : 0.0f;
        const float spread = (bits == 4 ? hi - lo : amax) / (float)highest;
        int found = bits == 4 && f16_round(lo) != lo ? 0 : -1;
        for (int step = 0; found < 0 && step < 3; step++) {
            const float d = f16_step(spread, step == 2 ? -1 : step);
            if (rebuilds(bits, g, d, mn, lowest, highest, codes + i * GROUP)) {
                scales[i] = d;
                minimums[i] = mn;
                found = 1;
            }
        }
        failed += found != 1;
    }
    return failed;
}
