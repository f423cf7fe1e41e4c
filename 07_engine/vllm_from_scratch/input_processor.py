"""A request in: the prompt parsed, encoded and checked, the settings checked and settled, once.

:class:`InputProcessor` (vLLM V1's ``vllm/v1/engine/input_processor.py``) turns what a caller
gives — a prompt in any of vLLM's shapes and a :class:`SamplingParams` — into an
:class:`EngineCoreRequest`, the one record the engine takes: token ids inside the vocabulary and
shorter than ``max_model_len``, ``max_tokens`` resolved, every setting the engine cannot honour
refused with a :class:`ParameterError` naming the argument. ``LLM.generate`` runs it for every
prompt before any is queued; the OpenAI server runs it in its worker threads, with a tokenizer of
their own, so a request body is encoded once and never on the engine's thread. What only the
engine can check — a request id already in use, a request bigger than the whole KV cache — it
checks when the request arrives (``LLMEngine.add_request``).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

from vllm_from_scratch.errors import ParameterError
from vllm_from_scratch.sampling_params import MAX_NUM_BAD_WORDS, SamplingParams, check_int

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from vllm_from_scratch.config import EngineConfig

# vLLM's single prompts: text, token ids, or the dicts TextPrompt / TokensPrompt.
PromptType: TypeAlias = str | list[int] | Mapping[str, Any]
# A parsed prompt: the text an output shows (None for token ids, as in vLLM), and what is encoded.
ParsedPrompt: TypeAlias = tuple[str | None, str | list[int]]

# The keys of vLLM's TextPrompt / TokensPrompt this engine acts on. The others (multimodal data,
# cache_salt, ...) are refused by name rather than ignored.
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids"})


@dataclass
class EngineCoreRequest:
    """A request as the engine takes it (vLLM V1's ``EngineCoreRequest``): checked and settled.

    ``prompt`` is the text outputs show (None when the prompt was token ids);
    ``prompt_token_ids`` are what the model reads (after ``truncate_prompt_tokens``);
    ``sampling_params`` are the caller's with ``max_tokens`` resolved (never None here: at most
    what the context leaves). ``arrival_time`` is ``time.time()`` when the request was made.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.time)

    @property
    def max_tokens(self) -> int:
        assert self.sampling_params.max_tokens is not None, "the input processor resolves max_tokens"
        return self.sampling_params.max_tokens


def _all_ints(values: Sequence[object]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in values)


def _is_token_ids(value: object) -> bool:
    """One prompt of token ids (vLLM's rule), rather than a batch of prompts."""
    return isinstance(value, list) and bool(value) and _all_ints(value)


