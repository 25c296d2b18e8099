/* A mixture-of-experts block's routed experts (baton_moe_experts), from their stored weights.
 *
 * The batch's (token, expert) assignments are grouped by expert, so each expert a token chose
 * is read once however many of the batch's tokens chose it, and experts no token chose are not
 * read at all: a Qwen3-30B-A3B token reads 8 of each layer's 128. Each expert's rows go
 * through the same products as a dense layer's (baton_linear: the compact kernel for a few
 * rows, staged float32 slabs for many), so every stored format the engine multiplies works.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "linear/linear.h"
#include "runtime/thread_buffer.h"
#include "runtime/thread_pool.h"

/* Rows of its busiest expert up to which a batch's experts are shared out among the threads,
 * each expert's products whole on one thread, rather than each product among them: a decode
 * step's experts take one to three rows each, and each product shared out cost a loop's start
 * and end (three an expert, 246 a layer for 16 rows of the Qwen3-30B-A3B shape) around tens of
 * microseconds of work, and the activation ran on one thread. */
#define EXPERTS_APART_MAX_ROWS 16

/* An assignment to an expert another tensor-parallel rank holds (each holds a share of whole
 * experts, engine/models/moe.py): this rank's sum leaves it out. */
#define OTHER_RANKS_EXPERT (-1)

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

/* What every expert's products read: the block's matrices, its rows and how they are grouped. */
typedef struct {
    const Matrix *gate, *up, *down;
    const float *x;
    const int64_t *order;  /* assignments grouped by expert, each expert's in token order */
    const int64_t *starts; /* expert e's assignments end at order[starts[e]] */
    int64_t top_k;
} Experts;

/* down_rows [count, hidden] = expert e's down(silu(gate(x)) * up(x)) for its rows of x. */
static int expert_products(const Experts *ex, int64_t e, float *down_rows) {
    static __thread ThreadBuffer rows_buffer, gate_buffer, up_buffer;
    const int64_t first = e ? ex->starts[e - 1] : 0, count = ex->starts[e] - first;
    const int64_t hidden = ex->gate[e].in_features, features = ex->down[e].in_features;
    float *gathered = thread_buffer(&rows_buffer, (int64_t)sizeof(float) * count * hidden);
    float *gates = thread_buffer(&gate_buffer, (int64_t)sizeof(float) * count * features);
    float *ups = thread_buffer(&up_buffer, (int64_t)sizeof(float) * count * features);
    if (!gathered || !gates || !ups) return -1;
    for (int64_t j = 0; j < count; j++)
        memcpy(gathered + j * hidden, ex->x + ex->order[first + j] / ex->top_k * hidden,
               sizeof(float) * (size_t)hidden);
    if (baton_linear(&ex->gate[e], gathered, count, gates)) return -1;
    if (baton_linear(&ex->up[e], gathered, count, ups)) return -1;
    for (int64_t i = 0; i < count * features; i++) gates[i] = silu(gates[i]) * ups[i];
    return baton_linear(&ex->down[e], gates, count, down_rows) ? -1 : 0;
}

/* out's rows += each of assignments order[begin..end)'s product (products, in that order) times
 * its routing weight. */
static void add_products(const Experts *ex, int64_t begin, int64_t end, const float *products,
                         const float *weights, int64_t hidden, float *out) {
    for (int64_t p = begin; p < end; p++) {
        const int64_t a = ex->order[p];
        const float weight = weights[a];
        float *y = out + a / ex->top_k * hidden;
        const float *product = products + (p - begin) * hidden;
        for (int64_t c = 0; c < hidden; c++) y[c] += product[c] * weight;
    }
}

/* Experts apart: chunk i is the i-th expert with rows, its products into its assignments' rows
 * of `products`. */
typedef struct {
    const Experts *ex;
    const int64_t *chosen;
    float *products;
    int64_t hidden;
    _Atomic int failed;
} ApartLoop;

