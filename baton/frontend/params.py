"""Validated API requests -> the pipeline's requests: one `ChoiceRequest` per returned choice."""

from __future__ import annotations

from dataclasses import dataclass

from baton.chat_options import ChatOptions, InvalidChatOption
from baton.frontend.chat_protocol import ChatCompletionRequest, ChatTemplateRequest
from baton.frontend.echo import EchoMode
from baton.frontend.errors import OpenAIError
from baton.frontend.protocol import CompletionRequest, SamplingRequest
from baton.frontend.response_format import structured_outputs
from baton.frontend.tools import NO_TOOLS, ToolPlan
from baton.generation_defaults import SamplingDefaults
from baton.messages import ChatMessage
from baton.sampling_params import InvalidSamplingParam, SamplingParams
from baton.structured_outputs import StructuredOutputsParams

Prompt = str | list[int] | list[ChatMessage]

# A server without a generation config's defaults: the API's own.
NO_DEFAULTS = SamplingDefaults()
# SamplingParams accepts seeds in [0, 2**63); choice i's seed wraps around inside that range.
SEED_RANGE = 2**63
# Request fields with SamplingParams' name and meaning, whose defaults are SamplingParams' own,
# or the generation config's (generation_defaults.py) where it sets one.
OPTIONAL_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "truncate_prompt_tokens",
)


@dataclass(frozen=True)
class ChoiceRequest:
    """One pipeline request: the choice `index` it answers and the prompt `group` it belongs to
    (usage counts each prompt once, however many choices it has); `chat` renders a chat
    prompt."""

    index: int
    group: int
    prompt: Prompt
    params: SamplingParams
    priority: int = 0
    deadline_ms: float | None = None
    return_stats: bool = False
    chat: ChatOptions | None = None
    add_special_tokens: bool = True  # a text prompt's; a chat's template decides its own
    echo: EchoMode | None = None  # completions' echo (frontend/echo.py)


