"""The HTTP gateway driven by the official `openai` client, against real tokenizer and engine
services with the default model: answers equal the engine's own tokens decoded by the tokenizer
library, streaming equals non-streaming, n, seeds, stop strings (which abort the engine
request), usage, logprobs, multi-byte text, and a client that leaves aborts its request."""

from __future__ import annotations

import math
import re
import time

import httpx
import openai
import pytest
from common.grpc_stubs.folio.v1 import common_pb2, engine_pb2

from gateway_helpers import MAX_MODEL_LEN, engine_stats, wait_engine_idle
from grpc_helpers import TIMEOUT

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Write one sentence about the sea."}]
PROMPT = "The three primary colors are"
# Long enough that only an abort ends it within the tests' patience.
LONG = 900


@pytest.fixture(scope="module")
def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT
    )


def engine_tokens(engine_stub, prompt_ids: list[int], **params) -> list[int]:
    """The engine service's own tokens for a prompt (no gateway in between)."""
    request = engine_pb2.GenerateRequest(
        add=engine_pb2.EngineRequest(
            request_id=f"reference-{time.monotonic_ns()}",
            prompt_token_ids=prompt_ids,
            sampling_params=common_pb2.SamplingParams(**params),
        )
    )
    return [
        t
        for response in engine_stub.Generate(iter([request]), timeout=TIMEOUT)
        for out in response.outputs
        for t in out.token_ids
    ]


def stream_text(chunks, kind: str = "chat") -> tuple[str, list]:
    pieces, seen = [], []
    for chunk in chunks:
        seen.append(chunk)
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "" if kind == "chat" else choice.text)
    return "".join(pieces), seen


def test_chat_equals_the_engines_greedy_tokens_decoded(client, engine_stub, tokenizer):
    response = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=24, temperature=0
    )
    prompt_ids = tokenizer.encode_chat(CHAT)
    expected_ids = engine_tokens(engine_stub, prompt_ids, temperature=0.0, max_tokens=24)
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == tokenizer.decode(expected_ids)
    assert choice.finish_reason == ("length" if len(expected_ids) == 24 else "stop")
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == len(expected_ids)
    assert response.usage.total_tokens == len(prompt_ids) + len(expected_ids)
    assert response.model == MODEL and response.object == "chat.completion"


def test_continue_final_message_continues_the_assistants_text(
    client, gateway, engine_stub, tokenizer
):
    started = [*CHAT, {"role": "assistant", "content": "The sea is"}]
    open_ended = {"add_generation_prompt": False, "continue_final_message": True}
    response = client.chat.completions.create(
        model=MODEL, messages=started, max_tokens=8, temperature=0, extra_body=open_ended
    )
    prompt_ids = tokenizer.encode_chat(started, **open_ended)
    prompt = tokenizer.decode(prompt_ids, skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\nThe sea is")
    expected_ids = engine_tokens(engine_stub, prompt_ids, temperature=0.0, max_tokens=8)
    assert response.choices[0].message.content == tokenizer.decode(expected_ids)
    assert response.usage.prompt_tokens == len(prompt_ids)
    # With echo (vLLM's), the answer is the whole message, whole or streamed.
    echoed = {**open_ended, "echo": True}
    whole = client.chat.completions.create(
        model=MODEL, messages=started, max_tokens=8, temperature=0, n=2, extra_body=echoed
    )
    message = "The sea is" + tokenizer.decode(expected_ids)
    assert [c.message.content for c in whole.choices] == [message, message]
    streamed, _ = stream_text(
        client.chat.completions.create(
            model=MODEL,
            messages=started,
            max_tokens=8,
            temperature=0,
            stream=True,
            extra_body=echoed,
        )
    )
    assert streamed == message
    with httpx.Client(base_url=gateway.url, timeout=TIMEOUT) as http:
        counted = http.post("/tokenize", json={"messages": started, **open_ended}).json()
        assert counted["tokens"] == prompt_ids
        both = {**open_ended, "add_generation_prompt": True}
        for path, body in (
            ("/v1/chat/completions", {"messages": started, **both}),
            ("/tokenize", {"messages": started, **both}),
        ):
            refused = http.post(path, json=body)
            assert refused.status_code == 400, path
            assert "continue_final_message and add_generation_prompt" in refused.text


def test_a_pinned_chat_answers_as_an_unpinned_one(client):
    """The `cache` extension reaches the engine (which would fail a TTL it refuses) and changes
    nothing in the answer; tests/services/test_kv_pins.py shows the pin keeping the prefix."""
    args = dict(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    plain = client.chat.completions.create(**args)
    pinned = client.chat.completions.create(
        **args, extra_body={"cache": {"pin_prefix": True, "ttl_seconds": 600}}
    )
    assert pinned.choices[0].message.content == plain.choices[0].message.content


def test_completion_equals_the_engines_greedy_tokens_decoded(client, engine_stub, tokenizer):
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    prompt_ids = tokenizer.encode(PROMPT)
    expected_ids = engine_tokens(
        engine_stub, prompt_ids, temperature=0.0, max_tokens=16, ignore_eos=True
    )
    assert response.choices[0].text == tokenizer.decode(expected_ids)
    assert response.choices[0].finish_reason == "length"
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(prompt_ids), 16)


def test_truncate_prompt_tokens_keeps_the_prompts_end(client, engine_stub, tokenizer):
    long_prompt = "Some words to drop first, whatever they say. " * 3 + PROMPT
    prompt_ids = tokenizer.encode(long_prompt)
    kept = prompt_ids[-6:]
    response = client.completions.create(
        model=MODEL,
        prompt=long_prompt,
        max_tokens=8,
        temperature=0,
        echo=True,
        extra_body={"truncate_prompt_tokens": 6},
    )
    expected_ids = engine_tokens(engine_stub, kept, temperature=0.0, max_tokens=8)
    echoed = tokenizer.decode(kept, skip_special_tokens=False)
    assert response.choices[0].text == echoed + tokenizer.decode(expected_ids)
    assert response.usage.prompt_tokens == 6
    chat = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=1,
        extra_body={"truncate_prompt_tokens": 5},
    )
    assert chat.usage.prompt_tokens == 5 < len(tokenizer.encode_chat(CHAT))


