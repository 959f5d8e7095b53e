"""The engine's Generate socket, with a real engine service on loopback (tiny random-weight
Llama): the wire contract as any client would speak it (open, ready, Generate's messages as
frames, the end status), the same tokens as gRPC's Generate, bad input ended with a status that
names it, a closed connection aborting its requests, a drain letting them end; the gateway's
client on the socket when offered and on gRPC when not or when it does not answer (said once in
the log); frames in order whatever the kernel's buffer takes."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time

import grpc
import pytest
from common.grpc_stubs.folio.v1 import common_pb2, engine_pb2, engine_pb2_grpc

from common import framing
from common.auth import KeySet
from common.config import EngineConfig
from common.framing import FrameError, FrameReader, frame
from common.grpc_server import State
from common.sampling_params import SamplingParams
from gateway.engines.clients import EngineClient
from grpc_helpers import TIMEOUT, LoopThread, ServerThread
from polling import wait_until
from services.engine.generate_session import GenerateSession
from services.engine.generate_socket import FrameWriter
from services.engine.server import EngineService

ENGINE_ARGS = dict(
    dtype="float32", block_size=4, num_kv_blocks=1024, max_num_batched_tokens=32, max_num_seqs=8
)
TOKEN = "socket-token-for-tests-0123456789"
LONG = 3000  # tokens: still running when the test acts on it, however slow the machine
# Requests of 1,500-token prompts with 20 prompt logprobs a token: ~0.3 MB of frames each, more
# than the kernel's buffers hold for a connection that does not read.
PROMPT_LOGPROB_REQUESTS = 24


@pytest.fixture(scope="module")
def guarded(model_dir):
    """An engine service requiring TOKEN, with its Generate socket."""
    service = EngineService(EngineConfig(model=str(model_dir), **ENGINE_ARGS), "127.0.0.1", 0)
    service.require_keys(KeySet([TOKEN]), "internal token")
    server = ServerThread(service)
    yield server
    server.close()


@pytest.fixture
def engine(guarded):
    yield guarded
    # Every test leaves the engine empty: no request and no KV block held.
    llm = guarded.service.engine.engine
    wait_until(lambda: not llm.requests, "the engine's requests to end", TIMEOUT)
    assert llm.kv_cache.usage == 0


def add(request_id: str, max_tokens: int, prompt=(5, 6, 7, 8, 9)) -> engine_pb2.GenerateRequest:
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return engine_pb2.GenerateRequest(
        add=engine_pb2.EngineRequest(
            request_id=request_id, prompt_token_ids=list(prompt), sampling_params=params
        )
    )


class Client:
    """A Generate socket client written from the proto file's words alone, with blocking
    sockets: what a client in any language would do."""

    def __init__(
        self, port: int, authorization: str = f"Bearer {TOKEN}", receive_buffer: int = 0
    ) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if receive_buffer:  # before connecting: it sets the window the engine may fill
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        self.sock.settimeout(TIMEOUT)
        self.sock.connect(("127.0.0.1", port))
        self._reader = FrameReader()
        self._frames: list[engine_pb2.GenerateSocketFrame] = []
        self.send_raw(
            frame(engine_pb2.GenerateSocketOpen(authorization=authorization).SerializeToString())
        )

    def send(self, message: engine_pb2.GenerateRequest) -> None:
        self.send_raw(frame(message.SerializeToString()))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def next(self) -> engine_pb2.GenerateSocketFrame | None:
        """The next frame; None once the engine has closed the connection."""
        while not self._frames:
            data = self.sock.recv(1 << 16)
            if not data:
                return None
            self._frames += [
                engine_pb2.GenerateSocketFrame.FromString(p) for p in self._reader.feed(data)
            ]
        return self._frames.pop(0)

    def ended(self) -> engine_pb2.GenerateSocketEnd:
        """Read up to the end frame, which must be the last."""
        while (message := self.next()) is not None:
            if message.HasField("end"):
                assert self.next() is None, "a frame after the end"
                return message.end
        raise AssertionError("closed without an end frame")

    def tokens(self, count: int) -> dict[str, list[int]]:
        """Each request's tokens, until `count` requests have finished."""
        tokens: dict[str, list[int]] = {}
        finished = 0
        while finished < count:
            message = self.next()
            assert message is not None and message.HasField("response"), message
            for output in message.response.outputs:
                assert not output.HasField("error"), output.error
                tokens.setdefault(output.request_id, []).extend(output.token_ids)
                finished += output.finished
        return tokens

    def close(self) -> None:
        self.sock.close()


