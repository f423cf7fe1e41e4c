"""Chapter 07's exercises against the book's own functions, on drawn inputs (exercises/differential.py).

Each test draws inputs across its function's domain (float32 and bfloat16, head sizes, GQA, tensor
parallel ranks, temperatures with greedy rows, top-k and top-p with masked tokens, seeded and
unseeded rows, drafts, multi-byte characters split across tokens, requests with every field at its
neutral value or not, load tests with failures) and compares the function in place with the book's.
Everything here is small: the whole file takes seconds.
"""

from __future__ import annotations

import pytest
import torch

from load_generator import RequestResult, summarize
from vllm_from_scratch.cuda_graph import CUDAGraphRunner, capture_batch_sizes
from vllm_from_scratch.layers.attention import AttentionMetadata
from vllm_from_scratch.layers.layernorm import RMSNorm
from vllm_from_scratch.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from vllm_from_scratch.layers.rotary_embedding import RotaryEmbedding, _llama3_inv_freq
from vllm_from_scratch.openai_protocol import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    REFUSAL_REASONS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingFields,
)
from vllm_from_scratch.output_processor import IncrementalDetokenizer
from vllm_from_scratch.sampler import Sampler, SamplingMetadata, apply_top_k_top_p
from vllm_from_scratch.spec_decoding import RejectionSampler
from vllm_from_scratch.structured_output import GrammarOutput, apply_grammar_bitmask

FLOAT32 = dict(atol=1e-6, rtol=1e-5)


def _generator(rng) -> torch.Generator:
    return torch.Generator().manual_seed(rng.getrandbits(32))


def _logits(rng, rows: int, vocab: int) -> torch.Tensor:
    """Logits without ties (which token of a tie survives a top-k is left open), some already
    masked to -inf by a logits processor, never a whole row."""
    logits = torch.randn(rows, vocab, generator=_generator(rng), dtype=torch.float64) * rng.choice([0.5, 2.0, 8.0])
    logits = logits.float()
    for r in range(rows):
        for v in rng.sample(range(vocab), rng.randint(0, vocab - 1)) if rng.random() < 0.3 else ():
            logits[r, v] = float("-inf")
    return logits


def _top_ks_and_ps(rng, rows: int, vocab: int):
    top_ks = top_ps = None
    if rng.random() < 0.6:  # vocab means "off"
        top_ks = torch.tensor([rng.choice([1, 2, vocab, rng.randint(1, vocab)]) for _ in range(rows)])
    if rng.random() < 0.6:  # 1.0 means "off"
        top_ps = torch.tensor([rng.choice([1.0, 0.01, 0.5, rng.uniform(0.05, 1.0)]) for _ in range(rows)])
    return top_ks, top_ps


def _listed(t: torch.Tensor | None) -> list | None:
    return None if t is None else t.tolist()


def test_apply_top_k_top_p(differential):
    book_fn = differential.book(apply_top_k_top_p)

    def check(rng):
        rows, vocab = rng.randint(0, 4), rng.randint(1, 40)
        # float32, as the engine's LM head returns them: a top-p cut is a comparison of sums,
        # which a 16-bit softmax would move.
        logits = _logits(rng, rows, vocab)
        top_ks, top_ps = _top_ks_and_ps(rng, rows, vocab)
        differential.agree(
            f"apply_top_k_top_p(logits {logits.tolist()}, top_ks={_listed(top_ks)}, top_ps={_listed(top_ps)})",
            differential.call(apply_top_k_top_p, logits.clone(), top_ks, top_ps),
            differential.call(book_fn, logits.clone(), top_ks, top_ps),
            meaning="a token stays when its rank is below top_k and the tokens ranked before it (softmax over what "
            "top-k left) do not yet reach top_p; the most likely token always stays; the rest become -inf",
        )

    differential.run(check, examples=250)


