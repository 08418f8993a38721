"""Records with named fields: JSON Lines, Parquet and Hugging Face `datasets`.

Each source yields one document per record: the value of one field (`data.text_field` for
text, `data.messages_field` for conversations), and only that field is used (Parquet and
`datasets` read only that column); with `whole`, the whole record (a dict that has the field:
a prompt with the columns its rewards read). Records come in a fixed order (files sorted by path, then
line or row order), each named by its file and line or row, so the split by name is
deterministic. A record without the field is an error naming the file, the line and the
fields it has.

- `jsonl`: a `.jsonl` / `.jsonl.gz` file, or a directory of them; one JSON object per line. A text
  corpus of 64 MiB or more, uncompressed, is read a block at a time as batches ask (`JsonlRecords`).
- `parquet`: a `.parquet` file, or a directory of them (pyarrow), a row group at a time; a text
  corpus is read as batches ask through `ParquetRecords` (`corpora.load_splits`), never whole.
- `hf`: Hugging Face `datasets`: a directory written by `save_to_disk` (a `DatasetDict`'s
  `data.hf_split`), a local data file (read by the `datasets` builder of its extension,
  `HF_BUILDERS`) or a directory of them, or a hub name (`org/name`, when the network or the
  local cache has it; `data.hf_config`, `data.hf_split`), streamed with `data.streaming`.
  A local path is never looked up on the hub. A text corpus not streamed is read a row at a time
  from its memory-mapped Arrow files as batches ask (`HfRecords`).

A file that cannot be read (damaged, truncated, no permission) is named, also when
`datasets` is the reader (it names the file only in its log, which is kept off stderr).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import pathlib
import re
import threading
from collections.abc import Iterator

import numpy as np

from modern_jax.data.config import EXTENSIONS, SAVED_DATASET, DataConfig, data_files

Record = tuple[str, str, object]  # (name for the split, where for errors, the field's value)
HF_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".jsonl.gz": "json", ".json": "json", ".csv": "csv"}


def record_documents(cfg: DataConfig, source: str) -> list[tuple[str, object]]:
    """`(name, value)` of the chosen field of every record (at most `data.max_documents`)."""
    return list(iter_record_documents(cfg, source))


def iter_record_documents(cfg: DataConfig, source: str) -> Iterator[tuple[str, object]]:
    """`(name, value)` of the chosen field of each record as it is read; text values are checked
    to be strings here, conversations when they are rendered."""
    chat = cfg.format == "chat"
    field, setting = (cfg.messages_field, "messages_field") if chat else (cfg.text_field, "text_field")
    reader = {"jsonl": _jsonl, "parquet": _parquet, "hf": _hf}[source]
    n = 0
    for name, where, value in reader(cfg, field, setting):
        if not chat:
            _check_text(value, where, field, setting)
        yield name, value
        n += 1
        if cfg.max_documents is not None and n >= cfg.max_documents:
            break
    if not n:
        raise ValueError(f"data.path={str(cfg.path)!r} holds no records")


def _check_text(value, where: str, field: str, setting: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {field!r} (data.{setting}) holds {type(value).__name__} "
                         f"{str(value)[:60]!r}, not text: point data.{setting} at a text field"
                         + ("; for conversations set data.format: chat" if isinstance(value, list) else ""))
    return value


def _json_record(line: str | bytes, where: str, field: str, setting: str) -> dict:
    """One line of a JSON Lines file: a JSON object with the field."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno}): each line of a .jsonl file "
                         "is one JSON object") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object {{...}}, got {type(record).__name__}")
    if field not in record:
        raise _missing(where, field, setting, record)
    return record


def _missing(where: str, field: str, setting: str, fields) -> ValueError:
    fields = list(fields)
    return ValueError(f"{where}: no field {field!r} (data.{setting}); the fields are "
                      f"{', '.join(map(repr, fields)) or 'none'}: set data.{setting} to the one to read")


