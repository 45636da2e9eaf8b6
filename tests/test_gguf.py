"""GGUF files read as checkpoints (issue 40, item 2; specmoe.storage.gguf).

The files are written by specmoe.models.testing.save_gguf the way llama.cpp's converter writes
them (its names, metadata keys, q/k row permutation, DeepSeek's kv_b split; checked by hand
against the converter's own output: the zoo model, same tokenizer ids and greedy tokens; a
tiny DeepSeek-V2 with YaRN rope scaling, same greedy tokens).  The
reference is the unmodified transformers model holding the weights the file holds (each
quantized tensor dequantized by the ``gguf`` package, on the writer's side)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")

import specmoe  # noqa: E402
from specmoe import zoo  # noqa: E402
from specmoe.models.testing import save_gguf, tiny_config, tiny_model  # noqa: E402
from specmoe.storage.gguf import GgufCheckpoint, GgufError  # noqa: E402


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMOE_CACHE", str(tmp_path / "cache"))


def _greedy(model, n=10):
    ids = torch.tensor([[1, 5, 9, 33, 7, 64, 3]])
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()


# as released, where a GGUF file has no other form (LFM2: no output matrix of its own)
_OVER = {"lfm2_moe": {"tie_word_embeddings": True}}


def _reference(arch, held):
    ref = tiny_model(arch, overrides=_OVER.get(arch))
    missing, unexpected = ref.load_state_dict(held, strict=False)
    tied = ["lm_head.weight"] if ref.config.tie_word_embeddings else []
    assert not unexpected and all("rotary" in k or k in tied for k in missing), \
        (missing, unexpected)
    return ref


@pytest.mark.parametrize("arch,qtype", [
    ("mixtral", "F32"), ("qwen2_moe", "F32"), ("qwen3_moe", "Q4_0"), ("olmoe", "Q8_0"),
    ("deepseek_v2", "F32"), ("deepseek_v2", "Q4_0"), ("deepseek_v3", "F32"),
    ("deepseek_v3", "Q4_0"), ("glm4_moe", "F32"), ("glm4_moe", "Q8_0"), ("minimax_m2", "F32"),
    ("minimax_m2", "Q8_0"), ("dots1", "F32"), ("dots1", "Q4_0"), ("gpt_oss", "F32"),
    ("gpt_oss", "Q8_0"), ("qwen3_next", "F32"), ("qwen3_next", "Q8_0"),
    ("qwen3_5_moe_text", "F32"), ("qwen3_5_moe_text", "Q4_0"), ("ernie4_5_moe", "F32"),
    ("ernie4_5_moe", "Q8_0"), ("granitemoe", "F32"), ("granitemoeshared", "Q4_0"),
    ("granitemoehybrid", "F32"), ("granitemoehybrid", "Q8_0"), ("afmoe", "F32"),
    ("afmoe", "Q8_0"), ("lfm2_moe", "F32"), ("lfm2_moe", "Q4_0")])
def test_greedy_equal_to_the_weights_the_file_holds(arch, qtype, tmp_path):
    path, held = save_gguf(tiny_model(arch, overrides=_OVER.get(arch)),
                           tmp_path / f"{arch}.gguf", qtype=qtype)
    want = _greedy(_reference(arch, held))
    # (dense weights: bf16 in memory from a quantized file unless asked otherwise)
    model = specmoe.from_pretrained(path, cache=0.5, dtype="f32", progress=False,
                                    torch_dtype=torch.float32)
    try:
        assert _greedy(model) == want
        assert specmoe.engine_of(model).dtype == "f32"
        ids = torch.tensor([[1, 5, 9, 33, 7, 64, 3]])  # (and the logits, closer than tokens)
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, _reference(arch, held)(ids).logits,
                                       atol=1e-4, rtol=1e-4)
    finally:
        specmoe.engine_of(model).close()
    # every dense tensor as the reader gives it (its name, layout and values put back) is
    # the one the file holds: closer than the logits, where a tiny model's (1 + w) norm or
    # decay rate moves little
    ck = GgufCheckpoint.open(path)
    dense = [k for k in ck.keys if ".experts." not in k]
    assert set(dense) <= set(held), set(dense) - set(held)
    for k in dense:
        torch.testing.assert_close(ck.tensor(k), held[k].float(), atol=1e-6, rtol=1e-5,
                                   msg=lambda m, k=k: f"{k}: {m}")
    # the config read from the metadata is the model's
    cfg, got = tiny_config(arch), ck.config()
    for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "num_experts_per_tok", "kv_lora_rank", "v_head_dim",
              "qk_nope_head_dim", "qk_rope_head_dim", "n_shared_experts",
              "first_k_dense_replace", "moe_intermediate_size", "layer_types",
              "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
              "linear_value_head_dim", "linear_conv_kernel_dim",
              "shared_expert_intermediate_size"):
        mla = arch.startswith("deepseek")
        if k == "num_key_value_heads" and mla:
            continue  # MLA: the file says 1 (llama.cpp's MQA form), transformers ignores it
        if hasattr(cfg, k) and (k in got or mla):
            assert got[k] == getattr(cfg, k), k
    assert [got[k] for k in ("num_experts", "num_local_experts", "n_routed_experts",
                             "moe_num_experts") if k in got] == [8]



def test_tensors_not_named_weight_stay_f32(tmp_path):
    """As llama.cpp's converter, only ``*.weight`` tensors are quantized: ERNIE-4.5's [1, E]
    ``exp_probs_b.bias`` with E a whole number of blocks was written Q4_0 and llama.cpp's add
    refused the file (``binary_op: unsupported types``)."""
    import gguf
    path, _ = save_gguf(tiny_model("ernie4_5_moe", overrides={"moe_num_experts": 32}),
                        tmp_path / "e.gguf", qtype="Q4_0")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    bias = [n for n in types if n.endswith("exp_probs_b.bias")]
    assert bias and all(types[n] == gguf.GGMLQuantizationType.F32 for n in bias)
    assert any(t == gguf.GGMLQuantizationType.Q4_0 for t in types.values())


def test_deepseek2_with_sigmoid_routing_is_deepseek_v3(tmp_path):
    """A deepseek2 file with expert_gating_func 2 (sigmoid: DeepSeek-V3 / R1, Kimi-K2,
    GLM-4.7-Flash) is read as transformers' deepseek_v3: group-limited sigmoid routing with
    each layer's correction bias (exp_probs_b, non-zero here, so a lost bias changes the
    experts chosen), its scaling and normalisation, the interleaved rotary pairs; other
    gating functions are refused by name before any conversion."""
    import gguf
    m = tiny_model("deepseek_v3")
    path, held = save_gguf(m, tmp_path / "v3.gguf")
    bias = [k for k in held if k.endswith("e_score_correction_bias")]
    assert bias and all(held[k].abs().sum() > 0 for k in bias)
    ck = GgufCheckpoint.open(path)
    try:
        got = ck.config()
        assert ck.model_type == "deepseek_v3" and ck.arch == "deepseek2"
        assert {k: got[k] for k in ("n_group", "topk_group", "norm_topk_prob",
                                    "routed_scaling_factor", "rope_interleave")} == \
            {"n_group": 2, "topk_group": 2, "norm_topk_prob": True,
             "routed_scaling_factor": 2.5, "rope_interleave": True}
        assert "topk_method" not in got
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in ck.keys
    finally:
        ck.close()
    # the bias matters: dropped from the reference, the greedy tokens change
    want = _greedy(_reference("deepseek_v3", held))
    nob = dict(held, **{k: torch.zeros_like(held[k]) for k in bias})
    assert _greedy(_reference("deepseek_v3", nob)) != want
    model = specmoe.from_pretrained(path, cache=0.5, dtype="f32", progress=False,
                                    torch_dtype=torch.float32)
    try:
        assert _greedy(model) == want
    finally:
        specmoe.engine_of(model).close()
    # the same file as if written with DeepSeek-V4's sqrt-softplus gating (3)
    real = gguf.GGUFWriter.add_expert_gating_func
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.GGUFWriter, "add_expert_gating_func",
                   lambda w, v: w.add_uint32("deepseek2.expert_gating_func", 3))
        p3, _ = save_gguf(m, tmp_path / "v4.gguf")
    assert gguf.GGUFWriter.add_expert_gating_func is real
    with pytest.raises(GgufError, match="v4.gguf: a deepseek2 file with expert_gating_func 3"):
        specmoe.convert(p3, progress=False)
    assert not list(tmp_path.glob("cache/v4*"))  # nothing written for it

def test_auto_dtype_keeps_the_blocks_or_picks_the_nearest_store_format(tmp_path, capfd):
    from specmoe.storage.store import ExpertStore
    p51, _ = save_gguf(tiny_model("mixtral"), tmp_path / "m51.gguf", qtype="Q5_1")
    st = ExpertStore(specmoe.convert(p51, progress=False))
    err = capfd.readouterr().err
    assert "experts are Q5_1: the store holds them as int4" in err, err
    assert "not kept as they are" in err
    try:
        assert st.extra["dtype"] == "int4"
    finally:
        st.close()
    path, _ = save_gguf(tiny_model("mixtral"), tmp_path / "m.gguf", qtype="Q8_0")
    store = specmoe.convert(path, progress=False)
    assert "experts are Q8_0: the store keeps their blocks as they are" in capfd.readouterr().err
    st = ExpertStore(store)
    try:
        assert st.extra["dtype"] == "gguf"
    finally:
        st.close()
    # the second call reuses the store; an edited file is seen as stale
    assert specmoe.convert(path, progress=False) == store
    assert "converting" not in capfd.readouterr().err
    save_gguf(tiny_model("mixtral", seed=3), path, qtype="Q8_0")
    specmoe.convert(path, progress=False)
    assert "(stale)" in capfd.readouterr().err


def test_tokenizer_from_the_metadata(tmp_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(zoo.path("tiny-moe"))
    # the chat template travels too (tokenizer.chat_template: run --chat on a GGUF file)
    tok.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    path, _ = save_gguf(tiny_model("mixtral"), tmp_path / "t.gguf", tokenizer=tok)
    got = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    text = "def parse(line):\n    return line.split(',')  # ok"
    assert got(text).input_ids == tok(text).input_ids
    from specmoe.models.pretrained import load_tokenizer
    assert load_tokenizer(path).chat_template == tok.chat_template
    # a gpt-oss file with YaRN keys, whose config transformers' AutoTokenizer fails to parse:
    # specmoe's loader falls back to the tokenizer built from the vocabulary alone
    p2, _ = save_gguf(tiny_model("gpt_oss", vocab=tok.vocab_size), tmp_path / "o.gguf",
                      tokenizer=tok)
    assert load_tokenizer(p2)(text).input_ids == tok(text).input_ids
    assert load_tokenizer(p2).chat_template == tok.chat_template


def test_bad_files_raise_naming_the_file(tmp_path):
    import gguf
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(GgufError, match="junk.gguf: not a readable GGUF"):
        specmoe.convert(bad, progress=False)
    path, _ = save_gguf(tiny_model("olmoe"), tmp_path / "o.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(GgufError, match="cut.gguf"):
        specmoe.convert(cut, progress=False)
    for arch, experts, what in (("gpt2", 8, "architecture 'gpt2' is not read"),
                                ("llama", 0, "without experts")):
        p = tmp_path / f"{arch}.gguf"
        w = gguf.GGUFWriter(str(p), arch)
        w.add_expert_count(experts)
        w.add_tensor("token_embd.weight", torch.zeros(4, 32).numpy())
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with pytest.raises(GgufError, match=what):
            specmoe.convert(p, progress=False)
    assert not list(tmp_path.glob("cache/*.smoe"))  # nothing was written for any of them


def test_linear_attention_decay_that_cannot_be_undone_is_refused_by_name(tmp_path):
    """Qwen3-Next's file holds A = -exp(A_log): a value >= 0 (or NaN) has no A_log; it is
    refused naming the file and tensor, not loaded as NaN."""
    import gguf
    path, _ = save_gguf(tiny_model("qwen3_next"), tmp_path / "bad.gguf")
    r = gguf.GGUFReader(str(path), "r+")
    next(t for t in r.tensors if t.name == "blk.0.ssm_a").data[1] = 0.5
    del r
    with pytest.raises(GgufError, match="bad.gguf: model.layers.0.linear_attn.A_log is stored"):
        specmoe.from_pretrained(path, cache=0.5, dtype="f32", progress=False)


@pytest.mark.parametrize("arch,qtype", [("mixtral", "Q8_0"), ("gpt_oss", "MXFP4")])
def test_cli_convert_and_run_a_gguf_file(tmp_path, capsys, arch, qtype):
    from transformers import AutoTokenizer

    from specmoe.cli import main
    tok = AutoTokenizer.from_pretrained(zoo.path("tiny-moe"))
    path, _ = save_gguf(tiny_model(arch, vocab=tok.vocab_size), tmp_path / "c.gguf",
                        qtype="Q8_0", expert_qtype=qtype, tokenizer=tok)
    assert main(["convert", str(path), "--quiet"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.endswith("-gguf.smoe")  # the Q8_0 / MXFP4 blocks kept as they are
    assert main(["run", str(path), "--prompt", "def parse(line):", "--max-new-tokens", "4",
                 "--cache", "50%"]) == 0
    assert "| cache " in capsys.readouterr().out


def test_q4_0_experts_are_kept_bit_for_bit(tmp_path, capfd):
    """A Q4_0 file's experts go into an int4 store with groups of 32 without dequantizing:
    every stored weight is the gguf package's dequantization of the file's block, exactly, and
    the kernel computes with them (exact path: to f32 rounding of the f32 math on those
    weights; fast path: the quantized-activation arithmetic of the AVX2 form)."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    from specmoe.runtime import kernels
    from specmoe.storage import quant
    from specmoe.storage.store import ExpertStore
    path, _ = save_gguf(tiny_model("olmoe", hidden=128, inter=96), tmp_path / "q.gguf",
                        qtype="Q4_0")
    # dtype='auto' keeps the Q4_0 blocks as they are in a 'gguf' store (test_gguf_blocks.py);
    # an int4 store takes them too, in groups of 32
    assert specmoe.convert(path, progress=False).name.endswith("-gguf.smoe")
    assert "the store keeps their blocks as they are" in capfd.readouterr().err
    store = specmoe.convert(path, dtype="int4", progress=False)
    rd = gguf.GGUFReader(str(path))
    by_name = {t.name: t for t in rd.tensors}
    st = ExpertStore(store)
    try:
        assert st.extra["dtype"] == "int4" and st.extra["kept_blocks"] == "Q4_0"
        for layer in (0, st.num_layers - 1):
            for e in (0, 5):
                t = st.read_expert(layer, e)
                assert t["gate.scale"].shape == (96, 128 // 32)
                got = quant.dequantize_expert(t)
                for name in ("gate", "up", "down"):
                    raw = by_name[f"blk.{layer}.ffn_{name}_exps.weight"]
                    want = dequantize(np.asarray(raw.data[e]), raw.tensor_type)
                    np.testing.assert_array_equal(got[name], want)
                x = np.random.default_rng(e).standard_normal((3, 128)).astype(np.float32)
                ref = kernels.ffn({k: v for k, v in got.items()}, x, "f32", "silu")
                y = kernels.ffn(t, x, "int4", "silu", precise=True)
                np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)
                yf = kernels.ffn(t, x, "int4", "silu")  # the fast path: activations rounded
                assert np.linalg.norm(yf - ref) / np.linalg.norm(ref) < 3e-2
    finally:
        st.close()


