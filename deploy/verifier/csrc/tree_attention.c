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

/* DEFINE_KERNEL(NAME, T, LOAD, DC): the kernel for element type T; DC is head_dim as a
 * compile-time constant (64, 128) or the runtime D (generic), which lets the compiler keep
 * accumulators in registers. Every instance of one (T, D) computes the same bits. */
#define DEFINE_ROW(NAME, T, LOAD, DC, NR)                                                              \
static void NAME(const T *restrict q, const T *restrict kc, const T *restrict vc,                  \
                 const int32_t *restrict bt, int32_t len, int64_t bits, int h, int nrep_, int Hkv, \
                 int D, float scale, float *restrict out, float *restrict scratch) {               \
    const int nextra = __builtin_popcountll((unsigned long long)bits);                             \
    const int S = len + nextra;                                                                    \
    float *restrict qf = scratch;                      /* [(NR)][DC] */                            \
    float *restrict kt = qf + (size_t)MAXREP * (DC);   /* [DC][PS] gathered tree keys */           \
    float *restrict sc = kt + (size_t)(DC) * PS;       /* [(NR)][S] scores, logical order */       \
    int32_t epos[64];                                                                              \
    (void)D; (void)nrep_;                                                                                       \
    for (int i = 0; i < (NR); i++)                                                                 \
        for (int d = 0; d < (DC); d++)                                                             \
            qf[i * (DC) + d] = LOAD(q[(size_t)(h * (NR) + i) * (DC) + d]) * scale;                 \
    int ne = 0;                                                                                    \
    for (int j = 0; j < 64; j++)                                                                   \
        if (bits >> j & 1) epos[ne++] = len + j;                                                   \
    const int npages = (len + PS - 1) / PS, ngroups = (ne + PS - 1) / PS;                          \
    for (int g = 0; g < npages + ngroups; g++) {                                                   \
        /* one group of PS keys in float32, transposed: a prefix page (converted once for     */   \
        /* all query heads) or gathered tree keys; the same score code runs on both           */   \
        int base, n;                                                                               \
        if (g < npages) {                                                                          \
            base = g * PS; n = len - base < PS ? len - base : PS;                                  \
            const T *kp = kc + ((size_t)bt[g] * Hkv + h) * (size_t)(DC) * PS;                      \
            prefetch_page(g + PF_PAGES < npages ? kc + ((size_t)bt[g + PF_PAGES] * Hkv + h) * (size_t)(DC) * PS : NULL, \
                          sizeof(T) * (DC) * PS, 3);                                                 \
            prefetch_page(vc + ((size_t)bt[g] * Hkv + h) * PS * (size_t)(DC), sizeof(T) * (DC) * PS, 2); \
            for (int x = 0; x < (DC) * PS; x++) kt[x] = LOAD(kp[x]);                               \
        } else {                                                                                   \
            const int e0 = (g - npages) * PS;                                                      \
            base = len + e0; n = ne - e0 < PS ? ne - e0 : PS;                                      \
            memset(kt, 0, sizeof(float) * (DC) * PS);                                              \
            for (int l = 0; l < n; l++) {                                                          \
                const int pos = epos[e0 + l];                                                      \
                const T *kp = kc + ((size_t)bt[pos / PS] * Hkv + h) * (size_t)(DC) * PS + pos % PS; \
                for (int d = 0; d < (DC); d++) kt[d * PS + l] = LOAD(kp[(size_t)d * PS]);         \
            }                                                                                      \
        }                                                                                          \
        for (int i = 0; i < (NR); i++) {                                                           \
            /* four chains over d (d mod 4): fixed order, independent for the pipeline */         \
            float a0[PS], a1[PS], a2[PS], a3[PS];                                                  \
            for (int l = 0; l < PS; l++) a0[l] = a1[l] = a2[l] = a3[l] = 0.0f;                     \
            const float *qi = qf + i * (DC);                                                       \
            for (int d = 0; d < (DC); d += 4)                                                      \
                for (int l = 0; l < PS; l++) {                                                     \
                    a0[l] = fmaf(qi[d], kt[(d + 0) * PS + l], a0[l]);                              \
                    a1[l] = fmaf(qi[d + 1], kt[(d + 1) * PS + l], a1[l]);                          \
                    a2[l] = fmaf(qi[d + 2], kt[(d + 2) * PS + l], a2[l]);                          \
                    a3[l] = fmaf(qi[d + 3], kt[(d + 3) * PS + l], a3[l]);                          \
                }                                                                                  \
            float *s = sc + (size_t)i * S + base;                                                  \
            for (int l = 0; l < n; l++) s[l] = (a0[l] + a1[l]) + (a2[l] + a3[l]);                  \
        }                                                                                          \
    }                                                                                              \
    float tot[MAXREP];                                                                             \
    for (int i = 0; i < (NR); i++) {                                                               \
        float *s = sc + (size_t)i * S;                                                             \
        float m = -INFINITY;                                                                       \
        for (int p = 0; p < S; p++) m = s[p] > m ? s[p] : m;                                       \
        float lane[PS];                                                                            \
        for (int l = 0; l < PS; l++) lane[l] = 0.0f;                                               \
        int p = 0;                                                                                 \
        for (; p + PS <= S; p += PS)                                                               \
            for (int l = 0; l < PS; l++) { s[p + l] = exp_neg(s[p + l] - m); lane[l] += s[p + l]; } \
        for (; p < S; p++) { s[p] = exp_neg(s[p] - m); lane[p % PS] += s[p]; }                     \
        float t = 0.0f;                                                                            \
        for (int l = 0; l < PS; l++) t += lane[l];                                                 \
        tot[i] = t;                                                                                \
    }                                                                                              \
    /* o = sum_p w_p v_p in logical order, all query heads of this KV head at once */             \
    float acc[MAXREP][DC];                                                                         \
    for (int i = 0; i < (NR); i++)                                                                 \
        for (int d = 0; d < (DC); d++) acc[i][d] = 0.0f;                                           \
    for (int p = 0; p < S; p++) {                                                                  \
        const int pos = p < len ? p : epos[p - len];                                               \
        const T *vp = vc + (((size_t)bt[pos / PS] * Hkv + h) * PS + pos % PS) * (size_t)(DC);      \
        float v[DC];                                                                               \
        for (int d = 0; d < (DC); d++) v[d] = LOAD(vp[d]);                                         \
        for (int i = 0; i < (NR); i++) {                                                           \
            const float w = sc[(size_t)i * S + p];                                                 \
            for (int d = 0; d < (DC); d++) acc[i][d] = fmaf(w, v[d], acc[i][d]);                   \
        }                                                                                          \
    }                                                                                              \
    for (int i = 0; i < (NR); i++) {                                                               \
        const float inv = 1.0f / tot[i];                                                           \
        float *o = out + (size_t)(h * (NR) + i) * (DC);                                            \
        for (int d = 0; d < (DC); d++) o[d] = acc[i][d] * inv;                                     \
    }                                                                                              \
}

