"""The command line's failures: every one ends with ONE line ``specmoe: error: ...`` on stderr
naming the file, field or option at fault, and a non-zero exit, never a traceback (``--debug``
shows it); argparse's usage errors stay as they are (exit 2).  Also the command line's
consistency with the API: ``--cache`` text means what ``cache=`` means, ``run --policy`` takes
simulate's policy specs, empty option lists are refused, and traces with an expert id repeated
within a (token, layer) row are refused wherever a trace is built.

Most cases call ``specmoe.cli.main`` in-process (fast); one per command runs
``python -m specmoe`` in a subprocess to show that no traceback reaches the terminal."""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specmoe import Trace, TraceError, load_puffin, load_trace
import specmoe.cli as cli
from specmoe.cli import main
from tests.conftest import SUBSET

ZOO = Path(__file__).resolve().parent.parent / "specmoe" / "zoo" / "tiny-moe"
need_zoo = pytest.mark.skipif(not (ZOO / "model.safetensors").is_file(),
                              reason="zoo weights not shipped in this build")


# -- helpers -----------------------------------------------------------------------------------

def _last_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines, "nothing on stderr"
    return lines[-1]


def _assert_one_line(code, err: str, *names: str) -> str:
    """Non-zero exit, no traceback, the last stderr line is the error naming each of names."""
    assert code not in (0, None), err
    assert isinstance(code, int), f"exit code {code!r}"
    assert "Traceback" not in err, err
    last = _last_line(err)
    assert last.startswith("specmoe: error: "), err
    for n in names:
        assert n in last, f"{n!r} not in {last!r}"
    return last


def _cli(argv, capsys):
    """main(argv) in-process: (exit code, stderr)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in argv])
    return exc.value.code, capsys.readouterr().err


def _sub(argv, tmp_path, **env):
    """python -m specmoe argv in a subprocess (cwd tmp_path): (exit code, stderr)."""
    e = dict(os.environ, SPECMOE_CACHE=str(tmp_path / "cache"), **env)
    r = subprocess.run([sys.executable, "-m", "specmoe", *map(str, argv)], capture_output=True,
                       text=True, env=e, cwd=tmp_path, timeout=300)
    return r.returncode, r.stderr


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("SPECMOE_CACHE", str(d))
    return d


@pytest.fixture
def zoo_copy(tmp_path):
    """A private copy of the zoo model folder (tests may damage it)."""
    if not (ZOO / "model.safetensors").is_file():
        pytest.skip("zoo weights not shipped in this build")
    dst = tmp_path / "tiny-moe"
    shutil.copytree(ZOO, dst)
    return dst


def _truncate(folder: Path) -> Path:
    shard = folder / "model.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(1_000_000)
    return shard


def _inconsistent(folder: Path) -> Path:
    """The header's last tensor claims 4 KiB more than the file holds (and than its shape)."""
    shard = folder / "model.safetensors"
    b = shard.read_bytes()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    last = max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][1])
    h[last]["data_offsets"][1] += 4096
    hs = json.dumps(h).encode()
    hs += b" " * (-len(hs) % 8)
    shard.write_bytes(struct.pack("<Q", len(hs)) + hs + b[8 + n:])
    return shard


def _bad_npz(tmp_path: Path) -> Path:
    p = tmp_path / "bad.npz"
    p.write_bytes(b"PK\x03\x04 not a zip at all")
    return p


# -- item 5: convert ---------------------------------------------------------------------------

def test_convert_truncated_shard_subprocess(zoo_copy, tmp_path):
    shard = _truncate(zoo_copy)
    code, err = _sub(["convert", zoo_copy, "--quiet"], tmp_path)
    _assert_one_line(code, err, str(shard))


def test_convert_inconsistent_shard(zoo_copy, cache_env, capsys):
    shard = _inconsistent(zoo_copy)
    code, err = _cli(["convert", zoo_copy, "--quiet"], capsys)
    _assert_one_line(code, err, str(shard))


@pytest.mark.parametrize("command", ["convert", "run"])
def test_config_not_json(zoo_copy, cache_env, capsys, command):
    (zoo_copy / "config.json").write_text("{nope")
    argv = [command, zoo_copy] + (["--prompt", "x"] if command == "run" else ["--quiet"])
    code, err = _cli(argv, capsys)
    _assert_one_line(code, err, str(zoo_copy / "config.json"), "not valid JSON")


@pytest.mark.parametrize("command", ["convert", "run"])
def test_cache_dir_is_a_regular_file(zoo_copy, tmp_path, monkeypatch, capsys, command):
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    monkeypatch.setenv("SPECMOE_CACHE", str(f))
    argv = [command, zoo_copy] + (["--prompt", "x"] if command == "run" else ["--quiet"])
    code, err = _cli(argv, capsys)
    _assert_one_line(code, err, str(f), "not a directory")


