"""`hf-specdec serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over a `SpeculativeEngine`.

    build_app(engine, tokenizer, model_name, api_key=None, processor=None) -> FastAPI  # what the tests start
    serve(model_path, speculative_config, host="127.0.0.1", port=8000, ...)  # what the CLI runs

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream`), GET /v1/models,
GET /health, GET /metrics (Prometheus). The engine runs on one background thread (engine_loop.py);
a handler tokenizes the prompt, maps the request to a transformers `GenerationConfig`, queues the
request and then reads its outputs: it decodes all the output tokens each time and sends only the
new text that can no longer change (text ending in an incomplete UTF-8 character, or in what could
be the start of a stop string, waits). A client that goes away aborts its request in the engine.

Images (chat, user messages, base64 `data:` URLs) go through the model's processor (`processor`:
its chat template, image processor and tokenizer, as `processor.apply_chat_template` gives plain
`generate()` its inputs); the engine prefills such a prompt with the model's own forward.

Sampling defaults, for the fields a request leaves out: the model's own when its generation config
samples (do_sample true), else OpenAI's (temperature 1, top_p 1, no top-k / min-p); temperature 0
is greedy. max_tokens defaults to 16 for /v1/completions (as OpenAI) and for chat to the room left
up to the engine's max_model_len, at most DEFAULT_CHAT_MAX_TOKENS.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import copy
import io
import itertools
import json
import secrets
import signal
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import PIL.Image
import torch
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import GenerationConfig, PreTrainedTokenizerBase, ProcessorMixin

from ..cache.own_attention import encoder_input_name
from ..config import SpeculativeConfig
from ..loop.encoder_decoder import decoder_start_ids, source_limit
from ..loop.engine import SpeculativeEngine
from ..models.real_models import load_image_processor, load_target
from ..sampling.penalties import OutputTokenPenalties
from .engine_loop import EngineError, EngineLoop
from .protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ResponseFormat,
    SamplingRequest,
    TextPart,
    error_body,
    validation_error_body,
)
from .tools import StreamedReply, ToolCalling, ToolRequestError

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 1024  # chat without max_tokens: the room left in max_model_len, at most this
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # request -> GenerationConfig
CLIENT_GONE = 499  # the status logged for a request whose client went away (nginx's; nobody receives it)
DISCONNECT_POLL_SECONDS = 0.5  # how often a request waiting on the engine checks that its client is still there


class APIError(Exception):
    """Answered with OpenAI's error JSON and this status."""

    def __init__(self, status_code: int, message: str, param: str | None = None,
                 error_type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status_code, self.body = status_code, error_body(message, param, error_type, code)


def build_app(
    engine: SpeculativeEngine, tokenizer: PreTrainedTokenizerBase, model_name: str, api_key: str | None = None,
    engine_thread: bool = True, processor: ProcessorMixin | None = None,
) -> FastAPI:
    """The server's app over `engine` (a `SpeculativeEngine`); `api_key`: when given, every endpoint but
    /health needs `Authorization: Bearer <api_key>`. `engine_thread`: the app starts a thread of its own
    for the engine while it runs; False: the caller runs `app.state.engine_loop.run()` (`run_app`).
    `processor`: the model's processor, for chat messages with images (None: images are refused)."""
    engine_loop = EngineLoop(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine_thread:
            engine_loop.start()
        yield
        engine_loop.stop()

    app = FastAPI(title="hf-specdec", lifespan=lifespan)
    app.state.engine_loop = engine_loop
    registry = CollectorRegistry()  # per app: two apps in one process (the tests) must not share counters
    registry.register(_EngineCollector(engine_loop))
    counters = _RequestCounters(registry)
    base_config = engine.model.generation_config
    max_model_len = engine.max_model_len
    vocab_size = engine.model.config.get_text_config().vocab_size  # the logits' width
    # an encoder-decoder model (T5, BART, Marian, ...): a completion's prompt is its encoder's source, and its decoder
    # starts as plain generate() starts it
    encoder_decoder = engine.model.config.is_encoder_decoder
    if encoder_decoder and encoder_input_name(engine.model) != "input_ids":
        raise ValueError(f"serve: {type(engine.model).__name__} reads {encoder_input_name(engine.model)}, not text; the "
                         "server takes text sources (encoder-decoder models over audio or images: generate())")
    decoder_start = decoder_start_ids(engine.model) if encoder_decoder else []
    max_source_len = source_limit(engine.model) if encoder_decoder else None
    grammars = _GrammarCompiler(tokenizer, vocab_size)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body, status_code=error.status_code)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        chat = request.url.path.endswith("/chat/completions")
        fields = list((ChatCompletionRequest if chat else CompletionRequest).model_fields)
        return JSONResponse(validation_error_body(list(error.errors()), fields), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:  # 404, 405, ...
        return JSONResponse(error_body(str(error.detail), None), status_code=error.status_code)

    async def require_api_key(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if api_key is not None and not secrets.compare_digest(given, f"Bearer {api_key}".encode()):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    api = APIRouter(dependencies=[Depends(require_api_key)])

    @api.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [
            {"id": model_name, "object": "model", "created": 0, "owned_by": "hf-specdec", "max_model_len": max_model_len}
        ]}  # fmt: skip

    @api.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        if isinstance(body.prompt, str):
            prompt_ids = tokenizer(body.prompt).input_ids
        else:
            _check_token_ids(body.prompt, len(tokenizer))
            prompt_ids = body.prompt
        max_tokens = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        if not encoder_decoder:
            return await generate(request, body, prompt_ids, max_tokens, "prompt")
        if max_source_len is not None and len(prompt_ids) > max_source_len:
            raise APIError(400, f"the prompt has {len(prompt_ids)} tokens; the model's encoder reads {max_source_len} at most",
                           "prompt", code="context_length_exceeded")  # fmt: skip
        source = torch.tensor([prompt_ids])
        return await generate(request, body, decoder_start, max_tokens, "prompt", prompt_tokens=len(prompt_ids),
                              model_inputs={"input_ids": source, "attention_mask": torch.ones_like(source)})  # fmt: skip

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        if encoder_decoder:
            raise APIError(400, f"the model {model_name!r} is an encoder-decoder model (its prompt is the source its encoder "
                           "reads): use /v1/completions", "messages")  # fmt: skip
        if tokenizer.chat_template is None:
            raise APIError(400, f"the model {model_name!r} has no chat template: use /v1/completions", "messages")
        arguments = (body, tokenizer, engine.model.config.model_type)
        try:  # with tools, off the event loop: the first finds transformers' response templates (an import)
            tools = await asyncio.to_thread(ToolCalling, *arguments) if body.tools else ToolCalling(*arguments)
        except ToolRequestError as error:
            raise APIError(400, str(error), error.param) from None
        model_inputs = None
        if any(message.images for message in body.messages):
            _check_takes_images(processor, body.messages, model_name)
            prompt_ids, model_inputs = await asyncio.to_thread(
                image_prompt, processor, body.messages, tools.template_tools, engine.model
            )
        else:
            messages = [_template_message(message) for message in body.messages]
            text = tokenizer.apply_chat_template(messages, tools=tools.template_tools, add_generation_prompt=True,
                                                 tokenize=False)  # fmt: skip
            prompt_ids = tokenizer(text, add_special_tokens=False).input_ids  # the template has them
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:
            max_tokens = max(1, min(max_model_len - len(prompt_ids), DEFAULT_CHAT_MAX_TOKENS))
        return await generate(request, body, prompt_ids, max_tokens, "messages", tools=tools, model_inputs=model_inputs)

    async def generate(request: Request, body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int],
                       max_tokens: int, prompt_field: str, tools: ToolCalling | None = None,
                       model_inputs: dict[str, torch.Tensor] | None = None, prompt_tokens: int | None = None) -> Response:
        """`tools`: a chat request's (None: a completion). `model_inputs`: a prompt's images, processed, or an
        encoder-decoder model's source. `prompt_tokens`: what usage counts (default: `prompt_ids`)."""
        chat = tools is not None
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; allowed: {model_name!r}", "model",
                           code="model_not_found")
        _check_length(len(prompt_ids), max_tokens, max_model_len, prompt_field)
        _check_token_ids(list(body.logit_bias), vocab_size, "logit_bias")
        request_id = uuid.uuid4().hex
        config = generation_config_for(body, max_tokens, base_config)
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        reply = _Reply(request_id, model_name, include_usage, prompt_ids, tools,
                       len(prompt_ids) if prompt_tokens is None else prompt_tokens)  # fmt: skip
        parsed_as_streamed = body.stream and tools is not None and tools.streams_calls and not body.stop
        choices = [
            _Choice(index, request_id if body.n == 1 else f"{request_id}-{index}",
                    IncrementalText(tokenizer, body.stop, with_logprobs=body.num_top_logprobs is not None),
                    StreamedReply(tools, prompt_ids) if parsed_as_streamed else None)
            for index in range(body.n)
        ]  # fmt: skip
        grammar = await grammars.compile(body.response_format, None if tools is None else tools.schema)
        penalties = output_token_penalties(body, len(prompt_ids))
        outputs = _EngineOutputs(request, engine_loop)
        for choice in choices:
            outputs.add(choice.request_id, prompt_ids, config, seed=_choice_seed(body.seed, choice.index),
                        logprobs=body.num_top_logprobs, grammar=grammar, logits_processor=penalties,
                        model_inputs=model_inputs)  # fmt: skip
        by_id = {choice.request_id: choice for choice in choices}

        def count(finish_reason: str | None = None) -> None:
            """Each choice as one request, ended as it ended (`finish_reason` overrides: "error")."""
            endpoint = "chat_completions" if chat else "completions"
            reasons = [finish_reason or choice.finish_reason or choice.text.finish_reason or "abort" for choice in choices]
            counters.finished(endpoint, reasons, reply.prompt_tokens, sum(c.text.completion_tokens for c in choices))

        try:  # a failure before the first token is an HTTP error, streamed or not
            first = await outputs.next()
            if first is not None:
                _raise_on_error(first)
        except APIError:
            outputs.close()
            count("error")
            raise
        if first is None:
            outputs.close()
            count()
            return Response(status_code=CLIENT_GONE)
        if body.stream:
            return StreamingResponse(_events(first, outputs, choices, by_id, reply, count), media_type="text/event-stream")
        try:
            output = first
            while output is not None:
                _raise_on_error(output)
                choice = by_id[output.request_id]
                choice.text.advance(output)
                if choice.text.finish_reason is not None:
                    outputs.abort(choice.request_id)  # a stop string ended its text: the engine may stop too
                    if all(c.text.finish_reason is not None for c in choices):
                        break
                output = await outputs.next()
        except APIError:
            count("error")
            raise
        finally:
            outputs.close()
        if any(choice.text.finish_reason is None for choice in choices):
            count()
            return Response(status_code=CLIENT_GONE)
        whole = reply.whole(choices, reply.prompt_tokens)
        count()
        return JSONResponse(whole)

    app.include_router(api)
    return app


