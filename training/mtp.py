"""Train the multi-token-prediction adapter (gated LoRA + mask embeddings, specmoe.speculation.mtp) of the
zoo's tiny-moe on the zoo corpus, and measure what its card states.

The gamma-tolerance paper (section 4.3) adopts Samragh et al.'s multi-token prediction with
gated LoRA as its drafter.  Training here is self-distillation: every position t of a training
window is an anchor followed by k masks; mask j after anchor t learns the target's own
distribution for the token at t + j + 1 (the anchor at t + j's output in the same forward --
the anchors run on the base weights only, so they are the unmodified target and serve as the
teacher; speculative decoding accepts a draft exactly when it matches the target, not the
corpus).  Only the adapter trains; the target's weights are frozen.

    python training/mtp.py                    # full run, writes specmoe/zoo/tiny-moe-mtp/
    python training/mtp.py --smoke --out DIR  # a few steps on a tiny slice (tests)

Seeded; the length is a number of steps (``--max-minutes`` only a safety stop, reported in the
card if it fires).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))
import corpus as corpus_mod  # noqa: E402
import train as zoo_train  # noqa: E402

OUT_NAME = "tiny-moe-mtp"


def mtp_loss(adapter, model, x, k: int):
    """Self-distillation loss of one batch ``x`` [B, T] and the per-offset top-1 agreement.

    Mask j (1-based) after anchor t is scored against the anchor outputs at t + j (the target's
    distribution of token t + j + 1); positions past the window's end are left out."""
    import torch
    import torch.nn.functional as F

    B, T = x.shape
    anc, ml = adapter.forward_mtp(model, x, k)          # [B, T, V], [B, T, k, V]
    teacher = anc.detach().float()
    losses, agree = [], []
    for j in range(1, k + 1):
        n = T - j
        if n <= 0:
            break
        p = F.softmax(teacher[:, j:], -1)                   # targets for anchors 0..T-j-1
        logq = F.log_softmax(ml[:, :n, j - 1].float(), -1)
        losses.append(-(p * logq).sum(-1).mean())
        agree.append(float((ml[:, :n, j - 1].argmax(-1) == teacher[:, j:].argmax(-1))
                           .float().mean()))
    return torch.stack(losses).mean(), agree


def heldout_agreement(adapter, model, windows: np.ndarray, k: int, batch: int = 8) -> list:
    """Top-1 agreement of each mask offset with the target's argmax on held-out windows
    (teacher-forced: the context is the real text)."""
    import torch
    hits = np.zeros(k)
    cnt = np.zeros(k)
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            x = torch.from_numpy(windows[i:i + batch, :-1])
            anc, ml = adapter.forward_mtp(model, x, k)
            for j in range(1, k + 1):
                n = x.shape[1] - j
                a = ml[:, :n, j - 1].argmax(-1) == anc[:, j:].argmax(-1)
                hits[j - 1] += float(a.sum())
                cnt[j - 1] += a.numel()
    return (hits / np.maximum(cnt, 1)).tolist()


def acceptance_per_position(model, drafter, stream: np.ndarray, prompts: int, prompt_len: int,
                            new: int, k: int, seed: int) -> dict:
    """Greedy speculative decoding with the MTP drafter through specmoe.generate (StaticK(k)) on
    prompts cut from a held-out stream: acceptance per draft position j = accepted at j /
    judged at j (position j is judged when the first j-1 drafts were accepted)."""
    import torch
    import specmoe
    rng = np.random.default_rng(seed)
    judged = np.zeros(k)
    acc = np.zeros(k)
    tokens = iters = 0
    equal = True
    for _ in range(prompts):
        i = int(rng.integers(0, len(stream) - prompt_len))
        prompt = torch.from_numpy(stream[i:i + prompt_len].astype(np.int64))
        out = specmoe.generate(model, prompt, drafter=drafter, controller=specmoe.StaticK(k),
                               max_new_tokens=new, tau=None, eos_token_id=None)
        plain = specmoe.generate(model, prompt, max_new_tokens=new, eos_token_id=None)
        equal &= bool(torch.equal(out.sequences, plain.sequences))
        for it in out.iterations:
            kd, n = it["k"], it["accepted"]
            for j in range(1, kd + 1):
                if n >= j - 1:
                    judged[j - 1] += 1
                    acc[j - 1] += n >= j
        tokens += out.stats["new_tokens"]
        iters += out.stats["iterations"]
    return {"per_position": (acc / np.maximum(judged, 1)).tolist(),
            "judged": judged.astype(int).tolist(), "accepted": acc.astype(int).tolist(),
            "acceptance_rate": float(acc.sum() / max(1, judged.sum())),
            "tokens_per_target_forward": tokens / max(1, iters),
            "output_equals_plain_greedy": equal,
            "prompts": prompts, "prompt_len": prompt_len, "new_tokens": new, "k": k}


