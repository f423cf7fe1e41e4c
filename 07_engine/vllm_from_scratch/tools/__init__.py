"""What sits beside the engine rather than in it: the classroom's step-trace viewer (``viz``: the
page and ``python -m vllm_from_scratch.tools.viz``; ``viz_server``: the server's live ``/viz``)
and the disaggregated-serving proxy (``disagg_proxy``: one endpoint in front of a prefill and a
decode instance sharing a KV pool). Each reads the engine's records; the engine imports none of
them."""
