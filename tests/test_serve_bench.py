"""benchmarks/serve.py: a smoke run of the serving load test (make test-bench runs it).

Four specmoe servers (batched, unbatched, paced, n-gram speculation) on the zoo model with 1 and 2 clients, one round, and
llama-server pointed at a folder without llama.cpp: checks the JSON's structure, that every
request was answered, that the batched server did batch, and that the peer that cannot run is
a row saying why.  No timing assertions."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.conftest import HERE

pytestmark = pytest.mark.skipif(not os.environ.get("SPECMOE_TEST_BENCH"),
                                reason="benchmark smoke runs: make test-bench runs them")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

ROOT = HERE.parent


def _smoke(tmp_path, *args):
    """serve.py with 1 and 2 clients, one round of 2 requests of 6 tokens, llama.cpp pointed
    at a folder without it: the JSON object."""
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--json",
                        "--clients", "1,2", "--rounds", "1", "--requests", "2",
                        "--max-tokens", "6", "--workdir", str(tmp_path / "work"),
                        "--peers", str(tmp_path / "no-peers"), "--no-build-peers", *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def test_serve_benchmark_smoke(tmp_path):
    from specmoe import zoo
    if not zoo.available("tiny-moe"):
        pytest.skip("zoo weights not in the package")
    res = _smoke(tmp_path)
    assert res["host"]["cpu"] and res["host"]["threads"]
    rows = {(r["server"], r["clients"]): r for r in res["models"]["zoo"]["rows"]}
    served = ("specmoe", "specmoe-unbatched", "specmoe-batch-prefill", "specmoe-paced",
              "specmoe-ngram")
    assert set(rows) == {(s, c) for s in served + ("llama-server",) for c in (1, 2)}
    for c in (1, 2):
        peer = rows[("llama-server", c)]
        assert "llama.cpp" in peer["error"] and "out_tok_s" not in peer
        for s in served:
            r = rows[(s, c)]
            assert "error" not in r, r
            assert r["errors"] == 0 and r["completion_tokens"] == [6 * 2 * c]
            for k in ("out_tok_s", "req_s", "ttft_p50_s", "itl_p50_s", "itl_p99_s"):
                assert math.isfinite(r[k]) and r[k] > 0, (s, c, k)
            assert 0 <= r["hit_rate"] <= 1 and r["bytes_read_per_token"] >= 0
    assert rows[("specmoe-unbatched", 2)]["mean_decode_batch"] == 1.0
    assert rows[("specmoe", 2)]["mean_decode_batch"] > 1.0   # two requests shared forwards
    assert rows[("specmoe", 2)]["vs_unbatched"] > 0 and rows[("specmoe", 2)]["scaling"] > 0
    assert rows[("specmoe", 2)]["vs_batch_prefill"] > 0
    ng = rows[("specmoe-ngram", 2)]
    assert ng["vs_plain"] > 0 and ng["drafts_per_token"] >= 0
    assert "drafts_per_token" not in rows[("specmoe", 2)]  # plain servers draft nothing


def test_serve_benchmark_smoke_on_a_hybrid(tmp_path):
    """--models hybrid (hybrid_peers.py's Qwen3.5-MoE file at its quick shapes): specmoe serves
    the GGUF file batched and unbatched, the batched server did batch the hybrid's decode
    steps, and llama-server without llama.cpp is a row saying why."""
    saved = tmp_path / "saved.json"
    res = _smoke(tmp_path, "--models", "hybrid", "--hybrid-quick",
                 "--servers", "specmoe,specmoe-unbatched,llama-server", "--save", str(saved))
    assert json.loads(saved.read_text()) == res    # --save writes what --json prints
    m = res["models"]["hybrid"]
    assert m["checkpoint"].endswith("qwen35moe-L4-E8-quick-Q4_0.gguf")
    rows = {(r["server"], r["clients"]): r for r in m["rows"]}
    for c in (1, 2):
        assert "llama.cpp" in rows[("llama-server", c)]["error"]
        for s in ("specmoe", "specmoe-unbatched"):
            r = rows[(s, c)]
            assert "error" not in r, r
            assert r["errors"] == 0 and r["completion_tokens"] == [6 * 2 * c]
    assert rows[("specmoe-unbatched", 2)]["mean_decode_batch"] == 1.0
    assert rows[("specmoe", 2)]["mean_decode_batch"] > 1.0   # the hybrid's rows shared forwards
