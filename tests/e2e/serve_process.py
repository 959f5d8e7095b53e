"""Test helper: a real `folio serve` process on free ports, its addresses read from what it prints,
and its child processes read from /proc (to prove none outlives it)."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common.config import INTERNAL_TOKEN_ENV

# Three processes loading on two cores; the first start may also convert the default model.
STARTUP_TIMEOUT = 180
# ... and compile decode steps (about 100 s on a loaded 2-core machine with a cold cache).
COMPILED_STARTUP_TIMEOUT = 600
STARTING = re.compile(r"starting tokenizer \((\S+)\), engine \((\S+)\) and gateway")
SERVING = re.compile(r"serving on (http://\S+) \(OpenAI API under /v1; gateway gRPC (\S+)\)")
# What an engine logs once its compiled decode steps are ready (engine.compiled_decode).
PROGRAMS_READY = r"compiled decode steps \(batches of [\d, ]+ rows\) (loaded|compiled) in"
# Small engine settings: quick to start, and checked to reach the engine process.
ENGINE_ARGS = ("--num-kv-blocks", "512", "--max-num-seqs", "32")


@dataclass
class ServeProcess:
    process: subprocess.Popen
    log: Path
    url: str = ""
    grpc_address: str = ""
    engine_address: str = ""
    tokenizer_address: str = ""
    # The token the engine and tokenizer ask of their callers (set for the run by start_serve).
    internal_token: str = ""

    def internal_metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC call metadata that lets a test call the internal services directly."""
        return (("authorization", f"Bearer {self.internal_token}"),)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def children(self) -> dict[int, str]:
        """Live child processes: pid -> command line."""
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue  # gone meanwhile
            # Fields after the command name, which is in parentheses and may contain spaces.
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            if int(ppid) == self.process.pid and state != "Z":
                found[int(entry.name)] = cmdline
        return found

    def child_pid(self, role: str) -> int:
        """The pid of the live child running `folio <role>` (tokenizer, engine or gateway)."""
        pids = [pid for pid, cmdline in self.children().items() if f"folio.cli {role} " in cmdline]
        assert len(pids) == 1, f"{role}: {pids} in {self.children()}"
        return pids[0]

    def wait_for_output(self, pattern: str, timeout: float, since: int = 0) -> re.Match:
        """The first match of `pattern` in what folio serve printed from offset `since` on
        (e.g. len(output()) before an action), once it is there."""
        deadline = time.monotonic() + timeout
        while not (match := re.compile(pattern).search(self.output(), since)):
            assert time.monotonic() < deadline, (
                f"no {pattern!r} after {timeout} s:\n{self.output()}"
            )
            time.sleep(0.1)
        return match

    def stop(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.terminate()
        try:
            return self.process.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        """Last resort after a failed test: the whole group, children included."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, 9)
            self.process.wait()


def processes_with(text: str) -> list[int]:
    """Live processes whose command line contains `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            ):
                found.append(int(entry.name))
        except OSError:
            continue  # gone meanwhile
    return [pid for pid in found if alive(pid)]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_serve(
    log: Path, *args: str, wait: bool = True, timeout: float = STARTUP_TIMEOUT
) -> ServeProcess:
    """`folio serve` on free ports in a session of its own (as a terminal would run it)."""
    command = [
        sys.executable,
        "-m",
        "folio.cli",
        "serve",
        "--port",
        "0",
        "--grpc-port",
        "0",
        "--engine-port",
        "0",
        "--tokenizer-port",
        "0",
        *args,
    ]
    token = secrets.token_urlsafe(16)
    with log.open("w") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, INTERNAL_TOKEN_ENV: token},
        )
    server = ServeProcess(process, log, internal_token=token)
    if wait:
        wait_serving(server, timeout)
    return server


def wait_serving(server: ServeProcess, timeout: float = STARTUP_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not (serving := SERVING.search(server.output())):
        if server.process.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise AssertionError(f"folio serve did not start:\n{server.output()}")
        time.sleep(0.1)
    server.url, server.grpc_address = serving[1], serving[2]
    server.tokenizer_address, server.engine_address = STARTING.search(server.output()).groups()