def test_streamed_random_gguf_is_a_model_both_sides_read(tmp_path):
    """benchmarks/big_model.py --source gguf writes its random model straight into a Q4_0
    file, tensor by tensor, with the metadata and tokenizer helpers save_gguf uses: specmoe
    reads back the config it was written from, the tokenizer padded to the vocabulary, and
    weights of the intended scale with no common mean (a common mean made random models
    repeat one token)."""
    import sys
    from pathlib import Path

    import gguf
    import numpy as np
    from gguf.quants import dequantize
    from transformers import AutoTokenizer
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import big_model

    for key, vocab in (("qwen3-30b-a3b", 8300), ("dsv2lite", 8200)):
        cfg = big_model.make_config(2, vocab, key)
        cfg["moe_intermediate_size"] = 64  # small experts, the model's other shapes
        path = tmp_path / f"{key}.gguf"
        big_model.write_gguf(path, cfg, seed=0, skew=1.0, qtype="Q4_0")
        got = GgufCheckpoint.open(path).config()
        for k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "num_experts_per_tok",
                  "moe_intermediate_size"):
            assert got[k] == cfg[k], k
        r = gguf.GGUFReader(str(path))
        toks = r.fields["tokenizer.ggml.tokens"]
        assert len(toks.data) == vocab
        types = r.fields["tokenizer.ggml.token_type"]
        last = types.parts[types.data[-1]][0]
        assert last == gguf.TokenType.UNUSED and bytes(toks.parts[toks.data[-1]]) == \
            f"[PAD{vocab - 1}]".encode()
        t = next(t for t in r.tensors if t.name == "blk.1.ffn_up_exps.weight")
        assert t.tensor_type == gguf.GGMLQuantizationType.Q4_0
        w = dequantize(np.asarray(t.data), t.tensor_type)
        assert abs(w.std() - 0.02) < 0.002 and abs(w.mean()) < 2e-4
        if key == "qwen3-30b-a3b":  # (transformers reads no deepseek2 tokenizer from GGUF)
            tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
            assert len(tok) == vocab
    model = specmoe.from_pretrained(path, cache=0.5, dtype="auto", progress=False)
    try:
        ids = torch.tensor([[5, 600, 7000, 8, 900, 1000]])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert out.shape == (1, 12)
    finally:
        specmoe.engine_of(model).close()