def test_cache_dir_read_only(zoo_copy, monkeypatch, capsys):
    """Root may write into a chmod-ed directory, so the read-only place is sysfs, where not
    even root may make a directory."""
    ro = Path("/sys/specmoe-test-cache")
    try:
        os.mkdir(ro)
    except OSError:
        pass
    else:
        os.rmdir(ro)
        pytest.skip("/sys is writable here: no read-only location to test with")
    monkeypatch.setenv("SPECMOE_CACHE", str(ro))
    code, err = _cli(["convert", zoo_copy, "--quiet"], capsys)
    _assert_one_line(code, err, str(ro))


@pytest.mark.parametrize("make, names", [
    (lambda d: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(d / "s.smoe")),
     ["s.smoe", os.strerror(errno.ENOSPC)]),
    (lambda d: PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(d / "s.smoe")),
     ["s.smoe", os.strerror(errno.EACCES)]),
    (lambda d: json.JSONDecodeError("Expecting value", "x", 0), ["tiny-moe", "invalid JSON"]),
    (lambda d: __import__("specmoe").StoreError(f"{d / 's.smoe'}: bad magic"),
     ["s.smoe", "bad magic"]),
    (lambda d: TypeError("dtype must be a str"), ["dtype must be a str"]),
    (lambda d: RuntimeError("something\nbroke"), ["RuntimeError: something broke"]),
], ids=["ENOSPC", "EACCES", "JSONDecodeError", "StoreError", "TypeError", "other"])
def test_errors_from_below_become_one_line(zoo_copy, cache_env, monkeypatch, capsys, make,
                                           names):
    """What the conversion may raise (a full disk, a file it may not write, ...) comes out as
    the one line, with the file named where the exception has one."""
    import specmoe.models.pretrained

    def convert(*a, **kw):
        raise make(zoo_copy)

    monkeypatch.setattr(specmoe.models.pretrained, "convert", convert)
    code, err = _cli(["convert", zoo_copy, "--quiet"], capsys)
    _assert_one_line(code, err, *names)


def test_run_truncated_shard(zoo_copy, cache_env, capsys):
    shard = _truncate(zoo_copy)
    code, err = _cli(["run", zoo_copy, "--prompt", "x", "--max-new-tokens", "1"], capsys)
    _assert_one_line(code, err, str(shard))


def test_run_threads_above_the_pool_limit_refused_at_parse_time(capsys):
    assert cli.MAX_THREADS == 1024  # csrc/kernels/pool.c, csrc/bindings/py_kernels.c
    code, err = _cli(["run", "no-such-ckpt", "--prompt", "x", "--threads", "1025"], capsys)
    assert code == 2 and "--threads: must be <= 1024" in err and "Traceback" not in err
    assert "no-such-ckpt" not in err  # refused before the checkpoint is looked at


def test_every_option_of_every_command_says_what_it_does():
    """`specmoe <command> --help` documents each option (three had no help text)."""
    import argparse

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"{name} {a.option_strings[-1] if a.option_strings else a.dest}"
               for name, p in sub.choices.items() for a in p._actions
               if not a.help and a.help is not argparse.SUPPRESS]
    assert sub.choices and not missing, missing


def test_run_empty_prompt_refused_before_loading(zoo_copy, cache_env, capsys):
    code, err = _cli(["run", zoo_copy, "--prompt", ""], capsys)
    _assert_one_line(code, err, "--prompt is empty")
    assert not cache_env.exists() or not any(cache_env.iterdir())  # nothing converted


@pytest.mark.parametrize("argv, what", [
    (["--gpu-cache", "1GiB"], "--gpu-cache: the hybrid tier needs --device cuda"),
    (["--device", "tpu"], "--device 'tpu'"),
    (["--device", "cuda", "--gpu-cache", "5xb"], "--gpu-cache"),
])
def test_run_device_options_refused_before_loading(zoo_copy, cache_env, capsys, argv, what):
    """The GPU tier's options of ``run`` (issue 37): named errors before anything loads."""
    code, err = _cli(["run", zoo_copy, "--prompt", "x"] + argv, capsys)
    _assert_one_line(code, err, what)
    assert not cache_env.exists() or not any(cache_env.iterdir())


