"""The process around the app: uvicorn and its connections, the asyncio loop, log throttling, drain."""
