"""What the shepherd and the worker agree on beyond the wire format: join tokens, worker keys, TLS, tensor checks."""