def contains(tokens: list[int], sequence: list[int]) -> bool:
    return any(tokens[i : i + len(sequence)] == sequence for i in range(len(tokens)))


def test_allowed_token_ids_and_bad_words_limit_the_tokens(client, engine_stub, tokenizer):
    yes_no = [tokenizer.encode(word, add_special_tokens=False)[0] for word in (" yes", " no")]
    limited = client.completions.create(
        model=MODEL,
        prompt="Is the sky blue? Answer:",
        max_tokens=6,
        seed=3,
        logprobs=0,
        extra_body={"allowed_token_ids": yes_no, "ignore_eos": True},
    )
    assert set(limited.choices[0].logprobs.tokens) <= {" yes", " no"}
    assert limited.usage.completion_tokens == 6
    # Limits a grammar leaves nothing of end the answer there, with no token they forbid.
    for temperature in (0.0, 1.0):
        stuck = client.completions.create(
            model=MODEL,
            prompt="Is the sky blue? Answer:",
            max_tokens=6,
            temperature=temperature,
            extra_body={"allowed_token_ids": yes_no, "guided_regex": "[0-9]+"},
        ).choices[0]
        assert (stuck.text, stuck.finish_reason) == ("", "stop")

    prompt_ids = tokenizer.encode(PROMPT)
    plain = engine_tokens(engine_stub, prompt_ids, temperature=0.0, max_tokens=12)
    word = tokenizer.decode(plain).split()[1]  # a word the greedy answer says, then banned
    spellings = [tokenizer.encode(w, add_special_tokens=False) for w in (word, " " + word)]
    assert any(contains(plain, ids) for ids in spellings)
    banned = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"bad_words": [word]}
    )
    words = [common_pb2.TokenIds(token_ids=ids) for ids in spellings]
    expected = engine_tokens(
        engine_stub, prompt_ids, temperature=0.0, max_tokens=12, bad_words_token_ids=words
    )
    assert banned.choices[0].text == tokenizer.decode(expected)
    assert not any(contains(expected, ids) for ids in spellings) and expected != plain


def test_streamed_text_equals_non_streamed_for_the_same_seed(client):
    args = dict(model=MODEL, messages=CHAT, max_tokens=32, temperature=0.9, seed=1234)
    whole = client.chat.completions.create(**args)
    text, chunks = stream_text(
        client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    assert text == whole.choices[0].message.content
    # One event per token delta: many of them, the first with the role, usage last.
    assert len(chunks) > 5
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    )


