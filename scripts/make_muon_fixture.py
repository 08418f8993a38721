"""The reference for Muon (`tests/fixtures/muon/torch_muon.npz`, read by tests/test_optimizer.py):
`torch.optim.Muon`'s parameters over three steps on fixed gradients, for each `adjust_lr_fn`.

Needs torch 2.13 (CPU), in an environment of its own: torch is no dependency of the project.

    python3.11 -m venv /tmp/muonvenv && /tmp/muonvenv/bin/pip install torch==2.13.0 numpy
    /tmp/muonvenv/bin/python scripts/make_muon_fixture.py

Three matrices (wide, tall, square; torch's weights are `[out, in]`), each with three gradients
drawn once; Muon at lr 0.02, weight decay 0.1, momentum 0.95, Nesterov. torch runs its
Newton-Schulz iteration in bfloat16; the project's runs in float32, so the fixture holds both:
torch as it is (`bf16`), and torch with its iteration in float32 (`f32`: `Tensor.bfloat16`
returning float32 while torch's own step runs; nothing else of torch's changes).
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib

import numpy as np
import torch

SHAPES = {"wide": (6, 10), "tall": (12, 5), "square": (8, 8)}  # torch's [out, in]
LR, WEIGHT_DECAY, MOMENTUM, STEPS = 0.02, 0.1, 0.95, 3


@contextlib.contextmanager
def float32_newton_schulz():
    """torch.optim.Muon's iteration in float32: its one cast, `grad.bfloat16()`, made a float32 one."""
    before = torch.Tensor.bfloat16
    torch.Tensor.bfloat16 = lambda self, *args, **kwargs: self.float()
    try:
        yield
    finally:
        torch.Tensor.bfloat16 = before


def run(params: dict, grads: dict, adjust_lr_fn: str, precision: str) -> dict:
    """`{name: [steps, out, in]}`: each parameter after each step."""
    weights = {name: torch.nn.Parameter(torch.tensor(p)) for name, p in params.items()}
    opt = torch.optim.Muon(list(weights.values()), lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM,
                           nesterov=True, adjust_lr_fn=adjust_lr_fn)
    after = {name: [] for name in params}
    for step in range(STEPS):
        for name, w in weights.items():
            w.grad = torch.tensor(grads[name][step])
        with float32_newton_schulz() if precision == "f32" else contextlib.nullcontext():
            opt.step()
        for name, w in weights.items():
            after[name].append(w.detach().numpy().copy())
    return {name: np.stack(v) for name, v in after.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("tests/fixtures/muon/torch_muon.npz"))
    args = parser.parse_args(argv)
    assert torch.__version__.startswith("2.13"), torch.__version__
    rng = np.random.default_rng(0)
    params = {name: rng.normal(0, 0.5, shape).astype(np.float32) for name, shape in SHAPES.items()}
    grads = {name: rng.normal(0, 1.0, (STEPS, *shape)).astype(np.float32) for name, shape in SHAPES.items()}
    out = {"lr": LR, "weight_decay": WEIGHT_DECAY, "momentum": MOMENTUM}
    for name in SHAPES:
        out[f"{name}/param"], out[f"{name}/grads"] = params[name], grads[name]
    for adjust in ("original", "match_rms_adamw"):
        for precision in ("f32", "bf16"):
            for name, after in run(params, grads, adjust, precision).items():
                out[f"{name}/{adjust}/{precision}"] = after
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **out)
    print(f"wrote {args.out} (torch {torch.__version__})")


if __name__ == "__main__":
    main()
