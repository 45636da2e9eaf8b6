"""Decode through the GPU tier (issue 12 item 6): bf16 experts at Qwen3-30B-A3B (default) or
Mixtral-8x7B shapes, all experts in host memory (pinned copy of a store), a GPU cache at
10%, 25% and 50% of them, tokens decoded one at a time through every MoE layer's routed
experts (the non-expert part of the model is not run: this measures the expert path alone).

Rows (``rows``), all on the same pre-drawn routing (Zipf-like expert popularity):

* ``specmoe N%``: the GPU cache at N% of the experts, no prefetch (demand loads only);
* ``specmoe N% + oracle prefetch``: prefetch of the next layer's experts from the pre-drawn
  routing (an ORACLE predictor: the prefetch upper bound, not a real predictor);
* ``all experts resident (upper bound)``: a cache with a slot for every expert, every expert
  loaded into it before timing (:func:`warm_all`); its ``misses`` must be 0.

Peer (``peer_rows``): accelerate's CPU offload of the experts, as a user would set it up:
one torch module per MoE layer holding its experts as bf16 ``nn.Linear`` gate/up/down with
the store's weights, ``accelerate.cpu_offload(model, execution_device=cuda)``, so each expert
call copies its weights from (pageable) host memory to the GPU through accelerate's hooks; the
same routing and per-layer normalisation as the specmoe rows, on the first ``--peer-tokens``
tokens only (every expert is copied on every call: it is slow).  If accelerate cannot be
imported or fails, the row says why (``error``).  ``specmoe_25pct_vs_accelerate``: tok/s of
the 25% rows (without and with oracle prefetch) over the peer's (the issue's target: >= 5).

Bandwidth, measured in the same run: ``pinned_h2d_gbps`` (256 MiB pinned host-to-device
copies, the ceiling of loads); the cache's own load path, ``cache_copy_gbps`` (a fresh
``GpuExpertCache`` of n = min(``--copy-blocks`` = 64, half the experts) slots: prefetch of n
non-resident experts, wait for the worker and the copy stream, acquire each on the compute
stream, synchronize; wall time, median of repeats; each repeat checks that n blocks were
really copied) against ``pinned_h2d_block_gbps`` (n back-to-back pinned copies of one expert
block each, CUDA-event timed, repeats alternating with the cache's) and their ratio
``cache_copy_fraction_of_pinned`` (the issue's target: >= 0.9).  Per row,
``copy_gbps_over_wall`` divides the bytes copied by the whole decode time (a lower bound).

``... + balancer``: MoE-SpAc's heterogeneous workload balancer (the C layers' hybrid split,
``cuda.ExpertLayers.set_hybrid(profile)``, §3.3, the engine's): of each layer's experts that
are neither resident nor loading, the coldest run on the CPU kernels from the pinned host copy
instead of being copied (and are then offered to the cache for admission behind the prefetches,
as in the engine), the split minimising ``|T_cpu - T_gpu|`` with per-expert costs measured once
in this run (``balance_profile``); ``balancer_vs_copy``: tok/s with it over tok/s without, at
each cache fraction and prefetch setting.  Every row runs on a fresh cache (the same empty
start), after a 2-token warm-up (the first two tokens of the routing).  Every row's layers are
one C call each, ``cuda.ExpertLayers`` (the engine's path, its own predictor off).

Not yet here: a real (non-oracle) predictor row; the whole model through
``offload(device="cuda")`` (see docs/gpu.md).

``--json`` prints one JSON object.  Without a usable GPU it prints {"skipped": reason} and
exits 0.  The helpers take a ``device`` (a CUDA index, or -1: CPU / the cache's host
emulation) so that they can be exercised without a GPU.  The rows of the first version ran
once on an H200; the all-resident warming, the copy-path measurement and the accelerate peer
were written and tested on a CPU only (the peer against numpy, the cache parts in the cache's
host emulation).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hostinfo  # noqa: E402,F401  (before torch: its OpenMP wait policy)

SHAPES = {  # H, I, experts, top_k, layers of the real model
    "qwen3-30b-a3b": (2048, 768, 128, 8, 48),
    "mixtral-8x7b": (4096, 14336, 8, 2, 32),
}
PEER_TARGET = 5.0  # issue 12: specmoe at a 25% cache >= 5x accelerate's offload
COPY_TARGET = 0.9  # issue 12: cache copies >= 0.9 of the pinned host-to-device bandwidth


def pinned_h2d_gbps(torch: Any, nbytes: int = 256 << 20, iters: int = 10) -> float:
    """Pinned host-to-device copy bandwidth (GB/s) with ``nbytes`` copies, CUDA-event timed."""
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        dst.copy_(src, non_blocking=True)
    b.record()
    torch.cuda.synchronize()
    return nbytes * iters / (a.elapsed_time(b) / 1e3) / 1e9


def make_store(path: str, H: int, I: int, E: int, L: int, seed: int = 0) -> None:
    """A bf16 store of L layers x E experts (gate [I, H], up [I, H], down [H, I]), weights
    0.02 x standard normal from ``seed``."""
    from specmoe.storage import quant
    from specmoe.storage.store import write_store

    rng = np.random.default_rng(seed)

    def layers():
        for _ in range(L):
            g = (rng.standard_normal((E, I, H), dtype=np.float32) * 0.02)
            u = (rng.standard_normal((E, I, H), dtype=np.float32) * 0.02)
            d = (rng.standard_normal((E, H, I), dtype=np.float32) * 0.02)
            yield {"gate": quant.f32_to_bf16(g), "up": quant.f32_to_bf16(u),
                   "down": quant.f32_to_bf16(d)}

    write_store(path, layers(), num_layers=L, top_k=1, progress=False,
                dtypes={"gate": "bf16", "up": "bf16", "down": "bf16"}).close()


def routing(rng, tokens: int, L: int, E: int, k: int, skew: float = 1.2) -> np.ndarray:
    """[tokens, L, k] expert ids, Zipf-like popularity per layer (some locality)."""
    p = 1.0 / np.arange(1, E + 1) ** skew
    p /= p.sum()
    out = np.empty((tokens, L, k), dtype=np.int64)
    perms = [rng.permutation(E) for _ in range(L)]
    for t in range(tokens):
        for l in range(L):
            out[t, l] = perms[l][rng.choice(E, k, replace=False, p=p)]
    return out


def decode(torch, cuda, cache, spec, ids, H: int, prefetch: bool, balance: Any = None,
           device: int = 0) -> dict:
    """Decode ``ids.shape[0]`` tokens through every layer's routed experts via ``cache``
    (weights 1/k, the output normalised after each layer), each layer one call of the GPU
    tier's C layer path (``cuda.ExpertLayers``, the engine's own, its predictor off: the
    oracle prefetch below is the caller's); tok/s and the cache's counters.  ``balance``: a
    ``cuda.BalanceProfile`` turns MoE-SpAc's CPU/GPU balancer on (the C layers' hybrid split).
    ``device``: the cache's (-1: its host emulation, tensors on the CPU)."""
    T, L, k = ids.shape
    dev = torch.device("cpu") if device < 0 else torch.device("cuda", device)
    x = torch.randn(1, H, device=dev) * 0.1
    w = torch.full((1, k), 1.0 / k, device=dev)
    ids_dev = torch.from_numpy(ids).to(dev)
    E = cache.store.num_experts
    lay = cuda.ExpertLayers(cache, spec, k)
    lay.set_hybrid(balance)
    sync = (lambda: None) if device < 0 else (lambda: torch.cuda.synchronize(dev))
    sync()
    cache.reset_stats()
    t0 = time.perf_counter()
    for t in range(T):
        for l in range(L):  # layer 0's call begins the token's pass
            if prefetch and l + 1 < L:
                cache.prefetch([(l + 1) * E + int(e) for e in ids[t, l + 1]], replace=True)
            elif prefetch and t + 1 < T:
                cache.prefetch([int(e) for e in ids[t + 1, 0]], replace=True)
            x = lay.forward(l, x, ids_dev[t, l].view(1, k), w)
            x = x / (x.norm() + 1e-6)
    sync()
    wall = time.perf_counter() - t0
    c = lay.counters()
    counters = {"gpu_experts": c["gpu_experts"], "cpu_experts": c["cpu_experts"],
                "hybrid_admitted": c.get("hybrid_admitted", 0)}
    st = cache.stats()
    return {"tok_s": T / wall, "wall_s": wall, "hits": st["hits"], "misses": st["misses"],
            "hit_rate": st["hits"] / max(1, st["hits"] + st["misses"]),
            "prefetch_issued": st["prefetch_issued"], "inflight_hits": st["inflight_hits"],
            "stall_s": st["stall_s"], "bytes_copied": st["bytes_read"],
            "copy_gbps_over_wall": st["bytes_read"] / wall / 1e9, **counters}


