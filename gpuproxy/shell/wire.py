"""The frames between the scheduler process and its request processes (`serve --workers N`).

One Unix socket per request process, in the data dir, mode 0600: both ends are this program,
run by the same user (each end checks the other's uid, SO_PEERCRED), so a frame is a pickle
behind a 4-byte length. A frame is a tuple whose
first item says what it is (docs/scheduler-design.md §8 lists them). Pickle carries the
catalog, the dispatch record and `inspect`'s reads (module-level functions travel by name) as
they are, with no second spelling of any of them.

Exceptions do not pickle faithfully (`ModelNotFound(model)` is rebuilt from its message, as
if it were the model), so a refusal crosses as its class and its attributes (`error_state`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import socket
import struct
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("gpuproxy.shell.wire")

_LENGTH = struct.Struct("!I")
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
MAX_FRAME = 256 * 1024 * 1024  # a corrupt length must not make us allocate gigabytes


def peer_uid(transport: asyncio.BaseTransport) -> int | None:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)
    return int(_CREDS.unpack(creds)[1])


def encode(frame: tuple[Any, ...]) -> bytes:
    body = pickle.dumps(frame, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


class Channel(asyncio.Protocol):
    """One end of a link: each whole frame that arrives goes to `on_frame`, in order; `send`
    queues a frame, and what is queued in one turn of the loop goes out in one write (at 32
    requests at once, a write per frame cost a syscall each on both sides)."""

    def __init__(self, on_frame: Callable[[tuple[Any, ...]], None],
                 on_lost: Callable[[], None] | None = None) -> None:
        self.on_frame = on_frame
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._in = bytearray()
        self._out: list[bytes] = []
        self._flushing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        uid = peer_uid(transport)
        if uid != os.getuid():
            # Frames are pickles: only this user's own processes may be at the other end
            # (a socket path in a directory others can write could be someone else's).
            logger.error("refusing a link with a process of uid %s (this is uid %d): only "
                         "gpuproxy's own processes may connect", uid, os.getuid())
            transport.abort()

    def data_received(self, data: bytes) -> None:
        buf = self._in
        buf += data
        start = 0
        end = len(buf)
        while end - start >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(buf, start)
            if length > MAX_FRAME:
                logger.error("a frame of %d bytes: the other end is not gpuproxy; closing",
                             length)
                self.close()
                return
            if end - start - _LENGTH.size < length:
                break
            body = bytes(buf[start + _LENGTH.size:start + _LENGTH.size + length])
            start += _LENGTH.size + length
            try:
                frame = pickle.loads(body)
            except Exception as exc:
                logger.error("a frame could not be read (%s: %s); skipped", type(exc).__name__,
                             exc)
                continue
            try:
                self.on_frame(frame)
            except Exception:
                logger.exception("handling the frame %r failed", frame[0] if frame else frame)
        del buf[:start]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
        if self.on_lost is not None:
            self.on_lost()

    @property
    def open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def send(self, frame: tuple[Any, ...]) -> None:
        self.send_encoded(encode(frame))

    def send_encoded(self, data: bytes) -> None:
        if not self.open:
            return
        self._out.append(data)
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flushing = False
        out, self._out = self._out, []
        if out and self.open:
            assert self.transport is not None
            self.transport.write(b"".join(out))

    def close(self) -> None:
        if self.transport is not None:
            self._flush()
            self.transport.close()


async def call(send: Callable[[tuple[Any, ...]], None], calls: dict[int, asyncio.Future[Any]],
               cid: int, name: str, args: tuple[Any, ...]) -> Any:
    """Send `call(cid, name, args)` and wait for the `reply` that `answer` settles."""
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    calls[cid] = future
    send(("call", cid, name, args))
    try:
        return await future
    finally:
        calls.pop(cid, None)


def answer(calls: dict[int, asyncio.Future[Any]], frame: tuple[Any, ...]) -> None:
    """A `reply(id, ok, value)` frame settles the call it answers (an error as itself); one
    whose asker left is dropped."""
    _, cid, ok, value = frame
    future = calls.get(cid)
    if future is not None and not future.done():
        if ok:
            future.set_result(value)
        else:
            future.set_exception(error_from(value))


def error_state(exc: BaseException) -> tuple[type[BaseException], dict[str, Any], tuple]:
    return type(exc), dict(vars(exc)), exc.args


def error_from(state: tuple[type[BaseException], dict[str, Any], tuple]) -> BaseException:
    """The exception `error_state` described, rebuilt without calling its `__init__`."""
    cls, attrs, args = state
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(attrs)
    return exc
