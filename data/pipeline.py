"""The data pipeline the training loop calls (docs/design.md §T3).

    data = data_config(cfg.data)          # the typed data section (data/config.py), built once
    it = make_train_iterator(data, process_index, process_count, tokenizer=tok)
    batch = next(it)           # dict of numpy arrays, [batch_size, seq_len] (+ image arrays)
    state = it.get_state()     # JSON-able; grain.checkpoint.CheckpointSave(it) stores it
    it.set_state(state)        # the next batches are bit-identical to the uninterrupted run
    it.counters()              # skipped records by reason, padding, tokens per stream
    it.skip_locations()        # the first file:line of each skip reason (and of truncation)

Per stream (text, multimodal; a stream with no sources is left out, so text-only data needs no
multimodal source): a grain `MapDataset` over the stream's records, sliced to this
process (`[process_index::process_count]`, so processes read disjoint records whose union is
the whole), shuffled with a per-epoch seed and repeated (training), then mapped (record ->
segments -> document -> pieces) -- in grain worker processes when `data.worker_count > 0`.
In the main process, `TokenMixer` picks the stream of each piece by token share,
`BestFitPacker` packs the pieces, and `assemble_row` lays out rows. Packer bins hold references
`[stream, index, piece, start, stop]`; a restore re-reads those records from the `MapDataset`s by
index, so the state stays small (no token ids, no pixels) while resume stays exact. A state is
restored by an iterator built from the same config (same sources, seed, seq_len, pool_bins,
packer_cuts and worker_count: grain's worker state is per worker).

Token features (optional, `token_features=`): a picklable callable
`f(tokens_1xL, segment_ids_1xL, dead_1xL) -> {key: int32 [1, L, C]}` with attributes `name` (its
batch key) and `lookback` (a position's value depends on its own token and at most `lookback`
tokens before it in the same run of segment id, a dead token -- an image placeholder -- cutting
the run). The pipeline computes them for each piece where the pieces are made (in the grain
workers when `data.worker_count > 0`, so the main process does not), recomputes only the first
`lookback` positions of a piece the packer cut, and fills padding from one precomputed run; the
batch then carries `batch[f.name]`, equal to f computed over the whole rows. Knowing no model, the
pipeline takes f from the launcher (`launch.setup.EngramFeatures`: the Engram hash ids, with the
tokenizer's compression map built once).

Batch keys (numpy, leading dim `batch_size`): `tokens`, `targets`, `loss_mask`, `segment_ids`,
`positions`, `image_mask` [B, seq_len]; `images` uint8 [B, M, P, P, 3], `image_count` [B],
`image_cells` [B, M, 2], `image_starts` [B, M] with M = max images per row and P the largest
image side (`packing.py` defines each).
"""

from __future__ import annotations

import collections
import copy
import logging
import threading
from typing import Any

import grain
import numpy as np

from data import corpus, documents, images, packing
from data.config import DataConfig, images_per_row
from data.mixture import TokenMixer, normalized_weights
from data.records import RecordSkipped, parse_record
from data.sources import open_source
from data.tokenizer import TokenizerHandle, cached_bpe, load_tokenizer

STREAMS = ("text", "multimodal")
SKIP_LOCATIONS = 5  # distinct file:line locations kept per skip reason
TRUNCATED = "truncated_documents"  # the counter (and skip_locations key) of documents cut short

log = logging.getLogger("dsv41.data")


def _typed(data) -> DataConfig:
  if not isinstance(data, DataConfig):
    raise TypeError(f"the data pipeline takes a DataConfig (data.config.data_config(cfg.data)), "
                    f"not {type(data).__name__}")
  return data


def cache_dir(data: DataConfig) -> str:
  return data.cache_dir or corpus.default_cache_dir()


def max_images_per_row(data: DataConfig) -> int:
  return images_per_row(data.seq_len, data.max_images_per_row)


def default_manifest(data: DataConfig) -> dict:
  return corpus.build_manifest(data.heldout_percent, data.image_docs_train, data.image_docs_eval,
                               data.seed)


def _source_keys(split: str) -> tuple[str, str]:
  """The data keys of the text and multimodal sources of a split."""
  return (("text_sources", "multimodal_sources") if split == "train"
          else ("text_eval_sources", "multimodal_eval_sources"))


def uses_default_corpus(data: DataConfig, split: str) -> bool:
  """No source given for the split (for evaluation: none for training either)."""
  given = any(getattr(data, k) for k in _source_keys(split))
  if split == "eval" and not given:
    return not any(getattr(data, k) for k in _source_keys("train"))
  return not given