def record_files(cfg: DataConfig, source: str) -> list[tuple[pathlib.Path, str]]:
    """`(file, name)` of a file or of every file of the source's extensions under a directory."""
    from modern_jax.data.shards import expand, is_glob, nothing_at

    if is_glob(cfg.path):  # shards: each named by its file
        files = [pathlib.Path(f) for f in expand(cfg.path, EXTENSIONS[source])]
        if not files:
            raise nothing_at(cfg.path, f"{' / '.join(EXTENSIONS[source])} files")
        return [(f, f.name) for f in files]
    path = pathlib.Path(cfg.path)
    if not path.exists():
        raise nothing_at(path)
    if path.is_file():
        return [(path, path.name)]
    files = data_files(path, EXTENSIONS[source])
    if not files:
        raise ValueError(f"data.path={str(path)!r} holds no {' / '.join(EXTENSIONS[source])} files")
    return [(f, f.relative_to(path).as_posix()) for f in files]


def _jsonl(cfg: DataConfig, field: str, setting: str, whole: bool = False) -> Iterator[Record]:
    for file, name in record_files(cfg, "jsonl"):
        opener = gzip.open if file.name.endswith(".gz") else open
        try:
            with opener(file, "rt", encoding="utf-8") as lines:
                for n, line in enumerate(lines, 1):
                    if not line.strip():
                        continue
                    where = f"{file}, line {n}"
                    record = _json_record(line, where, field, setting)
                    yield f"{name}, line {n}", where, record if whole else record[field]
        except UnicodeDecodeError as e:
            raise ValueError(f"{file}: not UTF-8 text (byte {e.start}): is it a JSON Lines file?") from None
        except (OSError, EOFError) as e:  # gzip: a damaged or truncated file
            raise ValueError(f"{file}: cannot be read ({type(e).__name__}: {e})") from None


@contextlib.contextmanager
def _reading_parquet(file):
    """pyarrow's errors on `file` as one line naming it."""
    try:
        yield
    except PermissionError as e:
        raise ValueError(f"{file} cannot be read ({e.strerror or e}): check its permissions") from None
    except Exception as e:  # pyarrow raises ArrowInvalid (a ValueError) and others on a damaged file
        raise ValueError(f"{file}: not a readable Parquet file ({type(e).__name__}: {e})") from None


def _parquet(cfg: DataConfig, field: str, setting: str, whole: bool = False) -> Iterator[Record]:
    """Each file a row group at a time (only the field's column, unless `whole`)."""
    import pyarrow.parquet as pq

    for file, name in record_files(cfg, "parquet"):
        with _reading_parquet(file):
            reader = pq.ParquetFile(file)
            names = reader.schema_arrow.names
        if field not in names:
            raise _missing(str(file), field, setting, names)
        row = 0
        for group in range(reader.num_row_groups):
            with _reading_parquet(file):
                table = reader.read_row_group(group, columns=None if whole else [field])
            for value in table.to_pylist() if whole else table.column(field).to_pylist():
                yield f"{name}, row {row}", f"{file}, row {row}", value
                row += 1


class ParquetRecords:
    """The text field of every row of Parquet shards as one random-access source of records (what
    `arrayrecords.RecordStream` reads): opening reads each file's footer (its row groups' row counts)
    and nothing more; record `i` reads its row group's one column, the last `KEPT` groups kept."""

    KEPT = 4

    def __init__(self, cfg: DataConfig):
        import pyarrow.parquet as pq

        self.field, self.files = cfg.text_field, [file for file, _ in record_files(cfg, "parquet")]
        self.groups, counts, self.counts = [], [], []  # (file, group) of each row group, its rows; rows a file
        for k, file in enumerate(self.files):
            with _reading_parquet(file):
                meta = pq.ParquetFile(file).metadata
                names = meta.schema.to_arrow_schema().names
            if self.field not in names:
                raise _missing(str(file), self.field, "text_field", names)
            rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            self.groups += [(k, g) for g in range(len(rows))]
            counts += rows
            self.counts.append(sum(rows))
        self.firsts = np.cumsum([0] + counts)  # the first row of each row group, and the total
        self._kept: dict[int, list] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self.firsts[-1])

    def where(self, i: int) -> str:
        """Record `i` named by its file and row."""
        k = int(np.searchsorted(np.cumsum(self.counts), i, side="right"))
        return f"{self.files[k]}, row {i - sum(self.counts[:k])}"

    def __getitem__(self, i: int) -> str:
        g = int(np.searchsorted(self.firsts, i, side="right")) - 1
        with self._lock:
            column = self._kept.pop(g, None)
        if column is None:
            import pyarrow.parquet as pq

            file, group = self.files[self.groups[g][0]], self.groups[g][1]
            with _reading_parquet(file):
                column = pq.ParquetFile(file).read_row_group(group, columns=[self.field]).column(self.field).to_pylist()
        with self._lock:
            self._kept[g] = column  # the most recent last
            while len(self._kept) > self.KEPT:
                self._kept.pop(next(iter(self._kept)))
        return _check_text(column[i - int(self.firsts[g])], self.where(i), self.field, "text_field")


