"""Speculative decoding where the papers say it pays: the zoo pair with its routed experts
behind an emulated slow link (issue 39, item 2, the zoo part).

On the zoo pair as it runs here a decode step is bound by compute and the framework (the
experts come from the page cache), so verifying K+1 tokens costs nearly K+1 steps and no model
drafter pays (``benchmarks/speculation.py``).  MoE-SpeQ and MoE-SpAc measure where a step is
bound by expert loads over PCIe or from an SSD: there one verification loads the union of the
experts of K+1 tokens once, and the self-draft's routing prefetches them while it drafts.

Each *setting* is a link of real hardware and a cache fraction, reduced to one number, the
ratio R of the link time of the expert bytes a token misses to the compute time of a token on
that hardware (the figures behind each R are printed in ``settings``).  The benchmark measures
the zoo target's own plain step time c0 and the expert bytes b0 a plain token reads at the
setting's cache fraction, then sets the engine's link throttle (``Engine.set_miss(throttle=)``,
every store load, prefetches included, emulates the link; latency 0) to b0 / (R * c0) bytes per
second, so that on the zoo pair too a token's misses take R times its compute.

Rows per setting: plain decoding; the n-gram lookup, the draft model (tiny-draft), the int4
self-draft (MoE-SpeQ, on the target's KV cache, with and without lookahead prefetch) and the
MTP adapter (the zoo's tiny-moe-mtp), each under Cascade and the SpeQ governor, and a static
K=2 self-draft row as the controllers' reference; ``--ablation`` adds MoE-SpeQ's ablation
against the whole design (self-draft, SpeQ governor, lookahead prefetch, lookahead-aware
eviction): static K=3 instead of the governor, no lookahead prefetch, no lookahead-aware
eviction (``protect_lookahead``), and Cascade (every drafter) and the SpeQ governor without the
slowdown budget (``cascade-nobudget``, ``speq-nobudget``).  Every row's greedy output must equal
plain decoding's (``outputs_equal``).

Method: 2 requests (one code, one prose prompt from held-out stdlib files, as in
speculation.py) x ``--new-tokens`` tokens x ``--repeats``; request-major rounds (every row runs
request j back to back, the rows' order rotated per round); the engine's cache is rebuilt empty
before every request; ``tok_per_s_vs_plain`` is the median over repeats of the row's tok/s over
plain's in the same repeat (``ratio_per_repeat`` lists them).  Each row names its ``setting``,
``drafter``, ``controller``, ``lookahead``, ``tok_per_s_vs_plain`` and ``outputs_equal``.

The DeepSeek-V2-Lite-shaped checkpoint of big_model.py under its memory cgroup with a drafter of
controlled acceptance is benchmarks/speculation_big.py.  Not here yet: the int2 self-draft
rows.

``--json`` prints one JSON object (host included); the tqdm bar goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "training"))

import hostinfo  # noqa: E402  (before torch: its OpenMP wait policy)

import torch  # noqa: E402

import specmoe  # noqa: E402
from specmoe import zoo  # noqa: E402
from specmoe.speculation import controllers as spec  # noqa: E402
from specmoe.speculation.generation import generate  # noqa: E402
from specmoe.speculation.mtp import MtpAdapter  # noqa: E402
from specmoe.speculation.tau import target_tau  # noqa: E402

import speculation as S  # noqa: E402  (prompts, drafters, controllers of the batch-1 benchmark)

# The settings: R = (link time of the expert bytes a token misses) / (compute time per token),
# from published sizes and the demand hit rates of the simulator on real DeepSeek-V2-Lite
# routing (least_stale: 0.26 at 10 % of the experts, 0.47 at 25 %; issue 42's figures).
_DSV2_EXPERT_MB = 3 * 2048 * 1408 * (0.5 + 4 / 128) / 1e6   # int4, f32 scales per 128: 4.60 MB
_DSV2_EXPERTS_PER_TOKEN = 26 * 6
_MIXTRAL_EXPERT_MB = 3 * 4096 * 14336 * (0.5 + 4 / 128) / 1e6  # 93.6 MB
_MIXTRAL_EXPERTS_PER_TOKEN = 32 * 2
_HIT = {0.10: 0.26, 0.25: 0.47}


def _setting(name: str, model: str, mb: float, per_token: int, link_gbps: float,
             compute_ms: float, compute_src: str, cache: float) -> Dict[str, Any]:
    miss_mb = (1 - _HIT[cache]) * per_token * mb
    link_ms = miss_mb / 1e3 / link_gbps * 1e3
    return {"name": f"{name}@{int(cache * 100)}%", "cache": cache, "ratio": link_ms / compute_ms,
            "figures": {"model": model, "expert_mb": round(mb, 2),
                        "experts_per_token": per_token, "hit_rate": _HIT[cache],
                        "miss_mb_per_token": round(miss_mb, 1), "link_gbps": link_gbps,
                        "link_ms_per_token": round(link_ms, 1), "compute_ms_per_token": compute_ms,
                        "compute_source": compute_src}}


SETTINGS = {
    # DeepSeek-V2-Lite int4 on an NVMe SSD (3.5 GB/s), compute on an AVX2 desktop/server CPU:
    # ~170 ms a token at 2 threads (decode_peers.py's 4-layer int4 figure, 27 ms, scaled to 27
    # layers): the link is not the bottleneck
    "nvme-cpu": lambda c: _setting("nvme-cpu", "DeepSeek-V2-Lite int4", _DSV2_EXPERT_MB,
                                   _DSV2_EXPERTS_PER_TOKEN, 3.5, 170.0,
                                   "decode_peers.py, AVX2 EPYC, 2 threads, scaled 4 -> 27 layers",
                                   c),
    # the same experts on NVMe with compute on a GPU (~10 ms a token for a 2.4 B-active MoE)
    "nvme-gpu": lambda c: _setting("nvme-gpu", "DeepSeek-V2-Lite int4", _DSV2_EXPERT_MB,
                                   _DSV2_EXPERTS_PER_TOKEN, 3.5, 10.0,
                                   "assumed: a GPU decode step of a 2.4 B-active MoE", c),
    # Mixtral-8x7B int4 experts in host memory over PCIe 4.0 x16 (25 GB/s), compute on an A100
    # (~20 ms a token for 13 B active parameters at int4)
    "pcie4-gpu": lambda c: _setting("pcie4-gpu", "Mixtral-8x7B int4", _MIXTRAL_EXPERT_MB,
                                    _MIXTRAL_EXPERTS_PER_TOKEN, 25.0, 20.0,
                                    "assumed: an A100 decode step of 13 B active int4 parameters",
                                    c),
}

# (drafter, controller, k, lookahead, lookahead-aware eviction)
ROWS = [(None, "nospec", None, True, True),
        ("ngram", "cascade", None, True, True), ("ngram", "speq", None, True, True),
        ("draft", "cascade", None, True, True), ("draft", "speq", None, True, True),
        ("self", "cascade", None, True, True), ("self", "speq", None, True, True),
        ("self", "cascade", None, False, True), ("self", "static", 2, True, True),
        ("mtp", "cascade", None, True, True), ("mtp", "speq", None, True, True)]
# MoE-SpeQ's ablation (issue 39 item 4), with ("self", "speq", None, True, True) the whole
# design: the governor replaced by a static K (static 2 above, and 3), the lookahead prefetch
# off, the lookahead-aware eviction off
SPEQ_ABLATION = [("self", "static", 3, True, True), ("self", "speq", None, False, True),
                 ("self", "speq", None, True, False)]
# and both controllers without specmoe's slowdown budget (csrc/spec/controller.h)
BUDGET_ABLATION = [(d, "cascade-nobudget", None, True, True) for d in ("ngram", "draft", "self",
                                                                      "mtp")] + \
    [("self", "cascade-nobudget", None, False, True), ("self", "speq-nobudget", None, True, True)]


def _row_name(r: tuple) -> str:
    d, c, k, la, protect = r
    if d is None:
        return "plain"
    return (f"{d}/{c}{k or ''}{'' if la else '/no-lookahead'}"
            f"{'' if protect else '/no-protect'}")


def calibrate(model: Any, eng: Any, ids: List[int], cache: float, tokens: int) -> Dict[str, float]:
    """c0: the median plain step (no throttle) and b0: the expert bytes read per token, on one
    plain run at ``cache`` from an empty cache."""
    eng.set_miss(throttle=None)
    eng.set_cache(cache)
    eng.reset_stats()
    out = generate(model, torch.tensor([ids]), None, None, max_new_tokens=tokens,
                   eos_token_id=None, engine=eng)
    steps = [i["t_iter"] for i in out.iterations]
    loads = sum(i["experts_loaded"] for i in out.iterations)
    return {"step_s": statistics.median(steps),
            "bytes_per_token": loads * eng._cache.slot_bytes / max(1, len(steps))}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--settings", default="nvme-cpu@25,pcie4-gpu@25,nvme-gpu@10",
                    help=f"comma list of LINK@CACHE_PERCENT, LINK one of {sorted(SETTINGS)}, "
                         "CACHE_PERCENT 10 or 25")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="f32", help="store dtype of the offloaded experts")
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 tokens, 1 repeat, "
                    "one setting")
    ap.add_argument("--ablation", action="store_true",
                    help="add MoE-SpeQ's ablation rows (static K, no lookahead prefetch, no "
                         "lookahead-aware eviction, each against self/speq) and both "
                         "controllers without the slowdown budget")
    ap.add_argument("--save", type=Path, default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    if a.quick:
        a.new_tokens, a.repeats, a.settings = 8, 1, "pcie4-gpu@25"
    settings = []
    for item in a.settings.split(","):
        link, _, pct = item.strip().partition("@")
        if link not in SETTINGS or pct not in ("10", "25"):
            ap.error(f"--settings: {item!r} is not LINK@10 or LINK@25 with LINK in "
                     f"{sorted(SETTINGS)}")
        settings.append(SETTINGS[link](int(pct) / 100))
    if a.new_tokens < 2 or a.repeats < 1:
        ap.error("--new-tokens must be >= 2 and --repeats >= 1")
    from tqdm import tqdm

    torch.set_num_threads(1)
    torch.manual_seed(0)
    t_all = time.perf_counter()
    model, tok = zoo.load("tiny-moe", experts_implementation="eager")
    draft_model, _ = zoo.load("tiny-draft")
    model.eval()
    draft_model.eval()
    docs = S.heldout_documents()
    code = S.make_prompts(tok, docs["code"], "code", 2, 0)
    prose = S.make_prompts(tok, docs["prose"], "prose", 1, 0)
    warm, requests = code[1][1], [code[0][1], prose[0][1]]
    eng = specmoe.offload(model, cache=settings[0]["cache"], dtype=a.dtype)
    eng.protect_lookahead = True
    S.MTP[0] = MtpAdapter.load(zoo.root() / "tiny-moe-mtp")
    results: Dict[str, Any] = {"benchmark": "speculation_offload", "settings": [], "rows": []}
    try:
        eng.enable_self_draft("int4")
        for d in [None, "ngram", "draft", "self", "mtp"]:  # warm-up, untimed
            dr = S.make_drafter(d, eng, draft_model)
            with S.mtp_installed(dr):
                generate(model, torch.tensor([warm]), dr, spec.StaticK(2) if dr else None,
                         max_new_tokens=12, eos_token_id=None, tau=None, engine=eng)
        tau = target_tau(model, warm, S.tau_g_max(["ngram", "mtp"]), eng)
        rows_run = ROWS + (SPEQ_ABLATION + BUDGET_ABLATION if a.ablation else [])
        total = len(settings) * a.repeats * len(requests) * len(rows_run)
        bar = tqdm(total=total, desc="speculation_offload", unit="req", file=sys.stderr)
        for st in settings:
            cal = calibrate(model, eng, warm, st["cache"], a.new_tokens)
            gbps = cal["bytes_per_token"] / (st["ratio"] * cal["step_s"]) / 1e9
            st = dict(st, zoo={"plain_step_ms": round(cal["step_s"] * 1e3, 2),
                               "expert_bytes_per_token": round(cal["bytes_per_token"]),
                               "throttle_gbps": round(gbps, 4), "throttle_latency_us": 0.0})
            results["settings"].append(st)
            eng.set_miss(throttle=(gbps, 0.0))
            tok_s: Dict[str, List[float]] = {_row_name(r): [] for r in rows_run}
            equal = {_row_name(r): True for r in rows_run}
            stats = {_row_name(r): {"tokens": 0, "proposed": 0, "accepted": 0, "iterations": 0,
                                    "loads": 0} for r in rows_run}
            for rep in range(a.repeats):
                # fresh drafters and controllers per repeat, kept across its requests
                state = {}
                for r in rows_run:
                    dr = S.make_drafter(r[0], eng, draft_model)
                    ctl = S.make_controller(r[1], r[2], dr) if dr is not None else None
                    state[_row_name(r)] = (r, dr, ctl, [0, 0.0])
                for j, ids in enumerate(requests):
                    outs: Dict[str, List[int]] = {}
                    order = list(state.values())
                    shift = (rep * len(requests) + j) % len(order)
                    order = order[shift:] + order[:shift]
                    if (rep + j) % 2:
                        order.reverse()
                    for r, dr, ctl, acc in order:
                        name = _row_name(r)
                        bar.set_postfix_str(f"{st['name']} {name}")
                        eng.set_cache(st["cache"])
                        eng.protect_lookahead = r[4]
                        eng.reset_stats()
                        row_tau = S.row_tau_table(tau, dr) if r[1] not in ("static", "nospec") \
                            else None
                        with S.mtp_installed(dr):
                            o = generate(model, torch.tensor([ids]), dr, ctl,
                                         max_new_tokens=a.new_tokens, eos_token_id=None,
                                         tau=row_tau, engine=eng, lookahead=r[3])
                        s = o.stats
                        acc[0] += s["new_tokens"]
                        acc[1] += s["time_s"]
                        outs[name] = o.sequences[0, len(ids):].tolist()
                        t = stats[name]
                        t["tokens"] += s["new_tokens"]
                        t["proposed"] += s["proposed"]
                        t["accepted"] += s["accepted"]
                        t["iterations"] += s["iterations"]
                        t["loads"] += s.get("experts_loaded", 0)
                        bar.update(1)
                    for name in outs:  # greedy speculation must not change the output
                        equal[name] = equal[name] and outs[name] == outs["plain"]
                for name, (_r, _dr, _ctl, acc) in state.items():
                    tok_s[name].append(acc[0] / acc[1])
            for r in rows_run:
                name = _row_name(r)
                ratios = [x / p for x, p in zip(tok_s[name], tok_s["plain"])]
                t = stats[name]
                results["rows"].append({
                    "setting": st["name"], "ratio_link_over_compute": round(st["ratio"], 2),
                    "drafter": r[0], "controller": r[1], "k": r[2], "lookahead": r[3],
                    "protect_lookahead": r[4],
                    "tok_per_s_vs_plain": round(statistics.median(ratios), 4),
                    "ratio_per_repeat": [round(x, 3) for x in ratios],
                    "tok_per_s": round(statistics.median(tok_s[name]), 2),
                    "etr": round(t["tokens"] / max(1, t["iterations"]), 3),
                    "k_mean": round(t["proposed"] / max(1, t["iterations"]), 3),
                    "acceptance": round(t["accepted"] / t["proposed"], 3) if t["proposed"]
                    else None,
                    "experts_loaded_per_token": round(t["loads"] / max(1, t["tokens"]), 2),
                    "outputs_equal": equal[name]})
        bar.close()
    finally:
        eng.close()
    rows = results["rows"]
    # issue 39's targets are Cascade's, with or without SpeQ's lookahead prefetch beside it:
    # every Cascade row counts (before 2026-11-30 only the lookahead rows did)
    cascade = [x for x in rows if x["controller"] == "cascade"]
    bound = [x for x in cascade if x["ratio_link_over_compute"] > 1]
    best_row = max(bound, key=lambda x: x["tok_per_s_vs_plain"], default=None)
    results["targets"] = {
        "cascade_worst_vs_plain": min((x["tok_per_s_vs_plain"] for x in cascade), default=None),
        "best_cascade_vs_plain_link_bound": None if best_row is None
        else best_row["tok_per_s_vs_plain"],
        "best_cascade_row": None if best_row is None else {
            k: best_row[k] for k in ("setting", "drafter", "lookahead", "ratio_per_repeat")}}
    results["targets"]["cascade_worst_met"] = results["targets"]["cascade_worst_vs_plain"] \
        is not None and results["targets"]["cascade_worst_vs_plain"] >= 0.95
    best = results["targets"]["best_cascade_vs_plain_link_bound"]
    results["targets"]["best_link_bound_met"] = best is not None and best >= 1.5
    results["config"] = {"target": "tiny-moe", "draft": "tiny-draft", "dtype": a.dtype,
                         "new_tokens": a.new_tokens, "repeats": a.repeats,
                         "requests": ["code", "prose"], "threads": 1,
                         "host": hostinfo.host(1), "loadavg": round(os.getloadavg()[0], 2),
                         "wall_s": round(time.perf_counter() - t_all, 1)}
    if a.save:
        a.save.write_text(json.dumps(results, indent=1) + "\n")
    if a.json:
        print(json.dumps(results))
    else:
        for st in results["settings"]:
            print(f"{st['name']}: R = {st['ratio']:.2f} ({st['figures']['model']}, "
                  f"{st['figures']['link_gbps']} GB/s); zoo throttle "
                  f"{st['zoo']['throttle_gbps']} GB/s")
        print(f"{'setting':16} {'row':28} {'vs plain':>8} {'tok/s':>7} {'etr':>5} {'k':>5} equal")
        for x in rows:
            name = _row_name((x["drafter"], x["controller"], x["k"], x["lookahead"],
                              x["protect_lookahead"]))
            print(f"{x['setting']:16} {name:28} {x['tok_per_s_vs_plain']:8.3f} "
                  f"{x['tok_per_s']:7.1f} {x['etr']:5.2f} {x['k_mean']:5.2f} "
                  f"{x['outputs_equal']}")
        print(json.dumps(results["targets"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
