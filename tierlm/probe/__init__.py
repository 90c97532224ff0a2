"""Measuring the machine: bandwidth and FLOP probes and their cached record, the process
baseline a budget charges, the link between pipeline stages, and corrections from measured runs."""
