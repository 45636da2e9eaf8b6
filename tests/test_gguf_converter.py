"""GGUF files written by llama.cpp's own converter (``convert_hf_to_gguf.py``), read by specmoe:
the independent check of the metadata and tensor-name mapping (specmoe.storage.gguf) that
tests/test_gguf.py checks against specmoe's own writer.

A tiny checkpoint of each architecture is saved as a transformers folder (with the keys the
released configs carry that transformers' tiny config does not write: DeepSeek-V3's,
GLM-4.7-Flash's, MiniMax-M2's and dots.llm1's ``scoring_func``, GLM's
``first_k_dense_replace`` and ``num_nextn_predict_layers``, MiniMax-M2's ``rotary_dim``),
converted to F32 (Qwen3-Next's and Qwen3.5's files: their norms stored as 1 + w, A_log as
-exp(A_log), the linear attention's projections split and their value heads reordered, all
of which the reader undoes)
GGUF by the converter of the llama-cpp-python source distribution that
``benchmarks/big_model.py --build-peers`` unpacks under ``$SPECMOE_PEERS`` (default
``~/.cache/specmoe/peers``), and loaded with ``specmoe.from_pretrained``; its logits must equal
transformers' on the folder.  Two things of the converter are set aside, neither of which
touches the weights: the BPE pre-tokenizer check (it knows released tokenizers by hash, not
the zoo's) and the vocabulary setters of GLM, ERNIE and llama.cpp's LlamaModel (Granite's and
Trinity's converters derive from it): GLM's looks for GLM's special tokens, the others try a
sentencepiece model first; the zoo's tokenizer is byte-level BPE.
Skipped where the source distribution is not unpacked."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

import specmoe  # noqa: E402
from specmoe import zoo  # noqa: E402
from specmoe.models.testing import save_checkpoint, tiny_model  # noqa: E402


def _converter() -> Path | None:
    peers = Path(os.environ.get("SPECMOE_PEERS", "~/.cache/specmoe/peers")).expanduser()
    found = sorted(peers.glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    return found[-1] if found else None


pytestmark = pytest.mark.skipif(_converter() is None,
                                reason="llama.cpp's convert_hf_to_gguf.py is not unpacked under "
                                       "$SPECMOE_PEERS (benchmarks/big_model.py --build-peers)")

# run the converter with the two checks that do not concern the weights set aside
_WRAPPER = """
import runpy, sys
src = sys.argv.pop(1)
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
for cls in vars(base).values():
    if isinstance(cls, type) and hasattr(cls, "get_vocab_base_pre"):
        cls.get_vocab_base_pre = lambda self, tokenizer: "default"
import conversion.glm as glm
glm.Glm4MoeLiteModel.set_vocab = lambda self: self._set_vocab_gpt2()
glm.Glm4MoeModel.set_vocab = lambda self: self._set_vocab_gpt2()
import conversion.ernie as ernie
ernie.Ernie4_5Model.set_vocab = lambda self: self._set_vocab_gpt2()
import conversion.llama as llama
llama.LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv[0] = src + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""

# config.json keys the released checkpoints carry (transformers' configs do not keep them)
_RELEASED = {
    "deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"},
    "glm4_moe_lite": {"scoring_func": "sigmoid", "topk_method": "noaux_tc",
                      "first_k_dense_replace": 1, "num_nextn_predict_layers": 1},
    # (GLM-4.5 / 4.7 and GLM-4.7-Flash carry one multi-token-prediction layer, which the
    # converter appends as a block after the main ones: block_count says one more)
    "glm4_moe": {"num_nextn_predict_layers": 1},
    "minimax_m2": {"rotary_dim": 8, "scoring_func": "sigmoid"},  # (head_dim 16, half rotary)
    "dots1": {"scoring_func": "sigmoid"},
    "granitemoehybrid": {"position_embedding_type": "nope"},  # (Granite 4.0 H: NoPE)
    "afmoe": {"route_norm": True},
}
# tiny models in the released form where the converter has no other (Trinity: three
# sliding-window layers, then a global one, which llama.cpp assumes; LFM2: tied embeddings)
_TINY = {"afmoe": dict(layers=4, overrides={"layer_types": ["sliding_attention"] * 3
                                                          + ["full_attention"]}),
         "lfm2_moe": dict(overrides={"tie_word_embeddings": True})}
