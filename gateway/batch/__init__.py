"""Batch jobs (the OpenAI Files and Batch APIs): the SQLite store, the lines, the runner."""