@pytest.mark.parametrize("argv, what", [
    (["--drafter", "ngram", "--controller", "fast"], "--controller 'fast'"),
    (["--drafter", "mtp"], "--drafter mtp needs --mtp-adapter"),
    (["--mtp-adapter", "somewhere"], "--mtp-adapter goes with --drafter mtp"),
    (["--drafter", "model"], "--drafter model needs --draft-model"),
    (["--draft-model", "somewhere"], "--draft-model goes with --drafter model"),
    (["--drafter", "model", "--draft-model", "nowhere"], "--draft-model nowhere: no config.json"),
])
def test_run_speculation_options_refused_before_loading(zoo_copy, cache_env, capsys, argv,
                                                        what):
    code, err = _cli(["run", zoo_copy, "--prompt", "x"] + argv, capsys)
    _assert_one_line(code, err, what)
    assert not cache_env.exists() or not any(cache_env.iterdir())


@need_zoo
def test_run_with_a_drafter_prints_plain_decodings_text(cache_env, capsys):
    """run --drafter: speculative decoding from the command line, its text that of plain
    greedy decoding (n-gram drafts on a prompt that repeats itself, accepted; the MTP adapter
    shipped with the zoo model and the zoo's draft model, at a fixed K), the drafts counted
    on the statistics line."""
    prompt = "import os\nimport sys\nimport os\nimport sys\nimport"
    base = ["run", ZOO, "--prompt", prompt, "--max-new-tokens", "20", "--quiet"]

    def text(extra):
        capsys.readouterr()
        assert main([str(a) for a in base + extra]) == 0
        out = capsys.readouterr()
        return out.out, out.err
    plain, _ = text([])
    for extra, name in ((["--drafter", "ngram", "--controller", "static:3"], "ngram"),
                        (["--drafter", "mtp", "--mtp-adapter", ZOO.parent / "tiny-moe-mtp",
                          "--controller", "static:2"], "mtp"),
                        (["--drafter", "model", "--draft-model", ZOO.parent / "tiny-draft",
                          "--controller", "static:3"], "model")):
        out, err = text(extra)
        assert out == plain
        m = re.search(rf"drafter {name} with static:\d: (\d+) of (\d+) drafts accepted", err)
        assert m and 0 < int(m.group(1)) <= int(m.group(2)), err


def test_run_refuses_a_draft_model_of_another_vocabulary(zoo_copy, cache_env, capsys,
                                                          tmp_path):
    """run --drafter model with a draft LM whose vocabulary is not the target's, or a folder
    that does not load as one: a named one-line error, nothing generated."""
    from transformers import LlamaConfig, LlamaForCausalLM
    LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=2)).save_pretrained(tmp_path / "d")
    code, err = _cli(["run", zoo_copy, "--prompt", "x", "--drafter", "model",
                      "--draft-model", tmp_path / "d"], capsys)
    _assert_one_line(code, err, "its vocabulary has 97 tokens, the target's")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"model_type": "no-such-model"}')
    code, err = _cli(["run", zoo_copy, "--prompt", "x", "--drafter", "model",
                      "--draft-model", tmp_path / "bad"], capsys)
    _assert_one_line(code, err, "does not load as a causal LM")


def test_run_interactive_holds_a_conversation(zoo_copy, cache_env, capsys, monkeypatch,
                                              tmp_path):
    """run --interactive: each line of standard input is a user's message; the answer to the
    second is the text run gives for the conversation so far (the first answer kept in it), as
    the tokenizer's apply_chat_template renders it, read whole, where the second turn read
    only its new part after the cache the first left; empty lines are skipped; the
    statistics per answer go to stderr; end of input ends it with status 0."""
    import io

    from transformers import AutoTokenizer

    cfg = zoo_copy / "tokenizer_config.json"
    tc = json.loads(cfg.read_text())
    tc["chat_template"] = CHAT_TEMPLATE
    cfg.write_text(json.dumps(tc))
    base = ["run", zoo_copy, "--max-new-tokens", "10", "--threads", "1", "--system", "be brief"]

    def run(*extra, stdin=""):
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
        capsys.readouterr()
        assert main([str(a) for a in base + list(extra)]) == 0
        return capsys.readouterr()

    out = run("--interactive", stdin="write a parser\n\nnow shorter\n")
    assert out.err.count("[specmoe] ") == 2 and "[specmoe]" not in out.out
    # the second turn read only what the first left out of its cache
    kept = [int(k) for k in re.findall(r"(\d+) of them kept from the last turn", out.err)]
    assert len(kept) == 2 and kept[0] == 0 and kept[1] > 10, out.err
    first = run("--chat", "--prompt", "write a parser", "--quiet").out[:-1]
    tok = AutoTokenizer.from_pretrained(str(zoo_copy))
    conv = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": "write a parser"},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "now shorter"}]
    f = tmp_path / "conversation.txt"
    f.write_text(tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True),
                 encoding="utf-8")
    base.remove("--system")
    base.remove("be brief")
    second = run("--prompt-file", f, "--quiet").out[:-1]
    assert out.out == f"> write a parser\n{first}\n>\n> now shorter\n{second}\n"
    # --prompt gives the first message; /exit ends the conversation
    base += ["--system", "be brief"]
    out2 = run("-i", "--prompt", "write a parser", stdin="/exit\nnot read\n")
    assert out2.out == f"> write a parser\n{first}\n> /exit\n"


