"""Subprocess body of tests/test_faults.py: run model.generate on an offloaded tiny model while
the LD_PRELOAD shim tests/c/faultfs.c injects read faults, and print one JSON line per case.

    LD_PRELOAD=faultfs.so python tests/fault_worker.py {pretrained|offload} DIR CASES_JSON

pretrained: specmoe.from_pretrained on a saved tiny Mixtral (store opened with verify=True);
offload: specmoe.offload (its store is opened with verify=False by specmoe/runtime/engine.py).
Each case is [name, mode, after, count, threads] as in faultfs.c; for each: arm, generate,
disarm, generate again.  Outcome "ok" (the reference tokens), "WRONG" (other tokens) or the
exception's type and message."""
from __future__ import annotations

import ctypes
import json
import os
import sys
import time

import torch

import specmoe
from specmoe.models.testing import save_checkpoint, tiny_model

which, folder, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
lib = ctypes.CDLL(None)
lib.smoe_fault_arm.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_long, ctypes.c_long,
                               ctypes.c_int]
lib.smoe_fault_injected.restype = ctypes.c_long

torch.manual_seed(0)
model = tiny_model("mixtral")
ids = torch.tensor([[1, 5, 9, 3, 7, 11, 4]])
ref = model.generate(ids, max_new_tokens=12, do_sample=False)
store = os.path.join(folder, f"{which}-store.smoe")
if which == "pretrained":
    ck = save_checkpoint(model, os.path.join(folder, "ckpt"))
    model = specmoe.from_pretrained(ck, cache=0.25, dtype="f32", policy="lru", store=store,
                                    progress=False)
    eng = specmoe.engine_of(model)
else:
    eng = specmoe.offload(model, store=store, cache=0.25, dtype="f32", progress=False)


def gen() -> str:
    try:
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"
    return "ok" if torch.equal(out, ref) else "WRONG"


print(json.dumps({"case": "baseline", "result": gen(), "store": store}), flush=True)
for name, mode, after, count, threads in cases:
    stats0 = eng.stats()
    lib.smoe_fault_arm(os.path.basename(store).encode(), mode, after, count, threads)
    t0 = time.perf_counter()
    res = gen()
    injected = lib.smoe_fault_injected()
    lib.smoe_fault_disarm()
    stats1 = eng.stats()
    print(json.dumps({"case": name, "result": res[:400], "injected": injected,
                      "prefetch_failed": stats1["prefetch_failed"] - stats0["prefetch_failed"],
                      "seconds": round(time.perf_counter() - t0, 2), "after": gen()}), flush=True)
eng.close()