def test_compute_probs(differential):
    book_fn = differential.book(Sampler.compute_probs)

    def check(rng):
        rows, vocab = rng.randint(0, 4), rng.randint(1, 30)
        logits = _logits(rng, rows, vocab).to(rng.choice([torch.float32, torch.bfloat16]))
        temps = torch.tensor([rng.choice([0.0, 1e-6, 0.3, 1.0, 1.7, rng.uniform(0.05, 3.0)]) for _ in range(rows)])
        top_ks, top_ps = _top_ks_and_ps(rng, rows, vocab)
        differential.agree(
            f"Sampler.compute_probs(logits {logits.tolist()} ({logits.dtype}), temperatures={temps.tolist()}, "
            f"top_ks={_listed(top_ks)}, top_ps={_listed(top_ps)})",
            differential.call(Sampler.compute_probs, logits.clone(), temps, top_ks, top_ps),
            differential.call(book_fn, logits.clone(), temps, top_ks, top_ps),
            meaning="temperatures below 1e-5 are greedy: a one-hot row on the argmax; other rows are softmax(logits "
            "/ temperature) after the top-k / top-p mask, in float32",
            **FLOAT32,
        )

    differential.run(check, examples=200)


def test_sample_from_probs(differential):
    book_fn = differential.book(Sampler.sample_from_probs)

    def check(rng):
        rows, vocab = rng.randint(0, 5), rng.randint(1, 30)
        probs = Sampler.compute_probs(_logits(rng, rows, vocab), torch.ones(rows))
        for r in range(rows):
            if rng.random() < 0.2:  # a greedy row
                probs[r] = torch.nn.functional.one_hot(probs[r].argmax(), vocab).float()
            if rng.random() < 0.2:  # a row that does not sum to one: the draw scales u by its total
                probs[r] *= rng.uniform(0.2, 3.0)
        seeds = [rng.choice([None, rng.getrandbits(32)]) for _ in range(rows)]
        with_generators = rng.random() < 0.7
        torch_seed = rng.getrandbits(32)

        def draw(fn):
            torch.manual_seed(torch_seed)  # unseeded rows draw from the default generator
            gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
            return differential.call(fn, probs.clone(), gens if with_generators else None)

        yours, book = draw(Sampler.sample_from_probs), draw(book_fn)
        seeded = [r for r, s in enumerate(seeds) if s is not None and with_generators]
        if yours.error is None and book.error is None and yours.value.shape == book.value.shape:
            # An unseeded row's draw is the default generator's, however it is used: it only has to
            # be a token of positive probability. A seeded row's is fixed by its own generator.
            drawn = yours.value
            for r in range(rows):
                if r not in seeded and 0 <= int(drawn[r]) < vocab and probs[r, int(drawn[r])] > 0:
                    drawn[r] = book.value[r]
        differential.agree(
            f"Sampler.sample_from_probs(probs {probs.tolist()}, generators {seeds if with_generators else None})",
            yours,
            book,
            meaning="the first token whose cumulative probability reaches u times the row's total, u = 1 - "
            "uniform_noise(...) in (0, 1]: a seeded row's u from its own generator, so the batch cannot change it, "
            "and never a token of probability 0",
        )

    differential.run(check, examples=200)


def test_rmsnorm_forward(differential):
    BookNorm = differential.twin(RMSNorm, "forward")

    def check(rng):
        hidden, dtype = rng.choice([1, 7, 16, 64, 576]), rng.choice([torch.float32, torch.bfloat16])
        eps = rng.choice([1e-6, 1e-5, 0.1])
        gen = _generator(rng)
        shape = rng.choice([(rng.randint(0, 6), hidden), (rng.randint(1, 4), rng.randint(1, 3), hidden)])
        x = (torch.randn(shape, generator=gen) * rng.choice([0.01, 1.0, 30.0])).to(dtype)
        residual = torch.randn(shape, generator=gen).to(dtype) if rng.random() < 0.5 else None
        weight = torch.randn(hidden, generator=gen)
        norms = [RMSNorm(hidden, eps).to(dtype), BookNorm(hidden, eps).to(dtype)]
        for norm in norms:
            norm.weight.data.copy_(weight)
        args = (x.clone(),) if residual is None else (x.clone(), residual.clone())
        differential.agree(
            f"RMSNorm({hidden}, eps={eps}) in {dtype} on x of shape {list(shape)}"
            f"{' with a residual' if residual is not None else ''}",
            differential.call(norms[0], *args),
            differential.call(norms[1], *(a.clone() for a in args)),
            meaning="x (plus the residual, first) * rsqrt(mean(x^2) + eps), normalized in float32 and rounded to "
            "x's dtype, then times the weight in x's dtype (bit for bit what transformers computes); with a residual "
            "the result is (normed, x + residual)",
            **(FLOAT32 if dtype == torch.float32 else {}),
        )

    differential.run(check, examples=200)