@pytest.mark.parametrize("qtype,dtype,fuse", [("Q8_0", "auto", False), ("Q4_0", "int4", True),
                                              ("Q4_0", "auto", True), ("MXFP4", "auto", False)])
def test_gpt_oss_file_keeps_its_blocks_and_expert_biases(tmp_path, capfd, qtype, dtype, fuse):
    """A gpt-oss file as llama.cpp's converter writes it (gate / up split out of GPT-OSS's
    interleaved gate_up_proj, or stacked in one ffn_gate_up_exps; F32 expert biases; sinks;
    the post-attention norm; sliding-window layers and YaRN in the metadata): its config is the
    model's, its expert blocks are kept with the biases beside them, and on the exact kernel
    path its logits equal the transformers model holding the weights the file holds."""
    import numpy as np

    from specmoe import _C
    from specmoe.runtime import kernels
    from specmoe.storage.store import ExpertStore

    path, held = save_gguf(tiny_model("gpt_oss"), tmp_path / "oss.gguf", qtype=qtype,
                           fuse_gate_up=fuse)
    want_cfg, got = tiny_config("gpt_oss"), GgufCheckpoint.open(path).config()
    assert got["model_type"] == "gpt_oss"
    for k in ("layer_types", "sliding_window", "intermediate_size", "num_local_experts",
              "head_dim", "rope_parameters", "tie_word_embeddings"):
        assert got[k] == getattr(want_cfg, k), k
    store = specmoe.convert(path, dtype=dtype, progress=False)
    st = ExpertStore(store)
    try:
        assert st.extra["dtype"] == ("gguf" if dtype == "auto" else dtype)
        assert st.extra["kept_blocks"] == qtype
        for layer in (0, st.num_layers - 1):
            b = held[f"model.layers.{layer}.mlp.experts.gate_up_proj_bias"][5].numpy()
            d = held[f"model.layers.{layer}.mlp.experts.down_proj_bias"][5].numpy()
            t = st.read_expert(layer, 5)
            np.testing.assert_array_equal(t["gate.bias"], b[0::2])
            np.testing.assert_array_equal(t["up.bias"], b[1::2])
            np.testing.assert_array_equal(t["down.bias"], d)
    finally:
        st.close()
    ref = tiny_model("gpt_oss")
    missing, unexpected = ref.load_state_dict(held, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    ids = torch.tensor([[1, 5, 9, 33, 7, 64, 3, 17]])
    with torch.no_grad():
        want = ref(ids).logits
    model = specmoe.from_pretrained(path, cache=0.5, dtype=dtype, progress=False,
                                    dense="torch", torch_dtype=torch.float32)
    try:
        kernels.set_isa("scalar")  # the exact path: the f32 math on the file's weights
        with torch.no_grad():
            got_logits = model(ids).logits
        assert float((got_logits - want).norm() / want.norm()) < 1e-5
        assert _greedy(model) == _greedy(ref)
        kernels.set_isa(_C.KernelContext(1).isa_max)  # the fast path: close
        with torch.no_grad():
            fast = model(ids).logits
        assert float((fast - want).norm() / want.norm()) < 3e-2
    finally:
        kernels.set_isa("auto")
        specmoe.engine_of(model).close()
    assert "not kept as they are" not in capfd.readouterr().err


def test_gpt_oss_file_without_its_expert_biases_is_refused_by_name(tmp_path, monkeypatch):
    """A gpt-oss file whose block lacks an expert bias (a truncated or hand-edited conversion)
    is refused naming the tensor, before anything is written."""
    import gguf
    orig = gguf.GGUFWriter.add_tensor

    def add_tensor(self, name, *a, **kw):
        if name != "blk.1.ffn_down_exps.bias":
            orig(self, name, *a, **kw)
    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add_tensor)
    path, _ = save_gguf(tiny_model("gpt_oss"), tmp_path / "nobias.gguf")
    monkeypatch.undo()
    with pytest.raises(GgufError,
                       match=r"block 1 lacks expert tensors blk\.1\.ffn_down_exps\.bias"):
        specmoe.convert(path, progress=False)
    assert not list(tmp_path.glob("cache/*.smoe"))
