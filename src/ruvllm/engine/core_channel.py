"""The core process's messages to the front: length-prefixed frames on one end of a Unix socket pair.

Why not ZeroMQ, as the commands use: a ZeroMQ send hands the message to the sender's I/O thread and
a receive takes it from the receiver's, so every step's outputs woke two threads beside the core's
and the front's own, on a host whose cores the engine's compute threads fill (at one stream that CPU
a token is what the server lags the offline rate by). On a plain socket the core's loop writes the
bytes itself and the front's event loop (or its receiving thread) reads them itself: nobody else
wakes. The pair is made by the front and one end is inherited by the child (no address to bind or
connect), so the child's exit, however it comes, is an end of file here at once.

An event loop does not watch the socket itself but a doorbell (an eventfd the core writes after
each frame). The reason is read from the scheduler's code, not measured (on the loaded machine of
session 17 no arm could be told from another; the quiet comparison was of ZeroMQ against socket and
bell, not of the socket alone against the bell): a socket's data wakes its waiter as a "sync"
wake-up, the kernel's hint that the writer is about to sleep, which places the waiter on the
writer's CPU when that CPU runs nothing else; but the core goes straight on to its next step, and the
front would then take its time from the core's serial part rather than from the CPU where an OpenMP
worker waits. An eventfd's wake-up carries no such hint. It costs a system call on each side per step.

A frame is a 4-byte little-endian length and that many bytes of one msgpack message. The writer
is shared by the core's threads (a call answered beside the loop): a lock keeps frames whole. It
blocks when the socket's buffer is full (the front has stopped reading): as ZeroMQ's PUSH does at
its high-water mark, so a stuck front holds the core back instead of its memory growing without
bound; the buffer is raised to the kernel's limit first (net.core.wmem_max: 4 MiB on this machine,
~208 KiB by default). Before it waits for room it rings the bell, so a reader that reads only when
the bell rings drains the buffer and the rest of a frame larger than the buffer gets through.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading

_HEADER = struct.Struct("<I")
# One receive's size: a step's message at one stream is ~100 bytes, at hundreds ~tens of kB; a larger
# message (prompt logprobs) is gathered over several receives.
_CHUNK = 1 << 16
# What the writer asks for as its socket buffer (the kernel caps it at net.core.wmem_max).
_SEND_BUFFER = 4 << 20


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """(the front's end, the child's end). Neither is inherited by other children (the child's end
    is passed to its process by `pass_fds`)."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


def doorbell() -> int:
    """An eventfd for the loop to watch (non-blocking; not inherited but by `pass_fds`)."""
    return os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)


def answer_bell(bell: int) -> None:
    """The bell heard: reset it before the socket is read, so a frame written after that rings again."""
    try:
        os.eventfd_read(bell)
    except BlockingIOError:
        pass


class FrameWriter:
    """Whole frames out, from any thread of the core's process."""

    def __init__(self, sock: socket.socket, bell: int | None = None) -> None:
        """`bell`: the reader's doorbell, rung after every frame."""
        self._sock = sock
        self._bell = bell
        self._lock = threading.Lock()
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER)
        except OSError:
            pass  # the default buffer only means the core waits for a stalled front sooner
        sock.setblocking(True)

    def send(self, data: bytes) -> None:
        """One frame, written whole before any other thread's (blocks while the buffer is full).
        BrokenPipeError / ConnectionResetError: the front is gone."""
        with self._lock:
            header = _HEADER.pack(len(data))
            total = len(data) + _HEADER.size
            # One system call for header and body: no copy of the body, and no second wake-up of
            # the reader for half a frame. Never blocking here: a reader that waits for the bell
            # must hear it before the writer waits for room, or neither moves (a frame larger than
            # the buffer: prompt logprobs, many embeddings; the default buffer is ~416 KiB).
            try:
                sent = self._sock.sendmsg((header, data), (), socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            if sent < total:
                rest = memoryview(header + data)[sent:]
                while rest:
                    self._ring()  # the buffer is full: the reader drains it, then there is room
                    select.select([], [self._sock], [])
                    try:
                        rest = rest[self._sock.send(rest, socket.MSG_DONTWAIT):]
                    except BlockingIOError:
                        pass
            self._ring()

    def _ring(self) -> None:
        if self._bell is not None:
            os.eventfd_write(self._bell, 1)


class FrameReader:
    """Whole frames in, read by one thread at a time: a blocking socket with a timeout (a thread that
    also watches the child) or a non-blocking one watched by an event loop."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._partial = bytearray()  # a frame's start, until its end arrives
        self._need = 0  # the bytes `_partial` must hold before a frame in it can be whole
        self.eof = False
        self.more = False  # the last receive filled its buffer: more may be waiting

    def read(self) -> list[bytes]:
        """One receive's complete frames (none when only part of one came). Raises the socket's
        timeout or BlockingIOError when nothing is there yet; sets `eof` (and returns nothing) when
        the other end has closed."""
        data = self._sock.recv(_CHUNK)
        self.more = len(data) == _CHUNK
        if not data:
            self.eof = True
            return []
        if self._partial:
            self._partial += data
            if len(self._partial) < self._need:  # a large frame's middle: nothing to parse yet
                return []
            data = bytes(self._partial)
            self._partial.clear()
        frames = []
        at, size = 0, len(data)
        while size - at >= _HEADER.size:
            (n,) = _HEADER.unpack_from(data, at)
            end = at + _HEADER.size + n
            if end > size:
                break
            frames.append(data[at + _HEADER.size:end])
            at = end
        if at < size:
            self._partial += data[at:]
            self._need = (_HEADER.size + _HEADER.unpack_from(data, at)[0] if size - at >= _HEADER.size
                          else _HEADER.size)
        return frames

    def read_ready(self) -> list[bytes]:
        """Every complete frame the socket holds now, from a non-blocking socket: empty when none;
        `eof` set when the other end has closed."""
        frames: list[bytes] = []
        while not self.eof:
            try:
                got = self.read()
            except (BlockingIOError, InterruptedError):
                break
            frames += got
        return frames