def _rope_settings(rng):
    head_size = rng.choice([2, 8, 16, 64, 128])
    base = rng.choice([10000.0, 500000.0, 1e6])
    scaling = None
    if rng.random() < 0.5:
        low = rng.choice([1.0, 0.5, 2.0])
        scaling = {
            "rope_type": "llama3",
            "factor": rng.choice([2.0, 8.0, 32.0]),
            "original_max_position_embeddings": rng.choice([64, 1024, 8192]),
        }
        if rng.random() < 0.7:  # else the defaults 1 and 4
            scaling |= {"low_freq_factor": low, "high_freq_factor": low * rng.choice([2.0, 4.0])}
    return head_size, base, scaling


def test_llama3_inv_freq(differential):
    book_fn = differential.book(_llama3_inv_freq)

    def check(rng):
        head_size, base, scaling = _rope_settings(rng)
        scaling = scaling or {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
        inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size))
        differential.agree(
            f"_llama3_inv_freq(inv_freq of head size {head_size}, base {base}, scaling={scaling})",
            differential.call(_llama3_inv_freq, inv_freq.clone(), dict(scaling)),
            differential.call(book_fn, inv_freq.clone(), dict(scaling)),
            meaning="wavelength 2*pi / inv_freq: longer than original_max_position_embeddings / low_freq_factor "
            "divided by factor, shorter than .../ high_freq_factor kept, and in between interpolated by "
            "smooth = (original_max / wavelength - low) / (high - low)",
            atol=0.0,
            rtol=1e-6,
        )

    differential.run(check, examples=200)


def test_rotary_embedding_forward(differential):
    BookRope = differential.twin(RotaryEmbedding, "forward")

    def check(rng):
        head_size, base, scaling = _rope_settings(rng)
        max_position = rng.choice([16, 300])
        ropes = [
            RotaryEmbedding(head_size, max_position, base, scaling),
            BookRope(head_size, max_position, base, scaling),
        ]
        tokens, q_heads, kv_heads = rng.randint(0, 6), rng.choice([1, 2, 4]), rng.choice([1, 2])
        dtype = rng.choice([torch.float32, torch.bfloat16])
        gen = _generator(rng)
        positions = torch.randint(0, max_position, (tokens,), generator=gen)
        flat = rng.random() < 0.7  # [T, heads * head_size], or [T, heads, head_size]
        q = torch.randn(tokens, q_heads, head_size, generator=gen).to(dtype)
        k = torch.randn(tokens, kv_heads, head_size, generator=gen).to(dtype)
        if flat:
            q, k = q.flatten(1), k.flatten(1)
        differential.agree(
            f"RotaryEmbedding({head_size}, {max_position}, {base}, {scaling}).forward(positions={positions.tolist()}, "
            f"q {list(q.shape)}, k {list(k.shape)}, {dtype})",
            differential.call(ropes[0], positions, q.clone(), k.clone()),
            differential.call(ropes[1], positions, q.clone(), k.clone()),
            meaning="each head's two halves rotated by the angles of its token's own position: cos and sin read "
            "from self.cos_sin_cache[positions] in q's dtype; q and k keep their shapes",
            **(FLOAT32 if dtype == torch.float32 else {}),
        )

    differential.run(check, examples=200)


def _tp(rng) -> tuple[int, int]:
    tp_size = rng.choice([1, 1, 2, 4])
    return rng.randrange(tp_size), tp_size


