"""What a run leaves on disk and the formats it converts: the only file that imports orbax, and it never imports
train.py. train.py reads a stage's start (--init_from) through the readers here, each process its own shards.
In reading order, under its headings:

1. Run directories: a local folder or gs://BUCKET/PATH, every file read and written through data.py's storage
   layer with its one retry policy (--storage_patience).
2. Checkpoints (Orbax): saves in the background, restores checked against our checksums, the quarantine of a
   damaged one and its undoing, and the check that a resume continues the same run.
3. The Hugging Face format in and out, read by byte range.
4. The OLMo-core format in, with its Adam state.
5. Averaging two runs.
6. The run directory's services: the lock that gives it one writer, log.txt, the run's files, preemption.
7. The metrics log (metrics.jsonl, TensorBoard, W&B), the goodput account (goodput.jsonl) and the plots.
8. The loop's instruments: the progress bar, the step watchdog and the profiler.
9. The command line:

    python ckpt.py list RUN_DIR            # checkpoints with step, size, time and validity (reads only)
    python ckpt.py to-hf RUN_DIR OUT       # newest valid checkpoint (or --step N) -> an HF directory + tokenizer
    python ckpt.py from-hf HF_DIR RUN_DIR  # HF weights -> a run directory train.py continues from (step 0)
    python ckpt.py average RUN_A RUN_B OUT  # the mean of two runs' weights -> step 0 of OUT (weights only)
    python ckpt.py restore-quarantined RUN_DIR [STEP]  # checkpoints set aside as corrupt, moved back
    python ckpt.py goodput RUN_DIR         # where the run's wall time went, start by start (--json), and a plot

A run directory holds `config.json`, `metrics.jsonl`, `goodput.jsonl` (each start's seconds), `loss.png`,
`log.txt` (the full story of every error that stopped the run, and every thread's stack where one hung), `lock` while a run writes to it, with --wandb
`wandb_id` (the W&B run it continues) and `wandb/` (wandb's own files), with --profile `profile/`, on
devices that state their memory `fit.json` (the fit search's choice: recorded_fit), and
`checkpoints/<step>/` with three Orbax items: `model` (parameters), `train` (optimizer state with the
skip-step window, RNG key) and `meta` (JSON: the config, the data fingerprint and a checksum per array). Orbax commits a step by writing its marker,
`commit_success.txt`, last (COMMIT: no folder is renamed, which Cloud Storage and gcsfuse cannot do), but
does not validate what it reads back, so the checksums are ours; a checkpoint whose bytes fail them (or cannot
be parsed) is moved to `quarantined/`, never one the storage failed to serve. Every path a command takes (run
directories, HF directories in and out) may be local or gs://.
"""

import argparse
import contextlib
import dataclasses
import functools
import io
import json
import logging
import math
import os
import pickle
import re
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import traceback
import zipfile
from collections import deque
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from tqdm import tqdm

import data
import olmo3
import shard
from olmo3 import FULL, SLIDING, Compute, Olmo3, Olmo3Config, Rope, Yarn, is_array

# ---------------------------------------------------------------------------------------------------------
# Run directories: where a run lives (a local folder or gs://BUCKET/PATH, every file of it read and written
# through data.py's storage layer), and the errors that refuse one.


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked: one line naming it and why."""


class RunDirBusy(RunDirError):
    """Another process (or job) writes to this run directory."""


def _unwritable(run_dir, e: OSError) -> RunDirError:
    return RunDirError(
        f"--run_dir {run_dir} cannot be written ({e.strerror or e}): a read-only mount? This run needs to write "
        "there; give it a writable --run_dir (a copy of this one resumes where it stopped)"
    )


COMMIT_MARKER = "commit_success.txt"  # Orbax's: a step directory without it is an unfinished write


def check_run_place(path, flag: str) -> None:
    """A run directory is local or gs://: Orbax writes no s3:// checkpoints (nor reads them without s3fs), and
    http(s):// is read-only. Refused in one line naming the flag, before anything is read."""
    data.check_writable(str(path), flag, schemes=("gs",))


def _absolute(path) -> str:
    """A run directory's path as every process and Orbax take it: a URL as is, a local folder absolute."""
    return str(path).rstrip("/") if data.is_url(path) else os.path.abspath(path)


# ---------------------------------------------------------------------------------------------------------
# Checkpoints (Orbax): checksums, the Checkpoints of a run, what a damaged one is and how it is set aside (and
# moved back), and the check that a resume continues the same run.


@jax.jit
def checksums(arrays) -> dict:
    """A uint32 checksum per array: sum of (bit pattern x (2i + 1)) mod 2^32 over its flat index i.

    Integer sums are exact in any order, so the value does not depend on how the array is sharded (a
    checkpoint restored onto another mesh checks out), and any single changed word changes the sum.
    One compiled program for the whole tree: op by op, each array's sum would be its own small program
    with its own all-reduce, and processes that ran those in different orders waited on each other
    forever (a two-process save hung so).
    """

    def one(x):
        x = jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
        bits = (
            jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)
            if x.dtype != jnp.bool_
            else x.astype(jnp.uint32)
        )
        odd = 2 * jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape) + 1
        return jnp.sum(bits * odd, dtype=jnp.uint32)

    return jax.tree.map(one, arrays)


def _checksum_table(arrays) -> dict[str, str]:
    sums = jax.device_get(checksums(arrays))
    return {
        jax.tree_util.keystr(p, simple=True, separator="/"): f"{int(v):08x}"
        for p, v in jax.tree_util.tree_leaves_with_path(sums)
    }


class CorruptCheckpoint(Exception):
    """A committed checkpoint that cannot be read back as it was written."""


class CheckpointError(OSError):
    """A checkpoint could not be written (or, NoValidCheckpoint, none can be read): one line naming the step,
    the path and the cause."""


class NoValidCheckpoint(CheckpointError):
    """Every checkpoint of a run has been set aside as corrupt: the run stops rather than start over."""


def _cause(e: BaseException) -> str:
    """What actually went wrong, in a few words: the operating system's error if there is one (TensorStore
    wraps it as os_error_code='28': "No space left on device"), else the innermost error's first line."""
    while e.__cause__ or e.__context__:
        e = e.__cause__ or e.__context__
    if code := re.search(r"os_error_code='(\d+)'", str(e)):
        return f"{os.strerror(int(code.group(1)))} (errno {code.group(1)})"
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"


def _barriers_through_the_coordinator() -> None:
    """Orbax's barriers between processes (at each save's start, before old steps are removed, ...) through
    JAX's coordination service, which waits with a timeout, instead of its default: a device all-reduce
    (multihost_utils.sync_global_devices), a collective that queues among the train step's own and waits
    forever for a process that is gone. Orbax reads the choice from an absl flag, which nothing here parses."""
    from absl import flags

    if jax.process_count() > 1:
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        flags.FLAGS.experimental_orbax_use_distributed_barrier = True


class _AppendHandler(logging.Handler):
    """Orbax's failure detail (its log records, and the late reports _late_callback routes) appended to a file,
    local or gs:// (which logging.FileHandler cannot write). Each piece is tried once, without the storage's
    patience: it details a failure already reported in one line, often the storage's own, and a patience spent
    on it would delay the stop. A piece that cannot be written is dropped, and that said once on stderr: never a
    traceback, never raised into Orbax."""

    def __init__(self, path):
        super().__init__()
        self.path, self.dropped = path, False

    def emit(self, record):
        try:
            with _FORMATTING:  # its exception's traceback too (format_traceback)
                text = self.format(record)
        except Exception:  # logging's own way: said on stderr, never raised into Orbax
            self.handleError(record)
            return
        self.add(text + "\n")

    def add(self, text: str) -> None:
        with self.lock:  # (logging's, held around emit too): one piece at a time, one line said at most
            try:
                with data.tried_once():
                    data.append(self.path, text)
            except Exception as e:
                if not self.dropped:
                    why = data.transient_answer(e) or e
                    print(
                        f"also: Orbax's failure detail dropped: {self.path} not written ({why})",
                        file=sys.stderr,
                    )
                self.dropped = True


def _orbax_detail_to(log) -> None:
    """Orbax logs its failures (a restore of a damaged checkpoint: pages of TensorStore detail) before raising
    them, and after a failed write TensorStore still calls back into Orbax's closed event loop, which Python
    prints as tracebacks. Checkpoints reports each failure in one line; the detail goes to `log` (the run's
    log.txt), or, for a command that only reads, nowhere."""
    absl = logging.getLogger("absl")
    absl.propagate = False
    for handler in absl.handlers[:]:
        absl.removeHandler(handler)
    detail = _AppendHandler(log) if log else None
    absl.addHandler(detail or logging.NullHandler())
    sys.unraisablehook = functools.partial(_late_callback, sys.__unraisablehook__, detail)


def _late_callback(default, detail: _AppendHandler | None, unraisable) -> None:
    """Route to `detail` the two late reports of a failure Checkpoints has already reported: the closed event
    loop, and an Orbax coroutine (reading another array of a damaged checkpoint) collected after its error."""
    code = getattr(unraisable.object, "cr_code", None)
    from_orbax = code is not None and f"orbax{os.sep}" in code.co_filename
    closed_loop = unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed"
    if closed_loop or from_orbax:
        if detail:
            detail.add(format_traceback(unraisable.exc_value))
    else:
        default(unraisable)


# Orbax commits a step by writing a marker file (COMMIT_MARKER) last into the step's folder, written in place
# (its COMMIT_FILE mode), on every storage. A commit without a rename is the only one Cloud Storage and a
# gcsfuse mount have: gcsfuse refuses to rename a folder on a flat bucket, or, with --rename-dir-limit, copies it
# object by object, which a kill leaves half done. A local disk loses nothing by it. A step counts only with
# its marker (all_steps), and a writer starting removes the steps without one.
COMMIT = ocp.options.AtomicityOptions(mode=ocp.options.AtomicityMode.COMMIT_FILE)


def _tensorstore_patience() -> None:
    """Orbax's arrays go through TensorStore, whose retries Orbax sets nowhere we can reach but in its default
    context: give them the storage layer's patience (data.tensorstore_retries), for each store it opens."""
    from orbax.checkpoint._src.serialization import tensorstore_utils

    retries = data.tensorstore_retries()
    for context in (tensorstore_utils._BASE_TS_CONTEXT, tensorstore_utils._DEFAULT_OCDBT_TS_CONTEXT):
        context.update({f"{driver}_request_retries": retries for driver in ("gcs", "s3")})


def _unreadable(step_dir: str, what: str, e: Exception) -> Exception:
    """Why a committed checkpoint's `what` did not read back. Damage (CorruptCheckpoint, which sets it aside)
    only where its bytes were read and are wrong or cannot be parsed; the storage's weather or a refusal stops
    the run naming it, and moves nothing: an outage never makes a sound checkpoint look corrupt, nor rolls a
    run back to an older one."""
    if answer := data.transient_answer(e):
        return data.StorageUnavailable(
            f"{step_dir}: its {what} got no answer but transient ones within --storage_patience "
            f"{data.PATIENCE_S:g} s (the last: {answer}); stopped with the checkpoint where it is: run again once "
            "the storage answers",
            answer,
        )
    if why := data.refusal(e):
        return data.StorageRefused(f"{step_dir}: reading its {what} was refused ({why})")
    return CorruptCheckpoint(f"{what} unreadable: {_cause(e)}")


def _blocking(method):
    """A Checkpoints method whose seconds the caller waits add to its blocked_s."""

    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        began = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.blocked_s += time.perf_counter() - began

    return timed


