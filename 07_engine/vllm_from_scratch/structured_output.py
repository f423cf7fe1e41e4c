"""Grammar-constrained decoding: a JSON schema, regex, choice or grammar enforced on the logits.

A constraint is compiled, once per schema, into a token-level automaton over the model's
vocabulary (xgrammar's ``CompiledGrammar``). Each request keeps a matcher, the automaton's
current state, advanced by every token the request accepts. Before each step the matcher of
every constrained request that samples writes its allowed set as a bitmask (one bit per vocabulary
id, 32 ids per int32); the model runner applies the batch's masks to those logits rows in one
kernel call (:func:`apply_grammar_bitmask`), so that the sampler, greedy or not, never draws a
token the grammar forbids. Rows without a constraint are untouched, and a step with none pays
nothing. The life of a constrained request::

    InputProcessor     check_structured_outputs: the constraint parses (a bad one is refused)
    LLMEngine.add      StructuredOutputManager.compile: compiled in a worker thread, cached
    ...waits...        the request joins the scheduler once its grammar is compiled
    each step          grammar_bitmask (engine) -> apply_grammar_bitmask (runner) -> accept_tokens
    the end            the grammar complete, only a stop token (EOS) is allowed: the request stops

Why the vocabulary: a grammar speaks of characters, a model of tokens, and a token such as
``'":'`` or ``' {"'`` spans several grammar symbols. Compiling walks every token's bytes through
the automaton ahead of time (xgrammar's adaptive token mask cache), so a step's mask costs a few
microseconds for most states rather than a walk over 49k tokens (07_engine/topics/structured_outputs.md).

With speculative decoding each draft position gets its own mask: the matcher accepts the drafts
one by one as it fills their rows and is rolled back after, so a draft the grammar forbids has
target probability 0 and is rejected, and the recovered token is drawn under the mask.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

try:
    import xgrammar as xgr
except ImportError:  # a bare machine (the lent GPU's has neither xgrammar nor pydantic): constraints are refused
    xgr = None  # type: ignore[assignment]

from vllm_from_scratch.errors import ParameterError
from vllm_from_scratch.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from scheduler import SchedulerOutput

# Compiled grammars kept for reuse: a server's clients mostly repeat a few schemas.
GRAMMAR_CACHE_SIZE = 256
# xgrammar 0.2.8's CPU kernel corrupts memory on rows narrower than this (2 logits: heap errors
# within a few hundred calls); a model's vocabulary is thousands wide, a test's may not be.
KERNEL_MIN_VOCAB = 32


def grammar_source(params: StructuredOutputsParams) -> tuple[str, str]:
    """``(kind, text)``: the constraint in the form the compiler reads, and the cache key's text.

    A schema is re-serialized compactly (its properties keep their order: the output lists them
    in it); a choice becomes the EBNF alternation of its strings, each a JSON-escaped literal.
    """
    kind = params.kind
    if kind == "json":
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ParameterError("structured_outputs.json", f"is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ParameterError("structured_outputs.json", f"must be a JSON schema object, got {schema!r}")
        return kind, json.dumps(schema)
    if kind == "json_object":
        if params.json_object is not True:
            raise ParameterError(
                "structured_outputs.json_object", f"must be true when given, got {params.json_object!r}"
            )
        return "json", '{"type": "object"}'
    if kind == "choice":
        choice = params.choice
        if not isinstance(choice, (list, tuple)) or not choice or not all(isinstance(c, str) and c for c in choice):
            raise ParameterError(
                "structured_outputs.choice", f"must be a non-empty list of non-empty strings, got {choice!r}"
            )
        # EBNF string literals take JSON's escapes (\", \\, \n, \uXXXX).
        return "grammar", "root ::= " + " | ".join(json.dumps(c) for c in choice)
    text = getattr(params, kind)
    if not isinstance(text, str) or not text:
        raise ParameterError(f"structured_outputs.{kind}", f"must be a non-empty string, got {text!r}")
    return kind, text


def _library_message(exc: Exception) -> str:
    """xgrammar's error without its timestamp and C++ source location."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip())


