"""Commands against live servers: one workload, dynamic vs continuous A/B, Ray Serve, compare, soak."""
