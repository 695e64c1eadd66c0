/* y = x W^T + b in bf16 on CPUs with AVX512-BF16 (or AVX2 + FMA: the second half of this file),
 * row-invariant by construction.
 *
 * Why our own: a decode step of a small model on one core is a stream of its weights through the
 * matrix multiplies; oneDNN's prepacked bf16 kernels reach a fraction of what one core reads from
 * memory, and their M = 1 kernel rounds differently from M >= 2 (docs/engine.md, "Own bf16
 * kernels on CPU", has the figures).
 *
 * Weights are packed once (linear_bf16_pack) into blocks of NV x 16 output features: for each
 * pair of k, the block's 16 NV features x 2 values lie together (VNNI order), so a block is
 * one contiguous stream. Output y[m, n] is one fixed chain of VDPBF16PS over the k pairs in
 * increasing order (lane n of an accumulator; no horizontal reduction), plus the bias in
 * float32, rounded once to bf16 (nearest even). The chain never depends on M, the blocking
 * or threads, so a row's result is the same in whatever batch it is computed (batch
 * invariance, M = 1 included).
 *
 * Blocking: tiles of MT rows of x x weight blocks. With more than MB rows in a tile, each block
 * is walked in chunks of KC k pairs (12 KiB of weights, L1-resident), and every group of MB
 * rows runs over a chunk before the next chunk starts, its MB x NV accumulators kept in
 * registers and parked in a float32 buffer between chunks (stored and reloaded exactly: the
 * chain is unchanged). So a block is read from memory once per tile, whatever the rows, and
 * the next chunk is prefetched while the groups work on this one: the memory stream and the
 * arithmetic overlap. One group (1-6 rows) streams each block in one pass.
 *
 * The prefetches bring the stream into L2 (T1), not L1 (T0): an L1 prefetch holds one of the
 * core's few L1 miss buffers until its line arrives, so while the groups compute, few lines
 * are in flight and the stream and the arithmetic add up instead of overlapping. A prefetch
 * changes no result.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define NV 4                /* 16-feature vectors per weight block */
#define NBLK (NV * 16)      /* output features per weight block */
#define MB 6                /* rows of x per group: MB x NV accumulators + NV weights in registers */
#define MT 64               /* rows of x per tile */
#define KC 48               /* k pairs per chunk: KC x NBLK x 2 bf16 = 12 KiB of weights */
#define PF 32               /* k pairs the prefetch runs ahead when one group streams a whole block */

int linear_bf16_supported(void) {
#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
    return 1;
#else
    return 0;
#endif
}

/* w [N, K] bf16 -> packed [ceil(N / NBLK)][K / 2][NBLK][2] (zero-padded features); K even. */
void linear_bf16_pack(const uint16_t *w, uint16_t *packed, int N, int K) {
    const int nb = (N + NBLK - 1) / NBLK;
    for (int b = 0; b < nb; b++)
        for (int kp = 0; kp < K / 2; kp++) {
            uint16_t *dst = packed + ((size_t)b * (K / 2) + kp) * NBLK * 2;
            for (int j = 0; j < NBLK; j++) {
                const int n = b * NBLK + j;
                dst[2 * j] = n < N ? w[(size_t)n * K + 2 * kp] : 0;
                dst[2 * j + 1] = n < N ? w[(size_t)n * K + 2 * kp + 1] : 0;
            }
        }
}

#ifdef __AVX512BF16__
#include <immintrin.h>

/* R rows of x (R <= MB, a compile-time constant) against kc k pairs of one weight block (wc).
 * acc: the rows' [R][NBLK] float32 partial sums, read unless first, written back unless last;
 * at last the bias is added and y[r][0 .. nvalid) stored, rounded once. pf: lpi cache lines
 * of the next chunk to prefetch per k pair (none at or past pf_end). */
