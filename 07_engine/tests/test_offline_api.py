"""vLLM's offline API on the embedded default model: ``LLM(model=...)``, ``generate`` with vLLM's
prompt types and ``RequestOutput`` results, ``chat``, ``get_tokenizer``, and the book's dict
shorthand (``out["text"]``) beside them.

One ``LLM`` serves the whole file (seconds to build); every test leaves its blocks free.
"""

from __future__ import annotations

import pytest

from vllm_from_scratch import LLM, CompletionOutput, RequestOutput, SamplingParams, default_model_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def llm():
    llm = LLM(
        model=default_model_dir(),
        dtype="float32",
        num_kvcache_blocks=64,
        max_model_len=512,
        warm_up=False,
        enforce_eager=True,
    )
    yield llm
    llm.shutdown()


@pytest.fixture(autouse=True)
def no_leak(llm):
    yield
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.block_manager.all_blocks_free()


def test_vllm_quickstart_runs_verbatim(llm, capsys):
    # https://docs.vllm.ai/en/latest/getting_started/quickstart.html, with this book's model
    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")

    printed = capsys.readouterr().out
    assert [o.prompt for o in outputs] == prompts
    assert all(f"Prompt: {p!r}" in printed for p in prompts)
    for output in outputs:
        assert isinstance(output, RequestOutput) and output.finished
        (completion,) = output.outputs
        assert isinstance(completion, CompletionOutput) and completion.index == 0
        assert completion.token_ids and completion.finish_reason in ("stop", "length")
        assert output.prompt_token_ids == llm.get_tokenizer().encode(output.prompt)
        assert output.prompt_logprobs is None and completion.logprobs is None and completion.cumulative_logprob is None


def test_vllm_chat_example_answers_paris(llm):
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    outputs = llm.chat(conversation, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    (output,) = outputs
    assert "Paris" in output.outputs[0].text, output.outputs[0].text
    # The server's rendering (one function), and the rendered text is the output's prompt.
    assert output.prompt == llm.get_tokenizer().apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    )
    assert output.prompt.endswith("<|im_start|>assistant\n")
    assert output.outputs[0].finish_reason == "stop" and output.outputs[0].stop_reason is None  # EOS
    assert output.outputs[0].token_ids[-1] in llm.llm_engine.eos_token_ids


