"""run_resilient's leaving of a broken round: the connections to the old round's ranks are shut, no others."""
import socket
import subprocess
import sys

import pytest

from alpha_ckpt.resilient import sever_connections_to

# A peer process: connects to PORT, says it is ready, then waits for the other end to go away.
PEER = """
import socket, sys
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
sock.sendall(b"r")
sys.exit(0 if sock.recv(1) == b"" else 1)
"""


def _connected_peer(listener):
    proc = subprocess.Popen([sys.executable, "-c", PEER, str(listener.getsockname()[1])])
    conn, _ = listener.accept()
    assert conn.recv(1) == b"r"
    return proc, conn


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(60)
def test_only_the_connections_to_the_named_processes_are_shut_and_both_ends_see_it():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        old_peer, to_old_peer = _connected_peer(listener)
        bystander, to_bystander = _connected_peer(listener)
        try:
            assert sever_connections_to({old_peer.pid}) == 1
            assert old_peer.wait(timeout=20) == 0  # its blocked read returned: the connection is gone
            assert to_old_peer.recv(1) == b""  # and this end sees it too, its descriptor still open
            assert to_old_peer.fileno() >= 0
            to_bystander.settimeout(0.5)
            with pytest.raises(socket.timeout):  # the other connection is untouched: still open, still waiting
                to_bystander.recv(1)
            assert bystander.poll() is None
            assert sever_connections_to(set()) == 0
        finally:
            to_bystander.close()
            assert bystander.wait(timeout=20) == 0
            to_old_peer.close()
