"""How to pick each next token: vLLM's ``SamplingParams``, with its defaults."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplingParams:
    """Per-request sampling settings (vLLM's names and defaults).

    Args:
        temperature: softmax temperature; below 1e-5 means greedy (argmax). vLLM's default 1.0.
        top_p: keep the smallest set of tokens whose probability reaches ``top_p``; in (0, 1].
        top_k: keep the ``top_k`` most likely tokens; -1 (or 0) keeps all.
        max_tokens: new tokens to generate at most (>= 1).
        ignore_eos: keep generating past the end-of-sequence token (benchmarks).
        stop: strings that end generation; checked on the decoded text and cut from it.
        stop_token_ids: token ids that end generation besides EOS (kept in ``token_ids``).
        seed: a per-request random seed: the same seed gives the same sample whatever the batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or a positive int, got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
