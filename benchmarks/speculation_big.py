"""Speculation on the DeepSeek-V2-Lite-shaped checkpoint of big_model.py under its memory cgroup
(issue 39, item 2, second part): plain decoding against a drafter of controlled acceptance.

The checkpoint's weights are random, so a real drafter's acceptance would mean nothing here.
:class:`ControlledDrafter` proposes the target's own greedy continuation, taken from a plain
reference run of the same prompt, each token right with probability ``alpha`` (independently;
a wrong token is the right one + 1), and spends ``delta`` plain steps of CPU time per drafted
token (a busy wait: a drafter computes).  ``delta`` is stated in the output; the default 0.1 is
an assumption (a draft with a tenth of the target's per-token cost, such as a 0.5 B dense model
for a 2.4 B-active MoE), not a measurement on this checkpoint.

Rows: plain decoding, then for each alpha a static K for each K in ``--ks`` and Cascade
(default ``k_max``, its slowdown budget on).  One process loads the int4 store once inside a
memory cgroup of bf16 non-expert bytes + 25 % of the experts + 512 MiB (big_model.py's rule);
before every row the engine's cache is rebuilt empty.  Rounds are request-major, the rows'
order rotated per round; ``tok_per_s_vs_plain`` is the median over rounds of the row's decode
tok/s (new tokens over the iterations' time, prefill left out) over plain's in the same round.
Every row's output must equal the reference (``outputs_equal``).

A verification forward gives every token the bits of one-token decoding (the kernels are batch
invariant, tests/test_batch_invariance.py; before 2026-11-30 tiles of three or more tokens
rounded differently, and every K >= 2 row here left the reference within a few tokens).  A row
whose output still leaves the reference (``outputs_equal`` false, listed in ``rows_diverged``)
measures nothing -- from there every draft is wrong -- and the targets leave it out.

``--routing replay`` routes every decode position by a recorded DeepSeek-V2-Lite trace (the
first of ``--trace``'s files long enough; its first MoE layers) instead of the random routers,
with prefetch off (:func:`follow_trace`): real routing repeats experts from token to token,
which is what a verification of K + 1 tokens amortizes.

``--drafter self``: MoE-SpeQ's quantized self-draft with its real acceptance instead of a
controlled one.  The target runs from an int8 store (6 GB at 12 layers, converted once) and
drafts with an int4 copy of every routed expert kept resident (``SelfDraft``, built from the
int8 store at load), so the acceptance is what int4 quantisation of these weights gives.  The
cgroup is the int8 rule (bf16 non-expert bytes + 25 % of the int8 experts + 512 MiB) plus the
int4 copy's bytes, which a self-draft must hold in fast memory; rows: plain, static K for each
of ``--ks``, Cascade; lookahead prefetch of the draft's routing on (``generate``'s default),
with the engine's prefetch.  ``--alphas`` and ``--delta`` do not apply.

Not here: lookahead prefetch with the controlled drafter (it has no routing to give).
``--json`` prints one JSON object (host included); progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import big_model as B  # noqa: E402  (the checkpoint, its store, the cgroup and process runner)
import hostinfo  # noqa: E402


class ControlledDrafter:
    """Drafts the reference continuation, each token right with probability ``alpha``.

    Args:
        prompt_len: tokens of the prompt; the history's tokens after it follow ``reference``.
        reference: the target's greedy continuation of the prompt (a plain run).
        alpha: probability that a drafted token is the reference's, in [0, 1].
        draft_s: seconds of busy CPU per drafted token (>= 0).
        vocab: vocabulary size (a wrong token is the right one + 1, modulo vocab).
        seed: the drafter's own random stream.
    """

    def __init__(self, prompt_len: int, reference: Sequence[int], alpha: float, draft_s: float,
                 vocab: int, seed: int = 0) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if draft_s < 0:
            raise ValueError(f"draft_s must be >= 0, got {draft_s}")
        self.prompt_len, self.ref = int(prompt_len), [int(t) for t in reference]
        self.alpha, self.draft_s, self.vocab = float(alpha), float(draft_s), int(vocab)
        self.rng = random.Random(seed)

    def propose(self, history: Sequence[int], k: int) -> List[int]:
        j = len(history) - self.prompt_len
        out: List[int] = []
        for i in range(max(0, int(k))):
            if j + i >= len(self.ref):
                break
            t = self.ref[j + i]
            if self.rng.random() >= self.alpha:
                t = (t + 1) % self.vocab
            out.append(t)
        end = time.perf_counter() + self.draft_s * len(out)
        while time.perf_counter() < end:  # a drafter computes: it holds a core
            pass
        return out


def follow_trace(model: Any, eng: Any, experts: "np.ndarray", prefill_above: int = 16) -> Any:
    """Route every decode-sized forward of ``model`` by the recorded ``experts`` [tokens, MoE
    layers, top_k] at the forward's position (its KV length): a verification of K drafts and
    the plain steps that redo a position after a rejection replay the same rows, so every
    row of the benchmark sees one routing per position, as a real model's would be for the
    same tokens.  Passes of more than ``prefill_above`` tokens (the prompt) route by the
    checkpoint's own routers: their shared experts run in torch (above the C layers' 16
    tokens), which a replay cannot follow (``Engine.replay_routing``), and prefill is not
    timed.  Returns a function that undoes
    it (the hooks removed, the replay off)."""
    def seek(kv: Any) -> None:
        eng.replay_routing(experts, start=kv.get_seq_length())

    def pre(mod: Any, args: Any, kwargs: Dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        kv = kwargs.get("cache", kwargs.get("past_key_values"))
        if ids is None or kv is None or ids.shape[1] > prefill_above:
            eng.replay_routing(None)
        else:
            seek(kv)

    handle = model.register_forward_pre_hook(pre, with_kwargs=True)
    from specmoe.models.decode_step import decode_step_of
    step = decode_step_of(model)
    if step is not None:  # generate's plain greedy step in one C call bypasses the forward
        greedy_next = step.greedy_next

        def greedy_next_replayed(tok: int, kv: Any) -> Any:
            seek(kv)
            return greedy_next(tok, kv)
        step.greedy_next = greedy_next_replayed

    def undo() -> None:
        handle.remove()
        if step is not None:
            step.greedy_next = greedy_next
        eng.replay_routing(None)
    return undo


def trace_for(trace_dir: Path, layers: int, top_k: int, experts: int, need: int,
              out: Path) -> Dict[str, Any]:
    """The first trace in ``trace_dir`` (sorted by name) of at least ``need`` tokens, its first
    ``layers`` MoE layers, saved as ``out`` (npz, ``experts``); returns what was taken."""
    import specmoe
    files = sorted(p for p in Path(trace_dir).iterdir()
                   if p.name.endswith((".csv", ".csv.gz", ".npz")))
    for f in files:
        tr = specmoe.load_trace(f)
        ex = np.asarray(tr.experts)
        if ex.shape[0] < need or ex.shape[1] < layers or ex.shape[2] != top_k \
                or int(tr.num_experts) != experts:
            continue
        np.savez(out, experts=ex[:, :layers].astype(np.int16))
        return {"file": f.name, "tokens": int(ex.shape[0]), "layers_used": layers,
                "layers_in_trace": int(ex.shape[1])}
    raise SystemExit(f"speculation_big: no trace in {trace_dir} has {need} tokens of "
                     f"{layers} layers x top-{top_k} of {experts} experts")


def worker(spec_path: str) -> None:
    """Inside the cgroup: load once, run every row in rounds, write the results."""
    spec = json.loads(Path(spec_path).read_text())
    import torch

    import specmoe
    from specmoe.speculation import controllers as ctl
    from specmoe.speculation.generation import generate

    torch.set_num_threads(spec["threads"])
    specmoe.runtime.kernels.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    replay = spec.get("replay")
    self_draft = spec.get("drafter") == "self"
    model = specmoe.from_pretrained(spec["ckpt"], cache=spec["cache"],
                                    dtype="int8" if self_draft else "int4",
                                    policy="least_stale", prefetch=replay is None,
                                    store=spec["store"], progress=False)
    eng = specmoe.engine_of(model)
    model.eval()
    if replay is not None:
        follow_trace(model, eng, np.load(replay)["experts"])
    sd = None
    if self_draft:  # the int4 copy of every routed expert, built once from the int8 store
        from specmoe.speculation.drafters import SelfDraft
        sd = SelfDraft(eng, "int4")
    load_s = time.perf_counter() - t0
    n, prompt = spec["tokens"], spec["prompt_ids"]
    vocab = int(model.config.vocab_size)

    def run(drafter: Any, controller: Any) -> Dict[str, Any]:
        eng.set_cache(spec["cache"])  # bytes, as a string: rebuilt empty
        eng.reset_stats()
        o = generate(model, torch.tensor([prompt]), drafter, controller, max_new_tokens=n,
                     eos_token_id=None, engine=eng, tau=None)
        its = o.iterations
        return {"out": o.sequences[0, len(prompt):].tolist(),
                "decode_s": sum(i["t_iter"] for i in its), "iterations": len(its),
                "proposed": sum(i["k"] for i in its), "accepted": sum(i["accepted"] for i in its),
                "loads": sum(i["experts_loaded"] for i in its),
                "steps": [i["t_iter"] for i in its if i["k"] == 0]}

    generate(model, torch.tensor([spec["warm_ids"]]), None, None, max_new_tokens=4,
             eos_token_id=None, engine=eng)  # warm-up: the code paths, not the cache
    ref = run(None, None)
    t_plain = statistics.median(ref["steps"])
    draft_s = spec["delta"] * t_plain
    rows = [{"name": "plain", "alpha": None, "controller": "nospec", "k": None}]
    for a in (["self"] if self_draft else spec["alphas"]):
        tag = "self" if self_draft else f"a{a}"
        rows += [{"name": f"{tag}/static{k}", "alpha": a, "controller": "static", "k": k}
                 for k in spec["ks"]]
        rows.append({"name": f"{tag}/cascade", "alpha": a, "controller": "cascade", "k": None})
    runs: Dict[str, List[Dict[str, Any]]] = {r["name"]: [] for r in rows}
    for rep in range(spec["repeats"]):
        order = rows[rep % len(rows):] + rows[:rep % len(rows)]
        for r in order:
            if r["alpha"] is None:
                d = c = None
            else:
                d = sd if self_draft else ControlledDrafter(len(prompt), ref["out"], r["alpha"],
                                                            draft_s, vocab, seed=rep)
                c = ctl.StaticK(r["k"]) if r["controller"] == "static" else ctl.Cascade()
            x = run(d, c)
            x["equal"] = x.pop("out") == ref["out"]
            x.pop("steps")
            runs[r["name"]].append(x)
            print(f"round {rep + 1}: {r['name']}: {n / x['decode_s']:.2f} tok/s", file=sys.stderr,
                  flush=True)
    eng.close()
    Path(spec["result"]).write_text(json.dumps({
        "load_s": load_s, "t_plain_step_s": t_plain, "draft_s_per_token": draft_s,
        "rows": rows, "runs": runs}))


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--save", type=Path, default=None, help="also write the JSON here")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--drafter", choices=("controlled", "self"), default="controlled",
                    help="controlled: a drafter of set acceptance (--alphas, --delta); self: "
                         "the int4 self-draft of an int8 store, its real acceptance")
    ap.add_argument("--alphas", default="0.5,0.7,0.9")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--delta", type=float, default=0.1,
                    help="drafting cost per token in plain steps (assumed, stated in the output)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-cgroup", action="store_true", help="run uncapped (not a valid result)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 2 layers, vocab 16384, 8 tokens, alpha 0.7, K 2, 1 round")
    ap.add_argument("--routing", choices=("random", "replay"), default="random",
                    help="random: the checkpoint's skewed random routers; replay: each decode "
                         "position routed by a recorded DeepSeek-V2-Lite trace (--trace)")
    ap.add_argument("--trace", type=Path, default=B.REPO.parent / "shared" / "traces" /
                    "deepseek-v2-lite-puffin", help="folder of traces for --routing replay")
    ap.add_argument("--workdir", default=os.path.expanduser("~/.cache/specmoe/bench"))
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._worker:
        worker(a._worker)
        return 0
    vocab = 102400
    if a.quick:
        a.layers, vocab, a.tokens, a.alphas, a.ks, a.repeats = 2, 16384, 8, "0.7", "2", 1
    try:
        alphas = [float(x) for x in a.alphas.split(",")]
        ks = [int(x) for x in a.ks.split(",")]
    except ValueError:
        ap.error("--alphas and --ks take comma-separated numbers")
    if not all(0 <= x <= 1 for x in alphas) or not all(1 <= k <= 8 for k in ks):
        ap.error("--alphas must be in [0, 1] and --ks in 1..8")
    if a.layers < 2 or a.tokens < 2 or a.repeats < 1 or a.delta < 0:
        ap.error("--layers >= 2, --tokens >= 2, --repeats >= 1, --delta >= 0")
    t_all = time.perf_counter()
    cfg = B.make_config(a.layers, vocab, "dsv2lite")
    chash = B.config_hash(cfg, 0, 1.0)
    root = Path(a.workdir).expanduser() / f"dsv2lite-L{a.layers}-V{vocab}-{chash}"
    ckpt, work = root / "ckpt", root / "run"
    work.mkdir(parents=True, exist_ok=True)
    B.write_checkpoint(ckpt, cfg, 0, 1.0)
    sdt = "int8" if a.drafter == "self" else "int4"  # the store's format
    store = root / f"store-{sdt}.smoe"
    info = B.convert_store_info(ckpt, sdt, store, a.timeout)
    if "error" in info:
        print(f"speculation_big: the {sdt} store: {info['error']}", file=sys.stderr)
        return 1
    prompt_ids, warm_ids = B.make_prompts(ckpt, B.PROMPT_TOKENS, 0)
    bud = dict(B.budgets(cfg)[sdt])
    cache_bytes = int(bud["cache_bytes"])
    if a.drafter == "self":  # the resident int4 copy is fast memory too
        bud["draft_copy_bytes"] = int(B.budgets(cfg)["int4"]["expert_bytes"])
        bud["budget_bytes"] += bud["draft_copy_bytes"]
    spec = {"ckpt": str(ckpt), "store": str(store), "cache": str(cache_bytes),
            "threads": a.threads, "prompt_ids": prompt_ids, "warm_ids": warm_ids,
            "tokens": a.tokens, "alphas": alphas, "ks": ks, "delta": a.delta,
            "drafter": a.drafter,
            "repeats": a.repeats, "result": str(work / "speculation_big.json")}
    trace_info = None
    if a.routing == "replay":
        moe_layers = a.layers - int(cfg["first_k_dense_replace"])
        need = len(prompt_ids) + a.tokens + max(ks) + 1
        spec["replay"] = str(work / "speculation_big-trace.npz")
        trace_info = trace_for(a.trace, moe_layers, int(cfg["num_experts_per_tok"]),
                               int(cfg["n_routed_experts"]), need, Path(spec["replay"]))
    spec_path = work / "speculation_big-spec.json"
    spec_path.write_text(json.dumps(spec))
    Path(spec["result"]).unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads),
               PYTHONPATH=os.pathsep.join(filter(None, [str(B.REPO),
                                                        os.environ.get("PYTHONPATH")])))
    cg = None if a.no_cgroup else B.Cgroup("speculation_big", bud["budget_bytes"])
    try:
        cold = B.drop_caches()
        r = B.run_process([sys.executable, str(Path(__file__).resolve()), "--_worker",
                           str(spec_path)], cg, a.timeout, env=env)
        peak = cg.peak() if cg is not None else None
    finally:
        if cg is not None:
            cg.close()
    if r["rc"] != 0 or not Path(spec["result"]).is_file():
        print(f"speculation_big: {B._fail_reason(r, cg, 'the speculation rows')}",
              file=sys.stderr)
        return 1
    res = json.loads(Path(spec["result"]).read_text())
    plain = [a.tokens / x["decode_s"] for x in res["runs"]["plain"]]
    out_rows = []
    for row in res["rows"]:
        xs = res["runs"][row["name"]]
        tps = [a.tokens / x["decode_s"] for x in xs]
        ratios = [t / p for t, p in zip(tps, plain)]
        prop, acc = sum(x["proposed"] for x in xs), sum(x["accepted"] for x in xs)
        out_rows.append({
            "setting": f"dsv2lite-L{a.layers} {sdt} in a memory cgroup"
                       + (", routing replayed from a trace" if trace_info else ""), "drafter":
            None if row["alpha"] is None else "self (int4)" if a.drafter == "self"
            else "controlled", "alpha": None if a.drafter == "self" else row["alpha"],
            "controller": row["controller"], "k": row["k"],
            "tok_per_s": round(statistics.median(tps), 3),
            "tok_per_s_vs_plain": round(statistics.median(ratios), 4),
            "ratio_per_repeat": [round(x, 3) for x in ratios],
            "acceptance": round(acc / prop, 3) if prop else None,
            "etr": round(a.tokens * len(xs) / max(1, sum(x["iterations"] for x in xs)), 3),
            "experts_loaded_per_token": round(sum(x["loads"] for x in xs)
                                              / (a.tokens * len(xs)), 2),
            "outputs_equal": all(x["equal"] for x in xs)})
    # a row whose output left the reference measures nothing: from there on every draft is
    # the reference's token for another history (see the module docstring)
    valid = [r for r in out_rows if r["outputs_equal"]]
    at7 = [r["tok_per_s_vs_plain"] for r in valid if r["alpha"] == 0.7]
    casc = [r["tok_per_s_vs_plain"] for r in valid if r["controller"] == "cascade"]
    results = {
        "benchmark": "speculation_big", "rows": out_rows,
        "rows_diverged": [f"{r['drafter']} alpha {r['alpha']} {r['controller']}{r['k'] or ''}"
                          for r in out_rows if not r["outputs_equal"]],
        "targets": {"best_at_alpha_0.7": max(at7) if at7 else None,
                    "best_at_alpha_0.7_met": bool(at7) and max(at7) >= 1.3,
                    "cascade_worst_vs_plain": min(casc) if casc else None,
                    "cascade_worst_met": bool(casc) and min(casc) >= 0.95},
        "config": {"layers": a.layers, "vocab": vocab, "dtype": sdt, "drafter": a.drafter,
                   "tokens": a.tokens,
                   "routing": a.routing, "trace": trace_info,
                   "prefetch": "router" if trace_info is None else "off (the random "
                               "routers' guesses mean nothing under a replay)",
                   "repeats": a.repeats,
                   **({"delta": a.delta,
                       "delta_source": "assumed: a draft with a tenth of the target's per-token "
                                       "cost" if a.delta == 0.1 else "--delta",
                       "draft_ms_per_token": round(res["draft_s_per_token"] * 1e3, 3)}
                      if a.drafter == "controlled" else
                      {"draft_copy_bytes": bud["draft_copy_bytes"],
                       "budget_rule": "int8: bf16 non-expert bytes + 25 % of the int8 experts "
                                      "+ 512 MiB, plus the resident int4 copy"}),
                   "plain_step_ms": round(res["t_plain_step_s"] * 1e3, 2),
                   "budget_bytes": bud["budget_bytes"], "cache_bytes": cache_bytes,
                   "cgroup": cg is not None, "cgroup_peak_bytes": peak, "cold_start": cold,
                   "load_s": round(res["load_s"], 1), "host": hostinfo.host(a.threads),
                   "loadavg": round(os.getloadavg()[0], 2),
                   "wall_s": round(time.perf_counter() - t_all, 1)}}
    if a.save:
        a.save.write_text(json.dumps(results, indent=1) + "\n")
    if a.json:
        print(json.dumps(results))
    else:
        for x in out_rows:
            name = "plain" if x["drafter"] is None else \
                f"{x['drafter'] if x['alpha'] is None else 'alpha ' + str(x['alpha'])} " \
                f"{x['controller']}{x['k'] or ''}"
            print(f"{name:24} {x['tok_per_s']:7.2f} tok/s  {x['tok_per_s_vs_plain']:.3f}x  "
                  f"equal={x['outputs_equal']}")
        print(json.dumps(results["targets"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
