"""Structured outputs: request fields to a grammar spec, tool calls, and the one module that compiles with xgrammar."""
