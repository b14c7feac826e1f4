"""The zygote's event loop: one ``select`` batch can hold both a step's exit (SIGCHLD) and its
client's EOF. The reaper closes the connection first; the EOF must not act on it (it once did,
and the zygote died of a ValueError: every later step of the session ran unserved)."""

import json
import os
import selectors
import signal
import socket

from preload_launcher.zygote.running import Step
from preload_launcher.zygote.server import Zygote


def a_zygote_loop() -> Zygote:
    """A zygote's loop state without a preload: the selector, its steps, nothing else."""
    zygote = Zygote.__new__(Zygote)
    zygote.selector = selectors.DefaultSelector()
    zygote.steps, zygote.pending = {}, {}
    zygote.warm = zygote.gpus = None
    zygote.learn_reports_dir = zygote.restart_reason = ""
    zygote.stopping = False
    zygote.last_request = 0.0
    return zygote


def test_a_batch_with_a_steps_exit_and_its_clients_eof_is_handled_once():
    zygote = a_zygote_loop()
    sig_r, sig_w = os.pipe()
    os.set_blocking(sig_r, False)
    zygote.selector.register(sig_r, selectors.EVENT_READ, "signal")
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    step = Step(pid, ours, standin=True)
    zygote.steps[pid] = step
    zygote.selector.register(ours, selectors.EVENT_READ, step)
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # exited, still to be reaped
    os.write(sig_w, bytes([signal.SIGCHLD]))  # what the SIGCHLD handler writes
    theirs.shutdown(socket.SHUT_WR)  # the client goes away at the same moment
    events = zygote.selector.select(0)
    events.sort(key=lambda event: event[0].data != "signal")  # the reaper's event comes first
    assert [key.data for key, _ in events] == ["signal", step]
    zygote.dispatch(events)
    assert zygote.steps == {} and ours.fileno() == -1
    assert json.loads(theirs.recv(4096)) == {"event": "exit", "returncode": 7}
    assert list(zygote.selector.get_map()) == [sig_r]
    theirs.close()
    os.close(sig_r)
    os.close(sig_w)
