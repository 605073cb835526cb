"""OpenAI tool calling for /v1/chat/completions: tools into the prompt, tool calls out of the reply.

- The tools reach the model through its chat template (`apply_chat_template(..., tools=...)`), as
  the model was trained to see them; a template that never reads `tools` is refused (the model
  would not know them).
- `tool_choice` "auto" (the default with tools): the model decides. Its reply is split into
  content, reasoning and tool calls by transformers' response parser
  (`tokenizer.parse_response`) with the tokenizer's `response_template`, or transformers' own
  template for the model's family (Qwen 2 / 3 / 3.5, Gemma 4). A model with neither is refused
  for "auto": its tool calls could not be found.
- "required" and a named function: the output is constrained with xgrammar (the request's grammar,
  as for `response_format`), the way vLLM does it, whatever the model's own format: a named
  function's reply is its arguments object, following the function's `parameters` schema;
  "required" is a JSON array of `{"name", "parameters"}` calls, at least one, each naming a tool.
- `parallel_tool_calls` false: "required" allows one call; under "auto", where the model's own
  format is not constrained, only its first call is returned.
- "none": the tools are in the prompt; the reply is text.

Exactness is the engine's: the constrained output equals plain `generate()` with xgrammar's
processor for the same schema. Tool calls come only from a complete reply (not one cut at
max_tokens). Streamed (`StreamedReply`), an "auto" reply goes through transformers' streaming
`ResponseParser`: content and reasoning are sent as the model writes them, each call once the model
closes it; a named function's arguments are sent as written, as OpenAI streams them. "required"
replies (a JSON array to parse whole), and "auto" ones with stop strings (cut on text, not tokens),
come as one chunk when the choice finishes.
"""

from __future__ import annotations

import functools
import json
import logging
import uuid
from typing import Any

from transformers import PreTrainedTokenizerBase

from .protocol import ChatCompletionRequest

logger = logging.getLogger(__name__)


class ToolRequestError(ValueError):
    """A request's tools the model cannot serve: `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@functools.cache
def _family_response_templates() -> dict:
    """transformers' response templates by model type (its `serve` command's, where it keeps them)."""
    try:
        from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS
    except ImportError:  # another transformers version: only the tokenizer's own template
        return {}
    return {model_type: template for types, template in _RESPONSE_TEMPLATE_FALLBACKS.items() for model_type in types}


def response_template(tokenizer: PreTrainedTokenizerBase, model_type: str) -> dict | None:
    """How to find tool calls in this model's replies: the tokenizer's own, else its family's."""
    return getattr(tokenizer, "response_template", None) or _family_response_templates().get(model_type)


class ToolCalling:
    """One chat request's tools: `template_tools` for the chat template, `schema` for the grammar (None:
    unconstrained), and `message(...)` to turn a finished reply into OpenAI's message fields."""

    def __init__(self, body: ChatCompletionRequest, tokenizer: PreTrainedTokenizerBase, model_type: str) -> None:
        self.tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
        self.choice = body.tool_choice or ("auto" if self.tools else "none")
        self.parallel = body.parallel_tool_calls
        self.tokenizer = tokenizer
        self.template = None
        if not self.tools:
            return
        if "tools" not in (tokenizer.chat_template or ""):
            raise ToolRequestError("the model's chat template does not render tools, so the model would not see them",
                                   "tools")  # fmt: skip
        if body.response_format is not None and body.response_format.type != "text" and self.choice != "none":
            raise ToolRequestError("response_format cannot be combined with tools unless tool_choice is 'none'",
                                   "response_format")  # fmt: skip
        if self.choice == "auto":
            self.template = response_template(tokenizer, model_type)
            if self.template is None:
                raise ToolRequestError(
                    f"tool calls cannot be found in the replies of this model (model type {model_type!r}: no "
                    "tokenizer.response_template, and transformers has none for the family); allowed here: "
                    "tool_choice 'none', 'required' or a named function",
                    "tool_choice",
                )

    @property
    def parses_calls(self) -> bool:
        """Whether the reply is turned into tool calls (streamed: as it comes where `streams_calls`,
        else whole when it finishes)."""
        return self.choice != "none" and bool(self.tools)

    @property
    def streams_calls(self) -> bool:
        """Whether a streamed reply can be sent as it comes ("auto", a named function)."""
        return self.parses_calls and self.choice != "required"

    @property
    def template_tools(self) -> list[dict] | None:
        return self.tools or None

    @property
    def schema(self) -> dict | None:
        """The JSON schema the reply must follow: required and named choices."""
        if self.choice == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {"name": {"const": tool["function"]["name"]}, "parameters": _parameters(tool)},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for tool in self.tools
            ]
            return {"type": "array", "minItems": 1, **({} if self.parallel else {"maxItems": 1}), "items": {"anyOf": calls}}
        if self.choice not in ("none", "auto"):
            return _parameters(next(tool for tool in self.tools if tool["function"]["name"] == self.choice))
        return None

    def message(self, text: str, token_ids: list[int] | None, prompt_ids: list[int], finish_reason: str) -> tuple[dict, str]:
        """OpenAI's message fields for a finished reply and its finish reason. `token_ids`: the reply's
        tokens when `text` is all of them (no stop string cut it): the parser then sees the special
        tokens that delimit calls."""
        if not self.parses_calls or finish_reason != "stop":
            return {"content": text}, finish_reason
        if self.choice == "auto":
            return self._parsed(text, token_ids, prompt_ids)
        try:  # the grammar made it valid JSON, unless a stop string cut it
            reply = json.loads(text)
        except json.JSONDecodeError:
            return {"content": text}, finish_reason
        if self.choice == "required":
            calls = [(call["name"], call["parameters"]) for call in reply]
            return {"content": None, "tool_calls": _tool_calls(calls)}, "tool_calls"
        return {"content": None, "tool_calls": _tool_calls([(self.choice, reply)])}, "stop"  # as OpenAI answers it

    def _parsed(self, text: str, token_ids: list[int] | None, prompt_ids: list[int]) -> tuple[dict, str]:
        try:
            parsed = self.tokenizer.parse_response(
                token_ids if token_ids is not None else text, self.template, prefix=prompt_ids, tools=self.tools
            )
        except Exception as error:  # the model wrote something its format does not parse: its text, as is
            logger.warning("could not parse tool calls from a reply (%r); sending it as content", error)
            return {"content": text}, "stop"
        message = {"content": parsed.get("content") or None}
        reasoning = parsed.get("reasoning_content") or parsed.get("thinking")
        if reasoning:
            message["reasoning_content"] = reasoning
        calls = [(call["function"]["name"], call["function"]["arguments"]) for call in parsed.get("tool_calls") or []]
        calls = calls if self.parallel else calls[:1]
        if not calls:
            return {**message, "content": message["content"] or ""}, "stop"
        return {**message, "tool_calls": _tool_calls(calls)}, "tool_calls"