def open_client(engine: ServerThread, **kwargs) -> Client:
    client = Client(engine.service.generate_socket.port, **kwargs)
    assert client.next().HasField("ready")
    return client


def grpc_tokens(engine: ServerThread, messages: list[engine_pb2.GenerateRequest]) -> dict:
    stub = engine_pb2_grpc.EngineServiceStub(engine.channel)
    tokens: dict[str, list[int]] = {}
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    for response in stub.Generate(iter(messages), metadata=metadata, timeout=TIMEOUT):
        for output in response.outputs:
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
    return tokens


def test_model_info_offers_the_socket_and_it_streams_grpcs_tokens(engine):
    stub = engine_pb2_grpc.EngineServiceStub(engine.channel)
    info = stub.GetModelInfo(
        engine_pb2.GetModelInfoRequest(),
        metadata=(("authorization", f"Bearer {TOKEN}"),),
        timeout=TIMEOUT,
    )
    assert info.generate_socket_port == engine.service.generate_socket.port > 0
    messages = [add("a", 12), add("b", 7, prompt=(9, 8, 7, 6, 5, 4, 3, 2, 1))]
    client = open_client(engine)
    try:
        for message in messages:
            client.send(message)
        by_socket = client.tokens(2)
    finally:
        client.close()
    assert by_socket == grpc_tokens(engine, messages)
    assert [len(by_socket["a"]), len(by_socket["b"])] == [12, 7]


@pytest.mark.parametrize(
    "authorization", ["", "Bearer not-the-token", TOKEN], ids=["none", "wrong", "no-scheme"]
)
def test_an_open_without_the_token_is_refused(engine, authorization):
    client = Client(engine.service.generate_socket.port, authorization)
    try:
        end = client.ended()
    finally:
        client.close()
    assert end.code == grpc.StatusCode.UNAUTHENTICATED.value[0]
    assert "internal token" in end.message and "authorization" in end.message


def test_malformed_input_ends_the_connection_naming_it_and_aborts_its_requests(engine):
    llm = engine.service.engine.engine
    cases = [
        (engine_pb2.GenerateRequest().SerializeToString(), "must set add or abort"),
        (b"\xff\xff\xff", "reading the request stream failed"),
    ]
    for payload, words in cases:
        client = open_client(engine)
        try:
            client.send(add("running", LONG))
            wait_until(lambda: "running" in llm.requests, "the request to start", TIMEOUT)
            client.send_raw(frame(payload))
            end = client.ended()
        finally:
            client.close()
        assert end.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert words in end.message, end.message
        wait_until(lambda: not llm.requests, "the stream's request to be aborted", TIMEOUT)
    client = open_client(engine)
    try:
        client.send_raw(struct.pack(">I", 1 << 30))
        end = client.ended()
    finally:
        client.close()
    assert end.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "limit" in end.message


def test_a_failure_acting_on_a_readable_message_is_internal_and_logged(engine, monkeypatch, caplog):
    """A message the engine can read but fails to act on (a fault of its own, injected here)
    ends the stream INTERNAL on both transports, logged once with its traceback: only what the
    client sent wrong is INVALID_ARGUMENT."""

    def fails(self, message):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(GenerateSession, "handle", fails)
    client = open_client(engine)
    try:
        with caplog.at_level(logging.ERROR):
            client.send(add("readable", 4))
            end = client.ended()
    finally:
        client.close()
    assert end.code == grpc.StatusCode.INTERNAL.value[0]
    assert "injected fault" in end.message
    with pytest.raises(grpc.RpcError) as error, caplog.at_level(logging.ERROR):
        grpc_tokens(engine, [add("readable", 4)])
    assert error.value.code() == grpc.StatusCode.INTERNAL
    logged = [r for r in caplog.records if r.exc_info and "injected fault" in str(r.exc_info[1])]
    assert len(logged) == 2, [r.getMessage() for r in caplog.records]


def test_a_request_error_travels_in_the_stream_and_the_others_go_on(engine):
    llm = engine.service.engine.engine
    client = open_client(engine)
    try:
        client.send(add("ok", LONG))
        client.send(add("ok", 5))  # in use on this stream
        client.send(add("bad", 5, prompt=()))
        errors: dict[str, str] = {}
        while len(errors) < 2:
            message = client.next()
            assert message is not None and message.HasField("response")
            for output in message.response.outputs:
                if output.HasField("error"):
                    errors[output.request_id] = output.error.message
        assert "ok" in llm.requests  # the first "ok" runs on
    finally:
        client.close()
    assert "already in use" in errors["ok"] and "prompt" in errors["bad"]


