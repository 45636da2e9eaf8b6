"""specmoe.serve.detok.IncrementalText against the tokenizer's own decoding of the whole list,
token by token, on a byte-level BPE (the zoo model's) and on a SentencePiece-style BPE with
byte fallback (built here, the way Llama's tokenizer.json is laid out): multi-byte characters
split over byte tokens, special tokens skipped, leading-space pieces."""
from __future__ import annotations

import random

import pytest

from specmoe import zoo
from specmoe.serve.detok import IncrementalText


def _llama_like():
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    pieces = ["\u2581"] + list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,!?'\u00e9") + [
        "\u2581t", "he", "\u2581the", "\u2581a", "in", "\u2581in", "er", "\u2581w", "or",
        "\u2581wor", "ld", "\u2581world"]
    merges = [("\u2581", "t"), ("h", "e"), ("\u2581t", "he"), ("\u2581", "a"), ("i", "n"),
              ("\u2581", "in"), ("e", "r"), ("\u2581", "w"), ("o", "r"), ("\u2581w", "or"),
              ("l", "d"), ("\u2581wor", "ld")]
    for p in pieces:
        vocab.setdefault(p, len(vocab))
    tk = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True,
                                         fuse_unk=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                          normalizers.Replace(" ", "\u2581")])
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never",
                                                split=False)
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>")
    return tok


def _zoo():
    if not zoo.available("tiny-moe"):
        pytest.skip("the zoo model is not shipped in this tree")
    from specmoe.models.pretrained import load_tokenizer
    return load_tokenizer(zoo.path("tiny-moe"))


TEXTS = ["the world in a word", "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u65e5\u672c\u8a9e \U0001f600!",
         "  two  spaces, then\nnewline\ttab", "\u00e9\u00e9\u00e9 \u4e2d\u6587 the end."]


@pytest.mark.parametrize("make", [_zoo, _llama_like], ids=["byte-level", "sentencepiece"])
def test_incremental_text_equals_whole_decoding(make):
    tok = make()
    rng = random.Random(7)
    seqs = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    specials = [i for i in (tok.bos_token_id, tok.eos_token_id) if i is not None]
    if make is _zoo:  # random ids: bytes that never complete a character, specials
        n_vocab = len(tok)
        for _ in range(40):
            seqs.append([rng.choice(specials) if rng.random() < 0.05 else
                         rng.randrange(n_vocab) for _ in range(rng.randrange(1, 60))])
    else:  # random texts (byte fallback's runs of invalid UTF-8: the next test)
        alphabet = "the world in a \u00e9\u00ef\u65e5\u672c\U0001f600., \n"
        for _ in range(40):
            seqs.append(tok.encode("".join(rng.choice(alphabet) for _ in range(
                rng.randrange(1, 40))), add_special_tokens=False))
    # the encoded texts with specials sprinkled in
    seqs += [[x for t in s for x in ([t] if rng.random() > 0.2 else [t] + specials)]
             for s in seqs[:len(TEXTS)]]
    held = 0
    for ids in seqs:
        whole = tok.decode(ids, skip_special_tokens=True)
        inc = IncrementalText(tok)
        for i, t in enumerate(ids):
            got = inc.add(t)
            want = tok.decode(ids[:i + 1], skip_special_tokens=True)
            if want.endswith("\ufffd"):
                # an unfinished character: the whole decoding may even turn finished ones
                # before it into U+FFFD for a while (byte fallback decodes a run of byte
                # tokens at once); what comes before the U+FFFDs stays in the final text
                held += 1
                assert whole.startswith(got.rstrip("\ufffd")), (ids[:i + 1], got, whole)
            else:
                assert got == want, (ids[:i + 1], got, want)
        assert inc.text == whole
    assert held > 0  # some step held an unfinished character (the case the window guards)


def test_window_stays_short():
    """Committed pieces leave the window: it spans the last piece and the pending tokens."""
    tok = _llama_like()
    ids = tok.encode(" ".join(["the world"] * 200), add_special_tokens=False)
    inc = IncrementalText(tok)
    longest = 0
    for t in ids:
        inc.add(t)
        longest = max(longest, len(inc.ids) - inc.start)
    assert inc.text == tok.decode(ids, skip_special_tokens=True)
    assert longest <= 3, longest


def test_byte_fallback_invalid_run():
    """The one known difference: byte fallback decodes a run of byte tokens at once, and a run
    that is not UTF-8 becomes all U+FFFD, the finished characters in it too; here a finished
    character stays (what was streamed is never taken back)."""
    tok = _llama_like()
    ids = tok.convert_tokens_to_ids(["K", "<0x20>", "<0x9D>"])
    inc = IncrementalText(tok)
    texts = [inc.add(t) for t in ids]
    assert texts[:2] == ["K", "K "]
    assert texts[2].startswith("K ") and texts[2].endswith("\ufffd")
    assert tok.decode(ids, skip_special_tokens=True) == "K\ufffd\ufffd"
