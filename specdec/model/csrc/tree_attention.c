/* Tree attention over a paged KV pool, read in place, batch-invariant by construction.
 *
 * One query row r attends its *logical* KV sequence: positions 0 .. row_len[r]-1 of its
 * session (the prefix, the root, or a prompt chunk up to itself), then the positions
 * row_len[r] + j for every set bit j of row_bits[r] (its draft-tree ancestors and itself,
 * in increasing j, i.e. parents first). Logical position p of session s lives in pool
 * page block_table[s][p / PS] at offset p % PS.
 *
 * Batch invariance: a row's scores are written to a scratch array in logical order and
 * every reduction (max, sum of exp, weighted sum of V) runs over that array in a fixed
 * order that depends only on the row's logical sequence: never on the batch, the tree's
 * layout, padding or threads. A score is computed by the same vector code (one lane per
 * key, fixed-order fmaf chains over head_dim) whether the key comes from a prefix page or
 * from a gathered group of tree keys, so a tree node's output is bit-identical to decoding
 * the same token one at a time over the same logical sequence.
 *
 * Groups: consecutive rows of one session with one row_len (a draft tree's root and nodes, as
 * the engine lays them out) are attended together, each prefix K and V page converted to
 * float32 once for all of them; a row's arithmetic is the same alone or in a group, so the
 * grouping depends on the batch and the results do not.
 *
 * Layout (per layer): K pages [num_pages, Hkv, D, PS] (keys transposed inside a page so
 * one vector holds one dimension of PS keys), V pages [num_pages, Hkv, PS, D].
 * Queries [N, Hq, D], output float32 [N, Hq, D]. Grouped-query attention: query head h
 * reads KV head h / (Hq / Hkv); no K/V is repeated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_math.h"

#define PS 16    /* tokens per page: one 512-bit vector of float32 */
#define MAXREP 8 /* query heads per KV head handled together */
#define PF_PAGES 4 /* K pages the prefetch runs ahead */
#define GMAX 32   /* rows attended together (one session, one length: a tree's root and nodes) */
#define GROUP_SCORES (1 << 18) /* at most this many float32 scores per group (1 MiB of scratch) */

/* Scores of one row's NR query heads (qi: [NR][DC], scaled) against PS keys (kt: [DC][PS],
 * float32) into s[i * smax + base + l] for the first n keys: four fixed-order chains over d
 * (d mod 4), independent for the pipeline, summed as (a0 + a1) + (a2 + a3). The same code for
 * prefix pages and gathered tree keys, so a key's score does not depend on where it lies. */
#define SCORE_KEYS(DC, NR, qi_, kt_, s_, smax_, base_, n_)                                         \
    {                                                                                              \
        for (int i = 0; i < (NR); i++) {                                                           \
            float a0[PS], a1[PS], a2[PS], a3[PS];                                                  \
            for (int l = 0; l < PS; l++) a0[l] = a1[l] = a2[l] = a3[l] = 0.0f;                     \
            const float *qi = (qi_) + i * (DC);                                                    \
            for (int d = 0; d < (DC); d += 4)                                                      \
                for (int l = 0; l < PS; l++) {                                                     \
                    a0[l] = fmaf(qi[d], (kt_)[(d + 0) * PS + l], a0[l]);                           \
                    a1[l] = fmaf(qi[d + 1], (kt_)[(d + 1) * PS + l], a1[l]);                       \
                    a2[l] = fmaf(qi[d + 2], (kt_)[(d + 2) * PS + l], a2[l]);                       \
                    a3[l] = fmaf(qi[d + 3], (kt_)[(d + 3) * PS + l], a3[l]);                       \
                }                                                                                  \
            float *s = (s_) + (size_t)i * (smax_) + (base_);                                       \
            for (int l = 0; l < (n_); l++) s[l] = (a0[l] + a1[l]) + (a2[l] + a3[l]);               \
        }                                                                                          \
    }

/* The KV of a row lies in pages scattered over the pool, so the hardware prefetcher stops at
 * each page's end and every page starts with a trip to memory. A row's K pass asks for the
 * next K page and for the V page it will read in the V pass (L2), one cache line at a time.
 * Prefetches change no arithmetic. */
