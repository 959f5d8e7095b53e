"""The gateway's output processor, fed engine outputs made up here (no engine, no model): texts
equal to the tokenizer's, turned into text in the gateway's own process, stop strings aborted in
one batched message and finished only once the engine confirms, the samples of n > 1 told apart
by index, logprob texts, and failures reaching the right callers. The tokenizer is the default
model's, rebuilt from its JSON as the gateway gets it from the tokenizer service."""

from __future__ import annotations

import asyncio

import pytest
from common.grpc_stubs.folio.v1 import common_pb2, engine_pb2

from common.errors import InternalError, InvalidRequestError, UnavailableError
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from gateway import wire
from gateway.metrics import Metrics
from gateway.pipeline.model_text import ModelText
from gateway.pipeline.output_processor import OutputProcessor, TrackedRequest
from gateway.pipeline.text import TextRequest

PROMPT = [1, 2, 3]


class Harness:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.model_text = ModelText(Tokenizer.decoding_only(tokenizer.to_json()))
        self.aborts: list[tuple[list[str], list[tuple[str, int]]]] = []
        self.metrics = Metrics()
        self.processor = OutputProcessor(
            lambda ids, samples: self.aborts.append((list(ids), list(samples))), self.metrics
        )

    def track(
        self, request_id: str, n: int = 1, first_choice: int = 0, **text_fields
    ) -> TrackedRequest:
        params = SamplingParams(n=n, max_tokens=100, logprobs=text_fields.pop("logprobs", None))
        request = TrackedRequest(
            request_id,
            TextRequest(list(PROMPT), params, **text_fields),
            n,
            first_choice,
            0.0,
            asyncio.Queue(),
            self.model_text,
        )
        self.processor.add(request)
        return request

    def step(self, *outputs: engine_pb2.RequestOutput) -> None:
        """One engine step, its outputs as the engine sends them (read through the wire edge)."""
        self.processor.process_outputs([wire.step_output(o) for o in outputs])


def out(request_id: str, token_ids=(), index: int = 0, **fields) -> engine_pb2.RequestOutput:
    return engine_pb2.RequestOutput(
        request_id=request_id, token_ids=list(token_ids), index=index, **fields
    )


def last(request_id: str, reason: int, completion_tokens: int, index: int = 0, token_ids=()):
    return out(
        request_id,
        token_ids,
        index,
        finished=True,
        finish_reason=reason,
        usage=common_pb2.Usage(prompt_tokens=len(PROMPT), completion_tokens=completion_tokens),
    )


def drain(request: TrackedRequest) -> list:
    items = []
    while not request.deltas.empty():
        items.append(request.deltas.get_nowait())
    return items


