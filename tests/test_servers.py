"""tests/servers.py's FaultProxy between fake-gcs-server (moto's S3 server too) and the clients the product
reaches them with: google-cloud-storage (told not to retry, so that it shows each fault as it comes),
TensorStore (which retries, here every few milliseconds) and gcsfs (through etils.epath). Each named matcher
fails its kind of request alone, as those clients send it; the faults come in place of the server's answer."""

import time
import uuid

import pytest
import requests
import tensorstore as ts
from etils import epath
from google.api_core import exceptions
from google.cloud import storage
from servers import (
    COMPOSE,
    CREATE_IF_ABSENT,
    DELETE,
    LIST,
    METADATA,
    READ,
    FaultProxy,
    request,
    s3_server,
    upload,
)


def tensorstore(spec: dict, retries: int = 100) -> ts.KvStore:
    """A TensorStore key-value store retrying every 5-20 ms (its default waits a second and more)."""
    backoff = {"max_retries": retries, "initial_delay": "5ms", "max_delay": "20ms"}
    context = ts.Context({f"{spec['driver']}_request_retries": backoff})
    return ts.KvStore.open(spec, context=context).result()


@pytest.fixture
def bucket(gcs_proxy):
    """A fresh bucket, made through the proxy; its log emptied after."""
    made = storage.Client().create_bucket(f"proxy-{uuid.uuid4().hex[:12]}")
    gcs_proxy.clear()
    return made


def statuses(proxy) -> list:
    return [status for _, _, status in proxy.log]


def test_three_clients_round_trip_through_the_proxy_and_a_resumable_upload_too(gcs_proxy, bucket):
    kv, folder = tensorstore({"driver": "gcs", "bucket": bucket.name}), epath.Path(f"gs://{bucket.name}")
    bucket.blob("by/gcs").upload_from_string(b"gcs")
    kv.write("by/ts", b"ts").result()
    (folder / "by/gcsfs").write_bytes(b"gcsfs")
    assert kv.read("by/gcs").result().value == b"gcs"
    assert (folder / "by/ts").read_bytes() == b"ts"
    # A blob got from the server is read at the mediaLink the server wrote in it: the proxy's (-external-url).
    assert bucket.get_blob("by/gcsfs").download_as_bytes() == b"gcsfs"
    assert gcs_proxy.log[-1] == ("GET", f"/download/storage/v1/b/{bucket.name}/o/by%2Fgcsfs?alt=media", 200)
    # Past 8 MiB with a chunk size, google-cloud-storage uploads in chunks to the session URL the server hands
    # out, which names the Host the request named: the proxy's, relayed as is.
    data = bytes(range(256)) * (9 << 12) + b"!"  # 9 MiB and a byte: chunks of 4, 4, 1 MiB
    bucket.blob("big", chunk_size=4 << 20).upload_from_string(data)
    assert kv.read("big").result().value == data
    chunks = [(method, status) for method, path, status in gcs_proxy.log if "name=big&upload_id=" in path]
    assert chunks == [("PUT", 308), ("PUT", 308), ("PUT", 200)]
    assert all(status in (200, 206, 308) for status in statuses(gcs_proxy))


# One request each, as the product makes them, by google-cloud-storage told not to retry; i: the round.
ACTIONS = {
    "create_if_absent": lambda b, i: b.blob(f"lock-{i}").upload_from_string(
        "", if_generation_match=0, retry=None
    ),
    "upload": lambda b, i: b.blob("run/config.json").upload_from_string("{}", retry=None),
    "compose": lambda b, i: b.blob("run/rows").compose([b.blob("run/rows"), b.blob("run/part")], retry=None),
    "read": lambda b, i: b.blob("run/config.json").download_as_bytes(retry=None),
    "metadata": lambda b, i: b.get_blob("run/config.json", retry=None),
    "list": lambda b, i: list(b.list_blobs(prefix="run/", retry=None)),
    "delete": lambda b, i: b.blob(f"gone-{i}").delete(retry=None),
}
MATCHERS = {
    "create_if_absent": (CREATE_IF_ABSENT, 503),
    "upload": (upload("run/config.json"), 503),
    "compose": (COMPOSE, 429),
    "read": (READ, 503),
    "metadata": (METADATA, 500),
    "list": (LIST, 503),
    "delete": (DELETE, 503),
}


def test_each_named_matcher_fails_its_kind_of_request_alone_once(gcs_proxy, bucket):
    for name in ("run/config.json", "run/rows", "run/part"):
        bucket.blob(name).upload_from_string("{}")
    for i, (kind, (match, status)) in enumerate(MATCHERS.items()):
        bucket.blob(f"gone-{i}").upload_from_string("")
        gcs_proxy.fail(match, how=status)
        failed = []
        for name, act in ACTIONS.items():
            try:
                act(bucket, i)
            except exceptions.GoogleAPICallError as e:
                failed.append((name, e.code))
        assert failed == [(kind, status)]
    assert bucket.get_blob("lock-0") is None  # answered by the proxy, never forwarded: a retry is safe


