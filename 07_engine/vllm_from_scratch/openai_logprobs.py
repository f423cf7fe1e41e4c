"""The engine's logprobs in OpenAI's two response shapes, rendered as vLLM's server renders them.

The engine reports one ``{token_id: Logprob}`` per token (:class:`~vllm_from_scratch.outputs.Logprob`):
the scored token first, then the most likely ones, as vLLM V1 orders them; a prompt's first
token has None (nothing predicts it). Two shapes come out of that:

* completions (``logprobs: k``): four parallel lists, ``tokens``, ``token_logprobs``,
  ``top_logprobs`` (a ``{token string: logprob}`` per token holding the first ``k + 1``
  entries: the scored token and the top ``k``) and ``text_offset``;
* chat (``logprobs: true, top_logprobs: k``): ``{"content": [...]}``, one
  ``{token, logprob, bytes, top_logprobs}`` per token, ``top_logprobs`` the first ``k``
  entries, the sampled token first (vLLM's slice, so a sampled token outside the top ``k``
  pushes the ``k``-th out).

The rules, each vLLM's (``serving_completion._create_completion_logprobs``,
``serving_chat._create_chat_logprobs``):

* a token's string is its ``decoded_token`` (``tokenizer.decode([id])``, special tokens kept),
  or ``"token_id:N"`` with ``return_tokens_as_token_ids``;
* ``-inf`` is sent as ``-9999.0``, OpenAI's stand-in (JSON has no infinity);
* ``text_offset[j + 1] = text_offset[j] + len(tokens[j])``: offsets count token strings,
  which may differ from the text where a token is half a UTF-8 character;
* chat's ``bytes`` are the UTF-8 of the decoded token (of the token string, for the top entries).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any, TypeAlias

from vllm_from_scratch.outputs import Logprob

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

LogprobEntry: TypeAlias = dict[int, Logprob] | None
# What OpenAI (and vLLM) send for a log-probability of -inf.
LOGPROB_FLOOR = -9999.0


def finite(logprob: float) -> float:
    """``logprob`` with ``-inf`` raised to :data:`LOGPROB_FLOOR`."""
    return max(logprob, LOGPROB_FLOOR)


def utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


@dataclass(frozen=True)
class LogprobsRenderer:
    """One request's logprobs settings: ``num_top`` is the completions ``logprobs`` or chat's
    ``top_logprobs``; ``as_token_ids`` is vLLM's ``return_tokens_as_token_ids``."""

    num_top: int
    tokenizer: PreTrainedTokenizerBase | None
    as_token_ids: bool = False

    def token(self, token_id: int, logprob: Logprob | None) -> str:
        """vLLM's ``_get_decoded_token``. Without a tokenizer (a checkpoint that has none) the
        id form stands in, where vLLM would fail the request."""
        if self.as_token_ids:
            return f"token_id:{token_id}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return str(self.tokenizer.decode([token_id]))

    def completion(
        self, token_ids: Sequence[int], entries: Sequence[LogprobEntry], text_offset: int = 0
    ) -> dict[str, Any]:
        """The completions API's ``logprobs`` object for ``token_ids``; offsets start at
        ``text_offset`` (the characters a stream already sent)."""
        offsets: list[int] = []
        token_logprobs: list[float | None] = []
        tokens: list[str] = []
        top_logprobs: list[dict[str, float] | None] = []
        for token_id, entry in zip(token_ids, padded(entries, len(token_ids))):
            scored = None if entry is None else entry.get(token_id)
            token = self.token(token_id, scored)
            if entry is None or scored is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
            else:
                token_logprobs.append(finite(scored.logprob))
                top = islice(entry.items(), self.num_top + 1)
                top_logprobs.append({self.token(t, lp): finite(lp.logprob) for t, lp in top})
            offsets.append(text_offset)
            text_offset += len(token)
            tokens.append(token)
        return {
            "text_offset": offsets,
            "token_logprobs": token_logprobs,
            "tokens": tokens,
            "top_logprobs": top_logprobs,
        }

    def chat(self, token_ids: Sequence[int], entries: Sequence[LogprobEntry]) -> dict[str, Any]:
        """The chat API's ``logprobs`` object (``{"content": [...]}``) for ``token_ids``."""
        content = []
        for token_id, entry in zip(token_ids, padded(entries, len(token_ids))):
            scored = None if entry is None else entry.get(token_id)
            token = self.token(token_id, scored)
            if entry is None or scored is None:  # vLLM's defaults for a token with no entry
                content.append({"token": token, "logprob": LOGPROB_FLOOR, "bytes": utf8(token), "top_logprobs": []})
                continue
            top = [
                {"token": (name := self.token(t, lp)), "logprob": finite(lp.logprob), "bytes": utf8(name)}
                for t, lp in islice(entry.items(), self.num_top)
            ]
            decoded = scored.decoded_token
            content.append(
                {
                    "token": token,
                    "logprob": finite(scored.logprob),
                    "bytes": None if decoded is None else utf8(decoded),
                    "top_logprobs": top,
                }
            )
        return {"content": content}


def prompt_logprobs_json(entries: Sequence[LogprobEntry]) -> list[dict[int, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` field: per prompt token None (the first) or
    ``{token_id: {"logprob", "rank", "decoded_token"}}``, -inf as :data:`LOGPROB_FLOOR`."""
    return [
        None
        if entry is None
        else {
            t: {"logprob": finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in entry.items()
        }
        for entry in entries
    ]


def padded(entries: Sequence[LogprobEntry], n: int) -> list[LogprobEntry]:
    """``entries`` for ``n`` tokens; a token the engine gave no entry for is rendered as vLLM
    renders one (no logprob)."""
    return [*entries[:n], *[None] * (n - len(entries))]
