"""Examples read from files (spec.training.data): TFRecord, Parquet or CSV, streamed by each
worker in the same batches as the built-in models' (a dict of NumPy arrays and the labels).

- Sharding: the files matching the glob, sorted, go to workers by position (file i to worker
  i mod N); with fewer files than workers every worker reads them all and keeps every Nth record.
- Reading: TFRecord through tf.data's TFRecordDataset and tf.io.parse_example, CSV through
  tf.io.decode_csv with the columns its header names, Parquet through pyarrow a row group at a
  time; a chunk of records is decoded at once, and one by one only when the chunk holds a bad
  record, to find it.
- Order: each epoch the worker's files in an order drawn from (seed, worker, epoch), the
  records through a shuffle buffer of `shuffleBuffer` examples; `epochs` passes, or endless.
- Fetch-ahead: a thread reads, shuffles and batches ahead of the training loop, a few batches
  deep, so a step waits for input only when the files are slower than the training.
- A bad record (a corrupt TFRecord, a line or row that does not parse, a null): with
  onBadRecord skip it is dropped and counted, with fail the worker stops naming the file. A
  corrupt TFRecord ends its file's reading (the format has no way to find the next record).
"""

from __future__ import annotations

import glob
import gzip
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from tfps.api.spec import BadRecordPolicy, DataFormat, DataSource, DataSpec

log = logging.getLogger("tfps.filedata")

CHUNK = 256  # records decoded at once
PREFETCH = 4  # batches read ahead of the training loop
_END = object()


class BadRecord(ValueError):
    """A record that cannot be read or parsed, with onBadRecord fail; the message names the file."""


def list_files(pattern: str, field: str = "training.data.train.files") -> list[str]:
    files = sorted(glob.glob(pattern))
    if not files:
        raise FileNotFoundError(f"{field}: no file matches {pattern!r}")
    return files


def shard_files(files: list[str], worker: int, num_workers: int) -> tuple[list[str], int]:
    """This worker's files and the record stride: file i to worker i mod N, or with fewer files
    than workers every file and every Nth record (stride N, offset `worker`)."""
    if len(files) >= num_workers:
        return files[worker::num_workers], 1
    return list(files), num_workers


def feature_spec(data: DataSpec, inputs: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, tuple[str, tuple]]:
    """Per feature (the label too) its dtype and per-example shape: training.data.features, or
    else the model's inputs. The label is read as int64 unless the features name it."""
    if data.features:
        spec = {name: (f.dtype, tuple(f.shape)) for name, f in data.features.items()}
    elif inputs:
        spec = dict(inputs)
    else:
        raise ValueError("training.data.features: the model declares no inputs, so the features must be listed")
    for name, (dtype, shape) in spec.items():
        if any(d is None for d in shape):
            raise ValueError(
                f"feature {name!r}: shape {shape} has an unknown dimension; give it in training.data.features"
            )
        if dtype not in ("float32", "float64", "int32", "int64", "string"):
            raise ValueError(f"feature {name!r}: dtype {dtype} cannot be read from files")
    spec.setdefault(data.label, ("int64", ()))
    return spec


# ---- readers: each yields (file, chunk of decoded columns, bad records in it) ----


@dataclass
class _Reader:
    source: DataSource
    spec: dict[str, tuple[str, tuple]]
    label: str
    on_bad: Callable[[str, int, str], None]  # (file, count, why): counts, or raises BadRecord

    def __post_init__(self) -> None:
        """A format's own setup."""

    def check(self, path: str) -> None:
        """Refuse a file that lacks a feature or holds it in another type, naming it."""

    def chunks(self, path: str) -> Iterator[dict[str, np.ndarray]]:
        raise NotImplementedError


def _numpy(tensor: tf.Tensor) -> np.ndarray:
    array = tensor.numpy()
    return array.astype(object) if array.dtype.kind == "S" else array


