"""`folio bench serve --compare-url`: the same workload on Folio and on a peer server, compared.

Folio here is a real gateway in front of real tokenizer and engine services on a tiny
random-weight model with SmolLM2's tokenizer. The peer is either a second real Folio gateway (it
streams usage, so its tokens are counted from it) or a stand-in that behaves like llama.cpp's
llama-server as the benchmark sees it: text prompts only, one chunk per token and a last one with
no text, no usage in the stream (its tokens are counted one per chunk). The benchmark's figures
are checked for consistency, never for speed."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import statistics
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from bench.serve import Comparison, RunResult, Sample, run_serve_benchmark, text_prompts
from common.config import EngineConfig
from common.tokenizer import Tokenizer
from folio.cli import build_parser
from gateway_helpers import ENGINE_ARGS, GatewayThread
from grpc_helpers import TIMEOUT, LoopThread, ServerThread
from services.engine.server import EngineService
from services.tokenizer.server import TokenizerService
from tiny_models import make_tiny_smollm2

PROMPT_LEN = 24
OUTPUT_LEN = 6
REQUESTS = 4  # per concurrency level
LEVELS = ("c=1", "c=2")
# One figure as the comparison prints it: "tok/s 812.3 vs 640.1 (x1.27)".
FIGURE = r"{name}(?: p50)? ([\d.]+) vs ([\d.]+)(?: ms)? \(x([\d.]+)\)"


class StandIn(LoopThread):
    """llama-server's /v1/completions as the benchmark sees it: a token-id prompt is refused,
    each token is a chunk of its own, the last chunk has no text, no usage ever. It honours
    ignore_eos unless `eos_after` says after how many tokens it ends anyway."""

    def __init__(self, eos_after: int | None = None) -> None:
        super().__init__()
        self.eos_after = eos_after
        self.prompts: list[str] = []
        app = Starlette(
            routes=[
                Route("/v1/models", self.models),
                Route("/v1/completions", self.completions, methods=["POST"]),
            ]
        )
        listener = socket.socket()
        # Each chunk leaves at once, as it would from llama-server (accepted sockets inherit it).
        listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        listener.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.serving = asyncio.run_coroutine_threadsafe(
            self.server.serve(sockets=[listener]), self.loop
        )
        deadline = time.monotonic() + TIMEOUT
        while not self.server.started:
            assert time.monotonic() < deadline, "the stand-in did not start"
            time.sleep(0.01)

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "stand-in", "object": "model"}]})

    async def completions(self, request: Request):
        body = await request.json()
        if not isinstance(body["prompt"], str):
            return JSONResponse({"error": {"message": "prompt must be a string"}}, 400)
        self.prompts.append(body["prompt"])
        count = body["max_tokens"]
        if self.eos_after is not None or not body.get("ignore_eos"):
            count = min(count, self.eos_after or 1)

        def chunk(text: str, finish_reason: str | None) -> str:
            choice = {"index": 0, "text": text, "finish_reason": finish_reason}
            return f"data: {json.dumps({'object': 'text_completion', 'choices': [choice]})}\n\n"

        async def stream():
            for i in range(count):
                await asyncio.sleep(0.002)  # a decode step
                yield chunk(f" w{i}", None)
            yield chunk("", "length" if count == body["max_tokens"] else "stop")
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    def close(self) -> None:
        self.server.should_exit = True
        self.serving.result(TIMEOUT)
        self.stop_loop()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    return make_tiny_smollm2(tmp_path_factory.mktemp("tiny-compare"), default_model_dir)


@pytest.fixture(scope="module")
def folio_gateways(tiny_model_dir):
    """Two real gateways in front of the same tokenizer and engine services."""
    tokenizer = ServerThread(TokenizerService(str(tiny_model_dir), "127.0.0.1", 0))
    engine = ServerThread(
        EngineService(
            EngineConfig(model=str(tiny_model_dir), **dict(ENGINE_ARGS, dtype="float32")),
            "127.0.0.1",
            0,
        )
    )
    gateways = [
        GatewayThread(f"127.0.0.1:{engine.port}", f"127.0.0.1:{tokenizer.port}") for _ in range(2)
    ]
    yield gateways
    for gateway in gateways:
        gateway.close()
    engine.close()
    tokenizer.close()


@pytest.fixture
def stand_in(request):
    server = StandIn(eos_after=getattr(request, "param", None))
    yield server
    server.close()


def bench_args(model_dir: Path, url: str, compare_url: str | None, *extra: str):
    """`folio bench serve` at `url`, compared with `compare_url`'s server; without one, with
    an engine in the test's process instead (eager: it starts in a second)."""
    against = ["--compare-url", compare_url, "--skip-in-process"] if compare_url else []
    return build_parser().parse_args(
        [
            "bench",
            "serve",
            "--url",
            url,
            *(against or ["--enforce-eager"]),
            "--model",
            str(model_dir),
            "--dtype",
            "float32",
            "--concurrency",
            ",".join(level.removeprefix("c=") for level in LEVELS),
            "--num-requests",
            str(REQUESTS),
            "--prompt-len",
            str(PROMPT_LEN),
            "--output-len",
            str(OUTPUT_LEN),
            *extra,
        ]
    )