def make_tokenizer(data: DataConfig, vocab_size: int | None) -> TokenizerHandle:
  """The tokenizer of `data.tokenizer_path`, or the default-corpus BPE of `vocab_size` entries
  (`model.vocab_size`; needed only then).

  A tokenizer file that is missing or unreadable is a FileNotFoundError / ValueError naming
  `data.tokenizer_path`."""
  data = _typed(data)
  if data.tokenizer_path:
    try:
      return load_tokenizer(data.tokenizer_path)
    except (OSError, ValueError) as e:
      raise type(e)(f"data.tokenizer_path: {e}; point it at a Hugging Face tokenizer.json, or "
                     "set it to '' for the default-corpus BPE") from None
  if vocab_size is None:
    raise ValueError("data.tokenizer_path is '': the default-corpus BPE needs model.vocab_size")
  manifest = default_manifest(data)
  corpus.write_manifest(manifest, cache_dir(data))
  return cached_bpe(lambda: corpus.bpe_texts(manifest), int(vocab_size), manifest["hash"],
                    cache_dir(data))


def check_tokenizer(tok: TokenizerHandle, vocab_size: int | None) -> None:
  """The tokenizer fits the model's vocabulary (`model.vocab_size`, when given)."""
  if vocab_size is not None and tok.vocab_size > vocab_size:
    raise ValueError(f"tokenizer {tok.source} has {tok.vocab_size} tokens, more than "
                     f"model.vocab_size={vocab_size}")


class ToPieces:
  """(index, payload) -> ("doc", index, pieces, n_tokens, cut) or ("skip", index, reason, where).

  `where` is the payload's `file:line` (or `record <index>` for sources without one); `cut` is
  `where` for a document cut at `max_document_tokens`, else None. Runs wherever grain runs the
  map (a worker process or the main process); picklable.
  """

  def __init__(self, tok: TokenizerHandle, seq_len: int, max_images: int, max_image_size: int,
               max_record_bytes: int, max_image_pixels: int, features=None,
               max_document_tokens: int = 2**20):
    self.tok, self.seq_len, self.max_images = tok, seq_len, max_images
    self.max_image_size = max_image_size
    self.max_record_bytes, self.max_image_pixels = max_record_bytes, max_image_pixels
    self.features, self.max_document_tokens = features, max_document_tokens

  def __call__(self, index: int, payload):
    where = payload[3] if len(payload) > 3 else f"record {index}"
    try:
      doc = documents.build_document(parse_record(payload, self.max_record_bytes), self.tok,
                                     self.max_image_size, self.max_image_pixels,
                                     self.max_record_bytes, self.max_document_tokens)
    except RecordSkipped as e:
      return ("skip", index, e.reason, where)
    pieces = documents.pieces(doc, self.seq_len, self.max_images)
    if self.features is not None:
      for p in pieces:
        tokens = p.tokens[None]
        out = self.features(tokens, np.ones_like(tokens), tokens == self.tok.image_pad_id)
        p.features = {k: v[0] for k, v in out.items()}
    return ("doc", index, pieces, len(doc), where if doc.truncated else None)


def stream_dataset(source, stream: int, fn: ToPieces, seed: int, process_index: int,
                   process_count: int, train: bool) -> tuple[grain.MapDataset, int]:
  """The dataset of stream `stream` (an index of STREAMS) for this process, and its records per
  pass; `seed` is `data.seed`."""
  ds = grain.MapDataset.source(source)[process_index::process_count]
  epoch_len = len(ds)
  if len(ds) == 0:
    raise ValueError(f"data stream {STREAMS[stream]!r} ({source!r}) has no records for process "
                     f"{process_index} of {process_count}")
  if train:
    ds = ds.shuffle(seed=(seed * 1000 + stream) % 2**32).repeat(None)
  return ds.map_with_index(fn), epoch_len


