"""Offline batch inference on Ray Data, with the same exactness as ``LLM.generate``.

A dataset is split into blocks; each worker (a Ray actor) loads one ``batchspec.LLM`` and decodes the blocks it is
handed; results stream to storage; Ray restarts a worker that dies and hands its unfinished blocks to a worker again.
Every block is decoded by ``LLM.generate``, whose greedy output is token-for-token that of batch-size-1 decoding, so
the output does not depend on the number of workers, the block size or which worker decoded which row.

- ``LLMPredictor``: the callable class for ``Dataset.map_batches``. It maps a batch with a ``prompt`` column (text
  or a list of token ids; Spec-Bench's ``turns`` is accepted too, ``turns[0]`` being the prompt) and optional
  per-row sampling columns (``max_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop_token_ids``,
  ``ignore_eos``; a missing or null value takes the default) to the same batch plus the columns ``token_ids``,
  ``text`` (None without a tokenizer), ``finish_reason``, ``num_accepted`` and ``num_drafted``.
- ``generate_dataset``: ``map_batches`` over a pool of ``workers`` actors with that class.
- ``prepare``: a dataset cut in order into blocks of a chosen size, with a row-order ``id`` added when there is none.
- ``run``: the whole pipeline: read JSONL / Parquet (or take rows or a ``Dataset``), ``prepare``, generate, write
  JSONL / Parquet files into a folder; ``read_results`` reads them back in id order.

Ray is an optional dependency (``pip install "batchspec[ray]"``): this module imports it only when used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import re
import time
from pathlib import Path

from ..config import EngineConfig
from ..params import SamplingParams

INSTALL = 'pip install "batchspec[ray]"'
SAMPLING_COLUMNS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "ignore_eos")
OUTPUT_COLUMNS = ("token_ids", "text", "finish_reason", "num_accepted", "num_drafted")
FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
MAX_BLOCK = 256  # the largest automatic block size (rows handed to a worker per call)

# Writes take no CPU slot: on a node whose slots all go to workers they would otherwise wait for the workers, which
# wait for them (a deadlock); they are light next to decoding, and Ray Data backpressures them on memory. (Reads run
# before the workers start: ``prepare`` materialises the input.)
IO_REMOTE_ARGS = {"num_cpus": 0}


class RayNotInstalled(ImportError):
    """Ray (the ``ray`` extra) is needed and not installed."""


def require_ray():
    """The ``ray`` module with Ray Data, or ``RayNotInstalled`` saying how to install it."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise RayNotInstalled(f"Ray is not installed; install the extra with: {INSTALL}") from None
    return ray


# --------------------------------------------------------------------------------------------------- the mapper


def _is_factory(spec) -> bool:
    """A callable that builds a model or tokenizer in the worker (not a model, tokenizer or drafter itself)."""
    if spec is None or isinstance(spec, (str, os.PathLike)) or not callable(spec) or hasattr(spec, "propose"):
        return False
    import torch
    from transformers import PreTrainedTokenizerBase

    return not isinstance(spec, (torch.nn.Module, PreTrainedTokenizerBase))


def _build(spec):
    return spec() if _is_factory(spec) else spec


