"""Loads `pcp.capnp` once, from this package's directory, and names what the codec needs.

The schema is the single source of truth for message layout; nothing here
restates field lists. `capnp.remove_import_hook()` keeps pycapnp from treating
`import`s of `.capnp` files as Python modules: we load the one schema explicitly.
"""

from __future__ import annotations

from pathlib import Path

import capnp

capnp.remove_import_hook()

SCHEMA = capnp.load(str(Path(__file__).with_name("pcp.capnp")))
Envelope = SCHEMA.Envelope

#: Message kinds: the members of the Envelope union, in schema order.
KINDS: tuple[str, ...] = tuple(Envelope.schema.union_fields)
#: Enumerant name -> wire value, straight from the schema.
DTYPE_VALUES: dict[str, int] = dict(SCHEMA.DType.schema.enumerants)
QUANTIZATION_VALUES: dict[str, int] = dict(SCHEMA.Quantization.schema.enumerants)
ERROR_CODES: tuple[str, ...] = tuple(SCHEMA.ErrorCode.schema.enumerants)
