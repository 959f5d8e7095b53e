"""The tokenizer service over real gRPC on loopback with the default model's tokenizer: results
equal the tokenizer library's, the streaming detokenizer never splits a character (an emoji
spread over three tokens) and holds back a partial stop string, bad input answers
INVALID_ARGUMENT, and health and reflection are served."""

from __future__ import annotations

import grpc
import pytest
from common.grpc_stubs.folio.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc

from common.tokenizer import Tokenizer
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
    assert set(info.special_token_ids) == library.special_token_ids
    named = {t.name: (t.text, t.token_id) for t in info.special_tokens}
    assert named["eos_token"] == (library.special_tokens["eos_token"], library.eos_token_ids[0])


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


def test_health_and_reflection(server):
    assert_health_and_reflection(server.channel, "folio.v1.TokenizerService")
