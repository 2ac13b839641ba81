"""The compiled CPU kernels (`worker_service/csrc/`): the library's build and cache (`library.py`),
its ctypes signatures and status check (`signatures.py`), the tensor-level calls
(`kernels.py`) and the paged attention's per-step plan (`plan.py`)."""

from worker_service.native.kernels import GemvWeight, NativeKernels, failure, load
from worker_service.native.library import build
from worker_service.native.signatures import DTYPE_CODES, KernelError

__all__ = ["DTYPE_CODES", "GemvWeight", "KernelError", "NativeKernels", "build", "failure", "load"]
