"""An object store that fails mid-run: moto's S3 server on 127.0.0.1 behind a proxy that injects faults.

The proxy answers 503 to chosen PUTs (a shard upload, the manifest), or drops the connection on one
and stops listening (the store is down: connection refused), until it is disarmed. A faulted run
must fail naming the store and the object, leave nothing that counts as finished, and a rerun once
the store is back must produce the shards of an uninterrupted run, byte for byte.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal

import pytest

from a2d.flows.pipeline import pipeline, plan
from a2d.stores.artifacts import ArtifactStore, IncompleteArtifactError, StoreWriteError
from tests.conftest import free_port, tiny_config
from tests.test_scale import LLAMA

Mode = Literal["503", "refuse"]
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade"}
SERVICE_UNAVAILABLE = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>ServiceUnavailable</Code>'
    b"<Message>injected by the test's fault proxy</Message></Error>"
)
# One shard at a time, so that the shard before the fault has finished and the one after never starts.
FAULTED = [*LLAMA, "run.workers=1"]


class FaultProxy:
    """A reverse proxy on 127.0.0.1 in front of the S3 server; `arm` makes it fail matching PUTs.

    "503" answers every matching PUT with 503 ServiceUnavailable until `disarm`; "refuse" drops the
    connection of the first matching PUT and stops listening, so every later request is refused
    until `disarm` listens again on the same port.
    """

    def __init__(self, upstream: str):
        self.upstream = upstream  # the S3 server's endpoint, http://127.0.0.1:PORT
        self.port = free_port()
        self.mode: Mode | None = None
        self.pattern: re.Pattern[str] | None = None
        self.failed: list[str] = []  # "METHOD path" of every request the proxy failed
        self.server: ThreadingHTTPServer | None = None
        self.listen()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def listen(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), _Relay)
        self.server.daemon_threads = True
        self.server.proxy = self  # type: ignore[attr-defined]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        """Stop listening: connections are refused from now on."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def arm(self, mode: Mode, pattern: str) -> None:
        self.mode, self.pattern, self.failed = mode, re.compile(pattern), []

    def disarm(self) -> None:
        self.mode = self.pattern = None
        if self.server is None:
            self.listen()

    def fails(self, method: str, path: str) -> bool:
        return (
            self.mode is not None
            and method == "PUT"
            and self.pattern is not None
            and self.pattern.search(path.split("?", 1)[0]) is not None
        )


