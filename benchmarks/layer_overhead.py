"""How much of an offloaded MoE layer's time is Python and torch glue, and what prefetch costs.

Model: the zoo's tiny-moe (or, with --arch, a random tiny model), experts offloaded with a 25 %
cache, f32 store, greedy decoding of --tokens tokens after a short prompt, torch and the kernels
on one thread.  For every MoE layer call it times the whole call of the experts module
(``SpecmoeExperts.forward``: the Python glue, the casts and the C work) and the C call inside it
(``_C.Layers.forward``, or ``_C.moe_forward`` in builds before the per-layer C object), so
``python_share`` = 1 - C time / whole call.  It also times ``generate`` with prefetch on and off
(interleaved repeats, median) and reports their ratio.

``--json`` prints one JSON object: {"config", "per_layer_ms": {"call", "c", "python"},
"python_share", "prefetch_on_vs_off"}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import hostinfo  # noqa: E402,F401  (before torch: its OpenMP wait policy)

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specmoe.models import testing  # noqa: E402
from specmoe.runtime import engine as hf  # noqa: E402
from specmoe.runtime.experts import SpecmoeExperts  # noqa: E402


def _timed(fn, acc):
    """fn, summing its wall time and call count into acc."""
    def f(*args):
        t0 = time.perf_counter()
        r = fn(*args)
        acc["t"] += time.perf_counter() - t0
        acc["n"] += 1
        return r
    return f


class _Proxy:
    """The Engine's C layer object with a timed forward."""

    def __init__(self, inner, acc):
        self.inner, self.forward = inner, _timed(inner.forward, acc)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--arch", default=None, help="random tiny model instead of the zoo model")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from specmoe.runtime import kernels
    kernels.set_num_threads(1)
    if a.arch:
        model = testing.tiny_model(a.arch, hidden=256, inter=512, layers=4, experts=16)
        prompt = torch.tensor([[5, 17, 33, 64, 9, 100, 7, 41]])
    else:
        from specmoe import zoo
        model, tok = zoo.load("tiny-moe", dtype=torch.float32, experts_implementation="eager")
        prompt = tok("def read_config(path):\n", return_tensors="pt").input_ids
    eng = hf.offload(model, cache=0.25, dtype="f32")
    calls = {"t": 0.0, "n": 0}
    orig = SpecmoeExperts.forward

    def timed_forward(self, *args):
        t0 = time.perf_counter()
        r = orig(self, *args)
        calls["t"] += time.perf_counter() - t0
        calls["n"] += 1
        return r

    def run(prefetch: bool) -> float:
        eng.set_cache(0.25)  # cold cache each run
        eng.set_prefetch(prefetch)
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=a.tokens, min_new_tokens=a.tokens,
                           do_sample=False)
        return time.perf_counter() - t0

    run(True)  # warm-up
    on, off, shares, per_call, per_c = [], [], [], [], []
    for _ in range(a.repeats):
        for prefetch in (True, False):
            t = run(prefetch)
            (on if prefetch else off).append(t)
        # the per-layer split, prefetch on (the default), one more run with the timers in
        eng.set_cache(0.25)
        eng.set_prefetch(True)
        c = {"t": 0.0, "n": 0}
        if hasattr(eng, "_layers"):
            eng._layers = _Proxy(eng._layers, c)
        else:  # builds before the per-layer C object: the C call is _forward_c
            eng._forward_c = _timed(eng._forward_c, c)
        calls.update(t=0.0, n=0)
        SpecmoeExperts.forward = timed_forward
        try:
            with torch.no_grad():
                model.generate(prompt, max_new_tokens=a.tokens, min_new_tokens=a.tokens,
                               do_sample=False)
        finally:
            SpecmoeExperts.forward = orig
            if isinstance(getattr(eng, "_layers", None), _Proxy):
                eng._layers = eng._layers.inner
            else:
                del eng._forward_c
        per_call.append(calls["t"] / calls["n"] * 1e3)
        per_c.append(c["t"] / c["n"] * 1e3)
        shares.append(1 - c["t"] / calls["t"])
    eng.close()
    res = {
        "config": {"model": a.arch or "zoo tiny-moe", "tokens": a.tokens, "repeats": a.repeats,
                   "cache": 0.25, "dtype": "f32", "threads": 1},
        "per_layer_ms": {"call": round(statistics.median(per_call), 4),
                         "c": round(statistics.median(per_c), 4),
                         "python": round(statistics.median(per_call) - statistics.median(per_c),
                                         4)},
        "python_share": round(statistics.median(shares), 3),
        "python_share_runs": [round(s, 3) for s in shares],
        "prefetch_on_vs_off": round(statistics.median(on) / statistics.median(off), 3),
        "generate_s": {"prefetch_on": round(statistics.median(on), 3),
                       "prefetch_off": round(statistics.median(off), 3)},
    }
    print(json.dumps(res) if a.json else json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
