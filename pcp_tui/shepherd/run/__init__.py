"""The service around a run: its state, its shards, its graphs and its checkpoints.

`state.RunState` is the one object views read; `ledger` says who trains which shard,
`graphs` exports per worker shape, `checkpoint` and `checkpoint_writer` save and load.
"""