def test_streamed_completion_equals_non_streamed(client):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0.7, seed=5)
    whole = client.completions.create(**args)
    text, chunks = stream_text(client.completions.create(**args, stream=True), kind="completion")
    assert text == whole.choices[0].text
    assert all(chunk.usage is None for chunk in chunks)  # include_usage was not asked


def test_seeds_reproduce(client):
    args = dict(model=MODEL, messages=CHAT, max_tokens=16, temperature=1.0)
    first = client.chat.completions.create(**args, seed=7)
    again = client.chat.completions.create(**args, seed=7)
    other = client.chat.completions.create(**args, seed=8)
    assert first.choices[0].message.content == again.choices[0].message.content
    assert first.choices[0].message.content != other.choices[0].message.content


def test_n2_gives_distinct_seeded_choices_with_their_own_usage(client, tokenizer):
    # Two requests batched together round differently in bf16 than one alone, so the choices
    # are checked for what holds whatever the batch: each is its own token stream.
    response = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=1.0, seed=7, n=2, logprobs=True
    )
    assert [c.index for c in response.choices] == [0, 1]
    texts = [c.message.content for c in response.choices]
    assert texts[0] != texts[1]  # seed + index: the choices differ
    counts = [len(c.logprobs.content) for c in response.choices]
    assert all(c.finish_reason in ("stop", "length") for c in response.choices)
    assert response.usage.prompt_tokens == len(tokenizer.encode_chat(CHAT))
    assert response.usage.completion_tokens == sum(counts)


def test_n2_streams_both_choices_and_prompt_lists(client, tokenizer):
    text = {0: "", 1: ""}
    finish = {}
    for chunk in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, n=2, temperature=0, stream=True
    ):
        for choice in chunk.choices:
            text[choice.index] += choice.text
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert text[0] and text[1] and set(finish) == {0, 1}
    # A batch of prompts, as strings or token ids: one choice each, in the prompts' order.
    prompts = [PROMPT, "Once upon a time, in a small village,"]
    for batch in ([*prompts], [tokenizer.encode(p) for p in prompts]):
        response = client.completions.create(
            model=MODEL,
            prompt=batch,
            max_tokens=8,
            temperature=0,
            logprobs=0,
            extra_body={"ignore_eos": True},
        )
        assert [c.index for c in response.choices] == [0, 1]
        assert response.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
        assert response.usage.completion_tokens == 16
        for choice in response.choices:
            assert choice.text == "".join(choice.logprobs.tokens)