static inline void prefetch_page(const void *p, size_t bytes, int locality) {
    if (!p) return;
    const char *c = (const char *)p;
    for (size_t o = 0; o < bytes; o += 64) {
        if (locality == 3) __builtin_prefetch(c + o, 0, 3);
        else __builtin_prefetch(c + o, 0, 2);
    }
}

/* DEFINE_GROUP(NAME, T, LOAD, DC, NR): G rows of one session with the same length (a draft
 * tree's root and nodes; a prompt chunk's rows are groups of one) against one KV head: the
 * prefix's K and V pages are converted to float32 once for all G rows and NR query heads, not
 * once per row. Each row's arithmetic is the single row's: the same score code per key, the
 * same reductions over its scores, V accumulated in increasing logical position (the prefix,
 * then its own tree keys), so a row's bits do not depend on the rows it is grouped with. DC is
 * head_dim as a compile-time constant (64, 128) or the runtime D (generic), NR the query heads
 * per KV head, which lets the compiler keep accumulators in registers. */
#define DEFINE_GROUP(NAME, T, LOAD, DC, NR)                                                        \
static void NAME(const T *restrict q, const T *restrict kc, const T *restrict vc,                  \
                 const int32_t *restrict bt, int32_t len, const int64_t *restrict bits, int G,     \
                 int h, int nrep_, int Hkv, int D, float scale, float *restrict out,                \
                 size_t rstride, float *restrict scratch, int smax) {                              \
    float *restrict qf = scratch;                            /* [G][NR][DC] */                     \
    float *restrict kt = qf + (size_t)GMAX * MAXREP * (DC);  /* [DC][PS] keys, transposed */       \
    float *restrict vt = kt + (size_t)(DC) * PS;             /* [PS][DC] values of one page */     \
    float *restrict ac = vt + (size_t)PS * (DC);             /* [G][NR][DC] V accumulators */      \
    float *restrict sc = ac + (size_t)GMAX * MAXREP * (DC);  /* [G][NR][smax] scores, logical order */ \
    int32_t epos[GMAX][64];                                                                        \
    int ne[GMAX];                                                                                  \
    (void)D; (void)nrep_;                                                                          \
    for (int r = 0; r < G; r++) {                                                                  \
        for (int i = 0; i < (NR); i++)                                                             \
            for (int d = 0; d < (DC); d++)                                                         \
                qf[((size_t)r * (NR) + i) * (DC) + d] =                                            \
                    LOAD(q[(size_t)r * rstride + (size_t)(h * (NR) + i) * (DC) + d]) * scale;      \
        ne[r] = 0;                                                                                 \
        for (int j = 0; j < 64; j++)                                                               \
            if (bits[r] >> j & 1) epos[r][ne[r]++] = len + j;                                      \
    }                                                                                              \
    /* scores of the prefix: each K page converted once, scored for every row and head */        \
    const int npages = (len + PS - 1) / PS;                                                        \
    for (int g = 0; g < npages; g++) {                                                             \
        const int base = g * PS, n = len - base < PS ? len - base : PS;                            \
        const T *kp = kc + ((size_t)bt[g] * Hkv + h) * (size_t)(DC) * PS;                          \
        prefetch_page(g + PF_PAGES < npages ? kc + ((size_t)bt[g + PF_PAGES] * Hkv + h) * (size_t)(DC) * PS : NULL, \
                      sizeof(T) * (DC) * PS, 3);                                                     \
        prefetch_page(vc + ((size_t)bt[g] * Hkv + h) * PS * (size_t)(DC), sizeof(T) * (DC) * PS, 2); \
        for (int x = 0; x < (DC) * PS; x++) kt[x] = LOAD(kp[x]);                                   \
        for (int r = 0; r < G; r++) SCORE_KEYS(DC, NR, qf + (size_t)r * (NR) * (DC), kt, sc + (size_t)r * (NR) * smax, smax, base, n) \
    }                                                                                              \
    /* scores of each row's tree keys (its ancestors and itself), gathered PS at a time */        \
    for (int r = 0; r < G; r++)                                                                    \
        for (int e0 = 0; e0 < ne[r]; e0 += PS) {                                                   \
            const int n = ne[r] - e0 < PS ? ne[r] - e0 : PS;                                       \
            memset(kt, 0, sizeof(float) * (DC) * PS);                                              \
            for (int l = 0; l < n; l++) {                                                          \
                const int pos = epos[r][e0 + l];                                                   \
                const T *kp = kc + ((size_t)bt[pos / PS] * Hkv + h) * (size_t)(DC) * PS + pos % PS; \
                for (int d = 0; d < (DC); d++) kt[d * PS + l] = LOAD(kp[(size_t)d * PS]);         \
            }                                                                                      \
            SCORE_KEYS(DC, NR, qf + (size_t)r * (NR) * (DC), kt, sc + (size_t)r * (NR) * smax, smax, len + e0, n) \
        }                                                                                          \
    /* softmax weights per row and head, in place; their sums */                                  \
    float tot[GMAX][MAXREP];                                                                       \
    for (int r = 0; r < G; r++)                                                                    \
        for (int i = 0; i < (NR); i++) {                                                           \
            const int S = len + ne[r];                                                             \
            float *s = sc + ((size_t)r * (NR) + i) * smax;                                         \
            /* the max lane by lane, then across lanes: the same value in any order (it feeds    */ \
            /* only s - m, and exp of +0 and -0 are both 1), and vectorised                        */ \
            float lane[PS];                                                                        \
            for (int l = 0; l < PS; l++) lane[l] = -INFINITY;                                      \
            int p = 0;                                                                             \
            for (; p + PS <= S; p += PS)                                                           \
                for (int l = 0; l < PS; l++) lane[l] = s[p + l] > lane[l] ? s[p + l] : lane[l];    \
            for (; p < S; p++) lane[p % PS] = s[p] > lane[p % PS] ? s[p] : lane[p % PS];           \
            float m = -INFINITY;                                                                   \
            for (int l = 0; l < PS; l++) m = lane[l] > m ? lane[l] : m;                            \
            for (int l = 0; l < PS; l++) lane[l] = 0.0f;                                           \
            p = 0;                                                                                 \
            for (; p + PS <= S; p += PS)                                                           \
                for (int l = 0; l < PS; l++) { s[p + l] = exp_neg(s[p + l] - m); lane[l] += s[p + l]; } \
            for (; p < S; p++) { s[p] = exp_neg(s[p] - m); lane[p % PS] += s[p]; }                 \
            float t = 0.0f;                                                                        \
            for (int l = 0; l < PS; l++) t += lane[l];                                             \
            tot[r][i] = t;                                                                         \
        }                                                                                          \
    /* o = sum_p w_p v_p in logical order: the prefix (each V page converted once for every     */ \
    /* row), then each row's tree keys; all query heads of this KV head at once                 */ \
    for (size_t x = 0; x < (size_t)G * (NR) * (DC); x++) ac[x] = 0.0f;                            \
    for (int g = 0; g < npages; g++) {                                                             \
        const int base = g * PS, n = len - base < PS ? len - base : PS;                            \
        const T *vp = vc + ((size_t)bt[g] * Hkv + h) * PS * (size_t)(DC);                          \
        for (int x = 0; x < n * (DC); x++) vt[x] = LOAD(vp[x]);                                    \
        for (int r = 0; r < G; r++) {                                                              \
            float a[MAXREP][DC];                                                                   \
            float *ar = ac + (size_t)r * (NR) * (DC);                                              \
            for (int i = 0; i < (NR); i++)                                                         \
                for (int d = 0; d < (DC); d++) a[i][d] = ar[i * (DC) + d];                         \
            for (int l = 0; l < n; l++)                                                            \
                for (int i = 0; i < (NR); i++) {                                                   \
                    const float w = sc[((size_t)r * (NR) + i) * smax + base + l];                  \
                    for (int d = 0; d < (DC); d++) a[i][d] = fmaf(w, vt[l * (DC) + d], a[i][d]);  \
                }                                                                                  \
            for (int i = 0; i < (NR); i++)                                                         \
                for (int d = 0; d < (DC); d++) ar[i * (DC) + d] = a[i][d];                         \
        }                                                                                          \
    }                                                                                              \
    for (int r = 0; r < G; r++) {                                                                  \
        float a[MAXREP][DC];                                                                       \
        const float *ar = ac + (size_t)r * (NR) * (DC);                                            \
        for (int i = 0; i < (NR); i++)                                                             \
            for (int d = 0; d < (DC); d++) a[i][d] = ar[i * (DC) + d];                             \
        for (int e = 0; e < ne[r]; e++) {                                                          \
            const int pos = epos[r][e];                                                            \
            const T *vq = vc + (((size_t)bt[pos / PS] * Hkv + h) * PS + pos % PS) * (size_t)(DC);  \
            float v[DC];                                                                           \
            for (int d = 0; d < (DC); d++) v[d] = LOAD(vq[d]);                                     \
            for (int i = 0; i < (NR); i++) {                                                       \
                const float w = sc[((size_t)r * (NR) + i) * smax + len + e];                       \
                for (int d = 0; d < (DC); d++) a[i][d] = fmaf(w, v[d], a[i][d]);                   \
            }                                                                                      \
        }                                                                                          \
        for (int i = 0; i < (NR); i++) {                                                           \
            const float inv = 1.0f / tot[r][i];                                                    \
            float *o = out + (size_t)r * rstride + (size_t)(h * (NR) + i) * (DC);                  \
            for (int d = 0; d < (DC); d++) o[d] = a[i][d] * inv;                                   \
        }                                                                                          \
    }                                                                                              \
}

