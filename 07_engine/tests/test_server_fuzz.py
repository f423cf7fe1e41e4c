"""Fuzz the whole request surface of a real server: no request may cost more than its own 4xx.

A server process (a one-layer cut of the default model: its real tokenizer and chat template,
a fast forward) takes the bodies that ``request_fuzzing.requests`` draws, seeded and bounded,
for ``/v1/completions``, ``/v1/chat/completions``, ``/tokenize`` and ``/detokenize``. Every
answer must be free of faults (``request_fuzzing.fault``: no 5xx, every 4xx in OpenAI's shape
naming its field, a 200 that holds together) and the process must live on. Afterwards the server
must be idle by its own ``/metrics`` (every KV block back) and answer a plain request as it did
before.

``VLLM_FS_FUZZ_EXAMPLES`` sets how many bodies (60 by default; the serving page gives the longer
run's command).
"""

from __future__ import annotations

import os
import re

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from proposers import make_truncated_draft
from request_fuzzing import ENDPOINT_FIELDS, MODEL, encode, fault, requests
from server_testing import ServerProcess
from vllm_from_scratch.default_model import default_model_dir
from vllm_from_scratch.openai_protocol import CHAT_FIELDS, COMPLETION_FIELDS, engine_fields

KEY = "fuzz-key"
FUZZ_EXAMPLES = int(os.environ.get("VLLM_FS_FUZZ_EXAMPLES", "60"))
# A small engine, so that its limits are met: n above 8, a context of 128 tokens.
ENGINE_ARGS = [
    "--served-model-name", MODEL, "--enforce-eager", "--no-warm-up", "--dtype", "float32",
    "--max-model-len", "128", "--num-kvcache-blocks", "48", "--max-num-seqs", "8",
]  # fmt: skip
# And a response limit that drawn requests meet.
SERVER_ARGS = [*ENGINE_ARGS, "--max-response-logprobs", "20000"]


def one_layer_model(directory) -> str:
    """The default model cut to its first layer: its real tokenizer and chat template, a fast forward."""
    return make_truncated_draft(default_model_dir(), 1, directory)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = one_layer_model(tmp_path_factory.mktemp("fuzz") / "one-layer")
    with ServerProcess(["vllm_from_scratch.serve", model_dir, "--api-key", KEY, *SERVER_ARGS]) as proc:
        with httpx.Client(base_url=proc.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as client:
            plain = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
            before = client.post("/v1/completions", json=plain).json()["choices"][0]["text"]
            yield proc, client
            assert proc.proc is not None and proc.proc.poll() is None, proc.output()[-3000:]
            assert_idle(client)
            assert client.post("/v1/completions", json=plain).json()["choices"][0]["text"] == before


def assert_idle(client: httpx.Client) -> None:
    text = client.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        values = [float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M)]
        assert values and all(v == 0 for v in values), f"{name} = {values} after the fuzz: something was kept"


@settings(max_examples=FUZZ_EXAMPLES, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=requests())
def test_no_request_costs_more_than_its_own_4xx(server, request):
    proc, client = server
    path, body = request
    response = client.post(path, content=encode(body), headers={"Content-Type": "application/json"})
    problem = fault(path, body, response)
    assert problem is None, f"{problem}\n{path} {encode(body)[:600]!r}\n-> {response.status_code} {response.text[:600]}"
    assert proc.proc.poll() is None, f"the server died on {path} {body!r}:\n{proc.output()[-3000:]}"


def test_every_sampling_field_is_drawn():
    drawn = set(ENDPOINT_FIELDS["/v1/completions"]) | set(ENDPOINT_FIELDS["/v1/chat/completions"])
    sampling = engine_fields(COMPLETION_FIELDS) | engine_fields(CHAT_FIELDS)
    assert sampling <= drawn, f"sampling fields the fuzz never draws: {sorted(sampling - drawn)}"
