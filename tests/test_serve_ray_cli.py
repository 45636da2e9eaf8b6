"""``specmoe serve --ray`` from the command line (issue 38, item 6): the process starts a local
Ray instance and two replicas behind Ray Serve's proxy; concurrent requests from the official
openai client spread over both replicas (``x-specmoe-replica``), every response, streamed or
not, equal to model.generate's greedy output for its prompt alone (with speculation on: the
zoo's draft model, loaded by each replica from its folder); SIGTERM ends the process with
status 0.  (One Ray start for the whole file: starting Ray is most of its time.)"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
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
pytestmark = [pytest.mark.skipif(not (ZOO / "model.safetensors").is_file(),
                                 reason="zoo weights not shipped in this build"),
              pytest.mark.slow]  # make test-slow (Makefile)
PROMPTS = ["def parse(line):\n    return line\n\n\ndef parse(line):", "import os\nimport sys\n",
           "The quick brown fox", "class Parser:\n    def __init__(self):",
           "for i in range(10):", "x = [1, 2, 3]"]
N = 16


def test_cli_serve_ray_answers_and_exits_on_sigterm(tmp_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(ZOO))
    store = tmp_path / "zoo.smoe"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = specmoe.from_pretrained(str(ZOO), cache="25%", dtype="f32", store=str(store))
        want = {}
        for p in PROMPTS:
            ids = tok(p).input_ids
            x = torch.tensor([ids])
            ref = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=N, pad_token_id=tok.eos_token_id)
            want[p] = tok.decode(ref[0, len(ids):], skip_special_tokens=True)
        specmoe.engine_of(model).close()
    finally:
        torch.set_num_threads(threads)
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RAY_ADDRESS", None)  # a local instance of its own
    proc = subprocess.Popen([sys.executable, "-m", "specmoe", "serve", str(ZOO), "--ray",
                             "--replicas", "2", "--port", str(port), "--threads", "1",
                             "--dtype", "f32", "--store", str(store), "--drafter", "model",
                             "--draft-model", str(ZOO.parent / "tiny-draft"),
                             "--controller", "static:3", "--model-name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=str(ROOT), env=env)
    lines: list[str] = []  # the process's output, read as it comes

    def read() -> None:
        for ln in proc.stdout:
            lines.append(ln)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    base = f"http://127.0.0.1:{port}"
    try:
        # up when the CLI says so (serve.run returned: both replicas ready), not at the first
        # /health answer, which one replica already gives
        t0 = time.time()
        while not any("[specmoe] serving" in ln for ln in list(lines)):
            assert proc.poll() is None, "".join(lines)[-3000:]
            assert time.time() - t0 < 120, "specmoe serve --ray did not come up"
            time.sleep(0.3)
        assert httpx.get(base + "/health", timeout=10).status_code == 200
        print(f"up after {time.time() - t0:.1f} s")
        c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        got, replicas, accepted, errors = {}, [], [], []

        def one(i, prompt):
            try:
                raw = c.completions.with_raw_response.create(model="tiny", prompt=prompt,
                                                             max_tokens=N, temperature=0)
                r = raw.parse()
                replicas.append(raw.headers.get("x-specmoe-replica"))
                got[(i, prompt)] = r.choices[0].text
                d = r.usage.completion_tokens_details  # the drafter reached the replica
                accepted.append(d.accepted_prediction_tokens if d is not None else None)
            except Exception as e:  # noqa: BLE001 (reported below)
                errors.append(repr(e))

        jobs = [(i, p) for i in range(3) for p in PROMPTS]
        ths = [threading.Thread(target=one, args=j) for j in jobs]
        for t in ths:
            t.start()
        for t in ths:
            t.join(180)
        assert not errors, errors
        assert len(got) == len(jobs)
        for (i, p), text in got.items():
            assert text == want[p], p
        assert None not in replicas and len(set(replicas)) == 2, replicas
        assert None not in accepted and sum(accepted) > 0, accepted
        # streaming goes through Ray's proxy too
        text = "".join(ch.choices[0].text for ch in c.completions.create(
            model="tiny", prompt=PROMPTS[0], max_tokens=N, temperature=0, stream=True))
        assert text == want[PROMPTS[0]]
        t1 = time.time()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
        reader.join(10)
        out = "".join(lines)
        assert proc.returncode == 0, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
        print(f"exited {time.time() - t1:.1f} s after SIGTERM")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
