"""From a step's logits to its tokens: the torch sampler and its per-batch plan, logit
adjustments (penalties, bias, bad words), token counts, grammar masks and argmax, and how the
native step samples its rows. Imports the engine's rooms below `models/` and `batch/`."""
