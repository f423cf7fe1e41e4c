"""``LLM``: offline batched generation, vLLM's (and nano-vllm's) entry point.

The offline API is vLLM's: ``LLM(model=...)``, ``generate(prompts, sampling_params)`` with
vLLM's prompt types, ``chat(messages)``, and :class:`~vllm_from_scratch.outputs.RequestOutput`
results. Underneath it drives the same ``add_request``/``step`` loop the OpenAI server does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from tqdm.auto import tqdm

from vllm_from_scratch.beam_search import BeamSearchOutput, beam_search
from vllm_from_scratch.chat_utils import render_chat
from vllm_from_scratch.engine import LLMEngine
from vllm_from_scratch.errors import ParameterError
from vllm_from_scratch.input_processor import ParsedPrompt, PromptType, describe, encode_prompt, parse_prompts
from vllm_from_scratch.metrics_reader import Metric
from vllm_from_scratch.outputs import Logprob, RequestOutput
from vllm_from_scratch.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Conversation: TypeAlias = list[Mapping[str, Any]]


def _check_conversation(conversation: object, where: str) -> Conversation:
    """One conversation: a list of ``{"role", "content"}`` dicts. Content may be a string, None,
    or OpenAI text parts, which are joined as the server joins them."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ParameterError("messages", f"{where} must be a non-empty list of {{'role', 'content'}} dicts")
    checked: Conversation = []
    for j, message in enumerate(conversation):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ParameterError("messages", f"{where}[{j}] must be a dict with a 'role' string")
        content = message.get("content")
        if isinstance(content, (list, tuple)):
            if any(not isinstance(p, Mapping) or p.get("type") != "text" for p in content):
                raise ParameterError("messages", f"{where}[{j}] content parts other than text are not supported")
            message = {**message, "content": "".join(str(p.get("text", "")) for p in content)}
        elif content is not None and not isinstance(content, str):
            raise ParameterError("messages", f"{where}[{j}]['content'] must be a string, got {type(content).__name__}")
        checked.append(message)
    return checked


