"""Speculative decoding of a batch of sequences (the batch path of :func:`specmoe.generate`).

B sequences of different lengths, given left-padded with an ``attention_mask`` as in
transformers, advance by different amounts per iteration: each has its own drafts, its own
accepted prefix and its own EOS.  The controller picks one K per batch step (drafts per
sequence), with tau(g, B) measured at the batch size in use (the gamma-tolerance paper,
section 3.1: tau falls with the batch size, Fig. 1 left).

How the KV cache holds sequences that advance by different amounts (:class:`BatchKV`)
--------------------------------------------------------------------------------------
transformers' ``DynamicCache`` keeps one length L for the whole batch.  We keep it so and mark
which cache positions are real per sequence with a 2-D attention mask [B, L] (1 real, 0 hole):

* every forward appends m columns for all rows: row b's c_b real tokens first, then m - c_b
  dummy tokens (copies of its last token) whose mask entries are 0 -- holes;
* position ids are explicit per row (the count of real tokens before each one), so RoPE sees
  each sequence as if it were alone, whatever holes its row has;
* after verification, row b keeps its pending token and its n_b accepted drafts; its rejected
  drafts become holes (mask 0), the "padding-out" of rejected positions.  Columns that are
  holes in every row at the end are cropped (``DynamicCache.crop``);
* when the cache is longer than the longest row's real positions by half of them (and by
  32 columns or more), it is compacted: every row's real positions are gathered right-aligned (left padding, the layout
  transformers itself uses), one ``gather`` per layer.

Chosen over re-aligning the rows after every step (a copy of the whole cache per step) because
a masked hole costs one extra key per attention row until the next compaction, while a
re-alignment costs a full cache copy per iteration; the output is the same either way (masked
keys get weight exactly 0).  Sequences that finish (EOS or max_new_tokens) leave the batch
(``DynamicCache.batch_select_indices``), so later steps run at the smaller batch.

Caveats, by construction: dummy tokens are routed by the MoE layers like any token (as the pad
tokens of transformers' own batched decoding are), so a row with fewer drafts than the step's K
adds expert traffic; caches with sliding-window layers are refused (a hole would count against
the window).

Recurrent layers (linear attention, Mamba, short convolutions: transformers 5.25's
``LinearAttentionLayer``) fold every token a row is fed into that row's state, which has no
positions to mask.  A BatchKV holding such layers (:attr:`BatchKV.stateful`) keeps each row's
state as row b of the layer's conv window and recurrent state tensors, and allows only what
adds no hole to them: a prefill without pads into an empty cache, forwards where every row
feeds the same number of real tokens (plain decode steps: one token a row), :meth:`join`,
:meth:`row` and :meth:`select`.  Holes in its attention layers (a row joined shorter than the
others, a row that left) are masked as above; its recurrent layers keep no position, so their
token count (what ``get_seq_length`` reads where layer 0 is recurrent) is held at the
attention layers' column count.  Left-padded prompts are refused by name.

Speculation on such a batch (``BatchKV(model, B, window=k_max + 1)``): its recurrent layers
record their states after each token of a forward (transformers 5.25's past recording, as
:func:`specmoe.speculation.decoding.new_kv` sets it up for one sequence), so rows may feed
different numbers of tokens (a shorter row's dummy tokens enter its state only after its real
ones) and :meth:`keep` may take back a row's tokens fed since the last settling.  Settling
(:meth:`trim`, and before anything else reads the rows) puts each row's state back to the one
recorded after its own last kept token -- row b of the recorded state, and the conv window's
last columns up to that token -- where transformers' own ``crop`` cuts every row back by one
count.  A plain step that no one will cut back runs unrecorded
(:func:`specmoe.speculation.decoding.unrecorded`), on the one-call decode path.  Without a
window, drafts of different lengths per row and :meth:`keep` below a row's length are refused
by name.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from ..models.layers import sequences
from .controllers import StaticK
from .decoding import (GenerateOutput, cache_kwargs, last_logits_kwargs, new_kv,
                       nothing_recorded, recording_state_layers, records_window,
                       unrecorded)
from .drafters import DraftModel, NgramDrafter, SelfDraft, propose
from .mtp import MtpDrafter, mtp_layout, next_drafts, priming
from .tau import batch_bucket, target_tau, tau_for_batch
from .verify import accept_logits, greedy_tokens

__all__ = ["BatchKV", "is_state_layer", "row_layer_kind", "per_position_acceptance"]


class BatchKV:
    """A DynamicCache of B sequences with holes: see the module docstring.

    ``mask`` [B, L] (int64, 1 = real position), ``npos[b]`` = real tokens of row b in the cache
    (the position id of its next token).  ``window`` > 0: recurrent layers record their states
    over that many tokens between two settlings, so rows can be cut back (module docstring);
    ValueError where they cannot record them."""

    def __init__(self, model: nn.Module, batch: int, window: int = 0) -> None:
        self.model = model
        self.kv = new_kv(model)
        # recurrent layers: a state per row and no positions (module docstring)
        self.stateful = any(is_state_layer(lay) for lay in getattr(self.kv, "layers", []))
        self.window = int(window) if self.stateful else 0
        if self.window > 0:
            if not records_window(self.kv):
                raise ValueError("BatchKV: this model's recurrent cache layers cannot record "
                                 "their states per token (transformers >= 5.25 and a modeling "
                                 "module that computes them); speculate one sequence at a time")
            self.kv.activate_past_recording(recurrent_states_to_keep=self.window)
            for lay in self.kv.layers:  # a list of its own per state (fromkeys shares one)
                if is_state_layer(lay):
                    lay.recurrent_states_history = {i: [] for i in range(lay.number_of_states)}
        # since the last settling (_settle): the columns every row's states took in (``_fed``,
        # what the records hold) and per row the real tokens fed and still kept (``_fresh``;
        # None when nothing was recorded since), so row b's states took in _fed - _fresh[b]
        # tokens past its kept ones (dummies and tokens taken back)
        self._fresh: Optional[List[int]] = None
        self._fed = 0
        # The bookkeeping (mask, npos) stays on the CPU, where Python indexes it; what the
        # model reads goes to the device of its embeddings (_call, forward_mtp).
        self.device = model.get_input_embeddings().weight.device
        self.mask = torch.zeros((batch, 0), dtype=torch.long)
        self.npos: List[int] = [0] * batch
        self.compactions = 0

    @property
    def batch(self) -> int:
        return int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])

    def _call(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor,
              **kw: Any) -> torch.Tensor:
        d = self.device
        with torch.no_grad():
            out = self.model(input_ids=ids.to(d), attention_mask=mask.to(d),
                             position_ids=pos.to(d),
                             use_cache=True, **cache_kwargs(self.model, self.kv), **kw)
        self._check_layers()
        return out.logits

    def _settle(self) -> None:
        """Each recurrent row back to its state after its last kept token (module docstring):
        row b of the state recorded ``_fed - _fresh[b]`` tokens ago, the conv window's columns
        up to that token; the records dropped.  Nothing to do when nothing was recorded since."""
        fresh, fed, self._fresh, self._fed = self._fresh, self._fed, None, 0
        if fresh is None:
            return
        cut = [fed - f for f in fresh]
        for lay in self.kv.layers:
            if not is_state_layer(lay):
                continue
            hist = getattr(lay, "recurrent_states_history", None) or {}
            for i in range(lay.number_of_states):
                if lay.is_conv_states_initialized[i]:
                    c, K = lay.conv_states[i], int(lay.conv_kernel_size[i])
                    W = c.shape[-1]
                    if W != K or any(cut):
                        win = c.new_zeros(c.shape[:-1] + (K,))
                        for b, r in enumerate(cut):
                            end = W - r
                            n = min(K, end)
                            win[b, ..., K - n:] = c[b, ..., end - n:end]
                        lay.conv_states[i] = win
                h = hist.get(i) or []
                if lay.is_recurrent_states_initialized[i] and any(cut):
                    if any(r > len(h) for r in cut):
                        raise RuntimeError(f"BatchKV: a recurrent layer recorded {len(h)} "
                                           f"states, a row needs {max(cut)} back")
                    st = lay.recurrent_states[i]
                    for b, r in enumerate(cut):
                        if r:
                            st[b].copy_(h[-r][b])  # (in place: the layer's tensor stays)
            if hist:  # a list of its own per state (transformers' fromkeys shares one)
                lay.recurrent_states_history = {i: [] for i in range(lay.number_of_states)}

    def _check_layers(self) -> None:
        from transformers.cache_utils import DynamicSlidingWindowLayer
        for layer in getattr(self.kv, "layers", []):
            if isinstance(layer, DynamicSlidingWindowLayer):
                raise ValueError("batched speculative decoding keeps holes in the KV cache and "
                                 "cannot run sliding-window attention layers; use batch "
                                 "size 1 or model.generate()")

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor,
                last_logits: bool = False) -> Optional[torch.Tensor]:
        """Feed left-padded ``ids`` [B, n] with ``mask`` [B, n] (transformers' layout): pads are
        holes, position ids count the real tokens (as transformers' generate computes them).
        Rows without pads into an empty cache run as sequences of one length
        (:func:`specmoe.models.layers.sequences`): each row then takes the implementations
        its prefill alone would.
        ``last_logits``: return the last column's logits [B, V] (every row's last token, the
        rows being left-padded).  Only that column's logits are computed, returned or not."""
        if ids.shape[1] == 0:
            return None
        mask = mask.to("cpu", torch.long)
        if self.stateful and (self.length or not bool(mask.all())):
            raise ValueError("BatchKV.prefill: a cache with recurrent layers takes prompts "
                             "without pads into an empty cache only (a pad would enter the "
                             "row's recurrent state)")
        pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        kw = last_logits_kwargs(self.model)  # (no other column's logits are ever read)
        # rows of one length into an empty cache: each takes the paths of its prefill alone
        # (specmoe.models.layers.sequences), so it gets that forward's bits where its products
        # run in C or, one prompt at a time, in torch (specmoe.models.layers.per_sequence)
        same = self.length == 0 and bool(mask.all())
        # (a prompt is never cut back: a recording cache's recurrent layers keep no states of it)
        with sequences(self.batch if same else 1), unrecorded(self.kv):
            logits = self._call(ids, torch.cat([self.mask, mask], 1), pos, **kw)
        self.mask = torch.cat([self.mask, mask], 1)
        self.npos = [p + int(c) for p, c in zip(self.npos, mask.sum(1).tolist())]
        return logits[:, -1].cpu() if last_logits else None

    def forward(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """Append each row's tokens (>= 1 per row, different counts allowed) in one forward;
        returns logits [B, m, V], row b's real outputs in [b, :len(rows[b])].  The B rows
        run as B sequences of m tokens (:func:`specmoe.models.layers.sequences`): specmoe's
        switches between C and torch count one row's m tokens, so a row takes the paths of
        its step alone, and with the C kernels batch invariant gets that step's bits at any
        batch size (before, past 16 tokens in all the projections went to torch's GEMM and
        rows left their bits: 21-70-token steps of random bf16 Qwen3-MoE, Qwen2-MoE and
        DeepSeek-V2 models, tests/test_batch_invariance.py).  It costs speed only where a
        step holds more than 16 tokens: there torch's GEMM is faster than the C kernels
        (docs/usage.md, "exactness")."""
        if len(rows) != self.batch:
            raise ValueError(f"BatchKV.forward: {len(rows)} rows for a batch of {self.batch}")
        c = [len(r) for r in rows]
        if min(c) < 1:
            raise ValueError("BatchKV.forward: every row needs at least one token")
        m = max(c)
        rec = self.window > 0 and bool(recording_state_layers(self.kv))
        if not rec:
            self._settle()  # (an unrecorded step adds nothing to take back: records go first)
        if self.stateful and min(c) != m and not rec:
            raise ValueError(f"BatchKV.forward: rows of {min(c)} to {m} tokens on a cache with "
                             "recurrent layers not recording their states (a dummy token would "
                             "stay in the row's state); every row must feed the same number of "
                             "tokens, or make the BatchKV with a window")
        if rec and self._fed + m > self.window:
            raise ValueError(f"BatchKV.forward: {m} more tokens a row after {self._fed} on a "
                             f"cache whose recurrent layers record {self.window} between two "
                             "settlings (trim)")
        ids = torch.tensor([list(r) + [r[-1]] * (m - len(r)) for r in rows], dtype=torch.long)
        new = torch.tensor([[1] * n + [0] * (m - n) for n in c], dtype=torch.long)
        pos = torch.tensor([[p + j for j in range(m)] for p in self.npos], dtype=torch.long)
        mask = torch.cat([self.mask, new], 1)
        with sequences(self.batch):  # each row on the paths of its step alone (above)
            logits = self._call(ids, mask, pos).cpu()  # the acceptance rule reads them on the host
        self.mask = mask
        self.npos = [p + n for p, n in zip(self.npos, c)]
        if rec:
            self._fresh = [f + n for f, n in zip(self._fresh or [0] * self.batch, c)]
            self._fed += m
        return logits

    def forward_mtp(self, rows: Sequence[Sequence[int]], n_masks: int, adapter: Any,
                    fetch_masks: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` for the MTP drafter: each row's anchors (its pending token and
        drafts, different counts allowed) followed by ``n_masks`` masks per anchor slot, in one
        forward (:meth:`specmoe.speculation.mtp.MtpAdapter.forward_mtp`).  Past holes and the padding
        anchors of shorter rows are hidden from every query; the masks' KV columns are cropped
        before returning.  Returns (anchor logits [B, A, V], mask logits [B, A, m, V])."""
        if len(rows) != self.batch:
            raise ValueError(f"BatchKV.forward_mtp: {len(rows)} rows for a batch of "
                             f"{self.batch}")
        c = [len(r) for r in rows]
        if min(c) < 1:
            raise ValueError("BatchKV.forward_mtp: every row needs at least one token")
        if self.stateful:
            raise ValueError("BatchKV.forward_mtp: a cache with recurrent layers cannot take "
                             "the masks' positions back out of its states")
        A, m, L, B = max(c), int(n_masks), self.length, self.batch
        dt = self.model.get_input_embeddings().weight.dtype
        rel, bias1 = mtp_layout(A, m, L, dt)
        q = rel.numel()
        bias = bias1.expand(B, 1, q, L + q).clone()
        lo = torch.finfo(dt).min
        real = torch.zeros((B, A), dtype=torch.long)
        for b in range(B):
            real[b, :c[b]] = 1
            bias[b, 0, :, :L].masked_fill_(self.mask[b] == 0, lo)      # past holes
            bias[b, 0, :, L + c[b]:L + A] = lo                        # padding anchors
        pos = torch.stack([rel - L + p for p in self.npos])
        ids = torch.tensor([list(r) + [r[-1]] * (A - len(r)) for r in rows], dtype=torch.long)
        d = self.device
        with torch.no_grad():
            lg, ml = adapter.forward_mtp(self.model, ids.to(d), m, past=L, kv=self.kv,
                                         layout=(pos.to(d), bias.to(d)),
                                         fetch_masks=fetch_masks)
        self._check_layers()
        if m:
            self.kv.crop(-(A * m))
        self.mask = torch.cat([self.mask, real], 1)
        self.npos = [p + n for p, n in zip(self.npos, c)]
        return lg.cpu(), ml.cpu()  # the acceptance rule and the next drafts read them on the host

    def keep(self, b: int, n_real: int) -> None:
        """Row b keeps its first ``n_real`` real positions; later ones become holes."""
        if n_real < self.npos[b]:
            if self.stateful:
                back = self.npos[b] - n_real
                if self._fresh is None or back > self._fresh[b]:
                    raise ValueError(f"BatchKV.keep: row {b}'s last {back} tokens are in its "
                                     "recurrent states, which keep no positions to take them "
                                     "back out of" + (f" (they recorded its last "
                                     f"{self._fresh[b]} only)" if self._fresh else ""))
                self._fresh[b] -= back
            real = torch.nonzero(self.mask[b]).flatten()
            self.mask[b, real[n_real:]] = 0
            self.npos[b] = n_real

    def trim(self) -> None:
        """Crop the columns at the end that are holes in every row, and compact when holes
        fill more than half of the cache.  Settles the recurrent rows first."""
        self._settle()
        L = self.length
        if L == 0:
            return
        any_real = self.mask.any(0)
        last = int(torch.nonzero(any_real).max()) + 1 if bool(any_real.any()) else 0
        if last < L:
            if self.stateful:  # its recurrent layers have no positions to crop
                for layer in self.kv.layers:
                    if not is_state_layer(layer):
                        layer.crop(last - L)
            else:
                self.kv.crop(last - L)
            self.mask = self.mask[:, :last]
            self._count_states()
        top = max(self.npos, default=0)
        if self.length - top >= max(32, top // 2):  # compaction saves a third or more
            self.compact()

    def compact(self) -> None:
        """Gather every row's real positions right-aligned into max(npos) columns."""
        L2 = max(self.npos)
        B = self.batch
        idx = torch.zeros((B, L2), dtype=torch.long)
        mask = torch.zeros((B, L2), dtype=torch.long)
        for b in range(B):
            real = torch.nonzero(self.mask[b]).flatten()
            n = real.numel()
            if n:
                idx[b, L2 - n:] = real
                mask[b, L2 - n:] = 1
        for layer in self.kv.layers:
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            g = idx.to(layer.keys.device)[:, None, :, None]
            layer.keys = layer.keys.gather(2, g.expand(-1, layer.keys.shape[1], -1,
                                                       layer.keys.shape[3]))
            layer.values = layer.values.gather(2, g.expand(-1, layer.values.shape[1], -1,
                                                           layer.values.shape[3]))
        self.mask = mask
        self._count_states()
        self.compactions += 1

    def _count_states(self) -> None:
        """The recurrent layers' token count held at the column count (module docstring)."""
        if self.stateful:
            for layer in self.kv.layers:
                if is_state_layer(layer):
                    layer.cumulative_length_linear.fill_(self.length)

    def join(self, kv: Any) -> None:
        """Add the sequence cached alone in ``kv`` (a DynamicCache of batch 1 without holes, as
        a batch-1 forward leaves it) as a new last row.  The shorter side is left-padded with
        holes to the longer one's length (a row's real positions stay in order; its position
        ids are its own count, so where the holes are does not matter); a recurrent layer's
        states become row B of the batch's (``kv`` may record its past where it recorded
        nothing since its last crop).  Copies the whole cache once (``torch.cat`` per
        layer): how :mod:`specmoe.serve.scheduler` takes a request whose prompt was prefilled
        alone into its running decode batch."""
        self._settle()
        n = int(kv.get_seq_length())
        src, dst = list(kv.layers), list(self.kv.layers)
        if len(src) != len(dst):
            raise ValueError(f"BatchKV.join: a cache of {len(src)} layers into one of "
                             f"{len(dst)}")
        L, B = self.length, self.batch
        for ls, ld in zip(src, dst):  # checked before anything changes
            if is_state_layer(ls) != is_state_layer(ld):
                raise ValueError(f"BatchKV.join: a {type(ls).__name__} layer into a "
                                 f"{type(ld).__name__} one")
            if is_state_layer(ls):
                _check_states(ls, ld if B else None)
                continue
            k = ls.keys
            if k is None or k.dim() != 4 or k.shape[0] != 1 or k.shape[-2] != n:
                raise ValueError("BatchKV.join: every layer must hold the sequence's "
                                 f"{n} positions at batch 1")
        W = max(L, n)
        for ls, ld in zip(src, dst):
            if is_state_layer(ls):
                if B == 0:
                    _copy_states(ls, ld, lambda t: t.clone())
                else:
                    for attr, i in _state_slots(ld):
                        getattr(ld, attr)[i] = torch.cat([getattr(ld, attr)[i],
                                                          getattr(ls, attr)[i]], 0)
                continue
            k, v = _pad_holes(ls.keys, W - n), _pad_holes(ls.values, W - n)
            if B == 0 or not ld.is_initialized:
                ld.lazy_initialization(k, v)
                # a copy (k is a view of the request's buffers when there were no holes to add)
                ld.keys, ld.values = k.clone() if W == n else k, v.clone() if W == n else v
            else:
                ld.keys = torch.cat([_pad_holes(ld.keys, W - L), k], 0)
                ld.values = torch.cat([_pad_holes(ld.values, W - L), v], 0)
        new = torch.zeros((1, W), dtype=torch.long)
        new[0, W - n:] = 1
        self.mask = torch.cat([torch.nn.functional.pad(self.mask, (W - L, 0)), new], 0)
        self.npos.append(n)
        self._count_states()

    def row(self, b: int) -> Any:
        """Row ``b`` as a cache of its own: a DynamicCache of batch 1 holding its real
        positions in order, without holes, and its recurrent states (what :meth:`join`
        takes).  A copy: the batch keeps the row until :meth:`select` drops it."""
        self._settle()
        real = torch.nonzero(self.mask[b]).flatten()
        # (a batch recording its rows' states: the row's own cache records them too)
        out = new_kv(self.model, rollback=self.window > 0, window=self.window)
        for ls, ld in zip(self.kv.layers, out.layers):
            if is_state_layer(ls):
                _copy_states(ls, ld, lambda t: t[b:b + 1].clone())
                ld.cumulative_length_linear.fill_(self.npos[b])
                continue
            idx = real.to(ls.keys.device)
            k = ls.keys[b:b + 1].index_select(-2, idx)
            v = ls.values[b:b + 1].index_select(-2, idx)
            ld.lazy_initialization(k, v)
            ld.keys, ld.values = k, v
        return out

    def select(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (indices into the current batch), in that order."""
        self._settle()
        if list(rows) == list(range(self.batch)):
            return
        t = torch.tensor(list(rows), dtype=torch.long)
        if self.length:
            if self.stateful:  # transformers' recurrent layers have no batch_select_indices
                for layer in self.kv.layers:
                    if is_state_layer(layer):
                        _copy_states(layer, layer, lambda x: x.index_select(0, t.to(x.device)))
                    else:
                        layer.batch_select_indices(t.to(self.device))
            else:
                self.kv.batch_select_indices(t.to(self.device))
        self.mask = self.mask[t]
        self.npos = [self.npos[r] for r in rows]
        self.trim()


def is_state_layer(layer: Any) -> bool:
    """Whether ``layer`` is one of transformers' recurrent cache layers (linear attention,
    Mamba, short convolutions: a state per row, no positions; transformers 5.25 on)."""
    from transformers import cache_utils
    mix = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
    return mix is not None and isinstance(layer, mix)


def row_layer_kind(layer: Any) -> Optional[str]:
    """What a cache layer can hold as rows of a BatchKV: ``"positions"`` (transformers' plain
    ``DynamicLayer``: keys and values per position, a hole a masked position), ``"states"`` (a
    recurrent layer holding states only: row b of its state tensors), or None (anything else:
    a sliding window, which would count a hole against its window, a layer holding keys and
    states at once, a cache class of a model's own)."""
    from transformers.cache_utils import DynamicLayer
    if type(layer) is DynamicLayer:
        return "positions"
    if is_state_layer(layer) and not hasattr(layer, "keys"):
        return "states"
    return None


def _state_slots(layer: Any) -> List[Tuple[str, int]]:
    """(attribute, state index) of every state a recurrent cache layer holds."""
    out = []
    for i in range(layer.number_of_states):
        if layer.is_conv_states_initialized[i]:
            out.append(("conv_states", i))
        if layer.is_recurrent_states_initialized[i]:
            out.append(("recurrent_states", i))
    return out


def _check_states(src: Any, dst: Any) -> None:
    """ValueError unless the recurrent layer ``src`` holds one sequence's states, not
    recording its past (or with nothing recorded since its last crop), of the forms of
    ``dst``'s (None: an empty batch)."""
    if (getattr(src, "record_past", False) and not nothing_recorded(src)) \
            or row_layer_kind(src) != "states":
        raise ValueError(f"BatchKV.join: a {type(src).__name__} recording its past or holding "
                         "keys too cannot be a row of a batch")
    slots = _state_slots(src)
    if not slots or any(getattr(src, a)[i].shape[0] != 1 for a, i in slots):
        raise ValueError("BatchKV.join: every recurrent layer must hold one sequence's states")
    if dst is not None and (
            slots != _state_slots(dst)
            or any(getattr(src, a)[i].shape[1:] != getattr(dst, a)[i].shape[1:]
                   or getattr(src, a)[i].dtype != getattr(dst, a)[i].dtype for a, i in slots)):
        raise ValueError("BatchKV.join: a recurrent layer's states differ in form from the "
                         "batch's")


def _copy_states(src: Any, dst: Any, fn: Any) -> None:
    """``dst``'s states := ``fn`` of ``src``'s (rows copied or selected), with the flags that
    say which states it holds and how wide its conv window is."""
    for attr, i in _state_slots(src):
        getattr(dst, attr)[i] = fn(getattr(src, attr)[i])
    if dst is src:
        return
    for name in ("is_conv_states_initialized", "is_recurrent_states_initialized",
                 "has_previous_state", "conv_kernel_size"):
        setattr(dst, name, dict(getattr(src, name)))
    dst.device, dst.dtype = src.device, src.dtype
    dst.cumulative_length_linear = src.cumulative_length_linear.clone()


def _pad_holes(t: torch.Tensor, p: int) -> torch.Tensor:
    """``t`` [B, H, L, D] with ``p`` zero positions (holes) in front of its L."""
    if p <= 0:
        return t
    z = t.new_zeros(t.shape[:-2] + (p, t.shape[-1]))
    return torch.cat([z, t], -2)


class BatchDraftModel:
    """Batched drafting with a :class:`specmoe.speculation.drafters.DraftModel` (or SelfDraft): one
    :class:`BatchKV` for the draft, each row rolled back to the prefix it shares with its
    sequence, all rows drafted together token by token.

    ``shared``: the target's own :class:`BatchKV` (a SelfDraft with ``share_kv``, MoE-SpeQ
    Sec. 3.4, as at batch size 1): the draft feeds each row's pending token and drafts on top
    of the verified prefix the target cached, then turns those positions back into holes and
    crops them, so there is no second cache and no draft prefill of the prompt.

    A draft model with recurrent layers (a small Qwen3.5 or Qwen3-Next drafting for a hybrid
    target) gets a BatchKV whose recurrent layers record ``window`` tokens (default 16) between
    two settlings, so that rows of different lengths feed together (:class:`BatchKV`'s
    window): its empty state takes the histories but their last tokens as a prefill (each
    prompt alone where lengths differ, then joined), a row's verified tokens not yet fed go in
    forwards that fit the window (settled after each, as is the drafting forward before the
    draft steps), and every call ends with each row cut back to its history, so no draft stays
    in a state that a later :meth:`select` (which settles) would make permanent.  ValueError
    where the window cannot hold a call's drafts, or a row's history has no new token."""

    def __init__(self, drafter: Any, batch: int, shared: Optional[BatchKV] = None,
                 window: int = 16) -> None:
        self.drafter = drafter
        self.shared = shared is not None
        self.state = shared if shared is not None else BatchKV(drafter.model, batch,
                                                               window=window)
        self.seen: List[List[int]] = [[] for _ in range(batch)]

    @property
    def joinable(self) -> bool:
        """Whether :meth:`join` takes rows: an own state without recurrent layers (those are
        fed their histories together, class docstring)."""
        return not self.shared and not self.state.stateful

    def join(self, kv: Any, seen: Sequence[int]) -> None:
        """Add a new last row: a draft model's cache ``kv`` of batch 1 holding the tokens
        ``seen`` (as :meth:`DraftModel.hand_over` gives them), so that a request joining a
        batch brings the draft cache it drafted on alone and the other rows feed nothing
        again.  ValueError where this state is not :attr:`joinable` or ``kv`` does not hold
        ``len(seen)`` positions."""
        if not self.joinable:
            raise ValueError("BatchDraftModel.join: only an own draft state without "
                             "recurrent layers takes a row")
        if int(kv.get_seq_length()) != len(seen):
            raise ValueError(f"BatchDraftModel.join: the cache holds "
                             f"{int(kv.get_seq_length())} positions, seen {len(seen)} tokens")
        self.state.join(kv)
        self.seen.append([int(t) for t in seen])

    def row(self, b: int) -> Tuple[Any, List[int]]:
        """Row ``b``'s draft cache of its own and the tokens it holds (a copy, as
        :meth:`BatchKV.row`): what :meth:`DraftModel.take_over` takes.  ValueError where this
        state is not :attr:`joinable`."""
        if not self.joinable:
            raise ValueError("BatchDraftModel.row: only an own draft state without recurrent "
                             "layers gives a row back")
        return self.state.row(b), list(self.seen[b])

    def select(self, rows: Sequence[int]) -> None:
        if not self.shared:  # a shared state is selected by its owner
            self.state.select(rows)
        self.seen = [self.seen[r] for r in rows]

    def _stateful_rows(self, hists: List[List[int]], K: int) -> List[List[int]]:
        """For a draft state with recurrent layers (class docstring): every row brought to the
        verified tokens of its history but the last few, and those tokens (at least one a row,
        at most a window of them) returned for the drafting forward."""
        st = self.state
        if st.window <= 0:
            raise ValueError("BatchDraftModel: a draft model with recurrent layers needs a "
                             "BatchKV that records their states (window > 0)")
        if K - 1 > st.window:
            raise ValueError(f"BatchDraftModel: {K} drafts a row do not fit a window of "
                             f"{st.window} recorded tokens (K - 1 at most)")
        for b, (h, s) in enumerate(zip(hists, self.seen)):
            if s and len(h) <= len(s) and h == s[:len(h)]:
                raise ValueError(f"BatchDraftModel: row {b}'s history has no token past what "
                                 "the last call fed (a draft model with recurrent layers "
                                 "needs one or more new tokens a row and call)")
        if st.length == 0 and all(len(h) >= 2 for h in hists):
            self._prefill([h[:-1] for h in hists])
            st = self.state
            self.seen = [list(h[:-1]) for h in hists]
        for b, h in enumerate(hists):  # (the last call cut every row back to its history)
            n, lim, s = 0, min(len(self.seen[b]), len(h) - 1), self.seen[b]
            while n < lim and s[n] == h[n]:
                n += 1
            st.keep(b, n)
            self.seen[b] = list(h[:n])
        st.trim()
        pend = [h[len(s):] for h, s in zip(hists, self.seen)]
        while max(len(p) for p in pend) > st.window:  # (the drafting forward is settled too)
            # a catch-up forward: all but a row's last token, at most a window of them; a row
            # with nothing to feed takes its next token as a dummy, taken back at once
            feed = [p[:min(len(p) - 1, st.window)] for p in pend]
            self._run([f or p[:1] for f, p in zip(feed, pend)], [], None)
            for b, f in enumerate(feed):
                if not f:
                    st.keep(b, st.npos[b] - 1)
                self.seen[b] += f
            st.trim()
            pend = [p[len(f):] for p, f in zip(pend, feed)]
        return pend

    def _prefill(self, rows: List[List[int]]) -> None:
        """An empty draft state with recurrent layers filled with ``rows`` (each >= 1 token),
        unrecorded: one prefill when they are of one length, else each alone, then joined (a
        pad would enter a row's state)."""
        d, st = self.drafter, self.state
        ctx = d.engine.drafting() if isinstance(d, SelfDraft) else contextlib.nullcontext()
        with ctx:
            if len({len(r) for r in rows}) == 1:
                ids = torch.tensor(rows, dtype=torch.long)
                st.prefill(ids, torch.ones_like(ids))
                return
            self.state = _joined_alone(d.model, rows, st.window)

    def _run(self, rows: List[List[int]], rec_rows: List[Tuple[List[int], int]],
             routing: Optional[Dict[int, np.ndarray]]) -> torch.Tensor:
        d = self.drafter
        if not isinstance(d, SelfDraft):
            return self.state.forward(rows)
        m = max(len(r) for r in rows)
        with d.engine.drafting() as rec:
            out = self.state.forward(rows)
        if routing is not None:
            # tokens are flattened row-major [B, m]: count the inputs the verification will
            # see again (each row's last fed token: its pending token or a draft)
            take = [b * m + j for b_rows, j in rec_rows for b in b_rows]
            E = d.engine.num_experts
            for pos, idx, _ in rec:
                c = routing.setdefault(pos, np.zeros(E, np.int64))
                np.add.at(c, idx[take].ravel(), 1)
        return out

    def draft(self, hists: List[List[int]], ks: List[int], sampling: Any,
              gen: Optional[torch.Generator]) -> Tuple[List[List[int]], List[Optional[torch.Tensor]],
                                                      Optional[Dict[int, np.ndarray]]]:
        """(drafts per row, their distributions per row or None, union routing or None)."""
        K = max(ks) if ks else 0
        B = len(hists)
        if K <= 0:
            return [[] for _ in range(B)], [None] * B, None
        rows = []
        own_states = not self.shared and self.state.stateful
        if own_states:
            rows = self._stateful_rows(hists, K)
        for b, h in enumerate(hists if not own_states else []):
            if self.shared:  # the target's cache holds every token of the row but the last
                if self.state.npos[b] != len(h) - 1:
                    raise RuntimeError(f"BatchDraftModel: row {b} of the shared cache holds "
                                       f"{self.state.npos[b]} positions, its history "
                                       f"{len(h)} tokens (expected {len(h) - 1})")
                rows.append(h[-1:])
                continue
            n, lim, s = 0, min(len(self.seen[b]), len(h) - 1), self.seen[b]
            while n < lim and s[n] == h[n]:
                n += 1
            self.state.keep(b, n)
            rows.append(h[n:])
        self.state.trim()
        routing: Optional[Dict[int, np.ndarray]] = {} if isinstance(self.drafter, SelfDraft) \
            else None
        logits = self._run(rows, [([b], len(rows[b]) - 1) for b in range(B) if ks[b] > 0],
                           routing)
        if own_states:  # a shorter row's dummies out of its state before it drafts on
            self.state.trim()
        last = torch.stack([logits[b, len(rows[b]) - 1] for b in range(B)])
        toks: List[List[int]] = [[] for _ in range(B)]
        probs: List[List[torch.Tensor]] = [[] for _ in range(B)]
        for i in range(K):
            if sampling is None:
                t = greedy_tokens(last)
            else:
                p = sampling.probs(last)
                t = torch.multinomial(p, 1, generator=gen)[:, 0].tolist()
                for b in range(B):
                    probs[b].append(p[b])
            for b in range(B):
                toks[b].append(int(t[b]))
            if i + 1 < K:
                live = [b for b in range(B) if ks[b] > i + 1]
                last = self._run([[x[-1]] for x in toks], [(live, 0)], routing)[:, 0]
        if self.shared:  # the draft's positions become holes and are cropped off again
            for b in range(B):
                self.state.keep(b, len(hists[b]) - 1)
            self.state.trim()
        elif own_states:  # each row back to its history (class docstring)
            for b in range(B):
                self.state.keep(b, len(hists[b]))
                self.seen[b] = list(hists[b])
            self.state.trim()
        else:
            for b in range(B):  # the cache holds history + toks[:-1] of every row
                self.seen[b] = list(hists[b]) + toks[b][:-1]
        drafts = [toks[b][:ks[b]] for b in range(B)]
        dprobs = [torch.stack(probs[b][:ks[b]]) if sampling is not None and ks[b] else None
                  for b in range(B)]
        return drafts, dprobs, routing


def _joined_alone(model: nn.Module, rows: Sequence[Sequence[int]], window: int = 0) -> BatchKV:
    """A BatchKV of ``rows`` (token ids, each >= 1), each prefilled alone, unrecorded, and
    joined (:meth:`BatchKV.join`): how prompts of different lengths enter a batch whose
    recurrent layers could not take a pad.  ``window``: what the batch records after."""
    state = BatchKV(model, 0, window=window)
    for r in rows:
        one = BatchKV(model, 1)
        one.prefill(torch.tensor([list(r)]), torch.ones((1, len(r)), dtype=torch.long))
        state.join(one.kv)
    return state


def per_position_acceptance(pairs: Sequence[Tuple[int, int]]) -> List[Optional[float]]:
    """Acceptance per draft position from (drafts verified, drafts accepted) per sequence and
    iteration: entry j-1 = P(position j accepted | it was verified and positions < j were
    accepted) = #(accepted >= j) / #(k >= j and accepted >= j - 1)."""
    kmax = max((k for k, _ in pairs), default=0)
    out: List[Optional[float]] = []
    for j in range(1, kmax + 1):
        reached = sum(1 for k, a in pairs if k >= j and a >= j - 1)
        acc = sum(1 for k, a in pairs if a >= j)
        out.append(acc / reached if reached else None)
    return out


def check_left_padded(ids: torch.Tensor, mask: torch.Tensor) -> None:
    """ValueError unless every row of ``mask`` is 0...0 1...1 with at least one 1."""
    m = mask.to(torch.long)
    if not bool(((m == 0) | (m == 1)).all()):
        raise ValueError("attention_mask must hold only 0 and 1")
    if bool((m[:, 1:] < m[:, :-1]).any()) or bool((m[:, -1] != 1).any()):
        raise ValueError("attention_mask must be left-padded (0...0 1...1 per row, the last "
                         "column real): pad the prompts on the left, as for transformers' "
                         "batched generate")


def run_batch(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, drafter: Any,
              controller: Any, max_new_tokens: int, sampling: Any, eos: set,
              gen: torch.Generator, tau: Any, engine: Any, lookahead: bool, progress: bool,
              pad_token_id: int, vocab: int) -> Any:
    """The batched loop of :func:`specmoe.generate` (arguments already checked there)."""
    B, n = ids.shape
    prompts = [ids[b][mask[b] == 1].tolist() for b in range(B)]
    mtp = drafter if isinstance(drafter, MtpDrafter) else None
    # tau per batch size: measured lazily at the batch sizes in use ("auto"), or given
    tau_tables: Optional[Dict[int, Mapping[int, float]]] = None
    if controller is not None and tau is not None and not (
            isinstance(tau, str) and isinstance(controller, StaticK)):
        if isinstance(tau, str):
            tau_tables = {}
        elif tau and all(isinstance(v, Mapping) for v in tau.values()):
            tau_tables = {int(b): v for b, v in tau.items()}
        else:
            tau_tables = {0: tau}  # one table for every batch size

    def tau_at(bsz: int) -> Mapping[int, float]:
        assert tau_tables is not None
        if isinstance(tau, str):
            # measured at the next power of two >= bsz (a handful of sizes per run)
            b2 = batch_bucket(bsz)
            if b2 not in tau_tables:
                longest = max(prompts, key=len)
                g_max = controller.k_max + 1
                if mtp is not None:  # g anchors and their masks per sequence
                    tau_tables[b2] = mtp.tau(target_tau(model, longest, mtp.tau_tokens(g_max),
                                                        engine, batch=b2), g_max)
                else:
                    tau_tables[b2] = target_tau(model, longest, g_max, engine, batch=b2)
            return tau_tables[b2]
        return tau_for_batch(tau_tables, bsz)

    if controller is not None and hasattr(controller, "begin_request"):
        controller.begin_request()
    t_start = time.perf_counter()
    # a hybrid's recurrent rows record their states over a verification's tokens, so each row
    # is cut back to its own accepted drafts (BatchKV's window; drafting on the target's own
    # cache, a shared SelfDraft, feeds at most as many before the cut)
    window = controller.k_max + 1 if drafter is not None and controller is not None else 0
    state = BatchKV(model, B, window=window)
    if state.stateful and not bool(mask.all()):
        # a pad would enter a recurrent row's state: each prompt prefilled alone, then joined
        if min(len(p) for p in prompts) < 2:
            raise ValueError("specmoe.generate: a batch of prompts of different lengths on a "
                             "model with recurrent layers needs 2 or more tokens a prompt")
        state = _joined_alone(model, [p[:-1] for p in prompts], window)
    else:
        state.prefill(ids[:, :-1], mask[:, :-1])  # the last column holds every pending token
    seqs = [list(p) for p in prompts]
    active = list(range(B))
    ngrams: Optional[List[Any]] = None
    bdraft: Optional[BatchDraftModel] = None
    # MTP: each row's next drafts (and their distributions) from its last step's masks
    mtp_next: List[Tuple[List[int], Optional[torch.Tensor]]] = [([], None)] * B
    if isinstance(drafter, DraftModel):
        share = isinstance(drafter, SelfDraft) and drafter.share_kv
        # (a draft model with recurrent layers records its K - 1 draft steps)
        bdraft = BatchDraftModel(drafter, B, shared=state if share else None,
                                 window=max(16, window))
    elif isinstance(drafter, NgramDrafter):
        ngrams = [drafter.clone() for _ in range(B)]
    its: List[Dict[str, Any]] = []
    loaded0, stall0 = engine.loads() if engine is not None else (0, 0.0)
    cur_b = -1
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=max_new_tokens * B, desc="generate", unit="tok")
    try:
        while active:
            Ba = len(active)
            if controller is not None and Ba != cur_b:
                if hasattr(controller, "set_batch"):
                    controller.set_batch(Ba)
                if tau_tables is not None:
                    controller.set_tau(tau_at(Ba))
                cur_b = Ba
            k_plan = controller.next_k() if controller is not None else 0
            ks = [max(0, min(k_plan, max_new_tokens - (len(seqs[r]) - len(prompts[r])) - 1))
                  for r in active]
            t0 = time.perf_counter()
            l0, s0 = engine.loads() if engine is not None else (0, 0.0)
            routing = None
            dprobs: List[Optional[torch.Tensor]] = [None] * Ba
            if drafter is None or max(ks) == 0:
                drafts: List[List[int]] = [[] for _ in active]
            elif mtp is not None:
                drafts = [mtp_next[r][0][:ks[i]] for i, r in enumerate(active)]
                dprobs = [None if mtp_next[r][1] is None or not ks[i]
                          else mtp_next[r][1][:len(drafts[i])] for i, r in enumerate(active)]
            elif bdraft is not None:
                drafts, dprobs, routing = bdraft.draft([seqs[r] for r in active], ks,
                                                       sampling, gen)
            else:
                drafts = []
                for i, r in enumerate(active):
                    d = propose(ngrams[r] if ngrams is not None else drafter, seqs[r], ks[i],
                               None, gen, vocab)
                    drafts.append(d.tokens)
            for i, d in enumerate(drafts):  # the same checks as batch size 1
                _draft_check(drafter, d, dprobs[i], ks[i], vocab)
            t_draft = time.perf_counter() - t0
            kd = [len(d) for d in drafts]
            if lookahead and routing and engine is not None:
                engine.lookahead(routing)
            anchors = [[seqs[r][-1]] + drafts[i] for i, r in enumerate(active)]
            if mtp is not None:
                # one forward verifies every row's drafts and drafts its next ones
                logits, mask_logits = state.forward_mtp(anchors, mtp.k if max(ks) > 0 else 0,
                                                        mtp.adapter, mtp.fetch_masks)
            elif max(kd) == 0:  # nothing to cut back: recurrent layers record nothing
                with unrecorded(state.kv):
                    logits = state.forward(anchors)
            else:
                logits = state.forward(anchors)
            acc: List[int] = []
            emitted: List[int] = []
            finished: List[int] = []
            for i, r in enumerate(active):
                n_acc, nxt = accept_logits(logits[i, :kd[i] + 1], drafts[i], sampling, gen,
                                           dprobs[i])
                state.keep(i, len(seqs[r]) + n_acc)  # pending token + accepted drafts
                new = drafts[i][:n_acc] + [int(nxt)]
                stop = False
                for j, t in enumerate(new):
                    if t in eos:
                        new, stop = new[:j + 1], True
                        break
                seqs[r].extend(new)
                if mtp is not None:
                    mtp_next[r] = next_drafts(mask_logits[i, n_acc], sampling, gen) \
                        if mask_logits.shape[2] else ([], None)
                if stop or len(seqs[r]) - len(prompts[r]) >= max_new_tokens:
                    finished.append(i)
                acc.append(int(n_acc))
                emitted.append(len(new))
            state.trim()
            t_end = time.perf_counter()
            t_iter = t_end - t0
            l1, s1 = engine.loads() if engine is not None else (0, 0.0)
            n_load, t_io = l1 - l0, max(0.0, min(s1 - s0, t_iter))
            k_used = max(kd)
            primed = priming(drafter, k_used, max(ks))  # no row had drafts yet: not observed
            if controller is not None and not primed:  # (SpeQ learns its I/O cost here)
                observe_batch_step(controller, kd, acc, t_iter, n_load, t_draft, t_io)
            its.append({"k_planned": int(k_plan), "k": k_used, "accepted": sum(acc),
                        "emitted": sum(emitted), "batch": Ba, "k_rows": kd,
                        "accepted_rows": acc, "t_iter": t_iter, "t_end": t_end,
                        "t_draft": t_draft, "experts_loaded": n_load, "priming": primed})
            if bar is not None:
                bar.update(sum(emitted))
            if finished:
                keep_rows = [i for i in range(Ba) if i not in finished]
                active = [active[i] for i in keep_rows]
                if active:
                    state.select(keep_rows)
                    if bdraft is not None:
                        bdraft.select(keep_rows)
    finally:
        if bar is not None:
            bar.close()
    elapsed = time.perf_counter() - t_start
    gen_rows = [s[len(p):] for s, p in zip(seqs, prompts)]
    width = max(len(g) for g in gen_rows)
    out = torch.full((B, n + width), int(pad_token_id), dtype=torch.long)
    out[:, :n] = ids.cpu()
    for b, g in enumerate(gen_rows):
        out[b, n:n + len(g)] = torch.tensor(g, dtype=torch.long)
    new_tokens = sum(len(g) for g in gen_rows)
    steps = sum(i["batch"] for i in its)
    pairs = [(k, a) for i in its for k, a in zip(i["k_rows"], i["accepted_rows"])]
    proposed = sum(k for k, _ in pairs)
    accepted = sum(a for _, a in pairs)
    stats: Dict[str, Any] = {
        "batch": B, "new_tokens": new_tokens, "new_tokens_per_row": [len(g) for g in gen_rows],
        "iterations": len(its), "time_s": elapsed,
        "tok_per_s": new_tokens / elapsed if elapsed > 0 else float("nan"),
        "proposed": proposed, "accepted": accepted,
        "acceptance": accepted / proposed if proposed else None,
        "acceptance_per_position": per_position_acceptance(pairs),
        "etr": new_tokens / steps if steps else None,
        "k_mean": sum(i["k"] for i in its) / len(its) if its else None,
        "kv_compactions": state.compactions,
    }
    if engine is not None:
        l1, s1 = engine.loads()
        stats.update({"experts_loaded": l1 - loaded0,
                      "experts_loaded_per_token": (l1 - loaded0) / max(1, new_tokens),
                      "stall_s": s1 - stall0})
    return GenerateOutput(out, stats, its)


def observe_batch_step(controller: Any, kd: List[int], acc: List[int], t_iter: float,
                       n_load: int, t_draft: float, t_io: float) -> None:
    """One batch step to ``controller``: rows ``kd`` drafts verified and ``acc`` accepted; k
    the largest row's drafts; the scalar accepted k when every row accepted all its drafts
    (the heuristic's "+2"), else the fewest accepted by a row that had a draft rejected;
    t_draft and t_io clamped within t_iter (used by :func:`run_batch` and the server's
    scheduler)."""
    k_used = max(kd)
    t_draft = min(t_draft, t_iter)
    if k_used == 0:  # a plain step: the same to the controller as one sequence's, and cheaper
        controller.observe(0, 0, t_iter, n_load, t_draft=t_draft,
                           t_io=min(t_io, t_iter - t_draft))
        return
    short = [a for a, k in zip(acc, kd) if a < k]
    controller.observe(k_used, min(short) if short else k_used, t_iter, n_load,
                       t_draft=t_draft, t_io=min(t_io, t_iter - t_draft),
                       rows_k=kd, rows_accepted=acc)


def _draft_check(drafter: Any, tokens: List[int], probs: Optional[torch.Tensor], k: int,
                 vocab: int) -> None:
    name = type(drafter).__name__
    if len(tokens) > k:
        raise ValueError(f"drafter {name} proposed {len(tokens)} tokens, more than the {k} "
                         "asked for")
    bad = [t for t in tokens if not (0 <= t < vocab)]
    if bad:
        raise ValueError(f"drafter {name} proposed token ids {bad} outside the vocabulary "
                         f"[0, {vocab})")
    if probs is not None and tuple(probs.shape) != (len(tokens), vocab):
        raise ValueError(f"drafter {name} returned probs of shape {tuple(probs.shape)}, "
                         f"expected ({len(tokens)}, {vocab})")
