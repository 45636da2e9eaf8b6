"""Train the specmoe zoo pair: a small Mixtral-layout MoE target and a tiny dense Llama draft,
sharing one byte-level BPE tokenizer trained on the same corpus (see corpus.py).

Everything the model card states is measured by this script in the same run, on the weights
as saved (bf16): held-out loss per domain for both models next to a unigram baseline,
per-layer routing entropy next to uniform, the draft's greedy acceptance rate per held-out
set, steps and wall time.

    python training/train.py                      # full run, writes specmoe/zoo/
    python training/train.py --smoke --out DIR    # whole pipeline on a tiny slice, ~30 s

The run is seeded and deterministic for a given machine, thread count and library versions:
the training length is a number of steps, never a time budget.  ``--max-minutes`` is only a
safety stop; if it fires, the card says so and how many steps were done.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")     # tokenizers: one thread, reproducible
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import corpus as corpus_mod  # noqa: E402

REPO = HERE.parent
ZOO = REPO / "specmoe" / "zoo"
TARGET_NAME = "tiny-moe"
DRAFT_NAME = "tiny-draft"
EOS = "<|endoftext|>"


@dataclass
class Plan:
    """Sizes and schedule.  The defaults are the full run; smoke() the tiny one."""

    vocab: int = 8192
    seq_len: int = 256
    # target (Mixtral layout)
    t_hidden: int = 256
    t_layers: int = 4
    t_heads: int = 4
    t_kv_heads: int = 2
    t_experts: int = 16
    t_topk: int = 2
    t_expert_inter: int = 256
    t_aux_coef: float = 0.01
    t_batch: int = 16
    t_steps: int = 1500
    t_lr: float = 2e-3
    # draft (Llama layout, dense)
    d_hidden: int = 128
    d_layers: int = 2
    d_heads: int = 2
    d_inter: int = 384
    d_batch: int = 16
    d_steps: int = 1200
    d_lr: float = 3e-3
    # shared
    warmup: int = 100
    weight_decay: float = 0.1
    prose_share: float = 0.3       # fraction of training sequences drawn from prose
    eval_tokens: int = 65536       # held-out tokens per domain for loss and routing
    eval_every: int = 250
    eval_tokens_during: int = 8192
    accept_prompts: int = 32       # prompts per domain for the acceptance rate
    accept_prompt_len: int = 64
    accept_new: int = 64
    accept_k: int = 4
    corpus_chars: int = 0          # 0: the whole corpus (smoke: a slice)

    @staticmethod
    def smoke() -> "Plan":
        return Plan(vocab=512, seq_len=64, t_hidden=64, t_layers=4, t_heads=2, t_kv_heads=1,
                    t_experts=16, t_topk=2, t_expert_inter=64, t_batch=4, t_steps=20,
                    d_hidden=32, d_layers=1, d_heads=1, d_inter=64, d_batch=4, d_steps=20,
                    warmup=5, eval_tokens=2048, eval_every=10, eval_tokens_during=512,
                    accept_prompts=2, accept_prompt_len=16, accept_new=12,
                    corpus_chars=100_000)


# ----------------------------------------------------------------------------- tokenizer

def train_tokenizer(domains, plan: Plan, out: Path):
    """Byte-level BPE on the training splits of both domains; saved for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=plan.vocab, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)

    def texts():
        for name in sorted(domains):
            for _, t in domains[name].train:
                yield t

    tok.train_from_iterator(texts(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS,
                                   unk_token=None, pad_token=EOS, model_max_length=plan.seq_len * 2)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return fast


def encode_split(tok, docs) -> np.ndarray:
    """Documents joined into one stream, each followed by EOS (uint16 ids)."""
    eos = tok.convert_tokens_to_ids(EOS)
    enc = tok._tokenizer.encode_batch([t for _, t in docs], add_special_tokens=False)
    parts = []
    for e in enc:
        parts.append(np.asarray(e.ids, dtype=np.uint16))
        parts.append(np.asarray([eos], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


# ----------------------------------------------------------------------------- models

def target_config(plan: Plan, eos_id: int):
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=plan.vocab, hidden_size=plan.t_hidden, intermediate_size=plan.t_expert_inter,
        num_hidden_layers=plan.t_layers, num_attention_heads=plan.t_heads,
        num_key_value_heads=plan.t_kv_heads, num_local_experts=plan.t_experts,
        num_experts_per_tok=plan.t_topk, max_position_embeddings=plan.seq_len * 2,
        router_aux_loss_coef=plan.t_aux_coef, output_router_logits=False,
        tie_word_embeddings=True, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def draft_config(plan: Plan, eos_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=plan.vocab, hidden_size=plan.d_hidden, intermediate_size=plan.d_inter,
        num_hidden_layers=plan.d_layers, num_attention_heads=plan.d_heads,
        num_key_value_heads=plan.d_heads, max_position_embeddings=plan.seq_len * 2,
        tie_word_embeddings=True, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- data

class Sampler:
    """Deterministic random windows of seq_len+1 tokens from the training streams."""

    def __init__(self, streams: dict[str, np.ndarray], prose_share: float, seq_len: int, seed: int):
        self.streams, self.share, self.L = streams, prose_share, seq_len
        self.rng = np.random.default_rng(seed)

    def batch(self, b: int):
        import torch

        rows = []
        for _ in range(b):
            name = "prose" if self.rng.random() < self.share else "code"
            s = self.streams[name]
            i = int(self.rng.integers(0, len(s) - self.L - 1))
            rows.append(s[i:i + self.L + 1].astype(np.int64))
        x = torch.from_numpy(np.stack(rows))
        return x[:, :-1], x[:, 1:]


def heldout_windows(stream: np.ndarray, seq_len: int, max_tokens: int) -> np.ndarray:
    """Non-overlapping windows of seq_len+1 tokens from the start of a held-out stream."""
    n = min(len(stream) - 1, max_tokens) // seq_len
    if n < 1:
        raise ValueError(f"held-out stream of {len(stream)} tokens is shorter than one window")
    return np.stack([stream[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)]).astype(np.int64)


# ----------------------------------------------------------------------------- training

def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def train_model(model, sampler, *, steps, batch, lr, plan, evalsets, label, max_seconds, aux):
    """AdamW with warmup + cosine; returns the history (train loss per step, periodic
    held-out loss) and how many steps ran before max_seconds, if it fired."""
    import torch
    from tqdm import tqdm

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": plan.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    hist = {"step": [], "loss": [], "eval_step": [], "eval": {k: [] for k in evalsets}}
    t0 = time.time()
    stopped_at = None
    bar = tqdm(range(steps), desc=f"train {label}", unit="step", mininterval=2.0)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, plan.warmup)
        model.train()
        x, y = sampler.batch(batch)
        kw = {"output_router_logits": True} if aux else {}
        out = model(input_ids=x, labels=x, **kw)
        # labels=x: transformers shifts internally, so y is implied; loss includes the
        # router load-balancing term when aux (Mixtral adds coef * aux_loss).
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        lm = out.loss.item() - (plan.t_aux_coef * out.aux_loss.item() if aux else 0.0)
        hist["step"].append(step)
        hist["loss"].append(lm)
        bar.set_postfix(loss=f"{lm:.3f}", refresh=False)
        last = step == steps - 1
        if (step + 1) % plan.eval_every == 0 or last:
            hist["eval_step"].append(step + 1)
            for k, w in evalsets.items():
                hist["eval"][k].append(heldout_loss(model, w))
        if max_seconds and time.time() - t0 > max_seconds and not last:
            stopped_at = step + 1
            bar.write(f"{label}: --max-minutes reached after {stopped_at} of {steps} steps")
            break
    bar.close()
    return hist, stopped_at, time.time() - t0


# ----------------------------------------------------------------------------- evaluation

def heldout_loss(model, windows: np.ndarray, batch: int = 8) -> float:
    """Mean next-token cross-entropy (nats) over all predicted positions of the windows."""
    import torch

    model.eval()
    tot, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            x = torch.from_numpy(windows[i:i + batch])
            logits = model(input_ids=x[:, :-1]).logits.float()
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                    x[:, 1:].reshape(-1), reduction="sum")
            tot += float(nll)
            n += x[:, 1:].numel()
    return tot / n


def unigram_loss(train_streams: dict[str, np.ndarray], windows: np.ndarray, vocab: int) -> float:
    """Cross-entropy (nats) of the same predicted tokens under the add-one-smoothed unigram
    distribution of all training tokens (both domains pooled)."""
    counts = np.ones(vocab, dtype=np.float64)
    for s in train_streams.values():
        counts += np.bincount(s, minlength=vocab)[:vocab]
    logp = np.log(counts / counts.sum())
    return float(-logp[windows[:, 1:]].mean())


def routing_stats(model, windows: np.ndarray, topk: int, batch: int = 8) -> list[dict]:
    """Per MoE layer, on held-out tokens: the mean entropy (nats) of the router's softmax
    over the E experts for one token, and the entropy of the layer's expert load (the share
    of the top-k assignments each expert receives), both next to log(E)."""
    import torch

    model.eval()
    ent_sum, loads, ntok = None, None, 0
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            x = torch.from_numpy(windows[i:i + batch, :-1])
            out = model(input_ids=x, output_router_logits=True)
            per_layer = [r.float().reshape(-1, r.shape[-1]) for r in out.router_logits]
            if ent_sum is None:
                E = per_layer[0].shape[-1]
                ent_sum = np.zeros(len(per_layer))
                loads = np.zeros((len(per_layer), E))
            for li, logits in enumerate(per_layer):
                p = torch.softmax(logits, dim=-1)
                ent_sum[li] += float(-(p * torch.log(p.clamp_min(1e-30))).sum())
                idx = torch.topk(logits, topk, dim=-1).indices.reshape(-1)
                loads[li] += np.bincount(idx.numpy(), minlength=loads.shape[1])
            ntok += per_layer[0].shape[0]
    res = []
    for li in range(len(ent_sum)):
        q = loads[li] / loads[li].sum()
        load_ent = float(-(q[q > 0] * np.log(q[q > 0])).sum())
        res.append({"layer": li, "token_entropy": ent_sum[li] / ntok,
                    "load_entropy": load_ent, "uniform": math.log(loads.shape[1]),
                    "tokens": ntok})
    return res


def speculative_greedy(target, draft, prompt: list[int], new_tokens: int, k: int):
    """Greedy speculative decoding without a KV cache.  Each round the draft proposes up to
    k tokens greedily; one target forward over prompt+proposal scores them; the longest
    prefix on which the draft's token equals the target's argmax is accepted, followed by
    the target's own token at the first mismatch (or after the last proposal).
    Returns (generated ids, proposed, accepted, rejected, rounds), where rejected counts
    the rounds that ended on a mismatch (tokens after it are never judged); the ids equal
    plain greedy decoding of the target."""
    import torch

    seq = list(prompt)
    proposed = accepted = rejected = rounds = 0
    with torch.no_grad():
        while len(seq) - len(prompt) < new_tokens:
            kk = min(k, new_tokens - (len(seq) - len(prompt)))
            cand = list(seq)
            for _ in range(kk):
                logits = draft(input_ids=torch.tensor([cand])).logits[0, -1]
                cand.append(int(torch.argmax(logits)))
            props = cand[len(seq):]
            tl = target(input_ids=torch.tensor([cand])).logits[0]
            preds = torch.argmax(tl[len(seq) - 1:len(seq) + kk], dim=-1).tolist()
            n = 0
            while n < kk and props[n] == preds[n]:
                n += 1
            seq += props[:n] + [preds[n]]
            proposed += kk
            accepted += n
            rejected += n < kk
            rounds += 1
    return seq[len(prompt):len(prompt) + new_tokens], proposed, accepted, rejected, rounds


def acceptance(target, draft, stream: np.ndarray, plan: Plan, seed: int) -> dict:
    """Greedy acceptance rate on prompts cut from a held-out stream at seeded offsets."""
    target.eval()
    draft.eval()
    rng = np.random.default_rng(seed)
    proposed = accepted = rejected = rounds = generated = 0
    span = plan.accept_prompt_len
    for _ in range(plan.accept_prompts):
        i = int(rng.integers(0, len(stream) - span))
        prompt = stream[i:i + span].astype(np.int64).tolist()
        gen, p, a, j, r = speculative_greedy(target, draft, prompt, plan.accept_new, plan.accept_k)
        proposed, accepted, rejected = proposed + p, accepted + a, rejected + j
        rounds, generated = rounds + r, generated + len(gen)
    return {"acceptance_rate": accepted / (accepted + rejected) if accepted + rejected else 1.0,
            "proposal_acceptance": accepted / proposed, "proposed": proposed,
            "accepted": accepted, "rejected": rejected,
            "tokens_per_target_forward": generated / rounds, "k": plan.accept_k,
            "prompts": plan.accept_prompts, "prompt_len": span, "new_tokens": plan.accept_new}


# ----------------------------------------------------------------------------- outputs

def save_bf16(model, tok, path: Path) -> int:
    import torch

    if path.exists():
        shutil.rmtree(path)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    model.to(torch.float32)
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def plot(hists: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(hists), figsize=(6 * len(hists), 4), squeeze=False)
    for ax, (label, h) in zip(axes[0], hists.items()):
        loss = np.asarray(h["loss"])
        w = max(1, len(loss) // 50)
        smooth = np.convolve(loss, np.ones(w) / w, mode="valid")
        ax.plot(h["step"], loss, color="0.8", lw=0.6, label="train (per step)")
        ax.plot(np.asarray(h["step"])[w - 1:], smooth, color="C0", label=f"train ({w}-step mean)")
        for j, (k, v) in enumerate(h["eval"].items()):
            ax.plot(h["eval_step"], v, "o-", color=f"C{j + 1}", label=f"held-out {k}")
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_card(path: Path, m: dict) -> None:
    t, d = m["target"], m["draft"]
    L = []
    L.append("# specmoe zoo: tiny-moe (target) and tiny-draft (draft)\n")
    L.append("Every figure below was measured by `training/train.py` in the run that produced "
             "these weights, on the weights as saved (bf16, evaluated in float32)."
             + (" **Smoke run: tiny slice, not a usable model.**" if m["smoke"] else "") + "\n")
    L.append("## Models\n")
    L.append("| | architecture | parameters | layers | experts | safetensors |")
    L.append("|---|---|---|---|---|---|")
    L.append(f"| `{TARGET_NAME}` | {t['architecture']} | {t['params']:,} "
             f"({t['active_params']:,} active/token) | {t['config']['num_hidden_layers']} "
             f"(all MoE) | {t['config']['num_local_experts']} per layer, top-"
             f"{t['config']['num_experts_per_tok']} | {t['bytes'] / 1e6:.1f} MB |")
    L.append(f"| `{DRAFT_NAME}` | {d['architecture']} | {d['params']:,} | "
             f"{d['config']['num_hidden_layers']} | dense | {d['bytes'] / 1e6:.1f} MB |")
    L.append("")
    L.append(f"Tokenizer: byte-level BPE (`tokenizers`), {m['tokenizer']['vocab']} tokens, trained "
             f"on the training splits of both domains; `{EOS}` separates documents. Both "
             "folders carry the same tokenizer files.\n")
    L.append("Load offline: `AutoModelForCausalLM.from_pretrained(path)`, "
             "`AutoTokenizer.from_pretrained(path)`, or `specmoe.zoo.load(name)`.\n")
    L.append("## Corpus\n")
    L.append("| domain | source | licence | train | held-out |")
    L.append("|---|---|---|---|---|")
    for name, c in m["corpus"].items():
        L.append(f"| {name} | {c['source']} | {c['licence']} (`{c['licence_file']}`) | "
                 f"{c['train_docs']} docs, {c['train_chars']:,} chars, {c['train_tokens']:,} tokens | "
                 f"{c['heldout_docs']} docs, {c['heldout_chars']:,} chars, "
                 f"{c['heldout_tokens']:,} tokens |")
    L.append(f"\nSplit by document: held-out when the first byte of SHA-256(relative path) < "
             f"{int(corpus_mod.HELDOUT_FRACTION * 256)} (about "
             f"{corpus_mod.HELDOUT_FRACTION:.0%}). Training sequences: {m['plan']['seq_len']} "
             f"tokens at seeded random offsets, {m['plan']['prose_share']:.0%} from prose.\n")
    L.append("## Training\n")
    L.append("| | steps | batch x length | peak lr | wall time | tokens seen |")
    L.append("|---|---|---|---|---|---|")
    for key, name in (("target", TARGET_NAME), ("draft", DRAFT_NAME)):
        r = m[key]
        planned = r["planned_steps"]
        steps = f"{r['steps']}" + (f" of {planned} (stopped by --max-minutes)" if r["steps"] != planned else "")
        L.append(f"| `{name}` | {steps} | {r['batch']} x {m['plan']['seq_len']} | {r['lr']} | "
                 f"{r['train_seconds'] / 60:.1f} min | {r['tokens_seen']:,} |")
    L.append(f"\nAdamW (betas 0.9/0.95, weight decay {m['plan']['weight_decay']}), "
             f"{m['plan']['warmup']} warm-up steps, cosine to 10%, gradient clip 1.0; the target "
             f"adds Mixtral's load-balancing loss x {m['plan']['t_aux_coef']}. Seed {m['seed']}, "
             f"{m['threads']} torch threads, deterministic algorithms. Total wall time of the "
             f"script: {m['wall_seconds'] / 60:.1f} min on {m['machine']}. Loss curves: "
             "`loss.png`.\n")
    L.append("## Held-out loss (nats/token)\n")
    L.append("| domain | tokens | unigram baseline | tiny-moe | tiny-draft |")
    L.append("|---|---|---|---|---|")
    for dom, e in m["heldout"].items():
        L.append(f"| {dom} | {e['tokens']:,} | {e['unigram']:.3f} | {e['target']:.3f} | "
                 f"{e['draft']:.3f} |")
    L.append("\nUnigram baseline: add-one-smoothed token frequencies of all training tokens, "
             "scored on the same predicted positions.\n")
    L.append("## Routing entropy of tiny-moe (held-out, nats)\n")
    L.append("| layer | domain | mean per-token router entropy | expert-load entropy | uniform log(E) |")
    L.append("|---|---|---|---|---|")
    for dom, layers in m["routing"].items():
        for r in layers:
            L.append(f"| {r['layer']} | {dom} | {r['token_entropy']:.3f} | "
                     f"{r['load_entropy']:.3f} | {r['uniform']:.3f} |")
    L.append("\nPer-token entropy: entropy of softmax(router logits) over the E experts, "
             "averaged over held-out tokens (a random-weight router sits at log E). "
             "Expert-load entropy: entropy of the share of top-k assignments each expert "
             "receives in the layer (log E means perfectly balanced load).\n")
    L.append("## Draft acceptance (greedy)\n")
    L.append("| held-out set | acceptance rate (per judged token) | accepted / judged | "
             "accepted / proposed (K) | tokens per target forward |")
    L.append("|---|---|---|---|---|")
    for dom, a in m["acceptance"].items():
        L.append(f"| {dom} | {a['acceptance_rate']:.1%} | {a['accepted']} / "
                 f"{a['accepted'] + a['rejected']} | {a['proposal_acceptance']:.1%} | "
                 f"{a['tokens_per_target_forward']:.2f} |")
    a0 = next(iter(m["acceptance"].values()))
    L.append(f"\nDefinition: {a0['prompts']} prompts of {a0['prompt_len']} held-out tokens per "
             f"set (seeded offsets); greedy speculative decoding of {a0['new_tokens']} new "
             f"tokens with K={a0['k']}: the draft proposes K tokens greedily, the target scores "
             "them in one forward pass, the longest prefix matching the target's argmax is "
             "accepted plus the target's token at the first mismatch (the output equals plain "
             "greedy decoding of the target). Acceptance rate = accepted draft tokens / judged "
             "draft tokens, where a round's tokens up to and including its first mismatch are "
             "judged and those after it are not (the per-token acceptance probability of "
             "the speculative-decoding literature). Accepted / proposed also counts the "
             "unjudged tail of each rejected proposal.\n")
    L.append("## Reproduce\n")
    L.append(f"`{m['command']}` (torch {m['versions']['torch']}, transformers "
             f"{m['versions']['transformers']}, tokenizers {m['versions']['tokenizers']}, "
             f"Python {m['versions']['python']}).\n")
    path.write_text("\n".join(L))


# ----------------------------------------------------------------------------- main

def step_seconds(model, plan: Plan, batch: int, aux: bool, steps: int, seed: int,
                 experts_impl: str | None) -> float:
    """Median wall time of one training step (after one warm-up step) on random tokens.
    Works on a deep copy, so the model itself and the global RNGs are left untouched."""
    import copy

    import torch

    model = copy.deepcopy(model)
    if aux and experts_impl:
        model.set_experts_implementation(experts_impl)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(seed)
    times = []
    for i in range(steps + 1):
        x = torch.from_numpy(rng.integers(0, plan.vocab, (batch, plan.seq_len)))
        t = time.perf_counter()
        kw = {"output_router_logits": True} if aux else {}
        model(input_ids=x, labels=x, **kw).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - t)
    return float(np.median(times))


def measure(plan: Plan, args) -> int:
    """Training tokens/s of the planned target and draft on random tokens (no corpus)."""
    from transformers import LlamaForCausalLM, MixtralForCausalLM

    res = {"threads": args.threads}
    for label, model, batch, aux in (
            ("target", MixtralForCausalLM(target_config(plan, 0)), plan.t_batch, True),
            ("draft", LlamaForCausalLM(draft_config(plan, 0)), plan.d_batch, False)):
        step_s = step_seconds(model, plan, batch, aux, args.measure, args.seed, args.experts_impl)
        planned = plan.t_steps if aux else plan.d_steps
        res[label] = {"params": n_params(model), "batch": batch, "seq_len": plan.seq_len,
                      "median_step_s": step_s, "tokens_per_s": batch * plan.seq_len / step_s,
                      "planned_steps": planned, "planned_minutes": planned * step_s / 60}
    print(json.dumps(res, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny slice, tiny models, temp dir")
    ap.add_argument("--out", type=Path, help=f"output folder (default {ZOO}; smoke: a new temp dir)")
    ap.add_argument("--cache", type=Path, default=HERE / ".cache", help="corpus download cache")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target-steps", type=int)
    ap.add_argument("--draft-steps", type=int)
    ap.add_argument("--target-minutes", type=float,
                    help="choose the target's step count from a measured step time (3 steps "
                         "on random tokens) to fill this many minutes; the card records the "
                         "steps, so --target-steps reproduces the run exactly")
    ap.add_argument("--draft-minutes", type=float, help="the same for the draft")
    ap.add_argument("--max-minutes", type=float, default=0.0,
                    help="safety stop per model (0: none); the card records an early stop")
    ap.add_argument("--experts-impl", default="grouped_mm",
                    help="transformers experts implementation used for training (the saved "
                         "config keeps the default)")
    ap.add_argument("--measure", type=int, default=0, metavar="STEPS",
                    help="only measure training throughput of the planned models on random "
                         "tokens for STEPS steps each (after one warm-up step), then exit")
    args = ap.parse_args(argv)

    import torch
    import tokenizers
    import transformers
    from transformers import AutoModelForCausalLM, LlamaForCausalLM, MixtralForCausalLM

    t_start = time.time()
    plan = Plan.smoke() if args.smoke else Plan()
    if args.target_steps is not None:
        plan.t_steps = args.target_steps
    if args.draft_steps is not None:
        plan.d_steps = args.draft_steps
    out = args.out or (None if args.measure else Path(tempfile.mkdtemp(prefix="specmoe-zoo-smoke-")) if args.smoke else ZOO)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    transformers.logging.set_verbosity_error()

    if args.measure:
        return measure(plan, args)
    print(f"[1/6] corpus -> {out}", flush=True)
    domains = corpus_mod.build(args.cache, smoke=args.smoke,
                               smoke_chars=plan.corpus_chars or 400_000)
    cinfo = corpus_mod.manifest(domains)
    print(f"[2/6] tokenizer (BPE, {plan.vocab})", flush=True)
    tok_dir = out / "_tokenizer"
    tok = train_tokenizer(domains, plan, tok_dir)
    eos_id = tok.convert_tokens_to_ids(EOS)
    train_streams = {k: encode_split(tok, d.train) for k, d in domains.items()}
    held_streams = {k: encode_split(tok, d.heldout) for k, d in domains.items()}
    for k in domains:
        cinfo[k]["train_tokens"] = int(len(train_streams[k]))
        cinfo[k]["heldout_tokens"] = int(len(held_streams[k]))
        print(f"  {k}: train {len(train_streams[k]):,} tokens, held-out "
              f"{len(held_streams[k]):,} tokens", flush=True)
    eval_full = {k: heldout_windows(s, plan.seq_len, plan.eval_tokens) for k, s in held_streams.items()}
    eval_during = {k: w[:max(1, plan.eval_tokens_during // plan.seq_len)] for k, w in eval_full.items()}

    print("[3/6] target (Mixtral layout)", flush=True)
    torch.manual_seed(args.seed)
    target = MixtralForCausalLM(target_config(plan, eos_id))
    sized = {}
    if args.target_minutes:
        st = step_seconds(target, plan, plan.t_batch, True, 3, args.seed, args.experts_impl)
        plan.t_steps = max(plan.warmup + 1, int(args.target_minutes * 60 / st))
        sized["target"] = st
        print(f"  measured {st:.2f} s/step -> {plan.t_steps} steps", flush=True)
    if args.experts_impl:
        target.set_experts_implementation(args.experts_impl)
    th, t_stop, t_secs = train_model(
        target, Sampler(train_streams, plan.prose_share, plan.seq_len, args.seed + 1),
        steps=plan.t_steps, batch=plan.t_batch, lr=plan.t_lr, plan=plan, evalsets=eval_during,
        label=TARGET_NAME, max_seconds=args.max_minutes * 60, aux=True)

    print("[4/6] draft (Llama layout, dense)", flush=True)
    torch.manual_seed(args.seed + 2)
    draft = LlamaForCausalLM(draft_config(plan, eos_id))
    if args.draft_minutes:
        st = step_seconds(draft, plan, plan.d_batch, False, 3, args.seed, None)
        plan.d_steps = max(plan.warmup + 1, int(args.draft_minutes * 60 / st))
        sized["draft"] = st
        print(f"  measured {st:.2f} s/step -> {plan.d_steps} steps", flush=True)
    dh, d_stop, d_secs = train_model(
        draft, Sampler(train_streams, plan.prose_share, plan.seq_len, args.seed + 3),
        steps=plan.d_steps, batch=plan.d_batch, lr=plan.d_lr, plan=plan, evalsets=eval_during,
        label=DRAFT_NAME, max_seconds=args.max_minutes * 60, aux=False)

    print("[5/6] save (bf16) and evaluate the saved weights", flush=True)
    t_dir, d_dir = out / TARGET_NAME, out / DRAFT_NAME
    if args.experts_impl:
        target.set_experts_implementation("eager")
    t_bytes = save_bf16(target, tok, t_dir)
    d_bytes = save_bf16(draft, tok, d_dir)
    shutil.rmtree(tok_dir, ignore_errors=True)
    target = AutoModelForCausalLM.from_pretrained(t_dir, dtype=torch.float32)
    draft = AutoModelForCausalLM.from_pretrained(d_dir, dtype=torch.float32)
    if args.experts_impl:
        target.set_experts_implementation(args.experts_impl)

    heldout, routing, accept = {}, {}, {}
    for k, w in eval_full.items():
        heldout[k] = {"tokens": int(w[:, 1:].size), "unigram": unigram_loss(train_streams, w, plan.vocab),
                      "target": heldout_loss(target, w), "draft": heldout_loss(draft, w)}
        routing[k] = routing_stats(target, w, plan.t_topk)
        accept[k] = acceptance(target, draft, held_streams[k], plan, args.seed + 10)
        print(f"  {k}: loss unigram {heldout[k]['unigram']:.3f} target {heldout[k]['target']:.3f} "
              f"draft {heldout[k]['draft']:.3f}; acceptance {accept[k]['acceptance_rate']:.1%}; "
              f"router entropy " + " ".join(f"{r['token_entropy']:.2f}" for r in routing[k])
              + f" (uniform {routing[k][0]['uniform']:.2f})", flush=True)

    print("[6/6] loss plot and model card", flush=True)
    plot({TARGET_NAME: th, DRAFT_NAME: dh}, out / "loss.png")
    tcfg, dcfg = target.config, draft.config
    expert_params = 3 * tcfg.hidden_size * tcfg.intermediate_size
    active = n_params(target) - tcfg.num_hidden_layers * (tcfg.num_local_experts - tcfg.num_experts_per_tok) * expert_params
    given = list(sys.argv[1:] if argv is None else argv)
    drop = {"--target-minutes", "--draft-minutes", "--target-steps", "--draft-steps"}
    kept = [a for i, a in enumerate(given) if a not in drop and (i == 0 or given[i - 1] not in drop)]
    cmd = " ".join(["python training/train.py", *kept, "--target-steps", str(plan.t_steps),
                    "--draft-steps", str(plan.d_steps)])
    metrics = {
        "smoke": args.smoke, "seed": args.seed, "threads": args.threads, "command": cmd,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__, "python": platform.python_version()},
        "plan": asdict(plan), "sized_from_step_seconds": sized, "corpus": cinfo, "tokenizer": {"vocab": len(tok)},
        "target": {"name": TARGET_NAME, "architecture": "MixtralForCausalLM", "params": n_params(target),
                   "active_params": int(active), "bytes": t_bytes, "steps": len(th["step"]),
                   "planned_steps": plan.t_steps, "batch": plan.t_batch, "lr": plan.t_lr,
                   "train_seconds": t_secs, "tokens_seen": len(th["step"]) * plan.t_batch * plan.seq_len,
                   "final_train_loss": th["loss"][-1], "config": {k: getattr(tcfg, k) for k in (
                       "num_hidden_layers", "num_local_experts", "num_experts_per_tok",
                       "hidden_size", "intermediate_size")}},
        "draft": {"name": DRAFT_NAME, "architecture": "LlamaForCausalLM", "params": n_params(draft),
                  "bytes": d_bytes, "steps": len(dh["step"]), "planned_steps": plan.d_steps,
                  "batch": plan.d_batch, "lr": plan.d_lr, "train_seconds": d_secs,
                  "tokens_seen": len(dh["step"]) * plan.d_batch * plan.seq_len,
                  "final_train_loss": dh["loss"][-1], "config": {k: getattr(dcfg, k) for k in (
                      "num_hidden_layers", "hidden_size", "intermediate_size")}},
        "heldout": heldout, "routing": routing, "acceptance": accept,
        "history": {TARGET_NAME: th, DRAFT_NAME: dh},
    }
    metrics["wall_seconds"] = time.time() - t_start
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    write_card(out / "MODEL_CARD.md", metrics)
    print(f"done in {metrics['wall_seconds'] / 60:.1f} min: {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
