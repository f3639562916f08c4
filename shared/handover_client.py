"""A prefill engine's end of a handover connection to one decode engine (the carriers
and the decode engine's end: :mod:`shared.handover_transport`)."""

from __future__ import annotations

import array
import fcntl
import mmap
import os
import socket
from typing import Callable

import zmq

from shared import handover_wire as hw
from shared.codec import DecodeError
from shared.handover_transport import (HEADER, MAX_SMALL, STAGED, STAGING, STAGING_SEALS, kv_offset,
                                       socket_path)
from shared.shm_ring import FRAME_SEALS


class Busy(Exception):
    """The decode engine cannot take a handover right now (its socket or queue is full);
    the connection is fine."""


class HandoverClient:
    """A prefill engine's connection to one decode engine (a run directory or
    ``tcp://HOST:PORT``). Used by one thread; nothing blocks. ``layout`` and
    ``engine_id`` are known once the decode engine's hello arrived (``ready``)."""

    def __init__(self, target: str, ctx: zmq.Context | None = None, staging_bytes: int = 0):
        self.target = target
        self.tcp = target.startswith("tcp://")
        self._ctx = ctx
        self._sock = None
        self.staging_bytes = 0 if self.tcp else staging_bytes
        self._staging: mmap.mmap | None = None
        self._extents: dict[str, tuple[int, int]] = {}  # request id → its room in the staging area
        self.num_staged = 0
        self.num_memfd = 0
        self.engine_id = ""
        self.layout: hw.KVLayout | None = None
        self.report: hw.DecodeReport | None = None

    @property
    def ready(self) -> bool:
        return self._sock is not None and self.layout is not None

    def connect(self) -> bool:
        """Try to connect (a no-op when connected); True once connected."""
        if self._sock is not None:
            return True
        try:
            if self.tcp:
                sock = (self._ctx or zmq.Context.instance()).socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 64)
                sock.connect(self.target)
                sock.send_multipart([b"M", b""])  # so the ROUTER learns of us and greets us
            else:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                try:
                    sock.connect(socket_path(self.target))
                except OSError:
                    sock.close()
                    return False
                sock.setblocking(False)
                if self.staging_bytes:
                    self._share_staging(sock)
        except (zmq.ZMQError, OSError):
            return False
        self._sock = sock
        return True

    def _share_staging(self, sock: socket.socket) -> None:
        fd = os.memfd_create("tickserve-staging", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, self.staging_bytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, STAGING_SEALS)
            self._staging = mmap.mmap(fd, self.staging_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            sock.sendmsg([STAGING.pack(b"S", self.staging_bytes)],
                         [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        except OSError:
            sock.close()
            self._staging = None
            raise
        finally:
            os.close(fd)

    def _room(self, size: int) -> int | None:
        """First fit for ``size`` bytes (4 KiB aligned) in the staging area, or None."""
        if self._staging is None:
            return None
        at = 0
        for off, n in sorted(self._extents.values()):
            if off - at >= size:
                return at
            at = max(at, kv_offset(off + n))
        return at if self.staging_bytes - at >= size else None

    def disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close(0) if self.tcp else self._sock.close()
        self._sock = None
        if self._staging is not None:
            self._staging.close()
        self._staging = None
        self._extents = {}
        self.layout = None
        self.engine_id = ""
        self.report = None

    def receive(self) -> list:
        """Messages from the decode engine waiting now (hello, acks, reports). Raises
        ``ConnectionError`` when the connection is gone (then :meth:`disconnect`)."""
        out = []
        for _ in range(256):
            frame = self._recv_one()
            if frame is None:
                break
            try:
                msg = hw.decode(frame, "prefill")
            except DecodeError:
                continue
            if isinstance(msg, hw.DecodeHello):
                self.engine_id, self.layout = msg.engine_id, msg.layout
            elif isinstance(msg, hw.DecodeReport):
                self.report = msg
            elif isinstance(msg, hw.KVReleased):
                self._extents.pop(msg.request_id, None)
            out.append(msg)
        return out

    def _recv_one(self) -> bytes | None:
        if self._sock is None:
            return None
        if self.tcp:
            try:
                parts = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return None
            return parts[1] if len(parts) == 2 and parts[0] == b"M" else None
        try:
            data = self._sock.recv(MAX_SMALL, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            raise ConnectionError(str(exc)) from None
        if not data:
            raise ConnectionError("the decode engine closed its handover socket")
        return data[1:] if data[:1] == b"M" else None

    def send(self, msg) -> None:
        """A small message (a HandoverAbort). Raises ``ConnectionError``."""
        frame = hw.encode(msg)
        try:
            if self.tcp:
                self._sock.send_multipart([b"M", frame], zmq.NOBLOCK)
            else:
                self._sock.send(b"M" + frame, socket.MSG_DONTWAIT)
        except (OSError, zmq.ZMQError, AttributeError) as exc:
            raise ConnectionError(str(exc)) from None

    def send_handover(self, h: hw.Handover, fill: Callable[[memoryview], None]) -> None:
        """Send ``h`` with its KV, which ``fill(view)`` writes into a writable view of
        ``h.kv_bytes`` bytes. Raises :class:`Busy` when the connection cannot take it now
        and ``ConnectionError`` when it is gone (either way nothing was delivered)."""
        meta = hw.encode(h)
        if self.tcp:
            kv = bytearray(h.kv_bytes)
            fill(memoryview(kv))
            try:
                self._sock.send_multipart([b"H", meta, kv], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                raise Busy("the decode engine's queue is full") from None
            except (zmq.ZMQError, AttributeError) as exc:
                raise ConnectionError(str(exc)) from None
            return
        off = kv_offset(len(meta))
        size = off + h.kv_bytes
        at = self._room(size)
        if at is not None:
            self._staging[at: at + len(meta)] = meta
            view = memoryview(self._staging)
            part = view[at + off: at + size]
            try:
                fill(part)
            finally:
                part.release()
                view.release()
            try:
                self._sock.sendmsg([STAGED.pack(b"P", at, len(meta), h.kv_bytes)], [], socket.MSG_DONTWAIT)
            except BlockingIOError:
                raise Busy("the decode engine's socket is full") from None
            except (OSError, AttributeError) as exc:
                raise ConnectionError(str(exc)) from None
            self._extents[h.request_id] = (at, size)
            self.num_staged += 1
            return
        self.num_memfd += 1
        fd = os.memfd_create("tickserve-handover", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                mm[:len(meta)] = meta
                view = memoryview(mm)
                part = view[off:size]
                try:
                    fill(part)
                finally:
                    part.release()
                    view.release()
            finally:
                mm.close()
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, FRAME_SEALS)
            self._sock.sendmsg([HEADER.pack(b"H", len(meta), h.kv_bytes)],
                               [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))],
                               socket.MSG_DONTWAIT)
        except BlockingIOError:
            raise Busy("the decode engine's socket is full") from None
        except (OSError, AttributeError) as exc:
            raise ConnectionError(str(exc)) from None
        finally:
            os.close(fd)
