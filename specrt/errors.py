"""User-facing errors: the CLI prints these as one line and exits non-zero."""


class SpecrtError(Exception):
    """A problem with the user's input (paths, checkpoints, artifacts, prompts, flags)."""