def figures(run: RunResult) -> dict[str, float]:
    """tok/s and the p50 TTFT and TPOT (ms) of a run, from its samples."""
    return {
        "tok/s": sum(s.num_tokens for s in run.samples) / run.seconds,
        "TTFT": 1000 * statistics.median(s.token_times[0] - s.start for s in run.samples),
        "TPOT": 1000
        * statistics.median(
            (s.token_times[-1] - s.token_times[0]) / (s.num_tokens - 1) for s in run.samples
        ),
    }


def check_printed(printed: str, comparisons: list[Comparison]) -> None:
    """Each comparison line shows both sides' figures and Folio / peer, as their samples say,
    and returns the same."""
    for c in comparisons:
        [line] = [x for x in printed.splitlines() if x.strip().startswith(c.label + " ")]
        folio, peer = figures(c.folio_run), figures(c.peer_run)
        returned = {
            "tok/s": c.ratio.tok_s,
            "TTFT": c.ratio.ttft_ms,
            "TPOT": c.ratio.tpot_ms,
        }
        for name in ("tok/s", "TTFT", "TPOT"):
            shown = re.search(FIGURE.format(name=name), line)
            assert shown, (name, line)
            assert [float(v) for v in shown.groups()] == [
                pytest.approx(folio[name], abs=0.06),
                pytest.approx(peer[name], abs=0.06),
                pytest.approx(folio[name] / peer[name], abs=0.006),
            ], line
            assert returned[name] == pytest.approx(folio[name] / peer[name])


def check_folio_side(comparisons: list[Comparison]) -> None:
    """Folio streamed every token asked for and told the prompt's length: the text prompt
    encodes to exactly PROMPT_LEN tokens with the model's tokenizer."""
    assert [c.label for c in comparisons] == list(LEVELS)
    for c in comparisons:
        assert len(c.folio_run.samples) == REQUESTS
        assert {s.num_tokens for s in c.folio_run.samples} == {OUTPUT_LEN}
        assert {s.prompt_tokens for s in c.folio_run.samples} == {PROMPT_LEN}
        assert c.folio_run.output_tokens == REQUESTS * OUTPUT_LEN


def test_compare_with_a_second_folio_gateway(tiny_model_dir, folio_gateways, capsys):
    folio, peer = folio_gateways
    comparisons = run_serve_benchmark(bench_args(tiny_model_dir, folio.url, peer.url))
    printed = capsys.readouterr().out

    check_folio_side(comparisons)
    for c in comparisons:
        # The peer counted the same tokens from its usage, for the very same prompts.
        assert [s.num_tokens for s in c.peer_run.samples] == [OUTPUT_LEN] * REQUESTS
        assert [s.prompt_tokens for s in c.peer_run.samples] == [PROMPT_LEN] * REQUESTS
        assert c.peer_run.output_tokens == c.folio_run.output_tokens
    check_printed(printed, comparisons)
    assert f"prompt tokens, mean: Folio {PROMPT_LEN:.1f}, " in printed
    assert "ended before" not in printed


def test_compare_with_a_server_without_token_prompts_or_usage(
    tiny_model_dir, folio_gateways, stand_in, capsys
):
    # The stand-in refuses what Folio alone is sent: token-id prompts.
    refused = httpx.post(
        stand_in.url + "/v1/completions",
        json={"model": "stand-in", "prompt": [1, 2, 3], "max_tokens": 2},
        timeout=TIMEOUT,
    )
    assert refused.status_code == 400
    args = bench_args(tiny_model_dir, folio_gateways[0].url, stand_in.url)
    comparisons = run_serve_benchmark(args)
    printed = capsys.readouterr().out

    check_folio_side(comparisons)
    for c in comparisons:
        # Counted one per chunk with text: the empty closing chunk is no token.
        assert [s.num_tokens for s in c.peer_run.samples] == [OUTPUT_LEN] * REQUESTS
        assert all(len(s.token_times) == OUTPUT_LEN for s in c.peer_run.samples)
        assert all(s.prompt_tokens is None for s in c.peer_run.samples)
        assert c.peer_run.output_tokens == c.folio_run.output_tokens
    check_printed(printed, comparisons)
    assert "no usage in its stream" in printed
    assert "ended before" not in printed
    # It got the text prompts Folio got: the warm-up's and each level's.
    prompts = text_prompts(args, Tokenizer.from_dir(tiny_model_dir))
    sent = prompts(2, "warm-up") + [p for level in LEVELS for p in prompts(REQUESTS, level)]
    assert sorted(stand_in.prompts) == sorted(sent)