def plot(hist: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    ax[0].plot(hist["step"], hist["loss"], lw=0.8)
    ax[0].set_xlabel("step")
    ax[0].set_ylabel("distillation loss (nats)")
    ax[0].set_title("MTP adapter: training loss")
    agree = np.asarray(hist["agree"])
    for j in range(agree.shape[1]):
        w = min(25, len(agree))
        sm = np.convolve(agree[:, j], np.ones(w) / w, mode="valid")
        ax[1].plot(np.arange(len(sm)) + w - 1, sm, label=f"mask {j + 1} (offset +{j + 2})")
    ax[1].set_xlabel("step")
    ax[1].set_ylabel("top-1 agreement with target")
    ax[1].set_title("training batches (moving mean)")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_card(path: Path, m: dict) -> None:
    a = m["config"]
    lines = [
        "# tiny-moe-mtp: multi-token-prediction adapter (gated LoRA) for tiny-moe",
        "",
        "Every figure below was measured by `training/mtp.py` in the run that produced this "
        "adapter.",
        "",
        "## What it is",
        "",
        f"The drafter of the gamma-tolerance paper (section 4.3, after Samragh et al. 2025): "
        f"k = {a['k']} learned mask embeddings and LoRA adapters (rank {a['rank']}, alpha "
        f"{a['alpha']:g}) on the attention projections ({', '.join(a['targets'])}) of all "
        f"{a['base_num_layers']} layers of `tiny-moe`, gated per position "
        "(Y = XW + (g * X) A B^T, g = 1 on masks only), so that real tokens run the unmodified "
        "target.  One forward of the target verifies the last drafts and proposes the next k "
        f"({m['params']:,} adapter parameters, float32).  Use:",
        "",
        "```python",
        "from specmoe import zoo, mtp, generate",
        "model, tok = zoo.load('tiny-moe')",
        "drafter = mtp.MtpDrafter(model, zoo.root() / 'tiny-moe-mtp')",
        "out = generate(model, ids, drafter=drafter)",
        "```",
        "",
        "## Training",
        "",
        "Self-distillation on the zoo corpus (training splits, 30% prose): each position of a "
        f"{m['seq_len']}-token window is an anchor followed by k masks; mask j learns the "
        "target's distribution at offset j + 1 (cross-entropy to the anchors' softmax in the "
        "same forward).  Target frozen.",
        "",
        "| steps | batch x length | peak lr | wall time | seed | threads |",
        "|---|---|---|---|---|---|",
        f"| {m['steps_done']} of {m['steps']}"
        + (" (stopped by --max-minutes)" if m["stopped_at"] else "")
        + f" | {m['batch']} x {m['seq_len']} | {m['lr']} | {m['train_minutes']:.1f} min | "
          f"{m['seed']} | {m['threads']} |",
        "",
        "## Held-out top-1 agreement with the target (teacher-forced)",
        "",
        "| domain | " + " | ".join(f"mask {j + 1} (offset +{j + 2})" for j in range(a["k"]))
        + " |",
        "|---|" + "---|" * a["k"],
    ]
    for d, v in m["agreement"].items():
        lines.append(f"| {d} | " + " | ".join(f"{x:.1%}" for x in v) + " |")
    lines += [
        "",
        "Fraction of held-out positions where mask j's argmax equals the target's own argmax "
        f"for that token, given the real text as context ({m['eval_tokens']} tokens per "
        "domain).",
        "",
        "## Acceptance per draft position (greedy speculative decoding)",
        "",
        "| held-out set | " + " | ".join(f"draft {j + 1}" for j in range(a["k"]))
        + " | overall | tokens per target forward | output = plain greedy |",
        "|---|" + "---|" * (a["k"] + 3),
    ]
    for d, r in m["acceptance"].items():
        lines.append(f"| {d} | " + " | ".join(
            f"{x:.1%} ({acc}/{jd})" for x, acc, jd in zip(r["per_position"], r["accepted"],
                                                          r["judged"]))
            + f" | {r['acceptance_rate']:.1%} | {r['tokens_per_target_forward']:.2f} | "
              f"{r['output_equals_plain_greedy']} |")
    r0 = next(iter(m["acceptance"].values()))
    lines += [
        "",
        f"{r0['prompts']} prompts of {r0['prompt_len']} held-out tokens per set (seeded "
        f"offsets), {r0['new_tokens']} new tokens each through `specmoe.generate` with "
        f"`StaticK({a['k']})`; draft j is judged when drafts 1..j-1 were accepted.  The first "
        "iteration of each request has no drafts (no masks have run yet).  Tokens per target "
        "forward counts every emitted token; each forward has (K+1)(k+1) positions.",
        "",
        "## Reproduce",
        "",
        f"`{m['command']}` ({m['versions']}).",
        "",
    ]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="a few steps on a tiny slice, temp dir")
    ap.add_argument("--out", type=Path, help="output folder (default specmoe/zoo/tiny-moe-mtp; "
                                             "smoke: a new temp dir)")
    ap.add_argument("--base", type=Path, default=None,
                    help="folder of the target (default: the zoo's tiny-moe)")
    ap.add_argument("--cache", type=Path, default=HERE / ".cache", help="corpus download cache")
    ap.add_argument("--k", type=int, default=3, help="masks per anchor (draft length)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-minutes", type=float, default=55.0,
                    help="safety stop (the card reports it if it fires); 0: none")
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--accept-prompts", type=int, default=24)
    a = ap.parse_args(argv)
    for name in ("k", "rank", "steps", "batch", "seq_len", "threads"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")

    import torch
    from tqdm import tqdm
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    from specmoe.speculation import mtp
    from specmoe import zoo

    if a.smoke:
        a.steps, a.batch, a.seq_len, a.warmup = 3, 2, 24, 1
        a.eval_tokens, a.accept_prompts = 256, 1
    out = a.out or (Path(tempfile.mkdtemp(prefix="mtp-smoke-")) if a.smoke
                    else zoo.root() / OUT_NAME)
    base = a.base or zoo.path("tiny-moe")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32,
                                                 local_files_only=True)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(base, local_files_only=True)

    t_all = time.time()
    domains = corpus_mod.build(a.cache, smoke=a.smoke, smoke_chars=100_000)
    streams = {n: zoo_train.encode_split(tok, d.train) for n, d in domains.items()}
    held = {n: zoo_train.encode_split(tok, d.heldout) for n, d in domains.items()}
    sampler = zoo_train.Sampler(streams, 0.3, a.seq_len, a.seed)

    adapter = mtp.MtpAdapter.for_model(model, k=a.k, rank=a.rank, alpha=a.alpha, seed=a.seed)
    params = adapter.trainable()
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    hist: dict = {"step": [], "loss": [], "agree": []}
    t0 = time.time()
    stopped_at = None
    bar = tqdm(range(a.steps), desc="train mtp", unit="step", mininterval=2.0)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = zoo_train.lr_at(step, a.steps, a.lr, a.warmup)
        x, _ = sampler.batch(a.batch)
        loss, agree = mtp_loss(adapter, model, x, a.k)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        hist["step"].append(step)
        hist["loss"].append(float(loss))
        hist["agree"].append(agree)
        bar.set_postfix(loss=f"{float(loss):.3f}",
                        agree="/".join(f"{v:.2f}" for v in agree), refresh=False)
        if a.max_minutes and time.time() - t0 > a.max_minutes * 60 and step + 1 < a.steps:
            stopped_at = step + 1
            bar.write(f"--max-minutes reached after {stopped_at} of {a.steps} steps")
            break
    bar.close()
    train_s = time.time() - t0

    # the adapter as saved is what is measured
    out.mkdir(parents=True, exist_ok=True)
    adapter.save(out)
    adapter.uninstall()
    adapter = mtp.MtpAdapter.load(out, model)
    wl = max(a.seq_len, 32)
    agreement = {}
    accept = {}
    for n, s in held.items():
        w = zoo_train.heldout_windows(s, wl, a.eval_tokens)
        agreement[n] = heldout_agreement(adapter, model, w, a.k)
        accept[n] = acceptance_per_position(
            model, mtp.MtpDrafter(model, adapter), s, a.accept_prompts,
            16 if a.smoke else 64, 8 if a.smoke else 64, a.k, a.seed + 1)
    import tokenizers
    import transformers
    m = {"config": json.loads((out / mtp.CONFIG_FILE).read_text()),
         "params": int(sum(p.numel() for p in adapter.trainable())),
         "steps": a.steps, "steps_done": len(hist["step"]), "stopped_at": stopped_at,
         "batch": a.batch, "seq_len": a.seq_len, "lr": a.lr, "seed": a.seed,
         "threads": a.threads, "train_minutes": train_s / 60,
         "total_minutes": (time.time() - t_all) / 60,
         "eval_tokens": a.eval_tokens, "agreement": agreement, "acceptance": accept,
         "final_train_loss": float(np.mean(hist["loss"][-20:])),
         "command": " ".join(["python training/mtp.py"] + [
             x for x in (sys.argv[1:] if argv is None else argv)]),
         "versions": f"torch {torch.__version__}, transformers {transformers.__version__}, "
                     f"tokenizers {tokenizers.__version__}, Python {platform.python_version()}, "
                     f"{platform.machine()}"}
    (out / "metrics.json").write_text(json.dumps({**m, "history": hist}, indent=1) + "\n")
    plot(hist, out / "loss.png")
    write_card(out / "MODEL_CARD.md", m)
    print(json.dumps({k: m[k] for k in ("steps_done", "train_minutes", "agreement",
                                        "final_train_loss")}, indent=1))
    for n, r in accept.items():
        print(n, "acceptance per position", [round(v, 3) for v in r["per_position"]],
              "tokens/forward", round(r["tokens_per_target_forward"], 2),
              "equal plain", r["output_equals_plain_greedy"])
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
