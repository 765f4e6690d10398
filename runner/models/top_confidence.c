/* A drafter's readout in one compiled call: each row's top k ids and the best one's
 * probability under the row's softmax (runner/models/top_confidence.py).
 *
 * Built at first use by runner/native.py and called through ctypes. torch takes about
 * ten calls for this (topk, max, a logsumexp in float32 and the ids' reordering): 74 us
 * a row of 8,192 logits warm and ~236 us just after a weight matrix has streamed
 * through the caches, as a drafter's readout always is; here one pass keeps the best
 * k and one sums the exponentials.
 *
 * Ids come best first, equal values in index order, so the first is the first index of
 * the maximum (what `argmax` and `torch.max` give). The probability is 1 / sum over the
 * row of exp(x - max): float32, summed in sixteen lanes, each in index order.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "exp_nonpositive.h"

#define LANES 16
#define MAX_K 16

static inline float value(const void *row, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

/* dtype: 0 float32, 1 bfloat16. logits: rows of V values, `stride` elements apart;
 * ids: [rows][k] int64; confidence: [rows] float32. k in [1, min(V, MAX_K)]. */
int specbudget_top_confidence(int dtype, const void *logits, int64_t stride, int64_t rows,
                              int64_t V, int k, int64_t *ids, float *confidence) {
    if (k < 1 || k > MAX_K || k > V) return -1;
    const int bf16 = dtype == 1;
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)logits + r * stride * (bf16 ? 2 : 4);
        float best[MAX_K];
        int64_t at[MAX_K];
        int n = 0;
        for (int64_t i = 0; i < V; i++) {
            const float x = value(row, bf16, i);
            if (n == k && !(x > best[k - 1])) continue; /* ties keep the earlier index */
            int p = n < k ? n++ : k - 1;
            while (p > 0 && x > best[p - 1]) {
                best[p] = best[p - 1];
                at[p] = at[p - 1];
                p--;
            }
            best[p] = x;
            at[p] = i;
        }
        float sum[LANES] = {0};
        int64_t i = 0;
        for (; i + LANES <= V; i += LANES)
            for (int l = 0; l < LANES; l++) sum[l] += exp_nonpositive(value(row, bf16, i + l) - best[0]);
        for (; i < V; i++) sum[0] += exp_nonpositive(value(row, bf16, i) - best[0]);
        float total = 0.0f;
        for (int l = 0; l < LANES; l++) total += sum[l];
        memcpy(ids + r * k, at, sizeof(int64_t) * (size_t)k);
        confidence[r] = 1.0f / total;
    }
    return 0;
}
