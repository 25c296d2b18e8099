"""Serving benchmark workloads: what to send, how many tokens to ask back, and when to send.

`build_payload` turns a request into an OpenAI streaming body (`ignore_eos`, and `max_tokens`
plus `min_tokens` = the output length, so output lengths are what was asked).

Datasets (`--dataset-name`), all seeded:

- `random`: input and output lengths uniform in [len * (1 - r), len * (1 + r)] (vLLM's
  `--random-range-ratio`); prompts are random token ids sent as a list of ints, or random words
  with `--random-prompt-text` (servers such as llama.cpp's that want text; also forced for
  /v1/chat/completions).
- `fixed`: exactly `--random-input-len` in and `--random-output-len` out for every request.
- `sharegpt-synthetic`: log-normal lengths shaped like ShareGPT's (see `SHAREGPT_INPUT` and
  `SHAREGPT_OUTPUT`), no dataset download needed.
- `jsonl`: `--dataset-path`, one JSON object per line: {"prompt": str | list[int],
  "output_len": int} with an optional "prompt_len" (else the id count, or the word count).

Arrivals (`arrival_offsets`) follow vLLM: gamma-distributed gaps with mean 1 / `--request-rate`
and shape `--burstiness` (1 = a Poisson process); an infinite rate sends everything at once.
"""

from __future__ import annotations

import builtins
import json
import keyword
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Short common English words: about one token each in most tokenizers, so a prompt of n words
# is roughly n tokens long.
_WORD_TEXT = (
    "the of and to in is it you that he was for on are with as his they be at one have this "
    "from or had by word but what some we can out other were all there when up use your how "
    "said an each she which do their time if will way about many then them write would like so "
    "these her long make thing see him two has look more day could go come did number sound no "
    "most people my over know water than call first who may down side been now find any new "
    "work part take get place made live where after back little only round man year came show"
)
_WORDS = tuple(_WORD_TEXT.split())


CHAT_ENDPOINT = "/v1/chat/completions"


@dataclass(frozen=True)
class LogNormalLengths:
    """A clipped log-normal length distribution: round(exp(N(ln median, sigma))) in [lo, hi]."""

    median: float
    sigma: float
    lo: int
    hi: int

    def sample(self, rng: random.Random) -> int:
        """One length drawn from the distribution."""
        value = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return min(max(value, self.lo), self.hi)


# Medians chosen so the clipped means land near ShareGPT's (~230 tokens in, ~200 out with a
# Llama tokenizer); the clip at 1024 mirrors vLLM's ShareGPT filter on prompt length.
SHAREGPT_INPUT = LogNormalLengths(median=150.0, sigma=1.0, lo=4, hi=1024)
SHAREGPT_OUTPUT = LogNormalLengths(median=137.0, sigma=0.9, lo=4, hi=1024)


@dataclass(frozen=True)
class BenchRequest:
    """One request: the prompt, its (planned) token count, and the exact output length."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int


def make_prompt(length: int, rng: random.Random, vocab_size: int, as_text: bool) -> str | list[int]:
    """A random prompt of `length` token ids, or of `length` words when `as_text`."""
    if as_text:
        return " ".join(rng.choice(_WORDS) for _ in range(length))
    return [rng.randrange(vocab_size) for _ in range(length)]


def uniform_length(length: int, range_ratio: float, rng: random.Random) -> int:
    """A length uniform in [length * (1 - r), length * (1 + r)], at least 1."""
    low = max(1, math.floor(length * (1 - range_ratio)))
    high = max(low, math.ceil(length * (1 + range_ratio)))
    return rng.randint(low, high)


def random_requests(
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    vocab_size: int,
    as_text: bool,
) -> list[BenchRequest]:
    """`random` dataset: uniform lengths around the given ones (range_ratio=0 gives `fixed`)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    requests = []
    for _ in range(num):
        prompt_len = uniform_length(input_len, range_ratio, rng)
        out_len = uniform_length(output_len, range_ratio, rng)
        prompt = make_prompt(prompt_len, rng, vocab_size, as_text)
        requests.append(BenchRequest(prompt, prompt_len, out_len))
    return requests


