"""Signal propagation at initialisation: post-LN vs pre-LN (and sandwich, OLMo-2, QK-norm).

A stack of 32 blocks, d=256, 4 heads, LayerNorm, GELU MLP of width 4d, every weight
matrix Xavier-initialised, no positions, a random input of 2 x 64 tokens. Per block:
the residual stream's RMS, the cross-token spread ||H - mean_t H|| / ||H||, and the
gradient norm of each attention projection under a fixed random linear read-out loss.

    uv run python scripts/exp_signal_propagation.py [--out results/signal_propagation]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from modern_jax.config import ModelConfig
from modern_jax.layers.block import Block
from modern_jax.report import pyplot, save_figure, write_table

VARIANTS = {
    "post-LN": dict(norm_placement="post"),
    "pre-LN": dict(norm_placement="pre"),
    "sandwich": dict(norm_placement="sandwich"),
    "OLMo-2 (output)": dict(norm_placement="output"),
    "post-LN + QK-norm": dict(norm_placement="post", qk_norm="head"),
    "pre-LN + QK-norm": dict(norm_placement="pre", qk_norm="head"),
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def run(variant: dict, n_blocks=32, d=256, heads=4, B=2, T=64, seed=0):
    cfg = ModelConfig(d_model=d, n_layers=n_blocks, n_heads=heads, norm_type="layernorm", ffn_type="mlp",
                      activation="gelu", init="xavier", position_embedding="none", **variant)
    rngs = nnx.Rngs(seed)
    blocks = [Block(cfg, cfg.layer_specs()[i], rngs=rngs) for i in range(n_blocks)]
    keys = jax.random.split(jax.random.key(seed + 1), 2)
    h0 = jax.random.normal(keys[0], (B, T, d))
    readout = jax.random.normal(keys[1], (B, T, d)) / np.sqrt(B * T * d)
    pos = jnp.tile(jnp.arange(T), (B, 1))
    graphdefs, states = zip(*(nnx.split(b) for b in blocks))

    def forward(states):
        h, stream = h0, []
        for graphdef, state in zip(graphdefs, states):
            h, _ = nnx.merge(graphdef, state)(h, pos)
            stream.append(h)
        return jnp.sum(h * readout), stream

    (_, stream), grads = jax.jit(jax.value_and_grad(forward, has_aux=True))(states)
    rows = []
    for i, (h, g) in enumerate(zip(stream, grads)):
        h = np.asarray(h, np.float64)
        row = {"block": i + 1, "stream_rms": float(np.sqrt(np.mean(h**2))),
               "spread": float(np.linalg.norm(h - h.mean(axis=1, keepdims=True)) / np.linalg.norm(h))}
        for name in PROJECTIONS:
            row[f"grad_{name[0]}"] = float(np.linalg.norm(np.asarray(g["self_attn"][name]["kernel"][...])))
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/signal_propagation")
    args = parser.parse_args()
    results = {name: run(variant) for name, variant in VARIANTS.items()}
    summary = []
    for name, rows in results.items():
        write_table(rows, args.out, name.replace(" ", "_").replace("+", "plus").replace("(", "").replace(")", ""),
                    title=f"{name}: per block")
        at = {r["block"]: r for r in rows}
        summary.append({"variant": name, "rms@32": at[32]["stream_rms"], "spread@8": at[8]["spread"],
                        "spread@16": at[16]["spread"], "spread@32": at[32]["spread"],
                        "|dq|@32": at[32]["grad_q"], "|dk|@32": at[32]["grad_k"], "|dv|@32": at[32]["grad_v"],
                        "|do|@32": at[32]["grad_o"]})
    path = write_table(summary, args.out, "summary", title="Signal propagation at init (32 blocks, d=256)")
    print(path.read_text())
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, rows in results.items():
        blocks = [r["block"] for r in rows]
        axes[0].plot(blocks, [r["stream_rms"] for r in rows], label=name)
        axes[1].semilogy(blocks, [r["spread"] for r in rows], label=name)
        axes[2].semilogy(blocks, [r["grad_q"] for r in rows], label=name)
    for ax, title in zip(axes, ("stream RMS", "cross-token spread", "|grad q_proj|")):
        ax.set_title(title)
        ax.set_xlabel("block")
    axes[0].legend(fontsize=7)
    save_figure(fig, f"{args.out}/signal_propagation.png")


if __name__ == "__main__":
    main()
