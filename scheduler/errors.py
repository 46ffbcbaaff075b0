"""Errors the scheduler raises to a submitter at once, before anything is queued."""


class QueueFullError(RuntimeError):
    """The waiting queue holds max_queue requests; the API answers 429."""


class SchedulerClosedError(RuntimeError):
    """The scheduler is shutting down and takes no new requests; the API answers 503."""


class EngineLoopStoppedError(SchedulerClosedError):
    """The engine loop thread died (its message says why): this server can serve nothing more; the API answers
    503 without Retry-After, and /health names the reason."""