class PackedIterator(grain.DatasetIterator):
  """Batches of packed rows; grain-checkpointable (get_state/set_state are JSON-able).

  `datasets` and `weights` are per stream present, `names` their STREAMS names."""

  def __init__(self, datasets: list[tuple[grain.MapDataset, int]], weights: list[float],
               d: DataConfig, tok: TokenizerHandle, train: bool, features=None,
               names: tuple[str, ...] = STREAMS):
    self.names = tuple(names)
    self.features, self._pad_features = features, None
    if features is not None:  # a run of seq_len pad tokens in segment 0: padding's features
      pad = np.full((1, d.seq_len), tok.pad_id, np.int32)
      self._pad_features = {k: v[0] for k, v in features(
          pad, np.zeros_like(pad), np.zeros(pad.shape, bool)).items()}
    self.datasets = [ds for ds, _ in datasets]
    self.epoch_len = [n for _, n in datasets]
    self.train, self.tok = train, tok
    self.seq_len, self.batch_size = d.seq_len, d.batch_size
    self.max_images = max_images_per_row(d)
    self.max_px = images.max_cells(d.max_image_size) * images.CELL_PX
    self.max_document_tokens = d.max_document_tokens
    iters = []
    if d.worker_count > 0:
      from absl import flags  # grain's workers read absl flags; outside an absl app use defaults
      if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    for ds in self.datasets:
      it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
      if d.worker_count > 0:
        it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(
            num_workers=d.worker_count, per_worker_buffer_size=d.worker_buffer_size))
      iters.append(iter(it_ds))
    super().__init__(iters)
    self.streams = iters
    self.mixer = TokenMixer(weights)
    self.packer = packing.BestFitPacker(d.seq_len, self.max_images, d.pool_bins, d.packer_cuts)
    self._pieces: dict[tuple, list] = {}  # (stream, index) -> pieces of a document in the packer
    self._cursor: list[list | None] = [None] * len(iters)
    self._counters = collections.Counter()
    self._skipped_at: dict[str, list[str]] = {}
    self._finished = False

  # --- pulling documents ---------------------------------------------------------------------

  def _pull(self) -> bool:
    """Move one piece into the packer; False when every stream has ended.

    The mixer picks a stream per piece, so a long document's pieces interleave with the other
    stream instead of arriving as one block; `self._cursor[s]` = [index, next piece] of the
    stream's current document.
    """
    while not self.mixer.done:
      s = self.mixer.choose()
      if self._cursor[s] is None and not self._next_document(s):
        continue
      index, k = self._cursor[s]
      p = self._pieces[(s, index)][k]
      self.packer.add([s, index, k, 0, len(p)], len(p.images), cuttable=not p.images)
      self.mixer.record(s, len(p))
      self._counters["pieces"] += 1
      self._cursor[s] = [index, k + 1] if k + 1 < len(self._pieces[(s, index)]) else None
      return True
    return False

  def _next_document(self, s: int) -> bool:
    """Fetch stream s's next valid document into the cursor; False if the stream ended."""
    skips = 0
    while True:
      try:
        item = next(self.streams[s])
      except StopIteration:
        self.mixer.exhaust(s)
        return False
      self._counters[f"records/{self.names[s]}"] += 1
      if item[0] == "skip":
        self._counters[f"skipped/{item[2]}"] += 1
        self._locate(item[2], item[3])
        skips += 1
        if skips > self.epoch_len[s]:
          raise RuntimeError(f"data stream {self.names[s]!r}: every record of a whole pass was "
                             f"skipped (see counters {self.counters()})")
        continue
      _, index, pieces, n_tokens, cut = item
      if cut is not None:
        self._counters[TRUNCATED] += 1
        if self._locate(TRUNCATED, cut):
          log.warning("data: the document at %s has more than data.max_document_tokens = %d "
                      "tokens; only its first %d are used (raise data.max_document_tokens to "
                      "keep more)", cut, self.max_document_tokens, n_tokens)
      self._pieces[(s, int(index))] = pieces
      self._cursor[s] = [int(index), 0]
      self._counters[f"documents/{self.names[s]}"] += 1
      return True

  def _locate(self, reason: str, where: str) -> bool:
    """Keep `where` among the first distinct locations of `reason`; whether it is new (a record
    skipped again on the next pass, or by another stream reading the same file, is not)."""
    seen = self._skipped_at.setdefault(reason, [])
    if where in seen or len(seen) >= SKIP_LOCATIONS:
      return False
    seen.append(where)
    return True

  def _next_row(self) -> dict | None:
    while not self.packer.ready:
      if not self._pull():
        self.packer.flush()
        if not self.packer.ready:
          return None
    refs = self.packer.ready.popleft()
    pieces = []
    for s, index, k, a, b in refs:
      pieces.append(self._pieces[(s, index)][k].slice(a, b))
      self._counters[f"row_tokens/{self.names[s]}"] += b - a
    row = packing.assemble_row(pieces, self.seq_len, self.max_images, self.max_px,
                               self.tok.pad_id, self.tok.image_pad_id, self.features,
                               self._pad_features)
    self._counters["rows"] += 1
    if self._counters["rows"] % 64 == 0:  # forget documents the packer no longer refers to
      live = {(r[0], r[1]) for r in self.packer.refs()}
      live.update((s, c[0]) for s, c in enumerate(self._cursor) if c is not None)
      self._pieces = {k: v for k, v in self._pieces.items() if k in live}
    self._counters["padding_tokens"] += self.seq_len - sum(len(p) for p in pieces)
    return row

  def __next__(self) -> dict:
    if self._finished:
      raise StopIteration
    rows = []
    while len(rows) < self.batch_size:
      row = self._next_row()
      if row is None:
        self._finished = True
        if not rows:
          raise StopIteration
        while len(rows) < self.batch_size:  # the last evaluation batch: empty rows
          rows.append(packing.empty_row(self.seq_len, self.max_images, self.max_px))
          rows[-1]["tokens"][:] = self.tok.pad_id
          rows[-1]["targets"][:] = self.tok.pad_id
          if self.features is not None:
            rows[-1][self.features.name] = {k: v.copy() for k, v in self._pad_features.items()}
        break
      rows.append(row)
    return packing.stack_rows(rows)

  # --- state ---------------------------------------------------------------------------------

  def counters(self) -> dict:
    """Counts for the logs: `skipped/<reason>`, `documents/<stream>`, `pieces`, `rows`,
    `padding_tokens`, `row_tokens/<stream>` (non-padding tokens emitted per stream),
    `packer/cuts`, `packer/early_closes`, `packer/waiting` (see `packing.py`), and
    `packer/cut_rate` = packer/cuts / pieces: cuts per piece placed (0 with data.packer_cuts off),
    `truncated_documents` (documents cut at data.max_document_tokens), `records/<stream>` (records
    read, skipped ones included) and `epochs/<stream>` = records / this process's records a pass:
    passes over the stream's data so far (above 1, a training run repeats its documents)."""
    out = dict(self._counters)
    for name, n in zip(self.names, self.epoch_len):
      out[f"epochs/{name}"] = self._counters[f"records/{name}"] / n
    out.update({"packer/cuts": self.packer.cuts, "packer/early_closes": self.packer.early_closes,
                "packer/waiting": len(self.packer.waiting),
                "packer/cut_rate": self.packer.cuts / max(1, self._counters["pieces"])})
    return dict(sorted(out.items()))

  def skip_locations(self) -> dict[str, list[str]]:
    """The first `SKIP_LOCATIONS` distinct `file:line` locations of each skip reason (and of
    `truncated_documents`), in reading order."""
    return {k: list(v) for k, v in sorted(self._skipped_at.items())}

  def get_state(self) -> dict:
    """A snapshot (a copy: the packer's and cursor's lists go on changing with the iterator)."""
    return copy.deepcopy({"streams": [it.get_state() for it in self.streams],
                          "mixer": self.mixer.get_state(), "packer": self.packer.get_state(),
                          "cursor": self._cursor,
                          "counters": dict(self._counters), "skipped_at": self.skip_locations(),
                          "finished": self._finished})

  def set_state(self, state: dict) -> None:
    for it, st in zip(self.streams, state["streams"]):
      it.set_state(st)
    self.mixer.set_state(state["mixer"])
    self.packer.set_state(state["packer"])
    self._counters = collections.Counter(state["counters"])
    self._skipped_at = {k: list(v) for k, v in state.get("skipped_at", {}).items()}
    self._finished = state["finished"]
    self._cursor = [None if c is None else [int(c[0]), int(c[1])] for c in state["cursor"]]
    self._pieces = {}
    keys = [(r[0], r[1]) for r in self.packer.refs()]
    keys += [(s, c[0]) for s, c in enumerate(self._cursor) if c is not None]
    for key in keys:
      if key not in self._pieces:
        item = self.datasets[key[0]][key[1]]
        if item[0] != "doc":
          raise RuntimeError(f"restored packer refers to record {key}, which no longer parses")
        self._pieces[key] = item[2]

  def close(self) -> None:
    for it in self.streams:
      close_stream(it)
    super().close()


