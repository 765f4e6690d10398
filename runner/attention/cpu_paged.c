/* Causal paged attention for the CPU, one row's arithmetic fixed whatever shares its pass.
 *
 * Built at first use by runner/attention/cpu_kernel.py (gcc -O3 -march=native -fopenmp
 * -ffp-contract=off) and called through ctypes; the Python side documents the contract.
 * The call first writes the step's own K/V rows into their cache slots (what a torch
 * backend does before it attends), then attends.
 *
 * Each query row's result is a function of its own query and its own keys and values
 * only, computed in an order fixed by key index: a score is a fused multiply-add chain
 * over the head dimension in order; the softmax's maximum is exact and its sum, like
 * the weighted sum of values, is a chain over keys in order. Work is split into items
 * of (request, KV head, tile of query rows) and a tile changes only which rows share
 * a key's conversion to float32,
 * never a row's arithmetic: so a row is bitwise the same alone, in any batch, and in a
 * prefill chunk cut anywhere (what greedy speculative decoding needs to equal plain
 * decoding). Contraction is off, so the compiler fuses nothing the code does not ask
 * for with fmaf, and vector and scalar code give the same bits.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

/* Float lanes of a vector: one AVX-512 register, else one AVX2 one. A lane is one query
 * row's column (scores) or one element of the head dimension (values), never a step of
 * a chain, so the width changes which work shares an instruction, not a bit. Sixteen
 * lanes on AVX2 (two registers a vector) ran out of registers: the score loop's 8
 * accumulators spilled, and attention at one row over 1,024 keys took 920 us a layer
 * on a 2-core AVX2 EPYC against torch's 282 (now 128; over 256 keys 1 / 5 / 17 rows
 * 249 / 389 / 1166 -> 60 / 84 / 201 us, with the softmax on vectors below). */
#ifdef __AVX512F__
#define LANES 16
#define PV_VECS 4 /* vectors of the head dimension held per row */
#define FILL_QUERIES 16 /* query columns a few rows' tile fills (tile_rows) */
#else
#define LANES 8
#define PV_VECS 2
#define FILL_QUERIES 32
#endif
#define KEY_GROUP 8 /* keys whose scores are computed together */
#define ROW_TILE 16 /* query rows per item: a long chunk's keys are read once per tile */

/* Rows per item of a request with `rows` query rows. Tiles of ROW_TILE rows read each
 * key once per 16 rows. Where a pass holds too few items to keep the threads busy (one
 * request decoding: an item per KV head, 3 items on 2 threads), a request of a few rows
 * (a verification, a drafted tree) is cut into tiles whose queries fill one vector of
 * lanes instead (5 rows for 3 heads per KV head): the vector work is the same, a key's
 * conversion is shared by fewer rows, and the threads share more items. Measured,
 * bfloat16, 9 query heads on 3 KV heads, 300 keys, 2 threads: one request of 9 rows
 * 109 -> 94 us, of 13 rows 157 -> 142 us, of 5 rows or fewer unchanged; cut alike, 4 or
 * 16 requests of 9 rows ran 8-12 % slower, so they are not. With AVX2's 8 lanes, tiles
 * of 32 query columns (10 rows) beat 16 (float32, 256 keys: 13 rows 250 against 303 us,
 * 5 and 17 rows alike). A row's arithmetic is the same in any tile. */
static inline int32_t tile_rows(int32_t rows, int group, int few_items) {
    const int32_t fill = group < FILL_QUERIES ? FILL_QUERIES / group : 1;
    return rows > ROW_TILE || !few_items ? ROW_TILE : fill;
}

/* A vector multiply-add is fmaf lane by lane: one instruction where the machine has
 * AVX-512 or AVX2 with FMA, else fmaf per lane; each gives the same bits. */
typedef float vec __attribute__((vector_size(LANES * 4)));

