"""The optional compiled CPU kernel: paged decode attention read straight from the KV cache.

``csrc/paged_decode.c`` (plain C, OpenMP, no Python or torch headers) is compiled once per machine with the
system C compiler (``$CC``, else ``cc``) into the user cache directory, and loaded with ``ctypes``. Compiling takes
about a second; later processes load the cached library. The file name carries a hash of the source, the flags,
the compiler's version and this CPU's feature flags, so an edited source, another compiler or another CPU
(``-march=native``) builds its own copy.

Nothing depends on it: without a compiler, on a build error, or with ``SARATHI_LITE_NATIVE=0`` in the
environment, ``paged_decode_library()`` returns None (the reason logged once) and the CPU attention falls back to
the pure-torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")
DISABLE_ENV = "SARATHI_LITE_NATIVE"
HEAD_DIMS = (16, 32, 64, 128)
MAX_GROUP = 16
MAX_QO_HEADS = 128


def cache_root() -> Path:
    """The user cache directory (the same ``$SARATHI_LITE_CACHE`` the embedded model uses)."""
    return Path(os.environ.get("SARATHI_LITE_CACHE", Path.home() / ".cache" / "sarathi-lite"))


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def build(out_dir: Path | None = None) -> Path:
    """Compile the kernel into ``out_dir`` (default: the cache's ``native`` folder) unless already there; return
    the library's path. Raises RuntimeError naming what is missing or what the compiler said."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError(f"no C compiler found ($CC={os.environ.get('CC')!r}, cc, gcc)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[:1]
    key = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(FLAGS), *version, _cpu_flags(),
                                    platform.machine()]).encode()).hexdigest()[:16]
    out_dir = out_dir or cache_root() / "native"
    lib = out_dir / f"paged_decode-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:  # concurrent builders each write their own, then rename
        part = Path(tmp) / lib.name
        done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(part)], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed to compile {SOURCE.name}: {done.stderr.strip()[-2000:]}")
        os.replace(part, lib)
    return lib


def native_enabled() -> bool:
    """False when ``SARATHI_LITE_NATIVE=0``: the switch that turns every CPU fast path off (this compiled kernel,
    and the packed bfloat16 weights of ``models.parallel.pack_weights``), leaving the plain torch paths."""
    return os.environ.get(DISABLE_ENV, "1") != "0"


@functools.cache
def paged_decode_library() -> ctypes.CDLL | None:
    """The loaded kernel with its signature set, or None (see the module docstring); built on first use."""
    if not native_enabled():
        logger.info("native CPU kernels off (%s=0)", DISABLE_ENV)
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("the compiled CPU decode attention is unavailable, using the torch path: %s", exc)
        return None
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.paged_decode.argtypes = [p, p, p, p, i, i, p, p, p, i, i, i, i, i, ctypes.c_float, i, i, ctypes.c_int]
    lib.paged_decode.restype = ctypes.c_int
    return lib


OPENMP_RUNTIMES = ("libgomp", "libiomp5", "libomp")


def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch runs on (the one loaded in this process, found in ``/proc/self/maps``, so a
    wheel's vendored copy is found under its own name), or None (not Linux, none loaded, or no OpenMP 5 API)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        path = fields[-1] if len(fields) >= 6 else ""
        if path.startswith("/") and Path(path).name.startswith(OPENMP_RUNTIMES):
            try:
                lib = ctypes.CDLL(path)  # already loaded: the same handle, nothing new runs
            except OSError:
                continue
            if hasattr(lib, "omp_pause_resource_all"):
                return lib
    return None


def release_thread_pool() -> bool:
    """Release the calling thread's idle OpenMP worker threads; returns whether they were released.

    Call it from a thread that hands its torch work over to another thread for good (``AsyncLLMEngine``: the
    engine is built in the caller's thread and stepped in its own). Each thread that runs a parallel region keeps
    a pool of workers, and when the process holds more OpenMP threads than CPUs, libgomp makes every idle worker
    spin only briefly before it sleeps, so each of a step's ~120 matmuls then waits for a worker to wake up
    (measured on this project's 2-core CPU: a 2-decode bfloat16 SmolLM2 step took 45 ms in the
    thread that built the engine, 60 ms in a second thread, 45 ms there with the builder's pool released). A
    later parallel region in the calling thread builds a new pool (correct, only slower again). Uses OpenMP 5's
    ``omp_pause_resource_all(omp_pause_soft)``."""
    lib = _openmp_runtime()
    return lib is not None and lib.omp_pause_resource_all(1) == 0


def unsupported(head_dim: int, group: int, num_qo_heads: int) -> str | None:
    """Why the kernel cannot take this attention shape, or None if it can."""
    if num_qo_heads > MAX_QO_HEADS:
        return f"{num_qo_heads} query heads (at most {MAX_QO_HEADS} on one device)"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (the kernel takes {', '.join(map(str, HEAD_DIMS))})"
    if not 1 <= group <= MAX_GROUP:
        return f"{group} query heads per KV head (at most {MAX_GROUP})"
    return None
