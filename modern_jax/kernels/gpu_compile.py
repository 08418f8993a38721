"""Compile the Pallas GPU (Triton) kernels to NVIDIA machine code on a host without a GPU.

The Triton lowering of `pallas_call` (`lowering_platforms=("cuda",)`) embeds each kernel's
Triton IR in a `stablehlo.custom_call @__gpu$xla.gpu.triton` whose backend config holds the
IR as MLIR bytecode beside its name, `num_warps` and `num_stages`. `triton_kernels(lowered)`
finds those calls; `compile_triton(call, arch)` prints the IR as text, compiles it with the
`triton` package (the dev group: `uv sync`, or `pip install triton==3.9.0`) for `sm_90a`
(H100 / H200) or `sm_80` (A100) to PTX and a cubin, reruns the bundled `ptxas -v` on that
PTX for registers and spills, and takes the shared memory from Triton's metadata.

What compiling proves: the kernels lower and compile to real machine code for that
architecture, with the registers, spills and shared memory each one needs, so a tile size
that spills or asks for more shared memory than a block may have (227 KiB on sm_90, 163 KiB
on sm_80; Triton itself checks that only when a kernel is loaded) is caught without a GPU.
What it does not prove: speed, or that the kernels run without faults (out-of-bounds
accesses, races) and give the right numbers; the interpret-mode tests check the numbers.
It compiles with the `triton` package and its bundled ptxas (CUDA 13 for sm_90a, 12.9 for
sm_80, with Triton's flags), not with the Triton and PTX compiler inside XLA, so the counts
are those of the same IR through another build of the same passes: XLA's may differ a little,
which is why the tile choices (`flash_gpu.default_blocks`) keep a margin below the limits.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import jax

from modern_jax.sharding.devices import gpu_arch, lowering_for

TRITON_TARGET = "__gpu$xla.gpu.triton"
MAX_REGISTERS = 255  # per thread, every NVIDIA architecture since Kepler
REGISTERS_PER_SM = 65536


@dataclass(frozen=True)
class TritonCall:
    """One Triton kernel of a lowered computation."""

    name: str
    ir: bytes  # MLIR bytecode of the Triton module
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class KernelReport:
    """What compiling one kernel for one architecture needed, and whether it fits."""

    name: str
    arch: str
    num_warps: int
    num_stages: int
    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    shared_bytes: int
    register_limit: int
    shared_limit: int

    @property
    def spill_bytes(self) -> int:
        return self.spill_stores + self.spill_loads

    @property
    def ok(self) -> bool:
        """Within the registers a thread may have, no spills, and shared memory a block may have."""
        fits = self.registers <= self.register_limit and self.shared_bytes <= self.shared_limit
        return fits and self.spill_bytes == 0

    def line(self) -> str:
        return (f"regs {self.registers:3d}/{self.register_limit} spills {self.spill_bytes:4d} B "
                f"smem {self.shared_bytes / 1024:6.1f}/{self.shared_limit / 1024:.0f} KiB "
                f"warps {self.num_warps:2d} stages {self.num_stages}")


def _triton():
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError as e:
        raise ImportError("compiling the Pallas GPU kernels needs the `triton` package: `uv sync` (it is in the "
                          "dev group) or `pip install triton==3.9.0`") from e
    return triton, GPUTarget, get_ptxas


def lower(fn, *args, arch: str = "sm_90a"):
    """`jax.jit(fn)` traced on `args` (arrays or ShapeDtypeStructs) and lowered for CUDA on `arch`."""
    with lowering_for(arch):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def triton_kernels(lowered) -> list[TritonCall]:
    """The Triton kernels of a lowered computation (a `jax.stages.Lowered`), in program order."""
    from jaxlib.mlir import ir

    calls = []

    def visit(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    child = child.operation
                    if (child.name == "stablehlo.custom_call"
                            and ir.StringAttr(child.attributes["call_target_name"]).value == TRITON_TARGET):
                        config = ir.DictAttr(child.attributes["mhlo.backend_config"])
                        calls.append(TritonCall(ir.StringAttr(config["name"]).value,
                                                ir.StringAttr(config["ir"]).value_bytes,
                                                ir.IntegerAttr(config["num_warps"]).value,
                                                ir.IntegerAttr(config["num_stages"]).value))
                    visit(child)

    module = lowered.compiler_ir("stablehlo")
    with module.context:
        visit(module.operation)
    return calls


def triton_ir_text(call: TritonCall) -> str:
    """The kernel's Triton IR as text (`.ttir`), parsed with jaxlib's Triton dialect."""
    from jaxlib.mlir import ir
    from jaxlib.triton import dialect as tt_dialect

    context = ir.Context()
    tt_dialect.register_dialect(context)
    with context:
        return ir.Module.parse(call.ir).operation.get_asm(enable_debug_info=False)


def _ptxas_usage(ptxas: str, ptx: str, gpu_name: str, workdir: Path) -> dict[str, int]:
    """Registers, spill bytes and static shared memory, from `ptxas -v` (Triton's own flags)."""
    src, out = workdir / "kernel.ptx", workdir / "kernel.cubin"
    src.write_text(ptx)
    run = subprocess.run([ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={gpu_name}", str(src),
                          "-o", str(out)], capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"ptxas failed ({run.returncode}):\n{run.stderr}")
    log = run.stderr

    def number(pattern: str) -> int:
        found = re.search(pattern, log)
        return int(found.group(1)) if found else 0

    registers = re.search(r"Used (\d+) registers", log)
    if registers is None:
        raise RuntimeError(f"ptxas -v reported no register count:\n{log}")
    return dict(registers=int(registers.group(1)), spill_stores=number(r"(\d+) bytes spill stores"),
                spill_loads=number(r"(\d+) bytes spill loads"), static_shared=number(r"(\d+) bytes smem"))


def compile_triton(call: TritonCall, arch: str = "sm_90a") -> KernelReport:
    """Compile one Triton kernel for `arch` ('sm_90a' or 'sm_80') and report what it needs."""
    spec = gpu_arch(arch)
    triton, GPUTarget, get_ptxas = _triton()
    with tempfile.TemporaryDirectory(prefix="modern_jax_triton_") as tmp:
        workdir = Path(tmp)
        source = workdir / f"{call.name}.ttir"
        source.write_text(triton_ir_text(call))
        kernel = triton.compile(str(source), target=GPUTarget("cuda", spec.capability, 32),
                                options=dict(num_warps=call.num_warps, num_stages=call.num_stages,
                                             enable_fp_fusion=True))
        gpu_name = re.search(r"^\.target\s+(\w+)", kernel.asm["ptx"], re.MULTILINE).group(1)
        usage = _ptxas_usage(get_ptxas(spec.capability).path, kernel.asm["ptx"], gpu_name, workdir)
    threads = 32 * call.num_warps
    return KernelReport(
        name=call.name, arch=gpu_name, num_warps=call.num_warps, num_stages=call.num_stages,
        registers=usage["registers"], spill_stores=usage["spill_stores"], spill_loads=usage["spill_loads"],
        shared_bytes=kernel.metadata.shared + usage["static_shared"],
        register_limit=min(MAX_REGISTERS, REGISTERS_PER_SM // threads // 8 * 8), shared_limit=spec.shared_bytes)