static inline vec load_vec(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store_vec(float *p, vec v) { memcpy(p, &v, sizeof v); }

typedef int32_t ivec __attribute__((vector_size(LANES * 4)));
typedef uint32_t uvec __attribute__((vector_size(LANES * 4)));

static inline vec splat(float c) {
#ifdef __AVX512F__
    return (vec)_mm512_set1_ps(c);
#elif defined(__AVX2__) && defined(__FMA__)
    return (vec)_mm256_set1_ps(c);
#else
    vec v;
    for (int l = 0; l < LANES; l++) v[l] = c;
    return v;
#endif
}

static inline ivec splat_i(int32_t c) {
#ifdef __AVX512F__
    return (ivec)_mm512_set1_epi32(c);
#elif defined(__AVX2__) && defined(__FMA__)
    return (ivec)_mm256_set1_epi32(c);
#else
    ivec v;
    for (int l = 0; l < LANES; l++) v[l] = c;
    return v;
#endif
}

static inline vec fma_vv(vec a, vec b, vec c) {
#ifdef __AVX512F__
    return (vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX2__) && defined(__FMA__)
    return (vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    for (int l = 0; l < LANES; l++) c[l] = fmaf(a[l], b[l], c[l]);
    return c;
#endif
}

static inline vec fma_vec(vec a, float b, vec c) { return fma_vv(a, splat(b), c); }

/* Lanes where mask is all ones from a, the others from b. */
static inline vec select_vec(ivec mask, vec a, vec b) {
    return (vec)(((ivec)a & mask) | ((ivec)b & ~mask));
}

/* exp_nonpositive (exp_nonpositive.h) on every lane, written out with its operations in
 * the same order (only IEEE basic operations and fused multiply-adds, so a lane's bits
 * are the same in this build and the portable one: test_cpu_attention.py). */
static inline vec exp_nonpositive_vec(vec x) {
    const vec lo = splat(-87.0f);
    x = select_vec(x > lo, x, lo);
    const vec n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    vec r = fma_vv(n, splat(-0.693359375f), x);
    r = fma_vv(n, splat(2.12194440e-4f), r);
    const vec z = r * r;
    vec y = splat(1.9875691500e-4f);
    y = fma_vv(y, r, splat(1.3981999507e-3f));
    y = fma_vv(y, r, splat(8.3334519073e-3f));
    y = fma_vv(y, r, splat(4.1665795894e-2f));
    y = fma_vv(y, r, splat(1.6666665459e-1f));
    y = fma_vv(y, r, splat(5.0000001201e-1f));
    y = fma_vv(y, z, r + 1.0f);
    const uvec e = (uvec)(__builtin_convertvector(n, ivec) + 127);
    return y * (vec)(e << 23);
}

typedef struct {
    int32_t req, kv_head, first_row, rows;
} Item;

typedef struct {
    const void *query, *key_cache, *value_cache;
    void *out;
    const int32_t *block_table, *query_start_loc, *seq_lens;
    const int32_t *tree_prefix; /* NULL, or per query row: -1, or the keys it sees before its own */
    int64_t table_stride, query_stride;
    int32_t num_heads, num_kv_heads, head_dim, block_size;
    float scale;
} Args;

/* Scratch one item needs, in floats (the slots' int64s counted as two floats each). */
static size_t item_scratch(int64_t nq, int64_t nkeys, int64_t head_dim) {
    int64_t nqp = (nq + LANES - 1) / LANES * LANES;
    return (size_t)(head_dim * nqp + nkeys * nqp + nq * head_dim + head_dim * (KEY_GROUP + 1)
                    + 2 * nkeys + 2);
}

static inline void row_f32(const void *base, int64_t index, int bf16, int D, float *dst) {
    if (bf16) {
        const uint16_t *src = (const uint16_t *)base + index;
        for (int d = 0; d < D; d++) dst[d] = bf16_to_f32(src[d]);
    } else {
        memcpy(dst, (const float *)base + index, sizeof(float) * (size_t)D);
    }
}

/* Cache rows are read in key order but scattered over blocks: fetched ahead of use. */
static inline void prefetch_row(const void *base, int64_t index, int bf16, int D) {
    const char *p = (const char *)base + index * (bf16 ? 2 : 4);
    for (int64_t b = 0; b < (int64_t)D * (bf16 ? 2 : 4); b += 64) __builtin_prefetch(p + b);
}

#define PV_ROWS 4 /* query rows whose value sums are held in registers at once */

/* A block of PV_ROWS rows x PV_VECS vectors of their value sums, held in registers over
 * a group's n keys: each value vector loaded once serves every row of the block. A sum
 * is still a multiply-add chain over keys in order. Rows past nq (at most the tile's
 * padding lanes, whose weights are 0) are computed and not stored. */
static inline void values_block(float *acc, const float *vals, const float *w, int i0, int nq,
                                int nqp, int d0, int D, int n) {
    vec o[PV_ROWS][PV_VECS];
    for (int r = 0; r < PV_ROWS; r++)
        for (int v = 0; v < PV_VECS; v++)
            o[r][v] = i0 + r < nq ? load_vec(acc + (int64_t)(i0 + r) * D + d0 + v * LANES)
                                  : (vec){0};
    for (int j = 0; j < n; j++) {
        vec x[PV_VECS];
        for (int v = 0; v < PV_VECS; v++) x[v] = load_vec(vals + j * D + d0 + v * LANES);
        for (int r = 0; r < PV_ROWS; r++) {
            const float wt = w[(int64_t)j * nqp + i0 + r];
            for (int v = 0; v < PV_VECS; v++) o[r][v] = fma_vec(x[v], wt, o[r][v]);
        }
    }
    for (int r = 0; r < PV_ROWS && i0 + r < nq; r++)
        for (int v = 0; v < PV_VECS; v++)
            store_vec(acc + (int64_t)(i0 + r) * D + d0 + v * LANES, o[r][v]);
}

/* One item: the tile's query rows of every query head on this KV head. Scores are laid
 * out key-major with query lanes ([key][query]), so a key's row is read once and each
 * of its elements multiplies every query of the tile in one vector; a score is still a
 * multiply-add chain over the head dimension in order, whatever lane it sits in. */
static inline void run_item(const Args *a, Item it, float *scratch, int bf16) {
    const int D = a->head_dim, Hkv = a->num_kv_heads, G = a->num_heads / Hkv;
    const int32_t q0 = a->query_start_loc[it.req];
    const int32_t pos0 = a->seq_lens[it.req] - (a->query_start_loc[it.req + 1] - q0);
    const int nq = it.rows * G, nqp = (nq + LANES - 1) / LANES * LANES;
    const int32_t nkeys = pos0 + it.first_row + it.rows; /* the tile's last row sees these */
    float *qt = scratch;                        /* [D][nqp] queries, transposed */
    float *st = qt + (int64_t)D * nqp;          /* [nkeys][nqp] scores, then weights */
    float *acc = st + (int64_t)nkeys * nqp;     /* [nq][D] */
    float *row = acc + (int64_t)nq * D;         /* [D] one value in float32 */
    float *keys = row + D;                      /* [KEY_GROUP][D] keys, then values */
    int64_t *slot = (int64_t *)(keys + (int64_t)KEY_GROUP * D + (D & 1)); /* [nkeys] */
    const int32_t *table = a->block_table + (int64_t)it.req * a->table_stride;
    const int64_t kv_row = (int64_t)Hkv * D, head = (int64_t)it.kv_head * D;
    for (int32_t t = 0, b = 0; t < nkeys; b++) {
        const int64_t base = (int64_t)table[b] * a->block_size;
        for (int32_t o = 0; o < a->block_size && t < nkeys; o++, t++)
            slot[t] = (base + o) * kv_row + head;
    }
    memset(qt, 0, sizeof(float) * (size_t)D * nqp);
    for (int r = 0; r < it.rows; r++)
        for (int g = 0; g < G; g++) {
            row_f32(a->query, (int64_t)(q0 + it.first_row + r) * a->query_stride
                              + (int64_t)(it.kv_head * G + g) * D, bf16, D, row);
            for (int d = 0; d < D; d++) qt[(int64_t)d * nqp + r * G + g] = row[d];
        }
    /* Keys in groups of KEY_GROUP: their chains run side by side (one chain is bound by
     * the multiply-add's latency), each still over the head dimension in order. */
    memset(keys, 0, sizeof(float) * (size_t)KEY_GROUP * D); /* a short last group reads 0s */
    for (int32_t t0 = 0; t0 < nkeys; t0 += KEY_GROUP) {
        const int n = nkeys - t0 < KEY_GROUP ? nkeys - t0 : KEY_GROUP;
        for (int j = 0; j < n; j++) row_f32(a->key_cache, slot[t0 + j], bf16, D, keys + j * D);
        for (int32_t j = t0 + KEY_GROUP; j < nkeys && j < t0 + 2 * KEY_GROUP; j++)
            prefetch_row(a->key_cache, slot[j], bf16, D);
        for (int c = 0; c < nqp; c += LANES) {
            vec s[KEY_GROUP] = {{0}};
            for (int d = 0; d < D; d++) {
                const vec q = load_vec(qt + (int64_t)d * nqp + c);
                for (int j = 0; j < KEY_GROUP; j++) s[j] = fma_vec(q, keys[j * D + d], s[j]);
            }
            for (int j = 0; j < n; j++) store_vec(st + (int64_t)(t0 + j) * nqp + c, s[j] * a->scale);
        }
    }
    /* Softmax down each query's column, 16 lanes at a time; padding lanes see no key. */
    float total[nqp];
    for (int c = 0; c < nqp; c += LANES) {
        /* A lane sees keys [0, valid) but those in [skip_lo, skip_hi): a tree row skips
         * the keys between its prefix and its own (weight exactly 0, so it computes the
         * bits it would at the end of its prefix). */
        ivec valid, skip_lo, skip_hi;
        vec top, sum;
        for (int l = 0; l < LANES; l++) {
            const int32_t row = it.first_row + (c + l) / G;
            valid[l] = c + l < nq ? pos0 + row + 1 : 0;
            skip_lo[l] = skip_hi[l] = 0;
            if (a->tree_prefix && c + l < nq && a->tree_prefix[q0 + row] >= 0) {
                skip_lo[l] = a->tree_prefix[q0 + row];
                skip_hi[l] = pos0 + row;
            }
            top[l] = -INFINITY;
            sum[l] = 0.0f;
        }
/* Which lanes see key t, as a mask of vector lanes. Written on vectors: gcc left the
 * lane-by-lane loops (and their exp) scalar, and the softmax took 4x its time now (AVX2,
 * float32, one row over 1,024 keys). */
#define SEEN(t) ((splat_i(t) < valid) & ((splat_i(t) < skip_lo) | (splat_i(t) >= skip_hi)))
        for (int32_t t = 0; t < nkeys; t++) {
            const vec s = load_vec(st + (int64_t)t * nqp + c);
            top = select_vec(SEEN(t) & (s > top), s, top);
        }
        for (int32_t t = 0; t < nkeys; t++) {
            float *s = st + (int64_t)t * nqp + c;
            /* computed for every lane, kept where the key is seen */
            const vec p = select_vec(SEEN(t), exp_nonpositive_vec(load_vec(s) - top), splat(0.0f));
            store_vec(s, p);
            sum += p; /* past a row's last key: + 0, nothing */
        }
        store_vec(total + c, sum);
    }
#undef SEEN
    /* Values in groups of KEY_GROUP too: a row's accumulator is loaded once a group and
     * its chain still runs over keys in order (weight 0 past a row's last key: no change).
     * Whole blocks of the head dimension go through values_block, which reuses each value
     * vector across PV_ROWS rows: one layer, bfloat16, 300 keys, one request of 9 rows
     * 136 -> 116 us, a 512-row prefill 3.37 -> 2.52 ms, 16 verifications of 5 rows 634
     * -> 512 us (the same bits; a /tmp timing). */
    memset(acc, 0, sizeof(float) * (size_t)nq * D);
    for (int32_t t0 = 0; t0 < nkeys; t0 += KEY_GROUP) {
        const int n = nkeys - t0 < KEY_GROUP ? nkeys - t0 : KEY_GROUP;
        for (int j = 0; j < n; j++) row_f32(a->value_cache, slot[t0 + j], bf16, D, keys + j * D);
        for (int32_t j = t0 + KEY_GROUP; j < nkeys && j < t0 + 2 * KEY_GROUP; j++)
            prefetch_row(a->value_cache, slot[j], bf16, D);
        const float *w = st + (int64_t)t0 * nqp;
        const int wide = D / (PV_VECS * LANES) * (PV_VECS * LANES);
        for (int i0 = 0; i0 < nq; i0 += PV_ROWS)
            for (int d0 = 0; d0 < wide; d0 += PV_VECS * LANES)
                values_block(acc, keys, w, i0, nq, nqp, d0, D, n);
        for (int i = 0; i < nq; i++) {
            float *o = acc + (int64_t)i * D;
            int d = wide;
            for (; d + LANES <= D; d += LANES) {
                vec v = load_vec(o + d);
                for (int j = 0; j < n; j++) v = fma_vec(load_vec(keys + j * D + d), w[j * nqp + i], v);
                store_vec(o + d, v);
            }
            for (; d < D; d++)
                for (int j = 0; j < n; j++) o[d] = fmaf(keys[j * D + d], w[j * nqp + i], o[d]);
        }
    }
    for (int r = 0; r < it.rows; r++)
        for (int g = 0; g < G; g++) {
            const int i = r * G + g;
            const int64_t at = (int64_t)(q0 + it.first_row + r) * a->num_heads * D
                               + (int64_t)(it.kv_head * G + g) * D;
            const float *o = acc + (int64_t)i * D;
            if (bf16) {
                uint16_t *dst = (uint16_t *)a->out + at;
                for (int d = 0; d < D; d++) dst[d] = f32_to_bf16(o[d] / total[i]);
            } else {
                float *dst = (float *)a->out + at;
                for (int d = 0; d < D; d++) dst[d] = o[d] / total[i];
            }
        }
}

static void item_f32(const Args *a, Item it, float *scratch) { run_item(a, it, scratch, 0); }
static void item_bf16(const Args *a, Item it, float *scratch) { run_item(a, it, scratch, 1); }

/* The kernel reads raw pointers: metadata that would send it outside the caches or the
 * query rows is refused before anything is read (the torch path raises on such an index
 * too). Every request has rows >= 0 ending within the query rows, a sequence that holds
 * its rows, and blocks for its keys inside the table and the caches. */
static int metadata_in_range(const int32_t *block_table, int64_t table_stride,
                             int32_t table_width, const int32_t *query_start_loc,
                             const int32_t *seq_lens, const int32_t *tree_prefix,
                             int32_t num_reqs, int64_t num_tokens,
                             int64_t num_blocks, int32_t block_size) {
    if (query_start_loc[0] < 0) return 0;
    for (int32_t i = 0; i < num_reqs; i++) {
        const int32_t rows = query_start_loc[i + 1] - query_start_loc[i];
        if (rows < 0 || query_start_loc[i + 1] > num_tokens || seq_lens[i] < rows) return 0;
        /* a tree row sees at least one key before its own, and none past it */
        for (int32_t r = 0; tree_prefix && r < rows; r++) {
            const int32_t v = tree_prefix[query_start_loc[i] + r];
            if (v != -1 && (v < 1 || v > seq_lens[i] - rows + r)) return 0;
        }
        const int64_t blocks = ((int64_t)seq_lens[i] + block_size - 1) / block_size;
        if (blocks > table_width) return 0;
        for (int64_t b = 0; b < blocks; b++) {
            const int32_t id = block_table[(int64_t)i * table_stride + b];
            if (id < 0 || id >= num_blocks) return 0;
        }
    }
    return 1;
}

/* Every slot this step writes lies inside the caches (the torch path's index_copy_
 * raises on one that does not). */
static int slots_in_range(const int64_t *slot_mapping, int64_t num_tokens, int64_t slots) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slot_mapping[t] < 0 || slot_mapping[t] >= slots) return 0;
    return 1;
}

