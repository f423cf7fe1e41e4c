"""How to pick each next token: vLLM's ``SamplingParams``, with its defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllm_from_scratch.errors import ParameterError

INT64_MAX = 2**63 - 1


def check_int(name: str, value: object, low: int, high: int = INT64_MAX) -> None:
    """``value`` must be an int (not a bool) in ``[low, high]``: 64-bit, like the kernels' ids."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ParameterError(name, f"must be an integer, got {value!r}")
    if not low <= value <= high:
        bounds = f">= {low} and fit in 64 bits" if high == INT64_MAX else f"be in [{low}, {high}]"
        raise ParameterError(name, f"must {bounds}, got {value}")


def check_float(name: str, value: object, low: float, high: float = math.inf, low_inclusive: bool = True) -> None:
    """``value`` must be a finite number in ``[low, high]`` (``(low, high]`` if not ``low_inclusive``)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ParameterError(name, f"must be a finite number, got {value!r}")
    if value > high or value < low or (value == low and not low_inclusive):
        bracket = "[" if low_inclusive else "("
        raise ParameterError(name, f"must be in {bracket}{low}, {high}], got {value}")


@dataclass
class SamplingParams:
    """Per-request sampling settings (vLLM's names and defaults).

    Args:
        temperature: softmax temperature; below 1e-5 means greedy (argmax). vLLM's default 1.0.
        top_p: keep the smallest set of tokens whose probability reaches ``top_p``; in (0, 1].
        top_k: keep the ``top_k`` most likely tokens; -1 (or 0) keeps all.
        max_tokens: new tokens to generate at most (>= 1); None: until ``max_model_len``.
        ignore_eos: keep generating past the end-of-sequence token (benchmarks).
        stop: strings that end generation; checked on the decoded text and cut from it.
        stop_token_ids: token ids that end generation besides EOS (kept in ``token_ids``), even
            with ``ignore_eos``.
        seed: a per-request random seed: the same seed gives the same sample whatever the batch.

    Every rule lives in :meth:`validate`, which raises :class:`ParameterError` naming the field.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = 16
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple, type(None))):
            raise ParameterError("stop", f"must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise ParameterError("stop_token_ids", f"must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        check_float("temperature", self.temperature, 0.0)
        check_float("top_p", self.top_p, 0.0, 1.0, low_inclusive=False)
        check_int("top_k", self.top_k, -1)
        if self.max_tokens is not None:
            check_int("max_tokens", self.max_tokens, 1)
        if not isinstance(self.ignore_eos, bool):
            raise ParameterError("ignore_eos", f"must be true or false, got {self.ignore_eos!r}")
        # Lists since __post_init__, unless reassigned since (the engine validates again).
        if not isinstance(self.stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ParameterError("stop", f"must be non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ParameterError("stop_token_ids", f"must be a list of token ids, got {self.stop_token_ids!r}")
        for t in self.stop_token_ids:
            check_int("stop_token_ids", t, 0)
        if self.seed is not None:
            check_int("seed", self.seed, -(2**63), 2**64 - 1)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
