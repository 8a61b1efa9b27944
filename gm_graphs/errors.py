"""Errors raised for bad input. Each message names the problem and the fix."""


class GraphmaxError(Exception):
    """Base class of graphmax's user-facing errors."""


class CorpusError(GraphmaxError, ValueError):
    """A corpus file is missing, empty, unreadable or lacks the text column."""


class TokenizerError(GraphmaxError, ValueError):
    """A tokenizer cannot be loaded, or does not match a graph's vocabulary."""


class GraphExistsError(GraphmaxError, FileExistsError):
    """A graph of that name exists and overwrite was not asked for."""


class GraphFormatError(GraphmaxError, ValueError):
    """A graph folder is missing, truncated, corrupted or of another format version."""