class LLMPredictor:
    """Loads one ``batchspec.LLM`` per worker and generates for a batch of rows (a pyarrow Table, a pandas DataFrame
    or a dict of numpy arrays; the result has the same kind, with every input column kept).

    The ``LLM`` is built from ``config`` (an ``EngineConfig``) or, without one, from ``LLM``'s arguments given here
    (``target``, ``draft``, ``tokenizer`` and any other of its keyword arguments in ``engine``). ``target``,
    ``draft`` and ``tokenizer`` are what ``batchspec.LLM`` takes (paths and built-in names are loaded in the worker),
    or factories: callables with no arguments, called in the worker, that return one (a module-level function or a
    ``functools.partial`` pickles by reference, so the worker must be able to import its module). ``dtype`` may be a
    name (``"float32"``). ``sampling``: the defaults (``SamplingParams`` or a dict of its fields) for rows without
    sampling columns. ``chat_template``: pass text prompts through the tokenizer's chat template. ``threads``:
    torch's CPU threads in this worker (None: leave torch's default)."""

    def __init__(self, target=None, draft=None, tokenizer=None, *, config: EngineConfig | None = None,
                 chat_template: bool = False, sampling=None, threads: int | None = None, **engine):
        import torch

        import batchspec

        if config is None:
            config = EngineConfig(target, draft, tokenizer, **engine)
        elif target is not None or draft is not None or tokenizer is not None or engine:
            raise ValueError("give an EngineConfig or LLM's arguments, not both")
        if threads is not None:
            torch.set_num_threads(int(threads))
        dtype = config.dtype
        if isinstance(dtype, str):
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise ValueError(f"unknown dtype {dtype!r}")
            dtype = getattr(torch, dtype)
        self.defaults = _defaults(sampling)
        self.chat_template = chat_template
        self.llm = batchspec.LLM.from_config(dataclasses.replace(
            config, target=_build(config.target), draft=_build(config.draft), tokenizer=_build(config.tokenizer),
            dtype=dtype))

    def __call__(self, batch):
        cols = _Columns(batch)
        prompts = cols.get("prompt")
        if prompts is None:
            turns = cols.get("turns")
            if turns is None:
                raise ValueError(f"the batch has no 'prompt' column (columns: {', '.join(cols.names)})")
            prompts = [None if t is None or len(t) == 0 else t[0] for t in turns]
        ids = cols.get("id") or list(range(cols.n))
        params = [self._params(cols, i, ids[i]) for i in range(cols.n)]
        tok = self.llm.tokenizer
        if tok is not None:
            from ..prompts import encode

            prompts = [encode(tok, [p], self.chat_template)[0] if isinstance(p, str) else p for p in prompts]
        try:
            outs = self.llm.generate(prompts, params) if cols.n else []
        except ValueError as e:  # name the row by its id, not by its place in this block
            raise ValueError(_with_row_id(str(e), ids)) from e
        return cols.extend({
            "token_ids": [list(o.token_ids) for o in outs],
            "text": [o.text for o in outs],
            "finish_reason": [o.finish_reason for o in outs],
            "num_accepted": [o.num_accepted for o in outs],
            "num_drafted": [o.num_drafted for o in outs],
        })

    def _params(self, cols: _Columns, i: int, row_id) -> SamplingParams:
        given = {}
        for name in SAMPLING_COLUMNS:
            values = cols.get(name)
            if values is not None:
                v = _plain(values[i], name)
                if v is not None:
                    given[name] = v
        if not given:
            return self.defaults
        try:
            return SamplingParams(**{**_fields(self.defaults), **given})
        except ValueError as e:
            raise ValueError(f"row {row_id}: {e}") from None


def _defaults(sampling) -> SamplingParams:
    if sampling is None:
        return SamplingParams()
    if isinstance(sampling, SamplingParams):
        return sampling
    return SamplingParams(**dict(sampling))


def _fields(sp: SamplingParams) -> dict:
    return {name: getattr(sp, name) for name in SAMPLING_COLUMNS}


def _plain(value, name):
    """A cell as a plain Python value for ``SamplingParams`` (None: take the default). Null and NaN are missing;
    a whole float in an integer column (pandas turns integer columns with nulls into floats) becomes an int."""
    if value is None:
        return None
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()  # numpy scalars and arrays
    if isinstance(value, float) and math.isnan(value):
        return None
    if name in ("max_tokens", "top_k", "seed") and isinstance(value, float) and value.is_integer():
        return int(value)
    if name == "stop_token_ids" and isinstance(value, tuple):
        return list(value)
    return value


def _with_row_id(message: str, ids) -> str:
    """``prompt 3 ...`` from ``LLM.generate`` (3: the place in the block) as ``row <id> ...``."""
    m = re.match(r"prompt (\d+)\b", message)
    if m and int(m.group(1)) < len(ids):
        return f"row {ids[int(m.group(1))]}{message[m.end():]}"
    return message


