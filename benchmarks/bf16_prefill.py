"""A bf16 model's prompt forward (TTFT) by how its dense layers' long products run: torch's bf16
GEMM, specmoe's C kernels at every size, or the widened f32 product (what specmoe runs).

    python benchmarks/bf16_prefill.py --json [--model dsv2lite] [--prompt-tokens 256,1024]

Above ``TORCH_ABOVE`` tokens a bf16 ``CLinear`` (attention projections, dense and shared MLPs)
hands its product to torch.  Where torch has no oneDNN bf16 GEMM (AVX2-only hosts:
``torch_bf16_gemm_fast()`` false) its fallback is slow, and specmoe widens the weight to f32 a
chunk at a time instead (``specmoe.models.layers.linear_widened``).  This times the whole
prompt forward, ``model(ids, logits_to_keep=1)``, of the ``decode_peers.py`` model shapes
(random weights, every expert resident, bf16 experts and dense layers) under three settings of
that one switch, in one process, each round in a rotated order:

* ``torch_bf16``: torch's own bf16 GEMM (``torch_bf16_gemm_fast`` forced true: the rule before);
* ``c_kernels``: no switch at all, every size in specmoe's C kernels (``torch_above=None``);
* ``widened``: the rule on this host as shipped.

Reported per prompt length: each setting's seconds per round, the per-round ratios
``widened_vs_torch_bf16`` and ``widened_vs_c_kernels`` (> 1: widened faster) and their
medians, and whether the last position's greedy token is the same under all three (with the
largest logit difference).  On a host where ``torch_bf16_gemm_fast()`` is true ``widened`` is
torch's bf16 GEMM itself, and the JSON says so (``config.torch_bf16_fast``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import big_model as bm  # noqa: E402  (prompts)
import decode_peers as dp  # noqa: E402  (the model shapes and their files)
import hostinfo  # noqa: E402

SETTINGS = ("torch_bf16", "c_kernels", "widened")


def log(*a: Any) -> None:
    print("[bf16_prefill]", *a, file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--model", default="dsv2lite", choices=("dsv2lite", "olmoe"))
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (dsv2lite: the "
                    "first is dense)")
    ap.add_argument("--prompt-tokens", default="256,1024")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workdir", default="~/.cache/specmoe/bench")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (smoke runs)")
    ap.add_argument("--save", help="also write the JSON object to this file")
    a = ap.parse_args()
    lengths = [int(x) for x in a.prompt_tokens.split(",") if x.strip()]
    if not lengths or min(lengths) < 2 or a.rounds < 1 or a.threads < 1 or a.layers < 2:
        ap.error("--prompt-tokens >= 2, --rounds and --threads >= 1, --layers >= 2")

    import specmoe  # before torch, as users should (OMP_WAIT_POLICY)
    import torch

    from specmoe.models import layers
    from specmoe.runtime import kernels
    torch.set_num_threads(a.threads)
    kernels.set_num_threads(a.threads)
    cfg = (dp.olmoe_config(a.layers, quick=a.quick) if a.model == "olmoe"
           else dp.dsv2_config(a.layers, quick=a.quick))
    row = {"name": "specmoe+dense-bf16", "kind": "specmoe", "precision": "bf16"}
    prep = dp.prepare(a.model, cfg, argparse.Namespace(
        workdir=a.workdir, seed=a.seed, router_skew=1.0, row_timeout=3600.0,
        prompt_tokens=max(lengths)), [row], None)
    if prep["err"]:
        raise SystemExit(f"bf16_prefill: {prep['err']}")
    log("loading", prep["ckpt"])
    model = specmoe.from_pretrained(prep["ckpt"], cache=1.0, dtype="bf16", policy="lru",
                                    prefetch=False, store=prep["store"][row["name"]],
                                    torch_dtype=torch.bfloat16, progress=False,
                                    dense="bf16").eval()
    eng = specmoe.engine_of(model)
    bm.load_every_expert(eng)
    clinears = [m for m in model.modules() if isinstance(m, layers.CLinear)]
    above = {id(m): m.torch_above for m in clinears}
    shipped = layers.torch_bf16_gemm_fast

    def setting(name: str) -> None:
        layers.torch_bf16_gemm_fast = (lambda: True) if name == "torch_bf16" else shipped
        for m in clinears:
            m.torch_above = None if name == "c_kernels" else above[id(m)]

    rows = []
    try:
        for T in lengths:
            timed, warm = bm.make_prompts(prep["ckpt"], T, a.seed + T)
            secs: dict[str, list[float]] = {s: [] for s in SETTINGS}
            last: dict[str, Any] = {}
            with torch.inference_mode():
                setting("widened")
                model(torch.tensor([warm]), logits_to_keep=1)
                for r in range(a.rounds):
                    k = r % len(SETTINGS)
                    for s in SETTINGS[k:] + SETTINGS[:k]:
                        setting(s)
                        t0 = time.perf_counter()
                        out = model(torch.tensor([timed]), logits_to_keep=1)
                        secs[s].append(time.perf_counter() - t0)
                        last[s] = out.logits[0, -1].float()
                    log(f"T={T} round {r + 1}/{a.rounds}:",
                        {s: round(v[-1], 3) for s, v in secs.items()})
            ratios = {f"widened_vs_{b}": [x / y for x, y in zip(secs[b], secs["widened"])]
                      for b in ("torch_bf16", "c_kernels")}
            rows.append({
                "prompt_tokens": T, "seconds": secs,
                "tok_per_s": {s: statistics.median(T / x for x in v) for s, v in secs.items()},
                **{k: {"runs": v, "median": statistics.median(v)} for k, v in ratios.items()},
                "greedy_token_equal": len({int(v.argmax()) for v in last.values()}) == 1,
                "max_abs_logit_diff": max(float((last[s] - last["widened"]).abs().max())
                                          for s in SETTINGS)})
    finally:
        setting("widened")
        eng.close()
    out = {"config": {"model": a.model, "layers": a.layers, "prompt_tokens": lengths,
                      "threads": a.threads, "rounds": a.rounds, "quick": a.quick,
                      "torch_bf16_fast": shipped(),
                      "model_summary": dp.model_summary(cfg)},
           "host": hostinfo.host(a.threads), "rows": rows}
    text = json.dumps(out, indent=1)
    if a.save:
        Path(a.save).write_text(text)
    if a.json:
        print(text)


if __name__ == "__main__":
    main()
