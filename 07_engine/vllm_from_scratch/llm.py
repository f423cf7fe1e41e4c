"""``LLM``: offline batched generation, vLLM's (and nano-vllm's) entry point.

The offline API is vLLM's: ``LLM(model=...)``, ``generate(prompts, sampling_params)`` with
vLLM's prompt types, ``chat(messages)``, and :class:`~vllm_from_scratch.outputs.RequestOutput`
results. Underneath it drives the same ``add_request``/``step`` loop the OpenAI server does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from tqdm.auto import tqdm

from vllm_from_scratch.chat_utils import render_chat
from vllm_from_scratch.engine import EngineRequest, LLMEngine, ParentRequest
from vllm_from_scratch.engine import RequestOutput as EngineOutput
from vllm_from_scratch.errors import ParameterError
from vllm_from_scratch.outputs import CompletionOutput, RequestOutput
from vllm_from_scratch.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# vLLM's single prompts: text, token ids, or the dicts TextPrompt / TokensPrompt.
PromptType: TypeAlias = str | list[int] | Mapping[str, Any]
Conversation: TypeAlias = list[Mapping[str, Any]]

# The keys of vLLM's TextPrompt / TokensPrompt this engine acts on. The others (multimodal data,
# cache_salt, ...) are refused by name rather than ignored.
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids"})


def _all_ints(values: Sequence[object]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in values)


def _is_token_ids(value: object) -> bool:
    """One prompt of token ids (vLLM's rule), rather than a batch of prompts."""
    return isinstance(value, list) and bool(value) and _all_ints(value)


def _describe(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_prompts(prompts: object) -> list[tuple[str | None, str | list[int]]]:
    """vLLM's prompt shapes as one list of ``(text shown in the output, what the engine encodes)``.

    One prompt: a string, a list of token ids, ``{"prompt": str}`` or ``{"prompt_token_ids":
    [...]}``. Several: a list (or tuple) of those. ``ParameterError`` naming ``prompts`` for any
    other shape: a bare ``{"prompt": ...}`` dict must not be iterated into its key.
    """
    if isinstance(prompts, (str, Mapping)) or _is_token_ids(prompts):
        return [_parse_one(prompts, "prompts")]
    if not isinstance(prompts, (list, tuple)):
        raise ParameterError(
            "prompts",
            "must be a string, a list of token ids, a {'prompt': ...} or {'prompt_token_ids': ...} dict, "
            f"or a list of those; got {type(prompts).__name__}",
        )
    if not prompts:
        raise ParameterError("prompts", "must hold at least one prompt")
    return [_parse_one(p, f"prompts[{i}]") for i, p in enumerate(prompts)]


def _parse_one(prompt: object, where: str) -> tuple[str | None, str | list[int]]:
    if isinstance(prompt, str):
        return prompt, prompt
    if isinstance(prompt, (list, tuple)):
        # Emptiness and the vocabulary are the engine's checks (encode_prompt); the shape is ours.
        if not _all_ints(prompt):
            raise ParameterError("prompts", f"{where} must be a list of token ids, got {_describe(prompt)}")
        return None, list(prompt)  # vLLM reports no prompt text for token ids
    if isinstance(prompt, Mapping):
        unknown = sorted(str(k) for k in prompt if k not in PROMPT_KEYS)
        if unknown:
            raise ParameterError("prompts", f"{where} has keys this engine does not support: {unknown}")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ParameterError("prompts", f"{where}['prompt'] must be a string, got {type(text).__name__}")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not _all_ints(ids):
                raise ParameterError("prompts", f"{where}['prompt_token_ids'] must be a list of token ids")
            return text, list(ids)  # a TokensPrompt may carry its text for the output
        if text is None:
            raise ParameterError("prompts", f"{where} must have a 'prompt' or a 'prompt_token_ids' key")
        return text, text
    raise ParameterError(
        "prompts", f"{where} must be a string, a list of token ids or a prompt dict, got {type(prompt).__name__}"
    )


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


def _num_completions(req: EngineRequest | ParentRequest) -> int:
    return len(req.children) if isinstance(req, ParentRequest) else 1


def _request_output(
    request_id: str, prompt: str | None, prompt_token_ids: list[int], finished: dict[int, EngineOutput]
) -> RequestOutput:
    """vLLM's result of one prompt from the engine's last record of each completion.

    The prompt's own facts come from completion 0, which scored the prompt (``prompt_logprobs``)
    and computed it: its ``num_cached_tokens`` are the request's prefix-cache hits.
    """
    outs = [finished[i] for i in range(len(finished))]
    completions = [
        CompletionOutput(
            index=out.index,
            text=out.text,
            token_ids=out.completion_token_ids,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            cumulative_logprob=out.cumulative_logprob,
            logprobs=out.logprobs,
        )
        for out in outs
    ]
    return RequestOutput(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        prompt_logprobs=outs[0].prompt_logprobs,
        outputs=completions,
        finished=True,
        num_cached_tokens=outs[0].num_cached_tokens,
    )


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
    """

    def __init__(self, model: str, **kwargs: Any):
        self.llm_engine = LLMEngine(model, **kwargs)
        self.tokenizer = self.llm_engine.tokenizer

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
        parsed: list[tuple[str | None, str | list[int]]] = []
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

    def _run(
        self,
        prompts: list[tuple[str | None, str | list[int]]],
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
            raise ParameterError("priority", f"must be a list with one int per prompt, got {_describe(priority)}")
        if len(priority) != n:
            raise ParameterError("priority", f"has {len(priority)} entries for {n} prompts (one per prompt)")
        engine = self.llm_engine
        try:
            requests = [
                engine.make_request(ids, sp, priority=pr) for (_, ids), sp, pr in zip(prompts, per_prompt, priority)
            ]
        except ParameterError as exc:
            if exc.param == "params":  # the engine's name for it; the offline API says vLLM's
                raise ParameterError("sampling_params", str(exc).removeprefix("params "), exc.code) from exc
            raise
        order = {r.request_id: i for i, r in enumerate(requests)}
        for req in requests:
            engine.add_request(req)
        finished: list[dict[int, EngineOutput]] = [{} for _ in requests]
        with tqdm(total=n, desc="Generating", disable=not use_tqdm, dynamic_ncols=True) as bar:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        i = order[out.request_id]
                        finished[i][out.index] = out
                        if len(finished[i]) == _num_completions(requests[i]):
                            bar.update(1)
        return [
            _request_output(req.request_id, text, req.prompt_token_ids, outs)
            for req, (text, _), outs in zip(requests, prompts, finished)
        ]

    def shutdown(self) -> None:
        self.llm_engine.shutdown()
