"""The OpenAI request bodies the server accepts, and OpenAI's error JSON.

Pydantic checks each field on its own (types, ranges, unknown fields through `extra="forbid"`); the
checks that need the model (the served model's name, prompt length against the engine's
max_model_len, token ids against the vocabulary) are in server.py. Fields with several accepted
shapes (prompt, stop, message content) are checked by hand, so that their error says which shapes
are allowed instead of listing one pydantic error per shape.

Supported: model (the served model's name, or left out), prompt / messages (roles system, user,
assistant; text content, and in user messages images as base64 `data:` URLs for a model that takes
them), max_tokens (chat: or max_completion_tokens), temperature (0: greedy),
top_p, seed, stop, stream, stream_options.include_usage, n (1 to MAX_CHOICES), logprobs
(completions: 0 to 5 alternatives; chat: logprobs true with top_logprobs 0 to 20), response_format
(text, json_object, json_schema: through xgrammar, the `structured` extra), presence_penalty and
frequency_penalty (-2 to 2, over the completion's tokens: `sampling.penalties`), logit_bias (token id
-> -100 to 100), and vLLM's extensions top_k, min_p, repetition_penalty. Accepted and ignored,
because by definition it does not change the output: `user` (an end-user id for the provider's abuse
monitoring). Chat also takes tools, tool_choice and parallel_tool_calls (serving/tools.py), and
messages with tool calls and tool results. Anything else is refused with a 400 naming the field
(echo, suffix, best_of, ...: not implemented).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

# the most completions one request may ask for (`n`); each is a request of its own in the engine
MAX_CHOICES = 16
PROMPT_SHAPES = "a non-empty string, a non-empty list of token ids, or a list holding one string"
CONTENT_SHAPES = (
    "a string, or a list of {'type': 'text', 'text': <string>} and {'type': 'image_url', 'image_url': {'url': "
    "'data:image/<format>;base64,<data>'}} parts (audio, files: not supported)"
)
IMAGE_URL_PREFIX = "data:image/"
MAX_ECHOED_INPUT = 200  # characters of a refused value quoted in its error


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str
    # OpenAI's low / high pick its own models' resolution; here the model's image processor sizes every image
    detail: Literal["auto"] = "auto"

    @field_validator("url")
    @classmethod
    def _data_url(cls, url: str) -> str:
        if not url.startswith(IMAGE_URL_PREFIX) or ";base64," not in url:
            raise ValueError(
                "allowed: an image sent as a base64 data URL, 'data:image/<format>;base64,<data>' "
                "(the server fetches no URLs)"
            )
        return url


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["image_url"]
    image_url: ImageURL


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # "schema" shadows a pydantic BaseModel attribute: held as json_schema, named schema in JSON
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's structured output: text (no constraint), any JSON object, or JSON following a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.json_schema is not None) != (self.type == "json_schema"):
            raise ValueError("allowed: a json_schema exactly when type is 'json_schema'")
        return self


class SamplingRequest(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)  # 0: greedy
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)  # extension (vLLM's)
    min_p: float | None = Field(None, ge=0, le=1)  # extension (vLLM's)
    repetition_penalty: float | None = Field(None, gt=0)  # extension (vLLM's)
    presence_penalty: float = Field(0.0, ge=-2, le=2)  # OpenAI's range
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[int, float] = {}  # token id -> bias added to its logit
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what torch.Generator.manual_seed takes
    stop: list[str] = []
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    response_format: ResponseFormat | None = None  # structured output, through xgrammar
    user: str | None = None  # accepted and ignored: an end-user id, no effect on the output

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, stop: Any) -> list[str]:
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(text, str) and text for text in stops):
            raise ValueError("allowed: a non-empty string, a list of non-empty strings, or null")
        return stops

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _biases(cls, logit_bias: Any) -> dict[int, float]:
        if logit_bias is None:
            return {}
        allowed = "allowed: an object mapping token ids (strings of digits) to numbers from -100 to 100"
        if not isinstance(logit_bias, dict):
            raise ValueError(allowed)
        biases = {}
        for token, bias in logit_bias.items():
            if not (isinstance(token, str) and token.isdigit() and token.isascii()) or isinstance(bias, bool) or (
                not isinstance(bias, (int, float)) or not -100 <= bias <= 100
            ):
                raise ValueError(f"{allowed}; got {token!r}: {bias!r}")
            biases[int(token)] = float(bias)
        return biases

    @field_validator("n")
    @classmethod
    def _choices(cls, n: int) -> int:
        if not 1 <= n <= MAX_CHOICES:
            raise ValueError(f"allowed: 1 to {MAX_CHOICES} completions per request")
        return n

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):  # `stream` is validated first: declared first
            raise ValueError("allowed only with stream=true")
        return options


class CompletionRequest(SamplingRequest):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=5)  # each token's, and this many alternatives' (OpenAI's limit)

    @property
    def num_top_logprobs(self) -> int | None:
        """The engine's `logprobs` for this request: None (none asked), else the alternatives per token."""
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> str | list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            return prompt
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(token, int) and not isinstance(token, bool) for token in prompt)
        ):
            return prompt
        raise ValueError(f"allowed: {PROMPT_SHAPES}")


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise ValueError("allowed: a JSON object as a string")
        return arguments


