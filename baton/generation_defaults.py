"""The model creator's sampling defaults, vLLM's `--generation-config`: what a request that leaves
a sampling parameter unset gets.

vLLM reads them from the model's `generation_config.json` by default (`auto`): its
`temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, and `max_new_tokens` as a cap on
`max_tokens`. `vllm` ignores the file (the API's own defaults), a folder path reads that folder's
file, and `--override-generation-config` (a JSON object) sets keys over either. A GGUF carries
no such file. Torch-free: the launcher, the frontend and the offline `LLM` read them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import msgspec

from baton.checkpoint.json_files import read_json
from baton.checkpoint.model_config import CheckpointError
from baton.checkpoint.source import resolve_model
from baton.config import BatonConfig
from baton.sampling_params import InvalidSamplingParam, SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# `--generation-config`'s values besides a folder: the model's file, or none.
FROM_MODEL, API_DEFAULTS = "auto", "vllm"
# The keys vLLM takes from a generation config (HF's max_new_tokens is max_tokens).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


class SamplingDefaults(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The defaults a generation config sets; None: the API's own (SamplingParams')."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    # HF's max_new_tokens caps max_tokens, as vLLM's: a request's own here (`fill`), and the
    # scheduler's "to the context's end" for a request without one (Admission.check).
    max_tokens: int | None = msgspec.field(default=None, name="max_new_tokens")

    def fill(self, params: SamplingParams, unset: set[str]) -> None:
        """Give `params` the defaults of the fields in `unset` (those the request left out), and
        cap its `max_tokens` where it has one."""
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None and name in unset:
                setattr(params, name, value)
        if self.max_tokens is not None and params.max_tokens is not None:
            params.max_tokens = min(params.max_tokens, self.max_tokens)

    def sampling_params(self) -> SamplingParams:
        """A request's params when it sets none: the offline `LLM.generate` without params."""
        params = SamplingParams()
        self.fill(params, set(SAMPLING_KEYS))
        if self.max_tokens is not None:  # up to max_new_tokens or the context's end, not 16
            params.max_tokens = None
        return params


def load_sampling_defaults(config: BatonConfig, announce: bool = False) -> SamplingDefaults:
    """The defaults for serving `config.model` under `config.generation_config` and
    `override_generation_config`; a CheckpointError in one line for a missing or invalid file
    or value. A repetition_penalty is left out under `--speculative-config`, which supports no
    penalty. `announce`: log what requests will get (once per server: its frontend does)."""
    setting, overrides = config.generation_config, config.override_generation_config
    if setting == API_DEFAULTS:
        values: dict[str, Any] = {}
    elif setting == FROM_MODEL:
        folder = resolve_model(config.model).folder
        values = read_json(folder / GENERATION_CONFIG_FILE, required=False) if folder else {}
    else:
        values = read_json(Path(setting).expanduser() / GENERATION_CONFIG_FILE, required=True)
    values = {**values, **(overrides or {})}
    chosen = {key: values[key] for key in SAMPLING_KEYS if values.get(key) is not None}
    try:
        defaults = msgspec.convert(chosen, SamplingDefaults)
        if defaults.max_tokens is not None and defaults.max_tokens < 1:  # named as in the file
            raise InvalidSamplingParam("max_new_tokens", "max_new_tokens must be at least 1")
        defaults.sampling_params().validate()
    except (msgspec.ValidationError, InvalidSamplingParam) as error:
        raise CheckpointError(f"the generation config's sampling defaults: {error}") from None
    penalty = defaults.repetition_penalty
    if penalty not in (None, 1.0) and config.speculative_config is not None:
        defaults = msgspec.structs.replace(defaults, repetition_penalty=None)
        if announce:
            logger.warning(
                "the generation config's repetition_penalty %s is not applied: "
                "--speculative-config supports no penalty",
                penalty,
            )
    if announce and defaults != SamplingDefaults():
        logger.warning(
            "requests that leave them unset get the model's generation config defaults %s "
            "(--generation-config vllm: the API's own)",
            msgspec.to_builtins(defaults),
        )
    return defaults
