"""Loading a Hugging Face checkpoint by shard: each process's peak memory, against one process's.

    uv run python scripts/bench_load_shards.py [--dir /tmp/bench_load_shards] [--layers 12]
    uv run python scripts/bench_load_shards.py --footprints     # the docs' 405B / DeepSeek-V3 figures

Writes (once, under --dir) a random Llama-family checkpoint in bfloat16 of about 1.3 GB, then on
localhost: 1 process x 8 CPU devices and 2 processes x 4 CPU devices, each with every device on
`fsdp`, run `from_hf` (bfloat16 parameters) and `to_hf` of the loaded model. Each process reports
the peak of its resident memory (VmHWM, reset before each step) above what it held before the step,
as a ratio of the checkpoint's size; the logits of the 2-process load must equal the 1-process
load's exactly, and the tensors the 2 processes export must equal, byte for byte, those 1 process
exports. With CPU devices a process's devices are its host memory: its share of the model (1/2
here) is part of what loading adds. `--footprints` prints, from the loader's own accounting
(`hf_checkpoint.load_footprint`), the bytes per process of loading Llama 3.1 405B and DeepSeek-V3
on the meshes the planner sizes them for.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOKENS_SEED = 0


def write_checkpoint(directory: Path, layers: int) -> int:
    """A random bfloat16 Llama checkpoint, written a tensor at a time; its size in bytes."""
    import ml_dtypes
    import numpy as np

    from modern_jax.convert.hf_checkpoint import plan, targets
    from modern_jax.convert.hf_config import config_from_hf, config_to_hf
    from modern_jax.convert.hf_families import FAMILIES
    from modern_jax.convert.safetensors_files import SafetensorsWriter
    from modern_jax.model import abstract_model

    hf = dict(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
              num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False, torch_dtype="bfloat16")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        directory.mkdir(parents=True, exist_ok=True)
        cfg = config_from_hf(hf)
        model = abstract_model(cfg)
        sources = plan(targets(model, __import__("flax").nnx.state(model, __import__("flax").nnx.Param),
                               FAMILIES["llama"]))
        shapes = {name: srcs[0].rule.hf_shape(srcs[0].shape, cfg.vocab_size) for name, srcs in sorted(sources.items())}
        names = list(shapes)
        rng = np.random.default_rng(0)
        for k, part in enumerate((names[:len(names) // 2], names[len(names) // 2:])):  # two files and an index
            writer = SafetensorsWriter(directory / f"model-{k + 1:05d}-of-00002.safetensors",
                                       {n: (shapes[n], "BF16") for n in part})
            for n in part:
                writer.write(n, (rng.standard_normal(shapes[n], np.float32) * 0.02).astype(ml_dtypes.bfloat16))
            writer.close()
        weight_map = {n: f"model-{1 if n in names[:len(names) // 2] else 2:05d}-of-00002.safetensors" for n in names}
        (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        (directory / "config.json").write_text(json.dumps({**config_to_hf(cfg, "llama"), "torch_dtype": "bfloat16"}))
        files = sorted(directory.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files)


def rss() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak() -> int:
    """Reset VmHWM to the current RSS; returns the current RSS."""
    Path("/proc/self/clear_refs").write_text("5")
    return rss()["VmRSS"]


def worker(args) -> None:
    """One process of a launch: load, run the logits, export; report each step's peak."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils

    from modern_jax.multihost import distributed

    distributed.start(distributed.detect(), "bench")
    from modern_jax.convert import from_hf, to_hf
    from modern_jax.sharding import logical_rules

    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    jnp.zeros(1).block_until_ready()
    base = reset_peak()
    cfg, model = from_hf(args.dir, dtype="bfloat16", mesh=mesh)
    load_peak = rss()["VmHWM"] - base
    print(f"loaded: peak {load_peak / 2**30:.2f} GiB above {base / 2**30:.2f}", file=sys.stderr, flush=True)
    tokens = np.random.default_rng(TOKENS_SEED).integers(0, cfg.vocab_size, (8, 64))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    placed = jax.make_array_from_callback(tokens.shape, sharding, lambda i: tokens[i])
    with logical_rules(mesh):
        logits = jax.jit(lambda m, t: m(t))(model, placed)
    logits = multihost_utils.process_allgather(logits, tiled=True)
    print(f"logits: RSS {rss()['VmRSS'] / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    base = reset_peak()
    out = Path(args.export)
    to_hf(model, out, model_type="llama")
    export_peak = rss()["VmHWM"] - base
    result = {"process": jax.process_index(), "load_peak": load_peak, "export_peak": export_peak}
    print("RESULT " + json.dumps(result), flush=True)
    if jax.process_index() == 0:
        np.save(out.parent / f"{out.name}.logits.npy", np.asarray(logits, np.float32))
    distributed.finish()


def launch(n: int, devices: int, directory: Path, export: Path) -> list[dict]:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    procs, logs = [], [export.parent / f"{export.name}.process{i}.log" for i in range(n)]
    for i in range(n):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_"))}
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                   MODERN_JAX_COMPILE_CACHE="off")
        if n > 1:
            env.update(JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES=str(n), JAX_PROCESS_ID=str(i))
        with open(logs[i], "w") as log:
            procs.append(subprocess.Popen([sys.executable, __file__, "--worker", "--dir", str(directory), "--export",
                                           str(export)], env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
    results = []
    for p, log in zip(procs, logs):
        p.wait()
        output = log.read_text()
        lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
        if p.returncode or not lines:
            raise SystemExit(f"a process failed ({log}):\n{output[-3000:]}")
        results.append(json.loads(lines[0].removeprefix("RESULT ")))
    return results


def exported(directory: Path) -> dict[str, bytes]:
    from modern_jax.convert.safetensors_files import SafetensorsFiles

    files = SafetensorsFiles(sorted(directory.glob("*.safetensors")))
    return {name: files.read(entry).tobytes() for name, entry in files.entries.items()}


def footprints() -> None:
    from modern_jax.config import ModelConfig
    from modern_jax.configfile import read_yaml
    from modern_jax.convert.hf_checkpoint import load_footprint

    gib = 2**30
    plans = [("Llama 3.1 405B", "configs/llama3_1_405b.yaml", "llama", {"stage": 2, "fsdp": 16, "tensor": 8}, 64),
             ("DeepSeek-V3 671B", "configs/deepseek_v3.yaml", "deepseek_v3", {"fsdp": 16, "expert": 16}, 64)]
    print("| model | mesh (256 v5p chips, 64 processes of 4) | checkpoint (bfloat16) | read by a process | held by its "
          "4 chips | host memory beside them |")
    print("|---|---|---|---|---|---|")
    for name, config, model_type, mesh, processes in plans:
        cfg = ModelConfig.from_dict(read_yaml(REPO / config)["model"])
        f = load_footprint(cfg, model_type, mesh, processes)
        total = load_footprint(cfg, model_type, {"fsdp": 1}, 1)["read"]
        shape = " x ".join(f"{k} {v}" for k, v in mesh.items())
        print(f"| {name} | {shape} | {total / gib:,.1f} GiB | {f['read'] / gib:,.2f} GiB | {f['held'] / gib:,.2f} GiB "
              f"({cfg.param_dtype}) | {f['slice'] / gib:,.2f} GiB |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/bench_load_shards/hf", help="where the checkpoint is (made once)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--export", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--footprints", action="store_true", help="print the 405B / DeepSeek-V3 loading footprints")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.footprints:
        return footprints()
    import shutil

    import numpy as np

    directory = Path(args.dir)
    size = write_checkpoint(directory, args.layers)
    print(f"checkpoint: {directory} ({size / 2**30:.2f} GiB, bfloat16)")
    rows = {}
    for n, devices in ((1, 8), (2, 4)):
        export = directory.parent / f"export_{n}"
        shutil.rmtree(export, ignore_errors=True)
        rows[n] = launch(n, devices, directory, export)
    print("| processes x devices | peak RSS added by from_hf / checkpoint | by to_hf / checkpoint |")
    print("|---|---|---|")
    for n, results in rows.items():
        for r in results:
            print(f"| {n} x {8 // n} (process {r['process']}) | {r['load_peak'] / size:.3f}x | "
                  f"{r['export_peak'] / size:.3f}x |")
    one, two = (np.load(directory.parent / f"export_{n}.logits.npy") for n in (1, 2))
    print(f"logits of the 2-process load equal the 1-process load's exactly: {bool(np.array_equal(one, two))}")
    a, b = exported(directory.parent / "export_1"), exported(directory.parent / "export_2")
    same = sorted(a) == sorted(b) and all(a[k] == b[k] for k in a)
    print(f"tensors exported by 2 processes equal 1 process's byte for byte: {same} ({len(a)} tensors)")


if __name__ == "__main__":
    main()