def sharegpt_synthetic_requests(
    num: int, seed: int, vocab_size: int, as_text: bool
) -> list[BenchRequest]:
    """`sharegpt-synthetic` dataset: lengths from `SHAREGPT_INPUT` / `SHAREGPT_OUTPUT`."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num):
        prompt_len = SHAREGPT_INPUT.sample(rng)
        out_len = SHAREGPT_OUTPUT.sample(rng)
        prompt = make_prompt(prompt_len, rng, vocab_size, as_text)
        requests.append(BenchRequest(prompt, prompt_len, out_len))
    return requests


def jsonl_requests(path: Path, num: int, seed: int) -> list[BenchRequest]:
    """`jsonl` dataset: `num` requests sampled (seeded, in file order) from the file's lines.

    Asking for more requests than the file holds cycles through it, as vLLM's datasets do.
    """
    entries = []
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        record = json.loads(line)
        prompt, output_len = record.get("prompt"), record.get("output_len")
        if not isinstance(prompt, (str, list)) or not isinstance(output_len, int):
            raise ValueError(f"{path}:{line_no}: need 'prompt' (str or list) and 'output_len'")
        default_len = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        entries.append(BenchRequest(prompt, int(record.get("prompt_len", default_len)), output_len))
    if not entries:
        raise ValueError(f"{path} holds no requests")
    if num <= len(entries):
        chosen = sorted(random.Random(seed).sample(range(len(entries)), num))
        return [entries[index] for index in chosen]
    return [entries[index % len(entries)] for index in range(num)]


def arrival_offsets(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s after the start) of `num` requests: gamma gaps of mean 1/rate."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(num):
        offsets.append(now)
        now += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return offsets


@dataclass(frozen=True)
class RequestOptions:
    """Request-body settings shared by every request of a run."""

    endpoint: str = "/v1/completions"
    temperature: float = 0.0
    ignore_eos: bool = True
    send_min_tokens: bool = True
    extra_body: dict[str, Any] | None = None  # merged in last, so it overrides


def build_payload(request: BenchRequest, model: str, options: RequestOptions) -> dict[str, Any]:
    """The JSON body of one streaming request: exactly `request.output_len` tokens asked for."""
    payload: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": request.output_len,
        "temperature": options.temperature,
        "ignore_eos": options.ignore_eos,
    }
    if options.send_min_tokens:
        payload["min_tokens"] = request.output_len
    if options.endpoint == CHAT_ENDPOINT:
        if not isinstance(request.prompt, str):
            raise ValueError(f"{CHAT_ENDPOINT} needs text prompts, not token ids")
        payload["messages"] = [{"role": "user", "content": request.prompt}]
        payload["max_completion_tokens"] = request.output_len
    else:
        payload["prompt"] = request.prompt
    payload.update(options.extra_body or {})
    return payload


def build_workload(
    dataset_name: str,
    num: int,
    seed: int,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 0.0,
    vocab_size: int = 256,
    as_text: bool = False,
    dataset_path: Path | None = None,
) -> list[BenchRequest]:
    """The requests of one named dataset (see the module docstring)."""
    if dataset_name == "random":
        return random_requests(num, input_len, output_len, range_ratio, seed, vocab_size, as_text)
    if dataset_name == "fixed":
        return random_requests(num, input_len, output_len, 0.0, seed, vocab_size, as_text)
    if dataset_name == "sharegpt-synthetic":
        return sharegpt_synthetic_requests(num, seed, vocab_size, as_text)
    if dataset_name == "jsonl":
        if dataset_path is None:
            raise ValueError("--dataset-name jsonl needs --dataset-path")
        return jsonl_requests(dataset_path, num, seed)
    raise ValueError(f"unknown dataset {dataset_name!r}")


DATASET_NAMES = ("random", "fixed", "sharegpt-synthetic", "jsonl")


# Names a rename would make the answer too easy, or wrong, to change.
_NOT_RENAMED = frozenset({"self", "cls", "None", "True", "False", "annotations", "__future__"})
_IDENTIFIER = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")


def _python_windows(source_dir: Path, lines: int) -> list[tuple[Path, list[str]]]:
    """Every .py file under `source_dir` (sorted) with at least `lines` lines, and its lines."""
    files = []
    for path in sorted(source_dir.rglob("*.py")):
        text = path.read_text(encoding="utf-8").splitlines()
        if len(text) >= lines:
            files.append((path, text))
    return files


def _name_to_rename(code: str, rng: random.Random) -> str:
    """An identifier used at least twice in `code` (a common one, seeded), not a keyword."""
    counts: dict[str, int] = {}
    for name in _IDENTIFIER.findall(code):
        ordinary = not keyword.iskeyword(name) and not hasattr(builtins, name)
        if len(name) >= 3 and name not in _NOT_RENAMED and ordinary:
            counts[name] = counts.get(name, 0) + 1
    if not counts:
        return "value"  # a window without names of its own: the instruction still reads sensibly
    ranked = sorted(counts, key=lambda name: (-counts[name], name))
    return rng.choice(ranked[:3])


def code_edit_requests(
    num: int,
    seed: int,
    output_len: int,
    window_lines: int = 40,
    source_dir: Path | None = None,
) -> list[BenchRequest]:
    """A repetitive workload for speculative decoding: each prompt gives a `window_lines`-line
    window of real Python (seeded choice among Baton's own sources, or `source_dir`'s) and asks for
    the whole code back with one identifier renamed, so a correct answer quotes most of the
    prompt. Text prompts, meant for /v1/chat/completions; `prompt_len` is a rough estimate (4
    characters a token) that the server's usage replaces."""
    source_dir = source_dir or Path(__file__).resolve().parents[1]
    files = _python_windows(source_dir, window_lines)
    if not files:
        raise ValueError(f"no .py file of at least {window_lines} lines under {source_dir}")
    rng = random.Random(seed)
    requests = []
    for _ in range(num):
        _, lines = rng.choice(files)
        start = rng.randrange(len(lines) - window_lines + 1)
        code = "\n".join(lines[start : start + window_lines]).strip("\n")
        old = _name_to_rename(code, rng)
        prompt = (
            f"Rewrite this Python code, renaming `{old}` to `{old}_new`. Change nothing else, "
            "and output the whole rewritten code in one ```python block.\n\n"
            f"```python\n{code}\n```"
        )
        requests.append(BenchRequest(prompt, max(1, len(prompt) // 4), output_len))
    return requests
