"""Incremental detokenization: UTF-8 safe, SentencePiece spaces kept, stop strings held back."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from backend.detokenizer import IncrementalDetokenizer

MULTILINGUAL = "Hello world! 你好，世界。 Emoji: 🙂👍🏽 café naïve — ∑ done."


def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-style SentencePiece BPE (``▁`` word starts, byte fallback) built without any download."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    pieces = ["▁"] + list("abcdefghijklmnopqrstuvwxyzHE!.,:") + ["▁w", "or", "ld", "▁wor", "▁world", "lo",
                                                                   "▁H", "▁He", "▁Hel", "▁Hello"]
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "H"), ("▁H", "e"), ("▁He", "l"), ("l", "o"), ("▁Hel", "lo"),
              ("▁", "w"), ("o", "r"), ("l", "d"), ("▁w", "or"), ("▁wor", "ld")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def stream(tokenizer, ids, stop=None):
    detok = IncrementalDetokenizer(tokenizer, stop=stop)
    deltas = []
    for token_id in ids:
        detok.add_token(token_id)
        deltas.append(detok.delta(final=False))
        if detok.stopped:
            break
    deltas.append(detok.delta(final=True))
    return deltas, detok


@pytest.mark.parametrize("which", ["smollm2_bytelevel", "sentencepiece"])
def test_joined_deltas_equal_full_decode_without_replacement_chars(which, tokenizer):
    tok = tokenizer if which == "smollm2_bytelevel" else sentencepiece_tokenizer()
    ids = tok.encode(MULTILINGUAL, add_special_tokens=False)
    assert len(ids) > len(MULTILINGUAL) // 4
    deltas, _ = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "你好" in "".join(deltas) and "🙂👍🏽" in "".join(deltas)


def test_sentencepiece_word_start_spaces_survive_streaming():
    tok = sentencepiece_tokenizer()
    ids = tok.encode("Hello world world", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["▁Hello", "▁world", "▁world"]
    deltas, _ = stream(tok, ids)
    assert deltas[:3] == ["Hello", " world", " world"]


def test_character_split_across_tokens_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE splits the emoji's 4 bytes
    deltas, _ = stream(tokenizer, ids)
    assert deltas[:-2] == [""] * (len(ids) - 1) and "".join(deltas) == "🙂"


def test_stop_string_across_tokens_is_held_back_then_cut(tokenizer):
    ids = tokenizer.encode("alpha beta STOPPING gamma", add_special_tokens=False)
    deltas, detok = stream(tokenizer, ids, stop=["STOP"])
    assert detok.stopped
    assert "".join(deltas) == "alpha beta "
    assert all("S" not in d for d in deltas)


def test_held_back_text_is_released_when_it_does_not_become_a_stop(tokenizer):
    ids = tokenizer.encode("one two thr one", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in ids] == ["one", " two", " thr", " one"]
    deltas, detok = stream(tokenizer, ids, stop=["three"])
    assert not detok.stopped
    # "thr" may begin "three": held back when it arrives, released with the next token.
    assert deltas == ["one", " two", " ", "thr one", ""]
