/* One decoder layer of a decode step in one call: the native engine's equivalent of a captured
 * CUDA graph. Each op is one of the other kernels (compact GEMV, RMSNorm, RoPE + K/V store,
 * paged decode attention), chained in C so no Python runs between them; the arithmetic is the
 * same as when the model calls those kernels one by one from Python (model.py).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "vector_math.h"

int baton_compact_gemv(int fmt, const float *x, int64_t m_dim, int64_t k_dim, const uint8_t *w,
                       int64_t n_dim, int64_t row_bytes, const float *bias, float *y);
void baton_rms_norm(const float *x, int64_t rows, int64_t dim, const float *weight, float eps,
                    float *out);
void baton_rope_and_store(float *qk, int64_t qk_stride, const float *v, int64_t v_stride,
                          int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                          const float *cos_table, const float *sin_table,
                          const int64_t *positions, const int64_t *slots, float *k_cache,
                          float *v_cache);
int baton_decode_attention(const float *q, int64_t q_stride, const int32_t *rows, int64_t n,
                           const float *k_cache, const float *v_cache, const int32_t *kv_indptr,
                           const int32_t *kv_indices, const int32_t *kv_lens, int64_t q_heads,
                           int64_t kv_heads, int64_t head_dim, int64_t page_size, float scale,
                           float *out);

/* A linear layer's compact weight (compact_weights.CompactWeight) and its bias (or NULL). */
typedef struct {
    int64_t format, in_features, out_features, row_bytes;
    const uint8_t *data;
    const float *bias;
} Matrix;

/* Mirrored by ctypes Structures in decode_step.py: keep the field order in step. */
typedef struct {
    Matrix qkv, o, gate_up, down;
    const float *input_norm, *post_norm, *qk_norm; /* qk_norm: [q + kv heads, head_dim] or NULL */
    float *k_cache, *v_cache;                      /* this layer's [pages, page_size, kv, dim] */
    int64_t q_heads, kv_heads, head_dim, page_size;
    float eps, scale;
} DecoderLayer;

typedef struct {
    int64_t rows;
    const int64_t *positions, *slots;
    const int32_t *batch_rows, *kv_indptr, *kv_indices, *kv_lens;
    const float *cos_table, *sin_table;
    float *scratch; /* rows * (2 * hidden + qkv + q_size + 3 * intermediate) floats */
} DecodeStep;

static void linear(const Matrix *m, const float *x, int64_t rows, float *y) {
    baton_compact_gemv((int)m->format, x, rows, m->in_features, m->data, m->out_features,
                       m->row_bytes, m->bias, y);
}

/* hidden [rows, hidden_size] += attention(norm(hidden)); hidden += mlp(norm(hidden)). */
static void decode_layer(const DecoderLayer *layer, const DecodeStep *step, float *hidden) {
    const int64_t rows = step->rows, hidden_size = layer->qkv.in_features;
    const int64_t qkv_size = layer->qkv.out_features, q_size = layer->o.in_features;
    const int64_t inter = layer->down.in_features, head_dim = layer->head_dim;
    float *normed = step->scratch, *qkv = normed + rows * hidden_size;
    float *attended = qkv + rows * qkv_size, *gate_up = attended + rows * q_size;
    float *activated = gate_up + rows * 2 * inter, *projected = activated + rows * inter;

    baton_rms_norm(hidden, rows, hidden_size, layer->input_norm, layer->eps, normed);
    linear(&layer->qkv, normed, rows, qkv);
    if (layer->qk_norm) { /* Qwen3: each q and k head normalised by its own weights */
        const int64_t heads = layer->q_heads + layer->kv_heads;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t h = 0; h < heads; h++) {
                float *x = qkv + r * qkv_size + h * head_dim;
                baton_rms_norm(x, 1, head_dim, layer->qk_norm + h * head_dim, layer->eps, x);
            }
    }
    const int64_t v_offset = (layer->q_heads + layer->kv_heads) * head_dim;
    baton_rope_and_store(qkv, qkv_size, qkv + v_offset, qkv_size, rows, layer->q_heads,
                         layer->kv_heads, head_dim, step->cos_table, step->sin_table,
                         step->positions, step->slots, layer->k_cache, layer->v_cache);
    baton_decode_attention(qkv, qkv_size, step->batch_rows, rows, layer->k_cache,
                           layer->v_cache, step->kv_indptr, step->kv_indices, step->kv_lens,
                           layer->q_heads, layer->kv_heads, head_dim, layer->page_size,
                           layer->scale, attended);
    linear(&layer->o, attended, rows, projected);
    for (int64_t i = 0; i < rows * hidden_size; i++) hidden[i] = projected[i] + hidden[i];

    baton_rms_norm(hidden, rows, hidden_size, layer->post_norm, layer->eps, normed);
    linear(&layer->gate_up, normed, rows, gate_up);
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * inter, *up = gate + inter;
        float *act = activated + r * inter;
        int64_t i = 0;
        for (; i + 8 <= inter; i += 8)
            _mm256_storeu_ps(act + i, _mm256_mul_ps(silu8(_mm256_loadu_ps(gate + i)),
                                                    _mm256_loadu_ps(up + i)));
        for (; i < inter; i++) act[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
    linear(&layer->down, activated, rows, projected);
    for (int64_t i = 0; i < rows * hidden_size; i++) hidden[i] = projected[i] + hidden[i];
}

/* Every decoder layer of the step, in order: one foreign call per step, so the engine thread
 * needs the GIL once, not once per layer (while the scheduler thread runs Python, each of those
 * returns waited for it). */
void baton_decode_layers(const DecoderLayer *layers, int64_t num_layers, const DecodeStep *step,
                         float *hidden) {
    for (int64_t i = 0; i < num_layers; i++) decode_layer(&layers[i], step, hidden);
}
