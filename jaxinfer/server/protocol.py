"""Request bodies of the OpenAI API subset we serve, and the OpenAI error shape.

Unknown fields are ignored (clients send many optional ones); known fields are typed so a
wrongly typed value is a 400 naming the field. Range checks live in `SamplingParams`; the
fields it never sees as they were sent (seed, the penalties) are checked here.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from jaxinfer.sampling import MAX_LOGPROBS, SamplingParams
from jaxinfer.server.tools import check_tools, constraint, template_message
from jaxinfer.structured_output import StructuredOutputsParams, strict_schema

STRUCTURED_OPTIONS = frozenset({"disable_any_whitespace", "disable_additional_properties",
                                "ignore_unsupported_keywords"})  # options, not constraints


class ErrorBody(Exception):
    """An error the server answers with `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 err_type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.err_type, self.headers = err_type, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}


class Body(BaseModel):
    """A request body's model: `null` for an optional field means its default, as OpenAI's
    API (whose SDK sends `"temperature": null` for `temperature=None`) and vLLM read it."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {key: value for key, value in data.items()
                if value is not None or key not in fields or fields[key].is_required()}


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class JsonSchemaFormat(Body):
    """`response_format.json_schema`: the schema (under the key "schema") and its name."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")  # `schema` would shadow pydantic's
    strict: bool | None = None  # true: objects admit only their declared properties (`strict_schema`)


class ResponseFormat(Body):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None


class _Common(Body):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # optional, as vLLM has it: the served model
    max_tokens: int | None = Field(None, ge=0)  # 0: only with completions' echo (score the prompt)
    min_tokens: int = Field(0, ge=0)  # extra (vLLM's): no EOS / stop before this many tokens
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = Field(0, ge=-1)  # extra; -1 also means off (vLLM's convention)
    min_p: float = 0.0  # extra
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # an int64 or uint64; its low 32 bits seed the choice
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = 1.0  # extra (vLLM's): HF's repetition penalty over prompt and output
    logit_bias: dict[str, float] | None = None  # {"token id": bias in [-100, 100]}
    allowed_token_ids: list[int] | None = None  # extra (vLLM's): sample only among these ids
    bad_words: list[str] | None = None  # extra (vLLM's): words the output never holds
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extra
    include_stop_str_in_output: bool = False  # extra (vLLM's)
    ignore_eos: bool = False  # extra
    skip_special_tokens: bool = True  # extra (vLLM's): False keeps special tokens in the text
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # extra (vLLM's): {"json" | "regex" | "choice" | "grammar" | "json_object": ...}, and its older names
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    user: str | None = None
    cache_salt: str | None = None  # extra; defaults to `user`: tenants never share prefix pages
    # extra (vLLM's): each prompt token's logprob, rank and this many alternatives (not streamed)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # extra (vLLM's): keep the prompt's last k tokens (-1: the context)

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keeps_something(cls, keep: int | None) -> int | None:
        if keep == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (the context) or at least 1")
        return keep

    def sampling_params(self, default_max_tokens: int, defaults: Mapping[str, Any] | None = None) -> list[SamplingParams]:
        """One SamplingParams per choice (choice i of a seeded request uses seed + i). `defaults`
        (the model's generation config: `temperature`, `top_p`, ... `max_tokens`) replace the
        API's own defaults for the fields the request leaves out, as in vLLM."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        unset = {k: v for k, v in (defaults or {}).items() if k not in self.model_fields_set}
        max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = min(default_max_tokens, unset.get("max_tokens", default_max_tokens))
        picked = {k: unset.get(k, getattr(self, k)) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
        base = dict(picked, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=tuple(stop),
                    include_stop_str_in_output=self.include_stop_str_in_output,
                    stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                    skip_special_tokens=self.skip_special_tokens,
                    logprobs=self.num_logprobs, frequency_penalty=self.frequency_penalty,
                    presence_penalty=self.presence_penalty,
                    logit_bias=self._logit_bias(), structured_outputs=self.structured(),
                    allowed_token_ids=self.allowed_token_ids, bad_words=tuple(self.bad_words or ()),
                    output_kind="delta" if self.stream else "cumulative")  # a stream sends only what is new
        seeds = [None] * self.n if self.seed is None else [(self.seed + i) % 2**32 for i in range(self.n)]
        return [SamplingParams(seed=s, **base) for s in seeds]

    @property
    def num_logprobs(self) -> int | None:
        """`SamplingParams.logprobs`: None (off) or the number of top alternatives."""
        return None

    def structured(self) -> StructuredOutputsParams | None:
        """What the output must match, from whichever field asked (at most one may), its
        grammar checked; a ValueError names the field."""
        asked = self._tool_constraint()
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise ValueError("response_format: type 'json_schema' needs json_schema.schema")
            schema = rf.json_schema.json_schema
            # OpenAI's strict mode refuses keywords it cannot enforce; a schema without it is best effort
            strict = bool(rf.json_schema.strict)
            asked.append(("response_format", {"json": strict_schema(schema) if strict else schema,
                                              "ignore_unsupported_keywords": not strict}))
        options = {}  # structured_outputs naming options only: they apply to another field's constraint (vLLM's merge)
        if self.structured_outputs is not None and set(self.structured_outputs) <= STRUCTURED_OPTIONS:
            options = self.structured_outputs
        elif self.structured_outputs is not None:
            asked.append(("structured_outputs", self.structured_outputs))
        for name in ("json", "regex", "choice", "grammar"):
            if (value := getattr(self, f"guided_{name}")) is not None:
                asked.append((f"guided_{name}", {name: value}))
        if options and not asked:
            asked.append(("structured_outputs", options))  # refused below: no constraint named
        if len(asked) > 1:
            raise ValueError(f"{asked[0][0]}: send only one of response_format, structured_outputs and guided_* "
                             f"(got {[field for field, _ in asked]})")
        if not asked:
            return None
        field, fields = asked[0]
        try:
            params = StructuredOutputsParams.from_dict(options | fields)
            params.grammar_text()  # a bad schema or grammar is this request's 400, not an engine error
        except (TypeError, ValueError) as e:
            message = str(e)
            raise ValueError(message if message.startswith(field) else f"{field}: {message}") from None
        return params

    def _tool_constraint(self) -> list[tuple[str, dict[str, Any]]]:
        """(field, structured-output fields) a tool choice asks for: chat only."""
        return []

    def _logit_bias(self) -> dict[int, float]:
        """OpenAI sends token ids as JSON object keys (strings)."""
        try:
            return {int(token): value for token, value in (self.logit_bias or {}).items()}
        except ValueError:
            raise ValueError(f"logit_bias must map token ids (the JSON keys) to numbers, got keys {list(self.logit_bias)[:5]}"
                             ) from None

    @property
    def salt(self) -> str | None:
        """The prefix cache's tenant: `cache_salt`, else `user` (a namespace of its own: a
        cache_salt equal to someone's user id does not reach their pages)."""
        if self.cache_salt is not None:
            return self.cache_salt
        return None if self.user is None else f"\x00user:{self.user}"

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]  # one prompt, or a batch (n choices each)
    echo: bool = False
    suffix: str | None = None  # refused unless empty: no fill-in-the-middle
    best_of: int | None = Field(None, ge=1)  # refused above 1 (as vLLM's v1 engine does)
    add_special_tokens: bool = True  # extra (vLLM's): False encodes a text prompt without BOS and the like
    use_beam_search: bool = False  # extra (vLLM's): refused when true, as best_of > 1
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # top alternatives per token

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class ContentPart(Body):
    """One part of a message's content. Only text is read: a message with other parts (images,
    audio, files) is refused by `ChatMessage`, not answered as if they were not there."""

    model_config = ConfigDict(extra="ignore")

    type: str
    text: str = ""


class ChatMessage(Body):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call
    name: str | None = None
    # an assistant's earlier thinking (vLLM takes both names); templates that keep the latest
    # thinking (Qwen3's, between tool calls) read `reasoning_content`
    reasoning_content: str | None = None
    reasoning: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content: str | list[ContentPart] | None) -> str | list[ContentPart] | None:
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if part.type != "text":
                raise ValueError(f"part {j} is of type {part.type!r}: this model reads text parts only")
        return content

    @model_validator(mode="after")
    def _says_something(self) -> ChatMessage:
        # OpenAI's 400s: a null content renders as an empty turn, which no client means
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs its content")
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs its content or its tool_calls")
        return self

    def template_fields(self) -> dict[str, Any]:
        """The message as the chat template reads it (`jaxinfer.server.tools.template_message`)."""
        extra = {key: value for key in ("tool_calls", "tool_call_id", "name") if (value := getattr(self, key)) is not None}
        if (thinking := self.reasoning_content or self.reasoning) is not None:
            extra["reasoning_content"] = thinking
        return template_message({"role": self.role, "content": self.text()} | extra)

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)  # text parts only (`_text_parts_only`)


class ChatTemplateOptions(Body):
    """How messages are rendered (vLLM's extras): the assistant's turn opened, or the last
    message continued (a prefilled answer: no turn opened, and asking for one too is refused),
    and variables the chat template reads (`chat_template_kwargs`, e.g. `enable_thinking`)."""

    add_generation_prompt: bool | None = None  # default: True, False with continue_final_message
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def template_options(self) -> dict[str, Any]:
        reserved = {"messages", "add_generation_prompt", "continue_final_message", "tools"}
        if clash := reserved & set(self.chat_template_kwargs or {}):
            raise ErrorBody(400, f"chat_template_kwargs: {sorted(clash)} have fields of their own",
                            param="chat_template_kwargs")
        opening = not self.continue_final_message if self.add_generation_prompt is None else self.add_generation_prompt
        return (self.chat_template_kwargs or {}) | {"add_generation_prompt": opening,
                                                     "continue_final_message": self.continue_final_message}


class FunctionDefinition(Body):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # true: objects admit only their declared properties (`strict_schema`)


class ToolDefinition(Body):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"] = "function"
    function: FunctionName


class ChatCompletionRequest(ChatTemplateOptions, _Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # needs logprobs=true
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # OpenAI: "auto" if tools
    parallel_tool_calls: bool | None = None  # False: "required" makes exactly one call
    include_reasoning: bool = True  # extra (vLLM's): with a reasoning parser, False drops the thinking
    chat_template: str | None = None  # vLLM's per-request template: refused (`jaxinfer serve --chat-template`)

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice | None:
        """OpenAI's default: "auto" when tools are sent, else none."""
        if self.tool_choice is None:
            return "auto" if self.tools else None
        return self.tool_choice

    @property
    def calls_tools(self) -> bool:
        """Whether the answer is constrained to tool calls (a named function or "required")."""
        return bool(self.tools) and self.effective_tool_choice not in (None, "none", "auto")

    def template_tools(self) -> list[dict[str, Any]] | None:
        """`tools` as chat templates read them (templates without tool support ignore them)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def _tool_constraint(self) -> list[tuple[str, dict[str, Any]]]:
        check_tools(self.tools, self.effective_tool_choice)
        fields = constraint(self.tools, self.effective_tool_choice, self.parallel_tool_calls)
        return [] if fields is None else [("tool_choice", fields)]

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(ChatTemplateOptions):
    """vLLM's `POST /tokenize`: a prompt, or chat messages rendered with the chat template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompt: BOS as the model wants it
    return_token_strs: bool = False


class DetokenizeRequest(Body):
    """vLLM's `POST /detokenize`."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
    skip_special_tokens: bool = False  # as transformers' decode: `<|im_start|>` and the like stay


def new_id(prefix: str, sep: str = "-") -> str:
    """An id as OpenAI writes it: "chatcmpl-..." (chat, completions), "resp_..." (Responses: sep "_")."""
    return f"{prefix}{sep}{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; `cached_tokens`: the prompt tokens the prefix cache spared (OpenAI's
    `prompt_tokens_details`)."""
    use: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    return use if cached_tokens is None else use | {"prompt_tokens_details": {"cached_tokens": cached_tokens}}
