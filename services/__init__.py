"""Folio's internal gRPC services: tokenizer and engine, one OS process each.

Each is a thin adapter that translates RPCs into calls of a library (common.tokenizer,
engine.async_engine); no service computes anything a library already does.
"""
