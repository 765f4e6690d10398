/* A decoder layer's small ops for the CPU, each one call where torch runs several
 * kernels: RMSNorm and the rotary embedding.
 *
 * Built at first use by runner/models/cpu_ops.py (runner/native.py: gcc -O3
 * -march=native -ffp-contract=off) and called through ctypes. At the few rows of a
 * decode step every op runs just after a weight matrix streamed through the caches,
 * and there each torch kernel and its dispatch cost several times what it costs warm:
 * torch's bfloat16 rms_norm (a float32 copy, the square, the mean, the reciprocal
 * root, two products, a copy back) ~40 us a call where this costs ~12.
 * Contraction is off, so the compiler fuses nothing the code does not ask for.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define LANES 16

static inline float load(const void *base, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline void store(void *base, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)base)[i] = f32_to_bf16(v);
    else
        ((float *)base)[i] = v;
}

/* One row of `specbudget_rms_norm`; `bf16` is a constant at each call, so the compiler
 * makes a loop per dtype. */
static inline void norm_row(const void *x, int64_t row, const void *weight, void *out,
                            int64_t out_row, int64_t n, float eps, int bf16) {
    float chains[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) {
            const float v = load(x, row + i + l, bf16);
            chains[l] = fmaf(v, v, chains[l]);
        }
    for (int l = 0; i + l < n; l++) {
        const float v = load(x, row + i + l, bf16);
        chains[l] = fmaf(v, v, chains[l]);
    }
    float sum = 0.0f;
    for (int l = 0; l < LANES; l++) sum += chains[l];
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    for (int64_t j = 0; j < n; j++)
        store(out, out_row + j, load(x, row + j, bf16) * inv * load(weight, j, bf16), bf16);
}

/* out = x * (1 / sqrt(mean(x^2) + eps)) * weight, in float32, rounded once to the
 * output's dtype: torch's formula. A row's sum of squares is sixteen fused multiply-add
 * chains over the row's elements in order (element i in chain i % 16), then the
 * sixteen summed in order: a fixed order, so a row's bits never depend on the other
 * rows of the call.
 * dtype: 0 float32, 1 bfloat16 (x, weight and out alike). Rows of x `x_stride`
 * elements apart; out is contiguous [rows, n]. */
void specbudget_rms_norm(int dtype, const void *x, int64_t x_stride, const void *weight,
                         void *out, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        if (dtype == 1)
            norm_row(x, r * x_stride, weight, out, r * n, n, eps, 1);
        else
            norm_row(x, r * x_stride, weight, out, r * n, n, eps, 0);
    }
}

/* One half of one head of `specbudget_rope`: out[d] = x[d] * cos[d] (rounded to the
 * dtype) + x[partner of d] * signed_sin[d] (one fused multiply-add, rounded). */
static inline void rope_half(const void *x, int64_t src, int64_t partner, const void *cos,
                             const void *signed_sin, int64_t table, void *out, int64_t dst,
                             int64_t count, int bf16) {
    for (int64_t d = 0; d < count; d++) {
        float scaled = load(x, src + d, bf16) * load(cos, table + d, bf16);
        if (bf16) scaled = bf16_to_f32(f32_to_bf16(scaled));
        store(out, dst + d,
              fmaf(load(x, partner + d, bf16), load(signed_sin, table + d, bf16), scaled), bf16);
    }
}

/* The rotary embedding as runner/models/llama.py's `Rotary` computes it, bit for bit:
 * out = x * cos + swap_halves(x) * signed_sin, the first product rounded to the dtype,
 * then one fused multiply-add (torch's addcmul) rounded to the dtype. x is [T, heads, D],
 * rows `x_stride` elements apart, heads contiguous; cos and signed_sin [T, D]; out
 * contiguous [T, heads, D]. dtype: 0 float32, 1 bfloat16. */
void specbudget_rope(int dtype, const void *x, int64_t x_stride, const void *cos,
                     const void *signed_sin, void *out, int64_t tokens, int64_t heads,
                     int64_t dim) {
    const int64_t half = dim / 2;
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++) {
            const int64_t src = t * x_stride + h * dim, dst = (t * heads + h) * dim;
            const int64_t table = t * dim;
            if (dtype == 1) {
                rope_half(x, src, src + half, cos, signed_sin, table, out, dst, half, 1);
                rope_half(x, src + half, src, cos, signed_sin, table + half, out, dst + half,
                          half, 1);
            } else {
                rope_half(x, src, src + half, cos, signed_sin, table, out, dst, half, 0);
                rope_half(x, src + half, src, cos, signed_sin, table + half, out, dst + half,
                          half, 0);
            }
        }
}