def test_continuous_usage_stats_count_each_choices_tokens_so_far(client, tokenizer):
    """vLLM's stream_options.continuous_usage_stats: every chunk has its choice's usage so far,
    the last usage chunk follows; chat, and completions of two prompts with n=2."""
    options = {"continuous_usage_stats": True}
    chat = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=6, stream=True, stream_options=options
        )
    )
    prompt = len(tokenizer.encode_chat(CHAT))
    assert all(c.usage is not None and c.usage.prompt_tokens == prompt for c in chat)
    counts = [c.usage.completion_tokens for c in chat[:-1]]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 6
    assert not chat[-1].choices and chat[-1].usage.completion_tokens == 6

    prompts = [PROMPT, "Once upon a time, in a small village,"]
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompts,
            max_tokens=5,
            n=2,
            stream=True,
            stream_options=options,
            extra_body={"ignore_eos": True},
        )
    )
    seen: dict[int, list[int]] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        prompt_ids = tokenizer.encode(prompts[choice.index // 2])
        assert chunk.usage.prompt_tokens == len(prompt_ids)
        seen.setdefault(choice.index, []).append(chunk.usage.completion_tokens)
    assert sorted(seen) == [0, 1, 2, 3]
    assert all(counts == sorted(counts) and counts[-1] == 5 for counts in seen.values())
    assert chunks[-1].usage.completion_tokens == 20


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_text_and_aborts_the_engine_request(client, engine_stub, stream):
    args = dict(model=MODEL, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**args, max_tokens=40).choices[0].text
    words = full.split()
    stop = words[len(words) // 2]
    assert len(words) > 4 and stop
    expected = full[: full.index(stop)]
    if stream:
        text, chunks = stream_text(
            client.completions.create(
                **args,
                max_tokens=LONG,
                stop=[stop, "never appears"],
                stream=True,
                stream_options={"include_usage": True},
            ),
            kind="completion",
        )
        reason, usage = chunks[-2].choices[0].finish_reason, chunks[-1].usage
    else:
        response = client.completions.create(**args, max_tokens=LONG, stop=stop)
        text, reason, usage = (
            response.choices[0].text,
            response.choices[0].finish_reason,
            response.usage,
        )
    assert text == expected and reason == "stop"
    # The request ended at the stop string, far short of max_tokens, and the engine was told:
    # it runs nothing once the response is complete.
    assert usage.completion_tokens < 40
    stats = engine_stats(engine_stub)
    assert stats.num_running == 0 and stats.num_waiting == 0


def test_usage_counts_equal_the_tokenizers(client, tokenizer):
    messages = [{"role": "system", "content": "You are terse."}, *CHAT]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, logprobs=True
    )
    tokens = [lp.token for lp in response.choices[0].logprobs.content]
    assert response.usage.prompt_tokens == len(tokenizer.encode_chat(messages))
    assert response.usage.completion_tokens == len(tokens)


def test_chat_logprobs_are_sane(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 10
    for entry in content:
        top = entry.top_logprobs
        assert len(top) == 3
        values = [t.logprob for t in top]
        assert values == sorted(values, reverse=True)
        assert all(v <= 0 for v in values) and sum(math.exp(v) for v in values) <= 1 + 1e-4
        # Greedy: the chosen token is a most likely one (bf16 logits do tie).
        assert entry.logprob == pytest.approx(top[0].logprob)
        assert entry.token in [t.token for t in top if t.logprob == pytest.approx(top[0].logprob)]


def test_completion_logprobs_are_sane(client):
    response = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 8
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    assert "".join(logprobs.tokens) == response.choices[0].text


def test_return_tokens_as_token_ids_names_tokens_by_id(client, engine_stub, tokenizer):
    ids = engine_tokens(
        engine_stub, tokenizer.encode(PROMPT), temperature=0.0, max_tokens=6, ignore_eos=True
    )
    by_id = {"return_tokens_as_token_ids": True, "ignore_eos": True}
    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, extra_body=by_id
    ).choices[0]
    assert completion.logprobs.tokens == [f"token_id:{i}" for i in ids]
    assert all(
        name.startswith("token_id:") for top in completion.logprobs.top_logprobs for name in top
    )
    # The offsets still count the text's characters.
    pieces = [tokenizer.decode([i]) for i in ids]
    assert completion.logprobs.text_offset == [sum(map(len, pieces[:k])) for k in range(6)]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=by_id,
    )
    chat_ids = engine_tokens(
        engine_stub, tokenizer.encode_chat(CHAT), temperature=0.0, max_tokens=4, ignore_eos=True
    )
    content = chat.choices[0].logprobs.content
    assert [entry.token for entry in content] == [f"token_id:{i}" for i in chat_ids]
    assert content[0].bytes == list(f"token_id:{chat_ids[0]}".encode())
    assert content[0].top_logprobs[0].token.startswith("token_id:")


def test_multibyte_text_streams_whole_characters(client, tokenizer):
    # The output is held to emoji that this model's byte-level vocabulary has no single token
    # for (🌟 is three tokens, ✨ two, whatever the tokenization), so characters are split
    # across tokens whatever the model's numerics prefer on this CPU.
    prompt = "🌟🌟🌟🌟 ✨✨"
    args = dict(
        model=MODEL,
        prompt=prompt,
        max_tokens=40,
        temperature=0,
        extra_body={"ignore_eos": True, "structured_outputs": {"regex": "(🌟|✨){6}"}},
    )
    response = client.completions.create(**args, logprobs=0)
    text, chunks = stream_text(client.completions.create(**args, stream=True), kind="completion")
    assert text == response.choices[0].text
    assert any(ord(c) > 0xFFFF or 0x4E00 <= ord(c) <= 0x9FFF for c in text), text
    # More tokens than characters: characters were split across tokens, and no event carries
    # half of one.
    assert len(response.choices[0].logprobs.tokens) > len(text)
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert "\ufffd" not in text and all("\ufffd" not in p for p in pieces)
    assert len(tokenizer.encode(text, add_special_tokens=False)) <= args["max_tokens"]


def test_models_tokenize_detokenize(client, gateway, tokenizer):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL) == models.data[0]
    with pytest.raises(openai.NotFoundError, match=f"serves '{MODEL}'"):
        client.models.retrieve("org/other-model")
    with httpx.Client(base_url=gateway.url, timeout=TIMEOUT) as http:
        text = http.post("/tokenize", json={"model": MODEL, "prompt": "héllo 世界 🙂"}).json()
        assert text["tokens"] == tokenizer.encode("héllo 世界 🙂")
        assert text["count"] == len(text["tokens"]) and text["max_model_len"] == MAX_MODEL_LEN
        assert text["token_strs"] is None
        chat = http.post("/tokenize", json={"messages": CHAT, "return_token_strs": True}).json()
        assert chat["tokens"] == tokenizer.encode_chat(CHAT)
        assert chat["token_strs"] == [tokenizer.id_to_token(i) for i in chat["tokens"]]
        back = http.post("/detokenize", json={"tokens": chat["tokens"]}).json()
        assert back == {"prompt": tokenizer.decode(chat["tokens"], skip_special_tokens=False)}


