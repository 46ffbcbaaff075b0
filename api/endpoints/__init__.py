"""The OpenAI-compatible HTTP surface: the app, its routes, request and response shapes, metrics."""
