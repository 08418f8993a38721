"""Logical axis names -> mesh axes: one rules table for parameters and activations.

Parameters carry logical names in their `out_sharding` metadata (`embed`, `vocab`,
`q_heads`, `kv_heads`, `head_dim`, `mlp`, `experts`, `norm`, `layers`, `q_latent`, `kv_latent`);
key activations are constrained to `activation_*` names. Model code names no mesh
axis: `RULES` maps logical names to mesh axes and a mesh axis is used at most once per
array. These are pure functions of a mesh and a rules table; `sharding.context` holds the
active ones (`constrain` does nothing outside them), so the same model runs on one CPU and
on a pod slice.

Megatron layout by default: q/k/v/gate/up column-parallel and o/down row-parallel over
`tensor`, embedding and head vocab-parallel over `tensor`, weights sharded over `fsdp`
(and `context` and `expert`, which outside a mixture's experts are more data parallelism)
on their `embed` dimension, a mixture's experts over `expert`, the batch
over `data` x `fsdp` x `expert`, the sequence over `context`.

Sequence parallelism (Megatron-SP) by default: between the tensor-parallel regions the
residual stream `[B, T, D]` is split along T over `context` x `tensor`
(`activation_norm_length`), inside them along T over `context` only (`activation_length`);
`sharding.sequence` marks the regions. Mapping `activation_norm_length` to `context`
(`parallel.rules.activation_norm_length=context`) turns it off.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding, PartitionSpec

RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("activation_batch", ("data", "fsdp", "expert")),
    ("activation_length", "context"),  # the sequence inside attention and the FFN
    ("activation_norm_length", ("context", "tensor")),  # the residual stream's: sequence parallelism
    ("activation_embed", None),
    ("activation_kv_heads", "tensor"),
    ("activation_heads", "tensor"),  # the attention output's query heads, entering o_proj
    ("activation_mlp", "tensor"),  # the FFN's hidden units, entering down_proj
    ("activation_vocab", "tensor"),
    ("layers", "stage"),  # a stack's layers over the pipeline stages
    ("vocab", "tensor"),
    ("embed", ("fsdp", "context", "expert")),  # context and expert (data parallel outside the experts) shard as fsdp
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("experts", "expert"),  # a mixture's routed experts, split over the expert axis
    ("norm", None),
    ("q_latent", ("fsdp", "context", "expert")),  # MLA's latents: q_b / kv_b have no embed dimension to split over
    ("kv_latent", ("fsdp", "context", "expert")),
)

# logical axes that had another name; a `parallel.rules` entry under the old one is refused with the new
RENAMED = {"q_lora": "q_latent", "kv_lora": "kv_latent"}  # MLA's low ranks, not LoRA adapters

# logical axes that are replicated, rather than rejected, when the mesh does not divide
# them: GQA with fewer KV heads than the tensor axis keeps whole KV heads on every device;
# a latent too small for the fsdp axis stays whole (its weights are the small ones); a sequence the
# context (and tensor) axes do not divide, one decoded token, stays whole on every device
REPLICABLE = ("kv_heads", "activation_kv_heads", "activation_batch", "activation_length", "activation_norm_length",
              "q_latent", "kv_latent")

def mesh_axes(name, rules) -> tuple[str, ...]:
    """The mesh axes a logical name maps to (empty: replicated; None is always replicated).

    A name missing from `rules` is a ValueError naming it: a typo or a new axis must not be
    silently replicated."""
    if name is None:
        return ()
    table = dict(rules)
    if name not in table:
        raise ValueError(f"logical axis {name!r} is not in the sharding rules (known: {', '.join(table)}); "
                         f"add it to the rules table, modern_jax.sharding.RULES")
    axes = table[name]
    return () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))


def live_axes(name, rules, mesh, size: int) -> tuple[str, ...] | None:
    """The mesh axes (of size > 1) that split a dimension `name` of `size`; None if they do not divide it."""
    axes = tuple(a for a in mesh_axes(name, rules) if mesh.shape.get(a, 1) > 1)  # a mesh without an axis: size 1
    return axes if axes and size % math.prod(mesh.shape[a] for a in axes) == 0 else None


def split_size(name, mesh, rules) -> int:
    """How many parts the mesh splits a dimension `name` into (the product of its mesh axes' sizes)."""
    return math.prod(mesh.shape[a] for a in mesh_axes(name, rules) if a in mesh.shape)


def free_axes(axes, *taken) -> tuple[str, ...] | None:
    """`axes`, or None if a dimension before already uses one of them: a mesh axis splits one
    dimension of an array (the rule `logical_to_spec` applies, for the specs ops build by hand)."""
    used = {a for t in taken if t for a in t}
    return None if axes is None or used & set(axes) else axes


def axis_position(axes) -> jax.Array:
    """Inside `shard_map`: this device's index along `axes`, row-major as a PartitionSpec lays a
    dimension split over several axes out."""
    index = 0
    for axis in axes:
        index = index * jax.lax.axis_size(axis) + jax.lax.axis_index(axis)
    return index


def logical_to_spec(axes, rules, mesh=None, shape=None, where: str = "") -> PartitionSpec:
    """Map logical axis names to a PartitionSpec; a mesh axis is used at most once.

    With `mesh` and `shape`, a dimension the mesh axes do not divide is replicated if its
    name is in REPLICABLE and rejected with a ValueError otherwise.
    """
    used, out = set(), []
    for i, name in enumerate(axes):
        group = tuple(a for a in mesh_axes(name, rules) if a not in used and (mesh is None or a in mesh.shape))
        if mesh is not None and shape is not None:
            group = tuple(a for a in group if mesh.shape[a] > 1)
            size = math.prod(mesh.shape[a] for a in group)
            if shape[i] % size:
                if name in REPLICABLE:
                    group = ()
                else:
                    raise ValueError(
                        f"{where or 'array'}: dimension {i} ({name}) of size {shape[i]} is not divisible by mesh "
                        f"axes {'x'.join(group)} = {size}; choose a mesh whose {'x'.join(group)} size divides "
                        f"{shape[i]}" + (" or set model.vocab_pad_to to that size" if name == "vocab" else ""))
        used.update(group)
        out.append(group if len(group) > 1 else (group[0] if group else None))
    return PartitionSpec(*out)


def state_shardings(state, mesh, rules=RULES):
    """NamedShardings for an `nnx.State` whose Variables carry logical axes (`out_sharding`):
    the one map from parameters to shardings (the Trainer, `create_sharded`, `from_hf(mesh=)`).

    Variables without axes (optimizer counts, RNG keys, scalars) are replicated.
    """
    from flax import nnx

    def one(path, var):
        axes = var.get_metadata().get("out_sharding") if isinstance(var, nnx.Variable) else None
        shape = getattr(var, "shape", ())
        if not axes or len(axes) != len(shape):
            return NamedSharding(mesh, PartitionSpec())
        where = "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
        return NamedSharding(mesh, logical_to_spec(axes, rules, mesh, shape, where=where))

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def check_mesh(cfg, mesh, rules=RULES) -> None:
    """Reject, before anything compiles, a model the mesh cannot split; name the field and the fix."""
    checks = [("n_heads", cfg.n_heads, "q_heads"), ("d_ff", cfg.ffn_width, "mlp"),
              ("vocab_size", cfg.padded_vocab_size, "vocab"), ("d_model", cfg.d_model, "embed")]
    if cfg.ffn_type == "moe":
        checks += [("n_experts", cfg.n_experts, "experts"), ("expert_d_ff", cfg.expert_width, "mlp")]
        checks += [("shared_expert_d_ff", cfg.shared_width, "mlp")] if cfg.n_shared_experts else []
    for field, value, logical in checks:
        n = split_size(logical, mesh, rules)
        if value % n:
            axes = [a for a in mesh_axes(logical, rules) if mesh.shape.get(a, 1) > 1]
            split = " x ".join(f"{a}={mesh.shape[a]}" for a in axes) + (f" = {n}" if len(axes) > 1 else "")
            fix = (f"set model.vocab_pad_to={n} (pads {(-value) % n} rows whose logits are masked)"
                   if field == "vocab_size" else f"choose a mesh whose {' x '.join(axes)} size divides {value}")
            raise ValueError(f"model.{field}={value} is not divisible by the mesh's {split}: {fix}")
    # n_heads divisible by the tensor axis is enough for any n_kv_heads: shard_map attention
    # replicates each KV head tp / gcd(n_kv, tp) times, which always divides the query group