def test_qkv_weight_loader(differential):
    BookQKV = differential.twin(QKVParallelLinear, "weight_loader")

    def check(rng):
        tp_rank, tp_size = _tp(rng)
        head_size, hidden = rng.choice([1, 2, 8]), rng.choice([3, 8])
        kv_heads = tp_size * rng.randint(1, 2)
        heads = kv_heads * rng.choice([1, 2, 3])
        bias = rng.random() < 0.5
        layers = [cls(hidden, head_size, heads, kv_heads, bias, tp_rank=tp_rank, tp_size=tp_size) for cls in
                  (QKVParallelLinear, BookQKV)]  # fmt: skip
        for layer in layers:
            for p in layer.parameters():
                p.data.fill_(-7)
        gen = _generator(rng)
        shards = rng.sample(["q", "k", "v"], rng.randint(1, 3)) + (["x"] if rng.random() < 0.1 else [])
        for shard in shards:
            rows = (heads if shard == "q" else kv_heads) * head_size
            weight = torch.randn(rows, hidden, generator=gen)
            b = torch.randn(rows, generator=gen)
            for param, loaded in [("weight", weight)] + ([("bias", b)] if bias else []):
                differential.agree(
                    f"QKVParallelLinear(hidden {hidden}, head {head_size}, {heads} q heads, {kv_heads} kv heads, "
                    f"tp_rank {tp_rank} of {tp_size}).weight_loader({param}, checkpoint {shard} {list(loaded.shape)}, "
                    f"{shard!r}) after loading {shards[: shards.index(shard)]}",
                    *(differential.call(layer.weight_loader, getattr(layer, param), loaded, shard) for layer in layers),
                    meaning="the fused output rows hold this rank's q heads, then its k heads, then its v heads; "
                    "shard s of the checkpoint is narrowed to this rank's heads (rows tp_rank * size ...) and copied "
                    "to its offset; a shard id other than 'q', 'k', 'v' is a ValueError",
                    state=tuple(getattr(layer, param).data for layer in layers),
                )

    differential.run(check, examples=150)


def test_merged_weight_loader(differential):
    BookMerged = differential.twin(MergedColumnParallelLinear, "weight_loader")

    def check(rng):
        tp_rank, tp_size = _tp(rng)
        sizes = [tp_size * rng.randint(1, 3) for _ in range(rng.choice([2, 2, 3]))]
        hidden, bias = rng.choice([2, 5]), rng.random() < 0.5
        layers = [cls(hidden, sizes, bias, tp_rank=tp_rank, tp_size=tp_size) for cls in (MergedColumnParallelLinear,
                  BookMerged)]  # fmt: skip
        for layer in layers:
            for p in layer.parameters():
                p.data.fill_(-7)
        gen = _generator(rng)
        order = rng.sample(range(len(sizes)), len(sizes)) + ([None] if rng.random() < 0.1 else [])
        for part in order:
            rows = sizes[part] if part is not None else sizes[0]
            for param in ["weight"] + (["bias"] if bias else []):
                loaded = torch.randn(rows, hidden, generator=gen) if param == "weight" else torch.randn(rows)
                differential.agree(
                    f"MergedColumnParallelLinear(hidden {hidden}, output_sizes={sizes}, tp_rank {tp_rank} of "
                    f"{tp_size}).weight_loader({param}, checkpoint part {list(loaded.shape)}, {part})",
                    *(differential.call(layer.weight_loader, getattr(layer, param), loaded, part) for layer in layers),
                    meaning="part i starts at sum(output_sizes[:i]) // tp_size of the fused rows and holds this rank's "
                    "slice (rows tp_rank * size ...) of the checkpoint's part; None is a ValueError",
                    state=tuple(getattr(layer, param).data for layer in layers),
                )

    differential.run(check, examples=150)


