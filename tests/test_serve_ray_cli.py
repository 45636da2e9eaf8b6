"""``specmoe serve --ray`` from the command line (issue 38, item 6): the process starts a local
Ray instance and a replica behind Ray Serve's proxy, answers the official openai client
exactly (with n-gram speculation on, passed through to the replica), tags the response with
its replica, and exits 0 on SIGTERM.  A file of its own: it must not meet the in-process
cluster of tests/test_serve_ray.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("ray")
pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

import specmoe  # noqa: E402
from tests.conftest import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ZOO = ROOT / "specmoe" / "zoo" / "tiny-moe"
pytestmark = pytest.mark.skipif(not (ZOO / "model.safetensors").is_file(),
                                reason="zoo weights not shipped in this build")
PROMPT, N = "def parse(line):\n    return line\n\n\ndef parse(line):", 16


def test_cli_serve_ray_answers_and_exits_on_sigterm(tmp_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(ZOO))
    store = tmp_path / "zoo.smoe"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = specmoe.from_pretrained(str(ZOO), cache="25%", dtype="f32", store=str(store))
        ids = tok(PROMPT).input_ids
        x = torch.tensor([ids])
        ref = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=N, pad_token_id=tok.eos_token_id)
        want = tok.decode(ref[0, len(ids):], skip_special_tokens=True)
        specmoe.engine_of(model).close()
    finally:
        torch.set_num_threads(threads)
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RAY_ADDRESS", None)  # a local instance of its own
    proc = subprocess.Popen([sys.executable, "-m", "specmoe", "serve", str(ZOO), "--ray",
                             "--port", str(port), "--threads", "1", "--dtype", "f32",
                             "--store", str(store), "--drafter", "ngram",
                             "--controller", "static:3", "--model-name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=str(ROOT), env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.time() - t0 < 120, "specmoe serve --ray did not come up"
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
        raw = c.completions.with_raw_response.create(model="tiny", prompt=PROMPT,
                                                     max_tokens=N, temperature=0)
        r = raw.parse()
        assert r.choices[0].text == want
        assert raw.headers.get("x-specmoe-replica")
        d = r.usage.completion_tokens_details          # the drafter reached the replica
        assert d is not None and d.accepted_prediction_tokens > 0
        t1 = time.time()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
        print(f"exited {time.time() - t1:.1f} s after SIGTERM")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
