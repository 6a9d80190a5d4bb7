"""The core process's frames (engine/core_channel.py) over a real Unix socket pair: whole frames
however the bytes are cut, frames from several threads never interleaved, the end of file, and the
doorbell the front's loop watches."""

from __future__ import annotations

import os
import select
import threading

from ruvllm.engine.core_channel import FrameReader, FrameWriter, answer_bell, doorbell, socket_pair


def _read_all(reader: FrameReader, count: int) -> list[bytes]:
    got: list[bytes] = []
    while len(got) < count and not reader.eof:
        got += reader.read()
    return got


def test_frames_of_every_size_come_whole_and_in_order() -> None:
    front, child = socket_pair()
    front.settimeout(5.0)
    # empty, tiny, a step's size, one larger than a receive, and one of several megabytes
    frames = [b"", b"x", os.urandom(300), os.urandom((1 << 16) + 7), os.urandom(3 << 20), b"end"]
    writer = FrameWriter(child)
    sender = threading.Thread(target=lambda: [writer.send(f) for f in frames])
    sender.start()
    got = _read_all(FrameReader(front), len(frames))
    sender.join()
    assert got == frames


def test_a_frame_cut_anywhere_is_held_until_its_end_comes() -> None:
    front, child = socket_pair()
    front.settimeout(5.0)
    reader = FrameReader(front)
    body = os.urandom(1000)
    wire = len(body).to_bytes(4, "little") + body + (3).to_bytes(4, "little") + b"abc"
    for cut in (2, 4, 5, 1003, 1004, 1006):  # inside the header, at its end, inside the body, between frames
        child.sendall(wire[:cut])
        first = reader.read()
        child.sendall(wire[cut:])
        rest = _read_all(reader, 2 - len(first))
        assert first + rest == [body, b"abc"], cut


def test_frames_from_several_threads_are_never_interleaved() -> None:
    front, child = socket_pair()
    front.settimeout(5.0)
    writer = FrameWriter(child)
    per_thread, threads = 200, 4
    # each thread's frames large enough that a write may be cut by a full buffer
    payloads = {t: [bytes([t]) * (5000 + i) for i in range(per_thread)] for t in range(threads)}
    senders = [threading.Thread(target=lambda t=t: [writer.send(p) for p in payloads[t]]) for t in range(threads)]
    for s in senders:
        s.start()
    got = _read_all(FrameReader(front), per_thread * threads)
    for s in senders:
        s.join()
    for t in range(threads):
        mine = [g for g in got if g[:1] == bytes([t])]
        assert mine == payloads[t]  # whole, and in the order that thread sent them
        assert all(set(g) == {t} for g in mine)


def test_the_end_of_file_after_the_last_frames() -> None:
    front, child = socket_pair()
    writer = FrameWriter(child)
    writer.send(b"last words")
    child.close()
    front.setblocking(False)
    reader = FrameReader(front)
    assert reader.read_ready() == [b"last words"]
    assert reader.eof
    assert reader.read_ready() == []


def test_a_writer_whose_reader_is_gone_raises_instead_of_blocking() -> None:
    front, child = socket_pair()
    front.close()
    writer = FrameWriter(child)
    try:
        writer.send(b"anyone?")
    except (BrokenPipeError, ConnectionResetError):
        return
    raise AssertionError("a send to a closed peer succeeded")


def test_the_bell_rings_after_each_frame_and_answering_resets_it() -> None:
    front, child = socket_pair()
    front.setblocking(False)
    bell = doorbell()
    try:
        writer, reader = FrameWriter(child, bell), FrameReader(front)
        assert select.select([bell], [], [], 0)[0] == []  # silent until a frame is written
        writer.send(b"one")
        writer.send(b"two")
        assert select.select([bell], [], [], 0)[0] == [bell]
        answer_bell(bell)  # reset before the socket is read: a later frame rings again
        assert select.select([bell], [], [], 0)[0] == []
        assert reader.read() == [b"one", b"two"] and not reader.more
        writer.send(b"three")
        assert select.select([bell], [], [], 0)[0] == [bell]
    finally:
        os.close(bell)


def test_a_frame_larger_than_the_buffer_reaches_a_reader_that_reads_only_on_the_bell() -> None:
    """The front's loop reads only when the bell rings (core_client's `_drain`): a writer that
    waited for room before ringing would wait forever on a frame the buffer cannot hold (prompt
    logprobs of a long prompt; the kernel's default buffer is ~416 KiB, 8 KiB here)."""
    import socket

    front, child = socket_pair()
    front.setblocking(False)
    bell = doorbell()
    try:
        writer, reader = FrameWriter(child, bell), FrameReader(front)
        child.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # after the writer raised it
        frames = [os.urandom(1 << 20), b"after"]
        sender = threading.Thread(target=lambda: [writer.send(f) for f in frames], daemon=True)
        sender.start()
        got: list[bytes] = []
        while len(got) < len(frames):
            assert select.select([bell], [], [], 5.0)[0] == [bell], "the writer waits for room the bell never asked for"
            answer_bell(bell)
            got += reader.read_ready()
        sender.join(5.0)
        assert got == frames and not sender.is_alive()
    finally:
        os.close(bell)
        front.close()
        child.close()
