/* Sampling a decode step's rows from their logits in the native step, so a sampled (non-greedy)
 * row costs no torch ops: the same rules as the torch sampler (engine/sampling/sampler.py), row by row.
 *
 * A row's weights are exp((logit - max) / temperature). With top_k, its candidates are its k
 * largest logits (all, if k exceeds them), best first; with top_p alone, the full
 * vocabulary's, best first (the best NUCLEUS_PREFIX when they hold the nucleus, as they usually
 * do, else all of them sorted); with neither, the vocabulary in order. min_p keeps a candidate
 * whose weight is at least min_p times the largest; then top_p keeps one while the kept mass
 * before it is below top_p of all the kept mass (vLLM's order). The draw is by inverse CDF with
 * the row's uniform u: the first kept candidate whose cumulative weight exceeds u times the
 * kept total.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "sampling.h"
#include "runtime/thread_pool.h"
#include "runtime/vector_math.h"

/* torch.argmax's answer for one row: the first NaN if there is one, else the first maximum.
 * One vector pass finds the maximum (and whether a NaN is there), a second finds where. */
int64_t baton_argmax_row(const float *x, int64_t n) {
    __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        top = _mm256_max_ps(top, v); /* a NaN in v leaves top as it was */
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float best = hmax8(top);
    int has_nan = _mm256_movemask_ps(nan) != 0;
    for (int64_t j = i; j < n; j++) {
        has_nan |= isnan(x[j]);
        best = x[j] > best ? x[j] : best;
    }
    if (has_nan) {
        for (int64_t j = 0; j < n; j++)
            if (isnan(x[j])) return j;
    }
    const __m256 wanted = _mm256_set1_ps(best);
    for (i = 0; i + 8 <= n; i += 8) {
        const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), wanted, _CMP_EQ_OQ));
        if (hits) return i + __builtin_ctz(hits);
    }
    for (; i < n; i++)
        if (x[i] == best) return i;
    return 0; /* unreachable: some element is the maximum */
}

/* How many of the best candidates top_p alone looks at before sorting the whole vocabulary. */
#define NUCLEUS_PREFIX 1024

typedef struct {
    float logit;
    int32_t id;
} Candidate;

/* Better first: a larger logit, then a lower id. */
static int better(const Candidate *a, const Candidate *b) {
    return a->logit > b->logit || (a->logit == b->logit && a->id < b->id);
}

static int compare_candidates(const void *a, const void *b) {
    return better(a, b) ? -1 : better(b, a) ? 1 : 0;
}

/* Sift the heap's root down; the heap keeps its worst candidate at the root. */
static void sift_down(Candidate *heap, int64_t size, int64_t at) {
    for (;;) {
        int64_t worst = at, left = 2 * at + 1, right = left + 1;
        if (left < size && better(&heap[worst], &heap[left])) worst = left;
        if (right < size && better(&heap[worst], &heap[right])) worst = right;
        if (worst == at) return;
        const Candidate swap = heap[at];
        heap[at] = heap[worst];
        heap[worst] = swap;
        at = worst;
    }
}

/* The k best of the row's logits into out[0..k), best first. */
static void best_k(const float *logits, int64_t vocab_size, int64_t k, Candidate *out) {
    for (int64_t i = 0; i < k; i++) out[i] = (Candidate){logits[i], (int32_t)i};
    for (int64_t i = k / 2 - 1; i >= 0; i--) sift_down(out, k, i);
    for (int64_t i = k; i < vocab_size; i++) {
        const Candidate next = {logits[i], (int32_t)i};
        if (better(&next, &out[0])) {
            out[0] = next;
            sift_down(out, k, 0);
        }
    }
    qsort(out, (size_t)k, sizeof(Candidate), compare_candidates);
}

/* Draw among weights w[0..n) (already filtered: zero for dropped ones) by inverse CDF with
 * uniform u; the index, or -1 when they are no distribution (NaN, all zero). Blocks of eight
 * are skipped whole while the running sum stays at or below the target. */
