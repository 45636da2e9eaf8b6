"""MLA decode on a GGUF file's own attn_k_b / attn_v_b blocks against the same attention on
bf16 weights absorbed from kv_b_proj: the same file, one process, interleaved rounds.

    python benchmarks/mla_blocks.py --json [--file F.gguf] [--rounds 3] [--threads 1,2]
    python benchmarks/mla_blocks.py --quick --json    # a tiny DeepSeek-V3 file, 1 round

DeepSeek-V2/V3's MLA is decoded in the absorbed form (``specmoe.models.mla``): per head, W^UK
folded into the query (q_lat = W^UK^T q_nope) and W^UV into the output.  llama.cpp's
converter writes those two matrices as tensors of their own (``attn_k_b`` [heads, kv_lora,
nope], ``attn_v_b`` [heads, v, kv_lora]), quantized like any other; with ``dense="gguf"``
specmoe reads them as the file holds them (``_C.MLADecode(..., blocks=...)``, the block
kernels' one-token rows).  The other row, ``bf16-absorbed``, is what specmoe did before
(2026-12-02): kv_b_proj dequantized to bf16 and absorbed from it (``GgufCheckpoint.mla_blocks``
patched to report no blocks), every other layer the same.

Each round times both models in alternating order, at each thread count of ``--threads``:
``model.generate`` of 33 tokens after a 64-token prompt (greedy, no end-of-sequence stop),
32 decode steps timed as the difference with a 1-token generation of the same prompt, every
expert resident.  ``blocks_vs_bf16_runs`` is the per-round ratio of the two decode rates.

Default file: GLM-4.7-Flash's per-layer shapes (``benchmarks/hybrid_peers.py --arch
glm47flash``'s, written there when missing: 20 heads, nope 192, v 256, kv_lora 512).
``--file`` takes any ``deepseek2`` GGUF file, e.g. ``decode_peers.py``'s DeepSeek-V2-Lite
one.  ``--quick``: transformers' tiny DeepSeek-V3 (``specmoe.models.testing.tiny_model``, heads of
32 nope columns so that attn_k_b holds whole Q4_0 blocks) as a Q4_0 file, one round: a smoke
run.  The results name the host (CPU model, ISA, threads).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import hostinfo  # noqa: E402

PROMPT, DECODE = 64, 32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--file", help="a deepseek2 GGUF file (default: GLM-4.7-Flash's shapes)")
    ap.add_argument("--quick", action="store_true", help="a tiny file, one round (smoke)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--workdir", default=os.environ.get("SPECMOE_BENCH",
                                                        "~/.cache/specmoe/bench"))
    ap.add_argument("--save", help="also write the JSON object to this file")
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(",")]

    import numpy as np
    import torch

    import specmoe
    from big_model import load_every_expert
    from hybrid_peers import write_file
    from specmoe.runtime import kernels
    from specmoe.storage.gguf import GgufCheckpoint

    if a.quick:
        from specmoe.models.testing import save_gguf, tiny_model
        a.rounds = 1
        path = Path(a.workdir).expanduser() / "mla_blocks" / "tiny-deepseek-v3-Q4_0.gguf"
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file():
            save_gguf(tiny_model("deepseek_v3", overrides={"qk_nope_head_dim": 32}), path,
                      qtype="Q4_0")
        made = {"path": str(path), "quick": True}
    elif a.file:
        path, made = Path(a.file), {"path": a.file, "written": False}
    else:
        path = Path(a.workdir).expanduser() / "hybrid_peers" / "glm47flash-L4-E32-Q4_0.gguf"
        made = write_file(path, 4, 32, False, "glm47flash")
    with_blocks = GgufCheckpoint.mla_blocks
    models: dict[str, Any] = {}
    for name in ("gguf-blocks", "bf16-absorbed"):
        GgufCheckpoint.mla_blocks = with_blocks if name == "gguf-blocks" \
            else (lambda self, key: None)
        try:
            m = specmoe.from_pretrained(str(path), cache=1.0, progress=False, prefetch=False)
        finally:
            GgufCheckpoint.mla_blocks = with_blocks
        load_every_expert(specmoe.engine_of(m))
        m.generation_config.eos_token_id = None  # (as llama.cpp's --ignore-eos)
        models[name] = m
    att = [mod._specmoe_mla.weights for mod in models["gguf-blocks"].modules()
           if getattr(getattr(mod, "_specmoe_mla", None), "weights", None) is not None]
    if not att or att[0].fmt != "gguf":
        raise SystemExit(f"{path}: its MLA attention does not run on the file's blocks "
                         "(a file with the joined attn_kv_b, or no MLA)")
    kinds = att[0].kernel.shape
    vocab = models["gguf-blocks"].config.vocab_size
    x = torch.tensor([np.random.default_rng(0).integers(3, vocab, PROMPT).tolist()])

    def rate(m: Any, n: int = DECODE) -> float:
        def gen(k: int) -> float:
            t0 = time.perf_counter()
            with torch.inference_mode():
                m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=k,
                           do_sample=False, pad_token_id=0)
            return time.perf_counter() - t0
        return n / (gen(n + 1) - gen(1))

    rows = []
    for th in threads:
        torch.set_num_threads(th)
        kernels.set_num_threads(th)
        for m in models.values():
            rate(m, 8)  # warm-up
        runs: dict[str, list[float]] = {k: [] for k in models}
        for k in range(a.rounds):
            for name in (list(models) if k % 2 == 0 else list(models)[::-1]):
                runs[name].append(rate(models[name]))
            print(f"[mla_blocks] threads {th} round {k + 1}: "
                  + ", ".join(f"{n} {v[-1]:.1f} tok/s" for n, v in runs.items()),
                  file=sys.stderr, flush=True)
        rows.append({"threads": th,
                     **{f"{n}_tok_per_s_runs": [round(v, 2) for v in r]
                        for n, r in runs.items()},
                     "blocks_vs_bf16_runs": [round(b / f, 3) for b, f in
                                             zip(runs["gguf-blocks"], runs["bf16-absorbed"])]})
    for m in models.values():
        specmoe.engine_of(m).close()
    res = {"config": {"file": made, "model": models["gguf-blocks"].config.model_type,
                      "mla": {k: kinds[k] for k in ("heads", "qk_nope_head_dim", "v_head_dim",
                                                    "kv_lora_rank", "dtype", "uv_dtype")},
                      "prompt_tokens": PROMPT, "decode_tokens": DECODE, "rounds": a.rounds,
                      "machine": hostinfo.host(threads)},
           "rows": rows}
    hostinfo.emit(res, a.save, a.json)


if __name__ == "__main__":
    main()
