"""Chat prompts through the model's own chat template, and the tokens the next turn will start with.

The KV worth storing after a chat turn is that of the conversation *as the
next request will render it*: the template wraps the answer in its own
markers (``<|im_end|>\\n`` after it, for instance) and re-tokenizes its text,
which need not give the generated ids back. :func:`next_turn_prefix` renders
the conversation with the answer and with a further user turn and keeps what
the two share, so the stored chunks are a prefix of any next prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

from cachegen.errors import ConfigError

ROLES = ("system", "developer", "user", "assistant")


def _text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text is understood here
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ConfigError("message content parts must be {'type': 'text', 'text': str}")
            parts.append(p["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise ConfigError("message content must be a string or a list of text parts")


def normalize(messages: Sequence) -> list[dict[str, str]]:
    """``[{role, content}]`` with string content; ``developer`` becomes ``system``."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ConfigError(f"messages[{i}] must be an object with a string 'role'")
        role = m["role"]
        if role not in ROLES:
            raise ConfigError(f"messages[{i}].role {role!r} is not one of {', '.join(ROLES)}")
        out.append({"role": "system" if role == "developer" else role, "content": _text(m.get("content"))})
    return out


def render(tokenizer, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("this model's tokenizer has no chat template: use /v1/completions")
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def next_turn_prefix(tokenizer, messages: Sequence[dict], answer: str) -> list[int]:
    """The token ids every next prompt of this chat starts with: the conversation plus ``answer``."""
    with_answer = [*list(messages), {"role": "assistant", "content": answer}]
    a = render(tokenizer, with_answer, add_generation_prompt=False)
    b = render(tokenizer, [*with_answer, {"role": "user", "content": "."}], add_generation_prompt=True)
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]