#define DEFINE_BLOCK(R)                                                                           \
static void block_##R(const uint32_t *restrict x, size_t xs, const uint16_t *restrict wc, int kc,  \
                      float *restrict acc_io, int first, int last, const float *restrict bias,      \
                      uint16_t *restrict y, int N, int nvalid, const char *pf, int lpi,             \
                      const char *pf_end) {                                                       \
    __m512 acc[R][NV];                                                                            \
    for (int i = 0; i < R; i++)                                                                   \
        for (int j = 0; j < NV; j++)                                                              \
            acc[i][j] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc_io + i * NBLK + j * 16); \
    for (int kp = 0; kp < kc; kp++) {                                                             \
        const uint16_t *wk = wc + (size_t)kp * NBLK * 2;                                          \
        for (int c = 0; c < lpi; c++, pf += 64)                                                   \
            if (pf < pf_end) _mm_prefetch(pf, _MM_HINT_T1);                                       \
        __m512bh wv[NV];                                                                          \
        for (int j = 0; j < NV; j++) wv[j] = (__m512bh)_mm512_loadu_si512((const void *)(wk + j * 32)); \
        for (int i = 0; i < R; i++) {                                                             \
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[i * xs + kp]);                 \
            for (int j = 0; j < NV; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);      \
        }                                                                                         \
    }                                                                                             \
    if (!last) {                                                                                  \
        for (int i = 0; i < R; i++)                                                               \
            for (int j = 0; j < NV; j++) _mm512_store_ps(acc_io + i * NBLK + j * 16, acc[i][j]);  \
        return;                                                                                   \
    }                                                                                             \
    for (int i = 0; i < R; i++)                                                                   \
        for (int j = 0; j < NV; j++) {                                                            \
            const int n = j * 16;                                                                 \
            if (n >= nvalid) break;                                                               \
            __m512 v = acc[i][j];                                                                 \
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n));                            \
            const __m256i o = (__m256i)_mm512_cvtneps_pbh(v);                                     \
            const int left = nvalid - n;                                                          \
            if (left >= 16) _mm256_storeu_si256((__m256i *)(y + (size_t)i * N + n), o);           \
            else _mm256_mask_storeu_epi16(y + (size_t)i * N + n, (__mmask16)((1u << left) - 1u), o); \
        }                                                                                         \
}

DEFINE_BLOCK(1)
DEFINE_BLOCK(2)
DEFINE_BLOCK(3)
DEFINE_BLOCK(4)
DEFINE_BLOCK(5)
DEFINE_BLOCK(6)

/* R rows (R <= MB) x kc k pairs of one weight block: the block function for R. */
#define CALL_BLOCK(R, ...)                                                                        \
    switch (R) {                                                                                  \
    case 6: block_6(__VA_ARGS__); break;                                                          \
    case 5: block_5(__VA_ARGS__); break;                                                          \
    case 4: block_4(__VA_ARGS__); break;                                                          \
    case 3: block_3(__VA_ARGS__); break;                                                          \
    case 2: block_2(__VA_ARGS__); break;                                                          \
    default: block_1(__VA_ARGS__);                                                                \
    }

/* x [M, K], packed weights (linear_bf16_pack), bias [ceil(N/NBLK)*NBLK] float32 or NULL
 * -> y [M, N], bf16, rows contiguous. */