def test_health(gateway):
    response = httpx.get(gateway.url + "/health", timeout=TIMEOUT)
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


def read_metrics(gateway) -> dict[str, float]:
    text = httpx.get(gateway.url + "/metrics", timeout=TIMEOUT).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_metrics_are_named_by_convention_and_count(client, gateway):
    before = read_metrics(gateway)
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    after = read_metrics(gateway)
    for name in (
        "folio_num_requests_running",
        "folio_num_requests_waiting",
        "folio_kv_cache_usage_ratio",
        "folio_prefix_cache_queries_total",
        "folio_prefix_cache_hits_total",
        "folio_prompt_tokens_total",
        "folio_generation_tokens_total",
        "folio_time_to_first_token_seconds_count",
        "folio_inter_token_latency_seconds_count",
        "folio_e2e_request_latency_seconds_count",
        "folio_request_queue_time_seconds_count",
        'folio_engine_step_seconds_total{phase="forward"}',
    ):
        assert name in after, name
    assert 0 <= after["folio_kv_cache_usage_ratio"] <= 1
    grew = {name: after[name] - before.get(name, 0) for name in after}
    assert grew["folio_generation_tokens_total"] == 6
    assert grew["folio_prompt_tokens_total"] == response.usage.prompt_tokens
    assert grew["folio_time_to_first_token_seconds_count"] == 1
    assert grew["folio_inter_token_latency_seconds_count"] == 5
    assert grew["folio_e2e_request_latency_seconds_count"] == 1
    assert grew["folio_request_queue_time_seconds_count"] == 1
    assert (
        0
        <= grew["folio_request_queue_time_seconds_sum"]
        <= grew["folio_time_to_first_token_seconds_sum"]
    )
    assert grew['folio_engine_step_seconds_total{phase="forward"}'] > 0
    assert grew["folio_engine_steps_total"] >= 6


def test_openapi_describes_every_route(gateway):
    document = httpx.get(gateway.url + "/openapi.json", timeout=TIMEOUT).json()
    routes = {
        # Starlette's {name:path} is OpenAPI's {name}.
        (re.sub(r"{(\w+):\w+}", r"{\1}", route.path), method.lower())
        for route in gateway.server.app.routes
        for method in route.methods
        if method != "HEAD"
    }
    described = {(path, method) for path, item in document["paths"].items() for method in item}
    assert routes == described
    schemas = document["components"]["schemas"]
    chat = document["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ChatCompletionRequest"
    )
    for field in (
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "top_logprobs",
        "seed",
        "stop",
        "n",
        "logit_bias",
        "stream_options",
    ):
        assert field in schemas["ChatCompletionRequest"]["properties"], field
    assert "choices" in schemas["ChatCompletionResponse"]["properties"]


def test_a_client_that_leaves_mid_stream_aborts_its_engine_request(gateway, engine_stub):
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": LONG,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(base_url=gateway.url, timeout=TIMEOUT) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        events = response.iter_lines()
        assert next(line for line in events if line.startswith("data: "))
        assert engine_stats(engine_stub).num_running == 1
    # LONG tokens take tens of seconds; the abort frees the engine at once.
    wait_engine_idle(engine_stub)


def test_a_client_that_leaves_before_the_answer_aborts_its_engine_request(gateway, engine_stub):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": LONG, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=0.5)
    wait_engine_idle(engine_stub)
