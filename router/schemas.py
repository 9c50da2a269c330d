"""Request schemas: the OpenAI fields pdserve honours (others are ignored, except those it cannot honour:
``router.guides.REFUSED``, a 400), validated here so a bad request is a 400 naming its ``param``.

``fanout`` turns one request into the sequences it asks for: ``n`` choices
for each prompt of a batch, each with its own seed (choice 0 keeps the
request's seed, so ``n=1`` and ``n=2`` agree on the first choice) and every
sampling default resolved except ``max_tokens`` of chat, which the first
worker settles against the context limit once it has the prompt's tokens."""
from __future__ import annotations

import hashlib
import secrets
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from .guides import guide_of, refused_fields
from .tools.spec import check_tools, choice_mode, forced_guide

MAX_PROMPT_CHARS = 1 << 20
MAX_N = 16
MAX_BATCH = 64
MAX_CHOICES = 64
MAX_LOGPROBS = 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    continuous_usage_stats: bool = False


def choice_seed(seed: int, index: int) -> int:
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept to refuse what cannot be honoured (guides.REFUSED)
    _guide: Optional[dict] = PrivateAttr(default=None)

    model: str
    max_tokens: Optional[int] = Field(default=None, ge=1, le=1 << 20)
    min_tokens: int = Field(default=0, ge=0, le=1 << 20)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: Optional[float] = Field(default=None, gt=0.0, le=10.0)
    n: Optional[int] = Field(default=None, ge=1, le=MAX_N)
    seed: Optional[int] = Field(default=None, ge=-(1 << 63), lt=1 << 63)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = Field(default=None, max_length=64)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    response_format: Optional[dict] = None
    guided_json: Optional[Union[dict, str]] = None
    guided_choice: Optional[list[str]] = None
    guided_regex: Optional[str] = None
    guided_grammar: Optional[str] = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return []
        v = [v] if isinstance(v, str) else v
        if len(v) > 16 or any(not s or len(s) > 256 for s in v):
            raise ValueError("stop must be at most 16 non-empty strings of at most 256 characters")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v):
        if v and any(t < 0 for t in v):
            raise ValueError("stop_token_ids must be non-negative")
        return v

    @model_validator(mode="after")
    def _limits(self):
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        refused = refused_fields(self.model_extra or {})
        if refused:
            raise ValueError("; ".join(f"{field}: {why}" for field, why in refused))
        self._guide = guide_of(self.response_format, self.guided_json, self.guided_choice, self.guided_regex,
                               self.guided_grammar)
        return self

    def _params(self, max_tokens, logprobs, seed: int) -> dict:
        return {
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": self.top_k or 0,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "repetition_penalty": self.repetition_penalty or 1.0,
            "seed": seed,
            "stop": self.stop or [],
            "stop_token_ids": self.stop_token_ids or [],
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "guide": self._guide,
        }

    def _seed(self) -> int:
        return self.seed if self.seed is not None else secrets.randbits(63)

    @property
    def choices_per_prompt(self) -> int:
        return self.n or 1


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        batch = v if isinstance(v, list) and v and isinstance(v[0], (str, list)) else [v]
        if len(batch) > MAX_BATCH:
            raise ValueError(f"at most {MAX_BATCH} prompts in one request")
        for p in batch:
            if isinstance(p, str) and len(p) > MAX_PROMPT_CHARS:
                raise ValueError(f"prompt longer than {MAX_PROMPT_CHARS} characters")
            if not p:
                raise ValueError("prompt is empty")
        return v

    @property
    def prompts(self) -> list:
        v = self.prompt
        return v if isinstance(v, list) and isinstance(v[0], (str, list)) else [v]

    def fanout(self) -> list[dict]:
        """One payload per choice, in choice-index order (prompt-major)."""
        if len(self.prompts) * self.choices_per_prompt > MAX_CHOICES:
            raise ValueError(f"a request may ask for at most {MAX_CHOICES} choices (prompts x n)")
        seed, out = self._seed(), []
        max_tokens = self.max_tokens if self.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        for prompt in self.prompts:
            for i in range(self.choices_per_prompt):
                params = self._params(max_tokens, self.logprobs, choice_seed(seed, i))
                params["echo"] = self.echo
                params["prompt_logprobs"] = self.logprobs if self.echo else None
                out.append({"prompt": prompt, "params": params})
        return out


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: Optional[str] = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text":
            raise ValueError(f"content parts of type {self.type!r} are not supported (text only)")
        if self.text is None:
            raise ValueError("a text content part needs 'text'")
        return self


CONTENT_REQUIRED = ("system", "developer", "user", "tool")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list] = None
    tool_call_id: Optional[str] = None

    @model_validator(mode="after")
    def _content_by_role(self):
        if self.content is None and (self.role in CONTENT_REQUIRED or not self.tool_calls):
            raise ValueError(f"a {self.role} message needs 'content' (a string or a list of text parts)")
        if isinstance(self.content, list) and not self.content and self.role in CONTENT_REQUIRED:
            raise ValueError(f"a {self.role} message needs at least one content part")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs 'tool_call_id'")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1, le=1 << 20)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Optional[list] = None
    tool_choice: Optional[Union[str, dict]] = None
    parallel_tool_calls: bool = True
    _functions: Optional[list] = PrivateAttr(default=None)
    _tool_mode: str = PrivateAttr(default="none")

    @property
    def tool_mode(self) -> str:
        """``none``, ``auto`` or ``forced`` (``router.tools.spec``)."""
        return self._tool_mode

    @property
    def tool_names(self) -> set[str]:
        return {f["name"] for f in self._functions or []}

    @model_validator(mode="after")
    def _tool_options(self):
        self._functions = check_tools(self.tools) if self.tools is not None else None
        self._tool_mode, name = choice_mode(self.tool_choice, self._functions)
        if self._tool_mode == "forced":
            if self._guide is not None:
                raise ValueError("give response_format (or a guided_ field) or a forced tool_choice, not both")
            self._guide = forced_guide(self._functions, name, self.parallel_tool_calls)
        return self

    @model_validator(mode="after")
    def _chat_options(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt: false")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs an assistant message last")
        limit = self.max_tokens if self.max_tokens is not None else self.max_completion_tokens
        if limit is not None and self.min_tokens > limit:
            raise ValueError("min_tokens must not exceed max_tokens")
        return self

    def plain_messages(self) -> list[dict]:
        total = sum(len(m.text()) for m in self.messages)
        if total > MAX_PROMPT_CHARS:
            raise ValueError(f"messages longer than {MAX_PROMPT_CHARS} characters")
        out = []
        for m in self.messages:
            msg = {"role": m.role, "content": m.text()}
            for key in ("name", "tool_calls", "tool_call_id"):
                if getattr(m, key):
                    msg[key] = getattr(m, key)
            out.append(msg)
        return out

    def fanout(self) -> list[dict]:
        messages, seed = self.plain_messages(), self._seed()
        limit = self.max_tokens if self.max_tokens is not None else self.max_completion_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        chat = {"add_generation_prompt": self.add_generation_prompt, "continue_final_message": self.continue_final_message}
        if self._tool_mode != "none":
            chat["tools"] = self.tools
        return [{"messages": messages, "chat": chat, "params": self._params(limit, logprobs, choice_seed(seed, i))}
                for i in range(self.choices_per_prompt)]