def _grain_workers():
  """grain's worker-process iterator module, or None where it has another layout."""
  try:
    from grain._src.python.dataset.transformations import process_prefetch
  except ImportError:
    return None
  needed = ("ProcessPrefetchDatasetIterator", "_clear_queue_and_maybe_unlink_shm")
  return process_prefetch if all(hasattr(process_prefetch, n) for n in needed) else None


def _worker_iterators(it, kind) -> list:
  """The `kind` iterators inside a stream iterator, found through the iterators' attributes."""
  found, seen, todo = [], set(), [it]
  while todo:
    obj = todo.pop()
    if id(obj) in seen:
      continue
    seen.add(id(obj))
    if isinstance(obj, kind):
      found.append(obj)
    elif isinstance(obj, (list, tuple)):
      todo.extend(obj)
    elif isinstance(obj, grain.DatasetIterator):
      todo.extend(getattr(obj, "__dict__", {}).values())  # (an iterator with __slots__: none)
  return found


def close_stream(it, poll_s: float = 0.02) -> None:
  """`it.close()`, without waiting out grain's 25 s worker timeout.

  grain's worker close sets the worker's stop event, empties the output queue once and joins the
  worker for up to 25 s before killing it. A worker that was writing an element into the queue's
  pipe at that moment cannot exit: its queue's feeder thread waits for the parent to read the rest
  of the element, and process exit waits for that thread (grain 0.2.18: every close of a train
  iterator with `data.worker_count > 0` took 25 s a stream, the end of a run included). Here a
  thread keeps emptying each worker's queue (releasing each element's shared memory, as grain's
  close does) from the moment grain's own close has set that worker's stop event until the close
  returns. Nothing is read before: grain closes the thread that reads a worker's queue first, and
  a queue emptied under that thread's blocking read would leave it waiting forever. With another
  grain layout, or workers this walk does not find: grain's close as it is."""
  module = _grain_workers()
  workers = [] if module is None else [
      w for w in _worker_iterators(it, module.ProcessPrefetchDatasetIterator)
      if hasattr(w, "_buffer") and hasattr(w, "_prefetch_should_stop")]
  if not workers:
    it.close()
    return
  closed = threading.Event()

  def drain():
    while not closed.is_set():
      for w in workers:
        if w._prefetch_should_stop.is_set():
          try:
            module._clear_queue_and_maybe_unlink_shm(w._buffer)
          except (OSError, ValueError):  # the queue is closed already
            pass
      closed.wait(poll_s)

  drainer = threading.Thread(target=drain, name="grain-worker-queue-drain", daemon=True)
  drainer.start()
  try:
    it.close()
  finally:
    closed.set()
    drainer.join()


