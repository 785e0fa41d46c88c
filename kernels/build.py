"""Build (JIT, cached) and load the CUDA extension.

Nothing here runs at `import kernels`: the build happens on the first kernel call,
on `kernels.is_available()`, or ahead of time with

    python -m kernels.build          # prints the build time

Cache: $FLASHGPT_KERNEL_CACHE if set, else ~/.cache/flashgpt/kernels/<torch version>-<source hash>
(the hash covers every file under csrc/ and the flags, so an edit rebuilds and a stale .so is
never loaded). Honoured: MAX_JOBS (parallel nvcc jobs, read by torch's ninja build) and
TORCH_CUDA_ARCH_LIST (default: the current GPU; sm_90 -> compute_90a/sm_90a, sm_80 -> sm_80).
"""
from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

from .tune_cache import apply_cached

CSRC = Path(__file__).resolve().parent / "csrc"

CXX_FLAGS = ["-O3"]  # the C++ standard is torch's choice (C++17 or C++20 by version)
NVCC_FLAGS = [
    "-O3",
    "--use_fast_math",
    "-Xptxas=-v",            # register / spill report in the build log (verbose builds)
    "-lineinfo",
    "--expt-relaxed-constexpr",
]

_lock = threading.Lock()
_ext: ModuleType | None = None
_error: str | None = None


def sources() -> list[Path]:
    """The binding, the pre/post-pass kernels, the Hopper sources, every generated instantiation and
    the GELU MLP's cuBLASLt calls and backward kernel (csrc/mlp), the residual add + LayerNorm (csrc/norm)."""
    inst = sorted((CSRC / "instantiations").glob("*.cu"))
    return [CSRC / "flash_api.cpp", CSRC / "flash_bwd_pre_post.cu", *sorted((CSRC / "hopper").glob("*.cu")), *inst,
            *sorted((CSRC / "mlp").glob("*.cpp")), *sorted((CSRC / "mlp").glob("*.cu")),
            *sorted((CSRC / "norm").glob("*.cpp")), *sorted((CSRC / "norm").glob("*.cu"))]


def cublaslt_ldflags() -> list[str]:
    """Linker flags for cuBLASLt (csrc/mlp): the copy torch's CUDA wheel depends on
    (site-packages/nvidia/*/lib, the one torch loads at import), else the toolkit's. Empty when
    neither is found: torch has then loaded it globally itself and the symbols resolve at import."""
    import importlib.util

    dirs = []
    spec = importlib.util.find_spec("nvidia")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            dirs += sorted(Path(root).glob("*/lib"))
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    dirs.append(Path(cuda_home) / "lib64")
    for d in dirs:
        libs = sorted(d.glob("libcublasLt.so*"))
        if libs:
            return [f"-L{d}", f"-l:{libs[0].name}", f"-Wl,-rpath,{d}"]
    return []


def source_hash() -> str:
    h = hashlib.sha256()
    for p in sorted(CSRC.rglob("*")):
        if p.is_file() and p.suffix in {".h", ".cu", ".cpp", ".cuh"}:
            h.update(str(p.relative_to(CSRC)).encode())
            h.update(p.read_bytes())
    h.update(" ".join(CXX_FLAGS + NVCC_FLAGS).encode())
    return h.hexdigest()[:16]


def default_arch_list() -> str:
    """TORCH_CUDA_ARCH_LIST for the current GPU ("9.0a" on Hopper: wgmma-capable target)."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}" + ("a" if (major, minor) == (9, 0) else "")


def build_dir() -> Path:
    import torch

    env = os.environ.get("FLASHGPT_KERNEL_CACHE")
    base = Path(env) if env else Path.home() / ".cache" / "flashgpt" / "kernels"
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST") or default_arch_list()
    tag = f"{torch.__version__}-{source_hash()}-sm{arch.replace('.', '').replace(' ', '_').replace(';', '_')}"
    return base / tag


def load_extension(verbose: bool = False) -> ModuleType:
    """Build if needed and import the extension. Raises RuntimeError with a clear reason."""
    global _ext, _error
    if _ext is not None:
        return _ext
    with _lock:
        if _ext is not None:
            return _ext
        import torch

        if not torch.cuda.is_available():
            _error = (
                "CUDA is not available in this process (torch "
                f"{torch.__version__}, built with CUDA {torch.version.cuda}). Our FlashAttention "
                "kernels need an NVIDIA GPU (sm_80 or newer) and a CUDA build of torch."
            )
            raise RuntimeError(_error)
        major, _ = torch.cuda.get_device_capability()
        if major < 8:
            _error = f"GPU compute capability {major}.x < 8.0: mma.sync bf16 needs sm_80+."
            raise RuntimeError(_error)
        from torch.utils import cpp_extension

        out = build_dir()
        out.mkdir(parents=True, exist_ok=True)
        old_arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
        if not old_arch:
            os.environ["TORCH_CUDA_ARCH_LIST"] = default_arch_list()
        # The Hopper (wgmma) kernels exist only in sm_90a code; the host-side dispatch picks them
        # only when the build has it (csrc/hopper/dispatch.h).
        hopper = ["-DFLASHGPT_HAS_SM90A"] if "9.0a" in os.environ["TORCH_CUDA_ARCH_LIST"] else []
        try:
            _ext = cpp_extension.load(
                name="flashgpt_fa2_" + source_hash(),
                sources=[str(s) for s in sources()],
                extra_cflags=CXX_FLAGS,
                extra_cuda_cflags=NVCC_FLAGS + hopper,
                extra_include_paths=[str(CSRC)],
                extra_ldflags=cublaslt_ldflags(),
                build_directory=str(out),
                verbose=verbose,
            )
        except Exception as e:  # compiler missing, nvcc error, ...
            _error = f"building the CUDA extension failed ({type(e).__name__}: {e})"
            raise RuntimeError(
                _error + f"\nBuild directory: {out}. Fix: install the CUDA toolkit (nvcc) matching "
                "torch.version.cuda, set CUDA_HOME, or run `python -m kernels.build` to see the log."
            ) from e
        finally:
            if not old_arch:
                os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        _error = None
        apply_cached(_ext, source_hash())  # this GPU's measured kernel choices, if tuned
        return _ext


def is_available() -> bool:
    """True only if CUDA is present AND the extension builds/loads (may trigger the build)."""
    try:
        load_extension()
        return True
    except Exception as e:  # noqa: BLE001 - report, don't raise
        global _error
        _error = _error or str(e)
        return False


def unavailable_reason() -> str:
    """Why is_available() is False ("" if it is True or was never asked)."""
    if _ext is not None:
        return ""
    if _error is None:
        is_available()
    return _error or ""


def main() -> int:
    import torch

    t0 = time.perf_counter()
    try:
        ext = load_extension(verbose="-v" in sys.argv or "--verbose" in sys.argv)
    except RuntimeError as e:
        print(f"build failed: {e}", file=sys.stderr)
        return 1
    dt = time.perf_counter() - t0
    print(f"flashgpt kernels ready: {ext.__file__}")
    print(f"build/load time: {dt:.1f} s  (MAX_JOBS={os.environ.get('MAX_JOBS', 'default')}, "
          f"arch={os.environ.get('TORCH_CUDA_ARCH_LIST') or default_arch_list()}, torch {torch.__version__}, "
          f"{len(sources())} sources)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
