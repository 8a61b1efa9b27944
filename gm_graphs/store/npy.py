"""The header of a ``.npy`` file: written as numpy writes it, and read from an untrusted folder without numpy's parser.

numpy parses a header with ``ast.literal_eval`` (and ``tokenize`` on failure): a crafted header of a few
kilobytes makes it raise exceptions no caller expects (``tokenize.TokenError``, ``MemoryError`` from the
parser's depth limit), and a version 2.0 header may declare 4 GiB that numpy reads before it checks the size.
Every file graphmax writes has the header numpy writes for a 1-D array, so this reads exactly that form and
refuses anything else with one ``ValueError``.
"""

from __future__ import annotations

import io
import re
import struct
from typing import BinaryIO

import numpy as np

MAGIC = b"\x93NUMPY"
MAX_HEADER = 4096  # numpy writes a 1-D array's header in 128 bytes or fewer
# numpy's own form, in its own key order: "{'descr': '<f2', 'fortran_order': False, 'shape': (12,), }"
_HEADER = re.compile(r"\{'descr': '(?P<descr>[<>|=][a-zA-Z][0-9]{0,2})', 'fortran_order': (?P<fortran>True|False), "
                     r"'shape': \((?P<shape>(?:[0-9]{1,19}, )*(?:[0-9]{1,19},?)?)\), \} *\n")


def read_header(fh: BinaryIO) -> tuple[np.dtype, tuple[int, ...], bool]:
    """Read a ``.npy`` header from ``fh`` (at its start) and leave ``fh`` at the first byte of data.

    Args:
        fh (binary file): the open file, positioned at byte 0.

    Returns:
        ``(dtype, shape, fortran_order)``.

    Raises:
        ValueError: not a ``.npy`` file of version 1.0 or 2.0, a header over ``MAX_HEADER`` bytes, or a header
        that is not numpy's plain form (a descr of one simple type, a shape of integers of up to 19 digits).

    Example::

        >>> import io, numpy as np
        >>> buf = io.BytesIO(); np.save(buf, np.arange(5, dtype=np.int32)); _ = buf.seek(0)
        >>> read_header(buf)
        (dtype('int32'), (5,), False)
        >>> read_header(io.BytesIO(b"\\x93NUMPY\\x01\\x00\\x02\\x00{\\n"))
        Traceback (most recent call last):
        ValueError: its header is not numpy's plain form of one array
    """
    start = fh.read(8)
    if len(start) != 8 or start[:6] != MAGIC:
        raise ValueError("it does not start with numpy's magic string")
    major, minor = start[6], start[7]
    if (major, minor) not in ((1, 0), (2, 0)):
        raise ValueError(f"it is of .npy version {major}.{minor}; graphmax reads 1.0 and 2.0")
    size_bytes = fh.read(2 if major == 1 else 4)
    if len(size_bytes) != (2 if major == 1 else 4):
        raise ValueError("it ends inside its header")
    size = struct.unpack("<H" if major == 1 else "<I", size_bytes)[0]
    if size > MAX_HEADER:
        raise ValueError(f"its header declares {size} bytes (over {MAX_HEADER})")
    header = fh.read(size)
    if len(header) != size:
        raise ValueError("it ends inside its header")
    match = _HEADER.fullmatch(header.decode("latin1"))
    if match is None:
        raise ValueError("its header is not numpy's plain form of one array")
    try:
        dtype = np.dtype(match["descr"])
    except (TypeError, ValueError):
        raise ValueError(f"its header names an unknown type {match['descr']!r}") from None
    shape = tuple(int(s) for s in match["shape"].replace(",", " ").split())
    return dtype, shape, match["fortran"] == "True"

WIDEST = 2**62  # the length a header is written for before the array's length is known: its header is the longest


def write_header(dtype: np.dtype, length: int) -> bytes:
    """The header numpy writes for a 1-D little-endian array of ``length`` values of ``dtype`` (format 1.0)."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                                               "shape": (length,)})
    return buf.getvalue()