@pytest.fixture(scope="module")
def library(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


def test_texts_equal_the_tokenizers(library):
    harness = Harness(library)
    texts = {"a": "Llama: 🦙, hug: 🤗, 日本語!", "b": "A plain sentence, then more words."}
    ids = {key: library.encode(text, add_special_tokens=False) for key, text in texts.items()}
    requests = {key: harness.track(key) for key in texts}
    steps = max(map(len, ids.values()))
    for step in range(steps):
        outputs = []
        for key, tokens in ids.items():
            if step < len(tokens) - 1:
                outputs.append(out(key, [tokens[step]]))
            elif step == len(tokens) - 1:
                outputs.append(
                    last(key, common_pb2.FINISH_REASON_LENGTH, len(tokens), token_ids=[tokens[-1]])
                )
        harness.step(*outputs)
    for key, request in requests.items():
        deltas = [item[1] for item in drain(request)]
        assert all(choice == 0 for choice, _ in [(0, d) for d in deltas])
        assert "".join(d.text for d in deltas) == texts[key]
        assert all("\ufffd" not in d.text for d in deltas)
        assert [d.finish_reason for d in deltas][-1] == "length"
        assert all(d.finish_reason is None for d in deltas[:-1])
        assert deltas[-1].usage.completion_tokens == len(ids[key])
        assert deltas[-1].usage.prompt_tokens == len(PROMPT)
    assert len(harness.processor) == 0  # both ended: forgotten
    metrics = harness.metrics
    assert metrics.value("folio_generation_tokens_total") == sum(map(len, ids.values()))
    assert metrics.value("folio_requests_total", {"finish_reason": "length"}) == 2
    assert not harness.aborts


def test_stop_strings_are_aborted_in_one_message_and_end_when_the_engine_confirms(library):
    harness = Harness(library)
    ids = library.encode("one two STOP three four five", add_special_tokens=False)
    stop_at = next(
        i for i in range(len(ids)) if "STOP" in library.decode(ids[: i + 1])
    )  # the step whose token completes the stop string
    requests = [harness.track(key, stop=["STOP"]) for key in ("a", "b")]
    for token in ids[: stop_at + 1]:
        harness.step(out("a", [token]), out("b", [token]))
    # Both matched in the same step: one Abort for both, and no last delta yet.
    assert harness.aborts == [(["a", "b"], [])]
    deltas = {r.request_id: [item[1] for item in drain(r)] for r in requests}
    assert all(d.finish_reason is None for ds in deltas.values() for d in ds)
    # Tokens the engine made before the abort landed are not text, nor counted.
    harness.step(out("a", [ids[stop_at + 1]]), out("b", [ids[stop_at + 1]]))
    harness.step(last("a", common_pb2.FINISH_REASON_ABORT, stop_at + 2))
    harness.step(last("b", common_pb2.FINISH_REASON_ABORT, stop_at + 2))
    for request in requests:
        deltas[request.request_id] += [item[1] for item in drain(request)]
        texts = deltas[request.request_id]
        assert "".join(d.text for d in texts) == "one two "
        assert texts[-1].finish_reason == "stop"
        assert texts[-1].usage.completion_tokens == stop_at + 1
    assert harness.metrics.value("folio_requests_total", {"finish_reason": "stop"}) == 2
    assert len(harness.processor) == 0


def test_a_step_of_several_tokens_ends_at_the_token_that_completes_a_stop(library):
    """Accepted speculative drafts: one output carries the stop string's tokens and more. The
    text, logprobs and token count end at the token that completed the stop, as when the tokens
    come one per step."""
    harness = Harness(library)
    ids = library.encode("one two STOP three four five", add_special_tokens=False)
    stop_at = next(i for i in range(len(ids)) if "STOP" in library.decode(ids[: i + 1]))
    request = harness.track("a", stop=["STOP"], logprobs=0)
    records = [common_pb2.TokenLogprob(token_id=t, logprob=-1.0) for t in ids]
    harness.step(out("a", ids[:1], logprobs=records[:1]))
    harness.step(out("a", ids[1:], logprobs=records[1:]))  # the stop and three tokens past it
    assert harness.aborts == [(["a"], [])]
    harness.step(last("a", common_pb2.FINISH_REASON_ABORT, len(ids)))
    deltas = [item[1] for item in drain(request)]
    assert "".join(d.text for d in deltas) == "one two "
    assert deltas[-1].finish_reason == "stop"
    assert deltas[-1].usage.completion_tokens == stop_at + 1
    assert sum(len(d.logprobs) for d in deltas) == stop_at + 1
    assert harness.metrics.value("folio_generation_tokens_total") == stop_at + 1


def test_samples_are_told_apart_by_index_and_a_stop_aborts_its_sample_alone(library):
    harness = Harness(library)
    request = harness.track("par", n=2, first_choice=4, stop=["STOP"])
    going = library.encode(" and on and on", add_special_tokens=False)
    stopping = library.encode(" STOP now", add_special_tokens=False)
    for step in range(2):
        harness.step(out("par", [going[step]], 0), out("par", [stopping[step]], 1))
    assert harness.aborts == [([], [("par", 1)])]
    harness.step(out("par", [going[2]], 0), last("par", common_pb2.FINISH_REASON_ABORT, 2, 1))
    harness.step(last("par", common_pb2.FINISH_REASON_LENGTH, 4, 0, token_ids=[going[3]]))
    items = drain(request)
    by_choice: dict[int, list] = {4: [], 5: []}
    for choice, delta in items:
        by_choice[choice].append(delta)
    assert "".join(d.text for d in by_choice[4]) == library.decode(going[:4])
    assert by_choice[4][-1].finish_reason == "length"
    assert by_choice[5][-1].finish_reason == "stop"
    assert "".join(d.text for d in by_choice[5]) == " "
    # The samples share one prefill: the prompt counts once.
    assert harness.metrics.value("folio_prompt_tokens_total") == len(PROMPT)
    assert len(harness.processor) == 0


def test_logprob_texts_are_each_tokens_own_with_special_tokens_kept(library):
    harness = Harness(library)
    request = harness.track("lp", logprobs=1)
    im_end = library.encode("<|im_end|>", add_special_tokens=False)[0]
    hello = library.encode("Hello", add_special_tokens=False)[0]

    def record(token: int, alternative: int) -> common_pb2.TokenLogprob:
        return common_pb2.TokenLogprob(
            token_id=token,
            logprob=-0.5,
            top_logprobs=[common_pb2.TopLogprob(token_id=alternative, logprob=-1.0)],
        )

    harness.step(out("lp", [hello], logprobs=[record(hello, im_end)]))
    harness.step(out("lp", [hello], logprobs=[record(hello, im_end)]))
    first, second = (item[1] for item in drain(request))
    assert first.logprobs[0].token == "Hello" and second.logprobs[0].token == "Hello"
    assert first.logprobs[0].top == [(im_end, "<|im_end|>", -1.0)]


def test_failures_reach_their_callers(library):
    harness = Harness(library)
    refused, running, other = (harness.track(key) for key in ("refused", "running", "other"))
    harness.step(
        out(
            "refused",
            error=engine_pb2.RequestError(code=3, message="n is too large"),
            finished=True,
        ),
        out("running", [28]),
    )
    (error,) = drain(refused)
    assert isinstance(error, InvalidRequestError) and "n is too large" in str(error)
    assert not harness.aborts  # it ended in the engine: nothing to abort
    # A token id with no text (outside the vocabulary) fails its request alone, aborted.
    outside = library.vocab_size + 5
    harness.step(out("running", [outside]), out("other", [30]))
    error = drain(running)[-1]
    assert isinstance(error, InternalError) and str(outside) in str(error)
    assert harness.aborts == [(["running"], [])]
    assert drain(other)[0][1].text
    # The engine stream ends: what it carried fails.
    harness.processor.fail_all(UnavailableError("engine: the Generate stream ended"))
    assert isinstance(drain(other)[-1], UnavailableError)
    assert len(harness.processor) == 0


def test_a_caller_that_leaves_is_aborted_and_its_later_outputs_dropped(library):
    harness = Harness(library)
    request = harness.track("left", n=2)
    harness.step(out("left", [28], 0))
    assert request.started
    harness.processor.release([request])
    assert harness.aborts == [(["left"], [])]
    drain(request)
    other = harness.track("other")
    harness.step(out("left", [29], 0), out("other", [30]))
    assert not drain(request)
    assert drain(other)
    assert len(harness.processor) == 1  # "other" alone


def test_each_sample_gets_the_prompt_logprobs_its_first_output_carries(library):
    harness = Harness(library)
    params = SamplingParams(n=2, max_tokens=100, prompt_logprobs=0)
    request = TrackedRequest(
        "echo", TextRequest(list(PROMPT), params), 2, 0, 0.0, asyncio.Queue(), harness.model_text
    )
    harness.processor.add(request)
    records = [common_pb2.TokenLogprob(token_id=t, logprob=-1.0) for t in PROMPT[1:]]
    harness.step(
        out("echo", [28], 0, prompt_logprobs=records),
        out("echo", [29], 1, prompt_logprobs=records),
    )
    harness.step(out("echo", [30], 0), out("echo", [31], 1))
    firsts = {}
    for choice, delta in drain(request):
        firsts.setdefault(choice, delta)
        if delta is not firsts[choice]:
            assert delta.prompt_logprobs is None  # only with the first
    for choice in (0, 1):
        prompt = firsts[choice].prompt_logprobs
        # The prompt's first token leads, with no logprob: nothing precedes it.
        assert [lp.token_id for lp in prompt] == PROMPT
        assert prompt[0].logprob is None and [lp.logprob for lp in prompt[1:]] == [-1.0, -1.0]
        assert prompt[1].token == library.decode([PROMPT[1]], skip_special_tokens=False)