# multi-token-prediction blocks of the released checkpoints, as mtp.* tensors (Qwen3-Next,
# Qwen3.5: one full-attention decoder layer, here a copy of layer 1, with its projection and
# norms; Qwen3.5's config says how many, Qwen3-Next's converter counts them)
_MTP = {"qwen3_next": {}, "qwen3_5_moe_text": {"mtp_num_hidden_layers": 1}}


def _add_mtp_block(folder: Path, hidden: int) -> None:
    from safetensors.torch import load_file, save_file
    g = torch.Generator().manual_seed(0)
    mtp = {"mtp.layers.0." + k[len("model.layers.1."):]: v.clone()
           for k, v in load_file(folder / "model.safetensors").items()
           if k.startswith("model.layers.1.")}
    mtp["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.02
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{n}.weight"] = torch.randn(hidden, generator=g) * 0.1
    save_file(mtp, str(folder / "model-mtp.safetensors"), metadata={"format": "pt"})


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMOE_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("arch,as_type", [("deepseek_v3", "deepseek_v3"),
                                          ("glm4_moe_lite", "deepseek_v3"),
                                          ("glm4_moe", "glm4_moe"),
                                          ("minimax_m2", "minimax_m2"),
                                          ("dots1", "dots1"),
                                          ("deepseek_v2", "deepseek_v2"),
                                          ("qwen3_moe", "qwen3_moe"),
                                          ("qwen3_next", "qwen3_next"),
                                          ("qwen3_5_moe_text", "qwen3_5_moe_text"),
                                          ("ernie4_5_moe", "ernie4_5_moe"),
                                          ("granitemoe", "granitemoe"),
                                          ("granitemoeshared", "granitemoeshared"),
                                          ("granitemoehybrid", "granitemoehybrid"),
                                          ("afmoe", "afmoe"),
                                          ("lfm2_moe", "lfm2_moe")])
def test_the_converters_file_gives_the_checkpoints_logits(arch, as_type, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(zoo.path("tiny-moe"))
    folder = save_checkpoint(tiny_model(arch, vocab=tok.vocab_size, **_TINY.get(arch, {})),
                             tmp_path / "ckpt", tokenizer=tok)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(_RELEASED.get(arch, {}), **_MTP.get(arch, {}))
    if arch == "granitemoehybrid":  # the released configs' layer names, which the converter
        # reads (transformers reads both)
        cfg["layer_types"] = ["attention" if t == "full_attention" else "mamba"
                              for t in cfg["layer_types"]]
    (folder / "config.json").write_text(json.dumps(cfg))
    if arch in _MTP:
        _add_mtp_block(folder, cfg["hidden_size"])
    out = tmp_path / f"{arch}.gguf"
    conv = _converter()
    import gguf
    run = subprocess.run([sys.executable, "-c", _WRAPPER, str(conv.parent), str(folder),
                          "--outtype", "f32", "--outfile", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    reader = gguf.GGUFReader(str(out))
    meta = reader.fields
    L = cfg["num_hidden_layers"]
    if arch in _MTP:  # the MTP block is in the file (and left out by the reader)
        assert any(t.name.startswith(f"blk.{L}.nextn.") for t in reader.tensors)
    arch_name = bytes(meta["general.architecture"].parts[-1]).decode()
    nextn = _RELEASED.get(arch, {}).get("num_nextn_predict_layers", int(arch in _MTP))
    assert int(meta[f"{arch_name}.block_count"].parts[-1][0]) == L + nextn
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                               experts_implementation="eager").eval()
    model = specmoe.from_pretrained(out, cache=0.5, dtype="f32", progress=False,
                                    torch_dtype=torch.float32)
    try:
        assert model.config.model_type == as_type
        assert model.config.num_hidden_layers == L  # (the MTP block left out)
        ids = torch.tensor([[1, 5, 9, 33, 7, 64, 3]])
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-5,
                                       rtol=1e-5)
    finally:
        specmoe.engine_of(model).close()
