"""`make demo` (python -m specmoe demo) runs end to end and its checks pass."""
from __future__ import annotations

from specmoe import demo


def test_demo_zoo_model_with_speculation(capsys):
    assert demo.main(["--tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert "tokens identical to the unmodified model: True" in out
    for row in ("plain (K=0)", "n-gram lookup", "tiny-draft model", "int4 self-draft"):
        assert row in out
    # every speculative row decoded the same tokens as plain greedy decoding
    rows = [ln for ln in out.splitlines() if ln.startswith(("n-gram", "tiny-draft", "int4"))]
    assert len(rows) == 3 and all(ln.rstrip().endswith("True") for ln in rows)


def test_demo_random_model_without_spec(capsys):
    assert demo.main(["--arch", "qwen2_moe", "--tokens", "6", "--no-spec"]) == 0
    assert "speculative" not in capsys.readouterr().out
