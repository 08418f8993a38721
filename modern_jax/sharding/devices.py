"""The devices a computation runs on or is compiled for: the platform, the TPU chips (`CHIPS`) and
their topologies (without a TPU), an abstract GPU.

    with compiling_for(mesh):                        # kernels resolve for the mesh's devices' platform
        ...
    devices = topology_devices("v5p:2x2x2")          # 8 compile-only v5p chips (libtpu, deviceless)
    mesh = make_mesh(fsdp=8, devices=devices)
    jax.jit(step, in_shardings=...).lower(abstract args).compile()   # the TPU compiler
    with lowering_for("sm_90a", mesh):               # an abstract H100 mesh: lower for CUDA here
        jax.jit(step).trace(...).lower(lowering_platforms=("cuda",))

The platform is the one the computation is compiled for, not the host's: inside
`compiling_for(target)` (the trainer enters it for its mesh) it is that target's platform, so a
step compiled for a TPU topology from a CPU host (`plan --topology`) picks and compiles the TPU
kernels; else an abstract mesh in context that names its device (`lowering_for`) decides, then
the default backend.

`libtpu` (`uv sync --extra tpu`, or the dev group) describes any topology it knows
(`v4:2x2x1`, `v5e:4x4`, `v5p:4x4x4`, `v6e:4x4`, ...; `slices=2` for multi-slice) and
compiles for it on a CPU host: lowering, VMEM fit and HBM fit are the chip's own, nothing
runs. The chip kinds, their memory per chip and the dimensions of their slices are in
`CHIPS`; a name is checked against them before libtpu sees it (libtpu stops the process on
some malformed names, e.g. a dimension of 0). The GPU architectures an abstract device can
stand for are in `ARCHS` (`kernels.gpu_compile` compiles their Triton kernels).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import warnings
from dataclasses import dataclass

import jax

GiB = 1024**3


@dataclass(frozen=True)
class Chip:
    name: str  # the generation as topologies spell it
    hbm_gib: float  # high-bandwidth memory per chip
    dims: int  # the dimensions of its slices' shapes: 2 (v5e:4x4) or 3 (v5p:4x4x4)
    peak_tflops: float  # dense bf16 matmul peak per chip (Google Cloud's published figure): MFU's denominator


CHIPS = {  # jax's device_kind -> the chip
    "TPU v4": Chip("v4", 32, 3, 275),
    "TPU v5 lite": Chip("v5e", 16, 2, 197),
    "TPU v5": Chip("v5p", 95, 3, 459),
    "TPU v6 lite": Chip("v6e", 32, 2, 918),
}
EXPECTED = "expected GENERATION:SHAPE such as v5e:2x2, v6e:4x4, v5p:2x2x2, v4:2x2x1"
_TOPOLOGY = re.compile(r"(?P<generation>[^:]*):(?P<shape>[^_]*)(?P<twist>_twisted|_untwisted)?")

# libtpu looks for a TPU VM's metadata when it loads; these say there is none (no warnings). It
# also takes a lockfile meant for processes that share chips: compile-only processes share none.
_QUIET = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_ACCELERATOR_TYPE": "v5p-8", "TF_CPP_MIN_LOG_LEVEL": "3",
          "TPU_SKIP_MDS_QUERY": "1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def no_tpu_runtime_without_chips() -> None:
    """Leave libtpu's runtime out of a host with no TPU chip. libtpu is installed for compiling to
    TPU topologies (the dev group, `--extra tpu`), so jax would otherwise start its runtime on
    every CPU or GPU host, where it fails after printing its start-up warnings (no accelerator
    type, no worker hostnames) on every command. A platform list (`JAX_PLATFORMS`) or
    `JAX_FORCE_TPU_INIT` still has the last word; compiling for a topology (`topology_devices`)
    loads libtpu by itself. Call it before the first computation starts jax's backends."""
    from jax._src import hardware_utils, xla_bridge

    if (jax.config.jax_platforms or "JAX_FORCE_TPU_INIT" in os.environ or xla_bridge.backends_are_initialized()
            or hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0):
        return

    def absent():
        raise RuntimeError("no TPU chip on this host")

    # the platform stays known (the TPU kernels' lowerings are registered for it); its runtime fails quietly
    xla_bridge.register_backend_factory("tpu", absent, priority=300, fail_quietly=True)


def check_topology(name: str) -> None:
    """A ValueError naming what is wrong with TPU topology `name` unless it is GENERATION:SHAPE with a
    known generation and as many positive dimensions as its slices have (`_twisted` may follow)."""
    chips = {c.name: c for c in CHIPS.values()}
    match = _TOPOLOGY.fullmatch(name)
    if match is None:
        problem = "not a topology name"
    elif match["generation"] not in chips:
        problem = f"unknown generation {match['generation']!r} (known: {', '.join(chips)})"
    else:
        chip, dims = chips[match["generation"]], match["shape"].split("x")
        if not all(d.isdigit() and int(d) > 0 for d in dims):
            problem = f"every dimension of the shape {match['shape']!r} must be a positive integer"
        elif len(dims) != chip.dims:
            problem = f"{chip.name} slices have {chip.dims} dimensions, {match['shape']!r} has {len(dims)}"
        else:
            return
    raise ValueError(f"--topology {name!r}: {problem}; {EXPECTED}")


