"""common.tokenizer gives the same results as transformers' AutoTokenizer on the same directory."""

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from common.config import TokenizerServiceConfig
from common.errors import InvalidRequestError
from common.flags import from_args
from common.tokenizer import Tokenizer, read_chat_template
from folio.cli import build_parser
from services.supervisor import ServeConfig

TEXTS = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\n\nlines\r\n",
    "héllo wörld, ça va? ¿Qué tal? Ελληνικά, русский",
    "emoji 😀👍🏽🇫🇷 and a family 👨‍👩‍👧",
    "中文文本，日本語のテキスト、한국어 텍스트",  # noqa: RUF001 (the fullwidth comma is the point)
    "code: def f(x):\n    return x**2  # comment",
    "special tokens inline <|im_start|>user\nhi<|im_end|> <|endoftext|>",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ],
    [
        {"role": "system", "content": "Réponds en français."},
        {"role": "user", "content": "Bonjour 😀"},
        {"role": "assistant", "content": "Bonjour ! Comment puis-je aider ?"},
        {"role": "user", "content": "写一首诗"},
    ],
    [{"role": "user", "content": "x", "name": None}, {"role": "assistant", "content": ""}],
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="module")
def reference(default_model_dir: Path):
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_equal_transformers(tokenizer: Tokenizer, reference, text: str) -> None:
    for add_special_tokens in (True, False):
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        assert ids == reference(text, add_special_tokens=add_special_tokens).input_ids
    for skip in (True, False):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == reference.decode(
            ids, skip_special_tokens=skip
        )


def test_decode_random_ids_equals_transformers(tokenizer: Tokenizer, reference) -> None:
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 20))]
        for skip in (True, False):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == reference.decode(
                ids, skip_special_tokens=skip
            ), ids


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(
    tokenizer: Tokenizer, reference, messages: list[dict], add_generation_prompt: bool
) -> None:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    ids = tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    expected = reference.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    assert ids == expected
    assert ids.count(tokenizer.bos_token_id) == text.count("<|im_start|>")


# A Llama 3 style template: it trims each message's content, so a continued message ends at its
# trimmed text.
TRIMMING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("template", [None, TRIMMING_TEMPLATE], ids=["model's", "trimming"])
@pytest.mark.parametrize("content", ["The answer is", "The answer is ", "  Sure:\n", "x"])
def test_continue_final_message_equals_transformers(
    tmp_path: Path, default_model_dir: Path, template: str | None, content: str
) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / name).write_bytes((default_model_dir / name).read_bytes())
    if template is not None:
        (tmp_path / "chat_template.jinja").write_text(template)
    tokenizer = Tokenizer.from_dir(tmp_path)
    reference = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": content}]
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    assert text == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert text.rstrip().endswith(content.strip()) and not text.endswith("<|im_end|>\n")
    ids = tokenizer.encode_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert ids == tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    ("messages", "add_generation_prompt", "problem"),
    [
        ([{"role": "assistant", "content": "a"}], True, "cannot both be true"),
        ([{"role": "assistant", "content": "  "}], False, "needs a final message with text"),
        ([{"role": "user", "content": "hi"}], False, None),
    ],
)
def test_continue_final_message_refusals(
    tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool, problem: str | None
) -> None:
    if problem is None:  # any role may be continued, as in transformers
        assert tokenizer.apply_chat_template(
            messages, add_generation_prompt, continue_final_message=True
        ).endswith("<|im_start|>user\nhi")
        return
    with pytest.raises(InvalidRequestError, match=problem) as error:
        tokenizer.apply_chat_template(messages, add_generation_prompt, continue_final_message=True)
    assert error.value.param == "continue_final_message"


