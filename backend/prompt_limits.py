"""Cheap checks on a prompt's size before the expensive work (tokenizing it)."""

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