def _sources(data: DataConfig, split: str) -> list[tuple[int, Any]]:
  """(stream index, source) of every stream the split has sources for; a stream without any is
  left out (text-only data needs no multimodal source), but a split needs one."""
  if uses_default_corpus(data, split):
    return list(enumerate(corpus.sources(default_manifest(data), split)))
  keys = _source_keys(split)
  out = [(stream, open_source(getattr(data, key), f"data.{key}", data.max_record_bytes))
         for stream, key in enumerate(keys) if getattr(data, key)]
  if not out:
    raise ValueError(f"data.{keys[0]} and data.{keys[1]} are empty: the {split} split has no "
                     f"source (give one of them, or leave every data.*sources empty for the "
                     f"default corpus)")
  return out


def _make(data: DataConfig, process_index: int, process_count: int, split: str, tok=None,
          features=None, vocab_size: int | None = None) -> PackedIterator:
  d = _typed(data)
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} outside process_count={process_count}")
  if tok is None:
    tok = make_tokenizer(d, vocab_size)
  check_tokenizer(tok, vocab_size)
  fn = ToPieces(tok, d.seq_len, max_images_per_row(d), d.max_image_size, d.max_record_bytes,
                d.max_image_pixels, features, d.max_document_tokens)
  train = split == "train"
  sources = _sources(d, split)
  names = tuple(STREAMS[s] for s, _ in sources)
  weights = normalized_weights({n: getattr(d, f"{n}_weight") for n in names})
  datasets = [stream_dataset(src, s, fn, d.seed, process_index, process_count, train)
              for s, src in sources]
  return PackedIterator(datasets, [weights[n] for n in names], d, tok, train, features, names)


def make_train_iterator(data: DataConfig, process_index: int = 0, process_count: int = 1,
                        tokenizer: TokenizerHandle | None = None, token_features=None,
                        vocab_size: int | None = None) -> PackedIterator:
  """Endless training batches for this process (its shard of every stream), with the optional
  token features (module docstring) under their batch key. Without `tokenizer`, the one of
  `make_tokenizer(data, vocab_size)`; with `vocab_size` (the model's), the tokenizer is checked
  to fit it."""
  return _make(data, process_index, process_count, "train", tokenizer, token_features,
               vocab_size)


def make_eval_iterator(data: DataConfig, process_index: int = 0, process_count: int = 1,
                       tokenizer: TokenizerHandle | None = None, token_features=None,
                       vocab_size: int | None = None) -> PackedIterator:
  """One pass over the held-out records of this process; the last batch is padded with empty
  rows (segment_ids 0), then StopIteration. Arguments as `make_train_iterator`'s."""
  return _make(data, process_index, process_count, "eval", tokenizer, token_features,
               vocab_size)
