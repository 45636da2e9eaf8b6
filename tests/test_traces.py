"""Trace importer and file format, checked against a plain csv/gzip reading of the files."""
from __future__ import annotations

import csv
import gzip
import json

import numpy as np
import pytest

from specmoe.sim.traces import Trace, TraceError, load_puffin, load_trace


def _plain_read(path):
    rows = list(csv.reader(gzip.open(path, "rt", encoding="utf-8")))[1:]
    layers = sorted({int(r[0]) for r in rows})
    per = {l: [json.loads(r[3]) for r in rows if int(r[0]) == l] for l in layers}
    return layers, per, [r[2] for r in rows if int(r[0]) == layers[0]]


def test_puffin_import_matches_plain_reading(puffin_subset):
    from tests.conftest import SUBSET

    paths = sorted(SUBSET.glob("*.csv.gz"), key=lambda p: int(p.name.split("_")[1]))
    tr = puffin_subset
    assert tr.num_requests == len(paths)
    for i, p in enumerate(paths[:5]):
        layers, per, toks = _plain_read(p)
        req = tr.request(i)
        assert list(req.layer_ids) == layers
        assert req.tokens == toks
        for pos, l in enumerate(layers):
            assert req.experts[:, pos, :].tolist() == per[l]
    assert tr.num_layers == 26 and tr.num_experts == 64 and tr.top_k == 6


def test_keys_replay_order(puffin_subset):
    tr = puffin_subset.slice(0, 3)
    keys = tr.keys()
    expect = [pos * 64 + int(e) for t in range(3) for pos in range(26) for e in tr.experts[t, pos]]
    assert keys.tolist() == expect


def test_save_load_roundtrip(tmp_path, puffin_subset):
    tr = puffin_subset.slice(0, 40)
    tr.weights = np.random.default_rng(0).random(tr.experts.shape, dtype=np.float32)
    tr.save(tmp_path / "t.npz")
    back = Trace.load(tmp_path / "t.npz")
    assert np.array_equal(back.experts, tr.experts)
    assert np.array_equal(back.weights, tr.weights)
    assert back.tokens == tr.tokens and back.num_experts == 64
    assert np.array_equal(back.request_starts, tr.request_starts)
    assert load_trace(tmp_path / "t.npz").num_tokens == 40


def test_bad_inputs(tmp_path):
    with pytest.raises(TraceError, match="outside"):
        Trace(experts=np.full((2, 1, 2), 9), num_experts=8)
    with pytest.raises(TraceError, match="request_starts"):
        Trace(experts=np.zeros((2, 1, 2)), num_experts=8, request_starts=[1])
    bad = tmp_path / "bad.csv"
    bad.write_text("Layer ID,Batch Number,Token,Activated Expert IDs\n1,0,a,\"[1, x]\"\n")
    with pytest.raises(TraceError, match=r"bad.csv:2"):
        load_puffin(bad)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(TraceError, match="junk.npz"):
        Trace.load(tmp_path / "junk.npz")
    with pytest.raises(TraceError, match="no such file"):
        load_puffin(tmp_path / "missing")


def test_shared_trace_dir_found_beside_the_checkout_from_any_directory(tmp_path, monkeypatch):
    """The shared traces beside the checkout are found whatever the working directory (the
    module moved one package level down in 0.2: its path arithmetic must follow)."""
    from pathlib import Path

    from specmoe.sim.traces import shared_trace_dir
    beside = Path(__file__).resolve().parents[2] / "shared" / "traces" / \
        "deepseek-v2-lite-puffin"
    if not beside.is_dir():
        pytest.skip(f"no shared traces beside this checkout ({beside})")
    monkeypatch.chdir(tmp_path)
    assert shared_trace_dir().resolve() == beside