@need_zoo
def test_run_stream_prints_the_same_text(cache_env, capsys):
    """run --stream prints the text as tokens arrive (transformers' TextStreamer), plainly and
    with drafts, and the whole output equals --no-stream's (the default off a terminal)."""
    prompt = "import os\nimport sys\nimport os\nimport sys\nimport"
    base = ["run", ZOO, "--prompt", prompt, "--max-new-tokens", "20"]
    for extra in ([], ["--drafter", "ngram", "--controller", "static:3"]):
        outs = []
        for flag in ([], ["--stream"], ["--no-stream"]):
            capsys.readouterr()
            assert main([str(a) for a in base + extra + flag]) == 0
            outs.append(capsys.readouterr().out)
        text = [o.rsplit("[specmoe] ", 1)[0] for o in outs]  # the statistics line aside
        assert text[0] == text[1] == text[2] and text[0].strip(), outs


@pytest.mark.parametrize("argv, what", [
    ([], "give the prompt as --prompt TEXT or --prompt-file FILE"),
    (["--prompt", "x", "--prompt-file", "p.txt"], "(one of them)"),
    (["--prompt-file", "no-such-file.txt"], "--prompt-file no-such-file.txt: cannot read it"),
    (["--prompt", "x", "--system", "be brief"], "--system goes with --chat"),
])
def test_run_prompt_options_refused_before_loading(zoo_copy, cache_env, capsys, argv, what):
    code, err = _cli(["run", zoo_copy] + argv, capsys)
    _assert_one_line(code, err, what)
    assert not cache_env.exists() or not any(cache_env.iterdir())


def test_run_chat_without_a_chat_template_refused_before_the_model_loads(zoo_copy, cache_env,
                                                                        capsys):
    code, err = _cli(["run", zoo_copy, "--prompt", "hello", "--chat"], capsys)
    _assert_one_line(code, err, "--chat: the tokenizer of", "has no chat template")
    assert not cache_env.exists() or not any(cache_env.iterdir())  # nothing converted


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def test_run_prompt_file_stdin_and_chat_give_transformers_text(zoo_copy, cache_env, capsys,
                                                              monkeypatch, tmp_path):
    """--prompt-file (and - for standard input) give the text --prompt gives; --chat (with
    --system) the text of the conversation as the tokenizer's own apply_chat_template renders
    it (a chat template added to a copy of the zoo model)."""
    import io

    from transformers import AutoTokenizer

    cfg = zoo_copy / "tokenizer_config.json"
    tc = json.loads(cfg.read_text())
    tc["chat_template"] = CHAT_TEMPLATE
    cfg.write_text(json.dumps(tc))
    base = ["run", zoo_copy, "--max-new-tokens", "12", "--quiet", "--threads", "1"]

    def text(*extra):
        capsys.readouterr()
        assert main([str(a) for a in base + list(extra)]) == 0
        return capsys.readouterr().out

    prompt = "def parse(line):\n    "
    plain = text("--prompt", prompt)
    f = tmp_path / "prompt.txt"
    f.write_text(prompt, encoding="utf-8")
    assert text("--prompt-file", f) == plain
    monkeypatch.setattr("sys.stdin", io.StringIO(prompt))
    assert text("--prompt-file", "-") == plain

    chat = text("--prompt", "write a parser", "--chat", "--system", "be brief")
    tok = AutoTokenizer.from_pretrained(str(zoo_copy))
    conv = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": "write a parser"}]
    rendered = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|assistant|>\n")
    f.write_text(rendered, encoding="utf-8")
    assert chat == text("--prompt-file", f)
    assert chat != text("--prompt", "write a parser")


@pytest.mark.parametrize("argv, what", [
    (["--top-p", "0.9"], "--top-p samples: give --temperature above 0"),
    (["--top-k", "5"], "--top-k samples: give --temperature above 0"),
    (["--seed", "3"], "--seed samples: give --temperature above 0"),
])
def test_run_sampling_options_without_a_temperature_refused(zoo_copy, cache_env, capsys,
                                                            argv, what):
    code, err = _cli(["run", zoo_copy, "--prompt", "x"] + argv, capsys)
    _assert_one_line(code, err, what)
    assert not cache_env.exists() or not any(cache_env.iterdir())


