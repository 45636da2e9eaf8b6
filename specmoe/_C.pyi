"""Type stubs for the specmoe._C extension.  One section per area, each between
`# --- <area> ---` and `# --- end <area> ---` so parallel changes merge cleanly."""
from __future__ import annotations

import os
from typing import Any, Optional, Union

import numpy as np
import numpy.typing as npt

class SpecmoeError(RuntimeError): ...
class StoreError(SpecmoeError): ...
class CacheError(SpecmoeError): ...
class PolicyError(SpecmoeError): ...

# --- store ---
def crc32c(data: Any, crc: int = 0) -> int:
    """CRC32C (Castagnoli) of a contiguous buffer, continuing from `crc`."""
def _crc32c_portable(data: Any, crc: int = 0) -> int:
    """CRC32C through the table path only (tests)."""

class Store:
    """Low-level reader of fixed-size expert blocks; see specmoe.ExpertStore."""
    def __init__(self, path: str | os.PathLike[str], data_offset: int, block_bytes: int,
                 num_layers: int, num_experts: int, crc: Any = None, direct: bool = False,
                 verify: bool = True) -> None: ...
    def read(self, layer: int, expert: int, out: Any = None) -> np.ndarray: ...
    def close(self) -> None: ...
    @property
    def path(self) -> str: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def data_offset(self) -> int: ...
    @property
    def direct(self) -> bool: ...
    @property
    def verify(self) -> bool: ...
    @property
    def bytes_read(self) -> int: ...
    @property
    def closed(self) -> bool: ...
# --- end store ---

# --- policy ---
POLICY_NAMES: str

