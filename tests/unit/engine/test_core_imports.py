"""engine.core is torch-free: every module of it imports in a fresh interpreter without torch
coming along (import-linter's contract checks the import graph; this checks what really runs,
lazy imports included)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
import textwrap

import engine.core


def core_modules() -> list[str]:
    return [m.name for m in pkgutil.iter_modules(engine.core.__path__, "engine.core.")]


def test_every_core_module_imports_and_schedules_without_torch():
    modules = core_modules()
    assert {"engine.core.scheduler", "engine.core.kv_cache_manager"} <= set(modules)
    code = textwrap.dedent(
        f"""
        import importlib, sys
        for name in {modules!r}:
            importlib.import_module(name)
        from common.config import EngineConfig
        from common.sampling_params import SamplingParams
        from engine.core.kv_cache_manager import KVCacheManager
        from engine.core.request import Request
        from engine.core.scheduler import Scheduler
        from engine.core.step_plan import decode, encode

        # A seeded n > 1 request that asks for prompt logprobs: the paths that once needed torch.
        scheduler = Scheduler(EngineConfig(block_size=4), KVCacheManager(16, 4, True))
        params = SamplingParams(n=2, seed=3, prompt_logprobs=1)
        scheduler.add_request(Request("a", [1, 2, 3, 4, 5], params))
        plan = scheduler.schedule().plan
        assert plan.num_sampled_rows == 2 and plan.prompt_logprob_spans
        assert decode(encode(plan)).scheduled_ids == plan.scheduled_ids
        assert "torch" not in sys.modules, "torch was imported"
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
