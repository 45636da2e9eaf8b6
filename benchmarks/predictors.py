"""Predictors and eviction policies against the offline bound, on real routing (issue 42).

    python benchmarks/predictors.py [--json] [--trace DIR] [--split val|train|all] [--quick]

Two tables, on the validation prompts of the shared DeepSeek-V2-Lite traces by default (the
split of specmoe.sim.nextuse.split_requests: the packaged next-use model never saw them), or
on any folder of traces in the same layout (--trace; --split all for traces a model was not
trained on):

1. **prediction**: the packaged next-use model's q (csrc/policy/nextuse.h) at a sample of the
   (token, layer) points before a layer runs: log loss and AUC of "used at its layer's next
   run" (all keys; keys with the fresh cross-layer feature; the rest), and for the layers
   1, 2 and 3 positions after the last one run, the top-k experts by q against the experts
   really used there (precision = recall = F1 at k = top_k) and the experts with q >= 0.5
   (precision, recall, F1), and 6 and 12 positions ahead.  The simulator's ``history``
   predictor (online recent use plus co-activation) at depth 1 for comparison; its
   ``learned`` predictor is the top-k by q.  With the packaged model's token prior (each
   pass told what its token's piece predicts, specmoe.sim.nextuse.TokenPrior) in
   ``prediction``, and without it in ``prediction_without_token_prior``.
2. **simulator rows**: policy x predictor x capacity (5/10/25 % of the experts) x hardware
   (laptop: DDR5 + NVMe; rtx4090-nvme: a 24 GB GPU streaming experts from a PCIe 4.0 x4
   NVMe; a100-pcie4: experts in host memory over PCIe 4.0 x16), each row with hit_rate,
   untimed_hit_rate (a prefetch still in flight counts as a hit, as MoE-Beyond's untimed
   simulation counts one), prefetch_waste (evicted unused / issued), est_tpot_ms,
   bytes_vs_demand (expert bytes read per token over the same policy's without prefetch) and
   vs_offline_bound (est_tpot over the bound's).  Every predictor runs twice: every request
   that finds a slot loaded (``admission: false``), and under the prefetch admission rule
   (``admission: true``, csrc/admit.h: a request loads only when its probability of use
   times the stall it saves exceeds the cost of the read and of its victim, and while the
   loads prefetching added stay within 8 % of those that were needed: its byte budget), with
   ``refused`` counting what the rule turned away.  Rows carry ``token_prior``: the learned
   predictor runs with the token prior and again without it (the ablation), and
   ``nextuse+prior`` is nextuse evicting with it too (NextUse(token_prior=True)).  The
   offline bound at a capacity and hardware is the fastest of Belady demand-only and Belady
   with an oracle prefetch of the next 1 or 2 layers, each with and without that same
   admission rule, taken without its byte budget (a bound of time: ``byte_budget: false``;
   issue 42 item 4 asks for the rule; the plain oracle rows are kept in the
   minimum because at 25 % on a fast link loading every oracle prediction is a little faster
   still).

3. **untimed**: the hit rate of MoE-Beyond's untimed simulation (every prefetch resident
   before its layer runs: a link without time), LRU and nextuse with no prefetch, the learned
   predictor's top 6 and top 12 (with and without the token prior) and the oracle.

4. **horizon** (``--horizon 1,2,4``, opt-in: a few minutes): what a perfect predictor would
   buy.  :class:`HorizonOracle` evicts by nextuse's value (csrc/policy/nextuse.h) with q
   replaced by the truth for the next H runs of each key's layer, and the bound's prefetch
   choices (none; the oracle's next layer under admission, without the byte budget); each
   row is the faster, with its time over the offline bound.  The smallest H within 1.15x of
   the bound says how many tokens of routing a predictor would have to know exactly to meet
   issue 42's target under this rule; ``current`` knows the token being decoded, through all
   its layers, and nothing of the next.

Every figure is simulated (csrc/sim.c's time model), not measured on hardware; the JSON
records the host only for the wall times.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "training"))

import nextuse as trainer  # noqa: E402  (training/nextuse.py: file order, split, metrics)
from hostinfo import host  # noqa: E402

from specmoe.runtime.policies import Belady, NextUse, PythonPolicy, make_policy  # noqa: E402
from specmoe.sim.hardware import PROFILES, with_  # noqa: E402
from specmoe.sim.nextuse import (NextUseModel, Walker, default_model,  # noqa: E402
                                 split_requests, used_at_next_run)
from specmoe.sim.replay import simulate  # noqa: E402
from specmoe.sim.traces import Trace, load_puffin, shared_trace_dir  # noqa: E402

HARDWARE = {
    "laptop": PROFILES["laptop"],
    "rtx4090-nvme": with_(PROFILES["rtx4090"], name="rtx4090-nvme", link_bw=7e9,
                          link_latency_s=80e-6,
                          description="RTX 4090 class GPU, experts streamed from a PCIe 4.0 x4 "
                                      "NVMe (7 GB/s sequential)"),
    "a100-pcie4": PROFILES["a100-pcie4"],
}
#: MoE-Beyond's untimed simulation (issue 42 item 5): every prefetch lands at once (a link
#: without time), so a prefetched expert counts as a hit however late it was predicted
UNTIMED = with_(PROFILES["laptop"], name="untimed", link_bw=1e18, link_latency_s=0.0,
                description="prefetches land instantly: MoE-Beyond's untimed hit rate")
UNTIMED_PREDICTORS = ("none", "learned", "learned:topk=12", "oracle:depth=1")
POLICIES = ("lru", "least_stale", "lhu", "nextuse")
PREDICTORS = ("none", "history", "learned", "oracle:depth=1")
BOUND_PREDICTORS = ("none", "oracle:depth=1", "oracle:depth=2")
# the bound's prefetch: under admission, without its byte budget (the bound is one of time;
# Belady's own regret already charges an oracle copy's victim exactly)
BOUND_ADMITTED = ("oracle:depth=1", "oracle:depth=2")


class HorizonOracle(PythonPolicy):
    """nextuse's eviction value with a perfect predictor of the next ``horizon`` runs: the
    slot of least

        v(k) = sum_{h < H} used(k, run h) / (dl(k) + h L + c)  +  beta r(k) / (dl(k) + H L + c)

    where run 0 is the next run of key k's layer (this token's pass when the layer is still to
    come, or running and k not yet asked for, else the next token's), dl the layer steps until
    it (csrc/policy/nextuse.h's definitions), used() read from the trace, and r the same
    exponential average of use (alpha_l) the C policy keeps as its long-run rate.  H = 0 is the
    rate term alone; H = 1 is nextuse with q exact.  ``current_only`` (H = 1): q exact for the
    keys whose next run is in the current token's pass, 0 for the others (the token being
    decoded known through all its layers, nothing of the next token).  An analysis instrument
    (it reads the future), replayed by the simulator as a Python policy: one pass per token,
    in trace order.  Ties: the first candidate (the lowest slot), as in C."""

    def __init__(self, trace: Trace, horizon: int, c: float = 1.0, beta: float = 1.0,
                 alpha_l: float = 1.0 / 64, current_only: bool = False) -> None:
        if horizon < 0 or (current_only and horizon != 1):
            raise ValueError(f"horizon must be >= 0 (1 with current_only), got {horizon}")
        self.current_only = current_only
        T, L, _ = trace.experts.shape
        E = trace.num_experts
        self.T, self.L, self.E, self.H, self.c, self.beta = T, L, E, horizon, c, beta
        # used[t, key] for t < T + H + 1 (rows past the trace: never used)
        self.used = np.zeros((T + horizon + 2, L * E), bool)
        self.used[np.arange(T)[:, None, None],
                  np.arange(L)[None, :, None] * E + trace.experts.astype(np.int64)] = True
        self.rate = np.zeros((T + 1, L * E))  # rate[t]: the average through pass t - 1
        for t in range(T):
            self.rate[t + 1] = self.rate[t] + alpha_l * (self.used[t] - self.rate[t])
        self.slot_key: dict[int, int] = {}
        self.touched = np.zeros(L * E, np.int64)  # pass of the latest demand touch
        self.pass_id, self.lc = 0, -1

    def _touch(self, key: int) -> None:
        self.lc = key // self.E
        self.touched[key] = self.pass_id

    def on_insert(self, slot: int, key: int, prefetch: bool) -> None:
        self.slot_key[slot] = key
        if not prefetch:
            self._touch(key)

    def on_access(self, slot: int, key: int) -> None:
        self._touch(key)

    def on_pass(self, pass_id: int) -> None:
        self.pass_id, self.lc = pass_id, -1

    def values(self, keys: np.ndarray) -> np.ndarray:
        """v of each key in ``keys`` in the current state (the docstring's formula)."""
        t, lc, L = self.pass_id - 1, self.lc, self.L
        lay = keys // self.E
        inpass = (lay > lc) | ((lay == lc) & (self.touched[keys] != self.pass_id))
        dl = np.where(inpass, np.where(lay == lc, 0, lay - lc), lay - lc + L).astype(float)
        run0 = np.where(inpass, t, t + 1)
        v = np.zeros(len(keys))
        for h in range(self.H):
            u = self.used[np.minimum(run0 + h, len(self.used) - 1), keys]
            v += (u & inpass if self.current_only else u) / (dl + h * L + self.c)
        return v + self.beta * self.rate[min(max(t, 0), self.T), keys] / \
            (dl + self.H * L + self.c)

    def victim(self, candidates: list[int]) -> int:
        keys = np.array([self.slot_key[s] for s in candidates], np.int64)
        return candidates[int(np.argmin(self.values(keys)))]


def horizon_rows(tr: Trace, horizons: list[str], caps: tuple[str, ...], hws: tuple[str, ...],
                 bound: dict) -> list[dict]:
    """Item 4 of the module docstring: per hardware, capacity and horizon H (an integer, or
    "current": HorizonOracle(1, current_only=True)) the faster of HorizonOracle(H)
    demand-only and with the oracle's next-layer prefetch under admission (no byte budget),
    against the offline bound ``bound[(cap, hw)]``."""
    out = []
    for hw in hws:
        for cap in caps:
            for H in horizons:
                cur = H == "current"

                def oracle(n: int, nl: int, ne: int) -> object:
                    return make_policy(HorizonOracle(tr, 1 if cur else int(H),
                                                     current_only=cur), n, nl, ne)
                runs = []
                for pred in ("none", "oracle:depth=1"):
                    r = simulate(tr, oracle,
                                 cap, prefetch=None if pred == "none" else pred,
                                 hardware=HARDWARE[hw], admission=pred != "none",
                                 byte_budget=False)
                    runs.append((r.est_tpot_ms, pred, r.hit_rate))
                ms, pred, hit = min(runs)
                out.append({"policy": f"horizon_oracle:{H}", "predictor": pred,
                            "admission": pred != "none", "capacity": cap, "hardware": hw,
                            "hit_rate": round(hit, 4), "est_tpot_ms": round(ms, 3),
                            "vs_offline_bound": round(ms / bound[(cap, hw)]["est_tpot_ms"],
                                                      3)})
    return out


def variants(has_prior: bool) -> list[tuple[str, str, bool, bool]]:
    """(policy, predictor, admission, token_prior) of the online rows: every policy with every
    predictor, loading every prediction and under admission; with a token prior, the
    learned predictor also without it (the ablation) and nextuse evicting with it too."""
    out = []
    for pol in POLICIES + (("nextuse+prior",) if has_prior else ()):
        for pred in PREDICTORS if pol != "nextuse+prior" else ("none", "learned"):
            for adm in ((False,) if pred == "none" else (False, True)):
                out.append((pol, pred, adm, True))
                if has_prior and pred == "learned" and pol != "nextuse+prior":
                    out.append((pol, pred, adm, False))
    return out


def untimed_rows(tr: Trace, caps: tuple[str, ...], has_prior: bool) -> list[dict]:
    """The untimed hit rate MoE-Beyond reports (their 72 % at a 10 % cache): the simulator with
    a link that takes no time, so every prefetch is resident before its layer runs; the
    learned predictor fetching the top 6 by q (the routing's k) or 12 (overfetch 2), with and
    without the token prior, beside no prefetch and the oracle."""
    out = []
    for cap in caps:
        for pol in ("lru", "nextuse"):
            for pred in UNTIMED_PREDICTORS:
                for tp in ((True, False) if has_prior and pred.startswith("learned") else
                           (False,)):
                    r = simulate(tr, NextUse() if pol == "nextuse" else pol, cap,
                                 prefetch=None if pred == "none" else pred, hardware=UNTIMED,
                                 token_prior=tp)
                    out.append({"policy": pol, "predictor": pred, "token_prior": tp,
                                "capacity": cap, "hardware": "untimed",
                                "hit_rate": round(r.hit_rate, 4),
                                "loads_per_token": round((r.misses + r.prefetch_issued) /
                                                         max(r.tokens, 1), 2)})
    return out


def add_trace_arg(ap: argparse.ArgumentParser) -> None:
    """``--trace DIR``: a folder of traces in the shared layout (see :func:`trace_dir`)."""
    ap.add_argument("--trace", type=Path, default=None,
                    help="folder of puffin-layout traces (default: the shared DeepSeek-V2-Lite "
                         "traces)")


def trace_dir(a: argparse.Namespace) -> Path:
    """``--trace``, else the shared DeepSeek-V2-Lite traces; exits naming it when absent."""
    path = a.trace or shared_trace_dir()
    if not path.is_dir():
        sys.exit(f"{path}: no traces (the shared DeepSeek-V2-Lite traces, or pass --trace DIR)")
    return path


def load_split(path: Path, split: str) -> tuple[Trace, dict]:
    files = trainer.trace_files(path)
    tr = load_puffin(path)
    tr_idx, va_idx = split_requests([f.name for f in files])
    idx = {"val": va_idx, "train": tr_idx, "all": list(range(len(files)))}[split]
    return trainer.subset(tr, idx), {"prompts": len(idx), "of": len(files)}


def token_priors(tr: Trace, model: NextUseModel) -> tuple[np.ndarray, np.ndarray] | None:
    """(table, rows) of tr's tokens from the model's token prior, None without one."""
    if model.tokens is None or tr.tokens is None:
        return None
    return model.tokens.table(), model.tokens.rows(tr.tokens)


def prediction(tr: Trace, model: NextUseModel, frac: float, seed: int = 0,
               priors: tuple[np.ndarray, np.ndarray] | None = None) -> dict:
    """The prediction table; ``priors``: (table, rows) of the tokens' priors, given at each
    pass as the simulator and the live layers give them, or None (the ablation)."""
    T, L, K = tr.experts.shape
    E = tr.num_experts
    rng = np.random.default_rng(seed)
    auc = trainer.auc
    w = Walker(L, E, model)
    z, y, fresh = [], [], []
    depth = {d: {"topk_hits": 0, "topk_n": 0, "tp": 0, "fp": 0, "fn": 0}
             for d in (1, 2, 3, 6, 12)}
    with_prior = 0
    for t in range(T):
        w.begin_pass()
        if priors is not None and priors[1][t] >= 0:
            w.set_prior(priors[0][priors[1][t]])
            with_prior += 1
        for lay in range(L):
            if t + 1 < T and rng.random() < frac:
                f = w.features()
                q = f["q"]
                z.append(np.log(q) - np.log1p(-q))
                y.append(used_at_next_run(tr.experts, t, f["inpass"]))
                fresh.append(f["fresh"])
                for d, acc in depth.items():  # layer lay - 1 + d (lay - 1 ran last)
                    p = lay - 1 + d
                    tt, ll = (t, p) if p < L else (t + 1, p - L)
                    if tt >= T:
                        continue
                    truth = set(int(e) for e in tr.experts[tt, ll])
                    qa = q[ll * E:(ll + 1) * E]
                    top = np.argsort(-qa, kind="stable")[:K]
                    acc["topk_hits"] += len(truth & set(int(e) for e in top))
                    acc["topk_n"] += K
                    sel = set(int(e) for e in np.nonzero(qa >= 0.5)[0])
                    acc["tp"] += len(truth & sel)
                    acc["fp"] += len(sel - truth)
                    acc["fn"] += len(truth - sel)
            w.touch_layer(lay, tr.experts[t, lay])
    z, y, fresh = np.concatenate(z), np.concatenate(y), np.concatenate(fresh)
    p = np.clip(1 / (1 + np.exp(-z)), 1e-9, 1 - 1e-9)
    base = float(y.mean())
    out = {"token_prior": priors is not None,
           "tokens_with_prior": round(with_prior / max(T, 1), 4),
           "points_sampled": frac, "keys_scored": int(len(y)), "base_rate": round(base, 4),
           "log_loss": round(float(-np.mean(y * np.log(p) + (~y) * np.log(1 - p))), 4),
           "log_loss_constant": round(float(-(base * np.log(base) + (1 - base) *
                                              np.log(1 - base))), 4),
           "auc": round(auc(z, y), 4), "auc_fresh": round(auc(z[fresh], y[fresh]), 4),
           "auc_stale": round(auc(z[~fresh], y[~fresh]), 4), "depth": {}}
    for d, a in depth.items():
        prec = a["tp"] / max(a["tp"] + a["fp"], 1)
        rec = a["tp"] / max(a["tp"] + a["fn"], 1)
        out["depth"][str(d)] = {
            "topk_precision_recall_f1": round(a["topk_hits"] / max(a["topk_n"], 1), 4),
            "q>=0.5_precision": round(prec, 4), "q>=0.5_recall": round(rec, 4),
            "q>=0.5_f1": round(2 * prec * rec / max(prec + rec, 1e-12), 4)}
    return out


def sim_row(tr: Trace, policy: str, pred: str, cap: str, hwname: str,
            admission: bool = False, token_prior: bool = True,
            byte_budget: bool = True) -> dict:
    """One simulator row.  ``policy`` "nextuse+prior": nextuse evicting with the token prior
    too (NextUse(token_prior=True)); ``token_prior=False``: no pass gets its token's prior
    (the learned predictor's ablation)."""
    spec = Belady(tr) if policy == "belady" else NextUse() if policy == "nextuse" else \
        NextUse(token_prior=True) if policy == "nextuse+prior" else policy
    r = simulate(tr, spec, cap, prefetch=None if pred == "none" else pred,
                 hardware=HARDWARE[hwname], admission=admission, token_prior=token_prior,
                 byte_budget=byte_budget)
    acc = max(r.accesses, 1)
    loads = r.misses - r.prefetch_late + r.prefetch_issued  # demand loads + prefetch copies
    uses_prior = token_prior and tr.tokens is not None and (
        pred.startswith("learned") or policy == "nextuse+prior")
    return {"policy": policy, "predictor": pred, "admission": admission,
            "byte_budget": admission and byte_budget,
            "token_prior": uses_prior, "capacity": cap,
            "hardware": hwname, "hit_rate": round(r.hit_rate, 4),
            "untimed_hit_rate": round((r.hits + r.prefetch_late) / acc, 4),
            "prefetch_waste": round(r.prefetch_wasted / r.prefetch_issued, 4)
            if r.prefetch_issued else 0.0,
            "predictor_precision": round(r.predictor_precision, 4),
            "predictor_recall": round(r.predictor_recall, 4),
            "refused": r.prefetch_refused,
            "est_tpot_ms": round(r.est_tpot_ms, 3), "loads_per_token": loads / r.tokens,
            "sim_seconds": round(r.elapsed_s, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    add_trace_arg(ap)
    ap.add_argument("--split", choices=("val", "train", "all"), default="val")
    ap.add_argument("--quick", action="store_true", help="10 %% capacity, laptop only")
    ap.add_argument("--sample", type=float, default=0.25,
                    help="fraction of (token, layer) points scored in the prediction table")
    ap.add_argument("--save", type=Path, help="also write the JSON object to this file")
    ap.add_argument("--horizon", default="",
                    help="comma-separated horizons H for the perfect-predictor rows "
                         "(HorizonOracle; integers >= 0 or 'current', e.g. current,1,2,4; "
                         "default: none)")
    a = ap.parse_args()
    horizons = [h.strip() for h in a.horizon.split(",") if h.strip()]
    if not all(h == "current" or (h.isdigit() and h.isascii()) for h in horizons):
        ap.error(f"--horizon: integers >= 0 or 'current', comma-separated; got {a.horizon!r}")
    path = trace_dir(a)
    t0 = time.time()
    tr, which = load_split(path, a.split)
    L, E = tr.num_layers, tr.num_experts
    model = default_model(L, E)
    out: dict = {"machine": host(), "trace": str(path), "split": a.split, **which,
                 "tokens": tr.num_tokens, "accesses": tr.num_accesses,
                 "model": {"shape": model.shape, "trained_on": model.info.get("trained_on"),
                           "c": model.c, "beta": model.beta}}
    priors = token_priors(tr, model)
    out["prediction"] = prediction(tr, model, a.sample, priors=priors)
    if priors is not None:  # the ablation: the same points without the token prior
        out["prediction_without_token_prior"] = prediction(tr, model, a.sample)
    hist = simulate(tr, "lru", "100%", prefetch="history")
    out["prediction"]["history_depth1"] = {"precision": round(hist.predictor_precision, 4),
                                           "recall": round(hist.predictor_recall, 4)}
    if not a.json:
        print(json.dumps(out["prediction"], indent=1), flush=True)
    caps = ("10%",) if a.quick else ("5%", "10%", "25%")
    hws = ("laptop",) if a.quick else tuple(HARDWARE)
    rows, bound = [], {}
    for hw in hws:
        for cap in caps:
            b = [sim_row(tr, "belady", p, cap, hw) for p in BOUND_PREDICTORS] + \
                [sim_row(tr, "belady", p, cap, hw, admission=True, byte_budget=False)
                 for p in BOUND_ADMITTED]
            best = min(b, key=lambda r: r["est_tpot_ms"])
            bound[(cap, hw)] = best
            for r in b:
                r["bytes_vs_demand"] = round(r["loads_per_token"] / b[0]["loads_per_token"], 3)
                r["vs_offline_bound"] = round(r["est_tpot_ms"] / best["est_tpot_ms"], 3)
            demand = {}
            for pol, pred, adm, tp in variants(priors is not None):
                r = sim_row(tr, pol, pred, cap, hw, admission=adm, token_prior=tp)
                if pred == "none":
                    demand[pol] = r
                r["bytes_vs_demand"] = round(r["loads_per_token"] /
                                             demand[pol]["loads_per_token"], 3)
                r["vs_demand_only"] = round(r["est_tpot_ms"] /
                                            demand[pol]["est_tpot_ms"], 4)
                r["vs_offline_bound"] = round(r["est_tpot_ms"] / best["est_tpot_ms"], 3)
                rows.append(r)
                if not a.json:
                    print(f"{hw:13s} {cap:>4s} {pol:13s} {pred:15s} "
                          f"{'prior' if r['token_prior'] else '     '} "
                          f"{'admit' if adm else 'all  '} hit {r['hit_rate']:.3f} "
                          f"untimed {r['untimed_hit_rate']:.3f} tpot "
                          f"{r['est_tpot_ms']:8.2f} ms  x{r['vs_offline_bound']:.2f} of "
                          f"bound  bytes x{r['bytes_vs_demand']:.2f}", flush=True)
            rows.extend(b)
    for r in rows:
        r["loads_per_token"] = round(r["loads_per_token"], 2)
    out["sim"] = rows
    out["untimed"] = untimed_rows(tr, caps, priors is not None)
    if not a.json:
        for r in out["untimed"]:
            print(f"untimed {r['capacity']:>4s} {r['policy']:8s} {r['predictor']:16s} "
                  f"{'prior' if r['token_prior'] else '     '} hit {r['hit_rate']:.3f}",
                  flush=True)
    out["offline_bound"] = [{"capacity": c, "hardware": h, "predictor": r["predictor"],
                             "admission": r["admission"], "est_tpot_ms": r["est_tpot_ms"],
                             "hit_rate": r["hit_rate"]}
                            for (c, h), r in bound.items()]
    if horizons:
        out["horizon"] = horizon_rows(tr, horizons, caps, hws, bound)
        if not a.json:
            for r in out["horizon"]:
                print(f"{r['hardware']:13s} {r['capacity']:>4s} {r['policy']:18s} "
                      f"{r['predictor']:15s} hit {r['hit_rate']:.3f} tpot "
                      f"{r['est_tpot_ms']:8.2f} ms  x{r['vs_offline_bound']:.2f} of bound",
                      flush=True)
    adm = [r for r in rows if r["admission"] and r["policy"] != "belady"]
    out["admission_summary"] = {
        "rows": len(adm),
        "worst_vs_demand_only": max((r["vs_demand_only"] for r in adm), default=None),
        "slower_than_demand_only": [
            {k: r[k] for k in ("policy", "predictor", "capacity", "hardware", "vs_demand_only")}
            for r in adm if r["vs_demand_only"] > 1.0],
        "worst_bytes_vs_demand": max((r["bytes_vs_demand"] for r in adm), default=None),
        "plain_rows_slower_than_demand_only": sum(
            1 for r in rows if not r["admission"] and r["predictor"] != "none" and
            r["policy"] != "belady" and r["vs_demand_only"] > 1.0)}
    out["wall_seconds"] = round(time.time() - t0, 1)
    if a.save:
        a.save.write_text(json.dumps(out, indent=1) + "\n")
    if a.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
