/* Sampling decode rows from their logits (sampling.c): what decode_layer.c and Python call. */
#ifndef BATON_SAMPLING_H
#define BATON_SAMPLING_H

#include <stdint.h>

/* How one row is sampled (sampling_params.py's meaning): temperature 0 takes the argmax; top_k
 * <= 0, top_p >= 1 and min_p <= 0 are off; uniform is the row's draw in [0, 1). Its penalties
 * (logit_adjustments.py's rules) apply to its logits first, in place: each of its num_seen
 * distinct tokens (prompt and output) is divided by repetition_penalty where positive,
 * multiplied where not, then loses frequency_penalty per time it occurs in the output and
 * presence_penalty once if it does. num_seen 0: no penalty. */
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
} RowSampling;

/* The index of the row's largest logit (its first NaN, if it has one). */
int64_t baton_argmax_row(const float *x, int64_t n);

/* tokens[r] for each of `rows` rows of logits [rows, vocab_size], penalized in place; -1 for a
 * row whose logits are no distribution (NaN, infinite) or whose scratch memory could not be
 * had. */
void baton_sample_rows(float *logits, int64_t rows, int64_t vocab_size,
                       const RowSampling *sampling, int64_t *tokens);

#endif
