"""The frames between the scheduler process and its request processes (`serve --workers N`).

One Unix socket per request process, in the data dir, mode 0600: both ends are this program,
run by the same user, so a frame is a pickle behind a 4-byte length. A frame is a tuple whose
first item says what it is (docs/scheduler-design.md §8 lists them). Pickle carries the
catalog, the dispatch record and `inspect`'s reads (module-level functions travel by name) as
they are, with no second spelling of any of them.

Exceptions do not pickle faithfully (`ModelNotFound(model)` is rebuilt from its message, as
if it were the model), so a refusal crosses as its class and its attributes (`error_state`).
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from typing import Any

_LENGTH = struct.Struct("!I")
MAX_FRAME = 256 * 1024 * 1024  # a corrupt length must not make us allocate gigabytes


def encode(frame: tuple[Any, ...]) -> bytes:
    body = pickle.dumps(frame, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


class BadFrame(Exception):
    """A frame that arrived whole but cannot be read: the link goes on with the next one."""


async def read(reader: asyncio.StreamReader) -> tuple[Any, ...]:
    """The next frame; `asyncio.IncompleteReadError` when the other end has gone, `BadFrame`
    when this one cannot be unpickled (the stream is still at a frame boundary)."""
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > MAX_FRAME:
        raise ValueError(f"a frame of {length} bytes: the other end is not gpuproxy")
    body = await reader.readexactly(length)
    try:
        frame = pickle.loads(body)
    except Exception as exc:
        raise BadFrame(f"{type(exc).__name__}: {exc}") from None
    if not isinstance(frame, tuple) or not frame:
        raise BadFrame(f"not a frame: {type(frame).__name__}")
    return frame


def error_state(exc: BaseException) -> tuple[type[BaseException], dict[str, Any], tuple]:
    return type(exc), dict(vars(exc)), exc.args


def error_from(state: tuple[type[BaseException], dict[str, Any], tuple]) -> BaseException:
    """The exception `error_state` described, rebuilt without calling its `__init__`."""
    cls, attrs, args = state
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(attrs)
    return exc