#define DEFINE_KERNEL(NAME, T, LOAD)                                                               \
DEFINE_GROUP(NAME##_d16, T, LOAD, 16, nrep_)                                                       \
DEFINE_GROUP(NAME##_d32, T, LOAD, 32, nrep_)                                                       \
DEFINE_GROUP(NAME##_d64, T, LOAD, 64, nrep_)                                                       \
DEFINE_GROUP(NAME##_d96, T, LOAD, 96, nrep_)                                                       \
DEFINE_GROUP(NAME##_d128, T, LOAD, 128, nrep_)                                                     \
DEFINE_GROUP(NAME##_dany, T, LOAD, D, nrep_)                                                       \
DEFINE_GROUP(NAME##_d64r1, T, LOAD, 64, 1)                                                         \
DEFINE_GROUP(NAME##_d64r2, T, LOAD, 64, 2)                                                         \
DEFINE_GROUP(NAME##_d64r3, T, LOAD, 64, 3)                                                         \
DEFINE_GROUP(NAME##_d64r4, T, LOAD, 64, 4)                                                         \
DEFINE_GROUP(NAME##_d128r1, T, LOAD, 128, 1)                                                       \
DEFINE_GROUP(NAME##_d128r2, T, LOAD, 128, 2)                                                       \
DEFINE_GROUP(NAME##_d128r4, T, LOAD, 128, 4)                                                       \
int NAME(const T *q, const T *kc, const T *vc, const int32_t *block_table, int bt_stride,          \
         const int32_t *row_seq, const int32_t *row_len, const int64_t *row_bits, float *out,      \
         int N, int Hq, int Hkv, int D, float scale, int max_len, int num_threads) {               \
    const int nrep = Hq / Hkv;                                                                     \
    if (nrep > MAXREP || Hq % Hkv || D % 4 || D > 256) return 2;                                   \
    const int smax = max_len + 64;                                                                 \
    /* groups: runs of consecutive rows of one session with one length, at most GMAX rows and  */ \
    /* GROUP_SCORES scores each                                                                 */ \
    int gcap = GROUP_SCORES / (nrep * smax);                                                       \
    gcap = gcap < 1 ? 1 : gcap > GMAX ? GMAX : gcap;                                               \
    int32_t *starts = (int32_t *)malloc(sizeof(int32_t) * ((size_t)N + 1));                       \
    if (!starts) return 1;                                                                         \
    int ng = 0;                                                                                    \
    for (int r = 0; r < N; r++)                                                                    \
        if (r == 0 || row_seq[r] != row_seq[r - 1] || row_len[r] != row_len[r - 1] || r - starts[ng - 1] >= gcap) \
            starts[ng++] = r;                                                                      \
    starts[ng] = N;                                                                                \
    const size_t scratch_floats = (size_t)2 * GMAX * MAXREP * D + (size_t)2 * D * PS + (size_t)gcap * nrep * smax; \
    int err = 0;                                                                                   \
    _Pragma("omp parallel num_threads(num_threads) reduction(|:err)")                              \
    {                                                                                              \
        float *scratch = (float *)malloc(scratch_floats * sizeof(float));                          \
        if (!scratch) err = 1;                                                                     \
        else {                                                                                     \
            _Pragma("omp for schedule(dynamic, 1)")                                                \
            for (int64_t t = 0; t < (int64_t)ng * Hkv; t++) {                                      \
                const int gi = (int)(t / Hkv), h = (int)(t % Hkv);                                 \
                const int r = starts[gi], G = starts[gi + 1] - r;                                  \
                const T *qr = q + (size_t)r * Hq * D;                                              \
                const int32_t *bt = block_table + (size_t)row_seq[r] * bt_stride;                  \
                float *o = out + (size_t)r * Hq * D;                                               \
                const size_t qs = (size_t)Hq * D;  /* a row's stride in q and out */              \
                const int32_t len = row_len[r];                                                    \
                const int64_t *bits = row_bits + r;                                                \
                /* compile-time head_dim and query heads per KV head where common: the     */   \
                /* accumulators stay in registers; every instance computes the same bits     */   \
                const int key = D * 16 + nrep;                                                     \
                switch (key) {                                                                     \
                case 64 * 16 + 1: NAME##_d64r1(qr, kc, vc, bt, len, bits, G, h, nrep, Hkv, D, scale, o, qs, scratch, smax); break; \
                case 64 * 16 + 2: NAME##_d64r2(qr, kc, vc, bt, len, bits, G, h, nrep, Hkv, D, scale, o, qs, scratch, smax); break; \
                case 64 * 16 + 3: NAME##_d64r3(qr, kc, vc, bt, len, bits, G, h, nrep, Hkv, D, scale, o, qs, scratch, smax); break; \
                case 64 * 16 + 4: NAME##_d64r4(qr, kc, vc, bt, len, bits, G, h, nrep, Hkv, D, scale, o, qs, scratch, smax); break; \
                case 128 * 16 + 1: NAME##_d128r1(qr, kc, vc, bt, len, bits, G, h, nrep, Hkv, D, scale, o, qs, scratch, smax); break; \
                case 128 * 16 + 2: NAME##_d128r2(qr, kc, vc, bt, len, bits, G, h, nrep, Hkv, D, scale, o, qs, scratch, smax); break; \
                case 128 * 16 + 4: NAME##_d128r4(qr, kc, vc, bt, len, bits, G, h, nrep, Hkv, D, scale, o, qs, scratch, smax); break; \
                default:                                                                           \
                switch (D) {                                                                       \
                case 16: NAME##_d16(qr, kc, vc, bt, len, bits, G, h, nrep, Hkv, D, scale, o, qs, scratch, smax); break; \
                case 32: NAME##_d32(qr, kc, vc, bt, len, bits, G, h, nrep, Hkv, D, scale, o, qs, scratch, smax); break; \
                case 64: NAME##_d64(qr, kc, vc, bt, len, bits, G, h, nrep, Hkv, D, scale, o, qs, scratch, smax); break; \
                case 96: NAME##_d96(qr, kc, vc, bt, len, bits, G, h, nrep, Hkv, D, scale, o, qs, scratch, smax); break; \
                case 128: NAME##_d128(qr, kc, vc, bt, len, bits, G, h, nrep, Hkv, D, scale, o, qs, scratch, smax); break; \
                default: NAME##_dany(qr, kc, vc, bt, len, bits, G, h, nrep, Hkv, D, scale, o, qs, scratch, smax); \
                }                                                                                  \
                }                                                                                  \
            }                                                                                      \
            free(scratch);                                                                         \
        }                                                                                          \
    }                                                                                              \
    free(starts);                                                                                  \
    return err;                                                                                    \
}

#define LOAD_BF16(x) bf16_to_f32(x)
#define LOAD_F32(x) (x)
DEFINE_KERNEL(tree_attention_bf16, uint16_t, LOAD_BF16)
DEFINE_KERNEL(tree_attention_f32, float, LOAD_F32)