def test_chat_batch_and_its_options(llm):
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    one = llm.chat(ask, GREEDY, use_tqdm=False)[0]
    batch = llm.chat([ask, [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]], GREEDY, use_tqdm=False)
    assert len(batch) == 2 and batch[0].outputs[0].token_ids == one.outputs[0].token_ids
    assert "<|im_start|>user\nHi<|im_end|>" in batch[1].prompt
    # continue_final_message leaves the assistant's turn open for the model to go on with.
    opened = ask + [{"role": "assistant", "content": "The capital of France is"}]
    out = llm.chat(opened, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt.endswith("The capital of France is") and "Paris" in out.outputs[0].text
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(opened, GREEDY, continue_final_message=True)  # add_generation_prompt defaults to True
    for bad in ([], [{"content": "no role"}], "Hi", [[]]):
        with pytest.raises(ValueError, match="messages"):
            llm.chat(bad, GREEDY, use_tqdm=False)


def test_every_vllm_prompt_type(llm):
    tok = llm.get_tokenizer()
    text = "The capital of France is"
    ids = tok.encode(text)
    ref = llm.generate(text, GREEDY, use_tqdm=False)[0]
    for prompts, n, shown in [
        (text, 1, text),
        ([text, text], 2, text),
        (ids, 1, None),
        ([ids, ids], 2, None),
        ({"prompt": text}, 1, text),
        ({"prompt_token_ids": ids}, 1, None),
        ([{"prompt": text}, {"prompt_token_ids": ids}], 2, None),
        ({"prompt_token_ids": ids, "prompt": text}, 1, text),  # a TokensPrompt may carry its text
        ((text, ids), 2, None),
    ]:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert len(outs) == n, prompts
        assert all(o.outputs[0].token_ids == ref.outputs[0].token_ids for o in outs), prompts
        assert all(o.prompt_token_ids == ids for o in outs), prompts
        assert outs[-1].prompt == shown, prompts


def test_a_prompt_dict_is_a_prompt_not_its_keys(llm):
    # Once, {"prompt": ...} was iterated into its key and generated for the literal "prompt".
    out = llm.generate({"prompt": "The capital of France is"}, GREEDY, use_tqdm=False)
    assert len(out) == 1 and out[0].prompt == "The capital of France is"
    assert out[0].prompt_token_ids != llm.get_tokenizer().encode("prompt")


@pytest.mark.parametrize(
    "prompts",
    [
        None,
        42,
        [],
        [None],
        ["ok", 3.5],
        [[1, "a"]],
        [[True, False]],
        {"text": "hi"},
        {"prompt": 5},
        {"prompt_token_ids": "abc"},
        {"prompt": "hi", "multi_modal_data": {}},
        [{"prompt": "hi"}, {}],
    ],
)
def test_bad_prompts_raise_naming_prompts(llm, prompts):
    with pytest.raises(ValueError, match="^prompts"):
        llm.generate(prompts, GREEDY, use_tqdm=False)


def test_the_books_dict_shorthand(llm):
    prompt = "Paris is the capital and largest city of France. " * 6  # some full KV blocks
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out["text"] == out.outputs[0].text and out["token_ids"] == out.outputs[0].token_ids
    assert out["num_cached_tokens"] == out.num_cached_tokens
    assert dict(out) == {"text": out["text"], "token_ids": out["token_ids"], "num_cached_tokens": out.num_cached_tokens}
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again["num_cached_tokens"] > 0  # the prompt's full blocks are prefix-cache hits now
    with pytest.raises(KeyError, match="shorthand"):
        out["finish_reason"]


def test_sampling_params_one_per_prompt(llm):
    prompts = ["The capital of France is", "Hello, my name is"]
    outs = llm.generate(prompts, sampling_params=[GREEDY, SamplingParams(temperature=0.0, max_tokens=3)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 3]
    assert outs[1].outputs[0].finish_reason == "length" and outs[1].outputs[0].stop_reason is None
    for params in ([GREEDY], [GREEDY] * 3):
        with pytest.raises(ValueError, match="^sampling_params has"):
            llm.generate(prompts, params, use_tqdm=False)
    with pytest.raises(ValueError, match="^sampling_params"):
        llm.generate(prompts, {"temperature": 0.0}, use_tqdm=False)


def test_priority_is_a_list_one_per_prompt(llm):
    prompts = ["The capital of France is", "Hello, my name is"]
    assert len(llm.generate(prompts, GREEDY, use_tqdm=False, priority=[1, 0])) == 2
    for priority in (0, [0], [0, 0, 0]):
        with pytest.raises(ValueError, match="^priority"):
            llm.generate(prompts, GREEDY, use_tqdm=False, priority=priority)
    with pytest.raises(ValueError, match="^priority"):
        llm.generate("Hi", GREEDY, use_tqdm=False, priority=0)  # vLLM's type: a list even for one


def test_finish_and_stop_reasons(llm):
    prompt = "The capital of France is"
    ref = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert (ref.finish_reason, ref.stop_reason) == ("length", None)

    stop_id = ref.token_ids[3]
    by_token = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id]))
    got = by_token[0].outputs[0]
    assert (got.finish_reason, got.stop_reason) == ("stop", stop_id)
    assert got.token_ids == ref.token_ids[: ref.token_ids.index(stop_id) + 1]  # the stop token is kept
    tokenizer = llm.get_tokenizer()
    assert got.text == tokenizer.decode(got.token_ids[:-1])  # but its text is not, as in vLLM
    kept = llm.generate(
        prompt,
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == tokenizer.decode(got.token_ids)

    word = ref.text.split()[2]
    by_string = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, stop=["zzz-never", word]))
    got = by_string[0].outputs[0]
    assert (got.finish_reason, got.stop_reason) == ("stop", word)
    assert got.text == ref.text[: ref.text.index(word)]  # cut before the stop string
    with_stop = llm.generate(
        prompt,
        SamplingParams(temperature=0.0, max_tokens=12, stop=[word], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert with_stop.text == ref.text[: ref.text.index(word) + len(word)]
    with pytest.raises(ValueError, match="^include_stop_str_in_output"):
        SamplingParams(include_stop_str_in_output="yes")


def test_greedy_tokens_are_the_engine_loops(llm):
    # The old generate drove add_request/step and returned dicts; the objects carry the same tokens.
    prompts = ["The capital of France is", "Hello, my name is", "The future of AI is"]
    engine = llm.llm_engine
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == [finished[i].outputs[0].token_ids for i in ids]
    assert [o.outputs[0].text for o in outs] == [finished[i].outputs[0].text for i in ids]


def test_positional_model_and_get_tokenizer(llm):
    assert llm.get_tokenizer() is llm.llm_engine.tokenizer is not None
    with pytest.raises(TypeError):
        LLM()  # type: ignore[call-arg]  # the model is required, by position or as model=


def test_skip_special_tokens_decides_whether_eos_text_shows(llm):
    eos = llm.get_tokenizer().eos_token_id
    forced = dict(temperature=0.0, max_tokens=2, ignore_eos=True, logit_bias={eos: 100.0})
    skipped, kept = (
        llm.generate("Hi", SamplingParams(**forced, skip_special_tokens=skip), use_tqdm=False)[0].outputs[0]
        for skip in (True, False)
    )
    assert skipped.token_ids == kept.token_ids == [eos, eos]
    assert skipped.text == "", "vLLM's default leaves special tokens out of the text"
    assert kept.text == llm.get_tokenizer().eos_token * 2


def test_truncate_prompt_tokens_keeps_the_prompts_end(llm):
    prompt = list(range(300, 340))
    short = llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=4, truncate_prompt_tokens=6), use_tqdm=False
    )
    alone = llm.generate(prompt[-6:], GREEDY, use_tqdm=False)
    assert short[0].prompt_token_ids == prompt[-6:]
    assert short[0].outputs[0].token_ids == alone[0].outputs[0].token_ids[:4]
    whole = llm.generate(prompt, SamplingParams(max_tokens=1, truncate_prompt_tokens=-1), use_tqdm=False)
    assert whole[0].prompt_token_ids == prompt, "-1 keeps up to max_model_len tokens"
    for bad in (0, -2, 513, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            llm.generate(prompt, SamplingParams(max_tokens=1, truncate_prompt_tokens=bad), use_tqdm=False)


def _contains(tokens: list[int], sequence: list[int]) -> bool:
    return any(tokens[i : i + len(sequence)] == sequence for i in range(len(tokens) - len(sequence) + 1))


def test_bad_words_are_never_generated(llm):
    prompt = "The capital of France is"
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    words = free.text.split()[:2]  # what greedy decoding says first, which must now be avoided
    params = SamplingParams(temperature=0.0, max_tokens=8, bad_words=words)
    (out,) = llm.generate(prompt, params, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    sequences = llm.llm_engine.input_processor.tokenize_bad_words(words)
    for word in words:  # vLLM's rule: the word alone, and after a space where that tokenizes differently
        alone = tokenizer.encode(word, add_special_tokens=False)
        spaced = tokenizer.encode(" " + word, add_special_tokens=False)
        assert alone in sequences and (spaced in sequences) == (spaced[0] != alone[0] and len(spaced) == len(alone))
    assert out.outputs[0].token_ids != free.token_ids
    assert not any(_contains(out.outputs[0].token_ids, s) for s in sequences), (words, out.outputs[0].text)
    # A batch mixing the rule with plain rows: the plain row is untouched.
    mixed = llm.generate([prompt, prompt], [params, SamplingParams(temperature=0.0, max_tokens=8)], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == out.outputs[0].token_ids
    assert mixed[1].outputs[0].token_ids == free.token_ids


def test_allowed_token_ids_mask_everything_else(llm):
    allowed = [11, 260, 314, 1029, 2455]
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed, seed=3)
    outs = llm.generate(["Hello, my name is", "The capital of France is"], params, use_tqdm=False)
    for out in outs:
        assert set(out.outputs[0].token_ids) <= set(allowed), out.outputs[0].token_ids
    greedy = SamplingParams(temperature=0.0, max_tokens=4, allowed_token_ids=[314])
    assert llm.generate("Hi", greedy, use_tqdm=False)[0].outputs[0].token_ids == [314] * 4


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
        (dict(allowed_token_ids=[10**9]), "allowed_token_ids"),  # past the vocabulary: the engine's check
        (dict(bad_words=[""]), "bad_words"),
        (dict(bad_words="word"), "bad_words"),
        (dict(bad_words=[" "]), "bad_words"),  # tokenizes to nothing once stripped
    ],
)
def test_bad_words_and_allowed_token_ids_are_checked_by_name(llm, kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        llm.generate("Hi", SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)


def test_vllm_v1_add_request_order_and_step_outputs(llm):
    from vllm_from_scratch.outputs import RequestOutput

    engine = llm.llm_engine
    engine.add_request("v1-text", "The capital of France is", GREEDY)  # vLLM V1: (request_id, prompt, params)
    engine.add_request("v1-ids", {"prompt_token_ids": [504, 8085]}, GREEDY)
    book = engine.add_request("The capital of France is", GREEDY, request_id="book")  # the book's order
    with pytest.raises(ValueError, match="^request_id"):
        engine.add_request(7, "Hi", GREEDY)
    with pytest.raises(ValueError, match="^params"):
        engine.add_request("Hi", 0.5)  # the book's order with settings that are not a SamplingParams
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert isinstance(out, RequestOutput)
            finished.update({out.request_id: out} if out.finished else {})
    assert book == "book" and set(finished) == {"v1-text", "v1-ids", "book"}
    assert finished["v1-text"].prompt == "The capital of France is" and finished["v1-ids"].prompt is None
    assert finished["v1-text"].outputs[0].token_ids == finished["book"].outputs[0].token_ids


def test_reset_prefix_cache_as_vllm(llm):
    engine = llm.llm_engine
    llm.generate("A prompt long enough to fill a block of the prefix cache, and a bit more", GREEDY, use_tqdm=False)
    assert engine.block_manager.num_cached_blocks > 0
    assert llm.reset_prefix_cache() is True
    assert engine.block_manager.num_cached_blocks == 0
    engine.add_request("held", "Another prompt that holds its blocks while it runs, for a while", GREEDY)
    engine.step()
    assert llm.reset_prefix_cache() is False, "a running request holds blocks"
    assert llm.reset_prefix_cache(reset_running_requests=True) is True
    while engine.has_unfinished_requests():
        engine.step()  # the preempted request is recomputed and ends normally


def test_sleep_and_wake_up_are_refused_by_name(llm):
    with pytest.raises(NotImplementedError, match="sleep"):
        llm.sleep(level=1)
    with pytest.raises(NotImplementedError, match="wake_up"):
        llm.wake_up()
