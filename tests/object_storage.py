"""Local stand-ins for object storage. `gcs()`: `gs://` paths served by an emulator
(`gcp-storage-emulator`, its HTTP server made to accept requests in parallel, as TensorStore
sends them, and to send an object's generation with it, as GCS does) in a process of its own
on localhost, which both ways to object storage speak to: `etils.epath` (through `gcsfs`) and
Orbax's TensorStore. `s3()`: `s3://` paths served by moto's S3 server on localhost (reached
through `s3fs`, which reads AWS_ENDPOINT_URL). No network, no credentials."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

_SERVE = """
import logging, sys, threading
from http import server
from gcp_storage_emulator.handlers import objects
download = objects.download
def with_generation(request, response, storage, *args, **kwargs):  # GCS's headers, which TensorStore reads
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        response["x-goog-generation"], response["x-goog-metageneration"] = obj["generation"], obj["metageneration"]
    except Exception:
        pass
    return download(request, response, storage, *args, **kwargs)
objects.download = with_generation
from gcp_storage_emulator import server as emulator
server.HTTPServer = server.ThreadingHTTPServer
one = threading.Lock()
handle = emulator.Router.handle
def serialized(self, method):
    with one:
        return handle(self, method)
emulator.Router.handle = serialized
emulator.create_server("localhost", int(sys.argv[1]), in_memory=True, default_bucket=sys.argv[2]).run()
"""

ENV = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING",
       "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")


@contextlib.contextmanager
def gcs(bucket: str = "bucket"):
    """Within: `gs://{bucket}/...` is an empty bucket on localhost, for this process and the
    processes it starts (the environment points them there)."""
    import fsspec

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-c", _SERVE, str(port), bucket], stdout=subprocess.DEVNULL,
                              stderr=open(os.environ.get("GCS_EMULATOR_LOG", os.devnull), "w"))
    deadline = time.monotonic() + 60
    while True:
        with socket.socket() as s:
            if s.connect_ex(("localhost", port)) == 0:
                break
        assert server.poll() is None and time.monotonic() < deadline, "the GCS emulator did not start"
        time.sleep(0.05)
    url = f"http://localhost:{port}"
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url, GOOGLE_AUTH_TOKEN_FOR_TESTING="x",
                      GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")  # no bucket-type probe (it asks Google's own API)
    fsspec.AbstractFileSystem.clear_instance_cache()
    for cls in fsspec.registry.values():
        cls.clear_instance_cache()
    try:
        yield url
    finally:
        server.kill()
        server.wait()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


S3_ENV = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")


@contextlib.contextmanager
def s3(bucket: str = "bucket"):
    """Within: `s3://{bucket}/...` is an empty bucket on localhost (moto's server, in a thread of
    this process), for this process and the processes it starts."""
    import logging

    import fsspec
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    saved = {k: os.environ.get(k) for k in S3_ENV}
    os.environ.update(AWS_ENDPOINT_URL=f"http://{host}:{port}", AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x",
                      AWS_DEFAULT_REGION="us-east-1")
    for cls in [fsspec.AbstractFileSystem, *fsspec.registry.values()]:
        cls.clear_instance_cache()
    fsspec.filesystem("s3").mkdir(bucket)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
