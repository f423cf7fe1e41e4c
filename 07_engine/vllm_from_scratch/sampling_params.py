"""How to pick each next token: vLLM's ``SamplingParams``, with its defaults, and
``BeamSearchParams`` for ``LLM.beam_search``."""

from __future__ import annotations

import copy
import enum
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm_from_scratch.errors import ParameterError

log = logging.getLogger(__name__)

INT64_MAX = 2**63 - 1
# vLLM's cap on the token sequences ``bad_words`` may become (VLLM_MAX_NUM_BAD_WORDS).
MAX_NUM_BAD_WORDS = 128
# vLLM's bounds on temperature: at most 2, and a positive temperature below 0.01 is raised to
# 0.01 (logits divided by less overflow float32 into inf and NaN); 0 means greedy.
MAX_TEMPERATURE = 2.0
MIN_POSITIVE_TEMPERATURE = 1e-2


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


def _all_token_ids(ids: Iterable[object]) -> bool:
    """Whether every item is an int token id in ``[0, INT64_MAX]``: one pass at C speed for the
    long ``stop_token_ids`` and ``logit_bias`` a body may hold (:func:`check_int` names a bad one)."""
    return all(type(t) is int and 0 <= t <= INT64_MAX for t in ids)  # type(t) is int: no bools


def _token_key(key: object) -> Any:
    """A ``logit_bias`` key as an int: JSON objects only have string keys ("50256")."""
    if isinstance(key, str):
        try:
            return int(key)
        except ValueError:
            raise ParameterError("logit_bias", f"keys must be token ids, got {key!r}") from None
    return key


def _clamp_bias(value: object) -> Any:
    """vLLM clamps each bias to [-100, 100]; a non-number is left for :meth:`validate` to name."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return min(100.0, max(-100.0, float(value)))
    return value


@dataclass
class StructuredOutputsParams:
    """A constraint every completion of a request must satisfy (vLLM's ``StructuredOutputsParams``),
    exactly one of:

    Args:
        json: a JSON schema (a dict, or its text): the output is one JSON value valid under it.
        regex: the output matches this regular expression in full.
        choice: the output is one of these strings.
        grammar: the output is a sentence of this EBNF grammar (GBNF: ``root ::= ...``).
        json_object: True: the output is any JSON object.
        disable_any_whitespace: JSON without whitespace between its tokens (a small model may
            otherwise fill its budget with newlines).

    A schema is read strictly: an object takes no property the schema does not list, unless it
    says ``additionalProperties`` itself (what vLLM's ``disable_additional_properties`` asks of
    other backends).

    The engine enforces it on the logits (``structured_output.py``); a constraint that cannot be
    compiled is refused with :class:`ParameterError` naming the field.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ParameterError(
                "structured_outputs", f"must set exactly one of {list(STRUCTURED_OUTPUT_KINDS)}, got {given or 'none'}"
            )

    @property
    def kind(self) -> str:
        """Which constraint is set: one of :data:`STRUCTURED_OUTPUT_KINDS`."""
        return next(name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) is not None)


STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a request carries (vLLM's enum and default)."""

    CUMULATIVE = 0  # everything so far, every step
    DELTA = 1  # only what this step added (the server's streams)
    FINAL_ONLY = 2  # nothing until the end, then everything, all n completions together (LLM.generate)


@dataclass
class SamplingParams:
    """Per-request sampling settings (vLLM's names and defaults).

    Args:
        n: completions to sample for the prompt (>= 1), returned in ``RequestOutput.outputs``
            in index order. Each runs as its own request (``parallel_sampling.ParentRequest``).
        temperature: softmax temperature in [0, 2]; 0 means greedy (argmax), and a positive
            temperature below 0.01 is raised to 0.01 with a warning, as vLLM does. Default 1.0.
        top_p: keep the smallest set of tokens whose probability reaches ``top_p``; in (0, 1].
        top_k: keep the ``top_k`` most likely tokens; -1 (or 0) keeps all.
        max_tokens: new tokens to generate at most (>= 1); None: until ``max_model_len``.
        ignore_eos: keep generating past the end-of-sequence token (benchmarks).
        stop: strings that end generation; checked on the decoded text and cut from it.
        stop_token_ids: token ids that end generation besides EOS (kept in ``token_ids``, their
            text left out of ``text``), even with ``ignore_eos``.
        include_stop_str_in_output: keep the stop string, or the stop token's text, at the end
            of ``text`` (vLLM's; default False).
        seed: a per-request random seed: the same seed gives the same sample whatever the batch.
            With ``n`` > 1, completion ``i`` samples with ``seed + i`` (vLLM's rule).
        presence_penalty: subtracted once from the logit of every token already generated; in
            [-2, 2] (vLLM V1: over output tokens only).
        frequency_penalty: subtracted from a token's logit once per time it was generated; in
            [-2, 2] (output tokens only).
        repetition_penalty: > 0; a token seen in the prompt or the output has a positive logit
            divided by it and a negative one multiplied by it (1.0: off).
        min_p: drop tokens whose probability (after temperature) is below ``min_p`` times the
            most likely token's; in [0, 1] (0: off).
        min_tokens: EOS and ``stop_token_ids`` cannot be sampled, and stop strings are not
            checked, before this many tokens are generated; >= 0 and <= ``max_tokens``.
        logit_bias: ``{token_id: bias}`` added to the logits; biases are clamped to [-100, 100]
            and string keys (JSON) read as ints, as vLLM's ``from_optional`` does. The engine
            checks the ids against the vocabulary.
        logprobs: return the log-probability of each sampled token plus this many most likely
            tokens' (vLLM V1: of the raw model distribution, before penalties, temperature,
            top-k and top-p); None: none. >= 0.
        prompt_logprobs: the same for every prompt token after the first; None: none. >= 0.
            Such a request takes no prefix-cache hits: its prompt is recomputed to score it.
        skip_special_tokens: leave special tokens (EOS, chat-template markers) out of ``text``;
            ``token_ids`` always holds them. vLLM's default True.
        bad_words: words never to generate (vLLM's): each is tokenized alone and after a space
            (the two ways a word starts), and the last token of such a sequence is banned
            whenever the tokens generated just before it are the rest of the sequence. Needs
            a tokenizer; the engine tokenizes them once per request.
        allowed_token_ids: the only token ids that may be generated (every other logit is
            masked); non-empty, inside the vocabulary.
        truncate_prompt_tokens: keep only the prompt's last ``k`` tokens (left truncation);
            -1: the last ``max_model_len``; None: no truncation. The engine checks it against
            ``max_model_len``.
            With ``n`` > 1 only completion 0 scores the prompt (once for the request).
        output_kind: what each ``RequestOutput`` carries (:class:`RequestOutputKind`);
            ``LLM.generate`` sets ``FINAL_ONLY`` and the server ``DELTA``, as in vLLM.
        structured_outputs: a JSON schema, regex, choice or grammar every completion follows
            (:class:`StructuredOutputsParams`); None: unconstrained.

    Every rule lives in :meth:`validate`, which raises :class:`ParameterError` naming the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = 16
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # ``bad_words`` as token sequences: set by the engine's input processor, which has the tokenizer.
    _bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple, type(None))):
            raise ParameterError("stop", f"must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise ParameterError("stop_token_ids", f"must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.bad_words, (list, tuple)):
            self.bad_words = list(dict.fromkeys(self.bad_words))  # vLLM drops repeats, keeping order
        if isinstance(self.allowed_token_ids, (list, tuple)):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {_token_key(k): _clamp_bias(v) for k, v in self.logit_bias.items()}
        self.validate()
        if 0 < self.temperature < MIN_POSITIVE_TEMPERATURE:
            log.warning(
                "temperature %s is less than %s, which may cause numerical errors (nan or inf); raised to %s",
                self.temperature,
                MIN_POSITIVE_TEMPERATURE,
                MIN_POSITIVE_TEMPERATURE,
            )
            self.temperature = MIN_POSITIVE_TEMPERATURE

    def validate(self) -> None:
        check_int("n", self.n, 1)
        check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        check_float("top_p", self.top_p, 0.0, 1.0, low_inclusive=False)
        check_int("top_k", self.top_k, -1)
        if self.max_tokens is not None:
            check_int("max_tokens", self.max_tokens, 1)
        for flag in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, flag), bool):
                raise ParameterError(flag, f"must be true or false, got {getattr(self, flag)!r}")
        # Lists since __post_init__, unless reassigned since (the engine validates again).
        if not isinstance(self.stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ParameterError("stop", f"must be non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ParameterError("stop_token_ids", f"must be a list of token ids, got {self.stop_token_ids!r}")
        if not _all_token_ids(self.stop_token_ids):  # the loop names the bad one
            for t in self.stop_token_ids:
                check_int("stop_token_ids", t, 0)
        if self.seed is not None:
            check_int("seed", self.seed, -(2**63), 2**64 - 1)
            if self.seed + self.n - 1 > 2**64 - 1:
                bad = f"got {self.seed} with n={self.n}"
                raise ParameterError("seed", f"+ n - 1 must fit in 64 bits (completion i samples with seed + i), {bad}")
        check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        check_float("repetition_penalty", self.repetition_penalty, 0.0, low_inclusive=False)
        check_float("min_p", self.min_p, 0.0, 1.0)
        check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParameterError(
                "min_tokens", f"must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ParameterError("logit_bias", f"must be a dict of token id to bias, got {self.logit_bias!r}")
            biases = self.logit_bias.values()
            if not _all_token_ids(self.logit_bias) or not all(type(b) is float and -100 <= b <= 100 for b in biases):
                for token, bias in self.logit_bias.items():  # names the bad entry
                    check_int("logit_bias", token, 0)
                    check_float("logit_bias", bias, -100.0, 100.0)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 0)
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list) or any(not isinstance(w, str) or not w for w in self.bad_words)
        ):
            raise ParameterError("bad_words", f"must be a list of non-empty strings, got {self.bad_words!r}")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise ParameterError(
                    "allowed_token_ids", f"must be a non-empty list of token ids, got {self.allowed_token_ids!r}"
                )
            if not _all_token_ids(self.allowed_token_ids):
                for t in self.allowed_token_ids:
                    check_int("allowed_token_ids", t, 0)
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1:
            check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ParameterError("output_kind", f"must be a RequestOutputKind, got {self.output_kind!r}")
        if not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise ParameterError(
                "structured_outputs", f"must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}"
            )

    def clone(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes`` set (vLLM's ``clone``), for the engine's settled and derived
        settings: a request's resolved ``max_tokens``, its ``output_kind``, a completion's seed.

        Not validated again: the fields are valid already, and validating walks every
        ``logit_bias`` and ``stop_token_ids`` entry (4 s for 64 completions of a 49k-entry
        ``logit_bias``); the copies share those collections, which nothing changes.
        """
        params = copy.copy(self)
        for name, value in changes.items():
            if not hasattr(params, name):
                raise AttributeError(f"SamplingParams has no field {name!r}")
            setattr(params, name, value)
        return params

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """``bad_words`` as the token sequences the sampler bans (vLLM's property); None until
        the engine has tokenized them."""
        return self._bad_words_token_ids

    @property
    def uses_penalties(self) -> bool:
        """Whether any of the three penalties is on (they need the request's token counts)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


@dataclass
class BeamSearchParams:
    """``LLM.beam_search``'s settings (vLLM's ``BeamSearchParams``, its names and defaults).

    Args:
        beam_width: beams kept at each step, and sequences returned per prompt (>= 1).
        max_tokens: tokens to generate at most (>= 1); the search runs this many steps unless
            every beam has ended.
        ignore_eos: treat EOS as an ordinary token: no beam ends before ``max_tokens``.
        temperature: the temperature of the draw each beam's step makes (0: greedy); the drawn
            token joins that beam's candidates beside its ``2 * beam_width`` most likely ones.
            The scores are always the model's raw log-probabilities.
        length_penalty: a sequence's score is its summed log-probability divided by its length
            (prompt included, a final EOS not) to this power (vLLM's rule, :mod:`beam_search`).
        include_stop_str_in_output: accepted for vLLM's scripts; the search has no stop strings.
        skip_special_tokens: leave special tokens out of each sequence's ``text``.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        check_int("beam_width", self.beam_width, 1)
        check_int("max_tokens", self.max_tokens, 1)
        check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        check_float("length_penalty", self.length_penalty, -math.inf)
        for flag in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, flag), bool):
                raise ParameterError(flag, f"must be true or false, got {getattr(self, flag)!r}")
