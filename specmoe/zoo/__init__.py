"""The specmoe model zoo: a small trained MoE target and a dense draft that ship inside the
package, so that the demo, the tests and the benchmarks have real routing and real text.

Each model is a folder in the standard HuggingFace layout (``config.json``,
``model.safetensors``, ``tokenizer.json``) beside ``MODEL_CARD.md``; they are produced by
``training/train.py`` and load offline::

    from specmoe import zoo
    model, tokenizer = zoo.load("tiny-moe")      # MixtralForCausalLM, 16 experts, top-2
    draft, _ = zoo.load("tiny-draft")            # LlamaForCausalLM, same tokenizer

or directly with ``AutoModelForCausalLM.from_pretrained(zoo.path("tiny-moe"))``.
``tiny-moe-mtp/`` beside them is tiny-moe's multi-token-prediction adapter
(:class:`specmoe.speculation.mtp.MtpDrafter`, ``training/mtp.py``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["NAMES", "ZooError", "root", "path", "available", "load"]

#: Models the zoo knows about (whether or not their weights are present).
NAMES: tuple[str, ...] = ("tiny-moe", "tiny-draft")

_ROOT = Path(__file__).resolve().parent
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json")


class ZooError(FileNotFoundError):
    """A zoo model is unknown, or its files are not in the package."""


def root() -> Path:
    """The folder holding the zoo models and MODEL_CARD.md."""
    return _ROOT


def _check_name(name: str) -> None:
    if not isinstance(name, str):
        raise TypeError(f"zoo model name must be a str, not {type(name).__name__}")
    if name not in NAMES:
        raise ZooError(f"unknown zoo model {name!r}; known: {', '.join(NAMES)}")


def _missing(folder: Path) -> list[str]:
    return [f for f in _REQUIRED if not (folder / f).is_file()]


def available(name: str, base: str | Path | None = None) -> bool:
    """True when the model's config, weights and tokenizer are all present."""
    _check_name(name)
    return not _missing(Path(base) / name if base is not None else _ROOT / name)


def path(name: str, base: str | Path | None = None) -> Path:
    """Folder of zoo model ``name`` (under ``base`` if given, else inside the package).

    Raises ZooError naming the missing files when the model's weights are absent."""
    _check_name(name)
    folder = (Path(base) if base is not None else _ROOT) / name
    missing = _missing(folder)
    if missing:
        raise ZooError(
            f"zoo model {name!r} is not available: {folder} lacks {', '.join(missing)}. "
            f"Produce it with `python training/train.py` (about 90 minutes on 2 cores) or "
            f"install a specmoe build that ships the zoo weights.")
    return folder


def load(name: str, base: str | Path | None = None, *, dtype: Any = None,
         experts_implementation: str | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) of zoo model ``name``, loaded offline with transformers.

    dtype: torch dtype for the weights (default float32; the files are bf16).
    experts_implementation: forwarded to transformers for MoE models (e.g. "eager")."""
    folder = path(name, base)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"dtype": dtype if dtype is not None else torch.float32,
                              "local_files_only": True}
    if experts_implementation is not None:
        kwargs["experts_implementation"] = experts_implementation
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model, tokenizer
