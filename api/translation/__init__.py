"""Other API styles translated onto the chat path: each request becomes a chat completion request, started by
api/endpoints/routes.py, and its answer is reshaped into the style's own objects and stream events."""
