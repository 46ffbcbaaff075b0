"""The live page: its files, its event streams and the workloads it starts."""
