"""Ops: what a layer calls, the same on one device and on a mesh.

Each wraps a kernel (or plain JAX) in `shard_map` when logical-axis rules are active
(`modern_jax.sharding.logical_rules`) and reads the active strategies, so the model never names a
mesh axis nor passes a parallel choice:

| module         | op                                                                   |
|----------------|----------------------------------------------------------------------|
| `attention.py` | attention with the KV heads split over the tensor axis                |
| `norm.py`      | the fused norm run per device                                          |
| `vocab.py`     | the vocab-parallel embedding lookup and the loss's per-shard logits   |
| `moe.py`       | the experts' dispatch: tokens sorted to their experts, exchanged over the expert axis |
"""