def check_structured_outputs(params: StructuredOutputsParams) -> None:
    """:class:`ParameterError` naming the field unless the constraint parses: the grammar is built
    (milliseconds, no vocabulary) but not compiled, which the engine does off its thread."""
    kind, text = grammar_source(params)
    field = f"structured_outputs.{params.kind}"
    if xgr is None:
        raise ParameterError(field, "needs the xgrammar package, which is not installed here (pip install xgrammar)")
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(text, any_whitespace=not params.disable_any_whitespace)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        else:
            xgr.Grammar.from_ebnf(text)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ParameterError(field, f"cannot be compiled: {_library_message(exc)}") from None


_TOKENIZER_INFOS: dict[tuple[str, int, tuple[int, ...]], xgr.TokenizerInfo] = {}
_TOKENIZER_INFOS_LOCK = threading.Lock()


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary (each id's bytes, which ids stop), built once per model:
    reading 49k tokens' bytes takes about half a second."""
    key = (str(getattr(tokenizer, "name_or_path", id(tokenizer))), vocab_size, stop_token_ids)
    with _TOKENIZER_INFOS_LOCK:
        if key not in _TOKENIZER_INFOS:
            _TOKENIZER_INFOS[key] = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
            )
        return _TOKENIZER_INFOS[key]


class StructuredOutputRequest:
    """One completion's constraint: its compiled grammar (a future until the compiler is done)
    and, once that is ready, its matcher. The matcher lives on the request, so it follows it
    through preemption (the tokens it accepted stay accepted) and each of ``n`` completions has
    its own."""

    def __init__(self, grammar: Future[xgr.CompiledGrammar], max_rollback_tokens: int):
        self.grammar = grammar
        self.max_rollback_tokens = max_rollback_tokens
        self._matcher: xgr.GrammarMatcher | None = None
        self.is_terminated = False

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        if self._matcher is None:
            self._matcher = xgr.GrammarMatcher(self.grammar.result(), max_rollback_tokens=self.max_rollback_tokens)
        return self._matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, drafts: list[int]) -> None:
        """Rows ``row .. row + len(drafts)`` of ``bitmask``: the allowed tokens before each draft
        and after the last, each draft accepted in turn and all rolled back at the end. Rows
        after a draft the grammar refuses stay all-allowed: the sampler rejects that draft
        (probability 0 under its row's mask) and never reads them."""
        matcher = self.matcher
        accepted = 0
        for j, token in enumerate([*drafts, None]):
            matcher.fill_next_token_bitmask(bitmask, row + j)
            if token is None or not matcher.accept_token(token):
                break
            accepted += 1
            if matcher.is_terminated():
                break
        if accepted:
            matcher.rollback(accepted)

    def accept_tokens(self, tokens: list[int]) -> bool:
        """Advance the matcher by the tokens the request drew; False if the grammar refuses one
        (a token drawn outside the mask: a bug, which ends the request). Once the grammar is
        complete its stop token (EOS) ends the request; tokens after it (``ignore_eos``) are
        not constrained, as in vLLM."""
        for token in tokens:
            if self.is_terminated:
                break
            if not self.matcher.accept_token(token):
                return False
            self.is_terminated = self.matcher.is_terminated()
        return True


@dataclass
class GrammarOutput:
    """One step's masks for the runner (vLLM V1's name): ``request_ids[i]``'s ``num_rows[i]``
    sampling rows (1 + its drafts) take ``bitmask``'s rows in order (int32, 32 ids per entry)."""

    request_ids: list[str]
    num_rows: list[int]
    bitmask: torch.Tensor


