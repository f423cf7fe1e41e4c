"""``LLM``: offline batched generation, nano-vllm's (and vLLM's) entry point."""

from __future__ import annotations

from typing import Any, cast

from tqdm.auto import tqdm

from vllm_from_scratch.engine import LLMEngine
from vllm_from_scratch.sampling_params import SamplingParams


class LLM:
    """Load a model and generate for many prompts at once.

    ``model_dir`` is a Hugging Face checkpoint directory (config.json, safetensors, and a tokenizer
    for text prompts); every other keyword is a field of
    :class:`~vllm_from_scratch.config.EngineConfig`, which documents each one with its default
    (``python -m vllm_from_scratch.serve --help`` prints the same list).

    Example::

        llm = LLM(default_model_dir(), dtype="bfloat16")
        out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=8))
        print(out[0]["text"])
    """

    def __init__(self, model_dir: str, **kwargs: Any):
        self.llm_engine = LLMEngine(model_dir, **kwargs)
        self.tokenizer = self.llm_engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[dict]:
        """Generate for every prompt (a string or a list of token ids, or a list of those).

        ``priority`` gives each prompt its priority (lower first) under
        ``scheduling_policy="priority"``, as in vLLM. Returns ``[{"text", "token_ids",
        "num_cached_tokens"}]`` in input order: the completion's text and token ids, and how many
        prompt tokens were not computed (prefix-cache hits). Every prompt is validated before
        any is scheduled: one bad prompt raises ``ValueError`` and leaves the engine idle.
        """
        one = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        prompt_list = cast(list[str | list[int]], [prompts] if one else prompts)
        per_prompt: list[SamplingParams | None] = (
            list(params) if isinstance(params, list) else [params] * len(prompt_list)
        )
        if len(per_prompt) != len(prompt_list):
            raise ValueError(f"params has {len(per_prompt)} entries for {len(prompt_list)} prompts")
        if priority is None:
            priority = [0] * len(prompt_list)
        if not isinstance(priority, list) or len(priority) != len(prompt_list):
            raise ValueError(f"priority must be a list with one int per prompt ({len(prompt_list)})")
        engine = self.llm_engine
        requests = [engine.make_request(p, sp, priority=pr) for p, sp, pr in zip(prompt_list, per_prompt, priority)]
        order = {r.request_id: i for i, r in enumerate(requests)}
        for req in requests:
            engine.add_request(req)
        results: dict[int, dict] = {}
        with tqdm(total=len(requests), desc="Generating", disable=not use_tqdm, dynamic_ncols=True) as bar:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[order[out.request_id]] = {
                            "text": out.text,
                            "token_ids": out.completion_token_ids,
                            "num_cached_tokens": out.num_cached_tokens,
                        }
                        bar.update(1)
        return [results[i] for i in range(len(requests))]

    def shutdown(self) -> None:
        self.llm_engine.shutdown()
