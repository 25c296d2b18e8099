"""The offline API, vLLM-shaped: `LLM(model).generate(prompts, SamplingParams(...))`, and
`LLM(model).chat(conversation)` rendered with the model's chat template."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from baton.chat_options import ChatOptions
from baton.config import BatonConfig
from baton.detokenizer_proc.incremental import IncrementalDetokenizer
from baton.generation_defaults import load_sampling_defaults
from baton.messages import ChatMessage
from baton.process_messages import StepOutput, TokenLogprob
from baton.sampling_params import SamplingParams
from baton.scheduler_proc.scheduler import Scheduler
from baton.scheduler_stats import RequestStats
from baton.tokenizer_proc.chat import request_chat_prompt
from baton.tokenizer_proc.reasoning import ReasoningTokens
from baton.validation import (
    RequestError,
    truncated_prompt,
    validate_chat_options,
    validate_params,
    validate_priority,
    validate_prompt,
)

Prompt = str | Sequence[int]
# One chat turn: OpenAI's message object (role, content as text or text parts, an assistant's
# tool_calls, a tool's tool_call_id), or the wire's ChatMessage.
Message = dict[str, Any] | ChatMessage


@dataclass
class RequestOutput:
    """One finished generation."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprob] | None = None
    # With `prompt_logprobs`: one entry per prompt token after the first (vLLM's list starts
    # with None for the first, which nothing precedes).
    prompt_logprobs: list[TokenLogprob] | None = None
    stats: RequestStats | None = None


