"""The waiting queue, fair across clients: each client's waiting requests in the policy's order
(request_order.py), and admission taking clients in turn.

Admission takes the most urgent rank (`RequestOrder.rank`: the policy's key, arrival aside) among
the clients' first requests, and among the clients whose first request has that rank, the one
whose turn it is: clients form a ring in the order they were last admitted from, the one just
admitted from going to its end, and a client that starts waiting joining the end. So however
many requests one client queues, a request of another client that the policy ranks as urgent
waits for at most one admission of each other client waiting, instead of for the whole flood;
a more urgent rank (a lower priority, an earlier deadline) still goes first, and within one
client the policy's order is kept. A preempted request rejoins its client's queue at its place
in that order.
"""

from __future__ import annotations

from baton.scheduler_proc.request_order import RequestOrder
from baton.scheduler_proc.sequence import Sequence


class WaitingQueue:
    """The sequences waiting for admission, by client; see the module's docstring."""

    def __init__(self, order: RequestOrder) -> None:
        self.order = order
        # Each client with waiting sequences, in turn order (dicts keep insertion order), to its
        # sequences most urgent first; a client leaves once none of its sequences waits.
        self._by_client: dict[bytes, list[Sequence]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __contains__(self, seq: Sequence) -> bool:
        return seq in self._by_client.get(seq.client, ())

    def count(self, client: bytes) -> int:
        """How many sequences of `client` are waiting."""
        return len(self._by_client.get(client, ()))

    def insert(self, seq: Sequence) -> None:
        """Queue `seq` at its place in its client's order (a new client's turn comes last)."""
        self.order.insert(self._by_client.setdefault(seq.client, []), seq)
        self._count += 1

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of the queue without using its client's turn (an abort)."""
        queue = self._by_client[seq.client]
        queue.remove(seq)
        self._count -= 1
        if not queue:
            del self._by_client[seq.client]

    def next_to_admit(self) -> Sequence | None:
        """The sequence admission takes next: the most urgent rank's first client in turn, its
        first sequence whose client is reading (a paused one waits until resumed)."""
        chosen: Sequence | None = None
        chosen_rank: tuple[float, ...] = ()
        for queue in self._by_client.values():
            seq = next((seq for seq in queue if not seq.paused), None)
            if seq is None:
                continue
            rank = self.order.rank(seq)
            if chosen is None or rank < chosen_rank:  # ties: the earlier client in turn
                chosen, chosen_rank = seq, rank
        return chosen

    def admit(self, seq: Sequence) -> None:
        """Take `seq` out of the queue for admission: its client's turn goes to the end."""
        self.remove(seq)
        rest = self._by_client.pop(seq.client, None)
        if rest is not None:
            self._by_client[seq.client] = rest

    def sort(self) -> None:
        """Re-sort each client's sequences (lrs: their urgency changes as costs are measured)."""
        for queue in self._by_client.values():
            self.order.sort(queue)
