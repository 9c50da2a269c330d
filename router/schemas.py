"""Request schemas (the OpenAI fields pdserve honours; others are ignored)."""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_PROMPT_CHARS = 1 << 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: Optional[int] = Field(default=None, ge=1, le=1 << 20)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=1)
    seed: Optional[int] = Field(default=None, ge=-(1 << 63), lt=1 << 63)
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    return_token_ids: bool = False

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return []
        v = [v] if isinstance(v, str) else v
        if len(v) > 16 or any(not s or len(s) > 256 for s in v):
            raise ValueError("stop must be at most 16 non-empty strings of at most 256 characters")
        return v

    def params(self, default_max_tokens: Optional[int]) -> dict:
        return {
            "max_tokens": self.max_tokens if self.max_tokens is not None else default_max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed if self.seed is not None else 0,
            "stop": self.stop or [],
            "ignore_eos": self.ignore_eos,
        }


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    logprobs: Optional[int] = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported; send one prompt per request")
            v = v[0]
        if isinstance(v, str) and len(v) > MAX_PROMPT_CHARS:
            raise ValueError(f"prompt longer than {MAX_PROMPT_CHARS} characters")
        if not v:
            raise ValueError("prompt is empty")
        return v

    @field_validator("echo", "logprobs")
    @classmethod
    def _unsupported(cls, v, info):
        if v:
            raise ValueError(f"{info.field_name} is not supported")
        return v


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1, le=1 << 20)

    def params(self, default_max_tokens):
        out = super().params(default_max_tokens)
        if self.max_tokens is None and self.max_completion_tokens is not None:
            out["max_tokens"] = self.max_completion_tokens
        return out

    def plain_messages(self) -> list[dict]:
        total = sum(len(m.text()) for m in self.messages)
        if total > MAX_PROMPT_CHARS:
            raise ValueError(f"messages longer than {MAX_PROMPT_CHARS} characters")
        return [{"role": m.role, "content": m.text()} for m in self.messages]