def steps(engine: ServerThread) -> int:
    return engine.call(engine.service.engine.stats())[1].steps


def test_closing_the_connection_aborts_its_requests(engine):
    llm = engine.service.engine.engine
    client = open_client(engine)
    client.send(add("left", LONG))
    message = client.next()  # its first token: it runs
    assert message.response.outputs[0].request_id == "left"
    steps_before = steps(engine)
    client.close()
    wait_until(lambda: not llm.requests, "the closed connection's request to end", TIMEOUT)
    assert steps(engine) - steps_before < LONG // 2  # aborted at once, not run to max_tokens


def test_a_client_that_stops_reading_stalls_nobody(engine):
    """Its frames (megabytes of prompt logprobs) wait in the engine process while another
    connection's request runs to its end; closing it then aborts its last request."""
    llm = engine.service.engine.engine
    silent = open_client(engine, receive_buffer=4096)
    for i in range(PROMPT_LOGPROB_REQUESTS):
        params = common_pb2.SamplingParams(max_tokens=1, prompt_logprobs=20)
        prompt = [3 + (i * 7 + j) % 140 for j in range(1500)]
        silent.send(
            engine_pb2.GenerateRequest(
                add=engine_pb2.EngineRequest(
                    request_id=f"p{i}", prompt_token_ids=prompt, sampling_params=params
                )
            )
        )
    silent.send(add("silent", LONG))
    wait_until(lambda: list(llm.requests) == ["silent"], "the prompt logprobs to be sent", TIMEOUT)
    other = open_client(engine)
    try:
        other.send(add("other", 20))
        assert len(other.tokens(1)["other"]) == 20
    finally:
        other.close()
    silent.close()
    wait_until(lambda: not llm.requests, "the silent request to be aborted", TIMEOUT)


def test_a_step_over_the_frame_limit_ends_the_connection_and_aborts_its_requests(
    engine, monkeypatch
):
    monkeypatch.setattr(framing, "GRPC_MAX_MESSAGE_BYTES", 4096)
    llm = engine.service.engine.engine
    client = open_client(engine)
    params = common_pb2.SamplingParams(
        temperature=0.0, max_tokens=LONG, ignore_eos=True, prompt_logprobs=20
    )
    steps_before = steps(engine)
    try:
        client.send(
            engine_pb2.GenerateRequest(
                add=engine_pb2.EngineRequest(
                    request_id="big",
                    prompt_token_ids=[3 + i % 140 for i in range(200)],
                    sampling_params=params,
                )
            )
        )
        end = client.ended()
    finally:
        client.close()
    assert end.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "over the 4096-byte limit" in end.message
    wait_until(lambda: not llm.requests, "the request to be aborted", TIMEOUT)
    assert steps(engine) - steps_before < LONG // 2


def test_a_draining_engine_lets_the_requests_end_then_closes(model_dir):
    server = ServerThread(
        EngineService(EngineConfig(model=str(model_dir), **ENGINE_ARGS), "127.0.0.1", 0)
    )
    client = open_client(server)
    try:
        client.send(add("last", 300))
        assert client.next().HasField("response")  # it runs
        stopping = threading.Thread(target=lambda: server.call(server.service.stop(TIMEOUT)))
        stopping.start()
        wait_until(lambda: server.service.state is State.DRAINING, "the drain", TIMEOUT)
        client.send(add("late", 5))  # refused in the stream
        tokens = 1
        refused = None
        while (message := client.next()) is not None:
            for output in message.response.outputs:
                if output.request_id == "late":
                    refused = output.error
                else:
                    tokens += len(output.token_ids)
        stopping.join(TIMEOUT)
    finally:
        client.close()
        server.channel.close()
        server.stop_loop()
    assert tokens == 300
    assert refused is not None and refused.code == grpc.StatusCode.UNAVAILABLE.value[0]


def gateway_tokens(port: int, token: str | None, requests: dict[str, int]) -> tuple[str, dict]:
    """The gateway's engine client, one stream: its transport and each request's tokens."""

    async def run() -> tuple[str, dict]:
        client = EngineClient(f"127.0.0.1:{port}", token)
        stream = client.generate_stream()
        try:
            for request_id, max_tokens in requests.items():
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
                stream.add(request_id, [5, 6, 7, 8, 9], params, 0)
            tokens: dict[str, list[int]] = {}
            finished = 0
            async for outputs in stream.steps():
                for output in outputs:
                    assert output.error is None, output.error
                    tokens.setdefault(output.request_id, []).extend(output.token_ids)
                    finished += output.finished
                if finished == len(requests):
                    break
            assert stream.transport is not None
            return stream.transport, tokens
        finally:
            stream.cancel()
            await client.close()

    loop = LoopThread()
    try:
        return loop.call(run())
    finally:
        loop.stop_loop()


