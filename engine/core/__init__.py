"""The engine's core: requests, the scheduler, the KV cache manager (prefix caching on the
chained block hashes of common/block_hash.py), the step plan, KV events, outputs and stop
conditions.

Plain Python (numpy at most): it decides what each step computes and keeps the books, and
never imports torch, a model or a kernel, so the simulated engine, the engine service and tests
can load it without them (an import-linter contract and tests/unit/engine/test_core_imports.py
hold it to that). Running a step is an executor's work (engine.executor).
"""
