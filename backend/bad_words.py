"""Banned token sequences (TensorRT-LLM's ``bad_words``, vLLM's ``SamplingParams.bad_words``)."""

from __future__ import annotations


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Token sequences to ban for ``words``: each word as given and with one leading space (how it is
    tokenized after another word in BPE tokenizers), without special tokens; duplicates once.

    Returns:
        A list of non-empty token id lists.
    """
    sequences: list[list[int]] = []
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def banned_next_tokens(token_ids: list[int], sequences: list[list[int]]) -> list[int]:
    """Tokens that would complete one of ``sequences`` after ``token_ids`` (prompt + output so far).

    A one-token sequence is always banned; a longer one only when the tail of ``token_ids`` equals all of
    it but its last token (as transformers' ``NoBadWordsLogitsProcessor`` and TensorRT-LLM do).
    """
    banned = []
    for seq in sequences:
        prefix = seq[:-1]
        if not prefix or (len(token_ids) >= len(prefix) and token_ids[len(token_ids) - len(prefix):] == prefix):
            banned.append(seq[-1])
    return banned