def test_verify_drafts(differential):
    # verify_drafts reads neither the device's kernel choice nor the vocabulary size: the CPU's.
    samplers = [
        cls(torch.device("cpu"), 1 << 20)
        for cls in (RejectionSampler, differential.twin(RejectionSampler, "verify_drafts"))
    ]

    def check(rng):
        vocab = rng.randint(2, 20)
        request_ids, drafts, seeds, temps = [], [], [], []
        for i in range(rng.randint(1, 5)):
            k = rng.choice([0, 0, rng.randint(1, 3)])
            request_ids.append(f"r{i}")
            drafts.append([rng.randrange(vocab) for _ in range(k)])
            seeds.append(rng.choice([None, rng.getrandbits(32)]))
            temps += [rng.choice([0.0, 0.7, 1.0])] * (k + 1)
        logits = _logits(rng, len(temps), vocab)
        row = 0
        for request_drafts in drafts:  # drafts the target often agrees with
            for token in request_drafts:
                if rng.random() < 0.5:
                    logits[row, token] = 20.0
                row += 1
            row += 1
        torch_seed = rng.getrandbits(32)

        def verify(sampler):
            torch.manual_seed(torch_seed)
            gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
            row_gens = [g for g, d in zip(gens, drafts) for _ in range(len(d) + 1)] if any(gens) else None
            metadata = SamplingMetadata(torch.tensor(temps), None, None, row_gens, list(request_ids), gens)
            return differential.call(sampler.verify_drafts, logits.clone(), metadata, drafts)

        differential.agree(
            f"verify_drafts of requests {request_ids} with drafts {drafts}, temperatures {temps}, seeds {seeds}",
            verify(samplers[0]),
            verify(samplers[1]),
            meaning="sampling request i owns k_i + 1 consecutive logits rows; one rejection_sampler call on the "
            "padded [B, K+1, V] targets with self.rejection_noise (seeded requests from their generators) keeps "
            "each request's accepted drafts plus one token",
        )

    differential.run(check, examples=120)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from vllm_from_scratch import default_model_dir

    return AutoTokenizer.from_pretrained(default_model_dir())


PIECES = ["Déjà", " vu", ": ", "東京", " 🙂", "naïve", " the", " end", "\n", "ß", "€", "🇫🇷", "…", "x"]


def test_incremental_detokenizer_update(differential, tokenizer):
    BookDetok = differential.twin(IncrementalDetokenizer, "update")

    def check(rng):
        prompt = tokenizer.encode("".join(rng.choice(PIECES) for _ in range(rng.randint(0, 4))) or "Hi")
        output = tokenizer.encode("".join(rng.choice(PIECES) for _ in range(rng.randint(1, 8))))
        if rng.random() < 0.3:
            output.insert(rng.randrange(len(output) + 1), tokenizer.eos_token_id)
        skip = rng.random() < 0.8
        detoks = [IncrementalDetokenizer(tokenizer, prompt, skip), BookDetok(tokenizer, prompt, skip)]
        seen = 0
        while seen < len(output):
            seen = min(len(output), seen + rng.choice([1, 1, 1, 2, 4]))  # drafts add several tokens at once
            differential.agree(
                f"IncrementalDetokenizer(prompt {prompt}, skip_special_tokens={skip}).update(prompt + {output[:seen]})",
                *(differential.call(d.update, prompt + output[:seen]) for d in detoks),
                meaning="text is released once the decoded window no longer ends in U+FFFD (half a character), "
                "decoding a few tokens of left context; prefix_offset and read_offset then move on",
                state=tuple({"text": d.text, "offsets": (d.prefix_offset, d.read_offset)} for d in detoks),
            )

    differential.run(check, examples=120)


