"""Text <-> token ids for one model directory (or GGUF file): encode, decode, chat templates.

Built on the `tokenizers` library (tokenizer.json) and jinja2 so that the serving processes never
import transformers, yet every result equals what transformers' AutoTokenizer gives for the same
directory. This module must never download anything or touch a device.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as FastTokenizer

from common.errors import InvalidRequestError
from common.gguf_tokenizer import read_gguf_tokenizer

# The named special tokens transformers passes to chat templates (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# config.json keys that hold the context length, most specific first.
CONTEXT_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _load_chat_template(path: Path, tokenizer_config: dict[str, Any]) -> str | None:
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        # Named templates: transformers uses the one called "default".
        named = {entry["name"]: entry["template"] for entry in template}
        template = named.get("default")
    return template


def read_chat_template(value: str) -> str:
    """--chat-template's value as Jinja source: the file it names, else the value itself where
    it reads as a template (vLLM's rule); ValueError naming the flag otherwise, or where the
    template does not compile."""
    path = Path(value).expanduser()
    if path.is_file():
        source = path.read_text()
    elif any(mark in value for mark in ("{{", "{%", "\n")):
        source = value
    else:
        raise ValueError(
            f"chat_template {value!r} is neither a file nor a Jinja template (no {{{{ or {{%)"
        )
    try:
        _compile_chat_template(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"chat_template does not compile: {exc} (line {exc.lineno})") from None
    return source


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; render
    its body."""

    # An instance attribute on jinja2.ext.Extension, read from the class.
    tags: set[str] = {"generation"}  # noqa: RUF012

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _compile_chat_template(source: str) -> jinja2.Template:
    # Same environment as transformers: chat templates are untrusted code, hence the sandbox.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


# Marks of the tool-call formats chat templates teach, by the vLLM parser that reads each.
TOOL_CALL_FORMAT_MARKS = (
    ("hermes", "<tool_call>"),
    ("mistral", "[TOOL_CALLS]"),
    ("llama3_json", "<|python_tag|>"),
    ("openai", "<|call|>"),  # gpt-oss's harmony: a call message ends with <|call|>
)


def tool_call_format(chat_template: str | None) -> str:
    """The tool-call format a chat template teaches ("hermes", "llama3_json", "mistral",
    "openai"), or "" when it knows no tools or none of these formats."""
    if not chat_template or "tools" not in chat_template:
        return ""
    return next((name for name, mark in TOOL_CALL_FORMAT_MARKS if mark in chat_template), "")


def reasoning_format(chat_template: str | None) -> str:
    """How a chat template marks the model's reasoning, named as vLLM names its reasoning
    parsers: "gpt_oss" (harmony's analysis channel), "qwen3" (<think> in a Qwen chat format,
    where an answer without the tag is plain content), "deepseek_r1" (any other <think>
    template, whose model may begin thinking without writing the tag); "" for none."""
    if not chat_template:
        return ""
    if "<|channel|>" in chat_template:
        return "gpt_oss"
    if "<think>" not in chat_template:
        return ""
    return "qwen3" if "<|im_start|>" in chat_template else "deepseek_r1"


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check a chat conversation; return it with None-valued keys dropped (as transformers does)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError(
            "messages must be a non-empty list of {'role': ..., 'content': ...} dicts"
        )
    cleaned = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        message = {k: v for k, v in message.items() if v is not None}
        for key in ("role", "content"):
            if key not in message:
                raise InvalidRequestError(f"messages[{i}] has no '{key}'")
            if not isinstance(message[key], str):
                raise InvalidRequestError(
                    f"messages[{i}]['{key}'] must be a string, got {type(message[key]).__name__}"
                )
        cleaned.append(message)
    return cleaned


def _open_final_message(rendered: str, content: str) -> str:
    """`rendered` cut right after the final message's content: what the template writes after
    it (the end of its turn) goes. Templates that trim a message's surrounding whitespace are
    met where they are: the cut falls after the content's trimmed text, and after its trailing
    whitespace only where the template kept it."""
    text = content.strip()
    if not text:
        raise InvalidRequestError(
            "continue_final_message needs a final message with text to continue",
            "continue_final_message",
        )
    start = rendered.rfind(text)
    if start < 0:
        raise InvalidRequestError(
            "continue_final_message: the chat template does not write the final message's "
            "text as sent, so it cannot be continued",
            "continue_final_message",
        )
    end = start + len(text)
    trailing = content[len(content.rstrip()) :]
    if trailing and rendered.startswith(trailing, end):
        end += len(trailing)
    return rendered[:end]


class Tokenizer:
    """One model's tokenizer: a fast tokenizer, its special tokens and its chat template."""

    def __init__(
        self,
        fast: FastTokenizer,
        tokenizer_config: dict[str, Any],
        model_config: dict[str, Any],
        generation_config: dict[str, Any],
        chat_template: str | None,
    ) -> None:
        self._fast = fast
        self.special_tokens = {
            name: text
            for name in SPECIAL_TOKEN_NAMES
            if (text := _token_text(tokenizer_config.get(name))) is not None
        }
        self.chat_template = chat_template
        self.tool_call_format = tool_call_format(chat_template)
        self.reasoning_format = reasoning_format(chat_template)
        self._template = _compile_chat_template(chat_template) if chat_template else None

        bos_text = self.special_tokens.get("bos_token")
        self.bos_token_id: int | None = (
            fast.token_to_id(bos_text) if bos_text is not None else model_config.get("bos_token_id")
        )
        eos_ids = _as_id_list(generation_config.get("eos_token_id"))
        eos_ids += _as_id_list(model_config.get("eos_token_id"))
        if (eos_text := self.special_tokens.get("eos_token")) is not None:
            eos_ids += _as_id_list(fast.token_to_id(eos_text))
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids))
        self.special_token_ids: frozenset[int] = frozenset(
            token_id for token_id, added in fast.get_added_tokens_decoder().items() if added.special
        )
        self.byte_fallback_ids = self._find_byte_fallback_ids()
        # Read once: a detokenizer checks every generated token against it.
        self._vocab_size: int = fast.get_vocab_size(with_added_tokens=True)
        self.max_model_len: int | None = next(
            (model_config[key] for key in CONTEXT_LENGTH_KEYS if key in model_config), None
        )

    @classmethod
    def from_dir(cls, path: str | Path, chat_template: str | None = None) -> Tokenizer:
        """The tokenizer of a model directory, or of a GGUF file (from its metadata);
        `chat_template` (Jinja source, read_chat_template's) in place of the model's own."""
        path = Path(path)
        if path.suffix == ".gguf":
            gguf = read_gguf_tokenizer(path)
            return cls(
                gguf.fast,
                gguf.tokenizer_config,
                gguf.model_config,
                {},
                chat_template or gguf.chat_template,
            )
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"{str(path)!r} has no tokenizer.json")
        tokenizer_config = _read_json(path / "tokenizer_config.json")
        return cls(
            FastTokenizer.from_file(str(path / "tokenizer.json")),
            tokenizer_config,
            _read_json(path / "config.json"),
            _read_json(path / "generation_config.json"),
            chat_template or _load_chat_template(path, tokenizer_config),
        )

    def to_json(self) -> str:
        """The fast tokenizer serialized (tokenizer.json's form, a GGUF's too): what
        `decoding_only` rebuilds in another process."""
        return self._fast.to_str()

    @classmethod
    def decoding_only(cls, tokenizer_json: str) -> Tokenizer:
        """A tokenizer rebuilt from `to_json`'s text that decodes as the original does (its
        vocabulary, special tokens and byte fallback are all in that text); it has no chat
        template, named special tokens, EOS ids or context length."""
        return cls(FastTokenizer.from_str(tokenizer_json), {}, {}, {}, None)

    def _find_byte_fallback_ids(self) -> frozenset[int]:
        # A ByteFallback decoder turns a run of <0xXX> tokens into the characters of their bytes,
        # or into one U+FFFD per token when the run is not valid UTF-8 as a whole.
        decoder = self._fast.decoder
        if decoder is None or b'"ByteFallback"' not in decoder.__getstate__():
            return frozenset()
        ids = (self._fast.token_to_id(f"<0x{b:02X}>") for b in range(256))
        return frozenset(i for i in ids if i is not None)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return self._vocab_size

    def id_to_token(self, token_id: int) -> str | None:
        """The token's string in the vocabulary (byte-level or SentencePiece form), None if
        unknown."""
        return self._fast.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._fast.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._fast.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The conversation as the template writes it; `tools` (OpenAI's tool definitions,
        {"type": "function", "function": {...}}) go to templates that know tools;
        `template_kwargs`, extra variables (e.g. enable_thinking), never replace the ones set
        here. `continue_final_message` leaves the final message open (the text ends with its
        content, not with the end of its turn), so that the model continues it: an assistant
        reply started by the caller (vLLM's flag; Anthropic's prefill)."""
        if self._template is None:
            raise InvalidRequestError(
                "this model has no chat template; send a plain prompt instead"
            )
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message and add_generation_prompt cannot both be true: "
                "continuing the final message opens no new turn",
                "continue_final_message",
            )
        messages = validate_messages(messages)
        try:
            rendered = self._template.render(
                {
                    **(template_kwargs or {}),
                    "messages": messages,
                    "tools": tools or None,
                    "documents": None,
                    "add_generation_prompt": add_generation_prompt,
                    **self.special_tokens,
                }
            )
        except jinja2.exceptions.TemplateError as error:
            # Templates reject conversations they cannot format (e.g. roles out of order).
            raise InvalidRequestError(
                f"the chat template rejected the messages: {error}"
            ) from error
        if continue_final_message:
            return _open_final_message(rendered, messages[-1]["content"])
        return rendered

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """apply_chat_template's text as token ids."""
        # The template writes its own BOS and control tokens; adding special tokens would double
        # them.
        return self.encode(
            self.apply_chat_template(
                messages, add_generation_prompt, tools, template_kwargs, continue_final_message
            ),
            add_special_tokens=False,
        )
