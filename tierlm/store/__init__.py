"""The running weight stores: resident, tiered (prefetch ring, hot rows, expert cache), LoRA
variants over a base, and the calibration store conversion records activations with."""
