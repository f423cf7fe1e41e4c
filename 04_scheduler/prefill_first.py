"""nano-vllm's scheduling policy: a step is either all prefill or all decode.

``schedule()`` first tries to admit waiting requests; if it admitted any, the step runs only
those prompts, and the running requests wait a step. Only when nothing can be admitted does it
decode every running request, preempting the newest ones when blocks run out::

    waiting non-empty and something fits?  ──yes──►  prefill step: [P1 P2 ...]
                 │ no
                 ▼
    decode step: [D1 D2 D3 ...]   (preempt from the tail when a block is missing)

The model runner then never sees a mixed batch, which is why nano-vllm chose it (its prefill
and decode paths call different flash-attn functions). The price is paid by the running
requests: every admission stalls all their decodes for one step. :class:`scheduler.Scheduler`
(vLLM V1's policy) lets the decodes ride along with the new prompts instead;
``compare_policies.py`` measures both on one workload.

Two things nano-vllm does differently and we do not copy: it caps the *per-step* number of
sequences but not the size of the running set (requests past ``max_num_seqs`` then never
decode), and it charges a prompt's full length to the token budget even when the prefix cache
serves most of it.
"""

from __future__ import annotations

from scheduler import Request, Scheduler, SchedulerOutput


class PrefillFirstScheduler(Scheduler):
    """Same interface as :class:`Scheduler`, nano-vllm's prefill-or-decode steps."""

    def schedule(self) -> SchedulerOutput:
        out = self._new_output()
        scheduled: list[Request]
        scheduled, _ = self._schedule_waiting(out, self.max_num_batched_tokens)
        if not scheduled:
            scheduled, _ = self._schedule_running(out, self.max_num_batched_tokens)
        out.scheduled_requests = scheduled
        self.num_steps += 1
        return out

    def is_prefill_step(self, out: SchedulerOutput) -> bool:
        """True when the step runs prompts (prefill-first never mixes them with decodes)."""
        return any(not r.is_decoding for r in out.scheduled_requests)
