"""batchserve's server: the command line, ServerConfig and its flags here; the rest in subpackages by job."""
