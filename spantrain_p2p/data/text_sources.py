"""Reading a local data set as text: a file, a directory, JSON Lines, Parquet; nothing is downloaded.

``PATH`` may be

- a text file (UTF-8): one document;
- a ``.jsonl`` file: one document per line, the line's ``text`` field;
- a ``.parquet`` file: one document per row of its ``text`` column (needs the optional ``pyarrow``);
- a Hugging Face ``datasets`` dataset saved with ``save_to_disk`` (a folder with ``state.json``; of a
  ``DatasetDict``, its ``train`` split): one document per row of its ``text`` column, its Arrow files
  in the order ``state.json`` lists them (needs ``pyarrow``; the ``datasets`` package is not needed);
- a directory: every regular file below it, recursively, in sorted order of relative path
  (POSIX, code-point order), each read by its suffix as above (``.jsonl``, ``.parquet``, else
  text). Hidden files and folders (a name starting with ``.``), ``__pycache__``,
  ``site-packages`` and ``dist-packages`` are left out; ``suffixes`` keeps only files with those
  suffixes. A file that is not UTF-8 text (a NUL byte in its first 8 KiB, or undecodable) is
  skipped and counted in ``ReadStats.skipped`` rather than failing the data set.

``stdlib`` names the demo corpus: the ``.py`` files of the Python standard library
(``stdlib_corpus_dir()``); a folder of that name is ``./stdlib``.

Large documents come in pieces of about ``PIECE_CHARS`` characters, cut after a newline, so
neither reading nor tokenizing holds a whole large file as one string; ``Piece.last`` marks the
end of a document. ``max_bytes`` stops after that many bytes of UTF-8 text (the last piece is
cut there), which makes "the first 4 MB of the standard library" a reproducible data set.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

PIECE_CHARS = 1 << 20
STDLIB = "stdlib"
STDLIB_SUFFIXES = (".py",)
_SKIP_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages"})
_MAX_WHOLE_FILE = 64 << 20  # text files up to this size are read at once (so a bad one is skipped whole)


class DataError(ValueError):
    """A data set could not be read, or a shard of it is not what its manifest says."""


@dataclass(frozen=True)
class Piece:
    text: str
    last: bool  # the last piece of its document


@dataclass
class ReadStats:
    files: int = 0
    documents: int = 0
    text_bytes: int = 0
    skipped: list[str] = field(default_factory=list)  # files left out: not UTF-8 text
    skipped_rows: int = 0  # JSON Lines / Parquet rows with no string ``text``

    def as_dict(self) -> dict:
        return {"files": self.files, "documents": self.documents, "text_bytes": self.text_bytes,
                "skipped_files": len(self.skipped), "skipped_rows": self.skipped_rows}


def stdlib_corpus_dir() -> Path:
    """The Python standard library's own sources: a corpus on every machine, no download.

    Read as a directory it is the ``.py`` files and other text beside ``os.py``, less
    ``site-packages``; its contents (hence a data set's fingerprint) depend on the Python version.
    """
    return Path(os.path.dirname(os.__file__))


def resolve_data(path: Union[str, Path], suffixes: Optional[Sequence[str]] = None) -> tuple[Path, Optional[tuple[str, ...]]]:
    """``(folder or file, suffixes)`` for a data spec: a path, or ``stdlib``."""
    if str(path) == STDLIB:
        return stdlib_corpus_dir(), tuple(suffixes) if suffixes else STDLIB_SUFFIXES
    return Path(path).expanduser(), tuple(suffixes) if suffixes else None


def list_files(path: Union[str, Path], suffixes: Optional[Sequence[str]] = None) -> list[Path]:
    """The files a data set at ``path`` reads, in the order it reads them."""
    root, suffixes = resolve_data(path, suffixes)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise DataError(f"data {str(path)!r}: no such file or directory (nothing is downloaded)")
    saved = saved_dataset_files(root)
    if saved is not None:
        return saved
    keep = tuple(suffixes) if suffixes else None
    found: list[tuple[str, Path]] = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if not x.startswith(".") and x not in _SKIP_DIRS]
        for name in files:
            if name.startswith(".") or (keep and not name.endswith(keep)):
                continue
            p = Path(d) / name
            if p.is_file():
                found.append((p.relative_to(root).as_posix(), p))
    found.sort(key=lambda rp: rp[0])
    return [p for _, p in found]


def saved_dataset_files(root: Path) -> Optional[list[Path]]:
    """The Arrow files of a ``datasets`` dataset saved with ``save_to_disk`` at ``root`` (a
    ``DatasetDict``'s ``train`` split), in its order; None if ``root`` is not one."""
    if (root / "dataset_dict.json").is_file():
        try:
            splits = json.loads((root / "dataset_dict.json").read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{root}/dataset_dict.json: unreadable ({e})") from None
        if "train" not in splits:
            raise DataError(f"{root}: a saved DatasetDict without a 'train' split (splits: {', '.join(map(str, splits))}); "
                            f"name the split's folder")
        root = root / "train"
    if not ((root / "state.json").is_file() and (root / "dataset_info.json").is_file()):
        return None
    try:
        names = [f["filename"] for f in json.loads((root / "state.json").read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{root}/state.json: unreadable ({e})") from None
    files = []
    for name in names:
        if not isinstance(name, str) or "/" in name or name.startswith(".") or not name.endswith(".arrow"):
            raise DataError(f"{root}/state.json names {name!r}, not an Arrow file of this folder")
        if not (root / name).is_file():
            raise DataError(f"{root}: {name}, listed in state.json, is missing")
        files.append(root / name)
    return files


def _arrow_file(p: Path, stats: ReadStats) -> Iterator[Piece]:
    """A saved dataset's Arrow file (the IPC stream format ``datasets`` writes): its ``text`` column."""
    try:
        import pyarrow as pa
    except ImportError:
        raise DataError(f"{p}: reading a saved datasets dataset needs pyarrow, which is not installed "
                        "(pip install pyarrow)") from None
    with pa.memory_map(str(p)) as source:
        try:
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            source.seek(0)
            reader = pa.ipc.open_file(source)
        if "text" not in reader.schema.names:
            raise DataError(f"{p}: the dataset has no 'text' column (columns: {', '.join(reader.schema.names)})")
        stats.files += 1
        batches = reader if hasattr(reader, "__iter__") else (reader.get_batch(i) for i in range(reader.num_record_batches))
        for rb in batches:
            for text in rb.column(rb.schema.get_field_index("text")).to_pylist():
                if not isinstance(text, str):
                    stats.skipped_rows += 1
                    continue
                yield from _pieces_of(text)


def _pieces_of(text: str) -> Iterator[Piece]:
    """``text`` in pieces of about PIECE_CHARS characters, each cut after a newline where there is one."""
    i, n = 0, len(text)
    while n - i > PIECE_CHARS:
        cut = text.rfind("\n", i, i + PIECE_CHARS)
        cut = i + PIECE_CHARS if cut < i + PIECE_CHARS // 2 else cut + 1
        yield Piece(text[i:cut], False)
        i = cut
    yield Piece(text[i:], True)


def _text_file(p: Path, stats: ReadStats, alone: bool) -> Iterator[Piece]:
    with open(p, "rb") as f:
        head = f.read(8192)
    reason = "a NUL byte: binary" if b"\0" in head else None
    size = p.stat().st_size
    if reason is None and size <= _MAX_WHOLE_FILE:
        raw = p.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            reason = e.reason
    if reason is not None:
        if alone:
            raise DataError(f"{p}: not UTF-8 text ({reason})")
        stats.skipped.append(str(p))
        return
    if size <= _MAX_WHOLE_FILE:
        stats.files += 1
        yield from _pieces_of(text)
        return
    stats.files += 1
    with open(p, encoding="utf-8", errors="strict", newline="") as f:
        buf: list[str] = []
        n = 0
        try:
            for line in f:
                buf.append(line)
                n += len(line)
                if n >= PIECE_CHARS:
                    yield Piece("".join(buf), False)
                    buf, n = [], 0
        except UnicodeDecodeError as e:
            raise DataError(f"{p}: not UTF-8 text past its first bytes ({e.reason})") from None
        yield Piece("".join(buf), True)


def _jsonl_file(p: Path, stats: ReadStats) -> Iterator[Piece]:
    stats.files += 1
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{p}:{lineno}: not JSON ({e.msg})") from None
            text = row.get("text") if isinstance(row, dict) else None
            if not isinstance(text, str):
                stats.skipped_rows += 1
                continue
            yield from _pieces_of(text)


def _parquet_file(p: Path, stats: ReadStats) -> Iterator[Piece]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{p}: reading Parquet needs pyarrow, which is not installed "
                        "(pip install pyarrow, or convert the data to JSON Lines with a 'text' field)") from None
    pf = pq.ParquetFile(p)
    if "text" not in pf.schema_arrow.names:
        raise DataError(f"{p}: Parquet file has no 'text' column (columns: {', '.join(pf.schema_arrow.names)})")
    stats.files += 1
    for rb in pf.iter_batches(columns=["text"], batch_size=1024):
        for text in rb.column(0).to_pylist():
            if not isinstance(text, str):
                stats.skipped_rows += 1
                continue
            yield from _pieces_of(text)


def read_pieces(
    path: Union[str, Path],
    *,
    max_bytes: Optional[int] = None,
    suffixes: Optional[Sequence[str]] = None,
    stats: Optional[ReadStats] = None,
) -> Iterator[Piece]:
    """The data set at ``path`` as pieces of text, in a fixed order (see the module's docstring)."""
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
        raise DataError(f"max_bytes must be a positive int, not {max_bytes!r}")
    stats = stats if stats is not None else ReadStats()
    root, suffixes = resolve_data(path, suffixes)
    files = list_files(root, suffixes)
    alone = root.is_file()
    left = max_bytes if max_bytes is not None else sys.maxsize
    for p in files:
        name = p.name.lower()
        if name.endswith(".jsonl"):
            it = _jsonl_file(p, stats)
        elif name.endswith(".parquet"):
            it = _parquet_file(p, stats)
        elif name.endswith(".arrow"):
            it = _arrow_file(p, stats)
        else:
            it = _text_file(p, stats, alone)
        for piece in it:
            size = len(piece.text.encode("utf-8"))
            if size >= left:
                text = piece.text.encode("utf-8")[:left].decode("utf-8", errors="ignore")
                stats.text_bytes += len(text.encode("utf-8"))
                stats.documents += 1
                yield Piece(text, True)
                return
            left -= size
            stats.text_bytes += size
            stats.documents += piece.last
            yield piece


def read_documents(path: Union[str, Path], **kw) -> Iterator[str]:
    """The texts of ``read_pieces`` (a large document comes as several texts)."""
    return (piece.text for piece in read_pieces(path, **kw))