int linear_bf16(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y, int M, int N, int K,
                int num_threads) {
    if (K % 2) return 2;
    const int nb = (N + NBLK - 1) / NBLK, kps = K / 2;
    const size_t block_len = (size_t)kps * NBLK * 2;  /* bf16 values per packed block */
    const char *pf_end = (const char *)(packed + (size_t)nb * block_len);
    #pragma omp parallel num_threads(num_threads) if (num_threads > 1 && (size_t)M * N * K >= ((size_t)1 << 22))
    {
        float acc[MT * NBLK] __attribute__((aligned(64)));  /* the tile's partial sums, one block */
        for (int m0 = 0; m0 < M; m0 += MT) {
            const int mt = M - m0 < MT ? M - m0 : MT, groups = (mt + MB - 1) / MB;
            const uint32_t *xt = (const uint32_t *)(x + (size_t)m0 * K);
            uint16_t *yt = y + (size_t)m0 * N;
            #pragma omp for schedule(static)
            for (int b = 0; b < nb; b++) {
                const uint16_t *wb = packed + (size_t)b * block_len;
                const int n0 = b * NBLK, nvalid = N - n0 < NBLK ? N - n0 : NBLK;
                const float *bb = bias ? bias + n0 : NULL;
                if (groups == 1) {  /* 1-6 rows: nothing to reuse a chunk for; one pass, prefetch PF ahead */
                    CALL_BLOCK(mt, xt, (size_t)kps, wb, kps, acc, 1, 1, bb, yt + n0, N, nvalid,
                               (const char *)(wb + (size_t)PF * NBLK * 2), 4, pf_end)
                    continue;
                }
                for (int k0 = 0; k0 < kps; k0 += KC) {
                    const int kc = kps - k0 < KC ? kps - k0 : KC;
                    const uint16_t *wc = wb + (size_t)k0 * NBLK * 2;
                    /* the next chunk (the next block's first after the last): its 4 lines per k
                     * pair spread over the groups, ceil(4 / groups) lines per k pair each */
                    const char *next = (const char *)(wc + (size_t)kc * NBLK * 2);
                    const int lpi = (4 + groups - 1) / groups;
                    const int first = k0 == 0, last = k0 + kc >= kps;
                    for (int g = 0; g < groups; g++) {
                        const int i = g * MB, r = mt - i < MB ? mt - i : MB;
                        CALL_BLOCK(r, xt + (size_t)i * kps + k0, (size_t)kps, wc, kc, acc + (size_t)i * NBLK,
                                   first, last, bb, yt + (size_t)i * N + n0, N, nvalid,
                                   next + (size_t)g * kc * lpi * 64, lpi, pf_end)
                    }
                }
            }
        }
    }
    return 0;
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "bf16_math.h"

/* AVX2 + FMA (no bf16 arithmetic; e.g. AMD Zen 1-3, Intel Haswell-Skylake client): the same
 * packed weights, widened to float32 in registers (a bf16 is the high half of a float32: the
 * even k of a pair shifted up 16 bits, the odd k masked in place), so the stream from memory is
 * still 2 bytes a weight. Output y[m, n] is one fixed chain of float32 FMAs over k in
 * increasing order (lane n % 8 of an accumulator; no horizontal reduction), plus the bias,
 * rounded once to bf16: whatever M, the blocking or threads, the same bits (batch invariance,
 * M = 1 included). torch's own bf16 linear on these CPUs is batch-invariant too but widens
 * element by element, and oneDNN's bf16 kernels need AVX512.
 *
 * Blocking: the FMA rate bounds this kernel from two rows up, not the memory stream, so no
 * chunking: a group of up to G2 rows runs over a strip of J
 * vectors of 8 features of one weight block for the whole k range, its G2 x J accumulators in
 * registers (16 ymm); the block stays in L2 for the next strip and group. One row takes the
 * whole block (8 vectors) in one pass, two rows half of it; the first strip over a block prefetches
 * whole k pairs PF2 ahead (one row then streams at what one core reads). */
#define G2 2   /* rows of x per group (groups of 3-4 rows over 16-feature strips ran slower) */
#define PF2 32 /* k pairs the prefetch runs ahead (8 KiB; one line of four, 8 ahead, was slower) */

/* R rows of xf (float32, row stride xs) against J vectors (8 features each) of one weight
 * block, starting at vector j0, for all kps k pairs -> y[r][8 * j0 ...], rounded once.
 * stream: this strip is the first over the block (it comes from memory: prefetch it). */
#define DEFINE_STRIP(R, J)                                                                        \
static void strip_##R##_##J(const float *restrict xf, size_t xs, const uint16_t *restrict wb, int kps, \
                            int j0, int stream, const float *restrict bias, uint16_t *restrict y, int N, \
                            int nvalid) {                                                         \
    __m256 acc[R][J];                                                                             \
    for (int i = 0; i < R; i++)                                                                   \
        for (int j = 0; j < J; j++) acc[i][j] = _mm256_setzero_ps();                              \
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);                                       \
    for (int kp = 0; kp < kps; kp++) {                                                            \
        const uint16_t *wk = wb + (size_t)kp * NBLK * 2 + (size_t)j0 * 16;                        \
        if (stream) /* all 4 lines of a k pair */                                                 \
            for (int c = 0; c < 4; c++)                                                           \
                _mm_prefetch((const char *)(wk + (size_t)(PF2 * NBLK + c * 16) * 2), _MM_HINT_T0); \
        __m256 xe[R], xo[R];                                                                      \
        for (int i = 0; i < R; i++) {                                                             \
            xe[i] = _mm256_broadcast_ss(xf + i * xs + 2 * kp);                                    \
            xo[i] = _mm256_broadcast_ss(xf + i * xs + 2 * kp + 1);                                \
        }                                                                                         \
        for (int j = 0; j < J; j++) {                                                             \
            const __m256i w = _mm256_loadu_si256((const __m256i *)(wk + j * 16));                 \
            const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));                      \
            const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(w, hi));                       \
            for (int i = 0; i < R; i++) {                                                         \
                acc[i][j] = _mm256_fmadd_ps(xe[i], we, acc[i][j]);                                \
                acc[i][j] = _mm256_fmadd_ps(xo[i], wo, acc[i][j]);                                \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    /* constant indices only (acc stays in registers: a runtime index into it would make the   \
     * compiler keep it in memory and store all of it every k pair) */                            \
    float v[R][J * 8] __attribute__((aligned(32)));                                               \
    for (int i = 0; i < R; i++)                                                                   \
        for (int j = 0; j < J; j++) _mm256_store_ps(v[i] + j * 8, acc[i][j]);                     \
    const int n0 = j0 * 8, left = nvalid - n0 < J * 8 ? nvalid - n0 : J * 8;                     \
    for (int i = 0; i < R; i++)                                                                   \
        for (int l = 0; l < left; l++)                                                            \
            y[(size_t)i * N + n0 + l] = f32_to_bf16(bias ? v[i][l] + bias[n0 + l] : v[i][l]);     \
}

