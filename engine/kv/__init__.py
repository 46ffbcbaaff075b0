"""The paged KV cache: its storage, the reference-counted block pool with the prefix cache over it, and the block
manager, the one owner of which sequence holds which blocks."""