def topology_devices(name: str, slices: int = 1) -> list:
    """The compile-only devices of TPU topology `name` (e.g. "v5p:2x2x2"), over `slices` slices."""
    check_topology(name)
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise ValueError(f"--topology {name}: compiling for a TPU needs libtpu: `uv sync --extra tpu` "
                         f"(or `pip install 'jax[tpu]'`); without it, --mesh alone gives the host-CPU "
                         f"estimate") from None
    if not isinstance(slices, int) or slices < 1:
        raise ValueError(f"slices={slices!r}: expected a positive integer")
    for key, value in _QUIET.items():
        os.environ.setdefault(key, value)
    from jax.experimental import topologies

    kwargs = {"num_slices": slices} if slices > 1 else {}
    try:
        return list(topologies.get_topology_desc(topology_name=name, platform="tpu", **kwargs).devices)
    except jax.errors.JaxRuntimeError as e:
        reason = str(e).split("\n")[0].removeprefix("INVALID_ARGUMENT: ")
        raise ValueError(f"--topology {name!r}: libtpu refuses it ({reason}); {EXPECTED}") from None


def chip(devices) -> Chip | None:
    """The chip of a list of TPU devices (None for a kind not in `CHIPS`)."""
    return CHIPS.get(devices[0].device_kind)


_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("modern_jax_target_platform", default=None)


def _platform_name(name: str) -> str:
    return "gpu" if name in ("cuda", "rocm") else name


def device_platform(target) -> str:
    """The platform of `target`: a name ('cpu', 'gpu', 'cuda', 'tpu'), a Mesh, or a sequence of devices."""
    if isinstance(target, str):
        return _platform_name(target)
    devices = getattr(target, "devices", target)
    devices = list(devices.flat) if hasattr(devices, "flat") else list(devices)
    if not devices:
        raise ValueError("compiling_for: no devices to take the platform from")
    kinds = {_platform_name(d.platform) for d in devices}
    if len(kinds) > 1:
        raise ValueError(f"compiling_for: the devices mix platforms ({', '.join(sorted(kinds))})")
    return kinds.pop()


@contextlib.contextmanager
def compiling_for(target):
    """Trace kernels inside the block for `target` (a platform name, a Mesh or devices)."""
    token = _TARGET.set(device_platform(target))
    try:
        yield
    finally:
        _TARGET.reset(token)


def platform() -> str:
    """The platform computations are compiled for: 'cpu', 'gpu' or 'tpu' (see the module docstring)."""
    target = _TARGET.get()
    if target is not None:
        return target
    device = jax.sharding.get_abstract_mesh().abstract_device
    if device is not None:
        return _platform_name(device.platform)
    return _platform_name(jax.default_backend())


@dataclass(frozen=True)
class Arch:
    """A GPU architecture to compile for: its compute capability, a device that has it, and its limits."""

    capability: int
    device_kind: str  # an abstract device of this architecture, for the lowering
    num_cores: int
    shared_bytes: int  # the most dynamic shared memory one block may use (opt-in)


ARCHS = {
    "sm_90a": Arch(90, "NVIDIA H100 80GB HBM3", 132, 227 * 1024),
    "sm_80": Arch(80, "NVIDIA A100-SXM4-80GB", 108, 163 * 1024),
}


def gpu_arch(arch: str) -> Arch:
    if arch not in ARCHS:
        raise ValueError(f"GPU arch {arch!r}: expected one of {', '.join(ARCHS)}")
    return ARCHS[arch]


@contextlib.contextmanager
def lowering_for(arch: str = "sm_90a", mesh=None):
    """Trace and lower inside the block for GPUs of `arch`, with no GPU here.

    The kernel dispatch resolves for GPU, and the Triton lowering finds its device in an
    abstract mesh of `mesh`'s axes (default: one device, axis `x`). Jax's deprecation of the
    Triton backend is silenced.
    """
    spec = gpu_arch(arch)
    device = jax.sharding.AbstractDevice(device_kind=spec.device_kind, num_cores=spec.num_cores, platform="gpu")
    sizes, names, types = ((1,), ("x",), (jax.sharding.AxisType.Explicit,)) if mesh is None else (
        mesh.axis_sizes, mesh.axis_names, mesh.axis_types)
    abstract = jax.sharding.AbstractMesh(sizes, names, types, abstract_device=device)
    with compiling_for("gpu"), jax.sharding.use_abstract_mesh(abstract), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield
