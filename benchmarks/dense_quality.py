"""What low-bit dense weights cost in quality: perplexity of the zoo's trained ``tiny-moe`` on
held-out text with its dense layers (attention projections, lm_head) in specmoe's C kernels at
f32 / bf16 / int8 / int4, beside the unmodified model.

    python benchmarks/dense_quality.py --json [--windows 24] [--window-tokens 256]

Text: the zoo corpus's held-out split (``training/corpus.py``), the same documents as
``benchmarks/speculation.py``: ``code`` (held-out standard-library sources) and ``prose`` (their
docstrings).  From each domain, ``--windows`` windows of ``--window-tokens`` tokens, one per
document in a seeded order; perplexity = exp(mean next-token NLL) over all windows of a domain.

Rows (every row offloads a fresh copy of the model with cache 100 %, so the experts' format is
the only other change): ``torch`` (unmodified), ``experts-<e>+dense-<d>`` for experts f32 with
dense torch / f32 / bf16 / int8 / int4, and experts int8 / int4 with dense at the same format
(all weights at that precision, as llama.cpp's Q8_0 / Q4_0 rows).  Each row also reports the
greedy agreement with the unmodified model: the share of 32-token greedy continuations of
``--prompts`` held-out prompts that are identical token for token, and the share of tokens equal
before the first difference.

The int8/int4 rows run the kernels' fast paths where the CPU has one (activations quantized:
int16 per token for int8 weights, int8 per 128 columns for int4; AVX-512 VNNI, or AVX2).
``SPECMOE_ISA=scalar`` runs the exact f32 math on the same weights instead, so the difference
between the two runs is the cost of the quantized activations alone; ``host`` in the JSON says
which ISA ran.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "training"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import hostinfo  # noqa: E402  (before torch: its OpenMP wait policy)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import specmoe  # noqa: E402
from specmoe import zoo  # noqa: E402

ROWS = [("torch", None, None), ("f32", "torch", None), ("f32", "f32", None),
        ("f32", "bf16", None), ("f32", "int8", None), ("f32", "int4", None),
        ("int8", "int8", None), ("int4", "int4", None)]


def log(*a: Any) -> None:
    print("[dense_quality]", *a, file=sys.stderr, flush=True)


def windows(tok: Any, docs: list[tuple[str, str]], n: int, width: int, seed: int
            ) -> list[list[int]]:
    rng = random.Random(seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    out = []
    for i in order:
        ids = tok(docs[i][1]).input_ids
        if len(ids) >= width:
            start = rng.randrange(0, len(ids) - width + 1)
            out.append(ids[start:start + width])
        if len(out) == n:
            break
    return out


def perplexity(model: Any, wins: list[list[int]]) -> float:
    nll, count = 0.0, 0
    with torch.inference_mode():
        for w in wins:
            ids = torch.tensor([w])
            lg = model(ids).logits[0, :-1].float()
            nll += F.cross_entropy(lg, ids[0, 1:], reduction="sum").item()
            count += len(w) - 1
    return math.exp(nll / count)


def greedy(model: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                               min_new_tokens=n, do_sample=False, pad_token_id=0)
            outs.append(g[0, len(p):].tolist())
    return outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--windows", type=int, default=24)
    ap.add_argument("--window-tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if not zoo.available("tiny-moe"):
        print(json.dumps({"error": "the zoo's tiny-moe weights are not in this build"}))
        return
    from speculation import heldout_documents
    _, tok = zoo.load("tiny-moe")
    docs = heldout_documents()
    wins = {d: windows(tok, docs[d], a.windows, a.window_tokens, a.seed) for d in docs}
    prompts = [w[:64] for w in windows(tok, docs["code"], a.prompts, 96, a.seed + 1)]
    ref_model, _ = zoo.load("tiny-moe")
    ref_model.eval()
    ref_greedy = greedy(ref_model, prompts, 32)
    rows = []
    for experts, dense, _ in ROWS:
        name = "torch" if experts == "torch" else f"experts-{experts}+dense-{dense}"
        model, _ = zoo.load("tiny-moe")
        model.eval()
        eng = None
        if experts != "torch":
            eng = specmoe.offload(model, cache=1.0, dtype=experts, dense=dense, prefetch=False)
        row: dict[str, Any] = {"name": name, "experts": experts, "dense": dense,
                               "dense_layers": len(eng.dense.converted) if eng else 0}
        for d, ws in wins.items():
            row[f"ppl_{d}"] = perplexity(model, ws)
        out = greedy(model, prompts, 32)
        row["greedy_identical"] = sum(o == r for o, r in zip(out, ref_greedy)) / len(prompts)
        pre = []
        for o, r in zip(out, ref_greedy):
            k = next((i for i, (x, y) in enumerate(zip(o, r)) if x != y), len(r))
            pre.append(k / len(r))
        row["greedy_prefix_share"] = sum(pre) / len(pre)
        if eng is not None:
            eng.close()
        rows.append(row)
        log(name, {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
    base = rows[0]
    for r in rows:
        for d in wins:
            r[f"ppl_{d}_change"] = r[f"ppl_{d}"] / base[f"ppl_{d}"] - 1
    res = {"config": {"model": "zoo tiny-moe (f32)", "windows": a.windows,
                      "window_tokens": a.window_tokens, "prompts": a.prompts,
                      "greedy_tokens": 32, "seed": a.seed,
                      "text": "held-out split of the zoo corpus (code; prose = docstrings)"},
           "host": hostinfo.host(),
           "rows": rows}
    if a.json:
        print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
