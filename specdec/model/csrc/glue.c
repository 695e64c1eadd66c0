/* The elementwise glue of a Llama-family decoder layer in bf16, fused, row by row.
 *
 * Between the matrix multiplies a layer runs ~40 small torch ops (RMSNorm alone is eight:
 * upcast, square, mean, add, rsqrt, multiply, downcast, scale), each a dispatch of a few
 * microseconds over a few hundred values; on one CPU core that was ~25 % of a decode step
 * for the embedded SmolLM2-135M. Here each piece is one call:
 *
 *   glue_add_rms_norm_bf16  h' <- h + delta (optional), x <- rms_norm(h') * w
 *   glue_rope_kv_bf16       q <- rope(q); k <- rope(k) and v written into the KV pool pages
 *   glue_swiglu_bf16        out <- silu(gate) * up
 *
 * Rounding follows the torch expressions they replace (model.py): every bf16 op computes in
 * float32 and rounds to bf16 (round to nearest even) where torch's would, so results agree
 * with the torch glue up to the order of RMSNorm's float32 sum and a last-ulp exp.
 *
 * Batch invariance: every output row depends only on its own input row, and every
 * reduction (RMSNorm's sum of squares) runs in a fixed order over the row (16 lanes, then
 * the lanes in order), never over the batch or across threads.
 *
 * Layouts: rows contiguous; qkv [N, Hq + 2 Hkv, D]; cos/sin [N, D]; q out [N, Hq, D];
 * K pages [num_pages, Hkv, D, PS] (keys transposed inside a page), V pages
 * [num_pages, Hkv, PS, D], as in tree_attention.c.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "bf16_math.h"

#define PS 16 /* tokens per KV page */
#define LANES 16

typedef float vf16 __attribute__((vector_size(LANES * sizeof(float))));

/* h_out [N, D] = h + delta (delta NULL: h_out = h, nothing written), then x [N, D] =
 * w * rms_norm(h_out): torch's ``w * (hf * rsqrt(mean(hf^2) + eps)).to(bf16)``, hf = h_out.float(). */
void glue_add_rms_norm_bf16(const uint16_t *restrict h, const uint16_t *restrict delta, uint16_t *restrict h_out,
                            const uint16_t *restrict w, uint16_t *restrict x, int N, int D, float eps,
                            int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && N >= 32)
    for (int r = 0; r < N; r++) {
        const uint16_t *hr = h + (size_t)r * D;
        if (delta) {
            const uint16_t *dr = delta + (size_t)r * D;
            uint16_t *hw = h_out + (size_t)r * D;
            for (int i = 0; i < D; i++) hw[i] = f32_to_bf16(bf16_to_f32(hr[i]) + bf16_to_f32(dr[i]));
            hr = hw;
        }
        /* sum of squares: lane l takes elements l, l + 16, ... (one 512-bit vector), then
         * the lanes are added in order */
        vf16 acc = {0};
        int i = 0;
        for (; i + LANES <= D; i += LANES) {
            vf16 v;
            for (int l = 0; l < LANES; l++) v[l] = bf16_to_f32(hr[i + l]);
            acc += v * v;
        }
        float lane[LANES];
        for (int l = 0; l < LANES; l++) lane[l] = acc[l];
        for (; i < D; i++) { const float v = bf16_to_f32(hr[i]); lane[i % LANES] = fmaf(v, v, lane[i % LANES]); }
        float ss = 0.0f;
        for (int l = 0; l < LANES; l++) ss += lane[l];
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        uint16_t *xr = x + (size_t)r * D;
        for (int j = 0; j < D; j++) xr[j] = f32_to_bf16(bf16_to_f32(w[j]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(hr[j]) * inv)));
    }
}

/* One head of D values rotated: torch's ``x * cos + cat(-x[h:], x[:h]) * sin`` in bf16. */
static inline void rope_head(const uint16_t *restrict x, const uint16_t *restrict c, const uint16_t *restrict s,
                             uint16_t *restrict y, int D, int stride) {
    const int half = D / 2;
    for (int i = 0; i < D; i++) {
        const float rot = i < half ? -bf16_to_f32(x[i + half]) : bf16_to_f32(x[i - half]);
        y[(size_t)i * stride] = f32_to_bf16(bf16_to_f32(f32_to_bf16(bf16_to_f32(x[i]) * bf16_to_f32(c[i]))) + bf16_to_f32(f32_to_bf16(rot * bf16_to_f32(s[i]))));
    }
}

