/* A whole decode step in one call, token ids in, logits (and greedy tokens) out: the native
 * engine's equivalent of a captured CUDA graph. Each op is one of the other kernels (compact
 * GEMV, RMSNorm, RoPE + K/V store, paged decode attention), chained in C so no Python runs
 * between them; the arithmetic is the same as when the model calls those kernels one by one
 * from Python (models/causal_lm.py).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attention/kv_cache.h"
#include "linear/linear.h"
#include "sampling/sampling.h"
#include "runtime/thread_buffer.h"
#include "runtime/thread_pool.h"
#include "runtime/vector_math.h"

void baton_silu_mul(const float *gate_up, int64_t rows, int64_t inter, float *out,
                    int64_t avx512);
void baton_gelu_tanh_mul(const float *gate_up, int64_t rows, int64_t inter, float *out);
void baton_rms_norm(const float *x, int64_t rows, int64_t dim, const float *weight, float eps,
                    float *out);

/* Mirrored by ctypes Structures in decode_step.py: keep the field order in step. */
typedef struct {
    Matrix qkv, o, gate_up, down;
    const float *input_norm, *post_norm, *qk_norm; /* qk_norm: [q + kv heads, head_dim] or NULL */
    void *k_cache, *v_cache;                       /* this layer's [pages, page_size, kv, dim] */
    int64_t q_heads, kv_heads, head_dim, page_size, kv_type; /* the caches' elements: KvType */
    int64_t window; /* the tokens a query sees, its own included (Mistral v0.1, Phi-3); 0: all */
    float eps, scale;
    /* A mixture of experts' layer (router non-NULL): the float32 router [num_experts, hidden]
     * and each expert's stored matrices (moe_experts.c); gate_up and down are then its shared
     * expert's, under the float32 gate [hidden] `shared_gate` (NULL: no shared expert). */
    const float *router;
    const Matrix *experts_gate, *experts_up, *experts_down;
    int64_t num_experts, top_k, normalize_top_k;
    const float *shared_gate;
    /* A Gemma's layer (else NULL, 0): the norms of attention's output and of the MLP's (its
     * post_norm is then the MLP input's), GeGLU for SwiGLU, the attention logits' soft cap, and
     * this layer's RoPE tables (Gemma 3's local layers; NULL: the step's). */
    const float *attn_out_norm, *mlp_out_norm;
    int64_t gelu;
    float softcap;
    const float *cos_table, *sin_table;
} DecoderLayer;

int baton_moe_experts(const Matrix *gate, const Matrix *up, const Matrix *down,
                      int64_t num_experts, const float *x, int64_t rows, const int64_t *experts,
                      const float *weights, int64_t top_k, float *out);

/* out [rows, hidden] += sigmoid(shared_gate . x) * the shared expert's gated MLP of x, as
 * SparseMoE adds Qwen2-MoE's; gate_up: [rows, 2 * its features] of scratch. Returns 0, or -1
 * if memory ran out. */
static int shared_expert(const DecoderLayer *layer, const float *x, int64_t rows,
                         float *gate_up, float *out) {
    static __thread ThreadBuffer shared_buffer;
    const int64_t hidden = layer->qkv.in_features, features = layer->down.in_features;
    float *activated = thread_buffer(
        &shared_buffer, (int64_t)sizeof(float) * rows * (features + hidden));
    if (!activated || baton_linear(&layer->gate_up, x, rows, gate_up)) return -1;
    float *product = activated + rows * features;
    baton_silu_mul(gate_up, rows, features, activated, layer->gate_up.avx512);
    if (baton_linear(&layer->down, activated, rows, product)) return -1;
    for (int64_t r = 0; r < rows; r++) {
        float logit = 0.0f;
        for (int64_t i = 0; i < hidden; i++) logit += layer->shared_gate[i] * x[r * hidden + i];
        const float gate = 1.0f / (1.0f + expf(-logit));
        for (int64_t i = 0; i < hidden; i++) out[r * hidden + i] += gate * product[r * hidden + i];
    }
    return 0;
}

/* out [rows, hidden] = the layer's routed experts of x [rows, hidden], as SparseMoE routes
 * (models/moe.py): the router's float32 softmax, each row's top-k most likely first (ties to
 * the lower expert), renormalised where the model says. Returns 0, or -1 if memory ran out. */
