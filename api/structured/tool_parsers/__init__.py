"""Tool-call parsers: each model family's way of writing calls into its answer, read back into OpenAI tool calls."""
