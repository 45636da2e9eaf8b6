"""The zoo: the training pipeline in smoke mode (whole pipeline, tiny slice, temp dir), its
outputs loaded offline by transformers, the card's figures, the evaluation helpers against
plain references, the corpus splitter, and the loader's errors."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from specmoe import zoo  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TRAINING = REPO / "training"


def _load_training(name: str):
    spec = importlib.util.spec_from_file_location(f"_zoo_training_{name}", TRAINING / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # dataclasses look their module up by name
    sys.path.insert(0, str(TRAINING))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(TRAINING))
    return mod


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models (conftest.py)


@pytest.fixture(scope="module")
def train_mod():
    return _load_training("train")


@pytest.fixture(scope="module")
def corpus_mod():
    return _load_training("corpus")


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory) -> tuple[Path, Path]:
    """Run `training/train.py --smoke` twice with the same seed, side by side in two
    subprocesses (their global torch settings stay out of this process; offline, one thread
    each): the outputs the tests read, and the second run the determinism test compares."""
    outs = (tmp_path_factory.mktemp("zoo-smoke"), tmp_path_factory.mktemp("zoo-smoke-again"))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    logs = [out.with_name(out.name + ".log") for out in outs]  # not pipes: neither waits
    files = [open(log, "w") for log in logs]
    procs = [subprocess.Popen([sys.executable, str(TRAINING / "train.py"), "--smoke", "--out",
                               str(out), "--threads", "1"], cwd=REPO, env=env, stdout=f,
                              stderr=subprocess.STDOUT)
             for out, f in zip(outs, files)]
    try:
        for p, log in zip(procs, logs):
            p.wait(timeout=300)
            assert p.returncode == 0, log.read_text()[-6000:]
    finally:
        for p, f in zip(procs, files):
            if p.poll() is None:
                p.kill()
                p.wait()
            f.close()
    return outs


@pytest.fixture(scope="module")
def smoke_out(smoke_runs) -> Path:
    return smoke_runs[0]


def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


# ------------------------------------------------------------------ smoke pipeline outputs

@pytest.mark.slow  # the training smoke run: make test-slow
def test_smoke_models_load_offline_with_auto_classes(smoke_out, monkeypatch):
    _offline(monkeypatch)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(smoke_out / "tiny-moe")
    draft = AutoModelForCausalLM.from_pretrained(smoke_out / "tiny-draft")
    assert type(target).__name__ == "MixtralForCausalLM"
    assert type(draft).__name__ == "LlamaForCausalLM"
    cfg = target.config
    assert cfg.num_hidden_layers >= 4 and cfg.num_local_experts >= 16
    assert cfg.num_experts_per_tok in (2, 4)
    for layer in target.model.layers:          # every layer is an MoE layer
        assert hasattr(layer.mlp, "experts") and hasattr(layer.mlp, "gate")
    assert sum(p.numel() for p in draft.parameters()) < sum(p.numel() for p in target.parameters())
    tok = AutoTokenizer.from_pretrained(smoke_out / "tiny-moe")
    text = "def f(x):\n    return x ** 2  # square\n\nThe quick brown fox."
    ids = tok(text).input_ids
    assert tok.decode(ids) == text                 # byte-level BPE round-trips exactly
    assert max(ids) < cfg.vocab_size
    # one tokenizer for both models
    assert (smoke_out / "tiny-moe" / "tokenizer.json").read_bytes() == \
        (smoke_out / "tiny-draft" / "tokenizer.json").read_bytes()
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), cfg.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.slow  # the training smoke run: make test-slow
def test_smoke_weights_are_bf16_safetensors(smoke_out):
    for name in ("tiny-moe", "tiny-draft"):
        f = smoke_out / name / "model.safetensors"
        header_len = int.from_bytes(f.read_bytes()[:8], "little")
        header = json.loads(f.read_bytes()[8:8 + header_len])
        dtypes = {v["dtype"] for k, v in header.items() if k != "__metadata__"}
        assert dtypes == {"BF16"}, (name, dtypes)
        assert json.loads((smoke_out / name / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.slow  # the training smoke run: make test-slow
def test_smoke_card_carries_the_runs_figures(smoke_out):
    card = (smoke_out / "MODEL_CARD.md").read_text()
    m = json.loads((smoke_out / "metrics.json").read_text())
    assert (smoke_out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for section in ("## Corpus", "## Training", "## Held-out loss", "## Routing entropy",
                    "## Draft acceptance", "licence", "wall time"):
        assert section in card
    for dom in ("code", "prose"):
        h = m["heldout"][dom]
        row = re.search(rf"^\| {dom} \| [\d,]+ \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", card, re.M)
        assert row, dom
        assert [float(x) for x in row.groups()] == pytest.approx(
            [h["unigram"], h["target"], h["draft"]], abs=6e-4)
        for r in m["routing"][dom]:
            assert r["uniform"] == pytest.approx(math.log(m["target"]["config"]["num_local_experts"]))
            assert 0 <= r["token_entropy"] <= r["uniform"] + 1e-6
            assert 0 <= r["load_entropy"] <= r["uniform"] + 1e-6
        a = m["acceptance"][dom]
        assert a["acceptance_rate"] == pytest.approx(a["accepted"] / (a["accepted"] + a["rejected"]))
        assert a["proposal_acceptance"] == pytest.approx(a["accepted"] / a["proposed"])
        assert f"{a['acceptance_rate']:.1%}" in card
    assert len(m["routing"]["code"]) == m["target"]["config"]["num_hidden_layers"]
    assert m["target"]["steps"] == m["target"]["planned_steps"]
    assert len(m["history"]["tiny-moe"]["loss"]) == m["target"]["steps"]
    assert "Smoke run" in card


# ------------------------------------------------------------------ evaluation helpers

def _greedy_reference(model, prompt, n):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.slow  # the training smoke run: make test-slow
def test_speculative_greedy_equals_plain_greedy(smoke_out, train_mod):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(smoke_out / "tiny-moe", dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(smoke_out / "tiny-draft", dtype=torch.float32).eval()
    prompt = [5, 17, 42, 8, 99, 3]
    for k in (1, 4):
        gen, proposed, accepted, rejected, rounds = train_mod.speculative_greedy(
            target, draft, prompt, 10, k)
        assert gen == _greedy_reference(target, prompt, 10)
        assert 0 <= accepted <= proposed and 0 <= rejected <= rounds
        # every round yields its accepted tokens plus one target token
        assert accepted + rounds >= 10 and accepted + rejected <= proposed
    # a draft identical to the target is always accepted: rounds of k+1 tokens
    gen, proposed, accepted, rejected, rounds = train_mod.speculative_greedy(
        target, target, prompt, 10, 4)
    assert gen == _greedy_reference(target, prompt, 10)
    assert accepted == proposed and rejected == 0 and rounds == 2


def test_unigram_loss_matches_plain_computation(train_mod):
    rng = np.random.default_rng(0)
    streams = {"a": rng.integers(0, 7, 300).astype(np.uint16), "b": rng.integers(0, 5, 100).astype(np.uint16)}
    windows = rng.integers(0, 8, (3, 5))
    counts = [1] * 8
    for s in streams.values():
        for t in s.tolist():
            counts[t] += 1
    total = sum(counts)
    ref = -sum(math.log(counts[t] / total) for row in windows.tolist() for t in row[1:]) / 12
    assert train_mod.unigram_loss(streams, windows, 8) == pytest.approx(ref, rel=1e-12)


@pytest.mark.slow  # the training smoke run: make test-slow
def test_routing_stats_against_manual_router_math(train_mod, smoke_out):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smoke_out / "tiny-moe", dtype=torch.float32).eval()
    E, k = model.config.num_local_experts, model.config.num_experts_per_tok
    windows = np.random.default_rng(1).integers(0, model.config.vocab_size, (2, 9))
    stats = train_mod.routing_stats(model, windows, k)
    # reference: capture each router's input with hooks and redo softmax/entropy/top-k here
    captured = []
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda mod, inp, out: captured.append(inp[0].reshape(-1, inp[0].shape[-1]) @ mod.weight.T))
        for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=torch.from_numpy(windows[:, :-1]))
    for h in hooks:
        h.remove()
    for li, logits in enumerate(captured):
        p = torch.softmax(logits.double(), -1)
        ent = float((-(p * p.log()).sum(-1)).mean())
        counts = np.bincount(torch.topk(logits, k, -1).indices.reshape(-1).numpy(), minlength=E)
        q = counts[counts > 0] / counts.sum()
        assert stats[li]["token_entropy"] == pytest.approx(ent, rel=1e-4)
        assert stats[li]["load_entropy"] == pytest.approx(float(-(q * np.log(q)).sum()), rel=1e-9)
        assert stats[li]["uniform"] == pytest.approx(math.log(E))
    # a zeroed router is exactly uniform
    for layer in model.model.layers:
        layer.mlp.gate.weight.data.zero_()
    for s in train_mod.routing_stats(model, windows, k):
        assert s["token_entropy"] == pytest.approx(math.log(E), rel=1e-6)


def test_heldout_windows_refuses_short_stream(train_mod):
    with pytest.raises(ValueError, match="shorter than one window"):
        train_mod.heldout_windows(np.zeros(10, np.uint16), 64, 1000)


# ------------------------------------------------------------------ corpus

def test_heldout_split_is_a_pure_function_of_the_path(corpus_mod):
    import hashlib

    paths = [f"pkg/mod_{i}.py" for i in range(4000)]
    flags = [corpus_mod.is_heldout(p) for p in paths]
    ref = [hashlib.sha256(p.encode()).digest()[0] < int(corpus_mod.HELDOUT_FRACTION * 256) for p in paths]
    assert flags == ref
    assert 0.03 < sum(flags) / len(flags) < 0.09


def test_rst_prose_keeps_sentences_and_drops_code(corpus_mod):
    rst = (".. _label:\n\nA Title\n=======\n\nThe :func:`len` function returns the number of\n"
           "items in ``obj`` for example::\n\n   >>> len([1, 2])\n   2\n\n"
           ".. note::\n   Indented note body is dropped.\n\n"
           "See `the docs <https://example.org>`_ and *emphasis* here for details.\n")
    out = corpus_mod.rst_prose(rst)
    assert out == ("The len function returns the number of items in obj for example:\n\n"
                   "See the docs and emphasis here for details.")


def test_code_domain_excludes_tests_and_site_packages(corpus_mod):
    dom = corpus_mod.code_domain(limit_chars=200_000)
    names = [n for n, _ in dom.train + dom.heldout]
    assert names and dom.train and dom.heldout
    assert not any(set(Path(n).parts[:-1]) & corpus_mod.EXCLUDED_DIRS for n in names)
    assert Path(dom.licence_file).name == "LICENSE.txt"


# ------------------------------------------------------------------ loader

def test_loader_errors_when_weights_absent(tmp_path):
    with pytest.raises(zoo.ZooError, match=r"'tiny-moe' is not available: .*config\.json"):
        zoo.path("tiny-moe", base=tmp_path)
    (tmp_path / "tiny-moe").mkdir()
    (tmp_path / "tiny-moe" / "config.json").write_text("{}")
    with pytest.raises(zoo.ZooError, match=r"lacks model\.safetensors, tokenizer\.json"):
        zoo.load("tiny-moe", base=tmp_path)
    assert not zoo.available("tiny-draft", base=tmp_path)
    assert isinstance(zoo.ZooError("x"), FileNotFoundError)


def test_loader_rejects_unknown_names():
    with pytest.raises(zoo.ZooError, match="unknown zoo model 'gpt-5'"):
        zoo.path("gpt-5")
    with pytest.raises(TypeError):
        zoo.path(3)  # type: ignore[arg-type]


@pytest.mark.slow  # the training smoke run: make test-slow
def test_loader_loads_a_zoo_folder(smoke_out, monkeypatch):
    _offline(monkeypatch)
    assert zoo.available("tiny-moe", base=smoke_out)
    model, tok = zoo.load("tiny-moe", base=smoke_out, experts_implementation="eager")
    assert type(model).__name__ == "MixtralForCausalLM" and not model.training
    assert model.dtype == torch.float32
    assert zoo.path("tiny-draft", base=smoke_out) == smoke_out / "tiny-draft"
    assert tok.decode(tok("x = 1").input_ids) == "x = 1"


def test_packaged_zoo_matches_loader_state():
    """Inside the package, path() succeeds exactly when the files are there."""
    for name in zoo.NAMES:
        folder = zoo.root() / name
        present = all((folder / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json"))
        assert zoo.available(name) == present
        if present:
            assert zoo.path(name) == folder
        else:
            with pytest.raises(zoo.ZooError):
                zoo.path(name)


@pytest.mark.slow
def test_smoke_run_is_deterministic(smoke_runs):
    """A second run with the same seed gives byte-identical weights and tokenizer."""
    smoke_out, again = smoke_runs
    for name in ("tiny-moe", "tiny-draft"):
        for f in ("model.safetensors", "tokenizer.json", "config.json"):
            assert (again / name / f).read_bytes() == (smoke_out / name / f).read_bytes(), (name, f)
    a = json.loads((again / "metrics.json").read_text())
    b = json.loads((smoke_out / "metrics.json").read_text())
    assert a["heldout"] == b["heldout"] and a["acceptance"] == b["acceptance"]
