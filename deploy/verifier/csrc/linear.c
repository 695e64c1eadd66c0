/* y = x W^T + b in bf16 on CPUs with AVX512-BF16, row-invariant by construction.
 *
 * Why our own: a decode step of a small model on one core is a stream of its weights through
 * the matrix multiplies. oneDNN's prepacked bf16 kernels reach ~11 GB/s on that stream for
 * 1-4 rows here (the embedded SmolLM2-135M: 212 MB of layer weights in ~19 ms), a third of
 * what one core reads from memory (~30 GB/s), and their M = 1 kernel rounds differently from
 * M >= 2, so the engine had to compute every single row as two.
 *
 * Weights are packed once (linear_bf16_pack) into blocks of NV x 16 output features: for each
 * pair of k, the block's 16 NV features x 2 values lie together (VNNI order), so a block is
 * one contiguous stream. Output y[m, n] is one fixed chain of VDPBF16PS over the k pairs in
 * increasing order (lane n of an accumulator; no horizontal reduction), plus the bias in
 * float32, rounded once to bf16 (nearest even). The chain never depends on M, the blocking
 * or threads, so a row's result is the same in whatever batch it is computed (batch
 * invariance, M = 1 included).
 *
 * Blocking: tiles of MT rows of x (kept in L2) x weight blocks (streamed once per tile);
 * inside, MB x NV accumulators.
 */
#include <stddef.h>
#include <stdint.h>

#define NV 4                /* 16-feature vectors per weight block */
#define NBLK (NV * 16)      /* output features per weight block */
#define MB 4                /* rows of x per inner block */
#define MT 64               /* rows of x per tile */
#define PF 16               /* k pairs the weight prefetch runs ahead */

int linear_bf16_supported(void) {
#ifdef __AVX512BF16__
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

/* R rows of x (R <= MB, a compile-time constant) against one weight block:
 * y[r][n0 .. n0 + nvalid). */
#define DEFINE_BLOCK(R)                                                                           \
static void block_##R(const uint16_t *restrict x, const uint16_t *restrict wb, const float *restrict bias, \
                      uint16_t *restrict y, int K, int N, int nvalid) {                           \
    __m512 acc[R][NV];                                                                            \
    for (int i = 0; i < R; i++)                                                                   \
        for (int j = 0; j < NV; j++) acc[i][j] = _mm512_setzero_ps();                             \
    const uint32_t *xp = (const uint32_t *)x;                                                     \
    const size_t xs = (size_t)K / 2;                                                              \
    for (int kp = 0; kp < K / 2; kp++) {                                                          \
        const uint16_t *wk = wb + (size_t)kp * NBLK * 2;                                          \
        for (int c = 0; c < NV; c++) _mm_prefetch((const char *)(wk + PF * NBLK * 2 + c * 32), _MM_HINT_T0); \
        __m512bh wv[NV];                                                                          \
        for (int j = 0; j < NV; j++) wv[j] = (__m512bh)_mm512_loadu_si512((const void *)(wk + j * 32)); \
        for (int i = 0; i < R; i++) {                                                             \
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[i * xs + kp]);                \
            for (int j = 0; j < NV; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);      \
        }                                                                                         \
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

/* x [M, K], packed weights (linear_bf16_pack), bias [ceil(N/NBLK)*NBLK] float32 or NULL
 * -> y [M, N], bf16, rows contiguous. */
int linear_bf16(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y, int M, int N, int K,
                int num_threads) {
    if (K % 2) return 2;
    const int nb = (N + NBLK - 1) / NBLK;
    #pragma omp parallel num_threads(num_threads) if (num_threads > 1 && (size_t)M * N * K >= ((size_t)1 << 22))
    for (int m0 = 0; m0 < M; m0 += MT) {
        const int mt = M - m0 < MT ? M - m0 : MT;
        #pragma omp for schedule(static)
        for (int b = 0; b < nb; b++) {
            const uint16_t *wb = packed + (size_t)b * (K / 2) * NBLK * 2;
            const int n0 = b * NBLK, nvalid = N - n0 < NBLK ? N - n0 : NBLK;
            const float *bb = bias ? bias + n0 : NULL;
            for (int i = 0; i < mt; i += MB) {
                const uint16_t *xi = x + (size_t)(m0 + i) * K;
                uint16_t *yi = y + (size_t)(m0 + i) * N + n0;
                switch (mt - i < MB ? mt - i : MB) {
                case 4: block_4(xi, wb, bb, yi, K, N, nvalid); break;
                case 3: block_3(xi, wb, bb, yi, K, N, nvalid); break;
                case 2: block_2(xi, wb, bb, yi, K, N, nvalid); break;
                default: block_1(xi, wb, bb, yi, K, N, nvalid);
                }
            }
        }
    }
    return 0;
}
#else
int linear_bf16(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y, int M, int N, int K,
                int num_threads) {
    (void)x; (void)packed; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)num_threads;
    return 1;
}
#endif