def test_apply_grammar_bitmask(differential):
    book_fn = differential.book(apply_grammar_bitmask)

    def applied(fn, logits, *args):
        fn(logits, *args)
        return logits

    def check(rng):
        vocab = rng.choice([1, 31, 32, 33, 64, rng.randint(1, 100)])
        num_rows = [rng.randint(0, 3) for _ in range(rng.randint(1, 5))]
        ids = [f"req-{i}" for i in range(len(num_rows))]
        masked = [(rid, n) for rid, n in zip(ids, num_rows) if n and rng.random() < 0.6]
        rng.shuffle(masked)  # the engine lists the constrained requests in its own order
        words = (vocab + 31) // 32
        bitmask = torch.tensor(
            [[rng.getrandbits(32) - 2**31 for _ in range(words)] for _, n in masked for _ in range(n)],
            dtype=torch.int32,
        ).reshape(-1, words)
        output = GrammarOutput([rid for rid, _ in masked], [n for _, n in masked], bitmask)
        logits = _logits(rng, sum(num_rows), vocab)
        differential.agree(
            f"apply_grammar_bitmask(logits {logits.tolist()}, masks of {masked} {bitmask.tolist()}, {ids}, {num_rows})",
            differential.call(applied, apply_grammar_bitmask, logits.clone(), output, ids, num_rows),
            differential.call(applied, book_fn, logits.clone(), output, ids, num_rows),
            meaning="request i owns num_rows[i] consecutive logits rows; each masked request's rows take its mask rows "
            "in order; token t is refused (-inf) when bit t % 32 of word t // 32 is 0; other rows are untouched",
        )

    differential.run(check, examples=200)


def test_capture_batch_sizes(differential):
    book_fn = differential.book(capture_batch_sizes)

    def check(rng):
        n = rng.choice([1, 2, 3, 8, 9, 15, 16, 17, 512, 513, rng.randint(1, 1100), 0, -3, 2.5, "8", None])
        differential.agree(
            f"capture_batch_sizes({n!r})",
            differential.call(capture_batch_sizes, n),
            differential.call(book_fn, n),
            meaning="1, 2, 4, 8, then every 16 below min(max_num_seqs, 512), then that maximum itself; anything "
            "but an int >= 1 is a ValueError",
        )

    differential.run(check, examples=150)


class _RecordingModel(torch.nn.Module):
    """Returns a function of every input row, and keeps everything the replay fed it."""

    def forward(self, input_ids, positions, md: AttentionMetadata):
        self.seen = {
            "input_ids": input_ids.clone(),
            "positions": positions.clone(),
            "slot_mapping": md.slot_mapping.clone(),
            "seq_lens_k": md.seq_lens_k.clone(),
            "block_tables": md.block_tables.clone(),
        }
        row = input_ids * 1000 + positions * 10 + md.seq_lens_k + md.block_tables.sum(-1)
        return row.float().unsqueeze(-1).expand(-1, 3)


def _replay(runner: CUDAGraphRunner, ids, positions, md) -> torch.Tensor:
    return runner.run(ids, positions, md).clone()  # a view of the output buffer until the next replay


def test_cuda_graph_runner_run(differential):
    BookRunner = differential.twin(CUDAGraphRunner, "run")

    def check(rng):
        max_num_seqs, block_size = rng.randint(1, 40), rng.choice([2, 8])
        max_model_len = block_size * rng.randint(1, 6)
        models = [_RecordingModel(), _RecordingModel()]
        runners = [
            cls(model, max_num_seqs, max_model_len, block_size, 3, torch.float32, "cpu", use_cuda_graph=False)
            for cls, model in zip((CUDAGraphRunner, BookRunner), models)
        ]
        for runner in runners:
            runner.capture()
        gen = _generator(rng)
        history = []
        for _ in range(rng.randint(1, 4)):  # replays of different sizes and widths: no leftovers may leak
            n = rng.randint(1, max_num_seqs)
            width = rng.randint(1, runners[1].max_num_blocks)
            positions = torch.randint(0, max_model_len, (n,), generator=gen)
            md = AttentionMetadata(
                slot_mapping=torch.randint(0, 500, (n,), generator=gen),
                cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32),
                seq_lens_k=(positions + 1).int(),
                block_tables=torch.randint(0, 50, (n, width), generator=gen).int(),
                max_seqlen_q=1,
                max_seqlen_k=int(positions.max()) + 1,
            )
            ids = torch.randint(0, 100, (n,), generator=gen)
            history.append(f"run({n} requests, block tables {width} wide)")
            outs = [differential.call(_replay, r, ids, positions, md) for r in runners]
            differential.agree(
                f"CUDAGraphRunner(max_num_seqs={max_num_seqs}, max_model_len={max_model_len}, block_size="
                f"{block_size}, captured {runners[1].batch_sizes}): " + " -> ".join(history),
                *outs,
                meaning="the smallest captured size >= n is replayed on the static buffers: rows past n are padding "
                "(slot -1, context length 1), block-table columns past this batch's width are 0, and the first n rows "
                "of the output come back",
                state=tuple(getattr(m, "seen", None) for m in models),
            )

    differential.run(check, examples=120)


