"""The tokenizer service over real gRPC on loopback with the default model's tokenizer: results
equal the tokenizer library's (the tokenizer itself too, rebuilt from the JSON it hands out),
the streaming detokenizer never splits a character (an emoji spread over three tokens) and holds
back a partial stop string, bad input answers INVALID_ARGUMENT, and health and reflection are
served. A template that knows tools (Qwen2.5's)
gets the tools and the conversation's calls as the library gives them, and its tool-call format
is reported."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import pytest
from common.grpc_stubs.folio.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc

from common.config import TokenizerOptions
from common.tokenizer import Tokenizer, read_chat_template
from grpc_helpers import TIMEOUT, ServerThread, assert_health_and_reflection
from services.tokenizer.server import TokenizerService

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hi in Japanese: 日本語 🦙"},
]


@pytest.fixture(scope="module")
def server(default_model_dir):
    server = ServerThread(TokenizerService(str(default_model_dir), "127.0.0.1", 0))
    yield server
    server.close()


@pytest.fixture(scope="module")
def stub(server):
    return tokenizer_pb2_grpc.TokenizerServiceStub(server.channel)


@pytest.fixture(scope="module")
def library(default_model_dir):
    return Tokenizer.from_dir(default_model_dir)


def chat(messages) -> tokenizer_pb2.Conversation:
    return tokenizer_pb2.Conversation(messages=[common_pb2.ChatMessage(**m) for m in messages])


@pytest.mark.parametrize(
    "text", ["Hello, world!", "日本語 and 🦙 emoji", "  spaced\n\nlines  ", ""]
)
def test_tokenize_text_equals_the_library(stub, library, text):
    request = tokenizer_pb2.TokenizeRequest(text=text, return_token_strs=True)
    answer = stub.Tokenize(request, timeout=TIMEOUT)
    assert list(answer.token_ids) == library.encode(text)
    assert answer.prompt == text
    assert list(answer.token_strs) == [library.id_to_token(i) for i in library.encode(text)]
    plain = stub.Tokenize(
        tokenizer_pb2.TokenizeRequest(text=text, add_special_tokens=False), timeout=TIMEOUT
    )
    assert list(plain.token_ids) == library.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tokenize_chat_equals_the_library(stub, library, add_generation_prompt):
    request = tokenizer_pb2.TokenizeRequest(
        chat=chat(CONVERSATION), add_generation_prompt=add_generation_prompt
    )
    answer = stub.Tokenize(request, timeout=TIMEOUT)
    assert list(answer.token_ids) == library.encode_chat(CONVERSATION, add_generation_prompt)
    assert answer.prompt == library.apply_chat_template(CONVERSATION, add_generation_prompt)


def test_tokenize_defaults_to_a_generation_prompt(stub, library):
    answer = stub.Tokenize(tokenizer_pb2.TokenizeRequest(chat=chat(CONVERSATION)), timeout=TIMEOUT)
    assert list(answer.token_ids) == library.encode_chat(CONVERSATION, add_generation_prompt=True)


def test_detokenize_equals_the_library(stub, library):
    ids = library.encode_chat(CONVERSATION)
    for skip in (True, False):
        answer = stub.Detokenize(
            tokenizer_pb2.DetokenizeRequest(
                token_ids=ids, skip_special_tokens=skip, return_token_texts=True
            ),
            timeout=TIMEOUT,
        )
        assert answer.text == library.decode(ids, skip_special_tokens=skip)
        assert list(answer.token_texts) == [
            library.decode([i], skip_special_tokens=skip) for i in ids
        ]
    default = stub.Detokenize(tokenizer_pb2.DetokenizeRequest(token_ids=ids), timeout=TIMEOUT)
    assert default.text == library.decode(ids)


def test_get_info_equals_the_library(stub, library):
    info = stub.GetInfo(tokenizer_pb2.GetInfoRequest(), timeout=TIMEOUT)
    assert info.vocab_size == library.vocab_size
    assert tuple(info.eos_token_ids) == library.eos_token_ids
    assert info.bos_token_id == library.bos_token_id
    assert info.max_model_len == library.max_model_len
    assert info.has_chat_template
    assert info.tool_call_format == ""  # SmolLM2's template knows no tools
    assert set(info.special_token_ids) == library.special_token_ids
    named = {t.name: (t.text, t.token_id) for t in info.special_tokens}
    assert named["eos_token"] == (library.special_tokens["eos_token"], library.eos_token_ids[0])


def test_the_tokenizer_itself_rebuilt_from_its_json_decodes_as_the_library(stub, library):
    chunks = list(stub.GetTokenizerJson(tokenizer_pb2.GetTokenizerJsonRequest(), timeout=TIMEOUT))
    assert len(chunks) > 1  # the default model's is over one chunk: they join in order
    rebuilt = Tokenizer.decoding_only(b"".join(c.chunk for c in chunks).decode())
    ids = library.encode_chat(CONVERSATION) + library.encode("日本語 🦙", add_special_tokens=False)
    for skip in (True, False):
        assert rebuilt.decode(ids, skip_special_tokens=skip) == library.decode(ids, skip)
    assert rebuilt.vocab_size == library.vocab_size
    assert rebuilt.special_token_ids == library.special_token_ids
    assert rebuilt.byte_fallback_ids == library.byte_fallback_ids


def detokenize_stream(stub, chunks: list[list[int]], finish: bool = True, **options):
    requests = [
        tokenizer_pb2.DetokenizeStreamRequest(
            options=tokenizer_pb2.DetokenizeOptions(**options), token_ids=chunks[0]
        )
    ]
    requests += [tokenizer_pb2.DetokenizeStreamRequest(token_ids=c) for c in chunks[1:]]
    requests.append(tokenizer_pb2.DetokenizeStreamRequest(finish=finish))
    return list(stub.DetokenizeStream(iter(requests), timeout=TIMEOUT))


def test_stream_never_splits_an_emoji(stub, library):
    text = "Llama: 🦙, hug: 🤗, 日本語!"
    ids = library.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # several characters span more than one token
    responses = detokenize_stream(stub, [[i] for i in ids])
    assert len(responses) == len(ids) + 1  # one answer per message
    assert all("\ufffd" not in r.text for r in responses)
    assert "".join(r.text for r in responses) == text
    assert responses[-1].finished and not any(r.finished for r in responses[:-1])


def test_stream_holds_back_a_partial_stop_string(stub, library):
    text = "one STO two STOP three"
    ids = library.encode(text, add_special_tokens=False)
    responses = detokenize_stream(stub, [[i] for i in ids], stop=["STOP"])
    emitted = ""
    for response in responses:
        emitted += response.text
        assert "one STO two STOP".startswith(emitted)
        # Held back: text that may be the start of the stop string is never emitted yet.
        assert not emitted.endswith(("S", "ST", "STO"))
        if response.stop_matched:
            break
    assert emitted == "one STO two "
    assert response.stop_matched == "STOP" and response.finished
    # Everything after the match is empty.
    assert all(r.text == "" and r.finished for r in responses[responses.index(response) + 1 :])


def test_stream_can_keep_the_stop_string(stub, library):
    ids = library.encode("say STOP now", add_special_tokens=False)
    responses = detokenize_stream(stub, [ids], stop=["STOP"], include_stop_str_in_output=True)
    assert "".join(r.text for r in responses) == "say STOP"


def test_stream_releases_held_text_on_finish(stub, library):
    ids = library.encode("the end is ST", add_special_tokens=False)
    held = detokenize_stream(stub, [ids], finish=False, stop=["STOP"])
    flushed = detokenize_stream(stub, [ids], finish=True, stop=["STOP"])
    assert "".join(r.text for r in held) == "the end is "
    assert "".join(r.text for r in flushed) == "the end is ST"


def test_bad_input_answers_invalid_argument(stub, library):
    outside = tokenizer_pb2.DetokenizeRequest(token_ids=[1, library.vocab_size])
    empty_chat = tokenizer_pb2.TokenizeRequest(chat=tokenizer_pb2.Conversation())
    calls = [
        lambda: stub.Detokenize(outside, timeout=TIMEOUT),
        lambda: stub.Tokenize(tokenizer_pb2.TokenizeRequest(), timeout=TIMEOUT),
        lambda: stub.Tokenize(empty_chat, timeout=TIMEOUT),
        lambda: detokenize_stream(stub, [[1]], stop=[""]),
        lambda: detokenize_stream(stub, [[1], [-3]]),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as error:
            call()
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_one_multiplexed_stream_detokenizes_many_sequences_as_their_own_streams(stub, library):
    texts = {7: "Llama: 🦙, hug: 🤗, 日本語!", 8: "one STO two STOP three", 9: "say STOP now"}
    ids = {key: library.encode(text, add_special_tokens=False) for key, text in texts.items()}
    options = {
        7: tokenizer_pb2.DetokenizeOptions(),
        8: tokenizer_pb2.DetokenizeOptions(stop=["STOP"]),
        9: tokenizer_pb2.DetokenizeOptions(stop=["STOP"], include_stop_str_in_output=True),
    }
    steps = max(map(len, ids.values()))
    requests = []
    for step in range(steps + 1):  # one token of each live sequence per message, then finish
        entries = [
            tokenizer_pb2.SequenceTokens(
                sequence_id=key,
                options=options[key] if step == 0 else None,
                token_ids=ids[key][step : step + 1],
                finish=step == len(ids[key]),
            )
            for key in texts
            if step <= len(ids[key])
        ]
        requests.append(tokenizer_pb2.DetokenizeSequencesRequest(sequences=entries))
    responses = list(stub.DetokenizeSequences(iter(requests), timeout=TIMEOUT))
    assert len(responses) == len(requests)  # one answer per message
    out = {key: "" for key in texts}
    stopped: dict[int, str] = {}
    after_stop = []  # entries of sequences whose stop string had matched
    for request, response in zip(requests, responses, strict=True):
        # One entry per request entry, in order.
        assert [e.sequence_id for e in response.sequences] == [
            e.sequence_id for e in request.sequences
        ]
        for entry in response.sequences:
            if entry.sequence_id in stopped:
                after_stop.append(entry)
                continue
            assert "\ufffd" not in entry.text and not entry.error
            out[entry.sequence_id] += entry.text
            if entry.stop_matched:
                assert entry.finished
                stopped[entry.sequence_id] = entry.stop_matched
    # Each equals its own DetokenizeStream; a stopped sequence is dropped, so the entries sent
    # after its stop matched fail alone, naming it, while the others go on.
    assert out[7] == texts[7] and 7 not in stopped
    assert out[8] == "one STO two " and stopped[8] == "STOP"
    assert out[9] == "say STOP" and stopped[9] == "STOP"
    assert after_stop and all("not live" in e.error and e.finished for e in after_stop)


def test_multiplexed_stream_answers_token_texts_releases_and_fails_bad_entries_alone(stub, library):
    im_end = library.encode("<|im_end|>", add_special_tokens=False)
    hello = library.encode("Hello world", add_special_tokens=False)
    requests = [
        tokenizer_pb2.DetokenizeSequencesRequest(
            sequences=[
                tokenizer_pb2.SequenceTokens(
                    sequence_id=1, options=tokenizer_pb2.DetokenizeOptions(), token_ids=hello
                ),
                tokenizer_pb2.SequenceTokens(
                    sequence_id=2, options=tokenizer_pb2.DetokenizeOptions(stop=[""])
                ),
                tokenizer_pb2.SequenceTokens(
                    sequence_id=3,
                    options=tokenizer_pb2.DetokenizeOptions(),
                    token_ids=[library.vocab_size],
                ),
            ],
            token_text_ids=[*hello, *im_end],
        ),
        # Released: the next entry of sequence 1 finds it gone.
        tokenizer_pb2.DetokenizeSequencesRequest(released_sequence_ids=[1]),
        tokenizer_pb2.DetokenizeSequencesRequest(
            sequences=[tokenizer_pb2.SequenceTokens(sequence_id=1, token_ids=hello)]
        ),
    ]
    first, released, after = stub.DetokenizeSequences(iter(requests), timeout=TIMEOUT)
    ok, bad_options, bad_token = first.sequences
    assert ok.text == "Hello world" and not ok.error and not ok.finished
    assert "stop strings" in bad_options.error and bad_options.finished
    assert "outside the vocabulary" in bad_token.error and bad_token.finished
    assert list(first.token_texts) == [
        *(library.decode([i]) for i in hello),
        "<|im_end|>",  # special tokens keep their text
    ]
    assert not released.sequences
    assert "not live" in after.sequences[0].error
    # A token text outside the vocabulary is the message's fault: the stream fails.
    with pytest.raises(grpc.RpcError) as error:
        list(
            stub.DetokenizeSequences(
                iter([tokenizer_pb2.DetokenizeSequencesRequest(token_text_ids=[-1])]),
                timeout=TIMEOUT,
            )
        )
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_health_and_reflection(server):
    assert_health_and_reflection(server.channel, "folio.v1.TokenizerService")


@pytest.fixture(scope="module")
def qwen_template_server(default_model_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen-template")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(default_model_dir / name, directory / name)
    # A model directory has weights; the tokenizer never reads them.
    (directory / "model.safetensors").symlink_to(default_model_dir / "model.safetensors")
    template = Path(__file__).parent.parent / "fixtures" / "chat_templates" / "qwen2_5.jinja"
    shutil.copy(template, directory / "chat_template.jinja")
    server = ServerThread(TokenizerService(str(directory), "127.0.0.1", 0))
    yield server, Tokenizer.from_dir(directory)
    server.close()


def test_tools_and_calls_reach_a_template_that_knows_tools(qwen_template_server):
    server, library = qwen_template_server
    stub = tokenizer_pb2_grpc.TokenizerServiceStub(server.channel)
    info = stub.GetInfo(tokenizer_pb2.GetInfoRequest(), timeout=TIMEOUT)
    assert info.tool_call_format == "hermes"
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    arguments = {"city": "Paris"}
    conversation = tokenizer_pb2.Conversation(
        messages=[
            common_pb2.ChatMessage(role="user", content="Weather?"),
            common_pb2.ChatMessage(
                role="assistant",
                content="",
                tool_calls=[
                    common_pb2.ToolCall(
                        id="call_1", name="get_weather", arguments=json.dumps(arguments)
                    )
                ],
            ),
            common_pb2.ChatMessage(role="tool", content="21 C", tool_call_id="call_1"),
        ],
        tools=[
            common_pb2.Tool(
                name="get_weather", description="Weather in a city.", parameters=json.dumps(schema)
            )
        ],
    )
    answer = stub.Tokenize(tokenizer_pb2.TokenizeRequest(chat=conversation), timeout=TIMEOUT)
    # What the library renders from OpenAI's dicts (arguments parsed, as templates expect).
    expected = library.apply_chat_template(
        [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": arguments},
                    }
                ],
            },
            {"role": "tool", "content": "21 C", "tool_call_id": "call_1"},
        ],
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Weather in a city.",
                    "parameters": schema,
                },
            }
        ],
    )
    assert answer.prompt == expected
    assert '"description": "Weather in a city."' in expected
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in expected
    assert "<tool_response>\n21 C\n</tool_response>" in expected
    assert list(answer.token_ids) == library.encode(expected, add_special_tokens=False)


def test_a_chat_template_given_to_the_service_replaces_the_models(default_model_dir):
    """--chat-template: a file's template (here Qwen2.5's, which knows tools and adds its own
    system prompt) renders the conversations and decides the tool-call format; an inline
    template renders as given."""
    path = Path(__file__).parent.parent / "fixtures" / "chat_templates" / "qwen2_5.jinja"
    inline = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    question = CONVERSATION[1:]  # no system message
    models_own = Tokenizer.from_dir(default_model_dir).apply_chat_template(question)
    for given, tool_call_format, start in (
        (str(path), "hermes", "<|im_start|>system\nYou are Qwen"),
        (inline, "", "[user] Say hi in Japanese"),
    ):
        options = TokenizerOptions(chat_template=given)
        server = ServerThread(TokenizerService(str(default_model_dir), "127.0.0.1", 0, options))
        try:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(server.channel)
            info = stub.GetInfo(tokenizer_pb2.GetInfoRequest(), timeout=TIMEOUT)
            request = tokenizer_pb2.TokenizeRequest(chat=chat(question))
            answer = stub.Tokenize(request, timeout=TIMEOUT)
        finally:
            server.close()
        assert info.has_chat_template and info.tool_call_format == tool_call_format
        library = Tokenizer.from_dir(default_model_dir, read_chat_template(given))
        assert answer.prompt == library.apply_chat_template(question)
        assert answer.prompt.startswith(start) and answer.prompt != models_own
