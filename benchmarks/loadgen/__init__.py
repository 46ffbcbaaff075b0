"""Drive any OpenAI-compatible server: workloads, arrivals, streamed requests, one run and its summaries."""