static int routed_experts(const DecoderLayer *layer, const float *x, int64_t rows, float *out) {
    static __thread ThreadBuffer route_buffer;
    const int64_t hidden = layer->qkv.in_features, n = layer->num_experts, k = layer->top_k;
    float *probabilities = thread_buffer(
        &route_buffer, (int64_t)(sizeof(float) * (n + k) + sizeof(int64_t) * k) * rows);
    if (!probabilities) return -1;
    float *weights = probabilities + rows * n;
    int64_t *chosen = (int64_t *)(weights + rows * k);
    for (int64_t r = 0; r < rows; r++) {
        float *p = probabilities + r * n, most = -INFINITY, sum = 0.0f, kept = 0.0f;
        for (int64_t e = 0; e < n; e++) {
            const float *w = layer->router + e * hidden, *row = x + r * hidden;
            __m256 acc = _mm256_setzero_ps();
            int64_t i = 0;
            for (; i + 8 <= hidden; i += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(row + i), acc);
            float logit = hsum8(acc);
            for (; i < hidden; i++) logit += w[i] * row[i];
            p[e] = logit;
            most = logit > most ? logit : most;
        }
        for (int64_t e = 0; e < n; e++) sum += p[e] = expf(p[e] - most);
        for (int64_t e = 0; e < n; e++) p[e] /= sum;
        for (int64_t j = 0; j < k; j++) { /* (k is small: a pass each) */
            int64_t best = -1;
            for (int64_t e = 0; e < n; e++) {
                int taken = 0;
                for (int64_t i = 0; i < j; i++) taken |= chosen[r * k + i] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            chosen[r * k + j] = best;
            kept += weights[r * k + j] = p[best];
        }
        if (layer->normalize_top_k)
            for (int64_t j = 0; j < k; j++) weights[r * k + j] /= kept;
    }
    return baton_moe_experts(layer->experts_gate, layer->experts_up, layer->experts_down, n, x,
                             rows, chosen, weights, k, out)
               ? -1
               : 0;
}

/* The model around its layers (decode_step.py's DecodeModelArgs). */
typedef struct {
    const float *embeddings; /* [vocab_size, hidden_size], or NULL: the rows of `embedding` */
    Matrix embedding;        /* the embedding as stored (formats.py), where embeddings is NULL */
    const float *final_norm;
    Matrix lm_head;
    float *hidden, *normed; /* [rows, hidden_size] each */
    float *logits;          /* [rows, vocab_size] */
    float eps;
    float embed_scale;   /* the embeddings' factor: Gemma's sqrt(hidden_size), 1 elsewhere */
    float final_softcap; /* Gemma 2's logits' soft cap, c tanh(logits / c); 0: none */
} DecodeModel;

typedef struct {
    int64_t rows;
    const int64_t *input_ids;
    int64_t *tokens; /* each row's token, or NULL: the caller samples from the logits */
    const RowSampling *sampling; /* how each row is sampled; NULL: every row takes its argmax */
    const int64_t *positions, *slots;
    const int32_t *batch_rows, *kv_indptr, *kv_indices, *kv_lens;
    const float *cos_table, *sin_table;
    float *scratch; /* rows * (2 * hidden + qkv + q_size + 3 * intermediate) floats */
} DecodeStep;

/* hidden [rows, out] += m x, normalised first by `norm` where given (Gemma's norms of attention's
 * and the MLP's outputs); scratch: [rows, out]. Returns 0, or -1 if memory ran out. */
static int add_normed(const Matrix *m, const float *norm, float eps, const float *x, int64_t rows,
                      float *hidden, float *scratch) {
    if (!norm) return baton_linear_add(m, x, rows, hidden, scratch);
    if (baton_linear(m, x, rows, scratch)) return -1;
    baton_rms_norm(scratch, rows, m->out_features, norm, eps, scratch);
    for (int64_t i = 0; i < rows * m->out_features; i++) hidden[i] += scratch[i];
    return 0;
}

/* hidden [rows, hidden_size] += attention(norm(hidden)); hidden += mlp(norm(hidden)).
 * Returns 0, or -1 if memory ran out. */
static int decode_layer(const DecoderLayer *layer, const DecodeStep *step, float *hidden) {
    const int64_t rows = step->rows, hidden_size = layer->qkv.in_features;
    const int64_t qkv_size = layer->qkv.out_features, q_size = layer->o.in_features;
    const int64_t inter = layer->down.in_features, head_dim = layer->head_dim;
    float *normed = step->scratch, *qkv = normed + rows * hidden_size;
    float *attended = qkv + rows * qkv_size, *gate_up = attended + rows * q_size;
    float *activated = gate_up + rows * 2 * inter, *projected = activated + rows * inter;

    baton_rms_norm(hidden, rows, hidden_size, layer->input_norm, layer->eps, normed);
    if (baton_linear(&layer->qkv, normed, rows, qkv)) return -1;
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
                         layer->kv_heads, head_dim,
                         layer->cos_table ? layer->cos_table : step->cos_table,
                         layer->sin_table ? layer->sin_table : step->sin_table,
                         step->positions, step->slots, layer->k_cache, layer->v_cache,
                         layer->kv_type);
    if (baton_decode_attention(qkv, qkv_size, step->batch_rows, rows, layer->k_cache,
                               layer->v_cache, step->kv_indptr, step->kv_indices, step->kv_lens,
                               layer->q_heads, layer->kv_heads, head_dim, layer->page_size,
                               layer->scale, layer->softcap, layer->window, layer->kv_type,
                               attended))
        return -1;
    if (add_normed(&layer->o, layer->attn_out_norm, layer->eps, attended, rows, hidden,
                   projected))
        return -1;

    baton_rms_norm(hidden, rows, hidden_size, layer->post_norm, layer->eps, normed);
    if (layer->router) {
        if (routed_experts(layer, normed, rows, projected)) return -1;
        if (layer->shared_gate && shared_expert(layer, normed, rows, gate_up, projected))
            return -1;
        for (int64_t i = 0; i < rows * hidden_size; i++) hidden[i] += projected[i];
        return 0;
    }
    if (baton_linear(&layer->gate_up, normed, rows, gate_up)) return -1;
    if (layer->gelu)
        baton_gelu_tanh_mul(gate_up, rows, inter, activated);
    else
        baton_silu_mul(gate_up, rows, inter, activated, layer->gate_up.avx512);
    return add_normed(&layer->down, layer->mlp_out_norm, layer->eps, activated, rows, hidden,
                      projected);
}

