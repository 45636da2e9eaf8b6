"""benchmarks/gptoss_peers.py --quick --json: a smoke run of the GPT-OSS same-file benchmark
(the random GGUF written with MXFP4 experts, specmoe's row with every expert resident, and
llama.cpp's row or the reason it did not run).  Run by `make test-bench`."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not os.environ.get("SPECMOE_TEST_BENCH"),
                                reason="benchmark smoke runs: make test-bench runs them")

ROOT = Path(__file__).resolve().parent.parent


def test_quick_run_reads_one_file_on_both_sides(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gptoss_peers.py"), "--quick",
                        "--json", "--no-build-peers", "--workdir", str(tmp_path), "--ab", "1",
                        "--peers", os.environ.get("SPECMOE_PEERS", str(tmp_path / "peers"))],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["config"]["experts"] == "MXFP4" and out["specmoe_store_dtype"] == "gguf"
    assert out["host"]["cpu"]
    rows = {(r["name"], r["threads"]): r for r in out["rows"]}
    for t in (1, 2):
        s, ll = rows[("specmoe-gguf-MXFP4", t)], rows[("llama.cpp-MXFP4", t)]
        assert s["tok_per_s"] > 0 and s["hit_rate"] == 1.0, s
        # llama.cpp runs where it is built; otherwise its row says why (never dropped)
        assert ll.get("tok_per_s") or "llama.cpp" in ll.get("error", ""), ll
        assert len(s["vs_llama_cpp_runs"]) == 1
        # --ab: the one-call paths (attention, layers, MoE blocks) on and off in the worker
        assert len(s["one_call_tok_s_runs"]) == len(s["torch_glue_tok_s_runs"]) == 1
        assert s["one_call_vs_torch_glue_runs"][0] > 0
    assert out["specmoe_one_call_modules"] == 3 * 2  # 2 layers: attention, layer, MoE block