class _TFRecord(_Reader):
    def __post_init__(self):
        self.parse_spec = {
            name: tf.io.FixedLenFeature(shape, tf.string if dtype == "string" else _parse_dtype(dtype))
            for name, (dtype, shape) in self.spec.items()
        }

    def check(self, path: str) -> None:
        for record in tf.data.TFRecordDataset(path, self.source.compression or "").take(1):
            example = tf.train.Example.FromString(record.numpy())
            for name, (dtype, _) in self.spec.items():
                if name not in example.features.feature:
                    raise ValueError(f"{path}: feature {name!r} is not in the records")
                kind = example.features.feature[name].WhichOneof("kind")
                wanted = "bytes_list" if dtype == "string" else "int64_list" if "int" in dtype else "float_list"
                if kind != wanted:
                    raise ValueError(
                        f"feature {name!r}: the records of {path} hold a {kind}, read as {dtype} it needs {wanted}"
                    )

    def _parse(self, path: str, records: list[bytes]) -> dict[str, np.ndarray] | None:
        try:
            parsed = tf.io.parse_example(tf.constant(records, tf.string), self.parse_spec)
        except tf.errors.InvalidArgumentError:
            good = [r for r in records if self._parses(r)]
            self.on_bad(path, len(records) - len(good), "a record that does not parse as the features")
            if not good:
                return None
            parsed = tf.io.parse_example(tf.constant(good, tf.string), self.parse_spec)
        return {k: _cast(_numpy(v), self.spec[k][0]) for k, v in parsed.items()}

    def _parses(self, record: bytes) -> bool:
        try:
            tf.io.parse_single_example(record, self.parse_spec)
            return True
        except tf.errors.InvalidArgumentError:
            return False

    def chunks(self, path: str) -> Iterator[dict[str, np.ndarray]]:
        records: list[bytes] = []
        it = iter(tf.data.TFRecordDataset(path, self.source.compression or "").as_numpy_iterator())
        while True:
            try:
                record = next(it)
            except StopIteration:
                break
            except tf.errors.DataLossError as err:  # a corrupt record: the rest of the file cannot be framed
                self.on_bad(path, 1, f"corrupt record ({err.message.splitlines()[0]})")
                break
            records.append(record)
            if len(records) == CHUNK:
                chunk = self._parse(path, records)
                records = []
                if chunk is not None:
                    yield chunk
        if records:
            chunk = self._parse(path, records)
            if chunk is not None:
                yield chunk


def _parse_dtype(dtype: str):
    return tf.int64 if "int" in dtype else tf.float32


def _cast(array: np.ndarray, dtype: str) -> np.ndarray:
    return array if dtype == "string" else np.ascontiguousarray(array, dtype)


class _CSV(_Reader):
    def _open(self, path: str):
        return gzip.open(path, "rt") if self.source.compression == "gzip" else open(path)  # noqa: SIM115

    def _header(self, path: str) -> list[str]:
        with self._open(path) as fh:
            return fh.readline().rstrip("\r\n").split(",")

    def check(self, path: str) -> None:
        header = self._header(path)
        for name, (_, shape) in self.spec.items():
            if name not in header:
                raise ValueError(f"{path}: feature {name!r} is not a column of its header ({', '.join(header)})")
            if int(np.prod(shape)) != 1:
                raise ValueError(f"feature {name!r}: a CSV column holds one value per example, not shape {shape}")

    def _decode(self, path: str, columns: list[str], lines: list[str]) -> dict[str, np.ndarray] | None:
        names = list(self.spec)
        cols = [columns.index(n) for n in names]
        order = sorted(range(len(names)), key=lambda i: cols[i])
        defaults = [
            tf.constant([], tf.string if self.spec[names[i]][0] == "string" else _parse_dtype(self.spec[names[i]][0]))
            for i in order
        ]

        def decode(batch: list[str]):
            values = tf.io.decode_csv(batch, defaults, select_cols=sorted(cols))
            return {names[i]: _numpy(v) for i, v in zip(order, values, strict=True)}

        try:
            out = decode(lines)
        except tf.errors.InvalidArgumentError:
            good = [line for line in lines if _try(decode, [line])]
            self.on_bad(path, len(lines) - len(good), "a line that does not parse as the features")
            if not good:
                return None
            out = decode(good)
        return {k: _cast(v, self.spec[k][0]).reshape(len(v), *self.spec[k][1]) for k, v in out.items()}

    def chunks(self, path: str) -> Iterator[dict[str, np.ndarray]]:
        try:
            with self._open(path) as fh:
                columns = fh.readline().rstrip("\r\n").split(",")
                lines: list[str] = []
                for line in fh:
                    line = line.rstrip("\r\n")
                    if not line:
                        continue
                    lines.append(line)
                    if len(lines) == CHUNK:
                        chunk = self._decode(path, columns, lines)
                        lines = []
                        if chunk is not None:
                            yield chunk
                if lines:
                    chunk = self._decode(path, columns, lines)
                    if chunk is not None:
                        yield chunk
        except (OSError, EOFError, UnicodeDecodeError) as err:  # a corrupt gzip stream, a binary file
            self.on_bad(path, 1, f"unreadable ({err})")


