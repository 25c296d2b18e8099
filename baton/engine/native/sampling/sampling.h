/* Sampling decode rows from their logits (sampling.c): what decode_layer.c and Python call. */
#ifndef BATON_SAMPLING_H
#define BATON_SAMPLING_H

#include <stdint.h>

/* How one row's token is chosen (sampling_params.py's meaning): temperature 0 takes the argmax;
 * top_k <= 0, top_p >= 1 and min_p <= 0 are off; uniform is the row's draw in [0, 1).
 *
 * Where allowed_bits is not NULL (a grammar's mask: bit t of word t / 32 set where token t may
 * come), every other token's logit becomes -inf first, as the torch path masks the logits
 * before its sampler. Its logits are then adjusted, in place, in vLLM's order (logit_adjustments.c): the bias is
 * added to its num_bias tokens; each of its num_seen distinct tokens (prompt and output) is
 * divided by repetition_penalty where positive, multiplied where not, then loses
 * frequency_penalty per time it occurs in the output and presence_penalty once if it does;
 * every token but its num_allowed ones, then its num_banned ones, become -inf. A zero count
 * turns each off.
 *
 * Where logprobs is not NULL, the row's raw log-probabilities (of its logits as they came,
 * before any adjustment: vLLM's default) are written there: the chosen token's, then its
 * num_top likeliest tokens', best first, whose ids go to top_ids. */
typedef struct {
    float temperature;
    float top_p;
    float min_p;
    float uniform;
    int64_t top_k;
    float repetition_penalty;
    float frequency_penalty;
    float presence_penalty;
    int64_t num_seen;
    const int32_t *seen_ids;
    const int32_t *output_counts; /* per seen token: how often it occurs in the output */
    int64_t num_bias;
    const int32_t *bias_ids;
    const float *bias_values;
    int64_t num_allowed;
    const int32_t *allowed_ids;
    int64_t num_banned;
    const int32_t *banned_ids;
    float *logprobs; /* 1 + num_top floats, or NULL */
    int32_t *top_ids; /* num_top ids */
    int64_t num_top;
    const int32_t *allowed_bits; /* ceil(vocab_size / 32) words, or NULL */
} RowSampling;

/* -inf for each token the row's allowed_bits leave out, in place. */
void baton_mask_row(float *logits, int64_t vocab_size, const int32_t *allowed_bits);

/* The row's adjustments (bias, penalties, allowed and banned tokens), in place; `scratch` holds
 * num_allowed floats. */
void baton_adjust_row(float *logits, int64_t vocab_size, const RowSampling *s, float *scratch);

/* log(sum(exp(logits - top))) for the row's largest logit `top` (finite): a raw
 * log-probability is (logit - top) minus this, as torch.log_softmax computes it. */
float baton_log_normalizer(const float *logits, int64_t vocab_size, float top);

/* The index of the row's largest logit (its first NaN, if it has one). */
int64_t baton_argmax_row(const float *x, int64_t n);

/* tokens[r] for each of `rows` rows of logits [rows, vocab_size], penalized in place; -1 for a
 * row whose logits are no distribution (NaN, infinite) or whose scratch memory could not be
 * had. */
void baton_sample_rows(float *logits, int64_t rows, int64_t vocab_size,
                       const RowSampling *sampling, int64_t *tokens);

#endif
