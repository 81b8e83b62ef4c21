"""What is trained: models, user model files, the exported graphs, corpora and their shards.

Workers import only `shards` (sampling batches from a shipped shard) and `sharding` (placing
arrays on their devices): never models or corpora.
"""
