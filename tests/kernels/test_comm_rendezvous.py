"""The rendezvous store (gloo's and the sockets transport's) listens on the given address only,
and only its group finds it.

Where the store listens is read from the kernel's own socket table (/proc/net/tcp), not from
our code; the secret is shown by a client that knows the store's address and port but not
the group's secret, and cannot join.
"""

from __future__ import annotations

import threading

import pytest

from raymoe.cluster.procfs import TCP_LISTEN, tcp_sockets
from raymoe.kernels.comm import CommBackend, CommError, make_communicator, new_rendezvous
from raymoe.kernels.comm.gloo import GlooCommunicator


def listening_addresses(port: int) -> set[str]:
    """Every local address with a socket in LISTEN on ``port``, as the kernel reports it."""
    return {address for address, listening, _ in tcp_sockets(TCP_LISTEN) if listening == port}


@pytest.mark.parametrize("backend", [CommBackend.GLOO, CommBackend.SOCKETS])
def test_store_listens_on_its_host_only_and_the_group_works(backend):
    rendezvous = new_rendezvous(backend, host="127.0.0.1", group_name="bind-test")
    comms: dict[int, object] = {}

    def join(rank: int) -> None:
        comms[rank] = make_communicator(backend, rendezvous, rank=rank, world_size=2, timeout_s=20,
                                        bind_host="127.0.0.1")

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert set(comms) == {0, 1}
    try:
        assert listening_addresses(rendezvous.port) == {"127.0.0.1"}  # not 0.0.0.0, not ::
        assert rendezvous.group_name.startswith("bind-test/") and len(rendezvous.group_name) > len("bind-test/") + 16
    finally:
        for comm in comms.values():
            comm.close()


def test_a_client_without_the_secret_cannot_join():
    rendezvous = new_rendezvous(CommBackend.GLOO, host="127.0.0.1", group_name="secret-test")
    outcome: dict[str, object] = {}

    def owner() -> None:  # rank 0, waiting for a rank 1 that knows the secret
        try:
            outcome["owner"] = GlooCommunicator.create(0, 2, rendezvous.host, rendezvous.port, 4.0,
                                                       group_name=rendezvous.group_name)
        except CommError as error:
            outcome["owner"] = error

    thread = threading.Thread(target=owner)
    thread.start()
    guessed = rendezvous.group_name.split("/")[0]  # knows host, port and the group's name only
    with pytest.raises(CommError, match="could not join"):
        GlooCommunicator.create(1, 2, rendezvous.host, rendezvous.port, 4.0, group_name=guessed)
    thread.join(timeout=30)
    assert isinstance(outcome["owner"], CommError)  # nobody with the secret came: rank 0 gave up too
