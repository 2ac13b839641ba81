"""The worker's backends: one contract (`base.py`), one implementation per way of running a step
(PyTorch's ops, the compiled CPU kernels, Triton with CUDA graphs), chosen once (`selection.py`)."""

from worker_service.backends.base import Backend, PackedLinear, StepBatch, StepContext
from worker_service.backends.selection import KERNEL_CHOICES, Selection, select_backend

__all__ = ["KERNEL_CHOICES", "Backend", "PackedLinear", "Selection", "StepBatch", "StepContext", "select_backend"]
