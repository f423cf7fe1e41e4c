"""``SamplingParams.n`` > 1: one parent request, ``n`` child requests (vLLM V1's
``vllm/v1/engine/parallel_sampling.py``).

Fan-out: completion ``i`` of request ``request_id`` runs as the child request
:func:`child_request_id` ``(i, request_id)`` with :meth:`ParentRequest.get_child_info`'s settings;
the scheduler runs children as independent requests. Fan-in: the output processor reports each
child's outputs under the parent's id, with its completion's ``index``, through
:meth:`ParentRequest.get_outputs`.

Sharing the prompt. The children's prompts are equal, so their full prompt blocks should be
computed once and held by all ``n`` (reference count ``n``): the fork after prefill of vLLM V0's
sequence groups. vLLM V1 has no fork; its prefix cache registers a block's hash when it allocates
the block, so children admitted in the same step as child 0 already hit the blocks child 0 is
filling. Chapter 03's cache registers a block once a forward has computed it
(``cache_full_blocks``), so children admitted beside child 0 would each compute the prompt. Here
child 0 is queued at once and the others wait in :class:`ParkedChildren`, outside the scheduler,
until child 0 has computed its whole prompt (or ended); then each finds the full prompt blocks in
the cache and computes only the rest (its last partial block; a whole last block when the prompt
fills whole blocks, as the last token is always computed). Without prefix caching, or with a
prompt too short to fill a block before its last token, there is nothing to share: every child is
queued at once and computes its own prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler import Request
from vllm_from_scratch.outputs import CompletionOutput, Logprob
from vllm_from_scratch.sampling_params import RequestOutputKind, SamplingParams, check_int


def child_request_id(index: int, parent_id: str) -> str:
    """The internal id of completion ``index`` of request ``parent_id`` (vLLM's spelling)."""
    return f"{index}_{parent_id}"


class ParentRequest:
    """A request with ``n`` > 1 completions, as the engine reports it.

    ``child_requests`` are the children that have not reported their end (vLLM's name). With
    ``RequestOutputKind.FINAL_ONLY`` the finished completions wait in ``output_aggregator`` until
    the last one ends. What a request reports once for its prompt comes from completion 0, the
    one that computes the prompt for the others: ``prompt_logprobs`` and ``num_cached_tokens``.
    """

    def __init__(self, request_id: str, sampling_params: SamplingParams):
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.child_requests: set[str] = set()
        self.output_aggregator: dict[int, CompletionOutput] = {}
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.num_cached_tokens = 0

    @property
    def n(self) -> int:
        return self.sampling_params.n

    def get_child_info(self, index: int) -> tuple[str, SamplingParams]:
        """Completion ``index``'s request id and settings: one sample, with ``seed + index`` when
        seeded (each completion is reproducible and equals an ``n=1`` request with that seed),
        and ``prompt_logprobs`` on completion 0 only, so the prompt is scored once (vLLM scores
        it in every child) and the other completions may take prefix-cache hits."""
        check_int("index", index, 0, self.n - 1)
        params = self.sampling_params
        child_id = child_request_id(index, self.request_id)
        self.child_requests.add(child_id)
        return child_id, params.clone(
            n=1,
            seed=None if params.seed is None else params.seed + index,
            prompt_logprobs=params.prompt_logprobs if index == 0 else None,
        )

    def get_outputs(self, child_id: str, completion: CompletionOutput) -> tuple[list[CompletionOutput], bool]:
        """What the parent reports for child ``child_id``'s ``completion``, and whether the
        parent has now ended: the completion itself as it comes, or, with ``FINAL_ONLY``,
        nothing until every child has ended and then all ``n`` in index order."""
        if completion.finished():
            self.child_requests.discard(child_id)
        finished = not self.child_requests
        if self.sampling_params.output_kind != RequestOutputKind.FINAL_ONLY:
            return [completion], finished
        self.output_aggregator[completion.index] = completion
        return ([self.output_aggregator[i] for i in sorted(self.output_aggregator)] if finished else []), finished


@dataclass
class ParkedChildren:
    """Children ``1 ..`` of a parent, held outside the scheduler until ``first`` (child 0) has
    computed its prompt; see the module docstring."""

    parent_id: str
    first: Request
    parked: list[Request]

    @property
    def prompt_computed(self) -> bool:
        """Whether child 0 has computed its whole prompt (or ended), so its full prompt blocks
        are in the prefix cache for the parked children."""
        return self.first.is_finished or self.first.num_computed_tokens >= self.first.num_prompt_tokens
