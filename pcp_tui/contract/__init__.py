"""What the shepherd and the worker agree on beyond the wire format: join tokens, TLS, tensor checks."""
