"""Multi-token prediction with gated LoRA: the drafter of the gamma-tolerance paper (section 4.3,
after Samragh et al. 2025), on the target model itself.

The target's attention projections get LoRA adapters whose path is *gated per position*
(Y = XW + (g * X) A B^T, g = 0 on real tokens, 1 on mask tokens), and k learned mask
embeddings m_1..m_k.  One forward of the target over

    anchors a_0 .. a_K  (the pending token and the K drafts of the last step), then
    k masks after each anchor  (group i: m_1..m_k at positions p_i + 1 .. p_i + k)

verifies the K drafts (the anchors see only the context and the earlier anchors, through the
base weights only: their logits are the unmodified model's, bit for bit) and proposes the next
drafts: mask j after anchor i predicts the token at offset j + 1 from it (the anchor's own
logits give offset 1), so once n drafts are accepted, group n's masks are the next step's k
drafts after the bonus token (paper, section 4.3: "the masks following the last accepted anchor
simultaneously provide the next-step drafts").  The paper interleaves each anchor with its
masks; we put all anchors first and the masks after them, with an attention mask that gives the
same visibility, so that cropping the KV cache back to the accepted prefix (what every other
drafter does) drops the masks and the rejected anchors together.  The input has (K+1)(k+1)
positions, as in the paper.

Not implemented from Samragh et al.: the sampler head (a small MLP conditioning each mask's
prediction on the previous draft token) and the latent consistency loss; the adapters are
trained by self-distillation (``training/mtp.py``).

The adapter installs on any causal LM whose attention projections are found by name (default
``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` inside ``self_attn`` modules, and multi-head
latent attention's ``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``: the projections both its
expanded and its absorbed forms call; ``kv_b_proj`` is read as a weight by the absorbed form,
so it is left out), ``nn.Linear`` or
specmoe's C dense modules (:mod:`specmoe.models.dense`).  With no gate set (every forward other than
an MTP step: prefill, plain decoding, other drafters) the model is exactly the base model.

    from specmoe import zoo
    from specmoe.speculation import mtp
    model = zoo.load("tiny-moe")
    drafter = mtp.MtpDrafter(model, mtp.MtpAdapter.load(zoo.path("tiny-moe-mtp")))
    out = specmoe.generate(model, ids, drafter=drafter)
"""
from __future__ import annotations

import contextlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..models.layers import mark_adapter_gate
from .decoding import Draft, cache_kwargs, crop_kv
from .sampling import Sampling

__all__ = ["MtpConfig", "MtpAdapter", "GatedLoRA", "MtpDrafter", "mtp_layout", "next_drafts",
           "priming",
           "ADAPTER_FILE", "CONFIG_FILE"]

ADAPTER_FILE = "mtp_adapter.safetensors"
CONFIG_FILE = "mtp_config.json"
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj",
                   "kv_a_proj_with_mqa")


@dataclass
class MtpConfig:
    """What an adapter is: ``k`` masks per anchor, LoRA ``rank`` and ``alpha`` (the LoRA path is
    scaled by alpha / rank), the projection names it adapts (inside ``parent`` modules), and
    the base model it was trained for (checked on install)."""

    k: int = 3
    rank: int = 16
    alpha: float = 32.0
    targets: Tuple[str, ...] = DEFAULT_TARGETS
    parent: str = "self_attn"
    base_model_type: str = ""
    base_hidden_size: int = 0
    base_vocab_size: int = 0
    base_num_layers: int = 0
    extra: Dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        for name in ("k", "rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MtpConfig.{name} must be an int >= 1, got {v!r}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha)
                and self.alpha > 0):
            raise ValueError(f"MtpConfig.alpha must be a finite number > 0, got {self.alpha!r}")
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise ValueError(f"MtpConfig.targets must be non-empty names, got {self.targets!r}")


class _Gate:
    """The gate g shared by one model's adapters: ``index`` = the positions (along the
    sequence dimension) where g = 1, or None (g = 0 everywhere: the base model)."""

    def __init__(self) -> None:
        self.index: Optional[torch.Tensor] = None