def generation_config_for(body: SamplingRequest, max_new_tokens: int, base: GenerationConfig) -> GenerationConfig:
    """The request's `GenerationConfig`: the model's (`base`: eos ids, repetition penalty, ...) with the
    request's fields on top; sampling fields left out take the model's values if `base` samples,
    else OpenAI's (temperature 1, top_p 1, no top-k, no min-p)."""
    fields = {} if base.do_sample else {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": None}  # 0: no top-k
    fields.update({name: getattr(body, name) for name in SAMPLING_FIELDS if getattr(body, name) is not None})
    greedy = fields.get("temperature", base.temperature) == 0
    if greedy:  # the sampling fields have no effect (the argmax survives top-k / top-p / min-p): unset
        fields.update(temperature=None, top_p=None, top_k=None, min_p=None)
    if body.logit_bias:  # transformers' bias processor, one-token sequences (as `transformers serve` maps it)
        fields["sequence_bias"] = {(token,): bias for token, bias in body.logit_bias.items()}
    config = copy.deepcopy(base)
    # one update: GenerationConfig.update validates (and warns about) what it is given
    config.update(**fields, do_sample=not greedy, max_new_tokens=max_new_tokens, stop_strings=body.stop or None)
    return config


def output_token_penalties(body: SamplingRequest, prompt_len: int) -> list[OutputTokenPenalties]:
    """The request's presence / frequency penalties as the processor that applies them (none when both are 0)."""
    if body.presence_penalty == 0 and body.frequency_penalty == 0:
        return []
    return [OutputTokenPenalties(body.presence_penalty, body.frequency_penalty, prompt_width=prompt_len)]


def _template_message(message: ChatMessage) -> dict:
    """A message as chat templates take it: a tool call's arguments as a mapping (templates iterate
    them), where OpenAI sends JSON text."""
    fields = message.model_dump(exclude_none=True)
    for call in fields.get("tool_calls", []):
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return fields


def _check_takes_images(processor: ProcessorMixin | None, messages: list[ChatMessage], model_name: str) -> None:
    if processor is None:
        index = next(i for i, message in enumerate(messages) if message.images)
        raise APIError(400, f"the model {model_name!r} takes no images (it has no image processor); allowed: text "
                       "content", f"messages[{index}].content")


def image_prompt(processor: ProcessorMixin, messages: list[ChatMessage], tools: list[dict] | None,
                 model: torch.nn.Module) -> tuple[list[int], dict[str, torch.Tensor]]:
    """A chat with images as the model's processor lays it out: (prompt ids, the other inputs the model
    takes: pixel_values, ...), floating ones in the model's dtype. Runs off the event loop (decoding and
    resizing images is CPU work). An image that does not decode is a 400 naming its part."""
    conversation = []
    for index, message in enumerate(messages):
        fields = _template_message(message)
        if message.images:
            fields["content"] = [
                {"type": "text", "text": part.text} if isinstance(part, TextPart)
                else {"type": "image", "image": _decoded_image(part.image_url.url, f"messages[{index}].content[{j}]")}
                for j, part in enumerate(message.content)
            ]  # fmt: skip
        conversation.append(fields)
    try:
        inputs = processor.apply_chat_template(conversation, tools=tools, add_generation_prompt=True, tokenize=True,
                                               return_dict=True, return_tensors="pt")  # fmt: skip
    except (ValueError, TypeError) as error:  # e.g. more images than the model takes
        raise APIError(400, f"the model's processor refused the messages: {error}", "messages") from None
    prompt_ids = inputs.pop("input_ids")[0].tolist()
    inputs.pop("attention_mask", None)  # one unpadded row: the engine's own
    return prompt_ids, {
        name: value.to(model.dtype) if value.is_floating_point() else value for name, value in inputs.items()
    }


def _decoded_image(url: str, param: str) -> PIL.Image.Image:
    """The image of a `data:image/...;base64,` URL (the protocol accepts no other), fully read."""
    try:
        image = PIL.Image.open(io.BytesIO(base64.b64decode(url.partition(";base64,")[2], validate=True)))
        image.load()
    except (binascii.Error, OSError, ValueError, PIL.Image.DecompressionBombError) as error:
        raise APIError(400, f"{param}.image_url.url does not hold an image Pillow can read ({error}); allowed: a "
                       "base64 PNG, JPEG, WebP, GIF, ...", f"{param}.image_url.url") from None
    return image


def _check_token_ids(token_ids: list[int], vocab_size: int, field: str = "prompt") -> None:
    bad = [token for token in token_ids if not 0 <= token < vocab_size]
    if bad:
        raise APIError(400, f"{field} has token ids {bad[:5]} outside the vocabulary; allowed: 0 to {vocab_size - 1}",
                       field)


def _check_length(prompt_len: int, max_tokens: int, max_model_len: int, prompt_field: str) -> None:
    if prompt_len == 0:
        raise APIError(400, f"{prompt_field} tokenizes to no tokens; allowed: text of at least one token",
                       prompt_field)
    if prompt_len >= max_model_len:
        raise APIError(400, f"the prompt is {prompt_len} tokens; allowed: at most {max_model_len - 1} "
                       f"(max_model_len {max_model_len} holds the prompt and the completion)", prompt_field)
    if prompt_len + max_tokens > max_model_len:
        raise APIError(400, f"max_tokens={max_tokens} with a {prompt_len}-token prompt exceeds max_model_len "
                       f"{max_model_len}; allowed: max_tokens <= {max_model_len - prompt_len}", "max_tokens")


class _GrammarCompiler:
    """`response_format` -> an xgrammar `CompiledGrammar` (None for text): xgrammar's compiler for the
    served tokenizer, built at the first request that asks (xgrammar is the optional `structured`
    extra), its compiled grammars cached by xgrammar. Compiling runs off the event loop."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._compiler = None
        self._lock = threading.Lock()

    async def compile(self, response_format: ResponseFormat | None, tools_schema: dict | None = None) -> Any:
        """The grammar of `response_format`, or of the tool calls `tool_choice` requires (`ToolCalling.schema`:
        the two never come together)."""
        if tools_schema is not None:  # compact JSON: a call's arguments, not a document to lay out
            return await asyncio.to_thread(self._compile_schema, tools_schema, True, "tools", False)
        if response_format is None or response_format.type == "text":
            return None
        if response_format.type == "json_object":  # OpenAI's JSON mode: any JSON object
            return await asyncio.to_thread(self._compile_schema, {"type": "object"}, False, "response_format")
        schema = response_format.json_schema
        return await asyncio.to_thread(self._compile_schema, schema.json_schema, schema.strict is not False,
                                       "response_format.json_schema.schema")  # fmt: skip

    def _compile_schema(self, schema: dict, strict: bool, param: str, any_whitespace: bool = True) -> Any:
        try:
            import xgrammar as xgr
        except ImportError:
            raise APIError(400, f"{param.split('.')[0]} needs xgrammar on the server: pip install 'hf-specdec[structured]'",
                           param.split(".")[0]) from None
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info)
        try:
            return self._compiler.compile_json_schema(json.dumps(schema), strict_mode=strict, any_whitespace=any_whitespace)
        except Exception as error:  # xgrammar's message names what it cannot take
            raise APIError(400, f"{param} is not a JSON schema xgrammar can compile: {error}", param) from None


def _choice_seed(seed: int | None, index: int) -> int | None:
    """Choice `index`'s seed: the request's plus the index (distinct choices, each reproducible),
    wrapped into what torch's generators take."""
    if seed is None:
        return None
    return seed + index if seed + index < 2**64 else seed + index - 2**64


@dataclass
class _Choice:
    """One of a request's `n` completions: its request in the engine and its text (streamed with
    tool_choice "auto": `reply`, its tool calls parsed as its tokens arrive)."""

    index: int
    request_id: str
    text: IncrementalText
    reply: StreamedReply | None = None
    finish_reason: str | None = None  # as sent, where the reply's differs from the text's ("tool_calls")


class _EngineOutputs:
    """The `RequestOutput`s of one HTTP request's engine requests (its `n` choices) from the engine
    thread, as they arrive, until each has finished or the client goes away. `abort(request_id)`: one
    of them is no longer wanted; `close()` aborts every one still running (the client left, a failure,
    or every choice's text is complete)."""

    def __init__(self, request: Request, engine_loop: EngineLoop) -> None:
        self.request, self.engine_loop = request, engine_loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.running: set[str] = set()

    def add(self, request_id: str, prompt_ids: list[int], config: GenerationConfig, **options: Any) -> None:
        """`options`: `SpeculativeEngine.add_request`'s keyword arguments."""
        self.engine_loop.add(request_id, prompt_ids, config, outputs=self.queue, **options)
        self.running.add(request_id)

    async def next(self) -> Any:
        """The next output of a running request; None once none runs or the client went away. An
        `EngineError` (the engine refused or failed) raises `APIError`."""
        while self.running:
            try:
                output = await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_SECONDS)
            except asyncio.TimeoutError:
                output = None
            if await self.request.is_disconnected():
                return None
            if isinstance(output, EngineError):
                raise APIError(output.status_code, output.message,
                               error_type="invalid_request_error" if output.status_code == 400 else "server_error")
            if output is None or output.request_id not in self.running:  # nothing yet, or an aborted one's
                continue
            if output.finished:
                self.running.discard(output.request_id)  # the engine holds nothing of it
            return output
        return None

    def abort(self, request_id: str) -> None:
        if request_id in self.running:
            self.running.discard(request_id)
            self.engine_loop.abort(request_id)

    def close(self) -> None:
        for request_id in list(self.running):
            self.abort(request_id)


