"""`folio bench startup`: how long `folio serve` takes to be healthy, cold and warm, and to
recover from a SIGKILLed engine.

Cold: a cache directory of its own, empty (the default model is read from its wheel's file; a
prepared directory stays in the usual cache) but for Folio's built kernels
(FOLIO_KERNEL_DIR points at the usual ones): nothing compiled yet, as on a fresh machine that
ran `make serve`'s set-up. Warm: the same directory again, the decode programs the cold run
stored now in it. Recovery: in the warm run, the engine killed with SIGKILL, the time until the
supervisor has restarted it and it is healthy again. Each also says when the engine's compiled
decode steps were ready (they get ready in the background, after the engine is healthy).
Prints figures, asserts nothing, and never touches the usual cache's compiled programs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.serve import cpu_seconds
from common.config import EngineConfig, GatewayFrontConfig, ListenConfig
from common.flags import flag
from services.supervisor import Child, ServeConfig, Supervisor

# The engine's log line once its compiled decode steps are ready (engine.compiled_decode).
PROGRAMS_READY = re.compile(
    r"compiled decode steps \(batches of [\d, ]+ rows\) (\w+) in ([\d.]+) s"
)


@dataclass
class StartupWorkload:
    """Workload."""

    programs_timeout: float = flag(
        900.0, "seconds to wait for the engine's compiled decode steps after it is healthy"
    )


@dataclass
class StartupRun:
    label: str
    healthy: dict[str, float]  # service -> seconds from its start to healthy
    serving: float  # seconds from `folio serve`'s start (or the kill) until all are healthy
    engine_cpu: float  # CPU seconds the engine process had used by then (all its threads)
    programs: str  # how and when the engine's decode programs got ready


# What limits the code Folio's kernels, oneDNN, torch (inductor included) and MKL (torch's dense
# float32 matmuls: a long prefill's) run to less than the CPU has (docs/quantization.md: forcing
# the AVX2 paths).
ISA_OVERRIDES = (
    "FOLIO_CPU_ISA",
    "ONEDNN_MAX_CPU_ISA",
    "ATEN_CPU_CAPABILITY",
    "MKL_ENABLE_INSTRUCTIONS",
)


def cpu_description() -> str:
    """The CPU's model, the instruction sets that matter to Folio's kernels, its cores, and how
    busy the machine was (others may share it)."""
    model, flags = "unknown CPU", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    features = ("avx2", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
    isa = [f for f in features if f in flags]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    # Figures taken with the AVX2 code forced on a CPU that has more must say so.
    forced = [f"{name}={os.environ[name]}" for name in ISA_OVERRIDES if os.environ.get(name)]
    overrides = f"; instruction sets limited by {' '.join(forced)}" if forced else ""
    if forced and not os.environ.get("MKL_ENABLE_INSTRUCTIONS"):
        overrides += " (not MKL's: long prefills' float32 matmuls use all the CPU has)"
    return (
        f"{model}, {len(os.sched_getaffinity(0))} cores, {' '.join(isa)}{overrides}; "
        f"load average {load}"
    )


def programs_ready(log: Path, since: int, timeout: float) -> str:
    """How the engine's decode programs got ready, from its log after offset `since`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")[since:]
        if match := PROGRAMS_READY.search(text):
            return f"{match[1]} in {float(match[2]):.1f} s"
        if "compiled decode steps unavailable" in text:
            return "unavailable (see the log): decode runs eagerly"
        time.sleep(0.2)
    return f"not ready after {timeout:.0f} s"


def engine_cpu(supervisor: Supervisor) -> float:
    process = supervisor.engine.process
    assert process is not None
    return cpu_seconds(process.pid)


def start(supervisor: Supervisor, label: str, log: Path, args: argparse.Namespace) -> StartupRun:
    since = log.stat().st_size
    started = time.monotonic()
    supervisor.start()
    serving = time.monotonic() - started
    cpu = engine_cpu(supervisor)
    healthy = {child.name: child.startup_seconds() for child in supervisor.children}
    programs = programs_ready(log, since, args.programs_timeout)
    return StartupRun(label, healthy, serving, cpu, programs)


def recover(supervisor: Supervisor, log: Path, args: argparse.Namespace) -> StartupRun:
    """SIGKILL the engine of a serving group and time its return (the supervisor's own restart
    back-off included). The supervisor watches and restarts in this thread, as in `folio
    serve` (a child dies with the thread that started it); another kills and times."""
    engine: Child = supervisor.engine
    runs: list[StartupRun] = []

    def kill_and_time() -> None:
        try:
            assert engine.process is not None
            since = log.stat().st_size
            killed = time.monotonic()
            os.kill(engine.process.pid, signal.SIGKILL)
            while (
                engine.started_at is None
                or engine.started_at < killed
                or engine.healthy_since is None
            ):
                time.sleep(0.05)
            recovered = engine.healthy_since - killed
            cpu = engine_cpu(supervisor)
            programs = programs_ready(log, since, args.programs_timeout)
            healthy = {"engine": engine.startup_seconds()}
            runs.append(StartupRun("recovery", healthy, recovered, cpu, programs))
        finally:
            supervisor.request_stop()

    threading.Thread(target=kill_and_time, daemon=True).start()
    supervisor.watch()
    if not runs:
        raise RuntimeError("the engine did not come back (see the service logs)")
    return runs[0]


def report(run: StartupRun) -> None:
    services = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in run.healthy.items())
    what = "back to healthy" if run.label == "recovery" else "all healthy"
    print(
        f"{run.label:>8}: {what} in {run.serving:.1f} s ({services}; the engine had used "
        f"{run.engine_cpu:.1f} CPU s); compiled decode steps {run.programs}",
        flush=True,
    )


def run_startup_benchmark(args: argparse.Namespace) -> list[StartupRun]:
    from common.config import engine_config_from_args
    from common.default_model import engine_model_path
    from engine.kernels.cpu.extension import KERNEL_DIR_ENV, kernel_dir

    config: EngineConfig = engine_config_from_args(args)
    # Found (the default model prepared where it must be, the kernels built) in the usual cache,
    # before the runs get their own.
    model = str(engine_model_path(config))
    config = dataclasses.replace(config, model=model, enforce_eager=False)
    saved = {name: os.environ.get(name) for name in ("FOLIO_CACHE_DIR", KERNEL_DIR_ENV)}
    os.environ[KERNEL_DIR_ENV] = str(kernel_dir())
    print(f"CPU: {cpu_description()}", flush=True)
    runs = []
    try:
        with tempfile.TemporaryDirectory(prefix="folio-bench-startup-") as cache:
            os.environ["FOLIO_CACHE_DIR"] = cache
            log = Path(cache) / "serve.log"
            log.touch()
            serve = ServeConfig(
                GatewayFrontConfig(ListenConfig(port=0), grpc_port=0),
                engine_port=0,
                tokenizer_port=0,
                engine=config,
            )
            print(f"folio serve --model {model} (service logs in {log})", flush=True)
            for label in ("cold", "warm"):
                with log.open("a") as output:
                    supervisor = Supervisor(serve, output=output)
                    try:
                        runs.append(start(supervisor, label, log, args))
                        report(runs[-1])
                        if label == "warm":
                            runs.append(recover(supervisor, log, args))
                            report(runs[-1])
                    finally:
                        supervisor.stop()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return runs