@pytest.mark.parametrize("stand_in", [3], indirect=True)
def test_a_server_that_ends_early_is_reported(tiny_model_dir, folio_gateways, stand_in, capsys):
    comparisons = run_serve_benchmark(
        bench_args(tiny_model_dir, folio_gateways[0].url, stand_in.url, "--concurrency", "2")
    )
    printed = capsys.readouterr().out

    assert [c.label for c in comparisons] == ["c=2"]
    for c in comparisons:
        assert [s.num_tokens for s in c.folio_run.samples] == [OUTPUT_LEN] * REQUESTS
        assert [s.num_tokens for s in c.peer_run.samples] == [3] * REQUESTS
        assert (
            f"127.0.0.1:{stand_in.url.rsplit(':', 1)[1]} {c.label}: {REQUESTS} of {REQUESTS} "
            f"requests ended before {OUTPUT_LEN} tokens (fewest 3)"
        ) in printed


def test_repeats_take_turns_with_prompts_of_their_own(
    tiny_model_dir, folio_gateways, stand_in, capsys
):
    args = bench_args(tiny_model_dir, folio_gateways[0].url, stand_in.url, "--repeats", "3")
    comparisons = run_serve_benchmark(args)
    lines = capsys.readouterr().out.splitlines()

    prompts = text_prompts(args, Tokenizer.from_dir(tiny_model_dir))
    turns = [
        [p for level in LEVELS for p in prompts(REQUESTS, name(level))]
        for name in (str, "{} turn 1".format, "{} turn 2".format)
    ]
    sent = [p for turn in turns for p in turn]
    # Each turn its own prompts (none found in a prefix cache), the warm-up once.
    assert len(set(sent)) == 3 * len(LEVELS) * REQUESTS
    assert sorted(stand_in.prompts) == sorted(prompts(2, "warm-up") + sent)
    # Folio's sweep and the peer's alternate, then each level's three turns pooled.
    peer = f"127.0.0.1:{stand_in.url.rsplit(':', 1)[1]}"
    runs = [line.split()[0] for line in lines if line.startswith(("gateway c=", f"{peer} c="))]
    levels = len(LEVELS)
    assert runs == (["gateway"] * levels + [peer] * levels) * 4
    for c in comparisons:
        assert len(c.folio_run.samples) == len(c.peer_run.samples) == 3 * REQUESTS
        assert c.folio_run.label == f"gateway {c.label} (3 turns)"
        assert c.peer_run.label == f"{peer} {c.label} (3 turns)"
    check_printed("\n".join(lines), comparisons)


def test_served_and_in_process_take_turns(tiny_model_dir, folio_gateways, capsys):
    run_serve_benchmark(bench_args(tiny_model_dir, folio_gateways[0].url, None, "--repeats", "2"))
    lines = capsys.readouterr().out.splitlines()

    # Gateway and in-process runs alternate, then each level's two turns pooled.
    runs = [line.split()[0] for line in lines if line.startswith(("gateway c=", "in-process c="))]
    levels = len(LEVELS)
    assert runs == (["gateway"] * levels + ["in-process"] * levels) * 3
    pooled = {
        tuple(line.split()[:2]): float(re.search(r"([\d.]+) tok/s", line).group(1))
        for line in lines
        if "(2 turns)" in line
    }
    for level in LEVELS:
        [ratio] = [
            line for line in lines if line.startswith(f"throughput gateway/in-process at {level}:")
        ]
        shown = float(ratio.split(": ")[1].split()[0])
        expected = pooled[("gateway", level)] / pooled[("in-process", level)]
        assert shown == pytest.approx(expected, abs=0.011)


def test_joined_runs_weigh_cpu_by_tokens():
    def run(tokens: int, seconds: float, cpu_ms: float) -> RunResult:
        sample = Sample(0.0, [0.1 * i for i in range(tokens)], tokens)
        return RunResult("x", [sample], seconds, {"gateway": cpu_ms})

    joined = run(10, 1.0, 0.5).joined(run(30, 2.0, 0.1), "x (2 turns)")
    assert joined.label == "x (2 turns)"
    assert joined.output_tokens == 40 and joined.seconds == 3.0
    assert joined.token_throughput == pytest.approx(40 / 3)
    assert joined.cpu_ms_per_token == {"gateway": pytest.approx((10 * 0.5 + 30 * 0.1) / 40)}


def test_repeats_below_one_is_refused(tiny_model_dir):
    args = bench_args(tiny_model_dir, "http://127.0.0.1:9", None, "--repeats", "0")
    with pytest.raises(ValueError, match="--repeats must be >= 1, got 0"):
        run_serve_benchmark(args)