def _raise_on_error(output: Any) -> None:
    if output.finish_reason == "error":
        raise APIError(500, f"the engine failed on this request: {output.error}", error_type="server_error")


@dataclass
class LoggedToken:
    """An output token's log-probability as the API reports it: its text (decoded alone), where it
    starts in the completion's text, and the most likely tokens' texts and log-probabilities."""

    text: str
    logprob: float
    offset: int
    top: list[tuple[str, float]]


def _logprobs_json(tokens: list[LoggedToken] | None, chat: bool) -> dict | None:
    """OpenAI's `logprobs` of a choice: chat's {"content": [...]}, or completions' parallel lists."""
    if tokens is None:
        return None
    if chat:
        def entry(text: str, logprob: float) -> dict:
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = [{**entry(t.text, t.logprob), "top_logprobs": [entry(*top) for top in t.top]} for t in tokens]
        return {"content": content, "refusal": None}
    return {
        "tokens": [t.text for t in tokens], "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [dict(t.top) for t in tokens], "text_offset": [t.offset for t in tokens],
    }  # fmt: skip


class IncrementalText:
    """The completion's text as its tokens arrive. `advance(output)` decodes all the output tokens and
    returns the text that is new and stable; the text ends before the first stop string (then
    `finish_reason` is "stop", whatever the engine said). `with_logprobs`: `take_logprobs()` gives the
    log-probabilities of the tokens whose text has been sent since its last call."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop_strings: list[str], with_logprobs: bool = False) -> None:
        self.tokenizer, self.stop_strings = tokenizer, stop_strings
        self.text = ""  # sent so far
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.token_ids: list[int] = []  # the output tokens so far
        self.with_logprobs = with_logprobs
        self.logprobs: list[Any] = []  # the engine's TokenLogprob of every output token so far
        self.token_ends: list[int] = []  # the text's length after each of them
        self.taken = 0  # how many of them take_logprobs() has given
        self.cut_by_stop_string = False

    def advance(self, output: Any) -> str:
        self.token_ids = output.token_ids
        self.completion_tokens = len(output.token_ids)
        if self.with_logprobs:
            self.logprobs.extend(output.logprobs)
            for end in range(len(self.token_ends) + 1, len(output.token_ids) + 1):
                self.token_ends.append(len(self.tokenizer.decode(output.token_ids[:end], skip_special_tokens=True)))
        text = self.tokenizer.decode(output.token_ids, skip_special_tokens=True)
        cuts = [index for index in (text.find(stop) for stop in self.stop_strings) if index >= 0]
        if cuts:
            text, self.finish_reason, self.cut_by_stop_string = text[: min(cuts)], "stop", True
        elif output.finished:
            self.finish_reason = output.finish_reason
        else:
            text = text[: len(text) - self._unstable_tail(text)]
        new = text[len(self.text) :]
        self.text += new
        return new

    def take_logprobs(self) -> list[LoggedToken] | None:
        """Each token not given yet whose text has all been sent; once finished, the rest of the
        tokens that reached the text (a stop string ends it: the tokens after where it starts do not;
        an eos token, no text, does). None without `with_logprobs`."""
        if not self.with_logprobs:
            return None
        if self.finish_reason is None:  # the leading tokens whose text has been sent
            count = len(list(itertools.takewhile(lambda end: end <= len(self.text), self.token_ends)))
        elif self.cut_by_stop_string:  # the leading tokens that start before the cut
            count = len(list(itertools.takewhile(lambda start: start < len(self.text), [0, *self.token_ends[:-1]])))
        else:
            count = len(self.token_ends)

        def decode(token_ids: list[int]) -> str:  # an eos token: "" (as in the text)
            return self.tokenizer.decode(token_ids, skip_special_tokens=True)

        taken = [
            LoggedToken(
                decode([entry.token_id]), entry.logprob, self.token_ends[index - 1] if index else 0,
                [(decode([token_id]), logprob) for token_id, logprob in entry.top],
            )
            for index, entry in enumerate(self.logprobs[self.taken : count], start=self.taken)
        ]  # fmt: skip
        self.taken = max(self.taken, count)
        return taken

    def _unstable_tail(self, text: str) -> int:
        """How many characters at the end may still change: an incomplete UTF-8 character decodes to
        U+FFFD, and the start of a stop string may become the whole of it."""
        tail = len(text) - len(text.rstrip("\ufffd"))
        for stop in self.stop_strings:
            tail = max(tail, next((n for n in range(len(stop) - 1, 0, -1) if text.endswith(stop[:n])), 0))
        return tail


class _Reply:
    """OpenAI's response JSON for one request: the whole of it, or its server-sent events. `tools`: a
    chat request's (None: a completion). `prompt_tokens`: what usage counts of the prompt."""

    def __init__(self, request_id: str, model_name: str, include_usage: bool, prompt_ids: list[int],
                 tools: ToolCalling | None, prompt_tokens: int) -> None:  # fmt: skip
        self.chat, self.prompt_tokens = tools is not None, prompt_tokens
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{request_id}"
        self.model_name, self.include_usage, self.prompt_ids, self.tools = model_name, include_usage, prompt_ids, tools
        self.created = int(time.time())

    @property
    def sends_whole_messages(self) -> bool:
        """Whether each choice's text is held until it finishes (tool calls are parsed from all of it)."""
        return self.tools is not None and self.tools.parses_calls

    def message(self, text: IncrementalText) -> tuple[dict, str]:
        """A finished chat choice's message fields (tool calls split out of it) and its finish reason."""
        token_ids = None if text.cut_by_stop_string else text.token_ids
        return self.tools.message(text.text, token_ids, self.prompt_ids, text.finish_reason)

    def whole(self, choices: list[_Choice], prompt_tokens: int) -> dict:
        """The response of finished `choices`."""
        body = []
        for choice in choices:
            text, finish_reason = choice.text, choice.text.finish_reason
            if self.chat:
                message, finish_reason = self.message(text)
                content, choice.finish_reason = {"message": {"role": "assistant", **message}}, finish_reason
            else:
                content = {"text": text.text}
            body.append({"index": choice.index, **content, "logprobs": _logprobs_json(text.take_logprobs(), self.chat),
                         "finish_reason": finish_reason})
        completion_tokens = sum(choice.text.completion_tokens for choice in choices)
        return self._body(body, streaming=False, usage=_usage(prompt_tokens, completion_tokens))

    def message_chunk(self, choice: _Choice) -> str:
        """A finished choice's whole message as one event (`sends_whole_messages`), tool calls indexed."""
        message, finish_reason = self.message(choice.text)
        choice.finish_reason = finish_reason
        if "tool_calls" in message:
            message["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        return self.delta_chunk(message, finish_reason, choice.text.take_logprobs(), choice.index)

    def chunk(self, text: str | None, finish_reason: str | None = None, logprobs: list[LoggedToken] | None = None,
              index: int = 0) -> str:
        """One event of choice `index`; chat: `text` None is its first chunk (the assistant's role)."""
        if self.chat:
            return self.delta_chunk({"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {}),
                                    finish_reason, logprobs, index)  # fmt: skip
        return self._chunk({"text": text}, finish_reason, logprobs, index)

    def delta_chunk(self, delta: dict, finish_reason: str | None, logprobs: list[LoggedToken] | None, index: int) -> str:
        """A chat event of choice `index` carrying `delta`."""
        return self._chunk({"delta": delta}, finish_reason, logprobs, index)

    def _chunk(self, choice: dict, finish_reason: str | None, logprobs: list[LoggedToken] | None, index: int) -> str:
        choices = [{"index": index, **choice, "logprobs": _logprobs_json(logprobs, self.chat), "finish_reason": finish_reason}]
        return _event(self._body(choices, streaming=True, **({"usage": None} if self.include_usage else {})))

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> str:
        """The last event with stream_options.include_usage: no choices, the usage."""
        return _event(self._body([], streaming=True, usage=_usage(prompt_tokens, completion_tokens)))

    def _body(self, choices: list[dict], streaming: bool, **extra: Any) -> dict:
        kind = ("chat.completion.chunk" if streaming else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_name,
                "choices": choices, **extra}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


DONE_EVENT = "data: [DONE]\n\n"


async def _events(first: Any, outputs: _EngineOutputs, choices: list[_Choice], by_id: dict[str, _Choice],
                  reply: _Reply, on_finish: Callable[[str | None], None]) -> AsyncIterator[str]:
    """The server-sent events of a streamed request, from its first output on: each choice's chunks
    under its index, as its text grows. An engine failure is an error event (the status, 200, has
    been sent). `on_finish(override)` at the end ("error" on a failure; None: each choice as it ended,
    "abort" where the client went away)."""
    failed = False
    try:
        if reply.chat:
            for choice in choices:
                yield reply.chunk(None, index=choice.index)
        output = first
        while output is not None:
            if output.finish_reason == "error":
                failed = True
                yield _event(error_body(f"the engine failed on this request: {output.error}", None, "server_error"))
                yield DONE_EVENT
                return
            choice = by_id[output.request_id]
            text = choice.text
            new_text = text.advance(output)
            if choice.reply is not None:  # tool calls parsed as the tokens arrive
                for event in _parsed_events(reply, choice, output.new_token_ids, new_text):
                    yield event
            elif reply.sends_whole_messages:
                if text.finish_reason is not None:
                    yield reply.message_chunk(choice)
            elif new_text or text.finish_reason is not None:
                yield reply.chunk(new_text, text.finish_reason, text.take_logprobs(), index=choice.index)
            if text.finish_reason is not None:
                outputs.abort(choice.request_id)  # a stop string ended its text: the engine may stop too
                if all(c.text.finish_reason is not None for c in choices):
                    if reply.include_usage:
                        completion_tokens = sum(c.text.completion_tokens for c in choices)
                        yield reply.usage_chunk(reply.prompt_tokens, completion_tokens)
                    yield DONE_EVENT
                    return
            output = await outputs.next()
    finally:
        outputs.close()
        on_finish("error" if failed else None)


def _parsed_events(reply: _Reply, choice: _Choice, new_token_ids: list[int], new_text: str) -> list[str]:
    """The events of a choice streamed through its `StreamedReply`: what the new tokens completed,
    then, once it finished, what the end closes, with the finish reason ("tool_calls" when it
    called one under "auto")."""
    events, text, streamed = [], choice.text, choice.reply
    delta = streamed.feed(new_token_ids, new_text)
    if delta:
        events.append(reply.delta_chunk(delta, None, text.take_logprobs(), choice.index))
    if text.finish_reason is not None:
        called = text.finish_reason == "stop" and streamed.num_calls
        choice.finish_reason = streamed.finish_reason_with_calls if called else text.finish_reason
        events.append(reply.delta_chunk(streamed.finish(), choice.finish_reason, text.take_logprobs(), choice.index))
    return events


# engine.metrics fields exported as counters (cumulative) and gauges; docs/metrics.md says more
ENGINE_COUNTERS = {
    "num_target_forwards": "engine steps: one target forward each",
    "num_row_steps": "(row, step) pairs, drafted or not",
    "num_drafts": "(row, step) pairs that got at least one draft token",
    "num_draft_tokens": "draft tokens proposed",
    "num_accepted_tokens": "draft tokens accepted",
    "num_rejected_drafts": "drafts in which a token was rejected",
    "num_emitted_tokens": "tokens added to the outputs (accepted drafts + one per row-step)",
    "draft_seconds": "seconds drafting",
    "verify_seconds": "seconds in target forwards",
    "sampler_seconds": "seconds in logits processors and rejection sampling",
    "total_seconds": "seconds in engine steps",
}
ENGINE_GAUGES = {
    "mean_acceptance_length": "tau = 1 + accepted / drafts: tokens a drafted step yields on average",
    "draft_acceptance_rate": "accepted / proposed draft tokens",
    "conditional_acceptance_rate": "alpha: accepted / (accepted + rejections)",
    "mean_k_chosen": "drafts per row the steps asked for, on average",
    "kv_peak_blocks_used": "the most KV blocks in use at once",
}


class _EngineCollector:
    """Prometheus collector reading the engine thread's latest snapshot at each scrape."""

    def __init__(self, engine_loop: EngineLoop) -> None:
        self.engine_loop = engine_loop

    def collect(self):
        stats = self.engine_loop.stats
        for name, documentation in ENGINE_COUNTERS.items():
            yield CounterMetricFamily(f"spec_decode_{name}", documentation, value=stats.metrics[name])
        per_position = CounterMetricFamily(
            "spec_decode_num_accepted_tokens_per_pos", "drafts whose first position+1 tokens were accepted",
            labels=["position"],
        )
        for position, count in enumerate(stats.metrics["num_accepted_tokens_per_pos"]):
            per_position.add_metric([str(position)], count)
        yield per_position
        for name, documentation in ENGINE_GAUGES.items():
            yield GaugeMetricFamily(f"spec_decode_{name}", documentation, value=stats.metrics[name])
        yield GaugeMetricFamily("spec_decode_num_requests_running", "requests being decoded", value=stats.num_running)
        yield GaugeMetricFamily("spec_decode_num_requests_waiting", "requests queued for a row", value=stats.num_waiting)


class _RequestCounters:
    """Generation requests that reached the engine, by endpoint and how they ended, and their tokens."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "spec_decode_requests", "generation requests by endpoint and finish reason (stop, length, tool_calls, error, "
            "abort: the client went away); each of a request's n choices counts", ["endpoint", "finish_reason"], registry=registry,
        )  # fmt: skip
        self.prompt_tokens = Counter("spec_decode_prompt_tokens", "prompt tokens of those requests", registry=registry)
        self.completion_tokens = Counter(
            "spec_decode_completion_tokens", "tokens those requests generated", registry=registry
        )

    def finished(self, endpoint: str, finish_reasons: list[str], prompt_tokens: int, completion_tokens: int) -> None:
        """One HTTP request: each of its choices, the prompt once, the choices' tokens."""
        for finish_reason in finish_reasons:
            self.requests.labels(endpoint, finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)


def serve(model_path: str, speculative_config: SpeculativeConfig | dict | str | None, host: str = "127.0.0.1",
          port: int = 8000, api_key: str | None = None, max_batch_size: int = 16, max_model_len: int | None = None,
          num_kv_blocks: int | None = None, dtype: torch.dtype | str = "auto", device: str = "cpu",
          prefill_chunk_size: int | None = None) -> None:
    """Loads the model (a folder, a Hub id, or 'smollm2' / 'gemma3' from PyPI, as `hf-specdec bench`)
    and serves it until interrupted. Without `api_key` on a host other than localhost, warns: anyone who
    can reach the port can use the model."""
    if host not in LOCAL_HOSTS and api_key is None:
        print(f"warning: serving on {host}:{port} without an API key: anyone who can reach it can use the model "
              "(give --api-key or set HF_SPECDEC_API_KEY)", file=sys.stderr)
    model, tokenizer = load_target(model_path, dtype, device)
    processor = load_image_processor(model_path)
    engine = SpeculativeEngine(model, speculative_config, max_batch_size=max_batch_size, max_model_len=max_model_len,
                               num_kv_blocks=num_kv_blocks, tokenizer=tokenizer, prefill_chunk_size=prefill_chunk_size)
    run_app(build_app(engine, tokenizer, model_path, api_key, engine_thread=False, processor=processor), host, port)


def run_app(app: FastAPI, host: str, port: int) -> None:
    """Serve `app` (built with `engine_thread=False`) until interrupted or stopped: uvicorn on a thread of
    its own, the engine on this one (why: engine_loop.py)."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port))
    engine_loop = app.state.engine_loop

    def serve_http() -> None:
        try:
            server.run()
        finally:  # uvicorn ended (shut down, or it could not bind): so does the engine loop
            engine_loop.stop()

    http = threading.Thread(target=serve_http, name="hf-specdec-http", daemon=True)
    http.start()
    if threading.current_thread() is threading.main_thread():  # uvicorn's graceful SIGTERM, now ours
        signal.signal(signal.SIGTERM, lambda signum, frame: engine_loop.stop())
    try:
        engine_loop.run()
    except KeyboardInterrupt:  # uvicorn no longer owns the signals: Ctrl-C lands here
        engine_loop.end_all()
    finally:
        server.should_exit = True
        http.join()