def _request_body(rng, known: dict, endpoint: type) -> dict:
    """A body with some known fields at a neutral value, null, or something else, an unknown field
    now and then, and stream / stream_options in every combination."""
    body: dict = (
        {"prompt": "Hi"} if endpoint is CompletionRequest else {"messages": [{"role": "user", "content": "Hi"}]}
    )
    declared = set(endpoint.model_fields)
    for name in rng.sample(sorted(known), rng.randint(0, 6)):
        if name in ("prompt", "messages", "stream", "stream_options"):
            continue
        neutral = known[name]
        if name in declared:  # a declared field must validate: null or its default
            body[name] = rng.choice([None, endpoint.model_fields[name].default])
        else:
            choices = [None, *neutral, 0, 1, 2, True, False, "x", {}, [], {"type": "json_object"}, 1.0, 0.5]
            body[name] = rng.choice(choices)
    if rng.random() < 0.15:
        body[rng.choice(["temprature", "beam_width", "max_new_tokens"])] = 1
    if rng.random() < 0.4:
        body["stream"] = rng.choice([True, False, None])
    if rng.random() < 0.3:
        body["stream_options"] = rng.choice([None, {"include_usage": True}])
    return body


def _refusal(fn, request) -> tuple | None:
    """What a check did: nothing, or an APIError's field, code and whether it gave the field's reason."""
    try:
        fn(request)
    except APIError as exc:
        return (
            "APIError",
            exc.param,
            exc.code,
            exc.param in REFUSAL_REASONS and str(exc).endswith(REFUSAL_REASONS[exc.param]),
        )
    return None


def _check_protocol(differential, rng, endpoint, yours, book, what: str):
    known = COMPLETION_FIELDS if endpoint is CompletionRequest else CHAT_FIELDS
    body = _request_body(rng, known, endpoint)
    try:
        request = endpoint.model_validate(body)
    except Exception:  # a value the model's own types refuse (a 400 before any check): not this exercise's
        return
    differential.agree(
        f"{endpoint.__name__}({body}).check_supported()",
        differential.call(_refusal, yours, request),
        differential.call(_refusal, book, request),
        meaning=what,
    )


SHARED_CHECKS = (
    "a field this endpoint's KNOWN_FIELDS lacks is refused (code unknown_field); a known field that is neither "
    "declared, nor an engine field, nor identifying must be null or neutral, else refused naming it (with its "
    "REFUSAL_REASONS entry); stream_options needs stream"
)


def test_check_supported_sampling(differential):
    book_fn = differential.book(_SamplingFields.check_supported)

    def check(rng):
        endpoint = rng.choice([CompletionRequest, ChatCompletionRequest])
        _check_protocol(differential, rng, endpoint, lambda r: r.check_supported(), book_fn, SHARED_CHECKS)

    differential.run(check, examples=250)


def test_check_supported_completion(differential):
    book_fn = differential.book(CompletionRequest.check_supported)

    def check(rng):
        _check_protocol(
            differential, rng, CompletionRequest, CompletionRequest.check_supported, book_fn,
            "a completion request runs the shared checks against its own table (best_of, suffix, prompt_embeds "
            "included): " + SHARED_CHECKS,
        )  # fmt: skip

    differential.run(check, examples=250)


