"""The worker: joins a shepherd, compiles the shipped graphs on a local backend, trains its shard."""
