"""Quantized checkpoints (issue 40, item 3) read by specmoe.from_pretrained without a bf16
copy of the model, each weight dequantized when it is read (a dense one into the model, an
expert into the store):

* FP8: e4m3 weights with an f32 ``weight_scale_inv`` per 128x128 block (DeepSeek-V3/R1's and
  the Qwen3 FP8 releases' layout), written by save_fp8_checkpoint (blocks of 32 so that the
  tiny models have several);
* GPTQ 4-bit (AutoGPTQ's ``gptq`` format: qweight, qzeros, scales, g_idx; with and without
  act-order, symmetric or not), written by save_gptq_checkpoint;
* AWQ 4-bit (AutoAWQ's ``gemm`` layout: qweight and qzeros packed along the output in AWQ's
  order, scales), written by save_awq_checkpoint.

The reference is the unmodified transformers model holding the weights the file holds
(computed on the writer's side), compared by greedy tokens and by logits, which tell the
file's weights from the unquantized model's."""
from __future__ import annotations

import json
import warnings

import numpy as np

import pytest
import torch

import specmoe
from specmoe.models.testing import (save_awq_checkpoint, save_fp8_checkpoint,
                                   save_gptq_checkpoint, tiny_model)
from specmoe.storage.conversion import CheckpointError


from .test_gguf import _cache_dir, _greedy  # noqa: F401 (the autouse fixture applies here)


@pytest.mark.parametrize("fmt,arch", [("fp8", "qwen3_moe"), ("fp8", "deepseek_v2"),
                                      ("gptq", "mixtral"), ("gptq-act-order", "qwen3_moe"),
                                      ("gptq-asym", "olmoe"), ("awq", "qwen3_moe"),
                                      ("awq", "deepseek_v2")])
def test_greedy_equal_to_the_weights_the_file_holds(fmt, arch, tmp_path):
    if fmt == "fp8":
        folder, held = save_fp8_checkpoint(tiny_model(arch), tmp_path / arch, block=32)
    elif fmt == "awq":
        folder, held = save_awq_checkpoint(tiny_model(arch), tmp_path / arch, group=32)
    elif fmt == "gptq-asym":
        folder, held = save_gptq_checkpoint(tiny_model(arch), tmp_path / arch, group=32,
                                            sym=False)
    else:
        folder, held = save_gptq_checkpoint(tiny_model(arch), tmp_path / arch, group=32,
                                            act_order=fmt.endswith("act-order"))
    ref = tiny_model(arch)
    ref.load_state_dict(held, strict=False)
    want = _greedy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the scales are not "unused tensors"
        model = specmoe.from_pretrained(folder, cache=0.5, dtype="f32", progress=False,
                                        torch_dtype=torch.float32)
    try:
        assert _greedy(model) == want
        # the logits are the file's weights', not the unquantized model's
        ids = torch.tensor([[1, 5, 9, 33, 7, 64, 3]])
        with torch.no_grad():
            got, r = model(ids).logits, ref(ids).logits
            plain = tiny_model(arch)(ids).logits
        assert (got - r).abs().max() < 0.1 * (plain - r).abs().max()
    finally:
        specmoe.engine_of(model).close()


