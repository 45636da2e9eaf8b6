"""specmoe.serve.ray.deployment's arguments (issue 38, item 6), checked before Ray starts.  The
deployment itself, two replicas on a local Ray instance answering concurrent openai requests
exactly, is tests/test_serve_ray_cli.py (through ``specmoe serve --ray``, one Ray start)."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("ray.serve")
pytest.importorskip("starlette")

from specmoe.serve.ray import deployment  # noqa: E402

ZOO = Path(__file__).resolve().parent.parent / "specmoe" / "zoo" / "tiny-moe"
pytestmark = pytest.mark.skipif(not (ZOO / "model.safetensors").is_file(),
                                reason="zoo weights not shipped in this build")


def test_deployment_arguments_are_checked():
    with pytest.raises(ValueError, match="replicas"):
        deployment(ZOO, replicas=0)
    with pytest.raises(ValueError, match="either"):
        deployment(ZOO, replicas=2, autoscaling={"max_replicas": 2})
    with pytest.raises(FileNotFoundError):
        deployment(ZOO / "missing", replicas=1)
    with pytest.raises(FileNotFoundError, match="draft model not found"):
        deployment(ZOO, replicas=1, draft_model=ZOO.parent / "tiny-moe-mtp")
    with pytest.raises(ValueError, match="either drafter or draft_model"):
        deployment(ZOO, replicas=1, drafter="ngram", draft_model=ZOO.parent / "tiny-draft")
