"""Reasoning output: a reasoning model's thinking split from its answer (parsers), whether and
how a request's answers are split (plan), structured output after the reasoning (grammar), and
the reader that splits each choice before its tools are read (reader)."""
