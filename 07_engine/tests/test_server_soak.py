"""The short soak: ``soak_server.py`` for three small rounds against a real server process.

Load past ``max_num_seqs`` with preemption, while a second client sends every kind of bad
request; every bad request must get its 4xx, every load request must finish, the server must be
idle by its own ``/metrics`` after each round (no request running or waiting, no KV block held,
aborted and dropped streams included), and its memory, file descriptors and threads must not
grow after the first round. The long version and its measured result are in
07_engine/topics/serving.md, "The soak".
"""

import pytest

import soak_server

pytestmark = pytest.mark.slow


def test_short_soak_leaves_the_server_idle_and_flat(capsys):
    # Six requests of 32 + 48 tokens, four at a time, in a 16-block cache: preemptions every round.
    problems = soak_server.main(["--duration", "0", "--rounds", "3", "--num-requests", "6", "--output-len", "48"])
    report = capsys.readouterr().out
    assert problems == [], report
    assert "passed: 3 rounds, 18 requests served" in report
