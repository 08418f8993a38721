"""Ops: what a layer calls, the same on one device and on a mesh.

Each wraps a kernel (or plain JAX) in `shard_map` when logical-axis rules are active
(`modern_jax.sharding.logical_rules`), so the model never names a mesh axis:

| module         | op                                                                   |
|----------------|----------------------------------------------------------------------|
| `attention.py` | attention with the KV heads split over the tensor axis                |
| `norm.py`      | the fused norm run per device                                          |
| `vocab.py`     | the vocab-parallel embedding lookup and the loss's per-shard logits   |
"""