class Checkpoints:
    """The checkpoints of one run directory (local, on a gcsfuse mount or gs://): asynchronous saves,
    validated restores, retention.

    Keeps the newest `keep_last` (at least 2: the newest may still be being written) and, forever, every
    step divisible by `keep_every`. Restoring skips a checkpoint that fails to read or to match its
    checksums: it is moved to RUN_DIR/quarantined/ (never deleted), the full error goes to RUN_DIR/log.txt,
    and the one before it is used. `read_only` opens an existing run for reading and writes nothing.
    """

    def __init__(self, run_dir, keep_last: int = 2, keep_every: int = 0, read_only: bool = False):
        if keep_last < 2:
            raise ValueError(
                f"--keep_last {keep_last}: keep at least 2 checkpoints; the newest may be mid-write"
            )
        self.saving, self.run_dir = None, _absolute(run_dir)
        self.blocked_s = 0.0  # seconds save() and close() kept the caller waiting: the goodput's checkpoint
        self.before_save = lambda: None  # train.py's: MetricsLog.flush, the metrics rows held back
        self.dir = data.join(self.run_dir, "checkpoints")
        self.quarantine = data.join(self.run_dir, "quarantined")
        if read_only and not data.is_dir(self.dir):
            raise FileNotFoundError(f"{self.dir} does not exist: is {run_dir} a run directory?")
        # Fail at the start, not at the first save an hour later; but a finished run on a read-only mount is
        # read without a write (the first save, if the run gets that far, is refused).
        self.cannot_write = None if read_only else data.unwritable(self.run_dir)
        if self.cannot_write and not data.is_dir(self.dir):
            raise RunDirError(f"run directory {self.run_dir}: cannot create {self.dir} ({self.cannot_write})")
        self.read_only = read_only or self.cannot_write is not None
        if not self.read_only and jax.process_index() == 0:
            # An interrupted save (no commit marker) is never read; remove it now, before this run saves.
            # (Orbax's own cleanup_tmp_directories does this in a thread it waits for only at the next save,
            # so a run that stops before saving, or a look right after the start, would still find it.)
            for name in unfinished_writes(self.dir):
                data.remove_tree(data.join(self.dir, name))
        _orbax_detail_to(
            None if self.read_only or jax.process_index() else data.join(self.run_dir, "log.txt")
        )
        _barriers_through_the_coordinator()
        _tensorstore_patience()
        self.options = (
            ocp.CheckpointManagerOptions(read_only=True, atomicity_options=COMMIT)
            if self.read_only
            else ocp.CheckpointManagerOptions(
                create=False,  # checkpoints/ made by the first save: a run that stops before leaves none
                max_to_keep=keep_last,
                keep_period=keep_every or None,
                enable_async_checkpointing=True,
                atomicity_options=COMMIT,
            )
        )
        self._open()

    def _open(self):
        handlers = {
            "model": ocp.StandardCheckpointHandler(),
            "train": ocp.StandardCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
        }
        self.manager = ocp.CheckpointManager(
            data.for_orbax(self.dir), item_handlers=handlers, options=self.options
        )

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    @_blocking
    def save(self, step: int, model, train=None, meta: dict | None = None) -> None:
        """Start an asynchronous save; the write goes on in the background. A failure raises
        CheckpointError at the next check(), wait() or close()."""
        if self.read_only:  # Orbax's read-only manager would skip the save without a word
            raise CheckpointError(f"saving checkpoint {step}: {self.dir} is read-only ({self.cannot_write})")
        self.before_save()
        if step == self.saving or step in self.manager.all_steps():  # a preemption's, after a periodic one
            return
        self.wait()  # one save at a time, and the previous one's failure first
        items = {"model": eqx.filter(model, is_array)}
        if train is not None:
            items["train"] = eqx.filter(train, is_array)
        meta = dict(
            meta or {},
            step=step,
            time=time.time(),
            checksums={k: _checksum_table(v) for k, v in items.items()},
        )
        self.saving = step
        try:
            self.manager.save(
                step,
                force=True,
                args=ocp.args.Composite(
                    meta=ocp.args.JsonSave(meta), **{k: ocp.args.StandardSave(v) for k, v in items.items()}
                ),
            )
        except Exception as e:
            self._failed(e)

    def check(self) -> None:
        """Raise CheckpointError now if the background save has failed (cheap; the loop calls it every step)."""
        if self.saving is not None and not self.manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        """Block until the background save, if any, has committed; raise CheckpointError if it failed."""
        if self.saving is None:
            return
        try:
            self.manager.wait_until_finished()
            self.manager.check_for_errors()
        except Exception as e:
            self._failed(e)
        self.saving = None

    def _failed(self, e: Exception):
        """A save failed: remove its temporary folder (the committed checkpoints stay as they were), and
        raise one line naming it."""
        step, self.saving = self.saving, None
        where = data.join(self.dir, str(step))
        if answer := data.transient_answer(
            e
        ):  # the storage is out: its log too, and the next start cleans up
            raise data.StorageUnavailable(
                f"saving checkpoint {step} to {where}: no answer but transient ones within --storage_patience "
                f"{data.PATIENCE_S:g} s (the last: {answer}); stopped, the checkpoints before it as they were",
                answer,
            ) from e
        self._log(f"saving checkpoint {step} failed", e)
        if jax.process_index() == 0:
            self._remove_unfinished(step)
        raise CheckpointError(f"saving checkpoint {step} to {where} failed: {_cause(e)}") from e

    def _remove_unfinished(self, step: int, quiet_s: float = 1.0, give_up_s: float = 30.0) -> None:
        """Remove a failed save's folder (it has no commit marker). Orbax reports the first item that fails (say
        the model) while another (the optimizer state) may still be writing in its own thread, and its writer
        makes the folders it needs again: so remove until the folder has stayed gone for `quiet_s`."""
        start = gone_since = time.monotonic()
        while time.monotonic() - gone_since < quiet_s:
            folder = data.join(self.dir, str(step))
            unfinished = data.is_dir(folder) and not data.exists(data.join(folder, COMMIT_MARKER))
            left = [folder] if unfinished else []
            for tmp in left:
                data.remove_tree(tmp)  # a writer may add files while it goes; look again
            if left:
                gone_since = time.monotonic()
            if left and time.monotonic() - start > give_up_s:
                self._log(f"could not remove {left} (the next start removes it)", OSError(str(left)))
                return
            time.sleep(0.05)

    @_blocking
    def close(self, failing: bool = False) -> None:
        """Finish the background save and let go of the directory. `failing`: the run is already stopping
        on another error, which goes on; a failed save is then reported as a line, not raised over it."""
        try:
            self.wait()
        except (CheckpointError, data.StorageUnavailable) as e:
            if not failing:
                raise
            print(f"also: {e}", file=sys.stderr)
        finally:
            self.manager.close()

    def _log(self, what: str, e: BaseException) -> None:
        """The full story of a failure, which the one-line message summarises, in RUN_DIR/log.txt."""
        if not self.read_only:
            log_error(self.run_dir, what, e)

    def read_meta(self, step: int) -> dict:
        try:
            return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except Exception as e:
            raise _unreadable(data.join(self.dir, str(step)), "meta", e) from e

    def read(self, step: int, model_like=None, train_like=None):
        """Step `step` as (model, train, meta), checksums verified.

        `model_like`/`train_like` are abstract trees (shard.abstract, on_first_device) giving structure, shapes
        and target shardings; with None an item comes back as the nested dict Orbax stores, on this
        process's first device.
        """
        meta = self.read_meta(step)
        stored = [k for k in ("model", "train") if k in meta.get("checksums", {})]
        wanted = {"model": model_like, "train": train_like}
        try:  # the arrays' metadata: read through TensorStore, as the arrays are
            metadata = self.manager.item_metadata(step)
        except Exception as e:
            raise _unreadable(data.join(self.dir, str(step)), "array metadata", e) from e
        abstract = {}
        for k in stored:
            if k not in set(metadata.keys()):  # its meta names it: removed by hand (retention: list tells)
                raise CorruptCheckpoint(f"its {k} arrays are missing")
            like = wanted[k]
            if like is None:
                like = on_first_device(
                    jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), metadata[k].tree)
                )
            abstract[k] = eqx.filter(like, is_array)
        for k in stored:  # a sound checkpoint of another shape is refused, never taken for a corrupt one
            saved = metadata[k].tree
            if wanted[k] is not None and (diff := _shape_differences(saved, abstract[k])):
                raise ResumeRefused(
                    f"{data.join(self.dir, str(step))} holds a {k} of other shapes: {diff} (saved vs now); it is sound "
                    "and stays where it is: resume with the recipe that wrote it, or use another --run_dir"
                )
        try:
            got = self.manager.restore(
                step, args=ocp.args.Composite(**{k: ocp.args.StandardRestore(v) for k, v in abstract.items()})
            )
        except Exception as e:
            raise _unreadable(data.join(self.dir, str(step)), "arrays", e) from e
        for k in stored:
            found, saved = _checksum_table(got[k]), meta["checksums"][k]
            if found != saved:
                bad = sorted(p for p in found.keys() | saved.keys() if found.get(p) != saved.get(p))
                raise CorruptCheckpoint(f"checksum mismatch in {k}: {bad[:5]}")
        out = {k: eqx.combine(got[k], wanted[k]) if wanted[k] is not None else got[k] for k in stored}
        return out.get("model"), out.get("train"), meta

    def saved_train_state(self, step: int) -> dict | None:
        """Step `step`'s train item (optimizer state, key) as abstract arrays in the nested dict Orbax stores,
        or None for a checkpoint of weights only: what the caller needs to shape a read of it."""
        saved = self.manager.item_metadata(step).get("train")
        if saved is None:
            return None
        return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), saved.tree)

    def read_model(self, step: int, place=None) -> Olmo3:
        """Step `step`'s model, shaped by the config it was saved with (for a command that knows no preset), its
        arrays placed as `place(abstract model)` says (default: on_first_device)."""
        cfg = config_from_hf(self.read_meta(step)["model"], f"{data.join(self.dir, str(step))} meta")
        return self.read(step, (place or on_first_device)(olmo3.abstract(cfg)))[0]

    def newest_valid(self, read):
        """The newest checkpoint that `read(step)` reads back intact, as (step, what `read` returned), or None.
        Each one that raises CorruptCheckpoint on the way is set aside (see set_aside)."""
        for step in reversed(self.steps()):
            try:
                return step, read(step)
            except CorruptCheckpoint as e:
                self.set_aside(step, e)
        return None

    def chosen(self, read, step: int | None = None):
        """Step `step` (default: the newest that reads back intact, as newest_valid) read by `read`, as (step,
        what `read` returned); FileNotFoundError, naming the steps there are, where there is none such."""
        if not self.steps() or (step is not None and step not in self.steps()):
            at = f" at step {step}" if step is not None else ""
            raise FileNotFoundError(f"{self.dir} has no checkpoint{at} (steps: {self.steps()})")
        if step is not None:  # asked for by number: a fault in it is named, and nothing is set aside
            try:
                return step, read(step)
            except CorruptCheckpoint as e:
                raise CorruptCheckpoint(
                    f"checkpoint {data.join(self.dir, str(step))} (step {step}): {e}"
                ) from e
        found = self.newest_valid(read)
        if found is None:
            raise FileNotFoundError(f"no valid checkpoint in {self.dir}")
        return found

    def restore_latest(self, model_like, train_like=None, check=None, start_over: bool = False):
        """The newest valid checkpoint as (step, model, train, meta), or None where the run has none. `check(meta)`
        may raise to refuse a checkpoint of another configuration: that is an error, not a corruption. Where
        every checkpoint has been set aside (now or by an earlier start), NoValidCheckpoint is raised unless
        `start_over`: a flaky mount must not erase a run."""

        def read(step):
            if check is not None:
                check(self.read_meta(step))
            return self.read(step, model_like, train_like)

        found = self.newest_valid(read)
        quarantined = quarantined_steps(self.run_dir)
        if found is None and quarantined and not start_over:
            raise NoValidCheckpoint(
                f"no checkpoint of {self.run_dir} reads back intact: {', '.join(quarantined)} in "
                f"{self.quarantine} (details in {data.join(self.run_dir, 'log.txt')}); if the storage was at "
                f"fault, `python ckpt.py restore-quarantined {self.run_dir}` moves them back, or pass "
                "--start_over to train from step 0"
            )
        return None if found is None else (found[0], *found[1])

    def set_aside(self, step: int, error: CorruptCheckpoint) -> None:
        """Report a corrupt checkpoint in a line and, unless read_only, move it to RUN_DIR/quarantined/ (never
        deleted) with the full error in RUN_DIR/log.txt."""
        if self.read_only:
            print(f"checkpoint {step} is corrupt ({error}); trying the one before it", file=sys.stderr)
            return
        target = data.join(self.quarantine, f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
        print(
            f"checkpoint {data.join(self.dir, str(step))} is corrupt ({error}); moved to {target} (details in "
            f"{data.join(self.run_dir, 'log.txt')}), falling back to the one before it",
            file=sys.stderr,
        )
        self._log(f"checkpoint {step} is corrupt", error)
        if jax.process_index() == 0:  # every process found the same fault (the checksums are global)
            data.move_tree(data.join(self.dir, str(step)), target, COMMIT_MARKER)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"set aside checkpoint {step}")
        self._open()  # the manager caches its list of steps


def unfinished_writes(folder) -> list[str]:
    """The folders of a checkpoint folder (local or gs://) that are no checkpoint: a save in flight, or cut short
    (no commit marker; or, from before commit markers, a temporary name)."""
    if not data.is_dir(folder):
        return []
    files = set(data.listing(folder))
    steps = {name.split("/")[0] for name in files if "/" in name}
    if not data.is_url(folder):  # a folder Orbax made before writing a file in it
        steps |= {name for name in os.listdir(folder) if os.path.isdir(os.path.join(folder, name))}
    return sorted(s for s in steps if ".orbax-checkpoint-tmp" in s or f"{s}/{COMMIT_MARKER}" not in files)


def format_of(path) -> str:
    """What directory `path` (local or gs://) holds: "run" (one of ours: checkpoints/), "olmo-core" (an
    OLMo-core step directory: model_and_optim/) or "hf" (a Hugging Face model: config.json); else one line
    saying what was expected."""
    path = str(path)
    for kind, inside in (("run", "checkpoints"), ("olmo-core", "model_and_optim"), ("hf", "config.json")):
        if data.is_dir(data.join(path, inside)) or data.exists(data.join(path, inside)):
            return kind
    found = (
        "does not exist"
        if not data.is_dir(path)
        else "holds none of checkpoints/, model_and_optim/, config.json"
    )
    raise FileNotFoundError(
        f"{path} {found}: expected one of our run directories (checkpoints/), an OLMo-core step directory "
        "(model_and_optim/) or a Hugging Face model directory (config.json, *.safetensors)"
    )


def has_checkpoints(run_dir) -> bool:
    """Whether `run_dir` holds a committed checkpoint; reads only."""
    if not data.is_dir(data.join(run_dir, "checkpoints")):
        return False
    ckpts = Checkpoints(run_dir, read_only=True)
    try:
        return bool(ckpts.steps())
    finally:
        ckpts.close()


def quarantined_steps(run_dir) -> list[str]:
    """The checkpoints a run has set aside as corrupt: RUN_DIR/quarantined/<step>-<time>, oldest first."""
    folder = data.join(run_dir, "quarantined")
    return sorted({name.split("/")[0] for name in data.listing(folder)}) if data.is_dir(folder) else []


def restore_quarantined(run_dir, step: int | None = None) -> list[tuple[str, str]]:
    """Move the checkpoints a run set aside as corrupt (RUN_DIR/quarantined/<step>-<time>) back into its
    checkpoints/, for when the storage, not the bytes, was at fault: the next run reads them again, and sets
    aside any that truly fail their checksums. `step`: that step's alone. Of several copies of a step, the
    newest moves. Refused where checkpoints/ holds that step already. Returns each (from, to) moved."""
    run_dir = _absolute(run_dir)
    with RunLock(run_dir):
        newest = {
            name.split("-")[0]: name for name in quarantined_steps(run_dir)
        }  # sorted: the last is newest
        if step is not None:
            newest = {k: v for k, v in newest.items() if k == str(step)}
        if not newest:
            which = f" of step {step}" if step is not None else ""
            raise FileNotFoundError(
                f"{data.join(run_dir, 'quarantined')} holds no checkpoint{which} to restore"
            )
        moves = [
            (data.join(run_dir, "quarantined", name), data.join(run_dir, "checkpoints", k))
            for k, name in sorted(newest.items(), key=lambda kv: int(kv[0]))
        ]
        for source, target in moves:
            if data.is_dir(target):
                raise FileExistsError(f"{target} exists already; {source} stays where it is")
        for source, target in moves:
            data.move_tree(source, target, COMMIT_MARKER)
    return moves


def list_checkpoints(run_dir) -> list[dict]:
    """Every committed checkpoint of a run with its size, time and whether it reads back intact (valid: True,
    False, or None for one removed while it was read); reads only."""
    ckpts = Checkpoints(run_dir, read_only=True)
    rows = []
    try:
        for step in ckpts.steps():
            step_dir = data.join(ckpts.dir, str(step))
            row = dict(step=step, size=data.tree_size(step_dir), time=None, valid=True, problem="")
            try:
                _, _, meta = ckpts.read(step)
                row["time"] = meta.get("time")
            except Exception as e:  # a removal fails a read anywhere in it, with any error
                if not isinstance(e, data.StorageUnavailable) and _removed_while_read(step_dir, row["size"]):
                    row.update(valid=None, problem="removed while listed")
                elif isinstance(e, CorruptCheckpoint):
                    row.update(valid=False, problem=str(e))
                else:
                    raise
            rows.append(row)
    finally:
        ckpts.close()
    return rows


def _removed_while_read(step_dir: str, size: int) -> bool:
    """Whether a committed checkpoint that failed to read was being removed meanwhile (by the retention of
    the run that is saving newer ones): its commit marker gone, or its files no longer the `size` bytes they
    were before the read. A committed checkpoint's files never change otherwise; a damaged one stays."""
    return not data.exists(data.join(step_dir, COMMIT_MARKER)) or data.tree_size(step_dir) != size


def check_run_start(run_dir, step: int | None, cfg: Olmo3Config, as_run, weights_only: bool) -> None:
    """A checkpoint of one of our runs (step `step`, default the newest) must hold model `cfg` once the run
    has made it its own (`as_run`), and Adam's state unless `weights_only`: refused in one line naming the
    checkpoint before anything is read but its metadata."""
    ckpts = Checkpoints(run_dir, read_only=True)
    try:
        step, meta = ckpts.chosen(ckpts.read_meta, step)
        where = data.join(ckpts.dir, str(step))
        if diff := model_differences(as_run(config_from_hf(meta["model"], f"{where} meta")), cfg):
            raise ValueError(f"{where} holds another model than the run's: {diff} (checkpoint vs run)")
        if not weights_only and ckpts.saved_train_state(step) is None:
            raise ValueError(
                f"{where} holds weights only (no Adam state to carry over); pass --init_weights_only true to "
                "start from them with Adam from zero"
            )
    finally:
        ckpts.close()


def _shape_differences(saved, like) -> str:
    """Where two trees' arrays differ in shape, by dotted path (`opt.losses (64,) vs (128,)`); '' if nowhere.
    Orbax stores a module as a dict of its fields, so paths are compared by name."""
    name = lambda k: str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
    shapes = lambda tree: {
        ".".join(name(k) for k in path): tuple(x.shape)
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
        if hasattr(x, "shape")
    }
    a, b = shapes(saved), shapes(eqx.filter(like, is_array))
    return ", ".join(
        f"{p} {a.get(p)} vs {b.get(p)}" for p in sorted(a.keys() | b.keys()) if a.get(p) != b.get(p)
    )


def on_first_device(tree):
    """`tree` (a model or optimizer state, its arrays real or abstract) as abstract arrays placed whole on this
    process's first device: what a command that reads a checkpoint without a mesh restores into."""
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return shard.abstract(tree, jax.tree.map(lambda _: one, tree))


class ResumeRefused(ValueError):
    """The run directory holds checkpoints of another model, data order or recipe."""


def check_resume(meta: dict, expected: dict, recipe_fields, allow_change: bool, run_dir: str) -> None:
    """Refuse a checkpoint whose metadata differs from what the run expects, naming what changed: the model
    shape always; the recipe's `recipe_fields` of the config, the compute dtype and the data's fingerprint
    unless `allow_change`. Weights from `ckpt.py from-hf` carry no config: any recipe may start there."""
    if diff := model_differences(
        config_from_hf(meta["model"], "its meta"), config_from_hf(expected["model"])
    ):
        raise ResumeRefused(
            f"--run_dir {run_dir} holds another model: {diff} (saved vs now); use another --run_dir"
        )
    if "config" not in meta or allow_change:
        return
    saved, now = meta["config"], expected["config"]
    changes = [f"{k}: {saved.get(k)!r} -> {now[k]!r}" for k in recipe_fields if saved.get(k) != now[k]]
    # Of the compute policy only the dtype and fp8 change the numbers (kernels and remat change rounding at
    # most); a checkpoint from before --fp8 trained without it.
    for name, before in [("dtype", None), ("fp8", "")]:
        if (old := saved.get("compute", {}).get(name, before)) != now["compute"][name]:
            changes.append(f"{name}: {old!r} -> {now['compute'][name]!r}")
    try:
        data.check_fingerprint(meta["data"], expected["data"])
    except ValueError as e:
        changes.append(str(e))
    if changes:
        raise ResumeRefused(
            f"--run_dir {run_dir} was trained with another recipe: {'; '.join(changes)}. Pass "
            "--allow_config_change to resume anyway (e.g. to extend --steps), or use a new --run_dir"
        )


# ---------------------------------------------------------------------------------------------------------
# The Hugging Face format: the key map, the config, reading a part of each tensor, saving, export and import.


# (our leaf, HF tensor, axes of our leaf that form torch's `in` dimension). HF stores Linear weights as
# [out, in]; we store [in..., out...], so a matrix is transposed and its grouped axes (heads, head_dim)
# flattened. n_in == 0 marks a vector or the embedding, which keeps its layout.
HF_LAYER_KEYS = [
    ("self_attn.q_proj", "self_attn.q_proj.weight", 1),
    ("self_attn.k_proj", "self_attn.k_proj.weight", 1),
    ("self_attn.v_proj", "self_attn.v_proj.weight", 1),
    ("self_attn.o_proj", "self_attn.o_proj.weight", 2),
    ("self_attn.q_norm", "self_attn.q_norm.weight", 0),
    ("self_attn.k_norm", "self_attn.k_norm.weight", 0),
    ("post_attention_layernorm", "post_attention_layernorm.weight", 0),
    ("mlp.gate_proj", "mlp.gate_proj.weight", 1),
    ("mlp.up_proj", "mlp.up_proj.weight", 1),
    ("mlp.down_proj", "mlp.down_proj.weight", 1),
    ("post_feedforward_layernorm", "post_feedforward_layernorm.weight", 0),
]

HF_MODEL_KEYS = [
    ("embed_tokens", "model.embed_tokens.weight", 0),
    ("norm", "model.norm.weight", 0),
    ("lm_head", "lm_head.weight", 1),
]

HF_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")

VOCAB_LEAVES = ("embed_tokens", "lm_head")  # padded to a multiple of 128 here, cut to vocab_size in HF


def hf_names(cfg: Olmo3Config):
    """Every tensor of the HF checkpoint in file order: (our leaf, layer index or None, HF name, n_in)."""
    yield "embed_tokens", None, "model.embed_tokens.weight", 0
    for i in range(cfg.n_layers):
        for ours, theirs, n_in in HF_LAYER_KEYS:
            yield f"layers.{ours}", i, f"model.layers.{i}.{theirs}", n_in
    yield "norm", None, "model.norm.weight", 0
    yield "lm_head", None, "lm_head.weight", 1


def leaf_at(model, path: str):
    """The leaf at dotted `path` ("layers.mlp.up_proj") of a model or of moments shaped like it."""
    return functools.reduce(getattr, path.split("."), model)


def _set_leaf(model, path: str, value):
    return eqx.tree_at(lambda m: leaf_at(m, path), model, value)