DEFINE_STRIP(1, 8)
DEFINE_STRIP(2, 4)

/* x [M, K], packed weights (linear_bf16_pack), bias [ceil(N/NBLK)*NBLK] float32 or NULL
 * -> y [M, N], bf16, rows contiguous. */
int linear_bf16(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y, int M, int N, int K,
                int num_threads) {
    if (K % 2) return 2;
    const int nb = (N + NBLK - 1) / NBLK, kps = K / 2;
    const size_t block_len = (size_t)kps * NBLK * 2;  /* bf16 values per packed block */
    float *xf = malloc((size_t)M * K * sizeof(float));  /* x widened once: exact */
    if (!xf) return 3;
    for (size_t i = 0; i < (size_t)M * K; i++) xf[i] = bf16_to_f32(x[i]);
    #pragma omp parallel for schedule(static) num_threads(num_threads) \
        if (num_threads > 1 && (size_t)M * N * K >= ((size_t)1 << 20))
    for (int b = 0; b < nb; b++) {
        const uint16_t *wb = packed + (size_t)b * block_len;
        const int n0 = b * NBLK, nvalid = N - n0 < NBLK ? N - n0 : NBLK;
        const float *bb = bias ? bias + n0 : NULL;
        for (int m = 0; m < M; m += G2) {
            const int r = M - m < G2 ? M - m : G2;
            const float *xr = xf + (size_t)m * K;
            uint16_t *yr = y + (size_t)m * N + n0;
            if (r == 1) strip_1_8(xr, (size_t)K, wb, kps, 0, m == 0, bb, yr, N, nvalid);
            else
                for (int j0 = 0; j0 < NV * 2; j0 += 4)
                    strip_2_4(xr, (size_t)K, wb, kps, j0, m == 0 && j0 == 0, bb, yr, N, nvalid);
        }
    }
    free(xf);
    return 0;
}
#else
int linear_bf16(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y, int M, int N, int K,
                int num_threads) {
    (void)x; (void)packed; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)num_threads;
    return 1;
}
#endif