def describe(value: object) -> str:
    """``repr(value)``, cut to 60 characters for an error message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_prompts(prompts: object) -> list[ParsedPrompt]:
    """vLLM's prompt shapes as one list of :data:`ParsedPrompt`.

    One prompt: a string, a list of token ids, ``{"prompt": str}`` or ``{"prompt_token_ids":
    [...]}``. Several: a list (or tuple) of those. ``ParameterError`` naming ``prompts`` for any
    other shape: a bare ``{"prompt": ...}`` dict must not be iterated into its key.
    """
    if isinstance(prompts, (str, Mapping)) or _is_token_ids(prompts):
        return [parse_prompt(prompts, "prompts")]
    if not isinstance(prompts, (list, tuple)):
        raise ParameterError(
            "prompts",
            "must be a string, a list of token ids, a {'prompt': ...} or {'prompt_token_ids': ...} dict, "
            f"or a list of those; got {type(prompts).__name__}",
        )
    if not prompts:
        raise ParameterError("prompts", "must hold at least one prompt")
    return [parse_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]


def parse_prompt(prompt: object, where: str) -> ParsedPrompt:
    """One prompt of vLLM's shapes; ``where`` names it in a :class:`ParameterError` on ``prompts``."""
    param = "prompts"
    if isinstance(prompt, str):
        return prompt, prompt
    if isinstance(prompt, (list, tuple)):
        # Emptiness and the vocabulary are encode_prompt's checks; the shape is this function's.
        if not _all_ints(prompt):
            raise ParameterError(param, f"{where} must be a list of token ids, got {describe(prompt)}")
        return None, list(prompt)  # vLLM reports no prompt text for token ids
    if isinstance(prompt, Mapping):
        unknown = sorted(str(k) for k in prompt if k not in PROMPT_KEYS)
        if unknown:
            raise ParameterError(param, f"{where} has keys this engine does not support: {unknown}")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ParameterError(param, f"{where}['prompt'] must be a string, got {type(text).__name__}")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not _all_ints(ids):
                raise ParameterError(param, f"{where}['prompt_token_ids'] must be a list of token ids")
            return text, list(ids)  # a TokensPrompt may carry its text for the output
        if text is None:
            raise ParameterError(param, f"{where} must have a 'prompt' or a 'prompt_token_ids' key")
        return text, text
    raise ParameterError(
        param, f"{where} must be a string, a list of token ids or a prompt dict, got {type(prompt).__name__}"
    )


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase | None,
    prompt: str | list[int],
    vocab_size: int,
    max_model_len: int,
    truncate_prompt_tokens: int | None = None,
) -> list[int]:
    """Token ids of ``prompt`` (text through ``tokenizer``, or ids as given), checked: not empty,
    inside the vocabulary, shorter than ``max_model_len``. :class:`ParameterError` on ``prompt``.

    ``truncate_prompt_tokens`` (``SamplingParams``'): keep the last ``k`` ids, ``-1`` the last
    ``max_model_len``, as vLLM does; more than ``max_model_len`` is an error naming it.
    """
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ParameterError("prompt", "must be a list of token ids: this checkpoint has no tokenizer")
        token_ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)):
        token_ids = list(prompt)
    else:
        raise ParameterError("prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}")
    if truncate_prompt_tokens is not None:
        if truncate_prompt_tokens > max_model_len:
            raise ParameterError(
                "truncate_prompt_tokens",
                f"must be at most max_model_len ({max_model_len}), got {truncate_prompt_tokens}",
            )
        keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        token_ids = token_ids[-keep:]
    if not token_ids:
        raise ParameterError("prompt", "must not be empty")
    bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise ParameterError("prompt", f"holds token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if len(token_ids) >= max_model_len:
        raise ParameterError(
            "prompt",
            f"has {len(token_ids)} tokens, but this model's maximum context length (max_model_len) is {max_model_len}",
            code="context_length_exceeded",
        )
    return token_ids


def resolve_max_tokens(max_tokens: int | None, num_prompt_tokens: int, max_model_len: int, fit_max_tokens: bool) -> int:
    """How many tokens a request may generate: ``max_tokens``, or the context left when None.

    A ``max_tokens`` that does not fit the context is cut to it when ``fit_max_tokens`` (the
    request then ends with finish reason "length", as vLLM's offline ``LLM`` does) and refused
    otherwise (the OpenAI API's rule, which the server follows).
    """
    room = max_model_len - num_prompt_tokens
    if max_tokens is None:
        return room
    if max_tokens > room and not fit_max_tokens:
        raise ParameterError(
            "max_tokens",
            f"is too large: {max_tokens}; the prompt has {num_prompt_tokens} "
            f"tokens and max_model_len is {max_model_len}",
            code="context_length_exceeded",
        )
    return min(max_tokens, room)


def load_tokenizer(model_dir: str) -> PreTrainedTokenizerBase | None:
    """The checkpoint's Hugging Face tokenizer; None for one without (token-id prompts only)."""
    if not any(os.path.exists(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None  # tiny test checkpoints
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def eos_token_ids(hf_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase | None) -> list[int]:
    """The ids that end a request unless ``ignore_eos``: the model config's ``eos_token_id`` (one
    or several), else the tokenizer's."""
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


class InputProcessor:
    """Parse, encode and check requests for one engine (see the module docstring).

    ``config`` is the engine's (its ``vocab_size``, ``max_model_len``, ``max_n_sequences`` and
    whether it speculates or shares a KV pool); ``tokenizer`` is whichever instance the calling
    thread may use (Hugging Face's fast tokenizers are not safe to share between threads).
    """

    def __init__(
        self, config: EngineConfig, tokenizer: PreTrainedTokenizerBase | None, eos_token_ids: list[int]
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._ids = itertools.count()

    def with_tokenizer(self, tokenizer: PreTrainedTokenizerBase | None) -> InputProcessor:
        """The same checks through another tokenizer instance (the server's worker threads')."""
        return InputProcessor(self.config, tokenizer, self.eos_token_ids)

    def process_inputs(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        fit_max_tokens: bool = True,
        prompt_text: str | None = None,
    ) -> EngineCoreRequest:
        """Validate everything about a request that does not depend on the engine's state, and
        settle it: :class:`ParameterError` naming the argument, else the :class:`EngineCoreRequest`.

        ``request_id`` None gets ``req-<n>``, ``n`` counting this processor's requests.
        ``prompt`` is text or token ids (:func:`parse_prompts` reads vLLM's other shapes);
        ``prompt_text`` is the text its outputs show (default: ``prompt`` when it is text).
        ``priority`` matters with ``scheduling_policy="priority"``: lower values are served
        first. ``fit_max_tokens``: see :func:`resolve_max_tokens`.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ParameterError("params", f"must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        self.check_sampling_support(params)
        check_int("priority", priority, -(2**63))
        cfg = self.config
        token_ids = encode_prompt(
            self.tokenizer, prompt, cfg.vocab_size, cfg.max_model_len, params.truncate_prompt_tokens
        )
        max_tokens = resolve_max_tokens(params.max_tokens, len(token_ids), cfg.max_model_len, fit_max_tokens)
        if params.min_tokens > max_tokens:  # vLLM checks the pair once max_tokens is resolved
            raise ParameterError(
                "min_tokens",
                f"must be less than or equal to max_tokens={max_tokens} (the tokens this request may "
                f"generate), got {params.min_tokens}",
            )
        if params.max_tokens != max_tokens:
            params = params.clone(max_tokens=max_tokens)
        if params.bad_words:
            params = params.clone(_bad_words_token_ids=self.tokenize_bad_words(params.bad_words))
        text = prompt if prompt_text is None and isinstance(prompt, str) else prompt_text
        request_id = f"req-{next(self._ids)}" if request_id is None else request_id
        return EngineCoreRequest(request_id, text, token_ids, params, priority)

    def tokenize_bad_words(self, bad_words: list[str]) -> list[list[int]]:
        """vLLM's reading of ``bad_words``: each word tokenized alone and after a space (a word
        at the start of the text, and one in the middle of it), the second kept only where the
        space makes a different token sequence of the same length."""
        if self.tokenizer is None:
            raise ParameterError("bad_words", "needs a tokenizer, and this checkpoint has none")
        sequences: list[list[int]] = []
        for word in bad_words:
            alone = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not alone:
                raise ParameterError("bad_words", f"entries must tokenize to at least one token, got {word!r}")
            sequences.append(alone)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                sequences.append(spaced)
        if len(sequences) > MAX_NUM_BAD_WORDS:
            raise ParameterError(
                "bad_words", f"make {len(sequences)} token sequences, more than the {MAX_NUM_BAD_WORDS} allowed"
            )
        vocab = self.config.vocab_size
        bad = [t for sequence in sequences for t in sequence if t >= vocab]
        if bad:
            raise ParameterError("bad_words", f"tokenize to ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        return sequences

    def check_sampling_support(self, params: SamplingParams) -> None:
        """What :meth:`SamplingParams.validate` cannot know: the vocabulary, and which fields
        speculative decoding cannot honour (penalties and ``min_tokens`` change with each
        position, and logprobs would be needed for every accepted draft)."""
        cfg = self.config
        vocab = cfg.vocab_size
        if params.n > cfg.max_n_sequences:
            raise ParameterError("n", f"must be at most {cfg.max_n_sequences} (max_n_sequences), got {params.n}")
        for name, ids in (
            ("logit_bias", params.logit_bias or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
        ):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ParameterError(name, f"holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > vocab:
                raise ParameterError(name, f"must be at most the vocabulary size ({vocab}), got {k}")
        banned = {t for t in params.stop_token_ids or () if t < vocab} if params.min_tokens else set()
        if params.min_tokens and not params.ignore_eos:
            banned.update(self.eos_token_ids)
        if len(banned) >= vocab:
            raise ParameterError(
                "stop_token_ids",
                f"cover the whole vocabulary, which min_tokens={params.min_tokens} bans until that many "
                "tokens are out: no token could be sampled",
            )
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ParameterError("structured_outputs", "needs the model's tokenizer, which this checkpoint lacks")
            from vllm_from_scratch.structured_output import check_structured_outputs  # xgrammar: only when used

            check_structured_outputs(params.structured_outputs)
        if cfg.kv_transfer is not None and params.prompt_logprobs is not None:
            # Blocks loaded from the pool skip their prompt positions, as prefix-cache hits would.
            raise ParameterError("prompt_logprobs", "is not supported with a KV pool (kv_transfer_config)")
        if cfg.speculative is not None:
            for name, off in (
                ("presence_penalty", 0.0),
                ("frequency_penalty", 0.0),
                ("repetition_penalty", 1.0),
                ("min_tokens", 0),
                ("logprobs", None),
                ("prompt_logprobs", None),
            ):
                if getattr(params, name) != off:
                    raise ParameterError(name, "is not supported with speculative decoding (speculative_config)")
            if params.bad_words:  # which token is banned depends on the tokens before it, drafts included
                raise ParameterError("bad_words", "is not supported with speculative decoding (speculative_config)")
