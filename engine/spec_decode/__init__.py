"""Speculative decoding: proposers draft tokens, the engine verifies them in its own step.

`drafter.py` (torch-free) chooses per step which running requests draft and how many tokens
(adaptive), asks the proposer (`ngram.py`, `suffix.py`, or the model executor's draft model,
`draft_model.py`, with its own KV cache) and keeps the acceptance counters; `verify.py` (the
model executor's) verifies the drafts against the model's distributions.
"""
