"""A loaded model under a scheduler loop: build it, run it offline, freeze the heap after loading; no HTTP."""
