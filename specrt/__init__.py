"""specrt: export-and-runtime toolkit for lossless speculative decoding."""

__version__ = "0.1.0"
