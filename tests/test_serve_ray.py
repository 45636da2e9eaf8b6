"""specmoe serve on Ray Serve (issue 38, item 6): two replicas of the zoo model on a local Ray
cluster that the test starts and stops; concurrent requests from the official openai client
spread over both replicas (``x-specmoe-replica``), every response equal to model.generate's
greedy output for its prompt alone."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

import specmoe  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from specmoe.serve.ray import deployment  # noqa: E402

ZOO = Path(__file__).resolve().parent.parent / "specmoe" / "zoo" / "tiny-moe"
pytestmark = pytest.mark.skipif(not (ZOO / "model.safetensors").is_file(),
                                reason="zoo weights not shipped in this build")
PROMPTS = ["def parse(line):", "import os\nimport sys\n", "The quick brown fox",
           "class Parser:\n    def __init__(self):", "for i in range(10):", "x = [1, 2, 3]"]
N = 10



@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    store = tmp_path_factory.mktemp("ray-store") / "zoo.smoe"
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(ZOO))
    # the references (one thread, as each replica runs), and the store both replicas read
    # (converted once, here)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = specmoe.from_pretrained(str(ZOO), cache="25%", dtype="f32", store=str(store))
    refs = {}
    for p in PROMPTS:
        ids = tok(p).input_ids
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=N, pad_token_id=tok.eos_token_id)
        refs[p] = tok.decode(out[0, len(ids):], skip_special_tokens=True)
    specmoe.engine_of(model).close()
    torch.set_num_threads(threads)
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="error",
             object_store_memory=100 * 1024 * 1024,
             runtime_env={"env_vars": {"SPECMOE_CACHE": os.environ.get("SPECMOE_CACHE", "")}}
             if os.environ.get("SPECMOE_CACHE") else None)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(deployment(ZOO, replicas=2, num_cpus=0.5, threads=1, cache="25%",
                             dtype="f32", store=str(store), model_name="tiny-moe"),
                  blocking=False)
        yield {"base": f"http://127.0.0.1:{port}", "refs": refs}
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_share_concurrent_requests_and_answer_exactly(cluster):
    client = openai.OpenAI(base_url=cluster["base"] + "/v1", api_key="none", max_retries=0,
                           timeout=120)
    got, replicas, errors = {}, [], []

    def one(i, prompt):
        try:
            raw = client.completions.with_raw_response.create(
                model="tiny-moe", prompt=prompt, max_tokens=N, temperature=0)
            replicas.append(raw.headers.get("x-specmoe-replica"))
            got[(i, prompt)] = raw.parse().choices[0].text
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(repr(e))

    jobs = [(i, p) for i in range(3) for p in PROMPTS]
    ths = [threading.Thread(target=one, args=j) for j in jobs]
    for t in ths:
        t.start()
    for t in ths:
        t.join(180)
    assert not errors, errors
    for (i, p), text in got.items():
        assert text == cluster["refs"][p], p
    assert len(got) == len(jobs)
    assert None not in replicas and len(set(replicas)) == 2, replicas
    # streaming goes through Ray's proxy too
    text = "".join(ch.choices[0].text for ch in client.completions.create(
        model="tiny-moe", prompt=PROMPTS[0], max_tokens=N, temperature=0, stream=True))
    assert text == cluster["refs"][PROMPTS[0]]


def test_deployment_arguments_are_checked():
    with pytest.raises(ValueError, match="replicas"):
        deployment(ZOO, replicas=0)
    with pytest.raises(ValueError, match="either"):
        deployment(ZOO, replicas=2, autoscaling={"max_replicas": 2})
    with pytest.raises(FileNotFoundError):
        deployment(ZOO / "missing", replicas=1)
