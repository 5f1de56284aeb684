"""Cheap checks on a prompt's size before the expensive work (tokenizing it), and the tokenizing itself done so
that other threads of the process keep running meanwhile (:func:`encode_prompt`)."""

from __future__ import annotations


def max_token_bytes(tokenizer) -> int:
    """UTF-8 bytes of the longest token's text, special tokens included (81 for SmolLM2's tokenizer: a
    newline and 80 spaces). One pass over the vocabulary, decoded by the Rust tokenizer (~0.2 s at 49k)."""
    backend = tokenizer.backend_tokenizer
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    texts = backend.decode_batch([[i] for i in range(vocab_size)], skip_special_tokens=False)
    return max(len(text.encode("utf-8")) for text in texts)


def max_prompt_bytes(tokenizer, max_model_len: int) -> int:
    """The longest prompt, in UTF-8 bytes, that could still fit ``max_model_len``.

    A prompt of B bytes becomes at least B / L tokens when no token covers more than L bytes, so a
    prompt over ``(max_model_len - 1) * L`` bytes cannot leave room for one output token: it can be
    rejected without tokenizing (SmolLM2 at max_model_len 4096: 4095 * 81 = 331,695 bytes). A tokenizer
    whose normalizer deletes text could fit a longer prompt; such a prompt is rejected all the same.
    """
    return (max_model_len - 1) * max_token_bytes(tokenizer)


def check_prompt_bytes(prompt: str | bytes, limit: int, max_model_len: int) -> None:
    """Rejects a prompt longer than ``limit`` UTF-8 bytes, without encoding a string that is clearly
    within (4 bytes per character at most) or clearly over (1 byte per character at least) the limit.

    Raises:
        ValueError: the prompt's size in bytes, the limit and where it comes from.
    """
    if isinstance(prompt, str):
        if 4 * len(prompt) <= limit:
            return
        size = len(prompt) if len(prompt) > limit else len(prompt.encode("utf-8", "surrogatepass"))
    else:
        size = len(prompt)
    if size > limit:
        raise ValueError(f"prompt is over {limit} bytes ({size} or more), the most that can fit max_model_len "
                         f"({max_model_len} tokens) with this tokenizer; rejected before tokenizing")


def encode_prompt(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """``tokenizer.encode(text, add_special_tokens=...)``: the same token ids, computed with the GIL released.

    A Hugging Face fast tokenizer's ``encode`` runs the Rust tokenizer with the GIL released, then builds Python
    lists of every feature (ids, type ids, attention mask, ...) while holding it: for a 330,000-token prompt
    about 0.2 s during which no other thread of the process (the event loop, the engine loop) runs. Here the
    Rust ``encode_batch`` (GIL released) is asked for one encoding and only its ids become a Python list (2 ms
    at 330,000 ids). A tokenizer without a Rust backend, or whose backend truncates or pads (``encode``
    would turn that off), goes through ``encode``.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
