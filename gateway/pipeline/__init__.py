"""The token pipeline: one engine request per prompt, its outputs turned into each caller's text."""
