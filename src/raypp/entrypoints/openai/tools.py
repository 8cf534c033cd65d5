"""Tool calling for the chat endpoint: what ``tool_choice`` asks of the model, and how
its output becomes ``message.tool_calls`` (or streamed ``delta.tool_calls``).

What callers may rely on:

- ``none``: tools are neither shown to the model nor parsed; the reply is text.
- ``auto``: tools are rendered through the chat template and the reply is parsed with
  the model's own format (:mod:`raypp.entrypoints.openai.tool_parsers`); text that is
  no call stays ``content``. ``parallel_tool_calls=false`` keeps the first call.
- ``required`` and a named function are enforced with the grammar: a named function's
  reply is its arguments, a JSON object valid against the function's ``parameters``
  schema; ``required``'s is a JSON list of ``{"name", "parameters"}`` (one item when
  ``parallel_tool_calls`` is false), each valid against its function's schema.
- A message with calls has ``finish_reason="tool_calls"`` (unless cut by length).
- :class:`ToolPlan` raises :class:`~raypp.entrypoints.openai.protocol.BadRequest`
  naming ``tool_choice`` or ``tools`` for a choice it cannot honour.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from raypp.entrypoints.openai import protocol as p
from raypp.entrypoints.openai.requests import ChatCompletionRequest, NamedToolChoice, Tool
from raypp.entrypoints.openai.tool_parsers import ParsedCall, ToolParser
from raypp.sampling_params import StructuredOutputsParams


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _parameters(tool: Tool) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    """One request's tool calling: ``mode`` is ``none``, ``auto``, ``required`` or
    ``named``; ``tools`` what the chat template shows the model."""

    mode: str
    tools: list[Tool]
    parser: ToolParser
    parallel: bool = True
    named: str | None = None

    @classmethod
    def of(cls, req: ChatCompletionRequest, parser: ToolParser) -> ToolPlan:
        tools = req.tool_list()
        choice = req.effective_tool_choice()
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise p.BadRequest("tools: function names must be unique", "tools")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise p.BadRequest(f"tool_choice names the function {choice.function.name!r}, "
                                   f"which is not in tools ({', '.join(names) or 'none given'})",
                                   "tool_choice")
            return cls("named", tools, parser, req.parallel_tool_calls, choice.function.name)
        if choice == "required" and not tools:
            raise p.BadRequest("tool_choice 'required' needs tools", "tool_choice")
        if choice == "none" or not tools:
            return cls("none", [], parser)
        return cls(choice, tools, parser, req.parallel_tool_calls)

    @property
    def template_tools(self) -> list[dict] | None:
        """The tools as a chat template takes them (OpenAI's JSON), or None."""
        return [t.model_dump(exclude_none=True, by_alias=True) for t in self.tools] or None

    def grammar(self) -> StructuredOutputsParams | None:
        """The grammar that forces the call (``required``, named), else None."""
        if self.mode == "named":
            tool = next(t for t in self.tools if t.function.name == self.named)
            return StructuredOutputsParams(json=_parameters(tool))
        if self.mode != "required":
            return None
        items = [{"type": "object",
                  "properties": {"name": {"enum": [t.function.name]}, "parameters": _parameters(t)},
                  "required": ["name", "parameters"]} for t in self.tools]
        schema: dict = {"type": "array", "minItems": 1,
                        "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)

    @property
    def streams_content(self) -> bool:
        """False when the whole reply is a forced call (no text content)."""
        return self.mode in ("none", "auto")

    def calls(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """``(content, calls)`` of a finished reply."""
        if self.mode == "named":
            assert self.named is not None
            return None, [ParsedCall(self.named, text)]  # as streamed
        if self.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:  # cut short by max_tokens: hand the text back
                return text, []
            return None, [ParsedCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False))
                          for i in items]
        if self.mode == "auto":
            content, calls = self.parser.parse(text)
            if calls and not self.parallel:
                calls = calls[:1]
            return content, calls
        return text, []


def tool_calls_out(calls: list[ParsedCall]) -> list[p.ToolCallOut]:
    return [p.ToolCallOut(id=new_call_id(), function=p.FunctionCallOut(name=c.name,
                                                                        arguments=c.arguments))
            for c in calls]


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


class ToolStream:
    """One choice's streamed reply under a :class:`ToolPlan`: text content is streamed
    until a call may start; a named call streams its arguments as they come; other
    calls are sent whole when the reply ends."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""  # everything received
        self.sent = 0  # characters of text sent as content (or named-call arguments)
        self.named_id: str | None = None

    def push(self, new_text: str, finished: bool) -> list[p.DeltaMessage]:
        """Deltas to send for ``new_text`` (and everything held back, once ``finished``)."""
        self.text += new_text
        plan = self.plan
        if plan.mode == "none":
            return self._content(len(self.text))
        if plan.mode == "named":
            return self._named_arguments()
        if plan.mode == "auto" and not finished:
            return self._content(plan.parser.call_start(self.text))
        if not finished:
            return []
        content, calls = plan.calls(self.text)
        if not calls:
            return self._content(len(self.text))
        out = []
        if content and self.sent < len(content):
            out.append(p.DeltaMessage(content=content[self.sent:]))
        out.extend(p.DeltaMessage(tool_calls=[p.DeltaToolCall(
            index=i, id=new_call_id(), type="function",
            function=p.DeltaFunctionCall(name=c.name, arguments=c.arguments))])
            for i, c in enumerate(calls))
        return out

    def _content(self, upto: int) -> list[p.DeltaMessage]:
        if upto <= self.sent:
            return []
        text, self.sent = self.text[self.sent:upto], upto
        return [p.DeltaMessage(content=text)]

    def _named_arguments(self) -> list[p.DeltaMessage]:
        out = []
        if self.named_id is None:
            self.named_id = new_call_id()
            out.append(p.DeltaMessage(tool_calls=[p.DeltaToolCall(
                index=0, id=self.named_id, type="function",
                function=p.DeltaFunctionCall(name=self.plan.named, arguments=""))]))
        if len(self.text) > self.sent:
            piece, self.sent = self.text[self.sent:], len(self.text)
            out.append(p.DeltaMessage(tool_calls=[p.DeltaToolCall(
                index=0, function=p.DeltaFunctionCall(arguments=piece))]))
        return out

    @property
    def has_calls(self) -> bool:
        return self.plan.mode == "named" or bool(self.plan.calls(self.text)[1])