class LLM:
    """Load a model and generate for many prompts at once (vLLM's ``vllm.LLM``).

    ``model`` is a Hugging Face checkpoint directory (config.json, safetensors, and a tokenizer
    for text prompts and chat), given by position or as vLLM's ``model=``; every other keyword
    is a field of :class:`~vllm_from_scratch.config.EngineConfig`, which documents each one with
    its default (``python -m vllm_from_scratch.serve --help`` prints the same list).

    Example (vLLM's quickstart)::

        llm = LLM(model=default_model_dir())
        outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8, top_p=0.95))
        for output in outputs:
            print(output.prompt, output.outputs[0].text)

    The book's shorthand from the source documents also works: ``outputs[0]["text"]``.

    As in vLLM, offline use records no metrics unless asked: ``LLM(model,
    disable_log_stats=False)`` records vLLM's ``vllm:`` families (labelled with ``model`` as the
    model name), which :meth:`get_metrics` reads.
    """

    def __init__(self, model: str, **kwargs: Any):
        kwargs.setdefault("disable_log_stats", True)
        self.llm_engine = LLMEngine(model, **kwargs)
        self.tokenizer = self.llm_engine.tokenizer
        if not self.llm_engine.config.disable_log_stats:
            self.llm_engine.attach_metrics(str(model))

    def get_tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The Hugging Face tokenizer (None for a checkpoint without one: token-id prompts only)."""
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; one :class:`RequestOutput` each, in input order.

        ``prompts``: a string, a list of token ids, ``{"prompt": str}`` or ``{"prompt_token_ids":
        [...]}``, or a list of those. ``sampling_params``: one for all prompts or a list with one
        per prompt (None: ``SamplingParams()``). ``priority``: a list with one int per prompt,
        lower first, under ``scheduling_policy="priority"`` (vLLM's type; a bare int is refused).
        Every prompt is validated before any is scheduled: one bad prompt raises ``ValueError``
        and leaves the engine idle. With ``SamplingParams(n=...)`` each result holds ``n``
        completions in index order; the progress bar counts prompts.
        """
        return self._run(parse_prompts(prompts), sampling_params, use_tqdm, priority)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}`` dicts) or a list of them.

        Each is rendered by the tokenizer's chat template, as the OpenAI server renders
        ``/v1/chat/completions`` (:func:`~vllm_from_scratch.chat_utils.render_chat`), then
        generated like :meth:`generate`; each output's ``prompt`` is the rendered text.
        """
        one = isinstance(messages, (list, tuple)) and bool(messages) and isinstance(messages[0], Mapping)
        conversations = [messages] if one else messages
        if not isinstance(conversations, (list, tuple)) or not conversations:
            raise ParameterError("messages", "must be a conversation (a list of message dicts) or a list of them")
        parsed: list[ParsedPrompt] = []
        for i, conversation in enumerate(conversations):
            text, ids = render_chat(
                self.tokenizer,
                _check_conversation(conversation, "messages" if one else f"messages[{i}]"),
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
            )
            parsed.append((text, ids))
        return self._run(parsed, sampling_params, use_tqdm, None)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: object = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (:mod:`~vllm_from_scratch.beam_search` says how, and how it differs
        from Hugging Face's): one :class:`~vllm_from_scratch.beam_search.BeamSearchOutput` per
        prompt, its ``sequences`` the ``beam_width`` best, best first.

        ``prompts`` as for :meth:`generate`. ``concurrency_limit``: prompts searched together
        (None: all). Each step runs every live beam as a one-token request through the engine;
        beams share their common prefix's KV blocks through the prefix cache.
        """
        if not isinstance(params, BeamSearchParams):
            raise ParameterError("params", f"must be a BeamSearchParams, got {type(params).__name__}")
        if lora_request is not None:
            raise ParameterError("lora_request", "is not supported: this engine serves no LoRA adapters")
        if concurrency_limit is not None and (
            not isinstance(concurrency_limit, int) or isinstance(concurrency_limit, bool) or concurrency_limit < 1
        ):
            raise ParameterError("concurrency_limit", f"must be a positive int or None, got {concurrency_limit!r}")
        engine = self.llm_engine
        cfg = engine.config
        if params.beam_width > cfg.max_n_sequences:
            raise ParameterError(
                "beam_width", f"must be at most {cfg.max_n_sequences} (max_n_sequences), got {params.beam_width}"
            )
        parsed = parse_prompts(prompts)
        token_ids = [encode_prompt(self.tokenizer, source, cfg.vocab_size, cfg.max_model_len) for _, source in parsed]
        longest = max(len(t) for t in token_ids)
        if longest + params.max_tokens > cfg.max_model_len:
            raise ParameterError(
                "max_tokens",
                f"({params.max_tokens}) plus the longest prompt ({longest} tokens) exceeds max_model_len "
                f"({cfg.max_model_len})",
            )
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else next(iter(engine.eos_token_ids), None)
        step = SamplingParams(max_tokens=1, logprobs=2 * params.beam_width, temperature=params.temperature)

        def expand(beams: list[list[int]]) -> list[dict[int, Logprob]]:
            outputs = self._run([(None, tokens) for tokens in beams], step, False, None)
            return [out.outputs[0].logprobs[0] for out in outputs]  # type: ignore[index]

        limit = concurrency_limit or len(token_ids)
        results: list[BeamSearchOutput] = []
        with tqdm(
            total=params.max_tokens * -(-len(token_ids) // limit), desc="Beam search", disable=not use_tqdm
        ) as bar:
            for start in range(0, len(token_ids), limit):
                found = beam_search(token_ids[start : start + limit], params, eos, expand, lambda: bar.update(1))
                for sequences in found:
                    if self.tokenizer is not None:
                        for seq in sequences:
                            seq.text = str(
                                self.tokenizer.decode(seq.tokens, skip_special_tokens=params.skip_special_tokens)
                            )
                    results.append(BeamSearchOutput(sequences))
        return results

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached prefix block; False while requests hold blocks (vLLM's;
        :meth:`LLMEngine.reset_prefix_cache`)."""
        return self.llm_engine.reset_prefix_cache(reset_running_requests, reset_connector)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Not supported: raises ``NotImplementedError`` saying so (:meth:`LLMEngine.sleep`)."""
        self.llm_engine.sleep(level, mode)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Not supported: raises ``NotImplementedError`` saying so (:meth:`LLMEngine.sleep`)."""
        return self.llm_engine.wake_up(tags)

    def _run(
        self,
        prompts: list[ParsedPrompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        priority: list[int] | None,
    ) -> list[RequestOutput]:
        """Validate every request, queue them all, step the engine until each has finished."""
        n = len(prompts)
        if isinstance(sampling_params, (list, tuple)):
            per_prompt: list[SamplingParams | None] = list(sampling_params)
            if len(per_prompt) != n:
                raise ParameterError(
                    "sampling_params", f"has {len(per_prompt)} entries for {n} prompts (pass one, or one per prompt)"
                )
        else:
            per_prompt = [sampling_params] * n  # type: ignore[list-item]  # a bad type is the engine's error
        if priority is None:
            priority = [0] * n
        if not isinstance(priority, (list, tuple)):
            raise ParameterError("priority", f"must be a list with one int per prompt, got {describe(priority)}")
        if len(priority) != n:
            raise ParameterError("priority", f"has {len(priority)} entries for {n} prompts (one per prompt)")
        engine = self.llm_engine
        # vLLM's rule: the offline API wants each request's one final output, all n completions.
        final_only: dict[int, SamplingParams] = {}
        try:
            requests = [
                engine.input_processor.process_inputs(
                    None, source, self._final_only(sp, final_only), pr, prompt_text=text
                )
                for (text, source), sp, pr in zip(prompts, per_prompt, priority)
            ]
        except ParameterError as exc:
            if exc.param == "params":  # the engine's name for it; the offline API says vLLM's
                raise ParameterError("sampling_params", str(exc).removeprefix("params "), exc.code) from exc
            raise
        engine.add_requests(requests)
        order = {r.request_id: i for i, r in enumerate(requests)}
        results: list[RequestOutput | None] = [None] * n
        with tqdm(total=n, desc="Generating", disable=not use_tqdm, dynamic_ncols=True) as bar:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[order[out.request_id]] = out
                        bar.update(1)
        assert all(r is not None for r in results), "every request ends with one final output"
        return results  # type: ignore[return-value]

    @staticmethod
    def _final_only(params: object, clones: dict[int, SamplingParams]) -> Any:
        """``params`` asking for ``RequestOutputKind.FINAL_ONLY``: one copy per distinct object (a
        batch usually shares one), never the caller's. Anything else is the input processor's to refuse."""
        if not isinstance(params, SamplingParams) and params is not None:
            return params
        key = id(params)
        if key not in clones:
            clones[key] = (params or SamplingParams()).clone(output_kind=RequestOutputKind.FINAL_ONLY)
        return clones[key]

    def get_metrics(self) -> list[Metric]:
        """Every ``vllm:`` series now, as vLLM's records (:mod:`metrics_reader`): the same
        registry the server's ``/metrics`` would show. Needs ``disable_log_stats=False``."""
        return self.llm_engine.get_metrics()

    def shutdown(self) -> None:
        self.llm_engine.shutdown()
