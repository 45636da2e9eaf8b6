"""specmoe.from_pretrained and the persistent store, against transformers' own from_pretrained
of the same checkpoint folder (eager experts) as the reference."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import specmoe
from specmoe.runtime import engine as hf
from specmoe.models import testing
from specmoe.storage.conversion import check_store, default_store_path

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
PROMPT = torch.tensor([[5, 17, 33, 64, 9, 100, 7, 41]])
ROOT = Path(__file__).resolve().parent.parent


def _reference(folder):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager",
                                                dtype=torch.float32).eval()


def _greedy(model, n=12):
    with torch.no_grad():
        return model.generate(PROMPT, max_new_tokens=n, do_sample=False)


def _load(folder, **kw):
    kw.setdefault("dtype", "f32")
    kw.setdefault("cache", 0.5)
    kw.setdefault("progress", False)
    return specmoe.from_pretrained(folder, torch_dtype=torch.float32, **kw)


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMOE_CACHE", str(tmp_path / "cache"))


# Every architecture from a per-expert checkpoint; from a fused one (transformers 5's own
# layout) a few whose expert tensors are named or split differently in make test, every one in
# make test-slow (both run in CI).
FUSED_FAST = {"deepseek_v3", "gpt_oss", "granitemoe", "jamba", "kimi_linear", "mixtral",
              "qwen3_5_moe_text", "qwen3_next"}


@pytest.mark.parametrize("arch,layout", [(a, "per_expert") for a in sorted(hf.SUPPORTED)] + [
    pytest.param(a, "fused", marks=() if a in FUSED_FAST else pytest.mark.slow)
    for a in sorted(hf.SUPPORTED)])
def test_greedy_equal_to_unmodified(arch, layout, tmp_path):
    m = testing.tiny_model(arch)
    folder = testing.save_checkpoint(m, tmp_path / "ckpt", layout=layout,
                                     max_shard_size="200KB")
    ref = _reference(folder)
    g_ref = _greedy(ref)
    assert torch.equal(g_ref, _greedy(m))  # the saved checkpoint is the model
    assert len(set(g_ref[0, PROMPT.shape[1]:].tolist())) > 2
    model = _load(folder)
    eng = specmoe.engine_of(model)
    try:
        # no expert parameter was ever materialised: none is left in the model
        assert not any(".experts." in n for n, _ in model.named_parameters())
        with torch.no_grad():
            torch.testing.assert_close(model(PROMPT).logits, ref(PROMPT).logits, atol=1e-5,
                                       rtol=1e-5)
        assert torch.equal(_greedy(model), g_ref)
        assert eng.stats()["misses"] > 0
    finally:
        eng.close()



@pytest.mark.parametrize("arch,piece", [("kimi_linear", "self_attn.k_conv1d.weight"),
                                        ("sarvam_moe", "attention.query_key_value.weight")])
def test_dense_weights_joined_or_split_from_checkpoint_pieces(arch, piece, tmp_path):
    """Dense weights the checkpoint holds in other pieces (transformers' dense converters):
    Kimi-Linear's q/k/v short convolutions, concatenated into one; Ling/Sarvam's fused
    query_key_value, split into q/k/v.  Loaded equal to transformers' own loading; a missing
    piece is an error naming it, before any conversion."""
    from safetensors.torch import load_file, save_file
    m = testing.tiny_model(arch)
    folder = testing.save_checkpoint(m, tmp_path / "ckpt")
    ref = _reference(folder)
    names = list(load_file(folder / "model.safetensors"))
    assert any(n.endswith(piece) for n in names)  # the checkpoint holds the pieces
    model = _load(folder)
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(PROMPT).logits, ref(PROMPT).logits, atol=1e-5,
                                       rtol=1e-5)
    finally:
        specmoe.engine_of(model).close()
    sd = load_file(folder / "model.safetensors")
    gone = next(n for n in sd if n.endswith(piece))
    del sd[gone]
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    from specmoe.storage.conversion import CheckpointError
    with pytest.raises((CheckpointError, ValueError), match="lacks"):
        _load(folder, store=tmp_path / "other.smoe")
    assert not (tmp_path / "other.smoe").exists()

def test_sharded_index_and_single_file_read_alike(tmp_path):
    m = testing.tiny_model("qwen2_moe")
    a = testing.save_checkpoint(m, tmp_path / "a", max_shard_size="100KB")
    b = testing.save_checkpoint(m, tmp_path / "b")
    assert (a / "model.safetensors.index.json").exists()
    assert not (b / "model.safetensors.index.json").exists()
    ga, gb = (_greedy(x) for x in (_load(a), _load(b)))
    assert torch.equal(ga, gb)


def _converted(capfd) -> str | None:
    err = capfd.readouterr().err
    for line in err.splitlines():
        if "converting the experts" in line:
            return line
    return None


def test_store_persists_and_is_reused(tmp_path, capfd):
    m = testing.tiny_model("mixtral")
    folder = testing.save_checkpoint(m, tmp_path / "ckpt")
    capfd.readouterr()
    specmoe.engine_of(_load(folder)).close()
    assert "no store yet" in _converted(capfd)
    path = default_store_path(folder, "f32")
    assert path.parent == tmp_path / "cache" and path.exists()
    mtime = path.stat().st_mtime_ns
    model = _load(folder)
    assert _converted(capfd) is None  # reused, not converted again
    assert path.stat().st_mtime_ns == mtime
    assert torch.equal(_greedy(model), _greedy(_reference(folder)))
    specmoe.engine_of(model).close()
    # another dtype is another store
    specmoe.engine_of(_load(folder, dtype="int8")).close()
    assert "no store yet" in _converted(capfd)
    assert default_store_path(folder, "int8").exists() and path.exists()


def _rebuilt_because(folder, store, capfd, **kw) -> str:
    capfd.readouterr()
    model = _load(folder, store=store, **kw)
    try:
        assert torch.equal(_greedy(model), _greedy(_reference(folder)))
    finally:
        specmoe.engine_of(model).close()
    line = _converted(capfd)
    assert line is not None, "the store was used instead of rebuilt"
    return line


def test_bad_stores_are_rebuilt_saying_why(tmp_path, capfd):
    m = testing.tiny_model("mixtral")
    folder = testing.save_checkpoint(m, tmp_path / "ckpt")
    store = tmp_path / "experts.smoe"
    specmoe.engine_of(_load(folder, store=store)).close()
    size = store.stat().st_size

    # truncated
    with open(store, "r+b") as f:
        f.truncate(size - 4096)
    assert "truncated or damaged" in _rebuilt_because(folder, store, capfd)
    # damaged: a byte of the last expert's block of the first layer flipped
    st = specmoe.ExpertStore(store)
    off = st.metadata["data_offset"] + (st.num_experts - 1) * st.block_bytes + 100
    st.close()
    with open(store, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))
    assert "damaged" in _rebuilt_because(folder, store, capfd)
    # foreign: a valid store of something else
    specmoe.write_store(store, [{"w": np.zeros((4, 8), np.float32)}], progress=False).close()
    assert "foreign" in _rebuilt_because(folder, store, capfd)
    # stale: the checkpoint changed after the store was written
    specmoe.engine_of(_load(folder, store=store)).close()
    with torch.no_grad():
        m.model.layers[0].mlp.experts.down_proj.mul_(1.5)
    testing.save_checkpoint(m, folder)
    assert "stale" in _rebuilt_because(folder, store, capfd)
    # other settings (dtype) at the same path
    assert "other settings" in _rebuilt_because(folder, store, capfd, dtype="bf16")


def test_damage_past_the_spot_check_raises_naming_the_block(tmp_path):
    """Blocks the open-time check does not read are verified when the cache reads them."""
    m = testing.tiny_model("mixtral")
    folder = testing.save_checkpoint(m, tmp_path / "ckpt")
    store = tmp_path / "experts.smoe"
    specmoe.engine_of(_load(folder, store=store)).close()
    st = specmoe.ExpertStore(store)
    off = st.metadata["data_offset"] + 3 * st.block_bytes + 10  # layer 0, expert 3
    st.close()
    with open(store, "r+b") as f:
        f.seek(off)
        f.write(b"\xff\xfe\xfd")
    eng = specmoe.engine_of(_load(folder, store=store, cache=1.0))
    try:
        with pytest.raises(specmoe.StoreError, match="expert 3"):
            eng._cache.acquire(0, 3)
        eng._cache.acquire(0, 2)  # the other blocks still serve
        eng._cache.release(0, 2)
    finally:
        eng.close()


def test_capacity_forms(tmp_path):
    m = testing.tiny_model("mixtral")
    folder = testing.save_checkpoint(m, tmp_path / "ckpt")
    total = 3 * 8
    for spec, slots in ((0.25, 6), ("25%", 6), (5, 5)):
        eng = specmoe.engine_of(_load(folder, cache=spec))
        assert eng._cache.capacity == slots
        eng.close()
    eng = specmoe.engine_of(_load(folder, cache="200KiB"))
    assert eng._cache.capacity == min(total, 200 * 1024 // eng._cache.slot_bytes)
    eng.close()
    with pytest.raises(ValueError, match="cache="):
        _load(folder, cache="lots")
    e2 = hf.offload(testing.tiny_model("mixtral"), cache="50%")
    assert e2._cache.capacity == 12
    e2.close()


@pytest.mark.parametrize("kw, exc, match", [
    ({"cache": "lots"}, ValueError, "cache='lots'"),
    ({"cache": "150%"}, ValueError, "percentage"),
    ({"cache": 1.5}, ValueError, "fraction"),
    ({"cache": "2 parsecs"}, ValueError, "unknown unit"),
    ({"policy": "lru2"}, ValueError, "unknown policy 'lru2'"),
    ({"policy": "belady"}, ValueError, "future"),
    ({"policy": 3}, TypeError, "cannot make a policy"),
])
def test_bad_cache_or_policy_fails_before_converting(tmp_path, kw, exc, match):
    """A typo in cache= or policy= is reported before the (possibly hours-long) conversion and
    the dense weights' load: no store is written."""
    folder = testing.save_checkpoint(testing.tiny_model("mixtral"), tmp_path / "ckpt")
    with pytest.raises(exc, match=match):
        _load(folder, **kw)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
    with pytest.raises(exc, match=match):  # offload: before any expert leaves the model
        hf.offload(testing.tiny_model("mixtral"), **kw)


def test_errors_name_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a checkpoint folder"):
        specmoe.from_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        specmoe.from_pretrained(tmp_path / "empty")
    m = testing.tiny_model("mixtral")
    folder = testing.save_checkpoint(m, tmp_path / "ckpt", layout="fused")
    with pytest.raises(ValueError, match="dtype"):
        specmoe.from_pretrained(folder, dtype="f16")
    # an expert tensor missing from the checkpoint: named, nothing written
    from safetensors.torch import load_file, save_file
    sd = load_file(folder / "model.safetensors")
    del sd["model.layers.1.mlp.experts.down_proj"]
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="decoder layer 1 lacks expert tensors: down_proj"):
        _load(folder)
    assert not list((tmp_path / "cache").glob("*.smoe")) if (tmp_path / "cache").exists() \
        else True
    # a dense model is not a MoE model
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "dense")
    with pytest.raises(hf.UnsupportedModelError, match="no decoder layer has a fused"):
        _load(tmp_path / "dense")
    with pytest.raises(ValueError, match="not served by specmoe"):
        specmoe.engine_of(LlamaForCausalLM(cfg))