#define DEFINE_KERNEL(NAME, T, LOAD)                                                               \
DEFINE_ROW(NAME##_d16, T, LOAD, 16, nrep_)                                                         \
DEFINE_ROW(NAME##_d32, T, LOAD, 32, nrep_)                                                         \
DEFINE_ROW(NAME##_d64, T, LOAD, 64, nrep_)                                                         \
DEFINE_ROW(NAME##_d96, T, LOAD, 96, nrep_)                                                         \
DEFINE_ROW(NAME##_d128, T, LOAD, 128, nrep_)                                                       \
DEFINE_ROW(NAME##_dany, T, LOAD, D, nrep_)                                                         \
DEFINE_ROW(NAME##_d64r1, T, LOAD, 64, 1)                                                           \
DEFINE_ROW(NAME##_d64r2, T, LOAD, 64, 2)                                                           \
DEFINE_ROW(NAME##_d64r3, T, LOAD, 64, 3)                                                           \
DEFINE_ROW(NAME##_d64r4, T, LOAD, 64, 4)                                                           \
DEFINE_ROW(NAME##_d128r1, T, LOAD, 128, 1)                                                         \
DEFINE_ROW(NAME##_d128r2, T, LOAD, 128, 2)                                                         \
DEFINE_ROW(NAME##_d128r4, T, LOAD, 128, 4)                                                         \
int NAME(const T *q, const T *kc, const T *vc, const int32_t *block_table, int bt_stride,          \
         const int32_t *row_seq, const int32_t *row_len, const int64_t *row_bits, float *out,      \
         int N, int Hq, int Hkv, int D, float scale, int max_len, int num_threads) {               \
    const int nrep = Hq / Hkv;                                                                     \
    if (nrep > MAXREP || Hq % Hkv || D % 4 || D > 256) return 2;                                   \
    const size_t scratch_floats = (size_t)MAXREP * D + (size_t)D * PS + (size_t)nrep * (max_len + 64); \
    int err = 0;                                                                                   \
    _Pragma("omp parallel num_threads(num_threads) reduction(|:err)")                              \
    {                                                                                              \
        float *scratch = (float *)malloc(scratch_floats * sizeof(float));                          \
        if (!scratch) err = 1;                                                                     \
        else {                                                                                     \
            _Pragma("omp for schedule(dynamic, 1)")                                                \
            for (int64_t t = 0; t < (int64_t)N * Hkv; t++) {                                       \
                const int r = (int)(t / Hkv), h = (int)(t % Hkv);                                  \
                const T *qr = q + (size_t)r * Hq * D;                                              \
                const int32_t *bt = block_table + (size_t)row_seq[r] * bt_stride;                  \
                float *o = out + (size_t)r * Hq * D;                                               \
                const int32_t len = row_len[r];                                                    \
                const int64_t bits = row_bits[r];                                                  \
                /* compile-time head_dim and query heads per KV head where common: the     */   \
                /* accumulators stay in registers; every instance computes the same bits     */   \
                const int key = D * 16 + nrep;                                                     \
                switch (key) {                                                                     \
                case 64 * 16 + 1: NAME##_d64r1(qr, kc, vc, bt, len, bits, h, nrep, Hkv, D, scale, o, scratch); break; \
                case 64 * 16 + 2: NAME##_d64r2(qr, kc, vc, bt, len, bits, h, nrep, Hkv, D, scale, o, scratch); break; \
                case 64 * 16 + 3: NAME##_d64r3(qr, kc, vc, bt, len, bits, h, nrep, Hkv, D, scale, o, scratch); break; \
                case 64 * 16 + 4: NAME##_d64r4(qr, kc, vc, bt, len, bits, h, nrep, Hkv, D, scale, o, scratch); break; \
                case 128 * 16 + 1: NAME##_d128r1(qr, kc, vc, bt, len, bits, h, nrep, Hkv, D, scale, o, scratch); break; \
                case 128 * 16 + 2: NAME##_d128r2(qr, kc, vc, bt, len, bits, h, nrep, Hkv, D, scale, o, scratch); break; \
                case 128 * 16 + 4: NAME##_d128r4(qr, kc, vc, bt, len, bits, h, nrep, Hkv, D, scale, o, scratch); break; \
                default:                                                                           \
                switch (D) {                                                                       \
                case 16: NAME##_d16(qr, kc, vc, bt, len, bits, h, nrep, Hkv, D, scale, o, scratch); break; \
                case 32: NAME##_d32(qr, kc, vc, bt, len, bits, h, nrep, Hkv, D, scale, o, scratch); break; \
                case 64: NAME##_d64(qr, kc, vc, bt, len, bits, h, nrep, Hkv, D, scale, o, scratch); break; \
                case 96: NAME##_d96(qr, kc, vc, bt, len, bits, h, nrep, Hkv, D, scale, o, scratch); break; \
                case 128: NAME##_d128(qr, kc, vc, bt, len, bits, h, nrep, Hkv, D, scale, o, scratch); break; \
                default: NAME##_dany(qr, kc, vc, bt, len, bits, h, nrep, Hkv, D, scale, o, scratch); \
                }                                                                                  \
                }                                                                                  \
            }                                                                                      \
            free(scratch);                                                                         \
        }                                                                                          \
    }                                                                                              \
    return err;                                                                                    \
}

#define LOAD_BF16(x) bf16_to_f32(x)
#define LOAD_F32(x) (x)
DEFINE_KERNEL(tree_attention_bf16, uint16_t, LOAD_BF16)
DEFINE_KERNEL(tree_attention_f32, float, LOAD_F32)
