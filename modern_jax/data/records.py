"""Records with named fields: JSON Lines, Parquet and Hugging Face `datasets`.

Each source yields one document per record: the value of one field (`data.text_field` for
text, `data.messages_field` for conversations), and only that field is used (Parquet and
`datasets` read only that column); with `whole`, the whole record (a dict that has the field:
a prompt with the columns its rewards read). Records come in a fixed order (files sorted by path, then
line or row order), each named by its file and line or row, so the split by name is
deterministic. A record without the field is an error naming the file, the line and the
fields it has.

- `jsonl`: a `.jsonl` / `.jsonl.gz` file, or a directory of them; one JSON object per line.
- `parquet`: a `.parquet` file, or a directory of them (pyarrow).
- `hf`: Hugging Face `datasets`: a directory written by `save_to_disk` (a `DatasetDict`'s
  `data.hf_split`), a local data file (read by the `datasets` builder of its extension,
  `HF_BUILDERS`) or a directory of them, or a hub name (`org/name`, when the network or the
  local cache has it; `data.hf_config`, `data.hf_split`), streamed with `data.streaming`.
  A local path is never looked up on the hub.

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
from collections.abc import Iterator

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
        if not chat and not isinstance(value, str):
            raise ValueError(f"{where}: field {field!r} (data.{setting}) holds {type(value).__name__} "
                             f"{str(value)[:60]!r}, not text: point data.{setting} at a text field"
                             + ("; for conversations set data.format: chat" if isinstance(value, list) else ""))
        yield name, value
        n += 1
        if cfg.max_documents is not None and n >= cfg.max_documents:
            break
    if not n:
        raise ValueError(f"data.path={str(cfg.path)!r} holds no records")


def _missing(where: str, field: str, setting: str, fields) -> ValueError:
    fields = list(fields)
    return ValueError(f"{where}: no field {field!r} (data.{setting}); the fields are "
                      f"{', '.join(map(repr, fields)) or 'none'}: set data.{setting} to the one to read")


def _files(cfg: DataConfig, source: str) -> list[tuple[pathlib.Path, str]]:
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
    for file, name in _files(cfg, "jsonl"):
        opener = gzip.open if file.name.endswith(".gz") else open
        try:
            with opener(file, "rt", encoding="utf-8") as lines:
                for n, line in enumerate(lines, 1):
                    if not line.strip():
                        continue
                    where = f"{file}, line {n}"
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno}): each line of a "
                                         ".jsonl file is one JSON object") from None
                    if not isinstance(record, dict):
                        raise ValueError(f"{where}: expected a JSON object {{...}}, got {type(record).__name__}")
                    if field not in record:
                        raise _missing(where, field, setting, record)
                    yield f"{name}, line {n}", where, record if whole else record[field]
        except UnicodeDecodeError as e:
            raise ValueError(f"{file}: not UTF-8 text (byte {e.start}): is it a JSON Lines file?") from None
        except (OSError, EOFError) as e:  # gzip: a damaged or truncated file
            raise ValueError(f"{file}: cannot be read ({type(e).__name__}: {e})") from None


def _parquet(cfg: DataConfig, field: str, setting: str, whole: bool = False) -> Iterator[Record]:
    import pyarrow.parquet as pq

    for file, name in _files(cfg, "parquet"):
        try:
            names = pq.read_schema(file).names
            column = None if field not in names else pq.read_table(file).to_pylist() if whole else \
                pq.read_table(file, columns=[field]).column(field).to_pylist()
        except PermissionError as e:
            raise ValueError(f"{file} cannot be read ({e.strerror or e}): check its permissions") from None
        except Exception as e:  # pyarrow raises ArrowInvalid (a ValueError) and others on a damaged file
            raise ValueError(f"{file}: not a readable Parquet file ({type(e).__name__}: {e})") from None
        if column is None:
            raise _missing(str(file), field, setting, names)
        for row, value in enumerate(column):
            yield f"{name}, row {row}", f"{file}, row {row}", value


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
    for row, record in enumerate(dataset):
        if field not in record:
            raise _missing(f"{where}, row {row}", field, setting, record)
        yield f"{cfg.hf_split}, row {row}", f"{where}, row {row}", dict(record) if whole else record[field]