class GatedLoRA(nn.Module):
    """``base(x)`` plus, at the gated positions only, ``(x A) B^T * alpha / rank``.

    The other positions' outputs are ``base(x)`` untouched (an ``index_add`` on the gated rows),
    so real tokens are bit-identical with the adapter on.  B starts at zero (the adapter starts
    as the identity), A at a scaled normal."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, gate: _Gate) -> None:
        super().__init__()
        fin = getattr(base, "in_features", None)
        fout = getattr(base, "out_features", None)
        if not isinstance(fin, int) or not isinstance(fout, int):
            raise TypeError(f"GatedLoRA wraps a linear layer with in_features/out_features, got "
                            f"{type(base).__name__}")
        self.base = base
        self.in_features, self.out_features = fin, fout
        self.rank, self.scale = int(rank), float(alpha) / int(rank)
        self.lora_a = nn.Parameter(torch.randn(fin, rank) / math.sqrt(fin))
        self.lora_b = nn.Parameter(torch.zeros(fout, rank))
        self._gate = gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        idx = self._gate.index
        if idx is None:
            return y
        xs = x.index_select(-2, idx).to(self.lora_a.dtype)
        delta = (xs @ self.lora_a) @ self.lora_b.t() * self.scale
        return y.index_add(-2, idx, delta.to(y.dtype))

    def extra_repr(self) -> str:
        return f"rank={self.rank}, scale={self.scale:g}"


def _find_targets(model: nn.Module, cfg: MtpConfig) -> List[Tuple[nn.Module, str, str]]:
    """(parent module, attribute, qualified name) of every projection to adapt, in module order."""
    out = []
    for pname, mod in model.named_modules():
        if pname.split(".")[-1] != cfg.parent:
            continue
        for t in cfg.targets:
            child = getattr(mod, t, None)
            if child is not None:
                out.append((mod, t, f"{pname}.{t}"))
    return out


class MtpAdapter(nn.Module):
    """The trainable part: k mask embeddings and one :class:`GatedLoRA` (A, B) per adapted
    projection.  :meth:`install` puts the LoRA modules into a model (once per model),
    :meth:`save`/:meth:`load` write/read ``mtp_config.json`` and ``mtp_adapter.safetensors``."""

    def __init__(self, cfg: MtpConfig, hidden_size: int) -> None:
        super().__init__()
        cfg.check()
        self.cfg = cfg
        self.mask_emb = nn.Parameter(torch.zeros(cfg.k, int(hidden_size)))
        self.gate = _Gate()
        # LoRA modules by qualified projection name ("." -> "__"); each holds its base layer
        # once installed.  Adapter parameters stay float32 whatever the model's dtype.
        self._lora_modules = nn.ModuleDict()
        object.__setattr__(self, "model", None)  # not a submodule: the model owns the adapter

    # -------------------------------------------------------------------------- build

    @classmethod
    def for_model(cls, model: nn.Module, k: int = 3, rank: int = 16, alpha: float = 32.0,
                  targets: Sequence[str] = DEFAULT_TARGETS, seed: int = 0) -> "MtpAdapter":
        """A fresh adapter for ``model`` (B = 0, so the masks' path starts as the base model's;
        mask embeddings start at the mean input embedding), installed on it."""
        c = model.config
        cfg = MtpConfig(k=k, rank=rank, alpha=float(alpha), targets=tuple(targets),
                        base_model_type=str(c.model_type), base_hidden_size=int(c.hidden_size),
                        base_vocab_size=int(c.vocab_size),
                        base_num_layers=int(c.num_hidden_layers))
        ad = cls(cfg, int(c.hidden_size))
        with torch.no_grad():
            emb = model.get_input_embeddings().weight.float()
            ad.mask_emb.copy_(emb.mean(0, keepdim=True).expand(k, -1))
        g = torch.Generator().manual_seed(seed)
        ad.install(model, generator=g)
        return ad

    def install(self, model: nn.Module, generator: Optional[torch.Generator] = None) -> None:
        """Wrap the model's target projections with this adapter's gated LoRA modules (created
        on first install; parameters kept).  Raises ValueError if the model does not match the
        adapter's base model, has no such projections, or carries another adapter."""
        c = model.config
        want = {"model_type": self.cfg.base_model_type, "hidden_size": self.cfg.base_hidden_size,
                "vocab_size": self.cfg.base_vocab_size,
                "num_hidden_layers": self.cfg.base_num_layers}
        for key, v in want.items():
            have = getattr(c, key, None)
            if v not in ("", 0) and have != v:
                raise ValueError(f"MTP adapter was trained for {key}={v!r}, the model has "
                                 f"{have!r}")
        if self.model is model:
            return
        if self.model is not None:
            raise ValueError("this MTP adapter is installed on another model already")
        if getattr(model, "_specmoe_mtp", None) is not None:
            raise ValueError("the model carries another MTP adapter already")
        found = _find_targets(model, self.cfg)
        if not found:
            raise ValueError(f"no {'/'.join(self.cfg.targets)} projections inside "
                             f"'{self.cfg.parent}' modules of {type(model).__name__}")
        fresh = not len(self._lora_modules)
        for parent, attr, name in found:
            base = getattr(parent, attr)
            if isinstance(base, GatedLoRA):
                raise ValueError(f"{name} is wrapped by another gated LoRA already")
            key = name.replace(".", "__")
            if fresh:
                mod = GatedLoRA(base, self.cfg.rank, self.cfg.alpha, self.gate)
                if generator is not None:
                    with torch.no_grad():
                        mod.lora_a.copy_(torch.randn(mod.lora_a.shape, generator=generator)
                                         / math.sqrt(mod.in_features))
                self._lora_modules[key] = mod
            else:
                if key not in self._lora_modules:
                    raise ValueError(f"MTP adapter has no LoRA for {name} (trained on another "
                                     "architecture?)")
                mod = self._lora_modules[key]
                if (mod.in_features, mod.out_features) != (base.in_features, base.out_features):
                    raise ValueError(f"{name}: adapter shape {mod.in_features}->"
                                     f"{mod.out_features}, model {base.in_features}->"
                                     f"{base.out_features}")
                mod.base = base
        if not fresh and len(found) != len(self._lora_modules):
            raise ValueError(f"MTP adapter holds {len(self._lora_modules)} LoRA modules, the "
                             f"model has {len(found)} target projections")
        for parent, attr, name in found:
            setattr(parent, attr, self._lora_modules[name.replace(".", "__")])
            # the fused C blocks step aside while the gate is set (models.layers.adapter_active)
            mark_adapter_gate(parent, self.gate)
        object.__setattr__(model, "_specmoe_mtp", self)
        object.__setattr__(self, "model", model)

    def uninstall(self) -> None:
        """Put the model's original projections back."""
        if self.model is None:
            return
        for parent, attr, name in _find_targets(self.model, self.cfg):
            m = getattr(parent, attr)
            if isinstance(m, GatedLoRA):
                setattr(parent, attr, m.base)
            mark_adapter_gate(parent, None)
        object.__setattr__(self.model, "_specmoe_mtp", None)
        object.__setattr__(self, "model", None)

    def trainable(self) -> List[nn.Parameter]:
        """The adapter's own parameters (mask embeddings, A and B of every LoRA)."""
        ps = [self.mask_emb]
        for m in self._lora_modules.values():
            ps += [m.lora_a, m.lora_b]
        return ps

    # -------------------------------------------------------------------------- files

    def state(self) -> Dict[str, torch.Tensor]:
        st = {"mask_emb": self.mask_emb.detach().float().contiguous()}
        for key, m in self._lora_modules.items():
            st[f"{key}.lora_a"] = m.lora_a.detach().float().contiguous()
            st[f"{key}.lora_b"] = m.lora_b.detach().float().contiguous()
        return st

    def save(self, path: Union[str, Path]) -> Path:
        """Write ``mtp_config.json`` and ``mtp_adapter.safetensors`` (float32) into ``path``."""
        from safetensors.torch import save_file
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        cfg = asdict(self.cfg)
        cfg["targets"] = list(cfg["targets"])
        (p / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(self.state(), str(p / ADAPTER_FILE), metadata={"format": "specmoe-mtp-1"})
        return p

    @classmethod
    def load(cls, path: Union[str, Path], model: Optional[nn.Module] = None) -> "MtpAdapter":
        """Read an adapter folder; with ``model``, install it there.  Raises FileNotFoundError
        or ValueError (bad config, missing or misshapen tensors) with the file named."""
        from safetensors.torch import load_file
        p = Path(path)
        cf, wf = p / CONFIG_FILE, p / ADAPTER_FILE
        for f in (cf, wf):
            if not f.is_file():
                raise FileNotFoundError(f"MTP adapter: {f} not found")
        try:
            raw = json.loads(cf.read_text())
            raw["targets"] = tuple(raw.get("targets", DEFAULT_TARGETS))
            cfg = MtpConfig(**raw)
            cfg.check()
        except (ValueError, TypeError) as e:
            raise ValueError(f"MTP adapter: bad {cf}: {e}") from None
        try:
            st = load_file(str(wf))
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"MTP adapter: cannot read {wf}: {e}") from None
        me = st.get("mask_emb")
        if me is None or me.dim() != 2 or me.shape[0] != cfg.k:
            raise ValueError(f"MTP adapter: {wf} needs mask_emb [{cfg.k}, hidden]")
        ad = cls(cfg, int(me.shape[1]))
        with torch.no_grad():
            ad.mask_emb.copy_(me)
        keys = sorted({k.rsplit(".", 1)[0] for k in st if k != "mask_emb"})
        for key in keys:
            a, b = st.get(f"{key}.lora_a"), st.get(f"{key}.lora_b")
            if a is None or b is None or a.dim() != 2 or b.dim() != 2 \
                    or a.shape[1] != cfg.rank or b.shape[1] != cfg.rank:
                raise ValueError(f"MTP adapter: {wf}: {key} needs lora_a [in, {cfg.rank}] and "
                                 f"lora_b [out, {cfg.rank}]")
            mod = GatedLoRA(_Shape(int(a.shape[0]), int(b.shape[0])), cfg.rank, cfg.alpha,
                            ad.gate)
            with torch.no_grad():
                mod.lora_a.copy_(a)
                mod.lora_b.copy_(b)
            ad._lora_modules[key] = mod
        if not keys:
            raise ValueError(f"MTP adapter: {wf} holds no LoRA tensors")
        if model is not None:
            ad.install(model)
        return ad

    # -------------------------------------------------------------------------- forward

    def forward_mtp(self, model: nn.Module, anchors: torch.Tensor, n_masks: int,
                    past: int = 0, kv: Any = None,
                    layout: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                    fetch_masks: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
        """One MTP forward: ``anchors`` [B, A] token ids after ``past`` cached positions, with
        ``n_masks`` (<= k) masks after each anchor.  Returns (anchor logits [B, A, V], mask
        logits [B, A, n_masks, V]); the KV cache (if any) then holds past + A + A*n_masks
        positions -- crop it to drop the masks.  ``layout``: (position ids [B, q], additive
        bias [B, 1, q, past + q]) instead of :func:`mtp_layout`'s (a batch with holes builds
        its own).  ``fetch_masks=False`` on an offloaded model: the masks are the Engine's
        draft tokens (:meth:`specmoe.runtime.engine.Engine.draft_tokens`), whose missing experts never
        load.  Gradients flow when called under grad mode (training)."""
        if self.model is not model:
            raise ValueError("forward_mtp: the adapter is not installed on this model")
        B, A = anchors.shape
        m = int(n_masks)
        if not 0 <= m <= self.cfg.k:
            raise ValueError(f"n_masks must be in [0, {self.cfg.k}], got {n_masks}")
        table = model.get_input_embeddings()
        dev = table.weight.device  # the ids, positions and bias go where the model runs
        emb = table(anchors.to(dev))
        if layout is None:
            pos, bias = mtp_layout(A, m, past, emb.dtype)
            pos, bias = pos.unsqueeze(0).expand(B, -1), bias.expand(B, 1, -1, -1)
        else:
            pos, bias = layout
        pos, bias = pos.to(dev), bias.to(dev)
        if m:
            me = self.mask_emb[:m].to(emb.dtype)
            masks = me.unsqueeze(0).expand(A, m, -1).reshape(1, A * m, -1).expand(B, -1, -1)
            x = torch.cat([emb, masks], 1)
        else:
            x = emb
        self.gate.index = torch.arange(A, A + A * m, device=dev) if m else None
        engine = None
        if m and not fetch_masks:
            from ..runtime.experts import find_engine
            engine = find_engine(model)
        drafts = contextlib.nullcontext()
        if engine is not None:
            flags = torch.zeros((B, A + A * m), dtype=torch.uint8)
            flags[:, A:] = 1
            drafts = engine.draft_tokens(flags.numpy())
        try:
            with drafts:
                out = model(inputs_embeds=x, position_ids=pos, attention_mask=bias,
                            use_cache=kv is not None, **cache_kwargs(model, kv))
        finally:
            self.gate.index = None
        lg = out.logits
        return lg[:, :A], lg[:, A:].reshape(B, A, m, lg.shape[-1])


class _Shape(nn.Module):
    """Placeholder base of a loaded LoRA module until it is installed on a model."""

    def __init__(self, fin: int, fout: int) -> None:
        super().__init__()
        self.in_features, self.out_features = fin, fout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("MTP adapter is not installed on a model")


def mtp_layout(n_anchors: int, n_masks: int, past: int = 0,
               dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """Position ids [A + A*m] and the additive attention bias [1, 1, A + A*m, past + A + A*m]
    of one MTP input: anchors first (positions past + i, causal among themselves), then mask j
    (1-based) of anchor i at position past + i + j, which sees the context, anchors 0..i and
    masks 1..j of its own group.  Anchors never see masks.  0 = attend, finfo.min = masked."""
    A, m = int(n_anchors), int(n_masks)
    q = A + A * m
    pos = torch.empty(q, dtype=torch.long)
    allow = torch.zeros((q, past + q), dtype=torch.bool)
    allow[:, :past] = True
    for i in range(A):
        pos[i] = past + i
        allow[i, past:past + i + 1] = True
        for j in range(1, m + 1):
            r = A + i * m + (j - 1)
            pos[r] = past + i + j
            allow[r, past:past + i + 1] = True
            allow[r, past + A + i * m:past + A + i * m + j] = True
    bias = torch.zeros((q, past + q), dtype=dtype)
    bias.masked_fill_(~allow, torch.finfo(dtype).min)
    return pos, bias.view(1, 1, q, past + q)


class MtpDrafter:
    """The MTP drafter for :func:`specmoe.generate`: drafting and verification in one forward
    of the target (see the module docstring).

    ``generate`` calls :meth:`verify` instead of a plain forward of the target, then
    :meth:`advance` with the accepted count; :meth:`propose` returns the drafts the last step's
    masks made for the current history (none before the first step, or when the last step had
    no masks because the controller chose K = 0).  K is at most the adapter's k.

    Args:
        model: the target (offloaded or not); the adapter is installed on it.
        adapter: an :class:`MtpAdapter` or the path of an adapter folder.
        fetch_masks: on an offloaded model, whether the masks may load the experts they route
            to.  False (default): the masks are draft tokens
            (:meth:`specmoe.runtime.engine.Engine.draft_tokens`): a missing expert is computed from the
            low-bit copy when the engine has one, else skipped, so drafting adds no expert
            traffic; the anchors (verification) are unaffected.  True: the masks load like any
            token.
    """

    def __init__(self, model: nn.Module, adapter: Union[MtpAdapter, str, Path], *,
                 fetch_masks: bool = False) -> None:
        if not isinstance(model, nn.Module) or not hasattr(model, "config"):
            raise TypeError("MtpDrafter needs a transformers causal LM")
        if not isinstance(adapter, MtpAdapter):
            adapter = MtpAdapter.load(adapter)
        if not isinstance(fetch_masks, bool):
            raise TypeError(f"fetch_masks must be a bool, got {type(fetch_masks).__name__}")
        adapter.install(model)
        self.model, self.adapter = model, adapter
        self.k = adapter.cfg.k
        self.fetch_masks = fetch_masks
        self._mask_logits: Optional[torch.Tensor] = None   # [A, m, V] of the last verify
        self._drafts: List[int] = []
        self._probs: Optional[torch.Tensor] = None
        self._for: Optional[Tuple[int, int]] = None         # (len(history), last token)

    def reset(self) -> None:
        self._mask_logits, self._drafts, self._probs, self._for = None, [], None, None

    def tau_tokens(self, g_max: int) -> int:
        """Tokens per sequence of the largest MTP forward for anchors up to ``g_max``."""
        return int(g_max) * (self.k + 1)

    def tau(self, table: Dict[int, float], g_max: int) -> Dict[int, float]:
        """The gamma-tolerance table the controllers should see with this drafter: verifying
        g - 1 drafts runs g anchors *and* their g*k masks, so tau'(g) = T(1) / T(g(k+1)) =
        table[g(k+1)] (drafting costs nothing extra: it is in that forward, delta ~ 0);
        tau'(1) = 1, a K = 0 step runs no masks.  ``table``: the target's tau(g) measured up to
        :meth:`tau_tokens` (g_max) tokens."""
        out = {1: 1.0}
        for g in range(2, int(g_max) + 1):
            n = g * (self.k + 1)
            if n not in table:
                raise ValueError(f"MtpDrafter.tau: the table stops at g = {max(table)}, "
                                 f"{n} needed")
            out[g] = float(table[n])
        return out

    def propose(self, history: Sequence[int], k: int) -> List[int]:
        """The drafts made for ``history`` by the last step (at most k; [] if none)."""
        return self.draft(history, k).tokens

    def draft(self, history: Sequence[int], k: int, sampling: Optional[Sampling] = None,
              generator: Optional[torch.Generator] = None) -> Any:
        h = list(history)
        if k <= 0 or not h or self._for != (len(h), int(h[-1])) or not self._drafts:
            return Draft([])
        n = min(int(k), len(self._drafts))
        probs = None if self._probs is None else self._probs[:n]
        return Draft(self._drafts[:n], probs)

    def verify(self, kv: Any, past: int, anchors: Sequence[int], n_masks: int) -> torch.Tensor:
        """The target's logits [len(anchors), V] for the anchors (bit-identical to a plain
        forward over the same positions with the same masks absent from their view), with
        ``n_masks`` masks after each; the masks' KV entries are cropped before returning."""
        a = torch.tensor([list(anchors)], dtype=torch.long)
        with torch.no_grad():
            lg, ml = self.adapter.forward_mtp(self.model, a, n_masks, past=past, kv=kv,
                                              fetch_masks=self.fetch_masks)
        crop_kv(kv, past + len(anchors))
        self._mask_logits = ml[0].cpu() if n_masks else None  # read on the host (advance)
        return lg[0].cpu()

    def advance(self, history: Sequence[int], n_acc: int, sampling: Optional[Sampling] = None,
                generator: Optional[torch.Generator] = None) -> None:
        """After a verification that accepted ``n_acc`` drafts and extended the sequence to
        ``history``: the next drafts are the masks after anchor n_acc (greedy argmax, or
        sampled from ``sampling.probs`` with those distributions kept for the acceptance
        rule)."""
        ml = self._mask_logits
        self._mask_logits = None
        if ml is None or ml.shape[1] == 0 or not history:
            self._drafts, self._probs, self._for = [], None, None
            return
        self._drafts, self._probs = next_drafts(ml[int(n_acc)], sampling, generator)
        self._for = (len(history), int(history[-1]))


def priming(drafter: Any, drafted: int, planned: int) -> bool:
    """Whether a step only primed ``drafter``: an MTP drafter that planned drafts
    (``planned`` > 0, the largest row's K after its tokens left) and had none to verify
    (``drafted`` == 0: the first step, or the first after a plain one).  Its masks make the
    next step's drafts; it is neither a plain step (its masks cost) nor a trial of its K, so
    the controllers do not observe it and plan the same K again (generate, its batched loop
    and the server's scheduler)."""
    return isinstance(drafter, MtpDrafter) and drafted == 0 and planned > 0


def next_drafts(rows: torch.Tensor, sampling: Optional[Sampling] = None,
                generator: Optional[torch.Generator] = None
                ) -> Tuple[List[int], Optional[torch.Tensor]]:
    """The drafts of one mask group's logits [m, V]: greedy argmax (no distributions), or
    sampled from ``sampling.probs`` (the distributions kept for the acceptance rule)."""
    if sampling is None:
        return [int(t) for t in torch.argmax(rows, -1).tolist()], None
    p = sampling.probs(rows)
    toks = [int(t) for t in torch.multinomial(p, 1, generator=generator)[:, 0]]
    return toks, p.float()