class _Columns:
    """Read columns of a batch in any of Ray Data's batch formats as Python lists; add columns in the same format."""

    def __init__(self, batch):
        self.batch = batch
        self.kind = "arrow" if hasattr(batch, "column_names") else "pandas" if hasattr(batch, "iloc") else "dict"
        self.names = list(batch.column_names if self.kind == "arrow" else batch.keys() if self.kind == "dict"
                          else batch.columns)
        self.n = batch.num_rows if self.kind == "arrow" else len(batch) if self.kind == "pandas" else (
            len(next(iter(batch.values()))) if batch else 0)

    def get(self, name):
        if name not in self.names:
            return None
        if self.kind == "arrow":
            return self.batch.column(name).to_pylist()
        return self.batch[name].tolist() if self.kind == "pandas" else list(self.batch[name])

    def extend(self, new: dict):
        if self.kind == "arrow":
            import pyarrow as pa

            types = {"token_ids": pa.list_(pa.int64()), "text": pa.string(), "finish_reason": pa.string(),
                     "num_accepted": pa.int64(), "num_drafted": pa.int64()}
            table = self.batch.drop_columns([c for c in new if c in self.names])
            for name, values in new.items():
                table = table.append_column(name, pa.array(values, types[name]))
            return table
        if self.kind == "pandas":
            out = self.batch.copy()
            for name, values in new.items():
                out[name] = values
            return out
        import numpy as np

        out = dict(self.batch)
        for name, values in new.items():
            if name == "token_ids":
                arr = np.empty(len(values), dtype=object)
                arr[:] = [np.asarray(v, dtype=np.int64) for v in values]
            elif name in ("num_accepted", "num_drafted"):
                arr = np.asarray(values, dtype=np.int64)
            else:
                arr = np.asarray(values, dtype=object)
            out[name] = arr
        return out


# --------------------------------------------------------------------------------------------------- the pipeline