class JsonlRecords:
    """The text field of the lines of JSON Lines shards (uncompressed) as one random-access source of
    records (what `arrayrecords.RecordStream` reads): record `b` of a file is the lines that start in its
    block `b` of `BLOCK` bytes (a list of texts, often several, none in a block that a long line crosses
    whole). Opening reads each file's size alone; a record reads its block and the end of its last line.
    A corpus of fewer than `FROM_BLOCKS` blocks (64 MiB) is read whole instead (`read_as_records`), where
    its records split by name."""

    BLOCK = 1 << 16
    FROM_BLOCKS = 1024
    head = 1  # blocks of each shard checked when the corpus opens (a block holds many records)

    @classmethod
    def block_counts(cls, files) -> list[int]:
        """The blocks of each of `files` (from their sizes)."""
        counts = []
        for file in files:
            try:
                counts.append(-(-file.stat().st_size // cls.BLOCK))
            except OSError as e:
                raise ValueError(f"{file} cannot be read ({e.strerror or e}): check its permissions") from None
        return counts

    def __init__(self, cfg: DataConfig):
        self.field, self.files = cfg.text_field, [file for file, _ in record_files(cfg, "jsonl")]
        self.counts = self.block_counts(self.files)
        self.firsts = np.cumsum([0] + self.counts)

    def __len__(self) -> int:
        return int(self.firsts[-1])

    def where(self, i: int) -> str:
        k = int(np.searchsorted(self.firsts, i, side="right")) - 1
        return f"{self.files[k]}, bytes {(i - int(self.firsts[k])) * self.BLOCK}+"

    def __getitem__(self, i: int) -> list[str]:
        k = int(np.searchsorted(self.firsts, i, side="right")) - 1
        file, begin = self.files[k], (i - int(self.firsts[k])) * self.BLOCK
        texts = []
        try:
            with open(file, "rb") as f:
                if begin:  # the line that starts in this block: after the first newline from its last byte before
                    f.seek(begin - 1)
                    f.readline()
                at = f.tell()
                while at < begin + self.BLOCK:
                    line = f.readline()
                    if not line:
                        break
                    if line.strip():
                        texts.append(self._text(line, file, at))
                    at = f.tell()
        except OSError as e:
            raise ValueError(f"{file} cannot be read ({e.strerror or e})") from None
        return texts

    def _text(self, line: bytes, file: pathlib.Path, at: int) -> str:
        """The field's text of the line at byte `at`; an error names the line by its number, counted then."""
        try:
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"not UTF-8 text (byte {at + e.start}): is it a JSON Lines file?") from None
            return _check_text(_json_record(text, "", self.field, "text_field")[self.field], "", self.field,
                               "text_field")
        except ValueError as e:
            raise ValueError(f"{file}, line {_line_number(file, at)}" + (str(e) if str(e).startswith(":") else
                                                                          f": {e}")) from None


def _line_number(file: pathlib.Path, at: int) -> int:
    """The number of the line that starts at byte `at` of `file` (its newlines before it, plus one)."""
    count, done = 1, 0
    with open(file, "rb") as f:
        while done < at:
            chunk = f.read(min(1 << 20, at - done))
            count, done = count + chunk.count(b"\n"), done + len(chunk)
    return count


@contextlib.contextmanager
def _datasets_log(messages: list[str]):
    """`datasets`' log records (its errors name the file they failed on) into `messages`, off stderr."""
    logger = logging.getLogger("datasets")
    saved = logger.handlers[:], logger.propagate

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logger.handlers, logger.propagate = [Collect(logging.ERROR)], False
    try:
        yield
    finally:
        logger.handlers, logger.propagate = saved


def _hf(cfg: DataConfig, field: str, setting: str, whole: bool = False) -> Iterator[Record]:
    dataset = hf_dataset(cfg, field, setting, whole)
    where = f"data.path={str(cfg.path)!r}"
    for row, record in enumerate(dataset):
        if field not in record:
            raise _missing(f"{where}, row {row}", field, setting, record)
        yield f"{cfg.hf_split}, row {row}", f"{where}, row {row}", dict(record) if whole else record[field]


class HfRecords:
    """The text field of every row of a Hugging Face dataset (its Arrow files, memory-mapped: a saved
    dataset, local data files or a hub dataset in the local cache; not streamed) as one random-access
    source of records (what `arrayrecords.RecordStream` reads): opening maps the files, record `i` reads
    its row's one column."""

    def __init__(self, cfg: DataConfig):
        self.field, self.path = cfg.text_field, cfg.path
        self.dataset = hf_dataset(cfg, self.field, "text_field")
        self.counts = [len(self.dataset)]

    def __len__(self) -> int:
        return self.counts[0]

    def where(self, i: int) -> str:
        return f"data.path={str(self.path)!r}, row {i}"

    def __getitem__(self, i: int) -> str:
        return _check_text(self.dataset[i][self.field], self.where(i), self.field, "text_field")


def hf_dataset(cfg: DataConfig, field: str, setting: str, whole: bool = False):
    """The dataset of `data.source: hf` (`datasets.Dataset`, or an `IterableDataset` with `data.streaming`),
    checked to have `field` (its other columns dropped unless `whole`); its errors in one line naming it."""
    import datasets

    datasets.disable_progress_bars()
    path, where = pathlib.Path(cfg.path), f"data.path={str(cfg.path)!r}"
    builder = next((b for ext, b in HF_BUILDERS.items() if path.name.endswith(ext)), None)
    local = path.exists() or str(cfg.path).startswith(("/", ".", "~")) or builder is not None
    if local and not path.exists():
        raise ValueError(f"{where} does not exist")
    if path.is_file() and builder is None:
        raise ValueError(f"{where} is a local file: source: hf reads a file with the `datasets` builder of its "
                         f"extension ({', '.join(HF_BUILDERS)}): give one of those, or set data.source: auto")
    logged: list[str] = []
    try:
        with _datasets_log(logged):
            if path.is_dir() and any((path / marker).is_file() for marker in SAVED_DATASET):
                dataset = datasets.load_from_disk(str(path))
                if isinstance(dataset, datasets.DatasetDict):
                    if cfg.hf_split not in dataset:
                        raise ValueError(f"{where} has no split {cfg.hf_split!r} (data.hf_split); its splits are "
                                         f"{', '.join(map(repr, dataset))}")
                    dataset = dataset[cfg.hf_split]
                if cfg.streaming:
                    dataset = dataset.to_iterable_dataset()
            elif path.is_file():  # the file is the split asked for
                dataset = datasets.load_dataset(builder, data_files={cfg.hf_split: str(path)}, split=cfg.hf_split,
                                                streaming=cfg.streaming)
            else:
                dataset = datasets.load_dataset(str(cfg.path), cfg.hf_config, split=cfg.hf_split,
                                                streaming=cfg.streaming)
    except ValueError as e:
        if str(e).startswith(where):
            raise
        raise ValueError(f"{where} (source: hf): {e}") from None
    except Exception as e:  # datasets raises many kinds: no network, not on the hub, no such config or split
        failed = next((m for m in logged if re.search(r"file '[^']+'", m)), None)
        if failed is not None:  # e.g. "Failed to read file '...' with error ArrowInvalid: ..."
            raise ValueError(f"{where} (source: hf): {failed}"[:500]) from None
        hint = "" if local else ("; a hub name needs the network or the dataset in the local Hugging Face cache "
                                 "(HF_DATASETS_OFFLINE=1 reads the cache only)")
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise ValueError(f"{where} (source: hf): the dataset cannot be loaded ({type(e).__name__}: {first}){hint}"
                         ) from None
    columns = dataset.column_names
    if columns is not None:
        if field not in columns:
            raise _missing(f"{where} (split {cfg.hf_split!r})", field, setting, columns)
        dataset = dataset if whole else dataset.select_columns([field])
    return dataset
