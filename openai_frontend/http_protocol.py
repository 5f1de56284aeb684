"""uvicorn's httptools protocol, fed a bounded slice of each read per turn of the event loop.

uvicorn hands every read from a socket (up to 256 KiB) to the HTTP parser in one callback. A body sent in
one-byte chunks makes that one Python callback per chunk: 256 KiB of ``1\\r\\nx\\r\\n`` is 43,690 of them, about
50 ms during which the event loop serves no one else. :class:`SlicedHttpToolsProtocol` passes the parser at most
:data:`SLICE_BYTES` per turn (about 3 ms of such chunks) and reads no more from that socket until the rest
is parsed, so other connections are served between slices whatever a client sends. The idea is the event
loop's own fairness (each ready callback runs in turn), applied inside one connection's reads.
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

SLICE_BYTES = 16 * 1024  # bytes parsed per turn of the event loop, per connection


class SlicedHttpToolsProtocol(HttpToolsProtocol):
    """``uvicorn.run(..., http=SlicedHttpToolsProtocol)``: as uvicorn's httptools protocol, with each read
    parsed :data:`SLICE_BYTES` at a time, one slice per turn of the event loop."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._backlog = bytearray()
        self._feeding = False

    def data_received(self, data: bytes) -> None:
        if not self._backlog and len(data) <= SLICE_BYTES:
            super().data_received(data)
            return
        self._backlog += data
        self.transport.pause_reading()  # nothing more from this socket until the backlog is parsed
        if not self._feeding:
            self._feeding = True
            self._feed_slice()

    def _feed_slice(self) -> None:
        if self.transport.is_closing():
            self._backlog.clear()
            self._feeding = False
            return
        chunk = bytes(self._backlog[:SLICE_BYTES])
        del self._backlog[:SLICE_BYTES]
        super().data_received(chunk)
        if self._backlog:
            self.loop.call_soon(self._feed_slice)
            return
        self._feeding = False
        if not self.flow.read_paused and not self.transport.is_closing():  # uvicorn's own back-pressure
            self.transport.resume_reading()