def _try(fn, *args) -> bool:
    try:
        fn(*args)
        return True
    except tf.errors.InvalidArgumentError:
        return False


class _Parquet(_Reader):
    def check(self, path: str) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pq.read_schema(path)
        for name, (dtype, _) in self.spec.items():
            if name not in schema.names:
                raise ValueError(f"{path}: feature {name!r} is not a column ({', '.join(schema.names)})")
            kind = schema.field(name).type
            while pa.types.is_list(kind) or pa.types.is_fixed_size_list(kind) or pa.types.is_large_list(kind):
                kind = kind.value_type
            text = pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
            if text != (dtype == "string"):
                raise ValueError(f"feature {name!r}: column of {path} is {kind}, not readable as {dtype}")

    def chunks(self, path: str) -> Iterator[dict[str, np.ndarray]]:
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(path)
        except Exception as err:  # noqa: BLE001 - pyarrow raises several kinds for a corrupt file
            self.on_bad(path, 1, f"unreadable ({err})")
            return
        for group in range(parquet.num_row_groups):
            try:
                table = parquet.read_row_group(group, columns=list(self.spec))
            except Exception as err:  # noqa: BLE001
                self.on_bad(path, parquet.metadata.row_group(group).num_rows, f"row group {group} unreadable ({err})")
                continue
            chunk = self._columns(path, table)
            if chunk is not None:
                yield chunk

    def _columns(self, path: str, table) -> dict[str, np.ndarray] | None:
        valid = np.ones(table.num_rows, bool)
        for name in self.spec:
            column = table.column(name)
            if column.null_count:
                valid &= ~np.asarray(column.is_null().to_numpy(zero_copy_only=False), bool)
        if not valid.all():
            self.on_bad(path, int((~valid).sum()), "a row with a null feature")
        if not valid.any():
            return None
        out = {}
        for name, (dtype, shape) in self.spec.items():
            values = table.column(name).to_pylist() if shape or dtype == "string" else table.column(name).to_numpy()
            values = np.asarray(values, object if dtype == "string" else None)[valid]
            out[name] = _cast(values, dtype).reshape(len(values), *shape)
        return out


_READERS = {DataFormat.TFRECORD: _TFRecord, DataFormat.CSV: _CSV, DataFormat.PARQUET: _Parquet}


# ---- batches ----


class _Shuffle:
    """A buffer of up to `size` examples (columns); batches are drawn from it at random."""

    def __init__(self, size: int, rng: np.random.Generator):
        self.size, self.rng = size, rng
        self.columns: dict[str, np.ndarray] | None = None

    def __len__(self) -> int:
        return 0 if self.columns is None else len(next(iter(self.columns.values())))

    def add(self, chunk: dict[str, np.ndarray]) -> None:
        self.columns = (
            chunk if self.columns is None else {k: np.concatenate([v, chunk[k]]) for k, v in self.columns.items()}
        )

    def take(self, n: int, shuffled: bool) -> dict[str, np.ndarray]:
        assert self.columns is not None
        total = len(self)
        idx = self.rng.choice(total, n, replace=False) if shuffled else np.arange(n)
        keep = np.ones(total, bool)
        keep[idx] = False
        out = {k: v[idx] for k, v in self.columns.items()}
        self.columns = {k: v[keep] for k, v in self.columns.items()}
        return out