def test_convert_then_from_pretrained_uses_it(tmp_path, capfd):
    m = testing.tiny_model("qwen3_moe")
    folder = testing.save_checkpoint(m, tmp_path / "ckpt")
    out = tmp_path / "q.smoe"
    assert specmoe.convert(folder, dtype="int4", out=out, progress=False) == out
    assert check_store(out, *_record(folder, "int4")) is None
    capfd.readouterr()
    model = _load(folder, dtype="int4", store=out)
    assert _converted(capfd) is None
    eng = specmoe.engine_of(model)
    assert eng.dtype == "int4"
    eng.close()


def _record(folder, dtype):
    from specmoe.storage.conversion import Checkpoint, store_settings
    from specmoe.models.pretrained import _prepare
    plan = _prepare(folder, dtype, None, {})
    return (Checkpoint.open(folder).fingerprint(),
            store_settings(plan.model.config, plan.info, plan.layer_ids, dtype))


def test_cli_convert_and_run_on_the_zoo_model(tmp_path):
    from specmoe import zoo
    if not zoo.available("tiny-moe"):
        pytest.skip("zoo weights not shipped in this build")
    env = dict(os.environ, SPECMOE_CACHE=str(tmp_path / "cache"))
    folder = str(zoo.path("tiny-moe"))
    r = subprocess.run([sys.executable, "-m", "specmoe", "convert", folder, "--dtype", "int8",
                        "-o", str(tmp_path / "t.smoe")], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(tmp_path / "t.smoe")
    assert "64/64 experts" in r.stderr  # the progress bar counted every expert
    r = subprocess.run([sys.executable, "-m", "specmoe", "run", folder, "--prompt",
                        "def parse(line):", "--cache", "25%", "--max-new-tokens", "8",
                        "--dtype", "int8", "--store", str(tmp_path / "t.smoe"), "--dense", "int8"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[-1].startswith("[specmoe] 8 tokens") and "hit rate" in lines[-1]
    assert "peak memory" in lines[-1] and "tok/s" in lines[-1]
    assert "dense layers: 17 in C (int8)" in lines[-1]  # 4 x (q, k, v, o) + lm_head
    assert "converting" not in r.stderr  # the store written by convert was reused
    # a folder without a checkpoint: test_cli.py::test_run_folder_without_config (in process)


@pytest.mark.parametrize("argv, what", [
    (["run", "ckpt", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens: must be >= 1"),
    (["run", "ckpt", "--prompt", "x", "--threads", "-2"], "--threads: must be >= 1"),
    (["run", "ckpt", "--prompt", "x", "--threads", "two"], "--threads: expected an integer"),
    (["simulate", "--tokens", "0"], "--tokens: must be >= 1"),
    (["simulate", "--verify-tokens", "0"], "--verify-tokens: must be >= 1"),
    (["sweep", "--processes", "0"], "--processes: must be >= 1"),
])
def test_cli_refuses_bad_counts_before_loading(argv, what, capsys):
    """Counts the command line cannot use fail in argparse, with its usage message, before any
    checkpoint is opened (they used to raise a traceback from transformers or torch after the
    model had loaded)."""
    from specmoe.cli import main
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert what in capsys.readouterr().err


def _mxfp4_checkpoint(tmp_path):
    """A tiny GPT-OSS checkpoint in the original release's layout (experts as MXFP4 blocks +
    scales, random codes and exponents) and transformers' own loader dequantizing it
    (Mxfp4Config(dequantize=True)): (folder, reference model)."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, Mxfp4Config
    m = testing.tiny_model("gpt_oss", inter=64)
    folder = testing.save_checkpoint(m, tmp_path / "ckpt")
    sd = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for k in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, n_in, n_out = sd.pop(k).shape  # blocks: [E, out, in / 32, 16] (two nibbles a byte)
        sd[k + "_blocks"] = torch.randint(0, 256, (E, n_out, n_in // 32, 16), dtype=torch.uint8,
                                          generator=g)
        sd[k + "_scales"] = torch.randint(120, 128, (E, n_out, n_in // 32), dtype=torch.uint8,
                                          generator=g)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    (folder / "config.json").write_text(json.dumps(cfg))
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                               quantization_config=Mxfp4Config(dequantize=True))
    return folder, ref.eval()


def test_gpt_oss_mxfp4_checkpoint_dequantized_while_converting(tmp_path):
    """GPT-OSS's original release stores experts as MXFP4 blocks + scales; dtype='f32'
    dequantizes them; the reference is transformers' own loader dequantizing them."""
    folder, ref = _mxfp4_checkpoint(tmp_path)
    model = _load(folder)
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(PROMPT).logits, ref.eval()(PROMPT).logits,
                                       atol=1e-5, rtol=1e-5)
        assert torch.equal(_greedy(model), _greedy(ref))
    finally:
        specmoe.engine_of(model).close()


def test_gpt_oss_mxfp4_experts_kept_as_mxfp4_blocks(tmp_path, capfd):
    """dtype='auto' keeps GPT-OSS's MXFP4 experts as MXFP4 blocks (the exponent byte as it
    is, the nibbles in ggml's order: repacked, not re-quantized) with their biases: every
    stored expert dequantizes to exactly transformers' dequantization, and on the exact
    kernel path the logits equal transformers' model."""
    import numpy as np
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from specmoe import _C
    from specmoe.runtime import kernels
    from specmoe.storage import ggml_blocks as gb
    from specmoe.storage import quant
    from specmoe.storage.store import ExpertStore
    folder, ref = _mxfp4_checkpoint(tmp_path)
    store = specmoe.convert(folder, progress=False)
    assert "GPT-OSS MXFP4 experts: the store keeps them as MXFP4 blocks" in capfd.readouterr().err
    exp = ref.model.layers[1].mlp.experts
    st = ExpertStore(store)
    try:
        assert st.extra["dtype"] == "gguf" and st.extra["kept_blocks"] == "MXFP4"
        t = st.read_expert(1, 3)
        assert gb.block_kind(t["gate"]) == "mxfp4"
        got = quant.dequantize_expert(t)
        gu, dn = exp.gate_up_proj[3].detach().numpy(), exp.down_proj[3].detach().numpy()
        np.testing.assert_array_equal(got["gate"], gu[:, 0::2].T)
        np.testing.assert_array_equal(got["up"], gu[:, 1::2].T)
        np.testing.assert_array_equal(got["down"], dn.T)
        np.testing.assert_array_equal(t["gate.bias"], exp.gate_up_proj_bias[3].detach()[0::2])
        np.testing.assert_array_equal(t["down.bias"], exp.down_proj_bias[3].detach())
    finally:
        st.close()
    # the repacking alone, on every code and exponent, against transformers' dequantization
    b = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 16, 16).repeat(1, 3, 1, 1)
    e = torch.tensor([[[0, 1, 2, 100, 127, 128, 150, 200] * 2] * 3], dtype=torch.uint8)
    want = convert_moe_packed_tensors(b, e, dtype=torch.float32)[0].T.numpy()  # [out, in]
    np.testing.assert_array_equal(gb.dequantize(gb.mxfp4_from_hf(b[0].numpy(), e[0].numpy())),
                                  want)
    model = _load(folder, dtype="auto", dense="torch")
    try:
        kernels.set_isa("scalar")
        with torch.no_grad():
            torch.testing.assert_close(model(PROMPT).logits, ref(PROMPT).logits, atol=1e-5,
                                       rtol=1e-5)
        assert torch.equal(_greedy(model), _greedy(ref))
        # the fast path: int8 input, close (these random codes span the whole FP4 range with
        # scales near 1, far larger weights than a trained model's: 5 % on this host; the
        # kernel itself equals a numpy model of its arithmetic, test_gguf_blocks.py)
        kernels.set_isa(_C.KernelContext(1).isa_max)
        with torch.no_grad():
            fast, want_l = model(PROMPT).logits, ref(PROMPT).logits
        assert float((fast - want_l).norm() / want_l.norm()) < 0.1
    finally:
        kernels.set_isa("auto")
        specmoe.engine_of(model).close()
