"""Errors the scheduler raises to a submitter at once, before anything is queued."""


class QueueFullError(RuntimeError):
    """The waiting queue holds max_queue requests; the API answers 429."""


class SchedulerClosedError(RuntimeError):
    """The scheduler is shutting down and takes no new requests; the API answers 503."""