static void expert_task(const void *arg, int64_t chunk) {
    ApartLoop *loop = (ApartLoop *)arg;
    const int64_t e = loop->chosen[chunk], first = e ? loop->ex->starts[e - 1] : 0;
    if (expert_products(loop->ex, e, loop->products + first * loop->hidden))
        atomic_store_explicit(&loop->failed, 1, memory_order_relaxed);
}

/* out [rows, hidden] = for each row, the sum over its top_k experts of weight * down(silu(gate)
 * * up), x [rows, hidden] float32; experts, weights [rows, top_k]: each row's choices and their
 * routing weights. gate[e], up[e] ([features, hidden]) and down[e] ([hidden, features]) for
 * e < num_experts: separate matrices, so that a GGUF's stacked experts are read where the file
 * maps them (no fused copy). A row's experts are added in ascending expert order, each product
 * rounded before its weight multiplies it: transformers' order, so float32 results match its
 * float32 reference's arithmetic (and do not depend on which thread took an expert). An
 * expert id of -1 is another rank's expert, left out. Returns 0, -1 if memory ran out (or a
 * product failed), -2 for an expert id out of range. */
int baton_moe_experts(const Matrix *gate, const Matrix *up, const Matrix *down,
                      int64_t num_experts, const float *x, int64_t rows, const int64_t *experts,
                      const float *weights, int64_t top_k, float *out) {
    static __thread ThreadBuffer order_buffer, product_buffer;
    const int64_t assignments = rows * top_k;
    if (!assignments) return 0;
    const int64_t hidden = gate[0].in_features;
    int64_t *starts = thread_buffer(
        &order_buffer, (int64_t)sizeof(int64_t) * (2 * num_experts + 1 + assignments));
    if (!starts) return -1;
    int64_t *order = starts + num_experts + 1, *chosen = order + assignments;
    /* A counting sort, stable: an expert's rows in token order (an assignment to another
     * rank's expert, -1, left out). */
    memset(starts, 0, sizeof(int64_t) * (size_t)(num_experts + 1));
    for (int64_t a = 0; a < assignments; a++) {
        if (experts[a] == OTHER_RANKS_EXPERT) continue;
        if (experts[a] < 0 || experts[a] >= num_experts) return -2;
        starts[experts[a] + 1]++;
    }
    int64_t most = 0, chosen_count = 0;
    for (int64_t e = 0; e < num_experts; e++) {
        most = starts[e + 1] > most ? starts[e + 1] : most;
        if (starts[e + 1]) chosen[chosen_count++] = e;
        starts[e + 1] += starts[e];
    }
    for (int64_t a = 0, *next = starts; a < assignments; a++)
        if (experts[a] != OTHER_RANKS_EXPERT) order[next[experts[a]]++] = a;
    /* (`next` advanced each expert's start to its end: starts[e] is now expert e's end, and
     * expert e's rows begin at starts[e - 1], 0 for the first.) */
    const int64_t placed = starts[num_experts - 1]; /* the assignments to these experts */
    const Experts ex = {gate, up, down, x, order, starts, top_k};
    memset(out, 0, sizeof(float) * (size_t)(rows * hidden));
    if (most <= EXPERTS_APART_MAX_ROWS) {
        /* Every assignment's product first, then the sums in the order below: the same. */
        float *products =
            thread_buffer(&product_buffer, (int64_t)sizeof(float) * (placed + 1) * hidden);
        if (!products) return -1;
        ApartLoop loop = {&ex, chosen, products, hidden, 0};
        baton_parallel(expert_task, &loop, chosen_count);
        if (atomic_load_explicit(&loop.failed, memory_order_relaxed)) return -1;
        add_products(&ex, 0, placed, products, weights, hidden, out);
        return 0;
    }
    float *down_rows = thread_buffer(&product_buffer, (int64_t)sizeof(float) * most * hidden);
    if (!down_rows) return -1;
    for (int64_t c = 0; c < chosen_count; c++) {
        const int64_t e = chosen[c], first = e ? starts[e - 1] : 0;
        if (expert_products(&ex, e, down_rows)) return -1;
        add_products(&ex, first, starts[e], down_rows, weights, hidden, out);
    }
    return 0;
}