def _hf_shape(shape: tuple[int, ...], n_in: int, vocab: int | None) -> tuple[int, ...]:
    """The HF tensor's shape for one of our (per-layer) leaves of `shape`."""
    if vocab is not None:  # embedding [vocab, d]; lm_head ours [d, vocab]
        return (vocab, shape[0] if n_in else shape[1])
    if n_in == 0:
        return (int(np.prod(shape)),)
    return (int(np.prod(shape[n_in:])), int(np.prod(shape[:n_in])))


def ours_to_hf(w: np.ndarray, n_in: int, vocab: int | None) -> np.ndarray:
    if vocab is not None:
        return w.T[:vocab] if n_in else w[:vocab]
    if n_in == 0:
        return w.reshape(-1)
    return w.reshape(int(np.prod(w.shape[:n_in])), -1).T


def _rope_to_hf(rope: Rope) -> dict:
    if rope.yarn is None:
        return {"rope_type": "default", "rope_theta": rope.theta}
    y = rope.yarn
    out = {
        "rope_type": "yarn",
        "rope_theta": rope.theta,
        "factor": y.factor,
        "beta_fast": y.beta_fast,
        "beta_slow": y.beta_slow,
        "original_max_position_embeddings": y.original_max_position,
    }
    if y.attention_factor is not None:
        out["attention_factor"] = y.attention_factor
    if not y.truncate:
        out["truncate"] = False
    return out


def _rope_from_hf(p: dict, layer_type: str, path: str) -> Rope:
    kind = p.get("rope_type", p.get("type", "default"))
    if kind == "default":
        return Rope(theta=float(p["rope_theta"]))
    if kind == "yarn":
        if p.get("mscale") or p.get("mscale_all_dim"):
            raise ValueError(
                f"{path}: YaRN with mscale/mscale_all_dim ({layer_type}) is not OLMo 3's and is not supported"
            )
        return Rope(
            theta=float(p["rope_theta"]),
            yarn=Yarn(
                factor=float(p["factor"]),
                original_max_position=int(p["original_max_position_embeddings"]),
                beta_fast=float(p.get("beta_fast") or 32),
                beta_slow=float(p.get("beta_slow") or 1),
                attention_factor=p.get("attention_factor"),
                truncate=bool(p.get("truncate", True)),
            ),
        )
    raise ValueError(
        f"{path}: rope_type {kind!r} on {layer_type} layers is not supported; "
        "olmo3-jax implements 'default' and 'yarn'"
    )


def config_to_hf(cfg: Olmo3Config, dtype: str = "float32") -> dict:
    return {
        "architectures": ["Olmo3ForCausalLM"],
        "model_type": "olmo3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": _longest_context(cfg),
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {SLIDING: _rope_to_hf(cfg.rope_sliding), FULL: _rope_to_hf(cfg.rope_full)},
        "sliding_window": cfg.sliding_window,
        "layer_types": list(cfg.layer_types),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "initializer_range": cfg.init_std,
        "use_cache": True,
        "dtype": dtype,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "bos_token_id": None,
    }


def _longest_context(cfg: Olmo3Config) -> int:
    """HF's max_position_embeddings: with YaRN the context it extends to (transformers checks it is the original
    length times the factor), or the run's longest if that is longer."""
    yarn = cfg.rope_full.yarn
    return max(cfg.max_seq_len, int(yarn.original_max_position * yarn.factor)) if yarn else cfg.max_seq_len


def config_from_hf(hf: dict, path: str = "config.json") -> Olmo3Config:
    """Our config from an HF config.json; anything OLMo 3 does not have is refused, naming the key."""
    if hf.get("model_type") != "olmo3":
        raise ValueError(f"{path}: model_type is {hf.get('model_type')!r}, expected 'olmo3'")
    if missing := [k for k in HF_REQUIRED if k not in hf]:
        raise ValueError(f"{path}: no {', '.join(missing)}; expected the config.json of an Olmo3ForCausalLM")
    for key, want in [("hidden_act", "silu"), ("attention_bias", False), ("tie_word_embeddings", False)]:
        if hf.get(key, want) != want:
            raise ValueError(f"{path}: {key}={hf[key]!r} is not supported (OLMo 3 has {want!r})")
    heads = hf["num_attention_heads"]
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [SLIDING if (i + 1) % 4 else FULL for i in range(layers)]
    if "rope_parameters" in hf and SLIDING in hf["rope_parameters"]:
        rp = hf["rope_parameters"]
    else:  # older configs: one rope_theta, and rope_scaling applies to the full-attention layers only
        base = {"rope_type": "default", "rope_theta": hf.get("rope_theta", 500_000.0)}
        rp = {SLIDING: base, FULL: {**base, **(hf.get("rope_scaling") or {})}}
    eos = hf.get("eos_token_id")
    return Olmo3Config(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        mlp_hidden=hf["intermediate_size"],
        layer_types=tuple(types),
        sliding_window=hf.get("sliding_window") or 4096,
        rope_sliding=_rope_from_hf(rp[SLIDING], SLIDING, path),
        rope_full=_rope_from_hf(rp[FULL], FULL, path),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        max_seq_len=max(hf.get("max_position_embeddings") or 0, 0) or 8192,
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        pad_token_id=hf.get("pad_token_id"),
    )


def _read_json(file: str) -> dict:
    """A JSON object from `file` (local or in a bucket), or one line naming the file and what is wrong with it."""
    try:
        value = json.loads(data.read_text(file))
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e}); cut short, or not the file it should be?") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file}: holds a JSON {type(value).__name__}, expected an object")
    return value


def read_hf_config(path) -> Olmo3Config:
    """Our config from the config.json of the Hugging Face directory `path` (local or gs://), refused in one line
    naming the file where it is missing, not JSON, or not an OLMo 3 model's."""
    file = data.join(path, "config.json")
    if not data.exists(file):
        raise FileNotFoundError(f"{file} not found: is {path} a Hugging Face model directory?")
    return config_from_hf(_read_json(file), file)


# safetensors' dtype names, as numpy reads them.
SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": jnp.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class Safetensors:
    """A safetensors file (local or in a bucket) read by byte range: 8 bytes giving the header's length, the
    JSON header (each tensor's dtype, shape and [begin, end) in the data after it), then the data. Only the
    header is read on opening, and of a tensor only the rows asked for: each host reads its own shards."""

    def __init__(self, path: str):
        self.path = path
        if (size := data.file_size(path)) is None:
            raise FileNotFoundError(f"{path} not found")
        try:
            (length,) = struct.unpack("<Q", next(data.read_ranges([(path, 0, 8)])))
            header = json.loads(next(data.read_ranges([(path, 8, 8 + length)])))
            self.tensors = {k: v for k, v in header.items() if k != "__metadata__"}
            self.start = 8 + length
            for name, t in self.tensors.items():
                begin, end = t["data_offsets"]
                want = math.prod(t["shape"]) * np.dtype(SAFETENSORS_DTYPES[t["dtype"]]).itemsize
                if not (end - begin == want and begin >= 0 and self.start + end <= size):
                    raise ValueError(
                        f"tensor {name}'s bytes {begin}..{end} do not fit the file's {size} bytes"
                    )
        except (
            struct.error,
            json.JSONDecodeError,
            UnicodeDecodeError,
            KeyError,
            ValueError,
            data.DataError,
        ) as e:
            raise ValueError(
                f"{path}: not a readable safetensors file ({e}); cut short by an interrupted download or copy? "
                "Fetch it again"
            ) from e

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])

    def read(self, name: str, region: tuple[slice, ...]) -> np.ndarray:
        """The part `region` (a slice per axis) of tensor `name`: the bytes of its rows, sliced within them."""
        t, shape = self.tensors[name], self.shape(name)
        dtype = np.dtype(SAFETENSORS_DTYPES[t["dtype"]])
        first, stop, _ = region[0].indices(shape[0])
        row = math.prod(shape[1:]) * dtype.itemsize
        at = self.start + t["data_offsets"][0] + first * row
        raw = next(data.read_ranges([(self.path, at, at + max(stop - first, 0) * row)]))
        return np.frombuffer(raw, dtype).reshape(max(stop - first, 0), *shape[1:])[(slice(None), *region[1:])]


def _hf_files(path: str) -> dict[str, Safetensors]:
    """HF tensor name -> the safetensors file that holds it; every file is opened (its header read), so a
    damaged one is named before anything loads."""
    index = data.join(path, "model.safetensors.index.json")
    if data.exists(index):
        names = _read_json(index).get("weight_map", {})
        opened = {f: Safetensors(data.join(path, f)) for f in set(names.values())}
        return {name: opened[f] for name, f in names.items()}
    single = data.join(path, "model.safetensors")
    if not data.exists(single):
        raise FileNotFoundError(f"{path}: neither model.safetensors nor model.safetensors.index.json found")
    file = Safetensors(single)
    return dict.fromkeys(file.tensors, file)


def check_hf(hf_dir, cfg: Olmo3Config, as_run=lambda hf: hf) -> None:
    """An HF directory must hold model `cfg` once the run has made it its own (`as_run`: e.g. YaRN added to a
    stage-2 model for stage 3), every file whole: refused in one line before anything is read."""
    hf_dir = str(hf_dir)
    saved = read_hf_config(hf_dir)
    files = _hf_files(hf_dir)
    if diff := model_differences(as_run(saved), cfg):
        raise ValueError(f"{hf_dir} holds another model than the run's: {diff} (checkpoint vs run)")
    _check_hf_tensors(hf_dir, saved, files)


def _check_hf_tensors(path: str, cfg: Olmo3Config, files: dict[str, Safetensors]) -> None:
    """The files hold every tensor of model `cfg` in its shape, and no other: read from their headers only."""
    expected = {name: (leaf, layer, n_in) for leaf, layer, name, n_in in hf_names(cfg)}
    if missing := sorted(expected.keys() - files.keys()):
        raise ValueError(
            f"{path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''} "
            f"({len(missing)} in all) for the model config.json describes"
        )
    if extra := sorted(files.keys() - expected.keys()):
        raise ValueError(
            f"{path}: unexpected tensors {extra[:5]} ({len(extra)} in all): not part of Olmo3ForCausalLM"
        )
    tree = olmo3.abstract(cfg)
    for name, (leaf, layer, n_in) in expected.items():
        shape = leaf_at(tree, leaf).shape[0 if layer is None else 1 :]
        want = _hf_shape(shape, n_in, cfg.vocab_size if leaf in VOCAB_LEAVES else None)
        if (got := files[name].shape(name)) != want:
            raise ValueError(
                f"{files[name].path}: tensor {name} has shape {list(got)}, expected {list(want)}"
            )


def with_config(model: Olmo3, cfg: Olmo3Config) -> Olmo3:
    """The same weights as a model of `cfg`, which differs from model.cfg only where no weight's shape shows it
    (RoPE, the context length): a stage that extends the context (YaRN) goes on from the weights as they are."""
    weights, like = eqx.filter(model, is_array), olmo3.abstract(cfg, model.compute)
    shapes = lambda tree: [w.shape for w in jax.tree.leaves(eqx.filter(tree, is_array))]
    if shapes(weights) != shapes(like):
        raise ValueError(f"the model's weights do not fit {cfg}")
    return eqx.combine(weights, eqx.filter(like, is_array, inverse=True))


class Tally:
    """Bytes of tensor data a process has read, beside the whole of what it reads from: a sharded start shows
    in numbers that each host read its own shards only."""

    def __init__(self):
        self.read = self.whole = 0

    def __str__(self) -> str:
        return f"read {self.read / 2**20:,.1f} MiB of the {self.whole / 2**20:,.1f} MiB"


def load_hf(path, *, shardings=None, compute: Compute = Compute(), tally: Tally | None = None) -> Olmo3:
    """An HF Olmo3ForCausalLM directory (local or gs://) as our model, computing as `compute` says, streamed
    tensor by tensor (no torch). Host memory holds the model plus one stacked leaf; with `shardings` (a pytree
    like the model, from shard.py) each process reads only its devices' parts of each tensor (assemble)."""
    path = str(path)
    cfg = read_hf_config(path)
    files = _hf_files(path)
    _check_hf_tensors(path, cfg, files)

    def read(name, want, region):
        if files[name].shape(name) != want:
            raise ValueError(
                f"{files[name].path}: tensor {name} has shape {files[name].shape(name)}, expected {list(want)}"
            )
        return files[name].read(name, region)

    return assemble(olmo3.abstract(cfg, compute), hf_names(cfg), read, cfg.vocab_size, shardings, tally)


def assemble(tree, names, read, vocab: int, shardings=None, tally: Tally | None = None):
    """`tree` (an abstract model, or moments shaped like it) with each leaf built from tensors in HF's layout:
    `names` yields (our leaf, layer index or None, tensor name, n_in) as hf_names does; `read(name, shape,
    region)` returns the part `region` (slices) of that tensor, checked to be of `shape` (embedding and LM
    head with `vocab` rows). With `shardings` (a pytree like the model, from shard.py) each process reads
    only the parts its devices hold, straight onto them; without, each leaf is read whole."""
    by_leaf = {}
    for leaf, layer, name, n_in in names:
        by_leaf.setdefault(leaf, []).append((layer, name, n_in))
    tally = tally or Tally()
    for leaf, entries in by_leaf.items():
        target = leaf_at(tree, leaf)
        vocab_leaf = vocab if leaf in VOCAB_LEAVES else None
        tally.whole += math.prod(target.shape) * 4
        blocks = {}  # devices of one process that hold the same part share one read

        def block(index, target=target, entries=entries, vocab_leaf=vocab_leaf):
            index = tuple(slice(*s.indices(n)) for s, n in zip(index, target.shape))
            key = tuple((s.start, s.stop) for s in index)
            if key not in blocks:
                stacked = entries[0][0] is not None  # a leaf of every layer: its first axis the layer
                wanted = range(index[0].start, index[0].stop, index[0].step) if stacked else [None]
                within, shape = (index[1:], target.shape[1:]) if stacked else (index, target.shape)
                parts = [
                    _leaf_part(read, name, shape, n_in, vocab_leaf, within)
                    for layer, name, n_in in entries
                    if layer in wanted
                ]
                blocks[key] = np.stack(parts) if stacked else parts[0]
                tally.read += blocks[key].nbytes
            return blocks[key]

        if shardings is None:  # uncommitted, as a fresh init: a jit may place it anywhere
            array = jnp.asarray(block(tuple(slice(None) for _ in target.shape)))
        else:
            array = jax.make_array_from_callback(target.shape, leaf_at(shardings, leaf), block)
        tree = _set_leaf(tree, leaf, array)
    return tree


def _hf_axes(shape: tuple[int, ...], n_in: int, vocab_leaf: bool) -> list[tuple[int, ...]]:
    """Which of our leaf's axes each axis of the HF tensor flattens: HF's [out, in] is our [in..., out...]
    transposed; a vector is every axis flattened; the embedding keeps its layout."""
    if vocab_leaf and not n_in:
        return [(0,), (1,)]
    if not n_in:
        return [tuple(range(len(shape)))]
    return [tuple(range(n_in, len(shape))), tuple(range(n_in))]


def _leaf_part(read, name: str, shape, n_in: int, vocab: int | None, index) -> np.ndarray:
    """The part `index` (slices of our per-layer leaf of `shape`) of HF tensor `name`, in our layout (fp32):
    only the span of HF's rows and columns that holds it is read. Vocabulary rows past the checkpoint's
    (our vocabulary is padded to a multiple of 128) are zero, as MaxText pads."""
    axes = _hf_axes(shape, n_in, vocab is not None)
    hf_shape = _hf_shape(shape, n_in, vocab)
    flats = []  # per HF axis: the flat HF index of each of our wanted positions along the axes it flattens
    for group in axes:
        ranges = [np.arange(shape[a])[index[a]] for a in group]
        grid = np.meshgrid(*ranges, indexing="ij")
        flats.append(np.ravel_multi_index(grid, [shape[a] for a in group]).reshape(-1))
    # The span to read along each HF axis; the first may stop short of ours (the vocabulary's padding).
    region = tuple(
        slice(int(f.min()), max(int(f.min()), min(int(f.max()) + 1, n))) for f, n in zip(flats, hf_shape)
    )
    part = np.asarray(read(name, hf_shape, region), np.float32)
    inside = flats[0] < hf_shape[0]
    at = [flats[0][inside] - region[0].start] + [f - r.start for f, r in zip(flats[1:], region[1:])]
    out = np.zeros([len(f) for f in flats], np.float32)
    out[inside] = part[np.ix_(*at)]
    sizes = [len(range(shape[a])[index[a]]) for group in axes for a in group]
    order = [a for group in axes for a in group]
    return out.reshape(sizes).transpose(np.argsort(order))


def _hf_shards(cfg: Olmo3Config, itemsize: int, shard_bytes: int) -> list[list[tuple]]:
    """hf_names' entries in files of about `shard_bytes`, planned from the shapes alone, so that each file has
    its final name (model-00001-of-00003.safetensors) as it is written."""
    shards, size = [[]], 0
    tree = olmo3.abstract(cfg)
    for leaf, layer, name, n_in in hf_names(cfg):
        shape = leaf_at(tree, leaf).shape[0 if layer is None else 1 :]
        nbytes = (
            math.prod(_hf_shape(shape, n_in, cfg.vocab_size if leaf in VOCAB_LEAVES else None)) * itemsize
        )
        if size and size + nbytes > shard_bytes:
            shards, size = [*shards, []], 0
        shards[-1].append((leaf, layer, name, n_in))
        size += nbytes
    return shards