def generate_dataset(ds, *, workers: int = 1, block_size: int = 64, cpus_per_worker: float = 1,
                     gpus_per_worker: float = 0, max_restarts: int = -1, max_task_retries: int = -1,
                     ray_remote_args: dict | None = None, predictor=LLMPredictor, **llm_kwargs):
    """``ds`` mapped by ``predictor`` (``LLMPredictor``) on a pool of ``workers`` Ray actors; lazy, like any
    ``Dataset``. ``block_size``: rows handed to a worker per call (each call decodes them ``batch_size`` at a time).
    Ray hands a worker whole blocks, so a dataset of fewer blocks than workers leaves workers idle: cut it with
    ``prepare`` first (which also materialises it: a lazy read that needs CPU slots could otherwise wait behind
    workers holding all of a node's slots).
    Each worker takes ``cpus_per_worker`` CPU slots and ``gpus_per_worker`` GPUs; torch uses
    ``int(cpus_per_worker)`` threads in it unless ``threads`` is given. A worker that dies is restarted up to
    ``max_restarts`` times and a call it did not finish retried up to ``max_task_retries`` times (-1: without limit).
    ``ray_remote_args`` go to the actors as they are; ``llm_kwargs`` to ``predictor``."""
    ray = require_ray()
    for name, value in (("workers", workers), ("block_size", block_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if gpus_per_worker == 0:
        llm_kwargs.setdefault("threads", max(1, int(cpus_per_worker)))
    # Ray Data's actor pools already restart and retry without limit (-1); only other values are passed on
    remote = {k: v for k, v in (("max_restarts", max_restarts), ("max_task_retries", max_task_retries)) if v != -1}
    remote.update(ray_remote_args or {})
    if gpus_per_worker:
        remote["num_gpus"] = gpus_per_worker
    return ds.map_batches(
        predictor, fn_constructor_kwargs=llm_kwargs, batch_size=block_size, batch_format="pyarrow",
        # one block at a time per worker: a worker that starts first would otherwise queue blocks that an idle one
        # could take (with 2 blocks and 2 workers, one worker sometimes decoded both)
        compute=ray.data.ActorPoolStrategy(size=workers, max_tasks_in_flight_per_actor=1),
        num_cpus=cpus_per_worker, **remote,
    )


def file_format(path, given: str | None = None) -> str:
    """``jsonl`` or ``parquet``: ``given``, else from the file's suffix (for a folder, from its files')."""
    if given is not None:
        if given not in ("jsonl", "parquet"):
            raise ValueError(f"format must be jsonl or parquet, got {given!r}")
        return given
    p = Path(path)
    suffixes = [p.suffix.lower()] if not p.is_dir() else sorted({f.suffix.lower() for f in p.iterdir() if f.is_file()})
    found = {FORMATS[s] for s in suffixes if s in FORMATS}
    if len(found) != 1:
        raise ValueError(f"cannot tell the format of {path} (.jsonl or .parquet files expected); give it explicitly")
    return found.pop()


def read(source, format: str | None = None):
    """A ``Dataset`` of prompt rows from a JSONL or Parquet file or folder, a list of paths, a list of dicts, or a
    ``Dataset`` (returned as it is)."""
    ray = require_ray()
    if hasattr(source, "map_batches"):
        return source
    if isinstance(source, (list, tuple)) and (not source or isinstance(source[0], dict)):
        if not source:
            raise ValueError("no prompt rows")
        return ray.data.from_items(list(source))
    paths = [os.fspath(p) for p in (source if isinstance(source, (list, tuple)) else [source])]
    for p in paths:
        if "://" not in p and not os.path.exists(p):
            raise FileNotFoundError(f"prompt file {p} does not exist")
    fmt = file_format(paths[0], format)
    return ray.data.read_parquet(paths) if fmt == "parquet" else ray.data.read_json(paths)


def check_prompt_file(path, sampling=None) -> int:
    """Check a local JSONL or Parquet prompt file (or a folder of them) here, before Ray starts, the way the workers
    will read it, and return its number of rows. JSONL: every line a JSON object whose prompt (``prompt``, else
    ``turns[0]``) is text or token ids, given the same way on every line (Ray reads a column of one type), and whose
    sampling columns make valid ``SamplingParams`` over the defaults ``sampling``. Parquet: a ``prompt`` or ``turns``
    column of text or token ids (the schema only; the rows are not read). A bad row is one ValueError naming its file
    and line, instead of a worker's error in Ray's log that names the row's place in a block."""
    p = Path(path)
    fmt = file_format(p)
    files = sorted(f for f in p.iterdir() if f.is_file() and FORMATS.get(f.suffix.lower()) == fmt) if p.is_dir() \
        else [p]
    defaults, first = _defaults(sampling), {}
    rows = sum(_check_parquet(f) if fmt == "parquet" else _check_jsonl(f, defaults, first) for f in files)
    if not rows:
        raise ValueError(f"no prompts in {path}")
    return rows


def _check_jsonl(path: Path, defaults: SamplingParams, first: dict) -> int:
    """Rows of one JSONL file, checked; ``first`` maps how a prompt was given to the first place it was seen."""
    from ..prompts import json_records, prompt_of, read_text

    rows = 0
    for where, rec in json_records(path, read_text(path)):
        prompt = prompt_of(rec, where, fields=("prompt", "turns"), token_ids=True)
        how = ('"prompt"' if "prompt" in rec else '"turns"[0]') + (" text" if isinstance(prompt, str) else
                                                                   " token ids")
        first.setdefault(how, where)
        if len(first) > 1:
            other = next(k for k in first if k != how)
            raise ValueError(f"{where}: the prompt is {how}, but {first[other]} gives {other}; with --ray every row "
                             "gives its prompt the same way")
        given = {k: v for k in SAMPLING_COLUMNS if (v := _plain(rec.get(k), k)) is not None}
        if given:
            try:
                SamplingParams(**{**_fields(defaults), **given})
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
        rows += 1
    return rows


def _check_parquet(path: Path) -> int:
    """Rows of one Parquet file, from its metadata, with its prompt column's type checked."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.read_metadata(path)
        schema = meta.schema.to_arrow_schema()
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path} is not a readable Parquet file ({e})") from None
    field = next((f for f in ("prompt", "turns") if f in schema.names), None)
    if field is None:
        raise ValueError(f'{path}: no "prompt" or "turns" column (columns: {", ".join(schema.names)})')
    kind = schema.field(field).type
    if field == "turns":
        kind = kind.value_type if _is_list(kind) else None
    text = kind is not None and (pa.types.is_string(kind) or pa.types.is_large_string(kind))
    if not (text or (kind is not None and _is_list(kind) and pa.types.is_integer(kind.value_type))):
        raise ValueError(f'{path}: column "{field}" has type {schema.field(field).type}; it must hold text or lists '
                         "of integer token ids" + (" (turns: lists of those)" if field == "turns" else ""))
    return meta.num_rows


def _is_list(kind) -> bool:
    import pyarrow as pa

    return pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)


def prepare(ds, *, block_size: int | None = None, workers: int = 1, id_column: str | None = "id",
            seed: int | None = None):
    """``(dataset, block size)``: ``ds`` cut, in order, into blocks of ``block_size`` rows (the last may be shorter;
    None: ``auto_block_size``), with ``id_column`` = the row's place (0, 1, ...) added when ``ds`` has no such column
    and ``seed`` = ``seed`` + the row's place when ``seed`` is given and ``ds`` has no ``seed`` column.

    Ray Data hands a worker whole blocks, so the blocks decide how many calls can run at once: a single Parquet file
    read as one block would otherwise keep all but one worker idle. The input is materialised (held in Ray's object
    store, which spills to disk when it is full); the outputs still stream to storage block by block."""
    ray = require_ray()
    ds = ds.materialize()
    columns = ds.columns() or []
    add_id = id_column is not None and id_column not in columns
    add_seed = seed is not None and "seed" not in columns
    # each block's row count is in its metadata: no data moves to this process
    blocks = [(ref, meta.num_rows) for bundle in ds.iter_internal_ref_bundles()
              for ref, meta in zip(bundle.block_refs, bundle.metadata) if meta.num_rows]
    rows = sum(n for _, n in blocks)
    if rows == 0:
        raise ValueError("no prompt rows to generate for")
    size = block_size if block_size is not None else auto_block_size(rows, workers)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {size!r}")
    assemble = ray.remote(_block_assembler())
    ends = list(itertools.accumulate(n for _, n in blocks))
    out = []
    for start in range(0, rows, size):
        stop = min(start + size, rows)
        parts, refs = [], []
        for (ref, n), end in zip(blocks, ends):
            lo, hi = max(start, end - n), min(stop, end)
            if lo < hi:  # rows lo..hi of the dataset lie in this input block, from its row lo - (end - n)
                parts.append((lo - (end - n), hi - lo))
                refs.append(ref)
        out.append(assemble.remote(start, id_column if add_id else None, seed if add_seed else None, parts, *refs))
    return ray.data.from_arrow_refs(out).materialize(), size


def _block_assembler():
    """The block task of ``prepare``, defined in a function so that Ray ships it by value: a worker running it
    imports pyarrow only, not batchspec (and torch)."""

    def assemble(start: int, id_column, seed, parts, *blocks):
        import pyarrow as pa

        tables = [(b if hasattr(b, "append_column") else pa.Table.from_pandas(b, preserve_index=False)).slice(o, n)
                  for b, (o, n) in zip(blocks, parts)]
        table = pa.concat_tables(tables, promote_options="permissive")
        rows = range(start, start + table.num_rows)
        if id_column is not None:
            table = table.append_column(id_column, pa.array(rows, pa.int64()))
        if seed is not None:
            table = table.append_column("seed", pa.array([seed + i for i in rows], pa.int64()))
        return table

    return assemble


def write(ds, out, format: str = "jsonl") -> None:
    """Write ``ds`` as JSONL or Parquet files into the folder ``out``."""
    fmt = file_format(out, format)
    if fmt == "parquet":
        ds.write_parquet(os.fspath(out), ray_remote_args=dict(IO_REMOTE_ARGS))
    else:
        ds.write_json(os.fspath(out), ray_remote_args=dict(IO_REMOTE_ARGS))


def read_results(out, format: str | None = None, sort_by: str | None = "id") -> list[dict]:
    """The rows written into ``out`` (read on this machine, without Ray), sorted by ``sort_by`` (None: in file-name
    order). Ray may write files out of input order unless ``preserve_order`` was set; the ``id`` restores it."""
    import pyarrow.parquet as pq

    out = Path(out)
    fmt = file_format(out, format)
    rows = []
    for f in sorted(p for p in out.iterdir() if p.is_file() and FORMATS.get(p.suffix.lower()) == fmt):
        if fmt == "parquet":
            rows.extend(pq.read_table(f).to_pylist())
        else:
            import json

            rows.extend(json.loads(line) for line in f.read_text(encoding="utf-8").splitlines() if line.strip())
    return sorted(rows, key=lambda r: r[sort_by]) if sort_by is not None else rows


@contextlib.contextmanager
def ordered(enabled: bool = True):
    """Within this block, Ray Data keeps blocks in input order (``DataContext.execution_options.preserve_order``)."""
    ray = require_ray()
    options = ray.data.DataContext.get_current().execution_options
    before = options.preserve_order
    options.preserve_order = enabled
    try:
        yield
    finally:
        options.preserve_order = before


def auto_block_size(rows: int, workers: int) -> int:
    """One block per worker, at most ``MAX_BLOCK`` rows: big blocks batch well, several blocks per worker balance."""
    return max(1, min(MAX_BLOCK, math.ceil(rows / workers)))


def run(source, out, *, input_format: str | None = None, output_format: str = "jsonl", workers: int = 1,
        block_size: int | None = None, id_column: str = "id", seed: int | None = None, preserve_order: bool = True,
        **kwargs) -> dict:
    """Read ``source`` (see ``read``), generate with ``workers`` Ray actors (``generate_dataset``'s options and
    ``LLMPredictor``'s in ``kwargs``), write ``output_format`` files into the folder ``out`` (new or empty).

    Rows keep their input columns; ``id_column`` is added from row order when absent. ``seed``: rows without a
    ``seed`` column get ``seed`` + their row number. ``block_size`` None: ``auto_block_size``. With
    ``preserve_order`` the files, read in name order, hold the rows in input order; either way ``read_results``
    sorts them by id. Returns a summary: rows, generated tokens, drafted and accepted tokens, seconds (from reading
    the input to the last file written), the folder and format."""
    require_ray()
    remote = "://" in os.fspath(out)
    fmt = file_format(out, output_format)
    if not remote:
        out = Path(out)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ValueError(f"{out} is not an empty folder; give a new or empty one")
    t0 = time.perf_counter()
    with ordered(preserve_order):
        ds, size = prepare(read(source, input_format), block_size=block_size, workers=workers, id_column=id_column,
                           seed=seed)
        rows = ds.count()
        write(generate_dataset(ds, workers=workers, block_size=size, **kwargs), out, fmt)
    summary = {"rows": rows, "seconds": time.perf_counter() - t0, "out": os.fspath(out), "format": fmt,
               "workers": workers, "block_size": size}
    if not remote:  # counted from the files written (None for remote storage)
        summary.update(_count(out, fmt))
    return summary


def _count(out: Path, fmt: str) -> dict:
    """Rows, generated, drafted and accepted tokens in the files of ``out`` (read with pyarrow, file by file)."""
    import pyarrow.compute as pc
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    totals = {"rows": 0, "tokens": 0, "drafted": 0, "accepted": 0}
    for f in sorted(p for p in out.iterdir() if p.is_file() and FORMATS.get(p.suffix.lower()) == fmt):
        columns = ["token_ids", "num_drafted", "num_accepted"]
        t = pq.read_table(f, columns=columns) if fmt == "parquet" else pj.read_json(f).select(columns)
        totals["rows"] += t.num_rows
        for key, column in (("tokens", pc.list_value_length(t["token_ids"])), ("drafted", t["num_drafted"]),
                            ("accepted", t["num_accepted"])):
            totals[key] += int(pc.sum(column).as_py() or 0)
    return totals
