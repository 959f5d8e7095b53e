"""The gateway is built on the contract layer only: loading it loads neither the engine, nor
what the engine runs on (torch, llguidance), nor the services. import-linter checks the import
graph in `make lint`; this checks what a real gateway process actually loads."""

from __future__ import annotations

import json
import subprocess
import sys


def test_importing_the_gateway_app_loads_no_engine_llguidance_torch_or_services():
    code = (
        "import json, sys, gateway.front.app, gateway.front.server; "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    loaded = set(json.loads(result.stdout))
    assert "gateway" in loaded and "common" in loaded  # the probe itself worked
    assert loaded.isdisjoint({"engine", "llguidance", "torch", "services", "transformers"})