class StructuredOutputManager:
    """Compiles constraints in a worker thread, cached by their text, and builds each step's masks.

    ``tokenizer``'s vocabulary, padded to the model's ``vocab_size`` (the logits' width), is
    read once, in the worker, at the first constraint. ``stop_token_ids`` (the model's EOS) are
    the tokens a complete grammar allows. ``max_rollback_tokens``: the most drafts a step
    checks (speculative decoding's k). ``disable_any_whitespace``: no request's JSON has
    whitespace between tokens (``structured_outputs_config``), whatever it asks.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        max_rollback_tokens: int = 0,
        disable_any_whitespace: bool = False,
    ):
        self.tokenizer = tokenizer
        self.disable_any_whitespace = disable_any_whitespace
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.max_rollback_tokens = max_rollback_tokens
        self._compiler: xgr.GrammarCompiler | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compiler")
        self._grammars: OrderedDict[tuple, Future[xgr.CompiledGrammar]] = OrderedDict()

    def new_request(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        return StructuredOutputRequest(self.compile(params), self.max_rollback_tokens)

    def compile(self, params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of ``params``, as a future: the one already compiled (or being
        compiled) for the same constraint, or a new compilation queued in the worker."""
        kind, text = grammar_source(params)
        compact = params.disable_any_whitespace or self.disable_any_whitespace
        key = (kind, text, compact)
        future = self._grammars.get(key)
        if future is None or (future.done() and future.exception() is not None):  # a failure is retried
            future = self._executor.submit(self._compile, kind, text, compact)
            self._grammars[key] = future
            while len(self._grammars) > GRAMMAR_CACHE_SIZE:
                self._grammars.popitem(last=False)
        self._grammars.move_to_end(key)
        return future

    def _compile(self, kind: str, text: str, disable_any_whitespace: bool) -> xgr.CompiledGrammar:
        if self._compiler is None:
            info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        if kind == "json":
            separators = (",", ":") if disable_any_whitespace else None
            return self._compiler.compile_json_schema(
                text, any_whitespace=not disable_any_whitespace, separators=separators
            )
        if kind == "regex":
            return self._compiler.compile_regex(text)
        return self._compiler.compile_grammar(text)

    def grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The masks of the scheduled requests that sample this step under a live constraint (a
        prompt chunk that stops short samples nothing and gets none); None when there are none."""
        constrained: list[tuple[str, StructuredOutputRequest]] = [
            (req.request_id, so)
            for req in scheduler_output.sampling_requests
            if (so := getattr(req, "structured_output", None)) is not None and not so.is_terminated
        ]
        if not constrained:
            return None
        drafts = [scheduler_output.scheduled_spec_decode_tokens.get(rid, []) for rid, _ in constrained]
        num_rows = [len(d) + 1 for d in drafts]
        bitmask = xgr.allocate_token_bitmask(sum(num_rows), self.vocab_size)
        row = 0
        for (_, so), draft, rows in zip(constrained, drafts, num_rows):
            so.fill_bitmask(bitmask, row, draft)
            row += rows
        return GrammarOutput([rid for rid, _ in constrained], num_rows, bitmask)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def apply_grammar_bitmask(
    logits: torch.Tensor, grammar_output: GrammarOutput, request_ids: list[str], num_rows: list[int]
) -> None:
    """Set to -inf, in place, every logit a constrained row's mask forbids; one kernel call.

    ``logits [B, V]`` holds ``num_rows[i]`` consecutive rows for sampling request
    ``request_ids[i]`` (the runner's batch order); ``grammar_output``'s masks go to the rows of
    the requests it names, and the other rows are not read. The library's kernel (C++ on a CPU,
    Triton or CUDA on a GPU) indexes the mask and the logits by the same row, so the masks are
    first scattered into a ``[B, V / 32]`` all-allowed mask. A vocabulary narrower than
    :data:`KERNEL_MIN_VOCAB` is masked by unpacking the bits with torch instead.
    """
    starts: dict[str, int] = {}
    row = 0
    for rid, n in zip(request_ids, num_rows):
        starts[rid] = row
        row += n
    logit_rows: list[int] = []
    mask_rows: list[int] = []
    mask_row = 0
    for rid, n in zip(grammar_output.request_ids, grammar_output.num_rows):
        if rid in starts:
            logit_rows.extend(range(starts[rid], starts[rid] + n))
            mask_rows.extend(range(mask_row, mask_row + n))
        mask_row += n
    if not logit_rows:
        return
    bitmask = grammar_output.bitmask
    vocab = logits.shape[1]
    if vocab < KERNEL_MIN_VOCAB:
        bits = (bitmask[mask_rows].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.reshape(len(mask_rows), -1)[:, :vocab].bool().to(logits.device)
        logits[logit_rows] = logits[logit_rows].masked_fill(~allowed, float("-inf"))
        return
    full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=bitmask.dtype)
    full[logit_rows] = bitmask[mask_rows]
    xgr.apply_token_bitmask_inplace(logits, full.to(logits.device), indices=logit_rows)
