"""run_resilient's leaving of a broken round: the connections to the old round's ranks are shut, no others."""
import socket
import subprocess
import sys

import pytest

from alpha_ckpt.launch.resilient import sever_connections_to

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


def _control_store():
    from torch.distributed import TCPStore
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return server, f"127.0.0.1:{server.port}"


def _compute_until(seconds: float) -> int:
    """Pure-Python work (a forward pass or a data pipeline, as far as a signal is concerned); iterations done."""
    import time
    done, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        done += 1
    return done


@pytest.mark.timeout(60)
def test_a_new_round_interrupts_main_at_once_while_it_computes_and_never_outside_it():
    import threading
    import time
    from alpha_ckpt.runtime.launch_env import round_key
    from alpha_ckpt.launch.resilient import FailureNotice, PeerFailed
    server, endpoint = _control_store()
    notice = FailureNotice(endpoint, 30, first_round=0)
    begun = []
    threading.Timer(0.3, lambda: (begun.append(time.monotonic()), server.set(round_key(1), "{}"))).start()
    with pytest.raises(PeerFailed):
        with notice.armed(0):
            _compute_until(20)
    assert time.monotonic() - begun[0] < 2  # not the 20 s of computing left

    # Armed in the new round: the round it runs in is no failure. Round 2 begins while nothing is armed.
    with notice.armed(1):
        _compute_until(0.5)
    server.set(round_key(2), "{}")
    _compute_until(0.5)  # outside main(): nothing is raised here
    with notice.armed(2):  # and nothing stale is delivered later
        _compute_until(0.5)