static int64_t draw(const float *w, int64_t n, float u) {
    double total = 0.0; /* summed as the scan below sums, so the target is always reached */
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) total += hsum8(_mm256_loadu_ps(w + i));
    for (; i < n; i++) total += w[i];
    if (!(total > 0.0)) return -1;
    double target = u * total;
    if (!(target < total)) target = 0.0; /* rounding reached the total: the first kept one */
    double cumulative = 0.0;
    for (i = 0; i + 8 <= n; i += 8) {
        const double block = hsum8(_mm256_loadu_ps(w + i));
        if (cumulative + block > target) break;
        cumulative += block;
    }
    for (; i < n; i++) {
        cumulative += w[i];
        if (cumulative > target && w[i] > 0.0f) return i;
    }
    for (int64_t j = n - 1; j >= 0; j--)
        if (w[j] > 0.0f) return j;
    return -1;
}

/* weights[i] = exp((logits[i] - top) * inverse_t), zero where below min_p (the largest weight
 * is exp(0) = 1); returns their sum. Eight at a time: this pass is most of a sampled row. */
static double exponentiate(const float *logits, int64_t n, float top, float inverse_t,
                           float min_p, float *weights) {
    const __m256 top_v = _mm256_set1_ps(top), scale = _mm256_set1_ps(inverse_t);
    const __m256 floor_v = _mm256_set1_ps(min_p);
    __m256 sum = _mm256_setzero_ps();
    double total = 0.0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(logits + i), top_v), scale);
        __m256 w = exp_nonpositive(x); /* clamped at e^-87: a -inf logit must still weigh 0 */
        w = _mm256_and_ps(w, _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GT_OQ));
        w = _mm256_and_ps(w, _mm256_cmp_ps(w, floor_v, _CMP_GE_OQ));
        _mm256_storeu_ps(weights + i, w);
        sum = _mm256_add_ps(sum, w);
        if ((i & 1023) == 1016) { /* fold into double now and then: no float drift */
            total += hsum8(sum);
            sum = _mm256_setzero_ps();
        }
    }
    total += hsum8(sum);
    for (; i < n; i++) {
        const float w = expf((logits[i] - top) * inverse_t);
        weights[i] = w >= min_p ? w : 0.0f;
        total += weights[i];
    }
    return total;
}

/* One row's token, or -1 (no distribution, or out of memory). `weights` and `candidates` hold
 * vocab_size entries each. */
static int64_t sample_row(const float *logits, int64_t vocab_size, const RowSampling *s,
                          float *weights, Candidate *candidates) {
    const float top = logits[baton_argmax_row(logits, vocab_size)]; /* NaN if any is */
    if (isnan(top) || isinf(top)) return -1;
    const float inverse_t = 1.0f / s->temperature;
    int64_t n = 0; /* candidates, best first; none: the vocabulary in order */
    double kept = 0.0; /* the mass min-p keeps of them: top_p is a share of it */
    if (s->top_k > 0) { /* best first, as the torch sampler's top-k, even past the vocabulary */
        n = s->top_k < vocab_size ? s->top_k : vocab_size;
        best_k(logits, vocab_size, n, candidates);
        for (int64_t i = 0; i < n; i++) {
            const float w = expf((candidates[i].logit - top) * inverse_t);
            kept += w >= s->min_p ? w : 0.0f;
        }
    } else if (s->top_p < 1.0f) {
        kept = exponentiate(logits, vocab_size, top, inverse_t, s->min_p, weights);
        n = vocab_size < NUCLEUS_PREFIX ? vocab_size : NUCLEUS_PREFIX;
        best_k(logits, vocab_size, n, candidates);
        double prefix_mass = 0.0;
        for (int64_t i = 0; i < n; i++) {
            const float w = expf((candidates[i].logit - top) * inverse_t);
            prefix_mass += w >= s->min_p ? w : 0.0f;
        }
        if (prefix_mass < s->top_p * kept && n < vocab_size) {
            n = vocab_size;
            best_k(logits, vocab_size, n, candidates);
        }
    }
    if (n == 0) {
        exponentiate(logits, vocab_size, top, inverse_t, s->min_p, weights);
        return draw(weights, vocab_size, s->uniform);
    }
    double before = 0.0; /* the kept mass of the better candidates */
    for (int64_t i = 0; i < n; i++) {
        const float w = expf((candidates[i].logit - top) * inverse_t);
        const int above_min_p = w >= s->min_p;
        const int in_nucleus = s->top_p >= 1.0f || before < s->top_p * kept;
        weights[i] = above_min_p && in_nucleus ? w : 0.0f;
        before += above_min_p ? w : 0.0f;
    }
    const int64_t index = draw(weights, n, s->uniform);
    return index < 0 ? -1 : candidates[index].id;
}