def sampling_params(
    request: SamplingRequest,
    defaults: SamplingDefaults,
    max_tokens: int | None,
    logprobs: int | None,
    choice: int,
    prompt_logprobs: int | None = None,
    tool_constraint: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The params of the `choice`-th sample: with a seed, choice i uses seed + i, so the choices
    differ from each other yet are reproducible. Fields the request leaves out take the model's
    `defaults`, which also cap `max_tokens`. A forced tool call's `tool_constraint` is the
    output's constraint (the request may set no other)."""
    seed = request.seed
    if seed is not None and seed >= 0:  # a negative one is left for validate() to refuse
        seed = (seed + choice) % SEED_RANGE
    params = SamplingParams(
        seed=seed,
        max_tokens=max_tokens,
        stop=request.stop,
        stop_token_ids=request.stop_token_ids,
        allowed_token_ids=request.allowed_token_ids,
        bad_words=request.bad_words,
        ignore_eos=request.ignore_eos,
        min_tokens=request.min_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured_outputs=tool_constraint
        or structured_outputs(request.response_format, request.structured_outputs),
    )
    unset = set()
    for name in OPTIONAL_SAMPLING_FIELDS:  # left out or null: the default
        value = getattr(request, name)
        if value is None:
            unset.add(name)
        else:
            setattr(params, name, value)
    defaults.fill(params, unset)
    try:
        params.validate()  # the vocabulary is the tokenizer process's to check
    except InvalidSamplingParam as error:
        param = error.param
        if param == "structured_outputs":  # the field the client set
            if tool_constraint is not None:
                param = "tools"
            elif request.structured_outputs is None:
                param = "response_format"
        raise OpenAIError(400, str(error), param=param) from error
    return params


def completion_prompts(request: CompletionRequest) -> list[str | list[int]]:
    """`prompt` as a list of prompts: a single string or token list is one prompt."""
    prompt = request.prompt
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


def completion_choices(
    request: CompletionRequest, max_choices: int, defaults: SamplingDefaults = NO_DEFAULTS
) -> list[ChoiceRequest]:
    """n choices per prompt; prompt p's choice i has index p * n + i, as in vLLM. More than
    `max_choices` in all is a 400 at once (the scheduler would refuse the rest as overloaded,
    "retry later", after the first ones had run)."""
    prompts = completion_prompts(request)
    if len(prompts) * request.n > max_choices:
        raise OpenAIError(
            400,
            f"{len(prompts)} prompts x n={request.n} is more choices than this server admits "
            f"at once ({max_choices}: --max-num-seqs running, and as many waiting as the queue "
            "holds for one client)",
            param="prompt",
        )
    echo: EchoMode | None = None
    max_tokens = request.max_tokens
    if request.echo:
        echo = "before_output"
        if max_tokens == 0:
            echo, max_tokens = "instead_of_output", 1
    # Streamed, only an echo's are returned (in its logprobs).
    prompt_logprobs = None if request.stream else request.prompt_logprobs
    if prompt_logprobs is None and request.echo:  # logprobs then cover the prompt too
        prompt_logprobs = request.logprobs
    return [
        ChoiceRequest(
            index=group * request.n + choice,
            group=group,
            prompt=prompt,
            params=sampling_params(
                request, defaults, max_tokens, request.logprobs, choice, prompt_logprobs
            ),
            priority=request.priority,
            deadline_ms=request.deadline_ms,
            return_stats=request.return_stats,
            add_special_tokens=request.add_special_tokens,
            echo=echo,
        )
        for group, prompt in enumerate(prompts)
        for choice in range(request.n)
    ]


def chat_messages(request: ChatTemplateRequest) -> list[ChatMessage]:
    """The conversation as the pipeline takes it."""
    return [
        ChatMessage(
            role=m.role,
            content=m.text,
            tool_calls=None if m.tool_calls is None else [c.model_dump() for c in m.tool_calls],
            tool_call_id=m.tool_call_id,
            reasoning=m.reasoning if m.reasoning is not None else m.reasoning_content,
        )
        for m in request.messages
    ]


def chat_options(request: ChatTemplateRequest) -> ChatOptions:
    """How the conversation is rendered; a 400 for options that cannot be honoured (the check
    the tokenizer process makes for every client, made here before any choice starts)."""
    options = ChatOptions(
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        chat_template_kwargs=request.chat_template_kwargs or {},
        documents=request.documents,
        reasoning_effort=request.reasoning_effort,
        tools=None if request.tools is None else [tool.model_dump() for tool in request.tools],
    )
    try:
        options.validate()
    except InvalidChatOption as error:
        raise OpenAIError(400, str(error), param=error.param) from error
    return options


def tool_plan(request: ChatCompletionRequest, tool_call_parser: str | None) -> ToolPlan:
    """How the reply relates to the request's tools (frontend/tools.py); a 400 where its
    `tool_choice` cannot be honoured here, or a forced call meets another constraint."""
    try:
        plan = ToolPlan.of(request.tools, request.tool_choice, tool_call_parser)
    except ValueError as error:
        raise OpenAIError(400, str(error), param="tool_choice") from error
    format_type = request.response_format.type if request.response_format else "text"
    if plan.mode in ("required", "named") and (
        request.structured_outputs is not None or format_type != "text"
    ):
        raise OpenAIError(
            400,
            "a forced tool call cannot take response_format or structured_outputs as well",
            param="tool_choice",
        )
    return plan


def chat_choices(
    request: ChatCompletionRequest,
    defaults: SamplingDefaults = NO_DEFAULTS,
    plan: ToolPlan = NO_TOOLS,
) -> list[ChoiceRequest]:
    """n choices of one conversation (the tokenizer process applies the chat template), under
    the request's `tool_plan`."""
    messages = chat_messages(request)
    options = chat_options(request)
    tool_constraint = plan.constraint(request.parallel_tool_calls)
    # Streamed, they have no place in the response.
    prompt_logprobs = None if request.stream else request.prompt_logprobs
    if prompt_logprobs is None and request.echo and not request.stream:
        # vLLM's rule, when top_logprobs is given (vLLM's defaults to 0: every echo is scored).
        prompt_logprobs = request.top_logprobs
    # The response carries the conversation's prompt logprobs once: the first choice scores it.
    choices = [
        ChoiceRequest(
            index=choice,
            group=0,
            prompt=messages,
            params=sampling_params(
                request,
                defaults,
                request.output_limit,
                request.logprob_count,
                choice,
                prompt_logprobs if choice == 0 else None,
                tool_constraint,
            ),
            priority=request.priority,
            deadline_ms=request.deadline_ms,
            return_stats=request.return_stats,
            chat=options,
        )
        for choice in range(request.n)
    ]
    if plan.mode == "auto":
        # A model may write its call tags as special tokens: the parser must see them (vLLM's
        # hermes parser and SGLang keep them too).
        for choice in choices:
            choice.params.skip_special_tokens = False
    return choices