/* x = cap * tanh(x / cap), in place (Gemma 2's final logits, as CausalLM.logits caps them). */
static void soft_cap(float *x, int64_t count, float cap) {
    const __m256 scale = _mm256_set1_ps(cap);
    int64_t i = 0;
    for (; i + 8 <= count; i += 8)
        _mm256_storeu_ps(x + i, _mm256_mul_ps(scale, tanh8(_mm256_div_ps(_mm256_loadu_ps(x + i), scale))));
    for (; i < count; i++) x[i] = cap * tanhf(x[i] / cap);
}

typedef struct {
    const float *logits;
    int64_t vocab_size;
    int64_t *tokens;
} ArgmaxLoop;

static void argmax_task(const void *arg, int64_t row) {
    const ArgmaxLoop *a = arg;
    a->tokens[row] = baton_argmax_row(a->logits + row * a->vocab_size, a->vocab_size);
}

/* The whole step for `step->rows` decode rows: embed the input ids, run every layer, normalise,
 * multiply by the LM head into model->logits and, where step->tokens is given, write each
 * row's token there: sampled as step->sampling says (sampling.c), else its argmax. Returns 0, -1 for an input id outside the vocabulary (nothing written to
 * the KV cache), or -2 if memory ran out. Everything runs in one foreign call, so the engine
 * thread needs the GIL once a step: each return to Python waited for the scheduler thread,
 * which runs Python while the step computes. */
int baton_decode_step(const DecoderLayer *layers, int64_t num_layers, const DecodeModel *model,
                      const DecodeStep *step) {
    const int64_t rows = step->rows, hidden_size = model->lm_head.in_features;
    const int64_t vocab_size = model->lm_head.out_features;
    for (int64_t r = 0; r < rows; r++)
        if (step->input_ids[r] < 0 || step->input_ids[r] >= vocab_size) return -1;
    if (!model->embeddings) {
        const Matrix *e = &model->embedding;
        if (baton_dequantize_rows((int)e->format, (int)e->avx512, e->data, hidden_size,
                                  e->row_bytes, step->input_ids, rows, model->hidden))
            return -2;
    } else {
        for (int64_t r = 0; r < rows; r++)
            memcpy(model->hidden + r * hidden_size,
                   model->embeddings + step->input_ids[r] * hidden_size,
                   sizeof(float) * hidden_size);
    }
    if (model->embed_scale != 1.0f)
        for (int64_t i = 0; i < rows * hidden_size; i++) model->hidden[i] *= model->embed_scale;
    for (int64_t i = 0; i < num_layers; i++)
        if (decode_layer(&layers[i], step, model->hidden)) return -2;
    baton_rms_norm(model->hidden, rows, hidden_size, model->final_norm, model->eps,
                   model->normed);
    if (baton_linear(&model->lm_head, model->normed, rows, model->logits)) return -2;
    if (model->final_softcap > 0.0f) soft_cap(model->logits, rows * vocab_size, model->final_softcap);
    if (step->tokens && step->sampling) {
        baton_sample_rows(model->logits, rows, vocab_size, step->sampling, step->tokens);
    } else if (step->tokens) {
        const ArgmaxLoop loop = {model->logits, vocab_size, step->tokens};
        baton_parallel(argmax_task, &loop, rows);
    }
    return 0;
}
