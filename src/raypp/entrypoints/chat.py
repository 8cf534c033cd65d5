"""Rendering chat messages into a prompt."""

from __future__ import annotations

from typing import Any


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """Apply the tokenizer's chat template (with the generation prompt).

    A model without a template gets a plain ``role: content`` transcript ending
    in ``assistant:``, so chat still works, visibly un-templated.
    """
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError("each chat message needs 'role' and 'content'")
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nassistant:"