def test_the_gateway_streams_on_the_socket_when_offered_and_on_grpc_otherwise(
    engine, model_dir, caplog
):
    requests = {"x": 9, "y": 4}
    transport, by_socket = gateway_tokens(engine.port, TOKEN, requests)
    assert transport == "socket"
    without = ServerThread(
        EngineService(
            EngineConfig(model=str(model_dir), **ENGINE_ARGS),
            "127.0.0.1",
            0,
            generate_socket_port=-1,
        )
    )
    try:
        assert without.service.generate_socket is None
        assert gateway_tokens(without.port, None, requests) == ("grpc", by_socket)
        # Offered but not answering (its listener closed): gRPC, said once in the log.
        unanswered = ServerThread(
            EngineService(EngineConfig(model=str(model_dir), **ENGINE_ARGS), "127.0.0.1", 0)
        )
        try:
            unanswered.call(unanswered.service.generate_socket.drain(0))
            with caplog.at_level(logging.WARNING, logger="gateway.engines.clients"):
                assert gateway_tokens(unanswered.port, None, requests) == ("grpc", by_socket)
            said = [r.getMessage() for r in caplog.records if "Generate socket" in r.getMessage()]
            assert len(said) == 1 and "streaming on gRPC" in said[0], said
        finally:
            unanswered.close()
    finally:
        without.close()


def test_a_port_taken_leaves_the_engine_on_grpc(model_dir, caplog):
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        service = EngineService(
            EngineConfig(model=str(model_dir), **ENGINE_ARGS),
            "127.0.0.1",
            0,
            generate_socket_port=taken.getsockname()[1],
        )
        with caplog.at_level(logging.WARNING, logger="services.engine.server"):
            server = ServerThread(service)
        try:
            assert service.generate_socket is None
            assert any("no Generate socket" in r.getMessage() for r in caplog.records)
            transport, tokens = gateway_tokens(server.port, None, {"z": 3})
            assert transport == "grpc" and len(tokens["z"]) == 3
        finally:
            server.close()
    finally:
        taken.close()


def test_frames_leave_in_order_whatever_the_kernel_buffer_takes():
    """Frames sent from two threads while the peer reads slowly: what the kernel cannot take
    waits, and the peer gets every frame whole and in each thread's order."""
    loop_thread = LoopThread()
    ours, peer = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    ours.setblocking(False)
    writer = FrameWriter(ours, loop_thread.loop)
    count = 300
    payload = bytes(range(256)) * 8  # 2 KiB: the buffer holds a few

    def send(tag: int) -> None:
        for i in range(count):
            writer.send(frame(struct.pack(">HI", tag, i) + payload))
            if i % 8 == 0:
                time.sleep(0.001)

    senders = [threading.Thread(target=send, args=(tag,)) for tag in (1, 2)]
    for sender in senders:
        sender.start()
    reader = FrameReader()
    seen: dict[int, list[int]] = {1: [], 2: []}
    peer.settimeout(TIMEOUT)
    while sum(len(v) for v in seen.values()) < 2 * count:
        for message in reader.feed(peer.recv(3000)):
            tag, i = struct.unpack_from(">HI", message)
            assert message[6:] == payload
            seen[tag].append(i)
        time.sleep(0.0005)
    for sender in senders:
        sender.join(TIMEOUT)
    assert seen == {1: list(range(count)), 2: list(range(count))}
    writer.send(frame(b"last"), last=True)
    writer.send(frame(b"dropped"))
    loop_thread.call(writer.close())
    rest = b""
    while data := peer.recv(1 << 16):
        rest += data
    assert reader.feed(rest) == [b"last"]
    peer.close()
    loop_thread.stop_loop()


def test_frame_reader_cuts_frames_across_any_chunks_and_refuses_oversize_lengths():
    messages = [b"", b"a", bytes(300), b"xyz" * 1000]
    stream = b"".join(frame(m) for m in messages)
    for step in (1, 3, 7, 4096):
        reader = FrameReader()
        out = []
        for start in range(0, len(stream), step):
            out += reader.feed(stream[start : start + step])
        assert out == messages and not reader.partial
    with pytest.raises(FrameError, match="over the"):
        FrameReader().feed(struct.pack(">I", (1 << 24) + 1))
    with pytest.raises(FrameError, match="over the"):
        frame(bytes((1 << 24) + 1))