# ---- all experts resident --------------------------------------------------------------------

def warm_all(torch: Any, cache: Any, device: int) -> int:
    """Load every expert of the store into ``cache`` (which needs a slot for each): prefetch
    all keys, wait for the worker and the copy stream, acquire and release each key on the
    current stream (torch's on a GPU, 0 in emulation; a key whose prefetch did not happen is
    loaded by that acquire), synchronize the device.  Returns the number of resident keys;
    RuntimeError unless every key is resident."""
    nl, ne = int(cache.store.num_layers), int(cache.store.num_experts)
    keys = list(range(nl * ne))
    if cache.capacity < len(keys):
        raise ValueError(f"warm_all: the cache has {cache.capacity} slots for {len(keys)} "
                         "experts")
    cache.begin_pass()
    cache.prefetch(keys)
    cache.wait_idle()
    for key in keys:
        layer, expert = divmod(key, ne)
        cache.acquire(layer, expert)
        cache.release(layer, expert)
    if device >= 0:
        torch.cuda.synchronize(device)
    resident = sorted(cache.resident())
    if resident != keys:
        raise RuntimeError(f"warm_all: {len(resident)} of {len(keys)} experts resident after "
                           "warming")
    return len(resident)


# ---- the cache's load path against raw pinned copies -----------------------------------------

