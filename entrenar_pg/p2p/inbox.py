"""Where a p2p payload goes: the matching's decisions carried out, by the channel's thread.

``matching.Matching`` decides which posted recv an arriving message is for
(sans-IO). ``Inbox`` holds what those decisions point at: the posted recvs'
ops and the payloads buffered for recvs not posted yet. It turns each
arriving header into the place its payload is read into (a recv's tensor or
a new buffer), and each outcome into a finished op. It runs under the
channel's lock; finished ops go into the ``done`` list the caller passes.
"""

from __future__ import annotations

from functools import partial

import torch

from ..transport.plan import Recv, bytes_of
from .link import PeerLink
from .matching import Discarded, Failed, IntoRecv, Matching, Message, PostedRecv
from .ops import Done, Op


class Inbox:
    """One channel's posted recvs and buffered payloads, and its matching."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.matching = Matching(rank)
        self._recvs: dict[int, Op] = {}  # the recvs the matching knows, by PostedRecv.id
        self._buffers: dict[int, torch.Tensor] = {}  # message payloads, by Message.id
        self._next_recv = 0

    def new_recv(self, op: Op, src: int, deadline: float) -> PostedRecv:
        """The matching's record of recv ``op`` from ``src`` (not posted yet)."""
        recv = PostedRecv(self._next_recv, src, op.tag, op.nbytes, op.host.dtype, deadline, op.what)
        self._next_recv += 1
        return recv

    def post(self, recv: PostedRecv, op: Op, done: list[Done]) -> None:
        self._recvs[recv.id] = op
        self.matching.post(recv)
        self.settle(done)

    def settle(self, done: list[Done]) -> int:
        """Act on the matching's outcomes: copy buffered payloads into their
        recvs, queue completions in ``done``, drop buffers. Returns how many
        recvs failed."""
        failed = 0
        for outcome in self.matching.take():
            if isinstance(outcome, Discarded):
                self._buffers.pop(outcome.msg.id, None)
                continue
            op = self._recvs.pop(outcome.recv.id)
            if isinstance(outcome, Failed):
                done.append((op, outcome.error))
                failed += 1
                continue
            op.work.src = outcome.msg.peer
            if outcome.buffered:
                buf = self._buffers.pop(outcome.msg.id)
                if op.nbytes:
                    op.host.view(torch.uint8).copy_(buf)
            done.append((op, None))
        return failed

    def deliver_local(self, op: Op, done: list[Done]) -> None:
        """A send to this rank: the matching places it like an arriving message."""
        data = op.host.view(torch.uint8) if op.nbytes else torch.empty(0, dtype=torch.uint8)
        place = self.matching.arrive(self.rank, op.tag, op.nbytes, op.host.dtype)
        if isinstance(place, IntoRecv):
            if op.nbytes:
                self._recvs[place.recv.id].host.view(torch.uint8).copy_(data)
        else:
            self._buffers[place.msg.id] = data.clone()
        self.matching.arrived(place.msg)
        done.append((op, None))
        self.settle(done)

    # ------------------------------------------------------------ stream callbacks

    def expect_header(self, link: PeerLink) -> None:
        link.expect_header(partial(self._header_in, link))

    def _header_in(self, link: PeerLink) -> None:
        header = link.read_header(self.rank)
        place = self.matching.arrive(link.peer, header.aux, header.numel, header.dtype)
        if isinstance(place, IntoRecv):
            view = bytes_of(self._recvs[place.recv.id].host)
        else:
            buf = torch.empty(header.numel, dtype=torch.uint8)
            self._buffers[place.msg.id] = buf
            view = bytes_of(buf)
        link.incoming = place.msg
        link.inc.push(Recv(view, partial(self._payload_in, link, place.msg)))

    def _payload_in(self, link: PeerLink, msg: Message) -> None:
        link.incoming = None
        self.matching.arrived(msg)
        self.expect_header(link)