def test_summarize(differential):
    book_fn = differential.book(summarize)

    def check(rng):
        results = []
        for _ in range(rng.randint(0, 8)):
            ok = rng.random() < 0.8
            out = rng.choice([0, 1, 2, rng.randint(1, 40)]) if ok else 0
            ttft = rng.uniform(0.001, 2.0)
            itl = [rng.uniform(0.001, 0.2) for _ in range(max(0, out - 1))]
            results.append(
                RequestResult(
                    ok=ok,
                    error="" if ok else rng.choice(["timeout", "HTTP 500", "connection reset"]),
                    prompt_tokens=rng.randint(1, 100),
                    output_tokens=out,
                    ttft=ttft if ok else 0.0,
                    e2e=ttft + sum(itl) + rng.uniform(0, 0.01) if ok else 0.0,
                    itl=itl,
                )
            )
        duration = rng.uniform(0.5, 30.0)
        differential.agree(
            f"summarize({len(results)} results: {sum(r.ok for r in results)} ok, output tokens "
            f"{[r.output_tokens for r in results]}, duration={duration:.3g})",
            differential.call(summarize, results, duration),
            differential.call(book_fn, results, duration),
            meaning="over successful requests only: throughputs per second of duration, and mean / median / p99 "
            "(linear interpolation) of TTFT, TPOT = (e2e - TTFT) / (output tokens - 1) for requests with more than "
            "one token, and every inter-token latency, in ms (NaN when there are none)",
            atol=1e-9,
            rtol=1e-9,
        )

    differential.run(check, examples=200)


class _StandInAttention(torch.nn.Module):
    """Attention's place in a decoder layer: a fixed linear mix of each token plus its position, so
    that what two layers compare is the layer's own arithmetic (norms, branch scales, residuals)."""

    def __init__(self, config, **tp):
        super().__init__()
        self.mix = torch.nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, positions, hidden_states, attn_metadata):
        return self.mix(hidden_states) + 0.01 * positions[:, None].to(hidden_states.dtype)


def test_minicpm_decoder_layer_forward(differential):
    from transformers import LlamaConfig

    from vllm_from_scratch.models.minicpm import MiniCPMDecoderLayer

    BookLayer = differential.twin(MiniCPMDecoderLayer, "forward")

    def check(rng):
        hidden, dtype = rng.choice([8, 16, 32]), rng.choice([torch.float32, torch.bfloat16])
        config = LlamaConfig(
            hidden_size=hidden, intermediate_size=rng.choice([8, 24, 64]), num_attention_heads=2,
            num_key_value_heads=rng.choice([1, 2]), num_hidden_layers=rng.randint(1, 62), vocab_size=32,
            rms_norm_eps=rng.choice([1e-6, 1e-5]), hidden_act="silu",
        )  # fmt: skip
        config.scale_depth = rng.choice([1.0, 1.4, 12.0])
        gen = _generator(rng)
        layers = [MiniCPMDecoderLayer(config, _StandInAttention), BookLayer(config, _StandInAttention)]
        weights = [torch.randn(p.shape, generator=gen) * 0.3 for p in layers[0].parameters()]
        for layer in layers:
            for p, w in zip(layer.parameters(), weights):
                p.data.copy_(w)
            layer.to(dtype)
        tokens = rng.randint(0, 6)
        positions = torch.tensor([rng.randrange(0, 4096) for _ in range(tokens)], dtype=torch.long)
        x = (torch.randn(tokens, hidden, generator=gen) * rng.choice([0.1, 1.0, 20.0])).to(dtype)
        residual = torch.randn(tokens, hidden, generator=gen).to(dtype) if rng.random() < 0.5 else None
        with torch.no_grad():
            outcomes = [
                differential.call(layer, positions, x.clone(), None if residual is None else residual.clone(), None)
                for layer in layers
            ]
        differential.agree(
            f"MiniCPMDecoderLayer.forward({tokens} tokens, hidden {hidden}, {dtype}, "
            f"{config.num_hidden_layers} layers, scale_depth {config.scale_depth}"
            f"{', with a residual' if residual is not None else ', first layer (no residual)'})",
            *outcomes,
            meaning="Llama's layer with each branch (attention, then MLP) scaled by scale_depth / "
            "sqrt(num_hidden_layers) as it leaves: the fused norms then add residual + scale * branch; returns "
            "(the MLP branch scaled, the residual)",
            **(FLOAT32 if dtype == torch.float32 else {}),
        )

    differential.run(check, examples=80)