/* qkv [N, Hq + 2 Hkv, D]: q heads rotated into q_out [N, Hq, D]; k heads rotated and v heads
 * copied into the pool at (page[r], off[r]) of this layer's K/V pages. */
void glue_rope_kv_bf16(const uint16_t *restrict qkv, const uint16_t *restrict cos, const uint16_t *restrict sin,
                       uint16_t *restrict q_out, uint16_t *restrict k_pages, uint16_t *restrict v_pages,
                       const int64_t *restrict page, const int64_t *restrict off, int N, int Hq, int Hkv, int D,
                       int num_threads) {
    const int H = Hq + 2 * Hkv;
    #pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && N >= 32)
    for (int r = 0; r < N; r++) {
        const uint16_t *row = qkv + (size_t)r * H * D, *c = cos + (size_t)r * D, *s = sin + (size_t)r * D;
        for (int h = 0; h < Hq; h++) rope_head(row + (size_t)h * D, c, s, q_out + ((size_t)r * Hq + h) * D, D, 1);
        for (int h = 0; h < Hkv; h++) {
            const size_t kv = (size_t)page[r] * Hkv + h;
            rope_head(row + (size_t)(Hq + h) * D, c, s, k_pages + kv * D * PS + off[r], D, PS);
            const uint16_t *v = row + (size_t)(Hq + Hkv + h) * D;
            uint16_t *vd = v_pages + (kv * PS + off[r]) * D;
            for (int i = 0; i < D; i++) vd[i] = v[i];
        }
    }
}

/* gate_up [N, 2 I] -> out [N, I] = silu(gate) * up: torch's ``F.silu(g) * u`` in bf16. */
void glue_swiglu_bf16(const uint16_t *restrict gate_up, uint16_t *restrict out, int N, int I, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && N >= 32)
    for (int r = 0; r < N; r++) {
        const uint16_t *g = gate_up + (size_t)r * 2 * I, *u = g + I;
        uint16_t *o = out + (size_t)r * I;
        for (int i = 0; i < I; i++) {
            const float x = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(x / (1.0f + exp_any(-x)))) * bf16_to_f32(u[i]));
        }
    }
}

/* torch.argmax of one bf16 row x[0 .. n): the index of the first largest value, a NaN counting
 * as the largest (the first NaN wins): the greedy token of a logits row, without torch's float32
 * copy (docs/engine.md, "Greedy tokens by a native bf16 argmax"). */
#define ARGMAX_CHUNK 64
int64_t glue_argmax_bf16(const uint16_t *restrict x, int64_t n) {
    /* the largest value by an integer key that orders like the floats (vectorises, unlike a
     * float max); NaNs are told apart by their bits */
    uint16_t best = 0;
    int nan = 0;
    for (int64_t i = 0; i < n; i++) {
        const uint16_t b = x[i];
        const uint16_t key = (b & 0x8000u) ? (uint16_t)~b : (uint16_t)(b | 0x8000u);
        best = key > best ? key : best;
        nan |= (b & 0x7fffu) > 0x7f80u;
    }
    const float m = bf16_to_f32((best & 0x8000u) ? (uint16_t)(best & 0x7fffu) : (uint16_t)~best);
    for (int64_t c = 0; c < n; c += ARGMAX_CHUNK) {
        const int64_t e = c + ARGMAX_CHUNK < n ? c + ARGMAX_CHUNK : n;
        int hit = 0;
        for (int64_t i = c; i < e; i++) {
            const float v = bf16_to_f32(x[i]);
            hit |= nan ? v != v : v == m;
        }
        if (!hit) continue;
        for (int64_t i = c; i < e; i++) {
            const float v = bf16_to_f32(x[i]);
            if (nan ? v != v : v == m) return i;
        }
    }
    return 0;
}