@pytest.mark.parametrize("argv, what", [
    (["--temperature", "-1"], "--temperature: must be a finite number >= 0"),
    (["--temperature", "nan"], "--temperature: must be a finite number >= 0"),
    (["--top-p", "0"], "--top-p: must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p: must be in (0, 1]"),
    (["--top-k", "0"], "--top-k: must be >= 1"),
    (["--seed", "-2"], "--seed: must be >= 0"),
])
def test_run_bad_sampling_values_are_usage_errors(argv, what, capsys):
    code, err = _cli(["run", "no-such-ckpt", "--prompt", "x", "--temperature", "1"] + argv,
                     capsys)
    assert code == 2 and what in err and "Traceback" not in err, err


@need_zoo
def test_run_samples_as_transformers_does_with_the_same_seed(cache_env, capsys):
    """run --temperature/--top-k/--top-p/--seed: the text of the unmodified transformers
    model sampling with the same seed and parameters (f32 store, dense layers in torch: the
    same probabilities to float rounding); the same seed gives the same text, another seed
    another; top-k 1 is greedy decoding; with n-gram drafts at a fixed K the
    seed reproduces the text too, and top-k 1 gives the greedy text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt, n = "def parse(line):", 24
    base = ["run", ZOO, "--prompt", prompt, "--max-new-tokens", str(n), "--quiet",
            "--dtype", "f32", "--dense", "torch", "--threads", "1"]

    def text(*extra, prompt=prompt):
        capsys.readouterr()
        argv = base + list(extra)
        argv[argv.index("--prompt") + 1] = prompt
        assert main([str(a) for a in argv]) == 0
        out = capsys.readouterr()
        return out.out, out.err

    greedy, _ = text()
    sampled, _ = text("--temperature", "1.3", "--top-p", "0.95", "--seed", "7")
    assert sampled == text("--temperature", "1.3", "--top-p", "0.95", "--seed", "7")[0]
    assert sampled != greedy
    assert sampled != text("--temperature", "1.3", "--top-p", "0.95", "--seed", "8")[0]
    assert text("--temperature", "1.3", "--top-k", "1", "--seed", "7")[0] == greedy

    tok = AutoTokenizer.from_pretrained(str(ZOO))
    ref_model = AutoModelForCausalLM.from_pretrained(str(ZOO), dtype=torch.float32)
    ids = tok(prompt, return_tensors="pt").input_ids
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(7)
        with torch.no_grad():
            ref = ref_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                     temperature=1.3, top_p=0.95, top_k=0, max_new_tokens=n,
                                     pad_token_id=tok.eos_token_id)
    finally:
        torch.set_num_threads(threads)
    assert sampled == tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True) + "\n"

    spec = ("--drafter", "ngram", "--controller", "static:3")
    rep = "import os\nimport sys\nimport os\nimport sys\nimport"  # n-gram drafts find it
    a, err = text(*spec, "--temperature", "0.8", "--seed", "7", prompt=rep)
    assert a == text(*spec, "--temperature", "0.8", "--seed", "7", prompt=rep)[0]
    assert re.search(r"drafter ngram with static:3: \d+ of [1-9]\d* drafts", err), err
    assert text(*spec, "--temperature", "1.3", "--top-k", "1", "--seed", "7", prompt=rep)[0] \
        == text(prompt=rep)[0]


def test_run_device_cuda_without_a_gpu_says_why(zoo_copy, cache_env, capsys):
    from specmoe.runtime.cuda import unusable_reason
    why = unusable_reason()
    if not why:
        pytest.skip("a GPU is usable here")
    code, err = _cli(["run", zoo_copy, "--prompt", "x", "--device", "cuda", "--gpu-cache",
                      "10%"], capsys)
    _assert_one_line(code, err, f"--device cuda: {why}")


def test_run_gpu_cache_reaches_from_pretrained(zoo_copy, cache_env, monkeypatch, capsys):
    import specmoe.models.pretrained
    from specmoe.runtime import cuda

    seen = {}

    def from_pretrained(path, **kw):
        seen.update(kw)
        raise RuntimeError("stop here")

    monkeypatch.setattr(specmoe.models.pretrained, "from_pretrained", from_pretrained)
    monkeypatch.setattr(cuda, "unusable_reason", lambda: "")
    code, err = _cli(["run", zoo_copy, "--prompt", "x", "--device", "cuda:0", "--gpu-cache",
                      "12GiB"], capsys)
    _assert_one_line(code, err, "RuntimeError: stop here")
    assert seen["device"] == "cuda:0" and seen["gpu_cache"] == "12GiB"


# -- item 5: simulate and sweep ----------------------------------------------------------------

@pytest.mark.parametrize("args, names", [
    (["--policies", "lru,random:seed=x"], ["--policies", "random:seed=x"]),
    (["--policies", "nosuch"], ["--policies", "nosuch"]),
    (["--policies", "lru:seed=3"], ["--policies", "lru:seed=3"]),
    (["--capacity", "0"], ["--capacity", "0"]),
    (["--capacity", "5xb"], ["--capacity", "5xb"]),
    (["--capacity", "1.5"], ["--capacity", "1.5"]),
    (["--prefetch", "oracle:depth=0"], ["--prefetch", "depth"]),
    (["--prefetch", "bogus"], ["--prefetch", "bogus"]),
    (["--hardware", "abacus"], ["--hardware", "abacus"]),
    (["--prefetch", "history", "--verify-tokens", "2"], ["--prefetch", "--verify-tokens"]),
    (["--miss", "drop", "--verify-tokens", "2"], ["--miss drop", "--verify-tokens"]),
    (["--miss", "priority", "--miss-keep", "3", "--miss-keep2", "1"], ["miss_keep2"]),
    (["--hybrid"], ["--hybrid", "cpu_bw", "a100-pcie4"]),
    (["--hybrid", "--hardware", "h200", "--miss", "drop"], ["--hybrid", "--miss fetch"]),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_simulate_bad_options(capsys, args, names):
    code, err = _cli(["simulate", "--trace", SUBSET, "--tokens", "5", *args], capsys)
    _assert_one_line(code, err, *names)


def test_simulate_hybrid(capsys):
    """--hybrid on the h200 profile: the JSON says so and counts the CPU's experts."""
    assert main(["simulate", "--trace", str(SUBSET), "--tokens", "5", "--hardware", "h200",
                 "--hybrid", "--capacity", "10%", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hybrid"] is True
    r = out["results"][0]
    assert r["hybrid"] and r["hybrid_cpu"] > 0  # (to_dict flattens extra)


def test_simulate_bad_trace_file_subprocess(tmp_path):
    bad = _bad_npz(tmp_path)
    code, err = _sub(["simulate", "--trace", bad, "--tokens", "5"], tmp_path)
    _assert_one_line(code, err, str(bad))


@pytest.mark.parametrize("trace", ["missing.npz", "garbage.npz", "dir-without-csv"])
def test_simulate_bad_trace_paths(tmp_path, capsys, trace):
    p = tmp_path / trace
    if trace == "garbage.npz":
        p.write_bytes(os.urandom(200))
    elif trace == "dir-without-csv":
        p.mkdir()
    code, err = _cli(["simulate", "--trace", p], capsys)
    _assert_one_line(code, err, str(p))


def test_sweep_bad_capacity_subprocess(tmp_path):
    code, err = _sub(["sweep", "--trace", SUBSET, "--tokens", "5", "--capacity", "0",
                      "--no-plots", "--out", tmp_path / "out"], tmp_path)
    _assert_one_line(code, err, "--capacity")


def test_sweep_out_is_a_file(tmp_path, capsys):
    f = tmp_path / "out"
    f.write_text("x")
    code, err = _cli(["sweep", "--trace", SUBSET, "--tokens", "5", "--policies", "lru",
                      "--capacity", "10%", "--no-plots", "--out", f], capsys)
    _assert_one_line(code, err, "--out", str(f))


def test_run_missing_path_subprocess(tmp_path):
    """(also item 7c) the path is blamed, not the tokenizer."""
    missing = tmp_path / "no-such-checkpoint"
    code, err = _sub(["run", missing, "--prompt", "x"], tmp_path)
    last = _assert_one_line(code, err, str(missing))
    assert "tokenizer" not in last


# -- item 5: --debug and interrupts ------------------------------------------------------------

@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_exception(tmp_path, where):
    bad = _bad_npz(tmp_path)
    argv = ["simulate", "--trace", str(bad)]
    argv = ["--debug", *argv] if where == "before" else [*argv, "--debug"]
    with pytest.raises(TraceError, match="bad.npz"):
        main(argv)


def test_debug_subprocess_prints_the_traceback(tmp_path):
    code, err = _sub(["--debug", "simulate", "--trace", _bad_npz(tmp_path)], tmp_path)
    assert code == 1 and "Traceback" in err and "TraceError" in err


def test_keyboard_interrupt_exits_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_cmd_simulate", interrupted)
    try:
        code, err = _cli(["simulate"], capsys)
    except KeyboardInterrupt:  # (it would end the whole pytest session)
        pytest.fail("KeyboardInterrupt escaped main()")
    assert code == 130 and "Traceback" not in err
    assert _last_line(err) == "specmoe: interrupted"


def test_a_message_exit_from_below_becomes_the_one_line(monkeypatch, capsys):
    def exits(args):
        raise SystemExit("something below\ngave up")

    monkeypatch.setattr(cli, "_cmd_simulate", exits)
    code, err = _cli(["simulate"], capsys)
    assert code == 1 and _last_line(err) == "specmoe: error: something below gave up"


# -- item 7a: --cache means what cache= means --------------------------------------------------

@pytest.mark.parametrize("text, value", [
    ("40", 40), ("0.5", 0.5), (" 0.25 ", 0.25), ("1.0", 1.0), ("25%", "25%"),
    ("6GiB", "6GiB"), ("512MiB", "512MiB"),
])
def test_cache_text_as_the_api_value(text, value):
    got = cli._capacity(text)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("text", ["0", "1.5", "-0.5", "nan", "5xb", "", "150%"])
def test_run_bad_cache_refused_before_loading(zoo_copy, cache_env, capsys, text):
    code, err = _cli(["run", zoo_copy, "--prompt", "x", "--cache", text], capsys)
    _assert_one_line(code, err, "--cache")
    assert not cache_env.exists() or not any(cache_env.iterdir())  # nothing converted


# -- item 7b: run --policy takes simulate's specs ----------------------------------------------

@pytest.mark.parametrize("spec, want", [
    ("lru", "lru"),
    ("random:seed=3", "Random(seed=3)"),
    ("least_stale:order=lru", "LeastStale(order='lru')"),
    ("spac:levels=3,gamma=7", "SpAc(levels=3, gamma=7, up=None, dn=None, tau=None, "
                               "estimator='alg1', gate=True)"),
])
def test_run_policy_spec_reaches_from_pretrained(zoo_copy, cache_env, monkeypatch, capsys,
                                                 spec, want):
    import specmoe.models.pretrained

    seen = {}

    def from_pretrained(path, **kw):
        seen.update(kw)
        raise RuntimeError("stop here")

    monkeypatch.setattr(specmoe.models.pretrained, "from_pretrained", from_pretrained)
    code, err = _cli(["run", zoo_copy, "--prompt", "x", "--policy", spec, "--cache", "0.5"],
                     capsys)
    _assert_one_line(code, err, "RuntimeError: stop here")
    pol = seen["policy"]
    assert (pol if isinstance(pol, str) else repr(pol)) == want
    assert seen["cache"] == 0.5


@pytest.mark.parametrize("argv, want", [([], "router"), (["--predictor", "learned"], "learned"),
                                        (["--no-prefetch", "--predictor", "learned"], False)])
def test_run_predictor_reaches_from_pretrained(zoo_copy, cache_env, monkeypatch, capsys, argv,
                                               want):
    assert _run_kwargs(zoo_copy, monkeypatch, capsys, argv)["prefetch"] == want


def _run_kwargs(zoo_copy, monkeypatch, capsys, argv) -> dict:
    """The keyword arguments `specmoe run ... argv` passes to from_pretrained."""
    import specmoe.models.pretrained

    seen = {}

    def from_pretrained(path, **kw):
        seen.update(kw)
        raise RuntimeError("stop here")

    monkeypatch.setattr(specmoe.models.pretrained, "from_pretrained", from_pretrained)
    code, err = _cli(["run", zoo_copy, "--prompt", "x"] + argv, capsys)
    _assert_one_line(code, err, "RuntimeError: stop here")
    return seen


@pytest.mark.parametrize("argv, want", [(["--memory", "8GiB"], ("8GiB", None)),
                                        (["--memory", "auto", "--cache", "10%"], ("auto", "10%")),
                                        ([], (None, "25%"))])
def test_run_memory_reaches_from_pretrained(zoo_copy, cache_env, monkeypatch, capsys, argv,
                                            want):
    seen = _run_kwargs(zoo_copy, monkeypatch, capsys, argv)
    assert (seen["memory"], seen["cache"]) == want


def test_run_bad_memory_refused_before_loading(zoo_copy, cache_env, capsys):
    code, err = _cli(["run", zoo_copy, "--prompt", "x", "--memory", "lots"], capsys)
    _assert_one_line(code, err, "--memory")
    assert not cache_env.exists() or not any(cache_env.iterdir())


@pytest.mark.parametrize("spec", ["random:seed=x", "lru:seed=3", "nosuch", "belady",
                                  "least_stale:order=sideways"])
def test_run_bad_policy_refused_before_loading(zoo_copy, cache_env, capsys, spec):
    code, err = _cli(["run", zoo_copy, "--prompt", "x", "--policy", spec], capsys)
    _assert_one_line(code, err, "--policy")
    assert not cache_env.exists() or not any(cache_env.iterdir())


def test_run_cache_fraction_and_policy_spec_end_to_end(zoo_copy, cache_env, capsys):
    """(7a, 7b) --cache 0.5 is half the experts, as from_pretrained(cache=0.5) (it was 0.5
    bytes: an error after the conversion), and random:seed=3 runs (it was refused)."""
    from specmoe.runtime.cache import parse_capacity

    want = parse_capacity(0.5, total_experts=4 * 16, slot_bytes=1)
    assert main(["run", str(zoo_copy), "--prompt", "def f", "--max-new-tokens", "2",
                 "--dtype", "int8", "--dense", "torch", "--cache", "0.5",
                 "--policy", "random:seed=3"]) == 0
    out = capsys.readouterr().out
    assert f"cache {want} experts" in out and "random:seed=3" in out


# -- item 7c: run checks the checkpoint folder first -------------------------------------------

def test_run_folder_without_config(tmp_path, cache_env, capsys):
    d = tmp_path / "empty"
    d.mkdir()
    code, err = _cli(["run", d, "--prompt", "x"], capsys)
    last = _assert_one_line(code, err, str(d / "config.json"))
    assert "tokenizer" not in last


def test_run_path_is_a_file(tmp_path, cache_env, capsys):
    f = tmp_path / "model.bin"
    f.write_bytes(b"x")
    code, err = _cli(["run", f, "--prompt", "x"], capsys)
    last = _assert_one_line(code, err, str(f), "not a checkpoint folder")
    assert "tokenizer" not in last


# -- item 7d: empty lists ----------------------------------------------------------------------

@pytest.mark.parametrize("command", ["simulate", "sweep"])
@pytest.mark.parametrize("option, text", [("--capacity", ""), ("--capacity", ","),
                                          ("--policies", ","), ("--policies", " "),
                                          ("--hardware", ",")])
def test_empty_lists_refused(tmp_path, capsys, command, option, text):
    argv = [command, "--trace", SUBSET, "--tokens", "5", option, text]
    if command == "sweep":
        argv += ["--no-plots", "--out", tmp_path / "out"]
    code, err = _cli(argv, capsys)
    _assert_one_line(code, err, option, "empty")
    assert not (tmp_path / "out").exists()


# -- item 7e: an expert id twice in one (token, layer) row -------------------------------------

def test_trace_constructor_refuses_repeated_ids():
    ex = np.array([[[0, 1, 2, 3, 4, 5]] * 2, [[0, 1, 2, 3, 4, 5], [8, 8, 8, 8, 8, 8]]])
    with pytest.raises(TraceError, match=r"token 1, layer position 1 .*expert id 8 appears "
                                         r"more than once"):
        Trace(experts=ex, num_experts=64)
    assert Trace(experts=ex[:1], num_experts=64).num_tokens == 1  # distinct rows are fine
    assert Trace(experts=np.zeros((3, 2, 1)), num_experts=4).top_k == 1


def _write_npz(path, experts, num_experts=64):
    meta = {"format": "specmoe-trace", "version": 1, "num_experts": num_experts, "model": "",
            "source": ""}
    np.savez(path, experts=np.asarray(experts, np.int16), request_starts=np.zeros(1, np.int64),
             layer_ids=np.arange(np.shape(experts)[1], dtype=np.int32),
             meta=np.array(json.dumps(meta)))
    return path


def test_trace_npz_refuses_repeated_ids(tmp_path, capsys):
    ex = np.tile(np.arange(6), (3, 2, 1))
    ex[2, 0] = [1, 2, 3, 4, 5, 3]
    p = _write_npz(tmp_path / "dup.npz", ex)
    with pytest.raises(TraceError, match=r"dup.npz: token 2, layer position 0 .*expert id 3"):
        load_trace(p)
    code, err = _cli(["simulate", "--trace", p, "--policies", "lru", "--capacity", "10%"],
                     capsys)
    _assert_one_line(code, err, str(p), "token 2, layer position 0", "expert id 3")


def test_trace_puffin_csv_refuses_repeated_ids(tmp_path):
    p = tmp_path / "prompt_1_data.csv"
    rows = ["Layer ID,Batch Number,Token,Activated Expert IDs"]
    for layer in (1, 2):
        for tok in range(3):
            ids = "[8, 8, 8, 8, 8, 8]" if (layer, tok) == (2, 1) else "[0, 1, 2, 3, 4, 5]"
            rows.append(f'{layer},0,t{tok},"{ids}"')
    p.write_text("\n".join(rows) + "\n")
    with pytest.raises(TraceError, match=r"prompt_1_data.csv:6: expert id 8 appears more than "
                                         r"once in the row of token 1, layer 2"):
        load_puffin(p)


def test_shipped_traces_still_load():
    tr = load_puffin(SUBSET)
    assert tr.num_tokens > 0 and tr.top_k == 6
    s = np.sort(tr.experts, axis=2)
    assert not (s[:, :, 1:] == s[:, :, :-1]).any()