def _raw_block_copier(torch: Any, n: int, block_bytes: int,
                      device: int) -> Callable[[], tuple[float, float]]:
    """A function timing n back-to-back pinned host-to-device copies of ``block_bytes`` each,
    from distinct parts of one pinned buffer into one device buffer: (seconds between CUDA
    events around them, wall seconds from the first enqueue to the end of the last copy)."""
    src = torch.empty(n * block_bytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(n * block_bytes, dtype=torch.uint8, device=torch.device("cuda", device))
    pairs = [(dst[i * block_bytes:(i + 1) * block_bytes],
              src[i * block_bytes:(i + 1) * block_bytes]) for i in range(n)]
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def once() -> tuple[float, float]:
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a.record()
        for d, s in pairs:
            d.copy_(s, non_blocking=True)
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3, time.perf_counter() - t0

    return once


def cache_load_once(torch: Any, cache: Any, keys: Sequence[int], device: int) -> dict:
    """Load ``keys`` (not resident) into ``cache`` through its own path and time it (wall):
    begin_pass, prefetch, wait_idle (queue empty, copy stream drained), acquire + release each
    key on the current stream (the stream waits on the slot's ready event), synchronize.
    Returns seconds and the deltas of the cache's counters over the call."""
    ne = int(cache.store.num_experts)
    s0 = cache.stats()
    cache.begin_pass()
    t0 = time.perf_counter()
    cache.prefetch(list(keys))
    cache.wait_idle()
    for key in keys:
        layer, expert = divmod(int(key), ne)
        cache.acquire(layer, expert)
        cache.release(layer, expert)
    if device >= 0:
        torch.cuda.synchronize(device)
    dt = time.perf_counter() - t0
    s1 = cache.stats()
    return {"s": dt, **{k: s1[k] - s0[k] for k in ("bytes_read", "misses", "hits",
                                                    "prefetch_issued", "prefetch_dropped")}}


def copy_path_bandwidth(torch: Any, cuda: Any, st: Any, device: int, blocks: int = 64,
                        repeats: int = 5) -> dict:
    """GB/s of the GPU cache's load path (:func:`cache_load_once` on a fresh host-mode cache
    of n = min(blocks, keys // 2) slots; each repeat loads the next of the disjoint groups of
    n keys, so LRU evicts the previous group and every copy happens) and, on a GPU
    (``device >= 0``), of n raw pinned copies of one block each (:func:`_raw_block_copier`),
    the two alternating; medians over ``repeats`` after one untimed round of each
    (``pinned_h2d_block_wall_gbps``: the raw copies timed like the cache's, by wall clock).  In
    emulation (``device < 0``) the raw side is None and the cache's side times memcpy."""
    nkeys = int(st.num_layers) * int(st.num_experts)
    if nkeys < 2:
        raise ValueError("copy_path_bandwidth needs a store of at least 2 experts")
    n = max(1, min(int(blocks), nkeys // 2))
    bb = int(st.block_bytes)
    groups = [list(range(g * n, (g + 1) * n)) for g in range(nkeys // n)]
    raw = _raw_block_copier(torch, n, bb, device) if device >= 0 else None
    cache_s: list[float] = []
    raw_s: list[float] = []
    raw_wall_s: list[float] = []
    bad: list[dict] = []
    with cuda.GpuExpertCache(st, n, "lru", device=device, mode="host") as cache:
        for r in range(repeats + 1):  # round 0 warms both paths up and is not counted
            t_raw = raw() if raw is not None else None
            got = cache_load_once(torch, cache, groups[r % len(groups)], device)
            if got["bytes_read"] != n * bb or got["misses"] or got["prefetch_issued"] != n:
                bad.append({"round": r, **{k: v for k, v in got.items() if k != "s"}})
            if r == 0:
                continue
            cache_s.append(got["s"])
            if t_raw is not None:
                raw_s.append(t_raw[0])
                raw_wall_s.append(t_raw[1])
    nbytes = n * bb
    out: dict[str, Any] = {
        "blocks": n, "block_bytes": bb, "repeats": repeats,
        "cache_copy_gbps": float(np.median([nbytes / s / 1e9 for s in cache_s])),
        "cache_copy_gbps_each": [nbytes / s / 1e9 for s in cache_s],
        "pinned_h2d_block_gbps": (float(np.median([nbytes / s / 1e9 for s in raw_s]))
                                  if raw_s else None),
        "pinned_h2d_block_gbps_each": [nbytes / s / 1e9 for s in raw_s],
        "pinned_h2d_block_wall_gbps": (float(np.median([nbytes / s / 1e9 for s in raw_wall_s]))
                                       if raw_wall_s else None),
        "all_copies_happened": not bad, "bad_rounds": bad}
    out["cache_copy_fraction_of_pinned"] = (out["cache_copy_gbps"] / out["pinned_h2d_block_gbps"]
                                            if out["pinned_h2d_block_gbps"] else None)
    return out


# ---- peer: accelerate's CPU offload of the experts -------------------------------------------

@functools.lru_cache(maxsize=None)
def _peer_classes(torch: Any) -> tuple[type, type, type]:
    """The peer's torch modules (defined here: torch is imported only when there is a GPU)."""
    nn = torch.nn

    class Expert(nn.Module):
        """One expert MLP: down(silu(gate(x)) * up(x)), bf16 ``nn.Linear`` without bias."""

        def __init__(self, w: dict) -> None:
            super().__init__()
            I, H = w["gate"].shape
            for name, (fan_in, fan_out) in (("gate", (H, I)), ("up", (H, I)), ("down", (I, H))):
                lin = nn.Linear(fan_in, fan_out, bias=False, device="meta", dtype=torch.bfloat16)
                if tuple(w[name].shape) != (fan_out, fan_in):
                    raise ValueError(f"expert tensor {name!r}: shape {tuple(w[name].shape)}, "
                                     f"expected {(fan_out, fan_in)}")
                lin.weight = nn.Parameter(w[name], requires_grad=False)
                setattr(self, name, lin)

        def forward(self, x: Any) -> Any:
            return self.down(nn.functional.silu(self.gate(x)) * self.up(x))

    class MoELayer(nn.Module):
        """The routed experts of one MoE layer: the given experts, weights 1/k, f32 sum, the
        output normalised as :func:`decode` does."""

        def __init__(self, experts: list) -> None:
            super().__init__()
            self.experts = nn.ModuleList(experts)

        def forward(self, x: Any, ids: tuple) -> Any:
            out = torch.zeros_like(x)
            xb = x.to(torch.bfloat16)
            for e in ids:
                out = out + self.experts[e](xb).float() * (1.0 / len(ids))
            return out / (out.norm() + 1e-6)

    class MoEStack(nn.Module):
        """Every MoE layer's routed experts; ``forward(x, ids)`` decodes one token with
        ``ids[l]`` the expert ids of layer l."""

        def __init__(self, layers: list) -> None:
            super().__init__()
            self.layers = nn.ModuleList(layers)

        def forward(self, x: Any, ids: tuple) -> Any:
            for layer, lids in zip(self.layers, ids):
                x = layer(x, lids)
            return x

    return Expert, MoELayer, MoEStack


def bf16_tensor(torch: Any, a: np.ndarray) -> Any:
    """A torch.bfloat16 CPU tensor sharing memory with uint16 bf16 bit patterns ``a``."""
    a = np.ascontiguousarray(a, dtype=np.uint16)
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)


def build_peer(torch: Any, st: Any) -> Any:
    """The peer model on the CPU: per layer of the store a module holding its experts as
    bf16 ``nn.Linear`` gate/up/down whose weights are the store's (read from it)."""
    names = {t["name"]: t["dtype"] for t in st.tensors}
    if names != {"gate": "BF16", "up": "BF16", "down": "BF16"}:
        raise ValueError(f"the peer needs a store of bf16 gate/up/down experts, got {names}")
    Expert, MoELayer, MoEStack = _peer_classes(torch)
    layers = []
    for layer in range(int(st.num_layers)):
        experts = []
        for e in range(int(st.num_experts)):
            t = st.read_expert(layer, e)
            experts.append(Expert({k: bf16_tensor(torch, t[k]) for k in ("gate", "up", "down")}))
        layers.append(MoELayer(experts))
    return MoEStack(layers)


def peer_weights_equal(torch: Any, model: Any, st: Any,
                       which: Sequence[tuple[int, int]]) -> bool:
    """Whether the (layer, expert) pairs ``which`` of ``model`` (before offloading) hold the
    store's bf16 weights bit for bit."""
    for layer, e in which:
        t = st.read_expert(layer, e)
        ex = model.layers[layer].experts[e]
        for k in ("gate", "up", "down"):
            w = getattr(ex, k).weight.detach().cpu().contiguous()
            if not np.array_equal(w.view(torch.int16).numpy().view(np.uint16), t[k]):
                return False
    return True


def offload_peer(torch: Any, model: Any, device: int) -> Any:
    """``accelerate.cpu_offload`` of the whole model, executing on CUDA ``device`` (the CPU
    when ``device < 0``): weights kept in host memory, copied in by accelerate's hooks at
    every call of a Linear."""
    import accelerate

    ex = torch.device("cuda", device) if device >= 0 else torch.device("cpu")
    return accelerate.cpu_offload(model, execution_device=ex)


def peer_decode(torch: Any, model: Any, ids: np.ndarray, x0: Any, device: int) -> dict:
    """Decode ``ids.shape[0]`` tokens (routing [T, L, k]) through ``model`` from ``x0``
    [1, H] f32; tok/s, wall seconds and the last hidden state ``out``."""
    T, L, _ = ids.shape
    routes = [tuple(tuple(int(e) for e in ids[t, layer]) for layer in range(L))
              for t in range(T)]
    x = x0
    if device >= 0:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        for r in routes:
            x = model(x, r)
    if device >= 0:
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    return {"tok_s": T / wall, "wall_s": wall, "out": x}


def _error(what: str, e: BaseException) -> dict:
    return {"error": f"{what}: {type(e).__name__}: {e}",
            "traceback": traceback.format_exc(limit=6).splitlines()[-12:]}


def run_peer(torch: Any, st: Any, ids: np.ndarray, device: int, tokens: int) -> dict:
    """The accelerate peer row: build, check one expert's weights, offload, one untimed
    token, then ``tokens`` timed tokens (the first of ``ids``).  Failures are recorded in
    the row (``error``, ``traceback``), never raised."""
    n = min(int(tokens), int(ids.shape[0]))
    row: dict[str, Any] = {"label": f"accelerate cpu_offload ({n} tokens timed)",
                           "peer": "accelerate.cpu_offload", "tokens": n,
                           "note": "experts as bf16 nn.Linear in host memory, copied to the "
                                   "device by accelerate's hooks at every call; the first "
                                   f"{n} tokens of the routing"}
    if n <= 0:
        row["error"] = "not run (--peer-tokens 0)"
        return row
    try:
        import accelerate
    except Exception as e:  # ImportError, or a broken install raising something else
        row.update(_error("accelerate cannot be imported", e))
        return row
    row["accelerate_version"] = str(getattr(accelerate, "__version__", "?"))
    model = None
    try:
        nl, ne = int(st.num_layers), int(st.num_experts)
        model = build_peer(torch, st)
        row["weights_equal_store"] = peer_weights_equal(torch, model, st,
                                                        [(0, 0), (nl - 1, ne - 1)])
        if not row["weights_equal_store"]:
            raise RuntimeError("the peer's weights differ from the store's")
        offload_peer(torch, model, device)
        H = int({t["name"]: t for t in st.tensors}["gate"]["shape"][1])  # gate is [I, H]
        ex = torch.device("cuda", device) if device >= 0 else torch.device("cpu")
        x0 = (torch.randn(1, H, generator=torch.Generator().manual_seed(2)) * 0.1).to(ex)
        peer_decode(torch, model, ids[:1], x0, device)  # warm-up (CUDA/cuBLAS init)
        got = peer_decode(torch, model, ids[:n], x0, device)
        per_token = ids.shape[1] * ids.shape[2] * int(st.expert_nbytes)
        row.update({"tok_s": got["tok_s"], "wall_s": got["wall_s"],
                    "weight_bytes_per_token": per_token,
                    "copy_gbps_over_wall": per_token * n / got["wall_s"] / 1e9})
    except Exception as e:
        row.update(_error("accelerate peer failed", e))
    finally:
        del model
        gc.collect()
        if device >= 0:
            torch.cuda.empty_cache()
    return row


def speedups(rows: Sequence[dict], peer: dict) -> dict:
    """tok/s of the specmoe 25% rows (no prefetch, oracle prefetch) over the peer's."""
    if not peer.get("tok_s"):
        return {"error": "no accelerate tok/s: " + str(peer.get("error", "not measured"))}
    out: dict[str, Any] = {}
    for r in rows:
        if abs(float(r.get("cache_fraction", -1)) - 0.25) < 1e-9 and r.get("tok_s"):
            out["oracle_prefetch" if r.get("prefetch") else "no_prefetch"] = (
                r["tok_s"] / peer["tok_s"])
    if not out:
        return {"error": "no specmoe 25% row (--fractions without 0.25)"}
    out["target"] = PEER_TARGET
    out["peer_tokens"] = peer.get("tokens")
    return out


def balancer_ratios(rows: Sequence[dict]) -> dict:
    """tok/s with the balancer over tok/s copying every miss, per cache fraction and prefetch
    setting (rows of the same fraction and prefetch)."""
    out: dict[str, float] = {}
    for r in rows:
        if not r.get("balance"):
            continue
        for c in rows:
            if (not c.get("balance") and c["cache_fraction"] == r["cache_fraction"]
                    and c["prefetch"] == r["prefetch"] and c.get("tok_s")):
                key = f"{int(round(r['cache_fraction'] * 100))}%" + \
                    (" + oracle prefetch" if r["prefetch"] else "")
                out[key] = r["tok_s"] / c["tok_s"]
    return out


def print_text(res: dict) -> None:
    """The human-readable summary of a result (what ``--json`` prints as one object)."""
    def fmt(v: Any, spec: str = ".1f") -> str:
        return "n/a" if v is None else format(v, spec)

    print(f"{res['shape']}: {res['layers']} layers x {res['experts']} experts, top-{res['top_k']}"
          f", expert {res['expert_mib']:.2f} MiB, {res['tokens']} tokens; {res['device']}")
    print(f"pinned H2D {fmt(res['pinned_h2d_gbps'])} GB/s (256 MiB copies); cache load path "
          f"{fmt(res.get('cache_copy_gbps'))} GB/s vs pinned block copies "
          f"{fmt(res.get('pinned_h2d_block_gbps'))} GB/s = "
          f"{fmt(res.get('cache_copy_fraction_of_pinned'), '.2f')} (target {COPY_TARGET})")
    if res.get("cache_copy", {}).get("error"):
        print(f"  cache copy measurement: {res['cache_copy']['error']}")
    for r in res["rows"]:
        line = (f"{r['label']:44s} {r['tok_s']:8.2f} tok/s  hit {r['hit_rate']:.2f}  "
                f"misses {r['misses']:5d}  {r['copy_gbps_over_wall']:.1f} GB/s over wall")
        if r.get("warm_error"):
            line += f"  WARM FAILED: {r['warm_error']}"
        print(line)
    for p in res.get("peer_rows", []):
        if p.get("tok_s"):
            print(f"{p['label']:44s} {p['tok_s']:8.2f} tok/s  "
                  f"{p['copy_gbps_over_wall']:.1f} GB/s over wall")
        else:
            print(f"{p['label']:44s} {p.get('error')}")
    print(f"specmoe 25% vs accelerate: {res.get('specmoe_25pct_vs_accelerate')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=4, help="MoE layers (the real model's: "
                    "48 Qwen3 / 32 Mixtral; host memory and disk bound this)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--fractions", default="0.1,0.25,0.5")
    ap.add_argument("--peer-tokens", type=int, default=8, help="tokens timed for the "
                    "accelerate peer (the first of the routing; 0: no peer)")
    ap.add_argument("--copy-blocks", type=int, default=64, help="expert blocks per "
                    "copy-path bandwidth measurement (at most half the experts)")
    ap.add_argument("--copy-repeats", type=int, default=5)
    ap.add_argument("--no-balance", action="store_true", help="leave out the rows with "
                    "MoE-SpAc's CPU/GPU balancer")
    ap.add_argument("--store", default=None, help="reuse/keep the store file here")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    t_start = time.perf_counter()

    from specmoe.runtime import cuda

    why = cuda.unusable_reason()
    if why:
        res = {"skipped": f"no usable GPU: {why}"}
        print(json.dumps(res) if a.json else res["skipped"])
        return
    import torch

    from specmoe.runtime import kernels
    from specmoe.storage.store import ExpertStore

    H, I, E, k, _ = SHAPES[a.shape]
    L = a.layers
    path = a.store or os.path.join(tempfile.mkdtemp(prefix="gpu_decode_"), "experts.smoe")
    t0 = time.perf_counter()
    if not os.path.exists(path):
        make_store(path, H, I, E, L)
    store_s = time.perf_counter() - t0
    res: dict = {"shape": a.shape, "H": H, "I": I, "experts": E, "top_k": k, "layers": L,
                 "tokens": a.tokens, "device": cuda.available()[1], "store_write_s": store_s,
                 "pinned_h2d_gbps": pinned_h2d_gbps(torch), "rows": []}
    ids = routing(np.random.default_rng(1), a.tokens, L, E, k)
    with ExpertStore(path) as st:
        spec = kernels.FFNSpec.from_store_schema(st.tensors, block_bytes=st.block_bytes)
        res["expert_mib"] = st.block_bytes / 2**20
        try:
            cp = copy_path_bandwidth(torch, cuda, st, 0, a.copy_blocks, a.copy_repeats)
        except Exception as e:
            cp = _error("copy-path measurement failed", e)
        for key in ("cache_copy_gbps", "pinned_h2d_block_gbps", "cache_copy_fraction_of_pinned"):
            res[key] = cp.get(key)
        res["cache_copy_target"] = COPY_TARGET
        res["cache_copy"] = cp
        fracs = [float(f) for f in a.fractions.split(",")] + [1.0]
        profile = None
        if not a.no_balance:
            try:  # the balancer's per-expert costs, measured once on this machine
                with cuda.GpuExpertCache(st, k, "lru", device=0, mode="host",
                                         top_k=k) as cache:
                    profile = cuda.measure_balance_profile(cache, spec)
                res["balance_profile"] = dataclasses.asdict(profile)
            except Exception as e:
                res["balance_profile"] = _error("balance profile failed", e)
        for f in fracs:
            modes = [(False, False)] if f == 1.0 else \
                [(pf, bal) for pf in (False, True) for bal in (False, True)
                 if not bal or profile is not None]
            for pf, bal in modes:
                # a fresh cache per row: every row starts from the same (empty) contents
                with cuda.GpuExpertCache(st, f, "lru", device=0, mode="host",
                                         top_k=k) as cache:
                    warm: dict[str, Any] = {}
                    if f == 1.0:
                        try:
                            warm["warmed_resident"] = warm_all(torch, cache, 0)
                        except Exception as e:
                            warm["warm_error"] = f"{type(e).__name__}: {e}"
                    prof = profile if bal else None
                    decode(torch, cuda, cache, spec, ids[:2], H, pf, prof)  # warm-up
                    row = {"cache_fraction": f, "prefetch": pf, "balance": bal,
                           "label": "all experts resident (upper bound)" if f == 1.0 else
                           f"specmoe {int(round(f * 100))}%" + (" + oracle prefetch" if pf
                                                                else "")
                           + (" + balancer" if bal else "")}
                    row.update(decode(torch, cuda, cache, spec, ids, H, pf, prof))
                    row["copy_fraction_of_pinned_bw"] = (row["copy_gbps_over_wall"]
                                                         / res["pinned_h2d_gbps"])
                    if f == 1.0:
                        row.update(warm)
                        row["all_resident_ok"] = row["misses"] == 0 and "warm_error" not in warm
                    res["rows"].append(row)
        peer = run_peer(torch, st, ids, 0, a.peer_tokens)
    res["peer_rows"] = [peer]
    res["specmoe_25pct_vs_accelerate"] = speedups(res["rows"], peer)
    res["balancer_vs_copy"] = balancer_ratios(res["rows"])
    res["elapsed_s"] = time.perf_counter() - t_start
    if a.json:
        print(json.dumps(res))
    else:
        print_text(res)


if __name__ == "__main__":
    main()
