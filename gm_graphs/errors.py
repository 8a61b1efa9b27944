"""Errors raised for bad input. Each message names the problem and the fix, on one line."""


class GraphmaxError(Exception):
    """Base class of graphmax's user-facing errors."""


class CorpusError(GraphmaxError, ValueError):
    """A corpus file is missing, empty, unreadable or lacks the text column."""


class TokenizerError(GraphmaxError, ValueError):
    """A tokenizer cannot be loaded, or does not match a graph's vocabulary."""


class GraphExistsError(GraphmaxError, FileExistsError):
    """A graph of that name exists and overwrite was not asked for."""


class NotOwnedError(GraphmaxError, FileExistsError):
    """A folder is in the way that graphmax did not write: it is never replaced or deleted."""


class GraphNameError(GraphmaxError, ValueError):
    """A ``str`` that is not a graph name (a folder must be given as a ``Path`` / ``--path``)."""


class GraphBusyError(GraphmaxError, RuntimeError):
    """Another process is writing the same graph (it holds the graph's lock)."""


class GraphFormatError(GraphmaxError, ValueError):
    """A graph folder is missing, truncated, corrupted, malformed or of another format version."""


class OptionError(GraphmaxError, ValueError):
    """A build or merge option is out of range."""


class MergeError(GraphmaxError, ValueError):
    """Graphs that cannot be merged: one graph, the same graph twice, other tokenizers or options."""


class StorageError(GraphmaxError, OSError):
    """Writing failed (disk full, read-only file system); nothing half-written was left behind."""


class DatastoreError(GraphmaxError, ValueError):
    """A kNN datastore folder is missing, truncated, corrupted or malformed, or its input is."""