def _hf_file_bodies(model: Olmo3, dtype: str, shard_bytes: int, extra: dict[str, str]):
    """(file name, bytes) of each file of an HF directory of `model`, config.json last (a directory cut short
    has none, so nothing loads it). Host memory holds one shard."""
    from safetensors.numpy import save

    cfg = model.cfg
    np_dtype = {"float32": np.float32, "bfloat16": jax.numpy.bfloat16}[dtype]
    shards = _hf_shards(cfg, np.dtype(np_dtype).itemsize, shard_bytes)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    weight_map, total = {}, 0
    for file, entries in zip(names, shards):
        tensors = {}
        for leaf, layer, name, n_in in entries:
            w = leaf_at(model, leaf) if layer is None else leaf_at(model, leaf)[layer]
            vocab = cfg.vocab_size if leaf in VOCAB_LEAVES else None
            tensors[name] = np.ascontiguousarray(
                ours_to_hf(np.asarray(jax.device_get(w)), n_in, vocab).astype(np_dtype)
            )
            weight_map[name], total = file, total + tensors[name].nbytes
        yield file, save(tensors, metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        yield "model.safetensors.index.json", json.dumps(index, indent=2)
    generation = {"eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
    yield "generation_config.json", json.dumps(generation, indent=2)
    yield from extra.items()
    yield "config.json", json.dumps(config_to_hf(cfg, dtype), indent=2)


# The files an export writes (_hf_file_bodies): a directory of these alone without config.json, which comes
# last, is an export cut short, which save_hf writes again; any other file is another's, never overwritten.
HF_EXPORT_FILE = re.compile(
    r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|generation_config\.json"
    r"|tokenizer(_config)?\.json"
)


def save_hf(
    model: Olmo3,
    path,
    *,
    dtype: str = "float32",
    shard_bytes: int = 5 * 10**9,
    extra: dict[str, str] | None = None,
) -> str:
    """Write a directory (local or gs://) transformers' Olmo3ForCausalLM.from_pretrained loads: vocab cut back
    to cfg.vocab_size, safetensors shards of about `shard_bytes` with an index when there are several, and
    `extra` files (name -> text: the tokenizer's). A local one is written beside `path` and renamed once
    complete; in a bucket, config.json comes last. A failed write (a full disk) leaves nothing, and says so in
    one line; one cut short where nothing could be removed (a bucket cut off) is written again by the next.
    A directory holding anything else is refused."""
    from safetensors import SafetensorError

    out = str(path).rstrip("/")
    data.check_writable(out, "writing")
    left = data.listing(out) if data.is_dir(out) else []
    if "config.json" in left or not all(map(HF_EXPORT_FILE.fullmatch, left)):
        raise FileExistsError(f"{out} exists and is not empty; choose a new output directory")
    folder = out if data.is_url(out) else f"{out}.tmp"
    data.remove_tree(folder)  # in a bucket, an export cut short (an outage): written again
    try:
        for name, body in _hf_file_bodies(model, dtype, shard_bytes, extra or {}):
            data.write_file(data.join(folder, name), body)
    except (OSError, SafetensorError) as e:
        data.remove_tree(folder)
        raise OSError(f"writing {out} failed ({e}); nothing is left there") from e
    if not data.is_url(out):
        data.remove_tree(out)  # an empty directory, or an export cut short, once the new one is whole
        os.replace(folder, out)
    return out


def export_hf(
    run_dir, out, step: int | None = None, dtype: str = "float32", tokenizer: str | None = None
) -> int:
    """Write the newest valid checkpoint of a run (or `step`) as an HF directory with its tokenizer (the
    run's, or `tokenizer`: dolma2, tiny, none or a tokenizer.json); returns its step. Reads the run only. An
    output nothing here can write (s3://, http://) is refused before the run is read."""
    data.check_writable(str(out), "OUT")
    ckpts = Checkpoints(run_dir, read_only=True)
    try:
        step, model = ckpts.chosen(ckpts.read_model, step)
        meta = ckpts.read_meta(step)
    finally:
        ckpts.close()
    save_hf(model, out, dtype=dtype, extra=_tokenizer_files(run_dir, meta, model.cfg, tokenizer))
    return step


def _tokenizer_files(run_dir, meta: dict, cfg: Olmo3Config, name: str | None) -> dict[str, str]:
    """The tokenizer to ship with an export: asked for, or the run's (train.py keeps the tiny one's
    tokenizer.json in the run directory), or dolma2 for a model of its vocabulary."""
    name = (
        name or meta.get("config", {}).get("tokenizer") or ("dolma2" if cfg.vocab_size == 100_278 else "none")
    )
    if name == "none":
        return {}
    if name == "tiny" and data.exists(kept := data.join(run_dir, "tokenizer.json")):
        return data.hf_tokenizer_files("tiny", kept)
    if name.endswith(".json"):
        return data.hf_tokenizer_files("tiny", name)
    if name == "tiny" and not os.path.exists(default := data.tiny_tokenizer_file(None)):
        raise FileNotFoundError(
            f"{run_dir} keeps no tokenizer.json and {default} does not exist: pass --tokenizer PATH/tokenizer.json "
            "(the tiny tokenizer its data was made with) or --tokenizer none"
        )
    return data.hf_tokenizer_files(name)


def preset_of(cfg: Olmo3Config) -> str | None:
    """The olmo3.MODELS name whose model `cfg` is (token ids and max length aside), if any."""
    from olmo3 import MODELS

    return next((name for name, model in MODELS.items() if not model_differences(model, cfg)), None)


def import_hf(hf_dir, run_dir) -> Olmo3Config:
    """An HF directory as step 0 of a new run directory, which `train.py --run_dir RUN_DIR` continues."""
    model = load_hf(hf_dir)
    write_first_step(run_dir, model, None, hf_dir)
    return model.cfg


def write_first_step(run_dir, model: Olmo3, train_state: dict | None, *sources) -> None:
    """Step 0 of a new run directory: `model` and, if given, train.py's {"opt": ..., "key": ...}; the meta
    names the model and where it came from (`sources`) but no recipe, so any recipe of this model may
    continue from it."""
    with RunLock(run_dir):
        ckpts = Checkpoints(run_dir)
        try:
            if ckpts.steps():
                raise FileExistsError(
                    f"{ckpts.dir} already holds checkpoints {ckpts.steps()}; choose a new run directory"
                )
            source = " + ".join(_absolute(s) for s in sources)
            meta = {"model": config_to_hf(model.cfg), "source": source}
            ckpts.save(0, model, train_state, meta=meta)
        finally:
            ckpts.close()


# ---------------------------------------------------------------------------------------------------------
# The OLMo-core format: a step directory as OLMo-core's trainer writes it (`config.json`, `train/rank*.pt`,
# `model_and_optim/.metadata` and `__<rank>_<n>.distcp`: a torch distributed checkpoint) read as the start of a run
# with its Adam moments and step count. Nothing here imports torch: `.metadata` is a pickle of torch classes
# and each chunk's bytes a `torch.save` zip (filesystem.py's FileSystemWriter: data.pkl + the raw storage),
# both read by a restricted unpickler that builds plain stand-ins; the tensor bytes are read with numpy.


# OLMo-core's parameter names for HF's (olmo_core/nn/hf/convert.py; OLMo 3's block is the reordered-norm one,
# whose norms come after attention and MLP). q, k and v are separate Linear weights, [out, in] as in HF.
OLMO_CORE_MODEL_KEYS = {
    "model.embed_tokens.weight": "embeddings.weight",
    "model.norm.weight": "lm_head.norm.weight",
    "lm_head.weight": "lm_head.w_out.weight",
}

OLMO_CORE_LAYER_KEYS = {
    "self_attn.q_proj.weight": "attention.w_q.weight",
    "self_attn.k_proj.weight": "attention.w_k.weight",
    "self_attn.v_proj.weight": "attention.w_v.weight",
    "self_attn.o_proj.weight": "attention.w_out.weight",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "post_attention_layernorm.weight": "attention_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "post_feedforward_layernorm.weight": "feed_forward_norm.weight",
}

# The optimizer state OLMo-core's AdamW and SkipStepAdamW keep per parameter, as the checkpoint names it.
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")

DCP_DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16, "float16": np.float16, "float64": np.float64}

TORCH_STORAGES = {"FloatStorage": np.float32, "BFloat16Storage": jnp.bfloat16, "HalfStorage": np.float16}


def olmo_core_names(cfg: Olmo3Config):
    """hf_names with OLMo-core's parameter names: (our leaf, layer index or None, OLMo-core name, n_in)."""
    for leaf, layer, name, n_in in hf_names(cfg):
        suffix = name.removeprefix(f"model.layers.{layer}.")
        yield (
            leaf,
            layer,
            OLMO_CORE_MODEL_KEYS.get(name) or f"blocks.{layer}.{OLMO_CORE_LAYER_KEYS[suffix]}",
            n_in,
        )


class TorchObject:
    """A stand-in for a torch object in a pickle: its constructor's arguments and its pickled fields."""

    def __init__(self, *args):
        self.args = args

    def __setstate__(self, state):
        if isinstance(state, dict):  # a dataclass's fields
            self.__dict__.update(state)
        else:  # its own __getstate__'s value (TensorProperties: dtype, layout, requires_grad, ...)
            self.state = state


def _tensor_ref(storage, offset, size, stride, *_):
    return storage, offset, tuple(size), tuple(stride)


class TorchUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata` or a `torch.save` tensor without torch: torch's classes (and OLMo-core's
    checkpoint writer's) become TorchObject subclasses of their name, a tensor becomes (storage (type name, key), offset, size, stride). Anything
    else outside a few containers is refused: a pickle can run code, and a checkpoint holds no code."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _tensor_ref
        if module.split(".")[0] == "torch" or module.startswith("olmo_core.distributed.checkpoint"):
            return type(name, (TorchObject,), {})  # OLMo-core's writer records chunks in its own _StorageInfo
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        raise pickle.UnpicklingError(f"{module}.{name} has no place in a torch checkpoint")

    def persistent_load(self, pid):  # ("storage", storage class, key, location, numel)
        return pid[1].__name__, pid[2]


@dataclasses.dataclass
class DcpTensor:
    """One tensor of a torch distributed checkpoint: its dtype, global shape, and chunks as (offsets, sizes,
    file, byte offset, byte length), each chunk's bytes one torch.save blob."""

    dtype: str
    shape: tuple[int, ...]
    chunks: list[tuple[tuple[int, ...], tuple[int, ...], Path, int, int]]


def read_dcp_metadata(ckpt_dir: str) -> dict[str, DcpTensor]:
    """Every tensor of CHECKPOINT_DIR/model_and_optim (local, gs:// or http(s)://) by name (non-tensor values,
    such as the param groups' settings, left out), each chunk's file checked to hold its bytes; or one line
    naming the file."""
    folder = data.join(ckpt_dir, "model_and_optim")
    file = data.join(folder, ".metadata")
    if not data.exists(file):
        raise FileNotFoundError(
            f"{file} not found: is {ckpt_dir} an OLMo-core step directory (model_and_optim/.metadata and "
            "__*_*.distcp)? An interrupted download or copy leaves it out; fetch it again"
        )
    try:
        meta = TorchUnpickler(io.BytesIO(data.read_bytes(file))).load()
        where = {  # a chunk's place by (name, offsets); non-tensor values have no offsets
            (i.fqn, tuple(i.offset.args[0])): s for i, s in meta.storage_data.items() if hasattr(i, "offset")
        }
        tensors = {
            fqn: DcpTensor(
                m.properties.state[0].__name__,
                tuple(m.size.args[0]),
                [_chunk(folder, fqn, c, where[fqn, tuple(c.offsets.args[0])]) for c in m.chunks],
            )
            for fqn, m in meta.state_dict_metadata.items()
            if hasattr(m, "chunks")
        }
    except (pickle.UnpicklingError, EOFError, AttributeError, KeyError, IndexError, TypeError) as e:
        raise ValueError(
            f"{file}: not the metadata of a torch distributed checkpoint ({type(e).__name__}: {e}); cut short?"
        ) from None
    for fqn, t in tensors.items():
        _check_chunk_files(fqn, t)
    return tensors


def _chunk(folder: str, fqn: str, chunk, storage) -> tuple:
    if getattr(storage, "transform_descriptors", None):
        raise ValueError(
            f"{data.join(folder, storage.relative_path)}: {fqn} is stored with {storage.transform_descriptors} "
            "(compressed?); expected plain torch.save blobs, as OLMo-core writes them"
        )
    offsets, sizes = tuple(chunk.offsets.args[0]), tuple(chunk.sizes.args[0])
    return offsets, sizes, data.join(folder, storage.relative_path), storage.offset, storage.length


def _check_chunk_files(fqn: str, t: DcpTensor) -> None:
    for _, _, file, start, length in t.chunks:
        if (size := data.file_size(file)) is None:
            raise FileNotFoundError(f"{file} not found; the checkpoint's .metadata places {fqn} there")
        if size < start + length:
            raise ValueError(
                f"{file}: {size} bytes, but {fqn} lies at bytes {start}-{start + length}: cut short by an "
                "interrupted download or copy? Fetch it again"
            )


def read_dcp_tensor(fqn: str, t: DcpTensor, region: tuple[slice, ...] | None = None) -> np.ndarray:
    """Tensor `fqn`, or its part `region` (slices), from the chunks that overlap it: memory holds the part and
    one chunk's blob, and a chunk outside the part is never read."""
    region = region or tuple(slice(0, n) for n in t.shape)
    out = np.empty([r.stop - r.start for r in region], DCP_DTYPES[t.dtype])
    for offsets, sizes, file, start, length in t.chunks:
        lo = [max(o, r.start) for o, r in zip(offsets, region)]
        hi = [min(o + n, r.stop) for o, n, r in zip(offsets, sizes, region)]
        if any(a >= b for a, b in zip(lo, hi)):
            continue
        blob = next(data.read_ranges([(file, start, start + length)]))
        chunk = torch_saved_tensor(blob, f"{file}: bytes {start}-{start + length} ({fqn})")
        if chunk.shape != sizes:
            raise ValueError(f"{file}: the chunk of {fqn} at {list(offsets)} has shape {list(chunk.shape)}")
        into = tuple(slice(a - r.start, b - r.start) for a, b, r in zip(lo, hi, region))
        out[into] = chunk[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))]
    return out


def torch_saved_tensor(blob: bytes, where: str) -> np.ndarray:
    """The tensor in one `torch.save` blob (a zip: data.pkl describes it, data/<key> is its raw storage)."""
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as z:
            pkl = next(n for n in z.namelist() if n.endswith("/data.pkl"))
            root = pkl.removesuffix("data.pkl")
            if root + "byteorder" in z.namelist() and z.read(root + "byteorder") != b"little":
                raise ValueError("big-endian tensor")
            (kind, key), offset, size, stride = TorchUnpickler(io.BytesIO(z.read(pkl))).load()
            storage = np.frombuffer(z.read(f"{root}data/{key}"), TORCH_STORAGES[kind])
    except (zipfile.BadZipFile, StopIteration, KeyError, ValueError, pickle.UnpicklingError, EOFError) as e:
        raise ValueError(f"{where}: not a torch.save tensor ({type(e).__name__}: {e}); damaged?") from None
    item = storage.itemsize
    return np.lib.stride_tricks.as_strided(storage[offset:], size, [s * item for s in stride]).copy()


def check_olmo_core_model(tensors: dict, cfg: Olmo3Config, file: str, weights_only: bool):
    """The checkpoint must hold the run's model `cfg`, and Adam's state for each parameter unless
    `weights_only`: refused before anything is read, naming what differs."""
    model = olmo3.abstract(cfg)
    expected = {}
    for leaf, layer, fqn, n_in in olmo_core_names(cfg):
        shape = leaf_at(model, leaf).shape[1 if layer is not None else 0 :]
        want = _hf_shape(shape, n_in, cfg.padded_vocab if leaf in VOCAB_LEAVES else None)
        expected[f"model.{fqn}"] = want
        expected.update(
            {f"optim.state.{fqn}.{m}": want for m in ADAM_MOMENTS} | {f"optim.state.{fqn}.step": ()}
        )
    found = {k: t.shape for k, t in tensors.items() if k.startswith("model.") or k.startswith("optim.state.")}
    if not weights_only and not any(k.startswith("optim.state.") for k in found):
        raise ValueError(
            f"{file} holds no optimizer state (no optim.state.* tensors: saved without it?); pass "
            "--init_weights_only true to start from the weights alone (Adam's moments and count then start from zero)"
        )
    if weights_only:
        expected = {k: v for k, v in expected.items() if k.startswith("model.")}
        found = {k: v for k, v in found.items() if k.startswith("model.")}
    diff = [
        f"{k} {list(found[k])} (checkpoint) vs {list(v)} (run)"
        for k, v in expected.items()
        if k in found and found[k] != v
    ]
    diff += [f"{k} missing" for k in expected if k not in found]
    diff += [f"{k} not in the run's model" for k in found if k not in expected]
    if diff:
        diff.sort(key=lambda d: d.startswith("optim."))  # the weights first: the moments repeat them
        raise ValueError(
            f"{file} holds another model than the run's: {_olmo_core_shape(found, cfg)}"
            f"{'; '.join(diff[:3])}{f' ({len(diff)} differences)' if len(diff) > 3 else ''}"
        )


def _olmo_core_shape(found: dict, cfg: Olmo3Config) -> str:
    """The checkpoint's layer count, width and vocabulary rows where they differ from `cfg`'s, in words."""
    layers = len({k.split(".")[2] for k in found if k.startswith("model.blocks.")})
    rows, width = found.get("model.embeddings.weight", (None, None))
    said = [
        f"{what} {a} (checkpoint) vs {b} (run); "
        for what, a, b in [
            ("n_layers", layers, cfg.n_layers),
            ("d_model", width, cfg.d_model),
            ("vocab rows", rows, cfg.padded_vocab),
        ]
        if a != b
    ]
    return "".join(said)


def check_olmo_core_config(ckpt_dir: str, cfg: Olmo3Config) -> None:
    """What the tensors' shapes cannot tell (heads of the same width, RoPE, the window, the norms' eps) from
    the config.json OLMo-core's trainer writes beside them, where there is one: refused naming the fields."""
    file = data.join(ckpt_dir, "config.json")
    if not data.exists(file):
        return
    model = _read_json(file).get("model") or {}
    block = model.get("block") or {}
    attn = block.get("sequence_mixer") or block.get("attention") or {}  # "attention" in older OLMo-core
    if not attn:
        raise ValueError(
            f"{file}: no model.block.sequence_mixer; expected the config.json of an OLMo-core run"
        )
    windows = [w for w in (attn.get("sliding_window") or {}).get("pattern", []) if w > 0]
    found = {
        "n_heads": attn.get("n_heads"),
        "n_kv_heads": attn.get("n_kv_heads") or attn.get("n_heads"),
        "rope theta": (attn.get("rope") or {}).get("theta"),
        "sliding_window": max(windows, default=cfg.sliding_window),
        "norm eps": (block.get("layer_norm") or {}).get("eps"),
    }
    ours = dict(
        zip(found, (cfg.n_heads, cfg.n_kv_heads, cfg.rope_full.theta, cfg.sliding_window, cfg.norm_eps))
    )
    if diff := [f"{k} {v} (config.json) vs {ours[k]} (run)" for k, v in found.items() if v != ours[k]]:
        raise ValueError(f"{file} describes another model than the run's: {'; '.join(diff)}")


def adam_count(tensors: dict, cfg: Olmo3Config, file: str) -> float:
    """Adam's step count: OLMo-core keeps one per parameter (skipped steps do not advance it), train.py one
    for all, so they must agree; refused naming the parameters that differ."""
    keys = {fqn: f"optim.state.{fqn}.step" for _, _, fqn, _ in olmo_core_names(cfg)}
    steps = {fqn: float(read_dcp_tensor(k, tensors[k])) for fqn, k in keys.items()}
    common = max(set(steps.values()), key=list(steps.values()).count)
    if odd := {fqn: s for fqn, s in steps.items() if s != common}:
        raise ValueError(
            f"{file}: Adam's step count is {common:g} for most parameters but "
            + ", ".join(f"{s:g} for {fqn}" for fqn, s in list(odd.items())[:4])
            + "; train.py keeps one count for all parameters and cannot continue this state"
        )
    return common


def load_olmo_core(ckpt_dir, cfg: Olmo3Config, weights_only: bool = False, shardings=None, tally=None):
    """An OLMo-core step directory as (our model, (first moments, second moments, Adam's count) or None
    with `weights_only`), checked against `cfg` first (check_olmo_core) and read a tensor at a time; with
    `shardings` each process reads only the chunks its devices' parts lie in (assemble)."""
    ckpt_dir = str(ckpt_dir)
    tensors = read_dcp_metadata(ckpt_dir)
    names = list(olmo_core_names(cfg))

    def tree(pattern: str, like):
        read = lambda fqn, _, region: read_dcp_tensor(
            pattern.format(fqn), tensors[pattern.format(fqn)], region
        )
        return assemble(like, names, read, cfg.padded_vocab, shardings, tally)

    model = tree("model.{}", olmo3.abstract(cfg))
    if weights_only:
        return model, None
    moments = [tree(f"optim.state.{{}}.{m}", eqx.filter(olmo3.abstract(cfg), is_array)) for m in ADAM_MOMENTS]
    return model, (*moments, adam_count(tensors, cfg, data.join(ckpt_dir, "model_and_optim", ".metadata")))


def check_olmo_core(ckpt_dir, cfg: Olmo3Config, weights_only: bool) -> None:
    """An OLMo-core step directory must hold model `cfg`, and Adam's state unless `weights_only`: refused
    in one line naming what differs, a damaged file or a foreign pickle, before anything is read."""
    ckpt_dir = str(ckpt_dir)
    tensors = read_dcp_metadata(ckpt_dir)
    metadata = data.join(ckpt_dir, "model_and_optim", ".metadata")
    check_olmo_core_model(tensors, cfg, metadata, weights_only)
    check_olmo_core_config(ckpt_dir, cfg)
    if not weights_only:
        adam_count(tensors, cfg, metadata)


# ---------------------------------------------------------------------------------------------------------
# Averaging: the mean of two runs (AI2's soup of the 32B's midtraining runs).


# Fields of an HF config that no weight depends on: two models differing only in them are one model.
NOT_THE_MODEL = ("max_position_embeddings", "eos_token_id", "pad_token_id", "bos_token_id")


def model_differences(a: Olmo3Config, b: Olmo3Config) -> str:
    """Where `a` and `b` are different models, as `field a vs b` over their HF configs' fields (a long list by
    its length: the layer types); '' if they are one model. The token ids and the longest context are left
    out: no weight depends on them. The one test of "the same model?" for resumes, starts and averages."""
    ha, hb = config_to_hf(a), config_to_hf(b)
    short = lambda v: f"{len(v)} entries" if isinstance(v, list) and len(v) > 4 else repr(v)
    return ", ".join(
        f"{k} {short(ha.get(k))} vs {short(hb.get(k))}"
        for k in {**ha, **hb}
        if ha.get(k) != hb.get(k) and k not in NOT_THE_MODEL
    )


def newest_model(run_dir) -> tuple[int, Olmo3]:
    """(step, model) of a run's newest valid checkpoint, whole on this process's first device; reads only."""
    ckpts = Checkpoints(run_dir, read_only=True)
    try:
        return ckpts.chosen(ckpts.read_model)
    finally:
        ckpts.close()


def average(run_a, run_b, out, different_steps: bool = False) -> tuple[int, int]:
    """The mean of two runs' weights (each run's newest valid checkpoint), as AI2 averaged the 32B's two
    midtraining runs into its release, written as step 0 of a new run directory, weights only: `to-hf` exports
    it, and train.py continues from it with Adam from zero (as AI2's stage 3 loads the average without optimizer
    state). Both models are held in host memory (fp32: 8 bytes a parameter), the mean taken a tensor at a time.
    Refused, before OUT is touched, if the two are not the same model. Returns the two steps."""
    check_run_place(out, "OUT")
    if _absolute(run_a) == _absolute(run_b):
        raise ValueError(f"{run_a} and {run_b} are one run: its average with itself is itself; name two runs")
    (step_a, a), (step_b, b) = newest_model(run_a), newest_model(run_b)
    if diff := model_differences(a.cfg, b.cfg):
        raise ValueError(f"{run_a} and {run_b} hold different models: {diff} ({run_a} vs {run_b})")
    if step_a != step_b and not different_steps:  # AI2's soup: two runs of one length, each at its end
        raise ValueError(
            f"{run_a} is at step {step_a} and {run_b} at step {step_b}: two runs at different stages; pass "
            "--different_steps to average them anyway"
        )
    params, static = eqx.partition(a, is_array)
    leaves, tree = jax.tree.flatten(params)
    others = jax.tree.leaves(eqx.filter(b, is_array))
    del a, b, params  # each tensor of either model is freed as soon as its mean replaces it
    for i, other in enumerate(others):
        leaves[i], others[i] = (leaves[i] + other) / 2, None
    write_first_step(out, eqx.combine(jax.tree.unflatten(tree, leaves), static), None, run_a, run_b)
    return step_a, step_b


# ---------------------------------------------------------------------------------------------------------
# The run directory's services: one writer at a time (the lock), log.txt and the errors' stories, the run's
# files, preemption.


LOCK_LEASE_S = 300  # a gs:// lock its holder has not renewed for this long is stale: taken over

LOCK_RENEW_S = 30  # how often the holder of a gs:// lock renews it


class RunLock:
    """One writer per run directory. RUN_DIR/lock names its holder (host, process id and start time, job);
    a second process refuses at once, naming it. The lock is a file (an object) created only if absent: an
    O_EXCL open locally, a generation precondition on Cloud Storage; of two processes, one wins.

    A lock whose holder is gone is taken over. On this host that is told by its process. Locally, a lock held
    on another host is refused (its process cannot be checked from here). On gs://, where a restarted job
    comes back on other hosts, the holder renews its lock every LOCK_RENEW_S seconds, and a lock not renewed
    for LOCK_LEASE_S is stale. A stale lock is replaced only at the generation it was read at, so of two
    processes taking it over, one wins; a holder that finds its lock taken over (it was cut off for longer
    than the lease) stops at once rather than write beside the new one. Every request rides out the
    storage's weather (data.patiently): an outage shorter than the lease delays a renewal, and one longer
    than the lease loses the lock only if another process took it meanwhile.

    With several processes, process 0 takes the lock for the job and the others check that it is theirs. A
    directory no one can write to (a read-only mount, or a bucket this account may only read: 403) needs no
    lock: reading it is safe, and whatever would write there is refused then, in one line."""

    held_here: list["RunLock"] = []  # the locks this process holds (release_all)

    def __init__(self, run_dir):
        self.run_dir = _absolute(run_dir)
        self.path, self.remote = data.join(self.run_dir, "lock"), data.is_url(self.run_dir)
        self.held = self.generation = None
        self.renewing, self.renewer = threading.Event(), None

    def __enter__(self):
        try:
            return self._enter()
        except BaseException:  # a signal while it was taken, or a peer's refusal: no lock of ours left behind
            self.release()
            raise

    def _enter(self):
        from jax.experimental import multihost_utils

        many = jax.process_count() > 1
        job = f"{os.getpid()}-{os.urandom(4).hex()}"  # one job: process 0's name for it, sent to all
        if many:
            job = bytes(multihost_utils.broadcast_one_to_all(np.frombuffer(job.encode().ljust(32), np.uint8)))
            job = job.decode().strip()
        error = None
        if jax.process_index() == 0:
            try:
                self._take(job)
            except RunDirError as e:  # every process stops, not only process 0
                error = e
        # 0: process 0 could not take it; 1: it holds the lock; 2: none is needed (nothing may be written)
        outcome = 0 if error else 1 if self.held else 2
        if many:
            outcome = int(multihost_utils.broadcast_one_to_all(np.int32(outcome)))
        if outcome == 0:
            raise error or RunDirError(f"{self.run_dir}: process 0 could not take the run directory's lock")
        if many and outcome == 1 and (self._read()[0] or {}).get("job") != job:
            raise RunDirBusy(
                f"{self.path} does not hold this job's lock: is {self.run_dir} on storage that every host "
                "shares?"
            )
        return self

    def __exit__(self, kind, error, tb):
        """Released. While an error stops the process, it stays the one named: a release that fails too is an
        `also:` line. And where that error is the storage giving up, the release is tried once, without the
        patience, which was just spent: the stop takes one patience, not two (a lock left so is taken over by
        the next start: at once on this host, on another once its lease is past)."""
        if error is None:
            self.release()
            return
        try:
            with data.tried_once() if data.transient_answer(error) else contextlib.nullcontext():
                self.release()
        except Exception as e:
            print(
                f"also: {self.path} not released ({data.transient_answer(e) or e}); the next start takes it over",
                file=sys.stderr,
            )

    def release(self) -> None:
        """Stop renewing the lock, and remove it if it is still ours (not taken over)."""
        if self.renewer is not None:  # stopped, and its renewal in flight finished: the generation is final
            self.renewing.set()
            if self.renewer.is_alive():  # not yet, where a signal cut its start short: it sees `renewing` set
                self.renewer.join()
        if self.held and self._read()[0] == self.held:  # still ours: not taken over
            data.remove(self.path, self.generation if self.remote else None)
        self.held = None
        if self in RunLock.held_here:
            RunLock.held_here.remove(self)

    @classmethod
    def release_all(cls) -> None:
        """Release every lock this process holds: for a process about to end at once (os._exit), whose
        main thread, the one in the `with`, cannot (StepWatchdog, Preemption's backstop)."""
        for lock in list(cls.held_here):
            lock.release()

    def _read(self) -> tuple[dict | None, int | None]:
        """The lock's holder (None: no lock, or one cut short) and, on gs://, the generation it was read at."""
        if self.remote:
            text, generation = data.read_versioned(self.path)
        else:
            text, generation = (
                (Path(self.path).read_bytes(), None) if os.path.isfile(self.path) else (None, None)
            )
        try:
            return (json.loads(text) if text else None), generation
        except json.JSONDecodeError:
            return None, generation

    def _take(self, job: str) -> None:
        if not self._writable():  # no process can write here, so none needs the lock
            return
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": _start_time(os.getpid()),
            "job": job,
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "renewed": time.time(),
        }
        seen = 0  # the lock there is to replace: 0, none; else a stale one, as read (its generation on gs://)
        for _ in range(3):
            self.held = me  # before the write: a signal midway (Preempted) finds a lock of ours to remove
            try:
                taken = self._put(me, seen)
            except data.StorageRefused:  # a bucket this account may only read: as a read-only mount
                self.held = None
                return
            if taken:
                RunLock.held_here.append(self)
                if self.remote:
                    self.renewer = threading.Thread(target=self._renew_until_released, daemon=True)
                    self.renewer.start()
                return
            self.held = None
            holder, generation = self._read()
            if holder and not self._stale(holder, me):
                raise RunDirBusy(self._busy(holder, me))
            seen = generation if self.remote else "stale"  # (gone since: generation None, look again)
        raise RunDirBusy(f"{self.run_dir}: could not take {self.path}; another process keeps taking it")

    def _writable(self) -> bool:
        """Whether the run directory can be written (made here, where it is a new local one)."""
        if self.remote:  # a bucket this account may only read is found where the lock is created
            return True
        if os.path.exists(self.run_dir) and not os.path.isdir(self.run_dir):
            raise RunDirError(
                f"--run_dir {self.run_dir} is a file; expected a directory (or a path to create one at)"
            )
        try:
            os.makedirs(self.run_dir, exist_ok=True)
        except OSError as e:
            raise RunDirError(f"--run_dir {self.run_dir}: cannot create it ({e.strerror or e})") from None
        return os.access(self.run_dir, os.W_OK)

    def _put(self, me: dict, seen) -> bool:
        """Write the lock naming `me` where there is none (`seen` 0) or the stale one `seen` is still there;
        False if another is there: of two processes, one wins. Locally the stale lock is set aside by a rename
        (one process does it) and the lock created only if absent (O_EXCL). On gs:// the object is written only
        at the generation seen (0: none), a single request that replaces a stale lock with no moment between."""
        text = json.dumps(me)
        if self.remote:
            try:
                generation = data.replace(self.path, text, seen) if seen else data.create(self.path, text)
            except data.StorageRefused:
                raise
            except data.StorageError as e:  # no such bucket, say
                raise RunDirError(f"--run_dir {self.run_dir}: cannot create {self.path} ({e})") from None
            self.generation = generation
            return generation is not None
        if seen:
            stale = f"{self.path}.stale-{os.getpid()}"
            with contextlib.suppress(FileNotFoundError):
                os.replace(self.path, stale)
                os.remove(stale)
        return data.create(self.path, text) is not None

    def _stale(self, holder: dict, me: dict) -> bool:
        """Whether the holder is gone: its process, on this host; on gs://, a lease not renewed in time."""
        if holder["host"] == me["host"]:
            return _start_time(holder["pid"]) != holder["started"]
        return self.remote and time.time() - holder.get("renewed", 0) > LOCK_LEASE_S

    def _busy(self, holder: dict, me: dict) -> str:
        where = "" if holder["host"] == me["host"] else f" on host {holder['host']}"
        lease = ""
        if self.remote and holder["host"] != me["host"]:
            ago = time.time() - holder.get("renewed", 0)
            lease = f", renewed {ago:.0f} s ago: taken over once not renewed for {LOCK_LEASE_S} s"
        return (
            f"{self.run_dir} is in use by process {holder['pid']}{where} (since {holder['since']}{lease}); "
            f"wait for it, use another --run_dir, or, if that process is gone, remove {self.path}"
        )

    def renew(self) -> None:
        """Renew a gs:// lock's lease, at the generation it was last written at; RunDirBusy if another process
        has taken it over since."""
        self.held = dict(self.held, renewed=time.time())
        generation = data.replace(self.path, json.dumps(self.held), self.generation)
        if generation is None:
            raise RunDirBusy(
                f"{self.path} was taken over by another process (this one did not renew it for "
                f"{LOCK_LEASE_S} s): stopping rather than write beside it"
            )
        self.generation = generation

    def _renew_until_released(self) -> None:
        """The lease, renewed in the background until __exit__. A renewal that fails (the storage out for
        longer than the patience) is said and tried again; a lock taken over ends the process at once (exit 1):
        two writers would corrupt the run."""
        while not self.renewing.wait(LOCK_RENEW_S):
            try:
                self.renew()
            except RunDirBusy as e:
                print(f"error: {e}", file=sys.stderr, flush=True)
                os._exit(1)
            except (data.StorageUnavailable, data.StorageError) as e:  # the next renewal may succeed
                print(f"warning: could not renew {self.path} ({e}); trying again", file=sys.stderr)


def _start_time(pid: int) -> str | None:
    """When process `pid` started (Linux clock ticks since boot), or None if there is no such process: a
    process id reused by a later process does not look like the lock's holder."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except FileNotFoundError:
        return None
    except OSError:  # no /proc (not Linux): whether the process exists is all that can be told
        try:
            os.kill(pid, 0)
            return "alive"
        except ProcessLookupError:
            return None


@contextlib.contextmanager
def none_left_if_stopped(run_dir):
    """A start that stops before it writes a file (e.g. a damaged --init_from step, found only as it is read,
    under the lock) leaves no run directory: the folders this start made for it, locally, are removed once
    the lock is released, those of them that are still empty, by process 0 (the lock's taker). A folder that
    was there before is kept, and so is any holding a file. (A bucket has no folders: its run directory is
    gone with its last object.)"""
    made = None if data.is_url(run_dir) or jax.process_index() else _absolute(run_dir)
    while made and not os.path.exists(os.path.dirname(made)):  # the highest folder this start makes
        made = os.path.dirname(made)
    if made and os.path.exists(made):
        made = None
    try:
        yield
    except BaseException:
        for folder, _, _ in os.walk(made, topdown=False) if made else ():  # the deepest first
            if not os.listdir(folder):
                os.rmdir(folder)
        raise


def write_run_files(run_dir: str, config: dict, tokenizer: str, tokenizer_path: str | None) -> None:
    """A run was accepted: its config is the run directory's now, and so is the tiny tokenizer, if the run
    has one (token files made elsewhere may come without it), which `ckpt.py to-hf` ships with the weights."""
    if jax.process_index() != 0:
        return
    try:
        data.write_file(data.join(run_dir, "config.json"), json.dumps(config, indent=2))
        tiny = data.tiny_tokenizer_file(tokenizer_path)
        if tokenizer == "tiny" and os.path.exists(tiny):
            data.write_file(data.join(run_dir, "tokenizer.json"), Path(tiny).read_text())
    except OSError as e:
        raise _unwritable(run_dir, e) from e


def autotuned_gemms(run_dir, device, compile_step, say=print) -> None:
    """On a GPU under deterministic ops: GEMMs that are the autotuned ones, the same in every process and at
    every restart (why: shard.py, above autotune_name). A run's first start on a kind of GPU compiles the
    step once more, tuned (`compile_step(options)`), and keeps XLA's choices in RUN_DIR/autotune/ (one file
    per GPU kind and jaxlib: shard.autotune_name); this process holds them already, and every later start
    loads the file. Call before the step first compiles. A file XLA cannot load stops the run, naming it."""
    if device.platform != "gpu":
        return
    kept = data.join(run_dir, "autotune", shard.autotune_name(device))
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, "autotune.textproto")  # XLA reads and writes local files only
        if data.exists(kept):
            data.write_file(local, data.read_bytes(kept))
            try:
                shard.load_autotuning(local, device)
            except jax.errors.JaxRuntimeError as e:
                raise RunDirError(
                    f"{kept}: XLA cannot load these GEMM choices ({_cause(e)}); remove the file and the next "
                    "start tunes afresh (the step's kernels may then differ from the run's so far)"
                ) from e
            say(f"GEMM autotuning: XLA's choices loaded from {kept}")
            return
        say(f"GEMM autotuning: compiling the step once more to tune it, for {kept} ...")
        compile_step(shard.tuning_options(local))
        tuned = os.path.exists(local)  # on a GPU; a compile-only target tunes nothing
        if tuned and jax.process_index() == 0:
            data.write_file(kept, data.read_bytes(local))


def recorded_fit(run_dir, made_for: dict, search, say=print) -> tuple[int, str]:
    """The fit search's choice, (microbatches, remat policy), as RUN_DIR/fit.json records it where it was made
    for `made_for` (the devices, the compiler and the flags it depends on); else `search()`'s, recorded there
    (by process 0) over any record made for something else, which is said with what changed."""
    path = data.join(run_dir, "fit.json")
    made_for = json.loads(json.dumps(made_for))  # as the file holds it: tuples as lists
    try:
        record = json.loads(data.read_text(path)) if data.exists(path) else None
    except json.JSONDecodeError as e:  # edited by hand: a choice not to be trusted
        say(f"fit: {path} is not JSON ({e}); searching again")
        record = None
    if record is not None and record.get("made_for") == made_for:
        n_micro, remat = record["n_micro"], record["remat"]
        say(f"fit: {n_micro} microbatch(es), remat {remat}, as {path} records for these devices and flags")
        return n_micro, remat
    if record is not None:
        was = record.get("made_for", {})
        changed = ", ".join(k for k in sorted(made_for.keys() | was.keys()) if made_for.get(k) != was.get(k))
        say(f"fit: {path} was made for other {changed}; searching again")
    n_micro, remat = search()
    if jax.process_index() == 0:
        chosen = dict(n_micro=n_micro, remat=remat, made_for=made_for)
        try:
            data.write_file(path, json.dumps(chosen, indent=2))
        except OSError as e:
            raise _unwritable(run_dir, e) from e
    return n_micro, remat


def log_error(run_dir, what: str, e: BaseException) -> None:
    """Append the full story of error `e` (its traceback, causes included) to RUN_DIR/log.txt, under `what`
    and the time: the one-line message a user sees summarises it. Process 0 writes; a log that cannot be
    written is said in a line, never raised over the error being reported."""
    if jax.process_index() != 0:
        return
    story = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {what}:\n{format_traceback(e)}\n"
    try:
        data.append(data.join(run_dir, "log.txt"), story)
    except Exception as failed:  # said, never raised over the error being reported
        print(f"also: could not write {data.join(run_dir, 'log.txt')}: {failed}", file=sys.stderr)


# One traceback formatted at a time, whichever thread: CPython 3.11 places a frame's ^^^ markers with
# ast.parse, whose state all threads share, and two at once can fail with "SystemError: AST constructor
# recursion depth mismatch" (python/cpython#106905). Orbax's late reports come on TensorStore's threads,
# while this one may be logging the error they follow. Reentrant: a report may come from a finalizer that
# the garbage collector runs inside a formatting.
_FORMATTING = threading.RLock()


def format_traceback(e: BaseException) -> str:
    with _FORMATTING:
        return "".join(traceback.format_exception(e))


@contextlib.contextmanager
def errors_logged(run_dir, unless: tuple = ()):
    """Log (log_error) every error that stops the run inside, and let it go on: where RUN_DIR holds a run
    (its config.json; nothing is created to hold a log, and a first run refused before it starts leaves the
    directory as it found it), and not for `unless` (bad usage), a RunDirError (a directory this process
    may not write to) nor an outage of the storage (the log is there too: the line said is the story)."""
    try:
        yield
    except Exception as e:
        quiet = (RunDirError, data.StorageUnavailable, *unless)
        try:
            if not isinstance(e, quiet) and data.exists(data.join(run_dir, "config.json")):
                log_error(run_dir, "the run stopped", e)
        except Exception as failed:  # looking for config.json: said, never raised over the error reported
            print(f"also: {failed}", file=sys.stderr)
        raise


class Preempted(BaseException):
    """A preemption ends the run here (Preemption says where). A BaseException, as KeyboardInterrupt: no
    `except Exception` takes it for a failure (a checkpoint being read is not set aside for it, nor is it
    logged as the run's error)."""


# Before the first step, how long a signal waits for the main thread to run its handler before the process
# ends without it: far longer than any pause between two lines of Python, far shorter than XLA's compile of a
# large model (minutes in C++, where Python runs no handler) or the 30 s a preemptible VM is given.
BACKSTOP_S = 3.0


class Preemption:
    """What a SIGTERM or SIGINT (a preemption, Ctrl-C) stops, and how soon; each way exits 0. A second signal
    exits at once, 128 + its number (a checkpoint counts only once Orbax has written its commit marker, so the
    last committed one is never harmed).

    - Before the first step (restore, fit search, compile, the first batch): at once. The handler raises
      Preempted, which releases the lock on its way out; nothing a later start needs is half-written then
      (files are written beside and renamed, objects whole). Where the main thread runs no Python (XLA
      compiling), a thread ends the process after BACKSTOP_S instead, the lock released first.
    - In a step: the loop saves it at its boundary (requested) and exits.
    - In an evaluation: at its next batch (between_batches raises Preempted); the loop saves the step, and the
      next start runs the evaluation first.
    - During a save: the save completes, then the loop exits at its next wait for data.
    - In a wait for data (waiting): at once; the loop saves the newest step done, if not saved yet.

    With several processes, JAX's preemption service takes the signal (a Python handler would silently turn
    it off) and agrees a sync point with every process: a count of the calls to `reached`, which every
    process makes in the same order (each step boundary, each evaluation batch). So all stop at the same step
    boundary or evaluation batch. A start, a compile or a wait for data is not cut short there: the run stops
    at the first step boundary or evaluation batch after it."""

    installed: "Preemption | None" = None  # the one in force: signals are the process's

    def __enter__(self):
        self.signals, self.calls, self.started, self.in_wait = 0, 0, False, False
        self.before, self.watcher, self.heard = {}, None, threading.Event()
        if jax.process_count() == 1:
            self.before = {s: signal.signal(s, self.on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
            self._watch_the_start()
        Preemption.installed = self
        return self

    def __exit__(self, *exc):
        Preemption.installed = None
        for s, handler in self.before.items():  # the caller's handlers again (a test, a notebook)
            signal.signal(s, handler)
        if self.watcher is not None:
            signal.set_wakeup_fd(self.wakeup_before)
            os.write(self.wake[1], b"\0")  # the watcher's end
            self.watcher.join()
            for fd in self.wake:
                os.close(fd)

    def on_signal(self, signum, frame):
        self.signals += 1
        self.heard.set()
        if self.signals > 1:
            os._exit(128 + signum)
        if not self.started:
            print(f"\nsignal {signum}: exiting before the first step, nothing to save", flush=True)
            raise Preempted(signum)
        if self.in_wait:
            print(
                f"\nsignal {signum}: in a wait for data; saving the newest step done, then exiting",
                flush=True,
            )
            raise Preempted(signum)
        print(
            f"\nsignal {signum}: saving at the next step boundary (or evaluation batch), then exiting",
            flush=True,
        )

    def requested(self) -> bool:
        """At a step boundary, every step: whether to save the step and exit. The first ends the start."""
        self.started = True
        return self.reached()

    def reached(self) -> bool:
        """Whether a preemption stops the run at this call: one at each step boundary and each evaluation
        batch, on every process in the same order (the sync point JAX's preemption service agrees is a count
        of these calls)."""
        self.calls += 1
        if self.signals or jax.process_count() == 1:
            return self.signals > 0
        from jax.experimental import multihost_utils

        try:
            return multihost_utils.reached_preemption_sync_point(self.calls)
        except RuntimeError:  # JAX's preemption service turned off (jax_enable_preemption_service)
            return False

    @contextlib.contextmanager
    def waiting(self):
        """A wait for data, which a signal ends at once (Preempted; one that came before, on entry)."""
        self.in_wait = True
        try:
            if self.signals:
                raise Preempted
            yield
        finally:
            self.in_wait = False

    def _watch_the_start(self) -> None:
        """Python runs a signal's handler in the main thread, between two bytecodes: not during XLA's compile,
        which releases the GIL but holds the main thread for minutes at scale. Python's C handler also writes
        the signal's number to the wakeup fd from whichever thread took it, so a thread reading it learns of
        the signal at once."""
        self.wake = os.pipe()
        os.set_blocking(self.wake[1], False)  # as set_wakeup_fd requires
        self.wakeup_before = signal.set_wakeup_fd(self.wake[1], warn_on_full_buffer=False)
        self.watcher = threading.Thread(
            target=self._end_a_stuck_start, name="preemption watcher", daemon=True
        )
        self.watcher.start()

    def _end_a_stuck_start(self) -> None:
        """Before the first step, a signal whose handler has not run within BACKSTOP_S (the main thread is in
        a compile, or another call that runs no Python and writes no file of the run) ends the process here:
        the lock released, exit 0."""
        while (got := os.read(self.wake[0], 1)) != b"\0":
            if got[0] not in (signal.SIGTERM, signal.SIGINT) or self.started or self.heard.wait(BACKSTOP_S):
                continue
            print(
                f"\nsignal {got[0]}: exiting before the first step (it compiles), nothing to save", flush=True
            )
            RunLock.release_all()
            os._exit(0)


def between_batches() -> None:
    """Between two batches of an evaluation: raise Preempted where a preemption stops the run here (every
    process calls it at the same batches: Preemption.reached). Outside a run (a benchmark), nothing."""
    if Preemption.installed is not None and Preemption.installed.reached():
        raise Preempted


def waiting_for_data():
    """The context a wait for a batch runs in (data.Prefetcher): where a run is under way, one that a signal
    ends at once (Preemption.waiting)."""
    return contextlib.nullcontext() if Preemption.installed is None else Preemption.installed.waiting()


# ---------------------------------------------------------------------------------------------------------
# The metrics log (metrics.jsonl, TensorBoard, W&B) and the plots.


# Our metrics row's keys under the names OLMo-core logs them (v3.0.0), so a W&B run overlays AI2's curves:
# train/common.py (TRAIN_CE_LOSS_METRIC, OPTIM_GRAD_NORM_METRIC), train/train_module/transformer/
# train_module.py ("Z loss", "LR (group i)", "step skipped", "masked instances (%)") and
# train/callbacks/speed_monitor.py (throughput/...). Its throughput is per device (TPS: a rank's tokens
# over the ranks that share them), so ours is divided by the devices; its MFU is a percentage, its masked
# instances a proportion of the batch.
OLMO_CORE_NAMES = {
    "ce_loss": "train/CE loss",
    "z_loss": "train/Z loss",  # with its multiplier, as OLMo-core's
    "grad_norm": "optim/total grad norm",
    "lr": "optim/LR (group 0)",
    "skipped": "optim/step skipped",
    "filtered": "train/masked instances (%)",
    "tokens_per_s": "throughput/device/TPS",
    "mfu": "throughput/device/MFU",
    "tokens": "throughput/total tokens",
    "data_wait_s": "throughput/device/data loading (s)",
}


def olmo_core_metrics(row: dict, devices: int, batch: int) -> dict:
    """A metrics row as OLMo-core logs it; keys already in its form (eval/lm/..., eval/downstream/...) pass
    unchanged. Left out: step (W&B's own), loss (CE + Z: OLMo-core logs the two), eval_loss and eval_ppl
    (the first set's eval/lm/... again) and batch_hash (not a number)."""
    scale = dict(tokens_per_s=1 / devices, mfu=100, filtered=1 / batch)
    out = {k: v for k, v in row.items() if "/" in k}
    out |= {name: row[k] * scale.get(k, 1) for k, name in OLMO_CORE_NAMES.items() if row.get(k) is not None}
    if "lr" in row:  # OLMo 3's two groups (embeddings without weight decay, the rest) share the schedule
        out["optim/LR (group 1)"] = row["lr"]
    if row.get("ce_loss", math.inf) < 10:  # trainer.py adds train/PPL below a CE of 10
        out["train/PPL"] = math.exp(row["ce_loss"])
    return out


def wandb_records(path: Path):
    """The records (wandb's Record protos) of a W&B transaction log, run-ID.wandb: LevelDB's log format, a
    7-byte file header, then 32 KiB blocks of chunks (CRC, length, type). A tail torn by a kill ends it."""
    from wandb.proto import wandb_internal_pb2

    raw, pos, record = path.read_bytes(), 7, b""
    while pos + 7 <= len(raw):
        if (left := 32768 - pos % 32768) < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, size, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        if kind == 0 or pos + 7 + size > len(raw):
            return
        record, pos = record + raw[pos + 7 : pos + 7 + size], pos + 7 + size
        if kind in (1, 4):  # a full record, or a fragmented one's last chunk
            yield wandb_internal_pb2.Record.FromString(record)
            record = b""


@dataclasses.dataclass(frozen=True)
class WandbRun:
    """Where --wandb logs (entity and credentials: wandb's environment), and what makes our rows OLMo-core's."""

    project: str
    name: str | None  # None: W&B names it
    config: dict
    devices: int
    batch: int  # instances per step


METRICS_FLUSH_S = 10.0  # on gs://, rows are stored at most this often (and before each checkpoint)


class MetricsLog:
    """RUN_DIR/metrics.jsonl: one row per train step, one per evaluated step (its keys eval_loss, eval/...), as
    of the checkpoint the run continues from; optionally TensorBoard and Weights & Biases too. Only process 0
    writes.

    A local file has each row as it comes. A Cloud Storage object cannot be appended to, so on gs:// rows are
    held and stored a batch at a time by data.append (uploaded, then composed onto the end of the object on the
    server: no row is sent twice, and readers see the file whole): every METRICS_FLUSH_S seconds at most (GCS
    takes about one write a second to an object), before each checkpoint (flush, which train.py's save calls)
    and at close. A kill -9 so loses only rows past the newest checkpoint, which the resume takes again, and
    rewind drops the rows stored past it: after kills and resumes the file holds one row per step, as a local
    one does. A run's `goodput` (Goodput) is stored at close, and its account is W&B's run summary."""

    def __init__(self, run_dir, lead: bool, tensorboard: bool, wandb: WandbRun | None = None, goodput=None):
        self.run_dir, self.lead = _absolute(run_dir), lead
        self.path = data.join(self.run_dir, "metrics.jsonl")
        self.tensorboard, self.wandb, self.goodput = tensorboard, wandb, goodput
        self.file = self.tb = self.wb = None
        self.opened, self.pending, self.flushed = False, [], time.monotonic()
        self.wb_held = -1  # the last step the W&B run holds

    def rewind(self, step: int) -> int:
        """Drop the rows past `step` (the steps about to be taken again): atomically, the old file kept until
        the new one is complete. A torn last line goes too. Returns how many train rows went: the steps
        earlier starts took past `step` (the goodput's retaken; 0 on the other processes)."""
        if not self.lead:
            return 0
        for part in data.objects(f"{self.path}.part-") if data.is_url(self.path) else ():
            data.remove(part)  # an upload a kill left before it was composed: rows past the checkpoint
        if not data.exists(self.path):
            return 0
        rows, text, dropped = [], data.read_text(self.path), 0
        for line in text.splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
            if row["step"] <= step:
                rows.append(line + "\n")
            else:
                dropped += "loss" in row
        if "".join(rows) == text:  # nothing to drop: a finished run on a read-only mount writes nothing
            return 0
        try:
            data.write_file(self.path, "".join(rows))
        except OSError as e:
            raise _unwritable(self.run_dir, e) from e
        return dropped

    def evaluated(self, step: int) -> bool:
        """Whether the file holds the run's evaluation row of step `step` (an --eval_only row is not the
        run's). Process 0 reads it; False on the others."""
        if not self.lead or not data.exists(self.path):
            return False
        for line in data.read_text(self.path).splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a line cut short by a kill
                row = json.loads(line)
                if row["step"] == step and "eval_only" not in row and any(k.startswith("eval/") for k in row):
                    return True
        return False

    def open(self) -> None:
        """Open what the rows go to: at the first row, or before (a run about to train opens it before its
        step compiles, so that W&B refusing it, say for want of a key, costs no compilation)."""
        if not self.lead or self.opened:
            return
        if self.wandb:  # first: it sends the rows already written that W&B lacks
            self.open_wandb()
        try:
            self.file = None if data.is_url(self.path) else open(self.path, "a")  # noqa: SIM115 - close()
        except OSError as e:
            raise _unwritable(self.run_dir, e) from e
        if self.tensorboard:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(data.join(self.run_dir, "tb"))
        self.opened = True

    def write(self, row: dict) -> None:
        if not self.lead:
            return
        self.open()
        self.pending.append(json.dumps(row) + "\n")
        if self.file is not None or time.monotonic() - self.flushed >= METRICS_FLUSH_S:
            self.flush()
        for k, v in row.items() if self.tb else ():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                self.tb.add_scalar(k, v, row["step"])
        self.send(row)

    def open_wandb(self) -> None:
        """Continue the run directory's W&B run (its id in RUN_DIR/wandb_id) and send it the rows it lacks.
        W&B history cannot be rewritten, and a killed process loses what wandb had not yet flushed, so what
        the W&B run holds is asked of W&B itself: the server (the step of the next log) or, offline, the run's
        transaction logs in RUN_DIR/wandb. Rows at steps it holds are never sent again (a step retaken after
        a resume keeps its first values there: the same numbers, as a resume is exact, but for the
        throughput); rows it lost are sent from metrics.jsonl."""
        import wandb

        id_file, cfg = data.join(self.run_dir, "wandb_id"), self.wandb
        run_id = data.read_text(id_file).strip() if data.exists(id_file) else None  # None: W&B makes one
        # wandb writes its own files with local file calls: for a gs:// run they stay on this host, in a
        # temporary folder named after the run (the W&B run itself lives on W&B's server).
        own = Path(self.run_dir)
        if data.is_url(self.run_dir):
            own = Path(tempfile.gettempdir()) / "olmo3-jax-wandb" / self.run_dir.partition("://")[2]
            own.mkdir(parents=True, exist_ok=True)
        self.wb = wandb.init(
            project=cfg.project, name=cfg.name, id=run_id, resume="allow", dir=own, config=cfg.config
        )
        run_id = self.wb.id
        data.write_file(id_file, run_id)
        if self.wb.offline:
            logs = own.glob(f"wandb/*-{run_id}/run-{run_id}.wandb")
            held = (r.history.step.num for log in logs for r in wandb_records(log) if r.HasField("history"))
            self.wb_held = max(held, default=-1)
        else:
            self.wb_held = self.wb.step - 1
        for line in data.read_text(self.path).splitlines() if data.exists(self.path) else ():
            self.send(json.loads(line))

    def send(self, row: dict) -> None:
        """One row to W&B at its step (a step's train and eval rows make one W&B row), unless W&B holds it."""
        if self.wb is not None and row["step"] > self.wb_held:
            self.wb.log(olmo_core_metrics(row, self.wandb.devices, self.wandb.batch), step=row["step"])

    def flush(self) -> None:
        """Store the rows held back (on gs://; a local file has each row as it comes)."""
        if not self.pending:
            return
        text, self.pending = "".join(self.pending), []
        try:
            if self.file is not None:
                self.file.write(text)
                self.file.flush()
            else:
                data.append(self.path, text)
        except OSError as e:  # a full disk, a bucket that refuses: the run stops in one line
            raise RunDirError(f"{self.path}: could not store the metrics rows ({e.strerror or e})") from e
        self.flushed = time.monotonic()

    def close(self) -> None:
        if self.lead:
            self.flush()
        if self.goodput is not None:  # the start's record as of its end; W&B's summary: the run's account
            self.goodput.refresh()
            if self.wb is not None and self.goodput.stored is not None:
                self.wb.summary.update(goodput_scalars(goodput_account(self.goodput.records())))
        for f in (self.file, self.tb):
            if f is not None:
                f.close()
        if self.wb is not None:
            self.wb.finish()


# The goodput account: where a run's wall time went, start by start, from the run directory alone
# (RUN_DIR/goodput.jsonl, `ckpt.py goodput`).

# What a start times itself, each as `<cause>_s` in its record: from the process's start to its run directory
# opened (imports, devices, the data's plan, the lock); the restore (or init); compiling, before step 1 (the
# fit search, GEMM tuning) and in the first step beyond a typical step's time; the waits for batches; the
# evaluations; the time checkpoint saves kept the loop waiting.
TIMED = ("start", "restore", "compile", "data_wait", "evaluation", "checkpoint")
# The account's badput: those, the seconds of steps trained again after a failure, the downtime from a start's
# last record to the next start's process start, and the rest (the run's files, W&B's start, the plots, ...).
BADPUT = (*TIMED, "retaken", "down", "other")
GOODPUT_FLUSH_S = METRICS_FLUSH_S  # a start's record is stored at most this often (and at each checkpoint)
IMPORTED_AT = time.time()  # process_start's answer where /proc cannot say


def process_start() -> float:
    """When this process started, on time.time()'s clock: Linux's /proc/self/stat start time (clock ticks
    since boot) against the boot-time clock, to 10 ms; elsewhere, when ckpt.py was imported."""
    ticks = _start_time(os.getpid())
    if ticks is None or not ticks.isdigit() or not hasattr(time, "CLOCK_BOOTTIME"):
        return IMPORTED_AT
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - int(ticks) / os.sysconf("SC_CLK_TCK"))


class Goodput:
    """This start's account: its seconds by cause (TIMED), the step it resumed from and the train rows of
    earlier starts it dropped past it, its steps and their seconds. Stored in RUN_DIR/goodput.jsonl, one line
    per start that trains: the file is written whole with this start's line in place of its last (readers see
    it before or after, never torn; on gs:// one small object), so a kill -9 leaves it as of the last store:
    before step 1 (restore, compile), at the first step, at each checkpoint, every GOODPUT_FLUSH_S, at the
    end. Only process 0 writes (`writes`). train.py feeds it: made as the run directory opens (the start ends),
    restored() once the restore is done (compiling begins), the first store() as set_up ends, stepped() with
    each step's numbers, timed() around each evaluation; Checkpoints counts its own blocking."""

    def __init__(self, run_dir, writes: bool, checkpoints: Checkpoints):
        self.run_dir, self.writes, self.checkpoints = _absolute(run_dir), writes, checkpoints
        self.path = data.join(self.run_dir, "goodput.jsonl")
        self.earlier = goodput_records(self.path) if writes and data.exists(self.path) else []
        # One writer at a time (the lock): a start began no earlier than the previous one's last record (a
        # second run in one process, as tests run train.py, began there).
        began = max([process_start(), *(r["at"] for r in self.earlier)])
        self.record = dict(id=os.urandom(6).hex(), began=began, restored=0, dropped=0, last_step=0, steps=0)
        self.seconds = dict.fromkeys(TIMED, 0.0) | dict(start=time.time() - began)
        self.phase_began, self.timed_s = time.perf_counter(), 0.0  # the phase under way, what timed() took
        self.waits_s = self.trained_s = self.first_step_s = 0.0
        self.stored = None  # time.monotonic() of the last store; None: this start has not stored

    @contextlib.contextmanager
    def timed(self, cause: str):
        """The seconds inside are `cause`'s (and not the phase's under way)."""
        began = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - began
            self.seconds[cause] += spent
            self.timed_s += spent

    def _phase_ends(self, cause: str) -> None:
        """The phase under way ends: its seconds, less those timed() took in it, are `cause`'s."""
        now = time.perf_counter()
        self.seconds[cause] += now - self.phase_began - self.timed_s
        self.phase_began, self.timed_s = now, 0.0

    def restored(self, step: int, dropped: int) -> None:
        """The restore is done: the run resumes after `step` (0: a first start), having dropped `dropped`
        train rows of earlier starts past it from metrics.jsonl (MetricsLog.rewind). Compiling begins."""
        self._phase_ends("restore")
        self.record |= dict(restored=step, dropped=dropped, last_step=step)

    def stepped(self, step: int, clock: float, wait: float) -> None:
        """Step `step`'s numbers arrived, `clock` seconds into the loop's training time (Progress.clock:
        saves and evaluations left out), `wait` of them spent waiting for its batch."""
        self.waits_s += wait
        self.trained_s = clock - self.waits_s
        self.record |= dict(steps=self.record["steps"] + 1, last_step=step)
        if self.record["steps"] == 1:
            self.first_step_s = self.trained_s
        due = self.stored is None or time.monotonic() - self.stored >= GOODPUT_FLUSH_S
        if due or self.record["steps"] == 1:
            self.store()

    def store(self) -> None:
        """This start's line, as of now, into goodput.jsonl; the first store ends the compile phase."""
        if self.stored is None:
            self._phase_ends("compile")
        self.stored = time.monotonic()
        if not self.writes:
            return
        try:
            data.write_file(self.path, "".join(json.dumps(r) + "\n" for r in self.records()))
        except OSError as e:
            raise _unwritable(self.run_dir, e) from e

    def refresh(self) -> None:
        """Store again, if this start stores at all (it trains)."""
        if self.stored is not None:
            self.store()

    def records(self) -> list[dict]:
        """The earlier starts' records and this start's, as of now."""
        n = self.record["steps"]
        typical = (self.trained_s - self.first_step_s) / (n - 1) if n > 1 else 0.0
        compiling = max(0.0, self.first_step_s - typical)  # the first step's compile (all of it, alone)
        seconds = self.seconds | dict(data_wait=self.waits_s, checkpoint=self.checkpoints.blocked_s)
        seconds["compile"] += compiling
        own = self.record | dict(at=time.time(), steps_s=self.trained_s - compiling)
        return [*self.earlier, own | {f"{cause}_s": s for cause, s in seconds.items()}]


def goodput_records(path) -> list[dict]:
    """Each start's last line in a goodput.jsonl, in the order the starts began (a line that is not JSON, which
    no run writes, is passed over)."""
    if not data.exists(path):
        raise FileNotFoundError(f"{path} does not exist: a run writes it at each start that trains")
    last = {}
    for line in data.read_text(path).splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            record = json.loads(line)
            last[record["id"]] = record
    return sorted(last.values(), key=lambda r: r["began"])


def goodput_account(records: list[dict]) -> dict:
    """Where a run's wall time went, from its starts' records (goodput_records): the wall time from the first
    start's process start to the last record; the seconds of the steps kept, `goodput` their share of it; the
    seconds of each cause of badput (BADPUT), which with the kept ones sum to the wall time; the steps kept
    and retaken; and `starts`, each start's own, over its span: from the previous start's last record (its
    `down` first) to its own last record."""
    starts = [_span(record, before) for before, record in zip([None, *records], records)]
    _retaken(records, starts)
    wall, kept = (sum(s[key] for s in starts) for key in ("wall_s", "kept_s"))
    return dict(
        wall_s=wall,
        goodput=kept / wall if wall else 0.0,
        kept_s=kept,
        badput_s={cause: sum(s[f"{cause}_s"] for s in starts) for cause in BADPUT},
        steps_kept=sum(s["steps_kept"] for s in starts),
        steps_retaken=sum(s["steps_retaken"] for s in starts),
        starts=starts,
    )


def _span(record: dict, before: dict | None) -> dict:
    """A start's span: `down` since the previous start's last record, then its own seconds by cause, its
    steps' (all kept, until _retaken says otherwise) and the rest."""
    down = record["began"] - before["at"] if before else 0.0
    own = {f"{cause}_s": record[f"{cause}_s"] for cause in TIMED}
    other = record["at"] - record["began"] - sum(own.values()) - record["steps_s"]
    return dict(
        id=record["id"],
        began=record["began"],
        ended=record["at"],
        restored=record["restored"],
        last_step=record["last_step"],
        wall_s=down + record["at"] - record["began"],
        kept_s=record["steps_s"],
        **own,
        retaken_s=0.0,
        down_s=down,
        other_s=other,
        steps_kept=record["steps"],
        steps_retaken=0,
    )


def _retaken(records: list[dict], starts: list[dict]) -> None:
    """The steps trained again, their seconds moved from kept to retaken. A start's steps past the lowest
    step a later start resumed from were trained again. Those it took after its last record (before a kill)
    the next start counted, as the rows it dropped (restored + dropped: the last step the run directory
    holds); their seconds, at the start's mean step time, come out of the next start's `down`."""
    steps = sum(r["steps"] for r in records)
    mean_of_run = sum(r["steps_s"] for r in records) / steps if steps else 0.0
    resumed = math.inf  # the lowest step a later start resumed from
    for i in reversed(range(len(records))):
        record, span, after = records[i], starts[i], records[i + 1] if i + 1 < len(records) else None
        mean = record["steps_s"] / record["steps"] if record["steps"] else mean_of_run
        found = after["restored"] + after["dropped"] if after and after["dropped"] else 0  # by the next start
        last = max(record["last_step"], found)
        resumed = min(resumed, after["restored"] if after else math.inf)
        lost = max(0, last - max(record["restored"], resumed))
        recorded = min(lost, max(0, record["last_step"] - max(record["restored"], resumed)))
        span["kept_s"] -= recorded * mean
        span["retaken_s"] += recorded * mean
        span["steps_kept"], span["steps_retaken"] = last - record["restored"] - lost, lost
        if after:
            moved = min(starts[i + 1]["down_s"], (lost - recorded) * mean)
            starts[i + 1]["down_s"] -= moved
            starts[i + 1]["retaken_s"] += moved


def goodput_scalars(account: dict) -> dict:
    """An account as W&B's scalars: goodput/fraction, goodput/wall_s, goodput/steps_retaken and
    goodput/badput_<cause>_s."""
    out = {"goodput/fraction": account["goodput"], "goodput/wall_s": account["wall_s"]}
    out["goodput/steps_retaken"] = account["steps_retaken"]
    return out | {f"goodput/badput_{cause}_s": s for cause, s in account["badput_s"].items()}


def goodput_table(account: dict) -> str:
    """An account as `ckpt.py goodput` prints it: a line per start (when it began, its seconds by cause, its
    steps kept and retaken), the totals, and the goodput."""
    widths = {c: max(len(c), 6) for c in ("wall", "kept", *BADPUT)}
    lines = [
        f"{'start':>5} {'began':<14}" + "".join(f" {c:>{w}}" for c, w in widths.items()) + " kept/retaken"
    ]
    total = dict(account, began=None, **{f"{c}_s": account["badput_s"][c] for c in BADPUT})
    for name, s in [*((str(i), s) for i, s in enumerate(account["starts"], 1)), ("all", total)]:
        began = time.strftime("%m-%d %H:%M:%S", time.localtime(s["began"])) if s["began"] else ""
        cells = "".join(f" {s[f'{c}_s']:>{w}.1f}" for c, w in widths.items())
        lines.append(f"{name:>5} {began:<14}{cells} {s['steps_kept']}/{s['steps_retaken']}")
    lines.append(
        f"goodput {account['goodput']:.1%}: {account['kept_s']:.1f} s of steps kept in "
        f"{account['wall_s']:.1f} s of wall time (seconds; {account['steps_retaken']} steps trained again)"
    )
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files, no window
    import matplotlib.pyplot as plt

    return plt


def _metric_rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in data.read_text(data.join(run_dir, "metrics.jsonl")).splitlines()]


def _save_figure(fig, path: str, dpi: int) -> None:
    """A figure as a PNG file, local or in a bucket (savefig writes to bytes; the storage layer stores them)."""
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=dpi)
    data.write_file(path, png.getvalue())


def _name(run_dir) -> str:
    return str(run_dir).rstrip("/").rsplit("/", 1)[-1]


def plot_losses(run_dir) -> list[str]:
    """RUN_DIR/loss.png: the train loss and each held-out set's CE loss over the steps. Returns the curves'
    labels."""
    plt, rows = _pyplot(), _metric_rows(run_dir)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    held = dict.fromkeys(k for r in rows for k in r if k.startswith("eval/lm/") and k.endswith("/CE loss"))
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", lw=0.8)
    for key in held:  # each held-out set's curve, labelled as OLMo-core labels it
        label = key.removeprefix("eval/lm/").removesuffix("/CE loss")
        ax.plot(*zip(*[(r["step"], r[key]) for r in rows if key in r]), "o-", label=f"held-out {label}", ms=3)
    ax.set(xlabel="step", ylabel="loss (nats/token)", title=_name(run_dir))
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    _save_figure(fig, data.join(run_dir, "loss.png"), dpi=120)
    plt.close(fig)
    return [line.get_label() for line in ax.get_lines()]


def plot_downstream(run_dir) -> list[str]:
    """RUN_DIR/downstream.png, where the run evaluated downstream tasks: a panel per task, its own metric
    (ICLMetric's first, as train.py prints it) over the steps. Returns the panels' titles."""
    plt, rows = _pyplot(), _metric_rows(run_dir)
    firsts = {}  # task -> its first metric's key, in the row's order
    for key in (
        k for r in rows for k in r if k.startswith("eval/downstream/") and "(requests truncated)" not in k
    ):
        firsts.setdefault(key.removeprefix("eval/downstream/").rsplit(" (", 1)[0], key)
    if not firsts:
        return []
    columns = min(len(firsts), 6)
    n_rows = -(-len(firsts) // columns)
    fig, axes = plt.subplots(n_rows, columns, figsize=(2.6 * columns, 2.1 * n_rows), squeeze=False)
    for ax, (task, key) in zip(axes.flat, firsts.items()):
        ax.plot(*zip(*[(r["step"], r[key]) for r in rows if key in r]), "o-", ms=3)
        ax.set_title(f"{task}\n{key.rsplit(' (', 1)[1][:-1]}", fontsize=7)
        ax.tick_params(labelsize=6)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(firsts) :]:
        ax.axis("off")
    fig.suptitle(f"{_name(run_dir)}: downstream tasks over the steps", fontsize=9)
    fig.tight_layout()
    _save_figure(fig, data.join(run_dir, "downstream.png"), dpi=110)
    plt.close(fig)
    return [ax.get_title() for ax in axes.flat[: len(firsts)]]


def plot_goodput(run_dir, account: dict) -> list[str]:
    """RUN_DIR/goodput.png: a bar per start, its span's seconds stacked by cause (the steps kept first), the
    run's goodput in the title. Returns the causes drawn (those with any seconds)."""
    plt, starts = _pyplot(), account["starts"]
    fig, ax = plt.subplots(figsize=(8, 4))
    x, bottom, drawn = range(1, len(starts) + 1), [0.0] * len(starts), []
    for cause in ("kept", *BADPUT):
        heights = [s[f"{cause}_s"] for s in starts]
        if any(h > 0 for h in heights):
            ax.bar(x, heights, bottom=bottom, label=cause)
            bottom, drawn = [b + h for b, h in zip(bottom, heights)], [*drawn, cause]
    title = f"{_name(run_dir)}: goodput {account['goodput']:.1%} of {account['wall_s']:,.0f} s"
    ax.set(xlabel="start", ylabel="seconds", title=title, xticks=list(x))
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1, 1))
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    _save_figure(fig, data.join(run_dir, "goodput.png"), dpi=120)
    plt.close(fig)
    return drawn


# ---------------------------------------------------------------------------------------------------------
# The loop's instruments: the progress bar with its tokens/s, the step watchdog (--step_timeout) and the
# profiler (--profile). They time and trace the steps; only the trace (and a hang's stacks) is left on disk.


class Progress:
    """The progress bar, and tokens/s: the steps of the last 20 over the training time they took, on a clock
    that runs from before a step is dispatched to when its numbers arrive and stops while the run saves or
    evaluates (pause, resume), so that no step's rate counts those; waiting for data does count. The first
    step (after a start or a resume, so with the compilation) is timed alone, and later windows start after
    it. Times are taken where the loop reads a step's numbers, one step behind the dispatch: over a window,
    the steps' times add up to the time the window took. A `watchdog` (StepWatchdog) keeps the same time:
    each step's numbers beat it, and it stops while the run saves or evaluates."""

    def __init__(self, start: int, steps: int, tokens_per_step: int, watchdog: "StepWatchdog | None" = None):
        self.watchdog = watchdog
        lead = jax.process_index() == 0
        self.bar = tqdm(total=steps, initial=start, disable=not lead, unit="step", dynamic_ncols=True)
        self.tokens_per_step, self.rate = tokens_per_step, 0.0
        self.trained, self.since = 0.0, time.perf_counter()  # seconds trained before `since`, when it resumed
        self.times, self.first = deque([0.0], 21), True  # the clock at the window's start and at each step

    def clock(self) -> float:
        """Seconds spent training so far (saves and evaluations left out)."""
        return self.trained + (0.0 if self.since is None else time.perf_counter() - self.since)

    def tick(self, loss: float) -> float:
        """A step's numbers arrived: move the bar on, showing its loss. Returns tokens/s."""
        if self.watchdog:
            self.watchdog.beat()
        self.times.append(self.clock())
        elapsed = max(self.times[-1] - self.times[0], 1e-9)
        self.rate = self.tokens_per_step * (len(self.times) - 1) / elapsed
        if self.first:  # the compilation stays in the first step's rate alone
            self.times, self.first = deque([self.times[-1]], 21), False
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{self.rate:,.0f}")
        return self.rate

    def pause(self) -> None:
        self.trained, self.since = self.clock(), None
        if self.watchdog:
            self.watchdog.pause()

    def resume(self) -> None:
        self.since = time.perf_counter()
        if self.watchdog:
            self.watchdog.resume()

    def close(self) -> None:
        self.bar.close()
        if self.watchdog:
            self.watchdog.close()


# --step_timeout's default (train.py), in seconds: longer than the slowest step a real run takes, so that
# only a hang is taken for one. A step of the 7B recipe (512 x 8192 tokens) on one H200, or of the 32B's on one
# 8 x H200 host, is about 10 minutes of matmuls at 40% MFU, and the data wait before it may ride out a storage
# outage for --storage_patience (10 minutes). On a pod, whose step takes seconds, 15 minutes will do.
STEP_TIMEOUT_S = 1800

HUNG_EXIT = 124  # the exit status of a run the watchdog ended: timeout(1)'s, "out of time, start it again"

LAST_WORDS_S = 120  # the most a hung process spends on its stacks and its lock before it exits regardless


class StepWatchdog:
    """Ends a run in which no step finishes: a collective waiting on a stuck host, a wedged thread. JAX's
    heartbeats stop a run one of whose processes is gone, not one whose processes are all alive and waiting,
    and such a pod holds its chips until someone notices.

    A daemon thread watches a clock that restarts when a step's numbers arrive (beat) and stands still while
    the run saves or evaluates (pause; resume restarts it). It starts at the first beat: restoring, compiling
    and the first step (which compiles) are not timed. Past `timeout_s` on it, this process writes every
    thread's stack to stderr and to RUN_DIR/log.txt, releases the run directory's lock if it holds it, and
    exits HUNG_EXIT from this thread (os._exit: the main thread is the stuck one), for its supervisor to start
    it again; it resumes from the newest checkpoint. Every process has its own watchdog: a step stuck in one
    process holds the others in its collectives, each watchdog fires, and the processes exit together once
    every one has reported."""

    def __init__(self, timeout_s: float, run_dir: str):
        self.timeout_s, self.log = timeout_s, data.join(run_dir, "log.txt")
        host, pid = socket.gethostname(), os.getpid()
        self.process = f"process {jax.process_index()} of {jax.process_count()} ({host}, pid {pid})"
        self.deadline = None  # on time.monotonic(); None: the clock stands still
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="step watchdog", daemon=True)
        self.thread.start()

    def beat(self) -> None:
        """A step's numbers arrived: the next step has `timeout_s`."""
        self.deadline = time.monotonic() + self.timeout_s

    def pause(self) -> None:
        self.deadline = None

    def resume(self) -> None:
        self.beat()

    def close(self) -> None:
        self.closed.set()
        self.thread.join()

    def _watch(self) -> None:
        # A deadline only moves later or stops: waking at one that has moved is only a look too early.
        while not self.closed.wait(self._seconds_left()):
            deadline = self.deadline
            if deadline is not None and time.monotonic() >= deadline:
                self._end_the_run()

    def _seconds_left(self) -> float:
        deadline = self.deadline
        return self.timeout_s if deadline is None else max(deadline - time.monotonic(), 0.0)

    def _end_the_run(self) -> None:
        # Whatever the report waits on (a bucket that does not answer, a lock the stuck thread holds) delays
        # the exit by LAST_WORDS_S at most.
        backstop = threading.Timer(LAST_WORDS_S, os._exit, (HUNG_EXIT,))
        backstop.daemon = True
        backstop.start()
        said = f"no step finished in {self.timeout_s:g} s (--step_timeout)"
        self._report(f"{said}: a hang")
        backstop.cancel()
        self._wait_for_the_others()
        print(f"error: {said}; stacks in {self.log}; exiting {HUNG_EXIT} to be restarted", file=sys.stderr)
        sys.stderr.flush()
        os._exit(HUNG_EXIT)

    def _report(self, what: str) -> None:
        """Every thread's stack to stderr and log.txt, and the run directory's lock released (first: the
        restart this exit is for may come before a bucket has taken every host's stacks)."""
        report = (
            f"{time.strftime('%Y-%m-%d %H:%M:%S')} {self.process}: {what}. Every thread's stack, the most "
            f"recent call last:\n{thread_stacks()}\n"
        )
        print(report, file=sys.stderr, flush=True)
        try:
            RunLock.release_all()
        except Exception as e:  # said, never raised over the hang being reported
            print(f"also: could not release the run directory's lock: {e}", file=sys.stderr, flush=True)
        try:
            data.append(self.log, report)
        except Exception as e:
            print(f"also: could not write {self.log}: {e}", file=sys.stderr, flush=True)

    def _wait_for_the_others(self) -> None:
        """With several processes, wait until every one has reported, for `timeout_s` at most: once one
        process exits, JAX's coordination service stops all the others, where they stand (the stacks of a
        process still stuck in the collective would be lost). The others' watchdogs fire within a step of
        this one: their steps end together, in their collectives."""
        from jax._src import distributed

        client = distributed.global_state.client
        if client is None or jax.process_count() == 1:
            return
        try:
            client.wait_at_barrier("olmo3-jax step watchdog", int(self.timeout_s * 1000))
        except Exception as e:  # a process that never reports (its watchdog thread stuck too)
            print(f"also: not every process reported within {self.timeout_s:g} s ({e})", file=sys.stderr)


def thread_stacks() -> str:
    """Every thread's Python stack, under its name, the most recent call last (as a traceback)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    with _FORMATTING:
        return "\n".join(
            f"thread {names.get(ident, ident)!r}:\n" + "".join(traceback.format_stack(frame))
            for ident, frame in sys._current_frames().items()
        )


class Profile:
    """--profile START:STEPS: jax.profiler traces steps START ... START + STEPS - 1, from the dispatch of the
    first to the arrival of the last one's numbers, into RUN_DIR/profile/plugins/profile/<time>/, where
    TensorBoard's profile plugin and XProf look: <host>.xplane.pb (trace viewer, op profile, memory) and
    perfetto_trace.json.gz (ui.perfetto.dev opens it). Every process traces its own devices. The profiler
    writes local files, so a gs:// run directory's trace is written to a local folder, then uploaded. A run
    that resumes past START traces the steps it takes of them, or says it traces none. An empty `spec` traces
    nothing."""

    def __init__(self, spec: str, run_dir: str):
        start, steps = map(int, spec.split(":")) if spec else (0, 0)
        self.first, self.last, self.run_dir, self.folder = start, start + steps - 1, run_dir, None
        self.spec, self.dispatched = spec, False

    def dispatching(self, step: int) -> None:
        if self.spec and not self.dispatched and step > self.first:  # the run resumed past START
            self.first = step
            if step > self.last and jax.process_index() == 0:
                print(f"--profile {self.spec}: this run starts at step {step}, past them: nothing is traced")
        self.dispatched = True
        if step == self.first and step <= self.last:
            local = tempfile.mkdtemp(prefix="olmo3-profile-") if data.is_url(self.run_dir) else None
            self.folder = local or data.join(self.run_dir, "profile")
            jax.profiler.start_trace(self.folder, create_perfetto_trace=True)

    def finished(self, step: int) -> None:
        if step != self.last or self.folder is None:
            return
        jax.profiler.stop_trace()
        target = data.join(self.run_dir, "profile")
        if data.is_url(self.run_dir):
            data.copy_tree(self.folder, target)
            shutil.rmtree(self.folder)
        self.folder = None
        if jax.process_index() == 0:
            print(
                f"profile of steps {self.first}-{self.last} in {target}: `xprof --logdir={target}` (pip install "
                "xprof), or its perfetto_trace.json.gz at ui.perfetto.dev",
                flush=True,
            )


# ---------------------------------------------------------------------------------------------------------
# The command line


# Commands whose work train.py now does, with what to run instead: a stage starts in one command.
RETIRED = {
    "next-stage": "python train.py --preset PRESET --init_from RUN_DIR[@STEP] --run_dir NEW_RUN_DIR",
    "from-olmo-core": "python train.py --preset PRESET --init_from OLMO_CORE_STEP_DIR --run_dir NEW_RUN_DIR",
}


def main(argv: list[str]) -> int:
    if argv and argv[0] in RETIRED:
        print(
            f"error: `ckpt.py {argv[0]}` is retired; start the stage with: {RETIRED[argv[0]]}",
            file=sys.stderr,
        )
        return 2
    args = parser().parse_args(argv)
    if args.storage_patience <= 0:
        parser().error(f"--storage_patience {args.storage_patience}: expected seconds above 0")
    data.set_patience(args.storage_patience)
    shard.quiet_libtpu()
    try:
        check_places(args)
        return run_command(args)
    except data.BadURL as e:  # bad usage, as argparse's
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError, CorruptCheckpoint, RunDirError, data.StorageUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)  # the message names the path and the fix
        return 1


PATH_ARGUMENTS = ("run_dir", "run_a", "run_b", "hf_dir", "out")  # ckpt.py's, in and out


def check_places(args) -> None:
    """Every path a command names, judged before anything is read or written, each refusal naming the argument:
    a URL the storage layer cannot use faithfully (data.check_url), a run directory Orbax cannot write
    (check_run_place), then a bucket that does not exist (data.check_bucket)."""
    paths = {name.upper(): str(getattr(args, name)) for name in vars(args) if name in PATH_ARGUMENTS}
    for name, path in paths.items():
        data.check_url(path, name)
    for name in ("RUN_DIR", "RUN_A", "RUN_B") + (("OUT",) if args.command == "average" else ()):
        if name in paths:
            check_run_place(paths[name], name)
    for name, path in paths.items():
        data.check_bucket(path, name)


def parser() -> argparse.ArgumentParser:
    """ckpt.py's command line: a subcommand each, every one taking --storage_patience."""
    parser = argparse.ArgumentParser(prog="ckpt.py", description=__doc__.split("\n\n")[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--storage_patience",
        type=float,
        default=data.PATIENCE_S,
        help="seconds each storage request is tried again on transient answers (503s, resets) before stopping",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add = lambda name, **kw: sub.add_parser(name, parents=[common], **kw)
    p = add("list", help="checkpoints of a run directory with step, size, time and validity")
    p.add_argument("run_dir")
    p = add(
        "restore-quarantined",
        help="move the checkpoints a run set aside as corrupt back (after a fault of the storage, not the bytes)",
    )
    p.add_argument("run_dir")
    p.add_argument("step", type=int, nargs="?", default=None, help="default: every step set aside")
    p = add("to-hf", help="export a checkpoint as a Hugging Face Olmo3ForCausalLM directory")
    p.add_argument("run_dir")
    p.add_argument("out")
    p.add_argument("--step", type=int, default=None, help="default: the newest valid checkpoint")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument(
        "--tokenizer", default=None, help="dolma2, tiny, none or a tokenizer.json; default: the run's"
    )
    p = add("from-hf", help="import a Hugging Face directory as step 0 of a new run directory")
    p.add_argument("hf_dir")
    p.add_argument("run_dir")
    p = add(
        "average",
        help="the mean of two runs' weights (newest valid checkpoints) as step 0 of a new run, weights only",
    )
    p.add_argument("run_a")
    p.add_argument("run_b")
    p.add_argument("out", help="a new run directory (export it with to-hf)")
    p.add_argument(
        "--different_steps", action="store_true", help="average newest checkpoints at different steps too"
    )
    p = add(
        "goodput",
        help="where a run's wall time went (RUN_DIR/goodput.jsonl): a table per start, and RUN_DIR/goodput.png",
    )
    p.add_argument("run_dir")
    p.add_argument("--json", action="store_true", help="print the account as one JSON object (nothing drawn)")
    return parser


def goodput_command(run_dir, as_json: bool) -> int:
    """`ckpt.py goodput RUN_DIR`: the account as a table, drawn into goodput.png; or as one JSON object."""
    account = goodput_account(goodput_records(data.join(run_dir, "goodput.jsonl")))
    if as_json:
        print(json.dumps(account))
        return 0
    print(goodput_table(account))
    plot_goodput(run_dir, account)
    print(f"drawn: {data.join(run_dir, 'goodput.png')}")
    return 0


def run_command(args) -> int:
    if args.command == "goodput":
        return goodput_command(args.run_dir, args.json)
    if args.command == "list":
        rows = list_checkpoints(args.run_dir)
        print(f"{'step':>10}  {'size':>10}  {'saved':<19}  valid")
        for r in rows:
            saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["time"])) if r["time"] else "?"
            valid = "yes" if r["valid"] else r["problem"] if r["valid"] is None else "NO: " + r["problem"]
            print(f"{r['step']:>10}  {r['size'] / 2**20:8.1f}MB  {saved:<19}  {valid}")
        folder = data.join(args.run_dir, "checkpoints")
        unfinished = unfinished_writes(folder)
        if not rows:  # an interrupted first write is not a checkpoint, and not nothing either
            left = (
                f"; only interrupted writes, never committed: {', '.join(unfinished)}" if unfinished else ""
            )
            print(f"no committed checkpoint in {folder}{left}")
        elif unfinished:
            print(
                f"not committed (no {COMMIT_MARKER}; never read, removed by the next run): {', '.join(unfinished)}"
            )
        return 0 if all(r["valid"] is not False for r in rows) and not (unfinished and not rows) else 1
    if args.command == "restore-quarantined":
        for source, target in restore_quarantined(args.run_dir, args.step):
            print(f"moved {source} back to {target}")
        print(
            f"the next run of {args.run_dir} reads them again (and sets aside any that fail their checksums)"
        )
        return 0
    if args.command == "to-hf":
        step = export_hf(args.run_dir, args.out, args.step, args.dtype, args.tokenizer)
        print(f"wrote step {step} of {args.run_dir} to {args.out}")
        return 0
    if args.command == "average":
        step_a, step_b = average(args.run_a, args.run_b, args.out, args.different_steps)
        print(
            f"wrote the mean of {args.run_a} (step {step_a}) and {args.run_b} (step {step_b}) as step 0 of "
            f"{args.out}; export it with:\n  python ckpt.py to-hf {args.out} OUT_HF_DIR"
        )
        return 0
    cfg = import_hf(args.hf_dir, args.run_dir)
    preset = preset_of(cfg)
    hint = (
        f"python train.py --preset {preset} --run_dir {args.run_dir} --data YOUR_TOKEN_FILES"
        if preset
        else "no preset of train.py has this model's shape; add one to olmo3.MODELS and train.PRESETS"
    )
    print(f"wrote {args.hf_dir} as step 0 of {args.run_dir}; continue with:\n  {hint}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