class StreamedReply:
    """One streamed choice under tool_choice "auto" or a named function: `feed(token_ids, text)` (the
    new tokens and the new stable text) and, once it finished, `finish()` give OpenAI's delta fields
    (content, reasoning_content, tool_calls indexed in order)."""

    def __init__(self, tools: ToolCalling, prompt_ids: list[int]) -> None:
        self.tools, self.num_calls = tools, 0
        # OpenAI's finish reason for a reply that called: "stop" where the call was forced
        self.finish_reason_with_calls = "tool_calls" if tools.choice == "auto" else "stop"
        if tools.choice != "auto":  # a named function: the reply is its arguments
            return
        from transformers.utils.chat_parsing import ResponseParser

        # token ids where the tokenizer can decode them itself: special-token delimiters then match
        self.by_ids = getattr(tools.tokenizer, "is_fast", False)
        prefix = prompt_ids if self.by_ids else tools.tokenizer.decode(prompt_ids)
        tokenizer = tools.tokenizer if self.by_ids else None
        self.parser = ResponseParser(tools.template, prefix=prefix, tools=tools.tools, tokenizer=tokenizer)

    def feed(self, token_ids: list[int], text: str) -> dict:
        if self.tools.choice != "auto":
            return self._arguments(text)
        return self._delta(self.parser.feed(token_ids if self.by_ids else self.tools.tokenizer.decode(token_ids)))

    def _arguments(self, text: str) -> dict:
        """A named function's arguments as written: the call (id, name) with the first piece, then pieces."""
        if self.num_calls == 0 and text:
            self.num_calls = 1
            (call,) = _tool_calls([(self.tools.choice, text)])
            return {"content": None, "tool_calls": [{"index": 0, **call}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}

    def finish(self) -> dict:
        if self.tools.choice != "auto":
            return {}
        try:
            return self._delta(self.parser.finalize()[1])
        except ValueError as error:  # a reply the format cannot close (cut short): what was sent stands
            logger.warning("could not finish parsing a streamed reply (%r)", error)
            return {}

    def _delta(self, events: list[dict]) -> dict:
        texts: dict[str, str] = {}
        calls = []
        for event in events:
            field = event.get("field")
            if event["type"] == "region_chunk" and not event.get("dirty") and event.get("text"):
                name = "reasoning_content" if field in ("reasoning_content", "thinking") else field
                if name in ("content", "reasoning_content"):
                    texts[name] = texts.get(name, "") + event["text"]
            elif event["type"] == "region_close" and field == "tool_calls" and event.get("value"):
                if self.tools.parallel or self.num_calls == 0:
                    function = event["value"]["function"]
                    (call,) = _tool_calls([(function["name"], function["arguments"])])
                    calls.append({"index": self.num_calls, **call})
                    self.num_calls += 1
        return {**texts, **({"tool_calls": calls} if calls else {})}


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object"}


def _tool_calls(calls: list[tuple[str, Any]]) -> list[dict]:
    """OpenAI's tool_calls: each with an id of its own and its arguments as JSON text."""
    return [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
         "function": {"name": name, "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}
        for name, arguments in calls
    ]  # fmt: skip
