"""Whole-model decode through the GPU tier (issue 12 item 6, the model-level rows): a
random-weight DeepSeek-V2-Lite-shaped checkpoint (``benchmarks/big_model.py``'s writer: bf16,
``--layers`` layers, the first dense), greedy ``model.generate`` of ``--tokens`` tokens, tok/s.

Rows, all loaded at once and timed in interleaved rounds (median), after ``--warm-rounds``
untimed ones:

* ``unmodified on the GPU (upper bound)``: ``AutoModelForCausalLM.from_pretrained(ckpt,
  device_map=<device>, dtype=bfloat16)``, every weight on the GPU;
* ``specmoe N%`` / ``+ prefetch`` (at each ``--overfetch``) / ``+ balancer``:
  ``specmoe.from_pretrained(ckpt, device=<device>, cache=N%, dtype="bf16", prefetch=...)``
  (experts in the GPU cache behind a pinned host copy of the store; ``balance=True`` for
  MoE-SpAc's CPU/GPU balancer);
* ``specmoe N% (one launch per expert)``: the first row with ``SPECMOE_GPU_GROUPED=0``, one
  kernel call per expert instead of a layer's experts of few tokens in one launch group
  (``grouped_over_per_expert_launches_25pct`` is the first row's tok/s over this one's);
* ``specmoe N% + prefetch + self-draft`` / ``+ n-gram``: speculative decoding on the tier,
  ``specmoe.generate(model, ids, SelfDraft(engine) | NgramDrafter())`` with the library's
  default controller (speculation length chosen by measured utility, off where it does not
  pay); seconds per token from two runs, (t(n) - t(1)) / (n - 1), so the prefill and first
  token are left out as in the greedy rows;
* ``accelerate device_map offload of the experts``: the same ``from_pretrained`` with a
  device map that puts every MoE layer's ``mlp.experts`` on ``"cpu"`` and everything else on
  the GPU (accelerate's hooks copy an offloaded module's weights to the GPU at each call).

Each row also reports whether its greedy tokens equal the upper bound's (``tokens_equal``):
with a bf16 store the expert sums are in another order, so a near-tie may flip a token; the
GPU tests check exact equality with an f32 store.  ``specmoe_25pct_vs_accelerate`` and
``specmoe_25pct_vs_unmodified`` are tok/s ratios.  A row that cannot run says why (``error``).
Without a usable GPU it prints ``{"skipped": reason}`` and exits 0; ``--device cpu`` runs the
same rows on the CPU (specmoe's CPU engine, accelerate offload to the CPU itself) and
``--device emulate`` the GPU tier's own code on the CPU: dry runs of the script, not
benchmarks.

Ran on an H200 on 2026-11-26 (``benchmarks/results/gpu_generate_h200.json``, before
``--warm-rounds`` existed: its first round is in the median's three).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
import hostinfo  # noqa: E402  (before torch: its OpenMP wait policy)


def _error(what: str, e: BaseException) -> dict[str, Any]:
    return {"error": f"{what}: {type(e).__name__}: {e}",
            "traceback": traceback.format_exc(limit=6)}


def experts_device_map(cfg: Any, device: str) -> dict[str, str]:
    """accelerate's device map: each MoE layer's routed experts on the CPU, the rest on
    ``device``."""
    first = int(getattr(cfg, "first_k_dense_replace", 0))
    dm: dict[str, str] = {"model.embed_tokens": device, "model.norm": device,
                          "model.rotary_emb": device, "lm_head": device}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        for part in ("self_attn", "input_layernorm", "post_attention_layernorm"):
            dm[f"{p}.{part}"] = device
        if i < first:
            dm[f"{p}.mlp"] = device
        else:
            dm[f"{p}.mlp.gate"] = device
            dm[f"{p}.mlp.shared_experts"] = device
            dm[f"{p}.mlp.experts"] = "cpu"
    return dm


def timed_speculative(torch: Any, model: Any, ids: Any, n: int,
                      drafter: Callable[[], Any]) -> tuple[float, list[int]]:
    """Seconds per token of ``specmoe.generate`` with a new ``drafter()`` (the default
    controller), as (t(n) - t(1)) / (n - 1) over two runs, and the n tokens."""
    import specmoe

    def run(k: int) -> tuple[float, Any]:
        if ids.is_cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = specmoe.generate(model, ids, drafter(), max_new_tokens=k, eos_token_id=None)
        if ids.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t, out
    t1, _ = run(1)
    tn, out = run(n)
    return max(tn - t1, 1e-9) / (n - 1), out.sequences[0, ids.shape[1]:].tolist()


def timed_generate(torch: Any, model: Any, ids: Any, n: int) -> tuple[float, list[int]]:
    """Seconds per token between the first and the last of n greedy tokens (the prefill and
    the first token excluded), and the tokens."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Stamp(LogitsProcessor):
        def __init__(self) -> None:
            self.t: list[float] = []

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            if scores.is_cuda:
                torch.cuda.synchronize()
            self.t.append(time.perf_counter())
            return scores

    st = Stamp()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, pad_token_id=0,
                             logits_processor=LogitsProcessorList([st]))
    return (st.t[-1] - st.t[0]) / (n - 1), out[0, ids.shape[1]:].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (the first dense)")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm-rounds", type=int, default=1, help="untimed rounds first (on the "
                    "H200 the first round ran up to 10x slower: the unmodified model's)")
    ap.add_argument("--fractions", default="0.25")
    ap.add_argument("--overfetch", default="1.5,1.0", help="the prefetch rows' overfetch "
                    "values (experts predicted per token = ceil(top_k * overfetch)); the "
                    "balancer row takes the first")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workdir", default=os.path.expanduser("~/.cache/specmoe/bench"))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    import torch

    import specmoe
    from specmoe.runtime import cuda
    from specmoe.runtime import kernels

    dev = a.device
    tdev = "cpu" if dev in ("cpu", "emulate") else dev  # where torch puts the model's weights
    why = "" if tdev == "cpu" else cuda.unusable_reason()
    if why:
        res = {"skipped": f"no usable GPU: {why}"}
        print(json.dumps(res) if a.json else res["skipped"])
        return
    import big_model
    from transformers import AutoConfig, AutoModelForCausalLM

    t0 = time.perf_counter()
    cfgd = big_model.make_config(a.layers, a.vocab)
    ckpt = Path(a.workdir) / f"gpu-dsv2lite-L{a.layers}-V{a.vocab}" / "ckpt"
    big_model.write_checkpoint(ckpt, cfgd, seed=0, skew=1.0)
    cfg = AutoConfig.from_pretrained(ckpt)
    res: dict[str, Any] = {"model": "deepseek_v2 (DeepSeek-V2-Lite shapes)", "layers": a.layers,
                           "vocab": a.vocab, "tokens": a.tokens, "rounds": a.rounds,
                           "warm_rounds": a.warm_rounds,
                           "device": dev if tdev == "cpu" else cuda.available()[1],
                           "host": hostinfo.host(kernels.num_threads()),
                           "checkpoint_s": time.perf_counter() - t0}
    ids = torch.randint(100, min(8000, a.vocab), (1, 32),
                        generator=torch.Generator().manual_seed(0))
    rows: dict[str, dict[str, Any]] = {}
    runs: dict[str, Callable[[], tuple[float, list[int]]]] = {}
    engines: list[Any] = []

    def add(label: str, load: Callable[[], Any], drafter: Callable[[Any], Any] | None = None,
            **info: Any) -> None:
        row: dict[str, Any] = {"label": label, **info}
        rows[label] = row
        try:
            t = time.perf_counter()
            model = load()
            row["load_s"] = time.perf_counter() - t
            x = ids.to(tdev)
            if drafter is None:
                timed_generate(torch, model, x, 4)  # warm-up
                runs[label] = lambda: timed_generate(torch, model, x, a.tokens)
            else:
                eng = specmoe.engine_of(model)
                timed_speculative(torch, model, x, 4, lambda: drafter(eng))
                runs[label] = lambda: timed_speculative(torch, model, x, a.tokens,
                                                        lambda: drafter(eng))
        except Exception as e:
            row.update(_error("load or warm-up failed", e))

    add("unmodified on the GPU (upper bound)", lambda: AutoModelForCausalLM.from_pretrained(
        ckpt, device_map=tdev, dtype=torch.bfloat16).eval())
    for f in [float(x) for x in a.fractions.split(",")]:
        ofs = [float(x) for x in a.overfetch.split(",")]
        # (prefetch, balancer, overfetch, grouped launches)
        variants = [(False, False, None, True), (False, False, None, False)] + \
            [(True, False, o, True) for o in ofs] + [(True, True, ofs[0], True)]
        for pf, bal, of, grouped in variants:
            if (bal or not grouped) and tdev == "cpu":
                continue  # (the balancer measures a GPU's costs; launches are a GPU's)
            label = f"specmoe {int(round(f * 100))}%" + (" + prefetch" if pf else "") + \
                (" + balancer" if bal else "") + \
                (f" (overfetch {of:g})" if pf and not bal and of != ofs[0] else "") + \
                ("" if grouped else " (one launch per expert)")

            def load(f: float = f, pf: bool = pf, bal: bool = bal, of: float | None = of,
                     label: str = label, grouped: bool = grouped) -> Any:
                kw = {"balance": True} if bal else {}
                # the tier reads it when the engine builds it (cuda.GpuExpertCache.tier)
                os.environ["SPECMOE_GPU_GROUPED"] = "1" if grouped else "0"
                try:
                    m = specmoe.from_pretrained(ckpt, device=dev, cache=f, dtype="bf16",
                                                policy="lru", prefetch=pf, progress=False,
                                                store=str(ckpt.parent / "store-bf16.smoe"),
                                                torch_dtype=torch.bfloat16, **kw)
                finally:
                    os.environ.pop("SPECMOE_GPU_GROUPED", None)
                eng = specmoe.engine_of(m)
                if pf:
                    eng.set_prefetch(True, overfetch=of)
                engines.append((label, eng))
                return m
            add(label, load, cache_fraction=f, prefetch=pf, balance=bal,
                overfetch=of if pf else None, grouped_launches=grouped)
        from specmoe.speculation.drafters import NgramDrafter, SelfDraft
        for name, make in (("self-draft", lambda eng: SelfDraft(eng, "int4")),
                           ("n-gram", lambda eng: NgramDrafter())):
            label = f"specmoe {int(round(f * 100))}% + prefetch + {name}"

            def load_spec(f: float = f, label: str = label) -> Any:
                m = specmoe.from_pretrained(ckpt, device=dev, cache=f, dtype="bf16",
                                            policy="lru", prefetch=True, progress=False,
                                            store=str(ckpt.parent / "store-bf16.smoe"),
                                            torch_dtype=torch.bfloat16)
                engines.append((label, specmoe.engine_of(m)))
                return m
            add(label, load_spec, drafter=make, cache_fraction=f, prefetch=True,
                speculative=name)
    add("accelerate device_map offload of the experts",
        lambda: AutoModelForCausalLM.from_pretrained(
            ckpt, device_map=experts_device_map(cfg, tdev), dtype=torch.bfloat16).eval(),
        peer="accelerate")

    times: dict[str, list[float]] = {k: [] for k in runs}
    toks: dict[str, list[int]] = {}
    for r in range(a.warm_rounds + a.rounds):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for k in order:
            try:
                s, tk = runs[k]()
                if r >= a.warm_rounds:
                    times[k].append(s)
                toks[k] = tk
            except Exception as e:
                rows[k].update(_error(f"round {r} failed", e))
                runs = {q: v for q, v in runs.items() if q != k}
    ref = toks.get("unmodified on the GPU (upper bound)")
    for k, v in times.items():
        if v:
            rows[k]["tok_s"] = 1.0 / statistics.median(v)
            rows[k]["tok_s_rounds"] = [1.0 / x for x in v]
            rows[k]["tokens_equal"] = None if ref is None else toks.get(k) == ref
    for label, eng in engines:  # counters over the warm-up and every round
        st = eng.stats()
        rows[label].update({k: st.get(k) for k in (
            "hit_rate", "hits", "misses", "stall_s", "prefetch_precision", "prefetch_recall",
            "cpu_experts", "gpu_experts", "capacity", "cache_bytes", "prefetch_issued",
            "prefetch_used")})
        eng.close()
    res["rows"] = list(rows.values())

    def ratio(num: str, den: str) -> float | None:
        n, d = rows.get(num, {}).get("tok_s"), rows.get(den, {}).get("tok_s")
        return n / d if n and d else None
    res["specmoe_25pct_vs_accelerate"] = {
        "no_prefetch": ratio("specmoe 25%", "accelerate device_map offload of the experts"),
        "prefetch": ratio("specmoe 25% + prefetch", "accelerate device_map offload of the experts"),
        "target": 5.0}
    res["specmoe_25pct_vs_unmodified"] = ratio("specmoe 25% + prefetch",
                                               "unmodified on the GPU (upper bound)")
    res["grouped_over_per_expert_launches_25pct"] = ratio(
        "specmoe 25%", "specmoe 25% (one launch per expert)")
    res["speculative_over_plain_25pct"] = {
        name: ratio(f"specmoe 25% + prefetch + {name}", "specmoe 25% + prefetch")
        for name in ("self-draft", "n-gram")}
    res["elapsed_s"] = time.perf_counter() - t0
    if a.json:
        print(json.dumps(res))
    else:
        for row in res["rows"]:
            print(f"{row['label']:48s} {row.get('tok_s', float('nan')):8.2f} tok/s  "
                  f"{row.get('error', '')}")


if __name__ == "__main__":
    main()
