"""Chapter 06's exercises against the book's own functions, on drawn inputs (exercises/differential.py).

Drawn: workloads for two chunked schedulers side by side (scheduler_testing.run_in_lockstep: token
budgets smaller than a prompt, long_prefill_token_threshold, drafts, preemption, prefix hits, a
global pool), the steps of random chunked workloads, and batches of rows mixing decodes (with
drafts), prompt chunks that start after cached tokens and chunks that stop short of the prompt's end,
with block tables in any order.
"""

from __future__ import annotations

from dataclasses import asdict

from chunked_prefill import ChunkedPrefillScheduler, SchedulerInfo, build_batch_inputs
from scheduler_testing import FakeModel, run_in_lockstep, run_random_workload

MEANINGS = {
    "_num_new_tokens": "a request gets the tokens it has left, capped by long_prefill_token_threshold (when set) "
    "and by the budget, plus the drafts that still fit",
    "_running_order": "decoding requests are visited before those still prefilling, each group in running order",
}


def _lockstep(differential, method: str) -> None:
    book = differential.twin(ChunkedPrefillScheduler, method)
    differential.run(
        lambda rng: run_in_lockstep(
            ChunkedPrefillScheduler, book, rng, differential, f"{method}: {MEANINGS[method]}", chunked=True
        ),
        examples=120,
    )


def test_num_new_tokens(differential):
    _lockstep(differential, "_num_new_tokens")


def test_running_order(differential):
    _lockstep(differential, "_running_order")


def test_from_scheduler_output(differential):
    book_info = differential.book(SchedulerInfo.from_scheduler_output)

    class ComparingModel(FakeModel):
        """Describes every step both ways before running it."""

        def execute(self, out):
            if not out.is_empty():
                drafts = dict(out.scheduled_spec_decode_tokens)
                differential.agree(
                    f"SchedulerInfo.from_scheduler_output(a step scheduling {dict(out.num_scheduled_tokens)}, "
                    f"first positions {dict(out.num_computed_tokens)}, drafts {drafts})",
                    differential.call(lambda: asdict(SchedulerInfo.from_scheduler_output(out))),
                    differential.call(lambda: asdict(book_info(out))),
                    meaning="one row per scheduled request in batch order: its chunk (known tokens from its first "
                    "position, then its drafts), kv_len = its first position, its block table, whether it decodes, "
                    "last_pos = the chunk's last index when it samples, else -1, and its number of drafts",
                )
            return super().execute(out)

    def check(rng):
        run_random_workload(
            ChunkedPrefillScheduler, rng.getrandbits(32), chunked=True, prefix_caching=rng.random() < 0.5,
            model_cls=ComparingModel, max_steps=300,
        )  # fmt: skip

    differential.run(check, examples=40)


def test_build_batch_inputs(differential):
    book_build = differential.book(build_batch_inputs)

    def check(rng):
        bs = rng.choice([1, 2, 4, 16])
        num_blocks = rng.randint(1, 24)
        info = SchedulerInfo()
        for i in range(rng.randint(0, 5)):
            kind = rng.choice(["decode", "prompt", "chunk", "last chunk"])
            num_spec = rng.randint(0, 3) if kind == "decode" else 0
            length = 1 + num_spec if kind == "decode" else rng.randint(1, 12)
            kv_len = 0 if kind == "prompt" else rng.randint(1, 20)
            blocks = -(-(kv_len + length) // bs)
            if blocks > num_blocks:
                continue
            table = rng.sample(range(num_blocks), blocks)
            chunk = [rng.randrange(1, 100) for _ in range(length)]
            samples = kind != "chunk"
            info.add_row(f"r{i}", chunk, kv_len, table, samples, num_spec, is_decoding=kind == "decode")
        rows = [
            f"({n} tokens after {k} computed, blocks {t}, samples {last >= 0}, {s} drafts)"
            for n, k, t, last, s in zip(info.chunk_len, info.kv_len, info.block_tables, info.last_pos, info.num_spec)
        ]
        differential.agree(
            f"build_batch_inputs(rows {rows or '(none)'}, block_size={bs})",
            differential.call(lambda: asdict(build_batch_inputs(info, bs))),
            differential.call(lambda: asdict(book_build(info, bs))),
            meaning="input_ids = the merged chunks; a row's positions run kv_len, kv_len + 1, ... for its chunk_len "
            "tokens; cu_seqlens_q = 0 then the running sum of chunk lengths; seq_lens_k = kv_len + chunk_len; slots "
            "from the block tables (chapter 01's formula); block_tables padded with 0; logits_indices = "
            "info.logits_indices",
        )

    differential.run(check, examples=200)