/* This step's K/V rows into their cache slots, before any row attends: the same bytes
 * as the write-only pass's index_copy_ (runner/attention/backend.py `write_kv`), in
 * the call that reads them, where two torch ops per layer cost ~18 us at one row. */
static void write_rows(const void *key, int64_t key_stride, const void *value,
                       int64_t value_stride, const int64_t *slot_mapping, void *key_cache,
                       void *value_cache, int64_t num_tokens, int64_t row_bytes) {
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping[t];
        memcpy((char *)key_cache + slot * row_bytes,
               (const char *)key + t * key_stride, (size_t)row_bytes);
        memcpy((char *)value_cache + slot * row_bytes,
               (const char *)value + t * value_stride, (size_t)row_bytes);
    }
}

/* dtype: 0 float32, 1 bfloat16. key and value: this step's rows, `key_stride` and
 * `value_stride` bytes apart, written to the slots `slot_mapping` names before any row
 * attends. `tree_prefix`: NULL, or each row's -1 (causal) or count of keys it sees before
 * its own (metadata.py). Returns 0; -1 when scratch could not be allocated; -2 for metadata or a slot
 * out of range (refused before anything is read or written). */
int specbudget_paged_attention(int dtype, const void *query, int64_t query_stride,
                               const void *key, int64_t key_stride, const void *value,
                               int64_t value_stride, const int64_t *slot_mapping,
                               void *key_cache, void *value_cache, void *out,
                               const int32_t *block_table, int64_t table_stride,
                               int32_t table_width, const int32_t *query_start_loc,
                               const int32_t *seq_lens, const int32_t *tree_prefix,
                               int32_t num_reqs, int64_t num_tokens,
                               int64_t num_blocks, int32_t num_heads, int32_t num_kv_heads,
                               int32_t head_dim, int32_t block_size, float scale) {
    if (block_size < 1 || num_kv_heads < 1 || num_heads % num_kv_heads ||
        !metadata_in_range(block_table, table_stride, table_width, query_start_loc, seq_lens,
                           tree_prefix, num_reqs, num_tokens, num_blocks, block_size) ||
        !slots_in_range(slot_mapping, num_tokens, num_blocks * block_size))
        return -2;
    write_rows(key, key_stride, value, value_stride, slot_mapping, key_cache, value_cache,
               num_tokens, (int64_t)num_kv_heads * head_dim * (dtype == 1 ? 2 : 4));
    Args a = {query, key_cache, value_cache, out, block_table, query_start_loc, seq_lens,
              tree_prefix, table_stride, query_stride, num_heads, num_kv_heads, head_dim, block_size,
              scale};
    const int group = num_heads / num_kv_heads;
    int64_t num_items = 0;
    for (int32_t i = 0; i < num_reqs; i++) {
        int32_t rows = query_start_loc[i + 1] - query_start_loc[i];
        num_items += (int64_t)num_kv_heads * ((rows + ROW_TILE - 1) / ROW_TILE);
    }
    const int few = num_items < 2 * (int64_t)omp_get_max_threads();
    num_items = 0;
    for (int32_t i = 0; i < num_reqs; i++) {
        int32_t rows = query_start_loc[i + 1] - query_start_loc[i];
        int32_t tile = tile_rows(rows, group, few);
        num_items += (int64_t)num_kv_heads * ((rows + tile - 1) / tile);
    }
    Item *items = malloc(sizeof(Item) * (size_t)(num_items ? num_items : 1));
    if (!items) return -1;
    int64_t n = 0;
    for (int32_t i = 0; i < num_reqs; i++) {
        int32_t rows = query_start_loc[i + 1] - query_start_loc[i];
        int32_t tile = tile_rows(rows, group, few);
        for (int32_t first = 0; first < rows; first += tile)
            for (int32_t h = 0; h < num_kv_heads; h++) {
                Item it = {i, h, first, rows - first < tile ? rows - first : tile};
                items[n++] = it;
            }
    }
    int failed = 0;
#pragma omp parallel
    {
        float *scratch = NULL;
        size_t held = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t j = 0; j < num_items; j++) {
            Item it = items[j];
            int32_t q0 = query_start_loc[it.req];
            int32_t rows_total = query_start_loc[it.req + 1] - q0;
            int32_t nkeys = seq_lens[it.req] - rows_total + it.first_row + it.rows;
            size_t need = item_scratch((int64_t)it.rows * group, nkeys, head_dim);
            if (need > held) {
                free(scratch);
                scratch = malloc(sizeof(float) * need);
                held = scratch ? need : 0;
            }
            if (!scratch) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            if (dtype == 1)
                item_bf16(&a, it, scratch);
            else
                item_f32(&a, it, scratch);
        }
        free(scratch);
    }
    free(items);
    return failed ? -1 : 0;
}
