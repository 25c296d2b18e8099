/* A mixture-of-experts block's routed experts (baton_moe_experts), from their stored weights.
 *
 * The batch's (token, expert) assignments are grouped by expert, so each expert a token chose
 * is read once however many of the batch's tokens chose it, and experts no token chose are not
 * read at all: a Qwen3-30B-A3B token reads 8 of each layer's 128. Each expert's rows go
 * through the same products as a dense layer's (baton_linear: the compact kernel for a few
 * rows, staged float32 slabs for many), so every stored format the engine multiplies works.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "linear/linear.h"
#include "runtime/thread_buffer.h"

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

/* out [rows, hidden] = for each row, the sum over its top_k experts of weight * down(silu(gate)
 * * up), x [rows, hidden] float32; experts, weights [rows, top_k]: each row's choices and their
 * routing weights. gate[e], up[e] ([features, hidden]) and down[e] ([hidden, features]) for
 * e < num_experts: separate matrices, so that a GGUF's stacked experts are read where the file
 * maps them (no fused copy). A row's experts are added in ascending expert order, each product
 * rounded before its weight multiplies it: transformers' order, so float32 results match its
 * float32 reference's arithmetic. Returns 0, -1 if memory ran out (or a product failed), -2
 * for an expert id out of range. */
int baton_moe_experts(const Matrix *gate, const Matrix *up, const Matrix *down,
                      int64_t num_experts, const float *x, int64_t rows, const int64_t *experts,
                      const float *weights, int64_t top_k, float *out) {
    static __thread ThreadBuffer order_buffer, rows_buffer, gate_buffer, up_buffer,
        product_buffer;
    const int64_t assignments = rows * top_k;
    if (!assignments) return 0;
    const int64_t hidden = gate[0].in_features, features = down[0].in_features;
    int64_t *starts = thread_buffer(&order_buffer,
                                    (int64_t)sizeof(int64_t) * (num_experts + 1 + assignments));
    if (!starts) return -1;
    int64_t *order = starts + num_experts + 1;
    /* A counting sort, stable: an expert's rows in token order. */
    memset(starts, 0, sizeof(int64_t) * (size_t)(num_experts + 1));
    for (int64_t a = 0; a < assignments; a++) {
        if (experts[a] < 0 || experts[a] >= num_experts) return -2;
        starts[experts[a] + 1]++;
    }
    int64_t most = 0;
    for (int64_t e = 0; e < num_experts; e++) {
        most = starts[e + 1] > most ? starts[e + 1] : most;
        starts[e + 1] += starts[e];
    }
    for (int64_t a = 0, *next = starts; a < assignments; a++) order[next[experts[a]]++] = a;
    /* (`next` advanced each expert's start to its end: starts[e] is now expert e's end, and
     * expert e's rows begin at starts[e - 1], 0 for the first.) */
    float *gathered = thread_buffer(&rows_buffer, (int64_t)sizeof(float) * most * hidden);
    float *gates = thread_buffer(&gate_buffer, (int64_t)sizeof(float) * most * features);
    float *ups = thread_buffer(&up_buffer, (int64_t)sizeof(float) * most * features);
    float *down_rows = thread_buffer(&product_buffer, (int64_t)sizeof(float) * most * hidden);
    if (!gathered || !gates || !ups || !down_rows) return -1;
    memset(out, 0, sizeof(float) * (size_t)(rows * hidden));
    for (int64_t e = 0; e < num_experts; e++) {
        const int64_t first = e ? starts[e - 1] : 0, count = starts[e] - first;
        if (!count) continue;
        for (int64_t j = 0; j < count; j++)
            memcpy(gathered + j * hidden, x + order[first + j] / top_k * hidden,
                   sizeof(float) * (size_t)hidden);
        if (baton_linear(&gate[e], gathered, count, gates)) return -1;
        if (baton_linear(&up[e], gathered, count, ups)) return -1;
        for (int64_t i = 0; i < count * features; i++) gates[i] = silu(gates[i]) * ups[i];
        if (baton_linear(&down[e], gates, count, down_rows)) return -1;
        for (int64_t j = 0; j < count; j++) {
            const int64_t a = order[first + j];
            const float weight = weights[a];
            float *y = out + a / top_k * hidden;
            const float *product = down_rows + j * hidden;
            for (int64_t c = 0; c < hidden; c++) y[c] += product[c] * weight;
        }
    }
    return 0;
}
