"""The OpenAI translation: Chat, Completions and Responses bodies, structured output, tools."""
