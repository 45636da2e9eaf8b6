"""Subprocess body of tests/test_threads.py: one thread generates on the zoo model while
another calls an Engine setter in a loop; prints one JSON line per setter.  A subprocess,
because the failure these cases guard against is a hang (issue 43: a three-way deadlock
between a setter holding the GIL, a forward holding the MoE layers' mutex and the prefetch
worker holding the slots' mutex inside a Python policy) that Ctrl-C cannot end.

    python tests/thread_worker.py DENSE SETTER[,SETTER...]

DENSE: "auto" (the C decoder: one call per layer or per decode step) or "torch".
Each line: {"setter": ..., "calls": setter calls made, "wrong": generations whose tokens
differ from the reference generated before the setter thread started, "error": repr or None}."""
from __future__ import annotations

import json
import sys
import threading
import time

import torch

import specmoe
from specmoe import zoo


class FirstCandidate(specmoe.PythonPolicy):
    """The probe's policy: evict the first candidate (a Python policy: its callbacks take the
    GIL inside the slot table's mutex)."""

    def victim(self, candidates):
        return candidates[0]


dense, setters = sys.argv[1], sys.argv[2].split(",")
torch.manual_seed(0)
model = specmoe.from_pretrained(zoo.path("tiny-moe"), policy=FirstCandidate(), dense=dense, progress=False)
eng = specmoe.engine_of(model)
ids = torch.tensor([[1, 5, 9, 3, 7, 11, 4]])
with torch.no_grad():
    ref = model.generate(ids, max_new_tokens=40, do_sample=False)


def flip(name: str, i: int) -> None:
    if name == "set_prefetch":
        eng.set_prefetch(bool(i % 2))
    elif name == "set_policy":
        eng.set_policy(FirstCandidate())
    elif name == "set_parallel_misses":
        eng.set_parallel_misses(bool(i % 2))
    elif name == "set_miss":
        eng.set_miss(miss="fetch", route_lambda=0.0)
    elif name == "stats":
        eng.stats()
    elif name == "set_cache":  # no pause between calls: generation must still get its turns
        eng.set_cache(8)
        eng.set_cache("25%")
    else:
        raise SystemExit(f"unknown setter {name}")


for name in setters:
    stop = threading.Event()
    calls, errors = [0], []

    def churn() -> None:
        try:
            while not stop.is_set():
                flip(name, calls[0])
                calls[0] += 1
                if name != "set_cache":
                    time.sleep(0.001)
        except BaseException as exc:  # noqa: BLE001 - reported in the JSON line
            errors.append(exc)

    t = threading.Thread(target=churn, daemon=True)
    t.start()
    wrong = 0
    try:
        with torch.no_grad():
            for _ in range(3):
                out = model.generate(ids, max_new_tokens=40, do_sample=False)
                wrong += not torch.equal(out, ref)
    except BaseException as exc:  # noqa: BLE001
        errors.append(exc)
    finally:
        stop.set()
        t.join()
    eng.set_prefetch(True)  # the defaults again for the next setter
    eng.set_parallel_misses(True)
    print(json.dumps({"setter": name, "calls": calls[0], "wrong": wrong,
                      "error": repr(errors[0]) if errors else None}), flush=True)
eng.close()