class FileBatches:
    """One worker's batches of a source: `batches(step)` as BatchSource gives them (the same step
    gives the same batch; a new step the next batch of the stream), `has(step)` False once
    `epochs` passes are used up. Also iterable, for an evaluation pass."""

    def __init__(
        self,
        data: DataSpec,
        source: DataSource,
        spec: dict[str, tuple[str, tuple]],
        batch: int,
        seed: int,
        worker: int = 0,
        num_workers: int = 1,
        epochs: int | None = None,
        shuffle: int | None = None,
        on_bad_record: Callable[[int], None] | None = None,
        on_wait: Callable[[float], None] | None = None,
        field: str = "training.data.train.files",
    ):
        self.batch, self.seed, self.worker, self.num_workers = batch, seed, worker, num_workers
        self.epochs, self.label = epochs, data.label
        self.shuffle = data.shuffle_buffer if shuffle is None else shuffle
        self.policy = data.on_bad_record
        self.on_bad_record, self.on_wait = on_bad_record, on_wait
        self.bad_records = 0
        files = list_files(source.files, field)
        self.files, self.stride = shard_files(files, worker, num_workers)
        self.reader = _READERS[source.format](source, spec, data.label, self._bad)
        self.reader.check(files[0])  # a missing or mistyped feature is refused before training starts
        self._queue: queue.Queue = queue.Queue(PREFETCH)
        self._memo: dict[int, tuple] = {}
        self.first: tuple | None = None  # the first batch (its features are an export's example)
        self._ended = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _bad(self, path: str, count: int, why: str) -> None:
        if self.policy is BadRecordPolicy.FAIL:
            raise BadRecord(f"{path}: {why} (training.data.onBadRecord: fail)")
        self.bad_records += count
        if self.on_bad_record:
            self.on_bad_record(count)
        log.warning("skipped %d bad record(s) in %s: %s", count, path, why)

    # ---- the reading thread ----
    def _examples(self) -> Iterator[dict[str, np.ndarray]]:
        """This worker's examples, chunk by chunk, pass after pass."""
        epoch = 0
        while self.epochs is None or epoch < self.epochs:
            order = np.random.default_rng([self.seed, self.worker, epoch]).permutation(len(self.files))
            if self.shuffle == 0:
                order = np.arange(len(self.files))
            position = 0  # of the record in this pass, for the stride
            for i in order:
                for chunk in self.reader.chunks(self.files[i]):
                    n = len(chunk[self.label])
                    if self.stride > 1:
                        keep = (np.arange(position, position + n) % self.stride) == self.worker
                        position += n
                        chunk = {k: v[keep] for k, v in chunk.items()}
                    if len(chunk[self.label]):
                        yield chunk
            epoch += 1

    def _produce(self) -> None:
        try:
            buffer = _Shuffle(max(self.shuffle, self.batch), np.random.default_rng([self.seed, self.worker, 1 << 20]))
            for chunk in self._examples():
                buffer.add(chunk)
                while len(buffer) >= buffer.size:
                    if not self._put(self._split(buffer.take(self.batch, self.shuffle > 0))):
                        return
            while len(buffer):
                if not self._put(self._split(buffer.take(min(self.batch, len(buffer)), self.shuffle > 0))):
                    return
            self._put(_END)
        except BaseException as err:  # noqa: BLE001 - handed to the training loop, which raises it
            self._put(err)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def _split(self, columns: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], np.ndarray]:
        y = columns.pop(self.label)
        return columns, y

    def _next(self):
        if self._thread is None:
            self._thread = threading.Thread(target=self._produce, name="tfps-input", daemon=True)
            self._thread.start()
        if self._ended:
            return _END
        started = time.perf_counter()
        item = self._queue.get()
        if self.on_wait:
            self.on_wait(time.perf_counter() - started)
        if item is _END:
            self._ended = True
        elif isinstance(item, BaseException):
            self._ended = True
            raise item
        return item

    # ---- BatchSource's interface ----
    def has(self, step: int) -> bool:
        if step not in self._memo:
            item = self._next()
            if item is _END:
                return False
            self._memo = {k: v for k, v in self._memo.items() if k > step - 8}
            self._memo[step] = item
            if self.first is None:
                self.first = item
        return True

    def __call__(self, step: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        if not self.has(step):
            raise StopIteration(f"no data for step {step}: training.data.epochs used up")
        return self._memo[step]

    def __iter__(self):
        while True:
            item = self._next()
            if item is _END:
                return
            yield item

    def close(self) -> None:
        self._stop.set()


def train_batches(data: DataSpec, inputs: dict, batch: int, seed: int, worker: int, num_workers: int, metrics=None):
    spec = feature_spec(data, inputs)
    return FileBatches(
        data,
        data.train,
        spec,
        batch,
        seed,
        worker,
        num_workers,
        epochs=data.epochs,
        on_bad_record=metrics.bad_records.inc if metrics else None,
        on_wait=metrics.input_wait_seconds.observe if metrics else None,
    )


def eval_batches(data: DataSpec, inputs: dict, batch: int = 4096, metrics=None) -> FileBatches | None:
    """The evaluation files, whole, in order, once (worker 0 at the end); None without them."""
    if data.eval is None:
        return None
    return FileBatches(
        data,
        data.eval,
        feature_spec(data, inputs),
        batch,
        0,
        epochs=1,
        shuffle=0,
        on_bad_record=metrics.bad_records.inc if metrics else None,
        field="training.data.eval.files",
    )
