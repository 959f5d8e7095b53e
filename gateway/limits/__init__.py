"""What a caller may do: API keys, rate limits (shared across workers), deadlines."""
