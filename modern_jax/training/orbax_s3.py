"""Orbax checkpoints in `s3://`, through TensorStore's S3 driver.

Orbax builds TensorStore's key-value store for `gs://` paths alone (its GCS driver) and takes
any other path for a local one; it marks a finished step on `gs://` by a commit file, since
object storage has no rename, and elsewhere by renaming a temporary directory. `reach_s3()`
gives `s3://` the same two things:

- the key-value store of an `s3://bucket/key` path is TensorStore's `s3` driver (bucket and key
  from the path; the endpoint from `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` where set, and the
  region from `AWS_REGION` or `AWS_DEFAULT_REGION`, as boto3 and s3fs read them; the keys in
  `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` where set, else as the AWS SDK finds them);
- a step there is finished when its commit file is written (`CommitFileTemporaryPath`), as on `gs://`.

Everything else Orbax does on a path (its metadata files, listings, deletes) already goes through
`etils.epath`, which reaches `s3://` through `s3fs`. The functions replaced are Orbax's own
(orbax-checkpoint is pinned in uv.lock); each replacement hands every other path to the original.
"""

from __future__ import annotations

import os

S3 = "s3://"


def _s3_kvstore(path: str) -> dict:
    """TensorStore's key-value store spec of `s3://bucket/key`."""
    bucket, _, key = path.removeprefix(S3).partition("/")
    spec = {"driver": "s3", "bucket": bucket, "path": key}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if endpoint:
        spec["endpoint"] = endpoint
    if region:
        spec["aws_region"] = region
    if os.environ.get("AWS_ACCESS_KEY_ID"):  # the keys the environment gives, as the SDK's chain would take first
        spec["aws_credentials"] = {"type": "environment"}  # (without the chain's complaints about absent profiles)
    return spec


def reach_s3() -> None:
    """Teach Orbax (once per process) to write and read checkpoints in `s3://`."""
    from orbax.checkpoint._src.path import atomicity, atomicity_defaults, gcs_utils
    from orbax.checkpoint._src.serialization import tensorstore_utils

    if getattr(tensorstore_utils, "reaches_s3", False):
        return
    normalize, remote, kvstore = (tensorstore_utils._normalize_path, tensorstore_utils._use_gcs_driver,
                                  gcs_utils.get_kvstore_for_gcs)
    # os.path.normpath makes `s3://b/k` `s3:/b/k`; Orbax mends `gs:/` alone
    tensorstore_utils._normalize_path = lambda path: normalize(path).replace("s3:/", S3, 1) \
        if str(path).startswith(S3) else normalize(path)
    tensorstore_utils._use_gcs_driver = lambda directory: directory.startswith(S3) or remote(directory)
    gcs_utils.get_kvstore_for_gcs = lambda path: _s3_kvstore(path) if str(path).startswith(S3) else kvstore(path)

    for name in ("get_default_temporary_path_class", "get_item_default_temporary_path_class"):
        default = getattr(atomicity_defaults, name)

        def chosen(path, *, atomicity_options=None, default=default):
            asked = atomicity_defaults._resolve_temporary_path_class_from_options(atomicity_options)
            if str(path).startswith(S3) and asked is None:
                return atomicity.CommitFileTemporaryPath
            return default(path, atomicity_options=atomicity_options)

        setattr(atomicity_defaults, name, chosen)
    tensorstore_utils.reaches_s3 = True
