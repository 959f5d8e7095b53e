"""Every kernel compiles to a cubin for sm_80 and sm_90 in fp16 and bf16, with no GPU: the
compiler checks what the interpreter lets through."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_every_kernel_compiles_for_ampere_and_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("aot_compile.py")
    root = Path(__file__).parents[2]
    proc = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    failures = [r for r in results if not r["ok"]]
    assert not failures, failures
    assert proc.returncode == 0, proc.stderr[-3000:]
    # 11 kernels per 16-bit dtype plus the 2 float32 sampling kernels, for each target.
    assert len(results) == 2 * (2 * 11 + 2)
    assert all(r["cubin_bytes"] > 0 for r in results)
    assert {r["sm"] for r in results} == {80, 90} and {r["dtype"] for r in results} == {
        "fp16",
        "bf16",
        "fp32",
    }
