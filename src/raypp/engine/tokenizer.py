"""Tokenizer loading from the checkpoint (local files only), and chat rendering with it
(``LLM.chat`` and the server's chat endpoint)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_tokenizer(model: str) -> Any:
    """The checkpoint's Hugging Face fast tokenizer; ``ValueError`` if it has none.

    ``model`` is a Hugging Face directory, or a ``.gguf`` file whose tokenizer
    transformers builds from the file's metadata.
    """
    from transformers import AutoTokenizer

    path = Path(model)
    kwargs: dict[str, Any] = {}
    if path.suffix == ".gguf" and path.is_file():
        model, kwargs["gguf_file"] = str(path.parent), path.name
    try:
        return AutoTokenizer.from_pretrained(model, local_files_only=True, **kwargs)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {str(path)!r}: {e}") from e


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                **template_kwargs: Any) -> str:
    """Apply the tokenizer's chat template (with the generation prompt).

    Messages are OpenAI's: ``role`` and ``content``, and where they apply
    ``tool_calls`` (assistant; each ``function.arguments`` an object) and
    ``tool_call_id`` (``tool``); ``tools`` (OpenAI's JSON) and ``template_kwargs`` go
    to the template as transformers passes them. A model without a template gets a
    plain ``role: content`` transcript ending in ``assistant:`` (tool calls written as
    JSON), so chat still works, visibly un-templated.
    """
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError("each chat message needs 'role' and 'content'")
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=True, **template_kwargs)
    lines = []
    for m in messages:
        calls = "".join(" " + json.dumps(c["function"]) for c in m.get("tool_calls") or [])
        lines.append(f"{m['role']}: {m['content'] or ''}{calls}")
    return "\n".join(lines) + "\nassistant:"
