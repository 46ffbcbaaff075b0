"""Several replicas behind Ray Serve's proxy: the only `import ray`, the replica wrapper, merged metrics."""
