/* A row's grammar mask, its logit adjustments and its raw log-probabilities' normalizer, for the native sampler
 * (sampling.c): the rules of engine/sampling/logit_adjustments.py and of torch.log_softmax. */
#include <math.h>
#include <stdint.h>

#include "sampling.h"
#include "runtime/vector_math.h"

void baton_mask_row(float *logits, int64_t vocab_size, const int32_t *allowed_bits) {
    for (int64_t word = 0; word * 32 < vocab_size; word++) {
        const uint32_t bits = (uint32_t)allowed_bits[word];
        if (bits == UINT32_MAX) continue; /* all 32 allowed: most words of a loose grammar */
        const int64_t end = word * 32 + 32 < vocab_size ? word * 32 + 32 : vocab_size;
        for (int64_t t = word * 32; t < end; t++)
            if (!((bits >> (t - word * 32)) & 1u)) logits[t] = -INFINITY;
    }
}

/* A row's tokens were checked against the vocabulary when its request came in; the checks
 * here only keep a bad id from writing past the row. */
void baton_adjust_row(float *logits, int64_t vocab_size, const RowSampling *s, float *scratch) {
    for (int64_t i = 0; i < s->num_bias; i++) {
        const int32_t id = s->bias_ids[i];
        if (id >= 0 && id < vocab_size) logits[id] += s->bias_values[i];
    }
    const float repetition = s->repetition_penalty;
    for (int64_t i = 0; i < s->num_seen; i++) {
        const int32_t id = s->seen_ids[i];
        if (id < 0 || id >= vocab_size) continue;
        float x = logits[id];
        if (repetition != 1.0f) x = x > 0.0f ? x / repetition : x * repetition;
        const int32_t count = s->output_counts[i];
        if (count > 0) x -= s->frequency_penalty * (float)count + s->presence_penalty;
        logits[id] = x;
    }
    if (s->num_allowed > 0) { /* all but the allowed: their values wait in scratch meanwhile */
        for (int64_t i = 0; i < s->num_allowed; i++) {
            const int32_t id = s->allowed_ids[i];
            scratch[i] = id >= 0 && id < vocab_size ? logits[id] : -INFINITY;
        }
        for (int64_t t = 0; t < vocab_size; t++) logits[t] = -INFINITY;
        for (int64_t i = 0; i < s->num_allowed; i++) {
            const int32_t id = s->allowed_ids[i];
            if (id >= 0 && id < vocab_size) logits[id] = scratch[i];
        }
    }
    for (int64_t i = 0; i < s->num_banned; i++) {
        const int32_t id = s->banned_ids[i];
        if (id >= 0 && id < vocab_size) logits[id] = -INFINITY;
    }
}

float baton_log_normalizer(const float *logits, int64_t vocab_size, float top) {
    const __m256 top_v = _mm256_set1_ps(top), floor_v = _mm256_set1_ps(-87.0f);
    __m256 sum = _mm256_setzero_ps();
    double total = 0.0;
    int64_t i = 0;
    for (; i + 8 <= vocab_size; i += 8) {
        const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(logits + i), top_v);
        /* exp_nonpositive clamps at e^-87: a -inf logit must still weigh 0 */
        sum = _mm256_add_ps(sum, _mm256_and_ps(exp_nonpositive(x),
                                               _mm256_cmp_ps(x, floor_v, _CMP_GT_OQ)));
        if ((i & 1023) == 1016) { /* fold into double now and then: no float drift */
            total += hsum8(sum);
            sum = _mm256_setzero_ps();
        }
    }
    total += hsum8(sum);
    for (; i < vocab_size; i++) total += expf(logits[i] - top);
    return (float)log(total);
}