class MessageToolCall(BaseModel):
    """A tool call an earlier assistant message made."""

    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    # None only in an assistant message with tool_calls; parts only with an image (text parts are joined)
    content: str | list[TextPart | ImagePart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call they answer

    @model_validator(mode="after")
    def _fields_of_the_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("allowed: tool_calls only in assistant messages")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("allowed: a tool_call_id exactly in tool messages")
        if self.content is None and not self.tool_calls:
            raise ValueError("content is required (null only in an assistant message with tool_calls)")
        if self.images and self.role != "user":
            raise ValueError("allowed: image_url parts only in user messages")
        return self

    @property
    def images(self) -> list[ImagePart]:
        return [part for part in self.content if isinstance(part, ImagePart)] if isinstance(self.content, list) else []

    @field_validator("content", mode="before")
    @classmethod
    def _text_of_parts(cls, content: Any) -> str | list | None:
        """Text parts alone become one string, as every chat template takes it; with images the parts stay."""
        if content is None or isinstance(content, str):
            return content
        if not isinstance(content, list) or not content or not all(
            isinstance(part, dict) and part.get("type") in ("text", "image_url") for part in content
        ):
            raise ValueError(f"allowed: {CONTENT_SHAPES}")
        if all(part["type"] == "text" and part.keys() == {"type", "text"} and isinstance(part["text"], str)
               for part in content):  # fmt: skip
            return "".join(part["text"] for part in content)
        parts = []
        for index, part in enumerate(content):  # one error naming the part, not one per shape of content
            try:
                parts.append((TextPart if part["type"] == "text" else ImagePart).model_validate(part))
            except ValidationError as error:
                first = error.errors()[0]
                where = "".join(f".{name}" for name in first["loc"])
                raise ValueError(f"content[{index}]{where}: {first['msg'].removeprefix('Value error, ')}") from None
        return parts


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


TOOL_CHOICES = "'none', 'auto', 'required', or {'type': 'function', 'function': {'name': <one of tools>}}"


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False  # each token's log-probability
    top_logprobs: int | None = Field(None, ge=0, le=20)  # and this many alternatives' (OpenAI's limit)
    tools: list[ToolDefinition] | None = None
    # None: "auto" with tools, else "none"; a named function: its name (the dict's shape checked here)
    tool_choice: str | None = None
    parallel_tool_calls: bool = True  # False: at most one tool call per reply

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
        names = [tool.function.name for tool in tools or []]
        if len(set(names)) < len(names):
            raise ValueError("allowed: tools with distinct function names")
        return tools or None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, choice: Any, info: ValidationInfo) -> str | None:
        if isinstance(choice, dict) and choice.keys() == {"type", "function"} and choice["type"] == "function" and (
            isinstance(choice["function"], dict) and choice["function"].keys() == {"name"}
        ):
            choice = choice["function"]["name"]
            if not isinstance(choice, str):
                raise ValueError(f"allowed: {TOOL_CHOICES}")
            if choice in ("none", "auto", "required"):  # held as the name: it would read as the mode
                raise ValueError(f"a function named {choice!r} cannot be chosen by name; allowed: {TOOL_CHOICES}")
            named = True
        elif choice is None or choice in ("none", "auto", "required"):
            named = False
        else:
            raise ValueError(f"allowed: {TOOL_CHOICES}")
        tools = info.data.get("tools") or []
        if choice not in (None, "none") and not tools:
            raise ValueError("allowed only with tools")
        if named and choice not in [tool.function.name for tool in tools]:
            raise ValueError(f"{choice!r} is not among tools' function names")
        return choice

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top is not None and not info.data.get("logprobs"):
            raise ValueError("allowed only with logprobs=true")
        return top

    @property
    def num_top_logprobs(self) -> int | None:
        """The engine's `logprobs` for this request: None (none asked), else the alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_token_limit(cls, limit: int | None, info: ValidationInfo) -> int | None:
        if limit is not None and info.data.get("max_tokens") is not None:
            raise ValueError("allowed: max_tokens or max_completion_tokens, not both")
        return limit


def error_body(message: str, param: str | None, error_type: str = "invalid_request_error",
               code: str | None = None) -> dict:
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def validation_error_body(errors: list[dict], request_fields: list[str]) -> dict:
    """OpenAI's error JSON for the first of FastAPI's request-validation errors: the field's
    dotted path as `param`, and in the message what is allowed (`request_fields`: the top-level
    fields, listed when one is unknown)."""
    error = errors[0]
    if error["type"] == "json_invalid":
        return error_body(f"the request body is not valid JSON: {error['ctx']['error']}", None)
    path = [part for part in error["loc"] if part != "body"]
    param = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path).lstrip(".") or None
    if error["type"] == "extra_forbidden":
        allowed = f"; allowed: {', '.join(request_fields)}" if len(path) == 1 else ""
        return error_body(f"unknown or unsupported field {param!r}{allowed}", param)
    if error["type"] == "missing":
        return error_body(f"{param} is required", param)
    if param is None:
        return error_body(f"the request body must be a JSON object, sent as Content-Type: application/json "
                          f"({error['msg']})", None)
    message = error["msg"].removeprefix("Value error, ")
    given = repr(error["input"])
    if len(given) > MAX_ECHOED_INPUT:  # an image's base64 is not sent back
        given = given[:MAX_ECHOED_INPUT] + "..."
    return error_body(f"{param}={given}: {message}", param)
