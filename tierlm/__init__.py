"""tierlm: run large language models inside a fixed memory budget."""

__version__ = "0.1.0"