class Policy:
    def __init__(self, name: str, nslots: int, num_layers: int, num_experts: int, *,
                 seed: Optional[int] = ..., order: Union[str, int, None] = ...,
                 future: Optional[npt.ArrayLike] = ..., pyobj: Any = ...,
                 levels: Optional[int] = ..., gamma: Optional[int] = ...,
                 model: Optional[npt.ArrayLike] = ..., up: Optional[int] = ...,
                 dn: Optional[int] = ..., tau: Optional[int] = ..., counts: bool = ...,
                 gate: bool = ...) -> None:
        """levels: spac/spac_ema utility levels K (1..255; 0/None = 4); gamma: spac's draft
        length (0..65536; None = 8), initial boundaries floor(gamma/2); both ignored by other
        policies.  model: nextuse only, NextUseModel.flat() (None: built-in temporal
        weights).  up, dn, tau, counts, gate: spac only, its ablations (fixed boundaries, a
        static threshold, the pass's count as the utility, prefetch not gated by tau; see
        specmoe.runtime.policies.SpAc)."""
    @property
    def name(self) -> str: ...
    @property
    def nslots(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def in_use(self) -> bool: ...

def replay(policy: Policy, keys: npt.ArrayLike,
           pass_starts: Union[int, npt.ArrayLike, None] = ..., *,
           mask_seed: int = ...,
           counts: Optional[tuple[npt.ArrayLike, npt.ArrayLike, npt.ArrayLike]] = ...,
           next_use: bool = ...) -> tuple[Any, ...]:
    """(hits uint8[n], victims int32[n]); with next_use=True (a nextuse policy) also q
    float64[num_layers*num_experts] in the final state.  counts=(keys, counts, offsets):
    on_counts(keys[o[j]:o[j+1]], ...) after on_pass(j+1)."""
# --- end policy ---

# --- cache ---
class Cache:
    """The fast tier over a Store: slots, pinning, loads, prefetch worker, counters.

    Public wrapper: specmoe.ExpertCache.  Keys are ``layer * num_experts + expert``.
    """
    def __init__(self, store: Store, nslots: int, policy: Any, *, min_slots: int = 1,
                 prefetch: bool = True) -> None: ...
    def acquire(self, layer: int, expert: int) -> np.ndarray:
        """Pin and return the block (read-only uint8 view; loads on a miss)."""
    def release(self, layer: int, expert: int) -> None: ...
    def begin_pass(self) -> int: ...
    def prefetch(self, keys: Any, priorities: Any, replace: bool = False) -> None: ...
    def cancel(self, key: int = -1) -> None: ...
    def wait_idle(self) -> None: ...
    def pause_prefetch(self, paused: bool) -> None: ...
    def queue_len(self) -> int: ...
    def take_prefetch_error(self) -> None:
        """Raise the first prefetch load error since the last call, if any."""
    def set_policy(self, policy: Any) -> None: ...
    def observe_counts(self, keys: npt.ArrayLike, counts: npt.ArrayLike) -> None:
        """Activation counts of one verification pass for the policy (no-op unless spac)."""
    def protect(self, keys: npt.ArrayLike) -> None: ...
    def utility(self, keys: npt.ArrayLike) -> npt.NDArray[np.int32]:
        """The policy's utility per key; PolicyError when the policy has none."""
    def resident(self) -> np.ndarray:
        """int32 keys of the READY slots, in slot order."""
    def stats(self) -> dict[str, int | float]: ...
    def reset_stats(self) -> None: ...
    def set_throttle(self, bytes_per_s: float, latency_s: float) -> None:
        """Emulate a slower link for every store read (SpecMD A.4); 0, 0: off."""
    def bench_hits(self, keys: Any, iters: int) -> float:
        """Seconds for iters rounds of acquire+release over keys, in one C loop."""
    def close(self) -> None: ...
    @property
    def nslots(self) -> int: ...
    @property
    def slot_bytes(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    @property
    def store(self) -> Store | None: ...
    @property
    def policy_name(self) -> str: ...
    @property
    def pass_id(self) -> int: ...
# --- end cache ---

# --- moe ---
class Layers:
    """The per-layer path of an offloaded model in one C call (csrc/layer.h)."""
    def __init__(self, cache: Any, kctx: Optional[Any], desc: dict[str, Any], routers: Any,
                 top_k: int, sigmoid: bool = False) -> None: ...
    def forward(self, pos: int, x: np.ndarray, idx: np.ndarray, w: np.ndarray, out: np.ndarray,
                used: np.ndarray, scores: Optional[np.ndarray] = None,
                replace: bool = True, draft: Optional[np.ndarray] = None) -> None: ...
    def configure(self, prefetch: bool, overfetch: float, mass: float,
                  feed_counts: bool) -> None: ...
    def set_miss(self, miss: str, keep: int, route_lambda: float, keep2: int = ...) -> None:
        """SpecMD miss handling (fetch, drop, substitute, lowest_bit, priority) and cache-aware
        routing."""
    def config(self) -> dict[str, Any]:
        """The settings configure(), set_miss() and set_predictor() set: prefetch, overfetch,
        mass, feed_counts, miss, miss_keep, miss_keep2, route_lambda, predictor."""
    def set_predictor(self, predictor: str, model: Optional[np.ndarray] = None) -> None:
        """Step 2's predictor without caller scores: 'router', 'learned' (the nextuse model's
        q; model = NextUseModel.flat()) or 'oracle' (a replay's next layer)."""
    def set_replay(self, experts: Optional[np.ndarray], start: int = 0) -> None:
        """forward_routed routes each token to int16 [tokens, layers, top_k] experts of a trace
        (router weights restricted to them); None: off."""
    def replay_position(self) -> tuple[int, int]:
        """(trace tokens replayed, tokens in the trace)."""
    def set_down_dtypes(self, codes: Optional[list[int]], /) -> None: ...
    def set_parallel(self, on: bool) -> None:
        """A layer's misses load on the prefetch worker while its resident experts compute."""
    def set_lowbit(self, buf: Any, desc: Optional[dict[str, Any]] = None,
                   block_bytes: int = 0) -> None: ...
    def counters(self, reset: bool = False) -> dict[str, int]: ...

def moe_forward(source: Any, kctx: Optional[Any], desc: dict[str, Any], block_bytes: int,
                layer: int, num_experts: int, x: np.ndarray, idx: np.ndarray, w: np.ndarray,
                out: np.ndarray, used: Optional[np.ndarray] = None) -> None:
    """One MoE layer in C (GIL released): out = sum_j w[:, j] * expert_{idx[:, j]}(x).
    source: a _C.Cache / ExpertCache, or a buffer of every block in store order; kctx: a
    KernelContext or None; desc: specmoe.kernels.FFNSpec.desc()."""
    ...
# --- end moe ---

# --- kernels ---
class KernelContext:
    """Persistent thread pool + ISA choice for the expert FFN kernels."""

    def __init__(self, threads: int = 0) -> None: ...
    @property
    def isa(self) -> str: ...
    @property
    def isa_max(self) -> str: ...
    @property
    def threads(self) -> int: ...
    @property
    def features(self) -> dict[str, bool]: ...
    def set_isa(self, name: str) -> None: ...
    def set_threads(self, n: int) -> None: ...
    def ffn_forward(self, desc: dict[str, Any], block: np.ndarray, x: np.ndarray,
                    out: np.ndarray, rows: np.ndarray | None = None,
                    scale: np.ndarray | None = None) -> None: ...
    def read_bw(self, buffer: np.ndarray, iters: int) -> float: ...
    def gated_delta(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                    beta: np.ndarray, state: np.ndarray, out: np.ndarray,
                    l2norm: bool) -> None: ...
    def scratch_bytes(self, desc: dict[str, Any], tokens: int) -> int: ...

class Linear:
    """A dense linear layer y = x W^T + b on the expert kernels (specmoe.dense.CLinear).
    desc keys: N, K, dtype (0 f32, 1 bf16, 2 int8, 3 int4), group, precise, and the byte
    offsets weight, weight_scale inside block; bias float32 [N] or None."""

    def __init__(self, ctx: KernelContext, desc: dict[str, Any], block: np.ndarray,
                 bias: np.ndarray | None = None) -> None: ...
    @property
    def shape(self) -> tuple[int, int]: ...
    def forward(self, x: np.ndarray, out: np.ndarray) -> None: ...

class AttnDecode:
    """Multi-head / grouped-query attention at decode sizes (specmoe.attention,
    csrc/kernels/attn.h); one object may serve every layer."""

    def __init__(self, ctx: KernelContext) -> None: ...
    def forward(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, bias: np.ndarray | None,
                out: np.ndarray, scale: float) -> None: ...

class AttnBlock:
    """One decoder layer's Llama-family attention module at decode sizes in two calls around
    the KV-cache update (specmoe.attention.fuse_attention, csrc/kernels/block.h): ``pre``
    runs the q/k/v projections (the given Linear objects), the q/k RMSNorm (``norm``:
    ``"none"``, ``"full"`` over all heads, ``"head"`` per head) and the rotary embedding;
    ``post`` the attention over the cache and the output projection.  ``qkv``: the q, k and v
    rows in one Linear, which ``pre`` then runs instead of the three.  ``bf16``: round every
    intermediate as a bf16 model does.  Qwen3-Next's and Qwen3.5's gated attention: ``gate``
    (q's rows per head are head_dim query rows then head_dim gate rows; the attention output is
    multiplied by sigmoid(gate) before ``o``; such a block runs ``layer`` only),
    ``rotary_dim`` (the rotary on a head's first rotary_dim values, cos and sin that wide; 0:
    head_dim), ``zero_centred`` (the q/k norms and the layer's norms scale by their weights
    given as 1 + the module's, in f32, rounded once; GPT-OSS's norms take the same form with
    their weights as they are).  GPT-OSS: ``sinks`` (float32 [heads], finite: a logit a head
    in every softmax's denominator, with no value).  ``rope``: ``"half"`` (rotate-half) or
    ``"pairs"`` (ERNIE-4.5: a head's pairs (x[2i], x[2i+1]) turned by angle i, read from the
    first rotary_dim / 2 values of cos and sin; f32 products, rounded once).  ``set_mlp``: a
    dense decoder layer's SiLU MLP, which ``layer(None, ...)`` runs in place of a MoE block
    (GLM-4.5's and ERNIE-4.5's dense layers)."""

    def __init__(self, ctx: KernelContext, q: Linear, k: Linear, v: Linear, o: Linear,
                 heads: int, kv_heads: int, head_dim: int, norm: str = "none",
                 q_norm: np.ndarray | None = None, k_norm: np.ndarray | None = None,
                 eps: float = 1e-6, bf16: bool = False, max_tokens: int = 16,
                 qkv: Linear | None = None, gate: bool = False, rotary_dim: int = 0,
                 zero_centred: bool = False, sinks: np.ndarray | None = None,
                 rope: str = "half") -> None: ...
    def pre(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, q: np.ndarray,
            k: np.ndarray, v: np.ndarray) -> None: ...
    def post(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, bias: np.ndarray | None,
             scale: float, out: np.ndarray) -> None: ...
    def layer(self, layers: Layers | None, pos: int, route_flags: int, x: np.ndarray,
              cos: np.ndarray, sin: np.ndarray, kbuf: np.ndarray, vbuf: np.ndarray, S: int,
              bias: np.ndarray | None, scale: float, ln1: np.ndarray, eps1: float,
              ln2: np.ndarray, eps2: float, out: np.ndarray) -> tuple[float, float, float]: ...
    def set_mlp(self, mlp: tuple[Linear, Linear, Linear] | None) -> None: ...

class GdnBlock:
    """A gated DeltaNet (linear attention) module of Qwen3.5 or Qwen3-Next for one decode token
    of up to ``max_rows`` sequences in one call (specmoe.models.linear_attn.fuse_gated_deltanet,
    csrc/gdn_block.c): the input projections (``inputs``: 1-4 Linear whose outputs side by side
    are q|k|v, z, b, a, or with ``order`` a permutation of them: ``y[j] = outputs[order[j]]``),
    the depthwise short convolution over each row's window, the gates (``decay`` =
    -exp(A_log), ``dt_bias``), the gated delta rule, the gated RMSNorm (``norm_weight``,
    ``eps``) and the output projection ``out``.  ``bf16``: round every intermediate as a bf16
    model does.  ``layer``: the whole decoder layer around it (norms, residual adds, the MoE
    block of a ``Layers`` routed in C) in the same call."""

    def __init__(self, ctx: KernelContext, inputs: tuple[Linear, ...], out: Linear,
                 conv_weight: np.ndarray, decay: np.ndarray, dt_bias: np.ndarray,
                 norm_weight: np.ndarray, k_heads: int, v_heads: int, k_dim: int, v_dim: int,
                 eps: float = 1e-6, bf16: bool = False, max_rows: int = 64,
                 conv_bias: np.ndarray | None = None,
                 order: np.ndarray | None = None) -> None: ...
    def step(self, x: np.ndarray, conv: np.ndarray, state: np.ndarray,
             out: np.ndarray) -> None: ...
    def layer(self, layers: Layers, pos: int, route_flags: int, x: np.ndarray,
              conv: np.ndarray, state: np.ndarray, ln1: np.ndarray, eps1: float,
              ln2: np.ndarray, eps2: float, zero_centred: bool,
              out: np.ndarray) -> tuple[float, float, float]: ...

class MLABlock:
    """A DeepSeek-V2/V3 decoder layer's MLA attention module at decode sizes in one call
    (specmoe.mla.fuse_mla): ``attn`` runs the input norm, the projections, kv_a_layernorm, the
    rotary (``rope``: ``"complex"``, freqs [T, rope_dim / 2, 2]; ``"half"`` / ``"interleave"``,
    freqs [T, 2, rope_dim] cos and sin), writes the new latent / rotary key into the cache buffers at ``S``, the
    absorbed attention (``mla``'s weights) and o_proj, the residual add and the post-attention
    norm; ``layer`` then also the MoE block of a ``Layers`` and the second add.  ``q`` is
    q_b_proj when ``q_a`` (q_a_proj, with ``q_a_norm``) is given; ``joint``: (q or q_a) | kv_a
    in one Linear.  ``bf16``: round every intermediate as a bf16 model does."""

    def __init__(self, ctx: KernelContext, mla: MLADecode, q: Linear, kv_a: Linear, o: Linear,
                 kv_norm: np.ndarray, kv_eps: float, q_a: Linear | None = None,
                 q_a_norm: np.ndarray | None = None, q_a_eps: float = 1e-6,
                 joint: Linear | None = None, bf16: bool = False,
                 max_tokens: int = 16, rope: str = "complex") -> None: ...
    def attn(self, x: np.ndarray, freqs: np.ndarray, cbuf: np.ndarray, kbuf: np.ndarray,
             S: int, bias: np.ndarray | None, ln1: np.ndarray, eps1: float, ln2: np.ndarray,
             eps2: float, out: np.ndarray, normed: np.ndarray) -> None: ...
    def layer(self, layers: Layers, pos: int, route_flags: int, x: np.ndarray,
              freqs: np.ndarray, cbuf: np.ndarray, kbuf: np.ndarray, S: int,
              bias: np.ndarray | None, ln1: np.ndarray, eps1: float, ln2: np.ndarray,
              eps2: float, out: np.ndarray) -> tuple[float, float]: ...

def layer_chain(calls: tuple[tuple[AttnBlock | MLABlock | GdnBlock, tuple[Any, ...]], ...]
                ) -> tuple[float, float, float]:
    """Decoder layers one after another with the GIL released once (specmoe.decode_step):
    each call is (block, the arguments of its ``layer`` method); all are checked before any
    runs; returns the seconds in their attention parts, MoE blocks and dense MLPs, summed.
    At most 128."""

class DecodePlan:
    """A one-token decode step of a whole model in one call (specmoe.decode_step): the
    embedding row of the token, the rotary rows of position S (``rows``: (table [P, ...],
    row) pairs), the layer calls (``layer_chain``'s items, checked once, no attention bias;
    their S is step()'s), the final RMSNorm (``norm``: rms_norm's (x, w, eps, out, bf16)
    over [1, n]) and the head (``head``: a Linear and its input [1, K]).  The arrays are
    referenced and read/written in place."""

    def __init__(self,
                 calls: tuple[tuple[AttnBlock | MLABlock | GdnBlock, tuple[Any, ...]], ...],
                 rows: tuple[tuple[np.ndarray, np.ndarray], ...] | None = None,
                 embed: tuple[np.ndarray, np.ndarray] | None = None,
                 norm: tuple[np.ndarray, np.ndarray, float, np.ndarray, bool] | None = None,
                 head: tuple[Linear, np.ndarray] | None = None) -> None: ...
    def step(self, token: int, S: int, logits: np.ndarray | None
             ) -> tuple[float, float, float, float]:
        """One step at S cached positions, logits [1, vocab] f32/bf16 bits (None without a
        head); everything checked before anything runs; GIL released once.  Returns the
        seconds in attention, MoE blocks, dense MLPs, and the final norm and head."""

class MLADecode:
    """Multi-head latent attention in the absorbed form (specmoe.mla, csrc/kernels/attn.h).
    w_uk [H, dn, r] and w_uv [H, dv, r]: float32, bf16 bits (uint16/int16), int8 (scales
    float32 [H, rows]) or int4 as one int8 value in [-8, 7] a byte (specmoe.mla.int4_values;
    scales float32 [H, rows, r / group]); or, with ``blocks`` = (W_UK's, W_UV's GGUF block
    dtype code, specmoe.runtime.kernels.dtype_code), a GGUF file's attn_k_b as uint8 [H, r,
    bytes a row] and attn_v_b as uint8 [H, dv, bytes a row], read by the block kernels' rows;
    C-contiguous, kept referenced."""

    def __init__(self, ctx: KernelContext, w_uk: np.ndarray, w_uv: np.ndarray, rope_dim: int,
                 scale: float, uk_scale: np.ndarray | None = None,
                 uv_scale: np.ndarray | None = None,
                 blocks: tuple[int, int] | None = None) -> None: ...
    @property
    def shape(self) -> dict[str, Any]: ...
    def forward(self, q_nope: np.ndarray, q_pe: np.ndarray, ckv: np.ndarray, kpe: np.ndarray,
                bias: np.ndarray | None, out: np.ndarray) -> None: ...
# --- end kernels ---

# --- spec ---
class SpecController:
    """A speculation controller ("static", "heuristic", "cascade", "speq"); see
    csrc/spec/controller.h.  Numeric parameters: 0 means the default."""
    def __init__(self, name: str, *, k_max: int = 0, k: int = 0, initial: int = 0,
                 trials: int = 0, trial_len: int = 0, set_len: int = 0, backoff_max: int = 0,
                 base_len: int = 0, base_refresh: int = 0, alpha: float = 0.0,
                 p_init: float = 0.0, telemetry_cap: int = 0, probe: int = 0,
                 trial_pool: int = 0, converge: float = 0.0, t_first: float = 0.0,
                 budget: float = 0.0) -> None: ...
    def begin_request(self) -> None: ...
    def next_k(self) -> int: ...
    def observe(self, k: int, accepted: int, t_iter: float, experts_loaded: int = 0,
                t_draft: float = 0.0, t_io: float = 0.0, rows_k: Optional[np.ndarray] = None,
                rows_accepted: Optional[np.ndarray] = None) -> None: ...
    def set_success(self, on: bool, min_obs: int = 4, probe: int = 64) -> None: ...
    def set_batch(self, batch: int) -> None: ...
    def success_model(self) -> tuple[list[float], list[float], float, int, int]: ...
    def set_tau(self, tau: Any) -> None: ...
    def set_io_cost(self, cost: Any) -> None: ...
    def telemetry(self) -> dict[str, np.ndarray]: ...
    def speq_model(self, k: int) -> tuple[float, float]: ...
    def speq_parts(self, k: int) -> tuple[float, float, float, float]: ...
    @property
    def name(self) -> str: ...
    @property
    def k_max(self) -> int: ...
    @property
    def phase(self) -> int: ...
    @property
    def base(self) -> float: ...
    @property
    def n_obs(self) -> int: ...
    @property
    def allowed(self) -> list[int]: ...
    @property
    def spent(self) -> tuple[float, float]: ...

class NgramDrafter:
    """Prompt-lookup n-gram drafter; see csrc/spec/ngram.h."""
    def __init__(self, max_n: int = 3, min_n: int = 1) -> None: ...
    def append(self, tokens: Any) -> None: ...
    def reset(self) -> None: ...
    def propose(self, history: Any, k: int) -> list[int]: ...
    @property
    def length(self) -> int: ...
    @property
    def max_n(self) -> int: ...
    @property
    def min_n(self) -> int: ...

def spec_accept(p: np.ndarray, draft: Any, q: Optional[np.ndarray] = None,
                u: Optional[np.ndarray] = None, *, check: bool = True) -> tuple[int, int]:
    """(n_accepted, next_token) of one speculative iteration; p float32 [K+1, V], draft K
    integer ids, q float32 [K, V] or None (one-hot proposals), u float64 [K+1, 2] in [0, 1) or
    None (greedy); check=False skips the scan of p's and q's entries.  See
    csrc/spec/verify.h and specmoe.spec.accept."""
# --- end spec ---

# --- sim ---
def simulate(experts: np.ndarray, num_experts: int, policy: Any, nslots: int, *,
             logits: np.ndarray | None = None, predictor: int = 0, depth: int = 1, topk: int = 0,
             percentile: float = 0.0, history: int = 16, cooc_weight: float = 0.8,
             expert_bytes: float, fast_bw: float, link_bw: float, link_latency_s: float,
             layer_fixed_s: float = 0.0, token_fixed_s: float = 0.0, seed: int = 0,
             order: int = 0, levels: int = 0, verify_tokens: int = 1, miss: int = 0,
             miss_keep: int = 0, lowbit_ratio: float = 1.0,
             gamma: int = -1, miss_keep2: int = ..., lowbit2_ratio: float = 1.0,
             protect: bool = False) -> dict[str, float]:
    """Replay a routing trace through the simulated cache; see specmoe.sim.replay.simulate."""
# --- end sim ---