def test_tensorstore_rides_through_503s_429s_and_resets(gcs_proxy, bucket):
    kv = tensorstore({"driver": "gcs", "bucket": bucket.name})
    gcs_proxy.fail(upload("ts/key"), times=2, how=503)
    gcs_proxy.fail(READ, times=2, how="reset")
    gcs_proxy.fail(LIST, how=429)
    kv.write("ts/key", b"value").result()
    assert kv.read("ts/key").result().value == b"value"
    assert kv.list().result() == [b"ts/key"]
    assert statuses(gcs_proxy) == [503, 503, 200, "reset", "reset", 200, 429, 200]


def test_a_reset_is_a_connection_error_to_a_client_that_does_not_retry(gcs_proxy, bucket):
    blob = bucket.blob("a")
    blob.upload_from_string(b"x")
    gcs_proxy.fail(READ, how="reset")
    with pytest.raises(requests.exceptions.ConnectionError, match="reset by peer"):
        blob.download_as_bytes(retry=None)
    assert blob.download_as_bytes(retry=None) == b"x"
    assert statuses(gcs_proxy) == [200, "reset", 200]


def test_read_only_refuses_every_write_403_and_serves_the_reads(gcs_proxy, bucket):
    blob, folder = bucket.blob("run/config.json"), epath.Path(f"gs://{bucket.name}")
    blob.upload_from_string(b"{}")
    kv = tensorstore({"driver": "gcs", "bucket": bucket.name})
    gcs_proxy.read_only()
    for write in (
        lambda: bucket.blob("new").upload_from_string(b"x", retry=None),
        lambda: blob.compose([blob, blob], retry=None),
        lambda: blob.delete(retry=None),
    ):
        with pytest.raises(exceptions.Forbidden, match="may only read"):
            write()
    with pytest.raises(ValueError, match="PERMISSION_DENIED"):
        kv.write("new", b"x").result()
    with pytest.raises(OSError, match="Forbidden"):
        (folder / "new").write_bytes(b"x")
    assert statuses(gcs_proxy) == [200, 403, 403, 403, 403, 403]
    assert blob.download_as_bytes(retry=None) == kv.read("run/config.json").result().value == b"{}"
    assert (folder / "run/config.json").read_bytes() == b"{}"
    assert [b.name for b in bucket.list_blobs(retry=None)] == ["run/config.json"]
    gcs_proxy.read_only(False)
    bucket.blob("new").upload_from_string(b"x", retry=None)


def test_an_outage_answers_every_request_until_it_ends(gcs_proxy, bucket):
    blob = bucket.blob("a")
    blob.upload_from_string(b"x")
    with gcs_proxy.outage():
        for call in (
            lambda: blob.download_as_bytes(retry=None),
            lambda: list(bucket.list_blobs(retry=None)),
            lambda: bucket.blob("b").upload_from_string(b"y", if_generation_match=0, retry=None),
        ):
            with pytest.raises(exceptions.ServiceUnavailable):
                call()
        with pytest.raises(ValueError, match="All 2 retry attempts failed: Service Unavailable"):
            tensorstore({"driver": "gcs", "bucket": bucket.name}, retries=2).read("a").result()
    assert statuses(gcs_proxy) == [200, 503, 503, 503] + [503] * 3  # TensorStore: a try and 2 retries
    assert blob.download_as_bytes(retry=None) == b"x"
    # 0.3 s of resets, ridden out by TensorStore's retries; never shorter.
    gcs_proxy.outage(seconds=0.3, how="reset")
    start = time.monotonic()
    assert tensorstore({"driver": "gcs", "bucket": bucket.name}).read("a").result().value == b"x"
    assert time.monotonic() - start >= 0.3
    assert statuses(gcs_proxy)[-1] == 200 and statuses(gcs_proxy).count("reset") > 1


def test_s3_behind_the_proxy():
    """moto's S3 server through the proxy: botocore's requests are signed over the Host header, relayed as is."""
    import boto3

    name = f"proxy-{uuid.uuid4().hex[:12]}"
    with FaultProxy() as proxy, s3_server(proxy) as url:
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket=name)
        s3.put_object(Bucket=name, Key="a", Body=b"x" * 100)
        proxy.fail(request("GET", f"^/{name}/a$"), how=503)
        kv = tensorstore({"driver": "s3", "bucket": name, "endpoint": url, "aws_region": "us-east-1"})
        assert kv.read("a").result().value == b"x" * 100
    assert statuses(proxy) == [200, 200, 503, 200]