def test_bad_fp8_checkpoints_are_refused_naming_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file
    folder, _ = save_fp8_checkpoint(tiny_model("mixtral"), tmp_path / "m", block=32)
    shard = next(folder.glob("*.safetensors"))
    sd = load_file(str(shard))
    key = next(k for k in sd if k.endswith("weight_scale_inv"))
    weight = key[:-len("_scale_inv")]
    # a scale of the wrong shape
    bad = dict(sd, **{key: torch.ones(7, 7)})
    save_file(bad, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="weight_scale_inv has shape"):
        specmoe.from_pretrained(folder, cache=0.5, dtype="f32", progress=False)
    # a weight without its scale
    save_file({k: v for k, v in sd.items() if k != key}, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"FP8 tensor {weight} has no"):
        specmoe.convert(folder, progress=False)
    # FP8 tensors but no quantization_config: the scales' meaning is unknown
    save_file(sd, str(shard), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["quantization_config"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="no fp8 quantization_config"):
        specmoe.convert(folder, progress=False)


def test_bad_gptq_checkpoints_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file
    folder, _ = save_gptq_checkpoint(tiny_model("mixtral"), tmp_path / "m")
    shard = next(folder.glob("*.safetensors"))
    sd = load_file(str(shard))
    cfg = json.loads((folder / "config.json").read_text())
    key = next(k for k in sd if k.endswith(".qzeros"))
    save_file({k: v for k, v in sd.items() if k != key}, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="lacks .*qzeros"):
        specmoe.convert(folder, progress=False)
    save_file(sd, str(shard), metadata={"format": "pt"})
    for q, what in (({"quant_method": "bitsandbytes"}, "says 'bitsandbytes'"),
                    (dict(cfg["quantization_config"], bits=8), "bits=8")):
        (folder / "config.json").write_text(json.dumps(dict(cfg, quantization_config=q)))
        with pytest.raises(CheckpointError, match=what):
            specmoe.convert(folder, progress=False)


@pytest.mark.parametrize("act_order", [False, True])
def test_symmetric_gptq_experts_are_repacked_not_requantized(act_order, tmp_path, capfd):
    """dtype='auto' on a GPTQ checkpoint: int4.  Symmetric, in column order: the store holds
    the file's 4-bit values and scales (every stored weight equals the dequantized file's
    exactly); with act-order they are re-quantized, and the line says so."""
    from specmoe.storage import quant
    from specmoe.storage.store import ExpertStore
    folder, held = save_gptq_checkpoint(tiny_model("mixtral"), tmp_path / "g", group=32,
                                        act_order=act_order)
    store = specmoe.convert(folder, progress=False)
    err = capfd.readouterr().err
    st = ExpertStore(store)
    try:
        assert st.extra["dtype"] == "int4"
        t = st.read_expert(1, 3)
        got = quant.dequantize_expert(t)
        gu = held["model.layers.1.mlp.experts.gate_up_proj"][3].numpy()
        exact = np.array_equal(got["gate"], gu[:96]) and np.array_equal(got["up"], gu[96:]) \
            and np.array_equal(got["down"],
                               held["model.layers.1.mlp.experts.down_proj"][3].numpy())
        if act_order:
            assert "re-quantized" in err and st.extra.get("kept_blocks") is None
            assert not exact
        else:
            assert "repacked, not re-quantized" in err and st.extra["kept_blocks"] == "GPTQ"
            assert t["gate.scale"].shape == (96, 64 // 32) and exact
    finally:
        st.close()


def test_bad_awq_checkpoints_are_refused(tmp_path):
    folder, _ = save_awq_checkpoint(tiny_model("qwen3_moe"), tmp_path / "a")
    cfg = json.loads((folder / "config.json").read_text())
    q = cfg["quantization_config"]
    for bad, what in ((dict(q, version="gemv"), "AWQ version 'gemv'"),
                      (dict(q, zero_point=False), "zero_point=false"),
                      (dict(q, bits=3), "bits=3")):
        (folder / "config.json").write_text(json.dumps(dict(cfg, quantization_config=bad)))
        with pytest.raises(CheckpointError, match=what):
            specmoe.convert(folder, progress=False)
    # a qzeros tensor of the wrong shape is named with the weight's prefix
    from safetensors.torch import load_file, save_file
    (folder / "config.json").write_text(json.dumps(cfg))
    shard = next(folder.glob("*.safetensors"))
    sd = load_file(str(shard))
    key = next(k for k in sd if k.endswith("experts.1.down_proj.qzeros"))
    save_file(dict(sd, **{key: sd[key][:1]}), str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="AWQ tensors of .*experts.1.down_proj do not fit"):
        specmoe.convert(folder, progress=False)
    with pytest.raises(ValueError, match="none of them"):  # a bf16 folder has no Q4_1 to keep
        plain = tmp_path / "plain"
        from specmoe.models.testing import save_checkpoint
        save_checkpoint(tiny_model("qwen3_moe"), plain)
        specmoe.convert(plain, dtype="gguf", progress=False)


@pytest.mark.parametrize("fmt", ["awq", "gptq-asym"])
def test_asymmetric_experts_are_repacked_onto_q4_1_not_requantized(fmt, tmp_path, capfd):
    """dtype='auto' on an AWQ (or asymmetric GPTQ) checkpoint keeps the experts' 4-bit
    values and f16 scales as Q4_1 blocks (only the offset -zero * scale is rounded to f16):
    every stored weight is within that rounding of the file's dequantized weights, the
    model's logits on the exact kernel path match the transformers model holding the file's
    weights, and its greedy tokens equal them."""
    from specmoe import _C
    from specmoe.runtime import kernels
    from specmoe.storage import ggml_blocks as gb
    from specmoe.storage.store import ExpertStore

    arch = "qwen3_moe"
    if fmt == "awq":
        folder, held = save_awq_checkpoint(tiny_model(arch), tmp_path / "a", group=32)
    else:
        folder, held = save_gptq_checkpoint(tiny_model(arch), tmp_path / "g", group=32,
                                            sym=False)
    store = specmoe.convert(folder, progress=False)
    err = capfd.readouterr().err
    name = fmt.split("-")[0].upper()
    assert f"{name} 4-bit experts (asymmetric, groups of 32): the store keeps them as Q4_1" \
        in err, err
    st = ExpertStore(store)
    try:
        assert st.extra["dtype"] == "gguf" and st.extra["kept_blocks"] == name
        for layer, e in ((0, 0), (1, 5)):
            t = st.read_expert(layer, e)
            gu = held[f"model.layers.{layer}.mlp.experts.gate_up_proj"][e].numpy()
            dn = held[f"model.layers.{layer}.mlp.experts.down_proj"][e].numpy()
            I = t["gate"].shape[0]
            for n, want in (("gate", gu[:I]), ("up", gu[I:]), ("down", dn)):
                assert gb.block_kind(t[n]) == "q4_1"
                got = gb.dequantize(t[n])
                tol = 2.0 ** -11 * np.abs(want).max() * 2  # |offset| <= |w| range of the group
                assert np.abs(got - want).max() <= tol, (n, np.abs(got - want).max(), tol)
    finally:
        st.close()
    ref = tiny_model(arch)
    ref.load_state_dict(held, strict=False)
    ids = torch.tensor([[1, 5, 9, 33, 7, 64, 3]])
    want = _greedy(ref)
    model = specmoe.from_pretrained(folder, cache=0.5, progress=False,
                                    torch_dtype=torch.float32, dense="torch")
    try:
        with torch.no_grad():
            r = ref(ids).logits
            plain = tiny_model(arch)(ids).logits
            for isa in ("scalar", _C.KernelContext(1).isa_max):  # exact path, then the fast one
                kernels.set_isa(isa)
                got = model(ids).logits
                rel = float((got - r).norm() / r.norm())
                if isa == "scalar":
                    assert rel < 1e-3, rel  # the f16 offsets alone
                    assert _greedy(model) == want
                else:  # the int8 input's rounding on top
                    assert rel < 3e-2, rel
        assert (got - r).abs().max() < 0.1 * (plain - r).abs().max()
    finally:
        kernels.set_isa("auto")
        specmoe.engine_of(model).close()
