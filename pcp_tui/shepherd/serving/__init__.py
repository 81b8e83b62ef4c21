"""Serving workers: the front door, one connection per worker, and what each may send.

`pool.WorkerPool` runs one task per admitted connection (`connection.WorkerLink`): the
handshake and admission (`admission`; `worker_keys` with --worker-keys), the plan it is sent
(`worker_plan`, `claims`), the bounds a peer is held to (`uploads`, `progress_rate`, `slots`)
and striping (`striping`).
"""
