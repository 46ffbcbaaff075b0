"""Speculative decoding: its configuration (`--speculative-config`), the drafters (n-gram lookup, a request's
predicted output) and the verification that accepts or rejects a step's drafts."""
