"""What a request must pass before the scheduler queues it: limits this server can never meet,
and the output limit and grammar matcher it runs with."""

from __future__ import annotations

from baton.config import BatonConfig
from baton.engine.batch.grammar import GrammarCompiler, GrammarError, GrammarMatcher
from baton.engine.engine import Engine
from baton.generation_defaults import load_sampling_defaults
from baton.sampling_params import SamplingParams
from baton.scheduler_proc.kv_cache_manager import KVCacheManager
from baton.structured_outputs import InvalidConstraint
from baton.validation import PromptTooLongError, RequestError


class Admission:
    """A request's admission checks against the engine and KV pool it would run on."""

    def __init__(self, config: BatonConfig, engine: Engine, kv: KVCacheManager) -> None:
        self.engine = engine
        self.kv = kv
        # The generation config's max_new_tokens: what a request without max_tokens runs to at
        # most (else to the context's end), as vLLM's; a request's own max_tokens is capped by
        # the frontend, which reads the same defaults.
        self.default_max_tokens = load_sampling_defaults(config).max_tokens
        self.grammars = GrammarCompiler(
            engine.checkpoint.tokenizer, engine.checkpoint.eos_token_ids, engine.vocab_size
        )

    def check(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The request's output limit; RequestError where this server could never run it:
        penalties or prompt logprobs under speculative decoding, more KV than the whole pool."""
        if params.adjusts_logits and self.engine.speculator is not None:
            # Verification scores drafts the sampler's penalties know nothing of.
            raise RequestError(
                "penalties and logit_bias are not supported with --speculative-config"
            )
        if params.prompt_logprobs is not None and self.engine.speculator is not None:
            raise RequestError("prompt_logprobs is not supported with --speculative-config")
        if params.structured_outputs is not None and self.engine.speculator is not None:
            raise RequestError("structured outputs are not supported with --speculative-config")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.engine.max_model_len - num_prompt_tokens
            if self.default_max_tokens is not None:
                max_tokens = min(max_tokens, self.default_max_tokens)
        if self.kv.pages_for(num_prompt_tokens + max_tokens) > self.kv.num_pages:
            raise PromptTooLongError(
                f"the request needs up to {num_prompt_tokens + max_tokens} tokens of KV cache, "
                f"more than the whole pool ({self.kv.num_pages * self.kv.page_size} tokens)"
            )
        return max_tokens

    def grammar(
        self, params: SamplingParams, reasoning_end_token: int | None = None
    ) -> GrammarMatcher | None:
        """The request's grammar matcher, compiled against the model's tokenizer (a few ms for
        a typical schema), where it asks for structured outputs; it constrains the output
        after `reasoning_end_token` where one is given (a reply that opens in reasoning)."""
        if params.structured_outputs is None:
            return None
        try:
            return self.grammars.matcher(params.structured_outputs, reasoning_end_token)
        except (GrammarError, InvalidConstraint) as error:
            raise RequestError(str(error)) from error
