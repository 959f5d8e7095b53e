"""Folio's HTTP gateway: the OpenAI routes, SSE, auth, limits and its own gRPC text API.

Built on the contract layer (common/) alone: it reaches the engine and the tokenizer only over
gRPC and never imports engine, services, torch or llguidance (import-linter checks it).
"""
