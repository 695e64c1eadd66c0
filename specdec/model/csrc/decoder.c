/* A stack of Llama-family decoder layers in bf16, one call for the whole stack.
 *
 * The per-op forward makes 9 native calls per layer (the fused QKV, O, gate/up and down
 * linears, RoPE + KV write, tree attention, its float32 -> bf16 cast, two residual RMSNorms,
 * SwiGLU) through ctypes, each with its Python-side allocations and conversions. Here the same
 * kernels run in the same order from C, on scratch buffers allocated once per call, so every
 * output bit is the same as the per-op path (decoder.py's ``DecoderModel.forward``, which keeps
 * LoRA, exit heads and Qwen3's q/k norms).
 *
 * Per layer, with h the residual stream [N, D] and x its normed copy:
 *   qkv = x Wqkv^T + b;  q, pool K/V <- rope(qkv);  a = attention(q, pool) (float32, cast to bf16)
 *   h' = h + a Wo^T + b;  x = rms_norm(h') * ln2
 *   y = swiglu(x Wgu^T + b) Wdown^T + b
 *   h = h' + y;  x = rms_norm(h) * ln1 of the next layer (the last layer: h = h' + y alone)
 *
 * Layer weights: ``lw`` holds LW_PTRS addresses per layer (see the LW_ enum), the packed
 * native weights and float32 biases of linear.c (a bias may be 0: none) and the bf16 norm
 * weights. K/V pages of layer l: k_pages + l * kv_layer_stride (elements), likewise v_pages.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16_math.h"

enum { LW_LN1, LW_QKV_W, LW_QKV_B, LW_O_W, LW_O_B, LW_LN2, LW_GU_W, LW_GU_B, LW_DOWN_W, LW_DOWN_B, LW_PTRS };

int linear_bf16(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y, int M, int N, int K,
                int num_threads);
void glue_add_rms_norm_bf16(const uint16_t *h, const uint16_t *delta, uint16_t *h_out, const uint16_t *w,
                            uint16_t *x, int N, int D, float eps, int num_threads);
void glue_rope_kv_bf16(const uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, uint16_t *q_out,
                       uint16_t *k_pages, uint16_t *v_pages, const int64_t *page, const int64_t *off, int N, int Hq,
                       int Hkv, int D, int num_threads);
void glue_swiglu_bf16(const uint16_t *gate_up, uint16_t *out, int N, int I, int num_threads);
int tree_attention_bf16(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int32_t *block_table,
                        int bt_stride, const int32_t *row_seq, const int32_t *row_len, const int64_t *row_bits,
                        float *out, int N, int Hq, int Hkv, int D, float scale, int max_len, int num_threads);

#define P(l, i) ((const void *)(intptr_t)lw[(size_t)(l) * LW_PTRS + (i)])

/* h [N, D] in/out: the residual stream before layer 0, after the last layer. Returns 0, or the
 * first kernel error (linear.c's, tree_attention.c's), or 3 when scratch allocation failed. */
int decoder_layers_bf16(const int64_t *lw, int L, uint16_t *h, int N, int D, int Hq, int Hkv, int hd, int I,
                        float eps, float scale, const uint16_t *cos, const uint16_t *sin, uint16_t *k_pages,
                        uint16_t *v_pages, int64_t kv_layer_stride, const int64_t *page, const int64_t *off,
                        const int32_t *block_table, int bt_stride, const int32_t *row_seq, const int32_t *row_len,
                        const int64_t *row_bits, int max_len, int num_threads) {
    const size_t n = (size_t)N, A = (size_t)Hq * hd, QKV = (size_t)(Hq + 2 * Hkv) * hd;
    const size_t bf16s = n * (D + D + QKV + A + A + D + 2 * (size_t)I + I + D), f32s = n * A;
    uint16_t *buf = malloc(bf16s * sizeof(uint16_t));
    float *att = malloc(f32s * sizeof(float));
    if (!buf || !att) { free(buf); free(att); return 3; }
    uint16_t *x = buf, *h2 = x + n * D, *qkv = h2 + n * D, *q = qkv + n * QKV, *a = q + n * A, *o = a + n * A,
             *gu = o + n * D, *act = gu + n * 2 * I, *down = act + n * I;
    int err = 0;
    glue_add_rms_norm_bf16(h, NULL, NULL, P(0, LW_LN1), x, N, D, eps, num_threads);
    for (int l = 0; l < L && !err; l++) {
        uint16_t *kp = k_pages + (size_t)l * kv_layer_stride, *vp = v_pages + (size_t)l * kv_layer_stride;
        if ((err = linear_bf16(x, P(l, LW_QKV_W), P(l, LW_QKV_B), qkv, N, (int)QKV, D, num_threads))) break;
        glue_rope_kv_bf16(qkv, cos, sin, q, kp, vp, page, off, N, Hq, Hkv, hd, num_threads);
        if ((err = tree_attention_bf16(q, kp, vp, block_table, bt_stride, row_seq, row_len, row_bits, att, N, Hq,
                                       Hkv, hd, scale, max_len, num_threads))) break;
        for (size_t i = 0; i < n * A; i++) a[i] = f32_to_bf16(att[i]);  /* torch's .to(bfloat16) */
        if ((err = linear_bf16(a, P(l, LW_O_W), P(l, LW_O_B), o, N, D, (int)A, num_threads))) break;
        glue_add_rms_norm_bf16(h, o, h2, P(l, LW_LN2), x, N, D, eps, num_threads);
        if ((err = linear_bf16(x, P(l, LW_GU_W), P(l, LW_GU_B), gu, N, 2 * I, D, num_threads))) break;
        glue_swiglu_bf16(gu, act, N, I, num_threads);
        if ((err = linear_bf16(act, P(l, LW_DOWN_W), P(l, LW_DOWN_B), down, N, D, I, num_threads))) break;
        if (l + 1 < L) {
            glue_add_rms_norm_bf16(h2, down, h, P(l + 1, LW_LN1), x, N, D, eps, num_threads);
        } else {
            for (size_t i = 0; i < n * D; i++) h[i] = f32_to_bf16(bf16_to_f32(h2[i]) + bf16_to_f32(down[i]));
        }
    }
    free(buf);
    free(att);
    return err;
}