class LLM:
    """Runs the scheduler core in-process (overlap loop included) over a batch of prompts.

    `LLM("path/or/hub-id", dtype="float32", page_size=16, ...)`: keyword arguments are
    `BatonConfig` fields; `LLM()` uses the default model (see `BatonConfig.model`).
    """

    def __init__(self, model: str | None = None, **config: object) -> None:
        self.config = BatonConfig(model=model, **config)
        if self.config.engine_processes > 1:
            # Its scheduler runs in this process; several ranks or replicas are processes of
            # their own, which the launcher starts and supervises.
            raise ValueError(
                "LLM runs one engine in this process: --tensor-parallel-size, "
                "--pipeline-parallel-size and --data-parallel-size need `baton launch`"
            )
        self.sampling_defaults = load_sampling_defaults(self.config, announce=True)
        self.scheduler = Scheduler(self.config)
        self.engine = self.scheduler.engine
        self.tokenizer = self.engine.checkpoint.tokenizer
        # reasoning_parser: a chat reply that opens in reasoning is constrained after it, as
        # vLLM's LLM does (its text stays whole, reasoning included).
        parser = self.config.reasoning_parser
        self.reasoning = ReasoningTokens.of(self.tokenizer, parser) if parser else None
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no params (vLLM's method): the model's
        generation config defaults (`generation_config`, `override_generation_config`)."""
        return self.sampling_defaults.sampling_params()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order. `priority`
        (one per prompt, lower first) needs `scheduling_policy="priority"` unless all are 0, as
        vLLM's (a RequestError otherwise). A RequestError refuses the whole batch before any of
        it runs."""
        return self._generate(prompts, sampling_params, priority)

    def _generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: Sequence[int] | None,
        reasoning_ends: Sequence[int | None] | None = None,
    ) -> list[RequestOutput]:
        """`generate`, where each reply may open in reasoning that `reasoning_ends` (one per
        prompt) says the end of."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        priority = priority or [0] * len(prompts)
        if len(priority) != len(prompts):
            raise ValueError("give one priority per prompt")
        # Every prompt is validated before any is queued: a refused one leaves none behind.
        prompt_ids = [
            self._validated_prompt_ids(prompt, params, request_priority)
            for prompt, params, request_priority in zip(prompts, sampling_params, priority)
        ]
        reasoning_ends = reasoning_ends or [None] * len(prompts)
        unqueued = deque(zip(prompt_ids, sampling_params, priority, reasoning_ends))
        outputs: dict[str, RequestOutput] = {}
        detokenizers: dict[str, IncrementalDetokenizer] = {}
        pending: set[str] = set()
        try:
            while unqueued or pending:
                # Any number of prompts, as vLLM's LLM takes: the scheduler holds at most
                # `max_waiting_requests` waiting (`max_queued_requests_per_client`, if fewer: the
                # LLM is one client), and the rest join as it admits them (so past that many, a
                # later prompt's priority cannot overtake an earlier one).
                while unqueued and self.scheduler.queue_refusal() is None:
                    pending.add(self._queue(*unqueued.popleft(), outputs, detokenizers))
                for step in self.scheduler.step():
                    if step.rid in pending:
                        self._absorb(step, outputs[step.rid], detokenizers[step.rid])
                        if step.finished:
                            pending.discard(step.rid)
        except BaseException:
            # Nothing is left running for nobody (a KeyboardInterrupt included).
            for request_id in pending:
                self.scheduler.abort_request(request_id)
            raise
        return list(outputs.values())

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, each rendered with the
        model's chat template (or the plain fallback) as the server renders it, under vLLM's
        options of the same names; `tools` (OpenAI's function definitions) go to the template.
        A RequestError refuses the whole batch before any of it runs."""
        conversations = [messages] if messages and _is_message(messages[0]) else messages
        options = ChatOptions(
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs or {},
            tools=tools,
        )
        validate_chat_options(options)
        prompts = []
        for conversation in conversations:
            chat = request_chat_prompt(
                self.tokenizer, [_chat_message(m) for m in conversation], options
            )
            prompts.append(self.tokenizer.encode(chat.text, chat.add_special_tokens))
        reasoning_ends = None
        if self.reasoning is not None:
            reasoning_ends = [
                self.reasoning.reply_end(self.tokenizer, prompt, continue_final_message)
                for prompt in prompts
            ]
        return self._generate(prompts, sampling_params, None, reasoning_ends)

    def _queue(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int,
        reasoning_end: int | None,
        outputs: dict[str, RequestOutput],
        detokenizers: dict[str, IncrementalDetokenizer],
    ) -> str:
        """Add one validated request to the scheduler and to the batch's outputs; its id."""
        request_id = str(next(self._ids))
        detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            prompt_ids,
            stop=params.stop or (),
            min_tokens=params.min_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
        )
        # Last: once the scheduler holds the request, nothing here may fail before it is
        # pending (and so aborted if the batch is interrupted).
        self.scheduler.add_request(
            request_id, prompt_ids, params, priority=priority, reasoning_end_token=reasoning_end
        )
        outputs[request_id] = RequestOutput(request_id, prompt_ids)
        detokenizers[request_id] = detokenizer
        return request_id

    def _validated_prompt_ids(
        self, prompt: Prompt, params: SamplingParams, priority: int
    ) -> list[int]:
        """The prompt's token ids; RequestError (or its subclasses) if it cannot be served."""
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        validate_params(params, self.engine.vocab_size)
        validate_priority(priority, self.config.scheduling_policy)
        max_model_len = self.engine.max_model_len
        prompt_ids = truncated_prompt(prompt_ids, params.truncate_prompt_tokens, max_model_len)
        validate_prompt(prompt_ids, params.max_tokens, self.engine.vocab_size, max_model_len)
        self.scheduler.admission.check(len(prompt_ids), params)
        # Compiled here too (the scheduler's copy comes from its cache): a constraint this
        # tokenizer cannot serve refuses the batch before any of it is queued.
        self.scheduler.admission.grammar(params)
        return prompt_ids

    def _absorb(
        self, step: StepOutput, output: RequestOutput, detok: IncrementalDetokenizer
    ) -> None:
        """Fold one step's tokens into the output; a stop string ends the request here."""
        if step.prompt_logprobs is not None:
            output.prompt_logprobs = step.prompt_logprobs
        if output.finish_reason is None and step.new_token_ids:
            delta = detok.push(step.new_token_ids, step.ends_on_stop_token)
            output.token_ids.extend(step.new_token_ids[: delta.num_tokens])
            if step.logprobs is not None:
                output.logprobs = (output.logprobs or []) + step.logprobs[: delta.num_tokens]
            output.text += delta.text
            if delta.stop_string is not None:
                output.finish_reason = "stop"
                self.scheduler.abort_request(step.rid, reason="stop")
        if step.finished:
            if output.finish_reason is None:
                output.text += detok.flush()
                output.finish_reason = step.finish_reason
            output.stats = step.stats


def _is_message(item: object) -> bool:
    return isinstance(item, (dict, ChatMessage))


def _chat_message(message: Message) -> ChatMessage:
    """A turn as the chat renderer takes it; RequestError for one that is not a turn."""
    if isinstance(message, ChatMessage):
        return message
    try:
        content = message.get("content") or ""
        if isinstance(content, list):  # text parts, joined as the HTTP API joins them
            content = "\n".join(part["text"] for part in content)
        return ChatMessage(
            role=message["role"],
            content=content,
            tool_calls=message.get("tool_calls"),
            tool_call_id=message.get("tool_call_id"),
            reasoning=message.get("reasoning") or message.get("reasoning_content"),
        )
    except (KeyError, TypeError, AttributeError) as error:
        raise RequestError(f"not a chat message: {message!r}") from error
