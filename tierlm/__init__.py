"""tierlm: run large language models inside a fixed memory budget."""

import os

# torch >= 2.5 imports every installed device backend (torch_npu, ...) inside `import torch`; a
# broken one would break CPU users too. tierlm imports torch_npu itself, only for an NPU.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

# OpenMP threads that sleep soon instead of spinning through a busy core's time slices; libgomp
# reads this once, when `import torch` loads it.
from tierlm.device.threads import bound_openmp_spinning  # noqa: E402

bound_openmp_spinning(os.environ)

__version__ = "0.1.0"