def test_continue_final_message_needs_the_text_as_sent(tmp_path: Path, default_model_dir: Path):
    (tmp_path / "tokenizer.json").write_bytes((default_model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    )
    tokenizer = Tokenizer.from_dir(tmp_path)
    with pytest.raises(InvalidRequestError, match="does not write the final message's text"):
        tokenizer.apply_chat_template(
            [{"role": "assistant", "content": "lower"}], False, continue_final_message=True
        )


def test_special_ids_and_lengths_equal_transformers(tokenizer: Tokenizer, reference) -> None:
    assert tokenizer.vocab_size == len(reference)
    assert tokenizer.bos_token_id == reference.bos_token_id
    assert reference.eos_token_id in tokenizer.eos_token_ids
    assert tokenizer.special_token_ids == set(reference.all_special_ids) | {
        i for i, t in reference.added_tokens_decoder.items() if t.special
    }
    assert tokenizer.max_model_len == 8192
    assert all(
        tokenizer.id_to_token(i) == reference.convert_ids_to_tokens(i) for i in range(0, 49152, 97)
    )


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], r"messages\[0\] must be a dict"),
        ([{"content": "hi"}], r"messages\[0\] has no 'role'"),
        ([{"role": "user", "content": "a"}, {"role": "user"}], r"messages\[1\] has no 'content'"),
        ([{"role": "user", "content": None}], r"messages\[0\] has no 'content'"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\['content'\] must be a string, got int"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "must be a string, got list",
        ),
        ([{"role": 1, "content": "hi"}], r"messages\[0\]\['role'\] must be a string"),
    ],
)
def test_malformed_messages_are_rejected(tokenizer: Tokenizer, messages, problem: str) -> None:
    with pytest.raises(InvalidRequestError, match=problem):
        tokenizer.apply_chat_template(messages)
    with pytest.raises(InvalidRequestError, match=problem):
        tokenizer.encode_chat(messages)


# Exercises what transformers sets up for templates: trim_blocks/lstrip_blocks, raise_exception,
# its tojson (no HTML or non-ASCII escaping), loop controls, the generation tag, special tokens.
DEMANDING_TEMPLATE = """{{ bos_token }}
{% for m in messages %}
    {% if m['role'] == 'system' %}
        {{ raise_exception('System role not supported') }}
    {% endif %}
    {% if m['content'] == 'skip me' %}{% continue %}{% endif %}
    [{{ m['role'] }}] {{ m['content'] | tojson }}
    {% if m['role'] == 'assistant' %}
        {% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
    [assistant]
{% endif %}
"""


def test_template_environment_equals_transformers(tmp_path: Path, default_model_dir: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((default_model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "chat_template.jinja").write_text(DEMANDING_TEMPLATE)
    (tmp_path / "tokenizer_config.json").write_text(
        '{"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}'
    )
    tokenizer = Tokenizer.from_dir(tmp_path)
    reference = AutoTokenizer.from_pretrained(tmp_path)
    messages = [
        {"role": "user", "content": 'é "quoted" <tag> & 😀'},
        {"role": "user", "content": "skip me"},
        {"role": "assistant", "content": "ok"},
    ]
    for add_generation_prompt in (True, False):
        assert tokenizer.apply_chat_template(messages, add_generation_prompt) == (
            reference.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        )
    with pytest.raises(InvalidRequestError, match="System role not supported"):
        tokenizer.apply_chat_template([{"role": "system", "content": "x"}])


def test_sentencepiece_style_tokenizer_equals_transformers(
    sentencepiece_style_tokenizer_dir: Path,
) -> None:
    tokenizer = Tokenizer.from_dir(sentencepiece_style_tokenizer_dir)
    reference = AutoTokenizer.from_pretrained(sentencepiece_style_tokenizer_dir)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == reference(text).input_ids, text
        assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True), text


def test_a_chat_template_flag_is_a_file_or_a_template_that_compiles(tmp_path: Path) -> None:
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert read_chat_template(str(tmp_path / "t.jinja")) == template
    assert read_chat_template(template) == template
    with pytest.raises(ValueError, match=r"chat_template '/no/such\.jinja' is neither a file"):
        read_chat_template("/no/such.jinja")
    with pytest.raises(ValueError, match=r"chat_template does not compile: .*\(line 2\)"):
        read_chat_template("ok\n{% for m in messages %}{{ m.content }}")
    # folio serve and folio tokenizer refuse it before any service starts.
    for command, config in (("serve", ServeConfig), ("tokenizer", TokenizerServiceConfig)):
        args = build_parser().parse_args([command, "--chat-template", "/no/such.jinja"])
        with pytest.raises(ValueError, match="neither a file"):
            from_args(config, args)
