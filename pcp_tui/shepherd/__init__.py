"""The coordinator: admits workers, ships the plan, runs rounds, checkpoints, reports state."""
