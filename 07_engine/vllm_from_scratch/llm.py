"""``LLM``: offline batched generation, nano-vllm's (and vLLM's) entry point."""

from __future__ import annotations

from typing import Any, cast

from tqdm.auto import tqdm

from vllm_from_scratch.engine import LLMEngine
from vllm_from_scratch.sampling_params import SamplingParams


class LLM:
    """Load a model and generate for many prompts at once.

    Args:
        model_dir: a Hugging Face checkpoint directory (config.json + safetensors [+ tokenizer]).
        device: "auto" (CUDA if available, else CPU), "cpu" or "cuda[:N]".
        tensor_parallel_size: ranks to split the model over (gloo on CPU, NCCL on GPU).
        enforce_eager: never use CUDA graphs.
        max_num_seqs / max_num_batched_tokens: the scheduler's per-step request and token caps.
        max_model_len: longest prompt + output; longer prompts are refused.
        kvcache_block_size / num_kvcache_blocks: paging; ``None`` blocks = size from memory.
        enable_prefix_caching / enable_chunked_prefill: chapters 03 and 06.
        long_prefill_token_threshold: most tokens of one prompt per step (chapter 06).
        scheduling_policy: "fcfs" or "priority" (chapter 04; see ``generate``'s ``priority``).
        dtype: None (the checkpoint's), "float32", "bfloat16" or "float16".
        attention_backend: "auto" (by device), "torch", "cpp", "triton" or "flash" (chapter 02).
        speculative_config: ``{"method": "ngram", "num_speculative_tokens": k}`` or
            ``{"method": "draft_model", "model": dir, "num_speculative_tokens": k}`` (chapter 05).

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
