"""The context-length error, and refusing a prompt that is obviously too
long before it is tokenized.

Tokenizing costs about a second per MB of text (SmolLM2's tokenizer on a
small CPU), so a 10 MB prompt for an 8192-token model is refused from its
length alone: when no token of the vocabulary stands for more than ``B``
bytes of text, ``N`` bytes of text become at least ``ceil(N / B)`` tokens.
That bound holds only where nothing shrinks the text before it is split
into tokens (see :attr:`megac.server.chat.Tokenizer.max_token_bytes`);
for other tokenizers the prompt is tokenized and then measured.
"""

from __future__ import annotations

from megac.server.chat import Tokenizer
from megac.server.errors import APIError, bad


def context_length_error(max_model_len: int, prompt_tokens: int, param: str, *, at_least: bool = False,
                         text_bytes: int | None = None) -> APIError:
    """The 400 of a prompt that leaves no room to generate (OpenAI's wording)."""
    count = f"at least {prompt_tokens} input tokens ({text_bytes} bytes of text)" if at_least \
        else f"{prompt_tokens} input tokens"
    return bad(f"This model's maximum context length is {max_model_len} tokens. However, your request has "
               f"{count}. Please reduce the length of the input.", param, "context_length_exceeded")


def refuse_obviously_too_long(tokenizer: Tokenizer, text: str, max_model_len: int, param: str) -> None:
    """Raise the context-length error when ``text`` cannot fit in fewer than
    ``max_model_len`` tokens, deciding from its length only."""
    per_token = tokenizer.max_token_bytes
    if per_token is None:
        return
    text_bytes = len(text.encode("utf-8", "surrogatepass"))
    min_tokens = -(-text_bytes // per_token)
    if min_tokens >= max_model_len:
        raise context_length_error(max_model_len, min_tokens, param, at_least=True, text_bytes=text_bytes)


__all__ = ["context_length_error", "refuse_obviously_too_long"]
