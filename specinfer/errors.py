"""The one exception type users see: a problem with their input, said in one line."""


class SpecInferError(Exception):
    """Bad input or an unsupported model: the message names the problem (CLI exit code 2)."""