typedef struct {
    float *logits;
    int64_t vocab_size;
    const RowSampling *rows;
    int64_t *tokens;
} SampleLoop;

/* Each thread's scratch for its rows: vocab_size weights and candidates, and a copy of a row
 * adjusted while its raw logits are still needed (for its logprobs), grown on demand and kept
 * for the next step (the pool's threads live as long as the process). */
static _Thread_local float *scratch_weights;
static _Thread_local Candidate *scratch_candidates;
static _Thread_local float *scratch_row;
static _Thread_local int64_t scratch_size;

static int reserve_scratch(int64_t vocab_size) {
    if (scratch_size >= vocab_size) return 1;
    float *weights = realloc(scratch_weights, sizeof(float) * (size_t)vocab_size);
    if (weights) scratch_weights = weights;
    Candidate *candidates = realloc(scratch_candidates, sizeof(Candidate) * (size_t)vocab_size);
    if (candidates) scratch_candidates = candidates;
    float *row = realloc(scratch_row, sizeof(float) * (size_t)vocab_size);
    if (row) scratch_row = row;
    if (!weights || !candidates || !row) return 0;
    scratch_size = vocab_size;
    return 1;
}

/* The row's num_top likeliest tokens and their raw log-probabilities (sampling.h), from its
 * largest logit `top` and log normalizer; NaN and -1 where the logits are no distribution. */
static void write_top_logprobs(const float *raw, int64_t vocab_size, const RowSampling *s,
                               float top, float normalizer) {
    const int64_t k = s->num_top < vocab_size ? s->num_top : vocab_size;
    if (k > 0 && isfinite(top) && isfinite(normalizer)) best_k(raw, vocab_size, k, scratch_candidates);
    for (int64_t j = 0; j < s->num_top; j++) {
        const int valid = j < k && isfinite(top) && isfinite(normalizer);
        s->top_ids[j] = valid ? scratch_candidates[j].id : -1;
        s->logprobs[1 + j] = valid ? (scratch_candidates[j].logit - top) - normalizer : NAN;
    }
}

static void sample_task(const void *arg, int64_t row) {
    const SampleLoop *a = arg;
    const RowSampling *s = &a->rows[row];
    const int64_t vocab_size = a->vocab_size;
    float *raw = a->logits + row * vocab_size, *logits = raw;
    const int needs_scratch = s->temperature > 0.0f || s->logprobs || s->num_allowed;
    if (needs_scratch && !reserve_scratch(vocab_size)) {
        a->tokens[row] = -1;
        return;
    }
    if (s->allowed_bits) baton_mask_row(raw, vocab_size, s->allowed_bits);
    float top = NAN, normalizer = NAN;
    if (s->logprobs) {
        top = raw[baton_argmax_row(raw, vocab_size)];
        if (isfinite(top)) normalizer = baton_log_normalizer(raw, vocab_size, top);
        write_top_logprobs(raw, vocab_size, s, top, normalizer);
        if (s->num_bias || s->num_seen || s->num_allowed || s->num_banned) {
            /* adjust a copy: raw is still read */
            memcpy(scratch_row, raw, sizeof(float) * (size_t)vocab_size);
            logits = scratch_row;
        }
    }
    baton_adjust_row(logits, vocab_size, s, scratch_weights);
    const int64_t token = s->temperature <= 0.0f
                              ? baton_argmax_row(logits, vocab_size)
                              : sample_row(logits, vocab_size, s, scratch_weights,
                                           scratch_candidates);
    a->tokens[row] = token;
    if (s->logprobs) s->logprobs[0] = token >= 0 ? (raw[token] - top) - normalizer : NAN;
}

void baton_sample_rows(float *logits, int64_t rows, int64_t vocab_size,
                       const RowSampling *sampling, int64_t *tokens) {
    const SampleLoop loop = {logits, vocab_size, sampling, tokens};
    baton_parallel(sample_task, &loop, rows);
}