class _Relay(BaseHTTPRequestHandler):
    """One client connection: every request is forwarded to the S3 server unless the proxy fails it."""

    protocol_version = "HTTP/1.1"  # keep-alive, as botocore expects of S3

    def log_message(self, format: str, *args: object) -> None:
        pass

    def relay(self) -> None:
        proxy: FaultProxy = self.server.proxy  # type: ignore[attr-defined]
        body = self.read_body()
        if proxy.server is None:  # down: a kept-alive connection is dropped like a new one is refused
            self.close_connection = True
            return
        if proxy.fails(self.command, self.path):
            proxy.failed.append(f"{self.command} {self.path}")
            if proxy.mode == "refuse":
                self.close_connection = True
                proxy.stop()
                return
            self.send_response_only(503, "Service Unavailable")
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(SERVICE_UNAVAILABLE)))
            self.end_headers()
            self.wfile.write(SERVICE_UNAVAILABLE)
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        if body is not None:
            headers["Content-Length"] = str(len(body))
        upstream = http.client.HTTPConnection(proxy.upstream.split("://", 1)[1], timeout=60)
        try:
            upstream.request(self.command, self.path, body=body, headers=headers)
            response = upstream.getresponse()
            data = response.read()
        finally:
            upstream.close()
        self.send_response_only(response.status, response.reason)
        for k, v in response.getheaders():
            if k.lower() not in HOP_BY_HOP and (k.lower() != "content-length" or self.command == "HEAD"):
                self.send_header(k, v)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def read_body(self) -> bytes | None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while size := int(self.rfile.readline().split(b";")[0], 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else None

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = relay


@pytest.fixture(scope="module")
def proxy(s3):
    """The fault proxy in front of the module's moto server: the stores' endpoint while the module runs."""
    p = FaultProxy(os.environ["AWS_ENDPOINT_URL"])
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ENDPOINT_URL", p.endpoint)
        # A fault stays until disarmed, so retries would only fail again: one attempt keeps it fast.
        env.setenv("AWS_MAX_ATTEMPTS", "1")
        env.setenv("AWS_RETRY_MODE", "standard")
        try:
            yield p
        finally:
            p.stop()


def _bucket(s3: str) -> str:
    return s3.split("://", 1)[1].split("/", 1)[0]


def _direct(proxy: FaultProxy, root: str) -> ArtifactStore:
    """The store read straight from the S3 server, whatever the proxy is doing."""
    return ArtifactStore(root, {"endpoint_url": proxy.upstream})


def _shards(store: ArtifactStore, refs: dict) -> dict[str, dict[str, str]]:
    """{stage: {file: sha256 of its bytes as stored}} over every shard file of every artifact in `refs`."""
    out = {}
    for stage, ref in refs.items():
        loc = store.loc(ref)
        files = {rel for m in store.manifest(ref)["shards"].values() for rel in m["files"]}
        out[stage] = {rel: hashlib.sha256(loc.read_bytes(rel)).hexdigest() for rel in sorted(files)}
    return out


def _records(store: ArtifactStore, refs: dict) -> dict[str, dict[str, dict]]:
    """{stage: {shard: its record in the manifest, less the time it finished}}."""
    return {
        stage: {
            shard: {k: v for k, v in record.items() if k != "finished"}
            for shard, record in store.manifest(ref)["shards"].items()
        }
        for stage, ref in refs.items()
    }


@pytest.fixture(scope="module")
def uninterrupted(s3, proxy):
    """The same config run once without a fault, into its own prefix: (store, refs, shard hashes)."""
    root = f"s3://{_bucket(s3)}/uninterrupted"
    refs = pipeline(tiny_config(root, *FAULTED), until="prompts")
    store = _direct(proxy, root)
    return store, refs, _shards(store, refs)


SHARD_PUT = r"/prompts/[0-9a-f]{16}/part-00001\.parquet$"
MANIFEST_PUT = r"/prompts/[0-9a-f]{16}/manifest\.json$"


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, pattern, failed_object",
    [
        ("503", SHARD_PUT, "part-00001.parquet"),
        ("503", MANIFEST_PUT, "manifest.json"),
        ("refuse", SHARD_PUT, "part-00001.parquet"),
    ],
    ids=["shard-503", "manifest-503", "shard-refused"],
)
def test_a_store_failing_mid_run_fails_clearly_keeps_nothing_half_done_and_a_rerun_matches(
    s3, proxy, uninterrupted, mode, pattern, failed_object
):
    root = f"s3://{_bucket(s3)}/faulted"  # one root for every case: its teacher is built once
    cfg = tiny_config(root, *FAULTED)
    ref = plan(cfg, until="prompts")["prompts"]
    store = _direct(proxy, root)
    store.loc(ref).remove()  # each case starts with no prompts artifact

    proxy.arm(mode, pattern)
    try:
        state = pipeline(cfg, until="prompts", return_state=True)
    finally:
        proxy.disarm()
    assert proxy.failed, f"the fault ({mode} on {pattern}) was never hit"

    # The run failed, and what its state shows names the object and the store.
    assert state.is_failed()
    with pytest.raises(StoreWriteError) as raised:
        state.result()
    error = raised.value
    for shown in (str(error), state.message):
        assert f"{ref.uri}/{failed_object}" in shown and f"the store {root}" in shown, shown
        assert "rerun once the store is reachable" in shown, shown
    assert error.__cause__ is not None  # the store's own error is kept

    # Nothing half-written counts as finished: no manifest, no marker for the shard that failed,
    # and every marker there names files that verify.
    assert not store.is_complete(ref) and not store.describe(ref)["complete"]
    with pytest.raises(IncompleteArtifactError):
        store.manifest(ref)
    markers = {s: store.marker(ref, s) for s in store.plan(ref)["shards"]}
    finished = {s for s, m in markers.items() if m is not None}
    assert finished == (
        {"part-00000", "part-00001", "part-00002"} if failed_object == "manifest.json" else {"part-00000"}
    )
    assert all(store.check_shard(ref, markers[s]) == [] for s in finished)

    # Once the store is back, a rerun finishes: finished shards are kept, and every shard matches
    # the uninterrupted run's byte for byte, in the files and in the manifest's checksums.
    refs = pipeline(cfg, until="prompts")
    assert refs["prompts"] == ref and store.verify(ref) == []
    assert all(store.marker(ref, s) == markers[s] for s in finished)
    clean_store, clean_refs, clean_hashes = uninterrupted
    assert refs == {
        stage: r.model_copy(update={"uri": r.uri.replace("/uninterrupted/", "/faulted/")})
        for stage, r in clean_refs.items()
    }
    hashes = _shards(store, refs)
    assert hashes == clean_hashes
    records = _records(store, refs)
    assert records == _records(clean_store, clean_refs)
    for stage, shards in records.items():  # the manifest's checksums are those of the bytes stored
        assert {rel: h for r in shards.values() for rel, h in r["files"].items()} == hashes[stage]
