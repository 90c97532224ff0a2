"""The compute device: which one, its dtype, streams/events/pinned memory, memory readings.

`resolve` picks the device (cuda, npu through torch_npu, mps, cpu) and says why one is
unavailable; `backend` gives streams, events, pinned host buffers and device memory figures
behind one interface; `graphs` captures a step and replays it; `host_pages` gives host buffers
on transparent huge pages. Those four hold tensors and import torch. `memory` reads this process's memory and limits, `proc` parses /proc/self/status,
`cpu` the CPU and its usable threads, `threads` the OpenMP defaults `import tierlm` sets: these
four are torch-free, so importing one of them (tierlm/__init__, profile.py) loads no torch.

Import from the submodules: this package's face names none of them, so importing it loads no torch.
"""
